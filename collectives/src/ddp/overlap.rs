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
//!   in the parameters' order, as `reduce_gradients` does, after recording the last segment
//!   in which each parameter gets a gradient; kept once that pass has worked): parameters
//!   grouped per segment, in reverse order of the parameters (as backward produces them), up
//!   to `bucket_bytes`; those that got none go last. The members agree on one plan first
//!   (one small all-reduce: each parameter's segment is the last any member completes it in,
//!   and a first pass whose cuts differ between members fails on every member), so their
//!   buckets pair up whatever each one's first batch used. A later pass in which a parameter
//!   gets a gradient after its bucket left fails, naming it (the model used its parameters
//!   differently from the first pass), rather than send an incomplete sum; so does a pass
//!   that cuts the model another number of times.
//! - DDP-3: the gradients combined are the same as [`DistributedDataParallel::reduce_gradients`]
//!   computes after a whole backward (the segments' gradients add up to the whole graph's).
//! - DDP-4: from the second pass on, a bucket whose weights' whole gradients were, in the
//!   first pass, one `grad_once` product each (a weight used once, by
//!   `autograd_dist::grad_once::matmul`) leaves as soon as the last of those products is
//!   computed, while its segment's backward goes on below the layer; such buckets go first
//!   among their segment's, in the plan's order, and the others leave at the segment's end.
//!   A weight that gets more gradient after its bucket left (the model now uses it twice)
//!   fails the pass, naming it.
//!
//! Cost where there is nothing to overlap (one segment): one copy of each cut's activation
//! and one surrogate graph per cut; no cut, none.

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use super::DistributedDataParallel;
use crate::group::CollectiveError;

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
    /// gradients combined over the group (DDP-1..4).
    pub async fn backward(self, loss: &Tensor) -> Result<GradStore, CollectiveError> {
        let ddp = self.ddp;
        ddp.check_in_step()?;
        let learnt_cuts = {
            let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
            plan.as_ref().map(|p| p.cuts)
        };
        if let Some(cuts) = learnt_cuts.filter(|&c| c != self.cuts.len()) {
            // DDP-2: the others follow the plan; this member fails the operations they start.
            let e = CollectiveError::Failed {
                op: "ddp backward",
                members: ddp.group.ranks().to_vec(),
                message: format!(
                    "this pass cuts the model {} times where the first pass, which the \
                     buckets were learnt from, cut it {cuts} times: every pass of every \
                     member must cut it at the same places",
                    self.cuts.len()
                ),
            };
            return Err(ddp.pass_failed(e, true, 0, false).await);
        }
        let planned = learnt_cuts.is_some();
        let by_id: HashMap<TensorId, usize> = ddp
            .vars
            .iter()
            .enumerate()
            .map(|(i, v)| (v.as_tensor().id(), i))
            .collect();
        let mut st = State {
            planned,
            by_id,
            total: None,
            last_segment: HashMap::new(),
            started: Vec::new(),
            handed: HashMap::new(),
            whole: HashSet::new(),
            segment: Segment::default(),
            all_started: false,
            agreed: false,
        };
        match self.run(loss, &mut st).await {
            Ok(grads) => Ok(grads),
            Err(e) => {
                let done = st.started.len() + usize::from(st.agreed);
                Err(ddp.pass_failed(e, st.planned, done, st.all_started).await)
            }
        }
    }

    /// The pass, from the last segment to the first, then the buckets' results.
    async fn run(&self, loss: &Tensor, st: &mut State) -> Result<GradStore, CollectiveError> {
        let (ddp, planned) = (self.ddp, st.planned);
        // The segments from the last to the first: what each is backpropagated from (the loss,
        // then the output before each cut, with the gradient at its leaf).
        let mut seed: Option<(Tensor, Option<Tensor>)> = Some((loss.clone(), None));
        for k in (0..=self.cuts.len()).rev() {
            let (from, g) = seed.take().expect("seeded");
            st.segment = Segment::default();
            let store = self.backpropagate(k, from, g, st).await?;
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
            self.segment_done(k, store, st)?;
        }
        let mut grads = st.total.take().expect("at least one segment");
        let (rest, learnt) = if planned {
            let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
            (plan.as_ref().expect("planned").unused.clone(), None)
        } else {
            let handed = st
                .whole
                .iter()
                .filter(|id| st.handed.get(id).is_some_and(|h| h.parts == 1))
                .copied()
                .collect();
            // One plan for the group: from every member's first pass (DDP-2).
            let agreed = ddp.agree(self.cuts.len(), &st.last_segment, &handed).await;
            st.agreed = true;
            // On failure (a member's verdict, or cuts that differ: the same result everywhere)
            // every member fails the buckets it has not started, and all stay in step.
            let (last_segment, handed) = agreed?;
            let plan = ddp.learn_plan(self.cuts.len(), &last_segment, handed);
            // The learning pass combines in the parameters' order (DDP-5: a member whose
            // pass fails knows how many buckets the others start).
            (ddp.param_buckets(), Some(plan))
        };
        for idx in rest {
            let bucket = ddp.start(&idx, |v| grads.get(v).cloned())?;
            st.started.push((idx, bucket));
        }
        let used = ddp.start_used(|v| grads.get(v).is_some());
        st.all_started = true;
        ddp.finish(std::mem::take(&mut st.started), used, &mut grads)
            .await?;
        // Kept only once the pass has worked here, and so, by DDP-5, on every member.
        if let Some(plan) = learnt {
            *ddp.plan.lock().unwrap_or_else(|p| p.into_inner()) = Some(plan);
        }
        // Only the wrapped parameters' gradients are the caller's business.
        for (_, leaf) in &self.cuts {
            grads.remove(leaf.as_tensor());
        }
        Ok(grads)
    }

    /// Backpropagates segment `k` from `from` (times `g` at it) on a blocking thread, so the
    /// runtime's threads carry the ring meanwhile; starts the segment's buckets whose weights
    /// `grad_once` hands over as backward computes them (DDP-4).
    async fn backpropagate(
        &self,
        k: usize,
        from: Tensor,
        g: Option<Tensor>,
        st: &mut State,
    ) -> Result<GradStore, CollectiveError> {
        let mut span = self
            .ddp
            .group
            .agent()
            .tracer()
            .span(rpc_core::trace::Cat::Compute, "backward segment");
        span.detail(|| format!("segment {k}"));
        let (tx, mut rx) =
            tokio::sync::mpsc::channel::<(TensorId, Tensor)>(self.ddp.vars.len().max(1));
        // A parameter's product, as `grad_once` computes it (a closed channel: the pass has
        // failed and nobody waits for it any more).
        let ready = move |w: &Tensor, dw: &Tensor| {
            let _ = tx.blocking_send((w.id(), dw.clone()));
        };
        let mut done = rpc_core::spawn_blocking(move || match g {
            None => autograd_dist::grad_once::backward_observed(&from, ready),
            Some(g) => autograd_dist::grad_once::backward_observed(&(from * g)?.sum_all()?, ready),
        });
        let store = loop {
            tokio::select! {
                biased;
                Some((id, dw)) = rx.recv() => self.handed_over(k, id, dw, st)?,
                store = &mut done => break store,
            }
        };
        // What was handed over just before the end.
        while let Ok((id, dw)) = rx.try_recv() {
            self.handed_over(k, id, dw, st)?;
        }
        drop(span);
        store
            .map_err(|e| CollectiveError::Candle(candle_core::Error::Msg(e.to_string())))?
            .map_err(CollectiveError::Candle)
    }

    /// DDP-4: a part of parameter `id`'s gradient, handed over in segment `k`; starts, in the
    /// plan's order, the segment's leading buckets whose parameters have all come.
    fn handed_over(
        &self,
        k: usize,
        id: TensorId,
        dw: Tensor,
        st: &mut State,
    ) -> Result<(), CollectiveError> {
        let Some(&index) = st.by_id.get(&id) else {
            return Ok(());
        };
        let h = st.handed.entry(id).or_insert(Handed {
            parts: 0,
            last: dw.id(),
        });
        h.parts += 1;
        h.last = dw.id();
        if !st.planned {
            return Ok(());
        }
        let plan = self.ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
        let plan = plan.as_ref().expect("planned");
        if !plan.handed.contains(&id) || plan.segment_of.get(&id) != Some(&k) {
            return Ok(()); // its bucket waits for the end of its segment
        }
        let seg = &mut st.segment;
        if seg.sent.contains_key(&id) {
            return Err(self.second_part(index));
        }
        if seg.ready.remove(&id).is_some() || seg.spoiled.contains(&id) {
            // A second part before its bucket left: the bucket waits for the segment's end,
            // which has the sum.
            seg.spoiled.insert(id);
            return Ok(());
        }
        seg.ready.insert(id, dw);
        while seg.next < plan.early[k] {
            let idx = &plan.after[k][seg.next];
            let vars = &self.ddp.vars;
            if !idx
                .iter()
                .all(|&i| seg.ready.contains_key(&vars[i].as_tensor().id()))
            {
                break;
            }
            let bucket = self.ddp.start(idx, |v| seg.ready.get(&v.id()).cloned())?;
            for &i in idx {
                let v = vars[i].as_tensor().id();
                let dw = seg.ready.remove(&v).expect("ready");
                seg.sent.insert(v, dw.id());
            }
            st.started.push((idx.clone(), bucket));
            seg.next += 1;
        }
        Ok(())
    }

    /// Segment `k`'s gradients are in `store`: checks what left early (DDP-4) and the plan
    /// (DDP-2), adds them to the pass's, and starts the segment's other buckets (DDP-1).
    fn segment_done(
        &self,
        k: usize,
        store: GradStore,
        st: &mut State,
    ) -> Result<(), CollectiveError> {
        let ddp = self.ddp;
        for (id, sent) in &st.segment.sent {
            let same = store.get_id(*id).map(Tensor::id) == Some(*sent);
            let before = st.total.as_ref().is_some_and(|t| t.get_id(*id).is_some());
            if !same || before {
                return Err(self.second_part(st.by_id[id]));
            }
        }
        for id in store.get_ids() {
            if st.by_id.contains_key(id) {
                st.last_segment.insert(*id, k);
                // Learning DDP-4: the whole gradient is the one product handed over.
                let whole = st.handed.get(id).map(|h| h.last) == store.get_id(*id).map(Tensor::id);
                let elsewhere = st.total.as_ref().is_some_and(|t| t.get_id(*id).is_some());
                if whole && !elsewhere {
                    st.whole.insert(*id);
                } else {
                    st.whole.remove(id);
                }
            }
        }
        match &mut st.total {
            None => st.total = Some(store),
            Some(t) => t.extend(store)?,
        }
        if !st.planned {
            return Ok(());
        }
        self.check_plan(&st.by_id, &st.last_segment, k)?;
        let grads = st.total.as_ref().expect("a store");
        let plan = ddp.plan.lock().unwrap_or_else(|p| p.into_inner());
        let buckets = plan.as_ref().expect("planned").after[k][st.segment.next..].to_vec();
        drop(plan);
        for idx in buckets {
            let bucket = ddp.start(&idx, |v| grads.get(v).cloned())?;
            st.started.push((idx, bucket));
        }
        Ok(())
    }

    /// DDP-4's refusal: a parameter sent early got more gradient afterwards.
    fn second_part(&self, index: usize) -> CollectiveError {
        CollectiveError::Failed {
            op: "ddp backward",
            members: self.ddp.group.ranks().to_vec(),
            message: format!(
                "parameter {index} got more gradient after its bucket was sent (its whole \
                 gradient was one product in the first pass); the model used its parameters \
                 differently from the first pass"
            ),
        }
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

/// One pass's bookkeeping.
struct State {
    planned: bool,
    /// Each wrapped parameter's index, by its tensor.
    by_id: HashMap<TensorId, usize>,
    /// The gradients of the segments done.
    total: Option<GradStore>,
    /// The last segment (lowest index) in which each parameter got a gradient.
    last_segment: HashMap<TensorId, usize>,
    /// The buckets on their way, in the order they started.
    started: Vec<(Vec<usize>, super::Bucket)>,
    /// The parts of each parameter's gradient `grad_once` handed over.
    handed: HashMap<TensorId, Handed>,
    /// Parameters whose gradient, so far, is one handed-over product (learning DDP-4).
    whole: HashSet<TensorId>,
    /// The segment being backpropagated.
    segment: Segment,
    /// Whether every bucket of the pass has started (DDP-5).
    all_started: bool,
    /// Whether the learning pass's agreement on the plan has run (DDP-5 counts it).
    agreed: bool,
}

/// What `grad_once` handed over of one parameter's gradient.
struct Handed {
    parts: usize,
    /// The last part (a tensor's id).
    last: TensorId,
}

/// A segment's buckets that may leave before it ends (DDP-4).
#[derive(Default)]
struct Segment {
    /// The handed-over gradients waiting for the rest of their bucket.
    ready: HashMap<TensorId, Tensor>,
    /// Parameters that got a second part before their bucket left: it waits for the end.
    spoiled: HashSet<TensorId>,
    /// The parameters sent, with the tensor sent.
    sent: HashMap<TensorId, TensorId>,
    /// The segment's next bucket to start.
    next: usize,
}

fn no_gradient_at_cut(k: usize) -> CollectiveError {
    CollectiveError::Candle(candle_core::Error::Msg(format!(
        "the loss does not depend on cut {k} (the segments after it ignore its output)"
    )))
}
