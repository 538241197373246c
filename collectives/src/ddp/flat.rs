//! A bucket's fast path: when its hook is the ring all-reduce in some element type (the
//! built-in hooks are), the gradients are copied straight into one flat buffer of that type
//! (converting as they are copied), reduced in place in the background, and read back as
//! views of one tensor. Against the tensor path (concatenate the gradients, then the ring
//! copies them out of the tensor; a cast to 16 bits and back for compression) that is one
//! pass over the bucket's bytes instead of three to five.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, DType, Storage, Tensor, WithDType};
use half::{bf16, f16};
use rpc_core::trace::{Cat, Tracer};

use crate::group::{per_lane, run_lanes, CollectiveError, Element, ProcessGroup, ReduceOp, Work};

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
///
/// The operation takes its place in the group's order at once; the copy into the flat buffer
/// runs on a blocking thread, split over the group's ring threads
/// ([`ProcessGroup::all_reduce_fill_async`]), so an overlapped pass goes on with the next
/// segment's backward while a bucket is being filled.
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
    let grads = grads.to_vec();
    Ok(Some(match ring {
        DType::F32 => {
            FlatWork::F32(group.all_reduce_fill_async(move |lanes| fill(&grads, scale, lanes), op))
        }
        DType::F64 => {
            FlatWork::F64(group.all_reduce_fill_async(move |lanes| fill(&grads, scale, lanes), op))
        }
        DType::BF16 => {
            FlatWork::Bf16(group.all_reduce_fill_async(move |lanes| fill(&grads, scale, lanes), op))
        }
        DType::F16 => {
            FlatWork::F16(group.all_reduce_fill_async(move |lanes| fill(&grads, scale, lanes), op))
        }
        _ => return Ok(None),
    }))
}

/// Waits for the bucket and returns it as one flat tensor of `dtype` (the parameters'),
/// converting only if the ring ran in another type, and, for a ring in f16, whether some
/// element of the sum is not finite (DDP-8; `false` for the other types, which are not
/// checked). A conversion is an `unpack bucket` span in `tracer`'s trace: the step's own
/// work, which a report would otherwise count as the program's.
pub(super) async fn finish(
    work: FlatWork,
    dtype: DType,
    tracer: &Tracer,
) -> Result<(Tensor, bool), CollectiveError> {
    match work {
        FlatWork::F32(w) => unpack(w, dtype, tracer, false).await,
        FlatWork::F64(w) => unpack(w, dtype, tracer, false).await,
        FlatWork::Bf16(w) => unpack(w, dtype, tracer, false).await,
        FlatWork::F16(w) => unpack(w, dtype, tracer, true).await,
    }
}

/// [`finish`] for a ring in `W`; `check`: whether to scan the sum for elements not finite.
async fn unpack<W: WithDType>(
    work: Work<Vec<W>>,
    dtype: DType,
    tracer: &Tracer,
    check: bool,
) -> Result<(Tensor, bool), CollectiveError> {
    let v = work.wait().await?;
    let _span = (W::DTYPE != dtype).then(|| tracer.span(Cat::Compute, "unpack bucket"));
    let not_finite = check && v.iter().any(|x| !x.to_f64().is_finite());
    Ok((to_tensor(v, dtype)?, not_finite))
}

/// One gradient's elements in its own type, or zeros for a parameter without one.
#[derive(Clone, Copy)]
enum Src<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    Zeros(usize),
}

impl<'a> Src<'a> {
    fn len(self) -> usize {
        match self {
            Src::F32(v) => v.len(),
            Src::F64(v) => v.len(),
            Src::Bf16(v) => v.len(),
            Src::F16(v) => v.len(),
            Src::Zeros(n) => n,
        }
    }

    /// Elements `a..b`.
    fn slice(self, a: usize, b: usize) -> Src<'a> {
        match self {
            Src::F32(v) => Src::F32(&v[a..b]),
            Src::F64(v) => Src::F64(&v[a..b]),
            Src::Bf16(v) => Src::Bf16(&v[a..b]),
            Src::F16(v) => Src::F16(&v[a..b]),
            Src::Zeros(_) => Src::Zeros(b - a),
        }
    }
}

