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
//! - SHUT-1: a job that failed is never reported as a success: rank 0's
//!   [`Agent::shutdown_failed`] reaches every member that arrives at its barrier, whose
//!   report says so and is not clean.
//! - SHUT-2: once a member knows the job failed (its own `shutdown_failed`, or the barrier's
//!   word), its calls in flight drain for at most a second before they are aborted, instead
//!   of the shutdown timeout: a call waiting for work that will never come (a trainer's pull
//!   for a step its failed peer will not push) cannot hold the failure's report back.
//! - SHUT-3: the barrier waits for the incarnation that holds a rank: a failure verdict on an
//!   earlier one, heard after its replacement joined, excuses nothing.
//! - AG-7: where a launcher replaces failed processes one by one
//!   ([`Config::replaced_on_failure`](crate::Config::replaced_on_failure)), a rank whose
//!   rank 0 failed waits, within the barrier's timeout, for rank 0's next incarnation and
//!   arrives at its barrier instead.

pub(crate) mod state;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::error::{BoxError, LeaveError, RpcError};
use crate::net::PeerState;
use crate::registry::RemoteFn;
use crate::rendezvous::Report;
use crate::state::{Agent, CallContext};

pub use state::{JobFailed, ShutdownReport};

impl Agent {
    /// Leaves the running group gracefully while the others go on: the layers above finish
    /// their protocol traffic (shutdown hooks), the rendezvous tells every member (their
    /// calls to this worker are refused from then on with
    /// [`RpcError::PeerLeft`], and their shutdown does not wait for it), calls in flight
    /// drain, then connections close. Later calls of [`Agent::shutdown`] return this report.
    /// Each step is bounded by the shutdown timeout.
    ///
    /// Rank 0 cannot leave (it hosts the shutdown barrier).
    pub async fn leave(&self) -> Result<ShutdownReport, LeaveError> {
        let worker = self.name().to_owned();
        if self.rank() == 0 {
            return Err(LeaveError::RankZero { worker });
        }
        if self.is_shutting_down() {
            return Err(LeaveError::ShuttingDown { worker });
        }
        let timeout = self.inner.shutdown.timeout;
        let hooks = self.inner.layers.shutdown_hooks();
        if tokio::time::timeout(timeout, futures::future::join_all(hooks))
            .await
            .is_err()
        {
            tracing::warn!(worker = %worker, "shutdown hooks did not finish in time");
        }
        // Peers' detectors first hear that this worker is leaving (they stop watching it), so
        // none takes its departure for a failure before the rendezvous's word reaches it.
        self.inner.net.leave().await;
        if self.inner.reports.send(Report::Leaving).await.is_err() {
            return Err(LeaveError::NoRendezvous { worker });
        }
        // The rendezvous's echo of the leave is its acknowledgement.
        let membership = &self.inner.net.membership;
        let me = self.rank();
        let confirmed = tokio::time::timeout(timeout, async {
            let mut changes = self.watch_membership();
            while membership.state(me) != PeerState::Left {
                if changes.next().await.is_none() {
                    return false;
                }
            }
            true
        })
        .await;
        match confirmed {
            Ok(true) => Ok(leave(self, timeout).await),
            Ok(false) => Err(LeaveError::NoRendezvous { worker }),
            Err(_) => Err(LeaveError::Unconfirmed { worker, timeout }),
        }
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.life.is_stopping()
    }

    /// Leaves the group gracefully: a group-wide barrier (every worker has called shutdown),
    /// then new calls are refused while calls in flight finish, then connections close.
    /// Each phase is bounded by the shutdown timeout, so a worker whose peers vanished still
    /// returns. Idempotent: later calls return the first call's report.
    ///
    /// # Cancel safety
    /// Cancel safe in the sense that a later call resumes and finishes the same shutdown.
    pub async fn shutdown(&self) -> ShutdownReport {
        shutdown(self, self.inner.shutdown.timeout).await
    }

