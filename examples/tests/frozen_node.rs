//! A frozen process on another node of a multi-node launch (issue: "no frozen process anywhere
//! hangs a launch"). Three `rpcrun --nnodes 3 --nproc 1` launchers on loopback run the hybrid
//! example; node 1's only child is stopped with SIGSTOP mid-run. Node 1's launcher must end it
//! (SUP-1: it stopped reporting), the run must recover, in both restart modes, and every
//! launcher must exit 0 with the parameters of an uninterrupted run, within a bound. Before,
//! node 1's launcher waited for ever beside its stopped child, and the others gave up.

use std::path::Path;
use std::time::{Duration, Instant};

mod common;
use common::{alive, last_json, ranks_of, rpcrun_beside, run_to_end, signal, Spawned};

const FLAGS: [&str; 14] = [
    "--embedding",
    "8",
    "--hidden",
    "16",
    "--head-hidden",
    "16",
    "--train-limit",
    "6400",
    "--test-limit",
    "200",
    "--epochs",
    "1",
    "--checkpoint-every",
    "20",
];

/// A stopped process is continued and killed at the end, however the test ends.
struct Frozen(Option<u32>);
impl Drop for Frozen {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            signal(pid, libc::SIGKILL);
            signal(pid, libc::SIGCONT);
        }
    }
}

