//! The worker: one [`Agent`] per worker ties the pieces together, each a narrow handle of its
//! own: who is who ([`Group`]), the network ([`Net`]), the lifecycle, the callee's and the
//! caller's state, what layers attached, and the shutdown barrier. [`init`] forms the group
//! and starts serving; the calls themselves are the caller's path (`call/`) and the callee's
//! (`dispatch.rs`).
//!
//! Invariants:
//! - AG-1: a call to oneself runs the function directly, without serialization, under the same
//!   checks (registered, same signature), deadline and panic handling as a remote call.
//! - AG-2: a call's deadline is the earliest of its own timeout and the deadline of the call it
//!   is nested in; it travels to the callee as a relative duration.
//! - AG-3, AG-4, AG-5: shutdown (`shutdown.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::call::{self, Caller};
use crate::config::Config;
use crate::dispatch::Callee;
use crate::error::{InitError, LeaveError, RpcError};
use crate::ext::Layers;
use crate::group::{Group, ToWorker};
use crate::lifecycle::Lifecycle;
use crate::net::{
    BulkStats, Directory, FailureWatch, MembershipWatch, Net, PeerState, Standing, WorkerFailed,
};
use crate::registry::{Registry, RemoteFn};
use crate::rendezvous::{self, Join, RendezvousServer, Report};
use crate::shutdown::{self, ShutdownReport};
use crate::wire::WorkerInfo;
use tokio::sync::mpsc;

/// What one worker is made of.
pub(crate) struct Inner {
    /// Who is who: this worker and the group, by rank and by name.
    pub group: Group,
    /// Connections, framing, bulk data: everything on the wire.
    pub net: Arc<Net>,
    /// Running, stopping, closed; the tokens and trackers shutdown drives.
    pub life: Arc<Lifecycle>,
    /// The callee's side: registry, admission, running cancellable calls.
    pub callee: Callee,
    /// The caller's side: default timeout, blocking connections, cancel ids.
    pub caller: Caller,
    /// What layers above attached: per-agent state, shutdown hooks, metadata providers.
    pub layers: Layers,
    /// The shutdown barrier and the report of the first shutdown.
    pub shutdown: shutdown::State,
    /// This worker's reports to the rendezvous (its membership link; see `rendezvous::follow`).
    pub reports: mpsc::Sender<Report>,
    /// The rendezvous this worker hosts, if it does: it serves the group's membership as long
    /// as this worker lives.
    pub rendezvous: std::sync::Mutex<Option<RendezvousServer>>,
}

/// A worker's handle on its group. Cheap to clone; all clones share one worker.
///
/// ```
/// use rpc_core::{remote, BoxError, CallContext, Config, Registry, Secret, Transport, MemoryNetwork};
///
/// #[remote]
/// async fn add(_ctx: CallContext, a: i32, b: i32) -> Result<i32, BoxError> {
///     Ok(a + b)
/// }
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let net = MemoryNetwork::new();
/// let secret = Secret::generate();
/// let start = |rank: u32| {
///     let cfg = Config::new()
///         .with_rank(rank)
///         .with_world_size(2)
///         .with_init_method("tcp://rendezvous:1")
///         .with_transport(Transport::Memory(net.clone()))
///         .with_secret(secret.clone());
///     rpc_core::init(cfg, Registry::builder().register(add).unwrap().build())
/// };
/// let (a, b) = tokio::try_join!(start(0), start(1))?;
/// assert_eq!(a.rpc_async("worker1", add, (2, 3)).await?, 5);
/// tokio::join!(a.shutdown(), b.shutdown());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("me", self.worker_info())
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// A handle that does not keep the agent alive; [`WeakAgent::upgrade`] it to use it.
#[derive(Clone)]
pub struct WeakAgent(pub(crate) std::sync::Weak<Inner>);

impl WeakAgent {
    /// The agent, if it still exists.
    pub fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|inner| Agent { inner })
    }
}

impl std::fmt::Debug for WeakAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeakAgent")
    }
}

