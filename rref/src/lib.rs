//! Remote references: values that live on one worker (the owner) and are used from any worker
//! through [`RRef<T>`] handles, with distributed reference counting.
//!
//! Semantics follow PyTorch's Remote Reference Protocol (owner and user references, `RRefId`
//! and `ForkId`, guarantees G1 and G2), with deletion driven by Rust's `Drop`, not a garbage
//! collector: the owner keeps a value exactly as long as a handle to it exists anywhere,
//! whatever order the protocol's messages arrive in.
//!
//! Install the protocol's functions in every worker's registry with [`install`].
//!
//! # Layout
//! Each module depends only on those above it:
//! - `error`: [`RRefError`].
//! - `id`: [`RRefId`], [`ForkId`].
//! - `owner`: the owner's table, a pure state machine over signed fork counts (OWN-1…).
//! - `context`: per-agent state, the sharing rule, background messages (CTX-1…), [`DebugInfo`].
//! - `protocol`: the messages (`add_fork`, `child_accepted`, `delete_fork`, `fetch`, the
//!   keep sink of `remote`).
//! - `handle`: the state every clone of one reference shares: its fork, its standing with the
//!   owner, the delete its drop sends (G1).
//! - `rref`: [`RRef<T>`], [`remote`], [`LocalValue`].
#![deny(missing_docs)]

mod context;
mod error;
mod handle;
mod id;
mod owner;
mod protocol;
mod rref;

pub use context::{clear_owned, debug_info, set_message_jitter, DebugInfo};
pub use error::RRefError;
pub use id::{ForkId, RRefId};
pub use rref::{remote, LocalValue, PrependArg, RRef};

/// Adds the RRef protocol's functions and keep sink to a worker's registry.
pub fn install(
    builder: rpc_core::RegistryBuilder,
) -> Result<rpc_core::RegistryBuilder, rpc_core::RegistryError> {
    builder
        .register(protocol::AddFork)?
        .register(protocol::ChildAccepted)?
        .register(protocol::DeleteFork)?
        .register(protocol::Fetch)?
        .keep_sink(protocol::KEEP_SINK, protocol::keep_sink())
}
