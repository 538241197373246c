//! The group secret and the connection handshake.
//!
//! Every connection (control, bulk, rendezvous, heartbeat, blocking) starts with a mutual
//! HMAC-SHA256 challenge before a single request byte is decoded:
//!
//! 1. server → client: `MAGIC`, a 32-byte random nonce `ns`;
//! 2. client → server: `MAGIC`, kind (1 byte), rank (u32 LE), incarnation (u64 LE), the
//!    protection it wants (1 byte, see `seal/`), nonce `nc`,
//!    `HMAC(secret, "client" | ns | nc | kind | rank | incarnation | wants)`;
//! 3. server → client: `1`, the agreed protection (the stronger of both sides' wishes), the
//!    server's own rank (u32 LE) and incarnation (u64 LE), and
//!    `HMAC(secret, "server" | nc | ns | agreed | rank | incarnation)` if the tag verifies
//!    (checked in constant time), else `0` and the connection closes.
//!
//! The client checks the server's tag too, so neither side talks to an impostor, and nobody
//! on the path can weaken the protection both tags cover. Both sides then derive the
//! connection's keys from the secret and both nonces (`seal/`).
//!
//! - IDN-1: a connection is bound to the worker its client dialled: the server says who it is
//!   (rank and incarnation, under its tag), and the client refuses a server that is another
//!   rank or an older incarnation than the group's table holds (a port that another worker
//!   took over after a restart, a stale process); the server checks the client's claim
//!   against its view of the group (MEM-1).
//!
//! - AUTH-1: the whole exchange is bounded by the handshake timeout, so a silent peer cannot
//!   hold a slot.
//! - AUTH-2: a listener runs at most [`MAX_UNAUTHENTICATED`] handshakes at once, each within
//!   [`ACCEPT_HANDSHAKE_TIMEOUT`]; connections beyond are closed at once, so a party without
//!   the secret cannot exhaust a worker's file descriptors.

use hmac::Mac;
use std::fmt;
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::seal::{self, Mode, Session, Transcript, WireProtection};
use super::transport::Conn;

pub(crate) use super::secret::fill_random;
pub use super::secret::{Secret, SECRET_ENV, SECRET_FILE_ENV};

const MAGIC: &[u8; 8] = b"RXRPC\x00v4";
const NONCE: usize = 32;
const TAG: usize = 32;

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
    /// timeout (or `timeout`, if shorter), stating `me`; the connection's kind and claimed
    /// rank, or why not.
    pub(crate) async fn handshake(
        &self,
        conn: &mut Conn,
        secret: &Secret,
        protection: WireProtection,
        timeout: std::time::Duration,
        me: Ident,
    ) -> io::Result<Accepted> {
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
        tokio::time::timeout(
            timeout.min(ACCEPT_HANDSHAKE_TIMEOUT),
            server(conn, secret, protection, me),
        )
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

/// Who either end of a connection says it is: a rank and the incarnation holding it (MEM-1),
/// so a replaced process can be refused (fencing), and a dial reaches the worker it meant
/// (IDN-1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ident {
    pub rank: u32,
    pub incarnation: u64,
}

/// The identity the rendezvous's listener states.
pub(crate) const RENDEZVOUS: Ident = Ident {
    rank: u32::MAX,
    incarnation: 0,
};

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == RENDEZVOUS {
            f.write_str("the rendezvous")
        } else {
            write!(f, "rank {} (incarnation {})", self.rank, self.incarnation)
        }
    }
}

/// What the server learns from a handshake that succeeded.
pub(crate) struct Accepted {
    /// What the connection is for.
    pub kind: ConnKind,
    /// The rank the client claims (proven only as far as the secret goes).
    pub rank: u32,
    /// The incarnation of that rank it claims to be.
    pub incarnation: u64,
    /// The connection's keys, as agreed.
    pub session: Session,
}

impl fmt::Debug for Accepted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accepted")
            .field("kind", &self.kind)
            .field("rank", &self.rank)
            .field("incarnation", &self.incarnation)
            .field("mode", &self.session.mode())
            .finish()
    }
}

/// The client's half of the handshake, computed from the server's hello.
struct ClientAnswer {
    /// What the client sends.
    msg: Vec<u8>,
    ns: [u8; NONCE],
    nc: [u8; NONCE],
    kind: u8,
    rank: u32,
    wants: Mode,
}

/// The client's message: magic, kind, rank, incarnation, wants, nonce, tag.
const CLIENT_MSG: usize = 8 + 1 + 4 + 8 + 1 + NONCE + TAG;

