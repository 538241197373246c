//! Data parallelism: [`DistributedDataParallel`] and [`DistributedSampler`].
//!
//! In the spirit of Horovod's `DistributedOptimizer` and PyTorch's DDP: parameters are
//! broadcast from the group's first rank at construction, and the replicas' gradients are
//! averaged across the group with the ring all-reduce, in buckets (flattened and concatenated
//! up to `bucket_bytes`, one element type and device each) so that many small tensors cost
//! few messages. With equal per-rank batches, the averaged gradient is the gradient of the
//! global batch's mean loss.
//!
//! Two ways to run it:
//! - after backward: [`DistributedDataParallel::reduce_gradients`] on a finished backward's
//!   gradients (also as an `autograd_dist::GradientHook`, inside every `DistributedOptimizer`
//!   step on the replicas' workers);
//! - overlapped with backward ([`Pass`], `overlap.rs`): the model's forward marks a few cuts
//!   (`let h = pass.cut(&h)?;`, one line each), and [`Pass::backward`] backpropagates segment
//!   by segment from the loss, starting each bucket's all-reduce as soon as the segment that
//!   completes its gradients is done, while the earlier segments' backward runs, and a
//!   `grad_once` weight's bucket as soon as its product is computed (DDP-1..4), and what
//!   else its segment completes, when small, with the next segment's buckets (DDP-7).
//!
//! Each bucket travels through a [`CommHook`] (`hooks.rs`): the all-reduce by default,
//! [`CompressHook`] for bf16 / f16 on the wire (an f16 sum out of range is combined again,
//! DDP-8), or the user's own. A pass that fails on one member fails on every member, naming
//! it (`failure.rs`, DDP-5). A parameter no member had a gradient for gets none, as in one
//! process (DDP-9: one small all-reduce of flags per step, after the buckets).

mod failure;
mod flat;
mod hooks;
mod optimizer;
mod overlap;
mod plan;
mod sampler;
mod verify;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use autograd_dist::{GradientHook, Gradients};
use candle_core::{DType, DeviceLocation, Tensor, TensorId, Var};
use futures::future::BoxFuture;
use rpc_core::BoxError;

use crate::group::{CollectiveError, ProcessGroup, ReduceOp, Work};

pub use hooks::{AllReduceHook, CommHook, CompressHook};
pub use optimizer::DdpOptimizer;
pub use overlap::Pass;
pub use sampler::DistributedSampler;

/// Keeps a model's replicas identical across a group.
pub struct DistributedDataParallel {
    group: ProcessGroup,
    vars: Vec<Var>,
    bucket_bytes: usize,
    op: ReduceOp,
    hook: Arc<dyn CommHook>,
    /// The buckets of an overlapped pass, learnt from the first one (`overlap.rs`).
    plan: Mutex<Option<plan::Plan>>,
    /// Why an earlier failed pass left this member out of step with the group (DDP-5).
    out_of_step: Mutex<Option<String>>,
    /// How many f16 buckets left f16's range and were combined again (DDP-8).
    f16_redone: AtomicU64,
}

impl std::fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("group", &self.group)
            .field("params", &self.vars.len())
            .field("bucket_bytes", &self.bucket_bytes)
            .field("op", &self.op)
            .field("hook", &self.hook.name())
            .finish()
    }
}

/// PyTorch DDP's default bucket size, 25 MiB.
pub(crate) const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

impl DistributedDataParallel {
    /// Wraps `vars` (the same parameters, in the same order, on every member) and makes them
    /// equal to the first rank's values. Buckets default to 25 MiB, like PyTorch's DDP.
    /// Members whose parameters differ in number, type or shape all fail here, with one
    /// message naming the parameter and the ranks (DDP-6).
    pub async fn new(group: ProcessGroup, vars: Vec<Var>) -> Result<Self, CollectiveError> {
        Self::with_bucket_bytes(group, vars, DEFAULT_BUCKET_BYTES).await
    }

