//! What comes back for a call, and the one mapping from it to the caller's result: the
//! callee's answer, a failure of the connection ([`CallFailed`]), the deadline, or a remote
//! error, whichever way the call went (multiplexed, blocking, or to this worker itself).

use std::future::Future;
use std::time::Instant;

use super::plan::{peer_failed, Timing};
use crate::cancel::Detach;
use std::sync::Arc;

use crate::blob;
use crate::context::META;
use crate::error::{RemoteError, RemoteErrorKind, RpcError};
use crate::net::{CallFailed, Waiter};
use crate::registry::RemoteFn;
use crate::state::Inner;
use crate::state::{MessageContext, MessageKind};
use crate::wire::{CallMeta, CallOk, CallReply, WorkerId};

/// A call on its way: what its arguments lent, its timing, its caller's metadata.
pub(super) struct Sent {
    /// Dropped without a verdict (the outcome is unknown), it runs nothing.
    pub lent: blob::Lent,
    pub timing: Timing,
    pub caller_meta: CallMeta,
    /// The call's span when this worker traces: it ends when the reply is settled.
    pub trace: Option<crate::trace::Span>,
}

/// A call queued on its connection (or refused by it: `waiter` is then the reason), waiting
/// for its reply.
pub(super) struct InFlight {
    pub waiter: Result<Waiter, CallFailed>,
    pub to: u32,
    /// The connection's generation, to forget it if the call finds it broken.
    pub gen: u64,
    pub cancel_id: Option<u64>,
    pub sent: Sent,
}

/// The wait for a queued call's reply and its reading, as a future. A call its caller may
/// drop goes on as a task of its own if it is dropped first (`cancel.rs`).
pub(super) fn await_reply<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
    w: &Arc<Inner>,
    q: InFlight,
) -> Detach<Result<O, RpcError>> {
    let (to, cancel_id) = (q.to, q.cancel_id);
    // Boxed: the wait and the reply's handling are most of a call's state, and a call's
    // future stays small (it is moved, and spawned by `remote`).
    let work = Box::pin(wait_reply::<F, O>(Arc::clone(w), q));
    let abandon = cancel_id.map(|id| {
        let w = Arc::clone(w);
        Box::new(move || super::send_cancel(&w, to, id)) as Box<dyn FnOnce() + Send>
    });
    Detach::new(w.net.runtime.clone(), work, abandon)
}

/// Waits for `q`'s reply until its deadline, then reads it. (Not an `async fn`: it would hold
/// `q` twice, as a parameter and as the locals it is taken apart into.)
fn wait_reply<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
    w: Arc<Inner>,
    q: InFlight,
) -> impl Future<Output = Result<O, RpcError>> + Send + 'static {
    let InFlight {
        waiter,
        to,
        gen,
        sent,
        ..
    } = q;
    async move {
        let reply = match (waiter, sent.timing.deadline) {
            (Err(e), _) => Err(e),
            (Ok(w), None) => w.await,
            (Ok(w), Some(d)) => match tokio::time::timeout_at(d.into(), w).await {
                Ok(r) => r,
                Err(_) => Err(CallFailed::Deadline),
            },
        };
        if reply.as_ref().is_err_and(CallFailed::broke_connection) {
            verdict(&w, to).await;
        }
        let (ok, deadline, caller_meta) = arrived::<F>(&w, to, gen, reply, sent)?;
        read_result::<F, O>(&w, to, ok, deadline, caller_meta).await
    }
}

/// A multiplexed call's reply as it arrived: forgets a connection the call found broken, then
/// settles the reply. (A function of its own, so nothing of it stays in the waiting future.)
fn arrived<F: RemoteFn>(
    w: &Arc<Inner>,
    to: u32,
    gen: u64,
    reply: Result<CallReply, CallFailed>,
    sent: Sent,
) -> Result<(CallOk, Option<Instant>, CallMeta), RpcError> {
    if reply.as_ref().is_err_and(CallFailed::broke_connection) {
        w.net.peers[to as usize].invalidate(gen);
    }
    let Sent {
        lent,
        timing,
        caller_meta,
        mut trace,
    } = sent;
    let ok = settle::<F>(w, to, reply, timing, lent);
    if let Some(s) = trace.as_mut() {
        s.ok(ok.is_ok());
    }
    Ok((ok?, timing.deadline, caller_meta))
}

