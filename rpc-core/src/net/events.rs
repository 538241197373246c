//! What the group's membership tells its watchers: a verdict ([`WorkerFailed`]), every change
//! ([`MembershipEvent`]), and the streams of them ([`FailureWatch`], [`MembershipWatch`]) that
//! replay what happened before the watch started.

use std::time::SystemTime;

/// A peer declared failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerFailed {
    /// Its rank.
    pub rank: u32,
    /// Its name.
    pub name: String,
    /// Which incarnation of the rank failed (0: the process that formed the group; one more
    /// for each replacement).
    pub incarnation: u64,
    /// Why it was declared failed (no heartbeat for how long, or its process is gone).
    pub cause: String,
    /// When.
    pub at: SystemTime,
}

/// A change of the group as this worker saw it (see `Agent::watch_membership`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MembershipEvent {
    /// The view's generation after the change: one more than the previous change's (every
    /// worker sees the same changes of each rank in the same order).
    pub generation: u64,
    /// The rank that changed.
    pub rank: u32,
    /// Its name (a replacement keeps the name and rank of the worker it replaces).
    pub name: String,
    /// The incarnation the change is about.
    pub incarnation: u64,
    /// What happened.
    pub change: MembershipChange,
}

/// What happened to a member.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipChange {
    /// A new incarnation holds the rank (the previous one failed, left or was replaced; or,
    /// with incarnation 0, a worker took a vacant rank of a group that grows); calls go to it
    /// from now on, connections of the previous one are refused.
    Joined {
        /// Where its listener is reachable.
        addr: String,
    },
    /// It left the group gracefully; calls to it are refused.
    Left,
    /// It was declared failed; calls to it and waits on it fail.
    Failed {
        /// Why.
        cause: String,
    },
}
