//! A parameter server: parameters sharded over server workers, trainers that pull parameters
//! and push gradients, servers that apply the optimizer (SGD) as gradients arrive.
//!
//! Consistency is one rule with three settings: a trainer's pull for its step `c` waits until
//! `c - min(trainer clocks) <= s`, where a trainer's clock is the number of steps it has
//! pushed. BSP is `s = 0` (every step waits for every trainer), SSP is a bound `s`, ASP never
//! waits. The server records the largest `c - min` it let through, so the bound is observable.
//!
//! - PS-1: a pull never proceeds with `c - min(clocks) > s` (the wait is bounded by the call's
//!   deadline; past it the pull fails instead of breaking the bound).
//! - PS-2: under BSP a step's gradients are applied together once every trainer has pushed
//!   that step, so every trainer's step `c` starts from the same parameters.
//! - PS-3: a trainer declared failed leaves the shard: its clock no longer holds the others
//!   back (the bound is over the live trainers' clocks, and a BSP step is applied once every
//!   live trainer has pushed it, with the gradients the departed one pushed before), and its
//!   later calls (a falsely suspected process that is still running) are refused, naming it.

use candle_core::Tensor;
use rpc_core::ext::AgentExt;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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

struct Shard {
    params: Vec<Tensor>,
    /// BSP: per step, which trainers pushed it and their gradients' sum, until every live
    /// trainer has.
    pending: HashMap<u64, (Vec<bool>, Vec<Tensor>)>,
    lr: f64,
    consistency: Consistency,
    clocks: Vec<u64>,
    /// The rank each trainer calls from (learned from its calls).
    trainer_ranks: Vec<Option<u32>>,
    /// Per trainer: `(worker name, cause)` once declared failed (PS-3).
    departed: Vec<Option<(String, String)>>,
    max_staleness: u64,
    changed: watch::Sender<u64>,
}

impl Shard {
    /// The slowest live trainer's clock (`None`: no trainer is left).
    fn min_live_clock(&self) -> Option<u64> {
        self.clocks
            .iter()
            .zip(&self.departed)
            .filter(|(_, d)| d.is_none())
            .map(|(c, _)| *c)
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

    fn apply(&mut self, grads: Vec<Tensor>) -> candle_core::Result<()> {
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
            let complete = self.pending[&c]
                .0
                .iter()
                .zip(&self.departed)
                .all(|(pushed, d)| *pushed || d.is_some());
            if !complete {
                break;
            }
            if let Some((_, g)) = self.pending.remove(&c) {
                if !g.is_empty() {
                    self.apply(g)?;
                }
            }
        }
        Ok(())
    }
}

#[derive(Default)]
struct Shards(Mutex<HashMap<u64, Shard>>);

fn shards(agent: &Agent) -> Arc<Shards> {
    let mut created = false;
    let s = agent.extension(|| {
        created = true;
        Shards::default()
    });
    if created {
        let weak = Arc::downgrade(&s);
        agent.on_worker_failed(move |f| {
            let Some(s) = weak.upgrade() else { return };
            let mut g = s.0.lock().unwrap_or_else(|p| p.into_inner());
            for (id, shard) in g.iter_mut() {
                let t = shard.trainer_ranks.iter().position(|r| *r == Some(f.rank));
                if let Some(t) = t {
                    if shard.departed[t].is_none() {
                        tracing::warn!(shard = id, trainer = t, worker = %f.name, "a trainer left the parameter shard");
                        shard.departed[t] = Some((f.name.clone(), f.cause.clone()));
                        if let Err(e) = shard.settle() {
                            tracing::warn!(shard = id, cause = %e, "applying a step's gradients failed");
                        }
                        shard.changed.send_modify(|v| *v += 1);
                    }
                }
            }
        });
    }
    s
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
    let s = Shard {
        params,
        pending: HashMap::new(),
        lr,
        consistency,
        clocks: vec![0; trainers],
        trainer_ranks: vec![None; trainers],
        departed: vec![None; trainers],
        max_staleness: 0,
        changed: watch::channel(0).0,
    };
    shards(agent)
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(shard, s);
}

/// The largest staleness (`c - min(clocks)`) shard `shard` let a pull proceed with, and the
/// trainers' clocks.
pub fn shard_stats(agent: &Agent, shard: u64) -> Option<(u64, Vec<u64>)> {
    let m = shards(agent);
    let m = m.0.lock().unwrap_or_else(|p| p.into_inner());
    m.get(&shard).map(|s| (s.max_staleness, s.clocks.clone()))
}

