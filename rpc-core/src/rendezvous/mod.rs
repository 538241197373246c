//! Group formation and membership: every worker tells the rendezvous its name, rank and
//! listener address; the rendezvous answers everyone with the full table once the group's
//! initial ranks have joined, or with the list of missing ranks when its deadline passes.
//! It then stays up as the group's membership service (`server.rs`): each member keeps its
//! connection, reports the failures its detector decides and a graceful leave on it, and
//! hears of every change (a rank failed, left, is held by a new incarnation: a restarted
//! process that joined in its place, or was taken for the first time by a worker joining a
//! group that grows) from it ([`follow`]); when nothing changes, the rendezvous still says it
//! is alive every `LINK_TICK`, and a member that hears nothing for `LINK_SILENCE` dials it
//! again (RDV-7).
//!
//! A group's size is a [`GroupSize`]: the ranks it forms with and the ranks it may grow to
//! (its capacity). Ranks past the initial ones are vacant until a worker joins the running
//! group with one; a dynamic group (no initial ranks, PyTorch's `init_rpc` without a world
//! size) forms at once and admits every worker as it comes.
//!
//! The rendezvous is hosted by rank 0 by default (like torch's TCPStore), or started on its own
//! with [`RendezvousServer::start`] (a launcher or a test can then bind port 0 and hand the
//! address to every worker; that is what lets any rank, rank 0 included, be replaced). Its
//! connections pass the same authenticated handshake as RPC connections.
//!
//! RDV-10: once its host has said that the job ended ([`RendezvousServer::end`]), the
//! rendezvous tells every connection so, first thing: a join fails with
//! [`InitError::JobEnded`] and [`probe_rendezvous`] returns it, never a seat in a group that
//! is gone; the links of members still connected are closed within a tick.

mod evidence;
#[cfg(any(test, feature = "fuzzing"))]
mod fuzz;
mod handed;
mod member;
mod server;
mod unsettled;

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use fuzz::{fuzz_messages, fuzz_seeds};
pub use handed::RENDEZVOUS_FD_ENV;
pub(crate) use handed::{check as check_handed, inherited as handed_listener};
pub use member::probe_rendezvous;
pub(crate) use member::{follow, join, Redial};

use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::error::InitError;
use crate::net::auth::Secret;
use crate::net::transport::{Conn, Listener, Transport};
use crate::net::{Endpoint, MembershipEvent, Standing};

/// Largest rendezvous message (a table of many workers still fits).
const MAX_MSG: usize = 16 << 20;
/// Extra time a joiner waits past its own deadline for the server's verdict (which names the
/// missing ranks).
const VERDICT_GRACE: Duration = Duration::from_secs(5);
/// RDV-7: the rendezvous speaks on every member's link at least this often (`Update::Alive`
/// when it has nothing else to say) ...
const LINK_TICK: Duration = Duration::from_millis(500);
/// ... and a member that hears nothing on its link for this long takes the link for broken
/// (a frozen rendezvous, or its host cut off, keeps the TCP connection open and says
/// nothing): it dials again (RDV-6) and is adrift meanwhile, which its launcher ends (SUP-3).
/// A false alarm costs one redial and resume.
const LINK_SILENCE: Duration = Duration::from_secs(3);

/// How many workers a group has: the ranks it forms with (`0..initial`) and the ranks it may
/// grow to (`0..capacity`). Every worker of a group and its rendezvous must agree on it.
///
/// ```
/// use rpc_core::GroupSize;
/// assert_eq!(GroupSize::from(4), GroupSize::fixed(4));
/// let g = GroupSize::growing(2, 8);
/// assert_eq!((g.initial(), g.capacity(), g.is_dynamic()), (2, 8, false));
/// assert!(GroupSize::dynamic(16).is_dynamic());
/// assert!(GroupSize::growing(3, 2).check().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSize {
    initial: u32,
    capacity: u32,
}

impl GroupSize {
    /// A group of exactly `n` workers, formed once all have joined (a failed rank may be
    /// taken by a replacement; no rank is added).
    pub fn fixed(n: u32) -> Self {
        Self {
            initial: n,
            capacity: n,
        }
    }

    /// A group that forms with ranks `0..initial` and admits workers with ranks
    /// `initial..capacity` into the running group, each when it comes.
    pub fn growing(initial: u32, capacity: u32) -> Self {
        Self { initial, capacity }
    }

