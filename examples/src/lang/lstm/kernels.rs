//! The LSTM's arithmetic: the matrix product (gemm), the per-step gate passes (compiled for
//! baseline x86-64 and for AVX2, chosen at run time), and an exponential that vectorizes.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, Layout};

/// `exp(x)` to about 2e-7 relative error, in plain arithmetic the compiler vectorizes (libm's
/// `expf` is a call per element). The power of two is built from the bits of the rounded
/// exponent: a float-to-integer `as` saturates element by element and would keep the loops
/// that call this from vectorizing.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let rounded = x * LOG2E + ROUND;
    let n = rounded - ROUND;
    // `rounded` is 1.5 * 2^23 + n with n an integer in [-126, 127]: n is in its low bits.
    let ni = (rounded.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((ni + 127) as u32) << 23)
}

#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
pub(super) fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (1.0 + exp(2.0 * x))
}

/// A matrix operand: element (r, c) at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// `dst[m × n] (row stride dst_rs) = (dst if acc) + a[m × k] · b[k × n]`, one thread.
pub(super) fn matmul(
    [m, n, k]: [usize; 3],
    dst: &mut [f32],
    dst_rs: usize,
    acc: bool,
    a: Mat,
    b: Mat,
) {
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(m > 0 && n > 0 && k > 0, "empty product");
    assert!(
        last(m, n, dst_rs, 1) < dst.len(),
        "product destination out of bounds"
    );
    assert!(
        last(m, k, a.rs, a.cs) < a.data.len(),
        "left operand out of bounds"
    );
    assert!(
        last(k, n, b.rs, b.cs) < b.data.len(),
        "right operand out of bounds"
    );
    // SAFETY: the asserts above keep every element gemm reads or writes inside the slices;
    // `dst` is borrowed mutably, so it cannot alias the operands.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            acc,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

pub(super) fn f32_slice<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("lstm: {what} is not contiguous")))?;
    Ok(&s.as_slice::<f32>()?[a..b])
}

/// Defines `fn $name(..) $body` twice: as `$name`, compiled for the baseline x86-64 (SSE2, 4
/// lanes), and as `$avx2`, compiled for AVX2 (8 lanes); `$name` runs `$avx2` where the CPU has
/// AVX2. Neither fuses a multiply and an add (Rust never contracts them), so both give the
/// same bits.
macro_rules! with_avx2 {
    ($(#[$m:meta])* fn $name:ident / $avx2:ident ($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        pub(super) fn $name($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { $avx2($($a),*) };
            }
            $body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx2($($a: $t),*) $body
    };
}

with_avx2! {
    /// One time step's gates, row by row: from the pre-activations `pre` `[B, 4H]` (input
    /// projection and recurrent product), the bias and the previous cell state `[B, H]`, the
    /// activated gates `g` `[4, B, H]` and the new hidden and cell states `[B, H]`.
    fn forward_gates / forward_gates_avx2(
        h: usize,
        pre: &[f32],
        bias: &[f32],
        c_prev: &[f32],
        g: &mut [MaybeUninit<f32>],
        h_out: &mut [MaybeUninit<f32>],
        c_out: &mut [MaybeUninit<f32>],
    ) {
        let bh = c_prev.len();
        assert!(g.len() == 4 * bh && h_out.len() == bh && c_out.len() == bh && bh % h == 0);
        let (gi, g) = g.split_at_mut(bh);
        let (gf, g) = g.split_at_mut(bh);
        let (gg, go) = g.split_at_mut(bh);
        let (bi, bf, bg, bo) = (
            &bias[..h],
            &bias[h..2 * h],
            &bias[2 * h..3 * h],
            &bias[3 * h..4 * h],
        );
        for r in 0..bh / h {
            let row = r * h..(r + 1) * h;
            let p = &pre[r * 4 * h..(r + 1) * 4 * h];
            let (pi, pf, pg, po) = (&p[..h], &p[h..2 * h], &p[2 * h..3 * h], &p[3 * h..]);
            let (ai, af) = (&mut gi[row.clone()], &mut gf[row.clone()]);
            let (ag, ao) = (&mut gg[row.clone()], &mut go[row.clone()]);
            let cp = &c_prev[row.clone()];
            let (ho, co) = (&mut h_out[row.clone()], &mut c_out[row]);
            for j in 0..h {
                let (i, f) = (sigmoid(pi[j] + bi[j]), sigmoid(pf[j] + bf[j]));
                let (g, o) = (tanh(pg[j] + bg[j]), sigmoid(po[j] + bo[j]));
                let c = f * cp[j] + i * g;
                ai[j].write(i);
                af[j].write(f);
                ag[j].write(g);
                ao[j].write(o);
                co[j].write(c);
                ho[j].write(o * tanh(c));
            }
        }
    }
}

