//! Per-call context: who called, the deadline, and the nesting depth.
//!
//! While a handler runs, a task-local scope holds its deadline and depth. Every call made from
//! inside it (on the same task) inherits the deadline, clipped to its own timeout, and carries
//! `depth + 1`, so nested calls never outlive the call that caused them and are admitted without
//! waiting for a root-call permit (see `server.rs`).

use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::wire::WorkerInfo;

/// Timeouts at or above this are treated as "no timeout" (tarpc needs some deadline).
pub(crate) const NO_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Clone, Copy, Debug)]
pub(crate) struct Scope {
    pub deadline: Option<Instant>,
    pub depth: u32,
}

tokio::task_local! {
    pub(crate) static SCOPE: Scope;
}

/// The scope of the current task, if it is running a handler.
pub(crate) fn current_scope() -> Option<Scope> {
    SCOPE.try_with(|s| *s).ok()
}

/// What a handler knows about the call it is serving.
#[derive(Clone)]
pub struct CallContext {
    pub(crate) agent: Agent,
    pub(crate) caller: WorkerInfo,
    pub(crate) deadline: Option<Instant>,
}

impl std::fmt::Debug for CallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallContext")
            .field("worker", &self.agent.name())
            .field("caller", &self.caller)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl CallContext {
    /// The agent serving this call; use it for nested calls (they inherit the deadline).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The worker that made the call.
    pub fn caller(&self) -> &WorkerInfo {
        &self.caller
    }

    /// When the caller stops waiting, if it set a timeout.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time left before the deadline (`None` if there is none).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }
}
