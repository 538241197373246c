//! Remote references: values that live on one worker (the owner) and are used from any worker
//! through [`RRef<T>`] handles, with distributed reference counting.
//!
//! Semantics follow PyTorch's Remote Reference Protocol (owner and user references, `RRefId`
//! and `ForkId`, guarantees G1 and G2), with deletion driven by Rust's `Drop`, not a garbage
//! collector: the owner keeps a value exactly as long as a handle to it exists anywhere,
//! whatever order the protocol's messages arrive in.
//!
//! ```
//! use rpc_core::{remote, testing, BoxError, CallContext, Registry, Secret, Transport};
//! use rref::RRef;
//!
//! /// A constructor: the counter it returns stays on the worker that runs it.
//! #[remote]
//! async fn counter(_ctx: CallContext, start: u64) -> Result<u64, BoxError> {
//!     Ok(start)
//! }
//!
//! /// A method: takes the reference first and reaches the value on its owner.
//! #[remote]
//! async fn add(_ctx: CallContext, c: RRef<u64>, n: u64) -> Result<u64, BoxError> {
//!     let value = c.local_value().await?;
//!     let mut v = value.lock().await;
//!     *v += n;
//!     Ok(*v)
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Every worker installs the protocol beside its own functions.
//! let registry = |_| {
//!     let b = Registry::builder().register(counter).unwrap().register(add).unwrap();
//!     rref::install(b).unwrap().build()
//! };
//! let workers =
//!     testing::start_group(2, Transport::Tcp, Secret::generate(), registry, |_, c| c).await?;
//! let me = &workers[0];
//! let c = rref::remote(me, "worker1", counter, (40,))?; // returns at once; lives on worker1
//! assert_eq!(c.rpc_async(add, (1,)).await?, 41); // a method, run on the owner
//! let sum: RRef<u64> = c.remote(add, (1,))?; // its result stays on the owner too
//! assert_eq!(sum.to_here().await?, 42); // a copy, fetched
//! assert_eq!(c.to_here().await?, 42);
//! drop((c, sum)); // the owner hears of it and frees both values
//! futures::future::join_all(workers.iter().map(|w| w.shutdown())).await;
//! # Ok(()) }
//! ```
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

pub use context::{clear_owned, debug_info, set_limits, set_message_jitter, DebugInfo};
pub use error::RRefError;
pub use id::{ForkId, RRefId};
pub use owner::Limits;
pub use rref::{remote, LocalValue, PrependArg, RRef};

/// What a hostile or broken peer could send, for the tests of the owner table's bounds.
#[doc(hidden)]
pub mod testing {
    use crate::id::{ForkId, RRefId};
    use rpc_core::{Agent, RpcError};

    /// Registers, with `owner`, a fork of the value `id` (which it may never have made), as a
    /// peer's `rref::add_fork` would.
    pub async fn register_fork(agent: &Agent, owner: u32, id: RRefId) -> Result<(), RpcError> {
        let fork = ForkId {
            created_on: agent.rank(),
            local: id.local,
        };
        agent
            .rpc_async(owner, crate::protocol::AddFork, (id, fork, owner))
            .await
    }
}

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
