//! Tensors over RPC, device placement, and distributed autograd.
//!
//! ```
//! use autograd_dist::{DistributedOptimizer, OptimizerKind, Parameter, RTensor};
//! use candle_core::{Device, Tensor};
//! use rpc_core::{remote, testing, BoxError, CallContext, Registry, Secret, Transport};
//! use rref::RRef;
//!
//! /// On the worker that runs it: a weight `w = 2`, returned as a remote reference.
//! #[remote]
//! async fn weight(ctx: CallContext) -> Result<RRef<Parameter>, BoxError> {
//!     let w = Parameter::new(&Tensor::new(&[2f32], &Device::Cpu)?)?;
//!     Ok(RRef::new(ctx.agent(), w))
//! }
//!
//! /// `w * x` on the weight's owner.
//! #[remote]
//! async fn forward(_ctx: CallContext, w: RRef<Parameter>, x: RTensor) -> Result<RTensor, BoxError> {
//!     let w = autograd_dist::parameter_var(&w).await?;
//!     Ok(RTensor(x.mul(w.as_tensor())?))
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let registry = |_| {
//!     let b = Registry::builder().register(weight).unwrap().register(forward).unwrap();
//!     autograd_dist::install(rref::install(b).unwrap()).unwrap().build()
//! };
//! let workers =
//!     testing::start_group(2, Transport::Tcp, Secret::generate(), registry, |_, c| c).await?;
//! let (me, owner) = (&workers[0], &workers[1]);
//! let w = me.rpc_async("worker1", weight, ()).await?;
//! let opt = DistributedOptimizer::new(me, OptimizerKind::sgd(0.1), vec![w.clone()])?;
//!
//! let ctx = autograd_dist::context(me);
//! let x = RTensor(Tensor::new(&[3f32], &Device::Cpu)?);
//! // Calls made inside the context record the graph across workers.
//! let y = ctx
//!     .run(async { me.rpc_async("worker1", forward, (w.clone(), x)).await })
//!     .await?;
//! let loss = y.0.sum_all()?;
//! ctx.backward(&[loss]).await?; // runs on worker1 too
//! // The gradient stays where the weight lives: d(w x)/dw = x = 3.
//! let grads = autograd_dist::gradients(owner, ctx.id());
//! let g: Vec<f32> = grads.values().next().unwrap().to_vec1()?;
//! assert_eq!(g, [3.0]);
//! opt.step(&ctx).await?; // w = 2 - 0.1 * 3, stepped on worker1
//! let stepped: Parameter = w.to_here().await?;
//! assert!((stepped.0.as_tensor().to_vec1::<f32>()?[0] - 1.7).abs() < 1e-6);
//! drop((w, opt));
//! ctx.release().await?;
//! futures::future::join_all(workers.iter().map(|w| w.shutdown())).await;
//! # Ok(()) }
//! ```
//!
//! - [`RTensor`]: a candle tensor that is a valid argument or result of any call (and of
//!   `remote`, `to_here` and RRef methods), raw bytes on the fastest path.
//! - [`DeviceSpec`]: `cpu` or `cuda:N` as plain data; CUDA behind the `cuda` feature.
//! - [`context`]: distributed autograd contexts; [`DistContext::backward`] runs backward
//!   across every worker the graph touched.
//! - [`DistributedOptimizer`]: steps every parameter where it lives (SGD, Adam, AdamW), with
//!   the same arithmetic as the local [`Optimizer`], a [`GradientHook`] for data-parallel
//!   replicas, and state export for checkpoints.
//! - [`grad_once`]: a weight's product whose gradient candle's backward writes once instead
//!   of into zeros and a sum (a tenth of a CPU training step of a large MLP).
//!
//! Install the engine's functions in every worker's registry with [`install`].
//!
//! # Layout
//! Each module depends only on those above it (as candle stacks `backprop.rs` on `Tensor`, the
//! recording sits under the tensor codec and the engine over both):
//! - `error`: [`AutogradError`].
//! - `device`: device identity and creation (dummy CUDA module without the feature).
//! - `devmap`: per-peer device maps, inverted on the reply path (DM-1).
//! - `record`: the per-worker state of every context; the send and recv functions recorded as
//!   tensors cross workers.
//! - `tensor`: [`RTensor`], the wire form of tensors, calling the recording hooks.
//! - `engine`: [`DistContext`], backward across workers, release (AD-1…).
//! - `grad_once`: parameters' gradients taken from candle's backward as they are (ONCE-1).
//! - `optim`: the local [`Optimizer`] and its update rules.
//! - `dist_optim`: [`DistributedOptimizer`], [`Parameter`], [`GradientHook`].
//! - `module`: [`RemoteModule`], a [`Module`] built and held on another worker.
//! - `stage`: a pipeline stage's side of a step (its actions, hand-offs, saved activations).
//! - `pipeline`: [`Pipeline`], stages of remote modules trained on micro-batches (GPipe, 1F1B).
#![deny(missing_docs)]

mod device;
mod devmap;
mod dist_optim;
mod engine;
mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
pub mod grad_once;
mod memory;
mod module;
mod optim;
mod pipeline;
mod record;
mod stage;
mod tensor;

pub use device::{cuda_devices, DeviceError, DeviceSpec};
pub use devmap::{DeviceMapError, DeviceMaps};
pub use dist_optim::{
    parameter_rrefs, parameter_var, set_gradient_hook, DistributedOptimizer, GradientHook,
    LocalOptimizer, Parameter,
};
pub use engine::{context, gradients, live_contexts, DistContext};
pub use error::AutogradError;
pub use memory::retain_freed_memory;
pub use module::{register_module, Held, Module, RemoteModule};
pub use optim::{Gradients, Optimizer, OptimizerKind, OptimizerState};
pub use pipeline::{
    bubble_theory, Action, Loss, Pipeline, Schedule, Stage, StageEvent, StepReport,
};
pub use record::{current_context_id, CTX_KEY};
pub use tensor::RTensor;

/// Adds the engine's functions to a worker's registry.
pub fn install(
    builder: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    dist_optim::register(
        builder
            .register(engine::BackwardStep)?
            .register(engine::BackwardFrom)?
            .register(engine::ReleaseContext)?
            .register(stage::Deliver)?,
    )
}
