//! Helpers for tests and single-process simulations.
//!
//! [`start_group`] starts a whole group inside the current process (over TCP on 127.0.0.1 or
//! over the in-memory network), with its own rendezvous on a free port. [`transports`] lists
//! one of each transport, so a test body can run over both.

use std::io;
use std::time::Duration;

use crate::agent::{init, Agent};
use crate::config::Config;
use crate::error::InitError;
use crate::net::auth::{self, ConnKind, Secret};
pub use crate::net::Io;
use crate::net::{MemoryNetwork, Transport};
use crate::registry::Registry;
use crate::rendezvous::RendezvousServer;

/// One TCP transport and one fresh in-memory network.
pub fn transports() -> Vec<Transport> {
    vec![Transport::Tcp, Transport::Memory(MemoryNetwork::new())]
}

/// Whether this host lets workers share bulk blobs through memory (see
/// [`Config::shm_arena_bytes`]): creates a small arena and maps it back the way a peer
/// would. The error says why not (no memfd, no `/proc`, not Linux).
pub fn shared_memory_probe() -> io::Result<()> {
    let arena = crate::net::shm::Arena::create(crate::net::shm::HEADER + 4096)?;
    crate::net::shm::Mapping::open(&arena.announce()).map(drop)
}

/// A short human name for a transport, for test messages.
pub fn transport_name(t: &Transport) -> &'static str {
    match t {
        Transport::Tcp => "tcp",
        Transport::Memory(_) => "memory",
    }
}

/// Starts `world_size` workers named `worker{rank}` in this process, sharing `secret`. `registry(rank)` gives
/// each worker its functions; `configure(rank, config)` may adjust each config (the secret,
/// rendezvous and transport are already set).
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), rpc_core::InitError> {
/// use rpc_core::{testing, Registry, Secret, Transport};
/// let agents =
///     testing::start_group(3, Transport::Tcp, Secret::generate(), |_| Registry::default(), |_, c| c)
///         .await?;
/// assert_eq!(agents[2].worker_info().name, "worker2");
/// futures::future::join_all(agents.iter().map(|a| a.shutdown())).await;
/// # Ok(()) }
/// ```
pub async fn start_group(
    world_size: u32,
    transport: Transport,
    secret: Secret,
    registry: impl Fn(u32) -> Registry,
    configure: impl Fn(u32, Config) -> Config,
) -> Result<Vec<Agent>, InitError> {
    let bind = match transport {
        Transport::Tcp => "127.0.0.1:0",
        Transport::Memory(_) => "rendezvous:0",
    };
    let server = RendezvousServer::start(
        &transport,
        bind,
        secret.clone(),
        world_size,
        Duration::from_secs(30),
    )
    .await?;
    let init_method = format!("tcp://{}", server.local_addr());
    let agents = futures::future::try_join_all((0..world_size).map(|rank| {
        let cfg = Config::new()
            .with_rank(rank)
            .with_world_size(world_size)
            .with_init_method(init_method.clone())
            .with_serve_rendezvous(false)
            .with_transport(transport.clone())
            .with_secret(secret.clone())
            .with_shutdown_timeout(Duration::from_secs(10));
        init(configure(rank, cfg), registry(rank))
    }))
    .await?;
    server.finish(Duration::from_secs(5)).await;
    Ok(agents)
}

/// Dials `addr` and completes the handshake as a control connection of `rank` with `secret`;
/// returns the raw stream, for tests that speak the wire protocol directly (oversized frames,
/// garbage).
pub async fn dial_authenticated(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
) -> io::Result<Box<dyn Io>> {
    dial_as(transport, addr, secret, rank, ConnKind::Control).await
}

/// Like [`dial_authenticated`], as a calling thread's own connection for blocking calls (see
/// [`Config::sync_connections`]), which the callee serves on a thread of its own.
pub async fn dial_authenticated_sync(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
) -> io::Result<Box<dyn Io>> {
    dial_as(transport, addr, secret, rank, ConnKind::Sync).await
}

async fn dial_as(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
    kind: ConnKind,
) -> io::Result<Box<dyn Io>> {
    let (mut conn, _) = transport.connect(addr).await?;
    auth::client(&mut conn, secret, kind, rank).await?;
    Ok(conn)
}

/// Stops (or resumes) the heartbeats of `agent`'s failure detector, as a frozen process's
/// would stop: its peers declare it failed once their failure timeout passes. The agent itself
/// goes on working (and watching its peers).
pub fn silence(agent: &Agent, silent: bool) {
    agent.inner.net.set_silent(silent);
}

/// Dials `addr` without authenticating.
pub async fn dial_raw(transport: &Transport, addr: &str) -> io::Result<Box<dyn Io>> {
    Ok(transport.connect(addr).await?.0)
}
