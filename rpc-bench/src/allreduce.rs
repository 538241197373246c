//! `allreduce`: the ring all-reduce in place and into a new tensor, in groups of 2 and 4, and
//! the latency of the collectives with a root on a tiny tensor.

use std::time::Instant;

use anyhow::Result;
use rpc_core::Agent;
use serde_json::json;

use crate::calls::raw_stream;
use crate::variant::bulk_path;
use crate::{emit, group, peak_rss_mb, raw_servers, runtime, stats};

const ALLREDUCE_ITERS: usize = 8;
const ROOTED_ITERS: usize = 200;

/// The timings of one run: `(metric, bytes, ms per iteration)` of the all-reduces, and
/// `(op, µs per iteration)` of the rooted collectives.
type Timings = (
    Vec<(&'static str, usize, Vec<f64>)>,
    Vec<(&'static str, Vec<f64>)>,
);

/// The timed loop every member runs: a barrier, then all-reduces of 64 MiB and 1 MiB in place
/// (as `torch.distributed.all_reduce` and gloo work), and of a 64 MiB tensor into a new one.
/// Returns the metric name, size and per-iteration times seen by this member, in
/// milliseconds.
pub(crate) async fn allreduce_loop(agent: &Agent) -> Result<Timings> {
    let g = collectives::world(agent);
    let n = g.size() as f32;
    let mut out = Vec::new();
    for (name, bytes) in [
        ("all_reduce_64MiB_ms", 64usize << 20),
        ("all_reduce_1MiB_ms", 1 << 20),
    ] {
        let mut x = vec![1.0f32; bytes / 4];
        let mut times = Vec::new();
        for i in 0..ALLREDUCE_ITERS + 2 {
            g.barrier().await?;
            let t = Instant::now();
            g.all_reduce_in_place(&mut x, collectives::ReduceOp::Sum)
                .await?;
            let dt = t.elapsed().as_secs_f64() * 1e3;
            // Every element was 1 on every member.
            let want = n;
            anyhow::ensure!(
                x[0] == want && x[x.len() - 1] == want,
                "all_reduce_in_place gave {} and {}, not {want}",
                x[0],
                x[x.len() - 1]
            );
            x.iter_mut().for_each(|v| *v = 1.0);
            if i >= 2 {
                times.push(dt);
            }
        }
        out.push((name, bytes, times));
    }
    let bytes = 64usize << 20;
    let x = candle_core::Tensor::ones(
        bytes / 4,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    let mut times = Vec::new();
    for i in 0..ALLREDUCE_ITERS + 2 {
        g.barrier().await?;
        let t = Instant::now();
        let y = g.all_reduce(&x, collectives::ReduceOp::Sum).await?;
        let dt = t.elapsed().as_secs_f64() * 1e3;
        let s = y.narrow(0, bytes / 4 - 1, 1)?.to_vec1::<f32>()?[0];
        anyhow::ensure!(s == n, "all_reduce gave {s}");
        if i >= 2 {
            times.push(dt);
        }
    }
    out.push(("all_reduce_tensor_64MiB_ms", bytes, times));
    Ok((out, rooted_loop(agent).await?))
}

/// The collectives with a root (the last member) on a 16-byte tensor, each timed from a barrier
/// to its end on this member: their latency, with ROOT-1's message to the next member and a
/// scatter's headers to its root.
async fn rooted_loop(agent: &Agent) -> Result<Vec<(&'static str, Vec<f64>)>> {
    use collectives::ReduceOp;
    let g = collectives::world(agent);
    let root = g.size() as u32 - 1;
    let me_root = agent.rank() == root;
    let x = candle_core::Tensor::new(&[1f32, 2., 3., 4.], &candle_core::Device::Cpu)?;
    let mut out = Vec::new();
    for op in ["broadcast", "reduce", "gather", "scatter"] {
        let mut times = Vec::with_capacity(ROOTED_ITERS);
        for i in 0..ROOTED_ITERS + 10 {
            g.barrier().await?;
            let t = Instant::now();
            match op {
                "broadcast" => {
                    g.broadcast(&x, root).await?;
                }
                "reduce" => {
                    g.reduce(&x, ReduceOp::Sum, root).await?;
                }
                "gather" => {
                    g.gather(&x, root).await?;
                }
                _ => {
                    let parts = me_root.then(|| vec![x.clone(); g.size()]);
                    g.scatter(parts, root).await?;
                }
            }
            if i >= 10 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        out.push((op, times));
    }
    Ok(out)
}

pub(crate) fn allreduce_bench(n: u32, threads: usize) -> Result<()> {
    let rt = runtime(threads)?;
    let (agent, _peers) = group(&rt, threads, n, "rank0", |rank, addr| {
        vec![
            "allreduce-rank".into(),
            n.to_string(),
            rank.to_string(),
            addr.into(),
        ]
    })?;
    // One-stream loopback TCP measured in the same run: the yardstick the bus bandwidth is
    // compared with (this machine's bandwidth drifts several-fold within minutes).
    let (_, sink_port) = rt.block_on(agent.rpc_async(1u32, raw_servers, ()))?;
    let tcp = raw_stream(sink_port)?;
    let tcp_gbps = tcp["median"].as_f64().unwrap_or(f64::NAN);
    emit(json!({
        "metric": "raw_tcp_stream_GBps",
        "processes": n,
        "median": tcp_gbps,
        "p99": tcp["p99"],
    }));
    let a = agent.clone();
    let results = rt.block_on(rt.spawn(async move { allreduce_loop(&a).await }))??;
    let (results, rooted) = results;
    for (op, times) in rooted {
        let st = stats(times);
        emit(json!({
            "metric": "rooted_16B_us",
            "op": op,
            "processes": n,
            "median": st.median,
            "p99": st.p99,
            "n": ROOTED_ITERS,
            "transport": "tcp",
        }));
    }
    for (name, bytes, times) in results {
        let st = stats(times);
        let busbw = 2.0 * (n as f64 - 1.0) / n as f64 * bytes as f64 / (st.median / 1e3) / 1e9;
        let api = if name.contains("tensor") {
            "tensor"
        } else {
            "in_place"
        };
        emit(json!({
            "metric": name,
            "api": api,
            "processes": n,
            "median": st.median,
            "p99": st.p99,
            "busbw_GBps": busbw,
            "busbw_over_tcp_stream": busbw / tcp_gbps,
            "n": ALLREDUCE_ITERS,
            "transport": "tcp",
            "bulk": bulk_path(),
        }));
    }
    emit(json!({
        "metric": "peak_rss_mb",
        "phase": "allreduce",
        "processes": n,
        "process": "rank0",
        "median": peak_rss_mb(),
    }));
    rt.block_on(agent.shutdown());
    Ok(())
}