/// The longest a call whose connection broke waits for the failure detector's verdict on the
/// peer before it reports a lost connection.
const VERDICT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A call to `to` found its connection broken: waits (bounded) for the failure detector's
/// verdict, so that a peer whose process is gone is reported as failed, not as a lost
/// connection, whichever of the two sockets noticed first.
pub(super) async fn verdict(w: &Arc<Inner>, to: u32) {
    let wait = VERDICT_WAIT.min(w.net.cfg.failure_timeout);
    w.net.membership.verdict_within(to, wait).await;
}

/// What came back for a call to `to`, as the caller's result: the callee's answer, or the
/// error that replaced it (a failure of the connection, the deadline, a remote error).
/// Settles what the arguments lent ([`decide`] says how).
pub(super) fn settle<F: RemoteFn>(
    w: &Arc<Inner>,
    to: u32,
    reply: Result<CallReply, CallFailed>,
    timing: Timing,
    lent: blob::Lent,
) -> Result<CallOk, RpcError> {
    let names = Names {
        callee: &w.group.worker(to).name,
        me: w.name(),
    };
    let standing = match &reply {
        Ok(_) => Standing::Live,
        Err(_) => match w.net.membership.failure(to) {
            Some(f) => Standing::Failed(f),
            None if w.net.membership.state(to) == crate::net::PeerState::Quiet => {
                Standing::ShutDown
            }
            None => Standing::Live,
        },
    };
    let standing = match (standing, w.life.signalled.get()) {
        (Standing::Live, Some(signal)) => Standing::Stopping(signal),
        (s, _) => s,
    };
    let (result, fate) = decide::<F>(names, standing, reply, timing, Instant::now());
    match fate {
        Fate::Answered => lent.answered(),
        Fate::NeverDecoded => lent.never_decoded(),
        // Kept: given up by its lender's own timeout.
        Fate::Unknown => drop(lent),
    }
    result
}

/// The workers a call's errors name.
#[derive(Clone, Copy)]
struct Names<'a> {
    callee: &'a str,
    me: &'a str,
}

/// How the callee stands in the group's view, when its call broke.
enum Standing {
    Live,
    /// Declared failed, with the verdict.
    Failed(crate::net::WorkerFailed),
    /// It said it was shutting down.
    ShutDown,
    /// This worker is stopping on this signal (`signals.rs`).
    Stopping(&'static str),
}

/// What became of a call's arguments on the callee, as far as the caller can tell: what the
/// values they lent are owed (see `MessageContext::on_undelivered`, `on_answered`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// The callee read them and answered.
    Answered,
    /// The callee certainly never read them.
    NeverDecoded,
    /// Nobody can tell.
    Unknown,
}