/// Forms the group: binds this worker's listener, meets every peer at the rendezvous, and
/// starts serving `registry`. Returns once every rank is known.
///
/// Must run inside a Tokio runtime; the agent's tasks run on it.
///
/// # Cancel safety
/// Not cancel safe: dropping the future mid-way leaves this rank missing from the rendezvous,
/// which then fails for the other ranks with this rank named.
pub async fn init(config: Config, registry: Registry) -> Result<Agent, InitError> {
    let cfg = config.resolve()?;
    let net_cfg = &cfg.net;
    let bind_error = |source| InitError::Bind {
        addr: cfg.listen_addr.clone(),
        source,
    };
    let listener = net_cfg
        .transport
        .bind(&cfg.listen_addr)
        .await
        .map_err(bind_error)?;
    let my_addr = listener.local_addr().map_err(bind_error)?;
    // The failure detector's own listener, on the same host, served by its own thread.
    let heartbeats = if net_cfg.heartbeat_interval.is_zero() {
        None
    } else {
        let host = cfg.listen_addr.rsplit_once(':').map_or("", |(h, _)| h);
        let addr = format!("{host}:0");
        let l = net_cfg
            .transport
            .bind_detached(&addr)
            .map_err(|source| InitError::Bind { addr, source })?;
        Some(l)
    };
    let heartbeat_addr = match &heartbeats {
        Some(l) => l.local_addr().map_err(bind_error)?,
        None => String::new(),
    };
    let server = if cfg.serve_rendezvous {
        let (t, secret) = (&net_cfg.transport, net_cfg.secret.clone());
        Some(RendezvousServer::start(t, &cfg.rendezvous, secret, cfg.size, cfg.init_timeout).await?)
    } else {
        None
    };
    let join = Join {
        name: cfg.name.clone(),
        rank: net_cfg.rank,
        size: cfg.size,
        addr: my_addr,
        heartbeat: heartbeat_addr,
        replace: cfg.replace,
    };
    let (view, link) = rendezvous::join(
        &net_cfg.transport,
        &cfg.rendezvous,
        &net_cfg.secret,
        net_cfg.protection,
        join,
        cfg.init_timeout,
    )
    .await?;
    let me = net_cfg.rank;
    let mut net_cfg = cfg.net;
    net_cfg.incarnation = view.members[me as usize].endpoint.incarnation;
    let standing: Vec<_> = view.members.iter().map(|m| m.standing.clone()).collect();
    let directory = Arc::new(Directory::new(
        view.members
            .into_iter()
            .map(|m| (m.standing != Standing::Vacant).then_some(m.endpoint))
            .collect(),
    ));
    let life = Arc::new(Lifecycle::new());
    // Bounded: reports are a worker's few verdicts and one leave; one that finds the queue
    // full is dropped (the rendezvous hears of it from another member).
    let (reports, reports_rx) = mpsc::channel(256);
    let incarnation = net_cfg.incarnation;
    let inner = Arc::new(Inner {
        group: Group::new(me, Arc::clone(&directory)),
        callee: Callee::new(registry, cfg.max_concurrent_calls),
        caller: Caller::new(cfg.rpc_timeout, cfg.sync_connections),
        layers: Layers::default(),
        shutdown: shutdown::State::new(cfg.shutdown_timeout, cfg.replaced_on_failure),
        net: Arc::new(Net::new(
            net_cfg,
            directory,
            Arc::clone(&life),
            view.generation,
            &standing,
        )),
        life,
        reports,
        rendezvous: std::sync::Mutex::new(server),
    });
    {
        let world = inner.group.size();
        // The barrier waits for no rank that is vacant, left or failed as this worker joins.
        for (r, st) in standing.iter().enumerate() {
            match st {
                Standing::Vacant | Standing::Left => inner.shutdown.depart(r as u32, world),
                Standing::Failed(_) => inner.shutdown.excuse(r as u32, world),
                Standing::Alive => {}
            }
        }
        // AG-6: the shutdown barrier does not wait for a worker declared failed.
        let weak = Arc::downgrade(&inner);
        inner
            .net
            .membership
            .on_failure(Arc::new(move |f: &WorkerFailed| {
                if let Some(inner) = weak.upgrade() {
                    inner.shutdown.excuse(f.rank, world);
                    // The group hears of this worker's verdicts (RDV-3).
                    if f.rank != me {
                        let _ = inner.reports.try_send(Report::Failed {
                            rank: f.rank,
                            incarnation: f.incarnation,
                            cause: f.cause.clone(),
                        });
                    }
                }
            }));
        // A rank that left does not come to the barrier; a new incarnation of one does.
        let weak = Arc::downgrade(&inner);
        inner.net.membership.on_left(Arc::new(move |rank| {
            if let Some(inner) = weak.upgrade() {
                inner.shutdown.depart(rank, world);
            }
        }));
        let weak = Arc::downgrade(&inner);
        inner.net.membership.on_rejoin(Arc::new(move |rank| {
            if let Some(inner) = weak.upgrade() {
                inner.shutdown.readmit(rank);
            }
        }));
    }
    tokio::spawn(rendezvous::follow(
        link,
        Arc::clone(&inner.net.membership),
        reports_rx,
        Arc::clone(&inner.life),
        me,
    ));
    inner.net.serve(listener, Arc::clone(&inner), heartbeats);
    let agent = Agent { inner };
    tracing::info!(worker = %agent.name(), rank = agent.rank(), incarnation, world = agent.world_size(), "joined group");
    Ok(agent)
}

impl Agent {
    /// This worker's name.
    pub fn name(&self) -> &str {
        &self.worker_info().name
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.inner.group.rank()
    }

    /// Number of ranks of the group: ranks are `0..world_size()`. In a group that may grow
    /// ([`Config::max_world_size`](crate::Config::max_world_size)) this is its capacity, and
    /// ranks no worker has joined yet are vacant ([`Agent::worker_infos`] lists those that
    /// have joined).
    pub fn world_size(&self) -> usize {
        self.inner.group.size()
    }

    /// This worker's identity.
    pub fn worker_info(&self) -> &WorkerInfo {
        self.inner.group.worker(self.rank())
    }

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

