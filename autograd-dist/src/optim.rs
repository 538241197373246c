//! [`DistributedOptimizer`]: steps every parameter where it lives.
//!
//! Built from the parameters' remote references, grouped by owner: each owner gets one local
//! optimizer (created there with `remote`) holding its parameters and their optimizer state.
//! `step(ctx)` runs concurrently on every owner with that context's gradients, as PyTorch's
//! `torch.distributed.optim.DistributedOptimizer` does. The update rules are PyTorch's:
//! SGD with momentum and (coupled) weight decay; Adam with coupled weight decay, AdamW with
//! decoupled weight decay, both bias-corrected. (candle-nn's optimizers take a `GradStore`, which
//! cannot be built outside candle, so the rules are written out here.)

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use futures::future::BoxFuture;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use rref::{RRef, RRefError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::engine;
use crate::error::AutogradError;
use crate::tensor::RTensor;

/// A trainable parameter. Keep it where it is used (`RRef::new` on its owner); `to_here` gives
/// a detached copy.
#[derive(Clone, Debug)]
pub struct Parameter(pub Var);

impl Parameter {
    /// A parameter initialized with `t`.
    pub fn new(t: &Tensor) -> candle_core::Result<Self> {
        Ok(Self(Var::from_tensor(t)?))
    }
}

impl Serialize for Parameter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RTensor(self.0.as_tensor().detach()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Parameter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = RTensor::deserialize(d)?;
        Var::from_tensor(&t.0)
            .map(Parameter)
            .map_err(serde::de::Error::custom)
    }
}

/// Owner-local references to a shard's parameters, to return from a remote method and hand to
/// a [`DistributedOptimizer`] (PyTorch's `parameter_rrefs()`). The references share the
/// variables: optimizer steps update the shard's model in place.
///
/// ```
/// # async fn demo(agent: rpc_core::Agent) {
/// let varmap = candle_nn::VarMap::new();
/// let refs = autograd_dist::parameter_rrefs(&agent, varmap.all_vars());
/// # }
/// ```
pub fn parameter_rrefs(agent: &Agent, vars: impl IntoIterator<Item = Var>) -> Vec<RRef<Parameter>> {
    vars.into_iter()
        .map(|v| RRef::new(agent, Parameter(v)))
        .collect()
}

/// The variable behind a parameter reference (on its owner).
pub async fn parameter_var(p: &RRef<Parameter>) -> Result<Var, RRefError> {
    Ok(p.local_value().await?.lock().await.0.clone())
}

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
/// their per-parameter state. [`DistributedOptimizer`] runs one on every owner; single-process
/// training uses it directly, with the same arithmetic.
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
    /// An optimizer over `vars`, with fresh state.
    pub fn new(kind: OptimizerKind, vars: Vec<Var>) -> Self {
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

    /// Changes the learning rate (for a schedule); the state is kept.
    pub fn set_lr(&mut self, new: f64) {
        match &mut self.kind {
            OptimizerKind::Sgd { lr, .. } | OptimizerKind::Adam { lr, .. } => *lr = new,
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Updates every parameter that has a gradient in `grads`; returns how many did.
    pub fn step(&mut self, grads: &impl Gradients) -> candle_core::Result<usize> {
        self.steps += 1;
        let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
        let mut updated = 0;
        for i in 0..self.vars.len() {
            let var = &self.vars[i];
            let Some(g) = grads.grad(var.as_tensor()) else {
                continue;
            };
            let p = var.as_tensor().detach();
            let new = update(self.kind, &p, &g, &mut self.m[i], &mut self.v[i], t)?;
            var.set(&new)?;
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

/// Runs on a parameter owner before each local optimizer step there, with that step's
/// gradients: the place to combine gradients across data-parallel replicas (see
/// `collectives::DistributedDataParallel`). Set with [`set_gradient_hook`].
pub trait GradientHook: Send + Sync + 'static {
    /// Rewrites `grads` (the context's gradients on this worker) before the update.
    fn before_step<'a>(
        &'a self,
        grads: &'a mut HashMap<TensorId, Tensor>,
    ) -> BoxFuture<'a, Result<(), BoxError>>;
}

#[derive(Default)]
struct HookSlot(std::sync::Mutex<Option<Arc<dyn GradientHook>>>);

/// Installs `hook` on `agent`'s worker (replacing any earlier one): every local step of a
/// [`DistributedOptimizer`] here runs it first.
pub fn set_gradient_hook(agent: &Agent, hook: Arc<dyn GradientHook>) {
    let slot = agent.extension(HookSlot::default);
    *slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
}

fn gradient_hook(agent: &Agent) -> Option<Arc<dyn GradientHook>> {
    let slot = agent.extension(HookSlot::default);
    let hook = slot.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
    hook
}

/// One owner's part of a [`DistributedOptimizer`]: its parameters and their state. Lives on
/// the owner; it cannot be copied to another worker.
pub struct LocalOptimizer {
    /// Keeps the parameters alive as long as the optimizer.
    _params: Vec<RRef<Parameter>>,
    opt: Optimizer,
}

impl Serialize for LocalOptimizer {
    fn serialize<S: Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "an optimizer stays on its owner; it cannot be copied",
        ))
    }
}

