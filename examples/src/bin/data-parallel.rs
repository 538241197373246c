//! Data parallelism, Horovod's program line for line: every process is a replica of one
//! model, trains on its share of each epoch, and the replicas' gradients are averaged with
//! the ring all-reduce while backward runs.
//!
//! `cargo run --release -p examples --bin data-parallel -- --nproc 2` launches two replicas on
//! 127.0.0.1 with the launcher's code; under `rpcrun --nproc N` (or torchrun, Slurm, mpirun)
//! each process is one replica. The model is an MLP over hashed character n-grams of the
//! word-language data (4096 → 1024 → 512 → 8: 4.7 M parameters, 19 MB of gradients a step).
//! Rank 0 logs and prints one JSON line at the end.

use rpc_core::trace::Cat;
use std::time::Instant;

use anyhow::{Context, Result};
use autograd_dist::{grad_once, Optimizer, OptimizerKind};
use candle_core::{DType, Device, Tensor, Var, D};
use clap::Parser;
use collectives::{CompressHook, DistributedDataParallel, DistributedSampler};
use examples::lang::wordlang::{self, dense, DIM, LANGS};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rpc_core::{Config, Registry};

/// Data-parallel training of a word-language classifier, Horovod style: N replica processes,
/// a DistributedSampler, parameters broadcast from rank 0, gradients averaged while backward
/// runs.
#[derive(Parser, Debug)]
#[command(name = "data-parallel", version)]
struct Args {
    /// Replicas to launch on this machine (ignored under a launcher: it decides).
    #[arg(long, default_value_t = 2)]
    nproc: u32,
    /// Local mode: trace the job into one file (Trace Event Format, for Perfetto or
    /// chrome://tracing; `rpctrace report PATH` says what held each step up).
    #[arg(long, value_name = "PATH")]
    trace: Option<std::path::PathBuf>,

    /// Epochs to train.
    #[arg(long, default_value_t = 2, value_parser = at_least_one::<u64>)]
    epochs: u64,
    /// Words per step on each replica.
    #[arg(long, default_value_t = 32, value_parser = at_least_one::<usize>)]
    batch: usize,
    /// SGD's learning rate for one replica (scaled by the number of replicas, as Horovod
    /// recommends).
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// Gradients on the wire as bf16 (half the bytes).
    #[arg(long)]
    bf16: bool,
    /// Log every this many steps (rank 0).
    #[arg(long, default_value_t = 100, value_parser = at_least_one::<u64>)]
    log_every: u64,
    /// Use only the first N training words (quick runs).
    #[arg(long, value_parser = at_least_one::<usize>)]
    train_limit: Option<usize>,
    /// Use only the first N test words (quick runs).
    #[arg(long, value_parser = at_least_one::<usize>)]
    test_limit: Option<usize>,
}

