//! The local mode: rank 0 (this process) starts the servers and trainers as its children on
//! 127.0.0.1, drives each run through RPCs, and injects the failures itself.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use collectives::Consistency;
use rpc_core::Agent;

use crate::model::{
    accuracy, final_params, reset_shards, stats, train, BACKUPS, FIRST_TRAINER, SHARDS, TRAINERS,
};
use crate::Args;

/// Failures to inject in a run.
#[derive(Clone, Copy, Default)]
struct Faults {
    kill_server_at: Option<u64>,
    kill_trainer_at: Option<u64>,
    replace_trainer: bool,
}

/// What a run measured.
struct Outcome {
    seconds: f64,
    accuracy: f64,
    max_staleness: u64,
    /// Per trainer that ran throughout: pushes acknowledged.
    acked: Vec<Option<u64>>,
    /// Per shard, per trainer: pushes in the final parameters.
    applied: Vec<Vec<u64>>,
    failed_over: bool,
    rejoined_at: Option<u64>,
}

pub async fn run_modes(
    agent: &Agent,
    args: &Args,
    test: &[(String, usize)],
    workers: &mut examples::Workers,
) -> Result<()> {
    let faults = Faults {
        kill_server_at: args.kill_server_at,
        kill_trainer_at: args.kill_trainer_at,
        replace_trainer: args.replace_trainer,
    };
    let with_faults = faults.kill_server_at.is_some() || faults.kill_trainer_at.is_some();
    for &mode in &args.modes {
        let base = run(agent, args, mode, test, workers, Faults::default()).await?;
        let (name, bound) = match mode {
            Consistency::Bsp => ("BSP", Some(0)),
            Consistency::Ssp(s) => ("SSP", Some(s)),
            Consistency::Asp => ("ASP", None),
        };
        let mut line = serde_json::json!({
            "mode": name,
            "staleness_bound": bound,
            "steps_per_s": (TRAINERS as u64 * args.steps) as f64 / base.seconds,
            "test_accuracy": base.accuracy,
            "max_staleness_observed": base.max_staleness,
            "trainers": TRAINERS,
            "server_shards": SHARDS.len(),
            "backups": args.backup,
            "steps_per_trainer": args.steps,
            "slow_factor": args.slow_factor,
            "seconds": base.seconds,
        });
        if with_faults {
            let hurt = run(agent, args, mode, test, workers, faults).await?;
            // Pushes acknowledged to a trainer that ran throughout, missing on the shards.
            let lost: u64 = hurt
                .acked
                .iter()
                .enumerate()
                .filter_map(|(t, a)| a.map(|a| (t, a)))
                .map(|(t, a)| a.saturating_sub(hurt.applied.iter().map(|s| s[t]).sum()))
                .sum();
            let extra = serde_json::json!({
                "kill_server_at": faults.kill_server_at,
                "kill_trainer_at": faults.kill_trainer_at,
                "baseline_accuracy": base.accuracy,
                "test_accuracy": hurt.accuracy,
                "updates_lost": lost,
                "acked_pushes": hurt.acked,
                "applied_updates": hurt.applied,
                "failed_over": hurt.failed_over,
                "trainer_rejoined_at": hurt.rejoined_at,
                "steps_per_s": (TRAINERS as u64 * args.steps) as f64 / hurt.seconds,
                "baseline_steps_per_s": (TRAINERS as u64 * args.steps) as f64 / base.seconds,
                "max_staleness_observed": hurt.max_staleness,
                "seconds": hurt.seconds,
            });
            for (k, v) in extra.as_object().into_iter().flatten() {
                line[k] = v.clone();
            }
        }
        println!("{line}");
    }
    Ok(())
}

