//! Data parallelism: [`DistributedDataParallel`] and [`DistributedSampler`].
//!
//! In the spirit of Horovod's `DistributedOptimizer` and PyTorch's DDP: parameters are
//! broadcast from the group's first rank at construction, and after each local backward the
//! gradients are averaged across the group with the ring all-reduce, in buckets (flattened and
//! concatenated up to `bucket_bytes`) so that many small tensors cost few messages. With equal
//! per-rank batches, the averaged gradient is the gradient of the global batch's mean loss.
//! Used as an `autograd_dist::GradientHook`, the combination runs inside every
//! `DistributedOptimizer` step on the replicas' workers.

use std::collections::HashMap;

use autograd_dist::{GradientHook, Gradients};
use candle_core::{Tensor, TensorId, Var};
use futures::future::BoxFuture;
use rpc_core::BoxError;

use crate::group::{CollectiveError, ProcessGroup, ReduceOp};

/// Keeps a model's replicas identical across a group.
pub struct DistributedDataParallel {
    group: ProcessGroup,
    vars: Vec<Var>,
    bucket_bytes: usize,
    op: ReduceOp,
}

impl std::fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("group", &self.group)
            .field("params", &self.vars.len())
            .field("bucket_bytes", &self.bucket_bytes)
            .field("op", &self.op)
            .finish()
    }
}

impl DistributedDataParallel {
    /// Wraps `vars` (the same parameters, in the same order, on every member) and makes them
    /// equal to the first rank's values. Buckets default to 25 MiB, like PyTorch's DDP.
    pub async fn new(group: ProcessGroup, vars: Vec<Var>) -> Result<Self, CollectiveError> {
        Self::with_bucket_bytes(group, vars, 25 << 20).await
    }

    /// [`DistributedDataParallel::new`] with an explicit bucket size.
    pub async fn with_bucket_bytes(
        group: ProcessGroup,
        vars: Vec<Var>,
        bucket_bytes: usize,
    ) -> Result<Self, CollectiveError> {
        let root = group.ranks()[0];
        for v in &vars {
            let t = group.broadcast(v.as_tensor(), root).await?;
            // The root gets its own tensor back.
            if t.id() != v.as_tensor().id() {
                v.set(&t)?;
            }
        }
        Ok(Self {
            group,
            vars,
            bucket_bytes: bucket_bytes.max(1),
            op: ReduceOp::Mean,
        })
    }

    /// The group the replicas live on.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    pub(crate) fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    pub(crate) fn reduce_op(&self) -> ReduceOp {
        self.op
    }

    /// Combines gradients with `op` instead of the mean: `ReduceOp::Sum` where every replica's
    /// gradient is already scaled for the global batch (as when one loss over the whole batch
    /// is backpropagated through every replica).
    pub fn with_reduce_op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// The wrapped parameters.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Replaces each parameter's gradient in `grads` by its mean (or the operation set with
    /// [`DistributedDataParallel::with_reduce_op`]) over the group. A parameter without a
    /// gradient here counts as zero, so every member sends the same buckets.
    pub async fn reduce_gradients(
        &self,
        grads: &mut impl Gradients,
    ) -> Result<(), CollectiveError> {
        let mut bucket: Vec<usize> = Vec::new();
        let mut size = 0usize;
        for i in 0..self.vars.len() {
            let t = self.vars[i].as_tensor();
            bucket.push(i);
            size += t.elem_count() * t.dtype().size_in_bytes();
            if size >= self.bucket_bytes || i + 1 == self.vars.len() {
                self.reduce_bucket(&bucket, grads).await?;
                bucket.clear();
                size = 0;
            }
        }
        Ok(())
    }

    async fn reduce_bucket(
        &self,
        idx: &[usize],
        grads: &mut impl Gradients,
    ) -> Result<(), CollectiveError> {
        let flats: Vec<Tensor> = idx
            .iter()
            .map(|&i| {
                let v = self.vars[i].as_tensor();
                match grads.grad(v) {
                    Some(g) => g.flatten_all(),
                    None => v.zeros_like()?.flatten_all(),
                }
            })
            .collect::<candle_core::Result<_>>()?;
        let joined = Tensor::cat(&flats, 0)?;
        let reduced = self.group.all_reduce(&joined, self.op).await?;
        let mut at = 0;
        for &i in idx {
            let v = self.vars[i].as_tensor();
            let n = v.elem_count();
            grads.set_grad(v, reduced.narrow(0, at, n)?.reshape(v.dims())?);
            at += n;
        }
        Ok(())
    }
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

/// Splits a dataset's indices across a group's members, reshuffled each epoch.
///
/// Like PyTorch's `DistributedSampler`: the permutation depends only on `seed` and the epoch,
/// so every member computes the same one; it is padded (by repeating its start) to a multiple
/// of the number of replicas, and member `rank` takes every `replicas`-th index from `rank`.
///
/// ```
/// let s = collectives::DistributedSampler::new(10, 3, 1, 42);
/// let mine = s.indices(0);
/// assert_eq!(mine.len(), 4);
/// ```
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    replicas: usize,
    rank: usize,
    seed: u64,
}

impl DistributedSampler {
    /// A sampler over `len` items for member `rank` of `replicas`.
    pub fn new(len: usize, replicas: usize, rank: usize, seed: u64) -> Self {
        assert!(
            replicas > 0 && rank < replicas,
            "rank {rank} must be below replicas {replicas}"
        );
        Self {
            len,
            replicas,
            rank,
            seed,
        }
    }

    /// The whole epoch's permutation (the same on every member).
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.len).collect();
        let mut s = (self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        for i in (1..p.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            p.swap(i, (s % (i as u64 + 1)) as usize);
        }
        p
    }

    /// This member's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut p = self.permutation(epoch);
        if p.is_empty() {
            return p;
        }
        let total = p.len().div_ceil(self.replicas) * self.replicas;
        let mut k = 0;
        while p.len() < total {
            p.push(p[k]);
            k += 1;
        }
        p.into_iter()
            .skip(self.rank)
            .step_by(self.replicas)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_partitions_the_epoch_and_reshuffles() {
        let n = 3;
        let parts: Vec<Vec<usize>> = (0..n)
            .map(|r| DistributedSampler::new(10, n, r, 7).indices(0))
            .collect();
        assert!(parts.iter().all(|p| p.len() == 4));
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>(), "every item is served");
        let s = DistributedSampler::new(10, n, 0, 7);
        assert_ne!(s.permutation(0), s.permutation(1), "a new order each epoch");
        assert_eq!(
            s.permutation(3),
            DistributedSampler::new(10, n, 2, 7).permutation(3),
            "same on every rank"
        );
    }
}
