//! This worker's view of the group ([`Membership`]): each rank's current incarnation and how
//! it stands (alive, shutting down, left, failed, vacant), and who is told when that changes.
//! The failure detector's verdicts change it (`liveness.rs`), and so does the rendezvous
//! (`rendezvous::follow`): failures other members decided, graceful leaves, and new
//! incarnations (restarted processes) that take a failed rank's place. Plain state behind a
//! lock and a status byte per rank; it never waits on the network.
//!
//! Invariants: LIVE-1 (a verdict at most once, never after a leave), MEM-1 and MEM-2 (on
//! [`Membership`]).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::dial::Directory;
use super::events::{MembershipChange, MembershipEvent, WorkerFailed};

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
    pub(super) failures_tx: broadcast::Sender<WorkerFailed>,
    pub(super) events_tx: broadcast::Sender<MembershipEvent>,
    hooks: RwLock<Vec<FailureHook>>,
    rejoin_hooks: RwLock<Vec<RankHook>>,
    left_hooks: RwLock<Vec<RankHook>>,
    /// This worker's own standing, as its launcher is told it (`supervisor.rs`).
    pub(crate) own: super::supervisor::Own,
    /// Tests: drops this worker's link to the rendezvous, as a network fault would.
    pub(crate) cut_link: tokio::sync::Notify,
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
            own: Default::default(),
            cut_link: tokio::sync::Notify::new(),
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
    pub(super) fn quiet(&self, rank: u32, incarnation: u64) {
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
        tracing::info!(
            worker = %e.name, rank, incarnation = e.incarnation, "worker left the group"
        );
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
        tracing::warn!(
            worker = %verdict.name,
            rank,
            incarnation = verdict.incarnation,
            cause = %verdict.cause,
            "worker declared failed",
        );
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
        tracing::info!(
            worker = %event.name,
            rank,
            incarnation = e.incarnation,
            addr = %e.addr,
            "a new incarnation joined",
        );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::dial::Endpoint;
    use std::sync::atomic::AtomicUsize;

    fn endpoint(r: u32, incarnation: u64) -> Endpoint {
        Endpoint {
            name: format!("worker{r}"),
            addr: format!("w{r}:{incarnation}"),
            heartbeat: String::new(),
            incarnation,
        }
    }

    /// Three ranks, alive at generation 0; the third vacant when `vacant`.
    fn view(vacant: bool) -> Membership {
        let eps = (0..3)
            .map(|r| (!(vacant && r == 2)).then(|| endpoint(r, 0)))
            .collect();
        let standing = if vacant {
            vec![Standing::Alive, Standing::Alive, Standing::Vacant]
        } else {
            Vec::new()
        };
        Membership::new(Arc::new(Directory::new(eps)), 0, &standing)
    }

    fn changes(m: &Membership) -> Vec<(u64, u32, u64, &'static str)> {
        m.history()
            .into_iter()
            .map(|e| {
                let kind = match e.change {
                    MembershipChange::Failed { .. } => "failed",
                    MembershipChange::Left => "left",
                    MembershipChange::Joined { .. } => "joined",
                };
                (e.generation, e.rank, e.incarnation, kind)
            })
            .collect()
    }

    /// LIVE-1: a verdict is made once, runs the hooks and cancels the rank's token once; a
    /// rank that left is never declared failed.
    #[test]
    fn a_verdict_is_made_once_and_never_after_a_leave() {
        let m = view(false);
        let hooks = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hooks);
        m.on_failure(Arc::new(move |f| {
            assert_eq!(f.rank, 1);
            h.fetch_add(1, Ordering::SeqCst);
        }));
        let gone = m.gone(1);
        assert!(m.declare_incarnation(1, None, "silent".into()));
        assert!(!m.declare_incarnation(1, None, "again".into()));
        assert!(gone.is_cancelled() && m.is_failed(1));
        assert_eq!(m.failure(1).unwrap().cause, "silent");
        assert_eq!(hooks.load(Ordering::SeqCst), 1);
        assert!(m.depart(2, 0));
        assert!(!m.declare_incarnation(2, None, "late".into()));
        assert!(m.has_left(2) && !m.alive(2));
        assert_eq!(m.failures().len(), 1);
    }

    /// MEM-2: one generation per change, published in order; a non-change is no generation.
    #[test]
    fn every_change_is_one_generation_in_order() {
        let m = view(false);
        assert!(m.declare_incarnation(0, Some(0), "x".into()));
        assert!(!m.depart(0, 0), "a failed rank cannot leave");
        assert!(m.depart(1, 0));
        assert!(m.rejoin(0, &endpoint(0, 1)));
        assert_eq!(
            changes(&m),
            [(1, 0, 0, "failed"), (2, 1, 0, "left"), (3, 0, 1, "joined")]
        );
        assert_eq!(m.generation(), 3);
    }

    /// MEM-1: a new incarnation fails the one it replaces (if it had not failed) and takes
    /// the rank; the old one is fenced (refused, and its verdicts ignored); incarnations only
    /// grow.
    #[tokio::test]
    async fn a_replacement_fences_the_incarnation_it_replaces() {
        let m = view(false);
        let wait = Duration::from_millis(50);
        assert!(m.admit(1, 0, wait).await.is_ok());
        assert!(m.rejoin(1, &endpoint(1, 1)));
        assert_eq!(
            changes(&m),
            [(1, 1, 0, "failed"), (2, 1, 1, "joined")],
            "the replaced incarnation fails first"
        );
        let e = m.admit(1, 0, wait).await.unwrap_err();
        assert!(e.contains("replaced by incarnation 1 (fenced)"), "{e}");
        assert!(m.admit(1, 1, wait).await.is_ok());
        assert!(!m.declare_incarnation(1, Some(0), "stale".into()));
        assert!(m.alive_incarnation(1, 1));
        assert!(!m.rejoin(1, &endpoint(1, 1)), "not news");
        assert!(!m.rejoin(1, &endpoint(1, 0)), "never back");
        // An incarnation not heard of yet is waited for, then refused.
        let e = m.admit(1, 2, wait).await.unwrap_err();
        assert!(e.contains("has not heard of"), "{e}");
    }

    /// A vacant rank refuses connections until its first worker joins (incarnation 0).
    #[tokio::test]
    async fn a_vacant_rank_is_refused_until_it_is_taken() {
        let m = view(true);
        assert!(m.is_vacant(2) && !m.alive(2));
        let e = m.admit(2, 0, Duration::from_millis(20)).await.unwrap_err();
        assert!(
            e.contains("vacant") || e.contains("has not heard of"),
            "{e}"
        );
        assert!(m.rejoin(2, &endpoint(2, 0)));
        assert!(m.alive_incarnation(2, 0));
        assert!(m.admit(2, 0, Duration::from_millis(20)).await.is_ok());
        assert_eq!(
            changes(&m),
            [(1, 2, 0, "joined")],
            "no verdict on a vacancy"
        );
    }
}
