//! `rref-stress` as a user runs it: the seeded random program over remote references, and the
//! same with a worker killed mid-run. Either way every value the live workers own is deleted
//! once nothing live refers to it, and nothing is left.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `rref-stress` with `args` (killed after 240 s); its exit code and last stdout line.
fn run(args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!(
        "rref-stress-test-{}-{}",
        std::process::id(),
        args.join("_").replace('-', "")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (so, se) = (dir.join("out"), dir.join("err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_rref-stress"))
        .args(args)
        .env_remove("RANK")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&so).unwrap())
        .stderr(std::fs::File::create(&se).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rref-stress {args:?} did not finish within 240 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&so).unwrap();
    let err = std::fs::read_to_string(&se).unwrap();
    let last = out.lines().last().unwrap_or_default();
    let j = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    let _ = std::fs::remove_dir_all(&dir);
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
