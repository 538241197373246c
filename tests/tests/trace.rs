//! One trace for the whole job (`rpc_core::trace`, `rpcrun --trace`, `rpctrace report`):
//! three `trace-worker` processes under the launcher, each recording; the merged file is a
//! valid Trace Event Format trace in which every call made is linked to its served span
//! (TR-3) and, on rank 0's clock, each callee span lies inside its caller's (TR-4); a clock
//! shifted by a time namespace is recovered within the stated bound; a worker slowed on
//! purpose is named as the straggler, its span as the critical path.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(tag: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("trace-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("a temp dir");
    Dir(d)
}

/// Runs three trace-workers traced to `trace` with `env`; the launcher's exit.
fn launch(trace: &Path, env: &[(&str, &str)]) -> rpcrun::Exit {
    launch_with(trace, env, |l| l)
}

/// [`launch`], with `more` set on the launch.
fn launch_with(
    trace: &Path,
    env: &[(&str, &str)],
    more: impl FnOnce(rpcrun::Launch) -> rpcrun::Launch,
) -> rpcrun::Exit {
    let launch = rpcrun::Launch::new(env!("CARGO_BIN_EXE_trace-worker"))
        .nproc(3)
        .stop_grace(Duration::from_secs(2))
        .trace(trace);
    let mut launch = more(launch);
    for (k, v) in env {
        launch = launch.env(*k, *v);
    }
    // On a thread of its own, bounded: the children end with this process if it overruns.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(launch.run());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the launch ends within 2 minutes")
        .expect("the launch runs")
}

/// Runs three trace-workers traced to `trace` with `env`, which succeed; the merged trace.
fn run(trace: &Path, env: &[(&str, &str)]) -> Value {
    let exit = launch(trace, env);
    assert_eq!(exit.code, 0, "{exit:?}");
    let merged = exit.trace.expect("the launcher merged the trace");
    assert_eq!(merged.parts, 3, "{merged:?}");
    serde_json::from_slice(&std::fs::read(trace).expect("the merged trace")).expect("JSON")
}

/// The format, and TR-3 / TR-4 (`rpcrun::report::validate`): every call linked to its served
/// span, inside the caller's within the clocks' bound. The number of linked calls.
fn check_calls(v: &Value) -> usize {
    let ok = rpcrun::report::validate(&file(v), 0.0).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.unlinked_calls, 0, "{ok:?}");
    ok.linked_calls
}

#[test]
fn the_merged_trace_links_every_call_and_names_the_straggler() {
    let dir = temp_dir("slow");
    let trace = dir.0.join("job.json");
    let v = run(&trace, &[("TRACE_SLOW_RANK", "2"), ("TRACE_SLOW_MS", "40")]);
    let bound_us = v["otherData"]["rpc_trace"]["clock_error_bound_ns"]
        .as_f64()
        .unwrap()
        / 1e3;
    assert!(
        bound_us < 5_000.0,
        "one host: clocks within 5 ms, got {bound_us} us"
    );
    // 6 steps x 2 workers.
    assert_eq!(check_calls(&v), 12);
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    let r = rpcrun::report::report(&t);
    assert_eq!(r.steps, 6, "{}", r.text());
    let (straggler, n) = r.straggler.clone().expect("a straggler");
    assert!(straggler.starts_with("worker2"), "{}", r.text());
    assert!(n >= 5, "{}", r.text());
    let (w, span, cat, _, share) = &r.critical[0];
    assert!(
        w.starts_with("worker2") && span == "forward" && cat == "self",
        "{}",
        r.text()
    );
    // Most of the path on an idle machine; on a loaded one the calls' time on the wire (the
    // callee's process not yet scheduled) grows beside it: 46 % with three copies of this
    // test binary at once on two cores, the wire 45 %.
    assert!(*share > 0.35, "{}", r.text());
    for s in &r.workers {
        let sum = s.busy + s.communicating + s.waiting;
        assert!((sum - 1.0).abs() < 1e-6, "{s:?}");
    }
}

