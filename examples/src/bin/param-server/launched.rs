//! The launched mode: `rpcrun --nproc 6 --restart worker -- param-server [--steps N] ...`, on
//! one node or several. Every process takes its role from its rank and none drives another:
//! the servers (ranks 1 and 2) serve their copies of the shards from the start, the trainers
//! (ranks 3–5) wait until every live server is ready and then train on their own, and rank 0
//! watches the shards' clocks until every trainer index has pushed its last step, collects
//! the trainers' reports, evaluates, prints the JSON line and shuts the group down.
//!
//! Any one process may fail and be started again by its launcher (`--restart worker`):
//! - a server's replacement holds nothing: each shard it held is served by its other copy from
//!   the failure on (PS-5, PS-8; nothing re-replicates a shard, so losing its second copy too
//!   ends the job with an error naming the shard);
//! - a trainer's replacement takes over its index at the others' step (PS-6);
//! - rank 0's replacement watches the same clocks and reports the same way.
//!
//! With `--restart group` every process starts again, from zeros.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rpc_core::{
    remote, Agent, BoxError, CallContext, Config, RegistryBuilder, RegistryError, RpcError,
};

use crate::model::{
    self, accuracy, final_params, stats, Fault, Plan, TrainReport, BACKUPS, FIRST_TRAINER, SHARDS,
    TRAINERS, WORLD,
};
use crate::Args;

/// Longest time the coordinator waits without any trainer pushing a step (a replacement's
/// start and join included) before it gives the job up.
const STALL: Duration = Duration::from_secs(300);

/// Whether this process was started by a launcher of ours (`rpcrun`, which names its restart
/// mode), rather than by the local mode's rank 0.
pub fn under_launcher() -> bool {
    examples::is_worker() && std::env::var_os(rpc_core::RESTART_MODE_ENV).is_some()
}

/// Server: its shards are in place.
static READY: AtomicBool = AtomicBool::new(false);
/// Trainer: what its loop reported, once it ended.
static REPORT: Mutex<Option<TrainReport>> = Mutex::new(None);

/// Server → trainer: whether this server serves its copies of the shards yet.
#[remote]
async fn ready(_ctx: CallContext) -> Result<bool, BoxError> {
    Ok(READY.load(Ordering::SeqCst))
}

/// Trainer → coordinator: the trainer's report and this process's incarnation, once its
/// loop has ended.
#[remote]
async fn trainer_report(ctx: CallContext) -> Result<Option<(TrainReport, u64)>, BoxError> {
    let r = REPORT.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(r.map(|r| (r, ctx.agent().incarnation())))
}

/// The launched mode's functions (every process registers them, in both modes).
pub fn register(b: RegistryBuilder) -> Result<RegistryBuilder, RegistryError> {
    b.register(ready)?.register(trainer_report)
}

/// Whether this is the first attempt's first incarnation (faults are injected only there).
fn first_attempt(agent: &Agent) -> bool {
    let restarts = rpc_core::RESTART_COUNT_ENV
        .iter()
        .find_map(|k| std::env::var(k).ok())
        .unwrap_or_default();
    agent.incarnation() == 0 && matches!(restarts.as_str(), "" | "0")
}

