//! The pipeline example as a user runs it: a master and one process per stage on 127.0.0.1,
//! small settings; every process is killed when its handle drops, whatever the outcome.

use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;
use common::{alive, await_step, last_json, ranks_of, run_to_end, signal, Spawned};

const BIN: &str = env!("CARGO_BIN_EXE_pipeline");

/// A small model and data set: seconds per run in a debug build.
const SMALL: [&str; 12] = [
    "--batch",
    "64",
    "--emb",
    "16",
    "--hidden",
    "32",
    "--mlp-width",
    "48",
    "--train-limit",
    "1280",
    "--test-limit",
    "200",
];

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pipeline-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn check_equivalence_passes_for_both_schedules() {
    let mut args: Vec<&str> = SMALL.to_vec();
    args.push("--check-equivalence");
    let (code, out, err) = run_to_end(BIN, &args, Duration::from_secs(300));
    assert_eq!(code, Some(0), "{out}\n{err}");
    let j = last_json(&out, &err);
    assert_eq!(j["ok"], true, "{j}");
    for key in ["max_grad_diff", "max_param_diff", "max_loss_diff"] {
        let d = j[key].as_f64().unwrap();
        assert!(d <= 1e-5, "{key} {d}");
    }
    // Eight configurations, each reported.
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("micro-batch(es)"))
            .count(),
        8,
        "{out}"
    );
}

