//! Leaving the group: a group-wide barrier on rank 0, then the phases that stop a worker.
//!
//! 0. Layers above finish their protocol traffic (their shutdown hooks) while every peer
//!    still serves.
//! 1. Every worker waits at rank 0's barrier, so no worker closes while another still needs
//!    it.
//! 2. New root calls are refused; calls in flight drain.
//! 3. The failure detector tells the peers this worker is leaving; outgoing connections and
//!    the listener close; the peers close theirs.
//! 4. Whatever is left is aborted.
//!
//! Invariants:
//! - AG-3: after shutdown starts, no new root call is sent or served; nested calls of work
//!   already in flight still are, so draining cannot deadlock.
//! - AG-4: shutdown is idempotent and bounded: every phase has a timeout, and a second call
//!   returns the first call's report.
//! - AG-6: the barrier does not wait for ranks declared failed, and a rank whose rank 0 was
//!   declared failed learns it at once.
//! - AG-5: rank 0 does not wait out the barrier's timeout for ranks whose process is gone:
//!   while it waits, it redials the missing ranks, and once every missing rank refuses
//!   connections (nothing listens: the process exited or was killed) the barrier fails at
//!   once, naming them. Frozen or partitioned peers still cost the timeout.
//! - AG-7: where a launcher replaces failed processes one by one
//!   ([`Config::replaced_on_failure`](crate::Config::replaced_on_failure)), a rank whose
//!   rank 0 failed waits, within the barrier's timeout, for rank 0's next incarnation and
//!   arrives at its barrier instead.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

use crate::agent::Agent;
use crate::context::CallContext;
use crate::error::{BoxError, RpcError};
use crate::registry::RemoteFn;

/// What [`Agent::shutdown`] did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// `Ok` if every worker reached the shutdown barrier; otherwise why not (missing ranks,
    /// unreachable rank 0).
    pub barrier: Result<(), String>,
    /// Incoming calls still running when draining began.
    pub in_flight: usize,
    /// Incoming calls aborted because draining timed out.
    pub aborted: usize,
    /// Total time taken.
    pub elapsed: Duration,
}

impl ShutdownReport {
    /// The barrier completed and nothing was aborted.
    pub fn is_clean(&self) -> bool {
        self.barrier.is_ok() && self.aborted == 0
    }
}

/// A worker's shutdown state: rank 0's barrier and the report of the first shutdown.
pub(crate) struct State {
    /// Bound on each phase unless a caller gives its own.
    pub timeout: Duration,
    /// A failed rank 0 is replaced by a launcher: wait for its replacement's barrier (AG-7).
    follow_rank0: bool,
    barrier: Mutex<Barrier>,
    report: tokio::sync::OnceCell<ShutdownReport>,
}

#[derive(Default)]
struct Barrier {
    /// Ranks that reached the barrier.
    arrived: BTreeSet<u32>,
    /// Ranks declared failed before they did (they will not come; shutdown skips them).
    excused: BTreeSet<u32>,
    /// Ranks that left the running group (they will not come, and that is no failure).
    departed: BTreeSet<u32>,
    waiters: Vec<oneshot::Sender<Result<(), Vec<u32>>>>,
    /// Set when rank 0 gave up waiting: the ranks that never arrived.
    failed: Option<Vec<u32>>,
}

impl Barrier {
    /// Every rank arrived or was excused: the waiters learn which were excused, if any.
    fn release_if_complete(&mut self, world: usize) {
        let done = (0..world as u32)
            .filter(|r| {
                self.arrived.contains(r) || self.excused.contains(r) || self.departed.contains(r)
            })
            .count();
        if done < world {
            return;
        }
        let excused: Vec<u32> = self.excused.iter().copied().collect();
        for tx in self.waiters.drain(..) {
            let _ = tx.send(if excused.is_empty() {
                Ok(())
            } else {
                Err(excused.clone())
            });
        }
    }
}

impl State {
    pub(crate) fn new(timeout: Duration, follow_rank0: bool) -> Self {
        Self {
            timeout,
            follow_rank0,
            barrier: Mutex::new(Barrier::default()),
            report: tokio::sync::OnceCell::new(),
        }
    }

    fn barrier(&self) -> std::sync::MutexGuard<'_, Barrier> {
        self.barrier.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ranks of a group of `world` that have neither reached the barrier nor been
    /// declared failed.
    fn missing(&self, world: u32) -> Vec<u32> {
        let b = self.barrier();
        (0..world)
            .filter(|r| !b.arrived.contains(r) && !b.excused.contains(r) && !b.departed.contains(r))
            .collect()
    }

    /// Rank 0's side of the barrier: waits until all `world` ranks have arrived or been
    /// declared failed (then fails naming those, AG-6), or until rank 0 gives up (then fails
    /// with the missing ranks).
    async fn arrive(&self, rank: u32, world: usize) -> Result<(), Vec<u32>> {
        let rx = {
            let mut b = self.barrier();
            if let Some(missing) = &b.failed {
                return Err(missing.clone());
            }
            b.arrived.insert(rank);
            let (tx, rx) = oneshot::channel();
            b.waiters.push(tx);
            b.release_if_complete(world);
            rx
        };
        rx.await.unwrap_or(Ok(()))
    }

