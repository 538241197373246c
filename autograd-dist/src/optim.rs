//! The update rules, run where the parameters live: [`Optimizer`] over variables of this
//! process, with the arithmetic of PyTorch's SGD (momentum, coupled weight decay), Adam
//! (coupled weight decay) and AdamW (decoupled), both bias-corrected. Single-process training
//! uses it directly; the [`DistributedOptimizer`](crate::DistributedOptimizer) runs one on every
//! owner. (candle-nn's optimizers take a `GradStore`, which cannot be built outside candle, so
//! the rules are written out here.)

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

use crate::error::AutogradError;
use crate::tensor::RTensor;

/// Which update rule, with its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum OptimizerKind {
    /// `p -= lr * buf`, `buf = momentum * buf + (g + weight_decay * p)`.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0: none).
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// Adam (`decoupled = false`) or AdamW (`decoupled = true`).
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
        /// Weight decay (L2 for Adam, decoupled for AdamW).
        weight_decay: f64,
        /// AdamW's decoupled weight decay.
        decoupled: bool,
    },
}

impl OptimizerKind {
    /// SGD without momentum or weight decay.
    pub fn sgd(lr: f64) -> Self {
        Self::Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }

    /// Adam with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
    pub fn adam(lr: f64) -> Self {
        Self::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }

    /// AdamW with PyTorch's defaults (weight decay 0.01).
    pub fn adamw(lr: f64) -> Self {
        Self::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        }
    }
}

impl OptimizerKind {
    /// Why these hyper-parameters cannot train, if they cannot: PyTorch's ranges (a finite
    /// learning rate, momentum, weight decay and epsilon of at least 0; betas in `[0, 1)`).
    pub(crate) fn check(&self) -> Result<(), String> {
        match *self {
            Self::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                at_least_zero("learning rate", lr)?;
                at_least_zero("momentum", momentum)?;
                at_least_zero("weight decay", weight_decay)
            }
            Self::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                at_least_zero("learning rate", lr)?;
                for (name, b) in [("beta1", beta1), ("beta2", beta2)] {
                    if !(0.0..1.0).contains(&b) {
                        return Err(format!("{name} {b} is not in [0, 1)"));
                    }
                }
                at_least_zero("eps", eps)?;
                at_least_zero("weight decay", weight_decay)
            }
        }
    }
}

/// `Ok` for a finite `v` of at least 0, else why not, naming the hyper-parameter.
pub(crate) fn at_least_zero(name: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} {v} is not a finite number of at least 0"))
    }
}

/// Gradients looked up by variable: candle's `GradStore` and a context's gradient map.
pub trait Gradients {
    /// The gradient of `var`, if it has one.
    fn grad(&self, var: &Tensor) -> Option<Tensor>;
    /// Replaces (or sets) the gradient of `var`.
    fn set_grad(&mut self, var: &Tensor, grad: Tensor);
}

impl Gradients for GradStore {
    fn grad(&self, var: &Tensor) -> Option<Tensor> {
        self.get(var).cloned()
    }
    fn set_grad(&mut self, var: &Tensor, grad: Tensor) {
        self.insert(var, grad);
    }
}

impl Gradients for HashMap<TensorId, Tensor> {
    fn grad(&self, var: &Tensor) -> Option<Tensor> {
        self.get(&var.id()).cloned()
    }
    fn set_grad(&mut self, var: &Tensor, grad: Tensor) {
        self.insert(var.id(), grad);
    }
}

/// An optimizer over variables of this process: the update rules of [`OptimizerKind`] with
/// their per-parameter state. [`DistributedOptimizer`](crate::DistributedOptimizer) runs one
/// on every owner; single-process training uses it directly, with the same arithmetic.
///
/// ```
/// use autograd_dist::{Optimizer, OptimizerKind};
/// use candle_core::{Device, Tensor, Var};
/// let w = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
/// let mut opt = Optimizer::new(OptimizerKind::sgd(0.5), vec![w.clone()]);
/// let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
/// opt.step(&loss.backward().unwrap()).unwrap();
/// assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), vec![0.0, 0.0]);
/// ```
pub struct Optimizer {
    kind: OptimizerKind,
    vars: Vec<Var>,
    /// Momentum buffer (SGD) or first moment (Adam), per parameter.
    m: Vec<Option<Tensor>>,
    /// Second moment (Adam), per parameter.
    v: Vec<Option<Tensor>>,
    steps: u64,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("kind", &self.kind)
            .field("params", &self.vars.len())
            .field("steps", &self.steps)
            .finish()
    }
}

