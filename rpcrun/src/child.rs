//! One child process: started in a process group of its own, its output passed on (prefixed
//! with its rank, or not), stopped by signalling its whole group.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::watch::Watch;
use crate::{Launch, LaunchError};

/// A started child.
pub(crate) struct Child {
    pub rank: u32,
    proc: std::process::Child,
    forwarders: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
    /// What it says of itself (`watch.rs`).
    watch: Watch,
    /// Why the launcher killed it, if it did.
    killed_because: Option<String>,
    /// SUP-4: when a child sent SIGTERM gets SIGKILL if it is still running.
    kill_at: Option<Instant>,
    /// How long a child sent SIGTERM gets to exit ([`Launch::stop_grace`]).
    grace: Duration,
}

impl Child {
    /// Starts `launch`'s program as `rank` with `env`.
    pub(crate) fn spawn(
        launch: &Launch,
        rank: u32,
        env: &[(String, String)],
        handed: Option<RawFd>,
    ) -> Result<Self, LaunchError> {
        let spawn_err = |source| LaunchError::Spawn {
            rank,
            program: launch.program.display().to_string(),
            source,
        };
        let (watch, status_fd) = Watch::new().map_err(spawn_err)?;
        let fd = status_fd.as_raw_fd();
        let mut cmd = Command::new(&launch.program);
        cmd.args(&launch.args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(rpc_core::SUPERVISOR_FD_ENV, fd.to_string())
            .stdin(Stdio::null())
            .process_group(0);
        for k in crate::env::REMOVED {
            cmd.env_remove(k);
        }
        if let Some(h) = handed {
            // RDV-8: the rendezvous's socket, which this process serves on.
            cmd.env(rpc_core::RENDEZVOUS_FD_ENV, h.to_string());
        }
        if launch.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: prctl, getppid, fcntl and _exit are async-signal-safe; nothing here allocates.
        unsafe {
            cmd.pre_exec(move || {
                // The status pipe's write end stays open in the program (only there).
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // So does the rendezvous's socket, when handed over.
                if let Some(h) = handed {
                    if libc::fcntl(h, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // The child dies with the launcher, whatever kills the launcher.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1); // the launcher died before the prctl took effect
                }
                Ok(())
            });
        }
        let mut proc = cmd.spawn().map_err(spawn_err)?;
        // The launcher's copy: closed, so that only the child holds the write end.
        drop(status_fd);
        let mut forwarders = Vec::new();
        if launch.prefix {
            let prefix = format!("[rank{rank}]: ");
            if let Some(out) = proc.stdout.take() {
                let p = prefix.clone();
                forwarders.push(std::thread::spawn(move || {
                    forward(out, &p, &mut std::io::stdout())
                }));
            }
            if let Some(err) = proc.stderr.take() {
                forwarders.push(std::thread::spawn(move || {
                    forward(err, &prefix, &mut std::io::stderr())
                }));
            }
        }
        Ok(Self {
            rank,
            proc,
            forwarders,
            status: None,
            watch,
            killed_because: None,
            kill_at: None,
            grace: launch.stop_grace,
        })
    }

    /// Ends it if what it said of itself says it must be ended (SUP-1..3 in `watch.rs`):
    /// SIGKILL to its group if it is frozen, else SIGTERM and SIGKILL once the stop grace
    /// has passed (SUP-4); returns why, once.
    pub(crate) fn check(&mut self) -> Option<String> {
        if self.try_wait().is_some() {
            return None;
        }
        let now = Instant::now();
        if let Some(at) = self.kill_at.filter(|&at| now >= at) {
            tracing::warn!(
                "rank {} (pid {}) still runs {:?} after SIGTERM; killing it",
                self.rank,
                self.pid(),
                now.duration_since(at) + self.grace
            );
            self.signal(libc::SIGKILL);
            self.kill_at = None;
        }
        if self.killed_because.is_some() {
            return None;
        }
        self.watch.read(self.pid(), now);
        let why = self.watch.verdict(now)?;
        self.end(why.clone(), now);
        Some(why)
    }

    /// Ends it for `why` (SUP-4): SIGTERM, then SIGKILL once the stop grace has passed (a
    /// later [`Child::check`]), if it still writes its lines; else SIGKILL at once.
    pub(crate) fn end(&mut self, why: String, now: Instant) {
        if self.killed_because.is_some() || self.try_wait().is_some() {
            return;
        }
        self.watch.read(self.pid(), now);
        if self.watch.answers(now) {
            tracing::warn!(
                "rank {} (pid {}): {why}; stopping it (SIGTERM, SIGKILL after {:?})",
                self.rank,
                self.pid(),
                self.grace
            );
            self.signal(libc::SIGTERM);
            self.kill_at = Some(now + self.grace);
        } else {
            tracing::warn!("rank {} (pid {}): {why}; killing it", self.rank, self.pid());
            // SIGKILL alone: it ends a stopped process too, where a SIGCONT first would let it
            // run for a moment on stale timers (declaring its peers failed, reporting them).
            self.signal(libc::SIGKILL);
        }
        self.killed_because = Some(why);
    }

    /// Where node 0's launcher takes the job's trace parts, if the child said so by the last
    /// [`Child::check`] (TR-11).
    pub(crate) fn sink(&self) -> Option<&str> {
        self.watch.sink()
    }

    /// The token that lets a process started in its place take its rank at once (RDV-5),
    /// if it reported one.
    pub(crate) fn replace_token(&mut self) -> Option<String> {
        self.watch.read(self.pid(), Instant::now());
        self.watch.token().map(str::to_owned)
    }

    /// Its exit as a code and in words, with the launcher's reason if it killed it.
    pub(crate) fn describe(&self, status: ExitStatus) -> (i32, String) {
        let (code, what) = describe(status);
        match &self.killed_because {
            Some(why) => (code, format!("{what}, killed by the launcher: {why}")),
            None => (code, what),
        }
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// Its status, once it has exited (reaped once; later calls repeat it).
    pub(crate) fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.proc.try_wait().ok().flatten();
        }
        self.status
    }

    /// Sends `sig` to its whole process group (ignored once the group is gone).
    pub(crate) fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(-(self.proc.id() as libc::pid_t), sig);
        }
    }

    /// Waits (at most 2 s) for its output to be passed on in full.
    fn drain(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        for f in std::mem::take(&mut self.forwarders) {
            while !f.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if f.is_finished() {
                let _ = f.join();
            }
        }
    }
}

