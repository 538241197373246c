//! Cancelling a call without losing track of what its messages lent: both sides of it, in
//! one place.
//!
//! An RPC framework usually cancels a dropped call by abandoning its request (possibly before
//! the callee has read its arguments) and its reply (possibly after the callee encoded it), as
//! tarpc does. A value that lends something for a message's journey (a remote reference holds
//! its fork until the receiver has registered its own, see `MessageContext::on_undelivered`)
//! would then wait for an answer that never comes, in either direction. So a call that its
//! caller may drop (`rpc_async`, not the blocking `rpc_sync`) is never abandoned:
//!
//! - the caller's side of it (waiting for the reply, reading it) runs inline while the caller
//!   waits, and goes on as a task of its own if the caller's future is dropped first
//!   ([`Detach`]), so a reply is always read and the values in it registered and dropped;
//! - dropping the caller's future sends `rpc_core::cancel` for the call instead (the caller's
//!   path, `call/`, says how in [`Detach`]'s abandon hook), and the callee stops the function
//!   only after its arguments were decoded; the reply (an error saying so) then tells the
//!   caller's task that the arguments were read.
//!
//! A call that ends at its deadline still leaves a reply already on its way unread (the
//! connection discards it, MUX-1); what that reply lent is given up after the lender's own
//! timeout.
//!
//! The callee's side:
//! - CAN-1: a cancel names `(caller, id)`; ids are unique per caller, and a cancel for a call
//!   that is not running (it finished, or never arrived) does nothing. A request is registered
//!   for cancellation when its first poll leaves it pending ([`Cancellable`]), before the next
//!   frame of its connection is read, so a cancel sent after the request finds it.
//! - CAN-2: a call is cancelled only between the decoding of its arguments and its end
//!   ([`until_cancelled`], which the registry's handlers run their function under).
//!
//! Nothing here knows the worker: the caller's path and the callee's (`dispatch.rs`) hand in
//! what they need.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

/// The caller's side of a sent call (waiting for the reply and reading it). Dropped before it
/// is done, it goes on as a task of its own on `rt`, so the reply is still read and whatever
/// it carries (a remote reference's fork, say) is registered and then dropped properly, and
/// its abandon hook runs (the caller's path sends the cancel there). Without a hook the work
/// is dropped with it. While the caller keeps it, it runs inline: no task and no thread
/// hand-off on the common path.
pub(crate) struct Detach<O: Send + 'static> {
    rt: tokio::runtime::Handle,
    work: Option<BoxFuture<'static, O>>,
    on_abandon: Option<Box<dyn FnOnce() + Send>>,
}

impl<O: Send + 'static> Detach<O> {
    pub(crate) fn new(
        rt: tokio::runtime::Handle,
        work: BoxFuture<'static, O>,
        on_abandon: Option<Box<dyn FnOnce() + Send>>,
    ) -> Self {
        Self {
            rt,
            work: Some(work),
            on_abandon,
        }
    }
}

impl<O: Send + 'static> Future for Detach<O> {
    type Output = O;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        let Some(work) = self.work.as_mut() else {
            panic!("a call's future was polled after it completed");
        };
        let out = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        Poll::Ready(out)
    }
}

impl<O: Send + 'static> Drop for Detach<O> {
    fn drop(&mut self) {
        let (Some(work), Some(abandon)) = (self.work.take(), self.on_abandon.take()) else {
            return;
        };
        // Reads the reply (or the error saying the call was cancelled) and drops it.
        self.rt.spawn(async move {
            drop(work.await);
        });
        abandon();
    }
}

/// The cancellable calls a worker is running, by `(caller, cancel id)` (CAN-1).
#[derive(Default)]
pub(crate) struct RunningCalls {
    calls: Mutex<HashMap<(u32, u64), CancellationToken, foldhash::fast::RandomState>>,
}

impl RunningCalls {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        HashMap<(u32, u64), CancellationToken, foldhash::fast::RandomState>,
    > {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cancels call `id` of `caller` if it is running; whether it was (CAN-1).
    pub(crate) fn cancel(&self, caller: u32, id: u64) -> bool {
        match self.lock().get(&(caller, id)) {
            Some(t) => {
                t.cancel();
                true
            }
            None => false,
        }
    }

    /// How many are running.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// An incoming cancellable call, registered while it runs.
struct Running {
    calls: Arc<RunningCalls>,
    key: (u32, u64),
}

impl Drop for Running {
    fn drop(&mut self) {
        self.calls.lock().remove(&self.key);
    }
}

pin_project_lite::pin_project! {
    /// A request from the wire that becomes cancellable (CAN-1) if its first poll leaves it
    /// pending: one that ends in its first poll cannot have been cancelled (the cancel would
    /// come in a later frame), so it costs no registration.
    pub(crate) struct Cancellable<F> {
        #[pin]
        run: F,
        register: Option<(Arc<RunningCalls>, (u32, u64), CancellationToken)>,
        running: Option<Running>,
    }
}

impl<F> Cancellable<F> {
    /// `run`, cancellable by `token` as call `key` (`(caller, id)`) among `calls`, or not
    /// cancellable at all (`None`: its caller sent no cancel id).
    pub(crate) fn new(
        run: F,
        register: Option<(Arc<RunningCalls>, (u32, u64), CancellationToken)>,
    ) -> Self {
        Self {
            run,
            register,
            running: None,
        }
    }
}

impl<F: Future> Future for Cancellable<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let r = this.run.poll(cx);
        if r.is_pending() {
            if let Some((calls, key, token)) = this.register.take() {
                // Registered before the next frame of the connection is read.
                calls.lock().insert(key, token);
                *this.running = Some(Running { calls, key });
            }
        }
        r
    }
}

