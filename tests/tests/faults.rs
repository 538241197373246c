//! Faults across processes (`fault-worker`): one worker of three is frozen (SIGSTOP) or
//! killed (SIGKILL) at a random moment while everything that can wait on it is in flight on
//! the other two: an async and a blocking call, 64 MiB blobs, all-reduces, an RRef fetch,
//! distributed backward and a parameter-server pull. Every pending operation on every
//! survivor must end with an error naming the worker, within `LIMIT` of the fault; the
//! survivors still reach each other and shut down. And a worker whose runtime computes for
//! 30 s is not declared failed.
//!
//! The detector's defaults (heartbeats every 250 ms, failure timeout 1.5 s) find a frozen
//! worker within 2 s on an idle machine; `LIMIT` is 4 s because CI runs this on two loaded
//! cores (three processes of busy loops). Each trial prints its seed and the slowest op;
//! `FAULT_TRIALS` (default 4) and `FAULT_SEED` choose more or other trials.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use integration_tests::procs::{self, Procs};

const LIMIT: Duration = Duration::from_secs(4);
/// The operations each survivor runs (rank 2 also pulls from the parameter server).
const OPS: [&str; 6] = [
    "async_call",
    "blocking_call",
    "blob_64MiB",
    "all_reduce",
    "rref_fetch",
    "backward",
];

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn start(roles: &[&str]) -> (tokio::runtime::Runtime, Procs) {
    procs::start(env!("CARGO_BIN_EXE_fault-worker"), roles, &[])
}

/// A small deterministic generator for the trials' delays (seeds are printed).
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// One trial: the fault `sig` on rank 1 after `delay`; returns the slowest op's latency.
fn trial(sig: i32, delay: Duration) -> Duration {
    let (_rt, mut p) = start(&["survivor", "victim", "survivor"]);
    for rank in 0..3 {
        p.expect(rank, "RUNNING", Duration::from_secs(60));
    }
    std::thread::sleep(delay);
    let fault_at = now_ms();
    p.signal(1, sig);
    let mut slowest = Duration::ZERO;
    for rank in [0u32, 2] {
        let count = OPS.len() + usize::from(rank == 2);
        for _ in 0..count {
            let line = p.expect(rank, "END", LIMIT + Duration::from_secs(20));
            let end: serde_json::Value = serde_json::from_str(&line).unwrap();
            let error = end["error"].as_str().unwrap();
            if end["op"] == "ps_pull" {
                // PS-3: the parameter server goes on without the departed trainer.
                assert_eq!(
                    error, "ended without an error",
                    "rank 2's trainer was held back by the failed one"
                );
            } else {
                assert!(
                    error.contains("worker1"),
                    "rank {rank}: {} ended without naming worker1: {error}",
                    end["op"]
                );
            }
            let at = end["at_ms"].as_u64().unwrap();
            assert!(
                at >= fault_at,
                "rank {rank}: {} ended {} ms before the fault: {error}",
                end["op"],
                fault_at - at
            );
            let after = Duration::from_millis(at - fault_at);
            assert!(
                after <= LIMIT,
                "rank {rank}: {} ended {after:?} after the fault: {error}",
                end["op"]
            );
            slowest = slowest.max(after);
        }
        p.expect(rank, "SURVIVORS_OK", Duration::from_secs(20));
    }
    for rank in [0u32, 2] {
        let done = p.expect(rank, "DONE", Duration::from_secs(30));
        assert!(
            done.contains("[1]"),
            "rank {rank}'s shutdown names worker1: {done}"
        );
    }
    slowest
}

#[test]
fn a_frozen_or_killed_worker_ends_every_wait_on_it_and_the_survivors_go_on() {
    let trials: usize = std::env::var("FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut seed: u64 = std::env::var("FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| now_ms() | 1);
    eprintln!("FAULT_SEED={seed} FAULT_TRIALS={trials}");
    for i in 0..trials {
        let (sig, name) = if i % 2 == 0 {
            (libc::SIGSTOP, "SIGSTOP")
        } else {
            (libc::SIGKILL, "SIGKILL")
        };
        let delay = Duration::from_millis(100 + next(&mut seed) % 1400);
        let slowest = trial(sig, delay);
        eprintln!("trial {i}: {name} after {delay:?}: every op ended within {slowest:?}");
    }
}

/// LIVE-2 across processes: a handler that computes for 30 s on a runtime thread leaves its
/// worker's detector beating.
#[test]
fn a_worker_computing_for_30_s_is_not_declared_failed() {
    let (_rt, mut p) = start(&["burner", "serve", "serve"]);
    let burned = p.expect(0, "BURNED", Duration::from_secs(90));
    let v: serde_json::Value = serde_json::from_str(&burned).unwrap();
    assert!(v["secs"].as_f64().unwrap() >= 30.0, "{v}");
    assert_eq!(v["failed_here"], serde_json::json!([]), "{v}");
    assert_eq!(v["failed_on_1"], serde_json::json!([]), "{v}");
    for rank in 0..3 {
        let done = p.expect(rank, "DONE", Duration::from_secs(30));
        assert_eq!(done, "clean=true", "rank {rank}: its shutdown report");
    }
    assert_eq!(p.wait_all(Duration::from_secs(30)), vec![Some(0); 3]);
}
