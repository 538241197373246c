//! What a worker is made of, as data: the [`Agent`] handle and everything its state holds that
//! refers back to it (a handler's [`CallContext`], a message's [`MessageContext`], the
//! registry of handlers that take them, the callee's and caller's state). These types refer to
//! each other, so they live in one module; their behaviour lives in the modules above, each of
//! which sees the parts it needs:
//!
//! ```text
//! agent      the Agent's API: identity, the group, calls (through call/), membership
//! init       forming the group and starting to serve
//! shutdown   the barrier and the phases that stop a worker
//! ext        the layer-author API (AgentExt)
//! call/      the caller: Inner's group, net, caller state and layers
//! dispatch   the callee: Inner's callee state, net and lifecycle
//! registry   RemoteFn and the erasure of handlers;   context: scopes, CallContext's API
//! blob       encoding with side tables, MessageContext's API
//! state      this module: the types, and the handle's identity
//! ```

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::cancel::RunningCalls;
use crate::error::{CodecError, RemoteError};
use crate::group::Group;
use crate::layers::Layers;
use crate::lifecycle::Lifecycle;
use crate::net::Net;
use crate::rendezvous::{RendezvousServer, Report};
use crate::shutdown::state::State as ShutdownState;
use crate::wire::{WorkerId, WorkerInfo};

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
    pub shutdown: ShutdownState,
    /// This worker's reports to the rendezvous (its membership link; see `rendezvous::follow`).
    pub reports: mpsc::Sender<Report>,
    /// The rendezvous this worker hosts, if it does: it serves the group's membership as long
    /// as this worker lives.
    pub rendezvous: Mutex<Option<RendezvousServer>>,
}

impl Inner {
    /// This worker's name.
    pub(crate) fn name(&self) -> &str {
        &self.group.worker(self.group.rank()).name
    }

    /// This worker's rank.
    pub(crate) fn rank(&self) -> u32 {
        self.group.rank()
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
            .field("me", self.worker_info())
            .field("world_size", &self.world_size())
            .finish()
    }
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

    /// The runtime the agent runs on (for work started from synchronous code such as `Drop`).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.inner.net.runtime
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

/// What a handler knows about the call it is serving (its API is in `context.rs`).
#[derive(Clone)]
pub struct CallContext {
    pub(crate) agent: Agent,
    /// The caller's rank (its [`WorkerInfo`] is the agent's: nothing is copied per call).
    pub(crate) caller: u32,
    pub(crate) deadline: Option<Instant>,
    /// Cancelled when the caller cancels this call by message (`call/cancel.rs`).
    pub(crate) cancel: Option<CancellationToken>,
}

/// Which way a message travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    /// Caller to callee.
    Request,
    /// Callee to caller.
    Reply,
}

/// The message being encoded or decoded on this thread: lets a value that cares (a remote
/// reference registering a fork) learn which worker the message goes to or comes from (its
/// API is in `blob.rs`).
#[derive(Clone)]
pub struct MessageContext {
    pub(crate) agent: Agent,
    pub(crate) peer: WorkerId,
    pub(crate) kind: MessageKind,
}

/// Encoded arguments or result: payload and blob side table.
pub(crate) type Encoded = (Vec<u8>, Vec<Bytes>);

/// A registered function, its types erased: decodes the arguments, runs, encodes the result.
pub(crate) type ErasedHandler = Arc<
    dyn Fn(CallContext, Vec<u8>, Vec<Bytes>) -> BoxFuture<'static, Result<Encoded, RemoteError>>
        + Send
        + Sync,
>;
/// A registered function run for a keep-call: its result kept as a typed value.
pub(crate) type ErasedKeep = Arc<
    dyn Fn(CallContext, Vec<u8>, Vec<Bytes>) -> BoxFuture<'static, Result<KeptValue, RemoteError>>
        + Send
        + Sync,
>;

/// A function's result kept on the callee as a typed value instead of being sent back (see
/// [`AgentExt::rpc_keep`](crate::ext::AgentExt::rpc_keep)); it remembers how to encode itself
/// (its API is in `registry.rs`).
pub struct KeptValue {
    pub(crate) value: Box<dyn Any + Send>,
    pub(crate) type_name: &'static str,
    pub(crate) encode: fn(&(dyn Any + Send), Option<MessageContext>) -> Result<Encoded, CodecError>,
}

/// Receives the typed results of keep-calls on the callee: `(ctx, token, result)`; the token is
/// the caller's opaque bytes. An `Err` it returns is reported to the caller.
pub type KeepSink = Arc<
    dyn Fn(CallContext, Vec<u8>, Result<KeptValue, RemoteError>) -> Result<(), RemoteError>
        + Send
        + Sync,
>;

/// One registered function.
#[derive(Clone)]
pub(crate) struct Entry {
    /// The function's name as registered (static: the trace names served calls with it).
    pub name: &'static str,
    pub handler: ErasedHandler,
    pub keep: ErasedKeep,
    pub sig: u64,
    pub args_ty: &'static str,
    pub output_ty: &'static str,
}

/// The set of functions a worker serves. Build with [`Registry::builder`] (its API is in
/// `registry.rs`).
///
/// ```
/// #[rpc_core::remote]
/// async fn add(_ctx: rpc_core::CallContext, a: i32, b: i32) -> Result<i32, rpc_core::BoxError> {
///     Ok(a + b)
/// }
/// let registry = rpc_core::Registry::builder().register(add)?.build();
/// assert!(registry.contains(add));
/// # Ok::<(), rpc_core::RegistryError>(())
/// ```
#[derive(Clone, Default)]
pub struct Registry {
    // Looked up by name on every request: a fast hash (names come from authenticated peers,
    // who could run any registered function anyway).
    pub(crate) entries: HashMap<&'static str, Entry, foldhash::fast::RandomState>,
    pub(crate) sinks: HashMap<&'static str, KeepSink, foldhash::fast::RandomState>,
}

/// The callee's state: what it serves, how many root calls at once, which calls can be
/// cancelled (its behaviour is in `dispatch.rs`).
pub(crate) struct Callee {
    pub registry: Registry,
    pub admission: Arc<Semaphore>,
    pub running: Arc<RunningCalls>,
    /// Delays injected before handlers by name (`testing::delay_calls`); `any_delay` keeps
    /// the common path to one load.
    pub delays: Mutex<HashMap<String, Duration>>,
    pub any_delay: AtomicBool,
}

/// The caller's settings and state (its behaviour is in `call/`).
pub(crate) struct Caller {
    /// The default call timeout (`Duration::ZERO`: none).
    pub rpc_timeout: Duration,
    /// Whether blocking calls take the calling thread's own connection.
    pub sync_connections: bool,
    pub next_cancel_id: AtomicU64,
}
