//! A parameter server training a real model, in BSP, SSP and ASP modes, that survives the
//! loss of a server process and of a trainer.
//!
//! `cargo run --release -p examples --bin param-server -- [--slow-factor F] [--steps N]
//! [--staleness S] [--mode bsp|ssp|asp|all] [--no-backup] [--kill-server-at STEP]
//! [--kill-trainer-at STEP] [--no-replacement]` starts six processes on 127.0.0.1: rank 0
//! coordinates and evaluates, ranks 1 and 2 serve the two parameter shards (each the other's
//! backup unless `--no-backup`: primary-backup, an update is acknowledged once both hold it),
//! ranks 3–5 are trainers, the first slowed down by `--slow-factor`. The model is a softmax
//! regression over hashed character 1–3-grams that identifies a word's language (the Debian
//! word lists in `data/wordlang`). For each mode it prints one JSON line with `mode`,
//! `staleness_bound`, `steps_per_s`, `test_accuracy` and `max_staleness_observed`.
//!
//! With `--kill-server-at` or `--kill-trainer-at` (one mode, BSP unless `--mode` says
//! otherwise) it first trains without failures, then again from scratch while it SIGKILLs
//! server 2 (the primary of shard 1 and backup of shard 0) once every trainer has pushed that
//! many steps, and/or trainer 3 (rank 5) once it has; a replacement process for the trainer
//! joins the running group and takes over its index at the others' step (unless
//! `--no-replacement`). The failure run's line adds `baseline_accuracy`, `updates_lost` (pushes
//! acknowledged to the trainers that ran throughout but missing from the final parameters:
//! must be 0), `applied_updates`, `failed_over` and `trainer_rejoined_at`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use collectives::{Consistency, PsClient, Replica};
use examples::lang::wordlang::{dense, logits, DIM, LANGS};
use rpc_core::trace::Cat;
use rpc_core::{remote, Agent, BoxError, CallContext, Registry};

const HALF: usize = DIM / 2;
const BATCH: usize = 64;
const LR: f64 = 0.5;
fn load(name: &str) -> Result<Vec<(String, usize)>> {
    examples::lang::wordlang::load(&examples::lang::wordlang::data_dir(), name)
}

/// The trainers' shards: `(primary rank, shard id)`, and each one's backup.
const SHARDS: [(u32, u64); 2] = [(1, 0), (2, 1)];
const BACKUPS: [u32; 2] = [2, 1];
const TRAINERS: usize = 3;
const FIRST_TRAINER: u32 = 3;

fn client(agent: &Agent, trainer: usize, backup: bool) -> PsClient {
    let c = PsClient::new(agent, SHARDS.to_vec(), trainer);
    if backup {
        c.with_backups(BACKUPS.map(Some))
    } else {
        c
    }
}

/// What a trainer reports: pushes acknowledged, whether it failed over (per shard), and the
/// step it started at.
type TrainReport = (u64, Vec<bool>, u64);