fn client_answer(
    secret: &Secret,
    hello: &[u8; 8 + NONCE],
    kind: ConnKind,
    me: Ident,
    wants: Mode,
) -> io::Result<ClientAnswer> {
    let rank = me.rank;
    if &hello[..8] != MAGIC {
        return Err(denied(
            "peer is not an rpc-core worker of this protocol version (bad magic)",
        ));
    }
    let ns: [u8; NONCE] = hello[8..].try_into().expect("NONCE bytes");
    let mut nc = [0u8; NONCE];
    fill_random(&mut nc);
    let kind_b = [kind as u8];
    let rank_b = rank.to_le_bytes();
    let inc_b = me.incarnation.to_le_bytes();
    let wants_b = [wants as u8];
    let tag = secret
        .mac(&[b"client", &ns, &nc, &kind_b, &rank_b, &inc_b, &wants_b])
        .finalize()
        .into_bytes();
    let mut msg = Vec::with_capacity(CLIENT_MSG);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&kind_b);
    msg.extend_from_slice(&rank_b);
    msg.extend_from_slice(&inc_b);
    msg.extend_from_slice(&wants_b);
    msg.extend_from_slice(&nc);
    msg.extend_from_slice(&tag);
    Ok(ClientAnswer {
        msg,
        ns,
        nc,
        kind: kind as u8,
        rank,
        wants,
    })
}

impl ClientAnswer {
    /// Checks the server's verdict, the protection it agreed to, its proof of the secret and
    /// who it says it is (IDN-1: `expect`'s rank, at least `expect`'s incarnation); the
    /// connection's keys.
    fn check(
        &self,
        secret: &Secret,
        status: u8,
        reply: &[u8; SERVER_REPLY],
        expect: Option<Ident>,
    ) -> io::Result<Session> {
        if status != 1 {
            return Err(denied("peer rejected our credentials (wrong secret)"));
        }
        let agreed = reply[0];
        let (rank_b, inc_b) = (&reply[1..5], &reply[5..13]);
        secret
            .mac(&[b"server", &self.nc, &self.ns, &[agreed], rank_b, inc_b])
            .verify_slice(&reply[13..])
            .map_err(|_| denied("peer failed to prove the group secret"))?;
        let is = Ident {
            rank: u32::from_le_bytes(rank_b.try_into().expect("4 bytes")),
            incarnation: u64::from_le_bytes(inc_b.try_into().expect("8 bytes")),
        };
        if let Some(want) = expect {
            if is.rank != want.rank || is.incarnation < want.incarnation {
                return Err(denied(&format!(
                    "the listener there is {is}, not {want} that the group's table names (its \
                     address taken over by another worker, or a stale process)"
                )));
            }
        }
        let mode = Mode::from_u8(agreed)
            .filter(|m| *m >= self.wants)
            .ok_or_else(|| denied("peer agreed to less protection than we asked for"))?;
        Ok(Session::derive(
            &Transcript {
                secret: secret.bytes(),
                ns: &self.ns,
                nc: &self.nc,
                kind: self.kind,
                rank: self.rank,
            },
            mode,
            true,
        ))
    }
}

fn closed_during_auth(_: io::Error) -> io::Error {
    denied("peer closed the connection during authentication (wrong secret?)")
}

/// What the server sends after the status byte: agreed protection, rank, incarnation, tag.
const SERVER_REPLY: usize = 1 + 4 + 8 + TAG;

/// Client side of the handshake, by `me`, to the worker `expect` (IDN-1; `None`: whoever
/// listens, for tools): the connection's keys (wrap the connection with them).
pub(crate) async fn client(
    conn: &mut Conn,
    secret: &Secret,
    protection: WireProtection,
    kind: ConnKind,
    me: Ident,
    expect: Option<Ident>,
) -> io::Result<Session> {
    let wants = protection.wants(seal::same_host(conn));
    let mut hello = [0u8; 8 + NONCE];
    conn.read_exact(&mut hello).await?;
    let answer = client_answer(secret, &hello, kind, me, wants)?;
    conn.write_all(&answer.msg).await?;
    conn.flush().await?;
    let mut status = [0u8; 1];
    conn.read_exact(&mut status)
        .await
        .map_err(closed_during_auth)?;
    let mut rest = [0u8; SERVER_REPLY];
    if status[0] == 1 {
        conn.read_exact(&mut rest).await?;
    }
    answer.check(secret, status[0], &rest, expect)
}

/// Client side of the handshake on a blocking stream (the stream's own timeouts bound it).
pub(crate) fn client_blocking(
    conn: &mut std::net::TcpStream,
    secret: &Secret,
    protection: WireProtection,
    kind: ConnKind,
    me: Ident,
    expect: Option<Ident>,
) -> io::Result<Session> {
    use std::io::{Read, Write};
    let wants = protection.wants(seal::same_host_std(conn));
    let mut hello = [0u8; 8 + NONCE];
    conn.read_exact(&mut hello)?;
    let answer = client_answer(secret, &hello, kind, me, wants)?;
    conn.write_all(&answer.msg)?;
    conn.flush()?;
    let mut status = [0u8; 1];
    conn.read_exact(&mut status).map_err(closed_during_auth)?;
    let mut rest = [0u8; SERVER_REPLY];
    if status[0] == 1 {
        conn.read_exact(&mut rest)?;
    }
    answer.check(secret, status[0], &rest, expect)
}

