//! Remote modules: a module built on a given worker and device, held there by an `RRef`, and
//! driven from anywhere (PyTorch's `RemoteModule`, typed).
//!
//! A module type implements [`Module`] (its constructor's arguments, its forward pass, its
//! parameters) and is registered in every worker's registry with [`register_module`], under
//! its [`Module::NAME`]. [`RemoteModule::new`] builds one on `"worker1/cpu"` or
//! `"worker2/cuda:0"`; [`RemoteModule::forward`] runs its forward pass there (inside a
//! [`DistContext::run`](crate::DistContext::run), the call records the graph like any call
//! with tensors, so a distributed backward reaches the module's parameters);
//! [`RemoteModule::remote_parameters`] hands its parameters to a
//! [`DistributedOptimizer`](crate::DistributedOptimizer), [`RemoteModule::state`] reads
//! their values for a checkpoint and [`RemoteModule::load_state`] puts them back.
//!
//! The module lives in an `RRef` owned by its worker: it stays there while any handle to it
//! exists anywhere, and goes when the last is dropped.

use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::{Tensor, Var};
use futures::future::BoxFuture;
use rpc_core::{Agent, BoxError, CallContext, RegistryBuilder, RegistryError, RemoteFn};
use rref::RRef;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};

use crate::device::DeviceSpec;
use crate::dist_optim::{parameter_rrefs, Parameter};
use crate::error::AutogradError;
use crate::stage::{stage_forget, stage_run, RunReply, RunReq, StageModule, StageOps};
use crate::tensor::RTensor;

/// A module that can live on another worker.
pub trait Module: Send + Sync + Sized + 'static {
    /// The name its remote calls are registered under: unique per module type in a group.
    const NAME: &'static str;
    /// What its constructor takes.
    type Init: Serialize + DeserializeOwned + Send + 'static;
    /// Builds the module, its parameters on `device`.
    fn new(init: Self::Init, device: &candle_core::Device) -> candle_core::Result<Self>;
    /// The forward pass.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;
    /// Its trainable parameters, in a fixed order.
    fn parameters(&self) -> Vec<Var>;
}

/// A module where it lives. Serializes as its parameters' values (what `to_here` of its
/// reference would copy); it is never rebuilt from them.
pub struct Held<M>(Arc<M>);

impl<M: Module> Serialize for Held<M> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let values: Vec<RTensor> = self
            .0
            .parameters()
            .iter()
            .map(|v| RTensor(v.as_tensor().detach()))
            .collect();
        values.serialize(s)
    }
}

/// What a module's remote function is asked.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
enum Op<M: Module> {
    New(M::Init, DeviceSpec),
    Forward(RRef<Held<M>>, RTensor),
    Parameters(RRef<Held<M>>),
    State(RRef<Held<M>>),
    LoadState(RRef<Held<M>>, Vec<RTensor>),
    StageRun(RRef<Held<M>>, RunReq),
    StageForget(u64, Option<u64>),
}

/// What it answers.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
enum Reply<M: Module> {
    New(RRef<Held<M>>),
    Forward(RTensor),
    Parameters(Vec<RRef<Parameter>>),
    State(Vec<RTensor>),
    LoadState,
    StageRun(RunReply),
    StageForget,
}

/// The remote function of module type `M` (registered under [`Module::NAME`]).
struct ModuleFn<M>(PhantomData<fn() -> M>);

impl<M: Module> RemoteFn for ModuleFn<M> {
    const NAME: &'static str = M::NAME;
    type Args = (Op<M>,);
    type Output = Reply<M>;
    async fn call(ctx: CallContext, (op,): (Op<M>,)) -> Result<Reply<M>, BoxError> {
        let held = |r: &RRef<Held<M>>| {
            let r = r.clone();
            async move { Ok::<_, BoxError>(Arc::clone(&r.local_value().await?.lock().await.0)) }
        };
        Ok(match op {
            Op::New(init, device) => {
                let m = M::new(init, &device.device()?)?;
                Reply::New(RRef::new(ctx.agent(), Held(Arc::new(m))))
            }
            Op::Forward(r, x) => Reply::Forward(RTensor(held(&r).await?.forward(&x.0)?)),
            Op::Parameters(r) => {
                Reply::Parameters(parameter_rrefs(ctx.agent(), held(&r).await?.parameters()))
            }
            Op::State(r) => Reply::State(
                held(&r)
                    .await?
                    .parameters()
                    .iter()
                    .map(|v| RTensor(v.as_tensor().detach()))
                    .collect(),
            ),
            Op::LoadState(r, values) => {
                load_values::<M>(&held(&r).await?.parameters(), values)?;
                Reply::LoadState
            }
            Op::StageRun(r, req) => {
                Reply::StageRun(stage_run(ctx.agent(), &Staged(held(&r).await?), req).await?)
            }
            Op::StageForget(pipe, abort) => {
                stage_forget(ctx.agent(), pipe, abort);
                Reply::StageForget
            }
        })
    }
}

