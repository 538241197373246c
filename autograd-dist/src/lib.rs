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
//! - `tensor`: the wire form of tensors and the send/recv hooks.
//! - `device`: device identity and creation (dummy CUDA module without the feature).
//! - `devmap`: per-peer device maps, inverted on the reply path (DM-1).
//! - `engine`: contexts, recording, backward, release (AD-1…).
//! - `optim`: [`DistributedOptimizer`], [`Parameter`].
//! - `error`: [`AutogradError`].
#![deny(missing_docs)]

mod device;
mod devmap;
mod engine;
mod error;
mod optim;
mod tensor;

pub use device::{DeviceError, DeviceSpec};
pub use devmap::{DeviceMapError, DeviceMaps};
pub use engine::{context, current_context_id, gradients, live_contexts, DistContext, CTX_KEY};
pub use error::AutogradError;
pub use optim::{
    parameter_rrefs, parameter_var, set_gradient_hook, DistributedOptimizer, GradientHook,
    Gradients, LocalOptimizer, Optimizer, OptimizerKind, OptimizerState, Parameter,
};
pub use tensor::RTensor;

/// Adds the engine's functions to a worker's registry.
pub fn install(
    builder: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    optim::register(
        builder
            .register(engine::BackwardStep)?
            .register(engine::ReleaseContext)?,
    )
}
