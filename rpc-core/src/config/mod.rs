//! Group configuration and its resolution from the environment.
//!
//! Rank and world size come from the config, else from the torchrun convention (`RANK`,
//! `WORLD_SIZE`), else Slurm (`SLURM_PROCID`, `SLURM_NTASKS`), else Open MPI
//! (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`), else MPICH and Intel MPI (`PMI_RANK`,
//! `PMI_SIZE`): [`RANK_ENV`], [`WORLD_SIZE_ENV`]. The rendezvous address comes from
//! `init_method` (`tcp://host:port`), else `MASTER_ADDR` and `MASTER_PORT`.
//!
//! A group may grow: with a maximum world size ([`Config::max_world_size`], or
//! [`MAX_WORLD_SIZE_ENV`]) above the world size, it forms with ranks `0..world_size` and
//! workers with the ranks after them join the running group, each when it starts. With a
//! maximum and no world size at all, the group is dynamic (PyTorch's `init_rpc` without a
//! world size): it forms at once and every worker joins and leaves when it likes.
//!
//! Layout: this file [`Config`] and its setters; `env.rs` every environment variable read;
//! `resolve.rs` the resolution into what each part of the worker uses.

mod env;
mod resolve;

pub(crate) use env::warn_of_near_misses;

use std::time::Duration;

use crate::net::{Secret, Transport, WireProtection};

pub use crate::rendezvous::RENDEZVOUS_FD_ENV;
pub use env::{
    launched_rank, launched_restart_count, FAILURE_TIMEOUT_ENV, HEARTBEAT_INTERVAL_ENV, JOB_ID_ENV,
    MASTER_ADDR_ENV, MASTER_PORT_ENV, MAX_WORLD_SIZE_ENV, RANK_ENV, REPLACE_TOKEN_ENV,
    RESTART_COUNT_ENV, RESTART_MODE_ENV, SERVE_RENDEZVOUS_ENV, SIGNAL_GRACE_ENV,
    TORCHRUN_AGENT_STORE_ENV, WIRE_PROTECTION_ENV, WORLD_SIZE_ENV,
};

