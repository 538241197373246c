//! The worker runtime: one [`Agent`] per worker ties the registry, the server and the peer
//! connections together.
//!
//! Invariants:
//! - AG-1: a call to oneself runs the function directly, without serialization, under the same
//!   checks (registered, same signature), deadline and panic handling as a remote call.
//! - AG-2: a call's deadline is the earliest of its own timeout and the deadline of the call it
//!   is nested in; it travels to the callee as a relative duration.
//! - AG-3: after shutdown starts, no new root call is sent or served; nested calls of work
//!   already in flight still are, so draining cannot deadlock.
//! - AG-4: shutdown is idempotent and bounded: every phase has a timeout, and a second call
//!   returns the first call's report.
//! - AG-5: rank 0 does not wait out the barrier's timeout for ranks whose process is gone:
//!   while it waits, it redials the missing ranks, and once every missing rank refuses
//!   connections (nothing listens: the process exited or was killed) the barrier fails at
//!   once, naming them. Frozen or partitioned peers still cost the timeout.

use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::blob::{self, MessageContext, MessageKind};
use crate::bulk::{self, Bulk};
use crate::client::{DialCtx, Peer};
use crate::config::{Config, Resolved};
use crate::context::{current_meta, current_scope, CallContext, Scope, META, NO_DEADLINE, SCOPE};
use crate::error::{BoxError, InitError, RemoteError, RemoteErrorKind, RpcError};
use crate::registry::{sig_of, KeptValue, Registry, RemoteFn};
use crate::rendezvous::{self, Join, RendezvousServer};
use crate::server;
use crate::wire::{CallRequest, KeepTarget, WorkerId, WorkerInfo};

const RUNNING: u8 = 0;
const STOPPING: u8 = 1;
const CLOSED: u8 = 2;

/// A way to name a call's target: a worker name, a rank, or a [`WorkerInfo`].
pub trait ToWorker {
    /// The name or rank this refers to.
    fn worker_ref(&self) -> WorkerRef<'_>;
}

/// A worker named by name or by rank.
#[derive(Clone, Copy, Debug)]
pub enum WorkerRef<'a> {
    /// By unique name.
    Name(&'a str),
    /// By rank.
    Rank(u32),
}

impl ToWorker for str {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Name(self)
    }
}
impl ToWorker for String {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Name(self)
    }
}
impl ToWorker for u32 {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(*self)
    }
}
impl ToWorker for usize {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(u32::try_from(*self).unwrap_or(u32::MAX))
    }
}
impl ToWorker for WorkerId {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(self.0)
    }
}
impl ToWorker for WorkerInfo {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(self.id.0)
    }
}
impl<T: ToWorker + ?Sized> ToWorker for &T {
    fn worker_ref(&self) -> WorkerRef<'_> {
        (**self).worker_ref()
    }
}

/// What [`Agent::shutdown`] did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// `Ok` if every worker reached the shutdown barrier; otherwise why not (missing ranks,
    /// unreachable rank 0).
    pub barrier: Result<(), String>,
    /// Incoming calls still running when draining began.
    pub in_flight: usize,
    /// Incoming calls aborted because draining timed out.
    pub aborted: usize,
    /// Total time taken.
    pub elapsed: Duration,
}

impl ShutdownReport {
    /// The barrier completed and nothing was aborted.
    pub fn is_clean(&self) -> bool {
        self.barrier.is_ok() && self.aborted == 0
    }
}

/// Rank 0's shutdown barrier.
#[derive(Default)]
struct Barrier {
    state: Mutex<BarrierState>,
}

#[derive(Default)]
struct BarrierState {
    arrived: std::collections::BTreeSet<u32>,
    waiters: Vec<oneshot::Sender<Result<(), Vec<u32>>>>,
    /// Set when rank 0 gave up waiting: the ranks that never arrived.
    failed: Option<Vec<u32>>,
}

pub(crate) struct Inner {
    pub cfg: Resolved,
    pub me: WorkerInfo,
    pub workers: Vec<WorkerInfo>,
    by_name: HashMap<String, u32>,
    pub registry: Registry,
    pub peers: Vec<Arc<Peer>>,
    pub admission: Arc<Semaphore>,
    state: AtomicU8,
    /// Cancelled when the listener closes (shutdown phase 3).
    pub stop_accepting: CancellationToken,
    /// Cancelled when everything left is aborted (shutdown phase 4).
    pub stop: CancellationToken,
    pub calls: TaskTracker,
    pub conns: TaskTracker,
    pub bulk: Arc<Bulk>,
    barrier: Barrier,
    report: tokio::sync::OnceCell<ShutdownReport>,
    pub runtime: tokio::runtime::Handle,
    extensions: Mutex<HashMap<std::any::TypeId, Arc<dyn std::any::Any + Send + Sync>>>,
    hooks: Mutex<Vec<ShutdownHook>>,
    providers: std::sync::RwLock<Vec<(&'static str, MetaProvider)>>,
    pub spin: Arc<crate::spin::Spin>,
    pub cancels: crate::cancel::Cancels,
    /// Sync connections this worker's threads opened (`direct.rs`).
    pub sync_out: crate::direct::SyncConns,
    /// Sync connections served here.
    pub sync_in: crate::direct::SyncConns,
}

impl Inner {
    /// Whether shutdown has finished (or been cut short): nothing is sent or served any more.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }
}

/// Computes a call-metadata value for each outgoing call from its destination (see
/// [`Agent::set_meta_provider`]); `None` removes the key for that call.
pub type MetaProvider = Arc<dyn Fn(WorkerId) -> Option<Vec<u8>> + Send + Sync>;

/// Work to finish before the shutdown barrier (see [`Agent::on_shutdown`]).
pub type ShutdownHook = Box<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// A handle that does not keep the agent alive; [`WeakAgent::upgrade`] it to use it.
#[derive(Clone)]
pub struct WeakAgent(std::sync::Weak<Inner>);

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
            .field("me", &self.inner.me)
            .field("world_size", &self.inner.workers.len())
            .finish()
    }
}

/// Internal: rank 0's shutdown barrier, served like any registered function.
struct ShutdownBarrier;

