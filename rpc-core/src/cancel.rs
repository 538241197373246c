//! Cancelling a call without losing track of what its messages lent.
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
//! - dropping the caller's future sends `rpc_core::cancel` for the call instead (CAN-1), and
//!   the callee stops the function only after its arguments were decoded (CAN-2); the reply
//!   (an error saying so) then tells the caller's task that the arguments were read.
//!
//! A call that ends at its deadline still leaves a reply already on its way unread (the
//! connection discards it, MUX-1); what that reply lent is given up after the lender's own
//! timeout.
//!
//! Invariants:
//! - CAN-1: a cancel names `(caller, id)`; ids are unique per caller, and a cancel for a call
//!   that is not running (it finished, or never arrived) does nothing.
//! - CAN-2: a call is cancelled only between the decoding of its arguments and its end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::context::CallContext;
use crate::error::BoxError;
use crate::registry::RemoteFn;

type RunningMap = HashMap<(u32, u64), CancellationToken, foldhash::fast::RandomState>;

/// The cancellable calls running on this worker, and ids for the ones it makes.
#[derive(Default)]
pub(crate) struct Cancels {
    running: Mutex<RunningMap>,
    next: AtomicU64,
}

impl Cancels {
    /// A fresh id for an outgoing cancellable call.
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn running(&self) -> std::sync::MutexGuard<'_, RunningMap> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers an incoming call that is still running after its first poll (one that
    /// finished in it cannot be cancelled: no cancel can have been read before it ended); it
    /// is cancellable through `token` until the guard drops.
    pub(crate) fn register(
        agent: &Agent,
        caller: u32,
        id: u64,
        token: CancellationToken,
    ) -> Running {
        agent.inner.cancels.running().insert((caller, id), token);
        Running {
            agent: agent.clone(),
            key: (caller, id),
        }
    }

    fn cancel(&self, caller: u32, id: u64) {
        if let Some(t) = self.running().get(&(caller, id)) {
            t.cancel();
        }
    }
}

/// An incoming cancellable call, registered while it runs.
pub(crate) struct Running {
    agent: Agent,
    key: (u32, u64),
}

impl Drop for Running {
    fn drop(&mut self) {
        self.agent.inner.cancels.running().remove(&self.key);
    }
}

/// Internal: the caller dropped call `id`.
pub(crate) struct CancelCall;

impl RemoteFn for CancelCall {
    const NAME: &'static str = "rpc_core::cancel";
    type Args = (u64,);
    type Output = ();
    async fn call(ctx: CallContext, (id,): (u64,)) -> Result<(), BoxError> {
        ctx.agent().inner.cancels.cancel(ctx.caller().id.0, id);
        Ok(())
    }
}

/// The caller's side of a sent call (waiting for the reply and reading it). Dropped before it
/// is done, a call its caller may drop (`id`: its cancel id) goes on as a task of its own, so
/// the reply is still read and whatever it carries (a remote reference's fork, say) is
/// registered and then dropped properly, and it sends a cancel for call `id` to `to`; without
/// an id the work is dropped with it. While the caller keeps it, it runs inline: no task and
/// no thread hand-off on the common path.
pub(crate) struct Detach<O: Send + 'static> {
    agent: Agent,
    to: u32,
    id: Option<u64>,
    work: Option<futures::future::BoxFuture<'static, O>>,
}

impl<O: Send + 'static> Detach<O> {
    pub(crate) fn new(
        agent: Agent,
        to: u32,
        id: Option<u64>,
        work: futures::future::BoxFuture<'static, O>,
    ) -> Self {
        Self {
            agent,
            to,
            id,
            work: Some(work),
        }
    }
}

impl<O: Send + 'static> std::future::Future for Detach<O> {
    type Output = O;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<O> {
        let Some(work) = self.work.as_mut() else {
            panic!("a call's future was polled after it completed");
        };
        let out = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        std::task::Poll::Ready(out)
    }
}

impl<O: Send + 'static> Drop for Detach<O> {
    fn drop(&mut self) {
        let (Some(work), Some(id)) = (self.work.take(), self.id) else {
            return;
        };
        let (agent, to) = (self.agent.clone(), self.to);
        let rt = self.agent.runtime();
        // Reads the reply (or the error saying the call was cancelled) and drops it.
        rt.spawn(async move {
            drop(work.await);
        });
        rt.spawn(async move {
            if let Err(e) = agent.rpc_async(to, CancelCall, (id,)).await {
                tracing::debug!(worker = %agent.name(), to, id, cause = %crate::error_chain(&e), "cancel not delivered");
            }
        });
    }
}
