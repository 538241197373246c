//! The command line: every flag, its checks, and what follows from the flags (the model's
//! dimensions, the flags a checkpoint must match).

use std::path::PathBuf;

use anyhow::{ensure, Result};
use autograd_dist::{DeviceSpec, Schedule};
use clap::Parser;
use examples::checkpoint::Flags;
use examples::lang::data::Data;
use examples::lang::model::Dims;
use examples::lang::wordlang::LANGS;

/// Pipeline-parallel training of the language identifier: a master and one process per stage.
#[derive(Parser, Debug)]
#[command(name = "pipeline", version)]
pub struct Args {
    /// Stages (worker processes): the encoder, then blocks of the fully connected layers.
    #[arg(long, default_value_t = 3)]
    pub stages: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 8)]
    pub micro_batches: usize,
    /// `gpipe` (every forward, then every backward) or `1f1b` (one forward, one backward).
    #[arg(long, default_value = "1f1b")]
    pub schedule: Schedule,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 2)]
    pub epochs: u64,
    /// Words per batch (default 256; 1024 for `--bench`, where micro-batches of 128 words
    /// keep the matrix products efficient).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Character embedding width.
    #[arg(long, default_value_t = 64)]
    pub emb: usize,
    /// LSTM state width.
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    /// Width of the fully connected layers.
    #[arg(long, default_value_t = 512)]
    pub mlp_width: usize,
    /// Fully connected layers before the classifier.
    #[arg(long, default_value_t = 4)]
    pub mlp_layers: usize,
    /// Second device of the last stage, which splits its layers over two devices
    /// (`cpu`, `cuda:1`).
    #[arg(long, default_value = "cpu")]
    pub last_stage_device: DeviceSpec,
    /// Seed of the initial parameters and the data order.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Use only the first N training words.
    #[arg(long)]
    pub train_limit: Option<usize>,
    /// Use only the first N test words.
    #[arg(long)]
    pub test_limit: Option<usize>,
    /// Directory of `train.tsv` and `test.tsv` (default: the bundled data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Where the timeline picture, the checkpoints (`ckpt-<step>.safetensors`) and the
    /// progress record go.
    #[arg(long, default_value = "target/pipeline")]
    pub out_dir: PathBuf,
    /// Write a checkpoint every K steps (and at every epoch's end): at most K steps are
    /// replayed after a failure.
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// Checkpoints kept in `--out-dir` (older ones are removed).
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Require a checkpoint in `--out-dir` to go on from (without it, a run goes on from the
    /// newest verified checkpoint there if there is one, written with the same model and data
    /// flags, and starts from the beginning if not).
    #[arg(long)]
    pub resume: bool,
    /// Start from the beginning: an earlier run's checkpoints and records in `--out-dir` are
    /// moved into `--out-dir/previous-<n>` (never deleted). Only on a first start.
    #[arg(long)]
    pub fresh: bool,
    /// Local mode: trace the job into one file (Trace Event Format, for Perfetto or
    /// chrome://tracing; `rpctrace report PATH` says what held each step up).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<std::path::PathBuf>,
    /// Local mode: restarts after a failure (a killed or frozen process) before giving up.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Local mode: what a failure restarts: `group` (every process; the new master resumes
    /// from the latest checkpoint) or `worker` (the failed process alone: the master keeps
    /// its process, rebuilds the stages, restores the latest checkpoint and replays).
    #[arg(long, default_value = "group")]
    pub restart: rpcrun::Restart,
    /// Only compare GPipe and 1F1B with 1, 2, 4 and 8 micro-batches against one process
    /// (gradients, then 20 SGD steps); exits 1 above 1e-5.
    #[arg(long)]
    pub check_equivalence: bool,
    /// Only measure: one JSON line per schedule, stage count (2 and 4) and micro-batch count.
    #[arg(long)]
    pub bench: bool,
    /// Steps timed per configuration of `--bench` (after 3 untimed).
    #[arg(long, default_value_t = 12)]
    pub bench_steps: usize,
    /// Fault injection: kill this stage's process (a stage's index, or `master`) with SIGKILL
    /// during step `--kill-at-step` (once: not again when a recovered run replays that step).
    #[arg(long, requires = "kill_at_step")]
    pub kill_stage: Option<Victim>,
    /// The step (counted from 0) during which `--kill-stage` is killed.
    #[arg(long)]
    pub kill_at_step: Option<u64>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Per-call timeout, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// How long the group may take to form, seconds.
    #[arg(long, default_value_t = 120)]
    pub init_timeout_secs: u64,
}

impl Args {
    pub fn batch(&self) -> usize {
        self.batch.unwrap_or(if self.bench { 1024 } else { 256 })
    }

    pub fn validate(&self) -> Result<()> {
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
        for (flag, width) in [
            ("--emb", self.emb),
            ("--hidden", self.hidden),
            ("--mlp-width", self.mlp_width),
        ] {
            ensure!(width >= 1, "{flag} must be at least 1 (a layer of width 0)");
        }
        ensure!(
            self.checkpoint_every > 0,
            "--checkpoint-every must be at least 1"
        );
        ensure!(
            self.keep_checkpoints > 0,
            "--keep-checkpoints must be at least 1 (0 removes each checkpoint as it is written)"
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
    pub fn world(&self) -> u32 {
        if self.bench {
            5
        } else {
            self.stages as u32 + 1
        }
    }

    /// The flags that must match for a checkpoint to continue this run.
    pub fn flags(&self, data: &Data) -> Flags {
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

    pub fn dims(&self, vocab: usize) -> Dims {
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
pub enum Victim {
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

/// The data set the flags choose.
pub fn load_data(args: &Args) -> Result<Data> {
    Data::load(
        args.data_dir.as_deref(),
        args.train_limit,
        args.test_limit,
        args.batch(),
    )
}
