//! Helpers for tests and single-process simulations.
//!
//! [`start_group`] starts a whole group inside the current process (over TCP on 127.0.0.1 or
//! over the in-memory network), with its own rendezvous on a free port. [`transports`] lists
//! one of each transport, so a test body can run over both.

use std::io;
use std::time::Duration;

use crate::config::Config;
use crate::error::InitError;
use crate::init::init;
use crate::net::auth::{self, ConnKind, Secret};
pub use crate::net::Io;
use crate::net::{MemoryNetwork, Transport, WireProtection};
use crate::rendezvous::RendezvousServer;
use crate::state::Agent;
use crate::state::Registry;

/// A port of 127.0.0.1 free now, for a rendezvous address a test must name before anything
/// binds it (`--rdzv`, `MASTER_PORT`): drawn below Linux's default ephemeral range (32768 and
/// up), where neither outgoing connections nor listeners on port 0 take ports, so that no
/// other test's traffic can take it before the program binds it (RDV-8; a launcher that chooses
/// the port itself keeps it bound instead). At most 64 draws, then any free port.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let mut x = h.finish();
    for _ in 0..64 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = 20_000 + ((x >> 33) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

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
/// returns the stream (protected as the worker asks), for tests that speak the wire protocol
/// directly (oversized frames, garbage).
pub async fn dial_authenticated(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
) -> io::Result<Box<dyn Io>> {
    dial_as(
        transport,
        addr,
        secret,
        auth::Ident {
            rank,
            incarnation: 0,
        },
        ConnKind::Control,
        WireProtection::Auto,
    )
    .await
}

/// Like [`dial_authenticated`], asking for at least `protection`; the stream seals what is
/// written to it (flush to send) and opens what is read as agreed.
pub async fn dial_protected(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
    protection: WireProtection,
) -> io::Result<Box<dyn Io>> {
    let me = auth::Ident {
        rank,
        incarnation: 0,
    };
    dial_as(transport, addr, secret, me, ConnKind::Control, protection).await
}

/// Like [`dial_authenticated`], claiming to be incarnation `incarnation` of `rank` (a process
/// that was replaced, or a replacement the worker has not heard of): the worker refuses the
/// connection unless that is the incarnation it knows (fencing).
pub async fn dial_as_incarnation(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
    incarnation: u64,
) -> io::Result<Box<dyn Io>> {
    let me = auth::Ident { rank, incarnation };
    dial_as(
        transport,
        addr,
        secret,
        me,
        ConnKind::Control,
        WireProtection::Auto,
    )
    .await
}

/// Like [`dial_authenticated`], as a calling thread's own connection for blocking calls (see
/// [`Config::sync_connections`]), which the callee serves on a thread of its own.
pub async fn dial_authenticated_sync(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    rank: u32,
) -> io::Result<Box<dyn Io>> {
    dial_as(
        transport,
        addr,
        secret,
        auth::Ident {
            rank,
            incarnation: 0,
        },
        ConnKind::Sync,
        WireProtection::Auto,
    )
    .await
}

async fn dial_as(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    ident: auth::Ident,
    kind: ConnKind,
    protection: WireProtection,
) -> io::Result<Box<dyn Io>> {
    let (mut conn, _) = transport.connect(addr).await?;
    // A tool's dial: whoever listens there (IDN-1's check is the workers' own dials').
    let session = auth::client(&mut conn, secret, protection, kind, ident, None).await?;
    Ok(session.wrap(conn))
}

/// Drops `agent`'s link to the rendezvous, as a network fault would; it dials again at once
/// (RDV-6).
pub fn cut_rendezvous_link(agent: &Agent) {
    agent.inner.net.membership.cut_link.notify_one();
}

/// Freezes (or thaws) `server`: while frozen it sends nothing on any member's link, neither
/// updates nor the ticks of RDV-7 (a member's redial gets no answer either), as a stopped
/// process would not; its connections stay open.
pub fn freeze_rendezvous(server: &RendezvousServer, frozen: bool) {
    server
        .shared
        .silenced
        .store(frozen, std::sync::atomic::Ordering::Relaxed);
}

/// Deafens (or restores) `server`: while deaf it drops every report it reads, as a connection
/// that breaks loses the reports still on their way (TCP accepted them from the sender).
pub fn deafen_rendezvous(server: &RendezvousServer, deaf: bool) {
    server
        .shared
        .deaf
        .store(deaf, std::sync::atomic::Ordering::Relaxed);
}

/// Whether `agent` has a link to the rendezvous now.
pub fn has_rendezvous_link(agent: &Agent) -> bool {
    !agent.inner.net.membership.own.is_adrift()
}

/// The token the rendezvous issued to `agent`'s incarnation, which its launcher hands to a
/// process that replaces it ([`Config::replace_token`](crate::Config::replace_token)).
pub fn replace_token(agent: &Agent) -> String {
    agent.inner.net.membership.own.token_value()
}

/// Stops (or resumes) the heartbeats of `agent`'s failure detector, as a frozen process's
/// would stop: its peers declare it failed once their failure timeout passes. The agent itself
/// goes on working (and watching its peers).
pub fn silence(agent: &Agent, silent: bool) {
    agent.inner.net.set_silent(silent);
}

/// Delays every call of `fn_name` that `agent` serves from another worker by `delay` before
/// its handler runs (`None` ends it), as an overloaded or slow worker would answer: for tests
/// of what happens while a call is still on its way.
pub fn delay_calls(agent: &Agent, fn_name: &str, delay: Option<std::time::Duration>) {
    agent.inner.callee.set_delay(fn_name, delay);
}

/// Dials `addr` without authenticating.
pub async fn dial_raw(transport: &Transport, addr: &str) -> io::Result<Box<dyn Io>> {
    Ok(transport.connect(addr).await?.0)
}

/// A request frame built field by field, for tests that send what no correct caller would
/// (hostile or broken peers): every field of the envelope and of tarpc's request around it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RawRequest {
    /// The function's registered name.
    pub fn_name: String,
    /// Its signature fingerprint.
    pub sig: u64,
    /// Nesting depth (0: a root call).
    pub depth: u32,
    /// The arguments as encoded (see [`RawRequest::call`]).
    pub payload: Vec<u8>,
    /// The side table's entries, each riding inline.
    pub blobs: Vec<Vec<u8>>,
    /// Empty entries appended to the side table (written as they are encoded: a test can
    /// send millions without holding them).
    pub padding_blobs: usize,
    /// Empty call-metadata entries (a correct caller sends a few keys), written the same way.
    pub meta_entries: usize,
    /// The relative deadline as it goes on the wire.
    pub deadline: Duration,
    /// The request's id on its connection.
    pub id: u64,
}

