//! Data parallelism that survives the loss of members (Horovod elastic's model): the
//! replicas commit their state at steps they choose; when a collective fails because a member
//! failed, the survivors roll back to the last commit, re-form their group without the failed
//! ranks (a new ring), and go on from the committed step, with the data re-partitioned over
//! the new group by the caller (a [`crate::DistributedSampler`] of the new size and index).
//!
//! - EL-1: after [`ElasticDdp::recover`] every survivor holds the committed parameters (rolled
//!   back, then shared as EL-4 says), so a step that completed on some members and failed on
//!   others is redone by all, and the replicas stay identical. Where the survivors' commits
//!   differ (one completed a step another failed, and reached its next commit), all take the
//!   newest commit's parameters and step: a state the group computed.
//! - EL-2: the new group is the old one without the ranks this worker's failure detector
//!   declared failed; `recover` waits (bounded) until it has declared at least one, so a member
//!   that learned of the failure through another's abort does not re-form the same group.
//!   Members that disagree (two failures detected in different orders) fail their next
//!   collective and recover again.
//! - EL-3: with [`Rejoin::WaitForReplacement`] the group keeps its size: the survivors wait for
//!   a new incarnation of each failed member, and the replacement ([`ElasticDdp::join`])
//!   receives the committed parameters and step, so all members go on from the same state.
//! - EL-4: the committed state comes from the survivors, not from a chosen rank: each
//!   survivor with the newest commit offers its committed values (identical, EL-1), every
//!   other member the lowest value there is, and an all-reduce takes the maximum, a
//!   survivor's value bit for bit. So any
//!   rank may be replaced, the group's first included, while one survivor is left (before, the
//!   first rank sent the state, and a replacement of it could not join).

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};

