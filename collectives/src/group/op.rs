//! One collective operation's bookkeeping: its sequence number, its members' positions, the
//! tags of its messages, sending and receiving them, and aborting it on every member.

use candle_core::Tensor;

use std::borrow::Cow;
use std::time::Duration;

use super::{CollectiveError, ProcessGroup, ReduceOp};
use crate::mailbox::{
    effective_timeout, mailbox, send_raw, send_tagged, Abort, Body, Call, Header, P2pError, Tag,
    TakeError,
};

/// The step of the message by which neighbours compare their calls ([`Op::agree_on_root`]);
/// no operation has as many steps of its own.
pub(super) const AGREE_STEP: u32 = u32::MAX;

/// How long an operation with a root waits before its members compare their calls with their
/// neighbours (ROOT-1), at most: a quarter of the wait bound where that is shorter.
const AGREE_AFTER: Duration = Duration::from_secs(1);

/// One collective call's bookkeeping.
pub(super) struct Op<'a> {
    pub g: &'a ProcessGroup,
    pub name: &'static str,
    pub seq: u64,
    pub me: usize,
    pub header: Header,
    /// The operation's span in the job's trace (ends when the operation does).
    pub _span: rpc_core::trace::Span,
}

impl Op<'_> {
    /// The operation reduces with `op`: its messages say so, and a member that reduces with
    /// another fails it everywhere (COL-1).
    pub(super) fn reducing(mut self, op: ReduceOp) -> Self {
        self.header.call.reduce = Some(Cow::Borrowed(op.name()));
        self
    }

    /// The operation has root `root`: its messages say so, and a member that names another
    /// root fails it everywhere (ROOT-1).
    pub(super) fn rooted(mut self, root: u32) -> Self {
        self.header.call.root = Some(root);
        self
    }

    pub(super) fn n(&self) -> usize {
        self.g.ranks.len()
    }

    pub(super) fn peer(&self, offset: isize) -> u32 {
        let n = self.n() as isize;
        self.g.ranks[((self.me as isize + offset) % n + n) as usize % self.n()]
    }

    pub(super) fn tag(&self, step: u32) -> Tag {
        Tag {
            group: self.g.id,
            seq: self.seq,
            step,
        }
    }

    pub(super) fn exchange_err(&self, source: P2pError) -> CollectiveError {
        CollectiveError::Exchange {
            op: self.name,
            members: self.g.ranks.to_vec(),
            source,
        }
    }

    pub(super) async fn send(&self, to: u32, step: u32, t: Tensor) -> Result<(), CollectiveError> {
        send_tagged(&self.g.agent, to, self.tag(step), self.header.clone(), t)
            .await
            .map_err(|e| self.exchange_err(e))
    }

    /// Receives a tensor and checks the sender's header against ours (COL-1).
    pub(super) async fn recv(&self, from: u32, step: u32) -> Result<Tensor, CollectiveError> {
        match self.recv_body(from, step).await? {
            Body::Tensor(t) => Ok(t),
            Body::Raw(_) => Err(self.failed("got raw elements where a tensor was expected".into())),
        }
    }

    /// Receives raw elements (the fast path).
    pub(super) async fn recv_raw(
        &self,
        from: u32,
        step: u32,
    ) -> Result<bytes::Bytes, CollectiveError> {
        match self.recv_body(from, step).await? {
            Body::Raw(b) => Ok(b),
            Body::Tensor(_) => {
                Err(self.failed("got a tensor where raw elements were expected".into()))
            }
        }
    }

    pub(super) fn failed(&self, message: String) -> CollectiveError {
        CollectiveError::Failed {
            op: self.name,
            members: self.g.ranks.to_vec(),
            message,
        }
    }

    pub(super) async fn send_raw(
        &self,
        to: u32,
        step: u32,
        data: bytes::Bytes,
    ) -> Result<(), CollectiveError> {
        send_raw(&self.g.agent, to, self.tag(step), self.header.clone(), data)
            .await
            .map_err(|e| self.exchange_err(e))
    }

    pub(super) async fn recv_body(&self, from: u32, step: u32) -> Result<Body, CollectiveError> {
        let me = self.g.agent.rank();
        self.recv_checked(from, step, |h| {
            if *h == self.header {
                return Ok(());
            }
            let (theirs, mine) = (&h.dims, &self.header.dims);
            Err(format!(
                "rank {from} has a {} tensor of shape {theirs:?}, rank {me} has a {} tensor of \
                 shape {mine:?}",
                h.dtype, self.header.dtype
            ))
        })
        .await
    }

    /// A root that is not a member fails the operation (COL-1's verdict) on every member
    /// that waits for the members that passed it (all of a broadcast's, a reduce's, a
    /// gather's or a scatter's), not only on those members.
    pub(super) async fn check_root(&self, root: u32) -> Result<(), CollectiveError> {
        if self.g.ranks.contains(&root) {
            Ok(())
        } else {
            Err(self.mismatch(format!("root {root} is not a member")).await)
        }
    }

    /// ROOT-1: runs `body`, an operation with a root that no member can end while members
    /// disagree on the root; if it has not ended after [`AGREE_AFTER`], this member also
    /// compares calls with its neighbours ([`Op::agree_on_root`]). Costs nothing while the
    /// operation ends sooner; members that name different roots all wait that long, then
    /// fail with one verdict instead of waiting for each other until their timeout.
    /// A `root` that is not a member fails the operation first, everywhere
    /// ([`Op::check_root`]).
    pub(super) async fn with_root_check<T>(
        &self,
        root: u32,
        body: impl std::future::Future<Output = Result<T, CollectiveError>>,
    ) -> Result<T, CollectiveError> {
        self.check_root(root).await?;
        let after = (effective_timeout(&self.g.agent) / 4).min(AGREE_AFTER);
        let check = async {
            tokio::time::sleep(after).await;
            self.agree_on_root().await?;
            // They agree: the operation's own waits say how it ends.
            std::future::pending().await
        };
        tokio::select! {
            out = body => out,
            failed = check => failed,
        }
    }

    /// Sends this member's call (its root included) to the next member and compares the
    /// previous member's with its own: a difference fails the operation with one verdict.
    /// Anything else (the message did not come, as from a member that ended the operation
    /// without waiting this long) is left to the operation's own waits.
    async fn agree_on_root(&self) -> Result<(), CollectiveError> {
        if self.n() < 2 {
            return Ok(());
        }
        let empty = Tensor::zeros(0, candle_core::DType::U8, &candle_core::Device::Cpu)?;
        // A send that fails leaves the next member to its own waits.
        let send = async { drop(self.send_part(self.peer(1), AGREE_STEP, empty).await) };
        let (from, me) = (self.peer(-1), self.g.agent.rank());
        let timeout = effective_timeout(&self.g.agent);
        let mb = mailbox(&self.g.agent);
        let recv = mb.take(from, self.tag(AGREE_STEP), timeout);
        let ((), got) = tokio::join!(send, recv);
        match got {
            Ok((h, _)) if h.call != self.header.call => {
                let why = format!(
                    "rank {from} called {}, rank {me} called {}",
                    h.call, self.header.call
                );
                Err(self.mismatch(why).await)
            }
            _ => Ok(()),
        }
    }

    /// Receives a tensor whose sender's header passes `check` (parts whose shapes differ by
    /// design: scatter, all-to-all).
    pub(super) async fn recv_part(
        &self,
        from: u32,
        step: u32,
        check: impl Fn(&Header) -> Result<(), String>,
    ) -> Result<Tensor, CollectiveError> {
        match self.recv_checked(from, step, check).await? {
            Body::Tensor(t) => Ok(t),
            Body::Raw(_) => Err(self.failed("got raw elements where a tensor was expected".into())),
        }
    }

    /// Receives a message and checks its sender's header; a mismatch fails the operation on
    /// every member with one verdict (COL-1).
    async fn recv_checked(
        &self,
        from: u32,
        step: u32,
        check: impl Fn(&Header) -> Result<(), String>,
    ) -> Result<Body, CollectiveError> {
        let timeout = effective_timeout(&self.g.agent);
        let got = mailbox(&self.g.agent)
            .take(from, self.tag(step), timeout)
            .await;
        let (h, t) = got.map_err(|e| match e {
            TakeError::PeerFailed { .. } => CollectiveError::Exchange {
                op: self.name,
                members: self.g.ranks.to_vec(),
                source: e.into(),
            },
            TakeError::Other(message) => CollectiveError::Failed {
                op: self.name,
                members: self.g.ranks.to_vec(),
                message,
            },
        })?;
        if h.call != self.header.call {
            let me = self.g.agent.rank();
            let why = format!(
                "rank {from} called {}, rank {me} called {}",
                h.call, self.header.call
            );
            return Err(self.mismatch(why).await);
        }
        if let Err(why) = check(&h) {
            return Err(self.mismatch(why).await);
        }
        Ok(t)
    }

    /// COL-1, one verdict: a member that finds a mismatch reports it to the group's first
    /// member, which aborts the operation on every member with the first report it got, so
    /// every member fails with the same message whichever members found one. When the first
    /// member cannot be reached, the finder aborts the others with its own finding.
    pub(super) async fn mismatch(&self, why: String) -> CollectiveError {
        self.failed(self.g.fail_everywhere(self.seq, why).await)
    }
}