/// The gradients, scaled, in one buffer of `W`, copied on up to `lanes` threads. Each element
/// is converted on its own, so the buffer does not depend on `lanes`, bit for bit.
fn fill<W: Element>(
    grads: &[(Option<Tensor>, usize)],
    scale: f64,
    lanes: usize,
) -> Result<Vec<W>, CollectiveError> {
    let flat: Vec<Option<Tensor>> = grads
        .iter()
        .map(|(g, _)| {
            g.as_ref()
                .map(|g| g.flatten_all()?.contiguous())
                .transpose()
        })
        .collect::<candle_core::Result<_>>()?;
    let held: Vec<_> = flat
        .iter()
        .map(|t| t.as_ref().map(|t| t.storage_and_layout()))
        .collect();
    let mut srcs = Vec::with_capacity(grads.len());
    for ((h, t), (_, n)) in held.iter().zip(&flat).zip(grads) {
        let Some((storage, layout)) = h else {
            srcs.push(Src::Zeros(*n));
            continue;
        };
        let (a, b) = layout
            .contiguous_offsets()
            .expect("contiguous() gives contiguous offsets");
        srcs.push(match &**storage {
            Storage::Cpu(CpuStorage::F32(v)) => Src::F32(&v[a..b]),
            Storage::Cpu(CpuStorage::F64(v)) => Src::F64(&v[a..b]),
            Storage::Cpu(CpuStorage::BF16(v)) => Src::Bf16(&v[a..b]),
            Storage::Cpu(CpuStorage::F16(v)) => Src::F16(&v[a..b]),
            Storage::Cpu(_) => {
                return Err(CollectiveError::Candle(candle_core::Error::Msg(format!(
                    "a gradient of type {:?} cannot go through the ring",
                    t.as_ref().map(Tensor::dtype)
                ))))
            }
            _ => {
                return Err(CollectiveError::Candle(candle_core::Error::Msg(
                    "a gradient left the CPU on the way to its bucket".into(),
                )))
            }
        });
    }
    let total: usize = srcs.iter().map(|s| s.len()).sum();
    let mut out = rpc_core::ext::large_vec::<W>(total);
    let per = per_lane(total, std::mem::size_of::<W>(), lanes);
    // Parts of `per` elements of the buffer (the last shorter), each with the pieces of the
    // gradients that land in it.
    let mut parts: Vec<(Vec<Src<'_>>, &mut [MaybeUninit<W>])> = Vec::new();
    let mut rest = &mut out.spare_capacity_mut()[..total];
    let mut pieces = Vec::new();
    let mut part = per.min(total);
    let mut room = part;
    for src in srcs {
        let mut at = 0;
        while at < src.len() {
            let take = (src.len() - at).min(room);
            pieces.push(src.slice(at, at + take));
            at += take;
            room -= take;
            if room == 0 {
                let (dst, r) = std::mem::take(&mut rest).split_at_mut(part);
                parts.push((std::mem::take(&mut pieces), dst));
                rest = r;
                part = per.min(rest.len());
                room = part;
            }
        }
    }
    assert!(
        pieces.is_empty() && rest.is_empty(),
        "the parts cover the buffer"
    );
    run_lanes(parts.into_iter(), |(pieces, dst)| {
        write(&pieces, dst, scale)
    });
    // SAFETY: the parts cover the first `total` elements of the buffer, each written once by
    // `write` (it writes every element of its part; a panic there never reaches this line).
    unsafe { out.set_len(total) };
    Ok(out)
}

/// Writes `pieces`, one after another, into `dst` (as long as they are together), times
/// `scale`, converted to `W`.
fn write<W: Element>(pieces: &[Src<'_>], dst: &mut [MaybeUninit<W>], scale: f64) {
    let mut at = 0;
    for &src in pieces {
        let d = &mut dst[at..at + src.len()];
        at += src.len();
        match src {
            Src::Zeros(_) => d.fill(MaybeUninit::new(W::from_f64(0.0))),
            // The common case (f32 gradients, f32 or 16-bit buckets): in f32, which
            // vectorizes, where `f64` would make every 16-bit conversion a slow one.
            Src::F32(v) if W::DTYPE != DType::F64 && (W::DTYPE != DType::F32 || scale != 1.0) => {
                let scale = scale as f32;
                for (o, x) in d.iter_mut().zip(v) {
                    o.write(W::from_f32(x * scale));
                }
            }
            Src::F32(v) => push(v, d, scale),
            Src::F64(v) => push(v, d, scale),
            Src::Bf16(v) => push(v, d, scale),
            Src::F16(v) => push(v, d, scale),
        }
    }
    assert_eq!(at, dst.len(), "a bucket's part written in full");
}

/// Writes `src × scale` as `W`: a plain copy when nothing changes, else through `f64` (exact
/// for every source type, so each value is rounded once).
fn push<S: WithDType, W: WithDType>(src: &[S], dst: &mut [MaybeUninit<W>], scale: f64) {
    if S::DTYPE == W::DTYPE && scale == 1.0 {
        // SAFETY: `S` and `W` are the same type (their DTYPEs are equal), `MaybeUninit<W>` has
        // `W`'s layout, and `dst` (a part of a buffer of its own) does not overlap `src`; the
        // caller made them the same length.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr().cast::<W>(),
                dst.as_mut_ptr().cast(),
                src.len(),
            )
        };
    } else {
        for (o, x) in dst.iter_mut().zip(src) {
            o.write(W::from_f64(x.to_f64() * scale));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Gradients of every kind a bucket takes: f32 (large, several lanes' worth), f64, bf16,
    /// f16, a strided one and a parameter without a gradient.
    fn grads() -> Vec<(Option<Tensor>, usize)> {
        let cpu = &Device::Cpu;
        let f = |n: usize, k: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7 + 3) % 1001) as f32 * k - 1.3)
                .collect()
        };
        let big = Tensor::from_vec(f(700_001, 0.0137), 700_001, cpu).unwrap();
        let wide = Tensor::from_vec(f(300 * 1001, 0.31), (300, 1001), cpu).unwrap();
        let strided = wide.t().unwrap(); // not contiguous
        let t64 = Tensor::from_vec(f(5_000, 0.7), 5_000, cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let b16 = Tensor::from_vec(f(400_003, 0.01), 400_003, cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let h16 = Tensor::from_vec(f(17, 0.5), 17, cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        vec![
            (Some(big), 700_001),
            (None, 123_457),
            (Some(strided), 300 * 1001),
            (Some(t64), 5_000),
            (Some(b16), 400_003),
            (Some(h16), 17),
        ]
    }

    /// Element by element, as the single-threaded copy did before lanes.
    fn reference<W: Element>(grads: &[(Option<Tensor>, usize)], scale: f64) -> Vec<W> {
        let mut out = Vec::new();
        for (g, n) in grads {
            let Some(g) = g else {
                out.extend(std::iter::repeat_n(W::from_f64(0.0), *n));
                continue;
            };
            let g = g.flatten_all().unwrap();
            if g.dtype() == DType::F32 && W::DTYPE != DType::F64 {
                let s = scale as f32;
                let v = g.to_vec1::<f32>().unwrap();
                out.extend(v.iter().map(|x| W::from_f32(x * s)));
            } else {
                let v = g.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
                out.extend(v.iter().map(|x| W::from_f64(x * scale)));
            }
        }
        out
    }

    fn same_bits<W: Element>(a: &[W], b: &[W]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits())
    }

    /// The buffer is the same, bit for bit, on one lane and on several, in every ring type,
    /// with and without a scale.
    #[test]
    fn a_bucket_filled_on_several_lanes_is_the_one_thread_s_bit_for_bit() {
        let g = grads();
        for scale in [1.0, 1.0 / 3.0] {
            for lanes in [1, 3, 16] {
                assert!(same_bits(
                    &fill::<f32>(&g, scale, lanes).unwrap(),
                    &reference::<f32>(&g, scale)
                ));
                assert!(same_bits(
                    &fill::<f64>(&g, scale, lanes).unwrap(),
                    &reference::<f64>(&g, scale)
                ));
                assert!(same_bits(
                    &fill::<bf16>(&g, scale, lanes).unwrap(),
                    &reference::<bf16>(&g, scale)
                ));
                assert!(same_bits(
                    &fill::<f16>(&g, scale, lanes).unwrap(),
                    &reference::<f16>(&g, scale)
                ));
            }
        }
        let empty: Vec<(Option<Tensor>, usize)> = vec![(None, 0)];
        assert!(fill::<f32>(&empty, 1.0, 4).unwrap().is_empty());
    }
}
