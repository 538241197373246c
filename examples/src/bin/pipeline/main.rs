//! Pipeline-parallel character-LSTM language identifier: a master and one process per stage.
//!
//! `cargo run --release -p examples --bin pipeline` trains end to end with every process on
//! 127.0.0.1, started by the `rpcrun` launcher's code. The model is hybrid-rnn's encoder
//! (embedding and LSTM) followed by a deeper fully connected part (`--mlp-layers` layers of
//! `--mlp-width`, then the classifier); stage 0 (worker 1) holds the encoder and the other
//! `--stages` - 1 stages hold contiguous blocks of the fully connected layers (the last block
//! split over two devices, as hybrid-rnn's `NetShard2`). The master holds no layer: it cuts
//! each batch into `--micro-batches` and drives the stages in the `--schedule`'s order
//! (`gpipe` or `1f1b`); activations and gradients go from stage to stage directly. One
//! `DistributedOptimizer` (Adam) step follows the backward passes of every micro-batch.
//!
//! It prints a progress bar, every epoch's test accuracy and a final JSON line, and draws one
//! step's passes per stage over time (`timeline.png` in `--out-dir`).
//!
//! Recovery, as hybrid-rnn's: a checkpoint every `--checkpoint-every` steps and at every
//! epoch's end (every stage's parameters, every stage's optimizer state, the step, the epoch's
//! running loss and the accuracies so far; the data order is a function of the seed and the
//! epoch). Under `--max-restarts K` the launcher restarts after a failure: with `--restart
//! group` every process, and the new master resumes from the newest verified checkpoint; with
//! `--restart worker` only the failed process, and the master, keeping its process, rebuilds
//! every stage (the replacement's included), restores the checkpoint and replays the steps
//! since. Either way the final parameters are bit-identical to an uninterrupted run's
//! (`params_sha256` in the JSON line). The same command run again also goes on from the
//! newest verified checkpoint in `--out-dir` (`examples::resume`); `--fresh` starts over.
//! `--check-equivalence` compares both schedules with 1, 2, 4 and 8 micro-batches against
//! the same model trained in one process on whole batches; `--bench` measures step times and
//! bubbles (one JSON line per configuration). With `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` set, each process joins that group instead (rank 0 is the master).

#[allow(dead_code)]
#[path = "../hybrid-rnn/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../hybrid-rnn/lstm.rs"]
mod lstm;
#[allow(dead_code)]
#[path = "../hybrid-rnn/model.rs"]
mod model;
mod stages;
mod timeline;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use autograd_dist::{
    bubble_theory, DeviceSpec, DistributedOptimizer, Loss, Module, Optimizer, OptimizerKind,
    Pipeline, RemoteModule, Schedule, StepReport,
};
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;
use examples::checkpoint::{self as ckpt, count, floats, put_optimizer, Flags, Tensors};
use examples::recovery::{Holders, Tracker};
use examples::resume::StartFlags;
use examples::wordlang::LANGS;
use examples::Fatal;
use rpc_core::{remote, Agent, BoxError, CallContext, Config, Registry};
use serde_json::json;

use data::{epoch_batches, Data, Split};
use model::Dims;
use stages::{mlp_blocks, EncoderStage, MlpInit, MlpStage};

/// Largest difference allowed between the pipeline and one process.
const TOLERANCE: f64 = 1e-5;

/// The optimizer of the 20 compared steps: SGD with momentum, whose update is linear in the gradient, so the
/// pipeline's summation order (micro-batch by micro-batch) stays a 1e-7 difference. Adam
/// divides by the gradient's running magnitude: where a gradient is itself ~1e-7, a rounding
/// difference becomes a full-size step, and the runs part by up to the learning rate per step
/// whatever the pipeline does (measured: 6e-3 after 20 steps with 4 micro-batches).
const EQUIVALENCE_OPTIMIZER: OptimizerKind = OptimizerKind::Sgd {
    lr: 0.1,
    momentum: 0.9,
    weight_decay: 0.0,
};

