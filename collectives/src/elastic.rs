//! Data parallelism that survives the loss of members (Horovod elastic's model): the
//! replicas commit their state at steps they choose; when a collective fails because a member
//! failed, the survivors roll back to the last commit, re-form their group without the failed
//! ranks (a new ring), and go on from the committed step, with the data re-partitioned over
//! the new group by the caller (a [`crate::DistributedSampler`] of the new size and index).
//!
//! - EL-1: after [`ElasticDdp::recover`] every survivor holds the committed parameters (rolled
//!   back, then broadcast from the new group's first rank), so a step that completed on some
//!   members and failed on others is redone by all, and the replicas stay identical.
//! - EL-2: the new group is the old one without the ranks this worker's failure detector
//!   declared failed; `recover` waits (bounded) until it has declared at least one, so a member
//!   that learned of the failure through another's abort does not re-form the same group.
//!   Members that disagree (two failures detected in different orders) fail their next
//!   collective and recover again.

use std::time::{Duration, Instant};

use candle_core::{Tensor, Var};

use crate::group::{new_group, CollectiveError, ProcessGroup};
use crate::DistributedDataParallel;

/// [`DistributedDataParallel`] with commits and recovery from failed members.
#[derive(Debug)]
pub struct ElasticDdp {
    ddp: DistributedDataParallel,
    committed: Vec<Tensor>,
    committed_step: u64,
    reforms: u32,
}

impl ElasticDdp {
    /// Wraps `vars` like [`DistributedDataParallel::new`] and commits them as step 0.
    pub async fn new(group: ProcessGroup, vars: Vec<Var>) -> Result<Self, CollectiveError> {
        let ddp = DistributedDataParallel::new(group, vars).await?;
        let committed = snapshot(ddp.vars())?;
        Ok(Self {
            ddp,
            committed,
            committed_step: 0,
            reforms: 0,
        })
    }

    /// The data-parallel wrapper: reduce gradients with it between commits.
    pub fn ddp(&self) -> &DistributedDataParallel {
        &self.ddp
    }

    /// The current group (smaller after each recovery).
    pub fn group(&self) -> &ProcessGroup {
        self.ddp.group()
    }

    /// This worker's index in the current group and the group's size (for the sampler).
    pub fn replica(&self) -> (usize, usize) {
        let g = self.group();
        let rank = g.agent().rank();
        let i = g.ranks().iter().position(|&r| r == rank).unwrap_or(0);
        (i, g.size())
    }

    /// Records the parameters as the state of `step` (every member commits at the same steps;
    /// optimizer state, if any, is the caller's to commit beside).
    pub fn commit(&mut self, step: u64) -> Result<(), CollectiveError> {
        self.committed = snapshot(self.ddp.vars())?;
        self.committed_step = step;
        Ok(())
    }

    /// The step of the last commit.
    pub fn committed_step(&self) -> u64 {
        self.committed_step
    }

    /// How many times the group was re-formed.
    pub fn reforms(&self) -> u32 {
        self.reforms
    }

    /// After a collective failed because a member failed: waits (at most `timeout`) until this
    /// worker's detector has declared a member of the group failed, rolls the parameters back
    /// to the last commit, re-forms the group over the members left (EL-2) and makes every
    /// survivor's parameters equal (EL-1). Returns the step to go on from.
    pub async fn recover(&mut self, timeout: Duration) -> Result<u64, CollectiveError> {
        let old = self.group().clone();
        let agent = old.agent().clone();
        let deadline = Instant::now() + timeout;
        let survivors = loop {
            let failed: Vec<u32> = agent.failed_workers().iter().map(|f| f.rank).collect();
            let left: Vec<u32> = old
                .ranks()
                .iter()
                .copied()
                .filter(|r| !failed.contains(r))
                .collect();
            if left.len() < old.size() {
                break left;
            }
            if Instant::now() >= deadline {
                return Err(CollectiveError::Failed {
                    op: "recover",
                    members: old.ranks().to_vec(),
                    message: format!("no member was declared failed within {timeout:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        for (v, t) in self.ddp.vars().iter().zip(&self.committed) {
            v.set(t)?;
        }
        let group = new_group(&agent, &survivors)?;
        tracing::warn!(
            members = ?survivors,
            step = self.committed_step,
            "data-parallel group re-formed without the failed members"
        );
        let vars = self.ddp.vars().to_vec();
        self.ddp = DistributedDataParallel::with_bucket_bytes(group, vars, self.ddp.bucket_bytes())
            .await?
            .with_reduce_op(self.ddp.reduce_op());
        self.reforms += 1;
        Ok(self.committed_step)
    }
}

fn snapshot(vars: &[Var]) -> Result<Vec<Tensor>, CollectiveError> {
    Ok(vars
        .iter()
        .map(|v| v.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?)
}
