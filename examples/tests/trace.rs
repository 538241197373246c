//! The job's trace of the training examples, as their docs say to make it (`--trace PATH`):
//! the merged file of a short `hybrid-rnn` run and of a `pipeline` run validates, every call
//! in it links to its callee's span inside the caller's on the aligned clock (TR-3, TR-4), it
//! has the spans each example's work makes (backward, optimizer steps, ring steps, pipeline
//! actions, checkpoints), and the report covers every step. `param-server` and `elastic-ddp`
//! (whose processes the example starts itself, not through the launcher) trace the same way.

use std::time::Duration;

mod common;
use common::run_to_end;

fn traced(bin: &str, tag: &str, args: &[&str]) -> serde_json::Value {
    traced_by(bin, tag, args, true)
}

/// Runs `bin` with `--trace` (and `--out-dir`, for the examples that write checkpoints) in a
/// directory of its own; the merged trace.
fn traced_by(bin: &str, tag: &str, args: &[&str], out_dir: bool) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!("{tag}-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let trace = dir.join("job.json");
    let (out, trace_s) = (dir.display().to_string(), trace.display().to_string());
    let mut all: Vec<&str> = [args, &["--trace", &trace_s]].concat();
    if out_dir {
        all.extend(["--out-dir", &out]);
    }
    let (code, out, err) = run_to_end(bin, &all, Duration::from_secs(300));
    let text = std::fs::read(&trace);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        err.contains("trace") && err.contains("parts"),
        "merged: {err}"
    );
    serde_json::from_slice(&text.expect("the merged trace")).expect("JSON")
}

fn check(
    v: &serde_json::Value,
    parts: usize,
    steps: usize,
    cats: &[&str],
) -> rpcrun::report::Report {
    assert_eq!(
        v["otherData"]["rpc_trace"]["parts"]
            .as_array()
            .unwrap()
            .len(),
        parts
    );
    let ok = rpcrun::report::validate(&file(v), 0.0).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.unlinked_calls, 0, "{ok:?}");
    assert!(ok.linked_calls > 10 * steps, "{ok:?}");
    for cat in cats {
        let has = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["cat"] == *cat);
        assert!(has, "no {cat} span");
    }
    let t = rpcrun::report::Trace::from_file(&file(v)).unwrap();
    let r = rpcrun::report::report(&t);
    assert_eq!(r.steps, steps, "{}", r.text());
    assert!(r.critical.iter().all(|c| c.3 >= 0.0), "{}", r.text());
    assert_eq!(r.workers.len(), parts, "{}", r.text());
    r
}

#[test]
fn a_hybrid_rnn_run_and_a_pipeline_run_trace_into_one_valid_file() {
    let v = traced(
        env!("CARGO_BIN_EXE_hybrid-rnn"),
        "hybrid",
        &[
            "--embedding",
            "8",
            "--hidden",
            "16",
            "--head-hidden",
            "16",
            "--train-limit",
            "640",
            "--test-limit",
            "200",
            "--local-steps",
            "3",
            "--quiet",
            "--epochs",
            "1",
        ],
    );
    let cats = [
        "call",
        "serve",
        "compute",
        "optimizer",
        "collective",
        "step",
        "checkpoint",
    ];
    check(&v, 3, 10, &cats);
    let v = traced(
        env!("CARGO_BIN_EXE_pipeline"),
        "pipeline",
        &[
            "--batch",
            "64",
            "--emb",
            "16",
            "--hidden",
            "32",
            "--mlp-width",
            "48",
            "--train-limit",
            "640",
            "--test-limit",
            "200",
            "--epochs",
            "1",
            "--stages",
            "3",
            "--micro-batches",
            "4",
            "--quiet",
        ],
    );
    let r = check(
        &v,
        4,
        10,
        &["call", "serve", "pipeline", "step", "optimizer"],
    );
    let stages = r
        .workers
        .iter()
        .filter(|w| w.pipeline_bubble.is_some())
        .count();
    assert_eq!(stages, 3, "{}", r.text());
}

