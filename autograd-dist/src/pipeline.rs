//! Pipeline parallelism: a model cut into stages ([`RemoteModule`]s on different workers),
//! each batch cut into micro-batches, and a [`Schedule`] that keeps the stages busy together.
//!
//! One master drives the pipeline; the stages talk to each other directly. For each stage the
//! master walks that stage's list of actions (forward or backward of one micro-batch, in the
//! schedule's order) and sends it the next action once the one before has finished and its
//! input exists:
//! - forward of micro-batch `j` on stage `s` fetches stage `s - 1`'s output for `j` from that
//!   worker (an `RRef`'s `to_here`, worker to worker, never through the master), runs the
//!   module, keeps its input and output (the saved activations) and keeps the output in an
//!   `RRef` for stage `s + 1`; the last stage computes the loss instead, where the logits are;
//! - backward of `j` on stage `s` fetches the gradient of its output from stage `s + 1` (the
//!   last stage starts from its loss), backpropagates through its module, adds its parameters'
//!   gradients to the step's [`DistContext`] on its worker (so one
//!   [`DistributedOptimizer`](crate::DistributedOptimizer) step follows, as after any
//!   distributed backward), drops the saved activations, and keeps its input's gradient for
//!   stage `s - 1`.
//!
//! The loss of micro-batch `j` is its rows' share of the whole batch's mean, so the gradients
//! summed over micro-batches are the whole batch's, up to floating-point summation order.
//!
//! GPipe runs every forward, then every backward: a stage keeps the activations of all `m`
//! micro-batches. 1F1B starts `p - s - 1` forwards on stage `s` of `p`, then alternates one
//! forward and one backward: stage `s` keeps at most `p - s`. Both leave the same fraction of
//! the step idle when stages take equal time, `(p - 1) / (m + p - 1)` (the bubble).

use std::sync::Arc;

use candle_core::Tensor;
use futures::StreamExt;
use rpc_core::ext::with_call_meta;
use rpc_core::Agent;
use rref::RRef;
use serde::{Deserialize, Serialize};

use crate::dist_optim::Parameter;
use crate::engine::DistContext;
use crate::error::AutogradError;
use crate::module::{Module, RemoteModule};
use crate::record::{container, CTX_KEY};
use crate::stage::{now_us, RunReply, RunReq, StageOps};
pub use crate::stage::{Action, Loss};
use crate::tensor::RTensor;

/// The order in which each stage runs the forward and backward passes of a step's
/// micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// Every forward, then every backward (GPipe): each stage keeps `m` micro-batches of
    /// activations.
    GPipe,
    /// One forward, one backward in the steady state (PipeDream-Flush's 1F1B): stage `s` of `p`
    /// keeps at most `p - s` micro-batches of activations.
    OneFOneB,
}

impl Schedule {
    /// Stage `stage`'s actions, in order, for `m` micro-batches over `stages` stages.
    pub fn actions(self, stage: usize, stages: usize, m: usize) -> Vec<Action> {
        match self {
            Schedule::GPipe => (0..m)
                .map(Action::Forward)
                .chain((0..m).map(Action::Backward))
                .collect(),
            Schedule::OneFOneB => {
                let warmup = (stages - stage - 1).min(m);
                let mut v: Vec<Action> = (0..warmup).map(Action::Forward).collect();
                for k in 0..m {
                    if warmup + k < m {
                        v.push(Action::Forward(warmup + k));
                    }
                    v.push(Action::Backward(k));
                }
                v
            }
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Self::GPipe),
            "1f1b" => Ok(Self::OneFOneB),
            other => Err(format!("unknown schedule {other:?} (gpipe or 1f1b)")),
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
        })
    }
}

/// A stage of a [`Pipeline`]: a remote module of any type.
#[derive(Clone)]
pub struct Stage(Arc<dyn StageOps>);

impl<M: Module> From<RemoteModule<M>> for Stage {
    fn from(m: RemoteModule<M>) -> Self {
        Stage(Arc::new(m))
    }
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stage(on `{}`)", self.0.worker())
    }
}