/// Trains every trainer from scratch in `mode`, injecting `faults`.
async fn run(
    agent: &Agent,
    args: &Args,
    mode: Consistency,
    test: &[(String, usize)],
    workers: &mut examples::Workers,
    faults: Faults,
) -> Result<Outcome> {
    let servers: Vec<u32> = (1..FIRST_TRAINER)
        .filter(|&r| agent.is_live(r).unwrap_or(false))
        .collect();
    anyhow::ensure!(
        servers.len() == SHARDS.len(),
        "a server was lost in an earlier run"
    );
    for &s in &servers {
        agent
            .rpc_async(s, reset_shards, (mode, args.backup))
            .await?;
    }
    let start = Instant::now();
    let trainer_rank = |t: usize| FIRST_TRAINER + t as u32;
    let mut runs: Vec<tokio::task::JoinHandle<_>> = (0..TRAINERS)
        .map(|t| {
            let slow = if t == 0 { args.slow_factor } else { 1.0 };
            tokio::spawn(agent.rpc_async(
                trainer_rank(t),
                train,
                (t, args.steps, slow, 7, args.backup, false),
            ))
        })
        .collect();
    let victim = TRAINERS - 1;
    let mut server_killed = faults.kill_server_at.is_none();
    let mut trainer_killed = faults.kill_trainer_at.is_none();
    let mut rejoined_at = None;
    // Watch the trainers' clocks (on shard 0's primary, which is never killed) and inject
    // the failures when they are due.
    while !(server_killed && trainer_killed) && runs.iter().any(|r| !r.is_finished()) {
        let (_, clocks, _) = agent.rpc_async(SHARDS[0].0, stats, (SHARDS[0].1,)).await?;
        let live_min = clocks.iter().copied().min().unwrap_or(0);
        if !server_killed && faults.kill_server_at.is_some_and(|k| live_min >= k) {
            workers.kill(SHARDS[1].0)?;
            tracing::warn!(
                rank = SHARDS[1].0,
                step = live_min,
                "killed a server (SIGKILL)"
            );
            server_killed = true;
        }
        if !trainer_killed && faults.kill_trainer_at.is_some_and(|k| clocks[victim] >= k) {
            let rank = trainer_rank(victim);
            workers.kill(rank)?;
            tracing::warn!(rank, step = clocks[victim], "killed a trainer (SIGKILL)");
            trainer_killed = true;
            if faults.replace_trainer {
                let mut watch = agent.watch_membership();
                workers.respawn(rank)?;
                wait_joined(&mut watch, rank).await?;
                runs[victim] = tokio::spawn(agent.rpc_async(
                    rank,
                    train,
                    (victim, args.steps, 1.0, 7, args.backup, true),
                ));
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut acked = Vec::new();
    let mut failed_over = false;
    for (t, r) in runs.into_iter().enumerate() {
        match r.await? {
            Ok((a, over, first)) => {
                failed_over |= over.iter().any(|&o| o);
                // A replacement's count covers only its own part of the run.
                let replacement = t == victim && faults.kill_trainer_at.is_some();
                if replacement {
                    rejoined_at = Some(first);
                }
                acked.push((!replacement).then_some(a));
            }
            Err(e)
                if t == victim && faults.kill_trainer_at.is_some() && !faults.replace_trainer =>
            {
                tracing::info!(cause = %e, "the killed trainer's run ended");
                acked.push(None);
            }
            Err(e) => return Err(e).with_context(|| format!("trainer {t}")),
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    // Every shard's counters, from a live holder of it.
    let mut max_staleness = 0;
    let mut applied = Vec::new();
    for (i, &(primary, shard)) in SHARDS.iter().enumerate() {
        let holder = if agent.is_live(primary)? {
            primary
        } else {
            BACKUPS[i]
        };
        let (s, clocks, a) = agent.rpc_async(holder, stats, (shard,)).await?;
        max_staleness = max_staleness.max(s);
        if faults.replace_trainer || faults.kill_trainer_at.is_none() {
            anyhow::ensure!(
                clocks.iter().all(|&c| c == args.steps),
                "shard {shard}: not every trainer finished: {clocks:?}"
            );
        }
        applied.push(a);
    }
    // Evaluate the final parameters on the test split.
    let (w, b) = final_params(agent, args.backup).await?;
    Ok(Outcome {
        seconds,
        accuracy: accuracy(&w, &b, test)?,
        max_staleness,
        acked,
        applied,
        failed_over,
        rejoined_at,
    })
}

/// Waits (at most a minute) until a new incarnation of `rank` has joined.
async fn wait_joined(watch: &mut rpc_core::MembershipWatch, rank: u32) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(e) = watch.next().await {
            if e.rank == rank && matches!(e.change, rpc_core::MembershipChange::Joined { .. }) {
                return Ok(());
            }
        }
        bail!("the membership watch ended")
    })
    .await
    .context("the replacement trainer did not join within 60 s")?
}