#[derive(Parser, Debug)]
#[command(about = "Pipeline-parallel training over RPC: a master and one process per stage")]
struct Args {
    /// Stages (worker processes): the encoder, then blocks of the fully connected layers.
    #[arg(long, default_value_t = 3)]
    stages: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// `gpipe` (every forward, then every backward) or `1f1b` (one forward, one backward).
    #[arg(long, default_value = "1f1b")]
    schedule: Schedule,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Words per batch (default 256; 1024 for `--bench`, where micro-batches of 128 words
    /// keep the matrix products efficient).
    #[arg(long)]
    batch: Option<usize>,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Character embedding width.
    #[arg(long, default_value_t = 64)]
    emb: usize,
    /// LSTM state width.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Width of the fully connected layers.
    #[arg(long, default_value_t = 512)]
    mlp_width: usize,
    /// Fully connected layers before the classifier.
    #[arg(long, default_value_t = 4)]
    mlp_layers: usize,
    /// Second device of the last stage, which splits its layers over two devices
    /// (`cpu`, `cuda:1`).
    #[arg(long, default_value = "cpu")]
    last_stage_device: DeviceSpec,
    /// Seed of the initial parameters and the data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Use only the first N training words.
    #[arg(long)]
    train_limit: Option<usize>,
    /// Use only the first N test words.
    #[arg(long)]
    test_limit: Option<usize>,
    /// Directory of `train.tsv` and `test.tsv` (default: the bundled data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where the timeline picture, the checkpoints (`ckpt-<step>.safetensors`) and the
    /// progress record go.
    #[arg(long, default_value = "target/pipeline")]
    out_dir: PathBuf,
    /// Write a checkpoint every K steps (and at every epoch's end): at most K steps are
    /// replayed after a failure.
    #[arg(long, default_value_t = 100)]
    checkpoint_every: u64,
    /// Checkpoints kept in `--out-dir` (older ones are removed).
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    /// Require a checkpoint in `--out-dir` to go on from (without it, a run goes on from the
    /// newest verified checkpoint there if there is one, written with the same model and data
    /// flags, and starts from the beginning if not).
    #[arg(long)]
    resume: bool,
    /// Start from the beginning: an earlier run's checkpoints and records in `--out-dir` are
    /// moved into `--out-dir/previous-<n>` (never deleted). Only on a first start.
    #[arg(long)]
    fresh: bool,
    /// Local mode: restarts after a failure (a killed or frozen process) before giving up.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Local mode: what a failure restarts: `group` (every process; the new master resumes
    /// from the latest checkpoint) or `worker` (the failed process alone: the master keeps
    /// its process, rebuilds the stages, restores the latest checkpoint and replays).
    #[arg(long, default_value = "group")]
    restart: rpcrun::Restart,
    /// Only compare GPipe and 1F1B with 1, 2, 4 and 8 micro-batches against one process
    /// (gradients, then 20 SGD steps); exits 1 above 1e-5.
    #[arg(long)]
    check_equivalence: bool,
    /// Only measure: one JSON line per schedule, stage count (2 and 4) and micro-batch count.
    #[arg(long)]
    bench: bool,
    /// Steps timed per configuration of `--bench` (after 3 untimed).
    #[arg(long, default_value_t = 12)]
    bench_steps: usize,
    /// Fault injection: kill this stage's process (a stage's index, or `master`) with SIGKILL
    /// during step `--kill-at-step` (once: not again when a recovered run replays that step).
    #[arg(long, requires = "kill_at_step")]
    kill_stage: Option<Victim>,
    /// The step (counted from 0) during which `--kill-stage` is killed.
    #[arg(long)]
    kill_at_step: Option<u64>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Per-call timeout, seconds.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
    /// How long the group may take to form, seconds.
    #[arg(long, default_value_t = 120)]
    init_timeout_secs: u64,
}

impl Args {
    fn batch(&self) -> usize {
        self.batch.unwrap_or(if self.bench { 1024 } else { 256 })
    }

    fn validate(&self) -> Result<()> {
        ensure!(
            (2..=8).contains(&self.stages),
            "--stages {}: between 2 and 8",
            self.stages
        );
        ensure!(
            self.stages <= self.mlp_layers + 2,
            "--stages {}: the model has {} fully connected layers for {} stages after the \
             encoder",
            self.stages,
            self.mlp_layers + 1,
            self.stages - 1
        );
        ensure!(
            self.micro_batches >= 1 && self.micro_batches <= self.batch(),
            "--micro-batches {} must be between 1 and --batch {}",
            self.micro_batches,
            self.batch()
        );
        ensure!(self.batch() >= 8, "--batch {} is below 8", self.batch());
        ensure!(self.epochs >= 1, "--epochs must be at least 1");
        ensure!(
            self.checkpoint_every > 0,
            "--checkpoint-every must be at least 1"
        );
        ensure!(
            self.lr.is_finite() && self.lr > 0.0,
            "--lr {} must be positive",
            self.lr
        );
        if let Some(Victim::Stage(s)) = self.kill_stage {
            ensure!(
                s < self.stages,
                "--kill-stage {s}: there are {} stages",
                self.stages
            );
        }
        Ok(())
    }

    /// Processes: the master and one per stage (`--bench` measures up to 4 stages).
    fn world(&self) -> u32 {
        if self.bench {
            5
        } else {
            self.stages as u32 + 1
        }
    }