with_avx2! {
    /// One time step back, row by row: from the step's activated gates `g` `[4, B, H]`, its
    /// hidden and cell states and the previous cell state, the gradients arriving at its
    /// outputs and from the next step (`dc_next` is replaced by the gradient of the previous
    /// cell state), the gradient of the pre-activations `dpre` `[B, 4H]`, summed into the
    /// bias's `d_b`.
    fn backward_gates / backward_gates_avx2(
        h: usize,
        g: &[f32],
        states: [&[f32]; 3],
        grads: [&[f32]; 3],
        dc_next: &mut [f32],
        dpre: &mut [MaybeUninit<f32>],
        d_b: &mut [f32],
    ) {
        let ([h_cur, c_cur, c_prev], [dh_out, dc_out, dh_next]) = (states, grads);
        assert!(dpre.len() == 4 * c_cur.len() && d_b.len() == 4 * h);
        let bh = c_cur.len();
        let (gi, g) = g.split_at(bh);
        let (gf, g) = g.split_at(bh);
        let (gg, go) = g.split_at(bh);
        for r in 0..bh / h {
            let row = r * h..(r + 1) * h;
            let (i, f, gv, o) = (
                &gi[row.clone()],
                &gf[row.clone()],
                &gg[row.clone()],
                &go[row.clone()],
            );
            let (c, cp) = (&c_cur[row.clone()], &c_prev[row.clone()]);
            let (hv, dho, dco) = (
                &h_cur[row.clone()],
                &dh_out[row.clone()],
                &dc_out[row.clone()],
            );
            let dhn = &dh_next[row.clone()];
            let dcn = &mut dc_next[row];
            let dp = &mut dpre[r * 4 * h..(r + 1) * 4 * h];
            let (di, dp) = dp.split_at_mut(h);
            let (df, dp) = dp.split_at_mut(h);
            let (dg, d_o) = dp.split_at_mut(h);
            for j in 0..h {
                // tanh(c) = h / o, except where o underflows.
                let tc = if o[j] > 1e-6 {
                    hv[j] / o[j]
                } else {
                    tanh(c[j])
                };
                let dh = dho[j] + dhn[j];
                let dc = dco[j] + dcn[j] + dh * o[j] * (1.0 - tc * tc);
                di[j].write(dc * gv[j] * i[j] * (1.0 - i[j]));
                df[j].write(dc * cp[j] * f[j] * (1.0 - f[j]));
                dg[j].write(dc * i[j] * (1.0 - gv[j] * gv[j]));
                d_o[j].write(dh * tc * o[j] * (1.0 - o[j]));
                dcn[j] = dc * f[j];
            }
            // SAFETY: the loop above wrote all 4H elements of the row (i, f, g and o parts).
            let dp = unsafe { assume_init(&dpre[r * 4 * h..(r + 1) * 4 * h]) };
            for (db, dpj) in d_b.iter_mut().zip(dp) {
                *db += dpj;
            }
        }
    }
}

/// The elements of `s`, all of them written.
///
/// # Safety
/// Every element of `s` must have been initialized.
pub(super) unsafe fn assume_init(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: MaybeUninit<f32> has f32's layout, and the caller vouches for every element.
    unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) }
}
