//! Gradients on the wire while backward runs.
//!
//! candle backpropagates a graph in one piece, so the model is cut into segments: at a cut,
//! the forward pass goes on from a fresh leaf holding a copy of the activation ([`Pass::cut`]).
//! [`Pass::backward`] then backpropagates the last segment from the loss, which yields its
//! parameters' gradients and the gradient at the cut; the segment before is backpropagated
//! from its output with the surrogate loss `sum(y * g)` (whose gradient is `g` at `y`, as the
//! distributed engine does at a worker boundary), and so on to the first. Backward runs on a
//! blocking thread, so the runtime's threads carry the ring meanwhile.
//!
//! - DDP-1: a bucket's combination starts once the segment after which none of its
//!   parameters gets any more gradient has been backpropagated, and before any earlier
//!   segment's backward; buckets start in the same order on every member. A bucket's copy
//!   into its flat buffer runs beside the next segment's backward (on a blocking thread, its
//!   place in the group's order taken when it starts: `ProcessGroup::all_reduce_fill_async`).
//! - DDP-2: the buckets are learnt from the first pass (which combines everything at its end,
//!   after recording the last segment in which each parameter gets a gradient): parameters
//!   grouped per segment, in reverse order of the parameters (as backward produces them), up
//!   to `bucket_bytes`; those that got none go last. A later pass in which a parameter gets a
//!   gradient after its bucket left fails, naming it (the model used its parameters
//!   differently from the first pass), rather than send an incomplete sum.
//! - DDP-3: the gradients combined are the same as [`DistributedDataParallel::reduce_gradients`]
//!   computes after a whole backward (the segments' gradients add up to the whole graph's).
//!
//! Cost where there is nothing to overlap (one segment): one copy of each cut's activation
//! and one surrogate graph per cut; no cut, none.

use std::collections::HashMap;

use autograd_dist::Optimizer;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use super::DistributedDataParallel;
use crate::group::CollectiveError;

/// The buckets of an overlapped pass (DDP-2).
#[derive(Debug)]
pub(super) struct Plan {
    cuts: usize,
    /// For each segment (by its index in the forward order), the buckets that complete once
    /// it has been backpropagated.
    after: Vec<Vec<Vec<usize>>>,
    /// Parameters that got no gradient in the first pass: zeros, sent at the end.
    unused: Vec<Vec<usize>>,
    /// The segment whose backward completes each parameter's gradient.
    segment_of: HashMap<TensorId, usize>,
}

/// One forward and backward pass of a data-parallel replica whose gradients are combined
/// while backward runs (see the module docs).
///
/// ```no_run
/// # async fn demo(
/// #     ddp: &collectives::DistributedDataParallel,
/// #     opt: &mut autograd_dist::Optimizer,
/// #     x: candle_core::Tensor,
/// #     layers: &[(candle_core::Var, candle_core::Var)],
/// # ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let mut pass = ddp.pass();
/// let mut h = x;
/// for (w, b) in layers {
///     let y = h.matmul(w)?.broadcast_add(b)?.relu()?;
///     h = pass.cut(&y)?; // the one line: a segment ends here
/// }
/// let loss = h.sqr()?.mean_all()?;
/// let grads = pass.backward(&loss).await?; // combined over the group, bucket by bucket
/// opt.step(&grads)?;
/// # Ok(()) }
/// ```
pub struct Pass<'a> {
    ddp: &'a DistributedDataParallel,
    /// Each cut: the activation (in the graph before it) and the leaf the forward went on
    /// from.
    cuts: Vec<(Tensor, Var)>,
}

impl DistributedDataParallel {
    /// Starts a pass whose backward overlaps the gradients' combination (see [`Pass`]).
    pub fn pass(&self) -> Pass<'_> {
        Pass {
            ddp: self,
            cuts: Vec::new(),
        }
    }

    /// Wraps a local optimizer, Horovod's `DistributedOptimizer` style: its step takes a pass
    /// and its loss, backpropagates with the combination overlapped, and updates.
    pub fn wrap(&self, opt: Optimizer) -> DdpOptimizer<'_> {
        DdpOptimizer { ddp: self, opt }
    }
}

