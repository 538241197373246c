//! `nccl` (built with `--features cuda`): the all-reduce of a tensor on a GPU through NCCL
//! against the ring over RPC on the same tensor in host memory, in a group of one process
//! per GPU (in this process, over TCP on 127.0.0.1; NCCL refuses two ranks on one device).
//! One JSON line per path and size: bus bandwidth in GB/s (`2 (n - 1) / n * bytes / time`,
//! nccl-tests' definition), median and best of the timed iterations.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use collectives::ReduceOp;
use rpc_core::testing::start_group;
use rpc_core::{Registry, Secret, Transport};
use serde_json::json;

use crate::{emit, stats};

const ITERS: usize = 10;

/// Runs the comparison on every GPU there is (at least two).
pub(crate) fn nccl_bench() -> Result<()> {
    let gpus = autograd_dist::cuda_devices()?;
    ensure!(
        gpus >= 2,
        "the NCCL all-reduce needs 2 GPUs, this machine has {gpus}"
    );
    let rt = crate::runtime(4)?;
    rt.block_on(async {
        let agents = start_group(
            gpus as u32,
            Transport::Tcp,
            Secret::generate(),
            |_| {
                collectives::install(Registry::builder())
                    .expect("names")
                    .build()
            },
            |_, c| c.with_rpc_timeout(Duration::from_secs(120)),
        )
        .await?;
        for bytes in [1usize << 20, 64 << 20, 256 << 20] {
            for path in ["nccl", "ring"] {
                let runs = agents.iter().enumerate().map(|(i, a)| async move {
                    let g = collectives::world(a);
                    let device = match path {
                        "nccl" => Device::new_cuda(i)?,
                        _ => Device::Cpu,
                    };
                    let x = Tensor::ones(bytes / 4, DType::F32, &device)?;
                    let mut times = Vec::new();
                    for it in 0..ITERS + 2 {
                        g.barrier().await?;
                        let t = Instant::now();
                        let y = g.all_reduce(&x, ReduceOp::Sum).await?;
                        // The result is on the host (or synchronized) before the clock stops.
                        let first: f32 = y.get(0)?.to_scalar()?;
                        let dt = t.elapsed().as_secs_f64();
                        ensure!(first == gpus as f32, "all-reduce gave {first}");
                        if it >= 2 {
                            times.push(dt);
                        }
                    }
                    anyhow::Ok(times)
                });
                let all = futures::future::try_join_all(runs).await?;
                // An iteration ends when its slowest member is done.
                let per_iter: Vec<f64> = (0..ITERS)
                    .map(|k| all.iter().map(|t| t[k]).fold(0.0, f64::max))
                    .collect();
                let n = gpus as f64;
                let bus = |s: f64| 2.0 * (n - 1.0) / n * bytes as f64 / s / 1e9;
                let best = per_iter.iter().copied().fold(f64::MAX, f64::min);
                let s = stats(per_iter);
                emit(json!({
                    "metric": "all_reduce_bus_gbps", "impl": path, "world_size": gpus,
                    "bytes": bytes, "median": bus(s.median), "best": bus(best),
                    "median_ms": s.median * 1e3,
                }));
            }
        }
        for a in &agents {
            let _ = a.shutdown().await;
        }
        anyhow::Ok(())
    })
}