/// Runs this process's role; rank 0 prints the run's JSON line.
pub async fn run(args: &Args) -> Result<()> {
    let timeout = Duration::from_secs(120);
    let cfg = Config::new()
        .with_rpc_timeout(timeout)
        .with_shutdown_timeout(timeout)
        .with_signal_grace(examples::SIGNAL_GRACE);
    let agent = rpc_core::init(cfg, crate::registry()?).await?;
    if agent.world_size() != WORLD as usize {
        return Err(examples::Fatal(format!(
            "param-server needs {WORLD} processes (rank 0 coordinates, 1-2 serve, 3-5 train), \
             not {}: run it with `rpcrun --nproc {WORLD}` (or nodes x processes that make it)",
            agent.world_size()
        ))
        .into());
    }
    let rank = agent.rank();
    if rank == 0 {
        let result = coordinate(&agent, args).await;
        let report = examples::shutdown_after(&agent, &result).await;
        println!("{}", result?);
        return examples::check_shutdown(&agent, &report);
    }
    if rank < FIRST_TRAINER {
        serve(&agent, args)?;
    } else {
        let t = (rank - FIRST_TRAINER) as usize;
        let plan = Plan {
            steps: args.steps,
            slow_factor: if t == 0 { args.slow_factor } else { 1.0 },
            seed: 7,
            backup: args.backup,
            fault: [
                (args.kill_trainer_at, Fault::Signal(libc::SIGKILL)),
                (args.freeze_trainer_at, Fault::Signal(libc::SIGSTOP)),
                (args.fail_trainer_at, Fault::Error),
            ]
            .into_iter()
            .find_map(|(at, fault)| Some((at?, fault)))
            .filter(|_| t == TRAINERS - 1 && first_attempt(&agent)),
        };
        let join = agent.incarnation() > 0;
        if !join {
            wait_for_servers(&agent).await?;
        }
        let r = model::train_loop(&agent, t, plan, join)
            .await
            .with_context(|| format!("trainer {t}"))?;
        *REPORT.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }
    let report = agent.wait_for_group().await;
    examples::check_shutdown(&agent, &report)
}

