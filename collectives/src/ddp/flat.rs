//! A bucket's fast path: when its hook is the ring all-reduce in some element type (the
//! built-in hooks are), the gradients are copied straight into one flat buffer of that type
//! (converting as they are copied), reduced in place in the background, and read back as
//! views of one tensor. Against the tensor path (concatenate the gradients, then the ring
//! copies them out of the tensor; a cast to 16 bits and back for compression) that is one
//! pass over the bucket's bytes instead of three to five.

use candle_core::{CpuStorage, DType, Storage, Tensor, WithDType};
use half::{bf16, f16};

use crate::group::{CollectiveError, Element, ProcessGroup, ReduceOp, Work};

/// A bucket on its way through the ring, by element type.
pub(super) enum FlatWork {
    F32(Work<Vec<f32>>),
    F64(Work<Vec<f64>>),
    Bf16(Work<Vec<bf16>>),
    F16(Work<Vec<f16>>),
}

/// Starts the ring all-reduce of `grads` (one per parameter, `None` for zeros of `shapes[i]`
/// elements) in `ring` elements: the values are multiplied by `scale` first (a compressed
/// mean divides before the cast), and `op` combines them. `None` if the path does not apply
/// (a gradient off the CPU or of a type the ring does not take).
pub(super) fn start(
    group: &ProcessGroup,
    grads: &[(Option<Tensor>, usize)],
    ring: DType,
    scale: f64,
    op: ReduceOp,
) -> Result<Option<FlatWork>, CollectiveError> {
    let applies = grads.iter().all(|(g, _)| {
        g.as_ref().is_none_or(|g| {
            g.device().is_cpu()
                && matches!(
                    g.dtype(),
                    DType::F32 | DType::F64 | DType::BF16 | DType::F16
                )
        })
    });
    if !applies {
        return Ok(None);
    }
    Ok(Some(match ring {
        DType::F32 => FlatWork::F32(group.all_reduce_vec_async(fill(grads, scale)?, op)),
        DType::F64 => FlatWork::F64(group.all_reduce_vec_async(fill(grads, scale)?, op)),
        DType::BF16 => FlatWork::Bf16(group.all_reduce_vec_async(fill(grads, scale)?, op)),
        DType::F16 => FlatWork::F16(group.all_reduce_vec_async(fill(grads, scale)?, op)),
        _ => return Ok(None),
    }))
}

/// Waits for the bucket and returns it as one flat tensor of `dtype` (the parameters'),
/// converting only if the ring ran in another type.
pub(super) async fn finish(work: FlatWork, dtype: DType) -> Result<Tensor, CollectiveError> {
    match work {
        FlatWork::F32(w) => to_tensor(w.wait().await?, dtype),
        FlatWork::F64(w) => to_tensor(w.wait().await?, dtype),
        FlatWork::Bf16(w) => to_tensor(w.wait().await?, dtype),
        FlatWork::F16(w) => to_tensor(w.wait().await?, dtype),
    }
}

/// The gradients, scaled, in one buffer of `W`.
fn fill<W: Element>(
    grads: &[(Option<Tensor>, usize)],
    scale: f64,
) -> Result<Vec<W>, CollectiveError> {
    let total = grads.iter().map(|(_, n)| n).sum();
    let mut out = rpc_core::ext::large_vec::<W>(total);
    for (g, n) in grads {
        match g {
            None => out.extend(std::iter::repeat_n(W::from_f64(0.0), *n)),
            Some(g) => append(&mut out, g, scale)?,
        }
    }
    Ok(out)
}

/// Appends `t`'s elements times `scale`, converted to `W`.
fn append<W: Element>(out: &mut Vec<W>, t: &Tensor, scale: f64) -> Result<(), CollectiveError> {
    let t = t.flatten_all()?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(CollectiveError::Candle(candle_core::Error::Msg(
            "a gradient left the CPU on the way to its bucket".into(),
        )));
    };
    let (a, b) = layout
        .contiguous_offsets()
        .expect("contiguous() gives contiguous offsets");
    match cpu {
        CpuStorage::F32(v) if W::DTYPE != DType::F64 => {
            // The common case (f32 gradients, f32 or 16-bit buckets): in f32, which
            // vectorizes, where `f64` would make every 16-bit conversion a slow one.
            let scale = scale as f32;
            if W::DTYPE == DType::F32 && scale == 1.0 {
                push(out, &v[a..b], 1.0);
            } else {
                out.extend(v[a..b].iter().map(|x| W::from_f32(x * scale)));
            }
        }
        CpuStorage::F32(v) => push(out, &v[a..b], scale),
        CpuStorage::F64(v) => push(out, &v[a..b], scale),
        CpuStorage::BF16(v) => push(out, &v[a..b], scale),
        CpuStorage::F16(v) => push(out, &v[a..b], scale),
        _ => {
            return Err(CollectiveError::Candle(candle_core::Error::Msg(format!(
                "a gradient of type {:?} cannot go through the ring",
                t.dtype()
            ))))
        }
    }
    Ok(())
}

/// Appends `src × scale` as `W`: a plain copy when nothing changes, else through `f64` (exact
/// for every source type, so each value is rounded once).
fn push<S: WithDType, W: WithDType>(out: &mut Vec<W>, src: &[S], scale: f64) {
    if S::DTYPE == W::DTYPE && scale == 1.0 {
        // SAFETY: `S` and `W` are the same type (their DTYPEs are equal).
        let same: &[W] = unsafe { std::slice::from_raw_parts(src.as_ptr().cast(), src.len()) };
        out.extend_from_slice(same);
    } else {
        out.extend(src.iter().map(|x| W::from_f64(x.to_f64() * scale)));
    }
}

/// A flat tensor of `dtype` from the ring's buffer (no copy when the types agree).
fn to_tensor<W: WithDType>(v: Vec<W>, dtype: DType) -> Result<Tensor, CollectiveError> {
    let n = v.len();
    let t = Tensor::from_vec(v, n, &candle_core::Device::Cpu)?;
    Ok(if t.dtype() == dtype {
        t
    } else {
        t.to_dtype(dtype)?
    })
}