impl ProcessGroup {
    /// Fails operation `seq` on every member with one verdict (COL-1, COL-4): reports `why`
    /// to the group's first member, which aborts the operation everywhere with the first
    /// report it got; returns that verdict. When the first member cannot be reached, this
    /// member's report is the verdict, sent to the others itself.
    ///
    /// It runs to its end in a task of its own, outside the caller's scope: the finder's
    /// operation can end first (its other receives fail with this very verdict, and a
    /// `try_join_all` drops this future), which must not cancel the report or the aborts
    /// still on their way to the others.
    pub(super) async fn fail_everywhere(&self, seq: u64, why: String) -> String {
        let g = self.clone();
        let task = async move { g.decide_everywhere(seq, why).await };
        match self.agent.runtime().spawn(task).await {
            Ok(verdict) => verdict,
            Err(e) => format!("the verdict on operation {seq} was lost: {e}"),
        }
    }

    async fn decide_everywhere(&self, seq: u64, why: String) -> String {
        let agent = &self.agent;
        let leader = self.ranks[0];
        let verdict = if leader == agent.rank() {
            decide(agent, &self.ranks, self.id, seq, why).await
        } else {
            let call = agent.rpc_async(leader, Verdict, (self.id, seq, why.clone()));
            match no_context(call).await {
                Ok(verdict) => verdict,
                // The first member is gone: this member's finding is the verdict here.
                Err(_) => decide(agent, &self.ranks, self.id, seq, why).await,
            }
        };
        mailbox(agent).finish(self.id, seq);
        verdict
    }

