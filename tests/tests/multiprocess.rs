//! Multi-process tests: real `rpc-test-worker` processes on 127.0.0.1:0. The test hosts the
//! rendezvous, hands the secret to the children through `RPC_SECRET`, and kills every child it
//! started when it ends (see `Procs`).

use std::time::Duration;

use integration_tests::procs::{self, Procs};

fn start(scenarios: &[&str]) -> (tokio::runtime::Runtime, Procs) {
    procs::start(env!("CARGO_BIN_EXE_rpc-test-worker"), scenarios, &[])
}

#[test]
fn three_processes_call_each_other() {
    let (_rt, mut p) = start(&["drive", "serve", "serve"]);
    let result = p.expect(0, "RESULT", Duration::from_secs(60));
    let v: serde_json::Value = serde_json::from_str(&result).unwrap();
    assert_eq!(v["sum"], 42);
    assert_eq!(v["hops"], 50);
    assert_eq!(v["echo_ok"], true);
    assert_eq!(v["shared_echo_ok"], true);
    match rpc_core::testing::shared_memory_probe() {
        Ok(()) => assert!(v["shared_blobs"].as_u64().unwrap() >= 2, "{v}"),
        Err(why) => {
            eprintln!("no shared memory on this host ({why})");
            assert_eq!(v["shared_blobs"], 0, "{v}");
        }
    }
    assert_eq!(v["whoami"], serde_json::json!(["worker0", "worker2"]));
    assert_eq!(v["error_worker"], "worker1");
    assert_eq!(v["error_chain"], serde_json::json!(["disk quota exceeded"]));
    assert_eq!(v["panic_kind"], "Some(Panic)");
    assert_eq!(v["after_panic"], 2);
    for rank in 0..3 {
        assert_eq!(
            p.expect(rank, "SHUTDOWN", Duration::from_secs(30)),
            "clean=true barrier=Ok(())"
        );
    }
    assert_eq!(p.wait_all(Duration::from_secs(30)), vec![Some(0); 3]);
}

#[test]
fn a_killed_peer_fails_the_call_in_flight_and_shutdown_still_ends() {
    let (_rt, mut p) = start(&["drive-kill", "hold", "serve"]);
    for rank in 0..3 {
        p.expect(rank, "READY", Duration::from_secs(30));
    }
    p.expect(0, "CALLING", Duration::from_secs(30));
    // Let the call reach worker1, then kill it.
    std::thread::sleep(Duration::from_millis(300));
    p.children[1].kill().unwrap();
    // The failure detector finds the process gone (its heartbeat connection closed and
    // nothing listens at its address), and the call ends with that verdict.
    let err: serde_json::Value =
        serde_json::from_str(&p.expect(0, "ERROR", Duration::from_secs(20))).unwrap();
    assert_eq!(err["kind"], "PeerFailed:worker1", "{err}");
    assert!(err["after_ms"].as_u64().unwrap() < 10_000, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("worker1"),
        "{err}"
    );
    // The same for a blocking call on its thread's own connection.
    let err: serde_json::Value =
        serde_json::from_str(&p.expect(0, "SYNC_ERROR", Duration::from_secs(20))).unwrap();
    assert_eq!(err["kind"], "PeerFailed:worker1", "{err}");
    assert!(err["after_ms"].as_u64().unwrap() < 10_000, "{err}");
    // The survivors' shutdown barrier misses rank 1; rank 0 (timeout 60 s) does not wait
    // for a rank declared failed (AG-6), and names it.
    let s0 = p.expect(0, "SHUTDOWN", Duration::from_secs(15));
    assert!(s0.contains("[1]"), "rank 0 names the missing rank: {s0}");
    assert!(s0.contains("declared failed"), "{s0}");
    let s2 = p.expect(2, "SHUTDOWN", Duration::from_secs(30));
    assert!(
        s2.contains("[1]"),
        "rank 0 tells the others who was missing: {s2}"
    );
    let codes = p.wait_all(Duration::from_secs(30));
    assert_eq!((codes[0], codes[2]), (Some(0), Some(0)));
}

