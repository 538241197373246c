//! Messages matched by (source, tag), and per-operation aborts.
//!
//! - COL-2: once a worker is declared failed, every receive from it fails at once with its
//!   verdict, and so does every receive of an operation of a group it belongs to, on every
//!   member (not only its ring neighbours, whose peers would otherwise wait for messages that
//!   will not come); later ones fail at once too.
//! - COL-3: a verdict dooms the incarnation it names and older ones: once a replacement of the
//!   worker has joined, groups created with it (and point-to-point messages from it) work, and
//!   what the failed incarnation left queued is dropped.

use candle_core::Tensor;
use rpc_core::ext::AgentExt;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn, ToWorker};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

use autograd_dist::RTensor;

/// Names a message: its operation (group and sequence number, or the user's p2p tag) and step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct Tag {
    pub group: u64,
    pub seq: u64,
    pub step: u32,
}

/// The group id of user point-to-point messages.
pub(crate) const P2P: u64 = 0;

/// Shape and dtype of a collective's whole input, checked by every receiver (COL-1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    pub dims: Vec<usize>,
    pub dtype: String,
}

/// A message's content: a tensor, or raw elements (the ring's fast path).
pub(crate) enum Body {
    Tensor(Tensor),
    Raw(bytes::Bytes),
}

/// Why a receive failed.
#[derive(Clone, Debug)]
pub(crate) enum TakeError {
    /// A worker the receive depends on was declared failed.
    PeerFailed { worker: String, cause: String },
    /// Anything else: a timeout, an abort, a closed mailbox.
    Other(String),
}

impl std::fmt::Display for TakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerFailed { worker, cause } => write!(f, "worker `{worker}` failed: {cause}"),
            Self::Other(why) => f.write_str(why),
        }
    }
}

impl From<TakeError> for P2pError {
    fn from(e: TakeError) -> Self {
        match e {
            TakeError::PeerFailed { worker, cause } => P2pError::PeerFailed { worker, cause },
            TakeError::Other(why) => P2pError::Recv(why),
        }
    }
}

type Msg = Result<(Header, Body), TakeError>;

/// A group's ranks and their incarnations.
type Members = (Arc<Vec<u32>>, Arc<Vec<u64>>);

#[derive(Default)]
struct Inner {
    queued: HashMap<(u32, Tag), VecDeque<(Header, Body)>>,
    waiting: HashMap<(u32, Tag), VecDeque<oneshot::Sender<Msg>>>,
    /// Aborted operations; kept after they end so that their late messages are dropped.
    aborted: HashMap<(u64, u64), String>,
    /// Next sequence number per group, shared by every handle on the group.
    next_seq: HashMap<u64, u64>,
    /// Members of every group created here and their incarnations, by group id.
    groups: HashMap<u64, Members>,
    /// Workers declared failed: (incarnation, name, cause) by rank (COL-2, COL-3).
    failed: HashMap<u32, (u64, String, String)>,
    /// The incarnation of each rank that has been replaced, as last heard (COL-3).
    current: HashMap<u32, u64>,
}

impl Inner {
    /// The verdict that dooms a receive from `from` of an operation of `group`, if any.
    fn doomed(&self, from: u32, group: u64) -> Option<TakeError> {
        // Whether incarnation `inc` of `rank` is covered by a verdict (COL-3).
        let failed = |rank: u32, inc: u64| {
            self.failed
                .get(&rank)
                .filter(|(failed, _, _)| *failed >= inc)
                .map(|(_, worker, cause)| TakeError::PeerFailed {
                    worker: worker.clone(),
                    cause: cause.clone(),
                })
        };
        let Some((ranks, incs)) = self.groups.get(&group) else {
            // Point to point: the incarnation heard of last.
            let inc = self.current.get(&from).copied().unwrap_or(0);
            return failed(from, inc);
        };
        let inc_of = |r: u32| ranks.iter().position(|&x| x == r).map_or(0, |i| incs[i]);
        failed(from, inc_of(from)).or_else(|| {
            ranks
                .iter()
                .zip(incs.iter())
                .find_map(|(&r, &i)| failed(r, i))
        })
    }
}

#[derive(Default)]
pub(crate) struct Mailbox {
    inner: Mutex<Inner>,
}

