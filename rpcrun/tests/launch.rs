//! `rpcrun` as a user runs it, with `sh` scripts as the children: the variables each gets,
//! prefixed output, restarts, out-of-restarts status, signals forwarded, a frozen child, and no
//! child outliving a killed launcher.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{alive, scratch, start};

#[test]
fn every_rank_gets_its_variables_a_private_secret_and_prefixed_lines() {
    let dir = scratch("env");
    let mut r = start(
        &dir,
        &["--nproc", "3"],
        r#"echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lw=$LOCAL_WORLD_SIZE \
restart=$RPC_RESTART_COUNT master=$MASTER_ADDR:$MASTER_PORT \
secret=$(wc -c < "$RPC_SECRET_FILE") file=$RPC_SECRET_FILE"
echo "err $RANK" >&2"#,
    );
    assert_eq!(r.wait(Duration::from_secs(20)), Some(0), "{}", r.stderr());
    let out = r.stdout();
    let mut files = Vec::new();
    let mut ports = Vec::new();
    for rank in 0..3 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("[rank{rank}]: rank={rank} ")))
            .unwrap_or_else(|| panic!("no line of rank {rank}: {out}"));
        assert!(
            line.contains(&format!(
                "local={rank} world=3 lw=3 restart=0 master=127.0.0.1:"
            )),
            "{line}"
        );
        assert!(
            line.contains("secret=64 "),
            "a 32-byte secret in hex: {line}"
        );
        files.push(line.rsplit("file=").next().unwrap().to_owned());
        ports.push(
            line.split("master=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_owned(),
        );
        assert!(
            r.stderr().contains(&format!("[rank{rank}]: err {rank}")),
            "{}",
            r.stderr()
        );
    }
    assert!(files.iter().all(|f| *f == files[0]) && ports.iter().all(|p| *p == ports[0]));
    assert!(
        !Path::new(&files[0]).exists(),
        "the secret file is removed at the end"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_failed_rank_restarts_the_whole_group_with_the_count_raised() {
    let dir = scratch("restart");
    let mut r = start(
        &dir,
        &["--nproc", "2", "--max-restarts", "3"],
        r#"echo "start $RANK $RPC_RESTART_COUNT"
           # (after rank 0 has surely printed its line: the failure stops it)
           if [ "$RANK" = 1 ] && [ "$RPC_RESTART_COUNT" -lt 2 ]; then sleep 0.3; exit 3; fi
           if [ "$RPC_RESTART_COUNT" -lt 2 ]; then sleep 30; fi
           echo "done $RANK $RPC_RESTART_COUNT""#,
    );
    assert_eq!(r.wait(Duration::from_secs(30)), Some(0), "{}", r.stderr());
    let out = r.stdout();
    for rank in 0..2 {
        for restart in 0..3 {
            assert!(
                out.contains(&format!("[rank{rank}]: start {rank} {restart}")),
                "{out}"
            );
        }
        assert!(
            out.contains(&format!("[rank{rank}]: done {rank} 2")),
            "{out}"
        );
        // Rank 0 was stopped in the first two attempts, never finishing them.
        assert!(!out.contains(&format!("done {rank} 0")), "{out}");
    }
    let err = r.stderr();
    assert!(err.contains("rank 1 (pid"), "{err}");
    assert!(err.contains("exited with status 3"), "{err}");
    assert!(err.contains("restart 2 of 3"), "{err}");
    assert!(!err.contains("restart 3 of 3"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// TR-7: every child of a launch gets one job id, in every restart (each start's trace parts
/// are one job's), and another launch gets another.
#[test]
fn every_child_of_a_launch_gets_one_job_id_in_every_restart() {
    let mut ids = Vec::new();
    for launch in 0..2 {
        let dir = scratch(&format!("job-id-{launch}"));
        let mut r = start(
            &dir,
            &["--nproc", "2", "--max-restarts", "1"],
            r#"echo "job $RPC_JOB_ID"
               if [ "$RANK" = 1 ] && [ "$RPC_RESTART_COUNT" = 0 ]; then sleep 0.3; exit 3; fi"#,
        );
        assert_eq!(r.wait(Duration::from_secs(30)), Some(0), "{}", r.stderr());
        let out = r.stdout();
        let mut seen: Vec<&str> = out.lines().filter_map(|l| l.split("job ").nth(1)).collect();
        assert_eq!(seen.len(), 4, "{out}");
        seen.dedup();
        assert_eq!(seen.len(), 1, "{out}");
        assert!(!seen[0].is_empty(), "{out}");
        ids.push(seen[0].to_owned());
        std::fs::remove_dir_all(dir).unwrap();
    }
    assert_ne!(ids[0], ids[1]);
}

/// A node other than 0, traced, clears its own earlier parts as it starts (only node 0
/// cleared: an earlier run's parts stayed beside this run's, to be copied to node 0 with
/// them) and says where this run's parts are, since node 0 merges.
#[test]
fn every_node_clears_its_earlier_trace_parts_and_node_1_says_where_its_are() {
    let dir = scratch("trace-node-1");
    let parts = dir.join("job.json.parts");
    std::fs::create_dir_all(&parts).unwrap();
    let earlier = parts.join("rank-9-inc-0.json");
    std::fs::write(&earlier, "{}").unwrap();
    std::fs::write(dir.join("secret"), "0123456789abcdef0123456789abcdef").unwrap();
    let flags = [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv",
        "127.0.0.1:29999",
        "--secret-file",
        "secret",
        "--trace",
        "job.json",
    ];
    let mut r = start(&dir, &flags, "true");
    assert_eq!(r.wait(Duration::from_secs(30)), Some(0), "{}", r.stderr());
    assert!(!earlier.exists(), "the earlier part is still there");
    assert!(parts.is_dir());
    let err = r.stderr();
    assert!(err.contains("this node's trace parts are in"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn out_of_restarts_it_exits_with_the_failure_status() {
    let dir = scratch("out");
    let mut r = start(
        &dir,
        &["--nproc", "2", "--max-restarts", "1"],
        // Rank 1 fails a second after it starts, so that rank 0 has printed its line by then
        // (failing at once, it raced rank 0's echo: under load the launcher had stopped rank 0
        // of the second attempt before it printed).
        concat!(
            r#"echo "start $RANK $RPC_RESTART_COUNT"; "#,
            r#"if [ "$RANK" = 1 ]; then sleep 1; exit 7; fi; sleep 30"#
        ),
    );
    assert_eq!(r.wait(Duration::from_secs(30)), Some(7), "{}", r.stderr());
    assert!(r.stdout().contains("[rank0]: start 0 1"), "{}", r.stdout());
    assert!(r.stderr().contains("out of restarts"), "{}", r.stderr());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_rank_killed_by_a_signal_is_named_and_gives_128_plus_it() {
    let dir = scratch("killed");
    let mut r = start(
        &dir,
        &["--nproc", "2"],
        r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 30"#,
    );
    assert_eq!(r.wait(Duration::from_secs(30)), Some(137), "{}", r.stderr());
    assert!(
        r.stderr().contains("rank 0 (pid") && r.stderr().contains("killed by signal 9 (SIGKILL)"),
        "{}",
        r.stderr()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sigterm_is_forwarded_to_every_rank() {
    let dir = scratch("term");
    let mut r = start(
        &dir,
        &["--nproc", "2"],
        r#"trap 'echo "rank $RANK got TERM"; exit 0' TERM
echo ready
while :; do sleep 0.05; done"#,
    );
    r.await_lines("ready", 2);
    let t0 = Instant::now();
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(r.child.id() as i32, libc::SIGTERM) };
    assert_eq!(
        r.wait(Duration::from_secs(20)),
        Some(128 + 15),
        "{}",
        r.stderr()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "the children exited on the forwarded signal, not after the grace"
    );
    for rank in 0..2 {
        assert!(
            r.stdout()
                .contains(&format!("[rank{rank}]: rank {rank} got TERM")),
            "{}",
            r.stdout()
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_frozen_rank_is_stopped_when_another_fails() {
    let dir = scratch("frozen");
    let mut r = start(
        &dir,
        &["--nproc", "2", "--stop-grace-secs", "1"],
        r#"if [ "$RANK" = 0 ]; then echo $$ > pid0; kill -STOP $$; sleep 60; fi
sleep 0.5
exit 1"#,
    );
    assert_eq!(r.wait(Duration::from_secs(20)), Some(1), "{}", r.stderr());
    let pid: u32 = std::fs::read_to_string(dir.join("pid0"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(!alive(pid), "the frozen rank was ended");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn no_child_outlives_a_killed_launcher() {
    let dir = scratch("orphans");
    let r = start(
        &dir,
        &["--nproc", "2"],
        r#"echo $$ > "pid$RANK"; echo ready; exec sleep 60"#,
    );
    r.await_lines("ready", 2);
    let pids: Vec<u32> = (0..2)
        .map(|k| {
            std::fs::read_to_string(dir.join(format!("pid{k}")))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(pids.iter().all(|&p| alive(p)));
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(r.child.id() as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "children outlived the launcher: {pids:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(r);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_launches_are_refused_with_a_reason() {
    let dir = scratch("bad");
    let mut r = start(&dir, &["--nproc", "2", "--nnodes", "2"], "true");
    assert_eq!(r.wait(Duration::from_secs(20)), Some(1));
    assert!(r.stderr().contains("needs --rdzv"), "{}", r.stderr());
    let mut r = start(&dir, &["--nnodes", "2", "--rdzv", "127.0.0.1:1"], "true");
    assert_eq!(r.wait(Duration::from_secs(20)), Some(1));
    assert!(
        r.stderr().contains("needs a secret every node shares"),
        "{}",
        r.stderr()
    );
    let mut r = start(&dir, &["--secret-file", "/nonexistent/s"], "true");
    assert_eq!(r.wait(Duration::from_secs(20)), Some(1));
    assert!(
        r.stderr().contains("group secret /nonexistent/s"),
        "{}",
        r.stderr()
    );
    drop(r);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A rank that exits with `FATAL_EXIT_CODE` is not restarted, in either mode: the launcher
/// stops the others and ends with that status, its restarts unspent.
#[test]
fn a_fatal_exit_is_not_restarted() {
    for mode in ["group", "worker"] {
        let dir = scratch(&format!("fatal-{mode}"));
        let code = rpcrun::FATAL_EXIT_CODE;
        let mut r = start(
            &dir,
            &["--nproc", "2", "--max-restarts", "3", "--restart", mode],
            &format!(
                r#"echo "start $RANK $RPC_RESTART_COUNT"
if [ "$RANK" = 1 ]; then exit {code}; fi
sleep 30"#
            ),
        );
        assert_eq!(
            r.wait(Duration::from_secs(30)),
            Some(code),
            "{}",
            r.stderr()
        );
        assert!(!r.stdout().contains("start 1 1"), "{}", r.stdout());
        assert!(
            r.stderr().contains("a restart cannot help"),
            "{}",
            r.stderr()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// RDZ-1 with `--rdzv-timeout`: a launcher of node 1 whose process failed waits that long, not
/// 60 s, for node 0's rendezvous (here: nothing listens) before it ends with an error naming
/// it and the cause, and restarts nothing meanwhile; 0 still tries once.
#[test]
fn a_silent_rendezvous_ends_a_launcher_after_its_rdzv_timeout() {
    for secs in ["2", "0"] {
        let dir = scratch(&format!("rdzv-timeout-{secs}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        std::fs::write(dir.join("secret"), "0123456789abcdef0123456789abcdef").unwrap();
        let rdzv = format!("127.0.0.1:{port}");
        let flags = [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv",
            &rdzv,
            "--secret-file",
            "secret",
            "--max-restarts",
            "3",
            "--rdzv-timeout",
            secs,
        ];
        let started = Instant::now();
        let mut r = start(
            &dir,
            &flags,
            r#"echo "start $RANK $RPC_RESTART_COUNT"; exit 3"#,
        );
        assert_eq!(r.wait(Duration::from_secs(30)), Some(1), "{}", r.stderr());
        let took = started.elapsed();
        let err = r.stderr();
        let said = format!(
            "the rendezvous at {rdzv} did not answer within {secs} s of the failure (its host is \
             down, frozen or cut off): "
        );
        let cause = err
            .split(&said)
            .nth(1)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_default();
        assert!(
            cause.len() > "; not restarting".len() + 1,
            "no cause after {said:?}: {err}"
        );
        assert!(took < Duration::from_secs(15), "{took:?}: {err}");
        assert!(!r.stdout().contains("start 1 1"), "{}", r.stdout());
        drop(r);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