impl RemoteFn for ShutdownBarrier {
    const NAME: &'static str = "rpc_core::shutdown_barrier";
    type Args = (u32,);
    type Output = ();
    async fn call(ctx: CallContext, (rank,): (u32,)) -> Result<(), BoxError> {
        ctx.agent().arrive(rank).await.map_err(|missing| {
            format!("ranks {missing:?} never reached the shutdown barrier").into()
        })
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
    let mut registry = registry;
    registry.insert_internal::<ShutdownBarrier>();
    registry.insert_internal::<crate::cancel::CancelCall>();
    let listener = cfg
        .transport
        .bind(&cfg.listen_addr)
        .await
        .map_err(|source| InitError::Bind {
            addr: cfg.listen_addr.clone(),
            source,
        })?;
    let my_addr = listener.local_addr().map_err(|source| InitError::Bind {
        addr: cfg.listen_addr.clone(),
        source,
    })?;
    let server = if cfg.serve_rendezvous {
        Some(
            RendezvousServer::start(
                &cfg.transport,
                &cfg.rendezvous,
                cfg.secret.clone(),
                cfg.world_size,
                cfg.init_timeout,
            )
            .await?,
        )
    } else {
        None
    };
    let join = Join {
        name: cfg.name.clone(),
        rank: cfg.rank,
        world_size: cfg.world_size,
        addr: my_addr,
    };
    let table = rendezvous::join(
        &cfg.transport,
        &cfg.rendezvous,
        &cfg.secret,
        join,
        cfg.init_timeout,
    )
    .await?;
    if let Some(s) = server {
        s.finish(Duration::from_secs(10)).await;
    }
    let workers: Vec<WorkerInfo> = table
        .iter()
        .enumerate()
        .map(|(r, (name, _))| WorkerInfo {
            name: name.clone(),
            id: WorkerId(r as u32),
        })
        .collect();
    let peers = workers
        .iter()
        .zip(&table)
        .map(|(w, (_, addr))| Peer::new(w.clone(), addr.clone()))
        .collect();
    let inner = Inner {
        me: workers[cfg.rank as usize].clone(),
        by_name: workers.iter().map(|w| (w.name.clone(), w.id.0)).collect(),
        workers,
        registry,
        peers,
        admission: Arc::new(Semaphore::new(cfg.max_concurrent_calls)),
        state: AtomicU8::new(RUNNING),
        stop_accepting: CancellationToken::new(),
        stop: CancellationToken::new(),
        calls: TaskTracker::new(),
        conns: TaskTracker::new(),
        bulk: Arc::new(Bulk::new(cfg.world_size, cfg.bulk_pool_bytes)),
        barrier: Barrier::default(),
        report: tokio::sync::OnceCell::new(),
        runtime: tokio::runtime::Handle::current(),
        extensions: Mutex::new(HashMap::new()),
        hooks: Mutex::new(Vec::new()),
        providers: std::sync::RwLock::new(Vec::new()),
        spin: Arc::new(crate::spin::Spin::new(cfg.busy_poll)),
        cancels: crate::cancel::Cancels::default(),
        sync_out: Default::default(),
        sync_in: Default::default(),
        cfg,
    };
    let agent = Agent {
        inner: Arc::new(inner),
    };
    tokio::spawn(server::accept_loop(agent.clone(), listener));
    if !agent.inner.cfg.busy_poll.is_zero() {
        tokio::spawn(Arc::clone(&agent.inner.spin).run(agent.inner.stop.clone()));
    }
    tracing::info!(worker = %agent.name(), rank = agent.rank(), world = agent.world_size(), "joined group");
    Ok(agent)
}

impl Agent {
    /// This worker's name.
    pub fn name(&self) -> &str {
        &self.inner.me.name
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.inner.me.id.0
    }

    /// Number of workers in the group.
    pub fn world_size(&self) -> usize {
        self.inner.workers.len()
    }

    /// This worker's identity.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    /// Every worker of the group, by rank.
    pub fn worker_infos(&self) -> &[WorkerInfo] {
        &self.inner.workers
    }

    /// The identity of a worker named by name or rank.
    pub fn get_worker_info(&self, to: impl ToWorker) -> Result<&WorkerInfo, RpcError> {
        let rank = self.resolve(&to)?;
        Ok(&self.inner.workers[rank as usize])
    }

    /// The address this worker's listener is reachable at, as advertised to its peers.
    pub fn local_addr(&self) -> &str {
        &self.inner.peers[self.rank() as usize].addr
    }

    /// A handle that does not keep the agent alive.
    pub fn downgrade(&self) -> WeakAgent {
        WeakAgent(Arc::downgrade(&self.inner))
    }

    /// The runtime the agent runs on (for work started from synchronous code such as `Drop`).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.inner.runtime
    }

