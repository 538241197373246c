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