impl Pass<'_> {
    /// Ends a segment at `h`: returns the tensor the forward pass goes on with (a leaf
    /// holding a copy of `h`).
    pub fn cut(&mut self, h: &Tensor) -> candle_core::Result<Tensor> {
        let leaf = Var::from_tensor(&h.detach())?;
        let t = leaf.as_tensor().clone();
        self.cuts.push((h.clone(), leaf));
        Ok(t)
    }

    /// Backpropagates `loss` segment by segment and returns the wrapped parameters'
    /// gradients combined over the group (DDP-1..3).
    pub async fn backward(self, loss: &Tensor) -> Result<GradStore, CollectiveError> {
        let ddp = self.ddp;
        let planned = {
            let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
            plan.as_ref().is_some_and(|p| p.cuts == self.cuts.len())
        };
        let by_id: HashMap<TensorId, usize> = ddp
            .vars
            .iter()
            .enumerate()
            .map(|(i, v)| (v.as_tensor().id(), i))
            .collect();
        let mut total: Option<GradStore> = None;
        let mut last_segment: HashMap<TensorId, usize> = HashMap::new();
        let mut started: Vec<(Vec<usize>, super::Bucket)> = Vec::new();
        // The segments from the last to the first: what each is backpropagated from (the loss,
        // then the output before each cut, with the gradient at its leaf).
        let mut seed: Option<(Tensor, Option<Tensor>)> = Some((loss.clone(), None));
        for k in (0..=self.cuts.len()).rev() {
            let (from, g) = seed.take().expect("seeded");
            let mut span = ddp
                .group
                .agent()
                .tracer()
                .span(rpc_core::trace::Cat::Compute, "backward segment");
            span.detail(|| format!("segment {k}"));
            // Parameters used through `grad_once::matmul` get their gradients written once.
            let store = rpc_core::spawn_blocking(move || match g {
                None => autograd_dist::grad_once::backward(&from),
                Some(g) => autograd_dist::grad_once::backward(&(from * g)?.sum_all()?),
            })
            .await
            .map_err(|e| CollectiveError::Candle(candle_core::Error::Msg(e.to_string())))??;
            drop(span);
            if k > 0 {
                let (before, leaf) = &self.cuts[k - 1];
                // Detached: a variable's gradient keeps the graph that computed it (candle
                // detaches only the inner nodes' ones), and backpropagating through it would
                // add second-order terms to the parameters it depends on.
                let g = store
                    .get(leaf.as_tensor())
                    .map(Tensor::detach)
                    .ok_or_else(|| no_gradient_at_cut(k))?;
                seed = Some((before.clone(), Some(g)));
            }
            for id in store.get_ids() {
                if by_id.contains_key(id) {
                    last_segment.insert(*id, k);
                }
            }
            match &mut total {
                None => total = Some(store),
                Some(t) => t.extend(store)?,
            }
            if planned {
                self.check_plan(&by_id, &last_segment, k)?;
                let grads = total.as_ref().expect("a store");
                let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
                let buckets = plan.as_ref().expect("planned").after[k].clone();
                drop(plan);
                for idx in buckets {
                    let bucket = ddp.start(&idx, |v| grads.get(v).cloned())?;
                    started.push((idx, bucket));
                }
            }
        }
        let mut grads = total.expect("at least one segment");
        if !planned {
            let plan = ddp.learn_plan(self.cuts.len(), &last_segment);
            for idx in plan.after.iter().rev().flatten().chain(&plan.unused) {
                let bucket = ddp.start(idx, |v| grads.get(v).cloned())?;
                started.push((idx.clone(), bucket));
            }
            *ddp.plan.lock().unwrap_or_else(|p| p.into_inner()) = Some(plan);
        } else {
            let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
            let unused = plan.as_ref().expect("planned").unused.clone();
            drop(plan);
            for idx in unused {
                let bucket = ddp.start(&idx, |v| grads.get(v).cloned())?;
                started.push((idx, bucket));
            }
        }
        for (idx, work) in started {
            ddp.unflatten(&idx, work, &mut grads).await?;
        }
        // Only the wrapped parameters' gradients are the caller's business.
        for (_, leaf) in &self.cuts {
            grads.remove(leaf.as_tensor());
        }
        Ok(grads)
    }

    /// DDP-2: fails if a parameter got a gradient in segment `k` after its bucket left
    /// (planned for a later segment).
    fn check_plan(
        &self,
        by_id: &HashMap<TensorId, usize>,
        last_segment: &HashMap<TensorId, usize>,
        k: usize,
    ) -> Result<(), CollectiveError> {
        let plan = self.ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
        let plan = plan.as_ref().expect("planned");
        for (id, &seg) in last_segment {
            if seg != k {
                continue;
            }
            // A parameter planned for a later segment (backpropagated before this one) has
            // gone; one that got no gradient in the first pass goes at the end.
            match plan.segment_of.get(id) {
                Some(&planned) if planned <= k => {}
                None => {}
                planned => {
                    return Err(CollectiveError::Failed {
                        op: "ddp backward",
                        members: self.ddp.group.ranks().to_vec(),
                        message: format!(
                            "parameter {} got a gradient in segment {k} after its bucket was \
                             sent (planned for {}); the model used its parameters differently \
                             from the first pass",
                            by_id[id],
                            planned.map_or(String::new(), |p| format!("segment {p}"))
                        ),
                    })
                }
            }
        }
        Ok(())
    }
}

