//! Reaching a peer: the group's directory of addresses and the one dialer every outgoing
//! connection goes through (control, bulk, blocking), each authenticated before it is used.
//!
//! - DIAL-1: every dial is bounded: connecting by the connect timeout (and, for a blocking
//!   connection, the call's deadline), the handshake by the handshake timeout.
//! - DIAL-2: a control connection's dial that is refused or finds no route ([`may_pass`]) to
//!   a peer the failure detector has not declared failed is tried again (pauses from 20 ms,
//!   doubling to 0.5 s) for twice the failure timeout: a peer that is gone is declared within
//!   its failure timeout, and the call then fails with that verdict; a route that came back
//!   (a link that flapped, a restarted group whose peer is still binding) costs a pause, not
//!   the call. Before, the first refusal failed the call, and a collective whose member
//!   could not send stalled its peers until their RPC timeout.

use std::collections::HashMap;
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;

use super::auth::{self, ConnKind};
use super::config::NetConfig;
use super::frame::left;
use super::seal::Keys;
use super::transport::Conn;
use crate::error::RpcError;
use crate::wire::{WorkerId, WorkerInfo};

/// A worker of the group as its peers reach it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Endpoint {
    pub name: String,
    /// Where its listener is reachable.
    pub addr: String,
    /// Where its failure detector listens for heartbeats (empty: it runs none).
    pub heartbeat: String,
    /// Which process holds the rank: 0 for the one that formed the group, one more for each
    /// replacement (MEM-1).
    pub incarnation: u64,
}

/// Where one rank is reached now (a replacement moves it).
#[derive(Debug)]
struct Slot {
    addr: Arc<str>,
    heartbeat: Arc<str>,
    incarnation: u64,
}

/// Every rank of the group: the identity of the worker holding it and the addresses its
/// current incarnation listens at. A rank's name is fixed once a worker has taken it;
/// addresses and incarnations change when a rank is replaced, and a vacant rank (of a group
/// that grows) gets its worker when one joins ([`Directory::replace`]).
#[derive(Debug)]
pub(crate) struct Directory {
    /// Set once a worker holds the rank.
    workers: Vec<OnceLock<WorkerInfo>>,
    /// What a vacant rank is called in messages.
    vacant: Vec<WorkerInfo>,
    by_name: RwLock<HashMap<String, u32>>,
    slots: Vec<RwLock<Slot>>,
}

impl Directory {
    /// The directory of `endpoints`, by rank; `None` for a vacant rank.
    pub(crate) fn new(endpoints: Vec<Option<Endpoint>>) -> Self {
        let n = endpoints.len();
        let (mut workers, mut vacant, mut slots) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut by_name = HashMap::with_capacity(n);
        for (r, e) in endpoints.into_iter().enumerate() {
            let id = WorkerId(r as u32);
            let info = OnceLock::new();
            vacant.push(WorkerInfo {
                name: format!("<vacant rank {r}>"),
                id,
            });
            let slot = match e {
                Some(e) => {
                    by_name.insert(e.name.clone(), r as u32);
                    let _ = info.set(WorkerInfo { name: e.name, id });
                    Slot {
                        addr: e.addr.into(),
                        heartbeat: e.heartbeat.into(),
                        incarnation: e.incarnation,
                    }
                }
                None => Slot {
                    addr: "".into(),
                    heartbeat: "".into(),
                    incarnation: 0,
                },
            };
            workers.push(info);
            slots.push(RwLock::new(slot));
        }
        Self {
            workers,
            vacant,
            by_name: RwLock::new(by_name),
            slots,
        }
    }

    fn slot(&self, rank: u32) -> std::sync::RwLockReadGuard<'_, Slot> {
        self.slots[rank as usize]
            .read()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Where worker `rank`'s failure detector listens (empty: it runs none).
    pub(crate) fn heartbeat(&self, rank: u32) -> Arc<str> {
        Arc::clone(&self.slot(rank).heartbeat)
    }

    /// Worker `rank` (a placeholder naming the rank while it is vacant). Ranks come from the
    /// group's own table; a rank past its capacity is a bug, not input.
    pub(crate) fn info(&self, rank: u32) -> &WorkerInfo {
        self.workers[rank as usize]
            .get()
            .unwrap_or(&self.vacant[rank as usize])
    }

    /// Whether no worker has taken `rank` yet.
    pub(crate) fn is_vacant(&self, rank: u32) -> bool {
        self.workers
            .get(rank as usize)
            .is_none_or(|w| w.get().is_none())
    }

    /// The rank of the worker named `name`, if one has joined.
    pub(crate) fn rank_of(&self, name: &str) -> Option<u32> {
        self.by_name
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied()
    }

    /// Number of ranks (vacant ones included).
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Worker `rank`'s name.
    pub(crate) fn name(&self, rank: u32) -> &str {
        &self.info(rank).name
    }

    /// The address worker `rank`'s current incarnation listens at.
    pub(crate) fn addr(&self, rank: u32) -> Arc<str> {
        Arc::clone(&self.slot(rank).addr)
    }

    /// Worker `rank`'s current incarnation.
    pub(crate) fn incarnation(&self, rank: u32) -> u64 {
        self.slot(rank).incarnation
    }

    /// Every worker that has taken a rank, by rank.
    pub(crate) fn workers(&self) -> Vec<WorkerInfo> {
        self.workers
            .iter()
            .filter_map(|w| w.get().cloned())
            .collect()
    }

