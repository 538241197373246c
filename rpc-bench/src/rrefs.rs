//! `rref`: remote references' operations, each batch beside a batch of raw ping-pongs.

use std::time::{Duration, Instant};

use anyhow::Result;
use rpc_core::Agent;
use serde_json::json;

use crate::{busy_poll, incr, new_counter, stats, RawConn};

/// Rounds of the RRef benchmarks (the first `RREF_WARM` are warm-up), each a batch of raw
/// ping-pongs and a batch of the operation measured.
const RREF_ROUNDS: usize = 35;
const RREF_WARM: usize = 5;
const RREF_BATCH: usize = 100;
const RREF_N: usize = (RREF_ROUNDS - RREF_WARM) * RREF_BATCH;

/// Raw 64-byte ping-pongs on a blocking socket, measured between the batches of an RRef
/// benchmark so that both see the same machine state, as in [`latency`]. (On this VM an idle
/// vCPU halts and takes an extra ~100 µs to wake; a run of back-to-back round trips keeps
/// it from halting, and a benchmark that measures without its baseline beside it reports
/// the machine's mood as much as the code.)
struct RawPing {
    conn: RawConn,
    xs: Vec<f64>,
}

impl RawPing {
    /// Polling like the framework's waits when busy polling is on.
    fn connect(port: u16) -> Result<Self> {
        Ok(Self {
            conn: RawConn::connect(port, !busy_poll().is_zero())?,
            xs: Vec::new(),
        })
    }

    fn batch(&mut self, keep: bool) -> Result<()> {
        for _ in 0..RREF_BATCH {
            let x = self.conn.ping()?;
            if keep {
                self.xs.push(x);
            }
        }
        Ok(())
    }

    /// Runs `batch` (which times `RREF_BATCH` operations) in rounds alternating with raw
    /// batches; the times of the rounds after the warm-up.
    fn interleave(&mut self, mut batch: impl FnMut() -> Result<Vec<f64>>) -> Result<Vec<f64>> {
        let mut xs = Vec::with_capacity(RREF_N);
        for round in 0..RREF_ROUNDS {
            let keep = round >= RREF_WARM;
            self.batch(keep)?;
            let b = batch()?;
            anyhow::ensure!(
                b.len() == RREF_BATCH,
                "a batch timed {} operations",
                b.len()
            );
            if keep {
                xs.extend(b);
            }
        }
        Ok(xs)
    }
}

/// Times `RREF_BATCH` runs of `op` as a task on the runtime (as real async callers run).
fn on_runtime<Fut>(
    rt: &tokio::runtime::Runtime,
    op: impl Fn() -> Fut + Send + 'static,
) -> Result<Vec<f64>>
where
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    rt.block_on(rt.spawn(async move {
        let mut v = Vec::with_capacity(RREF_BATCH);
        for _ in 0..RREF_BATCH {
            let t = Instant::now();
            op().await?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(v)
    }))?
}

/// Times `RREF_BATCH` runs of `op` on this (plain) thread.
fn on_thread(mut op: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut v = Vec::with_capacity(RREF_BATCH);
    for _ in 0..RREF_BATCH {
        let t = Instant::now();
        op()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// The RRef operations of PyTorch's `bench_rref.py`: `remote` (+ `to_here`), `to_here` of an
/// existing reference and a method call, from a task (async) and from a plain thread
/// (blocking, as PyTorch's, called from Python's main thread), each in batches alternating
/// with raw ping-pongs (`raw_tcp_us` and `ratio_to_raw_tcp` on every line).
pub(crate) fn rref_metrics(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    echo_port: u16,
) -> Result<Vec<serde_json::Value>> {
    let mut raw = RawPing::connect(echo_port)?;
    let mut timed: Vec<(&str, Vec<f64>)> = Vec::new();
    // remote + to_here; the handle is dropped each time (delete traffic included).
    let a = agent.clone();
    let xs = raw.interleave(|| {
        let a = a.clone();
        on_runtime(rt, move || {
            let a = a.clone();
            async move {
                let r = rref::remote(&a, 1u32, new_counter, (1,))?;
                let c = r.to_here().await?;
                anyhow::ensure!(c.value == 1, "wrong value");
                Ok(())
            }
        })
    })?;
    timed.push(("remote_to_here_us", xs));
    let a = agent.clone();
    timed.push((
        "remote_create_us",
        rt.block_on(rt.spawn(async move { remote_create(&a).await }))??,
    ));
    let existing = rref::remote(agent, 1u32, new_counter, (5,))?;
    existing.to_here_blocking()?;
    let e = existing.clone();
    let xs = raw.interleave(|| {
        let e = e.clone();
        on_runtime(rt, move || {
            let e = e.clone();
            async move {
                anyhow::ensure!(e.to_here().await?.value == 5, "wrong value");
                Ok(())
            }
        })
    })?;
    timed.push(("to_here_existing_us", xs));
    let counter = rref::remote(agent, 1u32, new_counter, (0,))?;
    let c = counter.clone();
    let xs = raw.interleave(|| {
        let c = c.clone();
        on_runtime(rt, move || {
            let c = c.clone();
            async move {
                c.rpc_async(incr, (1,)).await?;
                Ok(())
            }
        })
    })?;
    timed.push(("rref_rpc_async_method_us", xs));
    // The blocking forms, from this thread.
    let xs = raw.interleave(|| {
        on_thread(|| {
            let r = rref::remote(agent, 1u32, new_counter, (1,))?;
            anyhow::ensure!(r.to_here_blocking()?.value == 1, "wrong value");
            Ok(())
        })
    })?;
    timed.push(("remote_to_here_blocking_us", xs));
    let xs = raw.interleave(|| {
        on_thread(|| {
            anyhow::ensure!(existing.to_here_blocking()?.value == 5, "wrong value");
            Ok(())
        })
    })?;
    timed.push(("to_here_existing_blocking_us", xs));
    let before = counter.to_here_blocking()?.value;
    let xs = raw.interleave(|| {
        on_thread(|| {
            counter.rpc_sync(incr, (1,))?;
            Ok(())
        })
    })?;
    let calls = (RREF_ROUNDS * RREF_BATCH) as i64;
    anyhow::ensure!(
        counter.to_here_blocking()?.value == before + calls,
        "the counter missed increments"
    );
    timed.push(("rref_rpc_sync_method_us", xs));
    let raw = stats(raw.xs).median;
    Ok(timed
        .into_iter()
        .map(|(name, xs)| {
            let st = stats(xs);
            json!({
                "metric": name, "median": st.median, "p99": st.p99, "n": RREF_N,
                "raw_tcp_us": raw, "ratio_to_raw_tcp": st.median / raw,
            })
        })
        .collect())
}

/// `remote` alone (it returns without waiting for the owner), 3,500 times; then waits for
/// the values to be confirmed and released.
async fn remote_create(agent: &Agent) -> Result<Vec<f64>> {
    let n = RREF_WARM * RREF_BATCH + RREF_N;
    let mut keep = Vec::with_capacity(n);
    let mut xs = Vec::with_capacity(RREF_N);
    for i in 0..n {
        let t = Instant::now();
        keep.push(rref::remote(agent, 1u32, new_counter, (1,))?);
        if i >= RREF_WARM * RREF_BATCH {
            xs.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !keep.iter().all(|r| r.confirmed_by_owner()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(keep);
    let deadline = Instant::now() + Duration::from_secs(60);
    while rref::debug_info(agent).messages_in_flight > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(xs)
}
