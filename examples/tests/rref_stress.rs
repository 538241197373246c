//! `rref-stress` as a user runs it: the seeded random program over remote references, and the
//! same with a worker killed mid-run. Either way every value the live workers own is deleted
//! once nothing live refers to it, and nothing is left.

use std::time::Duration;

mod common;
use common::{last_json, run_to_end};

/// Runs `rref-stress` with `args` (killed after 240 s); its exit code, last stdout line and
/// stderr.
fn run(args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let (code, out, err) = run_to_end(
        env!("CARGO_BIN_EXE_rref-stress"),
        args,
        Duration::from_secs(240),
    );
    let j = last_json(&out, &err);
    (code, j, err)
}

fn assert_nothing_left(j: &serde_json::Value) {
    for k in [
        "owner_values_left",
        "user_refs_left",
        "pending_left",
        "use_after_delete",
        "wrong_values",
    ] {
        assert_eq!(j[k], 0, "{k}: {j}");
    }
    assert_eq!(j["values_created"], j["values_deleted"], "{j}");
    assert!(j["values_created"].as_u64().unwrap() > 100, "{j}");
}

#[test]
fn the_random_program_leaves_nothing() {
    let (code, j, err) = run(&["--workers", "3", "--ops", "1500", "--seed", "11"]);
    assert_eq!(code, Some(0), "{err}");
    assert_nothing_left(&j);
    assert_eq!(j["killed"], serde_json::Value::Null);
}

/// A user killed mid-run: the owners release what it held (`owner_values_left` 0 on the
/// survivors) and the program goes on among them.
#[test]
fn a_worker_killed_mid_run_leaves_nothing_on_the_survivors() {
    let (code, j, err) = run(&[
        "--workers",
        "4",
        "--ops",
        "2000",
        "--seed",
        "5",
        "--kill-rank",
        "2",
        "--kill-at",
        "700",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_nothing_left(&j);
    assert_eq!(j["killed"], 2, "{j}");
    assert!(j["lost_handles"].as_u64().unwrap() > 0, "{j}");
}
