//! The element types the fast ring reduces straight from received bytes, and their kernels:
//! `f32`, `f64`, and the 16-bit `bf16` and `f16` (summed in 16 bits at every hop, as the
//! compressed buckets of data parallelism are).

use super::ReduceOp;

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// Element types the ring reduces directly (`f32`, `f64`, `bf16`, `f16`).
pub trait Element:
    sealed::Sealed
    + candle_core::WithDType
    + Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::Mul<Output = Self>
{
    /// `self / n`.
    fn div_by(self, n: usize) -> Self;

    /// Reads a little-endian element.
    fn from_le(b: &[u8]) -> Self;

    /// An `f32`, rounded to this type.
    fn from_f32(x: f32) -> Self;

    /// Combines two elements under `op` (`Mean` sums; the division comes at the end).
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => a + b,
            ReduceOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
            ReduceOp::Min => {
                if b < a {
                    b
                } else {
                    a
                }
            }
            ReduceOp::Product => a * b,
        }
    }

    /// `dst[i] = combine(dst[i], src[i])`, reading `src` as little-endian elements.
    fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
        // SAFETY: reinterpreting initialized bytes as f32/f64/bf16/f16 is sound for any bit
        // pattern;
        // `align_to` only yields the aligned middle part.
        let (pre, mid, post) = unsafe { src.align_to::<Self>() };
        if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
            // One loop per operation, so the compiler vectorizes it.
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    for (d, s) in dst.iter_mut().zip(mid) {
                        *d += *s;
                    }
                }
                _ => {
                    for (d, s) in dst.iter_mut().zip(mid) {
                        *d = Self::combine(op, *d, *s);
                    }
                }
            }
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(w)) {
                *d = Self::combine(op, *d, Self::from_le(s));
            }
        }
    }

    /// Writes `src` into `dst` as little-endian elements (`dst` is exactly as long).
    fn write_le(src: &[Self], dst: &mut [u8]) {
        // SAFETY: the element types are plain data without padding; on a little-endian target their
        // in-memory bytes are their little-endian encoding.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        };
        if cfg!(target_endian = "little") {
            dst.copy_from_slice(bytes);
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.chunks_exact_mut(w).zip(bytes.chunks_exact(w)) {
                d.copy_from_slice(s);
                d.reverse();
            }
        }
    }

    /// Writes `combine(mine[i], theirs[i])` into `dst` as little-endian elements, reading
    /// `theirs` as little-endian elements (`theirs` and `dst` are as long as `mine`).
    fn fold_le(op: ReduceOp, mine: &[Self], theirs: &[u8], dst: &mut [u8]) {
        // SAFETY: as in `reduce_into`; every bit pattern is a valid element and `align_to_mut`
        // only yields the aligned middle part.
        let (tp, tm, tq) = unsafe { theirs.align_to::<Self>() };
        let (dp, dm, dq) = unsafe { dst.align_to_mut::<Self>() };
        let aligned = tp.is_empty() && tq.is_empty() && dp.is_empty() && dq.is_empty();
        if aligned && cfg!(target_endian = "little") {
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    for ((d, a), b) in dm.iter_mut().zip(mine).zip(tm) {
                        *d = *a + *b;
                    }
                }
                _ => {
                    for ((d, a), b) in dm.iter_mut().zip(mine).zip(tm) {
                        *d = Self::combine(op, *a, *b);
                    }
                }
            }
        } else {
            let w = std::mem::size_of::<Self>();
            let folded: Vec<Self> = mine
                .iter()
                .zip(theirs.chunks_exact(w))
                .map(|(a, b)| Self::combine(op, *a, Self::from_le(b)))
                .collect();
            Self::write_le(&folded, dst);
        }
    }

    /// `buf[i] = combine(buf[i], theirs[i])` (or `theirs[i]` when `op` is `None`), also
    /// written into `dst` as little-endian elements, in one pass (`theirs` and `dst` are as
    /// long as `buf`).
    fn fold_tee(op: Option<ReduceOp>, buf: &mut [Self], theirs: &[u8], dst: &mut [u8]) {
        // SAFETY: as in `fold_le`.
        let (tp, tm, tq) = unsafe { theirs.align_to::<Self>() };
        let (dp, dm, dq) = unsafe { dst.align_to_mut::<Self>() };
        let aligned = tp.is_empty() && tq.is_empty() && dp.is_empty() && dq.is_empty();
        if aligned && cfg!(target_endian = "little") {
            match op {
                None => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a = *b;
                        *d = *b;
                    }
                }
                Some(ReduceOp::Sum | ReduceOp::Mean) => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a += *b;
                        *d = *a;
                    }
                }
                Some(op) => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a = Self::combine(op, *a, *b);
                        *d = *a;
                    }
                }
            }
        } else {
            match op {
                None => Self::copy_into(buf, theirs),
                Some(op) => Self::reduce_into(op, buf, theirs),
            }
            Self::write_le(buf, dst);
        }
    }

    /// Overwrites `dst` with the little-endian elements in `src`.
    fn copy_into(dst: &mut [Self], src: &[u8]) {
        // SAFETY: as in `reduce_into`.
        let (pre, mid, post) = unsafe { src.align_to::<Self>() };
        if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
            let n = dst.len().min(mid.len());
            dst[..n].copy_from_slice(&mid[..n]);
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(w)) {
                *d = Self::from_le(s);
            }
        }
    }
}

impl Element for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }

    fn div_by(self, n: usize) -> Self {
        self / n as f32
    }

    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
}

impl Element for f64 {
    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }

    fn div_by(self, n: usize) -> Self {
        self / n as f64
    }

    fn from_le(b: &[u8]) -> Self {
        f64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
}

impl Element for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }

    fn div_by(self, n: usize) -> Self {
        bf16::from_f32(self.to_f32() / n as f32)
    }

    fn from_le(b: &[u8]) -> Self {
        bf16::from_le_bytes(b.try_into().expect("2 bytes"))
    }
}

impl Element for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }

    fn div_by(self, n: usize) -> Self {
        f16::from_f32(self.to_f32() / n as f32)
    }

    fn from_le(b: &[u8]) -> Self {
        f16::from_le_bytes(b.try_into().expect("2 bytes"))
    }
}
