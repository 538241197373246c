//! `param-server` as a user runs it with failures: a server process SIGKILLed mid-run (its
//! shard fails over to the backup, no acknowledged update is lost) and a trainer SIGKILLed
//! (a replacement process joins at the others' step and finishes), under BSP.

use std::time::Duration;

mod common;
use common::{last_json, run_to_end};

#[test]
fn a_killed_server_loses_no_update_and_a_replacement_trainer_finishes() {
    let args = [
        "--steps",
        "80",
        "--kill-server-at",
        "25",
        "--kill-trainer-at",
        "50",
    ];
    let (code, out, err) = run_to_end(
        env!("CARGO_BIN_EXE_param-server"),
        &args,
        Duration::from_secs(240),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    let j = last_json(&out, &err);
    assert_eq!(j["mode"], "BSP", "{j}");
    assert_eq!(j["updates_lost"], 0, "{j}");
    assert_eq!(j["failed_over"], true, "{j}");
    // The two trainers that ran throughout had all their pushes acknowledged (2 shards).
    assert_eq!(
        j["acked_pushes"],
        serde_json::json!([160, 160, null]),
        "{j}"
    );
    // Both shards applied the same pushes: all 80 steps of the two trainers that ran
    // throughout; of trainer index 2, the killed holder's (at least its first 50 steps) and
    // the replacement's (from the step it joined at; the steps the others took while the
    // index was vacant are not made up).
    let rejoined = j["trainer_rejoined_at"]
        .as_u64()
        .expect("a replacement joined");
    assert!((50..80).contains(&rejoined), "{j}");
    let applied = &j["applied_updates"];
    assert_eq!(applied[0], applied[1], "{j}");
    assert_eq!(
        (applied[0][0].as_u64(), applied[0][1].as_u64()),
        (Some(80), Some(80)),
        "{j}"
    );
    let third = applied[0][2].as_u64().unwrap();
    assert!((50 + 80 - rejoined..=80).contains(&third), "{j}");
    let (hurt, base) = (
        j["test_accuracy"].as_f64().unwrap(),
        j["baseline_accuracy"].as_f64().unwrap(),
    );
    assert!((hurt - base).abs() < 0.03, "{j}");
    assert!(err.contains("failing over to the shard's backup"), "{err}");
}
