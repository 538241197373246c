//! Failure detection: which peers are alive, and a verdict, once, for every kind of connection.
//!
//! Each worker runs a detector on a thread of its own with a runtime of its own, so its
//! heartbeats depend on neither the worker's runtime threads nor its connections: a handler
//! that computes for a minute on a runtime thread leaves the detector running (busy is not
//! dead), and a process under SIGSTOP stops beating (frozen is dead). The detector listens on
//! a port of its own (advertised at the rendezvous), dials every peer's detector, and on each
//! connection it dialled sends a heartbeat every `heartbeat_interval`; on each connection it
//! accepted it reads the peer's. A peer is declared failed when:
//!
//! - no heartbeat came from it for `failure_timeout` (a frozen process, a hung host, a
//!   partition; at start, a peer gets a grace of several timeouts to connect), or
//! - its heartbeat connection closed without it saying it was leaving, and nothing listens at
//!   its detector's address any more (the process is gone: noticed at once).
//!
//! A verdict is final ([`Membership::declare`]): it cancels the peer's token (work running
//! for it stops, its incoming connections close), runs the hooks (the network layer closes
//! every connection to it and fails what waits on them; layers above release what the peer
//! held), and is published to every watcher.
//!
//! Invariants:
//! - LIVE-1: a worker is declared failed at most once, and never after it said it was leaving
//!   (graceful shutdown sends `LEAVING` on every heartbeat connection).
//! - LIVE-2: the detector's heartbeats and checks run on its own thread; nothing it waits for
//!   runs on the worker's runtime.
//! - LIVE-3: every wait of the detector is bounded (dial and handshake by the timeouts, a
//!   write by the heartbeat interval), so one dead peer never delays the verdict on another.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

use super::auth::{self, ConnKind};
use super::config::NetConfig;
use super::dial::{Dialer, Directory};
use super::transport::{Conn, Detached, Listener};

/// A peer declared failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerFailed {
    /// Its rank.
    pub rank: u32,
    /// Its name.
    pub name: String,
    /// Why it was declared failed (no heartbeat for how long, or its process is gone).
    pub cause: String,
    /// When.
    pub at: SystemTime,
}

/// The verdicts of a worker's failure detector as they come, those made before the watch
/// began first (see `Agent::watch_failures`).
pub struct FailureWatch {
    membership: Arc<Membership>,
    known: std::collections::VecDeque<WorkerFailed>,
    seen: std::collections::BTreeSet<u32>,
    rx: broadcast::Receiver<WorkerFailed>,
}

impl std::fmt::Debug for FailureWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureWatch")
            .field("seen", &self.seen)
            .finish()
    }
}

impl FailureWatch {
    pub(crate) fn new(membership: Arc<Membership>) -> Self {
        // Subscribed before the known verdicts are read: none falls between the two.
        let rx = membership.subscribe();
        let known: std::collections::VecDeque<_> = membership.failures().into();
        Self {
            membership,
            known,
            seen: Default::default(),
            rx,
        }
    }