impl RawRequest {
    /// A request for `F` with `args` encoded as the framework encodes arguments: a correct one
    /// when `args` is an `F::Args` (edit its fields, or give other arguments, to make it
    /// hostile).
    pub fn call<F: crate::RemoteFn, A: serde::Serialize + ?Sized>(args: &A) -> Self {
        let (payload, blobs) = crate::blob::encode(args, None).expect("encodable arguments");
        Self {
            fn_name: F::NAME.to_owned(),
            sig: crate::registry::sig_of::<F>(),
            depth: 0,
            payload,
            blobs: blobs.into_iter().map(|b| b.to_vec()).collect(),
            padding_blobs: 0,
            meta_entries: 0,
            deadline: Duration::from_secs(30),
            id: 1,
        }
    }

    /// The request as one length-prefixed frame, as a control or blocking connection carries.
    /// Each part is encoded as the framework encodes it (`wire::CallRequest` inside tarpc's
    /// request), so a frame with nothing edited is served like any call.
    pub fn frame(&self) -> Vec<u8> {
        use serde::Serialize;
        #[derive(Serialize)]
        enum OutMessage<'a> {
            Request(OutRequest<'a>),
        }
        #[derive(Serialize)]
        struct OutRequest<'a> {
            context: OutContext,
            id: u64,
            message: OutCall<'a>,
        }
        #[derive(Serialize)]
        struct OutContext {
            deadline: Duration,
            trace_context: tarpc::trace::Context,
        }
        #[derive(Serialize)]
        struct OutCall<'a> {
            fn_name: &'a str,
            sig: u64,
            depth: u32,
            #[serde(with = "serde_bytes")]
            payload: &'a [u8],
            blobs: Blobs<'a>,
            keep: Option<()>,
            meta: Meta,
            cancel_id: Option<u64>,
            trace: Option<u64>,
        }
        #[derive(Clone, Serialize)]
        enum OutBlob<'a> {
            Inline(#[serde(with = "serde_bytes")] &'a [u8]),
        }
        struct Blobs<'a>(&'a [Vec<u8>], usize);
        impl Serialize for Blobs<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let real = self.0.iter().map(|b| OutBlob::Inline(b));
                let padding = std::iter::repeat_n(OutBlob::Inline(&[]), self.1);
                s.collect_seq(real.chain(padding))
            }
        }
        struct Meta(usize);
        impl Serialize for Meta {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(std::iter::repeat_n(("", &[] as &[u8]), self.0))
            }
        }
        let msg = OutMessage::Request(OutRequest {
            context: OutContext {
                deadline: self.deadline,
                trace_context: tarpc::context::current().trace_context,
            },
            id: self.id,
            message: OutCall {
                fn_name: &self.fn_name,
                sig: self.sig,
                depth: self.depth,
                payload: &self.payload,
                blobs: Blobs(&self.blobs, self.padding_blobs),
                keep: None,
                meta: Meta(self.meta_entries),
                cancel_id: None,
                trace: None,
            },
        });
        let mut buf = bytes::BytesMut::new();
        crate::net::encode_frame(&mut buf, &msg, usize::MAX).expect("encodes");
        buf.to_vec()
    }
}

