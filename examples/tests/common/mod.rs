//! Starting an example binary from a test: output to files, every wait bounded, the process
//! killed (with the children it launched, which die with it) when the handle is dropped.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A started example, killed on drop.
pub struct Spawned {
    pub child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Spawned {
    /// Starts `bin` with `args` and `env` (`RANK` unset unless `env` sets it), its output in
    /// `dir/stdout` and `dir/stderr`.
    pub fn start(bin: &str, args: &[impl AsRef<OsStr>], env: &[(&str, &str)], dir: &Path) -> Self {
        let (stdout, stderr) = (dir.join("stdout"), dir.join("stderr"));
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env_remove("RANK")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self {
            child: cmd.spawn().unwrap(),
            stdout,
            stderr,
        }
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Its exit code, waiting at most `limit` (a panic, and the process killed, after that).
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "no exit within {limit:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
