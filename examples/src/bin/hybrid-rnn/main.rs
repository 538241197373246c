//! Hybrid-parallel character-LSTM language identifier: a master and two workers.
//!
//! `cargo run --release -p examples --bin hybrid-rnn` trains end to end with all three
//! processes on 127.0.0.1, started by the `rpcrun` launcher's code (this process supervises
//! them and restarts the group after a failure, up to `--max-restarts` times; the restarted
//! master resumes from the latest checkpoint by itself): the master (rank 0) holds the embedding and the bidirectional LSTM
//! encoder and drives training; worker 1 holds `NetShard1`, the classifier head on one device;
//! worker 2 holds `NetShard2`, the same head split across two devices. Each step the master
//! splits the batch in two and sends each half's encodings to one worker (model parallelism),
//! computes the loss, runs distributed backward and steps a `DistributedOptimizer` over every
//! parameter; the workers sum their replicas' gradients with a ring all-reduce before their
//! update (data parallelism). With `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set,
//! each process joins that group instead (rank 0 is the master), so the same binary runs on
//! three machines, under `rpcrun`, torchrun, `srun` or `mpirun`.
//!
//! Checkpoints are written every `--checkpoint-every` steps and at every epoch's end, each
//! with a digest of its contents and the flags of the run. A run goes on from the newest
//! checkpoint in `--out-dir` that verifies (a damaged one is skipped and kept aside), if it
//! was written with the same flags (otherwise it stops, naming the differences), whatever
//! restarted it: the launcher, a requeue, the user running the same command again. It replays
//! the steps since, and its parameters end bit-identical to an uninterrupted run's.
//! `--fresh` starts over, moving the earlier run's files aside. With `--restart worker` only a failed process is restarted: the
//! master keeps its process when a worker fails, waits for the replacement, re-creates the
//! shards, restores every parameter and optimizer state from the latest checkpoint (the
//! failed shard's values are gone; the rest rolls back to the same step) and replays the steps
//! since, again bit-identically.
//!
//! The master first trains a copy of the same model in one process for `--local-steps` steps
//! on the same batches, and its losses are compared with the distributed run's
//! (`max_loss_diff`); `--check-equivalence` does only that comparison, over 20 steps. That copy
//! trains another `--local-steps` steps after every epoch, so `local_ms_per_step_median` is
//! sampled across the run as the distributed median is (this VM's speed drifts by a quarter
//! within minutes). The last line of the output is JSON.

mod checkpoint;
mod data;
mod local;
mod lstm;
mod model;
mod report;
mod shard;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use autograd_dist::{DeviceSpec, DistributedOptimizer, OptimizerKind, OptimizerState, RTensor};
use candle_core::{Device, Tensor};
use clap::Parser;
use examples::checkpoint::{Flags, Tensors};
use examples::recovery::Holders;
use examples::resume::StartFlags;
use examples::wordlang::LANGS;
use examples::Fatal;
use rpc_core::{Agent, Config, Registry};
use rref::RRef;
use serde_json::json;

use checkpoint::{Checkpoint, EpochProgress};
use data::{Batch, Data, Split};
use local::LocalModel;
use model::{Dims, Encoder, EncoderInput, HEAD_PARAMS};
use report::History;
use shard::NetShard;

/// Steps excluded from step-time medians.
const WARMUP: usize = 10;
/// Words per evaluation batch.
const EVAL_BATCH: usize = 1000;
/// Steps compared by `--check-equivalence`.
const EQUIVALENCE_STEPS: usize = 20;
/// Largest loss difference `--check-equivalence` accepts.
const EQUIVALENCE_TOLERANCE: f64 = 1e-4;

