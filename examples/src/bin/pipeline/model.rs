//! The model as the master holds it: the stages on their workers, the pipeline over them, one
//! optimizer; what a checkpoint holds and how it is restored; a training step; evaluation.

use std::collections::HashMap;

use anyhow::{Context, Result};
use autograd_dist::{
    DistributedOptimizer, Loss, Module, OptimizerKind, Pipeline, RemoteModule, Schedule, StepReport,
};
use candle_core::{DType, Device, Tensor, D};
use examples::checkpoint::{self as ckpt, count, floats, put_optimizer, Flags, Tensors};
use examples::lang::data::Split;
use examples::lang::model::Dims;
use examples::recovery::Holders;
use rpc_core::Agent;

use crate::args::Args;
use crate::process::peak_rss_mb;
use crate::stages::{mlp_blocks, EncoderStage, MlpInit, MlpStage};

/// The words at `idx` as the first stage's input, `[B, T + 1]` u32 (ids, then each word's
/// last position), and their labels.
pub fn packed(split: &Split, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let b = split.batch(idx)?;
    let ids = b.ids.reshape((b.t, b.b))?.t()?.contiguous()?;
    let last = Tensor::from_vec(b.last.to_vec(), (b.b, 1), &Device::Cpu)?;
    Ok((Tensor::cat(&[ids, last], 1)?, b.labels))
}

/// A stage module where it lives, kept for its state.
pub enum StageModule {
    Encoder(RemoteModule<EncoderStage>),
    Mlp(RemoteModule<MlpStage>),
}

impl StageModule {
    pub async fn state(&self) -> Result<Vec<Tensor>> {
        Ok(match self {
            Self::Encoder(m) => m.state().await?,
            Self::Mlp(m) => m.state().await?,
        })
    }

    pub async fn load_state(&self, state: Vec<Tensor>) -> Result<()> {
        match self {
            Self::Encoder(m) => m.load_state(state).await?,
            Self::Mlp(m) => m.load_state(state).await?,
        }
        Ok(())
    }
}

/// Where training stands, besides the parameters and optimizer states: what a checkpoint
/// holds to continue bit for bit.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Completed epochs.
    pub epoch: u64,
    /// Completed steps.
    pub step: u64,
    /// The sum of the losses of the epoch in progress.
    pub loss_sum: f64,
    /// Test accuracy after each completed epoch.
    pub accuracy: Vec<f64>,
}

/// The model as the master holds it: the stages, a pipeline over them, one optimizer over
/// every stage's parameters, and the workers that hold them.
pub struct Model {
    pub pipe: Pipeline,
    pub modules: Vec<StageModule>,
    pub opt: DistributedOptimizer,
    pub holders: Holders,
}

impl Model {
    /// Every stage built on its worker in its initial state.
    pub async fn new(agent: &Agent, plan: &Plan, args: &Args) -> Result<Self> {
        let holders = Holders::take(agent, 1..=plan.blocks.len() as u32 + 1);
        let (pipe, modules) = plan.build(agent, args.micro_batches, args.schedule).await?;
        let opt = DistributedOptimizer::new(
            agent,
            OptimizerKind::adam(args.lr),
            pipe.remote_parameters().await?,
        )?;
        Ok(Self {
            pipe,
            modules,
            opt,
            holders,
        })
    }

    /// Every parameter, stage by stage: `stage.<s>.<i>`.
    pub async fn named(&self) -> Result<Vec<(String, Tensor)>> {
        let mut all = Vec::new();
        for (s, state) in states(&self.modules).await?.into_iter().enumerate() {
            for (i, t) in state.into_iter().enumerate() {
                all.push((format!("stage.{s}.{i}"), t));
            }
        }
        Ok(all)
    }

    /// Writes the checkpoint of `progress` into `--out-dir` and prunes the old ones.
    pub async fn checkpoint(&self, args: &Args, flags: &Flags, progress: &Progress) -> Result<()> {
        let mut m: HashMap<String, Tensor> = self.named().await?.into_iter().collect();
        for (rank, st) in self.opt.owners().into_iter().zip(self.opt.state().await?) {
            put_optimizer(&mut m, rank, &st)?;
        }
        m.insert("train.epoch".into(), count(progress.epoch)?);
        m.insert("train.step".into(), count(progress.step)?);
        m.insert("train.loss_sum".into(), floats(&[progress.loss_sum])?);
        m.insert("train.accuracy".into(), floats(&progress.accuracy)?);
        ckpt::save(&args.out_dir, progress.step, &m, flags)?;
        ckpt::prune(&args.out_dir, args.keep_checkpoints)
    }