/// An optimizer's state, for checkpoints: the step count and each parameter's moments (in the
/// order the parameters were given; `None` before a parameter's first update).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Steps taken.
    pub steps: u64,
    /// First moment (or momentum buffer) per parameter.
    pub m: Vec<Option<RTensor>>,
    /// Second moment per parameter.
    pub v: Vec<Option<RTensor>>,
}

impl Optimizer {
    /// An optimizer over `vars`, with fresh state. Each variable is stepped once, however
    /// often it is listed (a weight tied between two modules is in both their lists).
    pub fn new(kind: OptimizerKind, vars: Vec<Var>) -> Self {
        let mut seen = std::collections::HashSet::new();
        let vars: Vec<Var> = vars
            .into_iter()
            .filter(|v| seen.insert(v.as_tensor().id()))
            .collect();
        let n = vars.len();
        Self {
            kind,
            vars,
            m: vec![None; n],
            v: vec![None; n],
            steps: 0,
        }
    }

    /// The parameters, in order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self.kind {
            OptimizerKind::Sgd { lr, .. } | OptimizerKind::Adam { lr, .. } => lr,
        }
    }

    /// Changes the learning rate (for a schedule); the state is kept. A rate out of range
    /// (negative, not finite) makes the next step fail.
    pub fn set_lr(&mut self, new: f64) {
        match &mut self.kind {
            OptimizerKind::Sgd { lr, .. } | OptimizerKind::Adam { lr, .. } => *lr = new,
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Updates every parameter that has a gradient in `grads`; returns how many did. Fails,
    /// updating nothing, when a hyper-parameter is out of PyTorch's range (a negative or
    /// non-finite learning rate, momentum, weight decay or epsilon; a beta outside `[0, 1)`).
    pub fn step(&mut self, grads: &impl Gradients) -> candle_core::Result<usize> {
        self.kind
            .check()
            .map_err(|why| candle_core::Error::Msg(format!("optimizer: {why}")))?;
        self.steps += 1;
        let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
        let mut updated = 0;
        for i in 0..self.vars.len() {
            let var = &self.vars[i];
            let Some(g) = grads.grad(var.as_tensor()) else {
                continue;
            };
            let p = var.as_tensor().detach();
            // The moments keep no graph: a gradient from candle's backward can carry the
            // step's forward pass (a variable used directly as a product's operand gets
            // `input.t() @ grad`), and `m` built on it would chain every step's to the next.
            let g = g.detach();
            if !sgd_in_place(self.kind, var, &g)? {
                let new = update(self.kind, &p, &g, &mut self.m[i], &mut self.v[i], t)?;
                var.set(&new)?;
            }
            updated += 1;
        }
        Ok(updated)
    }

    /// A copy of the state.
    pub fn state(&self) -> OptimizerState {
        let copy = |x: &Vec<Option<Tensor>>| x.iter().map(|t| t.clone().map(RTensor)).collect();
        OptimizerState {
            steps: self.steps,
            m: copy(&self.m),
            v: copy(&self.v),
        }
    }

    /// Replaces the state by `state` (from [`Optimizer::state`] of an optimizer over the same
    /// parameters); checks the number of parameters and every moment's shape.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<(), AutogradError> {
        let n = self.vars.len();
        if state.m.len() != n || state.v.len() != n {
            return Err(AutogradError::State(format!(
                "the state holds {} and {} moments for {n} parameters",
                state.m.len(),
                state.v.len()
            )));
        }
        let mut m = Vec::with_capacity(n);
        let mut v = Vec::with_capacity(n);
        for (i, (a, b)) in state.m.into_iter().zip(state.v).enumerate() {
            let var = self.vars[i].as_tensor();
            for (slot, out) in [(a, &mut m), (b, &mut v)] {
                let t = match slot {
                    Some(RTensor(t)) if t.dims() != var.dims() || t.dtype() != var.dtype() => {
                        return Err(AutogradError::State(format!(
                            "parameter {i} is {:?} {:?} but its saved moment is {:?} {:?}",
                            var.dims(),
                            var.dtype(),
                            t.dims(),
                            t.dtype()
                        )))
                    }
                    Some(RTensor(t)) => Some(t.to_device(var.device())?),
                    None => None,
                };
                out.push(t);
            }
        }
        self.m = m;
        self.v = v;
        self.steps = state.steps;
        Ok(())
    }
}

