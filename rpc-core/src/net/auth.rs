//! The group secret and the connection handshake.
//!
//! Every connection (control, bulk, rendezvous) starts with a mutual HMAC-SHA256 challenge
//! before a single request byte is decoded:
//!
//! 1. server → client: `MAGIC`, a 32-byte random nonce `ns`;
//! 2. client → server: `MAGIC`, kind (1 byte), rank (u32 LE), nonce `nc`,
//!    `HMAC(secret, "client" | ns | nc | kind | rank)`;
//! 3. server → client: `1` and `HMAC(secret, "server" | nc | ns)` if the tag verifies (checked in
//!    constant time), else `0` and the connection closes.
//!
//! The client checks the server's tag too, so neither side talks to an impostor.
//!
//! - AUTH-1: the whole exchange is bounded by the handshake timeout, so a silent peer cannot
//!   hold a slot.
//! - AUTH-2: a listener runs at most [`MAX_UNAUTHENTICATED`] handshakes at once, each within
//!   [`ACCEPT_HANDSHAKE_TIMEOUT`]; connections beyond are closed at once, so a party without
//!   the secret cannot exhaust a worker's file descriptors.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::transport::Conn;
use crate::error::InitError;

/// Env var holding the group secret.
pub const SECRET_ENV: &str = "RPC_SECRET";
/// Env var naming a file that holds the group secret.
pub const SECRET_FILE_ENV: &str = "RPC_SECRET_FILE";

const MAGIC: &[u8; 8] = b"RXRPC\x00v1";
const NONCE: usize = 32;
const TAG: usize = 32;

/// The group's shared secret. Its `Debug` output is redacted.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

impl Secret {
    /// A secret from raw bytes.
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Self(Arc::from(bytes.as_ref()))
    }

    /// 32 random bytes, hex-encoded (so it can be passed through an env var).
    ///
    /// ```
    /// let s = rpc_core::Secret::generate();
    /// assert_eq!(s.as_str().unwrap().len(), 64);
    /// ```
    pub fn generate() -> Self {
        let mut raw = [0u8; 32];
        fill_random(&mut raw);
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Self::new(hex)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The secret as text, if it is UTF-8 (to hand to child processes via [`SECRET_ENV`]).
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// Reads [`SECRET_ENV`], else the file named by [`SECRET_FILE_ENV`] (trailing newline
    /// trimmed); `Ok(None)` if neither is set.
    pub fn from_env() -> Result<Option<Self>, InitError> {
        Self::from_env_with(&|k| std::env::var(k).ok())
    }

    pub(crate) fn from_env_with(
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, InitError> {
        if let Some(s) = env(SECRET_ENV) {
            if !s.is_empty() {
                return Ok(Some(Self::new(s)));
            }
        }
        if let Some(path) = env(SECRET_FILE_ENV) {
            let data = std::fs::read(&path).map_err(|source| InitError::SecretFile {
                path: path.clone(),
                source,
            })?;
            let trimmed = data.strip_suffix(b"\n").unwrap_or(&data);
            if trimmed.is_empty() {
                return Err(InitError::Config(format!("secret file {path} is empty")));
            }
            return Ok(Some(Self::new(trimmed)));
        }
        Ok(None)
    }

    fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("hmac takes any key length");
        for p in parts {
            m.update(p);
        }
        m
    }
}

pub(crate) fn fill_random(buf: &mut [u8]) {
    getrandom::getrandom(buf).expect("the OS random source is available");
}

/// What a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ConnKind {
    Control = 1,
    Bulk = 2,
    Rendezvous = 3,
    /// A calling thread's own connection for blocking calls (`blocking.rs`).
    Sync = 4,
    /// A failure detector's heartbeats (`liveness.rs`).
    Heartbeat = 5,
}

impl ConnKind {
    fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Control),
            2 => Some(Self::Bulk),
            3 => Some(Self::Rendezvous),
            4 => Some(Self::Sync),
            5 => Some(Self::Heartbeat),
            _ => None,
        }
    }
}

