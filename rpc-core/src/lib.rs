//! Typed remote calls between worker processes.
//!
//! Workers form a group (rendezvous over TCP, torchrun/Slurm/Open MPI variables), register
//! functions under stable names, and call each other's functions with typed arguments and
//! results: [`Agent::rpc_async`] returns a future (dropping it cancels the call on the callee),
//! [`Agent::rpc_sync`] blocks. Every call has a deadline that nested calls inherit; nested
//! calls of any depth cannot deadlock (no fixed pool); every connection is authenticated with
//! the group's shared secret before anything is decoded; shutdown is a bounded, two-phase,
//! group-wide barrier.
//!
//! ```
//! use rpc_core::{remote, BoxError, CallContext, Config, MemoryNetwork, Registry, Secret, Transport};
//!
//! /// Adds two numbers on whichever worker is called.
//! #[remote]
//! async fn add(_ctx: CallContext, a: i32, b: i32) -> Result<i32, BoxError> {
//!     Ok(a + b)
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let net = MemoryNetwork::new(); // or Transport::Tcp with tcp://host:port
//! let secret = Secret::generate();
//! let agents = futures::future::try_join_all((0..3).map(|rank| {
//!     let cfg = Config::new()
//!         .with_rank(rank)
//!         .with_world_size(3)
//!         .with_init_method("tcp://rendezvous:1")
//!         .with_transport(Transport::Memory(net.clone()))
//!         .with_secret(secret.clone());
//!     rpc_core::init(cfg, Registry::builder().register(add).unwrap().build())
//! }))
//! .await?;
//! assert_eq!(agents[0].rpc_async("worker2", add, (1, 2)).await?, 3);
//! futures::future::join_all(agents.iter().map(|a| a.shutdown())).await;
//! # Ok(())
//! # }
//! ```
//!
//! Layers built on top (remote references, distributed autograd, collectives) use the items
//! in [`ext`]; a program that only makes calls needs none of them.
//!
//! # Layout
//! Each module depends only on those before it in this list (no circle: `tests/tests/
//! layering.rs` checks it). See `docs/architecture.md` for one call's path through them.
//!
//! - `error`, `bounded`, `wire`, `lifecycle`: the error types, bounded decoding, what travels on
//!   the wire ([`WorkerInfo`], the envelope, [`ext::CallMeta`]), running/stopping/closed.
//! - `net`: the network layer. Transports, the handshake ([`Secret`]), the directory and the
//!   one dialer, tarpc's frames, the multiplexed connection's two ends, blocking connections,
//!   the bulk path and shared memory, busy polling, the failure detector and the membership
//!   view. It never names the agent: it hands each request it reads to the `Serve` seam.
//! - `config`: [`Config`], every environment variable it reads, its resolution.
//! - `group`, `rendezvous`: the group by rank and name ([`ToWorker`]); group formation, then
//!   the membership service ([`RendezvousServer`]).
//! - `cancel`, `layers`, `shutdown::state`: cancellation's two sides; what layers attach; the
//!   shutdown barrier's state.
//! - `state`: the worker's state as data: [`Agent`], `Inner`, [`CallContext`], the
//!   registry's types ([`Registry`]).
//! - `blob`, `context`, `registry`: [`Blob`] and encoding with side tables; scopes
//!   ([`CallScope`], [`spawn`]); [`RemoteFn`] and the erasure of handlers.
//! - `dispatch`: the callee, one path for requests from the wire, calls to oneself and
//!   blocking connections (admission, panics, keep-calls).
//! - `call`: the caller, plan, send, reply, blocking.
//! - `agent`, `shutdown`, `signals`, `view_sync`, `init`: the [`Agent`] API; leaving the group
//!   ([`Agent::shutdown`], [`Agent::wait_for_group`]); an orderly end on SIGTERM; waiting
//!   until the others know a replacement ([`Agent::await_known`]); [`init`].
//! - [`ext`]: the layer-author API. [`testing`]: whole groups in one process, crafted
//!   frames, fuzz-target replay. `fuzz` (tests and the `fuzzing` feature only): the entry
//!   points of the fuzz targets in `fuzz/`.
#![deny(missing_docs)]

extern crate self as rpc_core;

mod agent;
mod blob;
mod bounded;
mod call;
mod cancel;
mod config;
mod context;
mod dispatch;
mod error;
pub mod ext;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
mod group;
mod init;
mod layers;
mod lifecycle;
mod net;
mod registry;
mod rendezvous;
mod shutdown;
mod signals;
mod state;
pub mod testing;
pub mod trace;
mod view_sync;
mod wire;

pub use blob::Blob;
pub use call::wait_all;
pub use config::{
    launched_rank, launched_restart_count, Config, FAILURE_TIMEOUT_ENV, HEARTBEAT_INTERVAL_ENV,
    JOB_ID_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV, MAX_WORLD_SIZE_ENV, RANK_ENV, RENDEZVOUS_FD_ENV,
    REPLACE_TOKEN_ENV, RESTART_COUNT_ENV, RESTART_MODE_ENV, SERVE_RENDEZVOUS_ENV, SIGNAL_GRACE_ENV,
    TORCHRUN_AGENT_STORE_ENV, WIRE_PROTECTION_ENV, WORLD_SIZE_ENV,
};
pub use context::{spawn, spawn_blocking, CallScope};
pub use error::{
    error_chain, BoxError, CodecError, InitError, LeaveError, RemoteError, RemoteErrorKind,
    RpcError,
};
pub use group::{ToWorker, WorkerRef};
pub use init::init;
pub use net::supervisor;
pub use net::supervisor::SUPERVISOR_FD_ENV;
pub use net::{
    BulkStats, FailureWatch, MembershipChange, MembershipEvent, MembershipWatch, MemoryNetwork,
    Secret, Transport, WireProtection, WorkerFailed, SECRET_ENV, SECRET_FILE_ENV,
};
pub use registry::{RegistryBuilder, RegistryError, RemoteFn};
pub use rendezvous::{probe_rendezvous, GroupSize, RendezvousServer};
pub use rpc_macros::remote;
pub use shutdown::{JobFailed, ShutdownReport};
pub use state::Agent;
pub use state::CallContext;
pub use state::Registry;
pub use wire::{WorkerId, WorkerInfo};

/// Support for the [`remote`] attribute's expansion; not an API.
#[doc(hidden)]
pub mod __private {
    pub use crate::registry::IntoHandlerResult;
}
