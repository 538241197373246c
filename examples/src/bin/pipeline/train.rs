//! The master's training loop: epochs of pipeline steps, checkpoints, evaluation, fault
//! injection, and (with `--restart worker`) the recovery in this process when a stage's worker
//! is replaced; then the timeline and the JSON line.

use rpc_core::trace::Cat;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use autograd_dist::{bubble_theory, StepReport};
use examples::checkpoint::{self as ckpt, Flags};
use examples::lang::data::{epoch_batches, Data};
use examples::recovery::Tracker;
use examples::resume::StartFlags;
use examples::round;
use rpc_core::Agent;
use serde_json::json;

use crate::args::{Args, Victim};
use crate::model::{accuracy, packed, pipeline_step, stage_rss, Model, Plan, Progress};
use crate::process::die;
use crate::timeline;

/// The master's state across the run.
struct Trainer<'a> {
    agent: &'a Agent,
    args: &'a Args,
    data: &'a Data,
    plan: Plan,
    flags: Flags,
    per_epoch: u64,
    restart: u32,
    model: Model,
    progress: Progress,
    tracker: Tracker,
    step_ms: Vec<f64>,
    bubbles: Vec<f64>,
    /// Per stage, the most activations it kept at once.
    live: Vec<usize>,
    last_loss: f64,
    /// The step the timeline shows (the middle of the last epoch).
    shown: Option<StepReport>,
    /// Recoveries in this process (`--restart worker`: a stage failed, the master did not).
    in_place: u32,
}

/// The master's whole run: where it starts (`examples::resume`), training to `--epochs`, the
/// report.
pub async fn train(agent: &Agent, args: &Args, data: &Data, restart: u32) -> Result<i32> {
    let started = Instant::now();
    let plan = Plan::new(args, data.vocab, args.stages);
    let flags = args.flags(data);
    let per_epoch = (data.train.len() / args.batch()) as u64;
    let start = StartFlags {
        resume: args.resume,
        fresh: args.fresh,
    };
    let resume_from = examples::resume::start(&args.out_dir, &flags, start, restart)?;
    let model = Model::new(agent, &plan, args).await?;
    let mut progress = Progress::default();
    if let Some(t) = &resume_from {
        progress = model.restore(t).await?;
        println!(
            "resumed from {} (epoch {}, step {}, restart {restart})",
            t.path().display(),
            progress.epoch,
            progress.step
        );
        examples::resume::say_if_complete(&args.out_dir, progress.epoch, args.epochs);
    }
    let resumed = resume_from.is_some() || restart > 0;
    let mut tracker = Tracker::open(&args.out_dir, restart, resumed.then_some(progress.step))?;
    tracker.completed(progress.step)?;
    println!(
        "pipeline: {} stages on {} ({} schedule, {} micro-batches of ~{} words)",
        args.stages,
        model.pipe.workers().join(", "),
        args.schedule,
        args.micro_batches,
        args.batch() / args.micro_batches
    );
    let mut t = Trainer {
        agent,
        args,
        data,
        plan,
        flags,
        per_epoch,
        restart,
        model,
        progress,
        tracker,
        step_ms: Vec::new(),
        bubbles: Vec::new(),
        live: vec![0usize; args.stages],
        last_loss: f64::NAN,
        shown: None,
        in_place: 0,
    };
    loop {
        // The training from where it stands; a stage's failure ends it with an error.
        let Err(err) = t.epochs().await else { break };
        if args.restart != rpcrun::Restart::Worker || examples::is_fatal(&err) {
            return Err(err);
        }
        t.recover_in_place(err).await?;
    }
    t.finish(started).await
}

