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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{DType, Tensor, Var, D};
use futures::channel::oneshot;
use futures::future::BoxFuture;
use rpc_core::ext::{with_call_meta, AgentExt};
use rpc_core::{Agent, BoxError};
use rref::RRef;
use serde::{Deserialize, Serialize};

use crate::dist_optim::Parameter;
use crate::engine::DistContext;
use crate::error::AutogradError;
use crate::module::{Module, RemoteModule};
use crate::record::{container, CTX_KEY};
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

/// One entry of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// The forward pass of a micro-batch.
    Forward(usize),
    /// Its backward pass.
    Backward(usize),
}

/// The loss the last stage computes from its output and the targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Loss {
    /// Cross-entropy of logits `[rows, classes]` against class indices `[rows]` (u32).
    CrossEntropy,
    /// Squared error against targets of the output's shape, summed over each row.
    SquaredError,
}

impl Loss {
    /// The loss of `rows` rows of a batch of `batch` rows: the sum over these rows divided by
    /// `batch` (the micro-batches' losses add up to the whole batch's mean).
    pub fn compute(
        self,
        output: &Tensor,
        targets: &Tensor,
        batch: usize,
    ) -> candle_core::Result<Tensor> {
        let scale = 1.0 / batch as f64;
        match self {
            Loss::CrossEntropy => {
                let max = output.max_keepdim(D::Minus1)?.detach();
                let shifted = output.broadcast_sub(&max)?;
                let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
                let logp = shifted.broadcast_sub(&lse)?;
                let idx = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
                logp.gather(&idx, 1)?.sum_all()?.affine(-scale, 0.0)
            }
            Loss::SquaredError => {
                let d = output.sub(&targets.to_dtype(output.dtype())?)?;
                d.sqr()?.sum_all()?.affine(scale, 0.0)
            }
        }
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

/// What a [`Pipeline`] needs of a stage (implemented by every [`RemoteModule`]).
pub(crate) trait StageOps: Send + Sync + 'static {
    fn worker(&self) -> String;
    fn rank(&self) -> u32;
    fn forward(&self, req: ForwardReq) -> BoxFuture<'static, Result<ForwardReply, AutogradError>>;
    fn backward(
        &self,
        req: BackwardReq,
    ) -> BoxFuture<'static, Result<BackwardReply, AutogradError>>;
    fn forget(&self, pipe: u64) -> BoxFuture<'static, Result<(), AutogradError>>;
    fn parameters(&self) -> BoxFuture<'static, Result<Vec<RRef<Parameter>>, AutogradError>>;
}

/// Where a stage's forward input comes from.
#[derive(Serialize, Deserialize)]
pub(crate) enum StageInput {
    /// The batch itself (first stage).
    Data(RTensor),
    /// The previous stage's output, fetched from its worker.
    Prev(RRef<RTensor>),
}

/// What a stage does with its forward output.
#[derive(Serialize, Deserialize)]
pub(crate) enum Finish {
    /// Keeps it in an `RRef` for the next stage.
    Pass,
    /// Computes the loss against `targets`, `batch` rows in the whole batch (last stage).
    Loss {
        loss: Loss,
        targets: RTensor,
        batch: u64,
    },
    /// Sends it back (last stage, evaluation).
    Return,
}

/// A stage's forward of one micro-batch.
#[derive(Serialize, Deserialize)]
pub(crate) struct ForwardReq {
    pub pipe: u64,
    pub stage: u32,
    pub step: u64,
    pub mb: u32,
    pub input: StageInput,
    pub finish: Finish,
    /// Keep activations for a backward (training).
    pub train: bool,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct ForwardReply {
    pub out: Option<RRef<RTensor>>,
    pub loss: Option<f64>,
    pub value: Option<RTensor>,
    pub span: (u64, u64),
    pub live: u32,
}

/// A stage's backward of one micro-batch.
#[derive(Serialize, Deserialize)]
pub(crate) struct BackwardReq {
    pub pipe: u64,
    pub stage: u32,
    pub step: u64,
    pub mb: u32,
    /// The gradient of the output, kept by the next stage (`None` on the last stage).
    pub grad: Option<RRef<RTensor>>,
    /// The context the parameters' gradients accumulate in.
    pub ctx: u64,
    /// Keep the input's gradient for the previous stage.
    pub input_grad: bool,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct BackwardReply {
    pub input_grad: Option<RRef<RTensor>>,
    pub span: (u64, u64),
    pub live: u32,
}

/// A micro-batch's saved activations on its stage.
struct Saved {
    /// The input as a leaf variable (`None` for the batch itself).
    input: Option<Tensor>,
    /// The output (the loss on the last stage), with its graph.
    output: Tensor,
}

/// The saved activations of one pipeline's stage: those of one step, by micro-batch.
#[derive(Default)]
struct StepSaved {
    step: u64,
    saved: HashMap<u32, Saved>,
}

/// Every pipeline's stages on this worker, by pipeline id and stage index.
#[derive(Default)]
struct StageTables(Mutex<HashMap<(u64, u32), StepSaved>>);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A stage's forward, on its worker.
pub(crate) async fn stage_forward<M: Module>(
    agent: &Agent,
    module: &M,
    req: ForwardReq,
) -> Result<ForwardReply, BoxError> {
    let input = match req.input {
        StageInput::Data(t) => t.0,
        StageInput::Prev(r) => r.to_here().await?.0,
    };
    let start = now_us();
    let leaf = if req.train
        && matches!(
            input.dtype(),
            DType::F16 | DType::BF16 | DType::F32 | DType::F64
        ) {
        Some(Var::from_tensor(&input)?.as_tensor().clone())
    } else {
        None
    };
    let y = module.forward(leaf.as_ref().unwrap_or(&input))?;
    let mut reply = ForwardReply {
        out: None,
        loss: None,
        value: None,
        span: (start, 0),
        live: 0,
    };
    let saved = match req.finish {
        Finish::Pass => {
            reply.out = Some(RRef::new(agent, RTensor(y.detach())));
            y
        }
        Finish::Loss {
            loss,
            targets,
            batch,
        } => {
            let l = loss.compute(&y, &targets.0, batch as usize)?;
            reply.loss = Some(l.to_dtype(DType::F64)?.to_scalar::<f64>()?);
            l
        }
        Finish::Return => {
            reply.value = Some(RTensor(y.detach()));
            y
        }
    };
    if req.train {
        let tables = agent.extension(StageTables::default);
        let mut t = lock(&tables.0);
        let table = t.entry((req.pipe, req.stage)).or_default();
        if table.step != req.step {
            // A new step: whatever an earlier, failed step left goes.
            table.step = req.step;
            table.saved.clear();
        }
        table.saved.insert(
            req.mb,
            Saved {
                input: leaf,
                output: saved,
            },
        );
        reply.live = table.saved.len() as u32;
    }
    reply.span.1 = now_us();
    Ok(reply)
}

/// A stage's backward, on its worker.
pub(crate) async fn stage_backward<M: Module>(
    agent: &Agent,
    module: &M,
    req: BackwardReq,
) -> Result<BackwardReply, BoxError> {
    let grad = match &req.grad {
        Some(r) => Some(r.to_here().await?.0),
        None => None,
    };
    let start = now_us();
    let tables = agent.extension(StageTables::default);
    let (saved, live) = {
        let mut t = lock(&tables.0);
        let entry = t
            .get_mut(&(req.pipe, req.stage))
            .filter(|t| t.step == req.step)
            .and_then(|t| t.saved.remove(&req.mb).map(|s| (s, t.saved.len())));
        entry.ok_or_else(|| {
            format!(
                "no saved activations of micro-batch {} of step {} here (forward not run, or \
                 backward run twice)",
                req.mb, req.step
            )
        })?
    };
    let root = match grad {
        None => saved.output.sum_all()?,
        Some(g) => {
            let g = g
                .to_device(saved.output.device())?
                .to_dtype(saved.output.dtype())?;
            (&saved.output * g)?.sum_all()?
        }
    };
    let grads = root.backward()?;
    drop(root);
    let params = module.parameters();
    container(agent).with(req.ctx, |st| -> candle_core::Result<()> {
        for v in &params {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            let acc = match st.grads.remove(&v.id()) {
                Some((_, old)) => (old + g)?,
                None => g.clone(),
            };
            st.grads.insert(v.id(), (v.as_tensor().clone(), acc));
        }
        Ok(())
    })?;
    let input_grad = match (&saved.input, req.input_grad) {
        (Some(x), true) => {
            let g = grads.get(x).cloned().map_or_else(|| x.zeros_like(), Ok)?;
            Some(RRef::new(agent, RTensor(g)))
        }
        _ => None,
    };
    drop((grads, saved));
    Ok(BackwardReply {
        input_grad,
        span: (start, now_us()),
        live: live as u32,
    })
}

/// Drops what pipeline `pipe` saved on this worker.
pub(crate) fn stage_forget(agent: &Agent, pipe: u64) {
    let tables = agent.extension(StageTables::default);
    lock(&tables.0).retain(|k, _| k.0 != pipe);
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

/// Why a stage's driver on the master stopped.
#[derive(Debug)]
enum DriverError {
    /// Its stage failed.
    Stage(AutogradError),
    /// Another stage it waits for failed (that one reports).
    Upstream,
}

impl From<candle_core::Error> for DriverError {
    fn from(e: candle_core::Error) -> Self {
        Self::Stage(AutogradError::Candle(e))
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
        let c = container(agent);
        let id = (u64::from(agent.rank()) << 48)
            | c.next_ctx
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            agent: agent.clone(),
            stages,
            micro_batches,
            schedule,
            loss,
            id,
            steps: std::sync::atomic::AtomicU64::new(0),
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

    /// Drives every stage through its actions. `train`: the context and the targets.
    async fn run(
        &self,
        step: u64,
        input: &Tensor,
        train: Option<(u64, &Tensor)>,
        splits: &[(usize, usize)],
    ) -> Result<Outcome, AutogradError> {
        let (p, m) = (self.stages.len(), splits.len());
        let run = StepRun {
            pipe: self,
            step,
            input,
            train,
            splits,
            outs: Handoffs::new(p * m),
            grads: Handoffs::new(p * m),
            events: Mutex::new(Vec::new()),
            losses: Mutex::new(vec![0f64; m]),
            outputs: Mutex::new(vec![None; m]),
        };
        // Every driver runs to its end: a failed stage closes every hand-off, so the others
        // stop waiting (`Upstream`) instead of hanging; the error reported is the stage's own.
        let results = futures::future::join_all((0..p).map(|s| run.drive(s))).await;
        let mut live = Vec::with_capacity(p);
        let (mut first, mut upstream) = (None, false);
        for r in results {
            live.push(*r.as_ref().unwrap_or(&0));
            match r {
                Ok(_) => {}
                Err(DriverError::Stage(e)) => {
                    first.get_or_insert(e);
                }
                Err(DriverError::Upstream) => upstream = true,
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        if upstream {
            return Err(AutogradError::State(
                "a pipeline stage stopped waiting for another that failed".into(),
            ));
        }
        let losses = into_inner(run.losses);
        let outputs = into_inner(run.outputs);
        Ok(Outcome {
            loss: losses.iter().sum(),
            events: into_inner(run.events),
            live,
            outputs: outputs.into_iter().flatten().collect(),
        })
    }
}

/// What [`Pipeline::run`] gives back.
struct Outcome {
    loss: f64,
    events: Vec<StageEvent>,
    live: Vec<usize>,
    outputs: Vec<Tensor>,
}

/// One reference per (stage, micro-batch), handed from the driver of the stage that made it
/// to the driver of the stage that takes it.
struct Handoffs {
    tx: Vec<Mutex<Option<oneshot::Sender<RRef<RTensor>>>>>,
    rx: Vec<Mutex<Option<oneshot::Receiver<RRef<RTensor>>>>>,
}

impl Handoffs {
    fn new(n: usize) -> Self {
        let (tx, rx) = (0..n)
            .map(|_| {
                let (t, r) = oneshot::channel();
                (Mutex::new(Some(t)), Mutex::new(Some(r)))
            })
            .unzip();
        Self { tx, rx }
    }

    fn give(&self, i: usize, r: RRef<RTensor>) {
        if let Some(tx) = lock(&self.tx[i]).take() {
            let _ = tx.send(r);
        }
    }

    async fn take(&self, i: usize) -> Result<RRef<RTensor>, DriverError> {
        let rx = lock(&self.rx[i]).take().ok_or(DriverError::Upstream)?;
        rx.await.map_err(|_| DriverError::Upstream)
    }

    /// Wakes every waiting taker with `Upstream`.
    fn close(&self) {
        for tx in &self.tx {
            lock(tx).take();
        }
    }
}

fn into_inner<T>(m: Mutex<T>) -> T {
    m.into_inner().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The state of one [`Pipeline::run`], shared by its stages' drivers.
struct StepRun<'a> {
    pipe: &'a Pipeline,
    step: u64,
    input: &'a Tensor,
    train: Option<(u64, &'a Tensor)>,
    splits: &'a [(usize, usize)],
    /// Stage `s`'s output of micro-batch `j` at `s * m + j`, for stage `s + 1`.
    outs: Handoffs,
    /// The gradient of stage `s`'s input of micro-batch `j` at `s * m + j`, for stage `s - 1`.
    grads: Handoffs,
    events: Mutex<Vec<StageEvent>>,
    losses: Mutex<Vec<f64>>,
    outputs: Mutex<Vec<Option<Tensor>>>,
}

impl StepRun<'_> {
    /// Runs stage `s`'s actions in order; returns the most micro-batches it kept at once.
    async fn drive(&self, s: usize) -> Result<usize, DriverError> {
        let (p, m) = (self.pipe.stages.len(), self.splits.len());
        let schedule = match self.train {
            Some(_) => self.pipe.schedule,
            None => Schedule::GPipe,
        };
        let mut live = 0;
        for action in schedule.actions(s, p, m) {
            let span = match action {
                Action::Forward(j) => self.forward(s, j, &mut live).await,
                Action::Backward(_) if self.train.is_none() => continue,
                Action::Backward(j) => self.backward(s, j).await,
            };
            let span = match span {
                Ok(span) => span,
                Err(e) => {
                    self.outs.close();
                    self.grads.close();
                    return Err(e);
                }
            };
            lock(&self.events).push(StageEvent {
                stage: s,
                action,
                start_us: span.0,
                end_us: span.1,
            });
        }
        Ok(live)
    }

    /// `e`, as stage `s`'s failure in `pass` of micro-batch `j`.
    fn failed(&self, s: usize, pass: &'static str, j: usize, e: AutogradError) -> DriverError {
        DriverError::Stage(AutogradError::Stage {
            stage: s,
            worker: self.pipe.stages[s].0.worker(),
            pass,
            micro_batch: j,
            source: Box::new(e),
        })
    }

    async fn forward(
        &self,
        s: usize,
        j: usize,
        live: &mut usize,
    ) -> Result<(u64, u64), DriverError> {
        let (p, m) = (self.pipe.stages.len(), self.splits.len());
        let (at, len) = self.splits[j];
        let input = if s == 0 {
            StageInput::Data(RTensor(self.input.narrow(0, at, len)?))
        } else {
            StageInput::Prev(self.outs.take((s - 1) * m + j).await?)
        };
        let finish = match (s + 1 == p, self.train) {
            (false, _) => Finish::Pass,
            (true, Some((_, targets))) => Finish::Loss {
                loss: self.pipe.loss,
                targets: RTensor(targets.narrow(0, at, len)?),
                batch: self.splits.iter().map(|s| s.1 as u64).sum(),
            },
            (true, None) => Finish::Return,
        };
        let req = ForwardReq {
            pipe: self.pipe.id,
            stage: s as u32,
            step: self.step,
            mb: j as u32,
            input,
            finish,
            train: self.train.is_some(),
        };
        let reply = self.pipe.stages[s]
            .0
            .forward(req)
            .await
            .map_err(|e| self.failed(s, "forward", j, e))?;
        *live = (*live).max(reply.live as usize);
        if let Some(out) = reply.out {
            self.outs.give(s * m + j, out);
        }
        if let Some(l) = reply.loss {
            lock(&self.losses)[j] = l;
        }
        if let Some(v) = reply.value {
            lock(&self.outputs)[j] = Some(v.0);
        }
        Ok(reply.span)
    }

    async fn backward(&self, s: usize, j: usize) -> Result<(u64, u64), DriverError> {
        let (p, m) = (self.pipe.stages.len(), self.splits.len());
        let Some((ctx, _)) = self.train else {
            return Err(DriverError::Upstream);
        };
        let grad = if s + 1 == p {
            None
        } else {
            Some(self.grads.take((s + 1) * m + j).await?)
        };
        let req = BackwardReq {
            pipe: self.pipe.id,
            stage: s as u32,
            step: self.step,
            mb: j as u32,
            grad,
            ctx,
            input_grad: s > 0,
        };
        let reply = self.pipe.stages[s]
            .0
            .backward(req)
            .await
            .map_err(|e| self.failed(s, "backward", j, e))?;
        if let Some(g) = reply.input_grad {
            self.grads.give(s * m + j, g);
        }
        Ok(reply.span)
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // What a failed step left on the stages goes (a completed step leaves nothing).
        let forgets: Vec<_> = self.stages.iter().map(|s| s.0.forget(self.id)).collect();
        self.agent.runtime().spawn(async move {
            for f in forgets {
                if let Err(e) = f.await {
                    tracing::debug!(cause = %e, "pipeline stage state not dropped");
                }
            }
        });
    }
}
