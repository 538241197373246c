//! Sending a planned call to another worker: queued on its connection at once when nothing has
//! to be awaited first (the connection is up, every blob rides inside the envelope), as
//! PyTorch's `rpc_async` does; otherwise, boxed, at its future's first poll (dialling, bulk
//! blobs). Either way the call's future then only waits for the reply.

use std::future::Future;
use std::time::Instant;

use super::plan::{self, Outgoing};
use super::reply::{self, InFlight, Sent};
use crate::cancel::Detach;
use std::sync::Arc;

use crate::error::RpcError;
use crate::net::{MuxClient, NO_DEADLINE};
use crate::registry::RemoteFn;
use crate::state::Inner;
use crate::wire::{KeepTarget, WireBlob};

/// A call as it was made: refused, queued on its connection (its arguments kept alive until
/// it ends), or left for its future's first poll.
pub(super) enum Started<A, O: Send + 'static> {
    Failed(RpcError),
    Queued(Detach<Result<O, RpcError>>, A),
    Later(futures::future::BoxFuture<'static, Result<O, RpcError>>),
}

impl<A: Send + 'static, O: Send + 'static> Started<A, O> {
    /// The call's future. (Not an `async fn`: its argument would be stored twice, and the
    /// future of every call in flight would be a hundred bytes larger.)
    #[allow(clippy::manual_async_fn)]
    pub(super) fn run(self) -> impl Future<Output = Result<O, RpcError>> + Send + 'static {
        async move {
            match self {
                Started::Failed(e) => Err(e),
                Started::Queued(reply, args) => {
                    let r = reply.await;
                    drop(args);
                    r
                }
                Started::Later(f) => f.await,
            }
        }
    }
}

/// What [`queue_now`] did: queued the call (or refused it), or left it for later.
enum Queued {
    Now(Result<InFlight, RpcError>),
    Later(Outgoing, Option<KeepTarget>),
}

/// Starts a call to another worker: queued now if it can be ([`queue_now`]), else left,
/// boxed, for its future's first poll. The arguments stay alive until it ends. `droppable`:
/// the caller may drop the future before it ends (see `cancel.rs`); `rpc_sync` drives it to
/// the end and says so, which spares a task.
pub(super) fn start_remote<F: RemoteFn, O: serde::de::DeserializeOwned + Send + 'static>(
    w: &Arc<Inner>,
    out: Outgoing,
    args: F::Args,
    keep: Option<KeepTarget>,
    droppable: bool,
) -> Started<F::Args, O> {
    w.net.spin.touch();
    match queue_now::<F>(w, out, keep, droppable) {
        Queued::Now(Ok(q)) => Started::Queued(reply::await_reply::<F, O>(w, q), args),
        Queued::Now(Err(e)) => Started::Failed(e),
        Queued::Later(out, keep) => {
            let w = Arc::clone(w);
            Started::Later(Box::pin(async move {
                let r = match queue_later::<F>(&w, out, keep, droppable).await {
                    Ok(q) => reply::await_reply::<F, O>(&w, q).await,
                    Err(e) => Err(e),
                };
                drop(args);
                r
            }))
        }
    }
}

/// Queues a call on its live connection at once when nothing has to be awaited first (the
/// connection is up, every blob rides inside the envelope); otherwise gives it back
/// (`Later`).
fn queue_now<F: RemoteFn>(
    w: &Arc<Inner>,
    out: Outgoing,
    keep: Option<KeepTarget>,
    droppable: bool,
) -> Queued {
    let net = &w.net;
    let Some((gen, client)) = net.peers[out.to as usize].current() else {
        return Queued::Later(out, keep);
    };
    let blobs = if out.blobs.is_empty() {
        Vec::new()
    } else {
        match net.bulk.all_inline(&out.blobs) {
            Some(b) => b,
            None => return Queued::Later(out, keep),
        }
    };
    // Until the request is queued, an error drops `out`, which gives back what its
    // arguments lent (`unsent`): the callee cannot have read them.
    if let Err(e) = plan::check_frame::<F>(w, &out.payload, &blobs) {
        return Queued::Now(Err(e));
    }
    Queued::Now(Ok(queue::<F>(w, out, blobs, gen, client, keep, droppable)))
}

/// [`queue_now`]'s other path: sends the bulk blobs and dials the connection if need be,
/// bounded by the deadline too (a peer that stopped reading must not hold the caller past it),
/// then queues the call.
async fn queue_later<F: RemoteFn>(
    w: &Arc<Inner>,
    mut out: Outgoing,
    keep: Option<KeepTarget>,
    droppable: bool,
) -> Result<InFlight, RpcError> {
    let (to, timing) = (out.to, out.timing);
    let net = &w.net;
    let blobs = std::mem::take(&mut out.blobs);
    let payload = &out.payload;
    let setup = async {
        let span = net.tracer.transfer("send arguments", to, None);
        let blobs = net
            .bulk
            .send(to, blobs)
            .await
            .map_err(|e| RpcError::Transport {
                worker: net.directory().name(to).to_owned(),
                source: e.into(),
            })?;
        drop(span);
        plan::check_frame::<F>(w, payload, &blobs)?;
        let (gen, client) = net.control(to).await?;
        Ok::<_, RpcError>((blobs, gen, client))
    };
    let set_up = match timing.deadline {
        None => setup.await,
        Some(d) => tokio::time::timeout_at(d.into(), setup)
            .await
            .unwrap_or_else(|_| Err(reply::deadline_exceeded::<F>(w, to, timing))),
    };
    if let Err(RpcError::Unreachable { .. }) = &set_up {
        reply::verdict(w, to).await;
    }
    let (blobs, gen, client) = set_up.map_err(|e| plan::peer_gone::<F>(w, to).unwrap_or(e))?;
    Ok(queue::<F>(w, out, blobs, gen, client, keep, droppable))
}

/// Queues `out` (its bulk blobs already sent, as `blobs`) on connection `gen`.
fn queue<F: RemoteFn>(
    w: &Arc<Inner>,
    out: Outgoing,
    blobs: Vec<WireBlob>,
    gen: u64,
    client: MuxClient,
    keep: Option<KeepTarget>,
    droppable: bool,
) -> InFlight {
    let Outgoing {
        to,
        payload,
        unsent,
        meta,
        caller_meta,
        timing,
        ..
    } = out;
    // A call its caller may drop is cancelled by message, and its reply is always read, so
    // that what its arguments or its result lent is accounted for (see `cancel.rs`).
    let cancel_id = droppable.then(|| w.caller.next_cancel_id());
    let (trace, flow) = match w.net.tracer.call_made(F::NAME, to) {
        Some((mut span, id)) => {
            span.bytes((payload.len() + crate::net::inline_bytes(&blobs)) as u64);
            (Some(span), Some(id))
        }
        None => (None, None),
    };
    let req = plan::envelope::<F>(timing.depth, payload, blobs, keep, meta, cancel_id, flow);
    // Dropped from here on without a verdict (the outcome is unknown), `lent` runs nothing.
    let sent = Sent {
        lent: unsent.sent(),
        timing,
        caller_meta,
        trace,
    };
    let by = timing
        .deadline
        .unwrap_or_else(|| Instant::now() + NO_DEADLINE);
    InFlight {
        waiter: client.send(req, by),
        to,
        gen,
        cancel_id,
        sent,
    }
}
