//! Replacement of killed and frozen workers across processes: three `elastic-worker`
//! processes under the launcher with `--restart worker`. Rank 0 SIGKILLs worker 1, then
//! SIGSTOPs worker 2; the launcher restarts the killed one, and kills and restarts the frozen
//! one once the group declared it failed; each new process joins as incarnation 1 of its rank
//! while rank 0 keeps its process, calls reach the new processes, and the group ends with
//! every process exiting 0 (clean shutdowns) after exactly two restarts.

use std::time::Duration;

#[test]
fn killed_and_frozen_workers_are_replaced_while_the_others_keep_running() {
    let dir = std::env::temp_dir().join(format!("elastic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let out = dir.join("summary.json");
    let launch = rpcrun::Launch::new(env!("CARGO_BIN_EXE_elastic-worker"))
        .nproc(3)
        .max_restarts(2)
        .restart(rpcrun::Restart::Worker)
        .stop_grace(Duration::from_secs(2))
        .env("ELASTIC_OUT", out.display().to_string());
    // The launcher runs on a thread of its own; if it overruns, the test fails and the process
    // ends, and the children with it (their parent-death signal). The workers bound each of
    // their own waits too (60 s per change, 90 s of shutdown).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(launch.run());
    });
    let exit = rx
        .recv_timeout(Duration::from_secs(300))
        .expect("the launch ends within 5 minutes")
        .expect("the launch runs");
    let summary = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(exit.code, 0, "{exit:?}\n{summary}");
    assert_eq!(exit.restarts, 2, "{exit:?}");
    let failed: Vec<u32> = exit.failures.iter().map(|f| f.rank).collect();
    assert_eq!(failed, [1, 2], "{exit:?}");
    let v: serde_json::Value = serde_json::from_str(&summary).expect("a JSON summary");
    let replaced = v["replaced"].as_array().expect("replaced");
    assert_eq!(replaced.len(), 2, "{v}");
    for (r, rank) in replaced.iter().zip([1, 2]) {
        assert_eq!(r["rank"], rank, "{v}");
        assert_eq!(r["old_incarnation"], 0, "{v}");
        assert_eq!(r["failed_incarnation"], 0, "{v}");
        assert_eq!(r["joined_incarnation"], 1, "{v}");
        assert_eq!(r["serving_incarnation"], 1, "{v}");
        assert_ne!(r["old_pid"], r["new_pid"], "another process serves: {v}");
    }
    // The frozen one was declared failed for its silence (or replaced by its restart).
    let cause = replaced[1]["cause"].as_str().unwrap_or_default();
    assert!(
        cause.contains("heartbeat") || cause.contains("replaced"),
        "{cause}"
    );
    assert_eq!(v["generation"], 4, "two failures and two joins: {v}");
    assert_eq!(v["sum"], 21, "{v}");
}