#[test]
fn remote_references_across_processes_are_counted_exactly() {
    let (_rt, mut p) = start(&["drive-rref", "serve", "serve"]);
    let result = p.expect(0, "RESULT", Duration::from_secs(60));
    let v: serde_json::Value = serde_json::from_str(&result).unwrap();
    assert_eq!(v["read_by_2"], 9);
    assert_eq!(v["method"], 9);
    assert_eq!(v["fetched"], 9);
    assert_eq!(
        v["quiescent"], true,
        "no owner values, user refs or pending forks left: {v}"
    );
    for rank in 0..3 {
        assert_eq!(
            p.expect(rank, "SHUTDOWN", Duration::from_secs(30)),
            "clean=true barrier=Ok(())"
        );
    }
    assert_eq!(p.wait_all(Duration::from_secs(30)), vec![Some(0); 3]);
}

#[test]
fn distributed_backward_across_processes_matches_one_process() {
    let (_rt, mut p) = start(&["drive-autograd", "serve", "serve"]);
    let result = p.expect(0, "RESULT", Duration::from_secs(60));
    let v: serde_json::Value = serde_json::from_str(&result).unwrap();
    let d = v["max_abs_diff"].as_f64().unwrap();
    assert!(d <= 1e-6, "max abs diff {d}");
    for rank in 0..3 {
        assert_eq!(
            p.expect(rank, "SHUTDOWN", Duration::from_secs(30)),
            "clean=true barrier=Ok(())"
        );
    }
    assert_eq!(p.wait_all(Duration::from_secs(30)), vec![Some(0); 3]);
}

/// A worker process joins a running group of processes with a new rank: ranks 0 and 1 form a
/// group of 2 that may grow to 4 (`RPC_MAX_WORLD_SIZE`); a third process starts later as rank
/// 3, calls both, is called by rank 0, and leaves; the two others shut down cleanly without
/// it (and without rank 2, which never came).
#[test]
fn a_worker_process_joins_a_running_group_and_leaves_it() {
    let (_rt, server, secret) = procs::rendezvous(rpc_core::GroupSize::growing(2, 4));
    let addr = server.local_addr().to_owned();
    let program = env!("CARGO_BIN_EXE_rpc-test-worker");
    let env = [("RPC_MAX_WORLD_SIZE", "4")];
    let mut group = procs::spawn(
        program,
        &[(0, "drive-grow"), (1, "serve")],
        2,
        &addr,
        &secret,
        &env,
    );
    group.expect(0, "READY", Duration::from_secs(30));
    group.expect(1, "READY", Duration::from_secs(30));
    let mut late = procs::spawn(program, &[(3, "join-leave")], 2, &addr, &secret, &env);
    assert_eq!(late.expect(3, "JOINED", Duration::from_secs(30)), "10");
    assert_eq!(
        late.expect(3, "LEFT", Duration::from_secs(30)),
        "clean=true"
    );
    let v: serde_json::Value =
        serde_json::from_str(&group.expect(0, "RESULT", Duration::from_secs(60))).unwrap();
    assert_eq!(
        v["newcomer"]["whoami"],
        serde_json::json!(["worker0", "worker3"]),
        "{v}"
    );
    assert_eq!(v["newcomer"]["sum"], 42, "{v}");
    assert_eq!(v["world_size"], 4, "{v}");
    assert_eq!(v["members"], 3, "{v}");
    let changes: Vec<(u64, u64, String)> = v["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["generation"].as_u64().unwrap(),
                c["rank"].as_u64().unwrap(),
                c["change"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        [(1, 3, "Joined".to_owned()), (2, 3, "Left".to_owned())],
        "{v}"
    );
    for rank in 0..2 {
        assert_eq!(
            group.expect(rank, "SHUTDOWN", Duration::from_secs(30)),
            "clean=true barrier=Ok(())"
        );
    }
    assert_eq!(group.wait_all(Duration::from_secs(30)), vec![Some(0); 2]);
    assert_eq!(late.wait_all(Duration::from_secs(30)), vec![Some(0)]);
    drop(server);
}