    /// A group without a world size (PyTorch's dynamic mode): it forms at once, and workers
    /// with ranks in `0..capacity` come and go (join, leave) at any time.
    pub fn dynamic(capacity: u32) -> Self {
        Self {
            initial: 0,
            capacity,
        }
    }

    /// The ranks the group forms with: `0..initial` (0: a dynamic group).
    pub fn initial(&self) -> u32 {
        self.initial
    }

    /// The ranks the group may ever hold: `0..capacity`.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Whether the group has no world size (it forms at once).
    pub fn is_dynamic(&self) -> bool {
        self.initial == 0
    }

    /// Why this is no size a group can have (no rank at all, or fewer ranks than it forms
    /// with), if it is not.
    pub fn check(&self) -> Result<(), String> {
        if self.capacity == 0 {
            Err("a group needs at least one rank (capacity 0)".into())
        } else if self.capacity < self.initial {
            Err(format!(
                "a group of {} cannot have a capacity of {}",
                self.initial, self.capacity
            ))
        } else {
            Ok(())
        }
    }
}

impl From<u32> for GroupSize {
    fn from(n: u32) -> Self {
        Self::fixed(n)
    }
}

impl std::fmt::Display for GroupSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_dynamic() {
            write!(f, "a dynamic group of up to {} ranks", self.capacity)
        } else if self.initial == self.capacity {
            write!(f, "a group of {}", self.initial)
        } else {
            write!(
                f,
                "a group of {} growing to {}",
                self.initial, self.capacity
            )
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Join {
    pub name: String,
    pub rank: u32,
    pub size: GroupSize,
    /// Where the worker's listener is reachable.
    pub addr: String,
    /// Where its failure detector listens for heartbeats (empty: no detector).
    pub heartbeat: String,
    /// It replaces the holder of its rank in a group that formed before (it is a restarted
    /// process); ignored while the group forms.
    pub replace: bool,
    /// The token the rendezvous issued to the holder it replaces, handed on by the launcher
    /// (RDV-5); with `resume`, this worker's own.
    pub token: Option<String>,
    /// It already holds its rank as this incarnation and lost its link to the rendezvous: the
    /// link is re-attached (RDV-6).
    pub resume: Option<u64>,
}

/// One rank as the rendezvous knows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Member {
    pub endpoint: Endpoint,
    pub standing: Standing,
}

impl Member {
    /// A rank no worker has joined yet.
    pub(crate) fn vacant() -> Self {
        Self {
            endpoint: Endpoint {
                name: String::new(),
                addr: String::new(),
                heartbeat: String::new(),
                incarnation: 0,
            },
            standing: Standing::Vacant,
        }
    }
}

/// The group: every rank's current incarnation and standing, after `generation` changes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct View {
    /// The group's identity: drawn at random by the rendezvous as it starts, the same for
    /// every member and every view it sends (a trace's parts name it, so that a merge can
    /// tell the parts of this run from those an earlier run left at the same path).
    pub job: String,
    /// The job's name that the rendezvous's host was given by its launcher
    /// ([`RendezvousServer::name_job`]; `rpcrun` draws one per launch on node 0): members whose
    /// own launcher gave them none take it, so that every node's parts name one job, and a
    /// later launch at the same address another (TR-7).
    pub named: Option<String>,
    /// Node 0's launcher's sink for trace parts (TR-9; [`RendezvousServer::trace_sink`]).
    pub sink: Option<String>,
    pub generation: u64,
    /// By rank, one per rank of the group's capacity (vacant ranks too).
    pub members: Vec<Member>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Verdict {
    /// The group, by rank, and the token that lets this worker's launcher replace it (RDV-5).
    Table(View, String),
    Missing(Vec<u32>),
    Refused(String),
    /// The rank's holder is alive and the joiner has no token for it: it may try again until
    /// its deadline (the holder may yet be declared failed).
    Held(String),
    /// The job has ended (RDV-10): nothing is left to join; sent to every connection, before
    /// it says anything, once the rendezvous's host has called [`RendezvousServer::end`].
    Ended,
}