/// Trains the hybrid-parallel language identifier (master + 2 workers on 127.0.0.1).
#[derive(Parser, Debug, Clone)]
#[command(name = "hybrid-rnn", version, about)]
struct Args {
    /// Epochs to train (in total, counting those of a resumed checkpoint).
    #[arg(long, default_value_t = 6)]
    epochs: u64,
    /// Words per step (split in two halves, one per worker).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Adam's initial learning rate; it follows a cosine down to 5% of it by the last epoch.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Dropout probability on the encoding (0 disables it).
    #[arg(long, default_value_t = 0.3)]
    dropout: f32,
    /// Character embedding width.
    #[arg(long, default_value_t = 64)]
    embedding: usize,
    /// LSTM state width per direction.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// The head's hidden width.
    #[arg(long, default_value_t = 128)]
    head_hidden: usize,
    /// Read words in one direction only (the PyTorch reference's encoder).
    #[arg(long)]
    unidirectional: bool,
    /// Seed of the initial parameters, the batch order and the dropout masks.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where checkpoints (`ckpt-<step>.safetensors`), the progress record and the plot
    /// (`training.png`) go.
    #[arg(long, default_value = "target/hybrid-rnn")]
    out_dir: PathBuf,
    /// Require a checkpoint in `--out-dir` to go on from (without it, a run goes on from the
    /// newest verified checkpoint there if there is one, and starts from the beginning if
    /// not). The model and data flags must be the checkpoint's; the learning-rate schedule
    /// follows `--epochs`.
    #[arg(long)]
    resume: bool,
    /// Start from the beginning: the checkpoints and records of an earlier run in `--out-dir`
    /// are moved into `--out-dir/previous-<n>` (never deleted). Only on a first start: a run
    /// the launcher restarts goes on from its own checkpoints.
    #[arg(long)]
    fresh: bool,
    /// Write a checkpoint every K steps (and at every epoch's end): at most K steps are
    /// replayed after a failure (1000 steps: under a minute on a 2-core machine).
    #[arg(long, default_value_t = 1000)]
    checkpoint_every: u64,
    /// Checkpoints kept in `--out-dir` (older ones are removed).
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    /// Local mode: restarts after a failure (a killed or frozen process) before giving up.
    #[arg(long, default_value_t = 3)]
    max_restarts: u32,
    /// Local mode: what a failure restarts: `group` (all three processes; the new master
    /// resumes from the latest checkpoint) or `worker` (the failed process alone: a failed
    /// worker's replacement joins the running group and the master, keeping its process,
    /// restores from the latest checkpoint and replays).
    #[arg(long, default_value = "group")]
    restart: rpcrun::Restart,
    /// Only compare 20 distributed steps with the same steps in one process, and fail if a
    /// loss differs by more than 1e-4.
    #[arg(long)]
    check_equivalence: bool,
    /// Steps of the one-process baseline measured before training (0: none).
    #[arg(long, default_value_t = 40)]
    local_steps: usize,
    /// The dataset directory (default: `$WORDLANG_DIR`, else the repository's data/wordlang).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Use only the first N training words (quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// Use only the first N test words (quick runs).
    #[arg(long)]
    test_limit: Option<usize>,
    /// NetShard1's device: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    shard1_device: DeviceSpec,
    /// NetShard2's two devices, `A,B` (e.g. `cuda:0,cuda:1`); `auto` picks two GPUs where the
    /// build has CUDA and two exist, else `cpu,cpu`.
    #[arg(long, default_value = "auto")]
    shard2_devices: String,
    /// Timeout of every remote call, and how long a worker waits for the master.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
    /// How long to wait for every process of the group to join.
    #[arg(long, default_value_t = 60)]
    init_timeout_secs: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

impl Args {
    fn validate(&self) -> Result<()> {
        ensure!(
            self.batch >= 2 && self.batch % 2 == 0,
            "--batch must be even and at least 2"
        );
        ensure!(
            (0.0..1.0).contains(&self.dropout),
            "--dropout must be in [0, 1)"
        );
        ensure!(
            self.lr > 0.0 && self.lr.is_finite(),
            "--lr must be positive"
        );
        ensure!(self.epochs > 0, "--epochs must be positive");
        ensure!(
            self.embedding > 0 && self.hidden > 0 && self.head_hidden > 0,
            "layer widths must be positive"
        );
        ensure!(self.timeout_secs > 0, "--timeout-secs must be positive");
        ensure!(
            self.checkpoint_every > 0,
            "--checkpoint-every must be positive"
        );
        ensure!(
            self.keep_checkpoints > 0,
            "--keep-checkpoints must be positive"
        );
        ensure!(
            self.init_timeout_secs > 0,
            "--init-timeout-secs must be positive"
        );
        ensure!(
            !(self.resume && self.check_equivalence),
            "--check-equivalence starts from the initial parameters; drop --resume"
        );
        ensure!(
            !(self.resume && self.fresh),
            "--resume and --fresh contradict each other"
        );
        self.shard2_devices()?;
        Ok(())
    }

