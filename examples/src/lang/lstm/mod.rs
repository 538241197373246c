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
//!
//! Layout: this file the operation and its forward; `backward.rs` back through time;
//! `kernels.rs` the arithmetic (the matrix product, the gate passes in their baseline and
//! AVX2 forms, the exponential).

mod backward;
mod kernels;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use backward::{LastSteps, LstmSeqBackward};
use kernels::{f32_slice, forward_gates, matmul, Mat};

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