/// CAN-2: runs `fut` (a function whose arguments are decoded) unless `cancel` is cancelled
/// first, or until it is: then `fut` is dropped and the result is `cancelled()`. A call
/// cancelled before it could start does not start.
pub(crate) async fn until_cancelled<T, E>(
    cancel: Option<CancellationToken>,
    fut: impl Future<Output = Result<T, E>>,
    cancelled: impl FnOnce() -> E,
) -> Result<T, E> {
    match cancel {
        None => fut.await,
        Some(token) => tokio::select! {
            biased;
            () = token.cancelled() => Err(cancelled()),
            out = fut => out,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// A call dropped before its reply came goes on as a task (the reply is still read) and
    /// runs its abandon hook once; a call that completed runs no hook.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_call_still_reads_its_reply_and_sends_its_cancel() {
        let rt = tokio::runtime::Handle::current();
        let (read_tx, read_rx) = tokio::sync::oneshot::channel();
        let (reply_tx, reply_rx) = tokio::sync::oneshot::channel::<u32>();
        let abandoned = Arc::new(AtomicBool::new(false));
        let a = Arc::clone(&abandoned);
        let call = Detach::new(
            rt.clone(),
            Box::pin(async move {
                let v = reply_rx.await.unwrap_or(0);
                let _ = read_tx.send(v);
                v
            }),
            Some(Box::new(move || a.store(true, Ordering::SeqCst))),
        );
        drop(call);
        assert!(abandoned.load(Ordering::SeqCst), "the cancel is sent");
        reply_tx.send(7).unwrap();
        let read = tokio::time::timeout(Duration::from_secs(5), read_rx).await;
        assert_eq!(
            read.unwrap().unwrap(),
            7,
            "the reply was read after the drop"
        );

        let abandoned = Arc::new(AtomicBool::new(false));
        let a = Arc::clone(&abandoned);
        let done = Detach::new(
            rt,
            Box::pin(async { 1 }),
            Some(Box::new(move || a.store(true, Ordering::SeqCst))),
        );
        assert_eq!(done.await, 1);
        assert!(!abandoned.load(Ordering::SeqCst), "nothing to cancel");
    }

    /// CAN-1: a call that ends in its first poll is never registered; one that waits is,
    /// until it ends; a cancel for a call not running does nothing.
    #[tokio::test]
    async fn only_waiting_calls_are_registered_and_found_by_their_cancel() {
        let calls = Arc::new(RunningCalls::default());
        let reg = |id| Some((Arc::clone(&calls), (3, id), CancellationToken::new()));
        assert_eq!(Cancellable::new(async { 5 }, reg(1)).await, 5);
        assert_eq!(calls.len(), 0);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut waiting = Box::pin(Cancellable::new(rx, reg(2)));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(calls.len(), 1);
        assert!(calls.cancel(3, 2), "found");
        assert!(
            !calls.cancel(3, 9) && !calls.cancel(4, 2),
            "others: nothing"
        );
        tx.send(()).unwrap();
        waiting.await.unwrap();
        assert_eq!(calls.len(), 0, "unregistered at its end");
    }

    /// CAN-2: cancelled before it starts, the function never starts; cancelled while it
    /// runs, it is dropped with the cancel's error.
    #[tokio::test]
    async fn a_cancel_stops_the_function_and_one_before_it_keeps_it_from_starting() {
        let started = Arc::new(AtomicBool::new(false));
        let token = CancellationToken::new();
        token.cancel();
        let s = Arc::clone(&started);
        let r = until_cancelled(
            Some(token),
            async move {
                s.store(true, Ordering::SeqCst);
                Ok::<u8, &str>(1)
            },
            || "cancelled",
        )
        .await;
        assert_eq!(r, Err("cancelled"));
        assert!(!started.load(Ordering::SeqCst));
        let token = CancellationToken::new();
        let t = token.clone();
        let stop = async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            t.cancel();
        };
        let (r, ()) = tokio::join!(
            until_cancelled(
                Some(token),
                std::future::pending::<Result<u8, &str>>(),
                || { "cancelled" }
            ),
            stop
        );
        assert_eq!(r, Err("cancelled"));
        assert_eq!(
            until_cancelled(None, async { Ok::<_, &str>(2) }, || "x").await,
            Ok(2)
        );
    }
}
