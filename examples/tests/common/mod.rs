//! Starting an example binary from a test: output to files, every wait bounded, the process
//! killed (with the children it launched, which die with it) when the handle is dropped; the
//! processes a launcher started, by rank, to signal them.

#![allow(dead_code)] // not every test binary uses every helper

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
                "no exit within {limit:?}; its processes:\n{}\nstdout:\n{}\nstderr:\n{}",
                process_tree(self.child.id()),
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `pid` and its descendants, a line each: pid, state (`R`, `S`, `T` stopped...), the kernel
/// function it sleeps in, its rank if it has one, per thread the states: what a hang's
/// report needs to say which process waits on what.
pub fn process_tree(pid: u32) -> String {
    let mut out = String::new();
    let mut todo = vec![(pid, 0)];
    while let Some((p, depth)) = todo.pop() {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        let state = stat.rsplit(") ").next().and_then(|r| r.chars().next());
        let wchan = std::fs::read_to_string(format!("/proc/{p}/wchan")).unwrap_or_default();
        let rank = std::fs::read(format!("/proc/{p}/environ"))
            .unwrap_or_default()
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"RANK=").map(|r| r.to_vec()))
            .map(|r| String::from_utf8_lossy(&r).into_owned());
        let threads: String = std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| {
                let s = std::fs::read_to_string(t.path().join("stat")).ok()?;
                s.rsplit(") ").next()?.chars().next()
            })
            .collect();
        out += &format!(
            "{:indent$}pid {p} state {state:?} wchan {wchan:?} rank {rank:?} threads {threads}\n",
            "",
            indent = depth * 2
        );
        // A child is listed under the thread that started it.
        for t in std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            todo.extend(
                kids.split_whitespace()
                    .filter_map(|k| k.parse().ok())
                    .map(|k| (k, depth + 1)),
            );
        }
    }
    out
}

/// Runs `bin` with `args` in a fresh temporary directory until it exits (at most `limit`):
/// its exit code, stdout and stderr.
pub fn run_to_end(bin: &str, args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    run_to_end_with(bin, args, &[], limit)
}

/// [`run_to_end`] with `env` added to the program's environment.
pub fn run_to_end_with(
    bin: &str,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> (Option<i32>, String, String) {
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
    let mut p = Spawned::start(bin, args, env, &dir);
    let code = p.wait(limit);
    let (out, err) = (p.stdout(), p.stderr());
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
    (code, out, err)
}

/// The last line of `out` as JSON (a panic showing both outputs if it is not).
pub fn last_json(out: &str, err: &str) -> serde_json::Value {
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"))
}

/// The example's processes: the children of its launcher (local mode), by rank.
pub fn ranks_of(launcher: u32) -> Vec<(u32, u32)> {
    let kids = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
        .unwrap_or_default();
    let mut out: Vec<(u32, u32)> = kids
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter_map(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"RANK="))
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())?;
            Some((rank, pid))
        })
        .collect();
    out.sort();
    out
}

/// Whether `pid` is running or stopped (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !matches!(
                s.rsplit(") ").next().and_then(|r| r.chars().next()),
                Some('Z') | None
            )
        })
        .unwrap_or(false)
}

pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, sig) };
}

/// Waits (at most `limit`) until the master's progress record in `out` shows `step` steps
/// done.
pub fn await_step(run: &mut Spawned, out: &Path, step: u64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let done = std::fs::read_to_string(out.join("progress"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if done.is_some_and(|d| d >= step) {
            return;
        }
        assert!(
            run.child.try_wait().unwrap().is_none(),
            "the run ended before step {step}:\n{}",
            run.stderr()
        );
        assert!(
            Instant::now() < deadline,
            "no step {step} within {limit:?}:\n{}",
            run.stderr()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A port of 127.0.0.1 free now, below the ephemeral range ([`rpc_core::testing::free_port`]).
pub fn free_port() -> u16 {
    rpc_core::testing::free_port()
}

/// The `rpcrun` built beside the example binary `bin`, or `None` after saying on stderr that the
/// test is skipped (a `cargo test` of the examples alone does not build it).
pub fn rpcrun_beside(bin: &str) -> Option<PathBuf> {
    let rpcrun = Path::new(bin).parent()?.join("rpcrun");
    if rpcrun.exists() {
        return Some(rpcrun);
    }
    let name = Path::new(bin).file_name()?.to_string_lossy().into_owned();
    eprintln!("skipped: no rpcrun beside {name} (cargo build -p rpcrun)");
    None
}