    /// The flags that must match for a checkpoint to continue this run.
    fn flags(&self, data: &Data) -> Flags {
        [
            ("vocabulary", data.vocab.to_string()),
            ("training words", data.train.len().to_string()),
            ("--stages", self.stages.to_string()),
            ("--emb", self.emb.to_string()),
            ("--hidden", self.hidden.to_string()),
            ("--mlp-width", self.mlp_width.to_string()),
            ("--mlp-layers", self.mlp_layers.to_string()),
            ("batch", self.batch().to_string()),
            ("--lr", self.lr.to_string()),
            ("--seed", self.seed.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    fn dims(&self, vocab: usize) -> Dims {
        Dims {
            vocab,
            emb: self.emb,
            hidden: self.hidden,
            head_hidden: self.mlp_width,
            classes: LANGS.len(),
            bidirectional: false,
        }
    }
}

/// Whom `--kill-stage` kills.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Victim {
    /// The master (rank 0).
    Master,
    /// Stage `s` (rank `s + 1`).
    Stage(usize),
}

impl std::str::FromStr for Victim {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "master" => Ok(Self::Master),
            _ => s
                .parse()
                .map(Self::Stage)
                .map_err(|_| format!("{s:?} is neither a stage index nor `master`")),
        }
    }
}

impl std::fmt::Display for Victim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Master => f.write_str("the master"),
            Self::Stage(s) => write!(f, "stage {s}"),
        }
    }
}

fn main() {
    examples::main_with("pipeline", run);
}

/// This process's peak resident memory in MiB.
#[remote]
async fn peak_rss_mb(_ctx: CallContext) -> Result<f64, BoxError> {
    Ok(examples::peak_rss_mb())
}

/// Starts this process's peak resident memory over from its current size (Linux).
#[remote]
async fn reset_peak_rss(_ctx: CallContext) -> Result<(), BoxError> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// Fault injection (`--kill-stage`): this process kills itself with SIGKILL.
#[remote]
async fn die(_ctx: CallContext) -> Result<(), BoxError> {
    // SAFETY: kill(2) on this very process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    Ok(())
}

fn registry() -> Result<Registry> {
    let b = rref::install(Registry::builder())?;
    let b = autograd_dist::install(b)?;
    let b = autograd_dist::register_module::<EncoderStage>(b)?;
    let b = autograd_dist::register_module::<MlpStage>(b)?;
    Ok(b.register(peak_rss_mb)?
        .register(reset_peak_rss)?
        .register(die)?
        .build())
}

fn run() -> Result<i32> {
    let rank = rpc_core::launched_rank()?;
    if let Some(r) = rank.filter(|&r| r != 0) {
        // A worker: serve until the master shuts the group down.
        return examples::serve_launched(registry()?, "PIPELINE_WORKER_TIMEOUT")
            .map(|()| 0)
            .with_context(|| format!("stage worker rank {r}"));
    }
    let args = Args::parse();
    args.validate().context(Fatal("invalid flags".into()))?;
    if rank.is_none() {
        return launch_local(&args);
    }
    let data = load_data(&args)?;
    let restart = rpc_core::launched_restart_count()?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let cfg = Config::new()
        .with_name("master")
        .with_rpc_timeout(timeout)
        .with_shutdown_timeout(timeout)
        .with_init_timeout(Duration::from_secs(args.init_timeout_secs));
    examples::runtime()?.block_on(async {
        let agent = rpc_core::init(cfg, registry()?)
            .await
            .context("forming the group (master and stages)")?;
        ensure!(
            agent.world_size() == args.world() as usize,
            "the group has {} workers; this run needs {} (a master and its stages)",
            agent.world_size(),
            args.world()
        );
        let result = if args.check_equivalence {
            check_equivalence(&agent, &args, &data).await
        } else if args.bench {
            bench(&agent, &args, &data).await
        } else {
            train(&agent, &args, &data, restart).await
        };
        // After a failure a stage may be gone; shutdown notices dead peers by itself.
        let report = agent.shutdown().await;
        let code = result?;
        if args.restart == rpcrun::Restart::Worker {
            // Stages replaced on the way are no reason to fail.
            examples::check_shutdown(&agent, &report)?;
        } else {
            ensure!(report.is_clean(), "shutdown was not clean: {report:?}");
        }
        Ok(code)
    })
}

/// Local mode: the master and every stage as children of this process (the launcher's code).
fn launch_local(args: &Args) -> Result<i32> {
    load_data(args)?;
    if args.resume {
        ensure!(
            ckpt::latest(&args.out_dir)?.is_some(),
            Fatal(format!(
                "--resume: no checkpoint in {} to go on from",
                args.out_dir.display()
            ))
        );
    }
    std::env::set_var(
        "PIPELINE_WORKER_TIMEOUT",
        args.timeout_secs.max(3600).to_string(),
    );
    examples::launch_here("pipeline", args.world(), args.max_restarts, args.restart)
}

/// The words at `idx` as the first stage's input, `[B, T + 1]` u32 (ids, then each word's
/// last position), and their labels.
fn packed(split: &Split, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let b = split.batch(idx)?;
    let ids = b.ids.reshape((b.t, b.b))?.t()?.contiguous()?;
    let last = Tensor::from_vec(b.last.to_vec(), (b.b, 1), &Device::Cpu)?;
    Ok((Tensor::cat(&[ids, last], 1)?, b.labels))
}

