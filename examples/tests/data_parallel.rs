//! `data-parallel` as its docs say to run it: launched by itself and under `rpcrun --nproc 2`,
//! two replicas train, rank 0 reports, every process exits 0.

use std::time::Duration;

mod common;
use common::{last_json, run_to_end};

const QUICK: [&str; 8] = [
    "--epochs",
    "1",
    "--train-limit",
    "640",
    "--test-limit",
    "200",
    "--log-every",
    "5",
];

fn check(code: Option<i32>, out: &str, err: &str) {
    assert_eq!(code, Some(0), "{out}\n{err}");
    let j = last_json(out, err);
    assert_eq!(j["replicas"], 2, "{j}");
    assert_eq!(j["steps"], 10, "640 words, 2 replicas, 32 a step: {j}");
    assert_eq!(j["parameters"], 4_724_232, "{j}");
    assert!(out.contains("epoch 0 step 5: loss"), "rank 0 logs: {out}");
}

#[test]
fn two_replicas_train_launched_by_themselves_and_by_rpcrun() {
    let bin = env!("CARGO_BIN_EXE_data-parallel");
    let (code, out, err) = run_to_end(
        bin,
        &[&["--nproc", "2"], &QUICK[..]].concat(),
        Duration::from_secs(300),
    );
    check(code, &out, &err);
    // The launcher's binary sits beside this package's binaries once the workspace is built
    // (`cargo test --workspace` builds it for rpcrun's own tests).
    let rpcrun = std::path::Path::new(bin).with_file_name("rpcrun");
    assert!(
        rpcrun.exists(),
        "{} is missing: build it first (cargo build -p rpcrun), or run the workspace's tests",
        rpcrun.display()
    );
    let args: Vec<&str> = [&["--nproc", "2", "--", bin], &QUICK[..]].concat();
    let (code, out, err) = run_to_end(rpcrun.to_str().unwrap(), &args, Duration::from_secs(300));
    assert!(
        out.contains("[rank0]: epoch 0 step 5"),
        "rpcrun prefixes lines: {out}"
    );
    let unprefixed: Vec<&str> = out
        .lines()
        .map(|l| l.strip_prefix("[rank0]: ").unwrap_or(l))
        .collect();
    check(code, &unprefixed.join("\n"), &err);
}

/// Arguments that would train on nothing are refused with the reason, before or as the
/// replicas start, and no restart is spent on them. Before, each replica panicked (a zero
/// chunk size, a remainder by zero, the median of no steps) and the launcher reported
/// "rank 0 exited with status 101".
#[test]
fn arguments_that_train_nothing_are_refused_with_the_reason() {
    let bin = env!("CARGO_BIN_EXE_data-parallel");
    for (args, code, says) in [
        (
            &["--batch", "0"][..],
            2,
            "--batch <BATCH>': must be at least 1",
        ),
        (
            &["--epochs", "0"],
            2,
            "--epochs <EPOCHS>': must be at least 1",
        ),
        (
            &["--log-every", "0"],
            2,
            "--log-every <LOG_EVERY>': must be at least 1",
        ),
        (
            &["--train-limit", "0"],
            2,
            "--train-limit <TRAIN_LIMIT>': must be at least 1",
        ),
        (
            &["--lr", "0"],
            rpcrun::FATAL_EXIT_CODE,
            "--lr must be a positive number",
        ),
        (
            &["--nproc", "2", "--train-limit", "10", "--epochs", "1"],
            rpcrun::FATAL_EXIT_CODE,
            "gets 5 of the 10 training words, less than one batch of 32",
        ),
    ] {
        let (got, out, err) = run_to_end(bin, args, Duration::from_secs(120));
        assert_eq!(got, Some(code), "{args:?}: {out}\n{err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
