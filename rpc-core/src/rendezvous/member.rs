//! A member's side of the rendezvous: joining (the table checked against what this worker
//! asked for), then following the group's membership on the same connection until it ends.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{sleep, Instant};

use super::{
    check_table, decode_update, framed, recv, send, send_sink, Framed_, Join, Report, Update,
    Verdict, View, VERDICT_GRACE,
};
use crate::error::InitError;
use crate::net::auth::{self, ConnKind, Secret};
use crate::net::transport::Transport;
use crate::net::{Membership, WireProtection};

/// This worker's membership link: its connection to the rendezvous, kept after joining.
pub(crate) struct Link(Framed_);

/// What one try at joining gave.
enum Joined {
    /// The group, the link, this worker's replacement token.
    In(View, Link, String),
    /// The rank's holder is alive and this worker has no token for it (RDV-5).
    Held(String),
}

/// Joins the group at `addr`; returns the group, the link [`follow`] keeps and the token the
/// rendezvous issued to this incarnation (its launcher hands it to a replacement). A rank
/// whose holder has not failed yet is tried again until the deadline (RDV-5).
pub(crate) async fn join(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    protection: WireProtection,
    me: Join,
    timeout_: Duration,
) -> Result<(View, Link, String), InitError> {
    let deadline = Instant::now() + timeout_;
    let mut backoff = Duration::from_millis(50);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match join_once(
            transport,
            addr,
            secret,
            protection,
            me.clone(),
            left,
            timeout_,
        )
        .await?
        {
            Joined::In(view, link, token) => return Ok((view, link, token)),
            Joined::Held(why) if Instant::now() + backoff < deadline => {
                tracing::info!(%why, "the rank's holder has not failed yet; trying again");
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Joined::Held(why) => return Err(InitError::Refused(why)),
        }
    }
}

/// One try at joining, within `left` (`timeout_` is the whole join's, for the errors).
async fn join_once(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    protection: WireProtection,
    mut me: Join,
    left: Duration,
    timeout_: Duration,
) -> Result<Joined, InitError> {
    let deadline = Instant::now() + left;
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
        auth::client(
            &mut conn,
            secret,
            protection,
            ConnKind::Rendezvous,
            auth::Ident {
                rank: me.rank,
                incarnation: 0,
            },
            Some(auth::RENDEZVOUS),
        ),
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
        Verdict::Table(t, token) => Ok(Joined::In(
            check_table(t, &me).map_err(err)?,
            Link(f),
            token,
        )),
        Verdict::Held(why) => Ok(Joined::Held(why)),
        Verdict::Missing(missing) => Err(InitError::RendezvousTimeout {
            missing,
            timeout: timeout_,
        }),
        Verdict::Refused(why) => Err(InitError::Refused(why)),
    }
}

/// Keeps this worker's view in step with the group's (`me` is its rank): applies every update
/// from the rendezvous (a failure another member's detector decided, a graceful leave, a new
/// incarnation of a rank) and sends this worker's reports, until `stop` or the link breaks
/// (then only this worker's own detector changes its view).
pub(crate) async fn follow(
    link: Link,
    membership: Arc<Membership>,
    mut reports: mpsc::Receiver<Report>,
    life: Arc<crate::lifecycle::Lifecycle>,
    me: u32,
) {
    let stop = life.stop.clone();
    let (mut sink, mut stream) = link.0.split();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            r = reports.recv() => match r {
                Some(r) => {
                    let send = send_sink(&mut sink, &r);
                    let sent = tokio::time::timeout(Duration::from_secs(10), send).await;
                    if !matches!(sent, Ok(Ok(()))) {
                        break;
                    }
                }
                None => return,
            },
            frame = stream.next() => match frame.map(|f| f.and_then(|f| decode_update(&f))) {
                Some(Ok(u)) => apply(&membership, me, u),
                Some(Err(e)) => {
                    tracing::warn!(cause = %e, "bad message from the rendezvous");
                    break;
                }
                None => break,
            },
        }
    }
    if !life.is_stopping() {
        membership.own.lost_rendezvous();
        tracing::warn!(
            rank = me,
            "lost the connection to the rendezvous: this worker hears of no replacement from now on"
        );
    }
}

/// Applies one update to this worker's (`me`'s) view.
fn apply(m: &Membership, me: u32, u: Update) {
    match u {
        Update::Joined { rank, endpoint } if rank != me && (rank as usize) < m.size() => {
            m.rejoin(rank, &endpoint);
        }
        Update::Left { rank, incarnation } if (rank as usize) < m.size() => {
            m.depart(rank, incarnation);
        }
        Update::Failed {
            rank,
            incarnation,
            cause,
        } if rank != me && (rank as usize) < m.size() => {
            m.declare_incarnation(rank, Some(incarnation), cause);
        }
        Update::Failed { rank, cause, .. } if rank == me => {
            // SUP-2: the launcher ends this process; without one, its peers refuse it.
            m.own.evicted(&cause);
            tracing::error!(
                rank = me,
                %cause,
                "the group declared this worker failed: its peers refuse it from now on"
            );
        }
        other => tracing::warn!(?other, "ignored a membership update for an unknown rank"),
    }
}