/// Data parallelism through the launcher (gradients as bf16 on the wire): every replica's
/// batch, forward pass, optimizer step and compressed buckets' unpacking are spans of their
/// own, and the step's own time (what no span covers) is small. `DdpOptimizer`'s step
/// recorded no span and the example none for its forward pass: `step (self)` was the critical
/// path's largest entry (53 % on both ranks of a full run) and every replica 11 % busy; the
/// batch and the buckets' conversion back to f32 were counted as `step (self)` too.
#[test]
fn a_data_parallel_run_traces_its_forward_pass_and_optimizer_steps() {
    let v = traced_by(
        env!("CARGO_BIN_EXE_data-parallel"),
        "data-parallel",
        &[
            "--nproc",
            "2",
            "--epochs",
            "1",
            "--train-limit",
            "640",
            "--test-limit",
            "100",
            "--bf16",
        ],
        false,
    );
    let r = check(&v, 2, 10, &["step", "compute", "optimizer", "collective"]);
    let events = v["traceEvents"].as_array().unwrap();
    for (rank, name) in [0, 1]
        .into_iter()
        .flat_map(|r| [(r, "batch"), (r, "unpack bucket")])
    {
        let has = (events.iter()).any(|e| e["pid"] == rank && e["name"] == name);
        assert!(has, "no {name:?} span of rank {rank}");
    }
    let on_path = |name: &str| r.critical.iter().any(|c| c.1 == name);
    assert!(
        on_path("forward") && on_path("optimizer step"),
        "{}",
        r.text()
    );
    let own: f64 = (r.critical.iter())
        .filter(|c| c.1 == "step" && c.2 == "self")
        .map(|c| c.4)
        .sum();
    assert!(own < 0.25, "{own}: {}", r.text());
}

/// The two examples that start their own processes: every process's part is in the file, every
/// call is linked, the k-th step of every trainer (or replica) is step k of the report, and
/// the trainers' (replicas') forward and backward passes are spans of their own.
#[test]
fn the_param_server_and_elastic_ddp_trace_into_one_valid_file() {
    for (bin, tag, args, parts, steps, cat) in [
        (
            env!("CARGO_BIN_EXE_param-server"),
            "ps",
            &["--steps", "8", "--mode", "bsp", "--slow-factor", "1"][..],
            6,
            8,
            "serve",
        ),
        (
            env!("CARGO_BIN_EXE_elastic-ddp"),
            "elastic",
            &["--steps", "8", "--commit-every", "4"][..],
            4,
            8,
            "collective",
        ),
    ] {
        let v = traced_by(bin, tag, args, false);
        let listed = v["otherData"]["rpc_trace"]["parts"].as_array().unwrap();
        assert_eq!(listed.len(), parts, "{tag}");
        let ok = rpcrun::report::validate(&file(&v), 0.0).unwrap_or_else(|e| panic!("{tag}: {e}"));
        assert_eq!(ok.unlinked_calls, 0, "{tag}: {ok:?}");
        assert!(ok.linked_calls >= steps, "{tag}: {ok:?}");
        let has = |c: &str| {
            v["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["cat"] == c)
        };
        assert!(has("call") && has(cat), "{tag}: no call or {cat} span");
        let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
        let r = rpcrun::report::report(&t);
        assert_eq!(r.steps, steps, "{tag}: {}", r.text());
        // The trainers' and replicas' computation is traced: the step's own time (what no
        // span covers) is not the critical path (it was 80 % of a parameter server's).
        let on_path = |name: &str| r.critical.iter().any(|c| c.1 == name);
        assert!(on_path("forward and backward"), "{tag}: {}", r.text());
        let own: f64 = (r.critical.iter())
            .filter(|c| c.1 == "step" && c.2 == "self")
            .map(|c| c.4)
            .sum();
        assert!(own < 0.5, "{tag}: {own}: {}", r.text());
    }
}

/// `v` as the report reads a trace.
fn file(v: &serde_json::Value) -> rpcrun::report::TraceFile<'_> {
    rpcrun::report::TraceFile::from_value(v).expect("a trace")
}
