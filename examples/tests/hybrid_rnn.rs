//! The hybrid RNN example as a user runs it: three processes on 127.0.0.1, small settings.
//!
//! Each test starts the binary (which starts its two workers), bounds it with a deadline and
//! kills it if the deadline passes; the binary kills and reaps its workers on every exit path.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A small model: every run takes seconds even in a debug build.
const SMALL_MODEL: &[&str] = &["--embedding", "8", "--hidden", "16", "--head-hidden", "16"];

/// The small model on a small dataset.
const SMALL: &[&str] = &[
    "--train-limit",
    "640",
    "--test-limit",
    "200",
    "--local-steps",
    "3",
    "--quiet",
];

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> serde_json::Value {
        let last = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(last).unwrap_or_else(|e| {
            panic!(
                "last line is not JSON ({e}): {last:?}\nstderr:\n{}",
                self.stderr
            )
        })
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hybrid-rnn-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the example with `args` and `env` (where `RANK` is unset unless `env` sets it), killed
/// after `limit`.
fn run(args: &[&str], env: &[(&str, &str)], out: &Path, limit: Duration) -> Run {
    let (so, se) = (out.join("stdout"), out.join("stderr"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hybrid-rnn"));
    cmd.args(args)
        .env_remove("RANK")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&so).unwrap())
        .stderr(std::fs::File::create(&se).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + limit;
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "hybrid-rnn {args:?} did not finish within {limit:?}\nstderr:\n{}",
                std::fs::read_to_string(&se).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Run {
        code,
        stdout: std::fs::read_to_string(so).unwrap(),
        stderr: std::fs::read_to_string(se).unwrap(),
    }
}

fn with(extra: &[&str]) -> Vec<String> {
    SMALL_MODEL
        .iter()
        .chain(SMALL)
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn trains_end_to_end_and_reports() {
    let dir = scratch("e2e");
    let out = dir.join("out");
    let args = with(&["--epochs", "2", "--out-dir", out.to_str().unwrap()]);
    let r = run(&strs(&args), &[], &dir, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "stderr:\n{}", r.stderr);
    let j = r.json();
    for key in [
        "test_accuracy",
        "epochs",
        "steps",
        "ms_per_step_median",
        "local_ms_per_step_median",
    ] {
        assert!(!j[key].is_null(), "{key} missing in {j}");
    }
    assert_eq!(j["epochs"], 2);
    assert_eq!(j["steps"], 20, "640 words in batches of 64, two epochs");
    let acc = j["test_accuracy"].as_f64().unwrap();
    assert!(acc > 1.0 / 8.0, "no better than chance: {acc}");
    assert!(j["max_loss_diff"].as_f64().unwrap() <= 1e-4, "{j}");
    assert_eq!(
        j["replica_max_diff"], 0.0,
        "the head replicas drifted apart: {j}"
    );
    assert!(r.stdout.contains("confusion matrix"), "{}", r.stdout);
    assert!(r.stdout.contains("epoch 2/2"), "{}", r.stdout);
    let png = std::fs::read(out.join("training.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    for e in 1..=2 {
        assert!(out.join(format!("epoch-{e}.safetensors")).exists());
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn check_equivalence_passes() {
    let dir = scratch("equiv");
    let args = with(&[
        "--check-equivalence",
        "--out-dir",
        dir.join("out").to_str().unwrap(),
    ]);
    let r = run(&strs(&args), &[], &dir, Duration::from_secs(300));
    assert_eq!(
        r.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        r.stdout,
        r.stderr
    );
    let j = r.json();
    assert_eq!(j["ok"], true, "{j}");
    assert_eq!(j["steps"], 20, "{j}");
    assert!(j["max_loss_diff"].as_f64().unwrap() <= 1e-4, "{j}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Two epochs in one go and one epoch + `--resume` for the second end with the same
/// parameters, optimizer state and accuracy, bit for bit.
#[test]
fn resume_matches_an_uninterrupted_run() {
    let dir = scratch("resume");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let limit = Duration::from_secs(300);
    let full = run(
        &strs(&with(&["--epochs", "2", "--out-dir", a.to_str().unwrap()])),
        &[],
        &dir,
        limit,
    );
    assert_eq!(full.code, Some(0), "stderr:\n{}", full.stderr);
    let first = run(
        &strs(&with(&["--epochs", "1", "--out-dir", b.to_str().unwrap()])),
        &[],
        &dir,
        limit,
    );
    assert_eq!(first.code, Some(0), "stderr:\n{}", first.stderr);
    let resumed = run(
        &strs(&with(&[
            "--epochs",
            "2",
            "--resume",
            "--out-dir",
            b.to_str().unwrap(),
        ])),
        &[],
        &dir,
        limit,
    );
    assert_eq!(resumed.code, Some(0), "stderr:\n{}", resumed.stderr);
    assert!(
        resumed.stdout.contains("resumed from"),
        "{}",
        resumed.stdout
    );
    assert_eq!(
        full.json()["test_accuracy"],
        resumed.json()["test_accuracy"]
    );
    assert_eq!(full.json()["steps"], resumed.json()["steps"]);
    let hash = full.json()["params_sha256"].clone();
    assert_eq!(hash.as_str().map(str::len), Some(64), "{hash}");
    assert_eq!(hash, resumed.json()["params_sha256"]);

    let dev = candle_core::Device::Cpu;
    let ta = candle_core::safetensors::load(a.join("epoch-2.safetensors"), &dev).unwrap();
    let tb = candle_core::safetensors::load(b.join("epoch-2.safetensors"), &dev).unwrap();
    let mut names: Vec<&String> = ta.keys().collect();
    names.sort();
    assert_eq!(names.len(), tb.len());
    assert!(
        names.iter().any(|n| n.starts_with("optimizer.1.m.")),
        "{names:?}"
    );
    for n in names {
        let (x, y) = (
            &ta[n],
            tb.get(n)
                .unwrap_or_else(|| panic!("{n} missing after resume")),
        );
        let x = x
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let y = y
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(x, y, "{n} differs after resume");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_fails_with_a_message_not_a_panic() {
    let dir = scratch("bad");
    let limit = Duration::from_secs(60);
    let r = run(&["--bogus"], &[], &dir, limit);
    assert_eq!(r.code, Some(2));
    assert!(
        r.stderr.contains("unexpected argument '--bogus'"),
        "{}",
        r.stderr
    );

    let r = run(&["--batch", "3"], &[], &dir, limit);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("--batch must be even"), "{}", r.stderr);

    let r = run(
        &["--data-dir", dir.join("nowhere").to_str().unwrap()],
        &[],
        &dir,
        limit,
    );
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("cannot read the dataset"), "{}", r.stderr);

    let r = run(
        &["--resume", "--out-dir", dir.join("empty").to_str().unwrap()],
        &[],
        &dir,
        limit,
    );
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("no checkpoint"), "{}", r.stderr);

    // Rank 0 of an external group whose workers never come: the missing ranks are named.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
        ("RPC_SECRET", "a test secret of some length"),
    ];
    let r = run(
        &["--init-timeout-secs", "2", "--train-limit", "640"],
        &env,
        &dir,
        limit,
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("ranks [1, 2] never arrived"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A worker killed in the middle of training: the master names it and exits non-zero within
/// seconds, well inside its 120 s timeouts (shutdown stops waiting for the dead peer), and the
/// surviving worker exits too.
#[test]
fn a_killed_worker_fails_the_run_quickly_naming_it() {
    a_failed_worker_ends_the_run("kill", "-KILL", Duration::from_secs(30));
}

/// A worker frozen (SIGSTOP) in the middle of training: its process and its connections stay,
/// and only the failure detector notices; the master names it and exits non-zero within 10 s.
#[test]
fn a_frozen_worker_fails_the_run_within_10_s_naming_it() {
    a_failed_worker_ends_the_run("stop", "-STOP", Duration::from_secs(10));
}

/// Sends `signal` to worker 1 once training is under way; the master must exit non-zero,
/// naming it, within `within`, and the other worker must exit too.
fn a_failed_worker_ends_the_run(name: &str, signal: &str, within: Duration) {
    let dir = scratch(name);
    let out = dir.join("out");
    let (so, se) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_hybrid-rnn"))
        .args(SMALL_MODEL)
        .args(["--local-steps", "0"])
        .args([
            "--train-limit",
            "1280",
            "--test-limit",
            "200",
            "--epochs",
            "1000",
        ])
        .args(["--quiet", "--out-dir", out.to_str().unwrap()])
        .env_remove("RANK")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&so).unwrap())
        .stderr(std::fs::File::create(&se).unwrap())
        .spawn()
        .unwrap();
    let children_of = |pid: u32| -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    // Training is under way once the first checkpoint exists.
    let deadline = Instant::now() + Duration::from_secs(240);
    while !out.join("epoch-1.safetensors").exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended early: {}",
            std::fs::read_to_string(&se).unwrap()
        );
        assert!(Instant::now() < deadline, "no checkpoint within 240 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let workers = children_of(child.id());
    assert_eq!(workers.len(), 2, "two worker processes: {workers:?}");
    let killed = Instant::now();
    // The first child is rank 1.
    let status = Command::new("kill")
        .args([signal, &workers[0].to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if killed.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            let _ = Command::new("kill")
                .args(["-KILL", &workers[0].to_string()])
                .status();
            panic!("the master did not exit within {within:?} of `kill {signal}` on a worker");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!(
        "the master exited {:?} after `kill {signal}`",
        killed.elapsed()
    );
    // A frozen worker is still there unless the master ended it.
    let _ = Command::new("kill")
        .args(["-KILL", &workers[0].to_string()])
        .status();
    let stderr = std::fs::read_to_string(&se).unwrap();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("worker1"),
        "the dead worker is named: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The surviving worker exits as well (it is the master's child; the master reaped it).
    let survivor = workers[1];
    let gone = Instant::now() + Duration::from_secs(30);
    while std::path::Path::new(&format!("/proc/{survivor}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{survivor}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(Instant::now() < gone, "worker2 still running");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_dir_all(dir).unwrap();
}
