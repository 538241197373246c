//! The seam between the network layer and whoever answers requests, in the spirit of tarpc's
//! `Serve`: the network layer reads a request, hands it to [`Serve::serve`] and writes the
//! reply the returned future produces. It is generic, not `dyn`, so no request gains a box or
//! a virtual call for it; the network layer never names what implements it.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::wire::{CallReply, CallRequest};

/// Timeouts at or above this are treated as "no timeout" (a request always carries one).
pub(crate) const NO_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Answers the requests the network layer reads.
pub(crate) trait Serve: Send + Sync + 'static {
    /// Runs request `req` from worker `caller` to its reply. `deadline` is when the caller
    /// stops waiting, if it set a deadline (see [`callers_deadline`]); the network layer also
    /// drops the request unanswered once its deadline passes.
    ///
    /// The future is polled once where the request was read, before the next request of the
    /// same connection is read; one that is still pending then runs as a task of its own.
    fn serve(
        self: &Arc<Self>,
        caller: u32,
        deadline: Option<Instant>,
        req: CallRequest,
    ) -> impl Future<Output = CallReply> + Send + 'static;

    /// The answer to request `req` from `caller`, refused before it ran because `why`.
    fn refuse(self: &Arc<Self>, caller: u32, req: &CallRequest, why: String) -> CallReply;
}

/// The deadline a request's caller set, if any (one without sends [`NO_DEADLINE`] from its
/// start), as of `now`.
pub(crate) fn callers_deadline(deadline: Instant, now: Instant) -> Option<Instant> {
    (deadline.saturating_duration_since(now) < NO_DEADLINE / 2).then_some(deadline)
}
