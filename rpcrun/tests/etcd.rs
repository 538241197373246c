//! `rpcrun --rdzv etcd://...` as a user runs it, with `sh` as the children: a spare takes the
//! place of a killed node, a failure restarts every node and the end of the restarts ends
//! every launcher with one status, the same command run again starts a new run, and a frozen
//! launcher is fenced (ETC-1..4 in `rpcrun`'s etcd module).
//!
//! Each test starts its own etcd on loopback (Debian's `etcd-server`). Skipped, saying why,
//! where etcd is not installed or `rpcrun` was built without its `etcd` feature; `.ci/run`
//! runs them with both.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, scratch, start, Run};
use rpc_core::testing::free_port;

/// An etcd server on loopback, killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    dir: PathBuf,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Etcd {
    /// A fresh etcd, answering; `None` (the reason printed) where these tests cannot run.
    fn start(name: &str) -> Option<Self> {
        if !cfg!(feature = "etcd") {
            eprintln!("skipped: rpcrun was built without its etcd feature (--features etcd)");
            return None;
        }
        if Command::new("etcd").arg("--version").output().is_err() {
            eprintln!("skipped: etcd is not installed (Debian: apt-get install etcd-server)");
            return None;
        }
        let dir = scratch(&format!("etcd-{name}"));
        // Drawn below the ephemeral range, where no other test's connection can take them
        // before etcd binds them (RDV-8).
        let client = free_port();
        let peer = (0..8).map(|_| free_port()).find(|&p| p != client);
        let peer = peer.expect("a second free port");
        let endpoint = format!("127.0.0.1:{client}");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .arg(format!("--listen-client-urls=http://{endpoint}"))
            .arg(format!("--advertise-client-urls=http://{endpoint}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=t=http://127.0.0.1:{peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn()
            .unwrap();
        let etcd = Self {
            child,
            endpoint,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&etcd.endpoint).is_err() {
            assert!(Instant::now() < deadline, "etcd did not start within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::fs::write(etcd.dir.join("secret"), "an etcd test's secret").unwrap();
        Some(etcd)
    }

    /// A launcher of job `job` with `--nnodes 2` and `flags`, its children running `script`.
    fn launcher(&self, job: &str, i: usize, flags: &[&str], script: &str) -> Run {
        let dir = self.dir.join(format!("{job}-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let rdzv = format!("etcd://{}/{job}", self.endpoint);
        let secret = self.dir.join("secret");
        let mut all = vec!["--nnodes", "2", "--rdzv", &rdzv, "--secret-file"];
        all.push(secret.to_str().unwrap());
        all.extend(flags);
        start(&dir, &all, script)
    }
}

/// Waits (at most 30 s) until one of `runs` says `what` on stderr; its index.
fn await_said(runs: &[&Run], what: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(i) = runs.iter().position(|r| r.stderr().contains(what)) {
            return i;
        }
        assert!(Instant::now() < deadline, "nobody said {what:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pids of `pid`'s children.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, sig) };
}

/// The two launchers of round 0 (node 0 first), and a third started after them, waiting as a
/// spare (ETC-1).
fn two_and_a_spare(etcd: &Etcd, job: &str, flags: &[&str], script: &str) -> (Run, Run, Run) {
    let mut a = etcd.launcher(job, 0, flags, script);
    let mut b = etcd.launcher(job, 1, flags, script);
    await_said(&[&a, &b], "node 1 of 2");
    if await_said(&[&a, &b], "node 0 of 2") == 1 {
        std::mem::swap(&mut a, &mut b);
    }
    let spare = etcd.launcher(job, 2, flags, script);
    await_said(&[&spare], "waiting as a spare");
    (a, b, spare)
}

#[test]
fn a_spare_takes_the_place_of_a_killed_node() {
    let Some(etcd) = Etcd::start("killed") else {
        return;
    };
    let script = "if [ $RPC_RESTART_COUNT = 0 ]; then sleep 60; fi; \
                  echo rank $RANK restart $RPC_RESTART_COUNT done";
    let (mut node0, mut node1, mut spare) =
        two_and_a_spare(&etcd, "killed", &["--max-restarts", "2"], script);
    let t0 = Instant::now();
    node0.child.kill().unwrap();
    let _ = node0.child.wait();
    for run in [&mut node1, &mut spare] {
        assert_eq!(
            run.wait(Duration::from_secs(40)),
            Some(0),
            "{}",
            run.stderr()
        );
        assert!(run.stdout().contains("restart 1 done"), "{}", run.stdout());
    }
    // The lease's TTL (5 s) and a poll: the round ends, the spare joins, the job ends.
    eprintln!("killed node 0: the job ended {:?} later", t0.elapsed());
    // Whichever of the two saw it first began round 1.
    let said = node1.stderr() + &spare.stderr();
    assert!(said.contains("left round 0"), "{said}");
}

#[test]
fn a_failure_restarts_every_node_and_out_of_restarts_ends_every_launcher_with_its_status() {
    let Some(etcd) = Etcd::start("fails") else {
        return;
    };
    // Rank 1 fails once the test says so (at most 30 s later): failing at once, it could end
    // round 0 before the third launcher came, which then joined the restart as a node
    // instead of waiting as a spare (seen once in CI under load).
    let go = etcd.dir.join("go");
    let script = format!(
        "echo rank $RANK restart $RPC_RESTART_COUNT; if [ $RANK = 1 ]; then \
         for i in $(seq 300); do [ -e {go} ] && break; sleep 0.1; done; exit 3; fi; sleep 60",
        go = go.display()
    );
    let (mut a, mut b, mut spare) =
        two_and_a_spare(&etcd, "fails", &["--max-restarts", "1"], &script);
    std::fs::write(&go, "").unwrap();
    for run in [&mut a, &mut b, &mut spare] {
        // ETC-4: one status for every launcher, the spare's included.
        assert_eq!(
            run.wait(Duration::from_secs(40)),
            Some(3),
            "{}",
            run.stderr()
        );
    }
    let all = [&a, &b, &spare].map(|r| r.stderr()).concat();
    assert!(
        all.contains("restarting the job on every node (restart 1 of 1)"),
        "{all}"
    );
    assert!(
        all.contains("ending the job with status 3 (out of restarts: 1 used)"),
        "{all}"
    );
    let out = [&a, &b, &spare].map(|r| r.stdout()).concat();
    assert!(out.contains("restart 1"), "{out}");
    assert!(!out.contains("restart 2"), "{out}");
}

#[test]
fn the_same_command_run_again_starts_a_new_run() {
    let Some(etcd) = Etcd::start("again") else {
        return;
    };
    let script = "echo rank $RANK restart $RPC_RESTART_COUNT";
    for round in 0..2 {
        let mut a = etcd.launcher("again", 2 * round, &[], script);
        let mut b = etcd.launcher("again", 2 * round + 1, &[], script);
        for run in [&mut a, &mut b] {
            assert_eq!(
                run.wait(Duration::from_secs(30)),
                Some(0),
                "{}",
                run.stderr()
            );
            assert!(run.stdout().contains("restart 0"), "{}", run.stdout());
        }
        let said = a.stderr() + &b.stderr();
        assert_eq!(
            said.contains("the job's last run ended with status 0; starting a new run"),
            round == 1,
            "{said}"
        );
    }
}

/// `--trace` with an etcd rendezvous (it was refused: "not supported yet"): every node's
/// children are traced, all under one job name (the job's run in etcd), and node 0 merges
/// the parts on the shared path, leaving out one an earlier run left there (TR-7); the
/// other node says where its own parts are. The children write their parts as a traced
/// worker would.
#[test]
fn a_job_meeting_in_etcd_is_traced_into_one_file() {
    let Some(etcd) = Etcd::start("trace") else {
        return;
    };
    let trace = etcd.dir.join("job.json");
    let parts = etcd.dir.join("job.json.parts");
    std::fs::create_dir_all(&parts).unwrap();
    let stale = parts.join("rank-2-inc-0.json");
    let part = serde_json::json!({"traceEvents": [], "otherData": {"rpc_trace":
        {"rank": 2, "ranks": [0, 1, 2], "job": "an earlier run"}}});
    std::fs::write(&stale, part.to_string()).unwrap();
    let ago = std::time::SystemTime::now() - Duration::from_secs(60);
    let f = std::fs::File::options().write(true).open(&stale).unwrap();
    f.set_modified(ago).unwrap();
    let script = concat!(
        r#"printf '{"traceEvents":[],"otherData":{"rpc_trace":"#,
        r#"{"rank":%s,"ranks":[0,1],"job":"%s"}}}' "$RANK" "$RPC_JOB_ID" "#,
        r#"> "$RPC_TRACE.parts/rank-$RANK-inc-0.json""#
    );
    let flags = ["--trace", trace.to_str().unwrap()];
    let mut a = etcd.launcher("trace", 0, &flags, script);
    let mut b = etcd.launcher("trace", 1, &flags, script);
    for run in [&mut a, &mut b] {
        assert_eq!(
            run.wait(Duration::from_secs(30)),
            Some(0),
            "{}",
            run.stderr()
        );
    }
    let (said_a, said_b) = (a.stderr(), b.stderr());
    let (node0, other) = match said_a.contains("node 0 of 2") {
        true => (said_a, said_b),
        false => (said_b, said_a),
    };
    assert!(node0.contains("2 parts, 0 events"), "{node0}");
    assert!(
        node0.contains("left out 1 part(s) an earlier job left at this path"),
        "{node0}"
    );
    assert!(other.contains("this node's trace parts are in"), "{other}");
    let merged: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let jobs: Vec<&str> = merged["otherData"]["rpc_trace"]["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["job"].as_str().unwrap())
        .collect();
    assert_eq!(jobs.len(), 2, "{merged}");
    assert!(
        jobs.iter()
            .all(|j| *j == jobs[0] && j.starts_with("trace/")),
        "{jobs:?}"
    );
}

/// TR-9 with etcd: a job that fails (each child writes its part, then exits 3), each node
/// tracing to its own directory (hosts without a shared filesystem). Node 1's launcher sends
/// its part to node 0's sink, which etcd names, and node 0 merges both at once. (Before, node
/// 0's merge held its own rank alone and named rank 1 missing.)
#[test]
fn a_failed_job_meeting_in_etcd_is_traced_whole_on_node_0() {
    let Some(etcd) = Etcd::start("failed-trace") else {
        return;
    };
    let script = concat!(
        r#"printf '{"traceEvents":[],"otherData":{"rpc_trace":"#,
        r#"{"rank":%s,"ranks":[0,1],"job":"%s"}}}' "$RANK" "$RPC_JOB_ID" "#,
        r#"> "$RPC_TRACE.parts/rank-$RANK-inc-0.json"; exit 3"#
    );
    let traces: Vec<PathBuf> = (0..2)
        .map(|i| etcd.dir.join(format!("node{i}")).join("job.json"))
        .collect();
    let flags = |i: usize| ["--trace", traces[i].to_str().unwrap()];
    let mut a = etcd.launcher("failed-trace", 0, &flags(0), script);
    let mut b = etcd.launcher("failed-trace", 1, &flags(1), script);
    let t0 = Instant::now();
    for run in [&mut a, &mut b] {
        let code = run.wait(Duration::from_secs(30));
        assert_eq!(code, Some(3), "{}", run.stderr());
    }
    let (said_a, said_b) = (a.stderr(), b.stderr());
    let (node0, other) = match said_a.contains("node 0 of 2") {
        true => (said_a, said_b),
        false => (said_b, said_a),
    };
    assert!(node0.contains("2 parts, 0 events"), "{node0}");
    assert!(other.contains("sent to node 0"), "{other}");
    // Node 0 heard from the other at once: it did not wait out its bound (15 s).
    assert!(t0.elapsed() < Duration::from_secs(14), "{:?}", t0.elapsed());
}

/// TR-7 across etcds: the same job run again on a fresh etcd (one started per experiment,
/// its data gone) is another run, so the earlier run's parts at the same trace path are left
/// out. Both runs were named `<job>/0`, and the earlier run's extra ranks were merged into
/// this run's trace as its own ("4 parts").
#[test]
fn a_rerun_on_a_fresh_etcd_is_another_job() {
    let dir = scratch("etcd-rerun-trace");
    let trace = dir.join("job.json");
    let flags = ["--trace", trace.to_str().unwrap()];
    let script = |extra: &str, ranks: &str| {
        format!(
            concat!(
                r#"for r in $RANK {}; do printf '{{"traceEvents":[],"otherData":"#,
                r#"{{"rpc_trace":{{"rank":%s,"ranks":{},"job":"%s"}}}}}}' "$r" "$RPC_JOB_ID" "#,
                r#"> "$RPC_TRACE.parts/rank-$r-inc-0.json"; done"#
            ),
            extra, ranks
        )
    };
    let mut said = Vec::new();
    for (run, script) in [
        ("first", script("$((RANK + 2))", "[0,1,2,3]")),
        ("second", script("", "[0,1]")),
    ] {
        let Some(etcd) = Etcd::start(&format!("rerun-{run}")) else {
            let _ = std::fs::remove_dir_all(&dir);
            return;
        };
        let mut a = etcd.launcher("rerun", 0, &flags, &script);
        let mut b = etcd.launcher("rerun", 1, &flags, &script);
        for r in [&mut a, &mut b] {
            assert_eq!(r.wait(Duration::from_secs(30)), Some(0), "{}", r.stderr());
        }
        said.push(a.stderr() + &b.stderr());
        // A part written in the same millisecond as the next run's would tie on its time.
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(said[0].contains("4 parts, 0 events"), "{}", said[0]);
    assert!(said[1].contains("2 parts, 0 events"), "{}", said[1]);
    assert!(
        said[1].contains("left out 2 part(s) an earlier job left at this path"),
        "{}",
        said[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_frozen_launcher_is_fenced() {
    let Some(etcd) = Etcd::start("frozen") else {
        return;
    };
    let script =
        "if [ $RPC_RESTART_COUNT = 0 ]; then sleep 60; fi; echo restart $RPC_RESTART_COUNT";
    let (mut node0, mut node1, mut spare) =
        two_and_a_spare(&etcd, "frozen", &["--max-restarts", "2"], script);
    let pid = node0.child.id();
    let kids = children_of(pid);
    assert!(!kids.is_empty());
    signal(pid, libc::SIGSTOP);
    // The others go on without it (its lease expires: ETC-2) and finish the job.
    for run in [&mut node1, &mut spare] {
        assert_eq!(
            run.wait(Duration::from_secs(40)),
            Some(0),
            "{}",
            run.stderr()
        );
    }
    // Thawed, it stops the processes it left running and ends with the job's status.
    let t0 = Instant::now();
    signal(pid, libc::SIGCONT);
    assert_eq!(
        node0.wait(Duration::from_secs(30)),
        Some(0),
        "{}",
        node0.stderr()
    );
    assert!(t0.elapsed() < Duration::from_secs(30));
    for k in kids {
        assert!(!alive(k), "the frozen launcher's child {k} outlived it");
    }
    let said = node0.stderr();
    assert!(said.contains("stopped this node's processes"), "{said}");
}

/// The refusals need no etcd.
#[test]
fn launches_etcd_cannot_serve_are_refused_with_a_reason() {
    let dir = scratch("etcd-refused");
    let why = |flags: &[&str]| {
        let mut all = vec!["--nnodes", "2", "--rdzv", "etcd://127.0.0.1:1/j"];
        all.extend(flags);
        let mut run = start(&dir, &all, "true");
        assert_eq!(run.wait(Duration::from_secs(10)), Some(1));
        run.stderr()
    };
    if cfg!(feature = "etcd") {
        assert!(why(&["--node-rank", "1"]).contains("--node-rank is not given"));
        assert!(why(&["--restart", "worker"]).contains("with etcd, restarts are of the group"));
    } else {
        assert!(why(&[]).contains("built without etcd"));
    }
    assert!(Path::new(&dir).exists());
}
