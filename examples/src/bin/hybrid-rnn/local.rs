//! The same model in one process: the baseline the distributed run is measured and checked
//! against (`local_ms_per_step_median`, `--check-equivalence`).

use anyhow::Result;
use autograd_dist::{Optimizer, OptimizerKind};
use candle_core::{Device, Tensor};

use crate::data::Batch;
use crate::model::{loss, Dims, Encoder, EncoderInput, Head};

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
