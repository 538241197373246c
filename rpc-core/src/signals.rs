//! An orderly end on a launcher's SIGTERM, SIGINT or SIGHUP (opt-in: [`Config::signal_grace`]).
//!
//! When one process of a group fails, its launcher stops the others with SIGTERM. By default
//! that kills them at once, so a master never prints the error its program was about to
//! report (a call to the failed worker, naming it, failing a moment later: the launcher is
//! faster than the failure detector). With a grace, the first SIGTERM or SIGINT changes
//! nothing for that long but a line in the log: calls go on, those to the failed worker end
//! with its verdict, and the program ends by itself with its own error. If it has not ended
//! when the grace is over, the worker stops: root calls fail at once with
//! [`RpcError::Stopped`](crate::RpcError::Stopped) naming the signal, its outgoing connections
//! close (calls still in flight fail the same way) and, a moment later, the process exits
//! with 128 + the signal's number, as the signal would have made it.
//!
//! [`Config::signal_grace`]: crate::Config::signal_grace

use std::sync::Weak;
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::state::Inner;

/// How long the program gets, after its outgoing connections closed, to report and exit.
const LAST_WORDS: Duration = Duration::from_millis(500);

/// Watches SIGTERM, SIGINT and SIGHUP (a launcher forwards all three) for the worker `w`, on a
/// thread of its own.
pub(crate) fn watch(w: Weak<Inner>, grace: Duration) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    std::thread::Builder::new()
        .name("rpc-signals".into())
        .spawn(move || {
            let Some(sig) = signals.forever().next() else {
                return;
            };
            let name = match sig {
                SIGTERM => "SIGTERM",
                SIGINT => "SIGINT",
                _ => "SIGHUP",
            };
            let Some(inner) = w.upgrade() else {
                std::process::exit(128 + sig)
            };
            tracing::warn!(
                worker = %inner.name(),
                signal = name,
                ?grace,
                "got a signal; stopping after the grace",
            );
            drop(inner);
            std::thread::sleep(grace);
            if let Some(inner) = w.upgrade() {
                tracing::warn!(
                    worker = %inner.name(),
                    signal = name,
                    "the grace after the signal is over; stopping",
                );
                let _ = inner.life.signalled.set(name);
                inner.net.close_outgoing();
            }
            std::thread::sleep(LAST_WORDS);
            std::process::exit(128 + sig);
        })?;
    Ok(())
}
