//! A parameter server: parameters sharded over server workers, trainers that pull parameters
//! and push gradients, servers that apply the optimizer (SGD) as gradients arrive.
//!
//! Consistency is one rule with three settings: a trainer's pull for its step `c` waits until
//! `c - min(trainer clocks) <= s`, where a trainer's clock is the number of steps it has
//! pushed. BSP is `s = 0` (every step waits for every trainer), SSP is a bound `s`, ASP never
//! waits. The server records the largest `c - min` it let through, so the bound is observable.
//!
//! A shard may have a backup on another server ([`Replica`]): primary-backup replication, the
//! state machine way. Every change of the shard (a push, a trainer's departure, a trainer's
//! join) goes through the shard's log (`log.rs`): numbered, held by the backup, then applied
//! on the primary and acknowledged; the backup serves the trainers once the primary has been
//! declared failed.
//!
//! Layout: `shard.rs` the state machine of one copy (admit, apply), `log.rs` the shards served
//! here and the log that replicates their changes, `server.rs` the trainers' calls, `client.rs`
//! [`PsClient`].
//!
//! - PS-1: a pull never proceeds with `c - min(clocks) > s` (the wait is bounded by the call's
//!   deadline; past it the pull fails instead of breaking the bound).
//! - PS-2: under BSP a step's gradients are applied together once every trainer has pushed
//!   that step, so every trainer's step `c` starts from the same parameters.
//! - PS-3: a trainer declared failed leaves the shard: its clock no longer holds the others
//!   back (the bound is over the live trainers' clocks, and a BSP step is applied once every
//!   live trainer has pushed it, with the gradients the departed one pushed before), and its
//!   later calls (a falsely suspected process that is still running) are refused, naming it.
//! - PS-4: a push is idempotent per (trainer, step): one the shard already holds is
//!   acknowledged and not applied again, so a trainer may retry it on the backup.
//! - PS-5: no change is visible to a trainer (in a pull from the primary) or acknowledged
//!   before the backup holds it (or was declared failed: the primary goes on alone), whatever
//!   happens to the call that pushed it; both copies apply the same changes in the same order,
//!   so their parameters are bit-identical and a primary's death loses no update a trainer saw
//!   or had acknowledged. A backup refuses changes once its view has the primary failed (a
//!   frozen primary that thaws is fenced), and serves trainers from then on.
//! - PS-6: a replacement trainer joins ([`PsClient::join`]) under the departed one's index at
//!   the slowest live trainer's clock, or after the last step the departed one pushed if that
//!   is later (no step of a trainer index is applied twice); steps before it do not wait for
//!   it.
//! - PS-7: a push for a step ahead of the trainer's clock (a step it has not pulled) is refused,
//!   naming both steps: accepted, it would hold every other trainer back under BSP.
//! - PS-8: a shard whose primary the group has declared failed is served by its backup from
//!   then on, also after a launcher started the primary's rank again: the replacement process
//!   holds nothing of the shard (nothing re-replicates it), so trainers never call it for the
//!   shard. A replacement trainer's join is admitted while the shard still counts the old
//!   incarnation of its rank as live (the group admitted a newer one, so the old one is gone,
//!   whatever order the verdict and the join arrive in).
//! - PS-9: under BSP a step's gradients are summed in trainer order, whatever order they
//!   arrived in (each is held until the step is complete), so the parameters after a step
//!   depend on the gradients alone, not on timing.
//! - PS-10: a trainer index is one rank's: once a rank has pushed as trainer `t` (or joined
//!   as it), a push as `t` from another rank is refused, naming both (it would pass for a
//!   retry of the first's, PS-4, acknowledged and never applied). Pulls only read.

mod client;
mod log;
mod server;
mod shard;

use candle_core::Tensor;
use rpc_core::Agent;
use serde::{Deserialize, Serialize};

pub use client::{primary_failed, PsClient};
pub(crate) use log::Replicate;
pub(crate) use server::{Join, Pull, Push};

/// How far trainers may drift apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Bulk synchronous: every step waits for every trainer.
    Bsp,
    /// Stale synchronous: the fastest trainer may be at most this many steps ahead of the
    /// slowest.
    Ssp(u64),
    /// Asynchronous: no waiting.
    Asp,
}

impl Consistency {
    pub(crate) fn bound(self) -> u64 {
        match self {
            Self::Bsp => 0,
            Self::Ssp(s) => s,
            Self::Asp => u64::MAX,
        }
    }
}

