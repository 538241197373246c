//! A worker's shutdown state: rank 0's barrier (who arrived, who was excused for failing or
//! leaving, who waits) and the report of the first shutdown. Plain state; the phases that
//! drive it are in `shutdown/mod.rs`.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

/// What [`Agent::shutdown`](crate::Agent::shutdown) did.
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
    /// Every worker the group declared failed while this worker was a member (a replaced
    /// one included), in the order of the verdicts: the barrier did not wait for them.
    pub failed: Vec<crate::net::WorkerFailed>,
    /// Total time taken.
    pub elapsed: Duration,
    /// The job failed: rank 0 (or this worker) shut down with
    /// [`Agent::shutdown_failed`](crate::Agent::shutdown_failed), and the barrier told every
    /// member.
    pub job_failed: Option<JobFailed>,
}

impl ShutdownReport {
    /// The barrier completed, nothing was aborted, and the job did not fail (workers that
    /// failed on the way are in [`ShutdownReport::failed`]; the barrier names those it did not
    /// wait for).
    pub fn is_clean(&self) -> bool {
        self.barrier.is_ok() && self.aborted == 0 && self.job_failed.is_none()
    }
}

/// The failure a job ended with, as the worker that shut down with it said
/// ([`Agent::shutdown_failed`](crate::Agent::shutdown_failed)).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct JobFailed {
    /// The worker that said so.
    pub worker: String,
    /// Its rank.
    pub rank: u32,
    /// Why the job failed.
    pub cause: String,
    /// Whether running the job again may succeed (a launcher restarts it), or would meet the
    /// same failure (a bad flag, a checkpoint that cannot be written).
    pub retry: bool,
}

impl std::fmt::Display for JobFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the job failed at `{}` (rank {}): {}",
            self.worker, self.rank, self.cause
        )
    }
}

/// A worker's shutdown state: rank 0's barrier and the report of the first shutdown.
pub(crate) struct State {
    /// Bound on each phase unless a caller gives its own.
    pub timeout: Duration,
    /// A failed rank 0 is replaced by a launcher: wait for its replacement's barrier (AG-7).
    pub follow_rank0: bool,
    barrier: Mutex<Barrier>,
    pub report: tokio::sync::OnceCell<ShutdownReport>,
    /// The job's failure, if this worker shuts down with one (rank 0's is told to all).
    outcome: Mutex<Option<JobFailed>>,
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
    /// Per rank readmitted, the incarnation that holds it now: the failure of an earlier one,
    /// heard late, excuses nothing (SHUT-3).
    holders: std::collections::BTreeMap<u32, u64>,
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
            outcome: Mutex::new(None),
        }
    }

    /// Records the job's failure (the first one said wins).
    pub(crate) fn set_outcome(&self, f: JobFailed) {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(f);
    }

    /// The job's failure, if one was recorded.
    pub(crate) fn outcome(&self) -> Option<JobFailed> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn barrier(&self) -> std::sync::MutexGuard<'_, Barrier> {
        self.barrier.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ranks of a group of `world` that have neither reached the barrier nor been
    /// declared failed.
    pub(crate) fn missing(&self, world: u32) -> Vec<u32> {
        let b = self.barrier();
        (0..world)
            .filter(|r| !b.arrived.contains(r) && !b.excused.contains(r) && !b.departed.contains(r))
            .collect()
    }

    /// Rank 0's side of the barrier: waits until all `world` ranks have arrived or been
    /// declared failed (then fails naming those, AG-6), or until rank 0 gives up (then fails
    /// with the missing ranks).
    pub(crate) async fn arrive(&self, rank: u32, world: usize) -> Result<(), Vec<u32>> {
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

    /// Incarnation `incarnation` of `rank` was declared failed: the barrier does not wait for
    /// it (AG-6), unless a later incarnation holds the rank now (SHUT-3: the verdict's hooks
    /// run outside the membership's lock, so one for the replaced incarnation can come after
    /// its replacement was readmitted; it excused the replacement, and the barrier ended
    /// with "ranks [2] never reached the shutdown barrier" though rank 2 had).
    pub(crate) fn excuse(&self, rank: u32, incarnation: u64, world: usize) {
        let mut b = self.barrier();
        if b.holders.get(&rank).is_some_and(|&held| incarnation < held) {
            return;
        }
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

    /// Incarnation `incarnation` holds `rank` now: the barrier waits for it again (unless it
    /// already released).
    pub(crate) fn readmit(&self, rank: u32, incarnation: u64) {
        let mut b = self.barrier();
        let held = b.holders.entry(rank).or_insert(incarnation);
        *held = (*held).max(incarnation);
        b.excused.remove(&rank);
        b.departed.remove(&rank);
        // A previous incarnation that arrived and then failed does not stand in for it.
        b.arrived.remove(&rank);
    }

    /// Rank 0 gives up on the barrier: every waiter learns which ranks never arrived.
    pub(crate) fn fail(&self, world: u32) -> Vec<u32> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// SHUT-3: a verdict on rank 2's replaced incarnation 0, whose hooks ran after incarnation
    /// 1 was readmitted (seen under rpcrun --restart worker: the param-server test's clean run
    /// ended with "ranks [2] never reached the shutdown barrier"), excuses nothing: the
    /// barrier still waits for rank 2. The replacement's own failure still excuses it.
    #[test]
    fn a_late_verdict_on_a_replaced_incarnation_excuses_nothing() {
        let s = State::new(Duration::from_secs(1), false);
        s.excuse(2, 0, 3);
        assert_eq!(
            s.missing(3),
            vec![0, 1],
            "incarnation 0's failure in time excuses it"
        );
        s.readmit(2, 1);
        assert_eq!(s.missing(3), vec![0, 1, 2], "its replacement is waited for");
        s.excuse(2, 0, 3);
        assert_eq!(
            s.missing(3),
            vec![0, 1, 2],
            "a late verdict on incarnation 0"
        );
        s.excuse(2, 1, 3);
        assert_eq!(s.missing(3), vec![0, 1], "the replacement's own failure");
    }
}
