//! The LSTM recurrence as one operation with a hand-written backward (as cuDNN does).
//!
//! Written with candle's operations, each time step is a dozen element-wise operations forward
//! and about thirty backward, each a fresh allocation; and every per-step slice of the input
//! projection makes its backward materialize a zero tensor of the whole sequence. At this
//! model's size those costs dominate a training step. [`lstm`] runs the whole sequence in one
//! operation: per step one matrix product and one fused pass over the gates; its backward is
//! one pass back through time with one product per step, and the recurrent weight's gradient
//! accumulated in place, as is the bias's.
//!
//! The gate passes are compiled twice, for baseline x86-64 and for AVX2, and chosen at run
//! time; the exponential builds its power of two from bits so that they vectorize.
//!
//! Output layout `[T, 2, B, H]`: per step the hidden state `h` and the cell state `c`. Gates
//! are in PyTorch's order (input, forget, cell, output); the operation keeps their activations
//! for its backward instead of recomputing them.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

/// `exp(x)` to about 2e-7 relative error, in plain arithmetic the compiler vectorizes (libm's
/// `expf` is a call per element). The power of two is built from the bits of the rounded
/// exponent: a float-to-integer `as` saturates element by element and would keep the loops
/// that call this from vectorizing.
#[inline(always)]
fn exp(x: f32) -> f32 {
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
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (1.0 + exp(2.0 * x))
}

/// A matrix operand: element (r, c) at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// `dst[m × n] (row stride dst_rs) = (dst if acc) + a[m × k] · b[k × n]`, one thread.
fn matmul([m, n, k]: [usize; 3], dst: &mut [f32], dst_rs: usize, acc: bool, a: Mat, b: Mat) {
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

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("lstm: {what} is not contiguous")))?;
    Ok(&s.as_slice::<f32>()?[a..b])
}

/// Input projections `[T, B, 4H]`, recurrent weight `[4H, H]` and bias `[4H]` to the states
/// `[T, 2, B, H]`, from a zero initial state; or, given each row's last step, to the hidden
/// state of each row at its last step, `[B, H]`. Keeps the activated gates (and then the
/// states) for its backward.
#[derive(Default)]
struct LstmSeq {
    /// `[T, 4, B, H]`: input, forget, cell and output gates after their activations.
    gates: Mutex<Option<Arc<Vec<f32>>>>,
    /// Each row's last step: the output is the hidden state there.
    last: Option<Arc<Vec<u32>>>,
    /// `[T, 2, B, H]`, kept when the output is `[B, H]`.
    states: Mutex<Option<Arc<Vec<f32>>>>,
}

impl CustomOp3 for LstmSeq {
    fn name(&self) -> &'static str {
        "lstm-sequence"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (t, b, h4) = l1.shape().dims3()?;
        let h = h4 / 4;
        if l2.shape().dims2()? != (h4, h) || l3.shape().dims1()? != h4 || h4 % 4 != 0 {
            candle_core::bail!(
                "lstm: weight {:?} and bias {:?} do not fit gates of width {h4}",
                l2.shape(),
                l3.shape()
            );
        }
        let xp = f32_slice(s1, l1, "the input projection")?;
        let w = f32_slice(s2, l2, "the recurrent weight")?;
        let bias = &f32_slice(s3, l3, "the bias")?[..h4];
        let bh = b * h;
        // The states and gates grow by one step at a time, each written once: their lengths
        // cover what is written (nothing is zeroed first: that was 5 MB of memset a step).
        let mut out: Vec<f32> = Vec::with_capacity(t * 2 * bh);
        let mut gates: Vec<f32> = Vec::with_capacity(t * 4 * bh);
        let zeros = vec![0f32; bh];
        // The previous cell state, copied out of `out` (which the step writes).
        let mut c_prev = vec![0f32; bh];
        let mut pre = vec![0f32; b * h4];
        for step in 0..t {
            pre.copy_from_slice(&xp[step * b * h4..(step + 1) * b * h4]);
            let h_prev = if step > 0 {
                let (hp, cp) = out[(step - 1) * 2 * bh..].split_at(bh);
                c_prev.copy_from_slice(cp);
                hp
            } else {
                &zeros[..]
            };
            if step > 0 {
                // pre += h_{t-1} · W_hhᵀ
                let hp = Mat {
                    data: h_prev,
                    rs: h,
                    cs: 1,
                };
                matmul(
                    [b, h4, h],
                    &mut pre,
                    h4,
                    true,
                    hp,
                    Mat {
                        data: w,
                        rs: 1,
                        cs: h,
                    },
                );
            }
            let (h_out, c_out) = out.spare_capacity_mut()[..2 * bh].split_at_mut(bh);
            let g = &mut gates.spare_capacity_mut()[..4 * bh];
            forward_gates(h, &pre, bias, &c_prev, g, h_out, c_out);
            // SAFETY: `forward_gates` wrote every element of the step's states and gates
            // (each output slice is written at every index, row by row), and the capacity
            // holds them.
            unsafe {
                out.set_len(out.len() + 2 * bh);
                gates.set_len(gates.len() + 4 * bh);
            }
        }
        *self.gates.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(gates));
        let Some(last) = &self.last else {
            return Ok((CpuStorage::F32(out), Shape::from((t, 2, b, h))));
        };
        if last.len() != b || last.iter().any(|&s| s as usize >= t) {
            candle_core::bail!("lstm: {} last steps for {b} rows of {t} steps", last.len());
        }
        let mut y = Vec::with_capacity(bh);
        for (r, &s) in last.iter().enumerate() {
            let at = s as usize * 2 * bh + r * h;
            y.extend_from_slice(&out[at..at + h]);
        }
        *self.states.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(out));
        Ok((CpuStorage::F32(y), Shape::from((b, h))))
    }

    fn bwd(
        &self,
        xp: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gates = self
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("lstm: backward before forward".into()))?;
        let states = match &self.last {
            Some(last) => {
                let states = self
                    .states
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .ok_or_else(|| {
                        candle_core::Error::Msg("lstm: backward before forward".into())
                    })?;
                Some(LastSteps {
                    states,
                    last: Arc::clone(last),
                })
            }
            None => None,
        };
        let back = LstmSeqBackward { gates, states };
        let flat = res.apply_op3_no_bwd(&w.contiguous()?, &grad.contiguous()?, &back)?;
        let (n, nw) = (xp.elem_count(), w.elem_count());
        let d_xp = flat.narrow(0, 0, n)?.reshape(xp.shape())?;
        let d_w = flat.narrow(0, n, nw)?.reshape(w.shape())?;
        let d_b = flat.narrow(0, n + nw, bias.elem_count())?;
        Ok((Some(d_xp), Some(d_w), Some(d_b)))
    }
}