    /// Rank `rank` is now held by `e`: its first worker if it was vacant, else a later
    /// incarnation than the one known (MEM-1: incarnations only grow). Returns whether it was.
    pub(crate) fn replace(&self, rank: u32, e: &Endpoint) -> bool {
        let mut s = self.slots[rank as usize]
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let first = self.workers[rank as usize].get().is_none();
        if first {
            let mut by_name = self.by_name.write().unwrap_or_else(|p| p.into_inner());
            if by_name.contains_key(&e.name) {
                return false; // the rendezvous gives a name to one rank only
            }
            by_name.insert(e.name.clone(), rank);
            let _ = self.workers[rank as usize].set(WorkerInfo {
                name: e.name.clone(),
                id: WorkerId(rank),
            });
        } else if e.incarnation <= s.incarnation {
            return false;
        }
        *s = Slot {
            addr: e.addr.as_str().into(),
            heartbeat: e.heartbeat.as_str().into(),
            incarnation: e.incarnation,
        };
        true
    }
}

/// Whether a dial that failed with `e` may succeed if tried again soon (DIAL-2): refused (no
/// listener yet, or any more), or no route (`EINVAL` from a blackhole route, unreachable
/// host or network); not a timeout, which took its whole bound already, nor a handshake's
/// refusal.
pub(crate) fn may_pass(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | InvalidInput | HostUnreachable | NetworkUnreachable
    )
}

/// A dial that failed: who, where, why.
#[derive(Debug)]
pub(crate) struct DialError {
    pub worker: String,
    pub addr: String,
    pub source: io::Error,
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "connection to `{}` at {} failed: {}",
            self.worker, self.addr, self.source
        )
    }
}

impl From<DialError> for RpcError {
    fn from(e: DialError) -> Self {
        RpcError::Unreachable {
            worker: e.worker,
            addr: e.addr,
            source: e.source,
        }
    }
}

/// Dials peers of the group and authenticates each connection as this worker.
#[derive(Debug)]
pub(crate) struct Dialer {
    cfg: Arc<NetConfig>,
    directory: Arc<Directory>,
}

impl Dialer {
    pub(crate) fn new(cfg: Arc<NetConfig>, directory: Arc<Directory>) -> Self {
        Self { cfg, directory }
    }

    /// The group's directory.
    pub(crate) fn directory(&self) -> &Directory {
        &self.directory
    }

    /// The error of a dial to `to` that failed with `source`.
    pub(crate) fn failed(&self, to: u32, source: io::Error) -> DialError {
        DialError {
            worker: self.directory.name(to).to_owned(),
            addr: self.directory.addr(to).to_string(),
            source,
        }
    }

    /// An authenticated connection of `kind` to worker `to`, protected as agreed (DIAL-1).
    ///
    /// # Cancel safety
    /// Cancel safe: a dial abandoned half way leaves nothing behind.
    /// Who must answer a dial to `to` (IDN-1): that rank, at least the incarnation the table
    /// holds.
    fn expect(&self, to: u32) -> auth::Ident {
        auth::Ident {
            rank: to,
            incarnation: self.directory.incarnation(to),
        }
    }

    pub(crate) async fn dial(&self, to: u32, kind: ConnKind) -> Result<Conn, DialError> {
        let cfg = &self.cfg;
        let addr = self.directory.addr(to);
        let (mut conn, _) = tokio::time::timeout(cfg.connect_timeout, cfg.transport.connect(&addr))
            .await
            .map_err(|_| {
                self.failed(
                    to,
                    io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
                )
            })?
            .map_err(|e| self.failed(to, e))?;
        let session = tokio::time::timeout(
            cfg.handshake_timeout,
            auth::client(
                &mut conn,
                &cfg.secret,
                cfg.protection,
                kind,
                cfg.me(),
                Some(self.expect(to)),
            ),
        )
        .await
        .map_err(|_| {
            self.failed(
                to,
                io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"),
            )
        })?
        .map_err(|e| self.failed(to, e))?;
        Ok(session.wrap(conn))
    }

    /// A blocking, authenticated TCP connection of `kind` to worker `to`, dialled from this
    /// thread, by `deadline` at the latest (DIAL-1), with the keys that protect its frames
    /// if any were agreed. Its socket timeouts are left set; the caller sets its own before
    /// waiting.
    pub(crate) fn dial_blocking(
        &self,
        to: u32,
        kind: ConnKind,
        deadline: Instant,
    ) -> Result<(TcpStream, Option<Keys>), DialError> {
        let cfg = &self.cfg;
        let addr = self.directory.addr(to);
        let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
        let mut stream = None;
        for a in addr
            .as_ref()
            .to_socket_addrs()
            .map_err(|e| self.failed(to, e))?
        {
            match TcpStream::connect_timeout(&a, cfg.connect_timeout.min(left(deadline))) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let mut stream = stream.ok_or_else(|| self.failed(to, last))?;
        let setup = |s: &mut TcpStream| -> io::Result<_> {
            super::transport::tcp::configure(&*s)?;
            let t = Some(cfg.handshake_timeout.min(left(deadline)));
            s.set_read_timeout(t)?;
            s.set_write_timeout(t)?;
            let expect = Some(self.expect(to));
            auth::client_blocking(s, &cfg.secret, cfg.protection, kind, cfg.me(), expect)
        };
        let session = setup(&mut stream).map_err(|e| self.failed(to, e))?;
        Ok((stream, session.into_keys()))
    }
}
