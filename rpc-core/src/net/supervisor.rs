//! The launcher's watch on this process: a line of status on a pipe the launcher gave it, every
//! heartbeat interval, written by the failure detector's own thread (LIVE-2), so that the
//! launcher on this process's node sees what the group sees: a process that stops writing is
//! frozen to its launcher exactly when its heartbeats stop for its peers. TorchElastic's file
//! timer (a worker's expiry requests on a named pipe, the agent killing the worker whose timer
//! ran out) is the same idea.
//!
//! The launcher (`rpcrun`) creates the pipe, names its write end in [`SUPERVISOR_FD_ENV`] and
//! ends the process when (SUP-1) no line came for the failure timeout the process stated (plus
//! one heartbeat interval), (SUP-2) the process says the group declared it failed, or (SUP-3)
//! it says it lost the rendezvous for longer than the failure timeout. A process that left its
//! group gracefully says `done`, and is not watched until an agent of it joins a group again.
//!
//! A line: `v1 PID RANK INCARNATION TIMEOUT_MS STATE TOKEN`, STATE one of `alive`, `evicted`,
//! `adrift:MS` (the rendezvous lost MS milliseconds ago) and `done`, TOKEN the one the
//! rendezvous issued to this incarnation (`-` if none), which the launcher hands to the
//! process it starts in this one's place (RDV-5); under 200 bytes, so each write is atomic on
//! a pipe. The launcher reads only the lines of the process it started (a
//! program that starts processes before its agent takes the pipe passes the pipe on).
//!
//! A traced worker also says once, as it joins its group, where node 0's launcher takes the
//! trace parts of the job (TR-9, TR-11): `sink1 PID ADDR`. Its launcher then knows where to
//! say that this node has no part, should every process of it be killed outright before
//! writing one. A launcher that does not know the line skips it.

use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable in which a launcher names the file descriptor of the pipe this
/// process reports its standing on (see the module's documentation); unset, nobody watches.
pub const SUPERVISOR_FD_ENV: &str = "RPC_SUPERVISOR_FD";

/// What this process knows of its own standing in its group, as the launcher is told it.
#[derive(Debug, Default)]
pub(crate) struct Own {
    /// The group declared this worker failed (the rendezvous said so): the cause.
    evicted: Mutex<Option<String>>,
    /// Since when this worker has had no link to the rendezvous (it broke while running).
    adrift: Mutex<Option<Instant>>,
    /// The token the rendezvous issued to this incarnation, for its launcher to hand to a
    /// replacement (RDV-5).
    token: Mutex<String>,
}

impl Own {
    pub(crate) fn evicted(&self, cause: &str) {
        lock(&self.evicted).get_or_insert_with(|| cause.to_owned());
    }

    pub(crate) fn set_token(&self, token: String) {
        *lock(&self.token) = token;
    }

    /// The token as issued (empty: none yet).
    pub(crate) fn token_value(&self) -> String {
        lock(&self.token).clone()
    }

    /// The TOKEN of a status line (`-` for none).
    fn token(&self) -> String {
        let t = lock(&self.token);
        if t.is_empty() || t.contains(char::is_whitespace) {
            "-".into()
        } else {
            t.clone()
        }
    }

    pub(crate) fn lost_rendezvous(&self) {
        lock(&self.adrift).get_or_insert_with(Instant::now);
    }

    /// The link to the rendezvous is back (RDV-6).
    pub(crate) fn found_rendezvous(&self) {
        *lock(&self.adrift) = None;
    }

    /// Whether this worker has no link to the rendezvous now.
    pub(crate) fn is_adrift(&self) -> bool {
        lock(&self.adrift).is_some()
    }