/// Copies `from` to `to` line by line, each prefixed (a last line without its newline gets
/// one), so lines of different children never interleave mid-line.
fn forward(from: impl Read, prefix: &str, to: &mut impl Write) {
    let mut r = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut out = Vec::with_capacity(prefix.len() + line.len());
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                let _ = to.write_all(&out).and_then(|()| to.flush());
            }
        }
    }
}

/// Stops every child still running: `sig` (and SIGCONT, so a frozen one acts on it) to each
/// group, up to `grace` for them to exit, then SIGKILL; every group is killed at the end (no
/// grandchild outlives its attempt) and every child reaped.
pub(crate) fn stop_all(children: &mut [Child], sig: i32, grace: Duration) {
    for c in children.iter_mut() {
        if c.try_wait().is_none() {
            c.signal(sig);
            c.signal(libc::SIGCONT);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && children.iter_mut().any(|c| c.try_wait().is_none()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        c.signal(libc::SIGKILL);
        if c.status.is_none() {
            c.status = c.proc.wait().ok();
        }
        c.drain();
    }
}

/// A status as an exit code (128 + the signal for a killed process) and in words.
pub(crate) fn describe(status: ExitStatus) -> (i32, String) {
    match (status.code(), status.signal()) {
        (Some(c), _) => (c, format!("exited with status {c}")),
        (None, Some(s)) => (128 + s, format!("was killed by {}", signal_name(s))),
        (None, None) => (1, format!("ended with {status}")),
    }
}

/// `signal 9 (SIGKILL)`.
pub(crate) fn signal_name(s: i32) -> String {
    let name = match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {s}"),
    };
    format!("signal {s} ({name})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_is_prefixed_and_the_last_one_ended() {
        let mut out = Vec::new();
        forward(&b"one\ntwo\n\nthree"[..], "[rank3]: ", &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[rank3]: one\n[rank3]: two\n[rank3]: \n[rank3]: three\n"
        );
    }

    /// A child of the test, killed however the test ends.
    struct Guard(Child);

    impl Drop for Guard {
        fn drop(&mut self) {
            if self.0.try_wait().is_none() {
                self.0.signal(libc::SIGKILL);
                let _ = self.0.proc.wait();
            }
        }
    }

    /// Starts `script` under bash as a child of a launch with a 5 s stop grace.
    fn child(script: &str) -> Guard {
        let launch = Launch::new("/bin/bash")
            .args(["-c", script])
            .stop_grace(Duration::from_secs(5));
        Guard(Child::spawn(&launch, 1, &[], None).expect("bash starts"))
    }

    /// Its exit, waiting at most 4 s (under the 5 s grace: a SIGKILL after it would be
    /// the grace's, not `end`'s).
    fn exit_of(c: &mut Child) -> ExitStatus {
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            if let Some(st) = c.try_wait() {
                return st;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the child did not end within 4 s");
    }

    /// SUP-4, as the launcher ends a child the group declared failed (the membership path of
    /// `--restart worker`, `Child::end`): a child that still writes its status lines gets
    /// SIGTERM, which it can handle (here it exits 0); one silent for more than 3/4 of its
    /// failure timeout, as a frozen one is, gets SIGKILL at once.
    #[test]
    fn an_ended_child_gets_sigterm_while_it_writes_and_sigkill_once_silent() {
        let writes = r#"trap 'exit 0' TERM
            while :; do echo "v1 $$ 1 0 1000 alive -" >&"$RPC_SUPERVISOR_FD"; sleep 0.1; done"#;
        let mut c = child(writes);
        std::thread::sleep(Duration::from_millis(300));
        c.0.end("declared failed".into(), Instant::now());
        let st = exit_of(&mut c.0);
        assert_eq!(st.code(), Some(0), "SIGTERM, handled: {st:?}");

        let silent = r#"trap 'exit 0' TERM
            echo "v1 $$ 1 0 1000 alive -" >&"$RPC_SUPERVISOR_FD"; exec sleep 30"#;
        let mut c = child(silent);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(c.0.check(), None, "its line is fresh");
        std::thread::sleep(Duration::from_millis(900));
        c.0.end("declared failed".into(), Instant::now());
        let st = exit_of(&mut c.0);
        assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    }

    #[test]
    fn statuses_read_as_codes_and_words() {
        assert_eq!(
            describe(ExitStatus::from_raw(3 << 8)),
            (3, "exited with status 3".into())
        );
        assert_eq!(
            describe(ExitStatus::from_raw(libc::SIGKILL)),
            (137, "was killed by signal 9 (SIGKILL)".into())
        );
    }
}
