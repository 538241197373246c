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

mod args;
mod checkpoint;
mod hybrid;
mod local;
mod report;
mod shard;
mod train;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Parser;
use examples::Fatal;
use rpc_core::{Config, Registry};

use args::{load_data, Args};

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
        .register(shard::usable_devices)?
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
        .with_signal_grace(examples::SIGNAL_GRACE)
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
        let result = train::master(&agent, &args, &data, resume_from, restart).await;
        // After a failure a worker may be gone; shutdown notices dead peers by itself (the
        // barrier and RRef traffic stop waiting for them), so this also returns in seconds.
        let report = examples::shutdown_after(&agent, &result).await;
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
    let trace = args.trace.as_deref();
    examples::launch_here("hybrid-rnn", 3, args.max_restarts, args.restart, trace)
}