    /// The next verdict this watch has not returned yet; `None` once the worker is gone.
    /// Each failed worker is returned once.
    ///
    /// # Cancel safety
    /// Cancel safe: a verdict is returned by the call that completes, never lost.
    pub async fn next(&mut self) -> Option<WorkerFailed> {
        loop {
            if let Some(v) = self.known.pop_front() {
                if self.seen.insert(v.rank) {
                    return Some(v);
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(v) => self.known.push_back(v),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.known = self.membership.failures().into();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// Messages on a heartbeat connection: 16 bytes, the kind, 7 reserved, a sequence number.
const BEAT: u8 = 1;
const LEAVING: u8 = 2;
const MSG: usize = 16;

/// Runs on the detector's thread when a peer is declared failed; must return quickly.
pub(crate) type FailureHook = Arc<dyn Fn(&WorkerFailed) + Send + Sync>;

#[derive(Clone)]
enum PeerState {
    Alive,
    Left,
    Failed(WorkerFailed),
}

/// Which peers are alive, left or failed, and who is told when one fails.
pub(crate) struct Membership {
    directory: Arc<Directory>,
    states: Mutex<Vec<PeerState>>,
    /// Set once a rank is declared failed: read on every call's path.
    failed: Vec<AtomicBool>,
    /// Cancelled when the rank is declared failed: work running for it stops.
    gone: Vec<CancellationToken>,
    events: broadcast::Sender<WorkerFailed>,
    hooks: RwLock<Vec<FailureHook>>,
}

impl Membership {
    pub(crate) fn new(directory: Arc<Directory>) -> Self {
        let n = directory.workers().len();
        Self {
            states: Mutex::new(vec![PeerState::Alive; n]),
            failed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            gone: (0..n).map(|_| CancellationToken::new()).collect(),
            // Bounded: a watcher that falls this far behind is told it lagged.
            events: broadcast::channel(1024).0,
            hooks: RwLock::new(Vec::new()),
            directory,
        }
    }

    fn states(&self) -> std::sync::MutexGuard<'_, Vec<PeerState>> {
        self.states.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `rank` was declared failed (cheap: on every call's path).
    pub(crate) fn is_failed(&self, rank: u32) -> bool {
        self.failed
            .get(rank as usize)
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// The verdict on `rank`, if it was declared failed.
    pub(crate) fn failure(&self, rank: u32) -> Option<WorkerFailed> {
        if !self.is_failed(rank) {
            return None;
        }
        match self.states().get(rank as usize) {
            Some(PeerState::Failed(f)) => Some(f.clone()),
            _ => None,
        }
    }

    /// Every verdict so far, by rank.
    pub(crate) fn failures(&self) -> Vec<WorkerFailed> {
        self.states()
            .iter()
            .filter_map(|s| match s {
                PeerState::Failed(f) => Some(f.clone()),
                _ => None,
            })
            .collect()
    }

    /// Verdicts from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<WorkerFailed> {
        self.events.subscribe()
    }

    /// Runs `hook` on every verdict from now on.
    pub(crate) fn on_failure(&self, hook: FailureHook) {
        self.hooks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Cancelled when `rank` is declared failed.
    pub(crate) fn gone(&self, rank: u32) -> &CancellationToken {
        &self.gone[rank as usize]
    }

    /// Waits, at most `wait`, for a verdict on `rank` if its detector is watched: a call
    /// that found its connection to `rank` broken learns whether the process is gone (the
    /// detector probes at once when a heartbeat connection closes) before it reports a lost
    /// connection.
    pub(crate) async fn verdict_within(&self, rank: u32, wait: Duration) -> Option<WorkerFailed> {
        if self.alive(rank) && !self.directory.heartbeat(rank).is_empty() {
            let _ = tokio::time::timeout(wait, self.gone(rank).cancelled()).await;
        }
        self.failure(rank)
    }

    /// Whether `rank` is still watched (not failed, not left).
    fn alive(&self, rank: u32) -> bool {
        matches!(self.states().get(rank as usize), Some(PeerState::Alive))
    }

    /// `rank` said it is leaving: it is not watched any more (LIVE-1).
    fn left(&self, rank: u32) {
        let mut s = self.states();
        if let Some(st @ PeerState::Alive) = s.get_mut(rank as usize) {
            *st = PeerState::Left;
        }
    }

    /// Declares `rank` failed for `cause`, once (LIVE-1): its token is cancelled, the hooks
    /// run, watchers are told. Returns whether this call made the verdict.
    pub(crate) fn declare(&self, rank: u32, cause: String) -> bool {
        let verdict = {
            let mut s = self.states();
            let Some(st @ PeerState::Alive) = s.get_mut(rank as usize) else {
                return false;
            };
            let v = WorkerFailed {
                rank,
                name: self.directory.name(rank).to_owned(),
                cause,
                at: SystemTime::now(),
            };
            *st = PeerState::Failed(v.clone());
            self.failed[rank as usize].store(true, Ordering::Release);
            v
        };
        tracing::warn!(worker = %verdict.name, rank, cause = %verdict.cause, "worker declared failed");
        self.gone[rank as usize].cancel();
        let hooks = self.hooks.read().unwrap_or_else(|p| p.into_inner()).clone();
        for h in hooks {
            h(&verdict);
        }
        let _ = self.events.send(verdict);
        true
    }
}

/// The detector of one worker: its thread, and the switches the worker and tests use.
pub(crate) struct Detector {
    stop: CancellationToken,
    leave: Arc<Notify>,
    leaving: Arc<AtomicBool>,
    /// Heartbeat connections this detector dialled that are up (they say `LEAVING`).
    connected: Arc<AtomicUsize>,
    /// Tests: the detector stops sending heartbeats, as a frozen process would.
    silent: Arc<AtomicBool>,
    heartbeat_interval: Duration,
}

/// What the detector's tasks share.
struct Ctx {
    cfg: Arc<NetConfig>,
    dialer: Arc<Dialer>,
    membership: Arc<Membership>,
    /// When each peer was last heard from (a grace ahead of the start for the first time).
    heard: Mutex<Vec<Instant>>,
    stop: CancellationToken,
    leave: Arc<Notify>,
    leaving: Arc<AtomicBool>,
    connected: Arc<AtomicUsize>,
    silent: Arc<AtomicBool>,
    seq: AtomicU64,
}

impl Detector {
    /// Starts the detector of worker `cfg.rank` on a thread of its own, listening on
    /// `listener`; `None` if heartbeats are off ([`NetConfig::heartbeat_interval`] zero).
    pub(crate) fn start(
        cfg: Arc<NetConfig>,
        dialer: Arc<Dialer>,
        membership: Arc<Membership>,
        listener: Detached,
    ) -> std::io::Result<Self> {
        let stop = CancellationToken::new();
        let leave = Arc::new(Notify::new());
        let leaving = Arc::new(AtomicBool::new(false));
        let silent = Arc::new(AtomicBool::new(false));
        let connected = Arc::new(AtomicUsize::new(0));
        let heartbeat_interval = cfg.heartbeat_interval;
        let n = dialer.directory().workers().len();
        // At first a peer is given several timeouts to connect (they start at slightly
        // different moments, some on loaded machines).
        let grace = (cfg.failure_timeout * 3).max(Duration::from_secs(5));
        let first = Instant::now() + grace - cfg.failure_timeout;
        let ctx = Arc::new(Ctx {
            heard: Mutex::new(vec![first; n]),
            cfg,
            dialer,
            membership,
            stop: stop.clone(),
            leave: Arc::clone(&leave),
            leaving: Arc::clone(&leaving),
            connected: Arc::clone(&connected),
            silent: Arc::clone(&silent),
            seq: AtomicU64::new(0),
        });
        let name = format!("rpc-liveness-{}", ctx.cfg.rank);
        std::thread::Builder::new().name(name).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(cause = %e, "no runtime for the failure detector; peers are not watched");
                    return;
                }
            };
            rt.block_on(run(ctx, listener));
        })?;
        Ok(Self {
            stop,
            leave,
            leaving,
            connected,
            silent,
            heartbeat_interval,
        })
    }

    /// Graceful: tells every peer this worker is leaving (LIVE-1), then stops. Returns once
    /// every connected heartbeat connection has said so, or after a bounded wait (a writer
    /// may be between two beats, or blocked on a peer that stopped reading).
    pub(crate) async fn leave(&self) {
        self.leaving.store(true, Ordering::Release);
        self.leave.notify_waiters();
        let by = Instant::now() + self.heartbeat_interval + Duration::from_millis(500);
        while self.connected.load(Ordering::Acquire) > 0 && Instant::now() < by {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.stop.cancel();
    }

    /// Tests: stops (or resumes) sending heartbeats, as a frozen process would.
    pub(crate) fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Release);
    }
}

impl Drop for Detector {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn run(ctx: Arc<Ctx>, listener: Detached) {
    let listener = match listener.attach() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(cause = %e, "the failure detector cannot listen; peers are not watched");
            return;
        }
    };
    let me = ctx.cfg.rank;
    tokio::spawn(accept(Arc::clone(&ctx), listener));
    for rank in 0..ctx.dialer.directory().workers().len() as u32 {
        if rank != me && !ctx.dialer.directory().heartbeat(rank).is_empty() {
            tokio::spawn(beat_to(Arc::clone(&ctx), rank));
        }
    }
    let period = (ctx.cfg.heartbeat_interval / 2).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            () = ctx.stop.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
        if ctx.leaving.load(Ordering::Acquire) {
            continue;
        }
        let now = Instant::now();
        let late: Vec<(u32, Duration)> = {
            let heard = ctx.heard.lock().unwrap_or_else(|p| p.into_inner());
            heard
                .iter()
                .enumerate()
                .filter(|(r, _)| *r as u32 != me)
                .filter_map(|(r, t)| {
                    let quiet = now.saturating_duration_since(*t);
                    (quiet > ctx.cfg.failure_timeout).then_some((r as u32, quiet))
                })
                .collect()
        };
        for (rank, quiet) in late {
            if ctx.membership.alive(rank) && !ctx.dialer.directory().heartbeat(rank).is_empty() {
                ctx.membership.declare(
                    rank,
                    format!(
                        "no heartbeat for {:.1} s (failure timeout {:?}): frozen, hung or cut off",
                        quiet.as_secs_f64(),
                        ctx.cfg.failure_timeout
                    ),
                );
            }
        }
    }
}