/// A trace that cannot be written is refused before any process starts: the job ran to its
/// end, every part failed to be written, and the launcher said so only then, exiting 0 (a
/// path under a regular file, or a directory as the path).
#[test]
fn a_trace_path_that_cannot_be_written_is_refused_before_the_job_starts() {
    let dir = temp_dir("unwritable");
    let ready = dir.0.join("started");
    std::fs::write(dir.0.join("a-file"), "").expect("a file");
    for bad in [dir.0.join("a-file/job.json"), dir.0.clone()] {
        let launch = rpcrun::Launch::new(env!("CARGO_BIN_EXE_trace-worker"))
            .nproc(2)
            .env("TRACE_READY_FILE", ready.display().to_string())
            .trace(&bad);
        // Bounded, as `launch_with` is: the children end with this process if it overruns.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(launch.run());
        });
        let ran = rx.recv_timeout(Duration::from_secs(120));
        let e = ran
            .expect("the launch ends")
            .expect_err("refused")
            .to_string();
        assert!(e.contains("trace"), "{}: {e}", bad.display());
        let started = std::fs::read_dir(&dir.0)
            .expect("the temp dir")
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with("started"));
        assert!(!started, "{}: the job started", bad.display());
    }
}

/// TR-5: a job that fails still leaves every rank's part. Rank 0 exits with an error at the
/// start of its fourth step without shutting down (its part is written as its process
/// exits); the launcher then stops ranks 1 and 2, still busy, with SIGTERM (theirs are
/// written on the signal, which then ends them). The merge has all three, the three steps
/// done and their six calls linked. Before TR-5 no part was written: the merge found none.
/// Rank 0's part was then missing in about one run in ten: the exit handler skipped a ring
/// whose drop, on a thread still winding down, was writing it, and the process ended first.
#[test]
fn a_job_that_fails_still_leaves_every_ranks_part() {
    let dir = temp_dir("fail");
    let trace = dir.0.join("job.json");
    let exit = launch(&trace, &[("TRACE_FAIL_STEP", "3")]);
    assert_eq!(exit.code, 3, "rank 0's status: {exit:?}");
    let merged = exit.trace.expect("the launcher merged the trace");
    assert_eq!(merged.parts, 3, "{merged:?}");
    assert!(merged.unaligned.is_empty(), "{merged:?}");
    let v: Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("the merged trace")).expect("JSON");
    assert_eq!(check_calls(&v), 6);
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    assert_eq!(rpcrun::report::report(&t).steps, 3);
    for rank in [1, 2] {
        assert!(
            t.spans
                .iter()
                .any(|s| s.rank == rank && s.name == "forward" && s.cat == "compute"),
            "rank {rank}'s part has its forward spans"
        );
    }
}

/// TR-6: a worker killed outright (SIGKILL: a crash, the OOM killer) writes no part; the
/// merge names its rank as missing, in its summary, in the merged file and in `rpctrace
/// report`, rather than present a trace without it as the whole job's (it said "2 parts"
/// and nothing more, and the report analysed the two workers left).
#[test]
fn a_rank_killed_outright_is_named_as_missing_from_the_trace() {
    let dir = temp_dir("killed");
    let trace = dir.0.join("job.json");
    let exit = launch(&trace, &[("TRACE_KILL_RANK", "2")]);
    assert_ne!(exit.code, 0, "rank 0's step failed: {exit:?}");
    let merged = exit.trace.expect("the launcher merged the trace");
    assert_eq!(
        (merged.parts, merged.missing.clone()),
        (2, vec![2]),
        "{merged:?}"
    );
    let said = merged.to_string();
    assert!(said.contains("no part from ranks [2]"), "{said}");
    let v: Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("the merged trace")).expect("JSON");
    assert_eq!(
        v.pointer("/otherData/rpc_trace/missing_ranks"),
        Some(&serde_json::json!([2])),
        "the merged file says so too"
    );
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    let text = rpcrun::report::report(&t).text();
    assert!(text.contains("no part from ranks [2]"), "{text}");
}

