//! The master's side of the model: the encoder here, the two head replicas on the workers
//! (created there, reached by `RRef`), one `DistributedOptimizer` over all of them; a training
//! step, predictions, checkpoints and their restoration.

use rpc_core::trace::Cat;
use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use autograd_dist::{DistributedOptimizer, OptimizerState, RTensor};
use candle_core::Tensor;
use examples::checkpoint::Tensors;
use examples::lang::data::{Batch, Split};
use examples::lang::model::{self, Dims, Encoder, EncoderInput, HEAD_PARAMS};
use examples::recovery::Holders;
use examples::Fatal;
use rpc_core::Agent;
use rref::RRef;

use crate::args::Args;
use crate::checkpoint::{Checkpoint, EpochProgress};
use crate::report::History;
use crate::shard::{self, NetShard};

/// Words per evaluation batch.
const EVAL_BATCH: usize = 1000;

/// The master's model: the encoder here, the two head replicas on the workers, and one
/// optimizer over all of them.
pub struct Hybrid {
    agent: Agent,
    encoder: Encoder,
    shards: [RRef<NetShard>; 2],
    /// The shards' workers when the shards were created.
    pub holders: Holders,
    pub opt: DistributedOptimizer,
    half: usize,
}

impl Hybrid {
    /// The model in its initial state; `instance` tells this instance's data-parallel group
    /// from the groups of instances abandoned after failures (see [`shard::instance`]).
    pub async fn new(agent: &Agent, args: &Args, dims: &Dims, instance: u64) -> Result<Self> {
        let encoder = Encoder::new(dims, args.seed)?;
        let (d0, d1) = args.shard2_devices()?;
        let [r1, r2] = shard::SHARD_RANKS;
        for (rank, devices) in [(r1, vec![args.shard1_device]), (r2, vec![d0, d1])] {
            let usable = agent.rpc_async(rank, shard::usable_devices, (devices,));
            if let Err(why) = usable
                .await
                .context("asking the workers for their devices")?
            {
                return Err(
                    Fatal(format!("worker rank {rank} cannot hold its shard: {why}")).into(),
                );
            }
        }
        let holders = Holders::take(agent, shard::SHARD_RANKS);
        let s1 = rref::remote(
            agent,
            shard::SHARD_RANKS[0],
            shard::new_net_shard1,
            (*dims, args.seed + 1, args.shard1_device, instance),
        )?;
        let s2 = rref::remote(
            agent,
            shard::SHARD_RANKS[1],
            shard::new_net_shard2,
            (*dims, args.seed + 1, d0, d1, instance),
        )?;
        let mut params = autograd_dist::parameter_rrefs(agent, encoder.vars());
        let (p1, p2) = futures::try_join!(
            s1.rpc_async(shard::shard_parameters, ()),
            s2.rpc_async(shard::shard_parameters, ())
        )
        .context("creating the head replicas on the workers")?;
        params.extend(p1);
        params.extend(p2);
        let opt = DistributedOptimizer::new(agent, args.optimizer(), params)?;
        Ok(Self {
            agent: agent.clone(),
            encoder,
            shards: [s1, s2],
            holders,
            opt,
            half: args.batch / 2,
        })
    }

    /// Logits of `enc`'s rows: the first half on worker 1, the rest on worker 2.
    async fn heads(&self, enc: &Tensor, half: usize) -> Result<Tensor> {
        let n = enc.dim(0)?;
        let a = RTensor(enc.narrow(0, 0, half)?);
        let b = RTensor(enc.narrow(0, half, n - half)?);
        let (o1, o2) = futures::try_join!(
            self.shards[0].rpc_async(shard::shard_forward, (a,)),
            self.shards[1].rpc_async(shard::shard_forward, (b,))
        )?;
        Ok(Tensor::cat(&[o1.0, o2.0], 0)?)
    }

    /// One distributed training step; returns the loss and the logits.
    pub async fn step(&self, batch: &Batch, dropout: Option<&Tensor>) -> Result<(f32, Tensor)> {
        let ctx = autograd_dist::context(&self.agent);
        let tracer = self.agent.tracer();
        let (loss, logits) = ctx
            .run(async {
                let span = tracer.span(Cat::Compute, "encoder forward");
                let enc = self.encoder.forward(&input(batch, dropout))?;
                drop(span);
                let logits = self.heads(&enc, self.half).await?;
                let _span = tracer.span(Cat::Compute, "loss");
                let loss = model::loss(&logits, &batch.labels)?;
                Ok::<_, anyhow::Error>((loss, logits))
            })
            .await?;
        ctx.backward(std::slice::from_ref(&loss)).await?;
        self.opt.step(&ctx).await?;
        // The context is released on every worker in the background.
        drop(ctx);
        Ok((loss.to_scalar::<f32>()?, logits.detach()))
    }

    /// Predictions for every word of `split`.
    pub async fn predict(&self, split: &Split) -> Result<Vec<u32>> {
        let idx: Vec<usize> = (0..split.len()).collect();
        let mut preds = Vec::with_capacity(split.len());
        for chunk in idx.chunks(EVAL_BATCH) {
            let batch = split.batch(chunk)?;
            let enc = self.encoder.forward(&input(&batch, None))?.detach();
            let logits = self.heads(&enc, chunk.len() / 2).await?;
            preds.extend(model::predictions(&logits)?);
        }
        Ok(preds)
    }