/// A layer of width 0 is refused with the flag that made it, before anything starts, and no
/// restart is spent on it. Before, `--hidden 0` started the group and a stage's handler
/// panicked (`NonFinite` from an initialiser's bound of 1/sqrt(0)).
#[test]
fn a_layer_of_width_zero_is_refused_naming_the_flag() {
    for flag in ["--emb", "--hidden", "--mlp-width"] {
        let (code, out, err) = run_to_end(BIN, &[flag, "0"], Duration::from_secs(60));
        assert_eq!(code, Some(rpcrun::FATAL_EXIT_CODE), "{flag}: {out}\n{err}");
        assert!(err.contains(&format!("{flag} must be at least 1")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `--keep-checkpoints 0` kept none: each checkpoint was removed as soon as it was written,
/// so a failure replayed the run from its start and a rerun found nothing to go on from.
/// It is refused before anything starts, as hybrid-rnn refuses it.
#[test]
fn keeping_no_checkpoint_is_refused() {
    let args = ["--keep-checkpoints", "0"];
    let (code, out, err) = run_to_end(BIN, &args, Duration::from_secs(60));
    assert_eq!(code, Some(rpcrun::FATAL_EXIT_CODE), "{out}\n{err}");
    assert!(
        err.contains("--keep-checkpoints must be at least 1"),
        "{err}"
    );
}

#[test]
fn trains_reports_and_draws_the_timeline() {
    let run = run_small("train", &[]);
    let (out, j) = (&run.out, &run.json);
    assert_eq!(run.code, Some(0), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("test accuracy")).count(),
        2,
        "{out}"
    );
    assert_eq!(j["schedule"], "1f1b");
    assert_eq!(j["stages"], 3);
    // 1F1B: stage s of 3 keeps at most 3 - s micro-batches.
    assert_eq!(
        j["max_live_activations"],
        serde_json::json!([3, 2, 1]),
        "{j}"
    );
    assert_eq!(j["peak_rss_mb"].as_array().unwrap().len(), 3);
    assert!(
        j["accuracy"].as_f64().unwrap() > 1.0 / 7.0,
        "better than chance: {j}"
    );
    let bubble = j["bubble_measured"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&bubble), "{j}");
    let png = run.timeline.expect("timeline.png written");
    assert_eq!(&png[1..4], b"PNG");
}

/// Stage 1's process killed (SIGKILL) in the middle of step 2: the master's step fails with an
/// error naming the stage and its worker, and the master exits 1 within seconds. The processes
/// are started as a launcher would, so the master's own message is what the test reads.
#[test]
fn a_killed_stage_fails_the_step_naming_it() {
    let dir = scratch("kill");
    let port = common::free_port().to_string();
    let mut args: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    args.extend(
        [
            "--epochs",
            "1",
            "--stages",
            "2",
            "--quiet",
            "--kill-stage",
            "1",
            "--kill-at-step",
            "2",
            "--timeout-secs",
            "60",
        ]
        .map(String::from),
    );
    // The master's checkpoints and progress record go to the scratch directory.
    args.push("--out-dir".into());
    args.push(dir.join("out").display().to_string());
    let mut procs: Vec<Spawned> = (0..3)
        .map(|rank| {
            let d = dir.join(format!("rank{rank}"));
            std::fs::create_dir_all(&d).unwrap();
            let r = rank.to_string();
            let env = [
                ("RANK", r.as_str()),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
                ("RPC_SECRET", "pipeline test secret, long enough"),
                ("PIPELINE_WORKER_TIMEOUT", "60"),
            ];
            Spawned::start(BIN, &args, &env, &d)
        })
        .collect();
    let code = procs[0].wait(Duration::from_secs(120));
    let err = procs[0].stderr();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("killing stage 1 during step 2"), "{err}");
    assert!(err.contains("training step 2"), "{err}");
    assert!(
        err.contains("pipeline stage 1 on worker `worker2` failed"),
        "the stage and its worker are named: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        procs[2].wait(Duration::from_secs(30)),
        None,
        "killed by SIGKILL"
    );
    drop(procs);
    std::fs::remove_dir_all(dir).unwrap();
}

/// What one run of the example left.
struct Run {
    code: Option<i32>,
    /// Its standard output, then its standard error.
    out: String,
    /// Its final JSON line.
    json: serde_json::Value,
    /// The timeline picture's bytes, if it drew one.
    timeline: Option<Vec<u8>>,
}

/// One small run in local mode (the launcher's code): 2 epochs of 20 steps over 3 stages with
/// 4 micro-batches, checkpoints every 5 steps, `extra` flags, and its own output directory
/// (removed after).
fn run_small(name: &str, extra: &[&str]) -> Run {
    run_small_with(name, extra, |_, _| {})
}

/// The flags of [`run_small`]'s runs, with `extra`, writing into `out_dir`.
fn small_args(extra: &[&str], out_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    args.extend(
        [
            "--epochs",
            "2",
            "--stages",
            "3",
            "--micro-batches",
            "4",
            "--checkpoint-every",
            "5",
            "--quiet",
            "--timeout-secs",
            "60",
        ]
        .map(String::from),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push("--out-dir".into());
    args.push(out_dir.display().to_string());
    args
}

/// [`run_small`], calling `during` with the running example and its output directory.
fn run_small_with(name: &str, extra: &[&str], during: impl FnOnce(&mut Spawned, &Path)) -> Run {
    let dir = scratch(name);
    let out_dir = dir.join("out");
    let args = small_args(extra, &out_dir);
    let mut p = Spawned::start(BIN, &args, &[], &dir);
    during(&mut p, &out_dir);
    let code = p.wait(Duration::from_secs(300));
    let (out, err) = (p.stdout(), p.stderr());
    let json = last_json(&out, &err);
    drop(p);
    let timeline = std::fs::read(out_dir.join("timeline.png")).ok();
    std::fs::remove_dir_all(dir).unwrap();
    Run {
        code,
        out: format!("{out}\n{err}"),
        json,
        timeline,
    }
}

/// Recovery: a stage process SIGKILLed in the middle of step 12 (checkpoints every 5 steps),
/// once with `--restart worker` (only that process is replaced; the master rebuilds every
/// stage, restores the checkpoint of step 10 and replays 2 steps) and once with `--restart
/// group` (every process restarts; the new master resumes from the checkpoint); then the
/// master killed with `--restart worker`, and a stage frozen (SIGSTOP). Each ends with exit 0
/// and parameters bit-identical to the uninterrupted run's.
#[test]
fn a_killed_stage_is_recovered_and_the_run_ends_bit_identical() {
    let Run {
        code,
        out,
        json: plain,
        ..
    } = run_small("plain", &[]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(plain["recoveries"], 0, "{plain}");
    let want = plain["params_sha256"].as_str().unwrap().to_owned();
    assert_eq!(want.len(), 64);
    assert_eq!(plain["steps"], 40);

    let kill = [
        "--max-restarts",
        "1",
        "--kill-stage",
        "1",
        "--kill-at-step",
        "12",
    ];
    let mut worker: Vec<&str> = kill.to_vec();
    worker.extend(["--restart", "worker"]);
    let Run {
        code, out, json: j, ..
    } = run_small("worker", &worker);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("killing stage 1 during step 12"), "{out}");
    assert!(
        out.contains("recovered in place from") && out.contains("after the loss of worker2"),
        "{out}"
    );
    assert_eq!(j["recoveries"], 1, "{j}");
    assert_eq!(j["recovered_in_place"], 1, "{j}");
    assert_eq!(j["replayed_steps"], serde_json::json!([2]), "{j}");
    assert_eq!(j["params_sha256"], want.as_str(), "bit-identical: {j}");
    assert_eq!(j["accuracy_per_epoch"], plain["accuracy_per_epoch"], "{j}");

    let mut group: Vec<&str> = kill.to_vec();
    group.extend(["--restart", "group"]);
    let Run {
        code, out, json: j, ..
    } = run_small("group", &group);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("resumed from"), "{out}");
    assert_eq!(j["restarts"], 1, "{j}");
    assert_eq!(j["recoveries"], 1, "{j}");
    assert_eq!(j["recovered_in_place"], 0, "{j}");
    assert_eq!(j["params_sha256"], want.as_str(), "bit-identical: {j}");

    // The master killed under `--restart worker`: the stages keep their processes (and what
    // the dead master left on them), the new master resumes from the checkpoint.
    let master = [
        "--max-restarts",
        "1",
        "--restart",
        "worker",
        "--kill-stage",
        "master",
        "--kill-at-step",
        "12",
    ];
    let Run {
        code, out, json: j, ..
    } = run_small("master", &master);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("killing the master during step 12"), "{out}");
    assert!(out.contains("rank 0 was killed by signal 9"), "{out}");
    assert_eq!(j["restarts"], 1, "{j}");
    assert_eq!(j["params_sha256"], want.as_str(), "bit-identical: {j}");
    // A stage frozen (SIGSTOP) after step 12: only the failure detector can tell; the
    // launcher replaces it and the master recovers in place.
    let frozen = ["--max-restarts", "1", "--restart", "worker"];
    let Run {
        code, out, json: j, ..
    } = run_small_with("frozen", &frozen, |run, out_dir| {
        await_step(run, out_dir, 12, Duration::from_secs(120));
        let ranks = ranks_of(run.child.id());
        let (_, pid) = *ranks.iter().find(|r| r.0 == 2).expect("stage 1's process");
        signal(pid, libc::SIGSTOP);
        // The launcher ends it (SIGKILL) once the group declared it failed.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while alive(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "the frozen stage was not ended"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("no heartbeat for"), "{out}");
    assert_eq!(j["recovered_in_place"], 1, "{j}");
    assert_eq!(j["params_sha256"], want.as_str(), "bit-identical: {j}");
}

/// RES-1, RES-3: the same command run again after the run ended goes on from its final
/// checkpoint (nothing is trained again; the same parameters); with `--fresh` the earlier
/// run's files are moved aside (kept) and the run trains from the beginning to the same
/// parameters.
#[test]
fn a_rerun_goes_on_from_its_checkpoint_and_fresh_starts_over() {
    let dir = scratch("rerun");
    let out_dir = dir.join("out");
    let go = |extra: &[&str]| {
        let mut p = Spawned::start(BIN, &small_args(extra, &out_dir), &[], &dir);
        let code = p.wait(Duration::from_secs(300));
        let (out, err) = (p.stdout(), p.stderr());
        assert_eq!(code, Some(0), "{out}\n{err}");
        (format!("{out}\n{err}"), last_json(&out, &err))
    };
    let (_, first) = go(&[]);
    let want = &first["params_sha256"];
    let (out, again) = go(&[]);
    assert!(
        out.contains(&format!(
            "resumed from {} (epoch 2, step 40",
            out_dir.join("ckpt-000000040.safetensors").display()
        )),
        "{out}"
    );
    assert_eq!(&again["params_sha256"], want, "{again}");
    let (out, fresh) = go(&["--fresh"]);
    assert!(out.contains("starting over (--fresh): moved"), "{out}");
    assert!(!out.contains("resumed from"), "{out}");
    assert!(
        out_dir
            .join("previous-1/ckpt-000000040.safetensors")
            .exists(),
        "the earlier run's checkpoints are kept"
    );
    assert_eq!(&fresh["params_sha256"], want, "{fresh}");
    std::fs::remove_dir_all(dir).unwrap();
}
