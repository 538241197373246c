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
//! - LIVE-1: an incarnation of a worker is declared failed at most once, and never after it
//!   said it was leaving (graceful shutdown sends `LEAVING` on every heartbeat connection).
//!
//! The verdicts go to this worker's view of the group (`membership.rs`).
//! - LIVE-2: the detector's heartbeats and checks run on its own thread; nothing it waits for
//!   runs on the worker's runtime.
//! - LIVE-3: every wait of the detector is bounded (dial and handshake by the timeouts, a
//!   write by the heartbeat interval), so one dead peer never delays the verdict on another.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::auth::{self, ConnKind};
use super::config::NetConfig;
use super::dial::Dialer;
use super::membership::Membership;
use super::supervisor;
use super::transport::{Conn, Detached, Listener};

/// Messages on a heartbeat connection: 16 bytes, the kind, 7 reserved, a sequence number.
const BEAT: u8 = 1;
const LEAVING: u8 = 2;
const MSG: usize = 16;

/// The detector of one worker: its thread, and the switches the worker and tests use.
pub(crate) struct Detector {
    stop: CancellationToken,
    leave: Arc<Notify>,
    leaving: Arc<AtomicBool>,
    /// Heartbeat writers (one task per watched peer, dialling or beating): leaving waits
    /// for each to say `LEAVING` on its connection, or to find it has none.
    writers: Arc<AtomicUsize>,
    /// Tests: the detector stops sending heartbeats, as a frozen process would.
    silent: Arc<AtomicBool>,
    heartbeat_interval: Duration,
    /// This worker, for its launcher's watch (`supervisor.rs`): rank, incarnation, timeout.
    me: (u32, u64, Duration),
}

/// What the detector's tasks share.
struct Ctx {
    cfg: Arc<NetConfig>,
    dialer: Arc<Dialer>,
    membership: Arc<Membership>,
    /// When each peer was last heard from (a grace ahead of the start for the first time),
    /// and which of its incarnations is watched.
    heard: Mutex<Vec<(Instant, u64)>>,
    stop: CancellationToken,
    leave: Arc<Notify>,
    leaving: Arc<AtomicBool>,
    writers: Arc<AtomicUsize>,
    silent: Arc<AtomicBool>,
    seq: AtomicU64,
    /// The grace a peer gets to connect (at start, and when a new incarnation joins).
    grace: Duration,
}

impl Detector {
    /// Starts the detector of worker `cfg.rank` on a thread of its own, listening on
    /// `listener`; `None` if heartbeats are off ([`NetConfig::heartbeat_interval`] zero).
    pub(crate) fn start(
        cfg: Arc<NetConfig>,
        dialer: Arc<Dialer>,
        membership: Arc<Membership>,
        listener: Detached,
        rejoined: tokio::sync::mpsc::Receiver<u32>,
    ) -> std::io::Result<Self> {
        let stop = CancellationToken::new();
        let leave = Arc::new(Notify::new());
        let leaving = Arc::new(AtomicBool::new(false));
        let silent = Arc::new(AtomicBool::new(false));
        let writers = Arc::new(AtomicUsize::new(0));
        let heartbeat_interval = cfg.heartbeat_interval;
        let me = (cfg.rank, cfg.incarnation, cfg.failure_timeout);
        let n = dialer.directory().capacity();
        // At first a peer is given several timeouts to connect (they start at slightly
        // different moments, some on loaded machines).
        let grace = (cfg.failure_timeout * 3).max(Duration::from_secs(5));
        let first = Instant::now() + grace - cfg.failure_timeout;
        let ctx = Arc::new(Ctx {
            heard: Mutex::new(
                (0..n as u32)
                    .map(|r| (first, dialer.directory().incarnation(r)))
                    .collect(),
            ),
            cfg,
            dialer,
            membership,
            stop: stop.clone(),
            leave: Arc::clone(&leave),
            leaving: Arc::clone(&leaving),
            writers: Arc::clone(&writers),
            silent: Arc::clone(&silent),
            seq: AtomicU64::new(0),
            grace,
        });
        let name = format!("rpc-liveness-{}", ctx.cfg.rank);
        std::thread::Builder::new().name(name).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(
                        cause = %e, "no runtime for the failure detector; peers are not watched"
                    );
                    return;
                }
            };
            rt.block_on(run(ctx, listener, rejoined));
        })?;
        Ok(Self {
            stop,
            leave,
            leaving,
            writers,
            silent,
            heartbeat_interval,
            me,
        })
    }

    /// Graceful: tells every peer this worker is leaving (LIVE-1), then stops. Returns once
    /// every heartbeat writer has said so on its connection (one still dialling a peer that
    /// just joined finishes its handshake first, else the peer would see a connection close
    /// unannounced) or found it has none, or after a bounded wait (a writer may be between
    /// two beats, or blocked on a peer that stopped reading).
    pub(crate) async fn leave(&self) {
        self.leaving.store(true, Ordering::Release);
        supervisor::report_done(self.me.0, self.me.1, self.me.2);
        self.leave.notify_waiters();
        let by = Instant::now() + self.heartbeat_interval + Duration::from_secs(1);
        while self.writers.load(Ordering::Acquire) > 0 && Instant::now() < by {
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
        supervisor::report_done(self.me.0, self.me.1, self.me.2);
    }
}

