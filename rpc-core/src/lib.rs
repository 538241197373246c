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
//! # Layout
//! - `wire`: worker identity, the call envelope and reply, signature fingerprints.
//! - `blob`: [`Blob`], bytes carried in a side table beside the serde payload.
//! - `transport`: TCP and the in-memory network behind one byte-stream abstraction.
//! - `auth`: the group [`Secret`] and the HMAC connection handshake.
//! - `registry`: [`RemoteFn`], [`Registry`].
//! - `context`: [`CallContext`], inherited deadlines and depth.
//! - `config`: [`Config`] and its resolution from the environment.
//! - `rendezvous`: group formation, [`RendezvousServer`].
//! - `client`: per-peer outgoing control connections.
//! - `mux`: calls multiplexed on a control connection (tarpc's frames, our dispatch).
//! - `server`: the accept loop, admission, panic isolation.
//! - `bulk`: the raw data path for large blobs, [`BulkStats`].
//! - `shm`: shared-memory arenas for bulk blobs between workers on one host.
//! - `agent`: [`Agent`], [`init`], calls and shutdown.
//! - `direct`: blocking calls on the calling thread's own connection.
//! - `cancel`: cancelling calls whose arguments lent something, by message.
//! - `spin`: busy polling before sleeping ([`Config::busy_poll`]): the runtime's polling task and
//!   `block_on` for plain threads.
//! - [`testing`]: start a whole group in one process; raw connections for protocol tests.
//! - `error`: [`RpcError`], [`InitError`], [`RemoteError`].
#![deny(missing_docs)]

extern crate self as rpc_core;

mod agent;
mod auth;
mod blob;
mod bulk;
mod cancel;
mod client;
mod config;
mod context;
mod direct;
mod error;
mod mux;
mod registry;
mod rendezvous;
mod server;
mod shm;
mod spin;
pub mod testing;
mod transport;
mod wire;

pub use agent::{
    init, wait_all, Agent, ShutdownHook, ShutdownReport, ToWorker, WeakAgent, WorkerRef,
};
pub use auth::{Secret, SECRET_ENV, SECRET_FILE_ENV};
pub use blob::{large_vec, Blob, MessageContext, MessageKind, Payload};
pub use bulk::BulkStats;
pub use config::Config;
pub use context::{call_meta, with_call_meta, CallContext, CallMeta};
pub use error::{
    error_chain, BoxError, CodecError, InitError, RemoteError, RemoteErrorKind, RpcError,
};
pub use registry::{
    IntoHandlerResult, KeepSink, KeptValue, Registry, RegistryBuilder, RegistryError, RemoteFn,
};
pub use rendezvous::RendezvousServer;
pub use rpc_macros::remote;
pub use transport::{MemoryNetwork, Transport};
pub use wire::{WorkerId, WorkerInfo};