    /// Per-agent state of type `T` for layers built on the agent (created by `init` on first
    /// use). One value per type per agent.
    pub fn extension<T: Send + Sync + 'static>(&self, init: impl FnOnce() -> T) -> Arc<T> {
        let mut ext = self
            .inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let any = ext
            .entry(std::any::TypeId::of::<T>())
            .or_insert_with(|| Arc::new(init()))
            .clone();
        any.downcast::<T>().expect("keyed by TypeId")
    }

    /// Registers work that [`Agent::shutdown`] runs (concurrently with other hooks, bounded by
    /// the shutdown timeout) before the group barrier, while every peer still serves.
    pub fn on_shutdown(&self, hook: ShutdownHook) {
        self.inner
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Sets the call-metadata key `key` of every outgoing remote call (calls to oneself run
    /// without serialization and keep the caller's metadata) to what `provider` returns for the
    /// call's destination. Unlike [`with_call_meta`](crate::with_call_meta),
    /// the value is per destination and per hop: a callee's own calls get its own providers'
    /// values. Replaces an earlier provider of the same key.
    pub fn set_meta_provider(&self, key: &'static str, provider: MetaProvider) {
        let mut p = self
            .inner
            .providers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        p.retain(|(k, _)| *k != key);
        p.push((key, provider));
    }

    pub(crate) fn outgoing_meta(&self, to: u32) -> crate::context::CallMeta {
        let mut meta = current_meta();
        let p = self
            .inner
            .providers
            .read()
            .unwrap_or_else(|e| e.into_inner());
        for (key, provider) in p.iter() {
            meta = match provider(WorkerId(to)) {
                Some(v) => meta.with(key, v),
                None => meta.without(key),
            };
        }
        meta
    }

    /// The group's default call timeout (`Duration::ZERO`: none).
    pub fn rpc_timeout(&self) -> Duration {
        self.inner.cfg.rpc_timeout
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.is_stopping()
    }

    /// The name of a worker for messages: its name, or a description of the reference if it
    /// names no worker of the group.
    pub fn name_of(&self, to: impl ToWorker) -> String {
        match self.get_worker_info(&to) {
            Ok(w) => w.name.clone(),
            Err(_) => match to.worker_ref() {
                WorkerRef::Name(n) => n.to_owned(),
                WorkerRef::Rank(r) => format!("rank {r}"),
            },
        }
    }

    /// The functions this worker serves.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    fn resolve(&self, to: &impl ToWorker) -> Result<u32, RpcError> {
        let r = to.worker_ref();
        let found = match r {
            WorkerRef::Name(n) => self.inner.by_name.get(n).copied(),
            WorkerRef::Rank(r) => ((r as usize) < self.inner.workers.len()).then_some(r),
        };
        found.ok_or_else(|| RpcError::UnknownWorker {
            target: match r {
                WorkerRef::Name(n) => format!("named `{n}`"),
                WorkerRef::Rank(r) => format!("of rank {r}"),
            },
            world_size: self.inner.workers.len(),
        })
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.inner.state.load(Ordering::Acquire) != RUNNING
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
        self.rpc_async_timeout(to, f, args, self.inner.cfg.rpc_timeout)
    }

    /// Like [`Agent::rpc_async`] with an explicit timeout (`Duration::ZERO`: none, though an
    /// enclosing call's deadline still applies).
    pub fn rpc_async_timeout<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
        timeout: Duration,
    ) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static {
        self.call_fut(to, f, args, timeout, true)
    }

    /// The future of a call. `droppable`: the caller may drop it before it ends (see
    /// `cancel.rs`); `rpc_sync` drives it to the end and says so, which spares a task.
    ///
    /// A call to another worker is queued here when nothing has to be awaited first (the
    /// connection is up, no bulk blobs): it starts at once, as PyTorch's `rpc_async` does,
    /// and the future only waits for the reply. Anything else (dialling, bulk blobs, a call
    /// to this worker) runs when the future is polled, boxed, so the future stays small.
    fn call_fut<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        _f: F,
        args: F::Args,
        timeout: Duration,
        droppable: bool,
    ) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static {
        let call = match self.plan::<F>(&to, args, timeout) {
            Plan::Remote(Err(e), _) => Started::Failed(e),
            Plan::Remote(Ok(out), args) => {
                self.start_remote::<F, F::Output>(out, args, None, droppable)
            }
            Plan::Local(planned, args, meta) => {
                let agent = self.clone();
                Started::Later(Box::pin(async move {
                    let (to, (deadline, depth, started)) = planned?;
                    let call = META.scope(meta, agent.call_local::<F>(args, deadline, depth));
                    match deadline {
                        None => call.await,
                        Some(d) => match tokio::time::timeout_at(d.into(), call).await {
                            Ok(r) => r,
                            Err(_) => Err(agent.deadline_exceeded::<F>(to, d, started)),
                        },
                    }
                }))
            }
        };
        call.run()
    }

    /// What a call will do, decided when it is made. A call to another worker is encoded
    /// here, in its caller's context (its call metadata, the moment of the call), so its
    /// future only sends and waits; its arguments stay alive in it until the call ends, as
    /// they would in the caller.
    fn plan<F: RemoteFn>(
        &self,
        to: &impl ToWorker,
        args: F::Args,
        timeout: Duration,
    ) -> Plan<F::Args> {
        let planned = self
            .resolve(to)
            .and_then(|to| Ok((to, self.plan_call::<F>(timeout, current_scope())?)));
        match planned {
            Ok((to, (deadline, depth, started))) if to != self.rank() => {
                Plan::Remote(self.prepare::<F>(to, &args, deadline, depth, started), args)
            }
            other => Plan::Local(other, args, current_meta()),
        }
    }

    /// A call to another worker (`to`), its arguments encoded.
    fn prepare<F: RemoteFn>(
        &self,
        to: u32,
        args: &F::Args,
        deadline: Option<Instant>,
        depth: u32,
        started: Instant,
    ) -> Result<Outgoing, RpcError> {
        let (payload, blobs, unsent) = self.encode_args::<F>(to, args)?;
        Ok(Outgoing {
            to,
            payload,
            blobs,
            unsent,
            meta: self.outgoing_meta(to),
            caller_meta: current_meta(),
            deadline,
            depth,
            started,
        })
    }

    /// A call's deadline (its own timeout, or the enclosing call's deadline if earlier), its
    /// nesting depth and its start; refused once the agent is closed, or for a root call once
    /// shutdown has begun (AG-3).
    fn plan_call<F: RemoteFn>(
        &self,
        timeout: Duration,
        scope: Option<Scope>,
    ) -> Result<(Option<Instant>, u32, Instant), RpcError> {
        let started = Instant::now();
        let own = (!timeout.is_zero()).then(|| started + timeout.min(NO_DEADLINE));
        let inherited = scope.and_then(|s| s.deadline);
        let deadline = match (own, inherited) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let depth = scope.map_or(0, |s| s.depth);
        if self.inner.is_closed()
            || (depth == 0
                && self.is_stopping()
                && F::NAME != ShutdownBarrier::NAME
                && F::NAME != crate::cancel::CancelCall::NAME)
        {
            return Err(RpcError::Shutdown {
                worker: self.name().to_owned(),
                fn_name: F::NAME.to_owned(),
            });
        }
        Ok((deadline, depth, started))
    }

    pub(crate) fn deadline_exceeded<F: RemoteFn>(
        &self,
        to: u32,
        deadline: Instant,
        started: Instant,
    ) -> RpcError {
        RpcError::DeadlineExceeded {
            worker: self.inner.workers[to as usize].name.clone(),
            fn_name: F::NAME.to_owned(),
            timeout: deadline.saturating_duration_since(started),
        }
    }

    /// Runs `f` on `to` and keeps its result there: instead of returning it, the callee hands
    /// the typed result (or the error) to the keep sink registered there under `sink`, with
    /// `token`. Resolves once the sink has taken it. This is how a layer above creates values
    /// that live on another worker (remote references).
    ///
    /// Unlike [`Agent::rpc_async`], the request is queued when this is called if it can be
    /// without waiting (the connection to `to` is up and no argument takes the bulk path), so
    /// it goes out ahead of anything the caller sends to `to` next; the future then only
    /// waits for the answer. The arguments stay alive in the future until the call ends.
    ///
    /// # Cancel safety
    /// Dropping the future before it ends cancels the call, as dropping an
    /// [`Agent::rpc_async`] future does (a cancel message; the answer is still read in the
    /// background); whether the sink ran is then unknown.
    pub fn rpc_keep<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        _f: F,
        args: F::Args,
        sink: &'static str,
        token: Vec<u8>,
    ) -> impl Future<Output = Result<(), RpcError>> + Send + 'static {
        let keep = KeepTarget {
            sink: sink.into(),
            token,
        };
        // Everything but the wait for a queued call is boxed: thousands of these may be
        // waiting at once (one per new remote reference), so the future stays small.
        let call = match self.plan::<F>(&to, args, self.inner.cfg.rpc_timeout) {
            Plan::Remote(Err(e), _) => Started::Failed(e),
            Plan::Remote(Ok(out), args) => self.start_remote::<F, ()>(out, args, Some(keep), true),
            Plan::Local(planned, args, meta) => {
                let agent = self.clone();
                Started::Later(Box::pin(async move {
                    agent
                        .keep_local::<F>(planned?, args, meta, sink, keep.token)
                        .await
                }))
            }
        };
        call.run()
    }

    /// [`Agent::rpc_keep`] to this worker: runs `f` here and hands its result to the sink.
    async fn keep_local<F: RemoteFn>(
        &self,
        (to, (deadline, depth, started)): (u32, (Option<Instant>, u32, Instant)),
        args: F::Args,
        meta: crate::context::CallMeta,
        sink: &'static str,
        token: Vec<u8>,
    ) -> Result<(), RpcError> {
        let Some(sink_fn) = self.inner.registry.sink(sink).cloned() else {
            return Err(RpcError::UnknownFunction {
                worker: self.name().to_owned(),
                fn_name: format!("keep sink `{sink}`"),
            });
        };
        let call = Box::pin(META.scope(meta.clone(), self.call_local::<F>(args, deadline, depth)));
        let out = match deadline {
            None => call.await,
            Some(d) => tokio::time::timeout_at(d.into(), call)
                .await
                .unwrap_or_else(|_| Err(self.deadline_exceeded::<F>(to, d, started))),
        };
        let ctx = CallContext {
            agent: self.clone(),
            caller: self.rank(),
            deadline,
            cancel: None,
        };
        let result = match out {
            Ok(v) => Ok(KeptValue::new(v)),
            Err(RpcError::Remote(r)) => Err(r),
            Err(e) => return Err(e),
        };
        let failed = result.as_ref().err().cloned();
        META.sync_scope(meta, || sink_fn(ctx, token, result))
            .map_err(RpcError::Remote)?;
        match failed {
            Some(r) => Err(RpcError::Remote(r)),
            None => Ok(()),
        }
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
    ///
    /// [`Config::sync_connections`]: crate::Config::sync_connections
    pub fn rpc_sync<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
    ) -> Result<F::Output, RpcError> {
        self.rpc_sync_timeout(to, f, args, self.inner.cfg.rpc_timeout)
    }

    /// Blocking [`Agent::rpc_async_timeout`].
    pub fn rpc_sync_timeout<F: RemoteFn>(
        &self,
        to: impl ToWorker,
        f: F,
        args: F::Args,
        timeout: Duration,
    ) -> Result<F::Output, RpcError> {
        use tokio::runtime::RuntimeFlavor;
        let rt = &self.inner.runtime;
        if rt.runtime_flavor() != RuntimeFlavor::MultiThread {
            return Err(RpcError::CannotBlock {
                reason: "the agent runs on a current-thread runtime, which blocking would stall",
            });
        }
        let in_runtime = match tokio::runtime::Handle::try_current() {
            Err(_) => false,
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => true,
            Ok(_) => {
                return Err(RpcError::CannotBlock {
                    reason: "called on a current-thread runtime",
                })
            }
        };
        let spin = self.inner.cfg.busy_poll;
        let run = move || match self.resolve(&to) {
            // The thread writes and reads its own connection (see `direct.rs`).
            Ok(rank) if self.sync_connection_applies(rank) => {
                let (deadline, depth, started) = self.plan_call::<F>(timeout, current_scope())?;
                match self.sync_conn(rank, deadline)? {
                    Some(conn) => {
                        self.call_on_thread::<F>(conn, rank, args, deadline, depth, started)
                    }
                    // Every place for a sync connection is taken: through the runtime.
                    None => {
                        crate::spin::block_on(rt, spin, self.call_fut(to, f, args, timeout, false))
                    }
                }
            }
            _ => crate::spin::block_on(rt, spin, self.call_fut(to, f, args, timeout, false)),
        };
        if in_runtime {
            tokio::task::block_in_place(run)
        } else {
            run()
        }
    }

    async fn call_local<F: RemoteFn>(
        &self,
        args: F::Args,
        deadline: Option<Instant>,
        depth: u32,
    ) -> Result<F::Output, RpcError> {
        let me = self.name();
        match self.inner.registry.get(F::NAME) {
            None => {
                return Err(RpcError::UnknownFunction {
                    worker: me.to_owned(),
                    fn_name: F::NAME.to_owned(),
                })
            }
            Some(e) if e.sig != sig_of::<F>() => {
                return Err(RpcError::TypeMismatch {
                    worker: me.to_owned(),
                    fn_name: F::NAME.to_owned(),
                    detail: format!(
                        "registered as {}, called as `{}` -> `{}`",
                        e.signature_text(),
                        std::any::type_name::<F::Args>(),
                        std::any::type_name::<F::Output>()
                    ),
                })
            }
            Some(_) => {}
        }
        let ctx = CallContext {
            agent: self.clone(),
            caller: self.rank(),
            deadline,
            cancel: None,
        };
        let scope = Scope {
            deadline,
            depth: depth + 1,
        };
        // Boxed and type-erased: a function that calls itself (directly or through a peer)
        // would otherwise have an infinitely sized future.
        let fut: std::pin::Pin<Box<dyn Future<Output = Result<F::Output, BoxError>> + Send>> =
            Box::pin(F::call(ctx, args));
        let out = SCOPE
            .scope(scope, AssertUnwindSafe(fut).catch_unwind())
            .await;
        match out {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(RpcError::Remote(RemoteError::from_error(
                RemoteErrorKind::Handler,
                F::NAME,
                me,
                &*e,
            ))),
            Err(p) => Err(RpcError::Remote(RemoteError::new(
                RemoteErrorKind::Panic,
                F::NAME,
                me,
                server::panic_message(&*p),
            ))),
        }
    }

    /// Starts a call to another worker: queued now if it can be ([`Agent::queue_now`]), else
    /// left, boxed, for its future's first poll. The arguments stay alive until it ends.
    fn start_remote<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        out: Outgoing,
        args: F::Args,
        keep: Option<KeepTarget>,
        droppable: bool,
    ) -> Started<F::Args, O> {
        self.inner.spin.touch();
        match self.queue_now::<F>(out, keep, droppable) {
            Queued::Now(Ok(q)) => Started::Queued(self.await_reply::<F, O>(q), args),
            Queued::Now(Err(e)) => Started::Failed(e),
            Queued::Later(out, keep) => {
                let agent = self.clone();
                Started::Later(Box::pin(async move {
                    let r = match agent.queue_later::<F>(out, keep, droppable).await {
                        Ok(q) => agent.await_reply::<F, O>(q).await,
                        Err(e) => Err(e),
                    };
                    drop(args);
                    r
                }))
            }
        }
    }

    /// Queues a call on its live connection at once when nothing has to be awaited first (the
    /// connection is up, every blob rides inside the envelope); otherwise gives it back
    /// (`Later`).
    fn queue_now<F: RemoteFn>(
        &self,
        out: Outgoing,
        keep: Option<KeepTarget>,
        droppable: bool,
    ) -> Queued {
        let peer = &self.inner.peers[out.to as usize];
        let Some((gen, client)) = peer.current() else {
            return Queued::Later(out, keep);
        };
        let blobs = if out.blobs.is_empty() {
            Vec::new()
        } else {
            match bulk::all_inline(self, &out.blobs) {
                Some(b) => b,
                None => return Queued::Later(out, keep),
            }
        };
        // Until the request is queued, an error drops `out`, which gives back what its
        // arguments lent (`unsent`): the callee cannot have read them.
        if let Err(e) = self.check_frame::<F>(&out.payload, &blobs) {
            return Queued::Now(Err(e));
        }
        Queued::Now(Ok(self.queue::<F>(out, blobs, gen, client, keep, droppable)))
    }

    /// [`Agent::queue_now`]'s other path: sends the bulk blobs and dials the connection if
    /// need be, bounded by the deadline too (a peer that stopped reading must not hold the
    /// caller past it), then queues the call.
    async fn queue_later<F: RemoteFn>(
        &self,
        mut out: Outgoing,
        keep: Option<KeepTarget>,
        droppable: bool,
    ) -> Result<InFlight, RpcError> {
        let (to, deadline, started) = (out.to, out.deadline, out.started);
        let peer = &self.inner.peers[to as usize];
        let blobs = std::mem::take(&mut out.blobs);
        let payload = &out.payload;
        let setup = async {
            let blobs = bulk::send(self, to, blobs)
                .await
                .map_err(|e| RpcError::Transport {
                    worker: peer.info.name.clone(),
                    source: e.into(),
                })?;
            self.check_frame::<F>(payload, &blobs)?;
            let (gen, client) = peer.client(&self.dial_ctx()).await?;
            Ok::<_, RpcError>((blobs, gen, client))
        };
        let (blobs, gen, client) = match deadline {
            None => setup.await,
            Some(d) => tokio::time::timeout_at(d.into(), setup)
                .await
                .unwrap_or_else(|_| Err(self.deadline_exceeded::<F>(to, d, started))),
        }?;
        Ok(self.queue::<F>(out, blobs, gen, client, keep, droppable))
    }

    /// Queues `out` (its bulk blobs already sent, as `blobs`) on connection `gen`.
    fn queue<F: RemoteFn>(
        &self,
        out: Outgoing,
        blobs: Vec<crate::wire::WireBlob>,
        gen: u64,
        client: crate::client::Client,
        keep: Option<KeepTarget>,
        droppable: bool,
    ) -> InFlight {
        let Outgoing {
            to,
            payload,
            unsent,
            meta,
            caller_meta,
            deadline,
            depth,
            started,
            ..
        } = out;
        // A call its caller may drop is cancelled by message, and its reply is always read,
        // so that what its arguments or its result lent is accounted for (see `cancel.rs`).
        let cancel_id = droppable.then(|| self.inner.cancels.next_id());
        let req = self.envelope::<F>(depth, payload, blobs, keep, meta, cancel_id);
        // Dropped from here on without a verdict (the outcome is unknown), `lent` runs nothing.
        let sent = Sent {
            lent: unsent.sent(),
            deadline,
            started,
            caller_meta,
        };
        let by = deadline.unwrap_or_else(|| Instant::now() + NO_DEADLINE);
        InFlight {
            waiter: client.send(req, by),
            to,
            gen,
            cancel_id,
            sent,
        }
    }

    /// The wait for a queued call's reply and its reading, as a future. A call its caller may
    /// drop goes on as a task of its own if it is dropped first (`cancel.rs`).
    fn await_reply<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        q: InFlight,
    ) -> crate::cancel::Detach<Result<O, RpcError>> {
        let (to, cancel_id) = (q.to, q.cancel_id);
        // Boxed: the wait and the reply's handling are most of a call's state, and a call's
        // future stays small (it is moved, and spawned by `remote`).
        let work = Box::pin(self.clone().wait_reply::<F, O>(q));
        crate::cancel::Detach::new(self.clone(), to, cancel_id, work)
    }

    /// Waits for `q`'s reply until its deadline, then reads it.
    async fn wait_reply<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
        self,
        q: InFlight,
    ) -> Result<O, RpcError> {
        let InFlight {
            waiter,
            to,
            gen,
            sent,
            ..
        } = q;
        let reply = match (waiter, sent.deadline) {
            (Err(e), _) => Err(e),
            (Ok(w), None) => w.await.map(Some),
            (Ok(w), Some(d)) => match tokio::time::timeout_at(d.into(), w).await {
                Ok(r) => r.map(Some),
                Err(_) => Ok(None),
            },
        };
        let Sent {
            lent,
            deadline,
            started,
            caller_meta,
        } = sent;
        let reply = self.reply_arrived::<F>(to, gen, reply, deadline, started, lent)?;
        self.read_result::<F, O>(to, reply, deadline, caller_meta)
            .await
    }

    /// Encodes a call's arguments for `to`: the payload, its blobs, and what they lent (given
    /// back unless the request is marked sent).
    pub(crate) fn encode_args<F: RemoteFn>(
        &self,
        to: u32,
        args: &F::Args,
    ) -> Result<(Vec<u8>, Vec<bytes::Bytes>, blob::Unsent), RpcError> {
        let msg = MessageContext::new(self.clone(), WorkerId(to), MessageKind::Request);
        let (encoded, lent) = blob::encode_request(args, Some(msg));
        let unsent = blob::Unsent::new(lent);
        match encoded {
            Ok((payload, blobs)) => Ok((payload, blobs, unsent)),
            Err(source) => Err(RpcError::Encode {
                what: "arguments",
                fn_name: F::NAME.to_owned(),
                source,
            }),
        }
    }

    /// Refuses a request that would exceed the frame limit.
    pub(crate) fn check_frame<F: RemoteFn>(
        &self,
        payload: &[u8],
        blobs: &[crate::wire::WireBlob],
    ) -> Result<(), RpcError> {
        let size = payload.len() + bulk::inline_bytes(blobs) + F::NAME.len();
        let limit = self.inner.cfg.max_frame_bytes;
        if size + 1024 > limit {
            return Err(RpcError::TooLarge {
                fn_name: F::NAME.to_owned(),
                size,
                limit,
            });
        }
        Ok(())
    }

    /// The envelope of a call to `to`.
    pub(crate) fn envelope<F: RemoteFn>(
        &self,
        depth: u32,
        payload: Vec<u8>,
        blobs: Vec<crate::wire::WireBlob>,
        keep: Option<KeepTarget>,
        meta: crate::context::CallMeta,
        cancel_id: Option<u64>,
    ) -> CallRequest {
        CallRequest {
            fn_name: std::borrow::Cow::Borrowed(F::NAME),
            sig: sig_of::<F>(),
            depth,
            payload,
            blobs,
            keep,
            meta,
            cancel_id,
        }
    }

    /// What came back for a call: the callee's answer, or the error that replaced it (a
    /// transport failure, the deadline, a remote error); settles what the arguments lent.
    fn reply_arrived<F: RemoteFn>(
        &self,
        to: u32,
        gen: u64,
        reply: Result<Option<crate::wire::CallReply>, crate::mux::CallFailed>,
        deadline: Option<Instant>,
        started: Instant,
        lent: blob::Lent,
    ) -> Result<crate::wire::CallOk, RpcError> {
        let peer = &self.inner.peers[to as usize];
        let worker = || peer.info.name.clone();
        let lost = || RpcError::ConnectionLost {
            worker: worker(),
            fn_name: F::NAME.to_owned(),
        };
        use crate::mux::CallFailed as T;
        let reply = match reply {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(self.deadline_exceeded::<F>(
                    to,
                    deadline.unwrap_or(started + NO_DEADLINE),
                    started,
                ))
            }
            Err(T::NotSent(e)) => {
                lent.never_decoded();
                if e.kind() != std::io::ErrorKind::NotConnected {
                    // Not encodable: the connection is fine, the request is not.
                    return Err(RpcError::Transport {
                        worker: worker(),
                        source: Box::new(e),
                    });
                }
                peer.invalidate(gen);
                return Err(lost());
            }
            Err(T::Lost) => {
                peer.invalidate(gen);
                return Err(lost());
            }
            Err(T::Server(e)) => {
                return Err(RpcError::Transport {
                    worker: worker(),
                    source: Box::new(e),
                })
            }
        };
        self.answered::<F>(reply, lent)
    }

    /// An answer that arrived: settles what the arguments lent; maps a remote error.
    pub(crate) fn answered<F: RemoteFn>(
        &self,
        reply: crate::wire::CallReply,
        lent: blob::Lent,
    ) -> Result<crate::wire::CallOk, RpcError> {
        match reply {
            Ok(ok) => {
                lent.answered();
                Ok(ok)
            }
            Err(remote) => {
                // Refused before its arguments were read, or answered after.
                if matches!(
                    remote.kind,
                    RemoteErrorKind::UnknownFunction
                        | RemoteErrorKind::TypeMismatch
                        | RemoteErrorKind::ShuttingDown
                ) {
                    lent.never_decoded();
                } else {
                    lent.answered();
                }
                Err(self.map_remote::<F>(remote))
            }
        }
    }

    /// Reads a result's bulk blobs, if it has any, and decodes it. Without blobs nothing is
    /// awaited, and the future stays small (many calls wait at once, each holding one).
    pub(crate) async fn read_result<F: RemoteFn, O: serde::de::DeserializeOwned>(
        &self,
        to: u32,
        ok: crate::wire::CallOk,
        deadline: Option<Instant>,
        caller_meta: crate::context::CallMeta,
    ) -> Result<O, RpcError> {
        let blobs = if ok.blobs.is_empty() {
            Vec::new()
        } else {
            Box::pin(bulk::receive(self, to, ok.blobs, deadline))
                .await
                .map_err(|e| RpcError::Transport {
                    worker: self.inner.peers[to as usize].info.name.clone(),
                    source: e.into(),
                })?
        };
        let msg = MessageContext::new(self.clone(), WorkerId(to), MessageKind::Reply);
        // Decoded with its caller's metadata, wherever the caller's future is polled (or
        // the task that took over a dropped one).
        let decoded = META.sync_scope(caller_meta, || {
            blob::decode::<O>(&ok.payload, blobs, Some(msg))
        });
        decoded.map_err(|e| RpcError::TypeMismatch {
            worker: self.inner.peers[to as usize].info.name.clone(),
            fn_name: F::NAME.to_owned(),
            detail: format!(
                "cannot decode the result as `{}`: {e}",
                std::any::type_name::<O>()
            ),
        })
    }

    fn map_remote<F: RemoteFn>(&self, r: RemoteError) -> RpcError {
        match r.kind {
            RemoteErrorKind::UnknownFunction => RpcError::UnknownFunction {
                worker: r.worker,
                fn_name: r.fn_name,
            },
            RemoteErrorKind::TypeMismatch => RpcError::TypeMismatch {
                worker: r.worker,
                fn_name: r.fn_name,
                detail: format!(
                    "{}; caller's is `{}` -> `{}`",
                    r.message,
                    std::any::type_name::<F::Args>(),
                    std::any::type_name::<F::Output>()
                ),
            },
            RemoteErrorKind::ShuttingDown => RpcError::PeerShuttingDown {
                worker: r.worker,
                fn_name: r.fn_name,
            },
            _ => RpcError::Remote(r),
        }
    }

    /// Rank 0's side of the barrier: waits until every rank has arrived, or until rank 0 gives
    /// up (then fails with the missing ranks).
    async fn arrive(&self, rank: u32) -> Result<(), Vec<u32>> {
        let rx = {
            let mut b = self.barrier_state();
            if let Some(missing) = &b.failed {
                return Err(missing.clone());
            }
            b.arrived.insert(rank);
            let (tx, rx) = oneshot::channel();
            b.waiters.push(tx);
            if b.arrived.len() == self.world_size() {
                for tx in b.waiters.drain(..) {
                    let _ = tx.send(Ok(()));
                }
            }
            rx
        };
        rx.await.unwrap_or(Ok(()))
    }

    fn barrier_state(&self) -> std::sync::MutexGuard<'_, BarrierState> {
        self.inner
            .barrier
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// A blob of `len` bytes written by `fill`, built where sending it to `to` costs least.
    ///
    /// Where `to` runs on the same host and has mapped this worker's shared-memory arena (see
    /// [`Config::shm_arena_bytes`]), the blob is built in the arena: `fill` writes shared memory
    /// directly and sending the blob to `to` copies nothing. Otherwise (another host, no room,
    /// a small blob, no large blob sent to `to` yet) it is an ordinary blob. Either way it is an
    /// immutable [`Blob`] that can be sent anywhere, any number of times.
    ///
    /// [`Config::shm_arena_bytes`]: crate::Config::shm_arena_bytes
    /// [`Blob`]: crate::Blob
    pub fn blob_for(
        &self,
        to: impl ToWorker,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<crate::Blob, RpcError> {
        let to = self.resolve(&to)?;
        Ok(crate::Blob::new(bulk::blob_for(self, to, len, fill)))
    }

    /// How this worker's large blobs have travelled so far: on the bulk connections' byte
    /// streams or through shared memory.
    pub fn bulk_stats(&self) -> crate::BulkStats {
        self.inner.bulk.stats()
    }

    /// Whether the process of worker `rank` is known to be gone: uses the live connection if
    /// there is one (then it is not gone), else redials and reports `true` only when nothing
    /// listens at the worker's address (connection refused). A live but slow, frozen or
    /// partitioned peer reads as not gone; so does this worker and an unknown rank.
    pub async fn peer_gone(&self, rank: u32) -> bool {
        if rank == self.rank() {
            return false;
        }
        let Some(peer) = self.inner.peers.get(rank as usize) else {
            return false;
        };
        matches!(
            peer.client(&self.dial_ctx()).await,
            Err(RpcError::Unreachable { source, .. })
                if source.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }

    /// What dialling a peer needs from the configuration.
    fn dial_ctx(&self) -> DialCtx<'_> {
        let cfg = &self.inner.cfg;
        DialCtx {
            transport: &cfg.transport,
            secret: &cfg.secret,
            my_rank: cfg.rank,
            connect_timeout: cfg.connect_timeout,
            handshake_timeout: cfg.handshake_timeout,
            max_frame_bytes: cfg.max_frame_bytes,
        }
    }

    /// Rank 0, waiting at the shutdown barrier: resolves once every rank that has not arrived
    /// is known dead (its listener refuses connections: the process is gone), with those
    /// ranks. Pending forever while any missing rank may still come. A frozen or partitioned
    /// peer does not refuse connections; the barrier's timeout covers those.
    async fn watch_missing_ranks(&self) -> Vec<u32> {
        let mut dead = std::collections::BTreeSet::new();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let missing: Vec<u32> = {
                let b = self.barrier_state();
                (0..self.world_size() as u32)
                    .filter(|r| !b.arrived.contains(r))
                    .collect()
            };
            for &r in &missing {
                if !dead.contains(&r) && self.peer_gone(r).await {
                    dead.insert(r);
                }
            }
            if !missing.is_empty() && missing.iter().all(|r| dead.contains(r)) {
                return missing;
            }
        }
    }

    /// Rank 0 gives up on the barrier: every waiter learns which ranks never arrived.
    fn fail_barrier(&self) -> Vec<u32> {
        let mut b = self.barrier_state();
        let missing: Vec<u32> = (0..self.world_size() as u32)
            .filter(|r| !b.arrived.contains(r))
            .collect();
        b.failed = Some(missing.clone());
        for tx in b.waiters.drain(..) {
            let _ = tx.send(Err(missing.clone()));
        }
        missing
    }

    /// Leaves the group gracefully: a group-wide barrier (every worker has called shutdown),
    /// then new calls are refused while calls in flight finish, then connections close.
    /// Each phase is bounded by the shutdown timeout, so a worker whose peers vanished still
    /// returns. Idempotent: later calls return the first call's report.
    ///
    /// # Cancel safety
    /// Cancel safe in the sense that a later call resumes and finishes the same shutdown.
    pub async fn shutdown(&self) -> ShutdownReport {
        self.shutdown_within(self.inner.cfg.shutdown_timeout).await
    }

    /// [`Agent::shutdown`] with `timeout` per phase instead of the configured one: after a
    /// failure, a worker leaves quickly instead of waiting out the group's generous timeout
    /// for traffic with peers that are gone. Only the first call of either decides.
    pub async fn shutdown_within(&self, timeout: Duration) -> ShutdownReport {
        self.inner
            .report
            .get_or_init(|| self.clone().do_shutdown(timeout))
            .await
            .clone()
    }

    async fn do_shutdown(self, t: Duration) -> ShutdownReport {
        let inner = &self.inner;
        let start = Instant::now();
        // Phase 0: layers above finish their protocol traffic while every peer still serves.
        let hooks: Vec<_> = {
            let hooks = inner.hooks.lock().unwrap_or_else(|p| p.into_inner());
            hooks.iter().map(|h| h()).collect()
        };
        if tokio::time::timeout(t, futures::future::join_all(hooks))
            .await
            .is_err()
        {
            tracing::warn!(worker = %self.name(), "shutdown hooks did not finish in time");
        }
        let barrier = if self.world_size() <= 1 {
            Ok(())
        } else {
            let barrier = self.rpc_async_timeout(0u32, ShutdownBarrier, (self.rank(),), t);
            if self.rank() == 0 {
                // AG-5: rank 0 stops waiting for ranks whose process is gone.
                tokio::select! {
                    r = barrier => r.map_err(|e| format!(
                        "ranks {:?} never reached the shutdown barrier: {e}",
                        self.fail_barrier()
                    )),
                    dead = self.watch_missing_ranks() => {
                        self.fail_barrier();
                        Err(format!(
                            "ranks {dead:?} never reached the shutdown barrier: their \
                             processes are gone (connections refused)"
                        ))
                    }
                }
            } else {
                barrier.await.map_err(|e| crate::error::error_chain(&e))
            }
        };
        if let Err(why) = &barrier {
            tracing::warn!(worker = %self.name(), %why, "shutdown barrier incomplete");
        }
        // Phase 2: refuse new root calls; let the calls in flight finish.
        inner.state.store(STOPPING, Ordering::Release);
        inner.calls.close();
        let in_flight = inner.calls.len();
        let drained = tokio::time::timeout(t, inner.calls.wait()).await.is_ok();
        let aborted = if drained { 0 } else { inner.calls.len() };
        // Phase 3: close our outgoing connections and the listener, then let the peers close
        // theirs (they do so once their own barrier call has returned), so every reply that
        // is still being written reaches its caller.
        inner.state.store(CLOSED, Ordering::Release);
        inner.admission.close();
        for p in &inner.peers {
            p.close();
        }
        inner.sync_out.close_all();
        inner.bulk.close();
        inner.stop_accepting.cancel();
        inner.conns.close();
        let _ = tokio::time::timeout(t, inner.conns.wait()).await;
        // Phase 4: abort whatever is left.
        inner.stop.cancel();
        inner.sync_in.close_all();
        let _ = tokio::time::timeout(Duration::from_secs(5), inner.conns.wait()).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), inner.calls.wait()).await;
        let report = ShutdownReport {
            barrier,
            in_flight,
            aborted,
            elapsed: start.elapsed(),
        };
        tracing::info!(worker = %self.name(), ?report, "shut down");
        report
    }
}

