//! The master's training loop: epochs of distributed steps, checkpoints, evaluation, and (with
//! `--restart worker`) the recovery in this process when a worker is replaced.

use rpc_core::trace::Cat;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use examples::checkpoint::Tensors;
use examples::lang::data::{self, Batch, Data};
use examples::lang::model::Dims;
use examples::recovery::Tracker;
use rpc_core::Agent;

use crate::args::Args;
use crate::checkpoint::EpochProgress;
use crate::hybrid::{correct, Hybrid};
use crate::local::{self, LocalModel, EQUIVALENCE_STEPS};
use crate::report::{self, History, Summary};
use crate::shard;

/// The training batch of words `idx` and the dropout mask of global step `step`: a function
/// of the seed and the step only, the same in every mode.
pub fn training_batch(
    args: &Args,
    dims: &Dims,
    data: &Data,
    idx: &[usize],
    step: u64,
) -> Result<(Batch, Option<Tensor>)> {
    let batch = data.train.batch(idx)?;
    let mask = data::dropout_mask(args.dropout, batch.b, dims.encoding(), args.seed, step)?;
    Ok((batch, mask))
}

/// Where training stands: what a checkpoint holds, and what a recovery rolls back.
#[derive(Default)]
struct Position {
    /// Completed epochs.
    epoch: u64,
    /// Completed steps.
    step: u64,
    /// The running sums of the epoch in progress.
    progress: EpochProgress,
    history: History,
}

/// The master's state across the run.
struct Trainer<'a> {
    agent: &'a Agent,
    args: &'a Args,
    data: &'a Data,
    dims: Dims,
    per_epoch: u64,
    model: Hybrid,
    at: Position,
    tracker: Tracker,
    /// The one-process copy (more timing samples after every epoch) and its first losses.
    local: LocalModel,
    local_times: Vec<f64>,
    local_losses: Vec<f64>,
    /// Whether the run started from the beginning (its first losses are compared).
    fresh: bool,
    step_times: Vec<f64>,
    dist_losses: Vec<f64>,
    last_preds: Option<Vec<u32>>,
    last_ckpt: Option<PathBuf>,
    /// Recoveries in this process (`--restart worker`: a worker failed, the master did not).
    in_place: u32,
}

/// The master's whole run: the one-process baseline, the model (restored from `resume_from`
/// if given), training to `--epochs` (or `--check-equivalence` alone), the report.
pub async fn master(
    agent: &Agent,
    args: &Args,
    data: &Data,
    resume_from: Option<Tensors>,
    restart: u32,
) -> Result<i32> {
    let dims = args.dims(data.vocab);
    let start = Instant::now();
    let baseline_steps = if args.check_equivalence {
        EQUIVALENCE_STEPS
    } else if resume_from.is_some() {
        0 // the loss comparison is of the first steps, which a resumed run does not take
    } else {
        args.local_steps
    };
    let (local, local_times, local_losses) =
        local::local_baseline(args, &dims, data, baseline_steps)?;
    let model = Hybrid::new(agent, args, &dims, shard::instance(agent, 0)).await?;
    let per_epoch = (data.train.len() / args.batch) as u64;
    let mut at = Position::default();
    if let Some(t) = &resume_from {
        at = restore(&model, t, &dims, per_epoch).await?;
        println!(
            "resumed from {} (epoch {}, step {}, restart {restart})",
            t.path().display(),
            at.epoch,
            at.step
        );
        examples::resume::say_if_complete(&args.out_dir, at.epoch, args.epochs);
    }
    if args.check_equivalence {
        return local::check_equivalence(&model, args, &dims, data, &local_losses).await;
    }
    // A restarted run resumes, if only from step 0 (a failure before the first checkpoint).
    let resumed = resume_from.is_some() || restart > 0;
    let mut tracker = Tracker::open(&args.out_dir, restart, resumed.then_some(at.step))?;
    tracker.completed(at.step)?;
    let mut t = Trainer {
        agent,
        args,
        data,
        dims,
        per_epoch,
        model,
        at,
        tracker,
        local,
        local_times,
        local_losses,
        fresh: resume_from.is_none(),
        step_times: Vec::new(),
        dist_losses: Vec::new(),
        last_preds: None,
        last_ckpt: None,
        in_place: 0,
    };
    loop {
        // The training from where it stands; a worker's failure ends it with an error.
        let Err(err) = t.epochs().await else { break };
        if args.restart != rpcrun::Restart::Worker || examples::is_fatal(&err) {
            return Err(err);
        }
        t.recover_in_place(err).await?;
    }
    t.finish(start).await
}