/// The pure part of [`settle`]: the caller's result of a call of `F` from `names.me` to
/// `names.callee`, and the fate of its arguments, from what came back, the verdict on the
/// callee if it was declared failed, and the time.
///
/// - REP-1: an answer (a result, or an error the callee's function returned) means the
///   arguments were read; a refusal before reading them (unknown function, signature
///   mismatch, shutting down, busy) means they never were.
/// - REP-2: whatever broke a call, a callee declared failed is reported as
///   [`RpcError::PeerFailed`] with its verdict's cause; a callee that shut down, whose
///   connection broke, as [`RpcError::PeerShutDown`].
/// - REP-3: a request never written was never read; one lost after writing, timed out or
///   ended by this worker's closing may or may not have been. A refusal that came at or
///   after the deadline is the deadline's.
fn decide<F: RemoteFn>(
    names: Names<'_>,
    standing: Standing,
    reply: Result<CallReply, CallFailed>,
    timing: Timing,
    now: Instant,
) -> (Result<CallOk, RpcError>, Fate) {
    let worker = || names.callee.to_owned();
    let lost = || RpcError::ConnectionLost {
        worker: worker(),
        fn_name: F::NAME.to_owned(),
    };
    let failure = match reply {
        Ok(Ok(ok)) => return (Ok(ok), Fate::Answered),
        Ok(Err(remote)) => {
            let refused = matches!(
                remote.kind,
                RemoteErrorKind::UnknownFunction
                    | RemoteErrorKind::TypeMismatch
                    | RemoteErrorKind::ShuttingDown
                    | RemoteErrorKind::Busy
            );
            let fate = if refused {
                Fate::NeverDecoded
            } else {
                Fate::Answered
            };
            return (Err(map_remote::<F>(remote)), fate);
        }
        Err(f) => f,
    };
    let not_sent = matches!(failure, CallFailed::NotSent { .. });
    let fate = if not_sent {
        Fate::NeverDecoded
    } else {
        Fate::Unknown
    };
    let broken = matches!(
        failure,
        CallFailed::Lost(_) | CallFailed::NotSent { broken: true, .. }
    );
    match standing {
        Standing::ShutDown if broken => {
            let e = RpcError::PeerShutDown {
                worker: worker(),
                fn_name: F::NAME.to_owned(),
            };
            return (Err(e), fate);
        }
        Standing::Stopping(signal) if broken => {
            let e = RpcError::Stopped {
                worker: names.me.to_owned(),
                fn_name: F::NAME.to_owned(),
                signal: signal.to_owned(),
            };
            return (Err(e), fate);
        }
        _ => {}
    }
    if let Standing::Failed(f) = standing {
        let e = RpcError::PeerFailed {
            worker: f.name,
            fn_name: F::NAME.to_owned(),
            cause: f.cause,
        };
        return (Err(e), fate);
    }
    let result = match failure {
        CallFailed::NotSent { cause, broken } => {
            if broken {
                tracing::debug!(peer = %worker(), %cause, "connection failed");
                Err(lost())
            } else {
                // Not encodable: the connection is fine, the request is not.
                Err(RpcError::Transport {
                    worker: worker(),
                    source: Box::new(cause),
                })
            }
        }
        CallFailed::Lost(cause) => {
            tracing::debug!(peer = %worker(), %cause, "connection failed");
            Err(lost())
        }
        CallFailed::Deadline => Err(deadline_error::<F>(names.callee, timing)),
        CallFailed::Refused(e)
            if e.kind == std::io::ErrorKind::TimedOut
                || timing.deadline.is_some_and(|d| now >= d) =>
        {
            Err(deadline_error::<F>(names.callee, timing))
        }
        CallFailed::Refused(e) => Err(RpcError::Transport {
            worker: worker(),
            source: Box::new(e),
        }),
        CallFailed::Closed => Err(RpcError::Shutdown {
            worker: names.me.to_owned(),
            fn_name: F::NAME.to_owned(),
        }),
    };
    (result, fate)
}

/// A call to this worker itself (`to`), run by `run` (or refused by the callee's checks)
/// within the call's deadline. (Not an `async fn`: it would hold `run` twice.)
pub(super) fn local<'a, F: RemoteFn, T: 'a>(
    w: &'a Arc<Inner>,
    to: u32,
    timing: Timing,
    run: Result<impl Future<Output = Result<T, RemoteError>> + 'a, RemoteError>,
) -> impl Future<Output = Result<T, RpcError>> + 'a {
    use futures::future::{ready, Either};
    use futures::FutureExt;
    let run = match run {
        Ok(run) => run,
        Err(e) => return Either::Left(ready(Err(map_remote::<F>(e)))),
    };
    Either::Right(match timing.deadline {
        None => Either::Left(run.map(|r| r.map_err(map_remote::<F>))),
        Some(d) => Either::Right(
            tokio::time::timeout_at(d.into(), run).map(move |r| match r {
                Ok(r) => r.map_err(map_remote::<F>),
                Err(_) => Err(deadline_exceeded::<F>(w, to, timing)),
            }),
        ),
    })
}

/// A remote error as the caller's error: the kinds a caller acts on get variants of their
/// own, with both sides' signatures for a mismatch.
fn map_remote<F: RemoteFn>(r: RemoteError) -> RpcError {
    match r.kind {
        RemoteErrorKind::UnknownFunction => RpcError::UnknownFunction {
            worker: r.worker,
            fn_name: r.fn_name,
        },
        RemoteErrorKind::TypeMismatch => RpcError::TypeMismatch {
            worker: r.worker,
            fn_name: r.fn_name,
            detail: format!(
                "{}; caller's is `{}` -> `{}`",
                r.message,
                std::any::type_name::<F::Args>(),
                std::any::type_name::<F::Output>()
            ),
        },
        RemoteErrorKind::ShuttingDown => RpcError::PeerShuttingDown {
            worker: r.worker,
            fn_name: r.fn_name,
        },
        _ => RpcError::Remote(r),
    }
}

