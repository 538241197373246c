//! Per-call context: who called, the deadline, the nesting depth, and the call metadata.
//!
//! While a handler runs, a task-local scope holds its deadline and depth. Every call made from
//! inside it (on the same task) inherits the deadline, clipped to its own timeout, and carries
//! `depth + 1`, so nested calls never outlive the call that caused them and are admitted without
//! waiting for a root-call permit (see `dispatch.rs`). A second task-local holds the
//! [`CallMeta`] the call carries.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::wire::{CallMeta, WorkerInfo};

#[derive(Clone, Copy, Debug)]
pub(crate) struct Scope {
    pub deadline: Option<Instant>,
    pub depth: u32,
}

tokio::task_local! {
    pub(crate) static SCOPE: Scope;
    pub(crate) static META: CallMeta;
}

/// The metadata of the current task (empty outside [`with_call_meta`] and handlers).
pub(crate) fn current_meta() -> CallMeta {
    META.try_with(|m| m.clone()).unwrap_or_default()
}

/// The value of `key` in the current task's call metadata.
pub fn call_meta(key: &str) -> Option<Vec<u8>> {
    META.try_with(|m| m.get(key).map(<[u8]>::to_vec))
        .ok()
        .flatten()
}

/// Runs `fut` with `key` set to `value` (`None` removes it) in its call metadata, on top of
/// whatever the current task carries.
pub async fn with_call_meta<F: Future>(key: &str, value: Option<Vec<u8>>, fut: F) -> F::Output {
    let base = current_meta();
    let meta = match value {
        Some(v) => base.with(key, v),
        None => base.without(key),
    };
    META.scope(meta, fut).await
}

/// The scope of the current task, if it is running a handler.
pub(crate) fn current_scope() -> Option<Scope> {
    SCOPE.try_with(|s| *s).ok()
}

/// What a handler knows about the call it is serving.
#[derive(Clone)]
pub struct CallContext {
    pub(crate) agent: Agent,
    /// The caller's rank (its [`WorkerInfo`] is the agent's: nothing is copied per call).
    pub(crate) caller: u32,
    pub(crate) deadline: Option<Instant>,
    /// Cancelled when the caller cancels this call by message (`call/cancel.rs`).
    pub(crate) cancel: Option<tokio_util::sync::CancellationToken>,
}

impl std::fmt::Debug for CallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallContext")
            .field("worker", &self.agent.name())
            .field("caller", self.caller())
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
        self.agent.inner.group.worker(self.caller)
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
