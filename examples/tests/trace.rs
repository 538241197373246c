//! The job's trace of the training examples, as their docs say to make it (`--trace PATH`):
//! the merged file of a short `hybrid-rnn` run and of a `pipeline` run validates, every call
//! in it links to its callee's span inside the caller's on the aligned clock (TR-3, TR-4), it
//! has the spans each example's work makes (backward, optimizer steps, ring steps, pipeline
//! actions, checkpoints), and the report covers every step.

use std::time::Duration;

mod common;
use common::run_to_end;

fn traced(bin: &str, tag: &str, args: &[&str]) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!("{tag}-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let trace = dir.join("job.json");
    let (out_dir, trace_s) = (dir.display().to_string(), trace.display().to_string());
    let all: Vec<&str> = [args, &["--out-dir", &out_dir, "--trace", &trace_s]].concat();
    let (code, out, err) = run_to_end(bin, &all, Duration::from_secs(300));
    let text = std::fs::read(&trace);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(err.contains("rpcrun: trace"), "the launcher merged: {err}");
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
    let ok = rpcrun::report::validate(v, 0.0).unwrap_or_else(|e| panic!("{e}"));
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
    let t = rpcrun::report::Trace::from_json(v).unwrap();
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
