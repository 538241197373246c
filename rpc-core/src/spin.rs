//! Optional busy polling after traffic ([`crate::Config::busy_poll`]).
//!
//! A task that yields in a loop keeps one runtime thread awake; Tokio polls its I/O driver
//! without blocking between the yields, so a reply that arrives is picked up at once instead
//! of after the kernel wakes a sleeping thread. The loop runs only within `window` of the last
//! message and then sleeps until the next one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub(crate) struct Spin {
    window: Duration,
    epoch: Instant,
    /// Nanoseconds after `epoch` of the last message.
    last: AtomicU64,
    spinning: AtomicBool,
    wake: Notify,
}

impl Spin {
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            window,
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            spinning: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Notes traffic: polling continues (or starts) for `window` from now.
    pub(crate) fn touch(&self) {
        if self.window.is_zero() {
            return;
        }
        self.last.store(self.now(), Ordering::Relaxed);
        if !self.spinning.load(Ordering::Relaxed) {
            self.wake.notify_one();
        }
    }

    /// The polling task; ends when `stop` is cancelled.
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        let window = self.window.as_nanos() as u64;
        loop {
            tokio::select! {
                () = self.wake.notified() => {}
                () = stop.cancelled() => return,
            }
            self.spinning.store(true, Ordering::Relaxed);
            while self.now().saturating_sub(self.last.load(Ordering::Relaxed)) < window {
                if stop.is_cancelled() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            self.spinning.store(false, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polling starts with traffic, stops once the window has passed, and ends with `stop`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn polls_only_within_the_window_after_traffic() {
        let spin = Arc::new(Spin::new(Duration::from_millis(20)));
        let stop = CancellationToken::new();
        let task = tokio::spawn(Arc::clone(&spin).run(stop.clone()));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(
            !spin.spinning.load(Ordering::Relaxed),
            "idle before any traffic"
        );
        // Bounded waits, not fixed sleeps: on a loaded machine the polling task may start late.
        let eventually = |spinning: bool, what: &'static str| {
            let spin = Arc::clone(&spin);
            async move {
                let by = Instant::now() + Duration::from_secs(5);
                while spin.spinning.load(Ordering::Relaxed) != spinning {
                    assert!(Instant::now() < by, "{what}");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        spin.touch();
        eventually(true, "polling after traffic").await;
        eventually(false, "idle again after the window").await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the task ends with stop")
            .unwrap();
    }
}
