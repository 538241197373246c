//! Tensors over RPC, device placement, and distributed autograd.
//!
//! - [`RTensor`]: a candle tensor that is a valid argument or result of any call (and of
//!   `remote`, `to_here` and RRef methods), raw bytes on the fastest path.
//! - [`DeviceSpec`]: `cpu` or `cuda:N` as plain data; CUDA behind the `cuda` feature.
//! - [`context`]: distributed autograd contexts; [`DistContext::backward`] runs backward
//!   across every worker the graph touched.
//! - [`DistributedOptimizer`]: steps every parameter where it lives (SGD, Adam, AdamW), with
//!   the same arithmetic as the local [`Optimizer`], a [`GradientHook`] for data-parallel
//!   replicas, and state export for checkpoints.
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
//! - `optim`: the local [`Optimizer`] and its update rules.
//! - `dist_optim`: [`DistributedOptimizer`], [`Parameter`], [`GradientHook`].
#![deny(missing_docs)]

mod device;
mod devmap;
mod dist_optim;
mod engine;
mod error;
mod optim;
mod record;
mod tensor;

pub use device::{DeviceError, DeviceSpec};
pub use devmap::{DeviceMapError, DeviceMaps};
pub use dist_optim::{
    parameter_rrefs, parameter_var, set_gradient_hook, DistributedOptimizer, GradientHook,
    LocalOptimizer, Parameter,
};
pub use engine::{context, gradients, live_contexts, DistContext};
pub use error::AutogradError;
pub use optim::{Gradients, Optimizer, OptimizerKind, OptimizerState};
pub use record::{current_context_id, CTX_KEY};
pub use tensor::RTensor;

/// Adds the engine's functions to a worker's registry.
pub fn install(
    builder: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    dist_optim::register(
        builder
            .register(engine::BackwardStep)?
            .register(engine::ReleaseContext)?,
    )
}