/// Plain SGD (no momentum, no weight decay) on a contiguous CPU `f32` / `f64` parameter, in
/// one pass over its storage: `p = p - (g * lr + 0)`, the very operations (and bits) of
/// [`update`]'s `p - (g * lr)`, without its two temporaries as large as the parameter (for a
/// 25 M-parameter model, 200 MB of fresh pages a step). Returns whether it applied.
fn sgd_in_place(kind: OptimizerKind, var: &Var, g: &Tensor) -> candle_core::Result<bool> {
    let OptimizerKind::Sgd {
        lr,
        momentum,
        weight_decay,
    } = kind
    else {
        return Ok(false);
    };
    let p = var.as_tensor();
    let fits = momentum == 0.0
        && weight_decay == 0.0
        && p.device().is_cpu()
        && g.device().is_cpu()
        && p.dtype() == g.dtype()
        && matches!(p.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
        && p.dims() == g.dims()
        && p.is_contiguous()
        && g.is_contiguous();
    if !fits {
        return Ok(false);
    }
    p.inplace_op2(g, &SgdStep(lr))?;
    Ok(true)
}

/// `p[i] = p[i] - (g[i] * lr + 0)` in place (see [`sgd_in_place`]).
struct SgdStep(f64);

impl candle_core::InplaceOp2 for SgdStep {
    fn name(&self) -> &'static str {
        "sgd-step"
    }

    fn cpu_fwd(
        &self,
        p: &mut candle_core::CpuStorage,
        lp: &candle_core::Layout,
        g: &candle_core::CpuStorage,
        lg: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage::{F32, F64};
        let (Some((a, b)), Some((c, d))) = (lp.contiguous_offsets(), lg.contiguous_offsets())
        else {
            candle_core::bail!("sgd-step: not contiguous")
        };
        match (p, g) {
            (F32(p), F32(g)) => {
                let (lr, zero) = (self.0 as f32, 0f32);
                for (p, g) in p[a..b].iter_mut().zip(&g[c..d]) {
                    *p -= *g * lr + zero;
                }
            }
            (F64(p), F64(g)) => {
                let (lr, zero) = (self.0, 0f64);
                for (p, g) in p[a..b].iter_mut().zip(&g[c..d]) {
                    *p -= *g * lr + zero;
                }
            }
            _ => candle_core::bail!("sgd-step: f32 or f64 only"),
        }
        Ok(())
    }
}