/// Awaits every future; returns all results in order, or the first error.
///
/// ```
/// # async fn demo(agent: rpc_core::Agent) -> Result<(), rpc_core::RpcError> {
/// # #[rpc_core::remote] async fn add(_c: rpc_core::CallContext, a: i32, b: i32) -> Result<i32, rpc_core::BoxError> { Ok(a + b) }
/// let sums = rpc_core::wait_all((0..4).map(|i| agent.rpc_async(1u32, add, (i, i)))).await?;
/// # Ok(()) }
/// ```
pub async fn wait_all<T, I>(futures: I) -> Result<Vec<T>, RpcError>
where
    I: IntoIterator,
    I::Item: Future<Output = Result<T, RpcError>>,
{
    futures::future::try_join_all(futures).await
}

/// A call to another worker, encoded where it was made.
struct Outgoing {
    to: u32,
    payload: Vec<u8>,
    blobs: Vec<bytes::Bytes>,
    /// What the arguments lent, given back unless the request is marked sent.
    unsent: blob::Unsent,
    /// What the envelope carries: the caller's metadata as the providers adjust it for `to`.
    meta: crate::context::CallMeta,
    /// The caller's metadata itself, in effect while the reply is decoded.
    caller_meta: crate::context::CallMeta,
    deadline: Option<Instant>,
    depth: u32,
    started: Instant,
}