    /// The STATE of a status line.
    fn state(&self) -> String {
        if lock(&self.evicted).is_some() {
            return "evicted".into();
        }
        match *lock(&self.adrift) {
            Some(t) => format!("adrift:{}", t.elapsed().as_millis()),
            None => "alive".into(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pipe, taken once per process (several agents of one process share it).
static PIPE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();

fn pipe() -> Option<&'static Mutex<std::fs::File>> {
    PIPE.get_or_init(|| {
        let fd: i32 = std::env::var(SUPERVISOR_FD_ENV).ok()?.parse().ok()?;
        take_pipe(fd)
    })
    .as_ref()
}

/// Takes `fd` if it is the write end of a pipe: non-blocking (a launcher that stops reading
/// costs a skipped line, never a stuck detector), closed on exec (a program this process
/// starts does not report for it).
fn take_pipe(fd: i32) -> Option<Mutex<std::fs::File>> {
    use std::os::fd::FromRawFd;
    // SAFETY: fstat and fcntl only read and set flags of a descriptor number; a closed or
    // foreign number fails the checks and is left alone.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if fd < 3 || libc::fstat(fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFIFO {
            tracing::warn!(
                fd,
                "{SUPERVISOR_FD_ENV} names no pipe; the launcher's watch is off"
            );
            return None;
        }
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        // SAFETY: the process owns the descriptor the launcher handed it, and only this
        // OnceLock takes it.
        Some(Mutex::new(std::fs::File::from_raw_fd(fd)))
    }
}

/// Writes this worker's standing, if a launcher watches, unless `ended()` says the agent has
/// left its group by now (checked under the pipe's lock, so that no `alive` follows a `done`).
pub(crate) fn report_alive(
    rank: u32,
    incarnation: u64,
    timeout: Duration,
    own: &Own,
    ended: impl Fn() -> bool,
) {
    if let Some(pipe) = pipe() {
        let mut pipe = lock(pipe);
        if !ended() {
            let state = format!("{} {}", own.state(), own.token());
            write(&mut pipe, rank, incarnation, timeout, &state);
        }
    }
}

/// Says that this worker's agent left its group (gracefully or dropped): not watched from now
/// on, until an agent of this process reports again.
pub(crate) fn report_done(rank: u32, incarnation: u64, timeout: Duration) {
    if let Some(pipe) = pipe() {
        write(&mut lock(pipe), rank, incarnation, timeout, "done -");
    }
}

/// TR-11: says where node 0's launcher takes the job's trace parts, if a launcher watches.
pub(crate) fn report_sink(sink: &str) {
    if sink.is_empty() || sink.contains(char::is_whitespace) || sink.len() > 1024 {
        return;
    }
    if let Some(pipe) = pipe() {
        let line = format!("sink1 {} {sink}\n", std::process::id());
        let _ = lock(pipe).write_all(line.as_bytes());
    }
}

/// A sink line (see the module's documentation) as the launcher reads it: the reporting
/// process and the sink's address; `None` for anything else.
pub fn parse_sink(line: &str) -> Option<(u32, String)> {
    let mut it = line.split(' ');
    if it.next()? != "sink1" {
        return None;
    }
    let pid = it.next()?.parse().ok()?;
    let addr = it.next().filter(|a| !a.is_empty())?;
    it.next().is_none().then(|| (pid, addr.to_owned()))
}

fn write(pipe: &mut std::fs::File, rank: u32, incarnation: u64, timeout: Duration, state: &str) {
    let line = format!(
        "v1 {} {rank} {incarnation} {} {state}\n",
        std::process::id(),
        timeout.as_millis()
    );
    // A full pipe (the launcher behind) skips this line; the next one carries the news.
    let _ = pipe.write_all(line.as_bytes());
}

/// A status line as the launcher reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The reporting process.
    pub pid: u32,
    /// The reporting worker's rank.
    pub rank: u32,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its failure timeout: the launcher's bound on silence (with one heartbeat interval).
    pub timeout: Duration,
    /// How it stands.
    pub state: StatusState,
    /// The token a replacement of it presents (RDV-5), if it has one.
    pub token: Option<String>,
}

/// How a reporting worker stands (see [`Status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StatusState {
    /// In its group.
    Alive,
    /// The group declared it failed.
    Evicted,
    /// It lost its link to the rendezvous this long ago.
    Adrift(Duration),
    /// It left its group gracefully: not watched until it reports again.
    Done,
}

impl Status {
    /// Parses one line (without its newline); `None` for anything else.
    pub fn parse(line: &str) -> Option<Self> {
        let mut it = line.split(' ');
        if it.next()? != "v1" {
            return None;
        }
        let pid = it.next()?.parse().ok()?;
        let rank = it.next()?.parse().ok()?;
        let incarnation = it.next()?.parse().ok()?;
        let timeout = Duration::from_millis(it.next()?.parse().ok()?);
        let state = match it.next()? {
            "alive" => StatusState::Alive,
            "evicted" => StatusState::Evicted,
            "done" => StatusState::Done,
            s => StatusState::Adrift(Duration::from_millis(
                s.strip_prefix("adrift:")?.parse().ok()?,
            )),
        };
        let token = match it.next()? {
            "-" => None,
            t => Some(t.to_owned()),
        };
        it.next().is_none().then_some(Self {
            pid,
            rank,
            incarnation,
            timeout,
            state,
            token,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher reads what a worker writes, and nothing else.
    #[test]
    fn status_lines_read_back() {
        let own = Own::default();
        assert_eq!(own.state(), "alive");
        own.lost_rendezvous();
        assert!(own.state().starts_with("adrift:"));
        own.evicted("no heartbeat");
        assert_eq!(own.state(), "evicted");
        let s = Status::parse("v1 77 3 2 1500 adrift:250 c0ffee").unwrap();
        assert_eq!(s.token.as_deref(), Some("c0ffee"));
        assert_eq!(
            (s.pid, s.rank, s.incarnation, s.timeout),
            (77, 3, 2, Duration::from_millis(1500))
        );
        assert_eq!(s.state, StatusState::Adrift(Duration::from_millis(250)));
        assert_eq!(
            Status::parse("v1 1 0 0 1 done -").unwrap().state,
            StatusState::Done
        );
        assert_eq!(
            parse_sink("sink1 77 10.0.0.1:4000"),
            Some((77, "10.0.0.1:4000".to_owned()))
        );
        for bad in [
            "sink1 77",
            "sink1 x a:1",
            "sink1 77 a:1 b",
            "sink2 77 a:1",
            "sink1 77 ",
        ] {
            assert_eq!(parse_sink(bad), None, "{bad}");
        }
        assert_eq!(Status::parse("sink1 77 10.0.0.1:4000"), None);
        for bad in [
            "",
            "v2 1 0 0 1 alive -",
            "v1 1 0 0 1 alive - x",
            "v1 1 x 0 1 alive -",
            "v1 1 0 0 1 adrift -",
            "v1 0 0 1 alive -",
            "v1 1 0 0 1 alive",
        ] {
            assert_eq!(Status::parse(bad), None, "{bad}");
        }
    }
}