    /// [`DistributedDataParallel::new`] with an explicit bucket size.
    pub async fn with_bucket_bytes(
        group: ProcessGroup,
        vars: Vec<Var>,
        bucket_bytes: usize,
    ) -> Result<Self, CollectiveError> {
        verify::same_models(&group, &vars).await?;
        let root = group.ranks()[0];
        for v in &vars {
            let t = group.broadcast(v.as_tensor(), root).await?;
            // The root gets its own tensor back.
            if t.id() != v.as_tensor().id() {
                v.set(&t)?;
            }
        }
        Ok(Self::assume_equal(group, vars, bucket_bytes))
    }

    /// Wraps `vars` as they are: the caller made them equal on every member (`ElasticDdp`'s
    /// recovery, EL-4).
    pub(crate) fn assume_equal(group: ProcessGroup, vars: Vec<Var>, bucket_bytes: usize) -> Self {
        Self {
            group,
            vars,
            bucket_bytes: bucket_bytes.max(1),
            op: ReduceOp::Mean,
            hook: Arc::new(AllReduceHook),
            plan: Mutex::new(None),
            out_of_step: Mutex::new(None),
            f16_redone: AtomicU64::new(0),
        }
    }

    /// The same wrapper with buckets of up to `bytes` (an overlapped pass learns them again).
    pub(crate) fn rebucketed(self, bytes: usize) -> Self {
        Self {
            bucket_bytes: bytes.max(1),
            plan: Mutex::new(None),
            ..self
        }
    }

    /// The same parameters and settings (bucket size, reduce operation, hook) over another
    /// group whose members hold equal parameters (`ElasticDdp`'s re-formed group); the buckets
    /// of an overlapped pass are learnt again.
    pub(crate) fn regroup(&self, group: ProcessGroup) -> Self {
        Self {
            group,
            vars: self.vars.clone(),
            bucket_bytes: self.bucket_bytes,
            op: self.op,
            hook: Arc::clone(&self.hook),
            plan: Mutex::new(None),
            out_of_step: Mutex::new(None),
            f16_redone: AtomicU64::new(0),
        }
    }

    /// The group the replicas live on.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Combines gradients with `op` instead of the mean: `ReduceOp::Sum` where every replica's
    /// gradient is already scaled for the global batch (as when one loss over the whole batch
    /// is backpropagated through every replica).
    pub fn with_reduce_op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Sends every bucket through `hook` (default: [`AllReduceHook`]).
    pub fn with_hook(mut self, hook: impl CommHook) -> Self {
        self.hook = Arc::new(hook);
        self
    }

