//! The blocking call (`rpc_sync`): on the calling thread's own connection to the callee where
//! that applies (TCP, another worker, `Config::sync_connections`, a place free; see
//! `net/blocking.rs`), else the async call driven to its end on this thread.

use tokio::runtime::RuntimeFlavor;

use super::plan::{self, Timing};
use super::reply;
use std::sync::Arc;

use crate::context::{current_meta, current_scope};
use crate::error::RpcError;
use crate::group::ToWorker;
use crate::net::{self, SyncConn};
use crate::registry::RemoteFn;
use crate::state::Inner;

/// Calls `F` on `to` and blocks this thread until it ends (see `Agent::rpc_sync`).
pub(crate) fn rpc_sync<F: RemoteFn>(
    w: &Arc<Inner>,
    to: impl ToWorker,
    args: F::Args,
    timeout: std::time::Duration,
) -> Result<F::Output, RpcError> {
    let rt = &w.net.runtime;
    if rt.runtime_flavor() != RuntimeFlavor::MultiThread {
        return Err(RpcError::CannotBlock {
            reason: "the agent runs on a current-thread runtime, which blocking would stall",
        });
    }
    let in_runtime = match tokio::runtime::Handle::try_current() {
        Err(_) => false,
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => true,
        Ok(_) => {
            return Err(RpcError::CannotBlock {
                reason: "called on a current-thread runtime",
            })
        }
    };
    let spin = w.net.cfg.busy_poll;
    let run = move || {
        let rank = w.group.resolve(&to)?;
        if let Some(e) = plan::peer_failed::<F>(w, rank) {
            return Err(e);
        }
        if applies(w, rank) {
            // The thread writes and reads its own connection (see `net/blocking.rs`).
            let timing = plan::timing::<F>(w, timeout, current_scope())?;
            let conn = w.net.sync_conn(rank, timing.deadline);
            let conn = conn.map_err(|e| plan::peer_gone::<F>(w, rank).unwrap_or(e.into()))?;
            if let Some(conn) = conn {
                return on_thread::<F>(w, conn, rank, args, timing);
            }
            // Every place for a sync connection is taken: through the runtime.
        }
        net::block_on(
            rt,
            spin,
            super::call_fut::<F>(w, rank, args, timeout, false),
        )
    };
    if in_runtime {
        tokio::task::block_in_place(run)
    } else {
        run()
    }
}

/// Whether `rpc_sync` to `to` takes this thread's own connection.
fn applies(w: &Arc<Inner>, to: u32) -> bool {
    let cfg = &w.net.cfg;
    w.caller.sync_connections && to != cfg.rank && matches!(cfg.transport, crate::Transport::Tcp)
}

/// A blocking call to `to` (another worker, over TCP) on `conn`, this thread's connection to
/// it. Must not be called from async code: it blocks the thread.
fn on_thread<F: RemoteFn>(
    w: &Arc<Inner>,
    conn: SyncConn,
    to: u32,
    args: F::Args,
    timing: Timing,
) -> Result<F::Output, RpcError> {
    let net = &w.net;
    let rt = &net.runtime;
    let prepared = (|| {
        let (payload, blobs, unsent) = plan::encode_args::<F>(w, to, &args)?;
        let blobs = if blobs.is_empty() {
            Vec::new()
        } else if let Some(inline) = net.bulk.all_inline(&blobs) {
            inline
        } else {
            // Large blobs take the bulk path, which the runtime drives.
            let send = net.bulk.send(to, blobs);
            let sent = match timing.deadline {
                None => rt.block_on(send),
                Some(d) => rt
                    .block_on(async { tokio::time::timeout_at(d.into(), send).await })
                    .map_err(|_| reply::deadline_exceeded::<F>(w, to, timing))?,
            };
            sent.map_err(|e| RpcError::Transport {
                worker: net.directory().name(to).to_owned(),
                source: e.into(),
            })?
        };
        plan::check_frame::<F>(w, &payload, &blobs)?;
        Ok((payload, blobs, unsent))
    })();
    // Nothing was written: the connection stays this thread's.
    let (payload, blobs, unsent) = match prepared {
        Ok(p) => p,
        Err(e) => {
            conn.put_back();
            return Err(e);
        }
    };
    let meta = w.layers.outgoing_meta(crate::context::current_meta(), to);
    let (mut trace, flow) = match w.net.tracer.call_made(F::NAME, to) {
        Some((mut span, id)) => {
            span.bytes((payload.len() + crate::net::inline_bytes(&blobs)) as u64);
            (Some(span), Some(id))
        }
        None => (None, None),
    };
    let req = plan::envelope::<F>(timing.depth, payload, blobs, None, meta, None, flow);
    let lent = unsent.sent();
    // DIR-1: `conn` goes back only after a whole round trip; on failure it is dropped.
    let replied = conn.call(req, timing.deadline);
    if replied
        .as_ref()
        .is_err_and(crate::net::CallFailed::broke_connection)
    {
        rt.block_on(reply::verdict(w, to));
    }
    let ok = reply::settle::<F>(w, to, replied, timing, lent);
    if let Some(s) = trace.as_mut() {
        s.ok(ok.is_ok());
    }
    drop(trace);
    let ok = ok?;
    rt.block_on(reply::read_result::<F, F::Output>(
        w,
        to,
        ok,
        timing.deadline,
        current_meta(),
    ))
}
