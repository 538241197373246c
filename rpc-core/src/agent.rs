//! The [`Agent`]'s API for programs: the group and its members, calls (made by `call/`), bulk
//! blobs, and the group's membership and failures as this worker sees them. The handle's type
//! and identity are in `state.rs`, forming the group in `init.rs`, leaving it in `shutdown/`.
//!
//! Invariants:
//! - AG-1: a call to oneself runs the function directly, without serialization, under the same
//!   checks (registered, same signature), deadline and panic handling as a remote call.
//! - AG-2: a call's deadline is the earliest of its own timeout and the deadline of the call it
//!   is nested in; it travels to the callee as a relative duration.
//! - AG-3, AG-4, AG-5: shutdown (`shutdown/mod.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::call;
use crate::error::RpcError;
use crate::group::ToWorker;
use crate::net::{BulkStats, FailureWatch, MembershipWatch, WorkerFailed};
use crate::registry::RemoteFn;
use crate::state::{Agent, Registry};
use crate::wire::WorkerInfo;

impl Agent {
    /// Every worker that has joined the group (those that failed or left since included;
    /// not vacant ranks), by rank.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        self.inner.group.workers()
    }

    /// The identity of a worker named by name or rank.
    pub fn get_worker_info(&self, to: impl ToWorker) -> Result<&WorkerInfo, RpcError> {
        let rank = self.inner.group.resolve(&to)?;
        Ok(self.inner.group.worker(rank))
    }

    /// The name of a worker for messages: its name, or a description of the reference if it
    /// names no worker of the group.
    pub fn name_of(&self, to: impl ToWorker) -> String {
        self.inner.group.name_of(&to)
    }

    /// The address this worker's listener is reachable at, as advertised to its peers.
    pub fn local_addr(&self) -> &str {
        self.inner.group.my_addr()
    }

    /// The functions this worker serves.
    pub fn registry(&self) -> &Registry {
        &self.inner.callee.registry
    }

    /// The group's default call timeout (`Duration::ZERO`: none).
    pub fn rpc_timeout(&self) -> Duration {
        self.inner.caller.rpc_timeout
    }

    /// How long a wait made on the group's behalf may last (a message from a peer, a
    /// neighbour's tensor, a verdict): the group's call timeout, or, when it has none
    /// (`Duration::ZERO`), as long as a call without a deadline waits (a year).
    pub fn wait_bound(&self) -> Duration {
        match self.rpc_timeout() {
            t if t.is_zero() => crate::net::NO_DEADLINE,
            t => t,
        }
    }

    /// Calls `f` on `to` with the group's default timeout. Dropping the future cancels the
    /// call, on the callee too.
    ///
    /// As PyTorch's `rpc_async` does, the call starts when this is called: a call to another
    /// worker whose connection is up (and whose arguments have no bulk blobs) is queued before
    /// this returns, so work done before awaiting the future overlaps it. Otherwise (the
    /// first call to a peer, bulk arguments, a call to this worker) it starts when the future
    /// is first polled. The queued request leaves when the connection's task next runs: work
    /// done off the runtime's threads ([`spawn_blocking`](crate::spawn_blocking), a plain
    /// thread) overlaps it, but compute on the calling task itself holds its runtime thread,
    /// which tokio gives the connection's task next, so the request waits until the task
    /// yields.
    ///
    /// # Cancel safety
    /// Cancelling (dropping the future, polled or not) abandons the call; the callee's
    /// handler is aborted if it is still running, and the reply is still read in the
    /// background.
    pub fn rpc_async<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
    ) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static {
        self.rpc_async_timeout(to, f, args, self.rpc_timeout())
    }

    /// Like [`Agent::rpc_async`] with an explicit timeout (`Duration::ZERO`: none, though an
    /// enclosing call's deadline still applies).
    pub fn rpc_async_timeout<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        _f: F,
        args: F::Args,
        timeout: Duration,
    ) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static {
        call::call_fut::<F>(&self.inner, to, args, timeout, true)
    }

    /// Blocking [`Agent::rpc_async`], for code that is not async.
    ///
    /// Works from plain threads and from `spawn_blocking` or multi-threaded runtime threads
    /// (via `block_in_place`). From a current-thread runtime it returns
    /// [`RpcError::CannotBlock`] instead of deadlocking.
    ///
    /// A call to another worker over TCP goes on the calling thread's own connection to it,
    /// which the callee serves on a thread of its own: no runtime thread is involved at either
    /// end of the round trip (see [`Config::sync_connections`](crate::Config::sync_connections)).
    pub fn rpc_sync<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
    ) -> Result<F::Output, RpcError> {
        self.rpc_sync_timeout(to, f, args, self.rpc_timeout())
    }

    /// Blocking [`Agent::rpc_async_timeout`].
    pub fn rpc_sync_timeout<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        _f: F,
        args: F::Args,
        timeout: Duration,
    ) -> Result<F::Output, RpcError> {
        call::rpc_sync::<F>(&self.inner, to, args, timeout)
    }

    /// A blob of `len` bytes written by `fill`, built where sending it to `to` costs least.
    ///
    /// Where `to` runs on the same host and has mapped this worker's shared-memory arena (see
    /// [`Config::shm_arena_bytes`](crate::Config::shm_arena_bytes)), the blob is built in the arena: `fill` writes shared memory
    /// directly and sending the blob to `to` copies nothing. Otherwise (another host, no room,
    /// a small blob, no large blob sent to `to` yet) it is an ordinary blob. Either way it is an
    /// immutable [`Blob`](crate::Blob) that can be sent anywhere, any number of times.
    pub fn blob_for(
        &self,
        to: impl ToWorker,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<crate::Blob, RpcError> {
        let to = self.inner.group.resolve(&to)?;
        Ok(crate::Blob::new(
            self.inner.net.bulk.blob_for(to, len, fill),
        ))
    }

    /// This worker's trace recorder (see [`trace`](crate::trace)): off unless
    /// [`Config::trace`](crate::Config::trace) is set; layers and programs add their spans to it.
    pub fn tracer(&self) -> crate::trace::Tracer {
        self.inner.net.tracer.clone()
    }

    /// How this worker's large blobs have travelled so far: on the bulk connections' byte
    /// streams or through shared memory.
    pub fn bulk_stats(&self) -> BulkStats {
        self.inner.net.bulk.stats()
    }

    /// The workers this worker's failure detector declared failed so far (frozen, hung, cut
    /// off, or their process gone; see [`Config::failure_timeout`](crate::Config::failure_timeout)), by rank. Every wait on
    /// them has ended with [`RpcError::PeerFailed`].
    pub fn failed_workers(&self) -> Vec<WorkerFailed> {
        self.inner.net.membership.failures()
    }

    /// The verdicts of this worker's failure detector as they come, those already made first:
    /// a master reacts to a failed worker here.
    ///
    /// ```no_run
    /// # async fn demo(agent: rpc_core::Agent) {
    /// let mut failures = agent.watch_failures();
    /// while let Some(f) = failures.next().await {
    ///     eprintln!("worker `{}` (rank {}) failed: {}", f.name, f.rank, f.cause);
    /// }
    /// # }
    /// ```
    pub fn watch_failures(&self) -> FailureWatch {
        FailureWatch::new(Arc::clone(&self.inner.net.membership))
    }

    /// Which incarnation of its rank this process is: 0 for the process that formed the
    /// group, one more for each restarted process that replaced a failed one.
    pub fn incarnation(&self) -> u64 {
        self.inner.net.cfg.incarnation
    }

    /// The incarnation of worker `to` this worker knows (calls go to it).
    pub fn incarnation_of(&self, to: impl ToWorker) -> Result<u64, RpcError> {
        let rank = self.inner.group.resolve(&to)?;
        Ok(self.inner.net.directory().incarnation(rank))
    }

    /// The generation of this worker's view of the group: the number of changes (failures,
    /// leaves, replacements) it has seen.
    pub fn generation(&self) -> u64 {
        self.inner.net.membership.generation()
    }

    /// Whether worker `to` is, as far as this worker knows, a member that can be called: not
    /// declared failed, not left (a replaced worker is live again once its new incarnation
    /// joined).
    pub fn is_live(&self, to: impl ToWorker) -> Result<bool, RpcError> {
        let rank = self.inner.group.resolve(&to)?;
        let m = &self.inner.net.membership;
        Ok(!m.is_failed(rank) && !m.has_left(rank))
    }

    /// The changes of the group as they come, every change since this worker joined first:
    /// a worker failed, left, or a new incarnation joined (a restarted process in the place
    /// of a failed one, or a worker taking a vacant rank of a group that grows), each with its
    /// generation.
    ///
    /// ```no_run
    /// # async fn demo(agent: rpc_core::Agent) {
    /// use rpc_core::MembershipChange;
    /// let mut changes = agent.watch_membership();
    /// while let Some(e) = changes.next().await {
    ///     if let MembershipChange::Joined { .. } = e.change {
    ///         eprintln!("`{}` is back (incarnation {}), generation {}", e.name, e.incarnation, e.generation);
    ///     }
    /// }
    /// # }
    /// ```
    pub fn watch_membership(&self) -> MembershipWatch {
        MembershipWatch::new(Arc::clone(&self.inner.net.membership))
    }
}