    fn encoder_named(&self, dims: &Dims) -> Vec<(String, Tensor)> {
        model::encoder_param_names(dims)
            .into_iter()
            .zip(self.encoder.vars())
            .map(|(n, v)| (n.to_string(), v.as_tensor().detach()))
            .collect()
    }

    pub async fn checkpoint(
        &self,
        dims: &Dims,
        args: &Args,
        epoch: u64,
        step: u64,
        history: &History,
        progress: EpochProgress,
    ) -> Result<PathBuf> {
        let head = self.shards[0].rpc_async(shard::shard_values, ()).await?;
        let states = self.opt.state().await?;
        let ck = Checkpoint {
            epoch,
            step,
            encoder: self.encoder_named(dims),
            head: HEAD_PARAMS
                .iter()
                .map(|n| n.to_string())
                .zip(head.into_iter().map(|t| t.0))
                .collect(),
            optim: self.opt.owners().into_iter().zip(states).collect(),
            history: history.clone(),
            progress,
        };
        ck.save(&args.out_dir, &args.flags(dims))
    }

    /// [`examples::checkpoint::params_sha256`] of every parameter: the encoder's, then the head's
    /// (one replica; `replica_diff` checks they are equal), in checkpoint order.
    pub async fn params_sha256(&self, dims: &Dims) -> Result<String> {
        let head = self.shards[0].rpc_async(shard::shard_values, ()).await?;
        let mut all = self.encoder_named(dims);
        all.extend(
            HEAD_PARAMS
                .iter()
                .map(|n| n.to_string())
                .zip(head.into_iter().map(|t| t.0)),
        );
        examples::checkpoint::params_sha256(&all)
    }

    /// The largest difference between the two head replicas' parameters (0 when the
    /// all-reduce keeps them identical).
    pub async fn replica_diff(&self) -> Result<f64> {
        let (a, b) = futures::try_join!(
            self.shards[0].rpc_async(shard::shard_values, ()),
            self.shards[1].rpc_async(shard::shard_values, ())
        )?;
        let mut worst = 0f64;
        for (x, y) in a.iter().zip(&b) {
            let d = (&x.0 - &y.0)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            worst = worst.max(f64::from(d));
        }
        Ok(worst)
    }

    /// Restores the checkpoint `t` (verified, written by a run with the same flags): its
    /// epoch, step, progress and history.
    pub async fn resume(
        &self,
        t: &Tensors,
        dims: &Dims,
        per_epoch: u64,
    ) -> Result<(u64, u64, EpochProgress, History)> {
        let ck = Checkpoint::load(
            t,
            &model::encoder_param_names(dims),
            &HEAD_PARAMS,
            &self.opt.owners(),
        )?;
        let (epoch, step) = (ck.epoch, ck.step);
        ensure!(
            (epoch * per_epoch..(epoch + 1) * per_epoch).contains(&step),
            "{}: step {step} is not in epoch {} of {per_epoch} steps",
            t.path().display(),
            epoch + 1
        );
        let (progress, history) = (ck.progress, ck.history.clone());
        self.restore(ck).await?;
        Ok((epoch, step, progress, history))
    }

    async fn restore(&self, ck: Checkpoint) -> Result<()> {
        for ((_, t), v) in ck.encoder.iter().zip(self.encoder.vars()) {
            ensure!(
                t.dims() == v.dims(),
                "checkpoint encoder parameter is {:?}, model has {:?}",
                t.dims(),
                v.dims()
            );
            v.set(t)?;
        }
        let head: Vec<RTensor> = ck.head.into_iter().map(|(_, t)| RTensor(t)).collect();
        futures::try_join!(
            self.shards[0].rpc_async(shard::load_shard_values, (head.clone(),)),
            self.shards[1].rpc_async(shard::load_shard_values, (head,))
        )?;
        let owners = self.opt.owners();
        let mut states: Vec<OptimizerState> = Vec::new();
        for o in owners {
            let st = ck
                .optim
                .iter()
                .find(|(r, _)| *r == o)
                .with_context(|| format!("checkpoint has no optimizer state for rank {o}"))?;
            states.push(st.1.clone());
        }
        self.opt.load_state(states).await?;
        Ok(())
    }
}

fn input<'a>(b: &'a Batch, dropout: Option<&'a Tensor>) -> EncoderInput<'a> {
    EncoderInput {
        ids: &b.ids,
        rev_ids: &b.rev_ids,
        last: &b.last,
        t: b.t,
        b: b.b,
        dropout,
    }
}

/// How many rows of `logits` predict their label.
pub fn correct(logits: &Tensor, labels: &Tensor) -> Result<usize> {
    let p = model::predictions(logits)?;
    let y = labels.to_vec1::<u32>()?;
    Ok(p.iter().zip(&y).filter(|(a, b)| a == b).count())
}