/// Sets `params` to `values` (a [`RemoteModule::state`]), refusing a count or shape that
/// differs, before anything is set.
fn load_values<M: Module>(params: &[Var], values: Vec<RTensor>) -> Result<(), AutogradError> {
    if params.len() != values.len() {
        return Err(AutogradError::State(format!(
            "module {}: a state of {} tensors for {} parameters",
            M::NAME,
            values.len(),
            params.len()
        )));
    }
    for (i, (p, v)) in params.iter().zip(&values).enumerate() {
        if p.dims() != v.0.dims() {
            return Err(AutogradError::State(format!(
                "module {}: parameter {i} is {:?}, the state's tensor {:?}",
                M::NAME,
                p.dims(),
                v.0.dims()
            )));
        }
    }
    for (p, v) in params.iter().zip(values) {
        p.set(&v.0.to_dtype(p.dtype())?.to_device(p.device())?)?;
    }
    Ok(())
}

/// Adds the remote function of module type `M` to a worker's registry (every worker that
/// builds or drives such modules needs it).
pub fn register_module<M: Module>(
    builder: RegistryBuilder,
) -> Result<RegistryBuilder, RegistryError> {
    builder.register(ModuleFn::<M>(PhantomData))
}

/// A module of type `M` on another worker (or this one), held there while this handle or a
/// clone of it exists.
pub struct RemoteModule<M> {
    module: RRef<Held<M>>,
    agent: Agent,
}

impl<M> Clone for RemoteModule<M> {
    fn clone(&self) -> Self {
        Self {
            module: self.module.clone(),
            agent: self.agent.clone(),
        }
    }
}

impl<M: 'static> std::fmt::Debug for RemoteModule<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RemoteModule({} on `{}`)",
            std::any::type_name::<M>(),
            self.module.owner_name()
        )
    }
}

impl<M: Module> RemoteModule<M> {
    /// Builds a module on `place`, `"<worker>/<device>"` (`"worker1/cpu"`, `"trainer/cuda:0"`;
    /// the device defaults to `cpu`), from `init`.
    pub async fn new(agent: &Agent, place: &str, init: M::Init) -> Result<Self, AutogradError> {
        let (worker, device) = match place.rsplit_once('/') {
            Some((w, d)) => (w, d),
            None => (place, "cpu"),
        };
        let device: DeviceSpec = device.parse().map_err(|e: crate::DeviceError| {
            AutogradError::State(format!("module {} on {place:?}: {e}", M::NAME))
        })?;
        match call::<M>(agent, worker, Op::New(init, device)).await? {
            Reply::New(module) => Ok(Self {
                module,
                agent: agent.clone(),
            }),
            _ => Err(unexpected::<M>(worker)),
        }
    }

