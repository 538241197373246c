//! Messages matched by (source, tag), and per-operation aborts.
//!
//! - COL-2: once a worker is declared failed, every receive from it fails at once with its
//!   verdict, and so does every receive of an operation of a group it belongs to, on every
//!   member (not only its ring neighbours, whose peers would otherwise wait for messages that
//!   will not come); later ones fail at once too.
//! - COL-3: a verdict dooms the incarnation it names and older ones: once a replacement of the
//!   worker has joined, groups created with it (and point-to-point messages from it) work, and
//!   what the failed incarnation left queued is dropped.
//!
//! - MB-3: a message for an operation this member has ended (one of the last 1024) is dropped
//!   on arrival: nothing will take it, and it would wait until it is too old.
//!
//! What arrives before its receive waits in a bounded queue (`queue.rs`, MB-1, MB-2); the
//! public point-to-point API is `p2p.rs`.

use candle_core::Tensor;
use rpc_core::ext::AgentExt;
use rpc_core::{Agent, BoxError, CallContext, RemoteFn};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

use autograd_dist::RTensor;

mod p2p;
mod queue;

pub(crate) use p2p::effective_timeout;
pub use p2p::{irecv, isend, recv, send, Handle, P2pError};
use queue::Queued;
pub use queue::{MailboxLimits, MailboxStats};

/// Names a message: its operation (group and sequence number, or the user's p2p tag) and step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct Tag {
    pub group: u64,
    pub seq: u64,
    pub step: u32,
}

/// The group id of user point-to-point messages.
pub(crate) const P2P: u64 = 0;

/// How many of the operations this member ended it remembers, to drop their late messages
/// (MB-3).
const RECENTLY_ENDED: usize = 1024;

/// Shape and dtype of a collective's whole input, and the call that sent it, checked by every
/// receiver (COL-1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    pub dims: Vec<usize>,
    pub dtype: String,
    /// The collective that sent it (`all_reduce`), its reduction (`sum`) if it reduces and
    /// its root if it has one; empty for point-to-point messages. Members that reach the same
    /// place in a group's order with different calls fail it with one verdict.
    pub call: Call,
}

/// A collective call as its messages name it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Call {
    pub name: Cow<'static, str>,
    pub reduce: Option<Cow<'static, str>>,
    /// The root a `broadcast`, `reduce`, `gather` or `scatter` was called with (ROOT-1).
    pub root: Option<u32>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        match (&self.reduce, self.root) {
            (Some(r), Some(root)) => write!(f, " ({r}, root {root})"),
            (Some(r), None) => write!(f, " ({r})"),
            (None, Some(root)) => write!(f, " (root {root})"),
            (None, None) => Ok(()),
        }
    }
}

impl Header {
    /// A tensor's header (no call: a point-to-point message, or a part whose sender names
    /// its call).
    pub(crate) fn of(t: &candle_core::Tensor) -> Self {
        Self {
            dims: t.dims().to_vec(),
            dtype: t.dtype().as_str().to_owned(),
            call: Call::default(),
        }
    }