use crate::ddp::DEFAULT_BUCKET_BYTES;
use crate::group::{new_group, CollectiveError, ProcessGroup};
use crate::{CommHook, DistributedDataParallel, ReduceOp};

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

    /// Sends every bucket through `hook` (as [`DistributedDataParallel::with_hook`]), in this
    /// group and in every group a recovery re-forms.
    pub fn with_hook(self, hook: impl CommHook) -> Self {
        Self {
            ddp: self.ddp.with_hook(hook),
            ..self
        }
    }

    /// Combines gradients with `op` instead of the mean (as
    /// [`DistributedDataParallel::with_reduce_op`]), here and after every recovery.
    pub fn with_reduce_op(self, op: ReduceOp) -> Self {
        Self {
            ddp: self.ddp.with_reduce_op(op),
            ..self
        }
    }

    /// Buckets of up to `bytes` instead of 25 MiB (as
    /// [`DistributedDataParallel::with_bucket_bytes`]), here and after every recovery; every
    /// member, a replacement included, must use the same size.
    pub fn with_bucket_bytes(self, bytes: usize) -> Self {
        Self {
            ddp: self.ddp.rebucketed(bytes),
            ..self
        }
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
    /// worker's view has a member of the group failed, rolls the parameters back to the last
    /// commit, re-forms the group over the members left (EL-2) and makes every survivor's
    /// parameters equal (EL-1). Returns the step to go on from.
    pub async fn recover(&mut self, timeout: Duration) -> Result<u64, CollectiveError> {
        self.recover_with(timeout, Rejoin::Shrink).await
    }

    /// [`ElasticDdp::recover`], choosing what happens to the failed members: with
    /// [`Rejoin::WaitForReplacement`] the survivors wait (within `timeout`) until a new
    /// incarnation of each has joined the group, and re-form the group with them; each
    /// replacement calls [`ElasticDdp::join`] and gets the committed parameters and step
    /// (EL-3).
    pub async fn recover_with(
        &mut self,
        timeout: Duration,
        rejoin: Rejoin,
    ) -> Result<u64, CollectiveError> {
        let old = self.group().clone();
        let agent = old.agent().clone();
        let deadline = Instant::now() + timeout;
        let members = || {
            old.ranks()
                .iter()
                .copied()
                .zip(old.incarnations().iter().copied())
        };
        // A member whose incarnation in the group failed (or was replaced already).
        let lost = |r: u32, inc: u64| {
            !agent.is_live(r).unwrap_or(false) || agent.incarnation_of(r).unwrap_or(inc) != inc
        };
        let failed: Vec<(u32, u64)> = loop {
            let failed: Vec<(u32, u64)> = members().filter(|&(r, i)| lost(r, i)).collect();
            if !failed.is_empty() {
                break failed;
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
        let ranks: Vec<u32> = match rejoin {
            Rejoin::Shrink => members()
                .filter(|m| !failed.contains(m))
                .map(|(r, _)| r)
                .collect(),
            Rejoin::WaitForReplacement => {
                let replaced = |&(r, i): &(u32, u64)| {
                    agent.is_live(r).unwrap_or(false)
                        && agent.incarnation_of(r).is_ok_and(|now| now > i)
                };
                while !failed.iter().all(replaced) {
                    if Instant::now() >= deadline {
                        let missing: Vec<u32> = failed
                            .iter()
                            .filter(|m| !replaced(m))
                            .map(|m| m.0)
                            .collect();
                        return Err(CollectiveError::Failed {
                            op: "recover",
                            members: old.ranks().to_vec(),
                            message: format!(
                                "ranks {missing:?} were not replaced within {timeout:?}"
                            ),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                old.ranks().to_vec()
            }
        };
        for (v, t) in self.ddp.vars().iter().zip(&self.committed) {
            v.set(t)?;
        }
        // The re-formed group keeps the old one's settings.
        let group = new_group(&agent, &ranks)?.with_ring_threads(self.group().ring_threads());
        tracing::warn!(
            members = ?ranks,
            step = self.committed_step,
            "data-parallel group re-formed after a failure"
        );
        // The same hook, bucket size and reduce operation over the new ring.
        self.ddp = self.ddp.regroup(group);
        // EL-1, EL-3, EL-4: every member takes the newest commit's state and step.
        let step =
            share_committed(self.ddp.group(), self.ddp.vars(), Some(self.committed_step)).await?;
        if step != self.committed_step {
            self.committed = snapshot(self.ddp.vars())?;
            self.committed_step = step;
        }
        self.reforms += 1;
        Ok(step)
    }

    /// A replacement of a failed member joins the survivors' re-formed group (they call
    /// [`ElasticDdp::recover_with`] with [`Rejoin::WaitForReplacement`]): `group` has the same
    /// ranks as theirs, `vars` the shapes of their parameters. It receives the committed
    /// parameters from the survivors (any rank may be replaced, the first included: EL-4),
    /// commits them, and returns the step to go on from (EL-3). Give the result the survivors'
    /// settings ([`ElasticDdp::with_bucket_bytes`], [`ElasticDdp::with_hook`],
    /// [`ElasticDdp::with_reduce_op`]) before its first step.
    pub async fn join(group: ProcessGroup, vars: Vec<Var>) -> Result<(Self, u64), CollectiveError> {
        let ddp = DistributedDataParallel::assume_equal(group, vars, DEFAULT_BUCKET_BYTES);
        let step = share_committed(ddp.group(), ddp.vars(), None).await?;
        let committed = snapshot(ddp.vars())?;
        Ok((
            Self {
                ddp,
                committed,
                committed_step: step,
                reforms: 0,
            },
            step,
        ))
    }
}

/// What happens to failed members in [`ElasticDdp::recover_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejoin {
    /// Go on without them (a smaller ring; the data re-partitioned over it).
    Shrink,
    /// Wait for a replacement of each (a process that joins the group as the rank's next
    /// incarnation, e.g. restarted by `rpcrun --restart worker`) and go on with it.
    WaitForReplacement,
}

/// EL-1, EL-4: makes `vars` and the step those of the survivors with the newest commit on
/// every member of `group`. A survivor passes its committed step (its `vars` hold the
/// committed values), a replacement `None`. Fails on every member when none is a survivor.
async fn share_committed(
    group: &ProcessGroup,
    vars: &[Var],
    step: Option<u64>,
) -> Result<u64, CollectiveError> {
    let offered = Tensor::new(&[step.map_or(-1.0, |s| s as f64)], &Device::Cpu)?;
    let newest = group
        .all_reduce(&offered, ReduceOp::Max)
        .await?
        .to_vec1::<f64>()?[0];
    // Survivors that committed the same step hold the same values; one whose commit is older
    // (it failed a step another completed) offers the lowest value, as a replacement does.
    let source = step.is_some_and(|s| s as f64 == newest);
    if newest < 0.0 {
        return Err(CollectiveError::Failed {
            op: "join",
            members: group.ranks().to_vec(),
            message: "no member of the group survived to hold the committed state: every one \
                      is a replacement"
                .into(),
        });
    }
    for v in vars {
        let t = v.as_tensor();
        let mine = if source {
            t.clone()
        } else {
            t.zeros_like()?.affine(1.0, f64::NEG_INFINITY)?
        };
        v.set(&group.all_reduce(&mine, ReduceOp::Max).await?)?;
    }
    Ok(newest as u64)
}

fn snapshot(vars: &[Var]) -> Result<Vec<Tensor>, CollectiveError> {
    Ok(vars
        .iter()
        .map(|v| v.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?)
}
