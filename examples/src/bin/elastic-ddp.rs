//! Data parallelism that survives a killed replica: four processes train one model with
//! `ElasticDdp`, one is SIGKILLed mid-run, and the group goes on.
//!
//! `cargo run --release -p examples --bin elastic-ddp -- [--steps N] [--commit-every K]
//! [--kill-at STEP] [--wait-for-replacement]` starts four processes on 127.0.0.1, each a
//! replica of a softmax regression over hashed character n-grams of the word-language data
//! (the global batch of 96 is split over the replicas; gradients are averaged with the ring).
//! With `--kill-at`, rank 0 SIGKILLs rank 3 just before that step's all-reduce. The survivors'
//! all-reduce fails naming it; they roll back to the last commit and either re-form the ring
//! over three (the sampler re-partitions the same global batch over them), or, with
//! `--wait-for-replacement`, rank 0 starts a new process for rank 3, which joins the running
//! group as its next incarnation and receives the committed parameters and step, and the four
//! go on. Rank 0 prints one JSON line: `members`, `reforms`, `recovered_from_step`,
//! `steps_replayed`, `recovery_s`, `replicas_identical` (the replicas' parameters compared
//! bit for bit over the final group), `params_sha256`, `test_accuracy`, `seconds`.
//!
//! Under a launcher (`rpcrun --nproc 4 --restart worker -- elastic-ddp`, on one node or
//! several) every rank is a replica and faults come from outside: a replica that fails is
//! started again by its launcher, joins as its rank's next incarnation, and the others wait
//! for it (as with `--wait-for-replacement`), so the run ends with the parameters of an
//! uninterrupted one. With `--restart group` every replica starts again from the beginning.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use collectives::{DistributedSampler, ElasticDdp, ReduceOp, Rejoin};
use examples::lang::wordlang::{dense, logits, DIM, LANGS};
use rpc_core::trace::Cat;
use rpc_core::{Agent, Config, Registry};

const WORLD: u32 = 4;
const BATCH: usize = 96;
const LR: f64 = 0.5;
const SEED: u64 = 3;

struct Args {
    steps: u64,
    commit_every: u64,
    kill_at: Option<u64>,
    victim: u32,
    wait: bool,
    trace: Option<std::path::PathBuf>,
    out_dir: Option<std::path::PathBuf>,
}

const USAGE: &str =
    "elastic-ddp: data parallelism that survives a lost replica: four replica processes train \
with a ring all-reduce, commit every K steps, and, when a replica is killed, roll back to the \
commit and go on with three (or with a replacement process).\n\n\
usage: elastic-ddp [--steps N] [--commit-every K] [--kill-at STEP] [--victim RANK] \
[--wait-for-replacement] [--out-dir DIR] [--trace PATH]\n\n\
--victim RANK: the replica killed at --kill-at (default 3); under a launcher it kills itself \
(SIGKILL), and any rank may be the victim, rank 0 included.\n\
--out-dir DIR: rank 0 writes the steps done to DIR/progress as it goes.\n\
--trace PATH: every process records the job's trace, merged into PATH at the end (Trace Event \
Format, for Perfetto; `rpctrace report PATH` says what held each step up).";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        steps: 300,
        commit_every: 20,
        kill_at: None,
        victim: 3,
        wait: false,
        trace: None,
        out_dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--steps" => a.steps = value()?.parse().context("--steps takes an integer")?,
            "--commit-every" => {
                a.commit_every = value()?
                    .parse()
                    .context("--commit-every takes an integer")?
            }
            "--kill-at" => a.kill_at = Some(value()?.parse().context("--kill-at takes a step")?),
            "--victim" => a.victim = value()?.parse().context("--victim takes a rank")?,
            "--wait-for-replacement" => a.wait = true,
            "--out-dir" => a.out_dir = Some(value()?.into()),
            "--trace" => a.trace = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (try --help)"),
        }
    }
    if a.steps == 0 || a.commit_every == 0 {
        bail!("--steps and --commit-every must be positive");
    }
    if a.kill_at.is_some_and(|k| k == 0 || k >= a.steps) {
        bail!("--kill-at must be within 1..{} (--steps)", a.steps);
    }
    if a.victim >= WORLD {
        bail!("--victim must be a rank within 0..{WORLD}");
    }
    if a.victim == 0 && !examples::is_worker() {
        bail!("--victim 0: rank 0 starts the others here; under a launcher any rank may be it");
    }
    if let Some(d) = &a.out_dir {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    Ok(a)
}

