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
//! Membership ([`Membership`]) is this worker's view of the group: each rank's current
//! incarnation and how it stands (alive, shutting down, left, failed). The detector's
//! verdicts change it, and so does the rendezvous (`rendezvous::follow`): failures other
//! members decided, graceful leaves, and new incarnations (restarted processes) that take a
//! failed rank's place. MEM-1 and MEM-2 are on [`Membership`].
//! - LIVE-2: the detector's heartbeats and checks run on its own thread; nothing it waits for
//!   runs on the worker's runtime.
//! - LIVE-3: every wait of the detector is bounded (dial and handshake by the timeouts, a
//!   write by the heartbeat interval), so one dead peer never delays the verdict on another.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
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
    /// Which incarnation of the rank failed (0: the process that formed the group; one more
    /// for each replacement).
    pub incarnation: u64,
    /// Why it was declared failed (no heartbeat for how long, or its process is gone).
    pub cause: String,
    /// When.
    pub at: SystemTime,
}

/// A change of the group as this worker saw it (see `Agent::watch_membership`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MembershipEvent {
    /// The view's generation after the change: one more than the previous change's (every
    /// worker sees the same changes of each rank in the same order).
    pub generation: u64,
    /// The rank that changed.
    pub rank: u32,
    /// Its name (a replacement keeps the name and rank of the worker it replaces).
    pub name: String,
    /// The incarnation the change is about.
    pub incarnation: u64,
    /// What happened.
    pub change: MembershipChange,
}

/// What happened to a member.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipChange {
    /// A new incarnation holds the rank (the previous one failed, left or was replaced; or,
    /// with incarnation 0, a worker took a vacant rank of a group that grows); calls go to it
    /// from now on, connections of the previous one are refused.
    Joined {
        /// Where its listener is reachable.
        addr: String,
    },
    /// It left the group gracefully; calls to it are refused.
    Left,
    /// It was declared failed; calls to it and waits on it fail.
    Failed {
        /// Why.
        cause: String,
    },
}

/// A stream of a membership's records: those made before it began first (read after
/// subscribing, so none falls between), then the live ones; re-read whole if it lags.
struct Replay<T> {
    membership: Arc<Membership>,
    known: std::collections::VecDeque<T>,
    rx: broadcast::Receiver<T>,
    reread: fn(&Membership) -> Vec<T>,
}

impl<T: Clone> Replay<T> {
    fn new(
        membership: Arc<Membership>,
        tx: fn(&Membership) -> &broadcast::Sender<T>,
        reread: fn(&Membership) -> Vec<T>,
    ) -> Self {
        let rx = tx(&membership).subscribe();
        let known = reread(&membership).into();
        Self {
            membership,
            known,
            rx,
            reread,
        }
    }

