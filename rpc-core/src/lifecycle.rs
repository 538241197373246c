//! A worker's lifecycle: running, stopping, closed, and the tokens and trackers that shutdown
//! drives. A narrow handle: the network layer takes it to know when to stop accepting and
//! serving, and to count what is in flight; the agent moves it from one state to the next.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const RUNNING: u8 = 0;
const STOPPING: u8 = 1;
const CLOSED: u8 = 2;

/// Where a worker stands between init and the end of its shutdown.
pub(crate) struct Lifecycle {
    state: AtomicU8,
    /// Cancelled when the listener closes (shutdown phase 3).
    pub stop_accepting: CancellationToken,
    /// Cancelled when everything left is aborted (shutdown phase 4).
    pub stop: CancellationToken,
    /// Incoming calls in flight (drained in phase 2).
    pub calls: TaskTracker,
    /// Connection tasks (waited for in phase 3).
    pub conns: TaskTracker,
    /// The signal this worker is stopping on, once its grace is over (see `signals.rs`).
    pub signalled: OnceLock<&'static str>,
}

impl Lifecycle {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU8::new(RUNNING),
            stop_accepting: CancellationToken::new(),
            stop: CancellationToken::new(),
            calls: TaskTracker::new(),
            conns: TaskTracker::new(),
            signalled: OnceLock::new(),
        }
    }

    /// Whether shutdown has begun: new root calls are refused.
    pub(crate) fn is_stopping(&self) -> bool {
        self.state.load(Ordering::Acquire) != RUNNING
    }

    /// Whether shutdown has finished (or been cut short): nothing is sent or served any more.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }

    /// Shutdown phase 2 begins: root calls are refused from now on.
    pub(crate) fn set_stopping(&self) {
        self.state.store(STOPPING, Ordering::Release);
    }

    /// Shutdown phase 3 begins: nothing is sent or served from now on.
    pub(crate) fn set_closed(&self) {
        self.state.store(CLOSED, Ordering::Release);
    }
}