/// Trainer → server: the shard's parameters for the trainer's step `clock`.
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
        loop {
            let mut rx = {
                let mut g = m.0.lock().unwrap_or_else(|p| p.into_inner());
                let s = g
                    .get_mut(&shard)
                    .ok_or_else(|| format!("no parameter shard {shard} here"))?;
                s.check_trainer(trainer)?;
                s.trainer_ranks[trainer] = Some(cx.caller().id.0);
                // PS-3: only live trainers' clocks count (the caller is one).
                let min = s.min_live_clock().unwrap_or(clock);
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
pub(crate) struct Push;

impl RemoteFn for Push {
    const NAME: &'static str = "collectives::ps_push";
    type Args = (u64, usize, u64, Vec<RTensor>);
    type Output = ();
    async fn call(
        cx: CallContext,
        (shard, trainer, clock, grads): Self::Args,
    ) -> Result<(), BoxError> {
        let m = shards(cx.agent());
        let mut g = m.0.lock().unwrap_or_else(|p| p.into_inner());
        let s = g
            .get_mut(&shard)
            .ok_or_else(|| format!("no parameter shard {shard} here"))?;
        if grads.len() != s.params.len() {
            return Err(format!(
                "{} gradients for {} parameters",
                grads.len(),
                s.params.len()
            )
            .into());
        }
        for (p, gr) in s.params.iter().zip(&grads) {
            if p.dims() != gr.dims() {
                return Err(format!(
                    "gradient of shape {:?} for a parameter of shape {:?}",
                    gr.dims(),
                    p.dims()
                )
                .into());
            }
        }
        s.check_trainer(trainer)?;
        s.trainer_ranks[trainer] = Some(cx.caller().id.0);
        let grads: Vec<Tensor> = grads.into_iter().map(|g| g.0).collect();
        if s.consistency == Consistency::Bsp {
            // Every trainer pulled step `clock` from the same state: apply the step's
            // gradients together, once every live trainer's have arrived.
            let trainers = s.clocks.len();
            let entry = s
                .pending
                .entry(clock)
                .or_insert_with(|| (vec![false; trainers], Vec::new()));
            if entry.0[trainer] {
                return Err(format!("trainer {trainer} pushed step {clock} twice").into());
            }
            entry.0[trainer] = true;
            entry.1 = if entry.1.is_empty() {
                grads
            } else {
                entry
                    .1
                    .iter()
                    .zip(&grads)
                    .map(|(a, b)| a + b)
                    .collect::<candle_core::Result<_>>()?
            };
            s.settle()?;
        } else {
            s.apply(grads)?;
        }
        let c = s.clocks.get_mut(trainer).ok_or("unknown trainer")?;
        *c = (*c).max(clock + 1);
        s.changed.send_modify(|v| *v += 1);
        Ok(())
    }
}

/// A trainer's view of the sharded parameters.
#[derive(Clone, Debug)]
pub struct PsClient {
    agent: Agent,
    /// `(server rank, shard id)` per shard.
    shards: Vec<(u32, u64)>,
    trainer: usize,
}

impl PsClient {
    /// A client for trainer number `trainer` over `shards` (`(server rank, shard id)`).
    pub fn new(agent: &Agent, shards: Vec<(u32, u64)>, trainer: usize) -> Self {
        Self {
            agent: agent.clone(),
            shards,
            trainer,
        }
    }

    /// Every shard's parameters for step `clock` (waiting as the consistency mode requires).
    pub async fn pull(&self, clock: u64) -> Result<Vec<Vec<Tensor>>, rpc_core::RpcError> {
        let calls = self.shards.iter().map(|&(server, shard)| {
            self.agent
                .rpc_async(server, Pull, (shard, self.trainer, clock))
        });
        Ok(futures::future::try_join_all(calls)
            .await?
            .into_iter()
            .map(|v| v.into_iter().map(|t| t.0).collect())
            .collect())
    }

    /// Pushes step `clock`'s gradients, one list per shard.
    pub async fn push(
        &self,
        clock: u64,
        grads: Vec<Vec<Tensor>>,
    ) -> Result<(), rpc_core::RpcError> {
        let calls = self.shards.iter().zip(grads).map(|(&(server, shard), g)| {
            self.agent.rpc_async(
                server,
                Push,
                (
                    shard,
                    self.trainer,
                    clock,
                    g.into_iter().map(RTensor).collect(),
                ),
            )
        });
        futures::future::try_join_all(calls).await.map(|_| ())
    }
}