/// Reads frames from `conn` until the reply to request `id` of `F` (a connection a test wrote
/// [`RawRequest`] frames on): the decoded result, or the callee's error. Bounded by `within`;
/// an error if the connection ends first or the reply does not decode as `F`'s result.
pub async fn read_reply<F: crate::RemoteFn>(
    conn: &mut Box<dyn Io>,
    id: u64,
    within: Duration,
) -> io::Result<Result<F::Output, crate::RemoteError>> {
    use tokio::io::AsyncReadExt;
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    tokio::time::timeout(within, async {
        loop {
            let len = conn.read_u32().await? as usize;
            let mut body = vec![0; len];
            conn.read_exact(&mut body).await?;
            let r: tarpc::Response<crate::wire::CallReply> = crate::net::decode_frame(&body)?;
            if r.request_id != id {
                continue;
            }
            let ok = match r.message {
                Ok(Ok(ok)) => ok,
                Ok(Err(e)) => return Ok(Err(e)),
                Err(e) => return Err(io::Error::new(e.kind, e.detail)),
            };
            let blobs = ok
                .blobs
                .into_iter()
                .map(|b| match b {
                    crate::wire::WireBlob::Inline(v) => Ok(bytes::Bytes::from(v)),
                    crate::wire::WireBlob::Bulk { .. } => {
                        Err(invalid("a bulk blob in a raw reply".into()))
                    }
                })
                .collect::<io::Result<_>>()?;
            return crate::blob::decode(&ok.payload, blobs, None)
                .map(Ok)
                .map_err(|e| invalid(e.to_string()));
        }
    })
    .await
    .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "no reply in time")))
}

/// Runs a fuzz target (a function that panics on a finding) over `seeds`, then over `mutations`
/// inputs derived from them as a fuzzer would (bits flipped, bytes set to edge values, ranges
/// inserted, removed, repeated, or spliced from another seed, lengths overwritten), drawn from
/// a generator seeded by `name` so a failure repeats. On a finding it prints the input (hex)
/// and panics with the target's message. Returns how many inputs ran.
pub fn replay_fuzz_target(
    name: &str,
    seeds: &[Vec<u8>],
    mutations: usize,
    target: impl Fn(&[u8]),
) -> usize {
    let mut state = name.bytes().fold(0x9e37_79b9_7f4a_7c15u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut rand = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let run = |input: &[u8]| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(input)));
        if let Err(p) = r {
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            eprintln!(
                "fuzz target {name} failed on input ({} bytes): {hex}",
                input.len()
            );
            std::panic::resume_unwind(p);
        }
    };
    for s in seeds {
        run(s);
    }
    if seeds.is_empty() {
        return 0;
    }
    let edges: [u64; 8] = [0, 1, 0x7f, 0x80, 0xff, 0xffff, u32::MAX as u64, u64::MAX];
    for _ in 0..mutations {
        let mut input = seeds[rand() as usize % seeds.len()].clone();
        for _ in 0..1 + rand() % 4 {
            let at = |r: u64, len: usize| (r as usize) % (len + 1);
            let pos = at(rand(), input.len());
            match rand() % 7 {
                0 if pos < input.len() => input[pos] ^= 1 << (rand() % 8),
                1 if pos < input.len() => input[pos] = edges[rand() as usize % 5] as u8,
                2 => {
                    let n = 1 + rand() as usize % 16;
                    let bytes: Vec<u8> = (0..n).map(|_| rand() as u8).collect();
                    input.splice(pos..pos, bytes);
                }
                3 => {
                    let end = (pos + 1 + rand() as usize % 32).min(input.len());
                    input.drain(pos..end);
                }
                4 => {
                    let end = (pos + 1 + rand() as usize % 64).min(input.len());
                    let copy = input[pos..end].to_vec();
                    let to = at(rand(), input.len());
                    input.splice(to..to, copy);
                }
                5 => {
                    let other = &seeds[rand() as usize % seeds.len()];
                    let from = at(rand(), other.len());
                    input.truncate(pos);
                    input.extend_from_slice(&other[from..]);
                }
                _ => {
                    let v = edges[rand() as usize % edges.len()].to_le_bytes();
                    let w = [4usize, 8][rand() as usize % 2];
                    let end = (pos + w).min(input.len());
                    let n = end - pos;
                    input[pos..end].copy_from_slice(&v[..n]);
                }
            }
        }
        run(&input);
    }
    seeds.len() + mutations
}
