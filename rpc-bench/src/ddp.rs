//! `ddp`: the data-parallel step on the reference model of `../shared/anchors/ddp/ddp_torch.py`
//! (MLP 1024 → 4096 → ReLU → 4096 → ReLU → 1024, f32, biases; 25.2 M parameters; 16 rows of
//! N(0, 1) inputs and targets per rank; MSE; SGD 0.01; one compute thread per process). Its
//! layers' products go through `autograd_dist::grad_once` in every variant: the weights'
//! gradients are written once, as PyTorch's `AccumulateGrad` takes them.
//!
//! Variants, one JSON line each (`{"metric":"ddp_step_ms","impl":"ours","variant":V,
//! "world_size":N,"median":..,"p90":..}`): `local` (one process, no communication: the
//! compute floor), `no_comm` (all N processes stepping at once, each on its own: barrier and
//! timing as below, no gradient exchange; the floor when N processes share the machine's
//! cores and memory), `after` (backward, then the gradients' buckets combined:
//! `DistributedDataParallel::reduce_gradients`), `overlap` (a `Pass` with a cut after each
//! hidden layer: buckets combined while backward runs), `bf16` (the same with
//! `CompressHook::bf16`). Then the all-reduce alone of the whole gradient (the communication
//! floor, `ddp_allreduce_ms`, variant `all_reduce`). A step's time is the largest over the
//! ranks (a barrier before each; 5 warm-up steps, then `--steps`, default 30). `--variants`
//! picks and orders them (repeats allowed, to alternate two). `--interleave K` alternates the
//! step variants instead, `local` among them, in blocks of K steps inside one group (rank 0
//! steps `local` alone while the others wait): a machine whose speed moves by tens of percent
//! from minute to minute then moves every variant alike. Each group line also carries
//! the group's `ring_threads` and how rank 0's blobs travelled meanwhile, in MB:
//! `shared_mb` through shared memory, `streamed_mb` on the stream (no room in the arena).

use std::time::Instant;

use anyhow::{Context, Result};
use autograd_dist::{grad_once, Optimizer, OptimizerKind};
use candle_core::{DType, Device, Tensor, Var};
use collectives::{CompressHook, DistributedDataParallel, ProcessGroup, ReduceOp};
use rpc_core::Agent;
use serde_json::json;

const DIMS: [usize; 4] = [1024, 4096, 4096, 1024];
const BATCH: usize = 16;
const LR: f64 = 0.01;
const WARMUP: usize = 5;

/// The reference model's parameters (the same on every rank: a fixed uniform pattern).
fn model() -> Result<Vec<Var>> {
    let mut vars = Vec::new();
    for (i, w) in DIMS.windows(2).enumerate() {
        let bound = 1.0 / (w[0] as f32).sqrt();
        let n = w[0] * w[1];
        let v: Vec<f32> = (0..n)
            .map(|k| ((k.wrapping_mul(2_654_435_761) ^ i) % 2001) as f32 / 1000.0 - 1.0)
            .map(|u| u * bound)
            .collect();
        vars.push(Var::from_tensor(&Tensor::from_vec(
            v,
            (w[0], w[1]),
            &Device::Cpu,
        )?)?);
        vars.push(Var::zeros(w[1], DType::F32, &Device::Cpu)?);
    }
    Ok(vars)
}

/// The MLP's MSE loss on a fresh batch; `cut` ends a segment after each hidden layer.
fn loss(p: &[Var], mut cut: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x = Tensor::randn(0f32, 1.0, (BATCH, DIMS[0]), &Device::Cpu)?;
    let y = Tensor::randn(0f32, 1.0, (BATCH, DIMS[3]), &Device::Cpu)?;
    let mut h = x;
    for l in 0..3 {
        h = grad_once::matmul(&h, p[2 * l].as_tensor())?.broadcast_add(p[2 * l + 1].as_tensor())?;
        if l < 2 {
            h = cut(&h.relu()?)?;
        }
    }
    Ok((h - y)?.sqr()?.mean_all()?)
}

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Local,
    NoComm,
    After,
    Overlap,
    Bf16,
    /// The all-reduce of the whole gradient alone.
    AllReduce,
}

const VARIANTS: [Variant; 6] = [
    Variant::Local,
    Variant::NoComm,
    Variant::After,
    Variant::Overlap,
    Variant::Bf16,
    Variant::AllReduce,
];

/// Every variant, in the default order.
pub const ALL_VARIANTS: &str = "local,no_comm,after,overlap,bf16,all_reduce";

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::NoComm => "no_comm",
            Self::After => "after",
            Self::Overlap => "overlap",
            Self::Bf16 => "bf16",
            Self::AllReduce => "all_reduce",
        }
    }
}