fn registry() -> Result<Registry> {
    Ok(collectives::install(Registry::builder())?.build())
}

/// Heartbeats every 100 ms, declared failed after 1 s: a killed replica is found at once (its
/// connections close), a frozen one within the second. Where the environment sets either
/// (`RPC_HEARTBEAT_INTERVAL_MS`, `RPC_FAILURE_TIMEOUT_MS`, on a loaded machine say), the
/// library reads both from it instead.
fn liveness(c: Config) -> Config {
    let set = |key: &str| std::env::var_os(key).is_some();
    if set(rpc_core::HEARTBEAT_INTERVAL_ENV) || set(rpc_core::FAILURE_TIMEOUT_ENV) {
        return c;
    }
    c.with_heartbeat_interval(Duration::from_millis(100))
        .with_failure_timeout(Duration::from_secs(1))
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    let args = parse_args()?;
    let timeout = Duration::from_secs(120);
    if examples::is_worker() {
        return rt.block_on(async {
            let cfg = liveness(Config::new())
                .with_rpc_timeout(timeout)
                .with_shutdown_timeout(timeout);
            let agent = rpc_core::init(cfg, registry()?).await?;
            let result = replica(&agent, &args, None).await;
            let report = agent.shutdown().await;
            let summary = result?;
            if agent.rank() == 0 {
                println!("{summary}");
            }
            examples::check_shutdown(&agent, &report)
        });
    }
    let mut workers = examples::Workers::spawn_traced(
        WORLD,
        std::env::args().skip(1).collect(),
        args.trace.as_deref(),
    )?;
    rt.block_on(async {
        let cfg = liveness(workers.rank0_config("worker0", timeout));
        let agent = rpc_core::init(cfg, registry()?).await?;
        let result = replica(&agent, &args, Some(&mut workers)).await;
        let report = examples::shutdown_after(&agent, &result).await;
        println!("{}", result?);
        examples::check_shutdown(&agent, &report)
    })?;
    workers.wait_success(Duration::from_secs(60))
}