/// TR-6 per start: a rank killed outright in the launcher's first start, before the group
/// restart that wrote its part, is named as missing from that start, in the summary and in
/// `rpctrace report` (its part from the restart stood in for it: nothing was missing).
#[test]
fn a_rank_killed_in_a_start_the_group_restarted_is_named_for_that_start() {
    let dir = temp_dir("killed-restart");
    let trace = dir.0.join("job.json");
    let env = [("TRACE_KILL_RANK", "2"), ("TRACE_FAIL_ONCE", "1")];
    let exit = launch_with(&trace, &env, |l| l.max_restarts(1));
    assert_eq!((exit.code, exit.restarts), (0, 1), "{exit:?}");
    let merged = exit.trace.expect("the launcher merged the trace");
    assert_eq!(merged.parts, 5, "{merged:?}");
    let by_start = vec![(0, vec![2])];
    assert_eq!(
        (merged.missing.clone(), merged.missing_by_start.clone()),
        (vec![2], by_start),
        "{merged:?}"
    );
    let said = merged.to_string();
    assert!(said.contains("no part from ranks [2] in start 0"), "{said}");
    let v: Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("the merged trace")).expect("JSON");
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    let text = rpcrun::report::report(&t).text();
    assert!(text.contains("no part from ranks [2] in start 0"), "{text}");
}

/// TR-5 across a group restart: the failed start's parts (rank 0's at its exit, the others'
/// on SIGTERM) stay beside the restart's, all merged, every call linked once. Before, each
/// start wrote `rank-R-inc-0.json` over the previous start's (and a part left from one start
/// shared its flow ids with the next's).
#[test]
fn a_group_restart_keeps_the_failed_starts_parts() {
    let dir = temp_dir("restart");
    let trace = dir.0.join("job.json");
    let launch = |l: rpcrun::Launch| l.max_restarts(1);
    let exit = launch_with(
        &trace,
        &[("TRACE_FAIL_STEP", "3"), ("TRACE_FAIL_ONCE", "1")],
        launch,
    );
    assert_eq!((exit.code, exit.restarts), (0, 1), "{exit:?}");
    let merged = exit.trace.expect("the launcher merged the trace");
    assert_eq!(merged.parts, 6, "{merged:?}");
    let v: Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("the merged trace")).expect("JSON");
    // 3 steps of the failed start and 6 of the restart, 2 calls each.
    assert_eq!(check_calls(&v), 18);
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    assert_eq!(rpcrun::report::report(&t).steps, 9);
}

