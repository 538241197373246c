//! What the launcher's tests share: an `rpcrun` run with `sh` as its children.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An `rpcrun` process, killed on drop (its children die with it).
pub struct Run {
    pub child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rpcrun-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn start(dir: &Path, flags: &[&str], script: &str) -> Run {
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let child = Command::new(env!("CARGO_BIN_EXE_rpcrun"))
        .args(flags)
        .args(["--", "sh", "-c", script])
        .env_remove("RPC_SECRET")
        .env_remove("RPC_SECRET_FILE")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Run { child, out, err }
}

impl Run {
    /// Its exit code, waiting at most `limit`.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "rpcrun did not end within {limit:?}; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap()
    }

    /// Waits (at most 20 s) until stdout has `n` lines containing `what`.
    pub fn await_lines(&self, what: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.stdout().lines().filter(|l| l.contains(what)).count() < n {
            assert!(
                Instant::now() < deadline,
                "no {n} lines with {what:?}: {}\n{}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub fn alive(pid: u32) -> bool {
    // A zombie has exited; only a running or stopped process counts.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(") ").next().and_then(|r| r.chars().next());
            !matches!(state, Some('Z') | Some('X') | None)
        })
        .unwrap_or(false)
}