/// Accepts the heartbeat connections peers dial, each authenticated before it is read.
async fn accept(ctx: Arc<Ctx>, mut listener: Listener) {
    let gate = auth::Gate::default();
    loop {
        let conn = tokio::select! {
            () = ctx.stop.cancelled() => return,
            c = listener.accept() => c,
        };
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotConnected => return,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (ctx, gate) = (Arc::clone(&ctx), gate.clone());
        tokio::spawn(async move {
            let hs = gate
                .handshake(
                    &mut conn,
                    &ctx.cfg.secret,
                    ctx.cfg.protection,
                    ctx.cfg.handshake_timeout,
                )
                .await;
            match hs {
                Ok(a) if a.kind == ConnKind::Heartbeat && a.rank < ctx.cfg.world_size => {
                    read_beats(&ctx, a.session.wrap(conn), a.rank).await
                }
                Ok(a) => {
                    tracing::warn!(kind = ?a.kind, rank = a.rank, "refused a connection on the heartbeat port")
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Err(e) => tracing::warn!(cause = %e, "refused a heartbeat connection"),
            }
        });
    }
}

/// Reads `rank`'s heartbeats until its connection ends.
async fn read_beats(ctx: &Ctx, mut conn: Conn, rank: u32) {
    let mut m = [0u8; MSG];
    loop {
        let read = tokio::select! {
            () = ctx.stop.cancelled() => return,
            r = conn.read_exact(&mut m) => r,
        };
        match read {
            Ok(_) if m[0] == BEAT => {
                ctx.heard.lock().unwrap_or_else(|p| p.into_inner())[rank as usize] = Instant::now();
            }
            Ok(_) if m[0] == LEAVING => {
                ctx.membership.left(rank);
                return;
            }
            Ok(_) => {
                tracing::warn!(rank, kind = m[0], "unknown heartbeat message; closing");
                return;
            }
            Err(_) => {
                if ctx.membership.alive(rank) && gone(ctx, rank).await {
                    ctx.membership.declare(
                        rank,
                        "its heartbeat connection closed and nothing listens at its address: \
                         the process exited or was killed"
                            .to_owned(),
                    );
                }
                return;
            }
        }
    }
}

/// Whether `rank`'s process is gone, within a bounded wait: its detector's port refuses
/// connections, or accepts and closes them unanswered (a process being torn down). A detector
/// that answers (it sends its handshake first) is alive; one that does not answer in time
/// (frozen: the kernel accepts for it) is left to the timeout.
async fn gone(ctx: &Ctx, rank: u32) -> bool {
    let addr = ctx.dialer.directory().heartbeat(rank);
    let wait = ctx.cfg.failure_timeout.min(Duration::from_millis(500));
    for _ in 0..5 {
        let mut conn = match tokio::time::timeout(wait, ctx.cfg.transport.connect(addr)).await {
            Ok(Ok((conn, _))) => conn,
            Ok(Err(e)) => return e.kind() == std::io::ErrorKind::ConnectionRefused,
            Err(_) => return false,
        };
        let mut hello = [0u8; 8];
        match tokio::time::timeout(wait, conn.read_exact(&mut hello)).await {
            Ok(Ok(_)) => return false,
            // Closed unanswered: its listener is going away with its process; look again.
            Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(_) => return false,
        }
    }
    true
}

/// Dials `rank`'s detector and beats on the connection until `rank` fails or leaves, or this
/// worker leaves (then it says so). A broken connection is dialled again.
async fn beat_to(ctx: Arc<Ctx>, rank: u32) {
    let interval = ctx.cfg.heartbeat_interval;
    while ctx.membership.alive(rank) && !ctx.stop.is_cancelled() {
        let dialled = tokio::select! {
            () = ctx.stop.cancelled() => return,
            c = dial(&ctx, rank) => c,
        };
        let Some(mut conn) = dialled else {
            tokio::select! {
                () = ctx.stop.cancelled() => return,
                () = tokio::time::sleep(interval) => continue,
            }
        };
        // Counted while up, so that leaving waits for its `LEAVING`.
        let _up = Connected::new(&ctx.connected);
        loop {
            let leaving = ctx.leaving.load(Ordering::Acquire);
            if !leaving && !ctx.membership.alive(rank) {
                return;
            }
            let kind = if leaving { LEAVING } else { BEAT };
            if leaving || !ctx.silent.load(Ordering::Acquire) {
                let mut m = [0u8; MSG];
                m[0] = kind;
                m[8..].copy_from_slice(&ctx.seq.fetch_add(1, Ordering::Relaxed).to_le_bytes());
                // LIVE-3: a peer that stopped reading costs one interval, not more.
                let wrote = tokio::time::timeout(interval, async {
                    conn.write_all(&m).await?;
                    conn.flush().await
                })
                .await;
                if !matches!(wrote, Ok(Ok(()))) {
                    break;
                }
            }
            if leaving {
                let _ = conn.shutdown().await;
                return;
            }
            tokio::select! {
                () = ctx.stop.cancelled() => return,
                () = ctx.leave.notified() => {}
                () = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// Counts a connected heartbeat writer while it lives.
struct Connected<'a>(&'a AtomicUsize);

impl<'a> Connected<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        Self(n)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An authenticated heartbeat connection to `rank`'s detector, or `None` (LIVE-3: bounded).
async fn dial(ctx: &Ctx, rank: u32) -> Option<Conn> {
    let addr = ctx.dialer.directory().heartbeat(rank);
    let cfg = &ctx.cfg;
    let connect = tokio::time::timeout(cfg.connect_timeout.min(cfg.failure_timeout), async {
        cfg.transport.connect(addr).await
    });
    let (mut conn, _) = connect.await.ok()?.ok()?;
    let hs = auth::client(
        &mut conn,
        &cfg.secret,
        cfg.protection,
        ConnKind::Heartbeat,
        cfg.rank,
    );
    let session = tokio::time::timeout(cfg.handshake_timeout.min(cfg.failure_timeout), hs)
        .await
        .ok()?
        .ok()?;
    Some(session.wrap(conn))
}