/// A change the rendezvous tells members of.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Update {
    /// A new incarnation holds `rank`.
    Joined { rank: u32, endpoint: Endpoint },
    /// Incarnation `incarnation` of `rank` left gracefully.
    Left { rank: u32, incarnation: u64 },
    /// Incarnation `incarnation` of `rank` failed.
    Failed {
        rank: u32,
        incarnation: u64,
        cause: String,
    },
    /// Nothing changed; the rendezvous is alive (RDV-7).
    Alive,
}

/// What a member tells the rendezvous.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Report {
    /// Its detector declared incarnation `incarnation` of `rank` failed.
    Failed {
        rank: u32,
        incarnation: u64,
        cause: String,
    },
    /// It is leaving the running group.
    Leaving,
}

type Framed_ = Framed<Conn, LengthDelimitedCodec>;

fn framed(conn: Conn) -> Framed_ {
    Framed::new(
        conn,
        LengthDelimitedCodec::builder()
            .max_frame_length(MAX_MSG)
            .new_codec(),
    )
}

/// A membership update from the rendezvous, decoded.
fn decode_update(frame: &[u8]) -> io::Result<Update> {
    bincode::deserialize::<Update>(frame).map_err(proto)
}

fn proto(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

async fn send<T: Serialize>(f: &mut Framed_, v: &T) -> io::Result<()> {
    send_sink(f, v).await
}

async fn send_sink<T: Serialize, S>(f: &mut S, v: &T) -> io::Result<()>
where
    S: futures::Sink<bytes::Bytes, Error = io::Error> + Unpin,
{
    let bytes = bincode::serialize(v).map_err(proto)?;
    f.send(bytes::Bytes::from(bytes)).await
}

async fn recv<T: for<'de> Deserialize<'de>>(f: &mut Framed_) -> io::Result<T> {
    let frame = f.next().await.ok_or_else(|| {
        io::Error::new(io::ErrorKind::UnexpectedEof, "rendezvous connection closed")
    })??;
    bincode::deserialize(&frame).map_err(proto)
}

/// A running rendezvous: forms one group, then serves its membership (failures, graceful
/// leaves, replacements) until dropped.
#[derive(Debug)]
pub struct RendezvousServer {
    addr: String,
    task: Option<JoinHandle<()>>,
    events: broadcast::Sender<MembershipEvent>,
    formed: tokio::sync::watch::Receiver<bool>,
    /// What its task shares with it: the faults tests inject (`testing::freeze_rendezvous`,
    /// `testing::deafen_rendezvous`), the job's end and name, the ranks linked now.
    pub(crate) shared: Arc<Shared>,
}

/// What a rendezvous's task shares with its handle: faults a test injects, and the state its
/// host sets or reads.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// While set, it sends nothing on any member's link, as a frozen process would not.
    pub silenced: AtomicBool,
    /// While set, it drops the reports it reads, as a connection that breaks loses those
    /// still on their way.
    pub deaf: AtomicBool,
    /// Not a fault: set by [`RendezvousServer::end`], after which every connection is told
    /// that the job has ended (RDV-10).
    pub ended: AtomicBool,
    /// Not a fault: the ranks whose member is linked now ([`RendezvousServer::linked_ranks`]).
    pub linked: std::sync::Mutex<Vec<u32>>,
    /// Not a fault: the job's name its host gave ([`RendezvousServer::name_job`],
    /// [`View::named`]).
    pub named: std::sync::OnceLock<String>,
    /// Not a fault: node 0's launcher's sink for trace parts ([`RendezvousServer::trace_sink`],
    /// [`View::sink`]).
    pub sink: std::sync::OnceLock<String>,
}

impl RendezvousServer {
    /// Binds `bind` (port 0 picks one) and serves a group of `size` (a number of workers, or
    /// a [`GroupSize`] that may grow): it forms once the initial ranks have joined, or fails
    /// for every joiner when `timeout` passes; after that it admits restarted processes in the
    /// place of failed ones and, up to the capacity, workers with new ranks.
    pub async fn start(
        transport: &Transport,
        bind: &str,
        secret: Secret,
        size: impl Into<GroupSize>,
        timeout: Duration,
    ) -> Result<Self, InitError> {
        let size = size.into();
        size.check().map_err(InitError::Config)?;
        let listener = transport.bind(bind).await;
        let listener = listener.map_err(|source| InitError::Bind {
            addr: bind.to_owned(),
            source,
        })?;
        Self::serve(listener, bind, secret, size, timeout)
    }

