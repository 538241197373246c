//! The same model in one process: the baseline the distributed run is measured and checked
//! against (`local_ms_per_step_median`, `max_loss_diff`, `--check-equivalence`).

use std::time::Instant;

use anyhow::Result;
use autograd_dist::{Optimizer, OptimizerKind};
use candle_core::{Device, Tensor};
use examples::lang::data::{self, Batch, Data};
use examples::lang::model::{loss, Dims, Encoder, EncoderInput, Head};
use serde_json::json;

use crate::args::Args;
use crate::hybrid::Hybrid;
use crate::train::training_batch;

/// Steps compared by `--check-equivalence`.
pub const EQUIVALENCE_STEPS: usize = 20;
/// Largest loss difference `--check-equivalence` accepts.
const EQUIVALENCE_TOLERANCE: f64 = 1e-4;

/// Encoder and one head, with one optimizer over both.
pub struct LocalModel {
    encoder: Encoder,
    head: Head,
    opt: Optimizer,
}

impl LocalModel {
    /// The model with the distributed run's initial values.
    pub fn new(dims: &Dims, seed: u64, kind: OptimizerKind) -> Result<Self> {
        let encoder = Encoder::new(dims, seed)?;
        let head = Head::new(dims, seed + 1, (Device::Cpu, Device::Cpu))?;
        let mut vars = encoder.vars();
        vars.extend(head.vars());
        Ok(Self {
            encoder,
            head,
            opt: Optimizer::new(kind, vars),
        })
    }

    /// One training step; returns the loss.
    pub fn step(&mut self, batch: &Batch, dropout: Option<&Tensor>) -> Result<f32> {
        let logits = self.logits(batch, dropout)?;
        let l = loss(&logits, &batch.labels)?;
        let grads = l.backward()?;
        self.opt.step(&grads)?;
        Ok(l.to_scalar::<f32>()?)
    }

    /// Logits of `batch` (`dropout` `None` to evaluate).
    pub fn logits(&self, batch: &Batch, dropout: Option<&Tensor>) -> Result<Tensor> {
        let enc = self.encoder.forward(&EncoderInput {
            ids: &batch.ids,
            rev_ids: &batch.rev_ids,
            last: &batch.last,
            t: batch.t,
            b: batch.b,
            dropout,
        })?;
        Ok(self.head.forward(&enc)?)
    }
}

/// The first `n` training batches, over as many epochs as that takes (the learning rate of
/// the first epoch throughout: the baseline and the equivalence check compare steps, not a
/// schedule).
fn first_batches(args: &Args, data: &Data, n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::with_capacity(n);
    let mut epoch = 0;
    while out.len() < n {
        let b = data::epoch_batches(data.train.len(), args.batch, args.seed, epoch);
        out.extend(b.into_iter().take(n - out.len()));
        epoch += 1;
    }
    out
}

/// The one-process copy of the model: its step times and losses over the first `steps`
/// batches, and the model, which goes on training for more timing samples.
pub fn local_baseline(
    args: &Args,
    dims: &Dims,
    data: &Data,
    steps: usize,
) -> Result<(LocalModel, Vec<f64>, Vec<f64>)> {
    let mut model = LocalModel::new(dims, args.seed, args.optimizer())?;
    let idx = first_batches(args, data, steps);
    let (times, losses) = local_steps(&mut model, args, dims, data, &idx, 0)?;
    Ok((model, times, losses))
}

/// Trains `model` on `batches` (global steps from `step0`): each step's time and loss.
pub fn local_steps(
    model: &mut LocalModel,
    args: &Args,
    dims: &Dims,
    data: &Data,
    batches: &[Vec<usize>],
    step0: u64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for (k, idx) in batches.iter().enumerate() {
        let t0 = Instant::now();
        let (batch, mask) = training_batch(args, dims, data, idx, step0 + k as u64)?;
        let loss = model.step(&batch, mask.as_ref())?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        losses.push(f64::from(loss));
    }
    Ok((times, losses))
}

/// `--check-equivalence`: the first steps of the distributed model against `local`, the same
/// steps' losses in one process; exit code 1 above the tolerance.
pub async fn check_equivalence(
    model: &Hybrid,
    args: &Args,
    dims: &Dims,
    data: &Data,
    local: &[f64],
) -> Result<i32> {
    let mut dist = Vec::new();
    for (step, idx) in first_batches(args, data, local.len()).iter().enumerate() {
        let (batch, mask) = training_batch(args, dims, data, idx, step as u64)?;
        let (loss, _) = model.step(&batch, mask.as_ref()).await?;
        dist.push(f64::from(loss));
        println!(
            "step {step:>2}: distributed loss {loss:.6}, one process {:.6}",
            local[step]
        );
    }
    let diff = max_abs_diff(&dist, local);
    let ok = dist.len() == local.len() && diff <= EQUIVALENCE_TOLERANCE;
    println!(
        "{}",
        json!({"check": "equivalence", "steps": dist.len(), "max_loss_diff": diff,
               "tolerance": EQUIVALENCE_TOLERANCE, "ok": ok})
    );
    Ok(if ok { 0 } else { 1 })
}

/// The largest difference between two loss curves.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