    /// The next record `fresh` accepts (it sees each one once, in order); `None` once the
    /// worker is gone. Cancel safe: a record is returned by the call that completes.
    async fn next(&mut self, mut fresh: impl FnMut(&T) -> bool) -> Option<T> {
        loop {
            if let Some(v) = self.known.pop_front() {
                if fresh(&v) {
                    return Some(v);
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(v) => self.known.push_back(v),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.known = (self.reread)(&self.membership).into();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// The verdicts of a worker's failure detector as they come, those made before the watch
/// began first (see `Agent::watch_failures`).
pub struct FailureWatch {
    replay: Replay<WorkerFailed>,
    seen: std::collections::BTreeSet<(u32, u64)>,
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
        Self {
            replay: Replay::new(membership, |m| &m.failures_tx, Membership::failures),
            seen: Default::default(),
        }
    }

    /// The next verdict this watch has not returned yet; `None` once the worker is gone.
    /// Each failed incarnation of a worker is returned once.
    ///
    /// # Cancel safety
    /// Cancel safe: a verdict is returned by the call that completes, never lost.
    pub async fn next(&mut self) -> Option<WorkerFailed> {
        let seen = &mut self.seen;
        self.replay
            .next(|v| seen.insert((v.rank, v.incarnation)))
            .await
    }
}

/// The changes of the group as they come, the view's history first (see
/// `Agent::watch_membership`).
pub struct MembershipWatch {
    replay: Replay<MembershipEvent>,
    next_generation: u64,
}

impl std::fmt::Debug for MembershipWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipWatch")
            .field("next_generation", &self.next_generation)
            .finish()
    }
}

impl MembershipWatch {
    pub(crate) fn new(membership: Arc<Membership>) -> Self {
        Self {
            replay: Replay::new(membership, |m| &m.events_tx, Membership::history),
            next_generation: 0,
        }
    }

    /// The next change this watch has not returned yet, in generation order; `None` once the
    /// worker is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: an event is returned by the call that completes, never lost.
    pub async fn next(&mut self) -> Option<MembershipEvent> {
        let next = &mut self.next_generation;
        self.replay
            .next(|v| {
                let fresh = v.generation >= *next;
                if fresh {
                    *next = v.generation + 1;
                }
                fresh
            })
            .await
    }
}

/// Messages on a heartbeat connection: 16 bytes, the kind, 7 reserved, a sequence number.
const BEAT: u8 = 1;
const LEAVING: u8 = 2;
const MSG: usize = 16;

/// Runs when a peer is declared failed; must return quickly.
pub(crate) type FailureHook = Arc<dyn Fn(&WorkerFailed) + Send + Sync>;
/// Runs when a peer left or a new incarnation of it joined; must return quickly.
pub(crate) type RankHook = Arc<dyn Fn(u32) + Send + Sync>;

/// How a member stands (its `status` byte mirrors it for the lock-free checks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PeerState {
    Alive,
    /// It is shutting down with the group (its detector said so): not watched any more,
    /// still served and called while the group's shutdown runs.
    Quiet,
    /// It left the running group: calls to it are refused.
    Left,
    Failed(WorkerFailed),
    /// No worker has taken the rank yet (a group that grows): calls to it are refused.
    Vacant,
}

const ALIVE: u8 = 0;
const LEFT: u8 = 1;
const FAILED: u8 = 2;
const QUIET: u8 = 3;
const VACANT: u8 = 4;

/// One rank: the incarnation holding it and how that incarnation stands.
struct Slot {
    state: PeerState,
    incarnation: u64,
    /// Cancelled when this incarnation fails: work running for it stops.
    gone: CancellationToken,
}

struct View {
    slots: Vec<Slot>,
    generation: u64,
    /// Every change so far, in order (bounded by the group's changes, which are few).
    history: Vec<MembershipEvent>,
    /// Every verdict so far, in order.
    verdicts: Vec<WorkerFailed>,
}

/// Which peers are alive, left or failed, which incarnation holds each rank, and who is told
/// when that changes.
///
/// Invariants:
/// - MEM-1: a rank's incarnation only grows; connections and verdicts of an earlier
///   incarnation are refused or ignored once a later one is known (fencing).
/// - MEM-2: every change is one generation: the generation grows by one per change, events
///   are published in generation order.
pub(crate) struct Membership {
    directory: Arc<Directory>,
    view: Mutex<View>,
    /// `ALIVE`, `LEFT` or `FAILED` per rank: read on every call's path.
    status: Vec<AtomicU8>,
    /// Bumped after every change: a handshake from an incarnation not known yet waits on it.
    changed: tokio::sync::watch::Sender<u64>,
    failures_tx: broadcast::Sender<WorkerFailed>,
    events_tx: broadcast::Sender<MembershipEvent>,
    hooks: RwLock<Vec<FailureHook>>,
    rejoin_hooks: RwLock<Vec<RankHook>>,
    left_hooks: RwLock<Vec<RankHook>>,
}

/// How a rank stood when this worker joined (a replacement joins a group where some ranks
/// failed or left).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub(crate) enum Standing {
    Alive,
    Left,
    Failed(String),
    /// No worker has taken the rank yet.
    Vacant,
}

