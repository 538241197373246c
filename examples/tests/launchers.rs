//! The same binary joins a group however it was launched: the rank and world size a launcher
//! sets (torchrun's `RANK`/`WORLD_SIZE`, Slurm's `SLURM_PROCID`/`SLURM_NTASKS`, Open MPI's
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, MPICH's and Intel MPI's `PMI_RANK`/`PMI_SIZE`)
//! with `MASTER_ADDR`/`MASTER_PORT` and the secret. Three `hello-group` processes are started
//! with each set of variables, as that launcher would start them.

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn launched_like(rank_var: &str, size_var: &str) {
    let port = free_port().to_string();
    let mut group = Group(Vec::new());
    for rank in 0..3 {
        let child = Command::new(env!("CARGO_BIN_EXE_hello-group"))
            .env(rank_var, rank.to_string())
            .env(size_var, "3")
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
    let mut codes = vec![None; 3];
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
    assert!(
        stdout(0).contains(r#"group formed: ["worker0", "worker1", "worker2"]"#),
        "{rank_var}: {}",
        stdout(0)
    );
    for r in 1..3 {
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