impl Trainer<'_> {
    /// Every epoch from where training stands to `--epochs`.
    async fn epochs(&mut self) -> Result<()> {
        while self.progress.epoch < self.args.epochs {
            self.epoch().await?;
        }
        Ok(())
    }

    /// The epoch in progress, from where it stands: its steps, evaluation, its checkpoint.
    async fn epoch(&mut self) -> Result<()> {
        let (args, data) = (self.args, self.data);
        let epoch = self.progress.epoch;
        let batches = epoch_batches(data.train.len(), args.batch(), args.seed, epoch);
        let bar = examples::epoch_bar(args.quiet, batches.len() as u64, epoch, args.epochs);
        // Where a resumed epoch picks up.
        let k0 = (self.progress.step - epoch * self.per_epoch) as usize;
        bar.set_position(k0 as u64);
        for (k, b) in batches.iter().enumerate().skip(k0) {
            self.step(epoch, k, b, batches.len()).await?;
            bar.inc(1);
            bar.set_message(format!(
                "loss {:.4}",
                self.progress.loss_sum / (k + 1) as f64
            ));
        }
        bar.finish_and_clear();
        let acc = accuracy(&self.model.pipe, &data.test, args.batch()).await?;
        let p = &mut self.progress;
        println!(
            "epoch {}/{}: train loss {:.4}, test accuracy {:.4}",
            epoch + 1,
            args.epochs,
            p.loss_sum / batches.len().max(1) as f64,
            acc
        );
        p.accuracy.push(acc);
        p.epoch += 1;
        p.loss_sum = 0.0;
        let _span = self.agent.tracer().span(Cat::Checkpoint, "checkpoint");
        self.model
            .checkpoint(args, &self.flags, &self.progress)
            .await
    }

    /// Step `k` of `n` of epoch `epoch` on the words `b` (with the fault injected when asked);
    /// a checkpoint after it every `--checkpoint-every` steps but the epoch's last.
    async fn step(&mut self, epoch: u64, k: usize, b: &[usize], n: usize) -> Result<()> {
        let (agent, args) = (self.agent, self.args);
        let step = self.progress.step;
        let mut span = agent.tracer().span(Cat::Step, "step");
        span.detail(|| format!("step {step}"));
        let (x, y) = packed(&self.data.train, b)?;
        let t = Instant::now();
        // Fault injection, once per run (not when a recovered run replays it).
        let kill = (args.kill_at_step == Some(step) && self.restart == 0 && self.in_place == 0)
            .then_some(args.kill_stage)
            .flatten();
        let killer = async {
            if let Some(v) = kill {
                // Once the step has begun (its first sends are out), not after a delay: a step
                // shorter than the delay ended first, and the fault came between steps or not
                // at all (seen on a faster machine: replayed 3 steps, or the master never
                // killed). The victim's `die` needs one hop; the step needs stage 0's forward
                // before it reaches any later stage, so it cannot end first.
                tokio::task::yield_now().await;
                eprintln!("pipeline: killing {v} during step {step}");
                let rank = match v {
                    Victim::Master => 0,
                    Victim::Stage(s) => s as u32 + 1,
                };
                // The call never answers: its worker is gone.
                let _ = agent.rpc_async(rank, die, ()).await;
            }
            std::future::pending::<()>().await
        };
        let report = tokio::select! {
            r = pipeline_step(agent, &self.model.pipe, &self.model.opt, &x, &y) => {
                r.with_context(|| format!("training step {step}"))?
            }
            () = killer => unreachable!("the fault injection never ends"),
        };
        if epoch > 0 || k >= 3 {
            self.step_ms.push(t.elapsed().as_secs_f64() * 1e3);
            self.bubbles.push(report.bubble());
        }
        for (l, r) in self.live.iter_mut().zip(&report.max_live_activations) {
            *l = (*l).max(*r);
        }
        let p = &mut self.progress;
        p.loss_sum += report.loss;
        p.step += 1;
        self.last_loss = report.loss;
        if epoch + 1 == args.epochs && k == n / 2 {
            self.shown = Some(report);
        }
        self.tracker.completed(p.step)?;
        if p.step % args.checkpoint_every == 0 && k + 1 < n {
            drop(span);
            let _span = agent.tracer().span(Cat::Checkpoint, "checkpoint");
            self.model.checkpoint(args, &self.flags, p).await?;
        }
        Ok(())
    }

    /// `--restart worker`: a stage's worker failed (`err`); waits for its replacement and
    /// rolls everything back to the newest verified checkpoint: every stage is rebuilt (the
    /// survivors' too: the interrupted step may have been applied on some of them) and
    /// restored, with every optimizer state.
    async fn recover_in_place(&mut self, err: anyhow::Error) -> Result<()> {
        let mut span = self.agent.tracer().span(Cat::Failure, "recovery");
        span.detail(|| examples::said(&err));
        let timeout = Duration::from_secs(self.args.timeout_secs);
        let lost = self
            .model
            .holders
            .await_replacements(&err, timeout, "pipeline")
            .await?;
        self.in_place += 1;
        self.model = Model::new(self.agent, &self.plan, self.args).await?;
        let from = match examples::resume::newest_verified(&self.args.out_dir)? {
            Some(t) => {
                self.progress = self.model.restore(&t).await?;
                t.path().display().to_string()
            }
            None => {
                self.progress = Progress::default();
                "the initial parameters (no checkpoint yet)".to_owned()
            }
        };
        let step = self.progress.step;
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

    /// The run's end: the timeline picture and the JSON line.
    async fn finish(self, started: Instant) -> Result<i32> {
        let args = self.args;
        let timeline = args.out_dir.join("timeline.png");
        let drawn = match &self.shown {
            Some(r) => {
                let title = format!(
                    "{} stages, {} micro-batches, {}: step {:.1} ms, bubble {:.2} (theory {:.2})",
                    args.stages,
                    args.micro_batches,
                    args.schedule,
                    r.span_us.1.saturating_sub(r.span_us.0) as f64 / 1e3,
                    r.bubble(),
                    bubble_theory(args.stages, args.micro_batches)
                );
                timeline::draw(r, &self.model.pipe.workers(), &title, &timeline)?;
                Some(timeline.display().to_string())
            }
            // Resumed past the step it shows.
            None => None,
        };
        let rss = stage_rss(self.agent, args.stages).await?;
        let params_sha256 = ckpt::params_sha256(&self.model.named().await?)?;
        let step_ms_median = median(self.step_ms);
        let p = &self.progress;
        let mut line = json!({
            "example": "pipeline",
            "schedule": args.schedule.to_string(),
            "stages": args.stages,
            "micro_batches": args.micro_batches,
            "batch": args.batch(),
            "epochs": args.epochs,
            "steps": p.step,
            "final_loss": round(self.last_loss, 5),
            "accuracy": round(p.accuracy.last().copied().unwrap_or(0.0), 4),
            "accuracy_per_epoch": p.accuracy.iter().map(|a| round(*a, 4)).collect::<Vec<_>>(),
            "step_ms_median": round(step_ms_median, 2),
            "words_per_s": round(args.batch() as f64 / step_ms_median * 1e3, 0),
            "bubble_measured": round(median(self.bubbles), 3),
            "bubble_theory": round(bubble_theory(args.stages, args.micro_batches), 3),
            "max_live_activations": self.live,
            "peak_rss_mb": rss.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
            "master_peak_rss_mb": round(examples::peak_rss_mb(), 1),
            "timeline": drawn,
            "params_sha256": params_sha256,
            "restarts": self.restart,
            "wall_s": round(started.elapsed().as_secs_f64(), 1),
        });
        let recoveries = examples::recovery::report(&self.tracker.recoveries()?);
        line.as_object_mut().expect("an object").extend(recoveries);
        println!("{line}");
        Ok(0)
    }
}

/// The median of `v` (0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}
