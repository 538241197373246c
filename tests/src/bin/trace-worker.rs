//! A worker of the trace tests (`tests/tests/trace.rs`), started by the launcher with
//! `Launch::trace` (so `RPC_TRACE` is set and every rank records).
//!
//! Rank 0 runs `TRACE_STEPS` steps (default 6): each a `step` span in which it calls `forward`
//! on every other rank at once, then computes for 2 ms (a `loss` span). `forward` computes for
//! 5 ms in a `forward` span, `TRACE_SLOW_MS` instead on rank `TRACE_SLOW_RANK`. With
//! `TRACE_SKEW_RANK` and `TRACE_SKEW_SECS`, that rank runs itself again under
//! `unshare --time --monotonic SECS`: its monotonic clock, the trace's clock, is that far
//! ahead of the others'. With `TRACE_FAIL_STEP`, rank 0 fails at the start of that step: it
//! exits with status 3 without shutting down, while the other ranks are still busy (they
//! wait up to 60 s before shutting down), so the launcher stops them with SIGTERM; with
//! `TRACE_FAIL_ONCE` too, only in the launcher's first start (a restart succeeds). With
//! `TRACE_KILL_RANK`, that rank kills itself with SIGKILL as it serves its third `forward` (a
//! crash or the OOM killer: it writes no part); with `TRACE_FAIL_ONCE`, only in the first start. With `TRACE_READY_FILE`, each rank creates
//! `<that path>.<rank>` once it has joined its group.

use std::time::Duration;

use integration_tests::*;
use rpc_core::trace::Cat;
use rpc_core::{remote, BoxError, CallContext, Config};

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

/// Computes (sleeps) for this rank's time inside a `forward` span.
#[remote]
async fn forward(ctx: CallContext, step: u64) -> Result<u64, BoxError> {
    let agent = ctx.agent();
    let me = u64::from(agent.rank());
    if step == 2 && env_u64("TRACE_KILL_RANK") == Some(me) && faults_now() {
        // SAFETY: raising a signal at this process has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    let ms = match env_u64("TRACE_SLOW_RANK") {
        Some(r) if r == me => env_u64("TRACE_SLOW_MS").unwrap_or(40),
        _ => 5,
    };
    let _span = agent.tracer().span(Cat::Compute, "forward");
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok(step + me)
}

/// Runs this program again in a time namespace whose monotonic clock is `secs` ahead.
fn rerun_skewed(secs: u64) -> ! {
    let me = std::env::current_exe().expect("this program's path");
    let status = std::process::Command::new("unshare")
        .args([
            "--time",
            "--monotonic",
            &secs.to_string(),
            "--fork",
            "--kill-child",
        ])
        .arg(me)
        .env("TRACE_SKEWED", "1")
        .status();
    match status {
        Ok(s) => std::process::exit(s.code().unwrap_or(1)),
        Err(e) => {
            eprintln!("unshare: {e}");
            std::process::exit(1)
        }
    }
}

/// Whether the faults asked for happen in this start: with `TRACE_FAIL_ONCE`, only in the
/// launcher's first.
fn faults_now() -> bool {
    let restarted = env_u64("RPC_RESTART_COUNT").unwrap_or(0) > 0;
    !(restarted && std::env::var_os("TRACE_FAIL_ONCE").is_some())
}

/// The step rank 0 fails at, in this start: `TRACE_FAIL_STEP` (see [`faults_now`]).
fn fail_step() -> Option<u64> {
    env_u64("TRACE_FAIL_STEP").filter(|_| faults_now())
}

fn main() {
    let rank = rpc_core::launched_rank().expect("RANK").unwrap_or(0);
    if std::env::var_os("TRACE_SKEWED").is_none() {
        if let (Some(r), Some(secs)) = (env_u64("TRACE_SKEW_RANK"), env_u64("TRACE_SKEW_SECS")) {
            if r == u64::from(rank) {
                rerun_skewed(secs);
            }
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let code = rt.block_on(async {
        let cfg = Config::new().with_shutdown_timeout(Duration::from_secs(60));
        let registry = registry_builder()
            .register(forward)
            .expect("distinct names")
            .build();
        let agent = match rpc_core::init(cfg, registry).await {
            Ok(a) => a,
            Err(e) => {
                eprintln!("init failed: {}", rpc_core::error_chain(&e));
                return 1;
            }
        };
        if let Some(f) = std::env::var_os("TRACE_READY_FILE") {
            let mut f = f;
            f.push(format!(".{}", agent.rank()));
            std::fs::write(f, "").expect("the ready file");
        }
        let mut failed = false;
        if agent.rank() == 0 {
            let tracer = agent.tracer();
            for step in 0..env_u64("TRACE_STEPS").unwrap_or(6) {
                if fail_step() == Some(step) {
                    eprintln!("step {step}: failing on purpose");
                    return 3;
                }
                let mut span = tracer.span(Cat::Step, "step");
                span.detail(|| format!("step {step}"));
                let calls =
                    (1..agent.world_size() as u32).map(|r| agent.rpc_async(r, forward, (step,)));
                if let Err(e) = rpc_core::wait_all(calls).await {
                    eprintln!("step {step}: {}", rpc_core::error_chain(&e));
                    failed = true;
                    break;
                }
                let _loss = tracer.span(Cat::Compute, "loss");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        } else if fail_step().is_some() {
            // Busy until rank 0's launcher stops this process.
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        let report = agent.shutdown().await;
        i32::from(failed || !report.is_clean())
    });
    // As a program's `main` ends: its runtime, and with it the worker, are gone before exit.
    drop(rt);
    std::process::exit(code);
}
