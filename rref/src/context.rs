//! Per-agent RRef state: the owner table, this worker's pending child forks, counters, and
//! the background protocol messages.
//!
//! Protocol (every case of PyTorch's note reduces to one rule): whenever a handle is
//! serialized to another worker, the sender mints a *child fork* and holds its own handle in
//! `pending_children` until the owner confirms the child (G2). The receiver registers the
//! child with the owner (locally, if it is the owner), and the owner then releases the
//! parent's hold with `child_accepted`. Deleting a handle sends `delete_fork` (G1). Owner→user,
//! user→owner and user→user sharing are the same path, so they cannot diverge.
//!
//! - CTX-1: a handle's background confirmation task holds the handle, so its delete is sent
//!   only after its fork's registration was answered.
//! - CTX-2: a pending child whose request was never sent, or was refused before its
//!   arguments were read (unknown function, signature mismatch, callee shutting down), is
//!   released at once (`MessageContext::on_undelivered`). A call or reply dropped by its caller
//!   is still read (rpc-core's `call/cancel.rs`), so its children are registered and released as
//!   usual. One whose fate is unknown (the connection broke after sending, or a reply arrived
//!   after its call's deadline) is released after `CHILD_TTL`, with a warning.
//! - CTX-3: a worker declared failed will never register or accept anything: the children
//!   sent to it, or whose owner it is, are given up at once, and the values it alone held are
//!   released by their owner (OWN-5).

use rpc_core::ext::{AgentExt, WeakAgent};
use rpc_core::Agent;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::id::{ForkId, RRefId};
use crate::owner::{Limits, Lookup, OwnerTable, Value};

/// A pending child is given up on after this long.
pub(crate) const CHILD_TTL: Duration = Duration::from_secs(600);

/// What a pending child holds: its parent's handle, kept alive (and so not deleted) until the
/// owner has accepted the child (G2). Held for its drop alone, so of no particular type here.
pub(crate) type Hold = Arc<dyn std::any::Any + Send + Sync>;

/// A child fork this worker sent and holds its parent for, until the owner accepts it (G2).
pub(crate) struct Child {
    /// The parent's handle.
    _hold: Hold,
    since: Instant,
    /// The worker it was sent to, and the value's owner.
    to: u32,
    owner: u32,
}

/// Why [`Ctx::settled`] found no value.
pub(crate) enum Settled {
    /// The constructor failed; its error.
    Failed(String),
    /// Not settled by the deadline (never created, or already deleted).
    Timeout,
}

/// Counts that make leaks visible (PyTorch's `_get_debug_info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DebugInfo {
    /// Values this worker owns (including ones whose creation is still running).
    pub owner_values: usize,
    /// Live handles on this worker to values owned elsewhere.
    pub user_refs: usize,
    /// Child forks this worker sent whose registration the owner has not confirmed yet.
    pub pending_children: usize,
    /// Handles on this worker not yet confirmed by their owner.
    pub pending_confirmations: usize,
    /// Protocol messages (deletes, registrations, acknowledgements) still in flight.
    pub messages_in_flight: usize,
}

pub(crate) struct Ctx {
    pub agent: WeakAgent,
    pub me: u32,
    next: AtomicU64,
    pub owner: Mutex<OwnerTable>,
    pending_children: Mutex<HashMap<ForkId, Child>>,
    last_sweep: Mutex<Instant>,
    /// The owner table's bounds (OWN-6) and when its pending entries were last swept.
    limits: Mutex<Limits>,
    last_pending_sweep: Mutex<Instant>,
    pub user_refs: AtomicUsize,
    pub unconfirmed: AtomicUsize,
    inflight: AtomicUsize,
    jitter_us: AtomicU64,
}

