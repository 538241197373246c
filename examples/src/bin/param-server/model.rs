//! What both modes share: the model (a softmax regression split into two shards), the
//! servers' shards, a trainer's loop, and the evaluation of the final parameters.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use collectives::{Consistency, PsClient, Replica};
use examples::lang::wordlang::{dense, logits, DIM, LANGS};
use rpc_core::trace::Cat;
use rpc_core::{remote, Agent, BoxError, CallContext, Registry, RegistryBuilder, RegistryError};

const HALF: usize = DIM / 2;
const BATCH: usize = 64;
const LR: f64 = 0.5;

pub fn load(name: &str) -> Result<Vec<(String, usize)>> {
    examples::lang::wordlang::load(&examples::lang::wordlang::data_dir(), name)
}

/// The trainers' shards: `(primary rank, shard id)`, and each one's backup.
pub const SHARDS: [(u32, u64); 2] = [(1, 0), (2, 1)];
pub const BACKUPS: [u32; 2] = [2, 1];
pub const TRAINERS: usize = 3;
pub const FIRST_TRAINER: u32 = 3;

/// Every process of a run: the coordinator, the servers, the trainers.
pub const WORLD: u32 = FIRST_TRAINER + TRAINERS as u32;

pub fn client(agent: &Agent, trainer: usize, backup: bool) -> PsClient {
    let c = PsClient::new(agent, SHARDS.to_vec(), trainer);
    if backup {
        c.with_backups(BACKUPS.map(Some))
    } else {
        c
    }
}

/// What a trainer reports: pushes acknowledged, whether it failed over (per shard), and the
/// step it started at.
pub type TrainReport = (u64, Vec<bool>, u64);

/// How a trainer trains (the same for every trainer of a run but the first's slowness).
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub steps: u64,
    pub slow_factor: f64,
    pub seed: u64,
    pub backup: bool,
    /// A fault to inject at this step (before its push; at `steps`, after the last one).
    pub fault: Option<(u64, Fault)>,
}

/// A fault a trainer injects into itself, as asked.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub enum Fault {
    /// It sends its process this signal (SIGKILL, or SIGSTOP: frozen).
    Signal(i32),
    /// Its run ends with an error; the process lives on.
    Error,
}

/// Injects `plan`'s fault if `step` is its step.
fn fault_at(plan: &Plan, step: u64) -> Result<()> {
    match plan.fault.filter(|(at, _)| *at == step) {
        Some((at, Fault::Signal(sig))) => {
            tracing::warn!(
                step = at,
                signal = sig,
                "this trainer signals itself, as asked"
            );
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(std::process::id() as i32, sig) };
            Ok(())
        }
        Some((at, Fault::Error)) => anyhow::bail!("failed at step {at}, as asked"),
        None => Ok(()),
    }
}

/// Trainer: steps up to `steps` over its partition, pulling and pushing through the servers;
/// as a replacement (`join`), it first takes over trainer index `trainer` and starts at the
/// step the shards give it; `fault`: one to inject into itself.
#[remote]
pub async fn train(
    ctx: CallContext,
    trainer: usize,
    steps: u64,
    slow_factor: f64,
    seed: u64,
    backup: bool,
    join: bool,
    fault: Option<(u64, Fault)>,
) -> Result<TrainReport, BoxError> {
    let plan = Plan {
        steps,
        slow_factor,
        seed,
        backup,
        fault,
    };
    match train_loop(ctx.agent(), trainer, plan, join).await {
        Ok(r) => Ok(r),
        Err(e) if ctx.agent().is_shutting_down() => {
            // The job ended under it (another's failure, said where it happened).
            tracing::info!(trainer, cause = %examples::said(&e), "the trainer's run was cut short");
            Err(e.into())
        }
        Err(e) => {
            // Said here too: the caller may be waiting on another trainer's run.
            tracing::error!(trainer, cause = %examples::said(&e), "the trainer's run failed");
            Err(e.into())
        }
    }
}

