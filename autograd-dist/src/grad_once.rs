//! Parameter gradients written once.
//!
//! candle's backward pass gives every tensor whose gradient it accumulates a buffer of zeros
//! and then a new buffer for `zeros + gradient`: for a weight matrix that is two more passes
//! over its size (and two more allocations) for every step, where the gradient itself was one
//! matrix product. PyTorch's `AccumulateGrad` takes the first gradient as it is. For a model's
//! large weights this costs a tenth of a CPU training step (the data-parallel reference
//! model's local step in `rpc-bench ddp`: 162 ms without it, 146 with it).
//!
//! [`matmul`] is `x.matmul(w)` for a parameter `w`; run backward with [`backward`] instead
//! of `loss.backward()`, and `w`'s gradient is the product `xᵀ·g` itself, handed to the
//! [`GradStore`] when backward ends. Opting in is one line per layer and one per step:
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{Device, Tensor, Var};
//! let w = Var::randn(0f32, 1.0, (4, 3), &Device::Cpu)?;
//! let x = Tensor::randn(0f32, 1.0, (2, 4), &Device::Cpu)?;
//! let loss = autograd_dist::grad_once::matmul(&x, w.as_tensor())?.sqr()?.sum_all()?;
//! let grads = autograd_dist::grad_once::backward(&loss)?; // instead of loss.backward()
//! assert_eq!(grads.get(w.as_tensor()).expect("w's gradient").dims(), &[4, 3]);
//! # Ok(()) }
//! ```
//!
//! - ONCE-1: the results are those of candle's `matmul` and `backward`: the same product
//!   forward, the same two products backward, in the same kernels. A parameter whose
//!   gradient has several parts (used twice, or also by other operations) gets their sum.
//! - ONCE-2: nothing depends on opting in everywhere: through a plain `loss.backward()`, or
//!   where `w` is not a variable (a view of one, a constant), or off the CPU, [`matmul`] is
//!   candle's `matmul` and its gradient takes candle's path.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// Told of each weight gradient as it is computed ([`backward_observed`]).
type Ready = Box<dyn FnMut(&Tensor, &Tensor)>;

/// The gradients taken in one [`backward`], and who is told of each.
struct Taken {
    grads: Vec<(Tensor, Tensor)>,
    ready: Option<Ready>,
}

thread_local! {
    /// The gradients [`MatmulParam`] produced in the backward pass running on this thread
    /// through [`backward`] (`None`: none is; gradients then take candle's path).
    static TAKEN: RefCell<Option<Taken>> = const { RefCell::new(None) };
}

/// `x @ w` whose backward hands `w`'s gradient to [`TAKEN`] when a [`backward`] collects it.
struct MatmulParam;

impl CustomOp2 for MatmulParam {
    fn name(&self) -> &'static str {
        "matmul-param"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = lx.shape().dims2()?;
        let (k2, n) = lw.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("grad_once::matmul: ({m}, {k}) @ ({k2}, {n})");
        }
        // The kernel (and layouts) candle's own matmul calls for these operands (ONCE-1).
        Ok((x.matmul(w, (1, m, n, k), lx, lw)?, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // As candle's backward of `Op::Matmul` computes them (ONCE-1); the weight's first, so
        // that whoever waits for it gets it before the rest of backward runs.
        let dw = x.t()?.matmul(g)?;
        let dw = TAKEN.with(|t| match t.borrow_mut().as_mut() {
            Some(taken) => {
                if let Some(ready) = taken.ready.as_mut() {
                    ready(w, &dw);
                }
                taken.grads.push((w.clone(), dw));
                None
            }
            None => Some(dw),
        });
        let dx = g.matmul(&w.t()?)?;
        Ok((Some(dx), dw))
    }
}

/// `x.matmul(w)` for a parameter `w` of shape `(k, n)` and `x` of shape `(.., k)` (leading
/// dimensions flattened, then restored). Under [`backward`], `w`'s gradient is written once
/// (ONCE-1); otherwise, or where `w` is not a variable or not on the CPU, this is candle's
/// `matmul` (ONCE-2).
pub fn matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (k, n) = w.dims2()?;
    if !w.is_variable() || !w.device().is_cpu() || !x.device().is_cpu() {
        return match x.rank() {
            2 => x.matmul(w),
            _ => x.broadcast_matmul(w),
        };
    }
    let dims = x.dims().to_vec();
    if dims.last() != Some(&k) {
        candle_core::bail!("grad_once::matmul: {:?} @ ({k}, {n})", x.dims());
    }
    if dims.len() == 2 {
        return x.apply_op2(w, MatmulParam);
    }
    let rows = dims[..dims.len() - 1].iter().product::<usize>();
    let mut out = dims;
    *out.last_mut().expect("at least one dimension") = n;
    x.reshape((rows, k))?
        .apply_op2(w, MatmulParam)?
        .reshape(out)
}

/// `loss.backward()`, with the gradients of the parameters used through [`matmul`] written
/// once: each is the matrix product itself (summed with any other part candle accumulated
/// for the same parameter).
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    collect(loss, None)
}

/// [`backward`], calling `ready(w, dw)` on this thread with each weight gradient taken, as
/// soon as it is computed and before the rest of backward runs: a data-parallel pass starts
/// sending a weight's gradient while backward goes on below it. `dw` is that one product: a
/// weight used several times, or also by other operations, ends with the sum of its parts in
/// the returned store (ONCE-1), which `ready` sees one part at a time. `ready` must not run a
/// backward pass itself.
pub fn backward_observed(
    loss: &Tensor,
    ready: impl FnMut(&Tensor, &Tensor) + 'static,
) -> Result<GradStore> {
    collect(loss, Some(Box::new(ready)))
}

fn collect(loss: &Tensor, ready: Option<Ready>) -> Result<GradStore> {
    let collecting = Collecting::start(ready);
    let result = loss.backward();
    let taken = collecting.end();
    let mut grads = result?;
    for (w, dw) in taken {
        let sum = match grads.remove(&w) {
            Some(part) => (part + dw)?,
            None => dw,
        };
        grads.insert(&w, sum);
    }
    Ok(grads)
}

/// This thread's collection of [`TAKEN`] gradients while it lasts. What was there before (an
/// enclosing [`backward`]'s, or none) is put back when it ends, also by a panic in backward
/// (else gradients would go on being taken for a collection nobody reads).
struct Collecting {
    /// What to put back; `None` once put back.
    outer: Option<Option<Taken>>,
}

impl Collecting {
    fn start(ready: Option<Ready>) -> Self {
        let fresh = Taken {
            grads: Vec::new(),
            ready,
        };
        let outer = TAKEN.with(|t| t.replace(Some(fresh)));
        Self { outer: Some(outer) }
    }

    /// The gradients taken.
    fn end(mut self) -> Vec<(Tensor, Tensor)> {
        let outer = self.outer.take().expect("not ended yet");
        TAKEN
            .with(|t| t.replace(outer))
            .map_or_else(Vec::new, |t| t.grads)
    }
}

impl Drop for Collecting {
    fn drop(&mut self) {
        if let Some(outer) = self.outer.take() {
            TAKEN.with(|t| t.replace(outer));
        }
    }
}

#[cfg(test)]
mod tests;
