//! Cancelling a call whose arguments lent something, without losing track of what they lent.
//!
//! Dropping an ordinary call's future cancels it through tarpc, which may drop the request
//! before the callee has read its arguments. For most arguments that is fine. A value that
//! lends something for the message's journey (a remote reference holds its fork until the
//! receiver has registered its own, see `MessageContext::on_undelivered`) would then wait for
//! an answer that never comes. So a call whose encoding lent something runs differently:
//!
//! - the caller's side of it (waiting for the reply, reading it) is a task of its own that
//!   outlives the caller's future, so a reply is always read, values in it included;
//! - dropping the caller's future sends `rpc_core::cancel` for the call instead (CAN-1), and
//!   the callee stops the function only after its arguments were decoded (CAN-2); the reply
//!   (an error saying so) then tells the caller's task that the arguments were read.
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

/// The cancellable calls running on this worker, and ids for the ones it makes.
#[derive(Default)]
pub(crate) struct Cancels {
    running: Mutex<HashMap<(u32, u64), CancellationToken>>,
    next: AtomicU64,
}

impl Cancels {
    /// A fresh id for an outgoing cancellable call.
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<(u32, u64), CancellationToken>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers an incoming call; it is cancellable until the guard drops.
    pub(crate) fn register(&self, caller: u32, id: u64) -> Running<'_> {
        let token = CancellationToken::new();
        self.running().insert((caller, id), token.clone());
        Running {
            cancels: self,
            key: (caller, id),
            token,
        }
    }

    fn cancel(&self, caller: u32, id: u64) {
        if let Some(t) = self.running().get(&(caller, id)) {
            t.cancel();
        }
    }
}

/// An incoming cancellable call, registered while it runs.
pub(crate) struct Running<'a> {
    cancels: &'a Cancels,
    key: (u32, u64),
    token: CancellationToken,
}

impl Running<'_> {
    pub(crate) fn token(&self) -> CancellationToken {
        self.token.clone()
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.cancels.running().remove(&self.key);
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

/// Sends a cancel for call `id` to `to` if dropped while armed.
pub(crate) struct CancelOnDrop {
    pub agent: Agent,
    pub to: u32,
    pub id: u64,
    pub armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (agent, to, id) = (self.agent.clone(), self.to, self.id);
        self.agent.runtime().spawn(async move {
            if let Err(e) = agent.rpc_async(to, CancelCall, (id,)).await {
                tracing::debug!(worker = %agent.name(), to, id, cause = %crate::error_chain(&e), "cancel not delivered");
            }
        });
    }
}
