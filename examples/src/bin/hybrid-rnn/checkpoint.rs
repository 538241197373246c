//! Checkpoints: every parameter, every optimizer state and the training history in one
//! safetensors file per checkpoint (`ckpt-<step>.safetensors`, written every
//! `--checkpoint-every` steps and at the end of every epoch; the newest `--keep-checkpoints`
//! are kept; the files' handling is [`examples::checkpoint`]'s), readable by any safetensors
//! loader.
//!
//! Names: `encoder.<param>`, `head.<param>` (the replicas are identical; one copy is kept),
//! `optimizer.<rank>.{steps,params}` and `optimizer.<rank>.{m,v}.<i>` per parameter owner,
//! `train.{epoch,step}` (completed epochs and steps), `train.progress` (the running sums of
//! the epoch in progress) and `history.*`; the flags that shape the run are in the file's
//! metadata (checked on resume, `examples::resume`). The data order and the dropout masks
//! are functions of the seed (one of those flags), the epoch and the step (`data::epoch_batches`, `data::dropout_mask`): they hold no state
//! of their own, so these numbers restore them exactly.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use autograd_dist::OptimizerState;
use candle_core::Tensor;
use examples::checkpoint::{count, floats, put_optimizer, Flags, Tensors};

use crate::report::History;

/// Everything a resumed run needs.
pub struct Checkpoint {
    /// Completed epochs.
    pub epoch: u64,
    /// Completed steps.
    pub step: u64,
    /// Encoder parameters by name.
    pub encoder: Vec<(String, Tensor)>,
    /// Head parameters by name.
    pub head: Vec<(String, Tensor)>,
    /// Optimizer state per owner rank.
    pub optim: Vec<(u32, OptimizerState)>,
    /// Curves so far.
    pub history: History,
    /// The running sums of the epoch in progress (zero at an epoch's end).
    pub progress: EpochProgress,
}

/// The running sums of an epoch in progress, for its report (kept bit-exact across a resume).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochProgress {
    /// Sum of this epoch's step losses.
    pub loss_sum: f64,
    /// Sum of the losses of the current window of 50 steps.
    pub window: f64,
    /// Steps in that window.
    pub window_n: u64,
    /// Training words classified correctly this epoch.
    pub hits: u64,
    /// Training words seen this epoch.
    pub seen: u64,
}

impl EpochProgress {
    fn to_vec(self) -> Vec<f64> {
        vec![
            self.loss_sum,
            self.window,
            self.window_n as f64,
            self.hits as f64,
            self.seen as f64,
        ]
    }

    fn from_vec(v: &[f64]) -> Result<Self> {
        let [loss_sum, window, window_n, hits, seen] = v else {
            bail!(
                "checkpoint tensor `train.progress` has {} values, not 5",
                v.len()
            );
        };
        Ok(Self {
            loss_sum: *loss_sum,
            window: *window,
            window_n: *window_n as u64,
            hits: *hits as u64,
            seen: *seen as u64,
        })
    }
}

impl Checkpoint {
    /// Writes `dir/ckpt-<step>.safetensors` (durably: a crash of the process or of the
    /// machine never leaves a truncated checkpoint) and returns its path.
    pub fn save(&self, dir: &Path, flags: &Flags) -> Result<PathBuf> {
        let mut m: HashMap<String, Tensor> = HashMap::new();
        m.insert("train.epoch".into(), count(self.epoch)?);
        m.insert("train.step".into(), count(self.step)?);
        m.insert("train.progress".into(), floats(&self.progress.to_vec())?);
        for (n, t) in &self.encoder {
            m.insert(format!("encoder.{n}"), t.clone());
        }
        for (n, t) in &self.head {
            m.insert(format!("head.{n}"), t.clone());
        }
        for (rank, st) in &self.optim {
            put_optimizer(&mut m, *rank, st)?;
        }
        self.history.save(&mut m)?;
        examples::checkpoint::save(dir, self.step, &m, flags)
    }

    /// The checkpoint written by [`Checkpoint::save`] that `t` holds (read and verified), with
    /// `encoder` and `head` naming the parameters expected.
    pub fn load(t: &Tensors, encoder: &[&str], head: &[&str], owners: &[u32]) -> Result<Self> {
        let named = |prefix: &str, names: &[&str]| -> Result<Vec<(String, Tensor)>> {
            names
                .iter()
                .map(|n| Ok((n.to_string(), t.get(&format!("{prefix}.{n}"))?)))
                .collect()
        };
        Ok(Self {
            epoch: t.count("train.epoch")?,
            step: t.count("train.step")?,
            encoder: named("encoder", encoder)?,
            head: named("head", head)?,
            optim: owners
                .iter()
                .map(|&r| Ok((r, t.optimizer(r)?)))
                .collect::<Result<_>>()?,
            history: History::load(t.map())?,
            progress: EpochProgress::from_vec(&t.floats("train.progress")?)?,
        })
    }
}