impl Membership {
    /// The membership of a group `directory` lists, each rank standing as `standing` says
    /// (alive where it says nothing), at `generation`.
    pub(crate) fn new(directory: Arc<Directory>, generation: u64, standing: &[Standing]) -> Self {
        let n = directory.capacity();
        let slots: Vec<Slot> = (0..n as u32)
            .map(|r| {
                let incarnation = directory.incarnation(r);
                let gone = CancellationToken::new();
                let state = match standing.get(r as usize) {
                    Some(Standing::Left) => PeerState::Left,
                    Some(Standing::Vacant) => PeerState::Vacant,
                    Some(Standing::Failed(cause)) => {
                        gone.cancel();
                        PeerState::Failed(WorkerFailed {
                            rank: r,
                            name: directory.name(r).to_owned(),
                            incarnation,
                            cause: cause.clone(),
                            at: SystemTime::now(),
                        })
                    }
                    _ => PeerState::Alive,
                };
                Slot {
                    state,
                    incarnation,
                    gone,
                }
            })
            .collect();
        let status = slots
            .iter()
            .map(|s| AtomicU8::new(code(&s.state)))
            .collect();
        let verdicts = slots
            .iter()
            .filter_map(|s| match &s.state {
                PeerState::Failed(f) => Some(f.clone()),
                _ => None,
            })
            .collect();
        Self {
            view: Mutex::new(View {
                slots,
                generation,
                history: Vec::new(),
                verdicts,
            }),
            status,
            changed: tokio::sync::watch::channel(0).0,
            // Bounded: a watcher that falls this far behind is told it lagged.
            failures_tx: broadcast::channel(1024).0,
            events_tx: broadcast::channel(1024).0,
            hooks: RwLock::new(Vec::new()),
            rejoin_hooks: RwLock::new(Vec::new()),
            left_hooks: RwLock::new(Vec::new()),
            directory,
        }
    }

    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn status(&self, rank: u32) -> u8 {
        self.status
            .get(rank as usize)
            .map_or(ALIVE, |s| s.load(Ordering::Acquire))
    }

    /// Whether `rank` was declared failed (cheap: on every call's path).
    pub(crate) fn is_failed(&self, rank: u32) -> bool {
        self.status(rank) == FAILED
    }

    /// Whether `rank` left the group gracefully (cheap: on every call's path).
    pub(crate) fn has_left(&self, rank: u32) -> bool {
        self.status(rank) == LEFT
    }

    /// Whether no worker has taken `rank` yet (cheap: on every call's path).
    pub(crate) fn is_vacant(&self, rank: u32) -> bool {
        self.status(rank) == VACANT
    }

    /// The verdict on `rank`'s current incarnation, if it was declared failed.
    pub(crate) fn failure(&self, rank: u32) -> Option<WorkerFailed> {
        if !self.is_failed(rank) {
            return None;
        }
        match self.view().slots.get(rank as usize).map(|s| &s.state) {
            Some(PeerState::Failed(f)) => Some(f.clone()),
            _ => None,
        }
    }

    /// Every verdict so far (of every incarnation), in the order they were made, those
    /// known when this worker joined first.
    pub(crate) fn failures(&self) -> Vec<WorkerFailed> {
        self.view().verdicts.clone()
    }

    /// Every change so far, in generation order.
    pub(crate) fn history(&self) -> Vec<MembershipEvent> {
        self.view().history.clone()
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.status.len()
    }

    /// The view's generation.
    pub(crate) fn generation(&self) -> u64 {
        self.view().generation
    }

    /// How `rank`'s current incarnation stands.
    pub(crate) fn state(&self, rank: u32) -> PeerState {
        self.view().slots[rank as usize].state.clone()
    }

