//! What comes back for a call, and the one mapping from it to the caller's result: the
//! callee's answer, a failure of the connection ([`CallFailed`]), the deadline, or a remote
//! error, whichever way the call went (multiplexed, blocking, or to this worker itself).

use std::future::Future;
use std::time::Instant;

use super::cancel::Detach;
use super::plan::Timing;
use crate::agent::Agent;
use crate::blob::{self, MessageContext, MessageKind};
use crate::context::META;
use crate::error::{RemoteError, RemoteErrorKind, RpcError};
use crate::net::{CallFailed, Waiter};
use crate::registry::RemoteFn;
use crate::wire::{CallMeta, CallOk, CallReply, WorkerId};

/// A call on its way: what its arguments lent, its timing, its caller's metadata.
pub(super) struct Sent {
    /// Dropped without a verdict (the outcome is unknown), it runs nothing.
    pub lent: blob::Lent,
    pub timing: Timing,
    pub caller_meta: CallMeta,
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
    agent: &Agent,
    q: InFlight,
) -> Detach<Result<O, RpcError>> {
    let (to, cancel_id) = (q.to, q.cancel_id);
    // Boxed: the wait and the reply's handling are most of a call's state, and a call's
    // future stays small (it is moved, and spawned by `remote`).
    let work = Box::pin(wait_reply::<F, O>(agent.clone(), q));
    Detach::new(agent.clone(), to, cancel_id, work)
}

/// Waits for `q`'s reply until its deadline, then reads it. (Not an `async fn`: it would hold
/// `q` twice, as a parameter and as the locals it is taken apart into.)
fn wait_reply<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
    agent: Agent,
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
            verdict(&agent, to).await;
        }
        let (ok, deadline, caller_meta) = arrived::<F>(&agent, to, gen, reply, sent)?;
        read_result::<F, O>(&agent, to, ok, deadline, caller_meta).await
    }
}

/// A multiplexed call's reply as it arrived: forgets a connection the call found broken, then
/// settles the reply. (A function of its own, so nothing of it stays in the waiting future.)
fn arrived<F: RemoteFn>(
    agent: &Agent,
    to: u32,
    gen: u64,
    reply: Result<CallReply, CallFailed>,
    sent: Sent,
) -> Result<(CallOk, Option<Instant>, CallMeta), RpcError> {
    if reply.as_ref().is_err_and(CallFailed::broke_connection) {
        agent.inner.net.peers[to as usize].invalidate(gen);
    }
    let Sent {
        lent,
        timing,
        caller_meta,
    } = sent;
    let ok = settle::<F>(agent, to, reply, timing, lent)?;
    Ok((ok, timing.deadline, caller_meta))
}

/// The longest a call whose connection broke waits for the failure detector's verdict on the
/// peer before it reports a lost connection.
const VERDICT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A call to `to` found its connection broken: waits (bounded) for the failure detector's
/// verdict, so that a peer whose process is gone is reported as failed, not as a lost
/// connection, whichever of the two sockets noticed first.
pub(super) async fn verdict(agent: &Agent, to: u32) {
    let wait = VERDICT_WAIT.min(agent.inner.net.cfg.failure_timeout);
    agent.inner.net.membership.verdict_within(to, wait).await;
}

/// The error of a call of `F` to `to` if `to` was declared failed.
pub(super) fn peer_failed<F: RemoteFn>(agent: &Agent, to: u32) -> Option<RpcError> {
    let f = agent.inner.net.membership.failure(to)?;
    Some(RpcError::PeerFailed {
        worker: f.name,
        fn_name: F::NAME.to_owned(),
        cause: f.cause,
    })
}

/// What came back for a call to `to`, as the caller's result: the callee's answer, or the
/// error that replaced it (a failure of the connection, the deadline, a remote error).
/// Settles what the arguments lent: given back if the callee certainly never read them,
/// released once it answered, kept (and given up by its lender's own timeout) if unknown.
pub(super) fn settle<F: RemoteFn>(
    agent: &Agent,
    to: u32,
    reply: Result<CallReply, CallFailed>,
    timing: Timing,
    lent: blob::Lent,
) -> Result<CallOk, RpcError> {
    let worker = || agent.inner.group.worker(to).name.clone();
    let lost = || RpcError::ConnectionLost {
        worker: worker(),
        fn_name: F::NAME.to_owned(),
    };
    let failed = match reply {
        Ok(Ok(ok)) => {
            lent.answered();
            return Ok(ok);
        }
        Ok(Err(remote)) => {
            // Refused before its arguments were read, or answered after.
            if matches!(
                remote.kind,
                RemoteErrorKind::UnknownFunction
                    | RemoteErrorKind::TypeMismatch
                    | RemoteErrorKind::ShuttingDown
            ) {
                lent.never_decoded();
            } else {
                lent.answered();
            }
            return Err(map_remote::<F>(remote));
        }
        Err(f) => f,
    };
    if let Some(e) = peer_failed::<F>(agent, to) {
        // Whatever broke the call, the peer is gone: say so.
        if let CallFailed::NotSent { .. } = failed {
            lent.never_decoded();
        }
        return Err(e);
    }
    match failed {
        CallFailed::NotSent { cause, broken } => {
            lent.never_decoded();
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
        CallFailed::Deadline => Err(deadline_exceeded::<F>(agent, to, timing)),
        CallFailed::Refused(e)
            if e.kind == std::io::ErrorKind::TimedOut
                || timing.deadline.is_some_and(|d| Instant::now() >= d) =>
        {
            Err(deadline_exceeded::<F>(agent, to, timing))
        }
        CallFailed::Refused(e) => Err(RpcError::Transport {
            worker: worker(),
            source: Box::new(e),
        }),
        CallFailed::Closed => Err(RpcError::Shutdown {
            worker: agent.name().to_owned(),
            fn_name: F::NAME.to_owned(),
        }),
    }
}

/// A call to this worker itself (`to`), run by `run` (or refused by the callee's checks)
/// within the call's deadline. (Not an `async fn`: it would hold `run` twice.)
pub(super) fn local<'a, F: RemoteFn, T: 'a>(
    agent: &'a Agent,
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
                Err(_) => Err(deadline_exceeded::<F>(agent, to, timing)),
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
pub(super) fn deadline_exceeded<F: RemoteFn>(agent: &Agent, to: u32, timing: Timing) -> RpcError {
    RpcError::DeadlineExceeded {
        worker: agent.inner.group.worker(to).name.clone(),
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
    agent: &Agent,
    to: u32,
    ok: CallOk,
    deadline: Option<Instant>,
    caller_meta: CallMeta,
) -> Result<O, RpcError> {
    let worker = || agent.inner.group.worker(to).name.clone();
    let blobs = if ok.blobs.is_empty() {
        Vec::new()
    } else {
        Box::pin(agent.inner.net.bulk.receive(to, ok.blobs, deadline))
            .await
            .map_err(|e| {
                peer_failed::<F>(agent, to).unwrap_or_else(|| RpcError::Transport {
                    worker: worker(),
                    source: e.into(),
                })
            })?
    };
    let msg = MessageContext::new(agent.clone(), WorkerId(to), MessageKind::Reply);
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