pub(crate) fn mailbox(agent: &Agent) -> Arc<Mailbox> {
    let mut created = false;
    let m = agent.extension(|| {
        created = true;
        Mailbox::default()
    });
    if created {
        let weak = Arc::downgrade(&m);
        agent.on_worker_failed(move |f| {
            if let Some(m) = weak.upgrade() {
                m.peer_failed(f.rank, f.incarnation, &f.name, &f.cause);
            }
        });
        let weak = Arc::downgrade(&m);
        let agent_weak = agent.downgrade();
        agent.on_worker_rejoined(move |rank| {
            let (Some(m), Some(agent)) = (weak.upgrade(), agent_weak.upgrade()) else {
                return;
            };
            if let Ok(inc) = agent.incarnation_of(rank) {
                m.peer_rejoined(rank, inc);
            }
        });
    }
    m
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the members of group `id` and their incarnations (COL-2 needs them).
    pub(crate) fn register_group(&self, id: u64, ranks: Arc<Vec<u32>>, incs: Arc<Vec<u64>>) {
        self.lock().groups.insert(id, (ranks, incs));
    }

    /// A new incarnation of `rank` joined: what the old one left queued goes (COL-3).
    pub(crate) fn peer_rejoined(&self, rank: u32, incarnation: u64) {
        let mut m = self.lock();
        m.current.insert(rank, incarnation);
        m.queued.retain(|(from, _), _| *from != rank);
    }

    /// Incarnation `incarnation` of worker `rank` was declared failed: fails every receive
    /// that depends on it (COL-2).
    pub(crate) fn peer_failed(&self, rank: u32, incarnation: u64, name: &str, cause: &str) {
        let mut m = self.lock();
        m.failed
            .insert(rank, (incarnation, name.to_owned(), cause.to_owned()));
        let doomed: Vec<((u32, Tag), TakeError)> = m
            .waiting
            .keys()
            .filter_map(|&(from, tag)| m.doomed(from, tag.group).map(|e| ((from, tag), e)))
            .collect();
        for (k, e) in doomed {
            for w in m.waiting.remove(&k).unwrap_or_default() {
                let _ = w.send(Err(e.clone()));
            }
        }
    }

    /// Takes the group's next sequence number.
    pub(crate) fn next_seq(&self, group: u64) -> u64 {
        let mut m = self.lock();
        let s = m.next_seq.entry(group).or_insert(1);
        *s += 1;
        *s - 1
    }

    fn deliver(&self, from: u32, tag: Tag, header: Header, t: Body) {
        let mut m = self.lock();
        if m.aborted.contains_key(&(tag.group, tag.seq)) {
            return;
        }
        let key = (from, tag);
        let mut item = Some((header, t));
        if let Some(ws) = m.waiting.get_mut(&key) {
            while let Some(w) = ws.pop_front() {
                match w.send(Ok(item.take().expect("one item"))) {
                    Ok(()) => break,
                    Err(back) => item = back.ok(),
                }
            }
            if ws.is_empty() {
                m.waiting.remove(&key);
            }
        }
        if let Some(item) = item {
            m.queued.entry(key).or_default().push_back(item);
        }
    }

    pub(crate) fn abort(&self, group: u64, seq: u64, why: String) {
        let mut m = self.lock();
        m.aborted.insert((group, seq), why.clone());
        let keys: Vec<_> = m
            .waiting
            .keys()
            .filter(|(_, t)| t.group == group && t.seq == seq)
            .copied()
            .collect();
        for k in keys {
            for w in m.waiting.remove(&k).unwrap_or_default() {
                let _ = w.send(Err(TakeError::Other(why.clone())));
            }
        }
    }

    /// Drops what an operation left queued (messages of an aborted operation).
    pub(crate) fn finish(&self, group: u64, seq: u64) {
        let mut m = self.lock();
        m.queued
            .retain(|(_, t), _| !(t.group == group && t.seq == seq));
    }

    pub(crate) async fn take(&self, from: u32, tag: Tag, timeout: Duration) -> Msg {
        let rx = {
            let mut m = self.lock();
            if let Some(why) = m.aborted.get(&(tag.group, tag.seq)) {
                return Err(TakeError::Other(why.clone()));
            }
            let key = (from, tag);
            if let Some(q) = m.queued.get_mut(&key) {
                if let Some(item) = q.pop_front() {
                    if q.is_empty() {
                        m.queued.remove(&key);
                    }
                    return Ok(item);
                }
            }
            // Whatever was delivered before a verdict is still taken; nothing more will come.
            if let Some(e) = m.doomed(from, tag.group) {
                return Err(e);
            }
            let (tx, rx) = oneshot::channel();
            m.waiting.entry(key).or_default().push_back(tx);
            rx
        };
        let until = Instant::now() + timeout;
        match tokio::time::timeout_at(until.into(), rx).await {
            Ok(Ok(m)) => m,
            Ok(Err(_)) => Err(TakeError::Other("the mailbox closed".into())),
            Err(_) => Err(TakeError::Other(format!(
                "no message from rank {from} (tag {tag:?}) within {timeout:?}"
            ))),
        }
    }
}

/// Sender → receiver: one tensor message.
pub(crate) struct Deliver;

impl RemoteFn for Deliver {
    const NAME: &'static str = "collectives::deliver";
    type Args = (Tag, Header, RTensor);
    type Output = ();
    async fn call(cx: CallContext, (tag, header, t): Self::Args) -> Result<(), BoxError> {
        mailbox(cx.agent()).deliver(cx.caller().id.0, tag, header, Body::Tensor(t.0));
        Ok(())
    }
}

/// Sender → receiver: raw elements (no tensor decoding; large ones take the bulk path).
pub(crate) struct DeliverRaw;

impl RemoteFn for DeliverRaw {
    const NAME: &'static str = "collectives::deliver_raw";
    type Args = (Tag, Header, rpc_core::Blob);
    type Output = ();
    async fn call(cx: CallContext, (tag, header, data): Self::Args) -> Result<(), BoxError> {
        mailbox(cx.agent()).deliver(cx.caller().id.0, tag, header, Body::Raw(data.into_bytes()));
        Ok(())
    }
}