/// A pass of one micro-batch on one stage, as the stage timed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageEvent {
    /// The stage's index.
    pub stage: usize,
    /// Forward or backward, and of which micro-batch.
    pub action: Action,
    /// Start, microseconds since the Unix epoch on the stage's clock.
    pub start_us: u64,
    /// End, likewise.
    pub end_us: u64,
}

/// What one [`Pipeline::step`] did.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// The whole batch's loss (the sum of the micro-batches').
    pub loss: f64,
    /// Every pass, in the order the master learnt of them.
    pub events: Vec<StageEvent>,
    /// The most micro-batches whose activations each stage kept at once.
    pub max_live_activations: Vec<usize>,
    /// When the step started and ended, microseconds since the Unix epoch on the master.
    pub span_us: (u64, u64),
}

impl StepReport {
    /// The fraction of the step the stages were idle: `1 - busy / (stages * step time)`.
    pub fn bubble(&self) -> f64 {
        let stages = self.max_live_activations.len().max(1) as f64;
        let total = self.span_us.1.saturating_sub(self.span_us.0) as f64;
        if total <= 0.0 {
            return 0.0;
        }
        let busy: u64 = self
            .events
            .iter()
            .map(|e| e.end_us.saturating_sub(e.start_us))
            .sum();
        (1.0 - busy as f64 / (stages * total)).max(0.0)
    }
}

/// The idle fraction of a pipeline of `stages` equal stages over `m` micro-batches:
/// `(p - 1) / (m + p - 1)`.
pub fn bubble_theory(stages: usize, m: usize) -> f64 {
    (stages as f64 - 1.0) / (m + stages - 1).max(1) as f64
}

/// A model cut into stages on (usually) different workers, trained on micro-batches.
///
/// ```no_run
/// # async fn demo(agent: rpc_core::Agent, s1: autograd_dist::Stage, s2: autograd_dist::Stage,
/// #     x: candle_core::Tensor, y: candle_core::Tensor) -> Result<(), autograd_dist::AutogradError> {
/// use autograd_dist::{DistributedOptimizer, Loss, OptimizerKind, Pipeline, Schedule};
/// let pipe = Pipeline::new(&agent, vec![s1, s2], 8, Schedule::OneFOneB, Loss::CrossEntropy)?;
/// let opt = DistributedOptimizer::new(&agent, OptimizerKind::adam(1e-3), pipe.remote_parameters().await?)?;
/// let ctx = autograd_dist::context(&agent);
/// let report = pipe.step(&ctx, &x, &y).await?; // every forward and backward
/// opt.step(&ctx).await?; // one update with the gradients of all 8 micro-batches
/// # Ok(()) }
/// ```
pub struct Pipeline {
    agent: Agent,
    stages: Vec<Stage>,
    micro_batches: usize,
    schedule: Schedule,
    loss: Loss,
    id: u64,
    steps: std::sync::atomic::AtomicU64,
    /// A step failed: the stages may hold what it left.
    failed: std::sync::atomic::AtomicBool,
}

impl Pipeline {
    /// The failure to report of a step in which `failed` stages failed (in the order their
    /// calls ended, at least one): the stage whose own worker the group declared failed, the
    /// others having failed because of it (a neighbour's hand-off to a dead stage can fail
    /// before the master's call to that stage does); else the first to end.
    fn cause(&self, mut failed: Vec<AutogradError>) -> AutogradError {
        let dead = failed.iter().position(|e| match e {
            AutogradError::Stage { stage, .. } => {
                let rank = self.stages[*stage].0.rank();
                self.agent.is_live(rank).is_ok_and(|live| !live)
            }
            _ => false,
        });
        failed.swap_remove(dead.unwrap_or(0))
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stages)
            .field("micro_batches", &self.micro_batches)
            .field("schedule", &self.schedule)
            .finish()
    }
}