/// Parses `--variants after,overlap,...` (names of [`ALL_VARIANTS`], repeats allowed: each
/// runs in the order given).
fn parse_variants(list: &str) -> Result<Vec<Variant>> {
    list.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            VARIANTS
                .into_iter()
                .find(|v| v.name() == x.trim())
                .with_context(|| format!("--variants: no variant `{x}` (of {ALL_VARIANTS})"))
        })
        .collect()
}

/// Whether `list` (checked) asks for the one-process `local` step.
pub fn wants_local(list: &str) -> Result<bool> {
    Ok(parse_variants(list)?.contains(&Variant::Local))
}

/// One step of `v` on this rank.
async fn step(
    v: Variant,
    ddp: Option<&DistributedDataParallel>,
    opt: &mut Optimizer,
    vars: &[Var],
) -> Result<()> {
    match (v, ddp) {
        (Variant::Local | Variant::NoComm | Variant::AllReduce, _) | (_, None) => {
            let l = loss(vars, |h| Ok(h.clone()))?;
            let g = grad_once::backward(&l)?;
            opt.step(&g)?;
        }
        (Variant::After, Some(ddp)) => {
            let l = loss(vars, |h| Ok(h.clone()))?;
            let mut g = grad_once::backward(&l)?;
            ddp.reduce_gradients(&mut g).await?;
            opt.step(&g)?;
        }
        (Variant::Overlap | Variant::Bf16, Some(ddp)) => {
            let mut pass = ddp.pass();
            let l = loss(vars, |h| Ok(pass.cut(h)?))?;
            let g = pass.backward(&l).await?;
            opt.step(&g)?;
        }
    }
    Ok(())
}

/// One variant's model, optimizer and data-parallel wrapper, and the step times it took.
struct Runner {
    v: Variant,
    vars: Vec<Var>,
    ddp: Option<DistributedDataParallel>,
    opt: Optimizer,
    /// Steps run so far, warm-up included.
    run: usize,
    times: Vec<f64>,
}

impl Runner {
    async fn new(v: Variant, group: Option<&ProcessGroup>) -> Result<Self> {
        let vars = model()?;
        let ddp = match group {
            Some(g) if !matches!(v, Variant::Local | Variant::NoComm) => {
                let d = DistributedDataParallel::new(g.clone(), vars.clone()).await?;
                Some(match v {
                    Variant::Bf16 => d.with_hook(CompressHook::bf16()),
                    _ => d,
                })
            }
            _ => None,
        };
        let opt = Optimizer::new(OptimizerKind::sgd(LR), vars.clone());
        Ok(Self {
            v,
            vars,
            ddp,
            opt,
            run: 0,
            times: Vec::new(),
        })
    }

    /// `k` more steps (a barrier before each in a group); those past the warm-up are timed.
    /// In a group, `local` is stepped by the `lead` (rank 0) alone while the others wait at
    /// the next barrier (they record 0: the step's time is rank 0's).
    async fn steps(&mut self, group: Option<&ProcessGroup>, k: usize, lead: bool) -> Result<()> {
        let alone = self.v == Variant::Local && group.is_some() && !lead;
        for _ in 0..k {
            if let Some(g) = group {
                g.barrier().await?;
            }
            let t = Instant::now();
            if !alone {
                step(self.v, self.ddp.as_ref(), &mut self.opt, &self.vars).await?;
            }
            let ms = if alone {
                0.0
            } else {
                t.elapsed().as_secs_f64() * 1e3
            };
            if self.run >= WARMUP {
                self.times.push(ms);
            }
            self.run += 1;
        }
        Ok(())
    }
}

/// Times `steps` steps of `v` (after the warm-up); each step's time is the largest over the
/// group's members when there is a group.
async fn timed(v: Variant, group: Option<&ProcessGroup>, steps: usize) -> Result<Vec<f64>> {
    let mut r = Runner::new(v, group).await?;
    r.steps(group, WARMUP + steps, true).await?;
    slowest(group, r.times).await
}

/// The step variants of `vs` (the all-reduce alone aside) alternated in blocks of `block`
/// steps, after each one's warm-up, until each has `steps` timed steps: every variant then
/// meets the machine's changes of speed alike, and a comparison of two (what `overlap` hid
/// of what `after` pays over `local`) holds within the run. `local` is rank 0 alone.
async fn interleaved(
    vs: &[Variant],
    group: &ProcessGroup,
    steps: usize,
    block: usize,
    lead: bool,
) -> Result<Vec<(Variant, Vec<f64>)>> {
    let mut runners = Vec::new();
    for &v in vs.iter().filter(|v| **v != Variant::AllReduce) {
        if runners.iter().all(|r: &Runner| r.v != v) {
            runners.push(Runner::new(v, Some(group)).await?);
        }
    }
    for r in &mut runners {
        r.steps(Some(group), WARMUP, lead).await?;
    }
    let mut left = steps;
    while left > 0 {
        let k = block.min(left);
        for r in &mut runners {
            r.steps(Some(group), k, lead).await?;
        }
        left -= k;
    }
    let mut out = Vec::new();
    for r in runners {
        out.push((r.v, slowest(Some(group), r.times).await?));
    }
    Ok(out)
}

