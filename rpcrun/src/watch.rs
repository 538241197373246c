//! The launcher's watch on one child (the launcher's side of `rpc_core::supervisor`): a pipe
//! whose write end the child inherits, the status lines read from it, and the verdict when the
//! child must be ended:
//!
//! - SUP-1: no line for its failure timeout and half again (at least 0.5 s more): it is
//!   frozen (SIGSTOP, a hung host) as its peers see it; they declared it failed by then.
//! - SUP-2: it says the group declared it failed (its peers refuse it).
//! - SUP-3: it says it lost the rendezvous longer than its failure timeout ago.
//! - SUP-4: a child that still writes its lines (SUP-2, SUP-3) gets SIGTERM first, and SIGKILL
//!   only if it has not exited within the launch's stop grace: its exit path writes its trace
//!   part (TR-5). A frozen one (SUP-1) gets SIGKILL at once.
//!
//! A child that never wrote (a program without an agent, heartbeats off) or said `done` (its
//! agent left its group) is not watched.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use rpc_core::supervisor::{Status, StatusState};

/// The read end of a child's pipe and what it said last.
pub(crate) struct Watch {
    pipe: std::fs::File,
    partial: Vec<u8>,
    /// The last line of the child itself, and when it came.
    last: Option<(Status, Instant)>,
    /// The last token it reported (a `done` line carries none, and must not lose it: the
    /// process that replaces a finished one needs it too).
    token: Option<String>,
    /// Where node 0's launcher takes the job's trace parts, as the child said (TR-11).
    sink: Option<String>,
}

impl Watch {
    /// A pipe: the watch on its read end, and the write end for the child (close-on-exec; the
    /// child's `pre_exec` clears that flag on its copy).
    pub(crate) fn new() -> std::io::Result<(Self, OwnedFd)> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned here alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // The child's end blocks or not as the child decides (it makes it non-blocking).
        // SAFETY: fcntl on a descriptor owned here.
        unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETFL, 0) };
        let watch = Self {
            pipe: std::fs::File::from(read),
            partial: Vec::new(),
            last: None,
            token: None,
            sink: None,
        };
        Ok((watch, write))
    }

    /// Reads what the child (process `pid`) wrote since the last call.
    pub(crate) fn read(&mut self, pid: u32, now: Instant) {
        let mut buf = [0u8; 4096];
        loop {
            match self.pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => self.partial.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break, // WouldBlock: all read
            }
        }
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let line = std::str::from_utf8(&line[..end]).ok();
            if let Some((from, sink)) = line.and_then(rpc_core::supervisor::parse_sink) {
                if from == pid {
                    self.sink = Some(sink);
                }
                continue;
            }
            let status = line.and_then(Status::parse);
            match status {
                Some(s) if s.pid == pid => {
                    if s.token.is_some() {
                        self.token.clone_from(&s.token);
                    }
                    self.last = Some((s, now));
                }
                Some(_) => {} // a process the child started, with the pipe inherited
                None => tracing::debug!("an unreadable status line from pid {pid}"),
            }
        }
        // A child writing garbage without newlines does not grow the buffer for ever.
        if self.partial.len() > 4096 {
            self.partial.clear();
        }
    }

    /// Where node 0's launcher takes the job's trace parts, if the child said (TR-11).
    pub(crate) fn sink(&self) -> Option<&str> {
        self.sink.as_deref()
    }

    /// The token the child's rendezvous issued it, for the process that replaces it (RDV-5).
    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether the child still writes its lines: its last within three quarters of its
    /// failure timeout (a running child writes every heartbeat interval, at most half the
    /// timeout; its peers declare a silent one failed only after the whole timeout). It runs
    /// and can end itself on a SIGTERM, where a frozen one cannot (SUP-4).
    pub(crate) fn answers(&self, now: Instant) -> bool {
        self.last
            .as_ref()
            .is_some_and(|(s, at)| now.saturating_duration_since(*at) <= s.timeout * 3 / 4)
    }

    /// Why the launcher must end the child now, if it must (SUP-1..3).
    pub(crate) fn verdict(&self, now: Instant) -> Option<String> {
        let (s, at) = self.last.as_ref()?;
        let quiet = now.saturating_duration_since(*at);
        let slack = (s.timeout / 2).max(Duration::from_millis(500));
        match &s.state {
            StatusState::Done => None,
            StatusState::Evicted => Some(format!(
                "the group declared rank {} (incarnation {}) failed",
                s.rank, s.incarnation
            )),
            StatusState::Adrift(d) if *d + quiet > s.timeout => Some(format!(
                "rank {} lost the rendezvous {:.1} s ago (failure timeout {:?})",
                s.rank,
                (*d + quiet).as_secs_f64(),
                s.timeout
            )),
            _ if quiet > s.timeout + slack => Some(format!(
                "rank {} gave no sign of life for {:.1} s (frozen or hung; failure timeout {:?})",
                s.rank,
                quiet.as_secs_f64(),
                s.timeout
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn watch_with(lines: &str) -> (Watch, Instant) {
        let (mut w, write) = Watch::new().unwrap();
        let mut f = std::fs::File::from(write);
        f.write_all(lines.as_bytes()).unwrap();
        let t = Instant::now();
        w.read(42, t);
        (w, t)
    }

    /// SUP-1..3 and the unwatched cases.
    #[test]
    fn verdicts_follow_what_the_child_said_and_when() {
        let s = Duration::from_secs;
        let (w, t) = watch_with("v1 42 1 0 1000 alive t1\n");
        assert_eq!(w.verdict(t + s(1)), None);
        assert_eq!(w.token(), Some("t1"));
        let why = w.verdict(t + s(2)).expect("SUP-1");
        assert!(why.contains("no sign of life for 2.0 s"), "{why}");
        let (w, t) = watch_with("v1 42 1 0 1000 alive t1\nv1 42 1 0 1000 evicted t1\n");
        assert!(w.verdict(t).expect("SUP-2").contains("declared rank 1"));
        let (w, t) = watch_with("v1 42 1 0 1000 adrift:400 t1\n");
        assert_eq!(w.verdict(t), None);
        let why = w.verdict(t + Duration::from_millis(700)).expect("SUP-3");
        assert!(why.contains("lost the rendezvous 1.1 s ago"), "{why}");
        assert!(
            w.answers(t + Duration::from_millis(700)),
            "SUP-4: it still writes"
        );
        assert!(
            !w.answers(t + Duration::from_millis(800)),
            "SUP-4: quiet too long"
        );
        let (w, t) = watch_with("v1 42 1 0 1000 alive t1\nv1 42 1 0 1000 done -\n");
        assert_eq!(w.verdict(t + s(60)), None, "done: not watched");
        assert_eq!(w.token(), Some("t1"), "a done line keeps the token");
        let (w, t) = watch_with("v1 43 1 0 1000 evicted t1\nnonsense\n");
        assert_eq!(
            w.verdict(t + s(60)),
            None,
            "another process's lines, garbage: ignored"
        );
    }

    /// TR-11: the sink a child names is kept, another process's is not, and the line is no
    /// sign of life.
    #[test]
    fn the_sink_a_child_names_is_kept() {
        let (w, _) = watch_with("sink1 43 10.0.0.9:1\nsink1 42 10.0.0.1:4000\n");
        assert_eq!(w.sink(), Some("10.0.0.1:4000"));
        assert!(w.last.is_none(), "not a status line");
        let (w, _) = watch_with("sink1 43 10.0.0.9:1\n");
        assert_eq!(w.sink(), None);
    }
}
