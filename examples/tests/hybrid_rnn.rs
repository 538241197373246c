//! The hybrid RNN example as a user runs it: three processes on 127.0.0.1, small settings.
//!
//! Each test starts the binary (which starts its two workers), bounds it with a deadline and
//! kills it if the deadline passes; the binary kills and reaps its workers on every exit path.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod common;
use common::{alive, await_step, ranks_of, signal, Spawned};

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
    let mut p = Spawned::start(env!("CARGO_BIN_EXE_hybrid-rnn"), args, env, out);
    let code = p.wait(limit);
    Run {
        code,
        stdout: p.stdout(),
        stderr: p.stderr(),
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
    // One checkpoint per epoch (10 steps each; --checkpoint-every is 1000).
    for step in [10, 20] {
        assert!(out.join(format!("ckpt-{step:09}.safetensors")).exists());
    }
    assert_eq!(j["recoveries"], 0, "{j}");
    assert_eq!(j["time_lost_s"], serde_json::json!([]), "{j}");
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
    let last = "ckpt-000000020.safetensors";
    let ta = candle_core::safetensors::load(a.join(last), &dev).unwrap();
    let tb = candle_core::safetensors::load(b.join(last), &dev).unwrap();
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

    // A restart would meet the same error: the launcher's code for it.
    let r = run(&["--batch", "3"], &[], &dir, limit);
    assert_eq!(r.code, Some(rpcrun::FATAL_EXIT_CODE));
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
    assert_eq!(r.code, Some(rpcrun::FATAL_EXIT_CODE));
    assert!(r.stderr.contains("no checkpoint"), "{}", r.stderr);

    // A device a worker cannot use (CUDA in a build without it, or on a machine without a
    // driver): the master names the worker and the cause, and no restart is spent on it.
    let out = dir.join("no-gpu");
    let mut args = with(&["--shard2-devices", "cpu,cuda:1", "--out-dir"]);
    args.push(out.to_str().unwrap().to_owned());
    let r = run(&strs(&args), &[], &dir, limit);
    assert_eq!(r.code, Some(rpcrun::FATAL_EXIT_CODE), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("hybrid-rnn: error: worker rank 2 cannot hold its shard: cuda:1"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("0 restart(s)"), "{}", r.stderr);

    // Rank 0 of an external group whose workers never come: the missing ranks are named.
    let port = rpc_core::testing::free_port().to_string();
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

/// A worker killed in the middle of training, with no restarts allowed: the launcher (the
/// example's local mode) names its rank and exits with 128 + SIGKILL within seconds, well
/// inside the 120 s timeouts, and no process of the group is left.
#[test]
fn a_killed_worker_fails_the_run_quickly_naming_it() {
    a_failed_worker_ends_the_run("kill", libc::SIGKILL, Duration::from_secs(30));
}

/// A worker frozen (SIGSTOP) in the middle of training: its process and its connections stay,
/// and only the failure detector notices; the master names it and the run exits non-zero
/// within 10 s.
#[test]
fn a_frozen_worker_fails_the_run_within_10_s_naming_it() {
    a_failed_worker_ends_the_run("stop", libc::SIGSTOP, Duration::from_secs(10));
}

/// The example in local mode with `args`, its output in `dir`.
fn launch(args: &[String], dir: &Path) -> Spawned {
    Spawned::start(env!("CARGO_BIN_EXE_hybrid-rnn"), args, &[], dir)
}

/// Sends `sig` to worker 1 once training is under way; the run must end non-zero, naming it,
/// within `within`, and leave no process behind.
fn a_failed_worker_ends_the_run(name: &str, sig: i32, within: Duration) {
    let dir = scratch(name);
    let out = dir.join("out");
    let args: Vec<String> = SMALL_MODEL
        .iter()
        .chain(&[
            "--local-steps",
            "0",
            "--train-limit",
            "1280",
            "--test-limit",
            "200",
        ])
        .chain(&["--epochs", "1000", "--max-restarts", "0", "--quiet"])
        .map(|s| s.to_string())
        .chain(["--out-dir".into(), out.display().to_string()])
        .collect();
    let mut run = launch(&args, &dir);
    await_step(&mut run, &out, 30, Duration::from_secs(240));
    let ranks = ranks_of(run.child.id());
    assert_eq!(
        ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
        [0, 1, 2],
        "{ranks:?}"
    );
    let killed = Instant::now();
    signal(ranks[1].1, sig);
    let code = run.wait(within + Duration::from_secs(30));
    let took = killed.elapsed();
    eprintln!("the run exited {took:?} after signal {sig} to worker 1");
    let stderr = run.stderr();
    assert!(took <= within, "the run took {took:?} to end: {stderr}");
    let (want_code, named) = if sig == libc::SIGKILL {
        (128 + libc::SIGKILL, "rank 1 (pid")
    } else {
        (1, "worker1")
    };
    assert_eq!(code, Some(want_code), "{stderr}");
    assert!(
        stderr.contains(named),
        "the failed worker is named: {stderr}"
    );
    // The master reports the failure as its own error (it stops in order on the launcher's
    // SIGTERM instead of dying of it), naming the worker.
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("hybrid-rnn: error:") && l.contains("worker1")),
        "the master's error names the worker: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    for (rank, pid) in ranks {
        assert!(!alive(pid), "rank {rank} (pid {pid}) outlived the run");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// One short epoch under the launcher (the example's local mode) with two failures at random
/// steps, each a SIGKILL or a SIGSTOP of a random process, first with `--restart group` (every
/// process restarts; the new master resumes from its checkpoint), then with `--restart worker`
/// (only the failed process restarts; the first failure is a worker's, and the master, unless
/// it is the second victim, keeps its process and recovers in place): each run goes on by
/// itself, exits 0, reports both recoveries, and its parameters are bit-identical to an
/// uninterrupted run's. The seed of the random choices is printed (`HYBRID_RNN_KILL_SEED`
/// repeats a run).
#[test]
fn recovers_from_two_random_failures_bit_identically() {
    let dir = scratch("recover");
    let base = |out: &Path, restart: &str| -> Vec<String> {
        let mut v = with(&["--checkpoint-every", "25", "--max-restarts", "3"]);
        // One epoch of 200 steps.
        let limit = v.iter().position(|x| x == "--train-limit").unwrap();
        v[limit + 1] = "12800".into();
        v.extend([
            "--epochs".into(),
            "1".into(),
            "--restart".into(),
            restart.into(),
            "--out-dir".into(),
            out.display().to_string(),
        ]);
        v
    };
    let full = run(
        &strs(&base(&dir.join("full"), "group")),
        &[],
        &dir,
        Duration::from_secs(300),
    );
    assert_eq!(full.code, Some(0), "stderr:\n{}", full.stderr);
    let full = full.json();

    let seed = std::env::var("HYBRID_RNN_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("HYBRID_RNN_KILL_SEED={seed}");
    let mut rng = seed;
    let mut next = |n: u64| {
        // splitmix64
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    };
    for restart in ["group", "worker"] {
        let out = dir.join(restart);
        let one_by_one = restart == "worker";
        let mut run = launch(&base(&out, restart), &dir);
        let mut failures = Vec::new();
        let mut first = Vec::new();
        for (i, (lo, span)) in [(10, 60), (110, 60)].into_iter().enumerate() {
            let at = lo + next(span);
            await_step(&mut run, &out, at, Duration::from_secs(240));
            let ranks = ranks_of(run.child.id());
            assert_eq!(ranks.len(), 3, "{ranks:?}");
            if i == 0 {
                first = ranks.clone();
            }
            let victim = if one_by_one && i == 0 {
                ranks[1 + next(2) as usize]
            } else {
                ranks[next(3) as usize]
            };
            let sig = if next(2) == 0 {
                libc::SIGKILL
            } else {
                libc::SIGSTOP
            };
            eprintln!(
                "--restart {restart}, step {at}: signal {sig} to rank {} (pid {})",
                victim.0, victim.1
            );
            signal(victim.1, sig);
            failures.push((victim, sig));
            // The failed processes (the victim alone, or the whole attempt) are gone before
            // the next failure is chosen.
            let ended: Vec<_> = if one_by_one { vec![victim] } else { ranks };
            let deadline = Instant::now() + Duration::from_secs(60);
            while ended.iter().any(|r| alive(r.1)) {
                assert!(
                    Instant::now() < deadline,
                    "the failed processes were not ended:\n{}",
                    run.stderr()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let survivors = ranks_of(run.child.id());
        let code = run.wait(Duration::from_secs(300));
        let stderr = run.stderr();
        assert_eq!(code, Some(0), "{failures:?}\n{stderr}");
        let got = Run {
            code,
            stdout: run.stdout(),
            stderr,
        };
        let j = got.json();
        assert_eq!(j["recoveries"], 2, "{failures:?} {j}");
        assert_eq!(j["time_lost_s"].as_array().unwrap().len(), 2, "{j}");
        let masters = failures.iter().filter(|(v, _)| v.0 == 0).count();
        let (resumed, in_place) = if one_by_one {
            (masters, failures.len() - masters)
        } else {
            (failures.len(), 0)
        };
        assert_eq!(
            (
                got.stdout.matches("resumed from").count(),
                got.stdout.matches("recovered in place").count()
            ),
            (resumed, in_place),
            "{failures:?}\n{}",
            got.stdout
        );
        if one_by_one {
            // Only the victims were replaced.
            for (rank, pid) in first {
                let hit = failures.iter().any(|(v, _)| v.1 == pid);
                let kept = survivors.contains(&(rank, pid));
                assert_eq!(kept, !hit, "rank {rank}: {failures:?} {survivors:?}");
            }
        }
        for key in ["steps", "params_sha256", "test_accuracy"] {
            assert_eq!(
                j[key], full[key],
                "--restart {restart}: {key} differs after {failures:?}"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Flags of a run of 200 steps with a checkpoint every 10 (the newest 5 kept), in `out`.
fn long_run(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = with(&["--checkpoint-every", "10", "--keep-checkpoints", "5"]);
    let limit = v.iter().position(|x| x == "--train-limit").unwrap();
    v[limit + 1] = "12800".into();
    v.extend(["--epochs", "1", "--out-dir"].map(String::from));
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// RES-1, CKPT-1: the run killed (the launcher and its processes, SIGKILL, as a crash or a
/// requeue ends it), its newest checkpoint then damaged by one flipped byte and the one before
/// cut short; the same command run again skips both (naming them, keeping them aside),
/// resumes from the third newest and ends bit-identical to an uninterrupted run, counting no
/// recovery (the launcher restarted nothing). Run once more, it says the run is complete and
/// only evaluates; with other flags it is refused, naming them.
#[test]
fn running_the_same_command_again_resumes_from_the_newest_verified_checkpoint() {
    let dir = scratch("rerun");
    let limit = Duration::from_secs(300);
    let full = run(&strs(&long_run(&dir.join("full"), &[])), &[], &dir, limit);
    assert_eq!(full.code, Some(0), "stderr:\n{}", full.stderr);
    let want = full.json()["params_sha256"].clone();

    let out = dir.join("out");
    let args = long_run(&out, &[]);
    let mut first = launch(&args, &dir);
    await_step(&mut first, &out, 120, Duration::from_secs(240));
    let ranks = ranks_of(first.child.id());
    signal(first.child.id(), libc::SIGKILL);
    first.wait(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    while ranks.iter().any(|r| alive(r.1)) {
        assert!(
            Instant::now() < deadline,
            "the group died with its launcher"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut ckpts: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    ckpts.sort();
    assert!(ckpts.len() >= 3, "{ckpts:?}");
    let (newest, second, third) = (
        ckpts[ckpts.len() - 1].clone(),
        ckpts[ckpts.len() - 2].clone(),
        ckpts[ckpts.len() - 3].clone(),
    );
    let mut bytes = std::fs::read(&newest).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&newest, bytes).unwrap();
    let bytes = std::fs::read(&second).unwrap();
    std::fs::write(&second, &bytes[..bytes.len() - 100]).unwrap();

    let again = run(&strs(&args), &[], &dir, limit);
    assert_eq!(again.code, Some(0), "stderr:\n{}", again.stderr);
    for damaged in [&newest, &second] {
        let name = damaged.display().to_string();
        assert!(
            again
                .stderr
                .contains(&format!("skipping the damaged checkpoint {name}")),
            "{}",
            again.stderr
        );
        assert!(Path::new(&format!("{name}.damaged")).exists());
    }
    assert!(
        again
            .stdout
            .contains(&format!("resumed from {}", third.display())),
        "{}",
        again.stdout
    );
    assert_eq!(again.json()["params_sha256"], want, "bit-identical");
    // Started again by hand, not restarted by the launcher: no recovery to time.
    assert_eq!(again.json()["recoveries"], 0, "{}", again.stdout);

    let once_more = run(&strs(&args), &[], &dir, limit);
    assert_eq!(once_more.code, Some(0), "stderr:\n{}", once_more.stderr);
    assert!(
        once_more.stdout.contains("resumed from"),
        "{}",
        once_more.stdout
    );
    assert_eq!(once_more.json()["params_sha256"], want);
    assert!(
        once_more
            .stdout
            .contains("is complete (1 of 1 epochs): nothing to train"),
        "{}",
        once_more.stdout
    );
    assert_eq!(once_more.json()["recoveries"], 0, "{}", once_more.stdout);

    let mut other = args.clone();
    let at = other.iter().position(|x| x == "--head-hidden").unwrap();
    other[at + 1] = "24".into();
    let refused = run(&strs(&other), &[], &dir, limit);
    assert_eq!(
        refused.code,
        Some(rpcrun::FATAL_EXIT_CODE),
        "{}",
        refused.stderr
    );
    assert!(
        refused.stderr.contains("--head-hidden 16 (this run: 24)")
            && refused.stderr.contains("--fresh"),
        "{}",
        refused.stderr
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A checkpoint that cannot be written (the output directory is a file system of 8 KiB, full
/// before the first checkpoint: "No space left on device") stops the run at once, naming the
/// file and the cause, without spending the launcher's restarts on the same failure. The
/// file system is mounted in a mount namespace of the run's own (`unshare -m`), so it goes
/// with the run; where that cannot be done (not root), the test says so and passes.
#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_at_once() {
    let probe = std::process::Command::new("unshare")
        .args(["-m", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: `unshare -m` is not available here (needs root)");
        return;
    }
    let dir = scratch("full-disk");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let args = long_run(&out, &["--max-restarts", "3"]);
    let script = format!(
        "mount -t tmpfs -o size=8k tmpfs '{}' && exec \"$0\" \"$@\"",
        out.display()
    );
    let mut cmd = vec!["-m".to_string(), "sh".into(), "-c".into(), script];
    cmd.push(env!("CARGO_BIN_EXE_hybrid-rnn").into());
    cmd.extend(args);
    let mut p = Spawned::start("unshare", &cmd, &[], &dir);
    let code = p.wait(Duration::from_secs(120));
    let err = p.stderr();
    assert_eq!(code, Some(rpcrun::FATAL_EXIT_CODE), "{err}");
    let ckpt = out.join("ckpt-000000010.safetensors");
    assert!(
        err.contains(&format!("cannot write the checkpoint {}", ckpt.display()))
            && err.contains("No space left on device"),
        "{err}"
    );
    assert!(!err.contains("restart 1 of 3"), "{err}");
    drop(p);
    std::fs::remove_dir_all(dir).unwrap();
}