pub(crate) async fn send_raw(
    agent: &Agent,
    to: u32,
    tag: Tag,
    header: Header,
    data: bytes::Bytes,
) -> Result<(), P2pError> {
    deliver(
        agent,
        to,
        DeliverRaw,
        (tag, header, rpc_core::Blob::new(data)),
    )
    .await
}

/// Sends one message; collective traffic never takes part in distributed autograd.
async fn deliver<F: RemoteFn<Output = ()>>(
    agent: &Agent,
    to: u32,
    f: F,
    args: F::Args,
) -> Result<(), P2pError> {
    rpc_core::ext::with_call_meta(autograd_dist::CTX_KEY, None, agent.rpc_async(to, f, args))
        .await
        .map_err(|source| P2pError::Send {
            worker: agent.name_of(to),
            source: Box::new(source),
        })
}

/// Any member → every member: the operation failed.
pub(crate) struct Abort;

impl RemoteFn for Abort {
    const NAME: &'static str = "collectives::abort";
    type Args = (u64, u64, String);
    type Output = ();
    async fn call(cx: CallContext, (group, seq, why): Self::Args) -> Result<(), BoxError> {
        mailbox(cx.agent()).abort(group, seq, why);
        Ok(())
    }
}

/// Why a point-to-point operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// The message could not be delivered.
    #[error("send to worker `{worker}` failed")]
    Send {
        /// The receiver.
        worker: String,
        /// The cause.
        #[source]
        source: Box<rpc_core::RpcError>,
    },
    /// No message arrived in time, or the operation was aborted.
    #[error("receive failed: {0}")]
    Recv(String),
    /// The sender was declared failed (COL-2).
    #[error("receive failed: worker `{worker}` failed: {cause}")]
    PeerFailed {
        /// The failed worker.
        worker: String,
        /// Why it was declared failed.
        cause: String,
    },
    /// The background task failed.
    #[error("the operation's task failed: {0}")]
    Task(String),
}

pub(crate) async fn send_tagged(
    agent: &Agent,
    to: u32,
    tag: Tag,
    header: Header,
    t: Tensor,
) -> Result<(), P2pError> {
    deliver(agent, to, Deliver, (tag, header, RTensor(t))).await
}

fn header(t: &Tensor) -> Header {
    Header {
        dims: t.dims().to_vec(),
        dtype: t.dtype().as_str().to_owned(),
    }
}

fn rank_of(agent: &Agent, w: impl ToWorker) -> Result<u32, P2pError> {
    agent
        .get_worker_info(w)
        .map(|i| i.id.0)
        .map_err(|e| P2pError::Recv(e.to_string()))
}

/// Sends `t` to `to` under `tag`; returns once it is in the receiver's mailbox.
pub async fn send(agent: &Agent, to: impl ToWorker, tag: u64, t: &Tensor) -> Result<(), P2pError> {
    let to = rank_of(agent, to)?;
    send_tagged(
        agent,
        to,
        Tag {
            group: P2P,
            seq: tag,
            step: 0,
        },
        header(t),
        t.clone(),
    )
    .await
}

/// Receives the next tensor `from` sent under `tag` (within the group's call timeout).
pub async fn recv(agent: &Agent, from: impl ToWorker, tag: u64) -> Result<Tensor, P2pError> {
    let from = rank_of(agent, from)?;
    let timeout = effective_timeout(agent);
    let tag = Tag {
        group: P2P,
        seq: tag,
        step: 0,
    };
    match mailbox(agent).take(from, tag, timeout).await {
        Ok((_, Body::Tensor(t))) => Ok(t),
        Ok((_, Body::Raw(_))) => Err(P2pError::Recv(
            "got raw elements where a tensor was expected".into(),
        )),
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn effective_timeout(agent: &Agent) -> Duration {
    let t = agent.rpc_timeout();
    if t.is_zero() {
        Duration::from_secs(365 * 24 * 3600)
    } else {
        t
    }
}

/// A running operation; `wait` for its result.
#[must_use = "an operation's outcome is only known by waiting for it"]
pub struct Handle<T>(tokio::task::JoinHandle<Result<T, P2pError>>);

impl<T> Handle<T> {
    /// Waits for the operation.
    pub async fn wait(self) -> Result<T, P2pError> {
        self.0.await.map_err(|e| P2pError::Task(e.to_string()))?
    }
}

/// Non-blocking [`send`].
pub fn isend(agent: &Agent, to: u32, tag: u64, t: &Tensor) -> Handle<()> {
    let (a, t) = (agent.clone(), t.clone());
    Handle(
        rpc_core::CallScope::current()
            .spawn_on(agent.runtime(), async move { send(&a, to, tag, &t).await }),
    )
}

/// Non-blocking [`recv`].
pub fn irecv(agent: &Agent, from: u32, tag: u64) -> Handle<Tensor> {
    let a = agent.clone();
    Handle(
        rpc_core::CallScope::current()
            .spawn_on(agent.runtime(), async move { recv(&a, from, tag).await }),
    )
}