/// A stage module where it lives, kept for its state.
enum StageModule {
    Encoder(RemoteModule<EncoderStage>),
    Mlp(RemoteModule<MlpStage>),
}

impl StageModule {
    async fn state(&self) -> Result<Vec<Tensor>> {
        Ok(match self {
            Self::Encoder(m) => m.state().await?,
            Self::Mlp(m) => m.state().await?,
        })
    }

    async fn load_state(&self, state: Vec<Tensor>) -> Result<()> {
        match self {
            Self::Encoder(m) => m.load_state(state).await?,
            Self::Mlp(m) => m.load_state(state).await?,
        }
        Ok(())
    }
}

/// Where training stands, besides the parameters and optimizer states: what a checkpoint
/// holds to continue bit for bit.
#[derive(Clone, Debug, Default)]
struct Progress {
    /// Completed epochs.
    epoch: u64,
    /// Completed steps.
    step: u64,
    /// The sum of the losses of the epoch in progress.
    loss_sum: f64,
    /// Test accuracy after each completed epoch.
    accuracy: Vec<f64>,
}

/// The model as the master holds it: the stages, a pipeline over them, one optimizer over
/// every stage's parameters, and the workers that hold them.
struct Model {
    pipe: Pipeline,
    modules: Vec<StageModule>,
    opt: DistributedOptimizer,
    holders: Holders,
}

impl Model {
    /// Every stage built on its worker in its initial state.
    async fn new(agent: &Agent, plan: &Plan, args: &Args) -> Result<Self> {
        let holders = Holders::take(agent, 1..=plan.blocks.len() as u32 + 1);
        let (pipe, modules) = plan.build(agent, args.micro_batches, args.schedule).await?;
        let opt = DistributedOptimizer::new(
            agent,
            OptimizerKind::adam(args.lr),
            pipe.remote_parameters().await?,
        )?;
        Ok(Self {
            pipe,
            modules,
            opt,
            holders,
        })
    }

    /// Every parameter, stage by stage: `stage.<s>.<i>`.
    async fn named(&self) -> Result<Vec<(String, Tensor)>> {
        let mut all = Vec::new();
        for (s, state) in states(&self.modules).await?.into_iter().enumerate() {
            for (i, t) in state.into_iter().enumerate() {
                all.push((format!("stage.{s}.{i}"), t));
            }
        }
        Ok(all)
    }

    /// Writes the checkpoint of `progress` into `--out-dir` and prunes the old ones.
    async fn checkpoint(&self, args: &Args, flags: &Flags, progress: &Progress) -> Result<()> {
        let mut m: HashMap<String, Tensor> = self.named().await?.into_iter().collect();
        for (rank, st) in self.opt.owners().into_iter().zip(self.opt.state().await?) {
            put_optimizer(&mut m, rank, &st)?;
        }
        m.insert("train.epoch".into(), count(progress.epoch)?);
        m.insert("train.step".into(), count(progress.step)?);
        m.insert("train.loss_sum".into(), floats(&[progress.loss_sum])?);
        m.insert("train.accuracy".into(), floats(&progress.accuracy)?);
        ckpt::save(&args.out_dir, progress.step, &m, flags)?;
        ckpt::prune(&args.out_dir, args.keep_checkpoints)
    }

    /// Restores every stage and optimizer state from the checkpoint `t` (verified, written by
    /// a run with the same flags), and returns where training stood.
    async fn restore(&self, t: &Tensors) -> Result<Progress> {
        let path = t.path();
        for (s, module) in self.modules.iter().enumerate() {
            // Every `stage.<s>.<i>` in order (the stage refuses a count or shape it lacks).
            let state: Vec<Tensor> = (0..)
                .map_while(|i| t.map().get(&format!("stage.{s}.{i}")).cloned())
                .collect();
            module
                .load_state(state)
                .await
                .with_context(|| format!("restoring stage {s} from {}", path.display()))?;
        }
        let states = self
            .opt
            .owners()
            .into_iter()
            .map(|r| t.optimizer(r))
            .collect::<Result<_>>()?;
        self.opt.load_state(states).await?;
        Ok(Progress {
            epoch: t.count("train.epoch")?,
            step: t.count("train.step")?,
            loss_sum: t.floats("train.loss_sum")?.first().copied().unwrap_or(0.0),
            accuracy: t.floats("train.accuracy")?,
        })
    }
}

/// The model's stages: what each is built from.
struct Plan {
    dims: Dims,
    seed: u64,
    blocks: Vec<MlpInit>,
}