    /// COL-4: this member cannot take part in operation `seq` (`op`) for the reason `why`:
    /// fails it on every member with one verdict, returned as this member's error.
    pub(crate) async fn fail_at(&self, op: &'static str, seq: u64, why: String) -> CollectiveError {
        let rank = self.agent.rank();
        if !self.ranks.contains(&rank) {
            return CollectiveError::NotMember {
                rank,
                members: self.ranks.to_vec(),
            };
        }
        CollectiveError::Failed {
            op,
            members: self.ranks.to_vec(),
            message: self.fail_everywhere(seq, why).await,
        }
    }

    /// COL-4 for the next `count` operations (at least one), which this member will not
    /// call: takes their sequence numbers and fails them on every member
    /// ([`ProcessGroup::fail_at`]); returns the first's error.
    pub(crate) async fn fail_next(
        &self,
        op: &'static str,
        why: String,
        count: usize,
    ) -> CollectiveError {
        let mb = mailbox(&self.agent);
        let seqs: Vec<u64> = (0..count.max(1)).map(|_| mb.next_seq(self.id)).collect();
        let fails = seqs
            .into_iter()
            .map(|seq| self.fail_at(op, seq, why.clone()));
        let mut errs = futures::future::join_all(fails).await;
        errs.swap_remove(0)
    }
}

