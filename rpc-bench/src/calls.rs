//! `latency` and `throughput`: round trips and calls per second, each beside raw TCP measured
//! in the same batches; `echo_bench`, the bulk path.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use anyhow::{bail, Result};
use futures::StreamExt;
use rpc_core::{Agent, Blob};
use serde_json::json;

use crate::{busy_poll, echo, noop, stats, RawConn};

/// Raw 64-byte TCP ping-pong (blocking, and polling as the framework's waits do when busy
/// polling is on), `rpc_sync` and sequential `rpc_async` round trips, measured in
/// alternating batches of 100 so all see the same machine state (this matters on noisy VMs,
/// where the raw round trip alone drifts several-fold within minutes). Ratios are to the
/// faster raw ping-pong.
pub(crate) fn latency(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    echo_port: u16,
    with_sync: bool,
) -> Result<Vec<serde_json::Value>> {
    const ROUNDS: usize = 55;
    const BATCH: usize = 100;
    let mut blocking = RawConn::connect(echo_port, false)?;
    let mut polled = RawConn::connect(echo_port, true)?;
    let (mut raw, mut raw_polled, mut sync, mut asy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let keep = round >= 5;
        for _ in 0..BATCH {
            let x = blocking.ping()?;
            if keep {
                raw.push(x);
            }
        }
        if !busy_poll().is_zero() {
            for _ in 0..BATCH {
                let x = polled.ping()?;
                if keep {
                    raw_polled.push(x);
                }
            }
        }
        if with_sync {
            for _ in 0..BATCH {
                let t = Instant::now();
                agent.rpc_sync(1u32, noop, ())?;
                if keep {
                    sync.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        // Run the async caller as a task on the runtime (as real callers are), not on the
        // thread blocked in `block_on`, which would add two thread hand-offs per call.
        let a = agent.clone();
        let batch: Vec<f64> = rt.block_on(rt.spawn(async move {
            let mut v = Vec::with_capacity(BATCH);
            for _ in 0..BATCH {
                let t = Instant::now();
                a.rpc_async(1u32, noop, ()).await?;
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, rpc_core::RpcError>(v)
        }))??;
        if keep {
            asy.extend(batch);
        }
    }
    let raw = stats(raw);
    let mut out = vec![json!({
        "metric": "raw_tcp_pingpong_64B_rtt_us",
        "median": raw.median,
        "p99": raw.p99,
        "n": 5000,
    })];
    let mut floor = raw.median;
    if !raw_polled.is_empty() {
        let st = stats(raw_polled);
        floor = floor.min(st.median);
        out.push(json!({
            "metric": "raw_tcp_pingpong_64B_polled_rtt_us",
            "median": st.median,
            "p99": st.p99,
            "n": 5000,
        }));
    }
    for (name, xs) in [
        ("rpc_sync_noop_rtt_us", sync),
        ("rpc_async_noop_rtt_us", asy),
    ] {
        if xs.is_empty() {
            continue;
        }
        let st = stats(xs);
        out.push(json!({
            "metric": name, "median": st.median, "p99": st.p99, "n": 5000,
            "raw_tcp_us": floor, "ratio_to_raw_tcp": st.median / floor,
        }));
    }
    Ok(out)
}

pub(crate) fn raw_stream(port: u16) -> Result<serde_json::Value> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let data = vec![1u8; 64 << 20];
    let mut xs = Vec::new();
    for i in 0..12 {
        let t = Instant::now();
        s.write_all(&(data.len() as u64).to_le_bytes())?;
        s.write_all(&data)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        if i >= 2 {
            xs.push(data.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let st = stats(xs);
    Ok(json!({ "metric": "raw_tcp_stream_GBps", "median": st.median, "p99": st.p99, "n": 10 }))
}

pub(crate) async fn throughput(agent: &Agent) -> Result<serde_json::Value> {
    const CALLS: usize = 20_000;
    const IN_FLIGHT: usize = 2_000;
    let mut rates = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let mut results =
            futures::stream::iter((0..CALLS).map(|_| agent.rpc_async(1u32, noop, ())))
                .buffer_unordered(IN_FLIGHT);
        while let Some(r) = results.next().await {
            r?;
        }
        rates.push(CALLS as f64 / t.elapsed().as_secs_f64());
    }
    let st = stats(rates[1..].to_vec());
    Ok(json!({
        "metric": "rpc_async_noop_calls_per_s",
        "median": st.median,
        "calls_per_s": st.median,
        "in_flight": IN_FLIGHT,
        "calls": CALLS,
        "runs": 6,
    }))
}

pub(crate) async fn echo_bench(
    agent: &Agent,
    name: &str,
    bytes: usize,
    iters: usize,
) -> Result<serde_json::Value> {
    let data = Blob::from((0..bytes).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let warm = (iters / 10).max(2);
    let mut xs = Vec::with_capacity(iters);
    for i in 0..iters + warm {
        let t = Instant::now();
        let back = agent.rpc_async(1u32, echo, (data.clone(),)).await?;
        let dt = t.elapsed().as_secs_f64();
        if back.len() != bytes {
            bail!("echo returned {} bytes, sent {bytes}", back.len());
        }
        if i >= warm {
            xs.push(dt * 1e6);
        }
    }
    let st = stats(xs);
    let gbps = 2.0 * bytes as f64 / (st.median / 1e6) / 1e9;
    Ok(json!({
        "metric": name,
        "median": st.median,
        "p99": st.p99,
        "effective_GBps": gbps,
        "bytes": bytes,
        "n": iters,
    }))
}