    /// `rank` was declared failed: the barrier does not wait for it (AG-6).
    pub(crate) fn excuse(&self, rank: u32, world: usize) {
        let mut b = self.barrier();
        if !b.arrived.contains(&rank) {
            b.excused.insert(rank);
            b.release_if_complete(world);
        }
    }

    /// `rank` left the running group: the barrier does not wait for it, and that is no
    /// failure.
    pub(crate) fn depart(&self, rank: u32, world: usize) {
        let mut b = self.barrier();
        if !b.arrived.contains(&rank) {
            b.excused.remove(&rank);
            b.departed.insert(rank);
            b.release_if_complete(world);
        }
    }

    /// A new incarnation holds `rank`: the barrier waits for it again (unless it already
    /// released).
    pub(crate) fn readmit(&self, rank: u32) {
        let mut b = self.barrier();
        b.excused.remove(&rank);
        b.departed.remove(&rank);
        // A previous incarnation that arrived and then failed does not stand in for it.
        b.arrived.remove(&rank);
    }

    /// Rank 0 gives up on the barrier: every waiter learns which ranks never arrived.
    fn fail(&self, world: u32) -> Vec<u32> {
        let mut b = self.barrier();
        let missing: Vec<u32> = (0..world)
            .filter(|r| !b.arrived.contains(r) && !b.departed.contains(r))
            .collect();
        b.failed = Some(missing.clone());
        for tx in b.waiters.drain(..) {
            let _ = tx.send(Err(missing.clone()));
        }
        missing
    }
}

/// Internal: rank 0's shutdown barrier, served like any registered function.
pub(crate) struct ShutdownBarrier;

impl RemoteFn for ShutdownBarrier {
    const NAME: &'static str = "rpc_core::shutdown_barrier";
    type Args = (u32,);
    type Output = ();
    async fn call(ctx: CallContext, (rank,): (u32,)) -> Result<(), BoxError> {
        let agent = ctx.agent();
        agent
            .inner
            .shutdown
            .arrive(rank, agent.world_size())
            .await
            .map_err(|missing| {
                format!(
                    "ranks {missing:?} never reached the shutdown barrier (missing or declared \
                     failed)"
                )
                .into()
            })
    }
}

/// Shuts `agent` down with `t` per phase, once (AG-4).
pub(crate) async fn shutdown(agent: &Agent, t: Duration) -> ShutdownReport {
    agent
        .inner
        .shutdown
        .report
        .get_or_init(|| run(agent.clone(), t, true))
        .await
        .clone()
}

/// Stops `agent`, which left the running group (its hooks ran and the group was told): the
/// phases after the barrier, with `t` per phase, once (AG-4).
pub(crate) async fn leave(agent: &Agent, t: Duration) -> ShutdownReport {
    agent
        .inner
        .shutdown
        .report
        .get_or_init(|| run(agent.clone(), t, false))
        .await
        .clone()
}

async fn run(agent: Agent, t: Duration, with_group: bool) -> ShutdownReport {
    let inner = &agent.inner;
    let start = Instant::now();
    let barrier = if with_group {
        // Phase 0: layers above finish their protocol traffic while every peer still serves.
        let hooks = inner.layers.shutdown_hooks();
        if tokio::time::timeout(t, futures::future::join_all(hooks))
            .await
            .is_err()
        {
            tracing::warn!(worker = %agent.name(), "shutdown hooks did not finish in time");
        }
        // Phase 1: the barrier.
        let barrier = barrier(&agent, t).await;
        if let Err(why) = &barrier {
            tracing::warn!(worker = %agent.name(), %why, "shutdown barrier incomplete");
        }
        barrier
    } else {
        Ok(())
    };
    // Phase 2: refuse new root calls; let the calls in flight finish.
    let life = &inner.life;
    life.set_stopping();
    life.calls.close();
    let in_flight = life.calls.len();
    let drained = tokio::time::timeout(t, life.calls.wait()).await.is_ok();
    let aborted = if drained { 0 } else { life.calls.len() };
    // Phase 3: tell the peers' failure detectors this worker is leaving (it is not failing),
    // close our outgoing connections and the listener, then let the peers close theirs (they
    // do so once their own barrier call has returned), so every reply that is still being
    // written reaches its caller.
    life.set_closed();
    inner.net.leave().await;
    inner.callee.close_admission();
    inner.net.close_outgoing();
    life.stop_accepting.cancel();
    life.conns.close();
    let _ = tokio::time::timeout(t, life.conns.wait()).await;
    // Phase 4: abort whatever is left.
    life.stop.cancel();
    inner.net.close_incoming();
    let _ = tokio::time::timeout(Duration::from_secs(5), life.conns.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), life.calls.wait()).await;
    // The rendezvous this worker hosts goes last: peers still leaving keep their link.
    let hosted = inner
        .rendezvous
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    drop(hosted);
    let report = ShutdownReport {
        barrier,
        in_flight,
        aborted,
        elapsed: start.elapsed(),
    };
    tracing::info!(worker = %agent.name(), ?report, "shut down");
    report
}

