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
//! The callee's side (the registry of running calls, `rpc_core::cancel`, CAN-1 and CAN-2) is in
//! `dispatch.rs`.

use crate::agent::Agent;
use crate::dispatch::CancelCall;

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