/// Which copy of a shard a server holds (PS-5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replica {
    /// The only copy (also a primary whose backup failed, and a backup whose primary did).
    Sole,
    /// The copy trainers call: every change is applied here, then on worker `backup`, before
    /// it is acknowledged.
    Primary {
        /// The rank holding the backup.
        backup: u32,
    },
    /// A copy that applies what worker `primary` forwards, and serves the trainers once
    /// `primary` has been declared failed.
    Backup {
        /// The rank holding the primary.
        primary: u32,
    },
}

/// A shard's counters, from [`shard_stats`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardStats {
    /// The largest staleness (`c - min(clocks)`) a pull was let through with.
    pub max_staleness: u64,
    /// Per trainer: the number of steps it has pushed (or the step it joined at).
    pub clocks: Vec<u64>,
    /// Per trainer: how many of its pushes are in the parameters.
    pub applied: Vec<u64>,
    /// The copy this server holds now.
    pub replica: Replica,
}

/// Why a shard cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("parameter shard {shard} on `{worker}`: {why}")]
#[non_exhaustive]
pub struct ServeError {
    /// The worker asked to serve it.
    pub worker: String,
    /// The shard.
    pub shard: u64,
    /// The cause.
    pub why: String,
}

/// Starts serving shard `shard` on this worker: `params` with SGD at learning rate `lr`, for
/// `trainers` trainers (ranks of trainers are mapped to indices by the trainers themselves).
///
/// Refuses, changing nothing: a shard this worker already serves (serving it again would drop
/// its parameters and every trainer's progress: [`retire_shard`] it first to start over), a
/// learning rate that is not a finite number of at least 0 (PyTorch's SGD range), no
/// trainers, and no parameters.
pub fn serve_shard(
    agent: &Agent,
    shard: u64,
    params: Vec<Tensor>,
    lr: f64,
    consistency: Consistency,
    trainers: usize,
) -> Result<(), ServeError> {
    serve_replica(
        agent,
        shard,
        params,
        lr,
        consistency,
        trainers,
        Replica::Sole,
    )
}

/// [`serve_shard`] as one copy of a replicated shard (PS-5): call it on the primary with
/// `Replica::Primary { backup }` and on the backup with `Replica::Backup { primary }`, with the
/// same `params`, before any trainer calls. Refuses what [`serve_shard`] refuses, and a copy
/// whose other copy is this worker itself or a rank outside the group.
pub fn serve_replica(
    agent: &Agent,
    shard: u64,
    params: Vec<Tensor>,
    lr: f64,
    consistency: Consistency,
    trainers: usize,
    replica: Replica,
) -> Result<(), ServeError> {
    let refuse = |why: String| ServeError {
        worker: agent.name().to_owned(),
        shard,
        why,
    };
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(refuse(format!(
            "learning rate {lr} is not a finite number of at least 0"
        )));
    }
    if trainers == 0 {
        return Err(refuse("no trainers: a shard serves at least one".into()));
    }
    if params.is_empty() {
        return Err(refuse("no parameters".into()));
    }
    if let Replica::Primary { backup: r } | Replica::Backup { primary: r } = replica {
        let size = agent.world_size() as u32;
        if r == agent.rank() || r >= size {
            return Err(refuse(format!(
                "its other copy, rank {r}, is not another worker of the group of {size}"
            )));
        }
    }
    let state = shard::Shard::new(params, lr, consistency, trainers, replica);
    log::shards(agent).insert(shard, state).map_err(|()| {
        refuse(format!(
            "shard {shard} is already served here (serving it again would drop its \
             parameters and every trainer's progress)"
        ))
    })
}

/// Stops serving shard `shard` on this worker and hands back its parameters as they are now
/// (`None` if it serves no such shard). Trainers' later calls for it fail, naming the worker
/// and the shard; [`serve_shard`] may then serve it again (a new run, from new parameters).
pub fn retire_shard(agent: &Agent, shard: u64) -> Option<Vec<Tensor>> {
    log::shards(agent).remove(shard).map(|s| s.params)
}

/// Shard `shard`'s counters on this worker.
pub fn shard_stats(agent: &Agent, shard: u64) -> Option<ShardStats> {
    let m = log::shards(agent);
    let g = m.lock();
    g.shards.get(&shard).map(|h| ShardStats {
        max_staleness: h.state.max_staleness,
        clocks: h.state.clocks.clone(),
        applied: h.state.applied.clone(),
        replica: h.state.replica,
    })
}