impl<'de> Deserialize<'de> for LocalOptimizer {
    fn deserialize<D: Deserializer<'de>>(_d: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "an optimizer stays on its owner; it cannot be copied",
        ))
    }
}

impl LocalOptimizer {
    async fn step(&mut self, agent: &Agent, ctx: u64) -> Result<usize, BoxError> {
        let mut grads = engine::gradients(agent, ctx);
        if let Some(hook) = gradient_hook(agent) {
            hook.before_step(&mut grads).await?;
        }
        Ok(self.opt.step(&grads)?)
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

/// Creates an owner's local optimizer (runs on the owner).
struct NewLocalOptimizer;

impl RemoteFn for NewLocalOptimizer {
    const NAME: &'static str = "autograd_dist::new_local_optimizer";
    type Args = (OptimizerKind, Vec<RRef<Parameter>>);
    type Output = LocalOptimizer;
    async fn call(
        _cx: CallContext,
        (kind, params): Self::Args,
    ) -> Result<LocalOptimizer, BoxError> {
        let mut vars = Vec::with_capacity(params.len());
        for p in &params {
            vars.push(parameter_var(p).await?);
        }
        Ok(LocalOptimizer {
            _params: params,
            opt: Optimizer::new(kind, vars),
        })
    }
}

/// Runs one step of an owner's local optimizer with context `ctx`'s gradients.
struct LocalStep;

impl RemoteFn for LocalStep {
    const NAME: &'static str = "autograd_dist::local_step";
    type Args = (RRef<LocalOptimizer>, u64);
    type Output = usize;
    async fn call(cx: CallContext, (opt, ctx): Self::Args) -> Result<usize, BoxError> {
        let local = opt.local_value().await?;
        let mut guard = local.lock().await;
        guard.step(cx.agent(), ctx).await
    }
}

/// A copy of an owner's optimizer state.
struct LocalState;

impl RemoteFn for LocalState {
    const NAME: &'static str = "autograd_dist::local_state";
    type Args = (RRef<LocalOptimizer>,);
    type Output = OptimizerState;
    async fn call(_cx: CallContext, (opt,): Self::Args) -> Result<OptimizerState, BoxError> {
        let local = opt.local_value().await?;
        let guard = local.lock().await;
        Ok(guard.opt.state())
    }
}

/// Replaces an owner's optimizer state.
struct LoadLocalState;

impl RemoteFn for LoadLocalState {
    const NAME: &'static str = "autograd_dist::load_local_state";
    type Args = (RRef<LocalOptimizer>, OptimizerState);
    type Output = ();
    async fn call(_cx: CallContext, (opt, state): Self::Args) -> Result<(), BoxError> {
        let local = opt.local_value().await?;
        let mut guard = local.lock().await;
        Ok(guard.opt.load_state(state)?)
    }
}

/// Changes an owner's learning rate.
struct SetLocalLr;

impl RemoteFn for SetLocalLr {
    const NAME: &'static str = "autograd_dist::set_local_lr";
    type Args = (RRef<LocalOptimizer>, f64);
    type Output = ();
    async fn call(_cx: CallContext, (opt, lr): Self::Args) -> Result<(), BoxError> {
        let local = opt.local_value().await?;
        local.lock().await.opt.set_lr(lr);
        Ok(())
    }
}

/// Steps parameters on every worker that owns some, from one place.
///
/// ```no_run
/// # async fn demo(agent: rpc_core::Agent, params: Vec<rref::RRef<autograd_dist::Parameter>>,
/// #               ctx: autograd_dist::DistContext) -> Result<(), autograd_dist::AutogradError> {
/// use autograd_dist::{DistributedOptimizer, OptimizerKind};
/// let opt = DistributedOptimizer::new(&agent, OptimizerKind::adam(1e-3), params)?;
/// opt.step(&ctx).await?;
/// # Ok(()) }
/// ```
pub struct DistributedOptimizer {
    agent: Agent,
    locals: Vec<(u32, RRef<LocalOptimizer>)>,
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let owners: Vec<u32> = self.locals.iter().map(|(o, _)| *o).collect();
        f.debug_struct("DistributedOptimizer")
            .field("owners", &owners)
            .finish()
    }
}

impl DistributedOptimizer {
    /// Groups `params` by owner and creates a local optimizer on each owner (returns at once;
    /// creation errors surface at the first step).
    pub fn new(
        agent: &Agent,
        kind: OptimizerKind,
        params: Vec<RRef<Parameter>>,
    ) -> Result<Self, AutogradError> {
        let mut by_owner: BTreeMap<u32, Vec<RRef<Parameter>>> = BTreeMap::new();
        for p in params {
            by_owner.entry(p.owner().0).or_default().push(p);
        }
        let mut locals = Vec::new();
        for (owner, ps) in by_owner {
            let r = rref::remote(agent, owner, NewLocalOptimizer, (kind, ps)).map_err(|e| {
                AutogradError::Optimizer {
                    worker: format!("rank {owner}"),
                    message: e.to_string(),
                }
            })?;
            locals.push((owner, r));
        }
        // This worker's own step runs inline when polled; polling it last lets the remote
        // owners' steps start first and overlap with it.
        let me = agent.rank();
        locals.sort_by_key(|(owner, _)| (*owner == me, *owner));
        Ok(Self {
            agent: agent.clone(),
            locals,
        })
    }

