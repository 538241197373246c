//! The same binary joins a group however it was launched: the rank and world size a launcher
//! sets (torchrun's `RANK`/`WORLD_SIZE`, Slurm's `SLURM_PROCID`/`SLURM_NTASKS`, Open MPI's
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, MPICH's and Intel MPI's `PMI_RANK`/`PMI_SIZE`)
//! with `MASTER_ADDR`/`MASTER_PORT` and the secret. Three `hello-group` processes are started
//! with each set of variables, as that launcher would start them (two with torchrun's too).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills whatever is still running when the test ends, however it ends.
struct Group(Vec<Child>);
impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn launched_like(rank_var: &str, size_var: &str) {
    launched_n(rank_var, size_var, 3);
}

/// Starts `n` hello-group processes with `rank_var` and `size_var` set; checks they form one
/// group of `n` and succeed.
fn launched_n(rank_var: &str, size_var: &str, n: usize) {
    let port = common::free_port().to_string();
    let mut group = Group(Vec::new());
    for rank in 0..n {
        let child = Command::new(env!("CARGO_BIN_EXE_hello-group"))
            .env(rank_var, rank.to_string())
            .env(size_var, n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("RPC_SECRET", "launcher test secret, long enough")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts hello-group");
        group.0.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut codes = vec![None; n];
    while codes.iter().any(Option::is_none) {
        assert!(
            Instant::now() < deadline,
            "{rank_var}: the group did not finish: {codes:?}"
        );
        for (i, c) in group.0.iter_mut().enumerate() {
            if codes[i].is_none() {
                codes[i] = c.try_wait().expect("waits");
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut outputs = Vec::new();
    for c in std::mem::take(&mut group.0) {
        outputs.push(c.wait_with_output().expect("output"));
    }
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.status.success(),
            "{rank_var}: rank {rank} exited with {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // One group of the three launched ranks (a process that did not see its rank would run
    // a group of its own, as the program does when started by hand, and print this too).
    let stdout = |r: usize| String::from_utf8_lossy(&outputs[r].stdout).into_owned();
    let names: Vec<String> = (0..n).map(|r| format!("worker{r}")).collect();
    assert!(
        stdout(0).contains(&format!("group formed: {names:?}")),
        "{rank_var}: {}",
        stdout(0)
    );
    for r in 1..n {
        assert!(
            !stdout(r).contains("group formed"),
            "{rank_var}: rank {r} ran a group of its own"
        );
    }
}

#[test]
fn torchrun_variables() {
    launched_like("RANK", "WORLD_SIZE");
}

/// Launched, the tour runs in a group of any size from 2 (it called ranks 1 and 2 by number:
/// with 2 processes rank 0 failed with "no worker of rank 2 in this group of 2").
#[test]
fn a_launched_group_of_two_runs_the_tour() {
    launched_n("RANK", "WORLD_SIZE", 2);
}

#[test]
fn slurm_variables() {
    launched_like("SLURM_PROCID", "SLURM_NTASKS");
}

#[test]
fn open_mpi_variables() {
    launched_like("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
}

#[test]
fn mpich_variables() {
    launched_like("PMI_RANK", "PMI_SIZE");
}

/// RDV-8: `rpcrun` chooses the rendezvous's port and keeps it bound until rank 0 serves on it.
/// Here rank 0 starts only once another process (this test) has tried to take the port in
/// between, as any program on the host may (an outgoing connection's ephemeral port is
/// enough): the attempt fails and the launch succeeds with no restart. Before, the launcher
/// let the port go; the test took it, rank 0 failed with "cannot bind 127.0.0.1:PORT: Address
/// already in use" and, with no restart allowed, the launch exited 1 (CI met this race once).
#[test]
fn a_port_taken_before_rank_0_starts_cannot_fail_the_launch() {
    let hello = env!("CARGO_BIN_EXE_hello-group");
    let rpcrun = std::path::Path::new(hello).with_file_name("rpcrun");
    assert!(
        rpcrun.exists(),
        "{} is missing: build it first (cargo build -p rpcrun)",
        rpcrun.display()
    );
    let dir = std::env::temp_dir().join(format!("launchers-port-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Rank 0 says its port, then waits (at most 10 s) for the test to have tried it.
    let script = r#"if [ "$RANK" = 0 ]; then
        echo "$MASTER_PORT" > port.tmp && mv port.tmp port
        i=0; while [ ! -e tried ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
    fi
    exec "$HELLO""#;
    let child = Command::new(&rpcrun)
        .args([
            "--nproc",
            "3",
            "--max-restarts",
            "0",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("HELLO", hello)
        .env_remove("RPC_SECRET")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts rpcrun");
    let mut group = Group(vec![child]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let port = loop {
        if let Ok(p) = std::fs::read_to_string(dir.join("port")) {
            break p.trim().to_owned();
        }
        assert!(Instant::now() < deadline, "rank 0 never said its port");
        std::thread::sleep(Duration::from_millis(20));
    };
    let thief = std::net::TcpListener::bind(format!("127.0.0.1:{port}"));
    std::fs::write(dir.join("tried"), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while group.0[0].try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "rpcrun did not end within 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = group.0.remove(0).wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the launch failed ({}); the test took the port: {}\n{stderr}",
        out.status,
        thief.is_ok()
    );
    assert!(
        stdout.contains(r#"group formed: ["worker0", "worker1", "worker2"]"#),
        "{stdout}"
    );
    assert!(
        thief.is_err(),
        "the port was free to take before rank 0 started"
    );
    drop(thief);
    std::fs::remove_dir_all(dir).unwrap();
}