/// The loop of [`train`], for trainer index `trainer` on `agent`'s process.
pub async fn train_loop(
    agent: &Agent,
    trainer: usize,
    plan: Plan,
    join: bool,
) -> Result<TrainReport> {
    let data = load("train.tsv")?;
    let sampler = collectives::DistributedSampler::new(data.len(), TRAINERS, trainer, plan.seed);
    let mine = sampler.indices(0);
    let client = client(agent, trainer, plan.backup);
    let first = if join { client.join().await? } else { 0 };
    for step in first..plan.steps {
        let mut span = agent.tracer().span(Cat::Step, "step");
        span.detail(|| format!("trainer {trainer} step {step}"));
        fault_at(&plan, step)?;
        let shards = client.pull(step).await?;
        let started = Instant::now();
        let compute = agent.tracer().span(Cat::Compute, "forward and backward");
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
        drop(compute);
        if plan.slow_factor > 1.0 {
            let _slow = agent.tracer().span(Cat::Compute, "slowed (--slow-factor)");
            tokio::time::sleep(started.elapsed().mul_f64(plan.slow_factor - 1.0)).await;
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
    fault_at(&plan, plan.steps.max(first))?;
    Ok((
        client.acked_pushes(),
        (0..SHARDS.len()).map(|i| client.failed_over(i)).collect(),
        first,
    ))
}

/// Server: (re)initializes its copies of the shards for a run: the primary of `shard` and,
/// with `backup`, the backup of the other.
#[remote]
pub async fn reset_shards(
    ctx: CallContext,
    mode: Consistency,
    backup: bool,
) -> Result<(), BoxError> {
    Ok(serve_shards(ctx.agent(), mode, backup)?)
}

/// The body of [`reset_shards`]: serves, from zeros, the copies of the shards that `agent`'s
/// rank holds (retiring those of an earlier run first).
pub fn serve_shards(agent: &Agent, mode: Consistency, backup: bool) -> Result<()> {
    let me = agent.rank();
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
        collectives::retire_shard(agent, shard);
        collectives::serve_replica(agent, shard, params, LR, mode, TRAINERS, replica)?;
    }
    Ok(())
}

/// Server: shard `shard`'s counters here (`(max staleness, clocks, applied per trainer)`).
#[remote]
pub async fn stats(ctx: CallContext, shard: u64) -> Result<(u64, Vec<u64>, Vec<u64>), BoxError> {
    let s = collectives::shard_stats(ctx.agent(), shard)
        .ok_or_else(|| format!("no shard {shard} on `{}`", ctx.agent().name()))?;
    Ok((s.max_staleness, s.clocks, s.applied))
}

/// The final parameters `(w, b)`, pulled through trainer index 0's routes (failing over where
/// a primary was lost).
pub async fn final_params(agent: &Agent, backup: bool) -> Result<(Tensor, Tensor)> {
    let shards = client(agent, 0, backup).pull(0).await?;
    let w = Tensor::cat(&[&shards[0][0], &shards[1][0]], 0)?;
    Ok((w, shards[0][1].clone()))
}

/// The share of `test` that `(w, b)` classifies right.
pub fn accuracy(w: &Tensor, b: &Tensor, test: &[(String, usize)]) -> Result<f64> {
    let mut correct = 0usize;
    for chunk in test.chunks(1000) {
        let (x, y) = dense(chunk)?;
        let pred = logits(&x, w, b)?.argmax(1)?;
        correct += pred
            .eq(&y)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    Ok(correct as f64 / test.len() as f64)
}

/// The functions of both modes, with `extra` ones (the launched mode's).
pub fn registry(
    extra: impl FnOnce(RegistryBuilder) -> Result<RegistryBuilder, RegistryError>,
) -> Result<Registry> {
    let b = Registry::builder()
        .register(train)?
        .register(reset_shards)?
        .register(stats)?;
    Ok(collectives::install(extra(b)?)?.build())
}