/// One update of parameter `p` with gradient `g` at step `t` (1-based); `m` and `v` are the
/// parameter's optimizer state, created on first use.
fn update(
    kind: OptimizerKind,
    p: &Tensor,
    g: &Tensor,
    m: &mut Option<Tensor>,
    v: &mut Option<Tensor>,
    t: i32,
) -> candle_core::Result<Tensor> {
    match kind {
        OptimizerKind::Sgd {
            lr,
            momentum,
            weight_decay,
        } => {
            let g = if weight_decay != 0.0 {
                (g + (p * weight_decay)?)?
            } else {
                g.clone()
            };
            let d = if momentum != 0.0 {
                let buf = match m.take() {
                    Some(b) => ((b * momentum)? + g)?,
                    None => g,
                };
                *m = Some(buf.clone());
                buf
            } else {
                g
            };
            p - (d * lr)?
        }
        OptimizerKind::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => {
            let g = if weight_decay != 0.0 && !decoupled {
                (g + (p * weight_decay)?)?
            } else {
                g.clone()
            };
            let p = if weight_decay != 0.0 && decoupled {
                (p * (1.0 - lr * weight_decay))?
            } else {
                p.clone()
            };
            let m1 = match m.take() {
                Some(m) => ((m * beta1)? + (&g * (1.0 - beta1))?)?,
                None => (&g * (1.0 - beta1))?,
            };
            let v1 = match v.take() {
                Some(v) => ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?,
                None => (g.sqr()? * (1.0 - beta2))?,
            };
            let m_hat = (&m1 / (1.0 - beta1.powi(t)))?;
            let v_hat = (&v1 / (1.0 - beta2.powi(t)))?;
            *m = Some(m1);
            *v = Some(v1);
            p - ((m_hat / (v_hat.sqrt()? + eps)?)? * lr)?
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A variable used directly as a product's operand (`h @ w`) gets `h.t() @ grad` from
    /// candle's backward: a gradient that carries the step's forward pass. The moments must
    /// keep none of it, or each step's graph chains to the next (the pipeline example's stages
    /// grew by 20 MB a step and stalled the machine).
    #[test]
    fn moments_keep_no_graph_of_the_gradients() {
        let dev = Device::Cpu;
        let var = |v: f32| Var::from_tensor(&Tensor::full(v, (4, 4), &dev).unwrap()).unwrap();
        let x = Tensor::ones((2, 4), candle_core::DType::F32, &dev).unwrap();
        for kind in [
            OptimizerKind::adam(1e-3),
            OptimizerKind::Sgd {
                lr: 1e-3,
                momentum: 0.9,
                weight_decay: 0.0,
            },
        ] {
            let (w1, w2) = (var(0.5), var(0.25));
            let mut opt = Optimizer::new(kind, vec![w1.clone(), w2.clone()]);
            for _ in 0..3 {
                let h = x.matmul(w1.as_tensor()).unwrap();
                let loss = h.matmul(w2.as_tensor()).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                assert!(
                    g.get(w2.as_tensor()).unwrap().track_op(),
                    "the premise: this gradient carries a graph"
                );
                assert_eq!(opt.step(&g).unwrap(), 2);
            }
            let st = opt.state();
            let moments: Vec<&RTensor> = st.m.iter().chain(&st.v).flatten().collect();
            assert!(!moments.is_empty(), "{kind:?}");
            for t in moments {
                assert!(!t.0.track_op(), "{kind:?}: a moment keeps a graph");
            }
            for w in [&w1, &w2] {
                assert!(!w.as_tensor().detach().track_op());
            }
        }
    }

    /// PyTorch refuses these at construction (`ValueError: Invalid learning rate`); taken,
    /// they trained silently wrong (a negative rate climbs the loss, `beta1 = 1` makes Adam's
    /// bias correction divide by zero and every parameter NaN). A step refuses them, naming
    /// the value, before it changes any parameter.
    #[test]
    fn a_hyper_parameter_out_of_range_is_refused_before_any_update() {
        let sgd = |lr, momentum, weight_decay| OptimizerKind::Sgd {
            lr,
            momentum,
            weight_decay,
        };
        let adam = |beta1, beta2, eps| OptimizerKind::Adam {
            lr: 0.1,
            beta1,
            beta2,
            eps,
            weight_decay: 0.0,
            decoupled: false,
        };
        for (kind, says) in [
            (OptimizerKind::sgd(-0.1), "learning rate -0.1"),
            (OptimizerKind::adam(f64::NAN), "learning rate NaN"),
            (sgd(0.1, -0.9, 0.0), "momentum -0.9"),
            (sgd(0.1, 0.0, f64::INFINITY), "weight decay inf"),
            (adam(1.0, 0.999, 1e-8), "beta1 1"),
            (adam(0.9, -0.5, 1e-8), "beta2 -0.5"),
            (adam(0.9, 0.999, -1e-8), "eps -0.00000001"),
        ] {
            let w = Var::from_tensor(&scalar(1.0)).unwrap();
            let mut opt = Optimizer::new(kind, vec![w.clone()]);
            let g = square_grad(&w);
            let e = opt.step(&g).expect_err("refused").to_string();
            assert!(e.contains(says), "{kind:?}: {e}");
            assert_eq!(get(w.as_tensor()), 1.0, "{kind:?}");
        }
        let w = Var::from_tensor(&scalar(1.0)).unwrap();
        let mut opt = Optimizer::new(OptimizerKind::sgd(0.1), vec![w.clone()]);
        opt.set_lr(-1.0);
        assert!(
            opt.step(&square_grad(&w)).is_err(),
            "a schedule's negative rate"
        );
    }

    /// A weight tied between two modules is in both modules' parameter lists: it was
    /// stepped once per listing (here twice: 1 -> 0 -> -1); it is stepped once.
    #[test]
    fn a_parameter_listed_twice_is_stepped_once() {
        let w = Var::from_tensor(&scalar(1.0)).unwrap();
        let other = Var::from_tensor(&scalar(2.0)).unwrap();
        let listed = vec![w.clone(), other.clone(), w.clone()];
        let mut opt = Optimizer::new(OptimizerKind::sgd(0.5), listed);
        assert_eq!(opt.vars().len(), 2);
        let loss = (w.as_tensor().sqr().unwrap() + other.as_tensor().sqr().unwrap()).unwrap();
        assert_eq!(
            opt.step(&loss.sum_all().unwrap().backward().unwrap())
                .unwrap(),
            2
        );
        assert_eq!(get(w.as_tensor()), 0.0);
        assert_eq!(get(other.as_tensor()), 0.0);
    }

    /// The gradients of `sum(w²)`.
    fn square_grad(w: &Var) -> GradStore {
        let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
        loss.backward().unwrap()
    }

    fn scalar(x: f64) -> Tensor {
        Tensor::new(&[x], &Device::Cpu).unwrap()
    }

    fn get(t: &Tensor) -> f64 {
        t.to_vec1::<f64>().unwrap()[0]
    }

    #[test]
    fn sgd_with_momentum_and_weight_decay_follows_pytorch() {
        let kind = OptimizerKind::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let (mut m, mut v) = (None, None);
        // Step 1: d = g + wd p = 0.5 + 0.01; buf = d; p = 1 - 0.1 d.
        let p1 = update(kind, &scalar(1.0), &scalar(0.5), &mut m, &mut v, 1).unwrap();
        let d1 = 0.5 + 0.01 * 1.0;
        assert!((get(&p1) - (1.0 - 0.1 * d1)).abs() < 1e-12);
        // Step 2: buf = 0.9 buf + (g + wd p).
        let p2 = update(kind, &p1, &scalar(0.2), &mut m, &mut v, 2).unwrap();
        let buf2 = 0.9 * d1 + (0.2 + 0.01 * get(&p1));
        assert!((get(&p2) - (get(&p1) - 0.1 * buf2)).abs() < 1e-12);
    }

    #[test]
    fn adam_with_l2_penalty_follows_pytorch() {
        let kind = OptimizerKind::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: false,
        };
        let (mut m, mut v) = (None, None);
        let (mut p, mut em, mut ev) = (1.0f64, 0.0f64, 0.0f64);
        let mut pt = scalar(p);
        for (t, g) in [(1, 0.3f64), (2, -0.2), (3, 0.05)] {
            pt = update(kind, &pt, &scalar(g), &mut m, &mut v, t).unwrap();
            let g = g + 0.1 * p;
            em = 0.9 * em + 0.1 * g;
            ev = 0.999 * ev + 0.001 * g * g;
            let (mh, vh) = (em / (1.0 - 0.9f64.powi(t)), ev / (1.0 - 0.999f64.powi(t)));
            p -= 0.01 * mh / (vh.sqrt() + 1e-8);
            assert!((get(&pt) - p).abs() < 1e-12, "step {t}");
        }
    }

    /// The in-place SGD step writes the bits the tensor operations write (f32 and f64, with
    /// values that round differently: negative zeros, subnormals, large and tiny ones).
    #[test]
    fn sgd_in_place_matches_the_tensor_operations_bit_for_bit() {
        let vals = |salt: u32| -> Vec<f64> {
            (0..997u32)
                .map(|i| {
                    let x = f64::from((i.wrapping_mul(2_654_435_761) ^ salt) % 100_003);
                    match i % 7 {
                        0 => -0.0,
                        1 => 1e-310,
                        2 => -x * 1e12,
                        _ => (x - 50_000.0) / 3_333.0,
                    }
                })
                .collect()
        };
        for dtype in [candle_core::DType::F32, candle_core::DType::F64] {
            let p0 = Tensor::new(vals(1), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let g = Tensor::new(vals(2), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let lr = 0.0123;
            let want = (&p0 - (&g * lr).unwrap()).unwrap();
            let var = Var::from_tensor(&p0).unwrap();
            assert!(sgd_in_place(OptimizerKind::sgd(lr), &var, &g).unwrap());
            let bits = |t: &Tensor| -> Vec<u64> {
                let t = t.to_dtype(candle_core::DType::F64).unwrap();
                t.to_vec1::<f64>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            assert_eq!(bits(var.as_tensor()), bits(&want), "{dtype:?}");
        }
        // Momentum and weight decay take the tensor operations.
        let var = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let g = Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap();
        let momentum = OptimizerKind::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        assert!(!sgd_in_place(momentum, &var, &g).unwrap());
    }
}