    fn shard2_devices(&self) -> Result<(DeviceSpec, DeviceSpec)> {
        if self.shard2_devices == "auto" {
            let two_gpus = candle_core::utils::cuda_is_available() && Device::new_cuda(1).is_ok();
            return Ok(if two_gpus {
                (DeviceSpec::Cuda(0), DeviceSpec::Cuda(1))
            } else {
                (DeviceSpec::Cpu, DeviceSpec::Cpu)
            });
        }
        let (a, b) = self
            .shard2_devices
            .split_once(',')
            .context("--shard2-devices takes two devices, `A,B`, or `auto`")?;
        Ok((a.trim().parse()?, b.trim().parse()?))
    }

    fn dims(&self, vocab: usize) -> Dims {
        Dims {
            vocab,
            emb: self.embedding,
            hidden: self.hidden,
            head_hidden: self.head_hidden,
            classes: LANGS.len(),
            bidirectional: !self.unidirectional,
        }
    }

    /// The flags that must match for a checkpoint to continue this run.
    fn flags(&self, dims: &Dims) -> Flags {
        let limit = self.train_limit.map_or("all".into(), |n| n.to_string());
        [
            ("vocabulary", dims.vocab.to_string()),
            ("--embedding", dims.emb.to_string()),
            ("--hidden", dims.hidden.to_string()),
            ("--head-hidden", dims.head_hidden.to_string()),
            ("classes", dims.classes.to_string()),
            ("--unidirectional", (!dims.bidirectional).to_string()),
            ("--batch", self.batch.to_string()),
            ("--lr", self.lr.to_string()),
            ("--dropout", self.dropout.to_string()),
            ("--seed", self.seed.to_string()),
            ("--train-limit", limit),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    fn start_flags(&self) -> StartFlags {
        StartFlags {
            resume: self.resume,
            fresh: self.fresh,
        }
    }

    fn optimizer(&self) -> OptimizerKind {
        OptimizerKind::adam(self.lr)
    }

    /// The learning rate of `epoch` (0-based): cosine annealing from `lr` to `lr / 20`.
    fn lr_at(&self, epoch: u64) -> f64 {
        let min = self.lr / 20.0;
        let frac = epoch as f64 / self.epochs.max(1) as f64;
        min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * frac).cos())
    }
}

fn main() {
    examples::main_with("hybrid-rnn", run);
}

fn registry() -> Result<Registry> {
    let b = Registry::builder();
    let b = rref::install(b)?;
    let b = autograd_dist::install(b)?;
    let b = collectives::install(b)?;
    Ok(b.register(shard::new_net_shard1)?
        .register(shard::new_net_shard2)?
        .register(shard::shard_forward)?
        .register(shard::shard_parameters)?
        .register(shard::shard_values)?
        .register(shard::load_shard_values)?
        .register(shard::peak_rss_mb)?
        .build())
}

fn run() -> Result<i32> {
    let rank = rpc_core::launched_rank()?;
    if let Some(r) = rank.filter(|&r| r != 0) {
        // A worker: serve until the master shuts the group down.
        return examples::serve_launched(registry()?, "HYBRID_RNN_WORKER_TIMEOUT")
            .map(|()| 0)
            .with_context(|| format!("worker rank {r}"));
    }
    let args = Args::parse();
    args.validate().context(Fatal("invalid flags".into()))?;
    if rank.is_none() {
        return launch_local(&args);
    }
    let data = load_data(&args)?;
    let restart = rpc_core::launched_restart_count()?;
    let resume_from = if args.check_equivalence {
        None
    } else {
        let flags = args.flags(&args.dims(data.vocab));
        examples::resume::start(&args.out_dir, &flags, args.start_flags(), restart)?
    };
    let timeout = Duration::from_secs(args.timeout_secs);
    let cfg = Config::new()
        .with_name("master")
        .with_rpc_timeout(timeout)
        .with_shutdown_timeout(timeout)
        .with_init_timeout(Duration::from_secs(args.init_timeout_secs));
    examples::runtime()?.block_on(async {
        let agent = rpc_core::init(cfg, registry()?)
            .await
            .context("forming the group (master, worker1, worker2)")?;
        ensure!(
            agent.world_size() == 3,
            "the group has {} workers; this example needs 3 (a master and two workers)",
            agent.world_size()
        );
        let result = master(&agent, &args, &data, resume_from, restart).await;
        // After a failure a worker may be gone; shutdown notices dead peers by itself (the
        // barrier and RRef traffic stop waiting for them), so this also returns in seconds.
        let report = agent.shutdown().await;
        let code = result?;
        if args.restart == rpcrun::Restart::Worker {
            // Workers replaced on the way are no reason to fail.
            examples::check_shutdown(&agent, &report)?;
        } else {
            ensure!(report.is_clean(), "shutdown was not clean: {report:?}");
        }
        Ok(code)
    })
}

/// Local mode: checks what can be checked here, then runs the master and both workers as
/// children of this process with the launcher's code (`rpcrun`), which restarts all three
/// after a failure, up to `--max-restarts` times. The children's output is this process's.
fn launch_local(args: &Args) -> Result<i32> {
    load_data(args)?;
    if args.resume {
        ensure!(
            examples::checkpoint::latest(&args.out_dir)?.is_some(),
            Fatal(format!(
                "--resume: no checkpoint in {} to go on from",
                args.out_dir.display()
            ))
        );
    }
    // Workers wait for the master as long as the training may take. (Set while this process
    // has a single thread.)
    std::env::set_var(
        "HYBRID_RNN_WORKER_TIMEOUT",
        (args.timeout_secs.max(3600)).to_string(),
    );
    examples::launch_here("hybrid-rnn", 3, args.max_restarts, args.restart)
}

/// The master's model: the encoder here, the two head replicas on the workers, and one
/// optimizer over all of them.
struct Hybrid {
    agent: Agent,
    encoder: Encoder,
    shards: [RRef<NetShard>; 2],
    /// The shards' workers when the shards were created.
    holders: Holders,
    opt: DistributedOptimizer,
    half: usize,
}

impl Hybrid {
    /// The model in its initial state; `instance` tells this instance's data-parallel group
    /// from the groups of instances abandoned after failures (see [`shard::instance`]).
    async fn new(agent: &Agent, args: &Args, dims: &Dims, instance: u64) -> Result<Self> {
        let encoder = Encoder::new(dims, args.seed)?;
        let (d0, d1) = args.shard2_devices()?;
        let holders = Holders::take(agent, shard::SHARD_RANKS);
        let s1 = rref::remote(
            agent,
            shard::SHARD_RANKS[0],
            shard::new_net_shard1,
            (*dims, args.seed + 1, args.shard1_device, instance),
        )?;
        let s2 = rref::remote(
            agent,
            shard::SHARD_RANKS[1],
            shard::new_net_shard2,
            (*dims, args.seed + 1, d0, d1, instance),
        )?;
        let mut params = autograd_dist::parameter_rrefs(agent, encoder.vars());
        let (p1, p2) = futures::try_join!(
            s1.rpc_async(shard::shard_parameters, ()),
            s2.rpc_async(shard::shard_parameters, ())
        )
        .context("creating the head replicas on the workers")?;
        params.extend(p1);
        params.extend(p2);
        let opt = DistributedOptimizer::new(agent, args.optimizer(), params)?;
        Ok(Self {
            agent: agent.clone(),
            encoder,
            shards: [s1, s2],
            holders,
            opt,
            half: args.batch / 2,
        })
    }