/// The forward's states `[T, 2, B, H]` and each row's last step (the output's rows).
struct LastSteps {
    states: Arc<Vec<f32>>,
    last: Arc<Vec<u32>>,
}

/// Back through time: from the forward's states, the recurrent weight and the states'
/// gradient, the gradients of the input projections, the weight and the bias, flattened one
/// after the other (`[T*B*4H + 4H*H + 4H]`). With `states` (the forward's `[T, 2, B, H]` and
/// each row's last step), the gradient is that of the `[B, H]` hidden states at the last
/// steps, fed in at those steps, and the first input is not read.
struct LstmSeqBackward {
    gates: Arc<Vec<f32>>,
    states: Option<LastSteps>,
}

impl CustomOp3 for LstmSeqBackward {
    fn name(&self) -> &'static str {
        "lstm-sequence-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (t, b, h, out, last) = match &self.states {
            Some(LastSteps { states, last }) => {
                let (b, h) = l3.shape().dims2()?;
                let t = states.len() / (2 * b * h).max(1);
                if states.len() != t * 2 * b * h || last.len() != b {
                    candle_core::bail!("lstm backward: unexpected shape {:?}", l3.shape());
                }
                (t, b, h, &states[..], Some(&last[..]))
            }
            None => {
                let (t, two, b, h) = l1.shape().dims4()?;
                if two != 2 || l3.shape() != l1.shape() {
                    candle_core::bail!(
                        "lstm backward: unexpected shapes {:?} {:?}",
                        l1.shape(),
                        l3.shape()
                    );
                }
                (t, b, h, f32_slice(s1, l1, "the forward output")?, None)
            }
        };
        if self.gates.len() != t * 4 * b * h {
            candle_core::bail!("lstm backward: the gates are not of this sequence");
        }
        let w = f32_slice(s2, l2, "the recurrent weight")?;
        let grad = f32_slice(s3, l3, "the output gradient")?;
        let (bh, h4) = (b * h, 4 * h);
        // The input projections' gradient is written once per element, step by step from the
        // last (not zeroed first: 3 MB of memset a step); the weight's and bias's are sums.
        let total = t * b * h4 + h4 * h + h4;
        let mut result: Vec<f32> = Vec::with_capacity(total);
        let (d_xp, d_wb) = result.spare_capacity_mut()[..total].split_at_mut(t * b * h4);
        for x in d_wb.iter_mut() {
            x.write(0.0);
        }
        // SAFETY: every element was just written.
        let d_wb = unsafe { &mut *(d_wb as *mut [MaybeUninit<f32>] as *mut [f32]) };
        let (d_w, d_b) = d_wb.split_at_mut(h4 * h);
        let zeros = vec![0f32; bh];
        let mut dh_next = vec![0f32; bh];
        let mut dc_next = vec![0f32; bh];
        for step in (0..t).rev() {
            let (h_cur, c_cur) = out[step * 2 * bh..(step + 1) * 2 * bh].split_at(bh);
            let (dh_out, dc_out) = match last {
                None => grad[step * 2 * bh..(step + 1) * 2 * bh].split_at(bh),
                Some(last) => {
                    // The rows that end here get their gradient (later steps gave them none).
                    for (r, _) in last.iter().enumerate().filter(|(_, &s)| s as usize == step) {
                        let row = r * h..(r + 1) * h;
                        for (d, g) in dh_next[row.clone()].iter_mut().zip(&grad[row]) {
                            *d += g;
                        }
                    }
                    (&zeros[..], &zeros[..])
                }
            };
            let c_prev = if step > 0 {
                &out[(step - 1) * 2 * bh + bh..step * 2 * bh]
            } else {
                &zeros[..]
            };
            let g = &self.gates[step * 4 * bh..(step + 1) * 4 * bh];
            let dpre = &mut d_xp[step * b * h4..(step + 1) * b * h4];
            backward_gates(
                h,
                g,
                [h_cur, c_cur, c_prev],
                [dh_out, dc_out, &dh_next],
                &mut dc_next,
                dpre,
                d_b,
            );
            if step > 0 {
                // SAFETY: `backward_gates` wrote every element of the step's slice.
                let done = unsafe { assume_init(&d_xp[step * b * h4..(step + 1) * b * h4]) };
                let dpre = Mat {
                    data: done,
                    rs: h4,
                    cs: 1,
                };
                // dh_{t-1} = dpre · W_hh
                matmul(
                    [b, h, h4],
                    &mut dh_next,
                    h,
                    false,
                    dpre,
                    Mat {
                        data: w,
                        rs: h,
                        cs: 1,
                    },
                );
                // dW_hh += dpreᵀ · h_{t-1}
                let h_prev = Mat {
                    data: &out[(step - 1) * 2 * bh..(step - 1) * 2 * bh + bh],
                    rs: h,
                    cs: 1,
                };
                matmul(
                    [h4, h, b],
                    d_w,
                    h,
                    true,
                    Mat {
                        rs: 1,
                        cs: h4,
                        ..dpre
                    },
                    h_prev,
                );
            }
        }
        // SAFETY: the tail was zeroed above, and each of the `t` steps wrote its slice of the
        // input projections' gradient (`backward_gates` writes all of `dpre`).
        unsafe { result.set_len(total) };
        Ok((CpuStorage::F32(result), Shape::from(total)))
    }
}

