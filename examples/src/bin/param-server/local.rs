//! The local mode: rank 0 (this process) starts the servers and trainers as its children on
//! 127.0.0.1, drives each run through RPCs, and injects the failures itself.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use collectives::Consistency;
use rpc_core::Agent;

use crate::model::{
    accuracy, final_params, reset_shards, stats, train, Fault, TrainReport, BACKUPS, FIRST_TRAINER,
    SHARDS, TRAINERS,
};
use crate::Args;

/// Failures to inject in a run.
#[derive(Clone, Copy, Default)]
struct Faults {
    kill_server_at: Option<u64>,
    kill_trainer_at: Option<u64>,
    fail_trainer_at: Option<u64>,
    replace_trainer: bool,
}

impl Faults {
    /// Whether any fault is asked for (`replace_trainer` only says how a killed one is met).
    fn any(&self) -> bool {
        self.kill_server_at.is_some()
            || self.kill_trainer_at.is_some()
            || self.fail_trainer_at.is_some()
    }
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
        fail_trainer_at: args.fail_trainer_at,
        replace_trainer: args.replace_trainer,
    };
    let with_faults = faults.any();
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
    let with_faults = faults.any();
    tracing::info!(?mode, with_faults, "a run starts");
    let start = Instant::now();
    let trainer_rank = |t: usize| FIRST_TRAINER + t as u32;
    let mut runs = Runs::default();
    let victim = TRAINERS - 1;
    for t in 0..TRAINERS {
        let slow = if t == 0 { args.slow_factor } else { 1.0 };
        let fault = faults
            .fail_trainer_at
            .filter(|_| t == victim)
            .map(|at| (at, Fault::Error));
        runs.start(
            t,
            tokio::spawn(agent.rpc_async(
                trainer_rank(t),
                train,
                (t, args.steps, slow, 7, args.backup, false, fault),
            )),
        );
    }
    let mut server_killed = faults.kill_server_at.is_none();
    let mut trainer_killed = faults.kill_trainer_at.is_none();
    // Only the killed trainer's own run may fail, when no replacement takes its index.
    let may_fail = |t: usize, killed: bool| t == victim && killed && !faults.replace_trainer;
    // Until every run has ended: watch the trainers' clocks (on shard 0's primary, which is
    // never killed) and inject the failures when they are due.
    while !runs.collect(|t| may_fail(t, trainer_killed)).await? {
        if server_killed && trainer_killed {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
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
                runs.start(
                    victim,
                    tokio::spawn(agent.rpc_async(
                        rank,
                        train,
                        (victim, args.steps, 1.0, 7, args.backup, true, None),
                    )),
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut acked = Vec::new();
    let mut failed_over = false;
    let mut rejoined_at = None;
    for (t, r) in runs.ended.into_iter().enumerate() {
        match r.expect("every run ended") {
            Ok((a, over, first)) => {
                failed_over |= over.iter().any(|&o| o);
                // A replacement's count covers only its own part of the run.
                let replacement = t == victim && faults.kill_trainer_at.is_some();
                if replacement {
                    rejoined_at = Some(first);
                }
                acked.push((!replacement).then_some(a));
            }
            Err(e) => {
                tracing::info!(cause = %e, "the killed trainer's run ended");
                acked.push(None);
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    tracing::info!(seconds, "every trainer's run ended");
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
    tracing::info!("the run's final parameters are in");
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

/// A trainer's run: its `train` call.
type Run = tokio::task::JoinHandle<Result<TrainReport, rpc_core::RpcError>>;

/// The trainers' runs, by trainer index, and the result of each one that ended.
#[derive(Default)]
struct Runs {
    running: Vec<Option<Run>>,
    ended: Vec<Option<Result<TrainReport, rpc_core::RpcError>>>,
}

impl Runs {
    /// Trainer `t`'s run is `run` (a replacement's takes the place of the killed one's).
    fn start(&mut self, t: usize, run: Run) {
        if self.running.len() <= t {
            self.running.resize_with(t + 1, || None);
            self.ended.resize_with(t + 1, || None);
        }
        self.running[t] = Some(run);
        self.ended[t] = None;
    }

    /// Takes in the runs that ended; whether all have. A run that failed, unless `may_fail`
    /// says its trainer may, fails the whole run at once, naming it: the other trainers' BSP
    /// pulls would wait for its steps until their deadline, saying nothing.
    async fn collect(&mut self, may_fail: impl Fn(usize) -> bool) -> Result<bool> {
        for (t, slot) in self.running.iter_mut().enumerate() {
            if !slot.as_ref().is_some_and(|r| r.is_finished()) {
                continue;
            }
            match slot.take().expect("a finished run").await? {
                Err(e) if !may_fail(t) => {
                    let rank = FIRST_TRAINER + t as u32;
                    return Err(anyhow::Error::new(e))
                        .with_context(|| format!("trainer {t} (rank {rank}) failed"));
                }
                result => self.ended[t] = Some(result),
            }
        }
        Ok(self.running.iter().all(Option::is_none))
    }
}
