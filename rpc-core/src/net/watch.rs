//! Streams of the membership's news for whoever watches: [`FailureWatch`] (verdicts) and
//! [`MembershipWatch`] (every change), each replaying what happened before it started.

use std::sync::Arc;

use tokio::sync::broadcast;

use super::events::{MembershipEvent, WorkerFailed};
use super::membership::Membership;

/// A stream of a membership's records: those made before it began first (read after
/// subscribing, so none falls between), then the live ones; re-read whole if it lags.
struct Replay<T> {
    membership: Arc<Membership>,
    known: std::collections::VecDeque<T>,
    rx: broadcast::Receiver<T>,
    reread: fn(&Membership) -> Vec<T>,
}

impl<T: Clone> Replay<T> {
    fn new(
        membership: Arc<Membership>,
        tx: fn(&Membership) -> &broadcast::Sender<T>,
        reread: fn(&Membership) -> Vec<T>,
    ) -> Self {
        let rx = tx(&membership).subscribe();
        let known = reread(&membership).into();
        Self {
            membership,
            known,
            rx,
            reread,
        }
    }

    /// The next record `fresh` accepts (it sees each one once, in order); `None` once the
    /// worker is gone. Cancel safe: a record is returned by the call that completes.
    async fn next(&mut self, mut fresh: impl FnMut(&T) -> bool) -> Option<T> {
        loop {
            if let Some(v) = self.known.pop_front() {
                if fresh(&v) {
                    return Some(v);
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(v) => self.known.push_back(v),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.known = (self.reread)(&self.membership).into();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// The verdicts of a worker's failure detector as they come, those made before the watch
/// began first (see `Agent::watch_failures`).
pub struct FailureWatch {
    replay: Replay<WorkerFailed>,
    seen: std::collections::BTreeSet<(u32, u64)>,
}

impl std::fmt::Debug for FailureWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureWatch")
            .field("seen", &self.seen)
            .finish()
    }
}

impl FailureWatch {
    pub(crate) fn new(membership: Arc<Membership>) -> Self {
        Self {
            replay: Replay::new(membership, |m| &m.failures_tx, Membership::failures),
            seen: Default::default(),
        }
    }

    /// The next verdict this watch has not returned yet; `None` once the worker is gone.
    /// Each failed incarnation of a worker is returned once.
    ///
    /// # Cancel safety
    /// Cancel safe: a verdict is returned by the call that completes, never lost.
    pub async fn next(&mut self) -> Option<WorkerFailed> {
        let seen = &mut self.seen;
        self.replay
            .next(|v| seen.insert((v.rank, v.incarnation)))
            .await
    }
}

/// The changes of the group as they come, the view's history first (see
/// `Agent::watch_membership`).
pub struct MembershipWatch {
    replay: Replay<MembershipEvent>,
    next_generation: u64,
}

impl std::fmt::Debug for MembershipWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipWatch")
            .field("next_generation", &self.next_generation)
            .finish()
    }
}

impl MembershipWatch {
    pub(crate) fn new(membership: Arc<Membership>) -> Self {
        Self {
            replay: Replay::new(membership, |m| &m.events_tx, Membership::history),
            next_generation: 0,
        }
    }

    /// The next change this watch has not returned yet, in generation order; `None` once the
    /// worker is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: an event is returned by the call that completes, never lost.
    pub async fn next(&mut self) -> Option<MembershipEvent> {
        let next = &mut self.next_generation;
        self.replay
            .next(|v| {
                let fresh = v.generation >= *next;
                if fresh {
                    *next = v.generation + 1;
                }
                fresh
            })
            .await
    }
}
