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
pub(crate) enum Verdict {
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
                let refusal = refusal(&join, world_size, joined.values().map(|(j, _)| j));
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

/// Why the rendezvous refuses `join`, given those who joined before it; `None` admits it.
fn refusal<'a>(
    join: &Join,
    world_size: u32,
    mut joined: impl Iterator<Item = &'a Join> + Clone,
) -> Option<String> {
    if join.world_size != world_size {
        Some(format!(
            "worker `{}` says world size {}, the rendezvous expects {world_size}",
            join.name, join.world_size
        ))
    } else if join.rank >= world_size {
        Some(format!(
            "rank {} of `{}` is outside world size {world_size}",
            join.rank, join.name
        ))
    } else if let Some(other) = joined.clone().find(|j| j.rank == join.rank) {
        Some(format!(
            "rank {} already joined as `{}`",
            join.rank, other.name
        ))
    } else {
        joined
            .find(|j| j.name == join.name)
            .map(|other| format!("name `{}` already taken by rank {}", join.name, other.rank))
    }
}

/// The table of a verdict, if it is one this worker can use: one endpoint per rank of the
/// group it joined, its own under its own name, no name twice (an authenticated rendezvous of
/// another version or a faulty one must not leave a worker with a table it indexes out of).
fn check_table(table: Vec<Endpoint>, me: &Join) -> io::Result<Vec<Endpoint>> {
    if table.len() != me.world_size as usize {
        return Err(proto(format!(
            "the rendezvous sent a table of {} workers for a group of {}",
            table.len(),
            me.world_size
        )));
    }
    let named = table.get(me.rank as usize).map(|e| e.name.as_str());
    if named != Some(me.name.as_str()) {
        return Err(proto(format!(
            "the rendezvous sent a table naming rank {} {named:?}, not `{}`",
            me.rank, me.name
        )));
    }
    let mut names: Vec<&str> = table.iter().map(|e| e.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(proto(format!(
            "the rendezvous sent a table naming `{}` twice",
            w[0]
        )));
    }
    Ok(table)
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
        Verdict::Table(t) => check_table(t, &me).map_err(err),
        Verdict::Missing(missing) => Err(InitError::RendezvousTimeout {
            missing,
            timeout: timeout_,
        }),
        Verdict::Refused(why) => Err(InitError::Refused(why)),
    }
}

/// Rendezvous messages as both ends read them (for fuzzing): length-delimited frames, the
/// first decoded as a join the server judges against three that joined before, the rest as
/// verdicts the joining worker checks.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_messages(data: &[u8]) {
    use tokio_util::codec::Decoder;
    let mut codec = LengthDelimitedCodec::builder()
        .max_frame_length(MAX_MSG)
        .new_codec();
    let mut buf = bytes::BytesMut::from(data);
    let me = Join {
        name: "w1".into(),
        rank: 1,
        world_size: 3,
        addr: "127.0.0.1:1".into(),
        heartbeat: String::new(),
    };
    let before = [
        me.clone(),
        Join {
            name: "w2".into(),
            rank: 2,
            ..me.clone()
        },
    ];
    let mut first = true;
    while let Ok(Some(frame)) = codec.decode(&mut buf) {
        if std::mem::take(&mut first) {
            if let Ok(join) = bincode::deserialize::<Join>(&frame) {
                let why = refusal(&join, 3, before.iter());
                let fits = join.world_size == 3 && join.rank < 3;
                let clash = before
                    .iter()
                    .any(|j| j.rank == join.rank || j.name == join.name);
                assert_eq!(why.is_none(), fits && !clash, "{join:?}: {why:?}");
            }
        } else if let Ok(Verdict::Table(t)) = bincode::deserialize::<Verdict>(&frame) {
            if let Ok(t) = check_table(t, &me) {
                assert_eq!(t.len(), 3);
                assert_eq!(t[1].name, "w1");
            }
        }
    }
}

/// Well-formed rendezvous messages for [`fuzz_messages`]: a join, then a verdict.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_seeds() -> Vec<Vec<u8>> {
    let framed = |parts: &[Vec<u8>]| {
        let mut out = Vec::new();
        for p in parts {
            out.extend_from_slice(&(p.len() as u32).to_be_bytes());
            out.extend_from_slice(p);
        }
        out
    };
    let join = Join {
        name: "w0".into(),
        rank: 0,
        world_size: 3,
        addr: "127.0.0.1:5000".into(),
        heartbeat: "127.0.0.1:5001".into(),
    };
    let table = Verdict::Table(
        ["w0", "w1", "w2"]
            .iter()
            .map(|n| Endpoint {
                name: (*n).into(),
                addr: "127.0.0.1:1".into(),
                heartbeat: String::new(),
            })
            .collect(),
    );
    fn enc<T: Serialize>(v: &T) -> Vec<u8> {
        bincode::serialize(v).expect("encodes")
    }
    vec![
        framed(&[enc(&join), enc(&table)]),
        framed(&[
            enc(&join),
            enc(&Verdict::Missing(vec![1, 2])),
            enc(&Verdict::Refused("no".into())),
        ]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(name: &str, rank: u32) -> Join {
        Join {
            name: name.into(),
            rank,
            world_size: 3,
            addr: String::new(),
            heartbeat: String::new(),
        }
    }

    fn table(names: &[&str]) -> Vec<Endpoint> {
        names
            .iter()
            .map(|n| Endpoint {
                name: (*n).into(),
                addr: String::new(),
                heartbeat: String::new(),
            })
            .collect()
    }

    #[test]
    fn joins_are_refused_for_the_wrong_world_rank_or_a_name_taken() {
        let before = [join("a", 0)];
        assert_eq!(refusal(&join("b", 1), 3, before.iter()), None);
        let why = |j: &Join| refusal(j, 3, before.iter()).expect("refused");
        assert!(why(&Join {
            world_size: 4,
            ..join("b", 1)
        })
        .contains("world size 4"));
        assert!(why(&join("b", 3)).contains("outside world size 3"));
        assert!(why(&join("b", 0)).contains("already joined as `a`"));
        assert!(why(&join("a", 2)).contains("already taken by rank 0"));
    }

    #[test]
    fn a_table_is_used_only_if_it_is_the_group_joined() {
        let me = join("b", 1);
        assert!(check_table(table(&["a", "b", "c"]), &me).is_ok());
        let why = |t: &[&str]| check_table(table(t), &me).unwrap_err().to_string();
        assert!(why(&["a", "b"]).contains("table of 2 workers for a group of 3"));
        assert!(why(&["a", "c", "b"]).contains("naming rank 1 Some(\"c\"), not `b`"));
        assert!(why(&["b", "b", "c"]).contains("`b` twice"));
    }
}
