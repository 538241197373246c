//! Communication hooks, in the spirit of PyTorch DDP's: how one bucket of gradients (flattened
//! into one tensor) is combined over the group. [`AllReduceHook`] is the default;
//! [`CompressHook`] halves the bytes on the wire (bf16 or f16) at the cost of rounding; a user's
//! own hook (top-k, PowerSGD, error feedback) implements [`CommHook`].

use candle_core::{DType, Tensor};

use crate::group::{ProcessGroup, ReduceOp, Work};

/// Combines a bucket of gradients over the group. `bucket` is this member's flattened
/// gradients (every member passes the same length and dtype, in the same order of calls);
/// the result must have `bucket`'s length and dtype, and be the same on every member.
pub trait CommHook: Send + Sync + 'static {
    /// Starts combining `bucket` with `op` (the mean or the sum over the group) and returns
    /// the work to wait for. Called while backward may still be running: the hook must not
    /// wait for anything itself.
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor>;

    /// A short name, for reports.
    fn name(&self) -> &'static str;

    /// When this hook is exactly the ring all-reduce of the bucket converted to some element
    /// type (given the gradients' type), that type: the wrapper then copies the gradients
    /// straight into one buffer of it and reduces the buffer in place, and `reduce` is not
    /// called (for a mean in a narrower type than the gradients', each member divides before
    /// converting and the ring sums). The default, for a hook of your own: `None`, and
    /// `reduce` gets the bucket as a tensor.
    fn ring_dtype(&self, grads: DType) -> Option<DType> {
        let _ = grads;
        None
    }
}

/// The default: the ring all-reduce of the bucket as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceHook;

impl CommHook for AllReduceHook {
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor> {
        group.all_reduce_async(&bucket, op)
    }

    fn name(&self) -> &'static str {
        "all_reduce"
    }

    fn ring_dtype(&self, grads: DType) -> Option<DType> {
        Some(grads)
    }
}

/// Gradients cast to a 16-bit type for the wire and back: half the bytes. For the mean, each
/// member divides by the group's size before the cast (as PyTorch's `fp16_compress_hook`
/// does), so the sum does not overflow f16. The rounding error is that of the 16-bit sum
/// along the ring: a relative error of about `2^-8 × (n - 1)` for bf16 and `2^-11 × (n - 1)`
/// for f16 per element, against f32's exact ring (measured in `rpc-bench ddp`). An f16 sum
/// that leaves f16's range (65,504) is not handed on as infinities: `DistributedDataParallel`
/// combines that bucket again in the gradients' own type (DDP-8).
#[derive(Clone, Copy, Debug)]
pub struct CompressHook {
    dtype: DType,
}

impl CompressHook {
    /// bf16 on the wire (f32's range, 8 bits of mantissa).
    pub fn bf16() -> Self {
        Self { dtype: DType::BF16 }
    }

    /// f16 on the wire (11 bits of mantissa, a range to 65,504).
    pub fn f16() -> Self {
        Self { dtype: DType::F16 }
    }
}

impl CommHook for CompressHook {
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor> {
        let (dtype, n) = (self.dtype, group.size());
        let original = bucket.dtype();
        let prepared = (|| {
            let scaled = match op {
                ReduceOp::Mean => (bucket / n as f64)?,
                _ => bucket,
            };
            scaled.to_dtype(dtype)
        })();
        let wire_op = match op {
            ReduceOp::Mean => ReduceOp::Sum,
            other => other,
        };
        match prepared {
            Ok(half) => group
                .all_reduce_async(&half, wire_op)
                .map(move |t| Ok(t.to_dtype(original)?)),
            // COL-4: the others would wait for this member's bucket, and the next operation
            // would pair with the wrong one.
            Err(e) => group.fail_async(
                "all_reduce",
                format!(
                    "the {} hook could not prepare the bucket on rank {}: {e}",
                    self.name(),
                    group.agent().rank()
                ),
            ),
        }
    }

    fn name(&self) -> &'static str {
        match self.dtype {
            DType::BF16 => "bf16",
            _ => "f16",
        }
    }

    fn ring_dtype(&self, _grads: DType) -> Option<DType> {
        Some(self.dtype)
    }
}
