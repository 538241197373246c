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
//! join) is applied on the primary and then, in the same order, on the backup, before it is
//! acknowledged; the backup serves the trainers once the primary has been declared failed.
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
//! - PS-5: a change is acknowledged only once the primary and its backup both hold it (or the
//!   backup was declared failed: the primary goes on alone), and both apply the same changes
//!   in the same order, so their parameters are bit-identical and a primary's death loses no
//!   acknowledged update. A backup refuses forwarded changes once its view has the primary
//!   failed (a frozen primary that thaws is fenced), and serves trainers from then on.
//! - PS-6: a replacement trainer joins ([`PsClient::join`]) under the departed one's index at
//!   the slowest live trainer's clock, or after the last step the departed one pushed if that
//!   is later (no step of a trainer index is applied twice); steps before it do not wait for
//!   it.

use candle_core::Tensor;
use rpc_core::ext::{AgentExt, WeakAgent};
use rpc_core::{Agent, BoxError, CallContext, RemoteFn, RpcError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

use autograd_dist::RTensor;

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
    fn bound(self) -> u64 {
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

/// A change of a shard: what the primary applies and forwards to its backup (PS-5).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Change {
    Push {
        trainer: usize,
        rank: u32,
        clock: u64,
        grads: Vec<RTensor>,
    },
    Depart {
        trainer: usize,
        incarnation: u64,
        worker: String,
        cause: String,
    },
    Join {
        trainer: usize,
        rank: u32,
        incarnation: u64,
        at: u64,
    },
}

struct Shard {
    params: Vec<Tensor>,
    /// BSP: per step, which trainers pushed it and their gradients' sum, until every live
    /// trainer has.
    pending: HashMap<u64, (Vec<bool>, Vec<Tensor>)>,
    lr: f64,
    consistency: Consistency,
    clocks: Vec<u64>,
    /// Per trainer: steps below this one do not wait for it (PS-6).
    joined_at: Vec<u64>,
    applied: Vec<u64>,
    /// The rank each trainer calls from (learned from its calls) and its incarnation.
    trainer_ranks: Vec<Option<(u32, u64)>>,
    /// Per trainer: `(worker name, cause)` once declared failed (PS-3).
    departed: Vec<Option<(String, String)>>,
    max_staleness: u64,
    changed: watch::Sender<u64>,
    replica: Replica,
    /// Changes pass one at a time, primary then backup (PS-5).
    lane: Arc<tokio::sync::Mutex<()>>,
}

impl Shard {
    /// The slowest live trainer's clock, leaving out `except` (`None`: no trainer is left).
    fn min_live_clock(&self, except: Option<usize>) -> Option<u64> {
        (0..self.clocks.len())
            .filter(|&t| self.departed[t].is_none() && Some(t) != except)
            .map(|t| self.clocks[t])
            .min()
    }

    /// An error if `trainer` is not one of the shard's or has left it (PS-3).
    fn check_trainer(&self, trainer: usize) -> Result<(), BoxError> {
        match self.departed.get(trainer) {
            None => Err(format!(
                "trainer {trainer} is not one of the shard's {} trainers",
                self.clocks.len()
            )
            .into()),
            Some(Some((worker, cause))) => Err(format!(
                "trainer {trainer} (worker `{worker}`) was declared failed and left the shard: \
                 {cause}"
            )
            .into()),
            Some(None) => Ok(()),
        }
    }

    fn apply_grads(&mut self, grads: Vec<Tensor>) -> candle_core::Result<()> {
        for (p, g) in self.params.iter_mut().zip(grads) {
            *p = (&*p - (g * self.lr)?)?;
        }
        Ok(())
    }

    /// BSP: applies, in step order, every pending step each live trainer has pushed.
    fn settle(&mut self) -> candle_core::Result<()> {
        let mut steps: Vec<u64> = self.pending.keys().copied().collect();
        steps.sort_unstable();
        for c in steps {
            let pushed = &self.pending[&c].0;
            let complete = (0..pushed.len())
                .all(|t| pushed[t] || self.departed[t].is_some() || c < self.joined_at[t]);
            if !complete {
                break;
            }
            if let Some((pushed, g)) = self.pending.remove(&c) {
                for (t, p) in pushed.iter().enumerate() {
                    self.applied[t] += u64::from(*p);
                }
                if !g.is_empty() {
                    self.apply_grads(g)?;
                }
            }
        }
        Ok(())
    }

    /// Applies `change`: whether it changed the shard (not for a push the shard already
    /// holds, PS-4), and the trainer's clock after it.
    fn apply(&mut self, change: &Change) -> Result<(bool, u64), BoxError> {
        match *change {
            Change::Push {
                trainer,
                rank,
                clock,
                ref grads,
            } => {
                if grads.len() != self.params.len() {
                    return Err(format!(
                        "{} gradients for {} parameters",
                        grads.len(),
                        self.params.len()
                    )
                    .into());
                }
                for (p, gr) in self.params.iter().zip(grads) {
                    if p.dims() != gr.dims() {
                        return Err(format!(
                            "gradient of shape {:?} for a parameter of shape {:?}",
                            gr.dims(),
                            p.dims()
                        )
                        .into());
                    }
                }
                self.check_trainer(trainer)?;
                if clock < self.clocks[trainer] {
                    return Ok((false, self.clocks[trainer]));
                }
                let incarnation = self.trainer_ranks[trainer].map_or(0, |(_, i)| i);
                self.trainer_ranks[trainer] = Some((rank, incarnation));
                let tensors: Vec<Tensor> = grads.iter().map(|g| g.0.clone()).collect();
                if self.consistency == Consistency::Bsp {
                    // Every trainer pulled step `clock` from the same state: apply the step's
                    // gradients together, once every live trainer's have arrived.
                    let trainers = self.clocks.len();
                    let entry = self
                        .pending
                        .entry(clock)
                        .or_insert_with(|| (vec![false; trainers], Vec::new()));
                    entry.0[trainer] = true;
                    entry.1 = if entry.1.is_empty() {
                        tensors
                    } else {
                        entry
                            .1
                            .iter()
                            .zip(&tensors)
                            .map(|(a, b)| a + b)
                            .collect::<candle_core::Result<_>>()?
                    };
                    self.settle()?;
                } else {
                    self.apply_grads(tensors)?;
                    self.applied[trainer] += 1;
                }
                self.clocks[trainer] = clock + 1;
                self.changed.send_modify(|v| *v += 1);
                Ok((true, clock + 1))
            }
            Change::Depart {
                trainer,
                incarnation,
                ref worker,
                ref cause,
            } => {
                let known = self.trainer_ranks[trainer].map_or(0, |(_, i)| i);
                if self.departed[trainer].is_some() || incarnation < known {
                    return Ok((false, self.clocks[trainer]));
                }
                tracing::warn!(trainer, worker = %worker, "a trainer left the parameter shard");
                self.departed[trainer] = Some((worker.clone(), cause.clone()));
                self.settle()?;
                self.changed.send_modify(|v| *v += 1);
                Ok((true, self.clocks[trainer]))
            }
            Change::Join {
                trainer,
                rank,
                incarnation,
                at,
            } => {
                if trainer >= self.clocks.len() {
                    return Err(format!(
                        "trainer {trainer} is not one of the shard's {} trainers",
                        self.clocks.len()
                    )
                    .into());
                }
                if self.departed[trainer].is_none() {
                    if let Some((r, i)) = self.trainer_ranks[trainer] {
                        if (r, i) != (rank, incarnation) {
                            return Err(format!(
                                "trainer {trainer} is held by live rank {r} (incarnation {i}); \
                                 only a departed trainer can be replaced"
                            )
                            .into());
                        }
                    }
                }
                // Never a step the departed holder pushed (PS-4 holds across incarnations).
                let j = at
                    .max(self.clocks[trainer])
                    .max(self.min_live_clock(Some(trainer)).unwrap_or(at));
                self.departed[trainer] = None;
                self.trainer_ranks[trainer] = Some((rank, incarnation));
                self.clocks[trainer] = j;
                self.joined_at[trainer] = j;
                self.settle()?;
                self.changed.send_modify(|v| *v += 1);
                tracing::info!(
                    trainer,
                    rank,
                    incarnation,
                    step = j,
                    "a trainer joined the parameter shard"
                );
                Ok((true, j))
            }
        }
    }
}

#[derive(Default)]
struct ShardsInner {
    shards: HashMap<u64, Shard>,
    /// Every failure this worker has heard of: (incarnation, name, cause) by rank.
    failed: HashMap<u32, (u64, String, String)>,
}

#[derive(Default)]
struct Shards(Mutex<ShardsInner>);

impl Shards {
    fn lock(&self) -> std::sync::MutexGuard<'_, ShardsInner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn shards(agent: &Agent) -> Arc<Shards> {
    let mut created = false;
    let s = agent.extension(|| {
        created = true;
        Shards::default()
    });
    if created {
        let weak = Arc::downgrade(&s);
        let agent_weak = agent.downgrade();
        let rt = tokio::runtime::Handle::try_current().ok();
        agent.on_worker_failed(move |f| {
            let Some(s) = weak.upgrade() else { return };
            let departures = worker_failed(&s, f);
            for (shard, change) in departures {
                let (agent_weak, s) = (agent_weak.clone(), Arc::clone(&s));
                let task = async move { submit_departure(&agent_weak, &s, shard, change).await };
                match &rt {
                    Some(rt) => {
                        rt.spawn(task);
                    }
                    None => futures::executor::block_on(task),
                }
            }
        });
    }
    s
}

/// A worker was declared failed: promotes the backups whose primary it was and returns the
/// departures to apply (through the lane) on the shards that decide them.
fn worker_failed(s: &Shards, f: &rpc_core::WorkerFailed) -> Vec<(u64, Change)> {
    let mut g = s.lock();
    g.failed
        .insert(f.rank, (f.incarnation, f.name.clone(), f.cause.clone()));
    let ShardsInner { shards, failed } = &mut *g;
    let mut out = Vec::new();
    for (&id, shard) in shards.iter_mut() {
        match shard.replica {
            Replica::Backup { primary } if primary == f.rank => {
                tracing::warn!(shard = id, primary = %f.name, "the shard's primary failed; its backup here serves the shard now");
                shard.replica = Replica::Sole;
            }
            Replica::Primary { backup } if backup == f.rank => {
                tracing::warn!(shard = id, backup = %f.name, "the shard's backup failed; the primary here goes on alone");
                shard.replica = Replica::Sole;
            }
            // The primary decides departures and forwards them (PS-5).
            Replica::Backup { .. } => continue,
            _ => {}
        }
        // Every failed trainer departs (after a promotion also those the primary did not get
        // to forward).
        for (t, r) in shard.trainer_ranks.iter().enumerate() {
            let Some((rank, _)) = r else { continue };
            if let Some((incarnation, worker, cause)) = failed.get(rank) {
                if shard.departed[t].is_none() {
                    out.push((
                        id,
                        Change::Depart {
                            trainer: t,
                            incarnation: *incarnation,
                            worker: worker.clone(),
                            cause: cause.clone(),
                        },
                    ));
                }
            }
        }
    }
    out
}

async fn submit_departure(agent: &WeakAgent, s: &Arc<Shards>, shard: u64, change: Change) {
    let Some(agent) = agent.upgrade() else { return };
    if let Err(e) = submit(&agent, s, shard, change).await {
        tracing::warn!(shard, cause = %e, "recording a trainer's departure failed");
    }
}

/// Applies `change` to shard `shard` here, then on its backup (PS-5); returns the trainer's
/// clock after it.
async fn submit(agent: &Agent, s: &Shards, shard: u64, change: Change) -> Result<u64, BoxError> {
    let lane = {
        let g = s.lock();
        let sh = g
            .shards
            .get(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} on `{}`", agent.name()))?;
        Arc::clone(&sh.lane)
    };
    let _turn = lane.lock().await;
    let (forward, clock, backup) = {
        let mut g = s.lock();
        let sh = g
            .shards
            .get_mut(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} on `{}`", agent.name()))?;
        let (changed, clock) = sh.apply(&change)?;
        // The backup repeats the change; a join at the step chosen here.
        let forward = changed.then(|| match change {
            Change::Join {
                trainer,
                rank,
                incarnation,
                ..
            } => Change::Join {
                trainer,
                rank,
                incarnation,
                at: clock,
            },
            other => other,
        });
        let backup = match sh.replica {
            Replica::Primary { backup } => Some(backup),
            _ => None,
        };
        (forward, clock, backup)
    };
    if let (Some(forward), Some(backup)) = (forward, backup) {
        replicate(agent, s, shard, backup, forward).await?;
    }
    Ok(clock)
}

/// Forwards `change` to the backup until it holds it, or until the group has declared the
/// backup failed (then the primary goes on alone).
async fn replicate(
    agent: &Agent,
    s: &Shards,
    shard: u64,
    backup: u32,
    change: Change,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + agent.rpc_timeout();
    loop {
        let e = match agent
            .rpc_async(backup, Replicate, (shard, change.clone()))
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let gone = matches!(e, RpcError::PeerFailed { .. } | RpcError::PeerLeft { .. })
            || !agent.is_live(backup).unwrap_or(true);
        if gone {
            let mut g = s.lock();
            if let Some(sh) = g.shards.get_mut(&shard) {
                if sh.replica == (Replica::Primary { backup }) {
                    tracing::warn!(shard, cause = %e, "the shard's backup failed; the primary goes on alone");
                    sh.replica = Replica::Sole;
                }
            }
            return Ok(());
        }
        // A refusal (the backup's view has this primary failed) or a lost connection: the
        // group's verdict ends the trainers' calls to a fenced primary; until then, retry.
        if !(transient(&e) || matches!(e, RpcError::Remote(_))) || Instant::now() >= deadline {
            return Err(format!("replicating shard {shard} to its backup failed: {e}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Errors after which the peer may still be alive (the detector decides).
fn transient(e: &RpcError) -> bool {
    matches!(
        e,
        RpcError::ConnectionLost { .. }
            | RpcError::Unreachable { .. }
            | RpcError::Transport { .. }
            | RpcError::DeadlineExceeded { .. }
    )
}

/// Starts serving shard `shard` on this worker: `params` with SGD at learning rate `lr`, for
/// `trainers` trainers (ranks of trainers are mapped to indices by the trainers themselves).
pub fn serve_shard(
    agent: &Agent,
    shard: u64,
    params: Vec<Tensor>,
    lr: f64,
    consistency: Consistency,
    trainers: usize,
) {
    serve_replica(
        agent,
        shard,
        params,
        lr,
        consistency,
        trainers,
        Replica::Sole,
    );
}

/// [`serve_shard`] as one copy of a replicated shard (PS-5): call it on the primary with
/// `Replica::Primary { backup }` and on the backup with `Replica::Backup { primary }`, with the
/// same `params`, before any trainer calls.
pub fn serve_replica(
    agent: &Agent,
    shard: u64,
    params: Vec<Tensor>,
    lr: f64,
    consistency: Consistency,
    trainers: usize,
    replica: Replica,
) {
    let s = Shard {
        params,
        pending: HashMap::new(),
        lr,
        consistency,
        clocks: vec![0; trainers],
        joined_at: vec![0; trainers],
        applied: vec![0; trainers],
        trainer_ranks: vec![None; trainers],
        departed: vec![None; trainers],
        max_staleness: 0,
        changed: watch::channel(0).0,
        replica,
        lane: Arc::default(),
    };
    let all = shards(agent);
    let mut g = all.lock();
    let mut s = s;
    // A peer already declared failed cannot hold the other copy.
    if let Replica::Primary { backup: r } | Replica::Backup { primary: r } = s.replica {
        if g.failed.contains_key(&r) {
            s.replica = Replica::Sole;
        }
    }
    g.shards.insert(shard, s);
}

/// Shard `shard`'s counters on this worker.
pub fn shard_stats(agent: &Agent, shard: u64) -> Option<ShardStats> {
    let m = shards(agent);
    let g = m.lock();
    g.shards.get(&shard).map(|s| ShardStats {
        max_staleness: s.max_staleness,
        clocks: s.clocks.clone(),
        applied: s.applied.clone(),
        replica: s.replica,
    })
}

/// Trainer → server: the shard's parameters for the trainer's step `clock`.
#[derive(Clone, Copy)]
pub(crate) struct Pull;

impl RemoteFn for Pull {
    const NAME: &'static str = "collectives::ps_pull";
    type Args = (u64, usize, u64);
    type Output = Vec<RTensor>;
    async fn call(
        cx: CallContext,
        (shard, trainer, clock): Self::Args,
    ) -> Result<Vec<RTensor>, BoxError> {
        let m = shards(cx.agent());
        let rank = cx.caller().id.0;
        let incarnation = cx.agent().incarnation_of(rank)?;
        loop {
            let mut rx = {
                let mut g = m.lock();
                let s = g
                    .shards
                    .get_mut(&shard)
                    .ok_or_else(|| format!("no parameter shard {shard} here"))?;
                s.check_trainer(trainer)?;
                // Known from its first call, so that its failure is its departure (PS-3).
                s.trainer_ranks[trainer].get_or_insert((rank, incarnation));
                // PS-3: only live trainers' clocks count (the caller is one).
                let min = s.min_live_clock(None).unwrap_or(clock);
                let ahead = clock.saturating_sub(min);
                if ahead <= s.consistency.bound() {
                    s.max_staleness = s.max_staleness.max(ahead);
                    return Ok(s.params.iter().cloned().map(RTensor).collect());
                }
                s.changed.subscribe()
            };
            // PS-1: wait for a push to move the slowest clock; the call's deadline bounds this.
            rx.changed().await.map_err(|_| "the shard was dropped")?;
        }
    }
}

/// Trainer → server: gradients for the trainer's step `clock`.
#[derive(Clone, Copy)]
pub(crate) struct Push;

impl RemoteFn for Push {
    const NAME: &'static str = "collectives::ps_push";
    type Args = (u64, usize, u64, Vec<RTensor>);
    type Output = ();
    async fn call(
        cx: CallContext,
        (shard, trainer, clock, grads): Self::Args,
    ) -> Result<(), BoxError> {
        let rank = cx.caller().id.0;
        let change = Change::Push {
            trainer,
            rank,
            clock,
            grads,
        };
        submit(cx.agent(), &shards(cx.agent()), shard, change).await?;
        Ok(())
    }
}

/// Trainer → server: a replacement trainer takes over trainer index `trainer` from step `at`
/// or later (PS-6); returns the step it starts at.
#[derive(Clone, Copy)]
pub(crate) struct Join;

impl RemoteFn for Join {
    const NAME: &'static str = "collectives::ps_join";
    type Args = (u64, usize, u64);
    type Output = u64;
    async fn call(cx: CallContext, (shard, trainer, at): Self::Args) -> Result<u64, BoxError> {
        let rank = cx.caller().id.0;
        let incarnation = cx.agent().incarnation_of(rank)?;
        let change = Change::Join {
            trainer,
            rank,
            incarnation,
            at,
        };
        submit(cx.agent(), &shards(cx.agent()), shard, change).await
    }
}

/// Primary → backup: one change of the shard, in the primary's order (PS-5).
pub(crate) struct Replicate;

impl RemoteFn for Replicate {
    const NAME: &'static str = "collectives::ps_replicate";
    type Args = (u64, Change);
    type Output = ();
    async fn call(cx: CallContext, (shard, change): Self::Args) -> Result<(), BoxError> {
        let m = shards(cx.agent());
        let from = cx.caller().id.0;
        let lane = {
            let g = m.lock();
            let s = g
                .shards
                .get(&shard)
                .ok_or_else(|| format!("no parameter shard {shard} here"))?;
            Arc::clone(&s.lane)
        };
        let _turn = lane.lock().await;
        let mut g = m.lock();
        let s = g
            .shards
            .get_mut(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} here"))?;
        match s.replica {
            Replica::Backup { primary } if primary == from => {}
            _ => {
                return Err(format!(
                    "`{}` does not hold a backup of shard {shard} for `{}` (it was declared \
                     failed, or this copy is not its backup)",
                    cx.agent().name(),
                    cx.caller().name
                )
                .into())
            }
        }
        s.apply(&change)?;
        Ok(())
    }
}

/// Where a trainer finds one shard.
#[derive(Clone, Debug)]
struct Route {
    server: u32,
    shard: u64,
    backup: Option<u32>,
}

/// A trainer's view of the sharded parameters.
#[derive(Clone, Debug)]
pub struct PsClient {
    agent: Agent,
    routes: Arc<Vec<Route>>,
    /// Per shard: whether calls go to the backup (the primary was declared failed).
    failed_over: Arc<Vec<AtomicBool>>,
    trainer: usize,
    acked: Arc<AtomicU64>,
}

impl PsClient {
    /// A client for trainer number `trainer` over `shards` (`(server rank, shard id)`).
    pub fn new(agent: &Agent, shards: Vec<(u32, u64)>, trainer: usize) -> Self {
        let routes: Vec<Route> = shards
            .into_iter()
            .map(|(server, shard)| Route {
                server,
                shard,
                backup: None,
            })
            .collect();
        Self {
            agent: agent.clone(),
            failed_over: Arc::new(routes.iter().map(|_| AtomicBool::new(false)).collect()),
            routes: Arc::new(routes),
            trainer,
            acked: Arc::default(),
        }
    }

    /// Names each shard's backup (the rank given to [`serve_replica`] as `Replica::Backup`'s
    /// host), in the order of the shards: calls fail over to it once the primary has been
    /// declared failed.
    pub fn with_backups(mut self, backups: impl IntoIterator<Item = Option<u32>>) -> Self {
        let mut routes = (*self.routes).clone();
        for (r, b) in routes.iter_mut().zip(backups) {
            r.backup = b;
        }
        self.routes = Arc::new(routes);
        self
    }

    /// How many pushes to a shard were acknowledged (each holds one shard's gradients).
    pub fn acked_pushes(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    /// Whether calls for shard number `i` (in the client's order) go to its backup now.
    pub fn failed_over(&self, i: usize) -> bool {
        self.failed_over
            .get(i)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Calls `f` on shard `i`'s server, failing over to its backup once the group has declared
    /// the primary failed (PS-5).
    async fn call<F: RemoteFn + Copy>(
        &self,
        i: usize,
        f: F,
        args: F::Args,
    ) -> Result<F::Output, RpcError>
    where
        F::Args: Clone,
    {
        let r = &self.routes[i];
        if !self.failed_over(i) {
            let e = match self.agent.rpc_async(r.server, f, args.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let Some(backup) = r.backup else {
                return Err(e);
            };
            if !self.primary_lost(r.server, &e).await {
                return Err(e);
            }
            tracing::warn!(shard = r.shard, primary = r.server, backup, cause = %e, "failing over to the shard's backup");
            self.failed_over[i].store(true, Ordering::Relaxed);
        }
        let backup = r.backup.expect("failed over only with a backup");
        self.agent.rpc_async(backup, f, args).await
    }

    /// Whether `e` from `server` means the group declared it failed (waiting, bounded by the
    /// call timeout, for the verdict after a lost connection).
    async fn primary_lost(&self, server: u32, e: &RpcError) -> bool {
        if matches!(e, RpcError::PeerFailed { .. } | RpcError::PeerLeft { .. }) {
            return true;
        }
        if !transient(e) {
            return false;
        }
        let deadline = Instant::now() + self.agent.rpc_timeout();
        while Instant::now() < deadline {
            if !self.agent.is_live(server).unwrap_or(true) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Every shard's parameters for step `clock` (waiting as the consistency mode requires).
    pub async fn pull(&self, clock: u64) -> Result<Vec<Vec<Tensor>>, RpcError> {
        let calls = (0..self.routes.len()).map(|i| {
            let shard = self.routes[i].shard;
            self.call(i, Pull, (shard, self.trainer, clock))
        });
        Ok(futures::future::try_join_all(calls)
            .await?
            .into_iter()
            .map(|v| v.into_iter().map(|t| t.0).collect())
            .collect())
    }

    /// Pushes step `clock`'s gradients, one list per shard.
    pub async fn push(&self, clock: u64, grads: Vec<Vec<Tensor>>) -> Result<(), RpcError> {
        let calls = grads.into_iter().enumerate().map(|(i, g)| {
            let shard = self.routes[i].shard;
            let g: Vec<RTensor> = g.into_iter().map(RTensor).collect();
            async move {
                self.call(i, Push, (shard, self.trainer, clock, g)).await?;
                self.acked.fetch_add(1, Ordering::Relaxed);
                Ok::<_, RpcError>(())
            }
        });
        futures::future::try_join_all(calls).await.map(|_| ())
    }

    /// A replacement trainer takes over this client's trainer index (whose previous holder
    /// was declared failed) on every shard (PS-6); returns the step to go on from: the
    /// earliest step one of the shards needs from this trainer index (a holder that died
    /// between its pushes to two shards left one shard a step ahead: that shard acknowledges
    /// the repeated step without applying it again, PS-4).
    pub async fn join(&self) -> Result<u64, RpcError> {
        let calls = (0..self.routes.len()).map(|i| {
            let shard = self.routes[i].shard;
            self.call(i, Join, (shard, self.trainer, 0))
        });
        let got = futures::future::try_join_all(calls).await?;
        Ok(got.into_iter().min().unwrap_or(0))
    }
}