/// The call of `F` to `to` ran out of time.
pub(super) fn deadline_exceeded<F: RemoteFn>(w: &Arc<Inner>, to: u32, timing: Timing) -> RpcError {
    deadline_error::<F>(&w.group.worker(to).name, timing)
}

fn deadline_error<F: RemoteFn>(callee: &str, timing: Timing) -> RpcError {
    RpcError::DeadlineExceeded {
        worker: callee.to_owned(),
        fn_name: F::NAME.to_owned(),
        timeout: timing
            .deadline_or_far()
            .saturating_duration_since(timing.started),
    }
}

/// Reads a result's bulk blobs, if it has any, and decodes it under its caller's metadata,
/// wherever the caller's future is polled (or the task that took over a dropped one). Without
/// blobs nothing is awaited, and the future stays small (many calls wait at once, each holding
/// one).
pub(super) async fn read_result<F: RemoteFn, O: serde::de::DeserializeOwned>(
    w: &Arc<Inner>,
    to: u32,
    ok: CallOk,
    deadline: Option<Instant>,
    caller_meta: CallMeta,
) -> Result<O, RpcError> {
    let worker = || w.group.worker(to).name.clone();
    let blobs = if ok.blobs.is_empty() {
        Vec::new()
    } else {
        let bytes = Some(crate::net::bulk_bytes(&ok.blobs));
        let _span = w.net.tracer.transfer("receive result", to, bytes);
        Box::pin(w.net.bulk.receive(to, ok.blobs, deadline))
            .await
            .map_err(|e| {
                peer_failed::<F>(w, to).unwrap_or_else(|| RpcError::Transport {
                    worker: worker(),
                    source: e.into(),
                })
            })?
    };
    let msg = MessageContext::for_worker(w, WorkerId(to), MessageKind::Reply);
    let decoded = META.sync_scope(caller_meta, || {
        blob::decode::<O>(&ok.payload, blobs, Some(msg))
    });
    decoded.map_err(|e| RpcError::TypeMismatch {
        worker: worker(),
        fn_name: F::NAME.to_owned(),
        detail: format!(
            "cannot decode the result as `{}`: {e}",
            std::any::type_name::<O>()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BoxError;
    use crate::state::CallContext;
    use std::time::Duration;

    struct Ping;

    impl RemoteFn for Ping {
        const NAME: &'static str = "test::ping";
        type Args = ();
        type Output = ();
        async fn call(_: CallContext, (): ()) -> Result<(), BoxError> {
            Ok(())
        }
    }

    const NAMES: Names<'static> = Names {
        callee: "worker1",
        me: "worker0",
    };

    fn timing(deadline_in: Option<Duration>) -> (Timing, Instant) {
        let now = Instant::now();
        let t = Timing {
            deadline: deadline_in.map(|d| now + d),
            depth: 0,
            started: now,
        };
        (t, now)
    }

    fn remote(kind: RemoteErrorKind) -> CallReply {
        Err(RemoteError::new(kind, "test::ping", "worker1", "x"))
    }

    fn io(kind: std::io::ErrorKind) -> std::io::Error {
        std::io::Error::new(kind, "x")
    }

    fn verdict() -> crate::net::WorkerFailed {
        crate::net::WorkerFailed {
            rank: 1,
            name: "worker1".into(),
            incarnation: 0,
            cause: "no heartbeat".into(),
            at: std::time::SystemTime::now(),
        }
    }

    fn decide_now(
        reply: Result<CallReply, CallFailed>,
        failed: Option<crate::net::WorkerFailed>,
    ) -> (Result<CallOk, RpcError>, Fate) {
        let (t, now) = timing(Some(Duration::from_secs(10)));
        let standing = failed.map_or(Standing::Live, Standing::Failed);
        decide::<Ping>(NAMES, standing, reply, t, now)
    }

    /// REP-1: answers read the arguments; refusals before reading them did not.
    #[test]
    fn answers_and_refusals_settle_what_the_arguments_lent() {
        let ok = Ok(Ok(CallOk {
            payload: vec![1],
            blobs: Vec::new(),
        }));
        assert_eq!(decide_now(ok, None).1, Fate::Answered);
        let (r, fate) = decide_now(Ok(remote(RemoteErrorKind::Handler)), None);
        assert!(matches!(r, Err(RpcError::Remote(_))));
        assert_eq!(fate, Fate::Answered);
        for (kind, want) in [
            (RemoteErrorKind::UnknownFunction, "UnknownFunction"),
            (RemoteErrorKind::TypeMismatch, "TypeMismatch"),
            (RemoteErrorKind::ShuttingDown, "PeerShuttingDown"),
            (RemoteErrorKind::Busy, "Remote"),
        ] {
            let (r, fate) = decide_now(Ok(remote(kind)), None);
            assert_eq!(fate, Fate::NeverDecoded, "{kind:?}");
            assert!(
                format!("{r:?}").starts_with(&format!("Err({want}")),
                "{r:?}"
            );
        }
    }

    /// REP-2: a failed callee is named with its verdict, whatever broke the call.
    #[test]
    fn a_failed_callee_is_named_with_its_verdict() {
        let lost = Err(CallFailed::Lost(io(std::io::ErrorKind::ConnectionReset)));
        let (r, fate) = decide_now(lost, Some(verdict()));
        match r {
            Err(RpcError::PeerFailed { worker, cause, .. }) => {
                assert_eq!(
                    (worker.as_str(), cause.as_str()),
                    ("worker1", "no heartbeat")
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(fate, Fate::Unknown);
        let not_sent = Err(CallFailed::closed_connection());
        assert_eq!(decide_now(not_sent, Some(verdict())).1, Fate::NeverDecoded);
        // A callee that shut down, whose connection broke, is named as such.
        let (t, now) = timing(None);
        let lost = Err(CallFailed::Lost(io(std::io::ErrorKind::ConnectionReset)));
        let (r, _) = decide::<Ping>(NAMES, Standing::ShutDown, lost, t, now);
        assert!(matches!(r, Err(RpcError::PeerShutDown { .. })), "{r:?}");
    }

    /// REP-3: not sent is never read; lost, timed out or closed is unknown; a refusal at the
    /// deadline is the deadline's.
    #[test]
    fn broken_calls_say_what_broke_and_what_the_callee_may_have_read() {
        let (r, fate) = decide_now(Err(CallFailed::closed_connection()), None);
        assert!(matches!(r, Err(RpcError::ConnectionLost { .. })), "{r:?}");
        assert_eq!(fate, Fate::NeverDecoded);
        let unencodable = CallFailed::NotSent {
            cause: io(std::io::ErrorKind::InvalidData),
            broken: false,
        };
        let (r, _) = decide_now(Err(unencodable), None);
        assert!(matches!(r, Err(RpcError::Transport { .. })), "{r:?}");
        let lost = CallFailed::Lost(io(std::io::ErrorKind::ConnectionReset));
        let (r, fate) = decide_now(Err(lost), None);
        assert!(matches!(r, Err(RpcError::ConnectionLost { .. })), "{r:?}");
        assert_eq!(fate, Fate::Unknown);
        let (r, fate) = decide_now(Err(CallFailed::Deadline), None);
        assert!(matches!(r, Err(RpcError::DeadlineExceeded { .. })), "{r:?}");
        assert_eq!(fate, Fate::Unknown);
        let (r, _) = decide_now(Err(CallFailed::Closed), None);
        assert!(
            matches!(&r, Err(RpcError::Shutdown { worker, .. }) if worker == "worker0"),
            "this worker closed: {r:?}"
        );
        let refused = || {
            CallFailed::Refused(tarpc::ServerError::new(
                std::io::ErrorKind::Other,
                "x".into(),
            ))
        };
        let (t, now) = timing(Some(Duration::from_secs(1)));
        let (r, _) = decide::<Ping>(NAMES, Standing::Live, Err(refused()), t, now);
        assert!(matches!(r, Err(RpcError::Transport { .. })), "{r:?}");
        let late = now + Duration::from_secs(2);
        let (r, _) = decide::<Ping>(NAMES, Standing::Live, Err(refused()), t, late);
        assert!(matches!(r, Err(RpcError::DeadlineExceeded { .. })), "{r:?}");
    }
}