/// Trainer: steps up to `steps` over its partition, pulling and pushing through the servers;
/// as a replacement (`join`), it first takes over trainer index `trainer` and starts at the
/// step the shards give it.
#[remote]
async fn train(
    ctx: CallContext,
    trainer: usize,
    steps: u64,
    slow_factor: f64,
    seed: u64,
    backup: bool,
    join: bool,
) -> Result<TrainReport, BoxError> {
    let data = load("train.tsv")?;
    let sampler = collectives::DistributedSampler::new(data.len(), TRAINERS, trainer, seed);
    let mine = sampler.indices(0);
    let client = client(ctx.agent(), trainer, backup);
    let first = if join { client.join().await? } else { 0 };
    for step in first..steps {
        let mut span = ctx.agent().tracer().span(Cat::Step, "step");
        span.detail(|| format!("trainer {trainer} step {step}"));
        let shards = client.pull(step).await?;
        let started = Instant::now();
        let w = Var::from_tensor(&Tensor::cat(&[&shards[0][0], &shards[1][0]], 0)?)?;
        let b = Var::from_tensor(&shards[0][1])?;
        let at = (step as usize * BATCH) % mine.len().saturating_sub(BATCH).max(1);
        let batch: Vec<_> = mine[at..at + BATCH]
            .iter()
            .map(|&i| data[i].clone())
            .collect();
        let (x, y) = dense(&batch)?;
        let loss = candle_nn::loss::cross_entropy(&logits(&x, w.as_tensor(), b.as_tensor())?, &y)?;
        let g = loss.backward()?;
        let gw = g.get(w.as_tensor()).context("no gradient")?;
        let gb = g.get(b.as_tensor()).context("no gradient")?;
        if slow_factor > 1.0 {
            tokio::time::sleep(started.elapsed().mul_f64(slow_factor - 1.0)).await;
        }
        client
            .push(
                step,
                vec![
                    vec![gw.narrow(0, 0, HALF)?, gb.clone()],
                    vec![gw.narrow(0, HALF, HALF)?],
                ],
            )
            .await?;
        drop(span);
    }
    Ok((
        client.acked_pushes(),
        (0..SHARDS.len()).map(|i| client.failed_over(i)).collect(),
        first,
    ))
}

/// Server: (re)initializes its copies of the shards for a run: the primary of `shard` and,
/// with `backup`, the backup of the other.
#[remote]
async fn reset_shards(ctx: CallContext, mode: Consistency, backup: bool) -> Result<(), BoxError> {
    let me = ctx.agent().rank();
    for (i, &(primary, shard)) in SHARDS.iter().enumerate() {
        let replica = if primary == me {
            if backup {
                Replica::Primary { backup: BACKUPS[i] }
            } else {
                Replica::Sole
            }
        } else if backup && BACKUPS[i] == me {
            Replica::Backup { primary }
        } else {
            continue;
        };
        let mut params = vec![Tensor::zeros(
            (HALF, LANGS.len()),
            DType::F32,
            &Device::Cpu,
        )?];
        if shard == 0 {
            params.push(Tensor::zeros(LANGS.len(), DType::F32, &Device::Cpu)?);
        }
        collectives::serve_replica(ctx.agent(), shard, params, LR, mode, TRAINERS, replica);
    }
    Ok(())
}

/// Server: shard `shard`'s counters here (`(max staleness, clocks, applied per trainer)`).
#[remote]
async fn stats(ctx: CallContext, shard: u64) -> Result<(u64, Vec<u64>, Vec<u64>), BoxError> {
    let s = collectives::shard_stats(ctx.agent(), shard)
        .ok_or_else(|| format!("no shard {shard} on `{}`", ctx.agent().name()))?;
    Ok((s.max_staleness, s.clocks, s.applied))
}

fn registry() -> Result<Registry> {
    let b = Registry::builder()
        .register(train)?
        .register(reset_shards)?
        .register(stats)?;
    Ok(collectives::install(b)?.build())
}

struct Args {
    slow_factor: f64,
    steps: u64,
    staleness: u64,
    modes: Vec<Consistency>,
    backup: bool,
    kill_server_at: Option<u64>,
    kill_trainer_at: Option<u64>,
    replace_trainer: bool,
    trace: Option<std::path::PathBuf>,
}