impl Pipeline {
    /// A pipeline over `stages` (in order: the first takes the batch, the last's output goes
    /// into `loss`), splitting each batch into `micro_batches`, run in `schedule`'s order.
    pub fn new(
        agent: &Agent,
        stages: Vec<Stage>,
        micro_batches: usize,
        schedule: Schedule,
        loss: Loss,
    ) -> Result<Self, AutogradError> {
        if stages.is_empty() || micro_batches == 0 {
            return Err(AutogradError::State(format!(
                "a pipeline needs at least one stage and one micro-batch ({} stages, {} \
                 micro-batches)",
                stages.len(),
                micro_batches
            )));
        }
        // Unique across this worker's incarnations: a replacement's pipelines never meet
        // what its predecessor's left on the stages.
        let id = container(agent).next_id();
        Ok(Self {
            agent: agent.clone(),
            stages,
            micro_batches,
            schedule,
            loss,
            id,
            steps: std::sync::atomic::AtomicU64::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The number of micro-batches per batch.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// The worker each stage lives on.
    pub fn workers(&self) -> Vec<String> {
        self.stages.iter().map(|s| s.0.worker()).collect()
    }

    /// Every stage's parameters, stage by stage, for a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer).
    pub async fn remote_parameters(&self) -> Result<Vec<RRef<Parameter>>, AutogradError> {
        let all =
            futures::future::try_join_all(self.stages.iter().map(|s| s.0.parameters())).await?;
        Ok(all.into_iter().flatten().collect())
    }

    /// Row ranges of the micro-batches of a batch of `rows` rows (sizes differ by at most 1).
    /// Training needs `rows >= micro_batches`; evaluation cuts fewer rows into fewer parts.
    fn splits(&self, rows: usize, training: bool) -> Result<Vec<(usize, usize)>, AutogradError> {
        let m = if training {
            self.micro_batches
        } else {
            self.micro_batches.min(rows).max(1)
        };
        if rows < m {
            return Err(AutogradError::State(format!(
                "a batch of {rows} rows cannot be cut into {m} micro-batches"
            )));
        }
        let (base, extra) = (rows / m, rows % m);
        let mut at = 0;
        Ok((0..m)
            .map(|j| {
                let len = base + usize::from(j < extra);
                let r = (at, len);
                at += len;
                r
            })
            .collect())
    }

    /// One training step's passes: the forward and backward of every micro-batch of `input`
    /// (rows along dimension 0) against `targets`, in the schedule's order. The gradients of
    /// every stage's parameters accumulate in `ctx` on the stage's worker; step a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer) with `ctx` next. Fails with the
    /// first stage that failed, naming its worker, the pass and the micro-batch.
    pub async fn step(
        &self,
        ctx: &DistContext,
        input: &Tensor,
        targets: &Tensor,
    ) -> Result<StepReport, AutogradError> {
        let rows = input.dim(0)?;
        if targets.dim(0)? != rows {
            return Err(AutogradError::State(format!(
                "{} targets for a batch of {rows} rows",
                targets.dim(0)?
            )));
        }
        self.loss
            .check_targets(targets)
            .map_err(AutogradError::State)?;
        let splits = self.splits(rows, true)?;
        // The context's release reaches every stage (it exchanged no tensor with them).
        container(&self.agent).with(ctx.id(), |st| {
            st.peers.extend(self.stages.iter().map(|s| s.0.rank()));
        });
        let step = self
            .steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start = now_us();
        let result = with_call_meta(
            CTX_KEY,
            None,
            self.run(step, input, Some((ctx.id(), targets)), &splits),
        )
        .await;
        let out = result?;
        Ok(StepReport {
            loss: out.loss,
            events: out.events,
            max_live_activations: out.live,
            span_us: (start, now_us()),
        })
    }

    /// The last stage's output for `input`, computed micro-batch by micro-batch through the
    /// stages (no gradients; a batch of fewer rows than micro-batches is cut into fewer).
    pub async fn forward(&self, input: &Tensor) -> Result<Tensor, AutogradError> {
        let splits = self.splits(input.dim(0)?, false)?;
        let step = self
            .steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = with_call_meta(CTX_KEY, None, self.run(step, input, None, &splits)).await?;
        Ok(Tensor::cat(&out.outputs, 0)?)
    }

    /// Runs every stage's actions for one step. `train`: the context and the targets.
    async fn run(
        &self,
        step: u64,
        input: &Tensor,
        train: Option<(u64, &Tensor)>,
        splits: &[(usize, usize)],
    ) -> Result<Outcome, AutogradError> {
        let (p, m) = (self.stages.len(), splits.len());
        let schedule = match train {
            Some(_) => self.schedule,
            None => Schedule::GPipe,
        };
        let part = |t: &Tensor| -> candle_core::Result<Vec<RTensor>> {
            splits
                .iter()
                .map(|&(at, len)| t.narrow(0, at, len).map(RTensor))
                .collect()
        };
        let mut calls = futures::stream::FuturesUnordered::new();
        for (s, stage) in self.stages.iter().enumerate() {
            let actions = schedule
                .actions(s, p, m)
                .into_iter()
                .filter(|a| train.is_some() || matches!(a, Action::Forward(_)))
                .collect();
            let loss = match train {
                Some((_, targets)) if s + 1 == p => Some((
                    self.loss,
                    part(targets)?,
                    splits.iter().map(|s| s.1 as u64).sum(),
                )),
                _ => None,
            };
            let req = RunReq {
                pipe: self.id,
                stage: s as u32,
                step,
                actions,
                data: if s == 0 { part(input)? } else { Vec::new() },
                loss,
                ctx: train.map(|t| t.0),
                prev: s.checked_sub(1).map(|q| self.stages[q].0.rank()),
                next: self.stages.get(s + 1).map(|n| n.0.rank()),
            };
            let call = stage.0.run(req);
            calls.push(async move { (s, call.await) });
        }
        let mut replies: Vec<Option<RunReply>> = (0..p).map(|_| None).collect();
        let mut failed: Vec<AutogradError> = Vec::new();
        while let Some((s, r)) = calls.next().await {
            match r {
                Ok(reply) => replies[s] = Some(reply),
                Err(e) => {
                    let first = failed.is_empty();
                    failed.push(AutogradError::Stage {
                        stage: s,
                        worker: self.stages[s].0.worker(),
                        source: Box::new(e),
                    });
                    if !first {
                        continue;
                    }
                    // The other stages stop waiting for this one.
                    let forgets = self
                        .stages
                        .iter()
                        .enumerate()
                        .filter(|(q, _)| *q != s)
                        .map(|(_, st)| st.0.forget(self.id, Some(step)));
                    for r in futures::future::join_all(forgets).await {
                        if let Err(e) = r {
                            tracing::debug!(cause = %e, "a stage could not be told to stop");
                        }
                    }
                }
            }
        }
        if !failed.is_empty() {
            self.failed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(self.cause(failed));
        }
        let mut out = Outcome {
            loss: 0.0,
            events: Vec::new(),
            live: Vec::with_capacity(p),
            outputs: Vec::new(),
        };
        for (s, reply) in replies.into_iter().enumerate() {
            let reply = reply.expect("every stage answered");
            let actions = schedule
                .actions(s, p, m)
                .into_iter()
                .filter(|a| train.is_some() || matches!(a, Action::Forward(_)));
            for (action, (start_us, end_us)) in actions.zip(reply.spans) {
                out.events.push(StageEvent {
                    stage: s,
                    action,
                    start_us,
                    end_us,
                });
            }
            out.live.push(reply.live as usize);
            if s + 1 == p {
                out.loss = reply.losses.iter().sum();
                out.outputs = reply.outputs.into_iter().map(|t| t.0).collect();
            }
        }
        Ok(out)
    }
}

/// What [`Pipeline::run`] gives back.
struct Outcome {
    loss: f64,
    events: Vec<StageEvent>,
    live: Vec<usize>,
    outputs: Vec<Tensor>,
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // What a failed step left on the stages goes (a completed step leaves nothing).
        if !self.failed.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let forgets: Vec<_> = self
            .stages
            .iter()
            .map(|s| s.0.forget(self.id, None))
            .collect();
        self.agent.runtime().spawn(async move {
            for f in forgets {
                if let Err(e) = f.await {
                    tracing::debug!(cause = %e, "pipeline stage state not dropped");
                }
            }
        });
    }
}