/// Each step's largest time over the group.
async fn slowest(group: Option<&ProcessGroup>, times: Vec<f64>) -> Result<Vec<f64>> {
    let Some(g) = group else { return Ok(times) };
    let n = times.len();
    let t = Tensor::from_vec(times, n, &Device::Cpu)?;
    Ok(g.all_reduce(&t, ReduceOp::Max).await?.to_vec1()?)
}

/// The all-reduce of a buffer as large as the model's gradients, alone.
async fn allreduce_alone(group: &ProcessGroup, steps: usize) -> Result<Vec<f64>> {
    let len: usize = DIMS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let mut buf = vec![1.0f32; len];
    let mut times = Vec::new();
    for i in 0..WARMUP + steps {
        group.barrier().await?;
        let t = Instant::now();
        group.all_reduce_in_place(&mut buf, ReduceOp::Mean).await?;
        if i >= WARMUP {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    slowest(Some(group), times).await
}

fn line(metric: &str, variant: &str, n: usize, mut times: Vec<f64>) -> serde_json::Value {
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    json!({
        "metric": metric,
        "impl": "ours",
        "variant": variant,
        "world_size": n,
        "median": at(0.5),
        "p90": at(0.9),
        "n": times.len(),
    })
}

/// What every rank of a group runs; rank 0's lines are returned to print. `interleave`:
/// the step variants (`local` too, stepped by rank 0 alone) alternated in blocks of that many
/// steps (see [`interleaved`]), their lines marked `"interleave"` and `"group"`; the
/// all-reduce alone, if asked for, after them.
pub async fn rank_main(
    agent: &Agent,
    steps: usize,
    ring_threads: Option<usize>,
    variants: &str,
    interleave: Option<usize>,
) -> Result<Vec<serde_json::Value>> {
    let mut g = collectives::world(agent);
    if let Some(k) = ring_threads {
        g = g.with_ring_threads(k);
    }
    let n = g.size();
    let mut out = Vec::new();
    let vs = parse_variants(variants)?;
    if let Some(block) = interleave {
        let lead = agent.rank() == 0;
        for (v, times) in interleaved(&vs, &g, steps, block, lead).await? {
            let mut l = match v {
                Variant::Local => line("ddp_step_ms", v.name(), 1, times),
                _ => line("ddp_step_ms", v.name(), n, times),
            };
            l["group"] = n.into();
            l["interleave"] = block.into();
            out.push(l);
        }
    }
    for v in vs {
        if interleave.is_some() && v != Variant::AllReduce {
            continue;
        }
        let before = agent.bulk_stats();
        let mut l = match v {
            Variant::Local => continue,
            Variant::AllReduce => {
                let times = allreduce_alone(&g, steps).await?;
                line("ddp_allreduce_ms", v.name(), n, times)
            }
            _ => {
                let times = timed(v, Some(&g), steps).await?;
                line("ddp_step_ms", v.name(), n, times)
            }
        };
        // How this rank's blobs travelled meanwhile: through shared memory, or on the stream
        // (a blob that finds no room in the arena takes the stream, SHM-2).
        let after = agent.bulk_stats();
        l["shared_mb"] = ((after.shared_bytes - before.shared_bytes) / 1_000_000).into();
        l["streamed_mb"] = ((after.streamed_bytes - before.streamed_bytes) / 1_000_000).into();
        out.push(l);
    }
    for o in &mut out {
        o["ring_threads"] = g.ring_threads().into();
    }
    Ok(out)
}

/// `local`: one process, no communication.
pub async fn local(steps: usize) -> Result<serde_json::Value> {
    let times = timed(Variant::Local, None, steps).await?;
    Ok(line("ddp_step_ms", "local", 1, times))
}

/// Parses `--world-sizes 2,4`.
pub fn world_sizes(arg: Option<&String>) -> Result<Vec<u32>> {
    match arg {
        None => Ok(vec![2, 4]),
        Some(s) => s
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| {
                let n = x
                    .trim()
                    .parse::<u32>()
                    .context("--world-sizes takes N,N,...")?;
                anyhow::ensure!(n >= 1, "--world-sizes: a group of {n} processes");
                Ok(n)
            })
            .collect(),
    }
}