const USAGE: &str =
    "param-server: a parameter server over RPC, trained on the word-language data: two \
server processes hold two shards (each the other's backup), three trainer processes pull and push \
under BSP, SSP or ASP; optionally a server and a trainer are killed and recovered.\n\n\
usage: param-server [--slow-factor F] [--steps N] [--staleness S] \
     [--mode bsp|ssp|asp|all] [--no-backup] [--kill-server-at STEP] [--kill-trainer-at STEP] \
     [--no-replacement] [--trace PATH]\n\n\
--trace PATH: every process records the job's trace, merged into PATH at the end (Trace Event \
Format, for Perfetto; `rpctrace report PATH` says what held each trainer's step up).";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        slow_factor: 3.0,
        steps: 400,
        staleness: 3,
        modes: Vec::new(),
        backup: true,
        kill_server_at: None,
        kill_trainer_at: None,
        replace_trainer: true,
        trace: None,
    };
    let mut mode = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--slow-factor" => {
                a.slow_factor = value()?.parse().context("--slow-factor takes a number")?
            }
            "--steps" => a.steps = value()?.parse().context("--steps takes an integer")?,
            "--staleness" => {
                a.staleness = value()?.parse().context("--staleness takes an integer")?
            }
            "--mode" => mode = Some(value()?),
            "--no-backup" => a.backup = false,
            "--kill-server-at" => {
                a.kill_server_at = Some(value()?.parse().context("--kill-server-at takes a step")?)
            }
            "--kill-trainer-at" => {
                a.kill_trainer_at =
                    Some(value()?.parse().context("--kill-trainer-at takes a step")?)
            }
            "--no-replacement" => a.replace_trainer = false,
            "--trace" => a.trace = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (try --help)"),
        }
    }
    if a.slow_factor < 1.0 || a.steps == 0 {
        bail!("--slow-factor must be >= 1 and --steps > 0");
    }
    let faults = a.kill_server_at.is_some() || a.kill_trainer_at.is_some();
    let all = [
        Consistency::Bsp,
        Consistency::Ssp(a.staleness),
        Consistency::Asp,
    ];
    a.modes = match mode.as_deref() {
        None if faults => vec![Consistency::Bsp],
        None | Some("all") => all.to_vec(),
        Some("bsp") => vec![all[0]],
        Some("ssp") => vec![all[1]],
        Some("asp") => vec![all[2]],
        Some(m) => bail!("--mode takes bsp, ssp, asp or all, not {m:?}"),
    };
    if faults && a.modes.len() != 1 {
        bail!("a run with failures trains one mode: pass --mode bsp, ssp or asp");
    }
    if a.kill_server_at.is_some() && !a.backup {
        bail!("--kill-server-at needs the backups (without them the shard is lost)");
    }
    for k in [a.kill_server_at, a.kill_trainer_at].into_iter().flatten() {
        if k == 0 || k >= a.steps {
            bail!("a kill step must be within 1..{} (--steps)", a.steps);
        }
    }
    Ok(a)
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    if examples::is_worker() {
        return rt.block_on(examples::serve_through_failures(
            registry()?,
            Duration::from_secs(300),
        ));
    }
    let args = parse_args()?;
    let test = load("test.tsv")?;
    load("train.tsv")?;
    let mut workers = examples::Workers::spawn_traced(
        FIRST_TRAINER + TRAINERS as u32,
        Vec::new(),
        args.trace.as_deref(),
    )?;
    rt.block_on(async {
        let agent = rpc_core::init(
            workers.rank0_config("master", Duration::from_secs(300)),
            registry()?,
        )
        .await?;
        let result = run_modes(&agent, &args, &test, &mut workers).await;
        let report = examples::shutdown_after(&agent, &result).await;
        result?;
        examples::check_shutdown(&agent, &report)
    })?;
    workers.wait_success(Duration::from_secs(60))
}

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

async fn run_modes(
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
    let shards = client(agent, 0, args.backup).pull(0).await?;
    let w = Tensor::cat(&[&shards[0][0], &shards[1][0]], 0)?;
    let b = &shards[0][1];
    let mut correct = 0usize;
    for chunk in test.chunks(1000) {
        let (x, y) = dense(chunk)?;
        let pred = logits(&x, &w, b)?.argmax(1)?;
        correct += pred
            .eq(&y)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    Ok(Outcome {
        seconds,
        accuracy: correct as f64 / test.len() as f64,
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