/// The RRef state of `agent` (created on first use).
pub(crate) fn ctx(agent: &Agent) -> Arc<Ctx> {
    let mut created = false;
    let c = agent.extension(|| {
        created = true;
        Ctx {
            agent: agent.downgrade(),
            me: agent.rank(),
            // Ids of each incarnation of a rank are apart (the top 16 bits), so a restarted
            // process never reuses an id its predecessor handed out.
            next: AtomicU64::new(((agent.incarnation() & 0xffff) << 48) + 1),
            owner: Mutex::new(OwnerTable::default()),
            pending_children: Mutex::new(HashMap::new()),
            last_sweep: Mutex::new(Instant::now()),
            limits: Mutex::new(Limits::default()),
            last_pending_sweep: Mutex::new(Instant::now()),
            user_refs: AtomicUsize::new(0),
            unconfirmed: AtomicUsize::new(0),
            inflight: AtomicUsize::new(0),
            jitter_us: AtomicU64::new(0),
        }
    });
    if created {
        let failed_ctx = Arc::downgrade(&c);
        agent.on_worker_failed(move |f| {
            if let Some(c) = failed_ctx.upgrade() {
                c.peer_failed(f.rank);
            }
        });
        let hook_ctx = Arc::downgrade(&c);
        agent.on_shutdown(Box::new(move || {
            let c = hook_ctx.clone();
            Box::pin(async move {
                if let Some(c) = c.upgrade() {
                    c.quiesce().await;
                }
            })
        }));
    }
    c
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ctx {
    pub(crate) fn new_rref_id(&self) -> RRefId {
        RRefId {
            created_on: self.me,
            local: self.next.fetch_add(1, Ordering::Relaxed),
        }
    }

    pub(crate) fn new_fork_id(&self) -> ForkId {
        ForkId {
            created_on: self.me,
            local: self.next.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Applies a fork count change to an owned value, the fork held by `holder`; drops what
    /// it frees outside the lock.
    pub(crate) fn owner_add(&self, id: RRefId, fork: ForkId, delta: i64, holder: u32) {
        let removed = lock(&self.owner).add(id, fork, delta, holder);
        drop(removed);
    }

    /// A fork count change sent by peer `holder`: refused, naming the limit, when it would
    /// make one pending entry more than `max_pending` (OWN-6).
    pub(crate) fn owner_add_from_peer(
        &self,
        id: RRefId,
        fork: ForkId,
        delta: i64,
        holder: u32,
    ) -> Result<(), String> {
        let removed = {
            let mut t = lock(&self.owner);
            if !t.contains(id) {
                // A new entry: the rare path sweeps and checks the bound.
                drop(t);
                self.sweep_pending();
                let max = lock(&self.limits).max_pending;
                t = lock(&self.owner);
                if !t.contains(id) && t.pending() >= max {
                    return Err(too_many_pending(id, max));
                }
            }
            t.add(id, fork, delta, holder)
        };
        drop(removed);
        Ok(())
    }

    /// Whether a peer may wait for `id` here (OWN-6: a wait for an unknown id makes a pending
    /// entry); an error naming the limit if not.
    pub(crate) fn may_wait_for(&self, id: RRefId) -> Result<(), String> {
        if lock(&self.owner).contains(id) {
            return Ok(());
        }
        self.sweep_pending();
        let max = lock(&self.limits).max_pending;
        let t = lock(&self.owner);
        if !t.contains(id) && t.pending() >= max {
            return Err(too_many_pending(id, max));
        }
        Ok(())
    }

    /// OWN-6: gives up the entries pending longer than the limit's ttl (at most once a
    /// second), dropping them outside the lock.
    fn sweep_pending(&self) {
        let now = Instant::now();
        {
            let mut last = lock(&self.last_pending_sweep);
            if now.duration_since(*last) < Duration::from_secs(1) {
                return;
            }
            *last = now;
        }
        let ttl = lock(&self.limits).pending_ttl;
        let gone = lock(&self.owner).expire_pending(now, ttl);
        if !gone.is_empty() {
            tracing::warn!(
                count = gone.len(),
                ttl_s = ttl.as_secs_f64(),
                first = %gone[0].0,
                "gave up owner entries whose value never came"
            );
        }
        drop(gone);
    }

    pub(crate) fn set_limits(&self, limits: Limits) {
        *lock(&self.limits) = limits;
        // The next change sweeps with the new ttl.
        *lock(&self.last_pending_sweep) = Instant::now() - Duration::from_secs(2);
    }

    /// Worker `rank` was declared failed: the values only it held are released (OWN-5), and
    /// the children this worker lent to it, or whose owner it was, are given up (CTX-3).
    pub(crate) fn peer_failed(&self, rank: u32) {
        let freed = lock(&self.owner).drop_holder(rank);
        let given_up: Vec<_> = {
            let mut pending = lock(&self.pending_children);
            let gone: Vec<ForkId> = pending
                .iter()
                .filter(|(_, c)| c.to == rank || c.owner == rank)
                .map(|(k, _)| *k)
                .collect();
            gone.into_iter()
                .filter_map(|k| pending.remove(&k))
                .collect()
        };
        if !freed.is_empty() || !given_up.is_empty() {
            tracing::info!(
                rank,
                values = freed.len(),
                children = given_up.len(),
                "released what a failed worker held"
            );
        }
        drop((freed, given_up));
    }

    /// Holds `parent` until the owner (`owner`) accepts `child`, sent to `to` (G2).
    pub(crate) fn hold_child(&self, child: ForkId, parent: Hold, to: u32, owner: u32) {
        let now = Instant::now();
        let expired: Vec<_> = {
            let mut sweep = lock(&self.last_sweep);
            let mut pending = lock(&self.pending_children);
            let c = Child {
                _hold: parent,
                since: now,
                to,
                owner,
            };
            pending.insert(child, c);
            if now.duration_since(*sweep) > Duration::from_secs(10) {
                *sweep = now;
                let old: Vec<ForkId> = pending
                    .iter()
                    .filter(|(_, c)| now.duration_since(c.since) > CHILD_TTL)
                    .map(|(k, _)| *k)
                    .collect();
                old.into_iter().filter_map(|k| pending.remove(&k)).collect()
            } else {
                Vec::new()
            }
        };
        if !expired.is_empty() {
            tracing::warn!(
                count = expired.len(),
                "released child forks never confirmed by their owner"
            );
        }
    }

    pub(crate) fn release_child(&self, child: ForkId) {
        let released = lock(&self.pending_children).remove(&child);
        drop(released);
    }

    /// Waits until the value `id` owned here is settled, or `deadline`.
    pub(crate) async fn settled(&self, id: RRefId, deadline: Instant) -> Result<Value, Settled> {
        for _ in 0..4 {
            let lookup = lock(&self.owner).lookup(id);
            match lookup {
                Lookup::Ready(v) => return Ok(v),
                Lookup::Failed(e) => return Err(Settled::Failed(e.to_string())),
                Lookup::Pending(mut rx) => {
                    if tokio::time::timeout_at(deadline.into(), rx.wait_for(|s| *s))
                        .await
                        .is_err()
                    {
                        let removed = lock(&self.owner).forget_if_idle(id);
                        drop(removed);
                        return Err(Settled::Timeout);
                    }
                }
            }
        }
        Err(Settled::Timeout)
    }

    /// Sets a delay of up to `max` before each protocol message (testing reorderings).
    pub(crate) fn set_jitter(&self, max: Duration) {
        self.jitter_us
            .store(max.as_micros() as u64, Ordering::Relaxed);
    }

    /// Whether protocol messages are delayed on purpose (tests of reorderings).
    pub(crate) fn jittered(&self) -> bool {
        self.jitter_us.load(Ordering::Relaxed) > 0
    }

    /// Runs a protocol message in the background, counted in `messages_in_flight`.
    pub(crate) fn background<Fut>(self: &Arc<Self>, agent: &Agent, fut: Fut)
    where
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        let me = self.clone();
        let jitter = self.jitter_us.load(Ordering::Relaxed);
        let salt = self.next.fetch_add(1, Ordering::Relaxed);
        agent.runtime().spawn(async move {
            if jitter > 0 {
                // A cheap hash of a counter: varied delays without a random-number crate.
                let r = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33;
                // Boxed: the task stays the size of the message when there is no jitter.
                Box::pin(tokio::time::sleep(Duration::from_micros(r % (jitter + 1)))).await;
            }
            fut.await;
            me.inflight.fetch_sub(1, Ordering::AcqRel);
        });
    }

    pub(crate) fn debug_info(&self) -> DebugInfo {
        DebugInfo {
            owner_values: lock(&self.owner).len(),
            user_refs: self.user_refs.load(Ordering::Acquire),
            pending_children: lock(&self.pending_children).len(),
            pending_confirmations: self.unconfirmed.load(Ordering::Acquire),
            messages_in_flight: self.inflight.load(Ordering::Acquire),
        }
    }

    /// Waits until this worker has no protocol traffic outstanding (shutdown hook; the agent
    /// bounds it with its shutdown timeout). Gives up early when the traffic has stopped
    /// moving for a second and a peer's process is gone: what is left is then most likely
    /// waiting on that peer, and would hold shutdown for the whole timeout.
    async fn quiesce(&self) {
        let mut last = None;
        let mut since = Instant::now();
        let mut next_probe = Instant::now();
        loop {
            let d = self.debug_info();
            if d.pending_children == 0 && d.messages_in_flight == 0 && d.pending_confirmations == 0
            {
                return;
            }
            let now = Instant::now();
            let key = (
                d.pending_children,
                d.messages_in_flight,
                d.pending_confirmations,
            );
            if last != Some(key) {
                (last, since) = (Some(key), now);
            } else if now.duration_since(since) > Duration::from_secs(1) && now >= next_probe {
                next_probe = now + Duration::from_millis(500);
                if let Some(agent) = self.agent.upgrade() {
                    let mut gone = Vec::new();
                    for r in 0..agent.world_size() as u32 {
                        if agent.peer_gone(r).await {
                            gone.push(r);
                        }
                    }
                    if !gone.is_empty() {
                        tracing::warn!(
                            worker = %agent.name(),
                            ?gone,
                            pending = ?d,
                            "RRef traffic stalled with peers gone; not waiting for it"
                        );
                        return;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn too_many_pending(id: RRefId, max: usize) -> String {
    format!(
        "refused {id}: {max} values named by peers have not been created here yet (limit \
         max_pending = {max})"
    )
}

/// Sets the bounds of `agent`'s owner table (OWN-6): how long an entry whose value never
/// comes is kept, and how many such entries peers may make.
pub fn set_limits(agent: &Agent, limits: Limits) {
    ctx(agent).set_limits(limits);
}

/// The RRef counters of `agent`'s worker.
pub fn debug_info(agent: &Agent) -> DebugInfo {
    ctx(agent).debug_info()
}

/// Delays each protocol message of `agent` by up to `max` (0 turns it off), so tests and the
/// stress program can provoke every message order.
pub fn set_message_jitter(agent: &Agent, max: Duration) {
    ctx(agent).set_jitter(max);
}

/// Drops every value this worker owns (after shutdown, to release memory deterministically).
pub fn clear_owned(agent: &Agent) -> usize {
    let c = ctx(agent);
    let drained = lock(&c.owner).drain();
    let n = drained.len();
    drop(drained);
    n
}