/// Phase 1: every rank calls rank 0's barrier; rank 0 stops waiting for ranks whose process
/// is gone (AG-5).
async fn barrier(agent: &Agent, t: Duration) -> Result<(), String> {
    let world = agent.world_size() as u32;
    if world <= 1 {
        return Ok(());
    }
    if agent.rank() != 0 {
        return arrive_at_rank0(agent, t).await;
    }
    let barrier = agent.rpc_async_timeout(0u32, ShutdownBarrier, (agent.rank(),), t);
    let state = &agent.inner.shutdown;
    tokio::select! {
        r = barrier => r.map_err(|e| {
            let missing = state.fail(world);
            let membership = &agent.inner.net.membership;
            let failed: Vec<String> = missing
                .iter()
                .filter_map(|r| membership.failure(*r))
                .map(|f| format!("rank {} declared failed: {}", f.rank, f.cause))
                .collect();
            if failed.is_empty() {
                format!(
                    "ranks {missing:?} never reached the shutdown barrier: {}",
                    crate::error::error_chain(&e)
                )
            } else {
                format!(
                    "ranks {missing:?} never reached the shutdown barrier ({})",
                    failed.join("; ")
                )
            }
        }),
        dead = watch_missing_ranks(agent) => {
            state.fail(world);
            Err(format!(
                "ranks {dead:?} never reached the shutdown barrier: their processes are gone \
                 (connections refused)"
            ))
        }
    }
}

/// A rank other than 0 at rank 0's barrier, for at most `t`: once, or (AG-7) again at each
/// replacement of a rank 0 that failed while it waited.
async fn arrive_at_rank0(agent: &Agent, t: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + t;
    loop {
        let holder = agent.incarnation_of(0u32).unwrap_or(0);
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let err = match agent
            .rpc_async_timeout(0u32, ShutdownBarrier, (agent.rank(),), left)
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let replaced = agent.inner.shutdown.follow_rank0
            && matches!(
                err,
                RpcError::PeerFailed { .. }
                    | RpcError::ConnectionLost { .. }
                    | RpcError::Unreachable { .. }
            )
            && rank0_replaced(agent, holder, deadline).await;
        if !replaced {
            return Err(crate::error::error_chain(&err));
        }
        tracing::info!(
            worker = %agent.name(),
            "rank 0 was replaced; arriving at its replacement's shutdown barrier"
        );
    }
}

/// Waits until a live incarnation of rank 0 newer than `holder` holds the rank; false if
/// none does by `deadline`.
async fn rank0_replaced(agent: &Agent, holder: u64, deadline: tokio::time::Instant) -> bool {
    let mut changes = agent.watch_membership();
    loop {
        let now = agent.incarnation_of(0u32).unwrap_or(holder);
        if now > holder && agent.is_live(0u32).unwrap_or(false) {
            return true;
        }
        // Re-checked on every change, and every 100 ms in case one was missed.
        let wait = tokio::time::sleep(Duration::from_millis(100));
        if tokio::time::timeout_at(deadline, async {
            tokio::select! {
                _ = changes.next() => {}
                () = wait => {}
            }
        })
        .await
        .is_err()
        {
            return false;
        }
    }
}

/// Rank 0, waiting at the shutdown barrier: resolves once every rank that has not arrived is
/// known dead (its listener refuses connections: the process is gone), with those ranks.
/// Pending forever while any missing rank may still come. A frozen or partitioned peer does
/// not refuse connections; the barrier's timeout covers those.
async fn watch_missing_ranks(agent: &Agent) -> Vec<u32> {
    let world = agent.world_size() as u32;
    let mut dead = BTreeSet::new();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let missing = agent.inner.shutdown.missing(world);
        for &r in &missing {
            if !dead.contains(&r) && peer_gone(agent, r).await {
                dead.insert(r);
            }
        }
        if !missing.is_empty() && missing.iter().all(|r| dead.contains(r)) {
            return missing;
        }
    }
}

/// Whether the process of worker `rank` is known to be gone (see
/// [`AgentExt::peer_gone`](crate::ext::AgentExt::peer_gone)).
pub(crate) async fn peer_gone(agent: &Agent, rank: u32) -> bool {
    if rank == agent.rank() || rank as usize >= agent.world_size() {
        return false;
    }
    matches!(
        agent.inner.net.control(rank).await.map_err(RpcError::from),
        Err(RpcError::Unreachable { source, .. })
            if source.kind() == std::io::ErrorKind::ConnectionRefused
    )
}