async fn run(ctx: Arc<Ctx>, listener: Detached, mut rejoined: tokio::sync::mpsc::Receiver<u32>) {
    let listener = match listener.attach() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(
                cause = %e, "the failure detector cannot listen; peers are not watched"
            );
            return;
        }
    };
    let me = ctx.cfg.rank;
    tokio::spawn(accept(Arc::clone(&ctx), listener));
    tokio::spawn(tell_launcher(Arc::clone(&ctx)));
    for rank in 0..ctx.dialer.directory().capacity() as u32 {
        if rank != me && !ctx.dialer.directory().heartbeat(rank).is_empty() {
            let incarnation = ctx.dialer.directory().incarnation(rank);
            tokio::spawn(beat_to(Arc::clone(&ctx), rank, incarnation));
        }
    }
    let period = (ctx.cfg.heartbeat_interval / 2).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            () = ctx.stop.cancelled() => return,
            () = tokio::time::sleep(period) => {}
            Some(rank) = rejoined.recv() => {
                // A new incarnation: watched from now on, with the grace a starting peer gets.
                let first = Instant::now() + ctx.grace - ctx.cfg.failure_timeout;
                let incarnation = ctx.dialer.directory().incarnation(rank);
                let mut heard = ctx.heard.lock().unwrap_or_else(|p| p.into_inner());
                heard[rank as usize] = (first, incarnation);
                drop(heard);
                if !ctx.dialer.directory().heartbeat(rank).is_empty() {
                    tokio::spawn(beat_to(Arc::clone(&ctx), rank, incarnation));
                }
                continue;
            }
        }
        if ctx.leaving.load(Ordering::Acquire) {
            continue;
        }
        let now = Instant::now();
        let late: Vec<(u32, u64, Duration)> = {
            let heard = ctx.heard.lock().unwrap_or_else(|p| p.into_inner());
            heard
                .iter()
                .enumerate()
                .filter(|(r, _)| *r as u32 != me)
                .filter_map(|(r, (t, inc))| {
                    let quiet = now.saturating_duration_since(*t);
                    (quiet > ctx.cfg.failure_timeout).then_some((r as u32, *inc, quiet))
                })
                .collect()
        };
        for (rank, incarnation, quiet) in late {
            // Only the incarnation watched: a new one gets its grace first (MEM-1).
            if ctx.membership.alive_incarnation(rank, incarnation)
                && !ctx.dialer.directory().heartbeat(rank).is_empty()
            {
                ctx.membership.declare_incarnation(
                    rank,
                    Some(incarnation),
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

/// SUP-1..3: this worker's standing, for its launcher, every heartbeat interval from the
/// detector's thread (LIVE-2): when this thread cannot run, the launcher hears nothing, as the
/// peers do. Silent (tests' frozen process) says nothing either.
async fn tell_launcher(ctx: Arc<Ctx>) {
    let c = &ctx.cfg;
    loop {
        if !ctx.silent.load(Ordering::Acquire) {
            supervisor::report_alive(
                c.rank,
                c.incarnation,
                c.failure_timeout,
                &ctx.membership.own,
                || ctx.leaving.load(Ordering::Acquire) || ctx.stop.is_cancelled(),
            );
        }
        tokio::select! {
            () = ctx.stop.cancelled() => return,
            () = tokio::time::sleep(c.heartbeat_interval) => {}
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
                    ctx.cfg.me(),
                )
                .await;
            match hs {
                Ok(a) if a.kind == ConnKind::Heartbeat && a.rank < ctx.cfg.capacity => {
                    let admitted = ctx
                        .membership
                        .admit(a.rank, a.incarnation, ctx.cfg.handshake_timeout)
                        .await;
                    match admitted {
                        Ok(_) => {
                            read_beats(&ctx, a.session.wrap(conn), a.rank, a.incarnation).await
                        }
                        Err(why) => {
                            tracing::warn!(rank = a.rank, %why, "refused a heartbeat connection")
                        }
                    }
                }
                Ok(a) => {
                    tracing::warn!(
                        kind = ?a.kind, rank = a.rank, "refused a connection on the heartbeat port"
                    )
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Err(e) => tracing::warn!(cause = %e, "refused a heartbeat connection"),
            }
        });
    }
}

/// Reads the heartbeats of incarnation `incarnation` of `rank` until its connection ends
/// (MEM-1: they count only while it holds the rank).
async fn read_beats(ctx: &Ctx, mut conn: Conn, rank: u32, incarnation: u64) {
    let mut m = [0u8; MSG];
    loop {
        let read = tokio::select! {
            () = ctx.stop.cancelled() => return,
            r = conn.read_exact(&mut m) => r,
        };
        match read {
            Ok(_) if m[0] == BEAT => {
                if !ctx.membership.alive_incarnation(rank, incarnation) {
                    return;
                }
                ctx.heard.lock().unwrap_or_else(|p| p.into_inner())[rank as usize].0 =
                    Instant::now();
            }
            Ok(_) if m[0] == LEAVING => {
                ctx.membership.quiet(rank, incarnation);
                return;
            }
            Ok(_) => {
                tracing::warn!(rank, kind = m[0], "unknown heartbeat message; closing");
                return;
            }
            Err(_) => {
                if ctx.membership.alive_incarnation(rank, incarnation) && gone(ctx, rank).await {
                    ctx.membership.declare_incarnation(
                        rank,
                        Some(incarnation),
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
        let mut conn = match tokio::time::timeout(wait, ctx.cfg.transport.connect(&addr)).await {
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

/// Dials the detector of incarnation `incarnation` of `rank` and beats on the connection
/// until it fails, leaves or is replaced, or this worker leaves (then it says so). A broken
/// connection is dialled again.
async fn beat_to(ctx: Arc<Ctx>, rank: u32, incarnation: u64) {
    let interval = ctx.cfg.heartbeat_interval;
    // Counted while it runs, so that leaving waits for its `LEAVING`.
    let _writer = Counted::new(&ctx.writers);
    while ctx.membership.alive_incarnation(rank, incarnation) && !ctx.stop.is_cancelled() {
        if ctx.leaving.load(Ordering::Acquire) {
            return; // no connection: nothing to close unannounced
        }
        let dialled = tokio::select! {
            () = ctx.stop.cancelled() => return,
            c = dial(&ctx, rank) => c,
        };
        let Some(mut conn) = dialled else {
            tokio::select! {
                () = ctx.stop.cancelled() => return,
                () = ctx.leave.notified() => continue,
                () = tokio::time::sleep(interval) => continue,
            }
        };
        loop {
            let leaving = ctx.leaving.load(Ordering::Acquire);
            if !leaving && !ctx.membership.alive_incarnation(rank, incarnation) {
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

/// Counts a heartbeat writer while it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        Self(n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An authenticated heartbeat connection to `rank`'s detector, or `None` (LIVE-3: bounded).
async fn dial(ctx: &Ctx, rank: u32) -> Option<Conn> {
    let addr = ctx.dialer.directory().heartbeat(rank);
    let cfg = &ctx.cfg;
    let connect = tokio::time::timeout(cfg.connect_timeout.min(cfg.failure_timeout), async {
        cfg.transport.connect(&addr).await
    });
    let (mut conn, _) = connect.await.ok()?.ok()?;
    let hs = auth::client(
        &mut conn,
        &cfg.secret,
        cfg.protection,
        ConnKind::Heartbeat,
        cfg.me(),
        Some(auth::Ident {
            rank,
            incarnation: ctx.dialer.directory().incarnation(rank),
        }),
    );
    let session = tokio::time::timeout(cfg.handshake_timeout.min(cfg.failure_timeout), hs)
        .await
        .ok()?
        .ok()?;
    Some(session.wrap(conn))
}