/// A count of 1 or more (0 would train or test on nothing), refused in those words (clap's
/// ranged parser says "0 is not in 1..18446744073709551615").
fn at_least_one<T: std::str::FromStr<Err = std::num::ParseIntError> + From<u8> + PartialOrd>(
    s: &str,
) -> Result<T, String> {
    let v: T = s.parse().map_err(|e| format!("{e}"))?;
    if v < T::from(1) {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

const WIDTHS: [usize; 4] = [DIM, 1024, 512, LANGS.len()];
const SEED: u64 = 7;

fn main() {
    // Freed tensors' memory kept for the next step (ALLOC-1), before any thread starts.
    autograd_dist::retain_freed_memory();
    examples::main_with("data-parallel", run)
}

fn run() -> Result<i32> {
    let args = Args::parse();
    anyhow::ensure!(
        args.lr.is_finite() && args.lr > 0.0,
        examples::Fatal(format!("--lr must be a positive number, not {}", args.lr))
    );
    if !examples::is_worker() {
        // Started by hand: this binary, `--nproc` times, under the launcher's code.
        return examples::launch_here(
            "data-parallel",
            args.nproc,
            0,
            rpcrun::Restart::Group,
            args.trace.as_deref(),
        );
    }
    examples::runtime()?.block_on(replica(args))
}

async fn replica(args: Args) -> Result<i32> {
    // hvd.init(): the group from the launcher's environment.
    let registry = collectives::install(Registry::builder())?.build();
    let agent = rpc_core::init(Config::new(), registry).await?;
    let (rank, size) = (agent.rank(), agent.world_size());
    // torch.cuda.set_device(hvd.local_rank()): the local rank's GPU where there is one.
    let local_rank: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let device = autograd_dist::DeviceSpec::cuda_if_usable(local_rank).device()?;
    // The data, and this replica's share of each epoch.
    let dir = wordlang::data_dir();
    let mut train = wordlang::load(&dir, "train.tsv")?;
    if let Some(n) = args.train_limit {
        train.truncate(n);
    }
    let mut test = wordlang::load(&dir, "test.tsv")?;
    if let Some(n) = args.test_limit {
        test.truncate(n);
    }
    let sampler = DistributedSampler::new(train.len(), size, rank as usize, SEED);
    let share = sampler.indices(0).len();
    if share < args.batch {
        // Every replica finds the same: no step to take.
        return Err(examples::Fatal(format!(
            "each of the {size} replicas gets {share} of the {} training words, less than one \
             batch of {}: lower --batch or raise --train-limit",
            train.len(),
            args.batch
        ))
        .into());
    }
    // The model; DistributedDataParallel broadcasts rank 0's parameters to every replica.
    let vars = init_model(&device, rank)?;
    let ddp = DistributedDataParallel::new(collectives::world(&agent), vars).await?;
    let ddp = if args.bf16 {
        ddp.with_hook(CompressHook::bf16())
    } else {
        ddp
    };
    // hvd.DistributedOptimizer(optimizer): SGD at lr × size.
    let sgd = Optimizer::new(
        OptimizerKind::sgd(args.lr * size as f64),
        ddp.vars().to_vec(),
    );
    let mut opt = ddp.wrap(sgd);
    let started = Instant::now();
    let mut step_ms = Vec::new();
    let mut step = 0u64;
    for epoch in 0..args.epochs {
        let mine = sampler.indices(epoch);
        for batch in mine.chunks_exact(args.batch) {
            let t = Instant::now();
            let mut span = agent.tracer().span(Cat::Step, "step");
            span.detail(|| format!("step {step}"));
            let batch_span = agent.tracer().span(Cat::Compute, "batch");
            let words: Vec<(String, usize)> = batch.iter().map(|&i| train[i].clone()).collect();
            let (x, y) = dense(&words)?;
            let (x, y) = (x.to_device(&device)?, y.to_device(&device)?);
            drop(batch_span);
            let mut pass = opt.pass();
            let forward_span = agent.tracer().span(Cat::Compute, "forward");
            let logits = forward(ddp.vars(), &x, |h| Ok(pass.cut(h)?))?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            drop(forward_span);
            opt.backward_step(pass, &loss).await?;
            drop(span);
            step_ms.push(t.elapsed().as_secs_f64() * 1e3);
            step += 1;
            if rank == 0 && step % args.log_every == 0 {
                println!(
                    "epoch {epoch} step {step}: loss {:.4} ({:.1} ms a step)",
                    loss.to_scalar::<f32>()?,
                    step_ms.last().copied().unwrap_or(0.0)
                );
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if rank == 0 {
        let accuracy = evaluate(ddp.vars(), &test, &device)?;
        step_ms.sort_by(f64::total_cmp);
        println!(
            "{}",
            serde_json::json!({
                "replicas": size,
                "parameters": ddp.vars().iter().map(|v| v.elem_count()).sum::<usize>(),
                "steps": step,
                "ms_per_step_median": examples::round(step_ms[step_ms.len() / 2], 2),
                "test_accuracy": examples::round(accuracy, 4),
                "hook": if args.bf16 { "bf16" } else { "all_reduce" },
                "seconds": examples::round(seconds, 1),
            })
        );
    }
    // Rank 0 may still be evaluating: the others serve until it is done (PyTorch's
    // rpc.shutdown(): the barrier waits for the group, not for a timeout).
    let report = if rank == 0 {
        agent.shutdown().await
    } else {
        agent.wait_for_group().await
    };
    anyhow::ensure!(report.is_clean() && report.failed.is_empty(), "{report:?}");
    Ok(0)
}

/// Weights and biases of every layer (Kaiming-uniform weights, zero biases), seeded by rank
/// so that the broadcast visibly matters.
fn init_model(device: &Device, rank: u32) -> Result<Vec<Var>> {
    let mut vars = Vec::new();
    for (i, w) in WIDTHS.windows(2).enumerate() {
        let bound = (6.0 / w[0] as f32).sqrt();
        let mut rng = ChaCha8Rng::seed_from_u64(SEED + 100 * u64::from(rank) + i as u64);
        let values: Vec<f32> = (0..w[0] * w[1])
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        vars.push(Var::from_tensor(&Tensor::from_vec(
            values,
            (w[0], w[1]),
            device,
        )?)?);
        vars.push(Var::zeros(w[1], DType::F32, device)?);
    }
    Ok(vars)
}

/// The MLP's logits; `cut` ends a segment after each hidden layer (the gradients of the
/// layers after it go on the wire while backward goes on).
fn forward(
    p: &[Var],
    x: &Tensor,
    mut cut: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut h = x.clone();
    let layers = p.len() / 2;
    for l in 0..layers {
        // The weight's gradient written once (`grad_once`: the pass's backward collects it).
        h = grad_once::matmul(&h, p[2 * l].as_tensor())?.broadcast_add(p[2 * l + 1].as_tensor())?;
        if l + 1 < layers {
            h = cut(&h.relu()?)?;
        }
    }
    Ok(h)
}

/// Accuracy on `test`, in batches of 1,000.
fn evaluate(p: &[Var], test: &[(String, usize)], device: &Device) -> Result<f64> {
    let mut right = 0usize;
    for chunk in test.chunks(1000) {
        let (x, y) = dense(chunk).context("test batch")?;
        let logits = forward(p, &x.to_device(device)?, |h| Ok(h.clone()))?;
        let predicted = logits
            .argmax(D::Minus1)?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        right += predicted
            .iter()
            .zip(y.to_vec1::<u32>()?)
            .filter(|(a, b)| **a == *b)
            .count();
    }
    Ok(right as f64 / test.len() as f64)
}
