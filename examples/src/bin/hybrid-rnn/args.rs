//! The command line: every flag, its checks, and what follows from the flags (the model's
//! dimensions, the flags a checkpoint must match, the learning-rate schedule).

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use autograd_dist::{DeviceSpec, OptimizerKind};
use clap::Parser;
use examples::checkpoint::Flags;
use examples::lang::data::Data;
use examples::lang::model::Dims;
use examples::lang::wordlang::LANGS;
use examples::resume::StartFlags;

/// Hybrid-parallel training of a character-LSTM language identifier: a master (embedding and
/// encoder) and two workers (classifier heads, one split over two devices), on 127.0.0.1 or
/// in a group the environment describes.
#[derive(Parser, Debug, Clone)]
#[command(name = "hybrid-rnn", version)]
pub struct Args {
    /// Epochs to train (in total, counting those of a resumed checkpoint).
    #[arg(long, default_value_t = 6)]
    pub epochs: u64,
    /// Words per step (split in two halves, one per worker).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Adam's initial learning rate; it follows a cosine down to 5% of it by the last epoch.
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Dropout probability on the encoding (0 disables it).
    #[arg(long, default_value_t = 0.3)]
    pub dropout: f32,
    /// Character embedding width.
    #[arg(long, default_value_t = 64)]
    pub embedding: usize,
    /// LSTM state width per direction.
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    /// The head's hidden width.
    #[arg(long, default_value_t = 128)]
    pub head_hidden: usize,
    /// Read words in one direction only (the PyTorch reference's encoder).
    #[arg(long)]
    pub unidirectional: bool,
    /// Seed of the initial parameters, the batch order and the dropout masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where checkpoints (`ckpt-<step>.safetensors`), the progress record and the plot
    /// (`training.png`) go.
    #[arg(long, default_value = "target/hybrid-rnn")]
    pub out_dir: PathBuf,
    /// Require a checkpoint in `--out-dir` to go on from (without it, a run goes on from the
    /// newest verified checkpoint there if there is one, and starts from the beginning if
    /// not). The model and data flags must be the checkpoint's; the learning-rate schedule
    /// follows `--epochs`.
    #[arg(long)]
    pub resume: bool,
    /// Start from the beginning: the checkpoints and records of an earlier run in `--out-dir`
    /// are moved into `--out-dir/previous-<n>` (never deleted). Only on a first start: a run
    /// the launcher restarts goes on from its own checkpoints.
    #[arg(long)]
    pub fresh: bool,
    /// Write a checkpoint every K steps (and at every epoch's end): at most K steps are
    /// replayed after a failure (1000 steps: under a minute on a 2-core machine).
    #[arg(long, default_value_t = 1000)]
    pub checkpoint_every: u64,
    /// Checkpoints kept in `--out-dir` (older ones are removed).
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Local mode: trace the job into one file (Trace Event Format, for Perfetto or
    /// chrome://tracing; `rpctrace report PATH` says what held each step up).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<std::path::PathBuf>,
    /// Local mode: restarts after a failure (a killed or frozen process) before giving up.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// Local mode: what a failure restarts: `group` (all three processes; the new master
    /// resumes from the latest checkpoint) or `worker` (the failed process alone: a failed
    /// worker's replacement joins the running group and the master, keeping its process,
    /// restores from the latest checkpoint and replays).
    #[arg(long, default_value = "group")]
    pub restart: rpcrun::Restart,
    /// Only compare 20 distributed steps with the same steps in one process, and fail if a
    /// loss differs by more than 1e-4.
    #[arg(long)]
    pub check_equivalence: bool,
    /// Steps of the one-process baseline measured before training (0: none).
    #[arg(long, default_value_t = 40)]
    pub local_steps: usize,
    /// The dataset directory (default: `$WORDLANG_DIR`, else the repository's data/wordlang).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Use only the first N training words (quick runs).
    #[arg(long)]
    pub train_limit: Option<usize>,
    /// Use only the first N test words (quick runs).
    #[arg(long)]
    pub test_limit: Option<usize>,
    /// NetShard1's device: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub shard1_device: DeviceSpec,
    /// NetShard2's two devices, `A,B` (e.g. `cuda:0,cuda:1`); `auto` picks two GPUs where the
    /// build has CUDA and two exist, else `cpu,cpu`.
    #[arg(long, default_value = "auto")]
    pub shard2_devices: String,
    /// Timeout of every remote call, and how long a worker waits for the master.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// How long to wait for every process of the group to join.
    #[arg(long, default_value_t = 60)]
    pub init_timeout_secs: u64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl Args {
    pub fn validate(&self) -> Result<()> {
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

    pub fn shard2_devices(&self) -> Result<(DeviceSpec, DeviceSpec)> {
        if self.shard2_devices == "auto" {
            let two_gpus = autograd_dist::cuda_devices().is_ok_and(|n| n >= 2);
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

    pub fn dims(&self, vocab: usize) -> Dims {
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
    pub fn flags(&self, dims: &Dims) -> Flags {
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

    pub fn start_flags(&self) -> StartFlags {
        StartFlags {
            resume: self.resume,
            fresh: self.fresh,
        }
    }

    pub fn optimizer(&self) -> OptimizerKind {
        OptimizerKind::adam(self.lr)
    }

    /// The learning rate of `epoch` (0-based): cosine annealing from `lr` to `lr / 20`.
    pub fn lr_at(&self, epoch: u64) -> f64 {
        let min = self.lr / 20.0;
        let frac = epoch as f64 / self.epochs.max(1) as f64;
        min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * frac).cos())
    }
}

/// The data set the flags choose.
pub fn load_data(args: &Args) -> Result<Data> {
    Data::load(
        args.data_dir.as_deref(),
        args.train_limit,
        args.test_limit,
        args.batch,
    )
}