/// Connections of one listener that may be in their handshake at once; more are closed at
/// once (AUTH-2).
pub(crate) const MAX_UNAUTHENTICATED: usize = 64;
/// The longest the accepting side waits for a client to prove the secret (AUTH-2).
pub(crate) const ACCEPT_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Admits a listener's connections to the handshake: at most [`MAX_UNAUTHENTICATED`] at
/// once, each bounded by [`ACCEPT_HANDSHAKE_TIMEOUT`] (AUTH-2: anyone who can reach the port,
/// without the secret, holds few descriptors for little time).
#[derive(Clone)]
pub(crate) struct Gate {
    permits: Arc<tokio::sync::Semaphore>,
    refused: Arc<std::sync::atomic::AtomicU64>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            permits: Arc::new(tokio::sync::Semaphore::new(MAX_UNAUTHENTICATED)),
            refused: Arc::default(),
        }
    }
}

impl Gate {
    /// Runs the server's handshake on `conn` if a place is free, within the accepting side's
    /// timeout (or `timeout`, if shorter); the connection's kind and claimed rank, or why not.
    pub(crate) async fn handshake(
        &self,
        conn: &mut Conn,
        secret: &Secret,
        timeout: std::time::Duration,
    ) -> io::Result<(ConnKind, u32)> {
        let Ok(_permit) = self.permits.try_acquire() else {
            let n = self
                .refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n.is_power_of_two() {
                tracing::warn!(
                    refused = n + 1,
                    limit = MAX_UNAUTHENTICATED,
                    "too many connections in their handshake; closing new ones"
                );
            }
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "too many connections in their handshake",
            ));
        };
        tokio::time::timeout(timeout.min(ACCEPT_HANDSHAKE_TIMEOUT), server(conn, secret))
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake timed out",
                ))
            })
    }
}

fn denied(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, msg.to_owned())
}

/// The client's half of the handshake, computed from the server's hello.
struct ClientAnswer {
    /// What the client sends.
    msg: Vec<u8>,
    ns: [u8; NONCE],
    nc: [u8; NONCE],
}

fn client_answer(
    secret: &Secret,
    hello: &[u8; 8 + NONCE],
    kind: ConnKind,
    rank: u32,
) -> io::Result<ClientAnswer> {
    if &hello[..8] != MAGIC {
        return Err(denied("peer is not an rpc-core worker (bad magic)"));
    }
    let ns: [u8; NONCE] = hello[8..].try_into().expect("NONCE bytes");
    let mut nc = [0u8; NONCE];
    fill_random(&mut nc);
    let kind_b = [kind as u8];
    let rank_b = rank.to_le_bytes();
    let tag = secret
        .mac(&[b"client", &ns, &nc, &kind_b, &rank_b])
        .finalize()
        .into_bytes();
    let mut msg = Vec::with_capacity(8 + 1 + 4 + NONCE + TAG);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&kind_b);
    msg.extend_from_slice(&rank_b);
    msg.extend_from_slice(&nc);
    msg.extend_from_slice(&tag);
    Ok(ClientAnswer { msg, ns, nc })
}

impl ClientAnswer {
    /// Checks the server's verdict and its proof of the secret.
    fn check(&self, secret: &Secret, status: u8, server_tag: &[u8; TAG]) -> io::Result<()> {
        if status != 1 {
            return Err(denied("peer rejected our credentials (wrong secret)"));
        }
        secret
            .mac(&[b"server", &self.nc, &self.ns])
            .verify_slice(server_tag)
            .map_err(|_| denied("peer failed to prove the group secret"))
    }
}

fn closed_during_auth(_: io::Error) -> io::Error {
    denied("peer closed the connection during authentication (wrong secret?)")
}

/// Client side of the handshake.
pub(crate) async fn client(
    conn: &mut Conn,
    secret: &Secret,
    kind: ConnKind,
    rank: u32,
) -> io::Result<()> {
    let mut hello = [0u8; 8 + NONCE];
    conn.read_exact(&mut hello).await?;
    let answer = client_answer(secret, &hello, kind, rank)?;
    conn.write_all(&answer.msg).await?;
    conn.flush().await?;
    let mut status = [0u8; 1];
    conn.read_exact(&mut status)
        .await
        .map_err(closed_during_auth)?;
    let mut server_tag = [0u8; TAG];
    if status[0] == 1 {
        conn.read_exact(&mut server_tag).await?;
    }
    answer.check(secret, status[0], &server_tag)
}

