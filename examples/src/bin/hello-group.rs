//! A master and two workers on loopback, exercising the RPC API end to end.
//!
//! `cargo run --release -p examples --bin hello-group` launches everything: it generates a
//! group secret, spawns ranks 1 and 2 as child processes (torchrun-style variables), and runs
//! rank 0 (the master) itself. With `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and
//! `RPC_SECRET` already set, the binary instead joins that external group as one worker, so the
//! same program runs across machines (`rpcrun --nproc N`, any N from 2: rank 0 calls the
//! others).

use std::time::{Duration, Instant};

use anyhow::Result;
use rpc_core::{remote, Agent, Blob, BoxError, CallContext, Config, Registry, RpcError};

/// Counts the vowels of a text on whichever worker is called.
#[remote]
async fn vowels(ctx: CallContext, text: String) -> Result<(String, usize), BoxError> {
    let n = text.chars().filter(|c| "aeiouAEIOU".contains(*c)).count();
    Ok((ctx.agent().name().to_owned(), n))
}

/// Sums a byte buffer (sent on the bulk path when large).
#[remote]
async fn checksum(_ctx: CallContext, data: Blob) -> Result<u64, BoxError> {
    Ok(data.iter().map(|&b| u64::from(b)).sum())
}

/// Asks the next worker (by rank, wrapping) for its name: a nested call.
#[remote]
async fn relay(ctx: CallContext, hops: u32) -> Result<Vec<String>, BoxError> {
    let me = ctx.agent().name().to_owned();
    if hops == 0 {
        return Ok(vec![me]);
    }
    let next = (ctx.agent().rank() + 1) % ctx.agent().world_size() as u32;
    let mut path = ctx.agent().rpc_async(next, relay, (hops - 1,)).await?;
    path.insert(0, me);
    Ok(path)
}

/// Refuses odd numbers.
#[remote]
async fn only_even(_ctx: CallContext, n: i64) -> Result<i64, BoxError> {
    if n % 2 != 0 {
        return Err(format!("{n} is odd").into());
    }
    Ok(n / 2)
}

/// Sleeps for `ms` milliseconds.
#[remote]
async fn nap(_ctx: CallContext, ms: u64) -> Result<(), BoxError> {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(())
}

fn registry() -> Result<Registry> {
    Ok(Registry::builder()
        .register(vowels)?
        .register(checksum)?
        .register(relay)?
        .register(only_even)?
        .register(nap)?
        .build())
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    if examples::is_worker() {
        // Part of an external (or launched) group: configuration comes from the environment.
        return rt.block_on(async {
            let agent = rpc_core::init(Config::new(), registry()?).await?;
            if agent.rank() == 0 {
                master(&agent).await?;
            }
            let report = agent.shutdown().await;
            anyhow::ensure!(
                report.is_clean(),
                "{} shut down uncleanly: {report:?}",
                agent.name()
            );
            Ok(())
        });
    }
    if let Some(a) = std::env::args().nth(1) {
        if a == "-h" || a == "--help" {
            println!(
                "hello-group: a tour of the RPC API: this process and two workers it starts on \
                 127.0.0.1 call functions on each other (concurrent calls, an 8 MiB blob on the \
                 bulk path, nested calls around the ring, errors, a timeout), then shut down.\n\n\
                 usage: hello-group (no arguments; with RANK, WORLD_SIZE, MASTER_ADDR, \
                 MASTER_PORT and RPC_SECRET set it joins that group instead)"
            );
            return Ok(());
        }
        anyhow::bail!("hello-group takes no arguments, not {a:?}");
    }
    let workers = examples::Workers::spawn(3)?;
    rt.block_on(async {
        let cfg = workers.rank0_config("master", Duration::from_secs(60));
        let agent = rpc_core::init(cfg, registry()?).await?;
        master(&agent).await?;
        let report = agent.shutdown().await;
        println!(
            "shutdown: barrier {:?}, {} calls aborted, {:?}",
            report.barrier, report.aborted, report.elapsed
        );
        anyhow::ensure!(report.is_clean(), "unclean shutdown: {report:?}");
        Ok::<_, anyhow::Error>(())
    })?;
    workers.wait_success(Duration::from_secs(60))?;
    println!("all 3 processes exited cleanly");
    Ok(())
}

async fn master(agent: &Agent) -> Result<()> {
    // Under a launcher the group has any size; rank 0 calls the others.
    let others = agent.world_size() as u32 - 1;
    anyhow::ensure!(
        others > 0,
        "hello-group needs 2 processes or more (rank 0 calls the others), not 1"
    );
    println!(
        "group formed: {:?}",
        agent
            .worker_infos()
            .iter()
            .map(|w| &w.name)
            .collect::<Vec<_>>()
    );
    // By name, by rank, concurrently.
    let texts = [
        "distributed autograd",
        "remote reference",
        "parameter server",
        "ring all-reduce",
    ];
    let t = Instant::now();
    let calls = texts
        .iter()
        .enumerate()
        .map(|(i, s)| agent.rpc_async(1 + i as u32 % others, vowels, (s.to_string(),)));
    for (text, (worker, n)) in texts.iter().zip(rpc_core::wait_all(calls).await?) {
        println!("  {worker:>8}: {n:2} vowels in {text:?}");
    }
    println!(
        "4 concurrent calls in {:.2} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    // A blob large enough for the bulk path.
    let data = Blob::from((0..8u32 << 20).map(|i| (i % 7) as u8).collect::<Vec<_>>());
    let t = Instant::now();
    let sum = agent.rpc_async(others, checksum, (data.clone(),)).await?;
    println!(
        "checksum of 8 MiB on worker2: {sum} (expected {}) in {:.1} ms",
        data.iter().map(|&b| u64::from(b)).sum::<u64>(),
        t.elapsed().as_secs_f64() * 1e3
    );
    // Nested calls around the ring.
    let path = agent.rpc_async(1u32, relay, (7,)).await?;
    println!("relay path: {}", path.join(" -> "));
    // Errors name the worker, the function and the cause.
    match agent.rpc_async(1u32, only_even, (7,)).await {
        Err(e) => println!("expected error: {}", rpc_core::error_chain(&e)),
        Ok(v) => anyhow::bail!("7 is odd, yet got {v}"),
    }
    match agent
        .rpc_async_timeout(others, nap, (2_000,), Duration::from_millis(100))
        .await
    {
        Err(e @ RpcError::DeadlineExceeded { .. }) => println!("expected timeout: {e}"),
        other => anyhow::bail!("expected a timeout, got {other:?}"),
    }
    Ok(())
}