    /// The wrapped parameters.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Replaces each parameter's gradient in `grads` by its mean (or the operation set with
    /// [`DistributedDataParallel::with_reduce_op`]) over the group, after backward: buckets in
    /// the parameters' order, all started at once and waited for in order. A parameter
    /// without a gradient here counts as zero, so every member sends the same buckets; one
    /// without a gradient on every member gets none (DDP-9).
    pub async fn reduce_gradients(
        &self,
        grads: &mut impl Gradients,
    ) -> Result<(), CollectiveError> {
        self.check_in_step()?;
        let buckets = self.param_buckets();
        let (total, one_op) = (buckets.len(), self.one_op_per_bucket());
        let mut started = Vec::with_capacity(total);
        for idx in buckets {
            match self.start(&idx, |v| grads.grad(v)) {
                Ok(bucket) => started.push((idx, bucket)),
                Err(e) => {
                    // The buckets not started, and the used parameters' flags (DDP-9).
                    let rest = one_op.then_some(total - started.len() + 1);
                    return Err(self.fail_rest(e, rest, true).await);
                }
            }
        }
        let used = self.start_used(|v| grads.grad(v).is_some());
        match self.finish(started, used, grads).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail_rest(e, one_op.then_some(0), false).await),
        }
    }

    /// DDP-9: starts combining which parameters this member has a gradient for (`has`), after
    /// the pass's buckets: a flag each, the maximum over the group (one small all-reduce).
    fn start_used(&self, has: impl Fn(&Tensor) -> bool) -> Work<Tensor> {
        let flags: Vec<f32> = (self.vars.iter())
            .map(|v| f32::from(u8::from(has(v.as_tensor()))))
            .collect();
        let n = flags.len();
        match Tensor::from_vec(flags, n, &candle_core::Device::Cpu) {
            Ok(t) => self.group.all_reduce_async(&t, ReduceOp::Max),
            // COL-4: the others wait for this member's flags.
            Err(e) => self.group.fail_async("all_reduce", e.to_string()),
        }
    }

    /// The buckets in the parameters' order (after backward, and an overlapped pass's first).
    fn param_buckets(&self) -> Vec<Vec<usize>> {
        self.fill_buckets(0..self.vars.len())
    }

    /// Parameters `order` in buckets of one element type and device each (a bucket is one
    /// flat buffer; PyTorch's DDP buckets by both too), each up to `bucket_bytes`: a bucket
    /// leaves the list once full, the ones still open follow in the order they opened. The
    /// same on every member, whose parameters DDP-6 found alike.
    fn fill_buckets(&self, order: impl IntoIterator<Item = usize>) -> Vec<Vec<usize>> {
        let mut open: Vec<((DType, DeviceLocation), Vec<usize>, usize)> = Vec::new();
        let mut full = Vec::new();
        for i in order {
            let t = self.vars[i].as_tensor();
            let kind = (t.dtype(), t.device().location());
            let k = match open.iter().position(|(k, ..)| *k == kind) {
                Some(k) => k,
                None => {
                    open.push((kind, Vec::new(), 0));
                    open.len() - 1
                }
            };
            let (_, bucket, size) = &mut open[k];
            bucket.push(i);
            *size += t.elem_count() * t.dtype().size_in_bytes();
            if *size >= self.bucket_bytes {
                full.push(open.remove(k).1);
            }
        }
        full.extend(open.into_iter().map(|(_, bucket, _)| bucket));
        full
    }

    /// Starts combining the gradients of parameters `idx` (zeros where `grad` has none):
    /// through the hook's fast path ([`CommHook::ring_dtype`], `flat.rs`) where it has one,
    /// else as one concatenated tensor through [`CommHook::reduce`].
    fn start(
        &self,
        idx: &[usize],
        grad: impl Fn(&Tensor) -> Option<Tensor>,
    ) -> Result<Bucket, CollectiveError> {
        self.start_with(self.hook.as_ref(), idx, grad)
    }

    /// [`Self::start`] through `hook`.
    fn start_with(
        &self,
        hook: &dyn CommHook,
        idx: &[usize],
        grad: impl Fn(&Tensor) -> Option<Tensor>,
    ) -> Result<Bucket, CollectiveError> {
        let grads: Vec<(Option<Tensor>, usize)> = idx
            .iter()
            .map(|&i| {
                let v = self.vars[i].as_tensor();
                (grad(v), v.elem_count())
            })
            .collect();
        let dtype = self.vars[idx[0]].dtype();
        let same = idx.iter().all(|&i| self.vars[i].dtype() == dtype);
        if let Some(ring) = hook.ring_dtype(dtype).filter(|_| same) {
            let narrower = ring.size_in_bytes() < dtype.size_in_bytes();
            let (scale, op) = match self.op {
                ReduceOp::Mean if narrower => (1.0 / self.group.size() as f64, ReduceOp::Sum),
                op => (1.0, op),
            };
            if let Some(w) = flat::start(&self.group, &grads, ring, scale, op)? {
                return Ok(Bucket::Flat(w, dtype));
            }
        }
        let flats: Vec<Tensor> = idx
            .iter()
            .zip(grads)
            .map(|(&i, (g, _))| match g {
                Some(g) => g.flatten_all(),
                None => self.vars[i].as_tensor().zeros_like()?.flatten_all(),
            })
            .collect::<candle_core::Result<_>>()?;
        let joined = Tensor::cat(&flats, 0)?;
        Ok(Bucket::Tensor(hook.reduce(&self.group, joined, self.op)))
    }

    /// Waits for the pass's buckets, in their order, and puts the combined gradients back,
    /// parameter by parameter (the pass's own are dropped as they are replaced), then for
    /// which parameters some member had a gradient for (`used`, started after the buckets):
    /// one that no member had gets none (DDP-9), as in one process, where the optimizer then
    /// leaves it alone (a zero would be decayed, or moved by momentum or Adam's moments).
    async fn finish(
        &self,
        started: Vec<(Vec<usize>, Bucket)>,
        used: Work<Tensor>,
        grads: &mut impl Gradients,
    ) -> Result<(), CollectiveError> {
        // Parameters without a gradient here, which only the flags can tell about.
        let mut unknown = Vec::new();
        for (idx, bucket) in started {
            let reduced = self.combined(&idx, bucket, grads).await?;
            let mut at = 0;
            for &i in &idx {
                let v = self.vars[i].as_tensor();
                let n = v.elem_count();
                let g = reduced.narrow(0, at, n)?.reshape(v.dims())?;
                if grads.grad(v).is_some() {
                    grads.set_grad(v, g);
                } else {
                    unknown.push((i, g));
                }
                at += n;
            }
        }
        let used = used.wait().await?.to_vec1::<f32>()?;
        for (i, g) in unknown {
            if used[i] > 0.0 {
                grads.set_grad(self.vars[i].as_tensor(), g);
            }
        }
        Ok(())
    }

    /// Waits for a bucket's combined gradients, as one flat tensor (DDP-8: an f16 sum that is
    /// not finite is combined again).
    async fn combined(
        &self,
        idx: &[usize],
        bucket: Bucket,
        grads: &impl Gradients,
    ) -> Result<Tensor, CollectiveError> {
        let dtype = self.vars[idx[0]].dtype();
        let to_f16 = self.hook.ring_dtype(dtype) == Some(DType::F16) && dtype != DType::F16;
        let (mut reduced, not_finite) = match bucket {
            Bucket::Tensor(work) => {
                let t = work.wait().await?;
                let not_finite = to_f16 && !all_finite(&t)?;
                (t, not_finite)
            }
            Bucket::Flat(work, dtype) => {
                flat::finish(work, dtype, &self.group.agent().tracer()).await?
            }
        };
        if to_f16 && not_finite {
            reduced = self.combine_again(idx, grads).await?;
        }
        Ok(reduced)
    }
}

