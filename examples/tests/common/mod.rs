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

/// Runs `bin` with `args` in a fresh temporary directory until it exits (at most `limit`):
/// its exit code, stdout and stderr.
#[allow(dead_code)] // not every test binary uses every helper
pub fn run_to_end(bin: &str, args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    let name = Path::new(bin)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let dir = std::env::temp_dir().join(format!(
        "{name}-test-{}-{}",
        std::process::id(),
        args.join("_").replace('-', "")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut p = Spawned::start(bin, args, &[], &dir);
    let code = p.wait(limit);
    let (out, err) = (p.stdout(), p.stderr());
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
    (code, out, err)
}

/// The last line of `out` as JSON (a panic showing both outputs if it is not).
#[allow(dead_code)]
pub fn last_json(out: &str, err: &str) -> serde_json::Value {
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"))
}