    /// [`RendezvousServer::start`] on a TCP listener bound already (RDV-8: a launcher that
    /// chose the port keeps it bound until the rendezvous serves on it, so that no other
    /// process can take it in between). Must run inside a Tokio runtime.
    pub fn adopt(
        listener: std::net::TcpListener,
        secret: Secret,
        size: impl Into<GroupSize>,
        timeout: Duration,
    ) -> Result<Self, InitError> {
        let size = size.into();
        size.check().map_err(InitError::Config)?;
        let what = listener
            .local_addr()
            .map_or_else(|_| "the listener handed over".to_owned(), |a| a.to_string());
        match Listener::adopt_tcp(listener) {
            Ok(l) => Self::serve(l, &what, secret, size, timeout),
            Err(source) => Err(InitError::Bind { addr: what, source }),
        }
    }

    fn serve(
        listener: Listener,
        bind: &str,
        secret: Secret,
        size: GroupSize,
        timeout: Duration,
    ) -> Result<Self, InitError> {
        let addr = listener.local_addr().map_err(|source| InitError::Bind {
            addr: bind.to_owned(),
            source,
        })?;
        let deadline = Instant::now() + timeout;
        // Bounded: a watcher that falls this far behind is told it lagged.
        let events = broadcast::channel(1024).0;
        let (formed_tx, formed) = tokio::sync::watch::channel(false);
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(server::serve(
            listener,
            secret,
            size,
            deadline,
            events.clone(),
            (formed_tx, Arc::clone(&shared)),
        ));
        Ok(Self {
            addr,
            task: Some(task),
            events,
            formed,
            shared,
        })
    }

    /// RDV-10: the job has ended (its host knows: with `rpcrun --restart worker`, node 0's
    /// launcher once its processes succeeded). From now on every connection is told so at once:
    /// a replacement that a launcher on another node started for a rank lost near the end
    /// fails to join with [`InitError::JobEnded`], and [`probe_rendezvous`] answers the same,
    /// so that launcher stops instead of taking the rendezvous's exit for its host's death.
    pub fn end(&self) {
        self.shared.ended.store(true, Ordering::SeqCst);
    }

    /// Names the job for its members (TR-7): every view this rendezvous sends carries `name`,
    /// and a member whose own launcher named no job ([`crate::JOB_ID_ENV`]) names its trace
    /// part with it. Call it before the group's first worker starts (a view sent before says
    /// nothing); a second name is ignored: a job keeps the name it was given first.
    pub fn name_job(&self, name: &str) {
        let _ = self.shared.named.set(name.to_owned());
    }

    /// Names the sink of node 0's launcher (`host:port`) for its members (TR-9): every view
    /// this rendezvous sends carries it, each member's trace part records it, and the launchers
    /// of the other nodes send the parts they find there once their processes have ended.
    /// Like [`RendezvousServer::name_job`]: before the first worker starts, and once.
    pub fn trace_sink(&self, addr: &str) {
        let _ = self.shared.sink.set(addr.to_owned());
    }