impl Plan {
    fn new(args: &Args, vocab: usize, stages: usize) -> Self {
        let dims = args.dims(vocab);
        let cut = mlp_blocks(
            dims.encoding(),
            args.mlp_width,
            args.mlp_layers,
            dims.classes,
            stages - 1,
        );
        let n = cut.len();
        let blocks = cut
            .into_iter()
            .enumerate()
            .map(|(k, (first_layer, widths))| MlpInit {
                widths,
                first_layer,
                relu_last: k + 1 < n,
                seed: args.seed,
                second: (k + 1 == n).then_some(args.last_stage_device),
            })
            .collect();
        Self {
            dims,
            seed: args.seed,
            blocks,
        }
    }

    /// The stages on workers 1, 2, … and a pipeline over them.
    async fn build(
        &self,
        agent: &Agent,
        m: usize,
        schedule: Schedule,
    ) -> Result<(Pipeline, Vec<StageModule>)> {
        let enc =
            RemoteModule::<EncoderStage>::new(agent, "worker1/cpu", (self.dims, self.seed)).await?;
        let mut stages = vec![enc.clone().into()];
        let mut modules = vec![StageModule::Encoder(enc)];
        for (k, init) in self.blocks.iter().enumerate() {
            let place = format!("worker{}/cpu", k + 2);
            let m = RemoteModule::<MlpStage>::new(agent, &place, init.clone()).await?;
            stages.push(m.clone().into());
            modules.push(StageModule::Mlp(m));
        }
        let pipe = Pipeline::new(agent, stages, m, schedule, Loss::CrossEntropy)?;
        Ok((pipe, modules))
    }

