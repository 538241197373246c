//! `rpc-bench soak [--calls N]`: a long run of mixed calls among three processes (this one
//! and two it starts), watching memory. Driven from rank 0 by [`CONCURRENCY`] tasks, each
//! operation one of: a small echo (inline), a small echo relayed by one peer to the other, a
//! 256 KiB echo (the bulk path), an RRef created on a peer, fetched and dropped, or an RRef
//! created on one peer and used from the other (a fork: the second peer calls a method on the
//! owner), then dropped. Calls are counted as the RPCs each operation makes (relay 2, create
//! and fetch 2, fork 3; protocol messages not counted).
//!
//! Every [`SAMPLE_EVERY`] calls it samples every process's resident and peak resident set
//! size (`soak_rss` lines). At the end: the slope of each process's peak RSS over the calls
//! after the warm-up (the first tenth), least squares, in MB per 100k calls
//! (`soak_rss_slope`, target < 1; none under three samples after the warm-up, about 30,000
//! calls, and then `soak_summary`'s slope fields are null), then every process's `rref::debug_info`, which must all
//! reach zero within [`SETTLE`] (`soak_rref_end`), and `soak_summary`. Exits non-zero if an
//! operation fails or the references do not settle; the slope is reported, not enforced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rpc_core::{remote, Agent, Blob, BoxError, CallContext, RegistryBuilder, RemoteFn};
use serde_json::json;

use crate::{emit, new_counter, Counter};

/// Operations in flight at once from rank 0.
const CONCURRENCY: usize = 8;
/// Calls between memory samples.
pub(crate) const SAMPLE_EVERY: u64 = 10_000;
/// How long the references may take to be released everywhere after the last operation.
const SETTLE: Duration = Duration::from_secs(20);
/// The small payload (rides inline in the request).
const SMALL: usize = 256;
/// The large payload (goes on the bulk path).
const LARGE: usize = 256 << 10;

/// Echoes `data` through worker `to` (a call between the two peers).
#[remote]
async fn relay_echo(ctx: CallContext, to: u32, data: Blob) -> Result<Blob, BoxError> {
    Ok(ctx.agent().rpc_async(to, crate::echo, (data,)).await?)
}

/// Calls the counter's `incr` on its owner through a reference this worker was given.
#[remote]
async fn use_counter(_ctx: CallContext, c: rref::RRef<Counter>) -> Result<i64, BoxError> {
    Ok(c.rpc_async(crate::incr, (1,)).await?)
}

/// This process's RSS and peak RSS, in MB.
#[remote]
async fn rss(_ctx: CallContext) -> Result<(f64, f64), BoxError> {
    Ok(rss_here())
}

/// This process's `rref::debug_info`: owned values, user references, pending children,
/// pending confirmations, messages in flight.
#[remote]
async fn rref_info(ctx: CallContext) -> Result<[usize; 5], BoxError> {
    Ok(info(ctx.agent()))
}

fn info(agent: &Agent) -> [usize; 5] {
    let d = rref::debug_info(agent);
    [
        d.owner_values,
        d.user_refs,
        d.pending_children,
        d.pending_confirmations,
        d.messages_in_flight,
    ]
}

/// Set on the soak's peers when rank 0 is done with them.
static FINISHED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Tells a soak peer that rank 0 is done (it then shuts down with the group).
#[remote]
async fn finish(_ctx: CallContext) -> Result<(), BoxError> {
    FINISHED.notify_one();
    Ok(())
}

/// The longest a soak peer serves.
const PEER_LIMIT: Duration = Duration::from_secs(4 * 3600);