    /// Runs the forward pass where the module lives. Inside a
    /// [`DistContext::run`](crate::DistContext::run) the call is recorded for distributed
    /// backward (make the call inside it).
    pub fn forward_async(
        &self,
        x: Tensor,
    ) -> impl std::future::Future<Output = Result<Tensor, AutogradError>> + Send + 'static {
        let (agent, owner) = (self.agent.clone(), self.module.owner());
        let op = Op::Forward(self.module.clone(), RTensor(x));
        let fut = agent.rpc_async(owner, ModuleFn::<M>(PhantomData), (op,));
        let worker = self.module.owner_name();
        async move {
            match fut.await.map_err(|source| AutogradError::Rpc {
                worker: worker.clone(),
                source: Box::new(source),
            })? {
                Reply::Forward(y) => Ok(y.0),
                _ => Err(unexpected::<M>(&worker)),
            }
        }
    }

    /// [`RemoteModule::forward_async`], awaited.
    pub async fn forward(&self, x: Tensor) -> Result<Tensor, AutogradError> {
        self.forward_async(x).await
    }

    /// References to the module's parameters, for a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer) (PyTorch's `remote_parameters`).
    pub async fn remote_parameters(&self) -> Result<Vec<RRef<Parameter>>, AutogradError> {
        let owner = self.module.owner_name();
        match call::<M>(
            &self.agent,
            owner.as_str(),
            Op::Parameters(self.module.clone()),
        )
        .await?
        {
            Reply::Parameters(p) => Ok(p),
            _ => Err(unexpected::<M>(&owner)),
        }
    }

    /// The values of the module's parameters, in [`Module::parameters`] order (a checkpoint).
    pub async fn state(&self) -> Result<Vec<Tensor>, AutogradError> {
        let owner = self.module.owner_name();
        match call::<M>(&self.agent, owner.as_str(), Op::State(self.module.clone())).await? {
            Reply::State(s) => Ok(s.into_iter().map(|t| t.0).collect()),
            _ => Err(unexpected::<M>(&owner)),
        }
    }

    /// Sets the module's parameters to `state` (values in [`Module::parameters`] order, as
    /// [`RemoteModule::state`] returns them: a checkpoint restored). A count or a shape that
    /// differs is refused naming the parameter, and then nothing is set.
    pub async fn load_state(&self, state: Vec<Tensor>) -> Result<(), AutogradError> {
        let owner = self.module.owner_name();
        let values = state.into_iter().map(RTensor).collect();
        match call::<M>(
            &self.agent,
            owner.as_str(),
            Op::LoadState(self.module.clone(), values),
        )
        .await?
        {
            Reply::LoadState => Ok(()),
            _ => Err(unexpected::<M>(&owner)),
        }
    }

    /// The name of the worker the module lives on.
    pub fn owner_name(&self) -> String {
        self.module.owner_name()
    }
}

async fn call<M: Module>(
    agent: &Agent,
    worker: &str,
    op: Op<M>,
) -> Result<Reply<M>, AutogradError> {
    agent
        .rpc_async(worker, ModuleFn::<M>(PhantomData), (op,))
        .await
        .map_err(|source| AutogradError::Rpc {
            worker: worker.to_owned(),
            source: Box::new(source),
        })
}

fn unexpected<M: Module>(worker: &str) -> AutogradError {
    AutogradError::State(format!(
        "module {} on `{worker}` answered another request than asked",
        M::NAME
    ))
}

impl<M: Module> StageOps for RemoteModule<M> {
    fn worker(&self) -> String {
        self.module.owner_name()
    }

    fn rank(&self) -> u32 {
        self.module.owner().0
    }

    fn run(&self, req: RunReq) -> BoxFuture<'static, Result<RunReply, AutogradError>> {
        let (agent, worker) = (self.agent.clone(), self.worker());
        let op = Op::StageRun(self.module.clone(), req);
        Box::pin(async move {
            match call::<M>(&agent, &worker, op).await? {
                Reply::StageRun(r) => Ok(r),
                _ => Err(unexpected::<M>(&worker)),
            }
        })
    }

    fn forget(
        &self,
        pipe: u64,
        abort: Option<u64>,
    ) -> BoxFuture<'static, Result<(), AutogradError>> {
        let (agent, worker) = (self.agent.clone(), self.worker());
        Box::pin(async move {
            match call::<M>(&agent, &worker, Op::StageForget(pipe, abort)).await? {
                Reply::StageForget => Ok(()),
                _ => Err(unexpected::<M>(&worker)),
            }
        })
    }

    fn parameters(&self) -> BoxFuture<'static, Result<Vec<RRef<Parameter>>, AutogradError>> {
        let this = self.clone();
        Box::pin(async move { this.remote_parameters().await })
    }
}

/// A module as a pipeline stage sees it.
struct Staged<M>(Arc<M>);

impl<M: Module> StageModule for Staged<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
    fn parameters(&self) -> Vec<Var> {
        self.0.parameters()
    }
}