    /// [`Agent::shutdown`] of a job that failed: the barrier tells every member (SHUT-1), whose
    /// [`ShutdownReport::job_failed`] then says so and is not clean, so that a worker that
    /// only serves exits non-zero instead of reporting success for a failed job. `retry`:
    /// whether running the job again may succeed. Only the first call of any shutdown decides;
    /// rank 0's failure is the one the others hear. Calls still in flight then drain for at
    /// most a second before they are aborted, on every member that heard (SHUT-2).
    ///
    /// ```no_run
    /// # async fn demo(agent: rpc_core::Agent, train: impl std::future::Future<Output = Result<(), String>>) {
    /// let report = match train.await {
    ///     Ok(()) => agent.shutdown().await,
    ///     Err(e) => agent.shutdown_failed(e, true).await,
    /// };
    /// # }
    /// ```
    pub async fn shutdown_failed(&self, cause: impl Into<String>, retry: bool) -> ShutdownReport {
        self.inner.shutdown.set_outcome(JobFailed {
            worker: self.name().to_owned(),
            rank: self.rank(),
            cause: cause.into(),
            retry,
        });
        self.shutdown().await
    }

    /// [`Agent::shutdown`] with `timeout` per phase instead of the configured one: after a
    /// failure, a worker leaves quickly instead of waiting out the group's generous timeout
    /// for traffic with peers that are gone. Only the first call of either decides.
    pub async fn shutdown_within(&self, timeout: Duration) -> ShutdownReport {
        shutdown(self, timeout).await
    }

    /// Serves the group until every member has called shutdown, then shuts down (PyTorch's
    /// `rpc.shutdown()`): the barrier waits for the group as long as the group's failure
    /// detection keeps the members it waits for (a member declared failed or that left is not
    /// waited for), whatever the shutdown timeout; the other phases are bounded by it. This is
    /// how a worker that only serves (its master drives the job) waits for the job's end:
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     cfg: rpc_core::Config,
    /// #     registry: rpc_core::Registry,
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// let agent = rpc_core::init(cfg, registry).await?;
    /// let report = agent.wait_for_group().await; // returns once the master shuts down too
    /// assert!(report.is_clean(), "{report:?}");
    /// # Ok(()) }
    /// ```
    ///
    /// Without a failure detector ([`Config::heartbeat_interval`](crate::Config) zero) a
    /// member that hung would hold the barrier for good, so the barrier is then bounded by the
    /// shutdown timeout, as [`Agent::shutdown`]'s is. Idempotent with `shutdown`: only the
    /// first call of either decides.
    ///
    /// # Cancel safety
    /// As [`Agent::shutdown`].
    pub async fn wait_for_group(&self) -> ShutdownReport {
        let t = self.inner.shutdown.timeout;
        let barrier = if self.inner.net.cfg.heartbeat_interval.is_zero() {
            t
        } else {
            UNTIL_THE_GROUP_IS_DONE
        };
        once(self, t, Some(barrier)).await
    }
}

/// After this long, a shutdown phase that still waits says so.
const NOTICE: Duration = Duration::from_secs(10);

/// How long calls in flight may go on draining once the job failed (SHUT-2): long enough for
/// a reply already on its way, short of a wait that could outlast anyone's patience.
const FAILED_JOB_DRAIN: Duration = Duration::from_secs(1);

/// The barrier's bound for [`Agent::wait_for_group`]: none in practice (the group's failure
/// detection ends the wait for a member that failed).
const UNTIL_THE_GROUP_IS_DONE: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Internal: rank 0's shutdown barrier, served like any registered function.
pub(crate) struct ShutdownBarrier;