    /// The same model in this process.
    fn local(&self) -> Result<(EncoderStage, Vec<MlpStage>)> {
        let enc = EncoderStage::new((self.dims, self.seed), &Device::Cpu)?;
        let blocks = self
            .blocks
            .iter()
            .map(|b| MlpStage::build(b.clone(), &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        Ok((enc, blocks))
    }
}

/// One process's forward pass of the whole model.
fn local_forward(model: &(EncoderStage, Vec<MlpStage>), x: &Tensor) -> Result<Tensor> {
    let mut h = model.0.forward(x)?;
    for b in &model.1 {
        h = b.forward(&h)?;
    }
    Ok(h)
}

fn local_vars(model: &(EncoderStage, Vec<MlpStage>)) -> Vec<Vec<candle_core::Var>> {
    let mut v = vec![model.0.parameters()];
    v.extend(model.1.iter().map(Module::parameters));
    v
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(a.to_dtype(DType::F64)?
        .sub(&b.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?)
}

/// One training step through the pipeline and the optimizer; the context is released.
async fn pipeline_step(
    agent: &Agent,
    pipe: &Pipeline,
    opt: &DistributedOptimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<StepReport> {
    let ctx = autograd_dist::context(agent);
    let report = pipe.step(&ctx, x, y).await?;
    opt.step(&ctx).await?;
    ctx.release().await?;
    Ok(report)
}

async fn check_equivalence(agent: &Agent, args: &Args, data: &Data) -> Result<i32> {
    let plan = Plan::new(args, data.vocab, args.stages);
    let batches = epoch_batches(data.train.len(), args.batch(), args.seed, 0);
    ensure!(batches.len() >= 20, "20 steps need 20 batches of --batch");
    let inputs: Vec<(Tensor, Tensor)> = batches[..20]
        .iter()
        .map(|b| packed(&data.train, b))
        .collect::<Result<_>>()?;
    // One process: the gradients of the first batch, then 20 steps.
    let model = plan.local()?;
    let vars = local_vars(&model);
    let (x0, y0) = &inputs[0];
    let loss = Loss::CrossEntropy.compute(&local_forward(&model, x0)?, y0, args.batch())?;
    let grads = loss.backward()?;
    let local_grads: Vec<Vec<Tensor>> = vars
        .iter()
        .map(|vs| {
            vs.iter()
                .map(|v| {
                    grads
                        .get(v.as_tensor())
                        .cloned()
                        .map_or_else(|| v.zeros_like(), Ok)
                })
                .collect()
        })
        .collect::<candle_core::Result<_>>()?;
    let mut sgd = Optimizer::new(EQUIVALENCE_OPTIMIZER, vars.concat());
    let mut local_losses = Vec::new();
    for (x, y) in &inputs {
        let loss = Loss::CrossEntropy.compute(&local_forward(&model, x)?, y, args.batch())?;
        sgd.step(&loss.backward()?)?;
        local_losses.push(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?);
    }
    let (mut grad_diff, mut param_diff, mut loss_diff) = (0f64, 0f64, 0f64);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for m in [1, 2, 4, 8] {
            // Gradients: one SGD step with rate 1 moves each parameter by minus its gradient.
            let (pipe, modules) = plan.build(agent, m, schedule).await?;
            let before = states(&modules).await?;
            let sgd = DistributedOptimizer::new(
                agent,
                OptimizerKind::sgd(1.0),
                pipe.remote_parameters().await?,
            )?;
            pipeline_step(agent, &pipe, &sgd, x0, y0).await?;
            let after = states(&modules).await?;
            let mut g = 0f64;
            for ((b, a), want) in before.iter().zip(&after).zip(&local_grads) {
                for ((b, a), w) in b.iter().zip(a).zip(want) {
                    g = g.max(max_diff(&(b - a)?, w)?);
                }
            }
            // 20 steps from the initial values.
            let (pipe, modules) = plan.build(agent, m, schedule).await?;
            let opt = DistributedOptimizer::new(
                agent,
                EQUIVALENCE_OPTIMIZER,
                pipe.remote_parameters().await?,
            )?;
            let mut l = 0f64;
            for ((x, y), want) in inputs.iter().zip(&local_losses) {
                let r = pipeline_step(agent, &pipe, &opt, x, y).await?;
                l = l.max((r.loss - want).abs());
            }
            let mut p = 0f64;
            for (got, want) in states(&modules).await?.iter().zip(&vars) {
                for (t, v) in got.iter().zip(want) {
                    p = p.max(max_diff(t, v.as_tensor())?);
                }
            }
            println!(
                "{schedule} with {m} micro-batch(es): gradients {g:.2e}, parameters after 20 \
                 steps {p:.2e}, losses {l:.2e}"
            );
            grad_diff = grad_diff.max(g);
            param_diff = param_diff.max(p);
            loss_diff = loss_diff.max(l);
        }
    }
    let ok = grad_diff <= TOLERANCE && param_diff <= TOLERANCE;
    println!(
        "{}",
        json!({
            "check": "equivalence",
            "stages": args.stages,
            "schedules": ["gpipe", "1f1b"],
            "micro_batches": [1, 2, 4, 8],
            "steps": 20,
            "max_grad_diff": grad_diff,
            "max_param_diff": param_diff,
            "max_loss_diff": loss_diff,
            "tolerance": TOLERANCE,
            "ok": ok,
        })
    );
    Ok(if ok { 0 } else { 1 })
}

async fn states(modules: &[StageModule]) -> Result<Vec<Vec<Tensor>>> {
    let mut v = Vec::with_capacity(modules.len());
    for m in modules {
        v.push(m.state().await?);
    }
    Ok(v)
}

/// Peak resident memory of each stage's process, MiB.
async fn stage_rss(agent: &Agent, stages: usize) -> Result<Vec<f64>> {
    let mut v = Vec::with_capacity(stages);
    for s in 0..stages {
        v.push(agent.rpc_async(s as u32 + 1, peak_rss_mb, ()).await?);
    }
    Ok(v)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// Predictions for `split`, batch by batch through the pipeline.
async fn accuracy(pipe: &Pipeline, split: &Split, batch: usize) -> Result<f64> {
    let idx: Vec<usize> = (0..split.len()).collect();
    let mut correct = 0usize;
    for chunk in idx.chunks(batch) {
        let (x, y) = packed(split, chunk)?;
        let logits = pipe.forward(&x).await?;
        let preds: Vec<u32> = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?;
        let labels: Vec<u32> = y.to_vec1()?;
        correct += preds.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(correct as f64 / split.len().max(1) as f64)
}

async fn train(agent: &Agent, args: &Args, data: &Data, restart: u32) -> Result<i32> {
    let started = Instant::now();
    let plan = Plan::new(args, data.vocab, args.stages);
    let flags = args.flags(data);
    let per_epoch = (data.train.len() / args.batch()) as u64;
    let start = StartFlags {
        resume: args.resume,
        fresh: args.fresh,
    };
    let resume_from = examples::resume::start(&args.out_dir, &flags, start, restart)?;
    let mut model = Model::new(agent, &plan, args).await?;
    let mut progress = Progress::default();
    if let Some(t) = &resume_from {
        progress = model.restore(t).await?;
        println!(
            "resumed from {} (epoch {}, step {}, restart {restart})",
            t.path().display(),
            progress.epoch,
            progress.step
        );
    }
    let resumed = resume_from.is_some() || restart > 0;
    let mut tracker = Tracker::open(&args.out_dir, restart, resumed.then_some(progress.step))?;
    tracker.completed(progress.step)?;
    println!(
        "pipeline: {} stages on {} ({} schedule, {} micro-batches of ~{} words)",
        args.stages,
        model.pipe.workers().join(", "),
        args.schedule,
        args.micro_batches,
        args.batch() / args.micro_batches
    );
    let (mut step_ms, mut bubbles) = (Vec::new(), Vec::new());
    let mut live = vec![0usize; args.stages];
    let mut last_loss = f64::NAN;
    let mut shown: Option<StepReport> = None;
    // Recoveries in this process (`--restart worker`: a stage failed, the master did not).
    let mut in_place = 0u32;
    loop {
        // The training from `progress` on; a stage's failure ends it with an error.
        let trained: Result<()> = async {
            let p = &mut progress;
            while p.epoch < args.epochs {
                let epoch = p.epoch;
                let batches = epoch_batches(data.train.len(), args.batch(), args.seed, epoch);
                let bar = examples::epoch_bar(args.quiet, batches.len() as u64, epoch, args.epochs);
                // Where a resumed epoch picks up.
                let k0 = (p.step - epoch * per_epoch) as usize;
                bar.set_position(k0 as u64);
                for (k, b) in batches.iter().enumerate().skip(k0) {
                    let step = p.step;
                    let (x, y) = packed(&data.train, b)?;
                    let t = Instant::now();
                    // Fault injection, once per run (not when a recovered run replays it).
                    let kill = (args.kill_at_step == Some(step) && restart == 0 && in_place == 0)
                        .then_some(args.kill_stage)
                        .flatten();
                    let killer = async {
                        if let Some(v) = kill {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            eprintln!("pipeline: killing {v} during step {step}");
                            let rank = match v {
                                Victim::Master => 0,
                                Victim::Stage(s) => s as u32 + 1,
                            };
                            // The call never answers: its worker is gone.
                            let _ = agent.rpc_async(rank, die, ()).await;
                        }
                        std::future::pending::<()>().await
                    };
                    let report = tokio::select! {
                        r = pipeline_step(agent, &model.pipe, &model.opt, &x, &y) => {
                            r.with_context(|| format!("training step {step}"))?
                        }
                        () = killer => unreachable!("the fault injection never ends"),
                    };
                    if epoch > 0 || k >= 3 {
                        step_ms.push(t.elapsed().as_secs_f64() * 1e3);
                        bubbles.push(report.bubble());
                    }
                    for (l, r) in live.iter_mut().zip(&report.max_live_activations) {
                        *l = (*l).max(*r);
                    }
                    p.loss_sum += report.loss;
                    p.step += 1;
                    last_loss = report.loss;
                    if epoch + 1 == args.epochs && k == batches.len() / 2 {
                        shown = Some(report);
                    }
                    tracker.completed(p.step)?;
                    if p.step % args.checkpoint_every == 0 && k + 1 < batches.len() {
                        model.checkpoint(args, &flags, p).await?;
                    }
                    bar.inc(1);
                    bar.set_message(format!("loss {:.4}", p.loss_sum / (k + 1) as f64));
                }
                bar.finish_and_clear();
                let acc = accuracy(&model.pipe, &data.test, args.batch()).await?;
                println!(
                    "epoch {}/{}: train loss {:.4}, test accuracy {:.4}",
                    epoch + 1,
                    args.epochs,
                    p.loss_sum / batches.len().max(1) as f64,
                    acc
                );
                p.accuracy.push(acc);
                p.epoch += 1;
                p.loss_sum = 0.0;
                model.checkpoint(args, &flags, p).await?;
            }
            Ok(())
        }
        .await;
        let Err(err) = trained else { break };
        if args.restart != rpcrun::Restart::Worker || examples::is_fatal(&err) {
            return Err(err);
        }
        let timeout = Duration::from_secs(args.timeout_secs);
        let lost = model
            .holders
            .await_replacements(&err, timeout, "pipeline")
            .await?;
        in_place += 1;
        // Everything rolls back to the latest checkpoint: every stage is rebuilt (the
        // survivors' too: the interrupted step may have been applied on some of them) and
        // restored, with every optimizer state.
        drop(model);
        model = Model::new(agent, &plan, args).await?;
        let from = match examples::resume::newest_verified(&args.out_dir)? {
            Some(t) => {
                progress = model.restore(&t).await?;
                t.path().display().to_string()
            }
            None => {
                progress = Progress::default();
                "the initial parameters (no checkpoint yet)".to_owned()
            }
        };
        tracker.interrupted(progress.step);
        tracker.completed(progress.step)?;
        println!(
            "recovered in place from {from} (step {}) after the loss of {}: {err:#}",
            progress.step,
            lost.iter()
                .map(|r| agent.name_of(*r))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let timeline = args.out_dir.join("timeline.png");
    let drawn = match &shown {
        Some(r) => {
            let title = format!(
                "{} stages, {} micro-batches, {}: step {:.1} ms, bubble {:.2} (theory {:.2})",
                args.stages,
                args.micro_batches,
                args.schedule,
                r.span_us.1.saturating_sub(r.span_us.0) as f64 / 1e3,
                r.bubble(),
                bubble_theory(args.stages, args.micro_batches)
            );
            timeline::draw(r, &model.pipe.workers(), &title, &timeline)?;
            Some(timeline.display().to_string())
        }
        // Resumed past the step it shows.
        None => None,
    };
    let rss = stage_rss(agent, args.stages).await?;
    let params_sha256 = ckpt::params_sha256(&model.named().await?)?;
    let recoveries = tracker.recoveries()?;
    let step_ms_median = median(step_ms);
    println!(
        "{}",
        json!({
            "example": "pipeline",
            "schedule": args.schedule.to_string(),
            "stages": args.stages,
            "micro_batches": args.micro_batches,
            "batch": args.batch(),
            "epochs": args.epochs,
            "steps": progress.step,
            "final_loss": round(last_loss, 5),
            "accuracy": round(progress.accuracy.last().copied().unwrap_or(0.0), 4),
            "accuracy_per_epoch": progress.accuracy.iter().map(|a| round(*a, 4)).collect::<Vec<_>>(),
            "step_ms_median": round(step_ms_median, 2),
            "words_per_s": round(args.batch() as f64 / step_ms_median * 1e3, 0),
            "bubble_measured": round(median(bubbles), 3),
            "bubble_theory": round(bubble_theory(args.stages, args.micro_batches), 3),
            "max_live_activations": live,
            "peak_rss_mb": rss.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
            "master_peak_rss_mb": round(examples::peak_rss_mb(), 1),
            "timeline": drawn,
            "params_sha256": params_sha256,
            "restarts": restart,
            "recoveries": recoveries.len(),
            "recovered_in_place": recoveries.iter().filter(|r| r.in_place).count(),
            "time_lost_s": recoveries.iter().map(|r| round(r.time_lost_s, 2)).collect::<Vec<_>>(),
            "restart_s": recoveries.iter().map(|r| round(r.restart_s, 2)).collect::<Vec<_>>(),
            "replayed_steps": recoveries.iter().map(|r| r.failed_after_step - r.resumed_from_step).collect::<Vec<_>>(),
            "wall_s": round(started.elapsed().as_secs_f64(), 1),
        })
    );
    Ok(0)
}

/// One JSON line per configuration: 2 and 4 stages, both schedules, 1, 2, 4 and 8
/// micro-batches, the same batches for each.
async fn bench(agent: &Agent, args: &Args, data: &Data) -> Result<i32> {
    let warmup = 3;
    let batches = epoch_batches(data.train.len(), args.batch(), args.seed, 0);
    let n = warmup + args.bench_steps;
    if batches.len() < n {
        bail!(
            "--bench needs {n} batches of {}; the training set has {}",
            args.batch(),
            batches.len()
        );
    }
    let inputs: Vec<(Tensor, Tensor)> = batches[..n]
        .iter()
        .map(|b| packed(&data.train, b))
        .collect::<Result<_>>()?;
    for stages in [2usize, 4] {
        let plan = Plan::new(args, data.vocab, stages);
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut one = None;
            for m in [1usize, 2, 4, 8] {
                for s in 0..stages {
                    agent.rpc_async(s as u32 + 1, reset_peak_rss, ()).await?;
                }
                let (pipe, _modules) = plan.build(agent, m, schedule).await?;
                let opt = DistributedOptimizer::new(
                    agent,
                    OptimizerKind::adam(args.lr),
                    pipe.remote_parameters().await?,
                )?;
                let (mut times, mut bubbles) = (Vec::new(), Vec::new());
                let mut live = vec![0usize; stages];
                for (k, (x, y)) in inputs.iter().enumerate() {
                    let t = Instant::now();
                    let r = pipeline_step(agent, &pipe, &opt, x, y).await?;
                    if k >= warmup {
                        times.push(t.elapsed().as_secs_f64() * 1e3);
                        bubbles.push(r.bubble());
                    }
                    for (l, r) in live.iter_mut().zip(&r.max_live_activations) {
                        *l = (*l).max(*r);
                    }
                }
                let ms = median(times);
                let bubble = median(bubbles);
                let (base, base_bubble) = *one.get_or_insert((ms, bubble));
                let rss = stage_rss(agent, stages).await?;
                println!(
                    "{}",
                    json!({
                        "bench": "pipeline",
                        "schedule": schedule.to_string(),
                        "stages": stages,
                        "micro_batches": m,
                        "batch": args.batch(),
                        "step_ms": round(ms, 2),
                        "speedup_vs_one": round(base / ms, 3),
                        "bubble_measured": round(bubble, 3),
                        "bubble_theory": round(bubble_theory(stages, m), 3),
                        // The speedup the overlap alone explains (stages busy a larger share
                        // of the step); the rest comes from each pass's work changing with
                        // the micro-batch's size.
                        "overlap_speedup": round((1.0 - bubble) / (1.0 - base_bubble).max(1e-9), 3),
                        "max_live_activations": live,
                        "peak_rss_mb": rss.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
                        "steps": args.bench_steps,
                    })
                );
            }
        }
    }
    Ok(0)
}

fn load_data(args: &Args) -> Result<Data> {
    Data::load(
        args.data_dir.as_deref(),
        args.train_limit,
        args.test_limit,
        args.batch(),
    )
}
