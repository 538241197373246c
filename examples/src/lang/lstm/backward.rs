//! The LSTM's backward through time: one pass from the last step to the first, one matrix
//! product per step, the recurrent weight's and the bias's gradients accumulated in place.

use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

use super::kernels::{assume_init, backward_gates, f32_slice, matmul, Mat};

/// The forward's states `[T, 2, B, H]` and each row's last step (the output's rows).
pub(super) struct LastSteps {
    pub states: Arc<Vec<f32>>,
    pub last: Arc<Vec<u32>>,
}

/// Back through time: from the forward's states, the recurrent weight and the states'
/// gradient, the gradients of the input projections, the weight and the bias, flattened one
/// after the other (`[T*B*4H + 4H*H + 4H]`). With `states` (the forward's `[T, 2, B, H]` and
/// each row's last step), the gradient is that of the `[B, H]` hidden states at the last
/// steps, fed in at those steps, and the first input is not read.
pub(super) struct LstmSeqBackward {
    pub gates: Arc<Vec<f32>>,
    pub states: Option<LastSteps>,
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
