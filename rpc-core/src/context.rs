//! Per-call context: who called, the deadline, the nesting depth, and the call metadata.
//!
//! While a handler runs, a task-local scope holds its deadline and depth. Every call made from
//! inside it (on the same task) inherits the deadline, clipped to its own timeout, and carries
//! `depth + 1`, so nested calls never outlive the call that caused them and are admitted without
//! waiting for a root-call permit (see `dispatch.rs`). A second task-local holds the
//! [`CallMeta`] the call carries. [`CallScope`] captures both, and [`spawn`] carries them into
//! a task of its own (a bare `tokio::spawn` starts outside them).

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::state::{Agent, CallContext, Inner};
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
    /// The context of a call from `caller` that worker `inner` serves.
    pub(crate) fn new(
        inner: &Arc<Inner>,
        caller: u32,
        deadline: Option<Instant>,
        cancel: Option<CancellationToken>,
    ) -> Self {
        Self {
            agent: Agent {
                inner: Arc::clone(inner),
            },
            caller,
            deadline,
            cancel,
        }
    }

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

/// The scope of the call the current task runs in: its deadline, its depth and its call
/// metadata (the distributed autograd context among them). Every call made inside a scope is
/// a nested call of the call that opened it: it inherits the deadline (clipped to its own
/// timeout), is admitted without waiting for a root-call permit, is accepted while the callee
/// shuts down, and carries the metadata.
///
/// The scope lives in task-locals, so a task started with a bare `tokio::spawn` (or a thread
/// of `spawn_blocking`) starts outside it: a call from there is a root call, with the default
/// timeout instead of the caller's deadline, a root permit to wait for (a deadlock under
/// [`Config::max_concurrent_calls`](crate::Config::max_concurrent_calls) when the caller holds
/// the last one), refused at shutdown, and outside the caller's autograd context (its tensors
/// are not recorded, so their gradients never reach the sender). Spawn with [`spawn`] (or
/// [`CallScope::spawn_on`], [`spawn_blocking`]) to carry the scope into the new task.
///
/// ```
/// # use rpc_core::{remote, BoxError, CallContext};
/// # #[remote] async fn step(_ctx: CallContext, x: u32) -> Result<u32, BoxError> { Ok(x) }
/// /// Fans `x` out to two workers in tasks of their own; the calls stay nested in this one.
/// #[remote]
/// async fn fan_out(ctx: CallContext, x: u32) -> Result<u32, BoxError> {
///     let a = ctx.agent().clone();
///     // Not `tokio::spawn`: that would make the call below a root call.
///     let left = rpc_core::spawn(async move { a.rpc_async("worker1", step, (x,)).await });
///     let right = ctx.agent().rpc_async("worker2", step, (x,)).await?;
///     Ok(left.await?? + right)
/// }
/// ```
#[derive(Clone, Debug, Default)]
pub struct CallScope {
    scope: Option<Scope>,
    meta: Option<CallMeta>,
}

impl CallScope {
    /// The current task's scope (empty outside handlers and [`with_call_meta`]).
    pub fn current() -> Self {
        Self {
            scope: current_scope(),
            meta: META.try_with(|m| m.clone()).ok(),
        }
    }

    /// Whether the current task runs inside no call and carries no metadata.
    pub fn is_empty(&self) -> bool {
        self.scope.is_none() && self.meta.as_ref().is_none_or(|m| m.is_empty())
    }

    /// When calls made in this scope stop waiting, if the scope has a deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.scope.and_then(|s| s.deadline)
    }

    /// `fut`, run inside this scope wherever it is polled.
    pub async fn wrap<F: Future>(self, fut: F) -> F::Output {
        let meta = self.meta.unwrap_or_default();
        match self.scope {
            Some(s) => SCOPE.scope(s, META.scope(meta, fut)).await,
            None => META.scope(meta, fut).await,
        }
    }

    /// Runs `f` inside this scope on the current thread (a thread of `spawn_blocking`, say,
    /// that makes blocking calls).
    pub fn in_scope<R>(self, f: impl FnOnce() -> R) -> R {
        let meta = self.meta.unwrap_or_default();
        match self.scope {
            Some(s) => SCOPE.sync_scope(s, || META.sync_scope(meta, f)),
            None => META.sync_scope(meta, f),
        }
    }

    /// Spawns `fut` on `rt` inside this scope.
    pub fn spawn_on<F>(self, rt: &tokio::runtime::Handle, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        rt.spawn(self.wrap(fut))
    }
}

/// `tokio::spawn` that carries the current call's scope ([`CallScope`]) into the new task:
/// calls made from it are nested in the current call. Panics outside a Tokio runtime, as
/// `tokio::spawn` does.
pub fn spawn<F>(fut: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(CallScope::current().wrap(fut))
}

/// `tokio::task::spawn_blocking` that carries the current call's scope ([`CallScope`]) onto
/// the blocking thread: blocking calls made there are nested in the current call.
pub fn spawn_blocking<R, F>(f: F) -> JoinHandle<R>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let scope = CallScope::current();
    tokio::task::spawn_blocking(move || scope.in_scope(f))
}