/// TR-5 with a signal grace, and the grace on SIGHUP (as the guide says; it watched only
/// SIGTERM and SIGINT, so SIGHUP killed the worker at once, its part lost): rank 1 of two,
/// started by hand, gets SIGHUP while rank 0 calls it; it ends when its grace is over with
/// status 128 + 1, and its part is written as it exits.
#[test]
fn a_sighup_under_a_grace_ends_the_worker_by_its_grace_and_keeps_its_part() {
    let dir = temp_dir("hup");
    let trace = dir.0.join("job.json");
    let ready = dir.0.join("ready");
    let port = rpc_core::testing::free_port();
    let spawn = |rank: u32| {
        std::process::Command::new(env!("CARGO_BIN_EXE_trace-worker"))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RPC_SECRET", "trace test secret, long enough")
            .env("RPC_TRACE", &trace)
            .env("RPC_SIGNAL_GRACE_MS", "200")
            .env("TRACE_STEPS", "100000")
            .env("TRACE_READY_FILE", &ready)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starts trace-worker")
    };
    let mut group = Group(vec![spawn(0), spawn(1)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let ready1 = dir.0.join("ready.1");
    while !ready1.exists() {
        assert!(std::time::Instant::now() < deadline, "rank 1 never joined");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: a signal to a child this test started and still holds.
    unsafe { libc::kill(group.0[1].id() as i32, libc::SIGHUP) };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = group.0[1].try_wait().expect("waits") {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rank 1 still runs 30 s after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGHUP), "{status:?}");
    let part = rpc_core::trace::part_path(&trace, 1, 0, 0);
    let v: Value =
        serde_json::from_slice(&std::fs::read(&part).expect("rank 1's part")).expect("JSON");
    assert!(v["traceEvents"].as_array().is_some_and(|e| !e.is_empty()));
}

/// Runs `world` trace-workers by hand (no launcher), traced to `trace`; waits (at most 60 s)
/// for every one to exit 0.
fn by_hand(trace: &Path, world: u32) {
    let port = rpc_core::testing::free_port();
    let mut group = Group(
        (0..world)
            .map(|rank| {
                std::process::Command::new(env!("CARGO_BIN_EXE_trace-worker"))
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("RPC_SECRET", "trace test secret, long enough")
                    .env("RPC_TRACE", trace)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("starts trace-worker")
            })
            .collect(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for c in &mut group.0 {
        let status = loop {
            if let Some(s) = c.try_wait().expect("waits") {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "not done in 60 s");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status:?}");
    }
}

/// TR-7: a program traced by hand to the path an earlier run of it used, with fewer ranks,
/// gets a trace of this run only: rank 2's part, left by the earlier run, is left out and
/// named (it was merged in, as if this run had three ranks: 3 parts).
#[test]
fn a_rerun_to_the_same_path_leaves_the_earlier_runs_parts_out() {
    let dir = temp_dir("rerun");
    let trace = dir.0.join("job.json");
    by_hand(&trace, 3);
    by_hand(&trace, 2);
    let s = rpc_core::trace::merge_parts(&trace, None).expect("merged");
    assert_eq!((s.parts, s.missing.clone()), (2, vec![]), "{s:?}");
    assert_eq!(
        s.stale,
        vec![rpc_core::trace::part_path(&trace, 2, 0, 0)],
        "{s:?}"
    );
    let v: Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("the merged trace")).expect("JSON");
    let t = rpcrun::report::Trace::from_file(&file(&v)).unwrap();
    assert_eq!(rpcrun::report::report(&t).steps, 6);
}

/// TR-10: a rerun after a run whose launcher ended before its merge (here: its trace deleted,
/// as if so) does not delete that run's parts, the only record of it: node 0's launcher merges
/// them into `job.prev.json` first. A run that was merged leaves nothing to keep.
#[test]
fn a_rerun_merges_an_earlier_runs_unmerged_parts_before_clearing_them() {
    let dir = temp_dir("unmerged");
    let (trace, earlier) = (dir.0.join("job.json"), dir.0.join("job.prev.json"));
    run(&trace, &[]);
    let first = part_job(&trace, 0);
    run(&trace, &[]);
    assert!(!earlier.exists(), "a merged run's parts were merged again");
    let second = part_job(&trace, 0);
    assert_ne!(first, second, "two launches, two jobs");
    std::fs::remove_file(&trace).expect("the trace");
    run(&trace, &[]);
    let v: Value =
        serde_json::from_slice(&std::fs::read(&earlier).expect("job.prev.json")).expect("JSON");
    let parts = v["otherData"]["rpc_trace"]["parts"]
        .as_array()
        .expect("parts");
    assert_eq!(parts.len(), 3, "{parts:?}");
    for p in parts {
        assert_eq!(p["job"].as_str(), Some(second.as_str()), "{p}");
    }
    assert_ne!(part_job(&trace, 0), second, "this run's parts are its own");
}

/// The job its part in `trace`'s parts names (rank `rank`, the first start).
fn part_job(trace: &Path, rank: u32) -> String {
    let part = rpc_core::trace::part_path(trace, rank, 0, 0);
    let v: Value = serde_json::from_slice(&std::fs::read(&part).expect("the part")).expect("JSON");
    v["otherData"]["rpc_trace"]["job"]
        .as_str()
        .expect("the part names its job")
        .to_owned()
}

/// The restart modes the two-node tests run in (group: the rendezvous in node 0's rank 0;
/// worker: in node 0's launcher).
const RESTARTS: [rpcrun::Restart; 2] = [rpcrun::Restart::Group, rpcrun::Restart::Worker];

/// The two-node launches of one test: a directory, a secret and a port its runs share.
struct TwoNodes {
    dir: Dir,
    secret: PathBuf,
    port: u16,
}

impl TwoNodes {
    fn new(tag: &str) -> Self {
        let dir = temp_dir(tag);
        let secret = dir.0.join("secret");
        std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
        // Below the ephemeral range: a port drawn by binding port 0 was taken by another
        // test's connection before rank 0 bound it (seen once in CI: "Address already in use").
        let port = rpc_core::testing::free_port();
        Self { dir, secret, port }
    }

    /// Run `run` of two nodes of one launch, meeting at `127.0.0.1:port`, node `n` tracing
    /// to `run{run}-node{n}/job.json` (its own directory, as on hosts without a shared
    /// filesystem), each launch given `more`: the traces, and each node's exit with when it
    /// came, by node, within 2 minutes.
    fn run(
        &self,
        run: usize,
        more: impl Fn(rpcrun::Launch) -> rpcrun::Launch,
    ) -> (Vec<PathBuf>, Vec<(rpcrun::Exit, std::time::Instant)>) {
        let traces: Vec<PathBuf> = (0..2)
            .map(|n| {
                self.dir
                    .0
                    .join(format!("run{run}-node{n}"))
                    .join("job.json")
            })
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        for (node, trace) in traces.iter().enumerate() {
            let launch = rpcrun::Launch::new(env!("CARGO_BIN_EXE_trace-worker"))
                .nproc(1)
                .nodes(2, node as u32)
                .rendezvous(format!("127.0.0.1:{}", self.port))
                .secret_file(&self.secret)
                .stop_grace(Duration::from_secs(2))
                .trace(trace);
            let launch = more(launch);
            let tx = tx.clone();
            // On threads of their own, bounded: the children end with this process if it
            // overruns.
            std::thread::spawn(move || {
                let exit = launch.run();
                let _ = tx.send((node, exit, std::time::Instant::now()));
            });
        }
        let mut exits: Vec<Option<(rpcrun::Exit, std::time::Instant)>> = vec![None, None];
        for _ in 0..2 {
            let (node, exit, at) = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("each node's launch ends within 2 minutes");
            exits[node] = Some((exit.expect("the launch runs"), at));
        }
        let exits = exits.into_iter().map(|e| e.expect("both nodes")).collect();
        (traces, exits)
    }
}

/// TR-7 across hosts: two launches, one after the other, of two nodes meeting at one `--rdzv
/// HOST:PORT` (each node tracing to its own directory, as on hosts without a shared
/// filesystem) are two jobs, and the two nodes of each one job: a part of the first run
/// copied by hand beside the second's is left out of the second's merge. Both restart modes
/// (group: the rendezvous in node 0's rank 0; worker: in node 0's launcher). Both runs were
/// one job, `rpcrun 127.0.0.1:PORT`, named after the address. TR-8: node 0's merge has node
/// 1's rank too, sent to rank 0 at shutdown (before, it named rank 1 missing: its part was
/// only in node 1's directory).
#[test]
fn two_launches_at_one_address_are_two_jobs_and_each_one_job_on_every_node() {
    let nodes = TwoNodes::new("two-nodes");
    let mut jobs = Vec::new();
    for (run, restart) in RESTARTS.into_iter().enumerate() {
        let (traces, exits) = nodes.run(run, |l| l.restart(restart));
        for (node, (exit, _)) in exits.into_iter().enumerate() {
            assert_eq!(exit.code, 0, "run {run} node {node}: {exit:?}");
            if node == 0 {
                let merged = exit.trace.expect("node 0 merged the trace");
                let whole = (merged.parts, merged.missing.clone());
                assert_eq!(whole, (2, vec![]), "run {run}: {merged}");
            }
        }
        let (node0, node1) = (part_job(&traces[0], 0), part_job(&traces[1], 1));
        assert_eq!(
            node0, node1,
            "run {run}: the two nodes' parts name two jobs"
        );
        jobs.push((node0, traces));
    }
    assert_ne!(jobs[0].0, jobs[1].0, "the two launches are one job");
    // The first run's rank 1 part, copied by hand beside the second's: left out, named.
    let (first, second) = (&jobs[0].1, &jobs[1].1);
    let stale = rpc_core::trace::part_path(&second[0], 1, 0, 0);
    std::fs::copy(rpc_core::trace::part_path(&first[1], 1, 0, 0), &stale).unwrap();
    let s = rpc_core::trace::merge_parts(&second[0], None).expect("merged");
    assert_eq!((s.parts, s.stale.clone()), (1, vec![stale]), "{s:?}");
}

/// TR-9: a job on two nodes (each tracing to its own directory, as on hosts without a shared
/// filesystem), in both restart modes, that fails: rank 0, on node 0, exits at step 2, and rank 1, on node 1, ends
/// without a clean shutdown, so TR-8 sends nothing. Node 1's launcher sends its part to node
/// 0's, which merges both. (Before, node 0's merge held rank 0 alone and named rank 1
/// missing: its part stayed on node 1.)
#[test]
fn a_failed_jobs_trace_on_node_0_has_every_nodes_part() {
    let nodes = TwoNodes::new("two-nodes-failed");
    for (run, restart) in RESTARTS.into_iter().enumerate() {
        let (traces, exits) = nodes.run(run, |l| l.restart(restart).env("TRACE_FAIL_STEP", "2"));
        for (node, (exit, _)) in exits.iter().enumerate() {
            assert_ne!(exit.code, 0, "{restart:?} node {node}: {exit:?}");
        }
        let merged = exits[0].0.trace.clone().expect("node 0 merged the trace");
        let whole = (merged.parts, merged.missing.clone());
        assert_eq!(whole, (2, vec![]), "{restart:?}: {merged}");
        // The part node 1 sent is the one it wrote.
        let sent = rpc_core::trace::part_path(&traces[0], 1, 0, 0);
        let own = rpc_core::trace::part_path(&traces[1], 1, 0, 0);
        assert_eq!(std::fs::read(sent).unwrap(), std::fs::read(own).unwrap());
    }
}

/// TR-11: a node whose every process was killed outright (rank 1, node 1's only one, SIGKILLs
/// itself at step 2) has no part, and no part to name node 0's sink; its launcher still
/// knows the sink, from its child's status line, and says the node has nothing, so node 0's
/// launcher merges at once instead of waiting out its 15 s (`SINK_WAIT`) for node 1. Both
/// restart modes. (The merge has rank 1 all the same: `trace-worker`'s rank 1 enters its
/// shutdown at once and waits in the barrier, serving, so TR-8 sends rank 0 its part as it
/// stood then.)
#[test]
fn a_node_without_parts_costs_node_0_no_wait() {
    let nodes = TwoNodes::new("two-nodes-killed");
    for (run, restart) in RESTARTS.into_iter().enumerate() {
        let (traces, exits) = nodes.run(run, |l| l.restart(restart).env("TRACE_KILL_RANK", "1"));
        assert!(
            !rpc_core::trace::part_path(&traces[1], 1, 0, 0).exists(),
            "{restart:?}: rank 1 wrote a part"
        );
        assert!(
            exits[0].0.trace.is_some(),
            "{restart:?}: node 0 merged no trace"
        );
        let waited = exits[0].1.saturating_duration_since(exits[1].1);
        assert!(
            waited < Duration::from_secs(10),
            "{restart:?}: node 0 ended {waited:?} after node 1"
        );
    }
}

/// Kills the processes a test started, however it ends.
struct Group(Vec<std::process::Child>);

impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A rank whose monotonic clock runs 1000 s ahead (a time namespace): its part states an
/// offset of -1000 s within its bound, and after alignment its spans nest in its callers'.
#[test]
fn a_shifted_clock_is_recovered_within_the_stated_bound() {
    let probe = std::process::Command::new("unshare")
        .args(["--time", "--monotonic", "1", "--fork", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: `unshare --time` is not available here (needs root and Linux 5.6)");
        return;
    }
    let dir = temp_dir("skew");
    let trace = dir.0.join("job.json");
    let v = run(
        &trace,
        &[("TRACE_SKEW_RANK", "1"), ("TRACE_SKEW_SECS", "1000")],
    );
    let parts = v["otherData"]["rpc_trace"]["parts"].as_array().unwrap();
    let p1 = parts
        .iter()
        .find(|p| p["rank"] == 1)
        .expect("rank 1's part");
    let offset = p1["clock"]["offset_ns"].as_i64().unwrap();
    let bound = p1["clock"]["error_bound_ns"].as_u64().unwrap();
    let err = (offset + 1_000_000_000_000).unsigned_abs();
    assert!(
        err <= bound,
        "offset {offset} ns: {err} ns from -1000 s, bound {bound} ns"
    );
    assert!(bound < 5_000_000, "bound {bound} ns");
    assert_eq!(check_calls(&v), 12);
}

/// `v` as the report reads a trace.
fn file(v: &Value) -> rpcrun::report::TraceFile<'_> {
    rpcrun::report::TraceFile::from_value(v).expect("a trace")
}
