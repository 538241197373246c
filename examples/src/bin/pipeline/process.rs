//! What the master asks of a stage's process, beside its stage: its memory, and to die (fault
//! injection).

use rpc_core::{remote, BoxError, CallContext};

/// This process's peak resident memory in MiB.
#[remote]
pub async fn peak_rss_mb(_ctx: CallContext) -> Result<f64, BoxError> {
    Ok(examples::peak_rss_mb())
}

/// Starts this process's peak resident memory over from its current size (Linux).
#[remote]
pub async fn reset_peak_rss(_ctx: CallContext) -> Result<(), BoxError> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// Fault injection (`--kill-stage`): this process kills itself with SIGKILL.
#[remote]
pub async fn die(_ctx: CallContext) -> Result<(), BoxError> {
    // SAFETY: kill(2) on this very process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    Ok(())
}