/// Server side of the handshake, stating `me` (IDN-1): the connection's kind, the peer's
/// claimed rank and the connection's keys.
pub(crate) async fn server(
    conn: &mut Conn,
    secret: &Secret,
    protection: WireProtection,
    me: Ident,
) -> io::Result<Accepted> {
    let mine = protection.wants(seal::same_host(conn));
    let mut ns = [0u8; NONCE];
    fill_random(&mut ns);
    let mut hello = Vec::with_capacity(8 + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&ns);
    conn.write_all(&hello).await?;
    conn.flush().await?;
    let mut msg = [0u8; CLIENT_MSG];
    conn.read_exact(&mut msg).await?;
    let kind_b = msg[8];
    let rank_b = &msg[9..13];
    let inc_b = &msg[13..21];
    let wants_b = msg[21];
    let nc = &msg[22..22 + NONCE];
    let tag = &msg[22 + NONCE..];
    let ok = &msg[..8] == MAGIC
        && secret
            .mac(&[b"client", &ns, nc, &[kind_b], rank_b, inc_b, &[wants_b]])
            .verify_slice(tag)
            .is_ok();
    match (ok, ConnKind::from_u8(kind_b), Mode::from_u8(wants_b)) {
        (true, Some(kind), Some(wants)) => {
            let agreed = wants.max(mine);
            let (my_rank, my_inc) = (me.rank.to_le_bytes(), me.incarnation.to_le_bytes());
            let server_tag = secret
                .mac(&[b"server", nc, &ns, &[agreed as u8], &my_rank, &my_inc])
                .finalize()
                .into_bytes();
            let mut reply = Vec::with_capacity(1 + SERVER_REPLY);
            reply.push(1);
            reply.push(agreed as u8);
            reply.extend_from_slice(&my_rank);
            reply.extend_from_slice(&my_inc);
            reply.extend_from_slice(&server_tag);
            conn.write_all(&reply).await?;
            conn.flush().await?;
            let rank = u32::from_le_bytes(rank_b.try_into().expect("4 bytes"));
            let incarnation = u64::from_le_bytes(inc_b.try_into().expect("8 bytes"));
            let session = Session::derive(
                &Transcript {
                    secret: secret.bytes(),
                    ns: &ns,
                    nc,
                    kind: kind_b,
                    rank,
                },
                agreed,
                false,
            );
            Ok(Accepted {
                kind,
                rank,
                incarnation,
                session,
            })
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

    /// The server the tests' clients dial.
    const SERVER: Ident = Ident {
        rank: 4,
        incarnation: 1,
    };

    async fn pair_with(
        cs: &Secret,
        ss: &Secret,
        cp: WireProtection,
        sp: WireProtection,
    ) -> (io::Result<(Session, Conn)>, io::Result<(Accepted, Conn)>) {
        pair_expecting(cs, ss, cp, sp, SERVER).await
    }

    async fn pair_expecting(
        cs: &Secret,
        ss: &Secret,
        cp: WireProtection,
        sp: WireProtection,
        expect: Ident,
    ) -> (io::Result<(Session, Conn)>, io::Result<(Accepted, Conn)>) {
        let (a, b) = tokio::io::duplex(4096);
        let mut a: Conn = Box::new(a);
        let mut b: Conn = Box::new(b);
        let me = Ident {
            rank: 7,
            incarnation: 2,
        };
        let (c, s) = tokio::join!(
            client(&mut a, cs, cp, ConnKind::Bulk, me, Some(expect)),
            server(&mut b, ss, sp, SERVER)
        );
        (c.map(|c| (c, a)), s.map(|s| (s, b)))
    }

    /// IDN-1: a client that dialled one worker refuses a listener that is another rank, or an
    /// older incarnation than the table holds; a newer one is the rank's holder.
    #[tokio::test]
    async fn a_dial_reaches_the_worker_it_meant_or_fails() {
        let s = Secret::new("k");
        let p = WireProtection::Auto;
        for (expect, ok) in [
            (SERVER, true),
            (
                Ident {
                    incarnation: 0,
                    ..SERVER
                },
                true,
            ),
            (Ident { rank: 5, ..SERVER }, false),
            (
                Ident {
                    incarnation: 2,
                    ..SERVER
                },
                false,
            ),
        ] {
            let (c, _) = pair_expecting(&s, &s, p, p, expect).await;
            match c {
                Ok(_) => assert!(ok, "{expect} accepted {SERVER}"),
                Err(e) => {
                    assert!(!ok, "{expect}: {e}");
                    assert!(
                        e.to_string()
                            .contains("the listener there is rank 4 (incarnation 1), not"),
                        "{e}"
                    );
                }
            }
        }
    }

    async fn pair(
        cs: &Secret,
        ss: &Secret,
    ) -> (io::Result<(Session, Conn)>, io::Result<(Accepted, Conn)>) {
        pair_with(cs, ss, WireProtection::Auto, WireProtection::Auto).await
    }

    #[tokio::test]
    async fn same_secret_authenticates_both_ways() {
        let s = Secret::new("k");
        let (c, srv) = pair(&s, &s).await;
        assert_eq!(c.unwrap().0.mode(), Mode::Plain);
        let srv = srv.unwrap().0;
        assert_eq!(
            (srv.kind, srv.rank, srv.incarnation),
            (ConnKind::Bulk, 7, 2)
        );
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_on_both_sides() {
        let (c, srv) = pair(&Secret::new("a"), &Secret::new("b")).await;
        assert_eq!(c.err().unwrap().kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(srv.err().unwrap().kind(), io::ErrorKind::PermissionDenied);
    }

    /// Either side's wish is honoured (the stronger wins), and the agreed keys carry bytes
    /// both ways.
    #[tokio::test]
    async fn the_stronger_protection_is_agreed_and_keys_match() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let s = Secret::new("k");
        let (p, a) = (WireProtection::Auto, WireProtection::Encrypt);
        for (cp, sp, want) in [
            (a, p, Mode::Encrypt),
            (p, a, Mode::Encrypt),
            (WireProtection::Mac, WireProtection::Off, Mode::Mac),
            (WireProtection::Off, WireProtection::Off, Mode::Plain),
        ] {
            let (c, srv) = pair_with(&s, &s, cp, sp).await;
            let (c, cconn) = c.unwrap();
            let (srv, sconn) = srv.unwrap();
            assert_eq!(
                (c.mode(), srv.session.mode()),
                (want, want),
                "{cp:?} {sp:?}"
            );
            let mut cconn = c.wrap(cconn);
            let mut sconn = srv.session.wrap(sconn);
            cconn.write_all(b"ping").await.unwrap();
            cconn.flush().await.unwrap();
            let mut got = [0u8; 4];
            sconn.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
        }
    }

    /// A client that asked for more than the server's (authenticated) answer grants refuses
    /// the connection: a server tag over a weaker mode cannot be produced without the secret.
    #[test]
    fn a_weaker_agreement_than_asked_is_refused() {
        let s = Secret::new("k");
        let hello = {
            let mut h = [0u8; 8 + NONCE];
            h[..8].copy_from_slice(MAGIC);
            h
        };
        let answer = client_answer(
            &s,
            &hello,
            ConnKind::Control,
            Ident {
                rank: 1,
                incarnation: 0,
            },
            Mode::Encrypt,
        )
        .unwrap();
        let (rank, inc) = (1u32.to_le_bytes(), 0u64.to_le_bytes());
        let tag = s
            .mac(&[
                b"server",
                &answer.nc,
                &answer.ns,
                &[Mode::Mac as u8],
                &rank,
                &inc,
            ])
            .finalize()
            .into_bytes();
        let reply = |agreed: Mode| {
            let mut r = [0u8; SERVER_REPLY];
            r[0] = agreed as u8;
            r[1..5].copy_from_slice(&rank);
            r[5..13].copy_from_slice(&inc);
            r[13..].copy_from_slice(&tag);
            r
        };
        let e = answer.check(&s, 1, &reply(Mode::Mac), None).err().unwrap();
        assert!(e.to_string().contains("less protection"), "{e}");
        // And a forged agreement fails the tag.
        let e = answer
            .check(&s, 1, &reply(Mode::Encrypt), None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("prove"), "{e}");
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
                    server(&mut c, &ss, WireProtection::Auto, SERVER)
                        .await
                        .map(|a| (a.kind, a.rank))
                })
            });
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let c = client_blocking(
                &mut s,
                &Secret::new(cs),
                WireProtection::Auto,
                ConnKind::Control,
                Ident {
                    rank: 3,
                    incarnation: 0,
                },
                Some(SERVER),
            );
            let srv = server.join().unwrap();
            if ok {
                assert_eq!(c.unwrap().mode(), Mode::Plain);
                assert_eq!(srv.unwrap(), (ConnKind::Control, 3));
            } else {
                assert_eq!(c.err().unwrap().kind(), io::ErrorKind::PermissionDenied);
                assert_eq!(srv.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
            }
        }
    }

    #[test]
    fn debug_redacts() {
        assert!(!format!("{:?}", Secret::new("hunter2")).contains("hunter2"));
    }
}
