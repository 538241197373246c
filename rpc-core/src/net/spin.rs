//! Busy polling before sleeping ([`crate::Config::busy_poll`]).
//!
//! - [`Spin`]: a task that yields in a loop keeps one runtime thread awake; Tokio polls its
//!   I/O driver without blocking between the yields, so a reply that arrives is picked up at
//!   once instead of after the kernel wakes a sleeping thread. The loop runs only within
//!   `window` of the last message and then sleeps until the next one.
//! - [`block_on`]: a plain thread waiting for a future checks for its wake-up for `window`
//!   before it parks.
//!
//! Both give way to any other thread runnable on their core at every turn (`sched_yield`),
//! so polling takes only time the core would spend idle.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub(crate) struct Spin {
    window: Duration,
    /// Traffic since the polling loop last looked (a flag, not a time: noting traffic is on
    /// every message's path and reads no clock).
    seen: AtomicBool,
    spinning: AtomicBool,
    wake: Notify,
}

impl Spin {
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            window,
            seen: AtomicBool::new(false),
            spinning: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }

    /// Notes traffic: polling continues (or starts) for `window` from now.
    pub(crate) fn touch(&self) {
        if self.window.is_zero() {
            return;
        }
        // SeqCst with the loop's end (`spinning` stored, then `seen` read): one of the two
        // sees the other, so traffic is never left without polling.
        self.seen.store(true, Ordering::SeqCst);
        if !self.spinning.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// The polling task; ends when `stop` is cancelled.
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = self.wake.notified() => {}
                () = stop.cancelled() => return,
            }
            self.spinning.store(true, Ordering::SeqCst);
            self.seen.store(false, Ordering::Relaxed);
            let mut until = Instant::now() + self.window;
            loop {
                if stop.is_cancelled() {
                    return;
                }
                // Another thread runnable on this core (a blocking call's, a compute pool's)
                // goes first: polling only fills time that would otherwise be idle.
                std::thread::yield_now();
                tokio::task::yield_now().await;
                let now = Instant::now();
                if self.seen.swap(false, Ordering::Relaxed) {
                    until = now + self.window;
                } else if now >= until {
                    self.spinning.store(false, Ordering::SeqCst);
                    if !self.seen.load(Ordering::SeqCst) {
                        break;
                    }
                    // Traffic came in as the window closed: go on polling.
                    self.spinning.store(true, Ordering::SeqCst);
                }
            }
        }
    }
}

/// Wakes a thread waiting in [`block_on`].
struct ThreadWaker {
    woken: AtomicBool,
    thread: std::thread::Thread,
}

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// Runs `fut` to completion on this thread (one that is not a runtime thread) in `rt`'s
/// context, as `Handle::block_on` does, except that after a pending poll the thread checks
/// for its wake-up for `window` (giving way to other runnable threads on its core) before it
/// parks: a future completed by another thread moments later, the usual case for a blocking
/// call, then needs no wake-up of a sleeping thread. `window` zero: `Handle::block_on`.
pub(crate) fn block_on<F: std::future::Future>(
    rt: &tokio::runtime::Handle,
    window: Duration,
    fut: F,
) -> F::Output {
    if window.is_zero() {
        return rt.block_on(fut);
    }
    let _entered = rt.enter();
    let waker = Arc::new(ThreadWaker {
        woken: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let as_waker = std::task::Waker::from(Arc::clone(&waker));
    let mut cx = std::task::Context::from_waker(&as_waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        let until = Instant::now() + window;
        while !waker.woken.swap(false, Ordering::Acquire) {
            if Instant::now() < until {
                std::thread::yield_now();
            } else {
                // `unpark` before `park` makes `park` return at once; a spurious return
                // finds `woken` unset and parks again.
                std::thread::park();
            }
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

    /// `block_on` returns what a future gives when another thread completes it within the
    /// polling window, long after it (the waiting thread parked), or at once; runtime
    /// resources (a timer) work in it. Each wait runs on a thread of its own and is bounded,
    /// so a lost wake-up fails the test instead of hanging it.
    #[test]
    fn block_on_sees_wake_ups_early_and_late() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let cases = [
            (Duration::from_millis(200), Some(Duration::from_micros(20))),
            (Duration::from_micros(50), Some(Duration::from_millis(30))),
            (Duration::from_micros(50), None),
            (Duration::ZERO, Some(Duration::from_millis(5))),
        ];
        for (window, delay) in cases {
            let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
            let sender = std::thread::spawn(move || match delay {
                Some(d) => {
                    std::thread::sleep(d);
                    let _ = tx.send(7);
                }
                None => {
                    let _ = tx.send(7);
                }
            });
            if delay.is_none() {
                sender.join().unwrap();
            }
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            let handle = rt.handle().clone();
            std::thread::spawn(move || {
                let _ = done_tx.send(block_on(&handle, window, rx));
            });
            let got = done_rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("block_on never returned ({window:?}, {delay:?})"));
            assert_eq!(got.unwrap(), 7);
        }
        let handle = rt.handle().clone();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let start = Instant::now();
            block_on(&handle, Duration::from_micros(100), async {
                tokio::time::sleep(Duration::from_millis(20)).await
            });
            let _ = done_tx.send(start.elapsed());
        });
        let took = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a timer in block_on fires");
        assert!(took >= Duration::from_millis(20), "{took:?}");
    }
}