/// Client side of the handshake on a blocking stream (the stream's own timeouts bound it).
pub(crate) fn client_blocking(
    conn: &mut (impl std::io::Read + std::io::Write),
    secret: &Secret,
    kind: ConnKind,
    rank: u32,
) -> io::Result<()> {
    let mut hello = [0u8; 8 + NONCE];
    conn.read_exact(&mut hello)?;
    let answer = client_answer(secret, &hello, kind, rank)?;
    conn.write_all(&answer.msg)?;
    conn.flush()?;
    let mut status = [0u8; 1];
    conn.read_exact(&mut status).map_err(closed_during_auth)?;
    let mut server_tag = [0u8; TAG];
    if status[0] == 1 {
        conn.read_exact(&mut server_tag)?;
    }
    answer.check(secret, status[0], &server_tag)
}

/// Server side of the handshake: returns the connection's kind and the peer's claimed rank.
pub(crate) async fn server(conn: &mut Conn, secret: &Secret) -> io::Result<(ConnKind, u32)> {
    let mut ns = [0u8; NONCE];
    fill_random(&mut ns);
    let mut hello = Vec::with_capacity(8 + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&ns);
    conn.write_all(&hello).await?;
    conn.flush().await?;
    let mut msg = [0u8; 8 + 1 + 4 + NONCE + TAG];
    conn.read_exact(&mut msg).await?;
    let kind_b = msg[8];
    let rank_b = &msg[9..13];
    let nc = &msg[13..13 + NONCE];
    let tag = &msg[13 + NONCE..];
    let ok = &msg[..8] == MAGIC
        && secret
            .mac(&[b"client", &ns, nc, &[kind_b], rank_b])
            .verify_slice(tag)
            .is_ok();
    let kind = ConnKind::from_u8(kind_b);
    match (ok, kind) {
        (true, Some(kind)) => {
            let server_tag = secret.mac(&[b"server", nc, &ns]).finalize().into_bytes();
            let mut reply = Vec::with_capacity(1 + TAG);
            reply.push(1);
            reply.extend_from_slice(&server_tag);
            conn.write_all(&reply).await?;
            conn.flush().await?;
            let rank = u32::from_le_bytes(rank_b.try_into().expect("4 bytes"));
            Ok((kind, rank))
        }
        _ => {
            let _ = conn.write_all(&[0]).await;
            let _ = conn.flush().await;
            Err(denied("client failed authentication"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(cs: &Secret, ss: &Secret) -> (io::Result<()>, io::Result<(ConnKind, u32)>) {
        let (a, b) = tokio::io::duplex(4096);
        let mut a: Conn = Box::new(a);
        let mut b: Conn = Box::new(b);
        tokio::join!(client(&mut a, cs, ConnKind::Bulk, 7), server(&mut b, ss))
    }

    #[tokio::test]
    async fn same_secret_authenticates_both_ways() {
        let s = Secret::new("k");
        let (c, srv) = pair(&s, &s).await;
        c.unwrap();
        assert_eq!(srv.unwrap(), (ConnKind::Bulk, 7));
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_on_both_sides() {
        let (c, srv) = pair(&Secret::new("a"), &Secret::new("b")).await;
        assert_eq!(c.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(srv.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
    }

    /// The blocking client speaks the same handshake as the async server, both ways.
    #[test]
    fn blocking_client_authenticates_against_the_server() {
        for (cs, ss, ok) in [("k", "k", true), ("a", "b", false)] {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let ss = Secret::new(ss);
            let server = std::thread::spawn(move || {
                let (s, _) = l.accept().unwrap();
                s.set_nonblocking(true).unwrap();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let mut c: Conn = Box::new(tokio::net::TcpStream::from_std(s).unwrap());
                    server(&mut c, &ss).await
                })
            });
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let c = client_blocking(&mut s, &Secret::new(cs), ConnKind::Control, 3);
            let srv = server.join().unwrap();
            if ok {
                c.unwrap();
                assert_eq!(srv.unwrap(), (ConnKind::Control, 3));
            } else {
                assert_eq!(c.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
                assert_eq!(srv.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
            }
        }
    }

    #[test]
    fn debug_redacts() {
        assert!(!format!("{:?}", Secret::new("hunter2")).contains("hunter2"));
    }
}