/// Defines `fn $name(..) $body` twice: as `$name`, compiled for the baseline x86-64 (SSE2, 4
/// lanes), and as `$avx2`, compiled for AVX2 (8 lanes); `$name` runs `$avx2` where the CPU has
/// AVX2. Neither fuses a multiply and an add (Rust never contracts them), so both give the
/// same bits.
macro_rules! with_avx2 {
    ($(#[$m:meta])* fn $name:ident / $avx2:ident ($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        fn $name($($a: $t),*) {
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
unsafe fn assume_init(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: MaybeUninit<f32> has f32's layout, and the caller vouches for every element.
    unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) }
}

/// Runs the LSTM over input projections `xp` `[T, B, 4H]` (without bias) with recurrent
/// weight `w_hh` `[4H, H]` and bias `b` `[4H]` from a zero state; returns the hidden and cell
/// states of every step, `[T, 2, B, H]`.
/// (Tests: the model reads only the last steps, [`lstm_last`]; the whole sequence is what the
/// textbook formulas are checked against.)
#[cfg(test)]
pub fn lstm(xp: &Tensor, w_hh: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    xp.contiguous()?
        .apply_op3(&w_hh.contiguous()?, &b.contiguous()?, LstmSeq::default())
}

/// Like [`lstm`], but returns only the hidden state of each row `r` at its step `last[r]`,
/// `[B, H]` (an encoding read at each word's last character). Its backward feeds the gradient
/// in at those steps: no `[T, 2, B, H]` gradient is made, zeroed and summed into.
pub fn lstm_last(
    xp: &Tensor,
    w_hh: &Tensor,
    b: &Tensor,
    last: Arc<Vec<u32>>,
) -> candle_core::Result<Tensor> {
    let op = LstmSeq {
        last: Some(last),
        ..LstmSeq::default()
    };
    xp.contiguous()?
        .apply_op3(&w_hh.contiguous()?, &b.contiguous()?, op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fast_exp_is_close_to_libm() {
        for i in -2000..2000 {
            let x = i as f32 * 0.04;
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 5e-7, "exp({x}) = {a}, libm {b}");
        }
    }

    /// The fused sequence against the textbook formulas in candle's own operations: outputs
    /// and the gradients of both inputs.
    #[test]
    fn lstm_matches_the_unfused_formulas() {
        let dev = Device::Cpu;
        let (t, b, h) = (4, 3, 5);
        let xp = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, b, 4 * h), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (4 * h, h), &dev).unwrap()).unwrap();
        let bias = Var::from_tensor(&Tensor::randn(0f32, 0.5, 4 * h, &dev).unwrap()).unwrap();
        let weights = Tensor::randn(0f32, 1.0, (t, b, h), &dev).unwrap();
        let cweights = Tensor::randn(0f32, 1.0, (b, h), &dev).unwrap();

        let fused = lstm(xp.as_tensor(), w.as_tensor(), bias.as_tensor()).unwrap();
        let f_h = fused.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
        let f_c = fused.get(t - 1).unwrap().get(1).unwrap();

        let (mut hs, mut hprev, mut cprev) = (
            vec![],
            Tensor::zeros((b, h), candle_core::DType::F32, &dev).unwrap(),
            Tensor::zeros((b, h), candle_core::DType::F32, &dev).unwrap(),
        );
        for s in 0..t {
            let p = (xp.as_tensor().get(s).unwrap()
                + hprev.matmul(&w.as_tensor().t().unwrap()).unwrap())
            .unwrap()
            .broadcast_add(bias.as_tensor())
            .unwrap();
            let sg = candle_nn::ops::sigmoid(&p).unwrap();
            let i = sg.narrow(1, 0, h).unwrap();
            let f = sg.narrow(1, h, h).unwrap();
            let g = p.narrow(1, 2 * h, h).unwrap().tanh().unwrap();
            let o = sg.narrow(1, 3 * h, h).unwrap();
            let c = ((f * &cprev).unwrap() + (i * g).unwrap()).unwrap();
            let hh = (o * c.tanh().unwrap()).unwrap();
            hs.push(hh.clone());
            hprev = hh;
            cprev = c;
        }
        let r_h = Tensor::stack(&hs, 0).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(diff(&f_h, &r_h) < 1e-5);
        assert!(diff(&f_c, &cprev) < 1e-5);
        let objective = |hs: &Tensor, c: &Tensor| {
            ((hs * &weights).unwrap().sum_all().unwrap()
                + (c * &cweights).unwrap().sum_all().unwrap())
            .unwrap()
        };
        let gf = objective(&f_h, &f_c).backward().unwrap();
        let gr = objective(&r_h, &cprev).backward().unwrap();
        for v in [xp.as_tensor(), w.as_tensor(), bias.as_tensor()] {
            let (a, b) = (gf.get(v).unwrap(), gr.get(v).unwrap());
            assert!(diff(a, b) < 1e-5, "gradient differs by {}", diff(a, b));
        }
    }

    /// The last-step form is the whole sequence's hidden states read at each row's last step
    /// through candle's operations (a one-hot mask, as the model read them before): the same
    /// values and the same gradients.
    #[test]
    fn lstm_last_reads_the_states_at_each_rows_last_step() {
        let dev = Device::Cpu;
        let (t, b, h) = (5, 4, 3);
        let xp = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, b, 4 * h), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (4 * h, h), &dev).unwrap()).unwrap();
        let bias = Var::from_tensor(&Tensor::randn(0f32, 0.5, 4 * h, &dev).unwrap()).unwrap();
        let weights = Tensor::randn(0f32, 1.0, (b, h), &dev).unwrap();
        let last = Arc::new(vec![4u32, 0, 2, 2]);
        let mut mask = vec![0f32; t * b];
        for (r, &s) in last.iter().enumerate() {
            mask[s as usize * b + r] = 1.0;
        }
        let mask = Tensor::from_vec(mask, (t, b, 1), &dev).unwrap();
        let (x, wt, bt) = (xp.as_tensor(), w.as_tensor(), bias.as_tensor());
        let fast = lstm_last(x, wt, bt, Arc::clone(&last)).unwrap();
        let slow = lstm(x, wt, bt)
            .unwrap()
            .narrow(1, 0, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .broadcast_mul(&mask)
            .unwrap()
            .sum(0)
            .unwrap();
        let values = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(values(&fast), values(&slow));
        let grads = |y: &Tensor| {
            (y * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        };
        let (gf, gs) = (grads(&fast), grads(&slow));
        for v in [x, wt, bt] {
            let (a, b) = (values(gf.get(v).unwrap()), values(gs.get(v).unwrap()));
            let worst = a
                .iter()
                .zip(&b)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-6, "gradient differs by {worst}");
            assert!(a.iter().any(|g| *g != 0.0));
        }
        assert!(lstm_last(x, wt, bt, Arc::new(vec![5, 0, 0, 0])).is_err());
    }
}