/// A call on its way: what its arguments lent, its deadline and start, its caller's metadata.
struct Sent {
    /// Dropped without a verdict (the outcome is unknown), it runs nothing.
    lent: blob::Lent,
    deadline: Option<Instant>,
    started: Instant,
    caller_meta: crate::context::CallMeta,
}

/// A call queued on its connection (or refused by it: `waiter` is then the reason), waiting
/// for its reply.
struct InFlight {
    waiter: Result<crate::mux::Waiter, crate::mux::CallFailed>,
    to: u32,
    gen: u64,
    cancel_id: Option<u64>,
    sent: Sent,
}

/// A call as it was made: refused, queued on its connection (its arguments kept alive until
/// it ends), or left for its future's first poll.
enum Started<A, O: Send + 'static> {
    Failed(RpcError),
    Queued(crate::cancel::Detach<Result<O, RpcError>>, A),
    Later(futures::future::BoxFuture<'static, Result<O, RpcError>>),
}

impl<A: Send + 'static, O: Send + 'static> Started<A, O> {
    /// The call's future. (Not an `async fn`: its argument would be stored twice, and the
    /// future of every call in flight would be a hundred bytes larger.)
    #[allow(clippy::manual_async_fn)]
    fn run(self) -> impl Future<Output = Result<O, RpcError>> + Send + 'static
    where
        A: Send,
    {
        async move {
            match self {
                Started::Failed(e) => Err(e),
                Started::Queued(reply, args) => {
                    let r = reply.await;
                    drop(args);
                    r
                }
                Started::Later(f) => f.await,
            }
        }
    }
}

/// What [`Agent::queue_now`] did: queued the call (or refused it), or left it for later.
enum Queued {
    Now(Result<InFlight, RpcError>),
    Later(Outgoing, Option<KeepTarget>),
}

/// A call as planned when it is made: to another worker (encoded, or why not) with its
/// arguments, or to this one with its arguments and its caller's metadata.
enum Plan<A> {
    Remote(Result<Outgoing, RpcError>, A),
    #[allow(clippy::type_complexity)]
    Local(
        Result<(u32, (Option<Instant>, u32, Instant)), RpcError>,
        A,
        crate::context::CallMeta,
    ),
}