/// How a worker joins its group. Build with [`Config::new`] and the `with_*` setters.
///
/// ```
/// use std::time::Duration;
/// let cfg = rpc_core::Config::new()
///     .with_name("trainer0")
///     .with_rank(0)
///     .with_world_size(3)
///     .with_init_method("tcp://127.0.0.1:29500")
///     .with_rpc_timeout(Duration::from_secs(10));
/// assert_eq!(cfg.rank, Some(0));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Unique worker name. Default: `worker{rank}`.
    pub name: Option<String>,
    /// Rank in `0..world_size` (`0..max_world_size` in a group that grows). Default: from
    /// the environment (see module docs).
    pub rank: Option<u32>,
    /// Number of workers the group forms with. Default: from the environment; none with a
    /// `max_world_size` makes the group dynamic.
    pub world_size: Option<u32>,
    /// Number of ranks the group may grow to: ranks from `world_size` up to this join the
    /// running group, each when it starts (every worker and the rendezvous must agree on it).
    /// Default: [`MAX_WORLD_SIZE_ENV`] if set, else the world size (a group of fixed size).
    pub max_world_size: Option<u32>,
    /// `tcp://host:port` of the rendezvous. Default: `MASTER_ADDR`:`MASTER_PORT`.
    pub init_method: Option<String>,
    /// Whether this worker hosts the rendezvous. Default: [`SERVE_RENDEZVOUS_ENV`] (`0` or
    /// `1`) if set (a launcher that hosts it sets `0`), else `rank == 0`.
    pub serve_rendezvous: Option<bool>,
    /// The socket the rendezvous this worker hosts serves on, bound already by whoever chose
    /// its port (which must be the rendezvous's), so that no other process can take the port
    /// between the choice and the bind (RDV-8). Default: the socket named in
    /// [`RENDEZVOUS_FD_ENV`] (a launcher hands it to the process it starts) if set, else the
    /// rendezvous binds its port itself.
    pub rendezvous_listener: Option<std::sync::Arc<std::net::TcpListener>>,
    /// Whether this process replaces the holder of its rank in a group that is already
    /// running (it was restarted after a failure): the rendezvous then admits it as the rank's
    /// next incarnation, and the group's connections from the previous one are refused from
    /// then on (fencing). While a group forms this changes nothing. Default: whether the
    /// launcher's restart count ([`launched_restart_count`]) is positive.
    pub replace: Option<bool>,
    /// The token that lets this replacement take its rank from a holder the group has not
    /// declared failed yet: the one the rendezvous issued to that holder, which told its
    /// launcher. Without it, a replacement waits (within the init timeout) until the holder
    /// is declared failed, so that holding the group's secret is not enough to evict a live
    /// member. Default: [`REPLACE_TOKEN_ENV`] (set by `rpcrun` on a process it restarts).
    pub replace_token: Option<String>,
    /// Whether a launcher replaces each failed process alone, into the running group
    /// (`rpcrun --restart worker`). Shutdown then waits, within its timeout, for a
    /// replacement of a failed rank 0 and meets the others at the replacement's barrier,
    /// instead of ending at once when rank 0 fails (a program whose workers serve until rank 0
    /// shuts the group down outlives the loss of rank 0). Default: whether
    /// [`RESTART_MODE_ENV`] is `worker`.
    pub replaced_on_failure: Option<bool>,
    /// Address this worker's listener binds. Default: `127.0.0.1:0` when the rendezvous host
    /// is loopback, else `0.0.0.0:0` (the advertised address is then the local IP of the
    /// connection to the rendezvous).
    pub listen_addr: Option<String>,
    /// The transport. Default: TCP.
    pub transport: Transport,
    /// The group secret. Default: from `RPC_SECRET` or the file named by `RPC_SECRET_FILE`;
    /// init fails if none is set.
    pub secret: Option<Secret>,
    /// Default timeout of a call; `Duration::ZERO` means none. Default: 60 s.
    pub rpc_timeout: Duration,
    /// How long init waits for every rank to join. Default: 120 s.
    pub init_timeout: Duration,
    /// Bound on each shutdown phase (barrier, drain). Default: 30 s.
    pub shutdown_timeout: Duration,
    /// Bound on dialling a peer. Default: 10 s.
    pub connect_timeout: Duration,
    /// Bound on the authentication handshake of a connection. Default: 10 s.
    pub handshake_timeout: Duration,
    /// Largest frame accepted or sent on a control or blocking connection: a call's payload
    /// and the blobs that ride inside its envelope (small ones, up to half this in all; the
    /// others take the bulk path). A frame is the envelope of one call, so this bounds what
    /// one request of an authenticated peer can make a worker allocate. Default: 32 MiB.
    pub max_frame_bytes: usize,
    /// Largest blob sent or accepted on the bulk path (large tensors). Default: 1 GiB.
    pub max_blob_bytes: usize,
    /// Bytes queued for one connection and not yet written above which new calls on it fail
    /// at once (a peer that stopped reading fails them instead of growing the queue; replies
    /// to a caller that stopped reading are dropped). Default: 256 MiB.
    pub max_queued_bytes: usize,
    /// Calls from one connection that may wait at once on this worker (a call that answers
    /// at once never counts): one more is refused at once with
    /// [`RemoteErrorKind::Busy`](crate::RemoteErrorKind::Busy), naming the limit, so a peer
    /// cannot grow the memory this worker spends on its calls without bound (calls nested in
    /// others skip [`Config::max_concurrent_calls`], not this). Default: 65,536.
    pub max_in_flight_calls: usize,
    /// Bytes of the arguments (payload and blobs) of the calls from one connection that wait
    /// at once on this worker: one more that would pass it is refused at once, as above (a
    /// call alone is never refused for its size: the frame and blob limits bound it).
    /// Default: 256 MiB.
    pub max_in_flight_bytes: usize,
    /// Root calls (not nested in another call) served at once; more wait. Nested calls are
    /// never held back, so call chains cannot deadlock on this limit. Default: 65,536.
    pub max_concurrent_calls: usize,
    /// Blobs of at least this many bytes travel on the bulk connection. Default: 256 KiB.
    pub bulk_threshold: usize,
    /// Receive buffers of large blobs kept for reuse once their blobs are dropped, in bytes.
    /// Default: 128 MiB.
    pub bulk_pool_bytes: usize,
    /// How long a thread that expects a message polls for it before it sleeps: after each
    /// call sent or request received, one runtime thread polls its sockets this long; a
    /// thread in a blocking call polls for the reply, and the thread serving a blocking
    /// connection for the next request, this long. Waking a sleeping thread costs more than
    /// a loopback round trip on VMs (an inter-processor interrupt to a halted virtual CPU:
    /// 50–150 µs measured on a 2-vCPU VM, against a 20 µs raw ping-pong), so a reply that
    /// comes within the window saves that. A polling thread gives way to any other thread
    /// runnable on its core, so it spends idle time; each message costs at most this much
    /// CPU. Zero turns polling off (for processes that pay for every cycle). Default: 100 µs.
    pub busy_poll: Duration,
    /// Bytes of the shared-memory arena each worker offers a peer on the same host for bulk
    /// blobs; 0 turns the shared-memory path off. Whether a peer shares the host is probed,
    /// not assumed: the first large blob to a peer announces an arena, and until the peer has
    /// mapped it (or where it cannot: another host, another container) blobs travel on the
    /// bulk connection's byte stream. A blob that finds no room in the arena also takes the
    /// stream, so a receiver that keeps blobs alive never blocks a sender. Pages are touched
    /// only as blobs use them. Linux only. Default: 128 MiB.
    pub shm_arena_bytes: usize,
    /// Whether `rpc_sync` from a thread that is not running async code writes and reads the
    /// thread's own connection to the peer (TCP only), instead of handing the call to a
    /// runtime thread and waiting to be handed the reply; the peer serves each such connection
    /// on a thread of its own instead of its runtime. A round trip then costs what a raw
    /// socket ping-pong does, with no thread hand-offs at either end. Each calling thread
    /// keeps one connection per peer it calls (and each peer one serving thread for it),
    /// closed when the calling thread ends or either agent shuts down. Default: on.
    pub sync_connections: bool,
    /// At most this many sync connections (see [`Config::sync_connections`]) are open from
    /// this worker at once, over all its threads and peers; a thread that finds none free
    /// makes its blocking calls through the runtime instead. This bounds the serving threads
    /// a program with many calling threads costs its peers. Default: 64.
    pub max_sync_connections: usize,
    /// How often the failure detector sends each peer a heartbeat. The detector runs on a
    /// thread of its own, so a worker whose runtime is busy computing still beats, and one
    /// that is frozen (SIGSTOP, a hung host, a partition) does not. `Duration::ZERO` turns
    /// the detector off. Default: `RPC_HEARTBEAT_INTERVAL_MS` if set, else 250 ms.
    pub heartbeat_interval: Option<Duration>,
    /// How long a peer may stay silent before it is declared failed (every wait on it then
    /// ends with [`RpcError::PeerFailed`](crate::RpcError::PeerFailed)). A peer whose process
    /// is gone is declared failed at once. At least twice the heartbeat interval. Default:
    /// `RPC_FAILURE_TIMEOUT_MS` if set, else 1.5 s: a frozen peer is found within 2 s on
    /// loopback, with room for a loaded machine's scheduling delays.
    pub failure_timeout: Option<Duration>,
    /// What protects connections' bytes after the handshake that authenticates each one: a
    /// MAC on every record (keyed BLAKE3 tags, keys of that connection alone), authenticated
    /// encryption (AES-256-GCM), or nothing. Each side's setting is the least it accepts, and a connection
    /// uses the stronger of its two sides'. Default: `RPC_WIRE_PROTECTION` (`auto`, `mac`,
    /// `encrypt`, `off`) if set, else [`WireProtection::Auto`]: a MAC between hosts, nothing
    /// within one.
    pub wire_protection: Option<WireProtection>,
    /// Opt-in: an orderly end on SIGTERM, SIGINT or SIGHUP (`signals.rs`). A launcher stops
    /// every process of a group with SIGTERM once one failed; with a grace, this worker refuses new
    /// calls ([`RpcError::Stopped`](crate::RpcError::Stopped), naming the signal) and lets
    /// those in flight end (a call to the failed worker then fails naming it), so the program
    /// can report its own error; after the grace its outgoing calls fail naming the signal and
    /// the process exits with 128 + the signal. Keep it below the launcher's own grace
    /// before SIGKILL (`rpcrun --stop-grace-secs`, 5 s). Installs a process-wide handler.
    /// Default: `RPC_SIGNAL_GRACE_MS` if set, else none (the signal's default action).
    pub signal_grace: Option<Duration>,
    /// The job's trace (see [`trace`](crate::trace)): with a path, this worker records its
    /// calls, transfers, collectives, backward, optimizer steps and failures, and at shutdown
    /// writes its part to `<path>.parts/`, on rank 0's clock (or, if it does not shut down,
    /// as its process exits or on the SIGTERM, SIGINT or SIGHUP that stops it: the signal
    /// then ends the process as it would have, TR-5); a launcher (`rpcrun --trace`)
    /// or [`trace::merge_parts`](crate::trace::merge_parts) makes the one file. Default:
    /// [`TRACE_ENV`](crate::trace::TRACE_ENV) if set, else off (and then free). A path that
    /// cannot be written fails `init` ([`trace::prepare`](crate::trace::prepare)).
    pub trace: Option<std::path::PathBuf>,
    /// The most events this worker's trace keeps: the newest (TR-2). Default
    /// [`DEFAULT_TRACE_CAPACITY`](crate::trace::DEFAULT_TRACE_CAPACITY); 0 is refused.
    pub trace_capacity: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            name: None,
            rank: None,
            world_size: None,
            max_world_size: None,
            init_method: None,
            serve_rendezvous: None,
            rendezvous_listener: None,
            replace: None,
            replace_token: None,
            replaced_on_failure: None,
            listen_addr: None,
            transport: Transport::Tcp,
            secret: None,
            rpc_timeout: Duration::from_secs(60),
            init_timeout: Duration::from_secs(120),
            shutdown_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            max_frame_bytes: 32 << 20,
            max_blob_bytes: 1 << 30,
            max_queued_bytes: 256 << 20,
            max_in_flight_calls: 65_536,
            max_in_flight_bytes: 256 << 20,
            max_concurrent_calls: 65_536,
            bulk_threshold: 256 << 10,
            bulk_pool_bytes: 128 << 20,
            busy_poll: Duration::from_micros(100),
            shm_arena_bytes: 128 << 20,
            sync_connections: true,
            max_sync_connections: 64,
            heartbeat_interval: None,
            failure_timeout: None,
            wire_protection: None,
            signal_grace: None,
            trace: None,
            trace_capacity: crate::trace::DEFAULT_TRACE_CAPACITY,
        }
    }
}

