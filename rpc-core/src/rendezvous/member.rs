//! A member's side of the rendezvous: joining (the table checked against what this worker
//! asked for), then following the group's membership on the same connection until it ends.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{sleep, Instant};

use super::unsettled::Unsettled;
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
    In(View, Box<Link>, String),
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
            Joined::In(view, link, token) => return Ok((view, *link, token)),
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
    let how = (protection, me.rank, timeout_);
    let (conn, local_ip) = dial(transport, addr, secret, how, deadline).await?;
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
            Box::new(Link(f)),
            token,
        )),
        Verdict::Held(why) => Ok(Joined::Held(why)),
        Verdict::Missing(missing) => Err(InitError::RendezvousTimeout {
            missing,
            timeout: timeout_,
        }),
        Verdict::Refused(why) => Err(InitError::Refused(why)),
        Verdict::Ended => Err(InitError::JobEnded {
            addr: addr.to_owned(),
        }),
    }
}

/// Whether a rendezvous answers at `addr` (`tcp://host:port` or `host:port`): a connection
/// and the authenticated handshake, within `within`. A launcher asks before it restarts its
/// processes into a group whose rendezvous may be gone with its host: a dead host refuses or
/// drops the connection, a frozen one accepts it (the kernel does) but never completes the
/// handshake; either way this fails within `within`, naming the address and the cause.
pub async fn probe_rendezvous(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    within: Duration,
) -> Result<(), InitError> {
    let addr = addr.strip_prefix("tcp://").unwrap_or(addr);
    let how = (WireProtection::Auto, 0, within);
    let (conn, _) = dial(transport, addr, secret, how, Instant::now() + within).await?;
    // RDV-10: a rendezvous whose job has ended says so at once; a live one waits for a join.
    let mut f = framed(conn);
    match tokio::time::timeout(ENDED_WITHIN.min(within), recv::<Verdict>(&mut f)).await {
        Ok(Ok(Verdict::Ended)) => Err(InitError::JobEnded {
            addr: addr.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// How long [`probe_rendezvous`] listens, after the handshake, for a rendezvous to say that
/// its job has ended (it says so at once).
const ENDED_WITHIN: Duration = Duration::from_millis(300);

/// Connects to the rendezvous and completes the handshake (as rank `rank`, with `protection`)
/// by `deadline`, retrying refused connections; `timeout_` is named in the errors.
async fn dial(
    transport: &Transport,
    addr: &str,
    secret: &Secret,
    (protection, rank, timeout_): (WireProtection, u32, Duration),
    deadline: Instant,
) -> Result<(crate::net::transport::Conn, Option<std::net::IpAddr>), InitError> {
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
                rank,
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
    Ok((session.wrap(conn), local_ip))
}

/// What a member needs to dial the rendezvous again (RDV-6): where, how, and its join, which
/// [`follow`] turns into a resume of its incarnation.
pub(crate) struct Redial {
    pub transport: Transport,
    pub addr: String,
    pub secret: Secret,
    pub protection: WireProtection,
    pub me: Join,
}

/// Keeps this worker's view in step with the group's (`me` is its rank, `incarnation` its
/// incarnation): applies every update from the rendezvous (a failure the group decided, a
/// graceful leave, a new incarnation of a rank) and sends this worker's reports, until `stop`.
/// A link that breaks is dialled again (RDV-6): the rendezvous re-attaches this incarnation
/// and sends the group as it is now, and what changed meanwhile is applied; while there is no
/// link the worker is adrift (its launcher ends it after its failure timeout, SUP-3), and a
/// rendezvous that no longer counts this incarnation a member ends the following for good.
pub(crate) async fn follow(
    link: Link,
    membership: Arc<Membership>,
    mut reports: mpsc::Receiver<Report>,
    life: Arc<crate::lifecycle::Lifecycle>,
    (me, incarnation): (u32, u64),
    redial: Redial,
) {
    let stop = life.stop.clone();
    let mut link = link;
    // RDV-9: what this member reported and the group has not decided yet, and what of it to
    // send again first on a new link.
    let mut unsettled = Unsettled::default();
    let mut resend = Vec::new();
    loop {
        let queues = (&mut reports, &mut unsettled, resend);
        if !serve_link(link, &membership, queues, &stop, me).await || life.is_stopping() {
            return;
        }
        membership.own.lost_rendezvous();
        tracing::warn!(
            rank = me,
            "lost the connection to the rendezvous; dialling it again"
        );
        let who = (me, incarnation);
        (link, resend) = match redial_until(&redial, &membership, &stop, who, &mut unsettled).await
        {
            Some(l) => l,
            None => return,
        };
    }
}

/// Serves one link until it breaks (true) or the worker stops (false): sends `resend` first,
/// then each report as it comes (kept in `unsettled` until the group decides, RDV-9).
async fn serve_link(
    link: Link,
    membership: &Membership,
    (reports, unsettled, resend): (&mut mpsc::Receiver<Report>, &mut Unsettled, Vec<Report>),
    stop: &tokio_util::sync::CancellationToken,
    me: u32,
) -> bool {
    let (mut sink, mut stream) = link.0.split();
    for r in resend {
        let sent = tokio::time::timeout(Duration::from_secs(10), send_sink(&mut sink, &r)).await;
        if !matches!(sent, Ok(Ok(()))) {
            return true;
        }
    }
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return false,
            () = membership.cut_link.notified() => return true,
            () = tokio::time::sleep_until(heard + super::LINK_SILENCE) => {
                tracing::warn!(
                    rank = me,
                    silent_for = ?super::LINK_SILENCE,
                    "the rendezvous said nothing (frozen, or cut off)"
                );
                return true;
            }
            r = reports.recv() => match r {
                Some(r) => {
                    unsettled.sent(&r);
                    let send = send_sink(&mut sink, &r);
                    let sent = tokio::time::timeout(Duration::from_secs(10), send).await;
                    if !matches!(sent, Ok(Ok(()))) {
                        return true;
                    }
                }
                None => return false,
            },
            frame = stream.next() => match frame.map(|f| f.and_then(|f| decode_update(&f))) {
                Some(Ok(u)) => {
                    heard = Instant::now();
                    unsettled.heard(&u);
                    apply(membership, me, u);
                }
                Some(Err(e)) => {
                    tracing::warn!(cause = %e, "bad message from the rendezvous");
                    return true;
                }
                None => return true,
            },
        }
    }
}

/// Dials the rendezvous until it re-attaches this incarnation (the new link, the group's
/// changes meanwhile applied, and the reports of `unsettled` to send again on it, RDV-9),
/// refuses it (`None`: no longer a member), or the worker stops.
async fn redial_until(
    redial: &Redial,
    membership: &Membership,
    stop: &tokio_util::sync::CancellationToken,
    (me, incarnation): (u32, u64),
    unsettled: &mut Unsettled,
) -> Option<(Link, Vec<Report>)> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut join = redial.me.clone();
        join.resume = Some(incarnation);
        join.replace = false;
        join.token = Some(membership.own.token_value());
        let (t, a, s, p) = (
            &redial.transport,
            &redial.addr,
            &redial.secret,
            redial.protection,
        );
        let tried = tokio::select! {
            () = stop.cancelled() => return None,
            r = join_once(t, a, s, p, join, Duration::from_secs(5), Duration::from_secs(5)) => r,
        };
        match tried {
            Ok(Joined::In(view, link, _)) => {
                let resend = unsettled.resend(&view);
                for (rank, m) in view.members.into_iter().enumerate() {
                    catch_up(membership, me, rank as u32, m);
                }
                membership.own.found_rendezvous();
                tracing::info!(
                    rank = me,
                    reports_again = resend.len(),
                    "the rendezvous link is back"
                );
                return Some((*link, resend));
            }
            Err(InitError::Refused(why)) => {
                tracing::error!(rank = me, %why, "the rendezvous no longer counts this worker");
                membership.own.evicted(&why);
                return None;
            }
            Ok(Joined::Held(_)) | Err(_) => {
                tokio::select! {
                    () = stop.cancelled() => return None,
                    () = sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Applies what the group's table says of `rank` now, as the updates missed while the link
/// was down would have (each is ignored where this worker knew it already).
fn catch_up(m: &Membership, me: u32, rank: u32, member: super::Member) {
    use crate::net::Standing;
    if rank == me || member.standing == Standing::Vacant {
        return;
    }
    let incarnation = member.endpoint.incarnation;
    let endpoint = member.endpoint;
    apply(m, me, Update::Joined { rank, endpoint });
    match member.standing {
        Standing::Failed(cause) => apply(
            m,
            me,
            Update::Failed {
                rank,
                incarnation,
                cause,
            },
        ),
        Standing::Left => apply(m, me, Update::Left { rank, incarnation }),
        Standing::Alive | Standing::Vacant => {}
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
        Update::Alive => {}
        other => tracing::warn!(?other, "ignored a membership update for an unknown rank"),
    }
}
