//! A worker of the replacement test (`tests/tests/replacement.rs`), started by the launcher
//! with `--restart worker` (the variables `rpc_core::Config` reads: `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, the secret's file, `RPC_RESTART_COUNT`).
//!
//! Rank 0 drives: it kills worker 1 (SIGKILL), then freezes worker 2 (SIGSTOP), and after each
//! waits until the group declared the victim failed and a new incarnation joined in its place
//! (the launcher restarts the killed process, and kills and restarts the frozen one), checks
//! that calls reach the new incarnation (another process), and writes a JSON summary to the
//! file named by `ELASTIC_OUT`. Every other rank (each incarnation) serves until the group
//! shuts down. Every process exits 0 only if its shutdown was clean.

use std::time::Duration;

use integration_tests::*;
use rpc_core::{remote, Agent, BoxError, CallContext, Config, MembershipChange};

/// The process id of the worker that serves the call.
#[remote]
async fn pid_here(_ctx: CallContext) -> Result<u32, BoxError> {
    Ok(std::process::id())
}

async fn wait_for(
    watch: &mut rpc_core::MembershipWatch,
    rank: u32,
    want: fn(&MembershipChange) -> bool,
) -> anyhow::Result<rpc_core::MembershipEvent> {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let e = watch
                .next()
                .await
                .ok_or_else(|| anyhow::anyhow!("the membership watch ended"))?;
            if e.rank == rank && want(&e.change) {
                return Ok(e);
            }
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("no such change of rank {rank} within 60 s"))?
}

async fn drive(agent: &Agent) -> anyhow::Result<serde_json::Value> {
    let mut watch = agent.watch_membership();
    let mut replaced = Vec::new();
    for (victim, signal) in [(1u32, libc::SIGKILL), (2u32, libc::SIGSTOP)] {
        let old_pid = agent.rpc_async(victim, pid_here, ()).await?;
        let old_inc = agent.incarnation_of(victim)?;
        let at = std::time::Instant::now();
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(old_pid as libc::pid_t, signal) };
        let failed = wait_for(&mut watch, victim, |c| {
            matches!(c, MembershipChange::Failed { .. })
        })
        .await?;
        let failed_after = at.elapsed();
        let joined = wait_for(&mut watch, victim, |c| {
            matches!(c, MembershipChange::Joined { .. })
        })
        .await?;
        let joined_after = at.elapsed();
        let new_inc = agent.rpc_async(victim, incarnation_here, ()).await?;
        let new_pid = agent.rpc_async(victim, pid_here, ()).await?;
        replaced.push(serde_json::json!({
            "rank": victim,
            "signal": signal,
            "old_pid": old_pid,
            "new_pid": new_pid,
            "old_incarnation": old_inc,
            "failed_incarnation": failed.incarnation,
            "joined_incarnation": joined.incarnation,
            "serving_incarnation": new_inc,
            "failed_after_ms": failed_after.as_millis() as u64,
            "joined_after_ms": joined_after.as_millis() as u64,
            "cause": match failed.change {
                MembershipChange::Failed { cause } => cause,
                _ => String::new(),
            },
        }));
    }
    // The survivor and the replacements reach each other too.
    let two_to_one: i32 = agent.rpc_async(2u32, add, (20, 1)).await?;
    Ok(serde_json::json!({
        "replaced": replaced,
        "generation": agent.generation(),
        "sum": two_to_one,
    }))
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let code = rt.block_on(async {
        let cfg = Config::new()
            .with_heartbeat_interval(Duration::from_millis(100))
            .with_failure_timeout(Duration::from_millis(1000))
            .with_shutdown_timeout(Duration::from_secs(90));
        let registry = registry_builder()
            .register(pid_here)
            .expect("distinct names")
            .build();
        let agent = match rpc_core::init(cfg, registry).await {
            Ok(a) => a,
            Err(e) => {
                eprintln!("init failed: {}", rpc_core::error_chain(&e));
                return 1;
            }
        };
        println!(
            "rank {} incarnation {} pid {} up",
            agent.rank(),
            agent.incarnation(),
            std::process::id()
        );
        if agent.rank() == 0 {
            let summary = drive(&agent).await;
            let out = std::env::var("ELASTIC_OUT").unwrap_or_default();
            let text = match &summary {
                Ok(v) => v.to_string(),
                Err(e) => serde_json::json!({ "error": format!("{e:#}") }).to_string(),
            };
            if !out.is_empty() {
                let _ = std::fs::write(&out, &text);
            }
            println!("{text}");
            let report = agent.shutdown().await;
            i32::from(summary.is_err() || !report.is_clean())
        } else {
            let report = agent.shutdown().await;
            i32::from(!report.is_clean())
        }
    });
    std::process::exit(code);
}
