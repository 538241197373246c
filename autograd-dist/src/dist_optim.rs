//! [`DistributedOptimizer`]: steps every parameter where it lives.
//!
//! Built from the parameters' remote references, grouped by owner: each owner gets one local
//! [`Optimizer`] (created there with `remote`) holding its parameters and their optimizer
//! state. `step(ctx)` runs concurrently on every owner with that context's gradients, as
//! PyTorch's `torch.distributed.optim.DistributedOptimizer` does, after the owner's
//! [`GradientHook`] (data-parallel replicas combine their gradients there).

use candle_core::{Tensor, TensorId, Var};
use futures::future::BoxFuture;
use rpc_core::ext::{with_call_meta, AgentExt};
use rpc_core::trace::Cat;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use rref::{RRef, RRefError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::engine::DistContext;
use crate::error::AutogradError;
use crate::optim::{Optimizer, OptimizerKind, OptimizerState};
use crate::record::CTX_KEY;
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
/// Give the variables in an order that is the same on every run and every process (a data
/// parallel replica's included): the optimizer's state, its checkpoints and the replicas'
/// gradient buckets refer to parameters by position. `candle_nn::VarMap::all_vars` is in hash
/// order, which is not; sort by name:
///
/// ```
/// # async fn demo(agent: rpc_core::Agent) -> candle_core::Result<()> {
/// use candle_nn::{linear, VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &candle_core::Device::Cpu);
/// let _fc1 = linear(64, 32, vb.pp("fc1"))?;
/// let _fc2 = linear(32, 8, vb.pp("fc2"))?;
/// let mut named: Vec<_> = varmap.data().lock().unwrap().clone().into_iter().collect();
/// named.sort_by(|a, b| a.0.cmp(&b.0)); // fc1.bias, fc1.weight, fc2.bias, fc2.weight
/// let refs = autograd_dist::parameter_rrefs(&agent, named.into_iter().map(|(_, v)| v));
/// assert_eq!(refs.len(), 4);
/// # Ok(()) }
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
        let mut grads = crate::engine::gradients(agent, ctx);
        if let Some(hook) = gradient_hook(agent) {
            hook.before_step(&mut grads).await?;
        }
        Ok(self.opt.step(&grads)?)
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
        let _span = cx.agent().tracer().span(Cat::Optimizer, "optimizer step");
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
    /// creation errors surface at the first step). Hyper-parameters out of PyTorch's range
    /// fail here, before any owner's optimizer is made.
    pub fn new(
        agent: &Agent,
        kind: OptimizerKind,
        params: Vec<RRef<Parameter>>,
    ) -> Result<Self, AutogradError> {
        kind.check().map_err(AutogradError::State)?;
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
    pub async fn step(&self, ctx: &DistContext) -> Result<usize, AutogradError> {
        let id = ctx.id();
        let updated = self
            .on_owners(false, |_, opt| {
                // The step's own calls (the gradient hook's) are not part of the context.
                with_call_meta(CTX_KEY, None, opt.rpc_async(LocalStep, (id,)))
            })
            .await?;
        Ok(updated.into_iter().sum())
    }

    /// Sets the learning rate on every owner (for a schedule, e.g. once per epoch).
    pub async fn set_lr(&self, lr: f64) -> Result<(), AutogradError> {
        crate::optim::at_least_zero("learning rate", lr).map_err(AutogradError::State)?;
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