    /// The runtime the agent runs on (for work started from synchronous code such as `Drop`).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.inner.net.runtime
    }

    /// The functions this worker serves.
    pub fn registry(&self) -> &Registry {
        &self.inner.callee.registry
    }

    /// The group's default call timeout (`Duration::ZERO`: none).
    pub fn rpc_timeout(&self) -> Duration {
        self.inner.caller.rpc_timeout
    }

    /// Calls `f` on `to` with the group's default timeout. Dropping the future cancels the
    /// call, on the callee too.
    ///
    /// As PyTorch's `rpc_async` does, the call starts when this is called: a call to another
    /// worker whose connection is up (and whose arguments have no bulk blobs) is queued before
    /// this returns, so work done before awaiting the future overlaps it. Otherwise (the
    /// first call to a peer, bulk arguments, a call to this worker) it starts when the future
    /// is first polled.
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
        call::call_fut::<F>(self, to, args, timeout, true)
    }

    /// Blocking [`Agent::rpc_async`], for code that is not async.
    ///
    /// Works from plain threads and from `spawn_blocking` or multi-threaded runtime threads
    /// (via `block_in_place`). From a current-thread runtime it returns
    /// [`RpcError::CannotBlock`] instead of deadlocking.
    ///
    /// A call to another worker over TCP goes on the calling thread's own connection to it,
    /// which the callee serves on a thread of its own: no runtime thread is involved at either
    /// end of the round trip (see [`Config::sync_connections`]).
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
        call::rpc_sync::<F>(self, to, args, timeout)
    }

    /// A blob of `len` bytes written by `fill`, built where sending it to `to` costs least.
    ///
    /// Where `to` runs on the same host and has mapped this worker's shared-memory arena (see
    /// [`Config::shm_arena_bytes`]), the blob is built in the arena: `fill` writes shared memory
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

    /// How this worker's large blobs have travelled so far: on the bulk connections' byte
    /// streams or through shared memory.
    pub fn bulk_stats(&self) -> BulkStats {
        self.inner.net.bulk.stats()
    }

    /// The workers this worker's failure detector declared failed so far (frozen, hung, cut
    /// off, or their process gone; see [`Config::failure_timeout`]), by rank. Every wait on
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

    /// Leaves the running group gracefully while the others go on: the layers above finish
    /// their protocol traffic (shutdown hooks), the rendezvous tells every member (their
    /// calls to this worker are refused from then on with
    /// [`RpcError::PeerLeft`], and their shutdown does not wait for it), calls in flight
    /// drain, then connections close. Later calls of [`Agent::shutdown`] return this report.
    /// Each step is bounded by the shutdown timeout.
    ///
    /// Rank 0 cannot leave (it hosts the shutdown barrier).
    pub async fn leave(&self) -> Result<ShutdownReport, LeaveError> {
        let worker = self.name().to_owned();
        if self.rank() == 0 {
            return Err(LeaveError::RankZero { worker });
        }
        if self.is_shutting_down() {
            return Err(LeaveError::ShuttingDown { worker });
        }
        let timeout = self.inner.shutdown.timeout;
        let hooks = self.inner.layers.shutdown_hooks();
        if tokio::time::timeout(timeout, futures::future::join_all(hooks))
            .await
            .is_err()
        {
            tracing::warn!(worker = %worker, "shutdown hooks did not finish in time");
        }
        // Peers' detectors first hear that this worker is leaving (they stop watching it), so
        // none takes its departure for a failure before the rendezvous's word reaches it.
        self.inner.net.leave().await;
        if self.inner.reports.send(Report::Leaving).await.is_err() {
            return Err(LeaveError::NoRendezvous { worker });
        }
        // The rendezvous's echo of the leave is its acknowledgement.
        let membership = &self.inner.net.membership;
        let me = self.rank();
        let confirmed = tokio::time::timeout(timeout, async {
            let mut changes = self.watch_membership();
            while membership.state(me) != PeerState::Left {
                if changes.next().await.is_none() {
                    return false;
                }
            }
            true
        })
        .await;
        match confirmed {
            Ok(true) => Ok(shutdown::leave(self, timeout).await),
            Ok(false) => Err(LeaveError::NoRendezvous { worker }),
            Err(_) => Err(LeaveError::Unconfirmed { worker, timeout }),
        }
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.life.is_stopping()
    }

    /// Leaves the group gracefully: a group-wide barrier (every worker has called shutdown),
    /// then new calls are refused while calls in flight finish, then connections close.
    /// Each phase is bounded by the shutdown timeout, so a worker whose peers vanished still
    /// returns. Idempotent: later calls return the first call's report.
    ///
    /// # Cancel safety
    /// Cancel safe in the sense that a later call resumes and finishes the same shutdown.
    pub async fn shutdown(&self) -> ShutdownReport {
        shutdown::shutdown(self, self.inner.shutdown.timeout).await
    }

    /// [`Agent::shutdown`] with `timeout` per phase instead of the configured one: after a
    /// failure, a worker leaves quickly instead of waiting out the group's generous timeout
    /// for traffic with peers that are gone. Only the first call of either decides.
    pub async fn shutdown_within(&self, timeout: Duration) -> ShutdownReport {
        shutdown::shutdown(self, timeout).await
    }
}
