//! Multi-process tests: real `rpc-test-worker` processes on 127.0.0.1:0. The test hosts the
//! rendezvous, hands the secret to the children through `RPC_SECRET`, and kills every child it
//! started when it ends (see `Procs`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rpc_core::{RendezvousServer, Secret, Transport};

/// Children that are killed and reaped when the test ends, however it ends.
struct Procs {
    children: Vec<Child>,
    lines: mpsc::Receiver<(u32, String)>,
    seen: Vec<(u32, String)>,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Procs {
    /// Waits for a line from `rank` starting with `prefix`; returns the rest. Lines read
    /// meanwhile are kept for later calls.
    fn expect(&mut self, rank: u32, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(i) = self
                .seen
                .iter()
                .position(|(r, l)| *r == rank && l.starts_with(prefix))
            {
                let (_, line) = self.seen.remove(i);
                return line[prefix.len()..].trim().to_owned();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((r, line)) => {
                    eprintln!("[rank {r}] {line}");
                    self.seen.push((r, line));
                }
                Err(_) => panic!("no `{prefix}` line from rank {rank} within {within:?}"),
            }
        }
    }

    /// Waits (bounded) for every child to exit; returns their exit codes.
    fn wait_all(&mut self, within: Duration) -> Vec<Option<i32>> {
        let deadline = Instant::now() + within;
        let mut codes = vec![None; self.children.len()];
        while Instant::now() < deadline && codes.iter().any(Option::is_none) {
            for (i, c) in self.children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    if let Ok(Some(s)) = c.try_wait() {
                        codes[i] = Some(s.code().unwrap_or(-1));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        codes
    }
}

fn start(scenarios: &[&str]) -> (tokio::runtime::Runtime, Procs) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let secret = Secret::generate();
    let world = scenarios.len() as u32;
    let server = rt
        .block_on(RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret.clone(),
            world,
            Duration::from_secs(30),
        ))
        .unwrap();
    let addr = server.local_addr().to_owned();
    // The server runs on `rt` until every worker joined.
    std::mem::forget(server);
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    for (rank, scenario) in scenarios.iter().enumerate() {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rpc-test-worker"))
            .args([
                scenario,
                "--rank",
                &rank.to_string(),
                "--world",
                &world.to_string(),
                "--rendezvous",
                &addr,
            ])
            .env("RPC_SECRET", secret.as_str().unwrap())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rpc-test-worker");
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((rank as u32, line));
            }
        });
        children.push(child);
    }
    (
        rt,
        Procs {
            children,
            lines,
            seen: Vec::new(),
        },
    )
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