    /// Runs `hook` on every verdict from now on.
    pub(crate) fn on_failure(&self, hook: FailureHook) {
        self.hooks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Runs `hook` whenever a new incarnation of a rank joins.
    pub(crate) fn on_rejoin(&self, hook: RankHook) {
        self.rejoin_hooks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Runs `hook` whenever a rank leaves gracefully.
    pub(crate) fn on_left(&self, hook: RankHook) {
        self.left_hooks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Cancelled when `rank`'s current incarnation is declared failed.
    pub(crate) fn gone(&self, rank: u32) -> CancellationToken {
        self.view().slots[rank as usize].gone.clone()
    }

    /// The token of incarnation `incarnation` of `rank` if it is the current one and has not
    /// failed: what serving a connection from it waits on. A later incarnation than the one
    /// known is waited for (at most `wait`): a replacement may dial before the news of it
    /// arrives here. `Err` says why the connection is refused (MEM-1).
    pub(crate) async fn admit(
        &self,
        rank: u32,
        incarnation: u64,
        wait: Duration,
    ) -> Result<CancellationToken, String> {
        let (known, vacant) = {
            let v = self.view();
            let s = &v.slots[rank as usize];
            (s.incarnation, s.state == PeerState::Vacant)
        };
        if incarnation > known || vacant {
            // A replacement, or the first worker of a vacant rank, may dial before the news
            // of it arrives here.
            let mut rx = self.changed.subscribe();
            let reached = rx.wait_for(|_| {
                let v = self.view();
                let s = &v.slots[rank as usize];
                s.incarnation >= incarnation && s.state != PeerState::Vacant
            });
            let got = matches!(tokio::time::timeout(wait, reached).await, Ok(Ok(_)));
            if !got {
                return Err(format!(
                    "it claims incarnation {incarnation} of rank {rank}, which this worker has \
                     not heard of within {wait:?} (it knows incarnation {known})"
                ));
            }
        }
        let v = self.view();
        let s = &v.slots[rank as usize];
        if incarnation < s.incarnation {
            return Err(format!(
                "incarnation {incarnation} of rank {rank} was replaced by incarnation {} \
                 (fenced)",
                s.incarnation
            ));
        }
        match &s.state {
            PeerState::Failed(f) => Err(format!(
                "incarnation {incarnation} of rank {rank} was declared failed: {}",
                f.cause
            )),
            PeerState::Vacant => Err(format!("rank {rank} is vacant: no worker has joined it")),
            _ => Ok(s.gone.clone()),
        }
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
    pub(crate) fn alive(&self, rank: u32) -> bool {
        self.status(rank) == ALIVE
    }

    /// Whether incarnation `incarnation` of `rank` is the current one and still watched.
    pub(crate) fn alive_incarnation(&self, rank: u32, incarnation: u64) -> bool {
        let v = self.view();
        let s = &v.slots[rank as usize];
        s.incarnation == incarnation && s.state == PeerState::Alive
    }

    /// Records `change` of `rank` as the next generation (MEM-2). Called with the view
    /// locked; publishing happens after it is released.
    fn record(v: &mut View, name: &str, rank: u32, change: MembershipChange) -> MembershipEvent {
        v.generation += 1;
        let e = MembershipEvent {
            generation: v.generation,
            rank,
            name: name.to_owned(),
            incarnation: v.slots[rank as usize].incarnation,
            change,
        };
        v.history.push(e.clone());
        e
    }

    fn publish(&self, e: MembershipEvent) {
        self.changed.send_modify(|g| *g += 1);
        let _ = self.events_tx.send(e);
    }

    /// Incarnation `incarnation` of `rank` said it is shutting down with the group: it is not
    /// watched any more (LIVE-1).
    fn quiet(&self, rank: u32, incarnation: u64) {
        let mut v = self.view();
        if let Some(s) = v.slots.get_mut(rank as usize) {
            if s.state == PeerState::Alive && s.incarnation == incarnation {
                s.state = PeerState::Quiet;
                self.status[rank as usize].store(QUIET, Ordering::Release);
            }
        }
    }

    /// Incarnation `incarnation` of `rank` left the running group: it is not watched any
    /// more (LIVE-1), calls to it are refused, watchers are told.
    pub(crate) fn depart(&self, rank: u32, incarnation: u64) -> bool {
        let e = {
            let mut v = self.view();
            let Some(s) = v.slots.get_mut(rank as usize) else {
                return false;
            };
            let live = matches!(s.state, PeerState::Alive | PeerState::Quiet);
            if !live || incarnation != s.incarnation {
                return false;
            }
            s.state = PeerState::Left;
            self.status[rank as usize].store(LEFT, Ordering::Release);
            Self::record(
                &mut v,
                self.directory.name(rank),
                rank,
                MembershipChange::Left,
            )
        };
        tracing::info!(worker = %e.name, rank, incarnation = e.incarnation, "worker left the group");
        let hooks = self
            .left_hooks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for h in hooks {
            h(rank);
        }
        self.publish(e);
        true
    }

    /// Declares incarnation `incarnation` of `rank` (the current one, if `None`) failed for
    /// `cause`, once (LIVE-1), unless a later one holds the rank (MEM-1): its token is
    /// cancelled, the hooks run, watchers are told. Returns whether this call made the
    /// verdict.
    pub(crate) fn declare_incarnation(
        &self,
        rank: u32,
        incarnation: Option<u64>,
        cause: String,
    ) -> bool {
        let (verdict, event, gone) = {
            let mut v = self.view();
            let Some(s) = v.slots.get_mut(rank as usize) else {
                return false;
            };
            if s.state != PeerState::Alive || incarnation.is_some_and(|i| i != s.incarnation) {
                return false;
            }
            let verdict = WorkerFailed {
                rank,
                name: self.directory.name(rank).to_owned(),
                incarnation: s.incarnation,
                cause: cause.clone(),
                at: SystemTime::now(),
            };
            s.state = PeerState::Failed(verdict.clone());
            let gone = s.gone.clone();
            v.verdicts.push(verdict.clone());
            self.status[rank as usize].store(FAILED, Ordering::Release);
            let name = verdict.name.clone();
            let e = Self::record(&mut v, &name, rank, MembershipChange::Failed { cause });
            (verdict, e, gone)
        };
        tracing::warn!(worker = %verdict.name, rank, incarnation = verdict.incarnation, cause = %verdict.cause, "worker declared failed");
        gone.cancel();
        let hooks = self.hooks.read().unwrap_or_else(|p| p.into_inner()).clone();
        for h in hooks {
            h(&verdict);
        }
        let _ = self.failures_tx.send(verdict);
        self.publish(event);
        true
    }

    /// A later incarnation of `e`'s rank joined the group at `e`'s addresses (or its first
    /// one, if the rank was vacant): the one it replaces is declared failed first if it was
    /// not (its connections are closed and refused from now on), then calls go to the new
    /// one (MEM-1). Returns whether `e` was news.
    pub(crate) fn rejoin(&self, rank: u32, e: &super::dial::Endpoint) -> bool {
        let news = |s: &Slot| e.incarnation > s.incarnation || s.state == PeerState::Vacant;
        let current = {
            let v = self.view();
            match v.slots.get(rank as usize) {
                Some(s) if news(s) => s.incarnation,
                _ => return false,
            }
        };
        self.declare_incarnation(
            rank,
            Some(current),
            format!(
                "replaced by incarnation {} of the rank at {} (its process was restarted)",
                e.incarnation, e.addr
            ),
        );
        let event = {
            let mut v = self.view();
            let s = &mut v.slots[rank as usize];
            if !news(s) || !self.directory.replace(rank, e) {
                return false;
            }
            s.incarnation = e.incarnation;
            s.state = PeerState::Alive;
            s.gone = CancellationToken::new();
            self.status[rank as usize].store(ALIVE, Ordering::Release);
            let addr = e.addr.clone();
            Self::record(
                &mut v,
                self.directory.name(rank),
                rank,
                MembershipChange::Joined { addr },
            )
        };
        tracing::info!(worker = %event.name, rank, incarnation = e.incarnation, addr = %e.addr, "a new incarnation joined");
        let hooks = self
            .rejoin_hooks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for h in hooks {
            h(rank);
        }
        self.publish(event);
        true
    }
}

fn code(s: &PeerState) -> u8 {
    match s {
        PeerState::Alive => ALIVE,
        PeerState::Quiet => QUIET,
        PeerState::Left => LEFT,
        PeerState::Failed(_) => FAILED,
        PeerState::Vacant => VACANT,
    }
}

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
                    tracing::error!(cause = %e, "no runtime for the failure detector; peers are not watched");
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
        })
    }

