//! The soak, short: mixed calls among three processes end with every remote reference
//! released on every process, and every process exits cleanly. (The full run, a million
//! calls, is `rpc-bench soak`; its memory slope is a benchmark figure, not asserted here.)

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the soak (and through it, its peers: they end when their group does) if the test
/// fails first.
struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_short_soak_releases_every_reference_and_exits_cleanly() {
    let mut child = Kill(
        Command::new(env!("CARGO_BIN_EXE_rpc-bench"))
            .args(["soak", "--calls", "20000"])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("starts rpc-bench"),
    );
    let out = child.0.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut lines = Vec::new();
    while let Ok(l) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        lines.push(serde_json::from_str::<serde_json::Value>(&l).expect("JSON lines"));
    }
    let status = loop {
        if let Some(s) = child.0.try_wait().expect("waits") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the soak did not end; got {lines:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let find = |m: &str| {
        lines
            .iter()
            .find(|v| v["metric"] == m)
            .unwrap_or_else(|| panic!("no {m} line in {lines:?}"))
            .clone()
    };
    let end = find("soak_rref_end");
    assert_eq!(end["all_zero"], true, "{end}");
    for p in ["bench", "soak1", "soak2"] {
        assert_eq!(end[p], serde_json::json!([0, 0, 0, 0, 0]), "{end}");
    }
    let summary = find("soak_summary");
    assert!(
        summary["calls"].as_u64().expect("calls") >= 20_000,
        "{summary}"
    );
    let samples = lines.iter().filter(|v| v["metric"] == "soak_rss").count();
    assert!(samples >= 2, "{samples} memory samples");
    // Too few samples after the warm-up for a slope: the summary says so, it does not pass.
    assert!(summary["slope_below_target"].is_null(), "{summary}");
    assert!(status.success(), "rpc-bench soak exited with {status}");
}