/// Server: serves its copies of the shards (a first incarnation) or nothing (a replacement,
/// PS-8); with `--kill-server-at`, server 2's first incarnation SIGKILLs itself once every
/// trainer has pushed that many steps to its shard.
fn serve(agent: &Agent, args: &Args) -> Result<()> {
    if agent.incarnation() > 0 {
        tracing::warn!(
            "a replacement server holds no shard: the shards it held are served by their \
             other copies"
        );
        return Ok(());
    }
    model::serve_shards(agent, args.modes[0], args.backup)?;
    READY.store(true, Ordering::SeqCst);
    let (victim, shard) = SHARDS[1];
    if let (Some(k), true) = (args.kill_server_at, agent.rank() == victim) {
        if first_attempt(agent) {
            let agent = agent.clone();
            tokio::spawn(async move {
                loop {
                    let s = collectives::shard_stats(&agent, shard);
                    if s.is_some_and(|s| s.clocks.iter().all(|&c| c >= k)) {
                        tracing::warn!(step = k, "killing this server (SIGKILL), as asked");
                        // SAFETY: kill has no memory-safety preconditions.
                        unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            });
        }
    }
    Ok(())
}

/// Trainer: waits (at most a minute) until every server the group has not declared failed
/// serves its shards, so that no first pull meets a shard not yet in place.
async fn wait_for_servers(agent: &Agent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for server in 1..FIRST_TRAINER {
        loop {
            if !agent.is_live(server)? {
                break;
            }
            if let Ok(true) = agent.rpc_async(server, ready, ()).await {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "server `{}` did not serve its shards within 60 s",
                agent.name_of(server)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// The rank that serves shard number `i` now: its primary unless any incarnation of it
/// failed (a replacement holds nothing, PS-8), else its backup.
fn holder(agent: &Agent, i: usize) -> u32 {
    let primary = SHARDS[i].0;
    if collectives::primary_failed(agent, primary) {
        BACKUPS[i]
    } else {
        primary
    }
}

/// Rank 0: waits until every trainer index has pushed its last step on every shard (writing
/// the slowest step to `--out-dir`'s `progress`), then reports the run.
async fn coordinate(agent: &Agent, args: &Args) -> Result<serde_json::Value> {
    let test = model::load("test.tsv")?;
    let started = Instant::now();
    let (mut last, mut moved) = (None, Instant::now());
    let (applied, max_staleness) = loop {
        anyhow::ensure!(
            moved.elapsed() < STALL,
            "no trainer pushed a step for {} s (clocks per shard: {last:?})",
            STALL.as_secs()
        );
        let mut now = Vec::new();
        for (i, &(_, shard)) in SHARDS.iter().enumerate() {
            // A server that just failed answers nothing: asked again on the next round.
            if let Ok(s) = agent.rpc_async(holder(agent, i), stats, (shard,)).await {
                now.push(s);
            }
        }
        if now.len() == SHARDS.len() {
            let clocks: Vec<Vec<u64>> = now.iter().map(|s| s.1.clone()).collect();
            if last.as_ref() != Some(&clocks) {
                moved = Instant::now();
                let slowest = clocks.iter().flatten().min().copied().unwrap_or(0);
                if let Some(d) = &args.out_dir {
                    std::fs::write(d.join("progress"), format!("{slowest}\n"))?;
                }
                last = Some(clocks.clone());
            }
            if clocks.iter().flatten().all(|&c| c >= args.steps) {
                let staleness = now.iter().map(|s| s.0).max().unwrap_or(0);
                break (now.into_iter().map(|s| s.2).collect::<Vec<_>>(), staleness);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    let reports = collect_reports(agent).await?;
    let (w, b) = final_params(agent, args.backup).await?;
    // Pushes acknowledged to a trainer that ran throughout, missing on the shards.
    let lost: u64 = reports
        .iter()
        .enumerate()
        .filter_map(|(t, r)| r.as_ref().filter(|(_, inc)| *inc == 0).map(|r| (t, r)))
        .map(|(t, ((acked, ..), _))| acked.saturating_sub(applied.iter().map(|s| s[t]).sum()))
        .sum();
    let first =
        |r: &Option<(TrainReport, u64)>| r.as_ref().map(|((.., first), inc)| (*first, *inc));
    let named = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
    Ok(serde_json::json!({
        "mode": format!("{:?}", args.modes[0]),
        "launched": true,
        "steps_per_trainer": args.steps,
        "trainers": TRAINERS,
        "seconds": seconds,
        "test_accuracy": accuracy(&w, &b, &test)?,
        "max_staleness_observed": max_staleness,
        "updates_lost": lost,
        // Every trainer index pushed its last step on every shard (what the wait above ends
        // on). A trainer killed between its pushes to the two shards leaves them one push of
        // it apart: a step it was never acknowledged.
        "finished": true,
        "acked_pushes": reports.iter()
            .map(|r| r.as_ref().and_then(|((a, ..), inc)| (*inc == 0).then_some(*a)))
            .collect::<Vec<_>>(),
        "applied_updates": applied,
        "failed_over": reports.iter().flatten().any(|((_, over, _), _)| over.iter().any(|&o| o)),
        "trainer_rejoined_at": reports.iter()
            .map(|r| first(r).and_then(|(f, inc)| (inc > 0).then_some(f)))
            .collect::<Vec<_>>(),
        "trainers_lost_at_the_end": reports.iter().enumerate()
            .filter_map(|(t, r)| r.is_none().then_some(t))
            .collect::<Vec<_>>(),
        "incarnations": (0..WORLD).map(|r| agent.incarnation_of(r).ok()).collect::<Vec<_>>(),
        "params_sha256": examples::checkpoint::params_sha256(&named)?,
    }))
}

/// Every trainer's report (asked again while its loop is still ending, or its process is
/// being replaced; at most a minute); `None` for one lost after its last step (the shards
/// hold all of it: nobody replaces it).
async fn collect_reports(agent: &Agent) -> Result<Vec<Option<(TrainReport, u64)>>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    for t in 0..TRAINERS {
        let rank = FIRST_TRAINER + t as u32;
        loop {
            match agent.rpc_async(rank, trainer_report, ()).await {
                Ok(Some(r)) => {
                    out.push(Some(r));
                    break;
                }
                Ok(None) => {}
                Err(e @ (RpcError::PeerFailed { .. } | RpcError::PeerLeft { .. })) => {
                    tracing::warn!(rank, cause = %e, "a trainer was lost after its last step");
                    out.push(None);
                    break;
                }
                Err(e) => tracing::info!(rank, cause = %e, "asking a trainer for its report"),
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "trainer {t} (rank {rank}) did not report within 60 s of the last step"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(out)
}