    /// Logits of `enc`'s rows: the first half on worker 1, the rest on worker 2.
    async fn heads(&self, enc: &Tensor, half: usize) -> Result<Tensor> {
        let n = enc.dim(0)?;
        let a = RTensor(enc.narrow(0, 0, half)?);
        let b = RTensor(enc.narrow(0, half, n - half)?);
        let (o1, o2) = futures::try_join!(
            self.shards[0].rpc_async(shard::shard_forward, (a,)),
            self.shards[1].rpc_async(shard::shard_forward, (b,))
        )?;
        Ok(Tensor::cat(&[o1.0, o2.0], 0)?)
    }

    /// One distributed training step; returns the loss and the logits.
    async fn step(&self, batch: &Batch, dropout: Option<&Tensor>) -> Result<(f32, Tensor)> {
        let ctx = autograd_dist::context(&self.agent);
        let (loss, logits) = ctx
            .run(async {
                let enc = self.encoder.forward(&input(batch, dropout))?;
                let logits = self.heads(&enc, self.half).await?;
                let loss = model::loss(&logits, &batch.labels)?;
                Ok::<_, anyhow::Error>((loss, logits))
            })
            .await?;
        ctx.backward(std::slice::from_ref(&loss)).await?;
        self.opt.step(&ctx).await?;
        // The context is released on every worker in the background.
        drop(ctx);
        Ok((loss.to_scalar::<f32>()?, logits.detach()))
    }

    /// Predictions for every word of `split`.
    async fn predict(&self, split: &Split) -> Result<Vec<u32>> {
        let idx: Vec<usize> = (0..split.len()).collect();
        let mut preds = Vec::with_capacity(split.len());
        for chunk in idx.chunks(EVAL_BATCH) {
            let batch = split.batch(chunk)?;
            let enc = self.encoder.forward(&input(&batch, None))?.detach();
            let logits = self.heads(&enc, chunk.len() / 2).await?;
            preds.extend(model::predictions(&logits)?);
        }
        Ok(preds)
    }

