//! `--bench`: step times and bubbles for 2 and 4 stages, both schedules, 1, 2, 4 and 8
//! micro-batches, one JSON line per configuration.

use std::time::Instant;

use anyhow::{bail, Result};
use autograd_dist::{bubble_theory, DistributedOptimizer, OptimizerKind, Schedule};
use candle_core::Tensor;
use examples::lang::data::{epoch_batches, Data};
use examples::round;
use rpc_core::Agent;
use serde_json::json;

use crate::args::Args;
use crate::model::{packed, pipeline_step, stage_rss, Plan};
use crate::process::reset_peak_rss;
use crate::train::median;

/// One JSON line per configuration: 2 and 4 stages, both schedules, 1, 2, 4 and 8
/// micro-batches, the same batches for each.
pub async fn bench(agent: &Agent, args: &Args, data: &Data) -> Result<i32> {
    let warmup = 3;
    let batches = epoch_batches(data.train.len(), args.batch(), args.seed, 0);
    let n = warmup + args.bench_steps;
    if batches.len() < n {
        bail!(
            "--bench needs {n} batches of {}; the training set has {}",
            args.batch(),
            batches.len()
        );
    }
    let inputs: Vec<(Tensor, Tensor)> = batches[..n]
        .iter()
        .map(|b| packed(&data.train, b))
        .collect::<Result<_>>()?;
    for stages in [2usize, 4] {
        let plan = Plan::new(args, data.vocab, stages);
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut one = None;
            for m in [1usize, 2, 4, 8] {
                for s in 0..stages {
                    agent.rpc_async(s as u32 + 1, reset_peak_rss, ()).await?;
                }
                let (pipe, _modules) = plan.build(agent, m, schedule).await?;
                let opt = DistributedOptimizer::new(
                    agent,
                    OptimizerKind::adam(args.lr),
                    pipe.remote_parameters().await?,
                )?;
                let (mut times, mut bubbles) = (Vec::new(), Vec::new());
                let mut live = vec![0usize; stages];
                for (k, (x, y)) in inputs.iter().enumerate() {
                    let t = Instant::now();
                    let r = pipeline_step(agent, &pipe, &opt, x, y).await?;
                    if k >= warmup {
                        times.push(t.elapsed().as_secs_f64() * 1e3);
                        bubbles.push(r.bubble());
                    }
                    for (l, r) in live.iter_mut().zip(&r.max_live_activations) {
                        *l = (*l).max(*r);
                    }
                }
                let ms = median(times);
                let bubble = median(bubbles);
                let (base, base_bubble) = *one.get_or_insert((ms, bubble));
                let rss = stage_rss(agent, stages).await?;
                println!(
                    "{}",
                    json!({
                        "bench": "pipeline",
                        "schedule": schedule.to_string(),
                        "stages": stages,
                        "micro_batches": m,
                        "batch": args.batch(),
                        "step_ms": round(ms, 2),
                        "speedup_vs_one": round(base / ms, 3),
                        "bubble_measured": round(bubble, 3),
                        "bubble_theory": round(bubble_theory(stages, m), 3),
                        // The speedup the overlap alone explains (stages busy a larger share
                        // of the step); the rest comes from each pass's work changing with
                        // the micro-batch's size.
                        "overlap_speedup": round((1.0 - bubble) / (1.0 - base_bubble).max(1e-9), 3),
                        "max_live_activations": live,
                        "peak_rss_mb": rss.iter().map(|r| round(*r, 1)).collect::<Vec<_>>(),
                        "steps": args.bench_steps,
                    })
                );
            }
        }
    }
    Ok(0)
}