/// Restores the checkpoint `t` into `model`: where training stood.
async fn restore(model: &Hybrid, t: &Tensors, dims: &Dims, per_epoch: u64) -> Result<Position> {
    let (epoch, step, progress, history) = model.resume(t, dims, per_epoch).await?;
    Ok(Position {
        epoch,
        step,
        progress,
        history,
    })
}

impl Trainer<'_> {
    /// Every epoch from where training stands to `--epochs`.
    async fn epochs(&mut self) -> Result<()> {
        for epoch in self.at.epoch..self.args.epochs {
            self.epoch(epoch).await?;
        }
        Ok(())
    }

    /// Epoch `epoch` from where training stands: its steps, more one-process samples,
    /// evaluation, the epoch's checkpoint and its line.
    async fn epoch(&mut self, epoch: u64) -> Result<()> {
        let (args, data) = (self.args, self.data);
        let batches = data::epoch_batches(data.train.len(), args.batch, args.seed, epoch);
        self.model.opt.set_lr(args.lr_at(epoch)).await?;
        let bar = examples::epoch_bar(args.quiet, batches.len() as u64, epoch, args.epochs);
        // Where a resumed epoch picks up.
        let k0 = (self.at.step - epoch * self.per_epoch) as usize;
        bar.set_position(k0 as u64);
        let epoch_start = Instant::now();
        for (k, idx) in batches.iter().enumerate().skip(k0) {
            self.step(epoch, k, idx, k + 1 < batches.len()).await?;
            let p = &self.at.progress;
            bar.set_message(format!(
                "loss {:.3}  acc {:.3}  {:.1} steps/s",
                p.loss_sum / (k + 1) as f64,
                p.hits as f64 / p.seen as f64,
                (k + 1 - k0) as f64 / epoch_start.elapsed().as_secs_f64()
            ));
            bar.inc(1);
        }
        bar.finish_and_clear();
        // More one-process samples, at this point of the run (the workers are idle).
        let n = args.local_steps.min(batches.len());
        let (times, _) = local::local_steps(
            &mut self.local,
            args,
            &self.dims,
            data,
            &batches[..n],
            self.at.step,
        )?;
        self.local_times.extend(times);
        let preds = self.model.predict(&data.test).await?;
        let test_acc = report::accuracy(&preds, data.test.labels());
        let done = std::mem::take(&mut self.at.progress);
        let train_acc = done.hits as f64 / done.seen.max(1) as f64;
        self.at.history.train_acc.push(train_acc);
        self.at.history.test_acc.push(test_acc);
        let path = self.checkpoint(epoch + 1).await?;
        println!(
            "epoch {}/{}: train loss {:.4}, train accuracy {:.4}, test accuracy {:.4}, {:.1} s, \
             checkpoint {}",
            epoch + 1,
            args.epochs,
            done.loss_sum / batches.len().max(1) as f64,
            train_acc,
            test_acc,
            epoch_start.elapsed().as_secs_f64(),
            path.display()
        );
        self.last_preds = Some(preds);
        self.last_ckpt = Some(path);
        Ok(())
    }

    /// Step `k` of epoch `epoch` on the words `idx`; a checkpoint after it every
    /// `--checkpoint-every` steps, unless it ends the epoch (`more` is false), which
    /// checkpoints anyway.
    async fn step(&mut self, epoch: u64, k: usize, idx: &[usize], more: bool) -> Result<()> {
        let step = self.at.step;
        let t0 = Instant::now();
        let mut span = self.agent.tracer().span(Cat::Step, "step");
        span.detail(|| format!("step {step}"));
        let (batch, mask) = training_batch(self.args, &self.dims, self.data, idx, step)?;
        let (loss, logits) = self
            .model
            .step(&batch, mask.as_ref())
            .await
            .with_context(|| format!("training step {step}"))?;
        drop(span);
        self.step_times.push(t0.elapsed().as_secs_f64() * 1e3);
        ensure!(
            loss.is_finite(),
            "the loss diverged at step {step} ({loss})"
        );
        if self.fresh && epoch == 0 && k < self.local_losses.len() {
            self.dist_losses.push(f64::from(loss));
        }
        self.at.step += 1;
        let step = self.at.step;
        let p = &mut self.at.progress;
        p.loss_sum += f64::from(loss);
        (p.window, p.window_n) = (p.window + f64::from(loss), p.window_n + 1);
        if p.window_n == 50 {
            self.at.history.loss.push((step as f64, p.window / 50.0));
            (p.window, p.window_n) = (0.0, 0);
        }
        p.hits += correct(&logits, &batch.labels)? as u64;
        p.seen += batch.b as u64;
        self.tracker.completed(step)?;
        if step % self.args.checkpoint_every == 0 && more {
            self.checkpoint(epoch).await?;
        }
        Ok(())
    }

    /// Writes the checkpoint of where training stands (`epoch` completed epochs) and prunes
    /// the old ones.
    async fn checkpoint(&self, epoch: u64) -> Result<PathBuf> {
        let mut span = self.agent.tracer().span(Cat::Checkpoint, "checkpoint");
        span.detail(|| format!("step {}", self.at.step));
        let at = &self.at;
        let path = self
            .model
            .checkpoint(
                &self.dims,
                self.args,
                epoch,
                at.step,
                &at.history,
                at.progress,
            )
            .await?;
        examples::checkpoint::prune(&self.args.out_dir, self.args.keep_checkpoints)?;
        Ok(path)
    }

    /// `--restart worker`: a worker failed (`err`); waits for its replacement, rebuilds the
    /// model and rolls everything back to the newest verified checkpoint (the new shards start
    /// from it, and so do the encoder and every optimizer state: a step the failure
    /// interrupted may have been applied in part).
    async fn recover_in_place(&mut self, err: anyhow::Error) -> Result<()> {
        let mut span = self.agent.tracer().span(Cat::Failure, "recovery");
        span.detail(|| examples::said(&err));
        let timeout = Duration::from_secs(self.args.timeout_secs);
        let lost = self
            .model
            .holders
            .await_replacements(&err, timeout, "hybrid-rnn")
            .await?;
        self.in_place += 1;
        let instance = shard::instance(self.agent, self.in_place);
        self.model = Hybrid::new(self.agent, self.args, &self.dims, instance).await?;
        let from = match examples::resume::newest_verified(&self.args.out_dir)? {
            Some(t) => {
                self.at = restore(&self.model, &t, &self.dims, self.per_epoch).await?;
                t.path().display().to_string()
            }
            None => {
                self.at = Position::default();
                "the initial parameters (no checkpoint yet)".to_owned()
            }
        };
        let step = self.at.step;
        // The loss comparison keeps the first pass over its steps.
        self.dist_losses.truncate(step as usize);
        self.tracker.interrupted(step);
        self.tracker.completed(step)?;
        println!(
            "recovered in place from {from} (step {step}) after the loss of {}: {}",
            lost.iter()
                .map(|r| self.agent.name_of(*r))
                .collect::<Vec<_>>()
                .join(", "),
            examples::said(&err)
        );
        Ok(())
    }

    /// The run's end: the confusion matrix, the plot and the JSON line.
    async fn finish(self, start: Instant) -> Result<i32> {
        let preds = match self.last_preds {
            Some(p) => p,
            None => self.model.predict(&self.data.test).await?, // resumed after the last epoch
        };
        let max_diff = (!self.dist_losses.is_empty())
            .then(|| local::max_abs_diff(&self.dist_losses, &self.local_losses));
        let summary = Summary {
            args: self.args,
            dims: &self.dims,
            labels: self.data.test.labels(),
            preds: &preds,
            history: &self.at.history,
            steps: self.at.step,
            step_times: self.step_times,
            local_times: self.local_times,
            max_loss_diff: max_diff,
            recoveries: self.tracker.recoveries()?,
            checkpoint: self.last_ckpt,
            start,
        };
        summary.print(self.agent, &self.model).await?;
        Ok(0)
    }
}
