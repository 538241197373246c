//! The caller's path, in the order a call takes it:
//!
//! ```text
//! plan      target, deadline and depth; the arguments encoded with their side table
//! send      queued on the peer's connection now, or at the first poll (dial, bulk blobs)
//! reply     the wait, the one mapping of what came back to the caller's result, decoding
//! blocking  rpc_sync on the calling thread's own connection
//! ```
//!
//! A call to this worker itself is planned the same way and then run by the callee's path
//! (`dispatch.rs`) with its typed arguments, without serialization (AG-1).

mod blocking;
mod plan;
mod reply;
mod send;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub(crate) use blocking::rpc_sync;
use plan::Plan;
use send::Started;

use std::sync::Arc;

use crate::dispatch;
use crate::error::RpcError;
use crate::group::ToWorker;
use crate::registry::RemoteFn;
use crate::state::{Caller, Inner};
use crate::wire::KeepTarget;

impl Caller {
    pub(crate) fn new(rpc_timeout: Duration, sync_connections: bool) -> Self {
        Self {
            rpc_timeout,
            sync_connections,
            next_cancel_id: AtomicU64::new(0),
        }
    }

    /// A fresh id for an outgoing cancellable call (unique per caller: CAN-1).
    pub(crate) fn next_cancel_id(&self) -> u64 {
        self.next_cancel_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// The future of a call of `F` to `to`. `droppable`: the caller may drop it before it ends
/// (see `cancel.rs`); `rpc_sync` drives it to the end and says so, which spares a task.
///
/// A call to another worker is queued here when nothing has to be awaited first (the
/// connection is up, no bulk blobs): it starts at once, as PyTorch's `rpc_async` does, and
/// the future only waits for the reply. Anything else (dialling, bulk blobs, a call to this
/// worker) runs when the future is polled, boxed, so the future stays small.
pub(crate) fn call_fut<F: RemoteFn>(
    w: &Arc<Inner>,
    to: impl ToWorker,
    args: F::Args,
    timeout: Duration,
    droppable: bool,
) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static {
    let call = match plan::plan::<F>(w, &to, args, timeout) {
        Plan::Remote(Err(e), _) => Started::Failed(e),
        Plan::Remote(Ok(out), args) => {
            send::start_remote::<F, F::Output>(w, out, args, None, droppable)
        }
        Plan::Local(planned, args, meta) => {
            let w = Arc::clone(w);
            Started::Later(Box::pin(async move {
                let (to, t) = planned?;
                let run = dispatch::call_local::<F>(&w, args, t.deadline, t.depth, meta);
                reply::local::<F, _>(&w, to, t, run).await
            }))
        }
    };
    call.run()
}

/// A keep-call of `F` to `to` (see `ext::AgentExt::rpc_keep`): the result goes to the keep
/// sink `sink` on the callee, with `token`. Queued when this is called where it can be, like
/// [`call_fut`]; everything but the wait for a queued call is boxed, since thousands of these
/// may be waiting at once (one per new remote reference).
pub(crate) fn rpc_keep<F: RemoteFn>(
    w: &Arc<Inner>,
    to: impl ToWorker,
    args: F::Args,
    sink: &'static str,
    token: Vec<u8>,
) -> impl Future<Output = Result<(), RpcError>> + Send + 'static {
    let keep = KeepTarget {
        sink: sink.into(),
        token,
    };
    let call = match plan::plan::<F>(w, &to, args, w.caller.rpc_timeout) {
        Plan::Remote(Err(e), _) => Started::Failed(e),
        Plan::Remote(Ok(out), args) => send::start_remote::<F, ()>(w, out, args, Some(keep), true),
        Plan::Local(planned, args, meta) => {
            let w = Arc::clone(w);
            Started::Later(Box::pin(async move {
                let (to, t) = planned?;
                let run = dispatch::keep_local::<F>(
                    &w, args, t.deadline, t.depth, meta, sink, keep.token,
                );
                reply::local::<F, _>(&w, to, t, run).await
            }))
        }
    };
    call.run()
}

/// Tells `to` that this worker dropped call `id` (`cancel.rs`): in a task of its own, since a
/// dropped call's future is what asks for it.
fn send_cancel(w: &Arc<Inner>, to: u32, id: u64) {
    let cancel = call_fut::<dispatch::CancelCall>(w, to, (id,), w.caller.rpc_timeout, true);
    let name = w.name().to_owned();
    w.net.runtime.spawn(async move {
        if let Err(e) = cancel.await {
            tracing::debug!(
                worker = %name, to, id, cause = %crate::error_chain(&e), "cancel not delivered"
            );
        }
    });
}

/// Awaits every future; returns all results in order, or the first error.
///
/// ```
/// # async fn demo(agent: rpc_core::Agent) -> Result<(), rpc_core::RpcError> {
/// # #[rpc_core::remote] async fn add(_c: rpc_core::CallContext, a: i32, b: i32) -> Result<i32, rpc_core::BoxError> { Ok(a + b) }
/// let sums = rpc_core::wait_all((0..4).map(|i| agent.rpc_async(1u32, add, (i, i)))).await?;
/// # Ok(()) }
/// ```
pub async fn wait_all<T, I>(futures: I) -> Result<Vec<T>, RpcError>
where
    I: IntoIterator,
    I::Item: Future<Output = Result<T, RpcError>>,
{
    futures::future::try_join_all(futures).await
}
