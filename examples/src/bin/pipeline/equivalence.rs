//! `--check-equivalence`: the pipeline against the same model trained in one process, for both
//! schedules and 1, 2, 4 and 8 micro-batches.

use anyhow::{ensure, Result};
use autograd_dist::{DistributedOptimizer, Loss, Module, Optimizer, OptimizerKind, Schedule};
use candle_core::{DType, Tensor};
use examples::lang::data::{epoch_batches, Data};
use rpc_core::Agent;
use serde_json::json;

use crate::args::Args;
use crate::model::{packed, pipeline_step, states, Plan};
use crate::stages::{EncoderStage, MlpStage};

/// Largest difference allowed between the pipeline and one process.
const TOLERANCE: f64 = 1e-5;

/// The optimizer of the 20 compared steps: SGD with momentum, whose update is linear in the gradient, so the
/// pipeline's summation order (micro-batch by micro-batch) stays a 1e-7 difference. Adam
/// divides by the gradient's running magnitude: where a gradient is itself ~1e-7, a rounding
/// difference becomes a full-size step, and the runs part by up to the learning rate per step
/// whatever the pipeline does (measured: 6e-3 after 20 steps with 4 micro-batches).
const EQUIVALENCE_OPTIMIZER: OptimizerKind = OptimizerKind::Sgd {
    lr: 0.1,
    momentum: 0.9,
    weight_decay: 0.0,
};

/// One process's forward pass of the whole model.
fn local_forward(model: &(EncoderStage, Vec<MlpStage>), x: &Tensor) -> Result<Tensor> {
    let mut h = model.0.forward(x)?;
    for b in &model.1 {
        h = b.forward(&h)?;
    }
    Ok(h)
}

fn local_vars(model: &(EncoderStage, Vec<MlpStage>)) -> Vec<Vec<candle_core::Var>> {
    let mut v = vec![model.0.parameters()];
    v.extend(model.1.iter().map(Module::parameters));
    v
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(a.to_dtype(DType::F64)?
        .sub(&b.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?)
}

/// `--check-equivalence`: both schedules with 1, 2, 4 and 8 micro-batches against the same
/// model in one process; exit code 1 above the tolerance.
pub async fn check_equivalence(agent: &Agent, args: &Args, data: &Data) -> Result<i32> {
    let plan = Plan::new(args, data.vocab, args.stages);
    let batches = epoch_batches(data.train.len(), args.batch(), args.seed, 0);
    ensure!(batches.len() >= 20, "20 steps need 20 batches of --batch");
    let inputs: Vec<(Tensor, Tensor)> = batches[..20]
        .iter()
        .map(|b| packed(&data.train, b))
        .collect::<Result<_>>()?;
    // One process: the gradients of the first batch, then 20 steps.
    let model = plan.local()?;
    let vars = local_vars(&model);
    let (x0, y0) = &inputs[0];
    let loss = Loss::CrossEntropy.compute(&local_forward(&model, x0)?, y0, args.batch())?;
    let grads = loss.backward()?;
    let local_grads: Vec<Vec<Tensor>> = vars
        .iter()
        .map(|vs| {
            vs.iter()
                .map(|v| {
                    grads
                        .get(v.as_tensor())
                        .cloned()
                        .map_or_else(|| v.zeros_like(), Ok)
                })
                .collect()
        })
        .collect::<candle_core::Result<_>>()?;
    let mut sgd = Optimizer::new(EQUIVALENCE_OPTIMIZER, vars.concat());
    let mut local_losses = Vec::new();
    for (x, y) in &inputs {
        let loss = Loss::CrossEntropy.compute(&local_forward(&model, x)?, y, args.batch())?;
        sgd.step(&loss.backward()?)?;
        local_losses.push(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?);
    }
    let (mut grad_diff, mut param_diff, mut loss_diff) = (0f64, 0f64, 0f64);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for m in [1, 2, 4, 8] {
            // Gradients: one SGD step with rate 1 moves each parameter by minus its gradient.
            let (pipe, modules) = plan.build(agent, m, schedule).await?;
            let before = states(&modules).await?;
            let sgd = DistributedOptimizer::new(
                agent,
                OptimizerKind::sgd(1.0),
                pipe.remote_parameters().await?,
            )?;
            pipeline_step(agent, &pipe, &sgd, x0, y0).await?;
            let after = states(&modules).await?;
            let mut g = 0f64;
            for ((b, a), want) in before.iter().zip(&after).zip(&local_grads) {
                for ((b, a), w) in b.iter().zip(a).zip(want) {
                    g = g.max(max_diff(&(b - a)?, w)?);
                }
            }
            // 20 steps from the initial values.
            let (pipe, modules) = plan.build(agent, m, schedule).await?;
            let opt = DistributedOptimizer::new(
                agent,
                EQUIVALENCE_OPTIMIZER,
                pipe.remote_parameters().await?,
            )?;
            let mut l = 0f64;
            for ((x, y), want) in inputs.iter().zip(&local_losses) {
                let r = pipeline_step(agent, &pipe, &opt, x, y).await?;
                l = l.max((r.loss - want).abs());
            }
            let mut p = 0f64;
            for (got, want) in states(&modules).await?.iter().zip(&vars) {
                for (t, v) in got.iter().zip(want) {
                    p = p.max(max_diff(t, v.as_tensor())?);
                }
            }
            println!(
                "{schedule} with {m} micro-batch(es): gradients {g:.2e}, parameters after 20 \
                 steps {p:.2e}, losses {l:.2e}"
            );
            grad_diff = grad_diff.max(g);
            param_diff = param_diff.max(p);
            loss_diff = loss_diff.max(l);
        }
    }
    let ok = grad_diff <= TOLERANCE && param_diff <= TOLERANCE;
    println!(
        "{}",
        json!({
            "check": "equivalence",
            "stages": args.stages,
            "schedules": ["gpipe", "1f1b"],
            "micro_batches": [1, 2, 4, 8],
            "steps": 20,
            "max_grad_diff": grad_diff,
            "max_param_diff": param_diff,
            "max_loss_diff": loss_diff,
            "tolerance": TOLERANCE,
            "ok": ok,
        })
    );
    Ok(if ok { 0 } else { 1 })
}