/// One replica's training; rank 0 (holding the worker processes) also injects the failure,
/// starts the replacement, and returns the summary.
async fn replica(
    agent: &Agent,
    args: &Args,
    mut workers: Option<&mut examples::Workers>,
) -> Result<serde_json::Value> {
    let data = examples::lang::wordlang::load(&examples::lang::wordlang::data_dir(), "train.tsv")?;
    let vars = vec![
        Var::from_tensor(&Tensor::zeros(
            (DIM, LANGS.len()),
            DType::F32,
            &Device::Cpu,
        )?)?,
        Var::from_tensor(&Tensor::zeros(LANGS.len(), DType::F32, &Device::Cpu)?)?,
    ];
    let world = collectives::world(agent);
    let started = Instant::now();
    let (mut el, mut step) = if agent.incarnation() > 0 {
        let (el, step) = ElasticDdp::join(world, vars).await?;
        tracing::warn!(step, "joined the data-parallel group as a replacement");
        (el, step)
    } else {
        (ElasticDdp::new(world, vars).await?, 0)
    };
    let mut sgd = candle_nn::SGD::new(el.ddp().vars().to_vec(), LR)?;
    // Replaced one by one, a lost replica comes back by its launcher's hand.
    let replaced = std::env::var(rpc_core::RESTART_MODE_ENV).is_ok_and(|m| m == "worker");
    let rejoin = if args.wait || replaced {
        Rejoin::WaitForReplacement
    } else {
        Rejoin::Shrink
    };
    // A replacement recovered from the step it joined at.
    let (mut recovered_from, mut replayed, mut recovery_s) =
        ((agent.incarnation() > 0).then_some(step), 0, 0.0);
    let mut failures = 0;
    // The same global batch every step, split over the current replicas.
    let order = DistributedSampler::new(data.len(), 1, 0, SEED).indices(0);
    while step < args.steps {
        if step % args.commit_every == 0 {
            el.commit(step)?;
        }
        let mut span = agent.tracer().span(Cat::Step, "step");
        span.detail(|| format!("step {step}"));
        let (i, n) = el.replica();
        let global = (step as usize * BATCH) % (order.len() - BATCH);
        let per = BATCH / n;
        let batch: Vec<_> = order[global + i * per..global + (i + 1) * per]
            .iter()
            .map(|&k| data[k].clone())
            .collect();
        let (x, y) = dense(&batch)?;
        let v = el.ddp().vars();
        let compute = agent.tracer().span(Cat::Compute, "forward and backward");
        let loss =
            candle_nn::loss::cross_entropy(&logits(&x, v[0].as_tensor(), v[1].as_tensor())?, &y)?;
        let mut grads = loss.backward()?;
        drop(compute);
        if args.kill_at == Some(step) && failures == 0 {
            if let Some(w) = workers.as_deref_mut() {
                w.kill(args.victim)?;
                tracing::warn!(rank = args.victim, step, "killed a replica (SIGKILL)");
            } else if agent.rank() == args.victim && agent.incarnation() == 0 {
                tracing::warn!(step, "killing this replica (SIGKILL), as --victim asks");
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
            }
        }
        match el.ddp().reduce_gradients(&mut grads).await {
            Ok(()) => {
                let _update = agent.tracer().span(Cat::Optimizer, "optimizer step");
                sgd.step(&grads)?;
                step += 1;
                if let (Some(d), 0) = (&args.out_dir, agent.rank()) {
                    std::fs::write(d.join("progress"), format!("{step}\n"))?;
                }
            }
            Err(e) => {
                failures += 1;
                anyhow::ensure!(failures <= 3, "recovering again and again: {e}");
                let at = Instant::now();
                tracing::warn!(
                    step, cause = %rpc_core::error_chain(&e), "an all-reduce failed; recovering"
                );
                if let (Some(w), true) = (workers.as_deref_mut(), args.wait) {
                    wait_declared(agent, args.victim, Duration::from_secs(30)).await?;
                    w.respawn(args.victim)?;
                }
                let from = el.recover_with(Duration::from_secs(60), rejoin).await?;
                recovery_s = at.elapsed().as_secs_f64();
                replayed = step - from;
                recovered_from = Some(from);
                step = from;
            }
        }
    }
    let group = el.group().clone();
    let flat = Tensor::cat(
        &el.ddp()
            .vars()
            .iter()
            .map(|v| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?,
        0,
    )?;
    let hi = group.all_reduce(&flat, ReduceOp::Max).await?;
    let lo = group.all_reduce(&flat, ReduceOp::Min).await?;
    let identical = hi
        .eq(&lo)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar::<u32>()? as usize
        == flat.elem_count();
    if agent.rank() != 0 {
        return Ok(serde_json::Value::Null);
    }
    let named: Vec<(String, Tensor)> = ["w", "b"]
        .iter()
        .zip(el.ddp().vars())
        .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
        .collect();
    let test = examples::lang::wordlang::load(&examples::lang::wordlang::data_dir(), "test.tsv")?;
    let v = el.ddp().vars();
    let mut correct = 0usize;
    for chunk in test.chunks(1000) {
        let (x, y) = dense(chunk)?;
        let pred = logits(&x, v[0].as_tensor(), v[1].as_tensor())?.argmax(1)?;
        correct += pred
            .eq(&y)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    Ok(serde_json::json!({
        "steps": args.steps,
        "members": group.size(),
        "ranks": group.ranks(),
        "incarnations": group.incarnations(),
        "reforms": el.reforms(),
        "killed_at": args.kill_at,
        "wait_for_replacement": args.wait,
        "recovered_from_step": recovered_from,
        "steps_replayed": replayed,
        "recovery_s": recovery_s,
        "replicas_identical": identical,
        "params_sha256": examples::checkpoint::params_sha256(&named)?,
        "test_accuracy": correct as f64 / test.len() as f64,
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// Waits until the group has declared `rank` failed.
async fn wait_declared(agent: &Agent, rank: u32, within: Duration) -> Result<()> {
    let by = Instant::now() + within;
    while agent.is_live(rank)? {
        anyhow::ensure!(
            Instant::now() < by,
            "rank {rank} was not declared failed within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}
