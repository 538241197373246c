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

mod args;
mod bench;
mod equivalence;
mod model;
mod process;
mod stages;
mod timeline;
mod train;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Parser;
use examples::Fatal;
use rpc_core::{Config, Registry};

use args::{load_data, Args};
use stages::{EncoderStage, MlpStage};

fn main() {
    examples::main_with("pipeline", run);
}

fn registry() -> Result<Registry> {
    let b = rref::install(Registry::builder())?;
    let b = autograd_dist::install(b)?;
    let b = autograd_dist::register_module::<EncoderStage>(b)?;
    let b = autograd_dist::register_module::<MlpStage>(b)?;
    Ok(b.register(process::peak_rss_mb)?
        .register(process::reset_peak_rss)?
        .register(process::die)?
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
        .with_signal_grace(examples::SIGNAL_GRACE)
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
            equivalence::check_equivalence(&agent, &args, &data).await
        } else if args.bench {
            bench::bench(&agent, &args, &data).await
        } else {
            train::train(&agent, &args, &data, restart).await
        };
        // After a failure a stage may be gone; shutdown notices dead peers by itself.
        let report = examples::shutdown_after(&agent, &result).await;
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
            examples::checkpoint::latest(&args.out_dir)?.is_some(),
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
    let trace = args.trace.as_deref();
    examples::launch_here(
        "pipeline",
        args.world(),
        args.max_restarts,
        args.restart,
        trace,
    )
}