impl DistributedDataParallel {
    /// DDP-8: an f16 bucket whose sum is not finite is combined again in the gradients' own
    /// type, the plain all-reduce of `grads` (still the member's own for `idx`). Every member
    /// holds the same sum, so every member decides the same, at the same place in the group's
    /// order of operations: after the pass's buckets and its flags (DDP-9), in their order.
    async fn combine_again(
        &self,
        idx: &[usize],
        grads: &impl Gradients,
    ) -> Result<Tensor, CollectiveError> {
        let redone = self.f16_redone.fetch_add(1, Ordering::Relaxed) + 1;
        let reduced = match self.start_with(&AllReduceHook, idx, |v| grads.grad(v))? {
            Bucket::Tensor(work) => work.wait().await?,
            Bucket::Flat(work, dtype) => {
                flat::finish(work, dtype, &self.group.agent().tracer())
                    .await?
                    .0
            }
        };
        if redone.is_power_of_two() {
            let cause = if all_finite(&reduced)? {
                "their sum left f16's range (65,504)"
            } else {
                "the gradients themselves are not finite"
            };
            tracing::warn!(
                rank = self.group.agent().rank(),
                "an f16 bucket of {} parameters (the first #{}) was not finite after the sum: \
                 {cause}; combined again in {:?} ({redone} bucket(s) so far; \
                 CompressHook::bf16 has f32's range)",
                idx.len(),
                idx[0],
                self.vars[idx[0]].dtype(),
            );
        }
        Ok(reduced)
    }
}

/// Whether every element of `t` is finite (its sum is: an infinity or a NaN spreads to it;
/// a sum that leaves the type's range only costs a bucket combined again).
fn all_finite(t: &Tensor) -> Result<bool, CollectiveError> {
    let sum = t.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok(sum.is_finite())
}

/// A bucket on its way.
enum Bucket {
    /// Through the hook's `reduce`.
    Tensor(Work<Tensor>),
    /// Through the ring on a flat buffer; the parameters' type.
    Flat(flat::FlatWork, candle_core::DType),
}

/// As a [`GradientHook`] (`autograd_dist::set_gradient_hook`), the replicas' gradients are
/// combined inside every `DistributedOptimizer` step on the members, before the update.
impl GradientHook for DistributedDataParallel {
    fn before_step<'a>(
        &'a self,
        grads: &'a mut HashMap<TensorId, Tensor>,
    ) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move { Ok(self.reduce_gradients(grads).await?) })
    }
}