    /// The ranks whose member holds its link to the rendezvous now (a member that exited,
    /// failed or lost its link is not among them).
    pub fn linked_ranks(&self) -> Vec<u32> {
        self.shared
            .linked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The address workers should use as `tcp://<addr>`.
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    /// The group's changes as the rendezvous decides them (a launcher restarts the process of
    /// a rank reported failed here, a frozen one included).
    pub fn subscribe(&self) -> broadcast::Receiver<MembershipEvent> {
        self.events.subscribe()
    }

    /// Waits at most `limit` for the group to form (or fail to), then lets the rendezvous
    /// serve the group's membership in the background for as long as the runtime runs (a
    /// group that never formed stops it).
    pub async fn finish(mut self, limit: Duration) {
        let mut formed = self.formed.clone();
        let _ = tokio::time::timeout(limit, formed.wait_for(|f| *f)).await;
        if *self.formed.borrow() {
            // Detached: dropping a task's handle does not stop the task.
            drop(self.task.take());
        }
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Why the rendezvous refuses `join`, given those who joined before it; `None` admits it.
fn refusal<'a>(
    join: &Join,
    size: GroupSize,
    mut joined: impl Iterator<Item = &'a Join> + Clone,
) -> Option<String> {
    if join.size != size {
        Some(format!(
            "worker `{}` says it joins {}, the rendezvous serves {size}",
            join.name, join.size
        ))
    } else if join.rank >= size.capacity() {
        Some(format!(
            "rank {} of `{}` is outside {size}",
            join.rank, join.name
        ))
    } else if let Some(other) = joined.clone().find(|j| j.rank == join.rank) {
        Some(format!(
            "rank {} already joined as `{}`",
            join.rank, other.name
        ))
    } else {
        joined
            .find(|j| j.name == join.name)
            .map(|other| format!("name `{}` already taken by rank {}", join.name, other.rank))
    }
}

/// The table of a verdict, if it is one this worker can use: one endpoint per rank of the
/// group it joined, its own under its own name, no name twice (an authenticated rendezvous of
/// another version or a faulty one must not leave a worker with a table it indexes out of).
fn check_table(view: View, me: &Join) -> io::Result<View> {
    let table = &view.members;
    if table.len() != me.size.capacity() as usize {
        return Err(proto(format!(
            "the rendezvous sent a table of {} ranks for {}",
            table.len(),
            me.size
        )));
    }
    let named = table
        .get(me.rank as usize)
        .map(|m| m.endpoint.name.as_str());
    if named != Some(me.name.as_str()) {
        return Err(proto(format!(
            "the rendezvous sent a table naming rank {} {named:?}, not `{}`",
            me.rank, me.name
        )));
    }
    let mut names: Vec<&str> = table
        .iter()
        .filter(|m| m.standing != Standing::Vacant)
        .map(|m| m.endpoint.name.as_str())
        .collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(proto(format!(
            "the rendezvous sent a table naming `{}` twice",
            w[0]
        )));
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(name: &str, rank: u32) -> Join {
        Join {
            name: name.into(),
            rank,
            size: GroupSize::fixed(3),
            addr: String::new(),
            heartbeat: String::new(),
            replace: false,
            token: None,
            resume: None,
        }
    }

    fn table(names: &[&str]) -> View {
        View {
            job: String::new(),
            named: None,
            sink: None,
            generation: 0,
            members: names
                .iter()
                .map(|n| Member {
                    endpoint: Endpoint {
                        name: (*n).into(),
                        addr: String::new(),
                        heartbeat: String::new(),
                        incarnation: 0,
                    },
                    standing: Standing::Alive,
                })
                .collect(),
        }
    }

    #[test]
    fn joins_are_refused_for_the_wrong_world_rank_or_a_name_taken() {
        let before = [join("a", 0)];
        let three = GroupSize::fixed(3);
        assert_eq!(refusal(&join("b", 1), three, before.iter()), None);
        let why = |j: &Join| refusal(j, three, before.iter()).expect("refused");
        assert!(why(&Join {
            size: GroupSize::fixed(4),
            ..join("b", 1)
        })
        .contains("joins a group of 4, the rendezvous serves a group of 3"));
        assert!(why(&join("b", 3)).contains("rank 3 of `b` is outside a group of 3"));
        let growing = GroupSize::growing(3, 5);
        let late = Join {
            size: growing,
            ..join("b", 4)
        };
        assert_eq!(refusal(&late, growing, before.iter()), None);
        assert!(why(&join("b", 0)).contains("already joined as `a`"));
        assert!(why(&join("a", 2)).contains("already taken by rank 0"));
    }

    #[test]
    fn a_table_is_used_only_if_it_is_the_group_joined() {
        let me = join("b", 1);
        assert!(check_table(table(&["a", "b", "c"]), &me).is_ok());
        let why = |t: &[&str]| check_table(table(t), &me).unwrap_err().to_string();
        assert!(why(&["a", "b"]).contains("table of 2 ranks for a group of 3"));
        assert!(why(&["a", "c", "b"]).contains("naming rank 1 Some(\"c\"), not `b`"));
        assert!(why(&["b", "b", "c"]).contains("`b` twice"));
    }

    #[test]
    fn vacant_ranks_of_a_growing_group_name_nobody() {
        let me = Join {
            size: GroupSize::growing(2, 4),
            ..join("b", 1)
        };
        let mut t = table(&["a", "b"]);
        t.members.extend([Member::vacant(), Member::vacant()]);
        assert!(check_table(t.clone(), &me).is_ok());
        t.members.pop();
        let why = check_table(t, &me).unwrap_err().to_string();
        assert!(
            why.contains("table of 3 ranks for a group of 2 growing to 4"),
            "{why}"
        );
    }
}