fn no_gradient_at_cut(k: usize) -> CollectiveError {
    CollectiveError::Candle(candle_core::Error::Msg(format!(
        "the loss does not depend on cut {k} (the segments after it ignore its output)"
    )))
}

impl DistributedDataParallel {
    /// DDP-2: buckets per segment from the last segment in which each parameter got a
    /// gradient, in reverse parameter order, up to `bucket_bytes`.
    fn learn_plan(&self, cuts: usize, last_segment: &HashMap<TensorId, usize>) -> Plan {
        let mut after: Vec<Vec<Vec<usize>>> = vec![Vec::new(); cuts + 1];
        let mut unused = Vec::new();
        let mut open: Vec<(Vec<usize>, usize)> = vec![(Vec::new(), 0); cuts + 2];
        for i in (0..self.vars.len()).rev() {
            let t = self.vars[i].as_tensor();
            let slot = last_segment.get(&t.id()).copied().unwrap_or(cuts + 1);
            let (bucket, size) = &mut open[slot];
            bucket.push(i);
            *size += t.elem_count() * t.dtype().size_in_bytes();
            if *size >= self.bucket_bytes {
                let full = std::mem::take(bucket);
                *size = 0;
                match after.get_mut(slot) {
                    Some(a) => a.push(full),
                    None => unused.push(full),
                }
            }
        }
        for (slot, (bucket, _)) in open.into_iter().enumerate() {
            if bucket.is_empty() {
                continue;
            }
            match after.get_mut(slot) {
                Some(a) => a.push(bucket),
                None => unused.push(bucket),
            }
        }
        Plan {
            cuts,
            after,
            unused,
            segment_of: last_segment.clone(),
        }
    }
}

/// A local optimizer whose step overlaps the gradients' combination with backward (Horovod's
/// `DistributedOptimizer`, over [`Pass`]).
pub struct DdpOptimizer<'a> {
    ddp: &'a DistributedDataParallel,
    opt: Optimizer,
}

impl<'a> DdpOptimizer<'a> {
    /// Starts a pass (mark its cuts in the forward pass with [`Pass::cut`]).
    pub fn pass(&self) -> Pass<'a> {
        self.ddp.pass()
    }

    /// Backpropagates `loss` through `pass`, combining gradients over the group as they
    /// come, then updates the parameters.
    pub async fn backward_step(
        &mut self,
        pass: Pass<'_>,
        loss: &Tensor,
    ) -> Result<(), CollectiveError> {
        let grads = pass.backward(loss).await?;
        self.opt.step(&grads)?;
        Ok(())
    }

    /// The wrapped optimizer (learning rate, state for checkpoints).
    pub fn optimizer(&mut self) -> &mut Optimizer {
        &mut self.opt
    }
}
