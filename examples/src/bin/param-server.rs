//! A parameter server training a real model, in BSP, SSP and ASP modes.
//!
//! `cargo run --release -p examples --bin param-server -- [--slow-factor F] [--steps N]
//! [--staleness S]` starts five processes on 127.0.0.1: ranks 0 and 1 hold the two parameter
//! shards, ranks 2–4 are trainers, one of them slowed down by `--slow-factor`. The model is a
//! softmax regression over hashed character 1–3-grams that identifies a word's language (the
//! Debian word lists in `data/wordlang`). For each mode it prints one JSON line with `mode`,
//! `staleness_bound`, `steps_per_s`, `test_accuracy` and `max_staleness_observed`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use collectives::{Consistency, PsClient};
use examples::wordlang::LANGS;
use rpc_core::{remote, Agent, BoxError, CallContext, Registry};

const DIM: usize = 4096;
const HALF: usize = DIM / 2;
const BATCH: usize = 64;
const LR: f64 = 0.5;
fn load(name: &str) -> Result<Vec<(String, usize)>> {
    examples::wordlang::load(&examples::wordlang::data_dir(), name)
}

/// Hashed character 1–3-grams of `^word$`.
fn features(word: &str) -> Vec<usize> {
    let chars: Vec<char> = std::iter::once('^')
        .chain(word.chars())
        .chain(std::iter::once('$'))
        .collect();
    let mut out = Vec::new();
    for n in 1..=3 {
        for w in chars.windows(n) {
            let h = w.iter().fold(0xcbf2_9ce4_8422_2325u64 ^ n as u64, |h, c| {
                (h ^ u64::from(*c as u32)).wrapping_mul(0x100_0000_01b3)
            });
            out.push((h % DIM as u64) as usize);
        }
    }
    out
}

fn dense(batch: &[(String, usize)]) -> Result<(Tensor, Tensor)> {
    let mut x = vec![0f32; batch.len() * DIM];
    for (i, (w, _)) in batch.iter().enumerate() {
        for f in features(w) {
            x[i * DIM + f] += 1.0;
        }
    }
    let y: Vec<u32> = batch.iter().map(|(_, y)| *y as u32).collect();
    Ok((
        Tensor::from_vec(x, (batch.len(), DIM), &Device::Cpu)?,
        Tensor::new(y.as_slice(), &Device::Cpu)?,
    ))
}

fn logits(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(w)?.broadcast_add(b)
}

/// Trainer: `steps` steps over its partition, pulling and pushing through the servers.
#[remote]
async fn train(
    ctx: CallContext,
    trainer: usize,
    steps: u64,
    slow_factor: f64,
    seed: u64,
) -> Result<(), BoxError> {
    let data = load("train.tsv")?;
    let sampler = collectives::DistributedSampler::new(data.len(), 3, trainer, seed);
    let mine = sampler.indices(0);
    let client = PsClient::new(ctx.agent(), vec![(0, 0), (1, 1)], trainer);
    for step in 0..steps {
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
    }
    Ok(())
}

/// Server: (re)initializes its shard for a run.
#[remote]
async fn reset_shard(ctx: CallContext, shard: u64, mode: Consistency) -> Result<(), BoxError> {
    let w = Tensor::zeros((HALF, LANGS.len()), DType::F32, &Device::Cpu)?;
    let mut params = vec![w];
    if shard == 0 {
        params.push(Tensor::zeros(LANGS.len(), DType::F32, &Device::Cpu)?);
    }
    collectives::serve_shard(ctx.agent(), shard, params, LR, mode, 3);
    Ok(())
}

/// Server: the largest staleness its shard granted.
#[remote]
async fn staleness(ctx: CallContext, shard: u64) -> Result<u64, BoxError> {
    Ok(collectives::shard_stats(ctx.agent(), shard).map_or(0, |(s, _)| s))
}

fn registry() -> Result<Registry> {
    let b = Registry::builder()
        .register(train)?
        .register(reset_shard)?
        .register(staleness)?;
    Ok(collectives::install(b)?.build())
}

struct Args {
    slow_factor: f64,
    steps: u64,
    staleness: u64,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        slow_factor: 3.0,
        steps: 400,
        staleness: 3,
    };
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
            "-h" | "--help" => {
                println!("param-server [--slow-factor F] [--steps N] [--staleness S]");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (try --help)"),
        }
    }
    if a.slow_factor < 1.0 || a.steps == 0 {
        bail!("--slow-factor must be >= 1 and --steps > 0");
    }
    Ok(a)
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    if examples::is_worker() {
        return rt.block_on(examples::serve_until_shutdown(
            registry()?,
            Duration::from_secs(300),
        ));
    }
    let args = parse_args()?;
    let test = load("test.tsv")?;
    load("train.tsv")?;
    let workers = examples::Workers::spawn(5)?;
    rt.block_on(async {
        let agent = rpc_core::init(
            workers.rank0_config("server0", Duration::from_secs(300)),
            registry()?,
        )
        .await?;
        let result = run_modes(&agent, &args, &test).await;
        let report = agent.shutdown().await;
        result?;
        anyhow::ensure!(report.is_clean(), "shutdown: {report:?}");
        Ok::<_, anyhow::Error>(())
    })?;
    workers.wait_success(Duration::from_secs(60))
}

async fn run_modes(agent: &Agent, args: &Args, test: &[(String, usize)]) -> Result<()> {
    let mut results = HashMap::new();
    for mode in [
        Consistency::Bsp,
        Consistency::Ssp(args.staleness),
        Consistency::Asp,
    ] {
        for shard in 0..2u64 {
            agent
                .rpc_async(shard as u32, reset_shard, (shard, mode))
                .await?;
        }
        let start = Instant::now();
        let runs = (0..3usize).map(|t| {
            let slow = if t == 0 { args.slow_factor } else { 1.0 };
            agent.rpc_async(2 + t as u32, train, (t, args.steps, slow, 7))
        });
        rpc_core::wait_all(runs).await?;
        let secs = start.elapsed().as_secs_f64();
        let mut observed = 0;
        for shard in 0..2u64 {
            observed = observed.max(agent.rpc_async(shard as u32, staleness, (shard,)).await?);
        }
        // Evaluate the final parameters on the test split.
        let client = PsClient::new(agent, vec![(0, 0), (1, 1)], 0);
        let shards = client.pull(0).await?;
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
        let (name, bound) = match mode {
            Consistency::Bsp => ("BSP", Some(0)),
            Consistency::Ssp(s) => ("SSP", Some(s)),
            Consistency::Asp => ("ASP", None),
        };
        let steps_per_s = (3 * args.steps) as f64 / secs;
        results.insert(name, steps_per_s);
        println!(
            "{}",
            serde_json::json!({
                "mode": name,
                "staleness_bound": bound,
                "steps_per_s": steps_per_s,
                "test_accuracy": correct as f64 / test.len() as f64,
                "max_staleness_observed": observed,
                "trainers": 3,
                "server_shards": 2,
                "steps_per_trainer": args.steps,
                "slow_factor": args.slow_factor,
                "seconds": secs,
            })
        );
    }
    Ok(())
}