    fn encoder_named(&self, dims: &Dims) -> Vec<(String, Tensor)> {
        model::encoder_param_names(dims)
            .into_iter()
            .zip(self.encoder.vars())
            .map(|(n, v)| (n.to_string(), v.as_tensor().detach()))
            .collect()
    }

    async fn checkpoint(
        &self,
        dims: &Dims,
        args: &Args,
        epoch: u64,
        step: u64,
        history: &History,
        progress: EpochProgress,
    ) -> Result<PathBuf> {
        let head = self.shards[0].rpc_async(shard::shard_values, ()).await?;
        let states = self.opt.state().await?;
        let ck = Checkpoint {
            epoch,
            step,
            encoder: self.encoder_named(dims),
            head: HEAD_PARAMS
                .iter()
                .map(|n| n.to_string())
                .zip(head.into_iter().map(|t| t.0))
                .collect(),
            optim: self.opt.owners().into_iter().zip(states).collect(),
            history: history.clone(),
            progress,
        };
        ck.save(&args.out_dir, &args.flags(dims))
    }

    /// [`examples::checkpoint::params_sha256`] of every parameter: the encoder's, then the head's
    /// (one replica; `replica_diff` checks they are equal), in checkpoint order.
    async fn params_sha256(&self, dims: &Dims) -> Result<String> {
        let head = self.shards[0].rpc_async(shard::shard_values, ()).await?;
        let mut all = self.encoder_named(dims);
        all.extend(
            HEAD_PARAMS
                .iter()
                .map(|n| n.to_string())
                .zip(head.into_iter().map(|t| t.0)),
        );
        examples::checkpoint::params_sha256(&all)
    }

    /// The largest difference between the two head replicas' parameters (0 when the
    /// all-reduce keeps them identical).
    async fn replica_diff(&self) -> Result<f64> {
        let (a, b) = futures::try_join!(
            self.shards[0].rpc_async(shard::shard_values, ()),
            self.shards[1].rpc_async(shard::shard_values, ())
        )?;
        let mut worst = 0f64;
        for (x, y) in a.iter().zip(&b) {
            let d = (&x.0 - &y.0)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            worst = worst.max(f64::from(d));
        }
        Ok(worst)
    }

    /// Restores the checkpoint `t` (verified, written by a run with the same flags): its
    /// epoch, step, progress and history.
    async fn resume(
        &self,
        t: &Tensors,
        dims: &Dims,
        per_epoch: u64,
    ) -> Result<(u64, u64, EpochProgress, History)> {
        let ck = Checkpoint::load(
            t,
            &model::encoder_param_names(dims),
            &HEAD_PARAMS,
            &self.opt.owners(),
        )?;
        let (epoch, step) = (ck.epoch, ck.step);
        ensure!(
            (epoch * per_epoch..(epoch + 1) * per_epoch).contains(&step),
            "{}: step {step} is not in epoch {} of {per_epoch} steps",
            t.path().display(),
            epoch + 1
        );
        let (progress, history) = (ck.progress, ck.history.clone());
        self.restore(ck).await?;
        Ok((epoch, step, progress, history))
    }