    /// Runs `call(i, owner's optimizer)` on every owner concurrently. With `wait_all`, every
    /// call runs to its end even if another fails (a state load is not cancelled half way);
    /// without, the first failure cancels the rest (a failed step must not wait for owners
    /// that may be blocked on the failed one, e.g. in a gradient all-reduce). The first error
    /// is returned, naming its owner.
    async fn on_owners<T, Fut>(
        &self,
        wait_all: bool,
        call: impl Fn(usize, &RRef<LocalOptimizer>) -> Fut,
    ) -> Result<Vec<T>, AutogradError>
    where
        Fut: std::future::Future<Output = Result<T, rpc_core::RpcError>>,
    {
        let calls = self.locals.iter().enumerate().map(|(i, (owner, opt))| {
            let call = call(i, opt);
            async move {
                call.await.map_err(|source| AutogradError::Rpc {
                    worker: self.agent.name_of(*owner),
                    source: Box::new(source),
                })
            }
        });
        if wait_all {
            futures::future::join_all(calls).await.into_iter().collect()
        } else {
            futures::future::try_join_all(calls).await
        }
    }

    /// One step on every owner, concurrently, with `ctx`'s gradients. Returns the number of
    /// parameters updated (those that received a gradient).
    pub async fn step(&self, ctx: &crate::engine::DistContext) -> Result<usize, AutogradError> {
        let id = ctx.id();
        let updated = self
            .on_owners(false, |_, opt| {
                // The step's own calls (the gradient hook's) are not part of the context.
                rpc_core::with_call_meta(
                    crate::engine::CTX_KEY,
                    None,
                    opt.rpc_async(LocalStep, (id,)),
                )
            })
            .await?;
        Ok(updated.into_iter().sum())
    }

    /// Sets the learning rate on every owner (for a schedule, e.g. once per epoch).
    pub async fn set_lr(&self, lr: f64) -> Result<(), AutogradError> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(AutogradError::State(format!(
                "learning rate {lr} is not a finite non-negative number"
            )));
        }
        self.on_owners(true, |_, opt| opt.rpc_async(SetLocalLr, (lr,)))
            .await?;
        Ok(())
    }

    /// The workers that own parameters, in the order of [`DistributedOptimizer::state`] (this
    /// worker, if it owns some, last).
    pub fn owners(&self) -> Vec<u32> {
        self.locals.iter().map(|(o, _)| *o).collect()
    }

    /// Every owner's optimizer state (for a checkpoint), in [`DistributedOptimizer::owners`]
    /// order; each lists its parameters in the order they were given to `new`.
    pub async fn state(&self) -> Result<Vec<OptimizerState>, AutogradError> {
        self.on_owners(true, |_, opt| opt.rpc_async(LocalState, ()))
            .await
    }

    /// Restores every owner's state from [`DistributedOptimizer::state`] of an optimizer over
    /// the same parameters.
    pub async fn load_state(&self, states: Vec<OptimizerState>) -> Result<(), AutogradError> {
        if states.len() != self.locals.len() {
            return Err(AutogradError::State(format!(
                "{} states for {} owners",
                states.len(),
                self.locals.len()
            )));
        }
        self.on_owners(true, |i, opt| {
            opt.rpc_async(LoadLocalState, (states[i].clone(),))
        })
        .await?;
        Ok(())
    }
}

pub(crate) fn register(
    b: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    b.register(NewLocalOptimizer)?
        .register(LocalStep)?
        .register(LocalState)?
        .register(LoadLocalState)?
        .register(SetLocalLr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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
}