/// A collective's control message never belongs to the caller's autograd context.
fn no_context<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
    rpc_core::ext::with_call_meta(autograd_dist::CTX_KEY, None, f)
}

/// Decides operation `seq` of `group`'s failure here: the first decision wins (a later one
/// returns the first's message) and aborts the operation on every other member of `ranks`.
async fn decide(
    agent: &rpc_core::Agent,
    ranks: &[u32],
    group: u64,
    seq: u64,
    why: String,
) -> String {
    let mb = mailbox(agent);
    if mb.abort(group, seq, why.clone()) {
        let calls = ranks
            .iter()
            .filter(|&&r| r != agent.rank())
            .map(|&r| no_context(agent.rpc_async(r, Abort, (group, seq, why.clone()))));
        let _ = futures::future::join_all(calls).await;
    }
    mb.aborted_with(group, seq).unwrap_or(why)
}

/// A member → the group's first member: "operation `seq` of `group` does not match here, for
/// this reason"; the answer is the operation's verdict, the first report's (COL-1).
pub(crate) struct Verdict;

impl rpc_core::RemoteFn for Verdict {
    const NAME: &'static str = "collectives::verdict";
    type Args = (u64, u64, String);
    type Output = String;
    async fn call(
        cx: rpc_core::CallContext,
        (group, seq, why): Self::Args,
    ) -> Result<String, rpc_core::BoxError> {
        let agent = cx.agent();
        let ranks = mailbox(agent)
            .group_ranks(group)
            .ok_or_else(|| format!("group {group:#x} is unknown on `{}`", agent.name()))?;
        Ok(decide(agent, &ranks, group, seq, why).await)
    }
}

impl ProcessGroup {
    pub(super) fn begin(&self, name: &'static str, t: &Tensor) -> Result<Op<'_>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.begin_at(name, t, seq)
    }

    pub(super) fn begin_at(
        &self,
        name: &'static str,
        t: &Tensor,
        seq: u64,
    ) -> Result<Op<'_>, CollectiveError> {
        self.begin_header(name, t.dims().to_vec(), t.dtype().as_str(), seq)
    }

    pub(super) fn begin_header(
        &self,
        name: &'static str,
        dims: Vec<usize>,
        dtype: &str,
        seq: u64,
    ) -> Result<Op<'_>, CollectiveError> {
        let rank = self.agent.rank();
        let me = self.ranks.iter().position(|&r| r == rank).ok_or_else(|| {
            CollectiveError::NotMember {
                rank,
                members: self.ranks.to_vec(),
            }
        })?;
        let mut span = self
            .agent
            .tracer()
            .span(rpc_core::trace::Cat::Collective, name);
        span.detail(|| {
            format!(
                "seq {seq}, members {:?}, shape {dims:?} {dtype}",
                self.ranks
            )
        });
        Ok(Op {
            _span: span,
            g: self,
            name,
            seq,
            me,
            header: Header {
                dims,
                dtype: dtype.to_owned(),
                call: Call {
                    // Both exchange the same messages, and pair with each other.
                    name: Cow::Borrowed(match name {
                        "all_reduce_in_place" => "all_reduce",
                        n => n,
                    }),
                    reduce: None,
                    root: None,
                },
            },
        })
    }

    pub(super) fn end(&self, op: &Op<'_>) {
        mailbox(&self.agent).finish(self.id, op.seq);
    }
}

pub(super) fn check_len<T>(o: &Op<'_>, elems: usize, bytes: usize) -> Result<(), CollectiveError> {
    if bytes == elems * std::mem::size_of::<T>() {
        Ok(())
    } else {
        Err(o.failed(format!(
            "a chunk of {bytes} bytes arrived where {elems} elements were expected"
        )))
    }
}