    /// Graceful: tells every peer this worker is leaving (LIVE-1), then stops. Returns once
    /// every heartbeat writer has said so on its connection (one still dialling a peer that
    /// just joined finishes its handshake first, else the peer would see a connection close
    /// unannounced) or found it has none, or after a bounded wait (a writer may be between
    /// two beats, or blocked on a peer that stopped reading).
    pub(crate) async fn leave(&self) {
        self.leaving.store(true, Ordering::Release);
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
    }
}

async fn run(ctx: Arc<Ctx>, listener: Detached, mut rejoined: tokio::sync::mpsc::Receiver<u32>) {
    let listener = match listener.attach() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(cause = %e, "the failure detector cannot listen; peers are not watched");
            return;
        }
    };
    let me = ctx.cfg.rank;
    tokio::spawn(accept(Arc::clone(&ctx), listener));
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
                ctx.heard.lock().unwrap_or_else(|p| p.into_inner())[rank as usize] = (first, incarnation);
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
                    tracing::warn!(kind = ?a.kind, rank = a.rank, "refused a connection on the heartbeat port")
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
    );
    let session = tokio::time::timeout(cfg.handshake_timeout.min(cfg.failure_timeout), hs)
        .await
        .ok()?
        .ok()?;
    Some(session.wrap(conn))
}
