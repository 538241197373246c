//! Parts of other hosts sent to rank 0 at shutdown (TR-8), so that node 0's merge has every
//! rank's part without a filesystem shared between the hosts.
//!
//! At a clean shutdown, before the barrier, a traced worker other than rank 0 asks rank 0
//! whether it wants its part ([`TraceWanted`]: rank 0 traces, and to another file than this
//! worker's own, as on another host or another path). If so it sends the part as it stands
//! ([`TracePart`]): everything but the barrier and what follows it. Rank 0 writes it under its
//! own parts' directory before it answers, so the part is there before the barrier releases
//! anyone, and before node 0's launcher merges. The worker still writes its whole part to its
//! own path after the barrier; where that is rank 0's file too (a shared filesystem reached
//! under another host name), the whole part replaces the one sent. A worker that never
//! reaches a clean shutdown sends nothing: its part stays on its own host (TR-6 names it).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Agent, Blob, BoxError, CallContext, RemoteFn};

use super::chrome::{self, part_path};

/// Worker → rank 0: "this worker, on host `host`, writes its part to `path`: do you want it
/// too?" Yes when rank 0 traces to another file.
pub(crate) struct TraceWanted;

impl RemoteFn for TraceWanted {
    const NAME: &'static str = "rpc_core::trace_wanted";
    type Args = (String, PathBuf);
    type Output = bool;
    async fn call(cx: CallContext, (host, path): Self::Args) -> Result<bool, BoxError> {
        let Some(ring) = cx.agent().tracer().ring().cloned() else {
            return Ok(false);
        };
        Ok(host != host_name() || absolute(&path) != absolute(&ring.path))
    }
}

/// Worker → rank 0: the caller's part (`incarnation`, launcher's start `restart`), as the
/// Trace Event Format's JSON; rank 0 writes it to the caller's part path under its own
/// trace's parts directory.
pub(crate) struct TracePart;

impl RemoteFn for TracePart {
    const NAME: &'static str = "rpc_core::trace_part";
    type Args = (u64, u64, Blob);
    type Output = ();
    async fn call(
        cx: CallContext,
        (incarnation, restart, part): Self::Args,
    ) -> Result<(), BoxError> {
        let Some(ring) = cx.agent().tracer().ring().cloned() else {
            return Err("this worker does not trace".into());
        };
        // The caller's own rank, not one it names: a worker writes its own part only.
        let rank = cx.caller().id.0;
        let path = part_path(&ring.path, rank, incarnation, restart);
        let write = move || chrome::write_bytes_atomic(&path, &part).map(|()| path);
        match tokio::task::spawn_blocking(write).await {
            Ok(Ok(path)) => {
                tracing::info!(rank, path = %path.display(), "trace part received");
                Ok(())
            }
            Ok(Err(e)) => Err(format!("writing rank {rank}'s trace part: {e}").into()),
            Err(e) => Err(format!("writing rank {rank}'s trace part: {e}").into()),
        }
    }
}

/// How long a worker waits for rank 0 to say whether it wants its part, at most: a live rank 0
/// answers at once, and one that does not should not hold up the shutdown.
const ASK_BOUND: Duration = Duration::from_secs(5);

/// TR-8: sends this worker's part to rank 0 if rank 0 wants it (see the module's
/// documentation): the question bounded by [`ASK_BOUND`] (or `t` if shorter), the part by
/// `t`; nothing where rank 0 is known to be gone. A failure is said, never fatal: a trace
/// must not fail the job.
pub(crate) async fn send_part_to_rank0(agent: &Agent, t: Duration) {
    let Some(ring) = agent.tracer().ring().cloned() else {
        return;
    };
    if agent.rank() == 0 || !agent.is_live(0u32).unwrap_or(false) {
        return;
    }
    let asked = (host_name(), ring.path.clone());
    let wanted = agent
        .rpc_async_timeout(0u32, TraceWanted, asked, t.min(ASK_BOUND))
        .await;
    match wanted {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::warn!(worker = %agent.name(), cause = %crate::error::error_chain(&e),
                "trace: could not ask rank 0 whether it wants this part; it stays here");
            return;
        }
    }
    let (part, who) = match tokio::task::spawn_blocking(move || ring.part_json()).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::warn!(worker = %agent.name(), cause = %e, "trace: part not encoded");
            return;
        }
        Err(e) => {
            tracing::warn!(worker = %agent.name(), cause = %e, "trace: part not encoded");
            return;
        }
    };
    let bytes = part.len();
    let args = (who.incarnation, who.restart, Blob::from(part));
    match agent.rpc_async_timeout(0u32, TracePart, args, t).await {
        Ok(()) => tracing::info!(worker = %agent.name(), bytes, "trace part sent to rank 0"),
        Err(e) => tracing::warn!(worker = %agent.name(),
            cause = %crate::error::error_chain(&e),
            "trace: part not sent to rank 0; it is written here only"),
    }
}

/// This host's name (empty where it cannot be read: then every part is sent).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what the call is given.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}