fn done_steps(out: &Path) -> u64 {
    std::fs::read_to_string(out.join("progress"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn freeze_node_1(restart: &str, reference: &str, rpcrun: &Path) {
    let dir = std::env::temp_dir().join(format!("frozen-{restart}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("run");
    std::fs::create_dir_all(&out).unwrap();
    let mut program: Vec<String> = vec![env!("CARGO_BIN_EXE_hybrid-rnn").into()];
    program.extend(FLAGS.iter().map(|s| s.to_string()));
    program.extend([
        "--quiet".into(),
        "--out-dir".into(),
        out.display().to_string(),
    ]);
    // The program's own recovery follows the launcher's mode.
    program.extend(["--restart".into(), restart.into()]);
    let mut nodes = launch_nodes(&dir, rpcrun, (3, 1), restart, &program);
    let deadline = Instant::now() + Duration::from_secs(120);
    while done_steps(&out) < 30 {
        assert!(
            Instant::now() < deadline,
            "no step 30: {}",
            nodes[0].stderr()
        );
        assert!(
            nodes[0].child.try_wait().unwrap().is_none(),
            "{}",
            nodes[0].stderr()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_, pid) = ranks_of(nodes[1].child.id())[0];
    let mut frozen = Frozen(Some(pid));
    signal(pid, libc::SIGSTOP);
    let stopped = Instant::now();
    // Bound: detection (1.5 s), the kill (2.25 s after the last report), the restart and the
    // replayed steps; 120 s leaves room for a loaded machine.
    let codes: Vec<Option<i32>> = nodes
        .iter_mut()
        .map(|n| n.wait(Duration::from_secs(120)))
        .collect();
    let took = stopped.elapsed();
    let errs: Vec<String> = nodes.iter().map(Spawned::stderr).collect();
    assert!(!alive(pid), "the frozen child outlived its launcher");
    frozen.0 = None;
    assert_eq!(codes, [Some(0); 3], "{restart}: {errs:#?}");
    assert!(
        errs[1].contains("gave no sign of life") && errs[1].contains("killing it"),
        "{restart}: node 1's launcher did not end its frozen child: {}",
        errs[1]
    );
    let j = last_json(&nodes[0].stdout().replace("[rank0]: ", ""), &errs[0]);
    assert_eq!(j["params_sha256"], reference, "{restart}: {errs:#?}");
    eprintln!("{restart}: frozen at step >= 30, every launcher done {took:?} later");
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_frozen_child_on_another_node_is_ended_and_the_run_recovers() {
    let bin = Path::new(env!("CARGO_BIN_EXE_hybrid-rnn"))
        .parent()
        .unwrap();
    let rpcrun = bin.join("rpcrun");
    if !rpcrun.exists() {
        eprintln!(
            "skipped: no rpcrun binary in {} (cargo build -p rpcrun)",
            bin.display()
        );
        return;
    }
    let ref_dir = std::env::temp_dir().join(format!("frozen-ref-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ref_dir);
    let ref_out = ref_dir.display().to_string();
    let mut args: Vec<&str> = FLAGS.to_vec();
    args.extend(["--quiet", "--out-dir", &ref_out]);
    let (code, out, err) = run_to_end(
        env!("CARGO_BIN_EXE_hybrid-rnn"),
        &args,
        Duration::from_secs(300),
    );
    let _ = std::fs::remove_dir_all(&ref_dir);
    assert_eq!(code, Some(0), "{err}");
    let reference = last_json(&out, &err)["params_sha256"]
        .as_str()
        .unwrap()
        .to_owned();
    for restart in ["group", "worker"] {
        freeze_node_1(restart, &reference, &rpcrun);
    }
}

/// RDZ-2: a rank on another node lost after the job's last step. Two `rpcrun --nnodes 2
/// --nproc 3 --restart worker` launchers run the parameter server; trainer 2 (rank 5, node 1)
/// stops itself (SIGSTOP) right after its last push, and the test stops node 1's launcher too
/// until node 0's processes are done, so that it asks the rendezvous only after the job ended
/// without rank 5 (on a real cluster: a cut, or a slow node). Node 0's launcher still answers
/// that the job has ended, and node 1's exits 0 without restarting rank 5. Before, node 0's
/// launcher exited at once, and node 1's found no rendezvous, waited 60 s for it (RDZ-1) and
/// exited 1 for a job that had succeeded.
#[test]
fn a_rank_lost_after_the_job_ended_does_not_fail_its_node() {
    let ps = env!("CARGO_BIN_EXE_param-server");
    let Some(rpcrun) = rpcrun_beside(ps) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("frozen-end-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let program: Vec<String> = [ps, "--steps", "60", "--slow-factor", "1"]
        .into_iter()
        .chain(["--freeze-trainer-at", "60"])
        .map(String::from)
        .collect();
    let mut nodes = launch_nodes(&dir, &rpcrun, (2, 3), "worker", &program);
    // Rank 5 stops itself after its last push; its launcher is stopped at once after.
    let deadline = Instant::now() + Duration::from_secs(120);
    let launcher = nodes[1].child.id();
    loop {
        let stopped = ranks_of(launcher)
            .into_iter()
            .any(|(r, pid)| r == 5 && stopped(pid));
        if stopped {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rank 5 never stopped: {}",
            nodes[1].stderr()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let _held = Frozen(Some(launcher));
    signal(launcher, libc::SIGSTOP);
    // Node 0's processes are done: it says so, lingering (RDZ-2), or it exited (before).
    while !nodes[0].stderr().contains("telling their launchers")
        && nodes[0].child.try_wait().unwrap().is_none()
    {
        assert!(
            Instant::now() < deadline,
            "node 0 never ended: {}",
            nodes[0].stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(launcher, libc::SIGCONT);
    let codes: Vec<Option<i32>> = nodes
        .iter_mut()
        .map(|n| n.wait(Duration::from_secs(120)))
        .collect();
    let errs: Vec<String> = nodes.iter().map(Spawned::stderr).collect();
    assert_eq!(codes, [Some(0); 2], "{errs:#?}");
    assert!(
        errs[1].contains("the job ended meanwhile") && !errs[1].contains("restarting rank 5 alone"),
        "node 1 did not hear that the job had ended: {}",
        errs[1]
    );
    let j = last_json(&nodes[0].stdout().replace("[rank0]: ", ""), &errs[0]);
    assert_eq!(j["updates_lost"], 0, "{j}");
    assert_eq!(j["trainers_lost_at_the_end"], serde_json::json!([2]), "{j}");
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `nnodes` launchers of `nproc` processes each on loopback (`--restart restart`, three
/// restarts), meeting at a free port with a shared secret, each in its own directory under
/// `dir`, running `program` (its path, then its flags).
fn launch_nodes(
    dir: &Path,
    rpcrun: &Path,
    (nnodes, nproc): (u32, u32),
    restart: &str,
    program: &[String],
) -> Vec<Spawned> {
    let secret = dir.join("secret");
    std::fs::write(&secret, "a test secret of the launchers").unwrap();
    let rdzv = format!("127.0.0.1:{}", common::free_port());
    (0..nnodes)
        .map(|i| {
            let d = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&d).unwrap();
            let mut args: Vec<String> = [
                "--nnodes",
                &nnodes.to_string(),
                "--nproc",
                &nproc.to_string(),
                "--node-rank",
                &i.to_string(),
                "--rdzv",
                &rdzv,
                "--secret-file",
                secret.to_str().unwrap(),
                "--max-restarts",
                "3",
                "--restart",
                restart,
                "--",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(program.iter().cloned());
            Spawned::start(rpcrun.to_str().unwrap(), &args, &[], &d)
        })
        .collect()
}

/// Whether process `pid` is stopped (state `T`).
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
        .unwrap_or(false)
}