    /// The header of a member that does not know what it will receive.
    pub(crate) fn any() -> Self {
        Self {
            dims: Vec::new(),
            dtype: String::new(),
            call: Call::default(),
        }
    }
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
    queued: Queued,
    limits: MailboxLimits,
    /// When the queue and the aborted operations are next checked for age (MB-2).
    next_sweep: Option<Instant>,
    waiting: HashMap<(u32, Tag), VecDeque<oneshot::Sender<Msg>>>,
    /// Aborted operations, and when; kept after they end so that their late messages are
    /// dropped, until they are as old as a queued message may be (MB-2).
    aborted: HashMap<(u64, u64), (String, Instant)>,
    /// The operations this member ended last, oldest first (at most [`RECENTLY_ENDED`]): a
    /// message for one of them that arrives after it ended is dropped, not kept until it is
    /// too old (MB-3).
    ended: VecDeque<(u64, u64)>,
    /// The same operations, to look up.
    ended_set: HashSet<(u64, u64)>,
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
    /// MB-2: drops queued messages and aborted operations older than the limit, at most once
    /// a second.
    fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|t| now < t) {
            return;
        }
        let max_age = self.limits.max_age;
        self.next_sweep =
            Some(now + (max_age / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)));
        for ((from, tag), bytes, age) in self.queued.expire(now, max_age) {
            tracing::warn!(
                from,
                ?tag,
                bytes,
                age_s = age.as_secs_f64(),
                "dropped a message nobody received (older than the mailbox's max_age)"
            );
        }
        self.aborted
            .retain(|_, (_, at)| now.duration_since(*at) <= max_age);
    }

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
        m.queued.retain(|(from, _)| *from != rank);
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

    /// Hands a message to its receive, or queues it (refused past the sender's bound, MB-1).
    fn deliver(&self, from: u32, tag: Tag, header: Header, t: Body) -> Result<(), String> {
        let mut m = self.lock();
        let now = Instant::now();
        m.sweep(now);
        let op = (tag.group, tag.seq);
        if m.aborted.contains_key(&op) || m.ended_set.contains(&op) {
            return Ok(());
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
        match item {
            Some((header, body)) => {
                let limits = m.limits;
                m.queued.push(key, header, body, &limits, now)
            }
            None => Ok(()),
        }
    }

    fn set_limits(&self, limits: MailboxLimits) {
        let mut m = self.lock();
        m.limits = limits;
        m.next_sweep = None;
    }

    fn stats(&self) -> MailboxStats {
        let mut m = self.lock();
        m.sweep(Instant::now());
        m.queued.stats()
    }

    /// Aborts operation `seq` of `group` here: its receives fail with `why`. The first abort
    /// of an operation decides its message (later ones change nothing); returns whether this
    /// one was the first.
    pub(crate) fn abort(&self, group: u64, seq: u64, why: String) -> bool {
        let mut m = self.lock();
        if m.aborted.contains_key(&(group, seq)) {
            return false;
        }
        m.aborted
            .insert((group, seq), (why.clone(), Instant::now()));
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
        true
    }

    /// The message operation `seq` of `group` was aborted with here, if it was.
    pub(crate) fn aborted_with(&self, group: u64, seq: u64) -> Option<String> {
        self.lock()
            .aborted
            .get(&(group, seq))
            .map(|(why, _)| why.clone())
    }

    /// The members of `group`, as registered here.
    /// The verdict that dooms operations of `group` (a member declared failed), if any: how a
    /// collective that does not receive through the mailbox (NCCL) learns of it (COL-2).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn group_doomed(&self, group: u64) -> Option<String> {
        let m = self.lock();
        let first = m.groups.get(&group)?.0.first().copied()?;
        m.doomed(first, group).map(|e| e.to_string())
    }

    pub(crate) fn group_ranks(&self, group: u64) -> Option<Arc<Vec<u32>>> {
        self.lock().groups.get(&group).map(|(r, _)| Arc::clone(r))
    }

    /// Drops what an operation left queued (messages of an aborted operation).
    pub(crate) fn finish(&self, group: u64, seq: u64) {
        let mut m = self.lock();
        m.queued
            .retain(|(_, t)| !(t.group == group && t.seq == seq));
        if m.ended_set.insert((group, seq)) {
            m.ended.push_back((group, seq));
        }
        while m.ended.len() > RECENTLY_ENDED {
            let oldest = m.ended.pop_front().expect("more than none");
            m.ended_set.remove(&oldest);
        }
    }

    pub(crate) async fn take(&self, from: u32, tag: Tag, timeout: Duration) -> Msg {
        let rx = {
            let mut m = self.lock();
            m.sweep(Instant::now());
            if let Some((why, _)) = m.aborted.get(&(tag.group, tag.seq)) {
                return Err(TakeError::Other(why.clone()));
            }
            let key = (from, tag);
            if let Some(item) = m.queued.pop(key) {
                return Ok(item);
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

/// Delivers a message from the caller of `cx`: an error naming both workers past MB-1.
fn delivered(cx: &CallContext, tag: Tag, header: Header, body: Body) -> Result<(), BoxError> {
    let from = cx.caller();
    mailbox(cx.agent())
        .deliver(from.id.0, tag, header, body)
        .map_err(|why| {
            format!(
                "the mailbox of `{}` refused a message from `{}` ({tag:?}): {why}",
                cx.agent().name(),
                from.name
            )
            .into()
        })
}

/// Sets the bounds of `agent`'s mailbox (MB-1, MB-2); they apply to what arrives from now on.
pub fn set_mailbox_limits(agent: &Agent, limits: MailboxLimits) {
    mailbox(agent).set_limits(limits);
}

/// What `agent`'s mailbox holds: messages delivered and not received yet, and how many were
/// dropped for their age.
pub fn mailbox_stats(agent: &Agent) -> MailboxStats {
    mailbox(agent).stats()
}

/// Sender → receiver: one tensor message.
pub(crate) struct Deliver;

impl RemoteFn for Deliver {
    const NAME: &'static str = "collectives::deliver";
    type Args = (Tag, Header, RTensor);
    type Output = ();
    async fn call(cx: CallContext, (tag, header, t): Self::Args) -> Result<(), BoxError> {
        delivered(&cx, tag, header, Body::Tensor(t.0))
    }
}

/// Sender → receiver: raw elements (no tensor decoding; large ones take the bulk path).
pub(crate) struct DeliverRaw;

impl RemoteFn for DeliverRaw {
    const NAME: &'static str = "collectives::deliver_raw";
    type Args = (Tag, Header, rpc_core::Blob);
    type Output = ();
    async fn call(cx: CallContext, (tag, header, data): Self::Args) -> Result<(), BoxError> {
        delivered(&cx, tag, header, Body::Raw(data.into_bytes()))
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

pub(crate) async fn send_tagged(
    agent: &Agent,
    to: u32,
    tag: Tag,
    header: Header,
    t: Tensor,
) -> Result<(), P2pError> {
    deliver(agent, to, Deliver, (tag, header, RTensor(t))).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(seq: u64) -> Tag {
        Tag {
            group: 7,
            seq,
            step: u32::MAX,
        }
    }

    fn empty() -> (Header, Body) {
        (Header::any(), Body::Raw(bytes::Bytes::new()))
    }

    /// MB-3: a message for an operation this member ended is dropped on arrival (ROOT-1's
    /// check sends one to a member that may have ended it); one for an operation not ended
    /// waits for its receive. Before, it waited until it was too old (ten minutes by
    /// default) and was then dropped with a warning.
    #[test]
    fn a_message_for_an_ended_operation_is_dropped_on_arrival() {
        let mb = Mailbox::default();
        mb.finish(7, 3);
        let (h, b) = empty();
        mb.deliver(1, tag(3), h, b).unwrap();
        assert_eq!(mb.stats().queued_messages, 0);
        let (h, b) = empty();
        mb.deliver(1, tag(4), h, b).unwrap();
        assert_eq!(mb.stats().queued_messages, 1);
        // The oldest ended operations are forgotten past the bound.
        for seq in 100..100 + RECENTLY_ENDED as u64 {
            mb.finish(7, seq);
        }
        let (h, b) = empty();
        mb.deliver(1, tag(3), h, b).unwrap();
        assert_eq!(mb.stats().queued_messages, 2);
    }
}
