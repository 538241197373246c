//! For authors of layers built on the RPC core (remote references, distributed autograd,
//! collectives), not for programs that only make calls: per-agent state, shutdown hooks, call
//! metadata, values that see the message they travel in, keep-calls.
//!
//! Most of it is reached through [`AgentExt`], implemented by [`Agent`]:
//!
//! ```
//! use rpc_core::ext::AgentExt;
//! use std::sync::atomic::{AtomicU64, Ordering};
//!
//! /// A layer's per-agent state, created on first use.
//! #[derive(Default)]
//! struct Counter(AtomicU64);
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use rpc_core::{testing, Registry, Secret, Transport};
//! let agents =
//!     testing::start_group(1, Transport::Tcp, Secret::generate(), |_| Registry::default(), |_, c| c)
//!         .await?;
//! let agent = &agents[0];
//! agent.extension(Counter::default).0.fetch_add(1, Ordering::Relaxed);
//! assert_eq!(agent.extension(Counter::default).0.load(Ordering::Relaxed), 1);
//! agent.shutdown().await;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::Arc;

use crate::error::RpcError;
use crate::group::ToWorker;
use crate::registry::RemoteFn;
use crate::state::Agent;
pub use crate::state::WeakAgent;

pub use crate::blob::Payload;
pub use crate::context::{call_meta, with_call_meta};
pub use crate::layers::{MetaProvider, ShutdownHook};
pub use crate::net::large_vec;
pub use crate::state::{KeepSink, KeptValue, MessageContext, MessageKind};
pub use crate::wire::CallMeta;

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::Agent {}
}

/// What layers built on the RPC core use of an [`Agent`]. Sealed: only `Agent` implements it.
pub trait AgentExt: sealed::Sealed {
    /// Per-agent state of type `T` for a layer built on the agent (created by `init` on first
    /// use). One value per type per agent.
    fn extension<T: Send + Sync + 'static>(&self, init: impl FnOnce() -> T) -> Arc<T>;

    /// Registers work that `shutdown` runs (concurrently with other hooks, bounded by the
    /// shutdown timeout) before the group barrier, while every peer still serves.
    fn on_shutdown(&self, hook: ShutdownHook);

    /// Sets the call-metadata key `key` of every outgoing remote call (calls to oneself run
    /// without serialization and keep the caller's metadata) to what `provider` returns for
    /// the call's destination. Unlike [`with_call_meta`], the value is per destination and per
    /// hop: a callee's own calls get its own providers' values. Replaces an earlier provider
    /// of the same key.
    fn set_meta_provider(&self, key: &'static str, provider: MetaProvider);

    /// A handle that does not keep the agent alive.
    fn downgrade(&self) -> WeakAgent;

    /// Runs `hook` whenever the failure detector declares a worker failed, after the network
    /// layer has closed every connection to it and failed what waited on them. It runs on
    /// the detector's thread: it must return quickly (spawn on the agent's runtime for work
    /// that waits).
    fn on_worker_failed(&self, hook: impl Fn(&crate::WorkerFailed) + Send + Sync + 'static);

    /// Runs `hook` with the rank whenever a new incarnation of a failed worker has joined the
    /// group in its place (`Agent::incarnation_of` already names the new one). Like
    /// [`AgentExt::on_worker_failed`], it must return quickly.
    fn on_worker_rejoined(&self, hook: impl Fn(u32) + Send + Sync + 'static);

    /// Whether the process of worker `rank` is known to be gone: uses the live connection if
    /// there is one (then it is not gone), else redials and reports `true` only when nothing
    /// listens at the worker's address (connection refused). A live but slow, frozen or
    /// partitioned peer reads as not gone; so does this worker and an unknown rank.
    fn peer_gone(&self, rank: u32) -> impl Future<Output = bool> + Send;

    /// Runs `f` on `to` and keeps its result there: instead of returning it, the callee hands
    /// the typed result (or the error) to the keep sink registered there under `sink`, with
    /// `token`. Resolves once the sink has taken it. This is how a layer above creates values
    /// that live on another worker (remote references).
    ///
    /// Unlike `Agent::rpc_async`, the request is queued when this is called if it can be
    /// without waiting (the connection to `to` is up and no argument takes the bulk path), so
    /// it goes out ahead of anything the caller sends to `to` next; the future then only waits
    /// for the answer. The arguments stay alive in the future until the call ends.
    ///
    /// # Cancel safety
    /// Dropping the future before it ends cancels the call, as dropping an `rpc_async` future
    /// does (a cancel message; the answer is still read in the background); whether the sink
    /// ran is then unknown.
    fn rpc_keep<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
        sink: &'static str,
        token: Vec<u8>,
    ) -> impl Future<Output = Result<(), RpcError>> + Send + 'static;
}

impl AgentExt for Agent {
    fn extension<T: Send + Sync + 'static>(&self, init: impl FnOnce() -> T) -> Arc<T> {
        self.inner.layers.extension(init)
    }

    fn on_shutdown(&self, hook: ShutdownHook) {
        self.inner.layers.on_shutdown(hook);
    }

    fn set_meta_provider(&self, key: &'static str, provider: MetaProvider) {
        self.inner.layers.set_provider(key, provider);
    }

    fn downgrade(&self) -> WeakAgent {
        WeakAgent(Arc::downgrade(&self.inner))
    }

    fn on_worker_failed(&self, hook: impl Fn(&crate::WorkerFailed) + Send + Sync + 'static) {
        self.inner.net.membership.on_failure(Arc::new(hook));
    }

    fn on_worker_rejoined(&self, hook: impl Fn(u32) + Send + Sync + 'static) {
        self.inner.net.membership.on_rejoin(Arc::new(hook));
    }

    fn peer_gone(&self, rank: u32) -> impl Future<Output = bool> + Send {
        crate::shutdown::peer_gone(self, rank)
    }

    fn rpc_keep<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        _f: F,
        args: F::Args,
        sink: &'static str,
        token: Vec<u8>,
    ) -> impl Future<Output = Result<(), RpcError>> + Send + 'static {
        crate::call::rpc_keep::<F>(&self.inner, to, args, sink, token)
    }
}