    async fn restore(&self, ck: Checkpoint) -> Result<()> {
        for ((_, t), v) in ck.encoder.iter().zip(self.encoder.vars()) {
            ensure!(
                t.dims() == v.dims(),
                "checkpoint encoder parameter is {:?}, model has {:?}",
                t.dims(),
                v.dims()
            );
            v.set(t)?;
        }
        let head: Vec<RTensor> = ck.head.into_iter().map(|(_, t)| RTensor(t)).collect();
        futures::try_join!(
            self.shards[0].rpc_async(shard::load_shard_values, (head.clone(),)),
            self.shards[1].rpc_async(shard::load_shard_values, (head,))
        )?;
        let owners = self.opt.owners();
        let mut states: Vec<OptimizerState> = Vec::new();
        for o in owners {
            let st = ck
                .optim
                .iter()
                .find(|(r, _)| *r == o)
                .with_context(|| format!("checkpoint has no optimizer state for rank {o}"))?;
            states.push(st.1.clone());
        }
        self.opt.load_state(states).await?;
        Ok(())
    }
}

fn input<'a>(b: &'a Batch, dropout: Option<&'a Tensor>) -> EncoderInput<'a> {
    EncoderInput {
        ids: &b.ids,
        rev_ids: &b.rev_ids,
        last: &b.last,
        t: b.t,
        b: b.b,
        dropout,
    }
}

fn median_ms(mut v: Vec<f64>) -> Option<f64> {
    let skip = if v.len() > WARMUP { WARMUP } else { 0 };
    v.drain(..skip);
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn correct(logits: &Tensor, labels: &Tensor) -> Result<usize> {
    let p = model::predictions(logits)?;
    let y = labels.to_vec1::<u32>()?;
    Ok(p.iter().zip(&y).filter(|(a, b)| a == b).count())
}

/// The one-process baseline over the first `steps` batches: step times and losses.
/// The first `n` training batches, over as many epochs as that takes (the learning rate of
/// the first epoch throughout: the baseline and the equivalence check compare steps, not a
/// schedule).
fn first_batches(args: &Args, data: &Data, n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::with_capacity(n);
    let mut epoch = 0;
    while out.len() < n {
        let b = data::epoch_batches(data.train.len(), args.batch, args.seed, epoch);
        out.extend(b.into_iter().take(n - out.len()));
        epoch += 1;
    }
    out
}

/// The training batch of words `idx` and the dropout mask of global step `step`: a function
/// of the seed and the step only, the same in every mode.
fn training_batch(
    args: &Args,
    dims: &Dims,
    data: &Data,
    idx: &[usize],
    step: u64,
) -> Result<(Batch, Option<Tensor>)> {
    let batch = data.train.batch(idx)?;
    let mask = data::dropout_mask(args.dropout, batch.b, dims.encoding(), args.seed, step)?;
    Ok((batch, mask))
}

/// The one-process copy of the model: its step times and losses over the first `steps`
/// batches, and the model, which goes on training for more timing samples.
fn local_baseline(
    args: &Args,
    dims: &Dims,
    data: &Data,
    steps: usize,
) -> Result<(LocalModel, Vec<f64>, Vec<f64>)> {
    let mut model = LocalModel::new(dims, args.seed, args.optimizer())?;
    let idx = first_batches(args, data, steps);
    let (times, losses) = local_steps(&mut model, args, dims, data, &idx, 0)?;
    Ok((model, times, losses))
}

/// Trains `model` on `batches` (global steps from `step0`): each step's time and loss.
fn local_steps(
    model: &mut LocalModel,
    args: &Args,
    dims: &Dims,
    data: &Data,
    batches: &[Vec<usize>],
    step0: u64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for (k, idx) in batches.iter().enumerate() {
        let t0 = Instant::now();
        let (batch, mask) = training_batch(args, dims, data, idx, step0 + k as u64)?;
        let loss = model.step(&batch, mask.as_ref())?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        losses.push(f64::from(loss));
    }
    Ok((times, losses))
}

async fn master(
    agent: &Agent,
    args: &Args,
    data: &Data,
    resume_from: Option<Tensors>,
    restart: u32,
) -> Result<i32> {
    let dims = args.dims(data.vocab);
    let start = Instant::now();
    let baseline_steps = if args.check_equivalence {
        EQUIVALENCE_STEPS
    } else if resume_from.is_some() {
        0 // the loss comparison is of the first steps, which a resumed run does not take
    } else {
        args.local_steps
    };
    let (mut local, mut local_times, local_losses) =
        local_baseline(args, &dims, data, baseline_steps)?;
    let mut model = Hybrid::new(agent, args, &dims, shard::instance(agent, 0)).await?;
    let per_epoch = (data.train.len() / args.batch) as u64;

    let mut history = History::default();
    let (mut epoch0, mut step) = (0u64, 0u64);
    let mut progress = EpochProgress::default();
    if let Some(t) = &resume_from {
        (epoch0, step, progress, history) = model.resume(t, &dims, per_epoch).await?;
        println!(
            "resumed from {} (epoch {epoch0}, step {step}, restart {restart})",
            t.path().display()
        );
    }

    if args.check_equivalence {
        return check_equivalence(&model, args, &dims, data, &local_losses).await;
    }

    // A restarted run resumes, if only from step 0 (a failure before the first checkpoint).
    let resumed = resume_from.is_some() || restart > 0;
    let mut tracker =
        examples::recovery::Tracker::open(&args.out_dir, restart, resumed.then_some(step))?;
    tracker.completed(step)?;
    let mut step_times = Vec::new();
    let mut dist_losses = Vec::new();
    let mut last_preds = None;
    let mut last_ckpt = None;
    // Recoveries in this process (`--restart worker`: a worker failed, the master did not).
    let mut in_place = 0u32;
    loop {
        // The training from `step` on; a worker's failure ends it with an error.
        let trained: Result<()> = async {
    for epoch in epoch0..args.epochs {
        let batches = data::epoch_batches(data.train.len(), args.batch, args.seed, epoch);
        model.opt.set_lr(args.lr_at(epoch)).await?;
        let bar = examples::epoch_bar(args.quiet, batches.len() as u64, epoch, args.epochs);
        // Where a resumed epoch picks up.
        let k0 = (step - epoch * per_epoch) as usize;
        bar.set_position(k0 as u64);
        let epoch_start = Instant::now();
        for (k, idx) in batches.iter().enumerate().skip(k0) {
            let t0 = Instant::now();
            let (batch, mask) = training_batch(args, &dims, data, idx, step)?;
            let (loss, logits) = model
                .step(&batch, mask.as_ref())
                .await
                .with_context(|| format!("training step {step}"))?;
            step_times.push(t0.elapsed().as_secs_f64() * 1e3);
            ensure!(
                loss.is_finite(),
                "the loss diverged at step {step} ({loss})"
            );
            if resume_from.is_none() && epoch == 0 && k < local_losses.len() {
                dist_losses.push(f64::from(loss));
            }
            step += 1;
            {
                let p = &mut progress;
                p.loss_sum += f64::from(loss);
                (p.window, p.window_n) = (p.window + f64::from(loss), p.window_n + 1);
                if p.window_n == 50 {
                    history.loss.push((step as f64, p.window / 50.0));
                    (p.window, p.window_n) = (0.0, 0);
                }
                p.hits += correct(&logits, &batch.labels)? as u64;
                p.seen += batch.b as u64;
            }
            tracker.completed(step)?;
            if step % args.checkpoint_every == 0 && k + 1 < batches.len() {
                model
                    .checkpoint(&dims, args, epoch, step, &history, progress)
                    .await?;
                examples::checkpoint::prune(&args.out_dir, args.keep_checkpoints)?;
            }
            bar.set_message(format!(
                "loss {:.3}  acc {:.3}  {:.1} steps/s",
                progress.loss_sum / (k + 1) as f64,
                progress.hits as f64 / progress.seen as f64,
                (k + 1 - k0) as f64 / epoch_start.elapsed().as_secs_f64()
            ));
            bar.inc(1);
        }
        bar.finish_and_clear();
        // More one-process samples, at this point of the run (the workers are idle).
        let n = args.local_steps.min(batches.len());
        let (times, _) = local_steps(&mut local, args, &dims, data, &batches[..n], step)?;
        local_times.extend(times);
        let preds = model.predict(&data.test).await?;
        let test_acc = accuracy(&preds, data.test.labels());
        let done = std::mem::take(&mut progress);
        let train_acc = done.hits as f64 / done.seen.max(1) as f64;
        history.train_acc.push(train_acc);
        history.test_acc.push(test_acc);
        let path = model
            .checkpoint(&dims, args, epoch + 1, step, &history, progress)
            .await?;
        examples::checkpoint::prune(&args.out_dir, args.keep_checkpoints)?;
        println!(
            "epoch {}/{}: train loss {:.4}, train accuracy {:.4}, test accuracy {:.4}, {:.1} s, checkpoint {}",
            epoch + 1,
            args.epochs,
            done.loss_sum / batches.len().max(1) as f64,
            train_acc,
            test_acc,
            epoch_start.elapsed().as_secs_f64(),
            path.display()
        );
        last_preds = Some(preds);
        last_ckpt = Some(path);
    }
    Ok(())
        }
        .await;
        let Err(err) = trained else { break };
        if args.restart != rpcrun::Restart::Worker || examples::is_fatal(&err) {
            return Err(err);
        }
        let lost = model
            .holders
            .await_replacements(&err, Duration::from_secs(args.timeout_secs), "hybrid-rnn")
            .await?;
        in_place += 1;
        // Everything rolls back to the latest checkpoint: the new shards start from it, and
        // so do the encoder and every optimizer state (a step the failure interrupted may
        // have been applied in part).
        drop(model);
        model = Hybrid::new(agent, args, &dims, shard::instance(agent, in_place)).await?;
        let from = match examples::resume::newest_verified(&args.out_dir)? {
            Some(t) => {
                (epoch0, step, progress, history) = model.resume(&t, &dims, per_epoch).await?;
                t.path().display().to_string()
            }
            None => {
                (epoch0, step, progress, history) = Default::default();
                "the initial parameters (no checkpoint yet)".to_owned()
            }
        };
        // The loss comparison keeps the first pass over its steps.
        dist_losses.truncate(step as usize);
        tracker.interrupted(step);
        tracker.completed(step)?;
        println!(
            "recovered in place from {from} (step {step}) after the loss of {}: {err:#}",
            lost.iter()
                .map(|r| agent.name_of(*r))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let preds = match last_preds {
        Some(p) => p,
        None => model.predict(&data.test).await?, // resumed after the last epoch
    };
    let test_acc = accuracy(&preds, data.test.labels());
    println!(
        "\nconfusion matrix (test set):\n{}",
        report::confusion_matrix(data.test.labels(), &preds, &LANGS)
    );
    let plot = args.out_dir.join("training.png");
    report::plot(&history, &plot)?;
    println!("plot: {}", plot.display());

    let replica_diff = model.replica_diff().await?;
    let params_sha256 = model.params_sha256(&dims).await?;
    let rss = futures::try_join!(
        agent.rpc_async(shard::SHARD_RANKS[0], shard::peak_rss_mb, ()),
        agent.rpc_async(shard::SHARD_RANKS[1], shard::peak_rss_mb, ())
    )?;
    let dist = median_ms(step_times);
    let local = median_ms(local_times);
    let max_diff = (!dist_losses.is_empty()).then(|| max_abs_diff(&dist_losses, &local_losses));
    let recoveries = tracker.recoveries()?;
    let line = json!({
        "test_accuracy": round(test_acc, 4),
        "epochs": args.epochs,
        "steps": step,
        "ms_per_step_median": dist.map(|x| round(x, 2)),
        "local_ms_per_step_median": local.map(|x| round(x, 2)),
        "distributed_over_local": dist.zip(local).map(|(d, l)| round(d / l, 3)),
        "max_loss_diff": max_diff,
        "recoveries": recoveries.len(),
        "recovered_in_place": recoveries.iter().filter(|r| r.in_place).count(),
        "time_lost_s": recoveries.iter().map(|r| round(r.time_lost_s, 2)).collect::<Vec<_>>(),
        "restart_s": recoveries.iter().map(|r| round(r.restart_s, 2)).collect::<Vec<_>>(),
        "replayed_steps": recoveries.iter().map(|r| r.failed_after_step - r.resumed_from_step).collect::<Vec<_>>(),
        "replica_max_diff": replica_diff,
        "params_sha256": params_sha256,
        "languages": LANGS.len(),
        "encoder": if dims.bidirectional { "bilstm" } else { "lstm" },
        "master_peak_rss_mb": round(examples::peak_rss_mb(), 1),
        "worker_peak_rss_mb": [round(rss.0, 1), round(rss.1, 1)],
        "wall_s": round(start.elapsed().as_secs_f64(), 1),
        "checkpoint": last_ckpt.map(|p| p.display().to_string()),
        "plot": plot.display().to_string(),
    });
    println!("{line}");
    Ok(0)
}

async fn check_equivalence(
    model: &Hybrid,
    args: &Args,
    dims: &Dims,
    data: &Data,
    local: &[f64],
) -> Result<i32> {
    let mut dist = Vec::new();
    for (step, idx) in first_batches(args, data, local.len()).iter().enumerate() {
        let (batch, mask) = training_batch(args, dims, data, idx, step as u64)?;
        let (loss, _) = model.step(&batch, mask.as_ref()).await?;
        dist.push(f64::from(loss));
        println!(
            "step {step:>2}: distributed loss {loss:.6}, one process {:.6}",
            local[step]
        );
    }
    let diff = max_abs_diff(&dist, local);
    let ok = dist.len() == local.len() && diff <= EQUIVALENCE_TOLERANCE;
    println!(
        "{}",
        json!({"check": "equivalence", "steps": dist.len(), "max_loss_diff": diff,
               "tolerance": EQUIVALENCE_TOLERANCE, "ok": ok})
    );
    Ok(if ok { 0 } else { 1 })
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn accuracy(preds: &[u32], labels: &[u32]) -> f64 {
    preds.iter().zip(labels).filter(|(p, y)| p == y).count() as f64 / labels.len().max(1) as f64
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

fn load_data(args: &Args) -> Result<Data> {
    Data::load(
        args.data_dir.as_deref(),
        args.train_limit,
        args.test_limit,
        args.batch,
    )
}