/// A soak peer: serves until rank 0 says it is done (or fails, or [`PEER_LIMIT`] passes),
/// then shuts down with the group. (Shutting down at once would leave it waiting at the
/// shutdown barrier, which gives up after `shutdown_timeout` and refuses calls from then on.)
pub(crate) async fn serve(agent: &Agent) {
    let mut failures = agent.watch_failures();
    let rank0_failed = async {
        while let Some(f) = failures.next().await {
            if f.rank == 0 {
                return;
            }
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        () = FINISHED.notified() => {}
        () = rank0_failed => {}
        () = tokio::time::sleep(PEER_LIMIT) => {}
    }
}

/// Registers the soak's remote functions.
pub(crate) fn register(b: RegistryBuilder) -> Result<RegistryBuilder, rpc_core::RegistryError> {
    b.register(relay_echo)?
        .register(use_counter)?
        .register(rss)?
        .register(rref_info)?
        .register(finish)
}

fn rss_here() -> (f64, f64) {
    let [now, peak] = crate::status_mb(["VmRSS", "VmHWM"]);
    (now, peak)
}

/// `f` called on both peers (ranks 1 and 2) at once.
async fn on_peers<F: RemoteFn<Args = ()> + Copy>(
    agent: &Agent,
    f: F,
) -> Result<(F::Output, F::Output)> {
    Ok(futures::try_join!(
        agent.rpc_async(1u32, f, ()),
        agent.rpc_async(2u32, f, ())
    )?)
}

/// One operation, `i`-th of the run; how many calls it made.
async fn op(agent: &Agent, i: u64, small: &Blob, large: &Blob) -> Result<u64> {
    let p = 1 + (i % 2) as u32;
    let q = 3 - p;
    let kind = i % 10;
    let calls = match kind {
        0..=4 => {
            let back = agent.rpc_async(p, crate::echo, (small.clone(),)).await?;
            anyhow::ensure!(back.bytes().len() == SMALL, "echo lost bytes");
            1
        }
        5 => {
            let back = agent.rpc_async(p, relay_echo, (q, small.clone())).await?;
            anyhow::ensure!(back.bytes().len() == SMALL, "relay lost bytes");
            2
        }
        6 => {
            let back = agent.rpc_async(p, crate::echo, (large.clone(),)).await?;
            anyhow::ensure!(back.bytes().len() == LARGE, "bulk echo lost bytes");
            1
        }
        7 | 8 => {
            let r = rref::remote(agent, p, new_counter, (i as i64,))?;
            if kind == 7 {
                let c = r.to_here().await?;
                anyhow::ensure!(c.value == i as i64, "fetched the wrong counter");
                2
            } else {
                let v = agent.rpc_async(q, use_counter, (r,)).await?;
                anyhow::ensure!(v == i as i64 + 1, "the fork reached the wrong counter");
                3
            }
        }
        _ => {
            agent.rpc_async(q, crate::noop, ()).await?;
            1
        }
    };
    Ok(calls)
}

/// One memory sample: calls so far, then (RSS, peak RSS) of ranks 0, 1, 2.
type Sample = (u64, [(f64, f64); 3]);

async fn sample(agent: &Agent, calls: u64) -> Result<Sample> {
    let (a, b) = on_peers(agent, rss).await?;
    Ok((calls, [rss_here(), a, b]))
}

/// Least-squares slope of `ys` over `xs`.
fn slope(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let cov: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let var: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    cov / var
}

/// Runs the soak on rank 0 of a group of three.
pub(crate) async fn drive(agent: Agent, calls: u64) -> Result<()> {
    let start = Instant::now();
    let counted = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(Mutex::new(vec![sample(&agent, 0).await?]));
    let small = Blob::from(vec![1u8; SMALL]);
    let large = Blob::from(vec![2u8; LARGE]);
    let timing: Arc<[AtomicU64; 10]> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let timing = Arc::clone(&timing);
        let (agent, counted, next, samples) = (
            agent.clone(),
            Arc::clone(&counted),
            Arc::clone(&next),
            Arc::clone(&samples),
        );
        let (small, large) = (small.clone(), large.clone());
        tasks.spawn(async move {
            while counted.load(Ordering::Relaxed) < calls {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                let n = op(&agent, i, &small, &large)
                    .await
                    .with_context(|| format!("operation {i} (kind {})", i % 10))?;
                timing[(i % 10) as usize]
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let before = counted.fetch_add(n, Ordering::Relaxed);
                if (before + n) / SAMPLE_EVERY > before / SAMPLE_EVERY {
                    let s = sample(&agent, before + n).await?;
                    emit(json!({
                        "metric": "soak_rss", "calls": s.0,
                        "rss_mb": s.1.map(|r| r.0), "peak_rss_mb": s.1.map(|r| r.1),
                        "processes": ["bench", "soak1", "soak2"],
                    }));
                    samples.lock().expect("not poisoned").push(s);
                }
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("a soak task panicked")??;
    }
    let secs = start.elapsed().as_secs_f64();
    let ops = next.load(Ordering::Relaxed);
    // Mean time of each kind of operation (ops are spread evenly over the ten kinds).
    let mean_us = |k: std::ops::RangeInclusive<usize>| {
        let n = k.clone().count() as f64 * ops as f64 / 10.0;
        k.map(|i| timing[i].load(Ordering::Relaxed)).sum::<u64>() as f64 / 1e3 / n
    };
    emit(json!({
        "metric": "soak_op_mean_us", "echo_inline": mean_us(0..=4), "relay": mean_us(5..=5),
        "echo_bulk_256KiB": mean_us(6..=6), "rref_fetch": mean_us(7..=7),
        "rref_fork": mean_us(8..=8), "noop": mean_us(9..=9), "concurrency": CONCURRENCY,
    }));
    let total = counted.load(Ordering::Relaxed);
    let mut samples = std::mem::take(&mut *samples.lock().expect("not poisoned"));
    samples.sort_by_key(|s| s.0);
    let after: Vec<&Sample> = samples.iter().filter(|s| s.0 * 10 >= calls).collect();
    let mut worst: f64 = 0.0;
    let sloped = after.len() >= 3;
    if sloped {
        let xs: Vec<f64> = after.iter().map(|s| s.0 as f64 / 1e5).collect();
        for (i, name) in ["bench", "soak1", "soak2"].iter().enumerate() {
            let peak: Vec<f64> = after.iter().map(|s| s.1[i].1).collect();
            let now: Vec<f64> = after.iter().map(|s| s.1[i].0).collect();
            let (sp, sn) = (slope(&xs, &peak), slope(&xs, &now));
            worst = worst.max(sp);
            emit(json!({
                "metric": "soak_rss_slope", "process": name,
                "peak_rss_mb_per_100k_calls": sp, "rss_mb_per_100k_calls": sn,
                "peak_rss_mb_first": peak[0], "peak_rss_mb_last": peak[peak.len() - 1],
                "samples": after.len(), "warmup_calls": calls / 10, "target": 1.0,
            }));
        }
    }
    // The references are released by messages that may still be on their way.
    let until = Instant::now() + SETTLE;
    let infos = loop {
        let (a, b) = on_peers(&agent, rref_info).await?;
        let infos = [info(&agent), a, b];
        if infos.iter().all(|i| i.iter().all(|&n| n == 0)) || Instant::now() >= until {
            break infos;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let settled = infos.iter().all(|i| i.iter().all(|&n| n == 0));
    emit(json!({
        "metric": "soak_rref_end",
        "fields": [
            "owner_values",
            "user_refs",
            "pending_children",
            "pending_confirmations",
            "messages_in_flight",
        ],
        "bench": infos[0],
        "soak1": infos[1],
        "soak2": infos[2],
        "all_zero": settled,
    }));
    emit(json!({
        "metric": "soak_summary", "calls": total, "operations": ops,
        "seconds": secs, "calls_per_s": total as f64 / secs,
        // Null, not a pass, when too few samples followed the warm-up to fit a slope.
        "worst_peak_rss_slope_mb_per_100k": sloped.then_some(worst),
        "slope_below_target": sloped.then_some(worst < 1.0), "slope_samples": after.len(),
    }));
    on_peers(&agent, finish).await?;
    if !settled {
        bail!("references still held {SETTLE:?} after the soak: {infos:?}");
    }
    Ok(())
}