macro_rules! setters {
    ($($(#[$m:meta])* $fn:ident($field:ident: $ty:ty) => $conv:expr;)*) => {
        $( $(#[$m])* pub fn $fn(mut self, $field: $ty) -> Self { self.$field = $conv; self } )*
    };
}

impl Config {
    /// The defaults (see each field).
    pub fn new() -> Self {
        Self::default()
    }

    setters! {
        /// Sets [`Config::name`].
        with_name(name: impl Into<String>) => Some(name.into());
        /// Sets [`Config::rank`].
        with_rank(rank: u32) => Some(rank);
        /// Sets [`Config::world_size`].
        with_world_size(world_size: u32) => Some(world_size);
        /// Sets [`Config::max_world_size`].
        with_max_world_size(max_world_size: u32) => Some(max_world_size);
        /// Sets [`Config::init_method`] (`tcp://host:port`).
        with_init_method(init_method: impl Into<String>) => Some(init_method.into());
        /// Sets [`Config::serve_rendezvous`].
        with_serve_rendezvous(serve_rendezvous: bool) => Some(serve_rendezvous);
        /// Sets [`Config::rendezvous_listener`].
        with_rendezvous_listener(rendezvous_listener: std::net::TcpListener) =>
            Some(std::sync::Arc::new(rendezvous_listener));
        /// Sets [`Config::replace`].
        with_replace(replace: bool) => Some(replace);
        /// Sets [`Config::replace_token`].
        with_replace_token(replace_token: impl Into<String>) => Some(replace_token.into());
        /// Sets [`Config::replaced_on_failure`].
        with_replaced_on_failure(replaced_on_failure: bool) => Some(replaced_on_failure);
        /// Sets [`Config::listen_addr`](Config#structfield.listen_addr).
        with_listen_addr(listen_addr: impl Into<String>) => Some(listen_addr.into());
        /// Sets [`Config::transport`].
        with_transport(transport: Transport) => transport;
        /// Sets [`Config::secret`](Config#structfield.secret).
        with_secret(secret: Secret) => Some(secret);
        /// Sets [`Config::rpc_timeout`] (`Duration::ZERO`: none).
        with_rpc_timeout(rpc_timeout: Duration) => rpc_timeout;
        /// Sets [`Config::init_timeout`].
        with_init_timeout(init_timeout: Duration) => init_timeout;
        /// Sets [`Config::shutdown_timeout`].
        with_shutdown_timeout(shutdown_timeout: Duration) => shutdown_timeout;
        /// Sets [`Config::connect_timeout`].
        with_connect_timeout(connect_timeout: Duration) => connect_timeout;
        /// Sets [`Config::handshake_timeout`].
        with_handshake_timeout(handshake_timeout: Duration) => handshake_timeout;
        /// Sets [`Config::max_frame_bytes`].
        with_max_frame_bytes(max_frame_bytes: usize) => max_frame_bytes;
        /// Sets [`Config::max_blob_bytes`].
        with_max_blob_bytes(max_blob_bytes: usize) => max_blob_bytes;
        /// Sets [`Config::max_queued_bytes`].
        with_max_queued_bytes(max_queued_bytes: usize) => max_queued_bytes;
        /// Sets [`Config::max_in_flight_calls`].
        with_max_in_flight_calls(max_in_flight_calls: usize) => max_in_flight_calls;
        /// Sets [`Config::max_in_flight_bytes`].
        with_max_in_flight_bytes(max_in_flight_bytes: usize) => max_in_flight_bytes;
        /// Sets [`Config::max_concurrent_calls`].
        with_max_concurrent_calls(max_concurrent_calls: usize) => max_concurrent_calls;
        /// Sets [`Config::bulk_threshold`].
        with_bulk_threshold(bulk_threshold: usize) => bulk_threshold;
        /// Sets [`Config::bulk_pool_bytes`].
        with_bulk_pool_bytes(bulk_pool_bytes: usize) => bulk_pool_bytes;
        /// Sets [`Config::busy_poll`].
        with_busy_poll(busy_poll: Duration) => busy_poll;
        /// Sets [`Config::shm_arena_bytes`] (0: off).
        with_shm_arena_bytes(shm_arena_bytes: usize) => shm_arena_bytes;
        /// Sets [`Config::sync_connections`].
        with_sync_connections(sync_connections: bool) => sync_connections;
        /// Sets [`Config::max_sync_connections`].
        with_max_sync_connections(max_sync_connections: usize) => max_sync_connections;
        /// Sets [`Config::heartbeat_interval`] (`Duration::ZERO`: no failure detector).
        with_heartbeat_interval(heartbeat_interval: Duration) => Some(heartbeat_interval);
        /// Sets [`Config::failure_timeout`].
        with_failure_timeout(failure_timeout: Duration) => Some(failure_timeout);
        /// Sets [`Config::signal_grace`].
        with_signal_grace(signal_grace: Duration) => Some(signal_grace);
        /// Sets [`Config::trace`].
        with_trace(trace: impl Into<std::path::PathBuf>) => Some(trace.into());
        /// Sets [`Config::trace_capacity`].
        with_trace_capacity(trace_capacity: usize) => trace_capacity;
        /// Sets [`Config::wire_protection`].
        with_wire_protection(wire_protection: WireProtection) => Some(wire_protection);
    }
}

#[cfg(test)]
mod tests;