    /// Restores every stage and optimizer state from the checkpoint `t` (verified, written by
    /// a run with the same flags), and returns where training stood.
    pub async fn restore(&self, t: &Tensors) -> Result<Progress> {
        let path = t.path();
        for (s, module) in self.modules.iter().enumerate() {
            // Every `stage.<s>.<i>` in order (the stage refuses a count or shape it lacks).
            let state: Vec<Tensor> = (0..)
                .map_while(|i| t.map().get(&format!("stage.{s}.{i}")).cloned())
                .collect();
            module
                .load_state(state)
                .await
                .with_context(|| format!("restoring stage {s} from {}", path.display()))?;
        }
        let states = self
            .opt
            .owners()
            .into_iter()
            .map(|r| t.optimizer(r))
            .collect::<Result<_>>()?;
        self.opt.load_state(states).await?;
        Ok(Progress {
            epoch: t.count("train.epoch")?,
            step: t.count("train.step")?,
            loss_sum: t.floats("train.loss_sum")?.first().copied().unwrap_or(0.0),
            accuracy: t.floats("train.accuracy")?,
        })
    }
}

/// The model's stages: what each is built from.
pub struct Plan {
    pub dims: Dims,
    pub seed: u64,
    pub blocks: Vec<MlpInit>,
}

impl Plan {
    pub fn new(args: &Args, vocab: usize, stages: usize) -> Self {
        let dims = args.dims(vocab);
        let cut = mlp_blocks(
            dims.encoding(),
            args.mlp_width,
            args.mlp_layers,
            dims.classes,
            stages - 1,
        );
        let n = cut.len();
        let blocks = cut
            .into_iter()
            .enumerate()
            .map(|(k, (first_layer, widths))| MlpInit {
                widths,
                first_layer,
                relu_last: k + 1 < n,
                seed: args.seed,
                second: (k + 1 == n).then_some(args.last_stage_device),
            })
            .collect();
        Self {
            dims,
            seed: args.seed,
            blocks,
        }
    }

    /// The stages on workers 1, 2, … and a pipeline over them.
    pub async fn build(
        &self,
        agent: &Agent,
        m: usize,
        schedule: Schedule,
    ) -> Result<(Pipeline, Vec<StageModule>)> {
        let enc =
            RemoteModule::<EncoderStage>::new(agent, "worker1/cpu", (self.dims, self.seed)).await?;
        let mut stages = vec![enc.clone().into()];
        let mut modules = vec![StageModule::Encoder(enc)];
        for (k, init) in self.blocks.iter().enumerate() {
            let place = format!("worker{}/cpu", k + 2);
            let m = RemoteModule::<MlpStage>::new(agent, &place, init.clone()).await?;
            stages.push(m.clone().into());
            modules.push(StageModule::Mlp(m));
        }
        let pipe = Pipeline::new(agent, stages, m, schedule, Loss::CrossEntropy)?;
        Ok((pipe, modules))
    }

    /// The same model in this process.
    pub fn local(&self) -> Result<(EncoderStage, Vec<MlpStage>)> {
        let enc = EncoderStage::new((self.dims, self.seed), &Device::Cpu)?;
        let blocks = self
            .blocks
            .iter()
            .map(|b| MlpStage::build(b.clone(), &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        Ok((enc, blocks))
    }
}

/// One training step through the pipeline and the optimizer; the context is released.
pub async fn pipeline_step(
    agent: &Agent,
    pipe: &Pipeline,
    opt: &DistributedOptimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<StepReport> {
    let ctx = autograd_dist::context(agent);
    let report = pipe.step(&ctx, x, y).await?;
    opt.step(&ctx).await?;
    ctx.release().await?;
    Ok(report)
}

/// Every stage's parameters, stage by stage.
pub async fn states(modules: &[StageModule]) -> Result<Vec<Vec<Tensor>>> {
    let mut v = Vec::with_capacity(modules.len());
    for m in modules {
        v.push(m.state().await?);
    }
    Ok(v)
}

/// Peak resident memory of each stage's process, MiB.
pub async fn stage_rss(agent: &Agent, stages: usize) -> Result<Vec<f64>> {
    let mut v = Vec::with_capacity(stages);
    for s in 0..stages {
        v.push(agent.rpc_async(s as u32 + 1, peak_rss_mb, ()).await?);
    }
    Ok(v)
}

/// Predictions for `split`, batch by batch through the pipeline.
pub async fn accuracy(pipe: &Pipeline, split: &Split, batch: usize) -> Result<f64> {
    let idx: Vec<usize> = (0..split.len()).collect();
    let mut correct = 0usize;
    for chunk in idx.chunks(batch) {
        let (x, y) = packed(split, chunk)?;
        let logits = pipe.forward(&x).await?;
        let preds: Vec<u32> = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?;
        let labels: Vec<u32> = y.to_vec1()?;
        correct += preds.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(correct as f64 / split.len().max(1) as f64)
}