impl RemoteFn for ShutdownBarrier {
    const NAME: &'static str = "rpc_core::shutdown_barrier";
    type Args = (u32,);
    /// SHUT-1: the job's failure as rank 0 recorded it before it arrived.
    type Output = Option<JobFailed>;
    async fn call(ctx: CallContext, (rank,): (u32,)) -> Result<Option<JobFailed>, BoxError> {
        let agent = ctx.agent();
        agent
            .inner
            .shutdown
            .arrive(rank, agent.world_size())
            .await
            .map(|()| agent.inner.shutdown.outcome())
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
    once(agent, t, Some(t)).await
}

/// Stops `agent`, which left the running group (its hooks ran and the group was told): the
/// phases after the barrier, with `t` per phase, once (AG-4).
pub(crate) async fn leave(agent: &Agent, t: Duration) -> ShutdownReport {
    once(agent, t, None).await
}

/// The shutdown, once (AG-4): `t` per phase, the barrier (`None`: none) bounded by its own.
async fn once(agent: &Agent, t: Duration, barrier: Option<Duration>) -> ShutdownReport {
    agent
        .inner
        .shutdown
        .report
        .get_or_init(|| run(agent.clone(), t, barrier))
        .await
        .clone()
}

async fn run(agent: Agent, t: Duration, group_barrier: Option<Duration>) -> ShutdownReport {
    let inner = &agent.inner;
    let start = Instant::now();
    let barrier = if let Some(bt) = group_barrier {
        // Phase 0: layers above finish their protocol traffic while every peer still serves.
        let hooks = inner.layers.shutdown_hooks();
        if tokio::time::timeout(t, futures::future::join_all(hooks))
            .await
            .is_err()
        {
            tracing::warn!(worker = %agent.name(), "shutdown hooks did not finish in time");
        }
        // TR-8: rank 0 gets the parts it would not find, before the barrier releases it.
        crate::trace::send_part_to_rank0(&agent, t).await;
        // Phase 1: the barrier.
        let barrier = barrier(&agent, bt).await;
        if let Err(why) = &barrier {
            tracing::warn!(worker = %agent.name(), %why, "shutdown barrier incomplete");
        }
        barrier
    } else {
        Ok(None)
    };
    let job_failed = match &barrier {
        Ok(Some(f)) => Some(f.clone()),
        _ => inner.shutdown.outcome(),
    };
    if let Some(f) = &job_failed {
        tracing::warn!(worker = %agent.name(), "{f}");
    }
    let barrier = barrier.map(|_| ());
    // This worker's part of the job's trace: everything it did for the group is recorded.
    crate::trace::write_part(&agent.tracer());
    // Phase 2: refuse new root calls; let the calls in flight finish.
    let life = &inner.life;
    life.set_stopping();
    life.calls.close();
    let in_flight = life.calls.len();
    // SHUT-2: the work of a job that failed is wanted by nobody.
    let drain = match job_failed {
        Some(_) => t.min(FAILED_JOB_DRAIN),
        None => t,
    };
    let drained = match tokio::time::timeout(drain.min(NOTICE), life.calls.wait()).await {
        Ok(()) => true,
        Err(_) if drain > NOTICE => {
            // Said, so that a long drain is never a silent one.
            tracing::warn!(
                worker = %agent.name(),
                calls = life.calls.len(),
                more = ?(drain - NOTICE),
                "calls in flight are still running at shutdown; waiting for them"
            );
            tokio::time::timeout(drain - NOTICE, life.calls.wait())
                .await
                .is_ok()
        }
        Err(_) => false,
    };
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
        failed: inner.net.membership.failures(),
        elapsed: start.elapsed(),
        job_failed,
    };
    tracing::info!(worker = %agent.name(), ?report, "shut down");
    report
}

/// Phase 1: every rank calls rank 0's barrier; rank 0 stops waiting for ranks whose process
/// is gone (AG-5).
async fn barrier(agent: &Agent, t: Duration) -> Result<Option<JobFailed>, String> {
    let world = agent.world_size() as u32;
    if world <= 1 {
        return Ok(None);
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
async fn arrive_at_rank0(agent: &Agent, t: Duration) -> Result<Option<JobFailed>, String> {
    let deadline = tokio::time::Instant::now() + t;
    loop {
        let holder = agent.incarnation_of(0u32).unwrap_or(0);
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let err = match agent
            .rpc_async_timeout(0u32, ShutdownBarrier, (agent.rank(),), left)
            .await
        {
            Ok(told) => return Ok(told),
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
    let notice = Instant::now() + NOTICE;
    let mut said = false;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let missing = agent.inner.shutdown.missing(world);
        if !said && !missing.is_empty() && Instant::now() >= notice {
            said = true;
            tracing::info!(
                worker = %agent.name(),
                ?missing,
                "still waiting at the shutdown barrier for these ranks"
            );
        }
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
