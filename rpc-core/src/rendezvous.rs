//! Group formation: every worker tells the rendezvous its name, rank and listener address; the
//! rendezvous answers everyone with the full table once all `world_size` ranks have joined, or
//! with the list of missing ranks when its deadline passes.
//!
//! The rendezvous is hosted by rank 0 by default (like torch's TCPStore), or started on its own
//! with [`RendezvousServer::start`] (a launcher or a test can then bind port 0 and hand the
//! address to every worker). Its connections pass the same authenticated handshake as RPC
//! connections.

use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::error::InitError;
use crate::net::auth::{self, ConnKind, Secret};
use crate::net::transport::{Conn, Listener, Transport};
use crate::net::{Endpoint, WireProtection};

/// Largest rendezvous message (a table of many workers still fits).
const MAX_MSG: usize = 16 << 20;
/// Extra time a joiner waits past its own deadline for the server's verdict (which names the
/// missing ranks).
const VERDICT_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Join {
    pub name: String,
    pub rank: u32,
    pub world_size: u32,
    /// Where the worker's listener is reachable.
    pub addr: String,
    /// Where its failure detector listens for heartbeats (empty: no detector).
    pub heartbeat: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum Verdict {
    /// Every member, by rank.
    Table(Vec<Endpoint>),
    Missing(Vec<u32>),
    Refused(String),
}

type Framed_ = Framed<Conn, LengthDelimitedCodec>;

fn framed(conn: Conn) -> Framed_ {
    Framed::new(
        conn,
        LengthDelimitedCodec::builder()
            .max_frame_length(MAX_MSG)
            .new_codec(),
    )
}

fn proto(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

async fn send<T: Serialize>(f: &mut Framed_, v: &T) -> io::Result<()> {
    let bytes = bincode::serialize(v).map_err(proto)?;
    f.send(bytes::Bytes::from(bytes)).await
}

async fn recv<T: for<'de> Deserialize<'de>>(f: &mut Framed_) -> io::Result<T> {
    let frame = f.next().await.ok_or_else(|| {
        io::Error::new(io::ErrorKind::UnexpectedEof, "rendezvous connection closed")
    })??;
    bincode::deserialize(&frame).map_err(proto)
}

/// A running rendezvous for one group formation. Dropping it stops it.
#[derive(Debug)]
pub struct RendezvousServer {
    addr: String,
    task: Option<JoinHandle<()>>,
}

impl RendezvousServer {
    /// Binds `bind` (port 0 picks one) and serves one group of `world_size` workers until all
    /// have joined or `timeout` passes.
    pub async fn start(
        transport: &Transport,
        bind: &str,
        secret: Secret,
        world_size: u32,
        timeout: Duration,
    ) -> Result<Self, InitError> {
        let mut listener = transport
            .bind(bind)
            .await
            .map_err(|source| InitError::Bind {
                addr: bind.to_owned(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| InitError::Bind {
            addr: bind.to_owned(),
            source,
        })?;
        let deadline = Instant::now() + timeout;
        let task = tokio::spawn(async move {
            serve(&mut listener, secret, world_size, deadline).await;
        });
        Ok(Self {
            addr,
            task: Some(task),
        })
    }

    /// The address workers should use as `tcp://<addr>`.
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    /// Waits (at most `limit`) until the server has answered every joiner.
    pub async fn finish(mut self, limit: Duration) {
        if let Some(t) = self.task.take() {
            let abort = t.abort_handle();
            if tokio::time::timeout(limit, t).await.is_err() {
                abort.abort();
            }
        }
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

async fn serve(listener: &mut Listener, secret: Secret, world_size: u32, deadline: Instant) {
    // Bounded: each accepted connection sends at most one join.
    let (tx, mut rx) = mpsc::channel::<(Join, Framed_)>(64);
    let mut joined: BTreeMap<u32, (Join, Framed_)> = BTreeMap::new();
    let mut conns = tokio::task::JoinSet::new();
    let gate = auth::Gate::default();
    while joined.len() < world_size as usize {
        tokio::select! {
            acc = listener.accept() => {
                let Ok(mut conn) = acc else { continue };
                let (tx, secret, gate) = (tx.clone(), secret.clone(), gate.clone());
                conns.spawn(async move {
                    let left = deadline.saturating_duration_since(Instant::now());
                    // The server asks for the least (a joiner may ask for more).
                    let conn = match gate.handshake(&mut conn, &secret, WireProtection::Auto, left).await {
                        Ok(a) if a.kind == ConnKind::Rendezvous => a.session.wrap(conn),
                        Ok(a) => {
                            tracing::warn!(kind = ?a.kind, "rendezvous got a non-rendezvous connection");
                            return;
                        }
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return,
                        Err(e) => {
                            tracing::warn!(cause = %e, "rendezvous refused a connection");
                            return;
                        }
                    };
                    let mut f = framed(conn);
                    if let Ok(Ok(join)) = tokio::time::timeout_at(deadline, recv::<Join>(&mut f)).await {
                        let _ = tx.send((join, f)).await;
                    }
                });
            }
            Some((join, mut f)) = rx.recv() => {
                let refusal = if join.world_size != world_size {
                    Some(format!("worker `{}` says world size {}, the rendezvous expects {world_size}", join.name, join.world_size))
                } else if join.rank >= world_size {
                    Some(format!("rank {} of `{}` is outside world size {world_size}", join.rank, join.name))
                } else if let Some((other, _)) = joined.get(&join.rank) {
                    Some(format!("rank {} already joined as `{}`", join.rank, other.name))
                } else if let Some((other, _)) = joined.values().find(|(j, _)| j.name == join.name) {
                    Some(format!("name `{}` already taken by rank {}", join.name, other.rank))
                } else {
                    None
                };
                match refusal {
                    Some(why) => {
                        tracing::warn!(%why, "rendezvous refused a worker");
                        conns.spawn(async move { let _ = send(&mut f, &Verdict::Refused(why)).await; });
                    }
                    None => { joined.insert(join.rank, (join, f)); }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<u32> = (0..world_size).filter(|r| !joined.contains_key(r)).collect();
                tracing::warn!(?missing, "rendezvous timed out");
                let v = Verdict::Missing(missing);
                for (_, (_, mut f)) in std::mem::take(&mut joined) {
                    let _ = tokio::time::timeout(Duration::from_secs(2), send(&mut f, &v)).await;
                }
                return;
            }
        }
    }
    let table: Vec<Endpoint> = joined
        .values()
        .map(|(j, _)| Endpoint {
            name: j.name.clone(),
            addr: j.addr.clone(),
            heartbeat: j.heartbeat.clone(),
        })
        .collect();
    let verdict = Verdict::Table(table);
    let sends = joined.into_values().map(|(_, mut f)| {
        let v = &verdict;
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                send(&mut f, v).await?;
                // Wait for the joiner to close, so the table is surely delivered.
                let _ = f.next().await;
                Ok::<_, io::Error>(())
            })
            .await;
        }
    });
    futures::future::join_all(sends).await;
}

/// Joins the group at `addr`; returns every member, by rank.
pub(crate) async fn join(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    protection: WireProtection,
    mut me: Join,
    timeout_: Duration,
) -> Result<Vec<Endpoint>, InitError> {
    let deadline = Instant::now() + timeout_;
    let mut backoff = Duration::from_millis(20);
    let (mut conn, local_ip) = loop {
        match tokio::time::timeout_at(deadline, transport.connect(addr)).await {
            Ok(Ok(c)) => break c,
            Ok(Err(e)) if Instant::now() + backoff < deadline => {
                tracing::debug!(cause = %e, addr, "rendezvous not reachable yet");
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Ok(Err(source)) => {
                return Err(InitError::RendezvousUnreachable {
                    addr: addr.to_owned(),
                    timeout: timeout_,
                    source,
                })
            }
            Err(_) => {
                return Err(InitError::RendezvousUnreachable {
                    addr: addr.to_owned(),
                    timeout: timeout_,
                    source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
                })
            }
        }
    };
    let hs = tokio::time::timeout_at(
        deadline,
        auth::client(&mut conn, secret, protection, ConnKind::Rendezvous, me.rank),
    )
    .await;
    let session = match hs {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => {
            return Err(InitError::Auth {
                addr: addr.to_owned(),
                source,
            })
        }
        Err(_) => {
            return Err(InitError::Auth {
                addr: addr.to_owned(),
                source: io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"),
            })
        }
    };
    let conn = session.wrap(conn);
    // A wildcard listener is advertised under the IP this host uses to reach the rendezvous.
    if let Some(ip) = local_ip {
        for addr in [&mut me.addr, &mut me.heartbeat] {
            if let Some((host, port)) = addr.clone().rsplit_once(':') {
                if host == "0.0.0.0" || host == "[::]" {
                    *addr = std::net::SocketAddr::new(ip, port.parse().unwrap_or(0)).to_string();
                }
            }
        }
    }
    let mut f = framed(conn);
    let err = |source| InitError::Rendezvous {
        addr: addr.to_owned(),
        source,
    };
    send(&mut f, &me).await.map_err(err)?;
    let verdict = tokio::time::timeout_at(deadline + VERDICT_GRACE, recv::<Verdict>(&mut f))
        .await
        .map_err(|_| {
            err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the rendezvous gave no verdict",
            ))
        })?
        .map_err(err)?;
    match verdict {
        Verdict::Table(t) => Ok(t),
        Verdict::Missing(missing) => Err(InitError::RendezvousTimeout {
            missing,
            timeout: timeout_,
        }),
        Verdict::Refused(why) => Err(InitError::Refused(why)),
    }
}
