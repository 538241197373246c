//! One collective operation's bookkeeping: its sequence number, its members' positions, the
//! tags of its messages, sending and receiving them, and aborting it on every member.

use candle_core::Tensor;

use super::{CollectiveError, ProcessGroup};
use crate::mailbox::{
    effective_timeout, mailbox, send_raw, send_tagged, Abort, Body, Header, P2pError, Tag,
    TakeError,
};

/// One collective call's bookkeeping.
pub(super) struct Op<'a> {
    pub g: &'a ProcessGroup,
    pub name: &'static str,
    pub seq: u64,
    pub me: usize,
    pub header: Header,
}

impl Op<'_> {
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
        if h != self.header {
            let why = format!(
                "rank {from} has a {} tensor of shape {:?}, rank {} has a {} tensor of shape {:?}",
                h.dtype,
                h.dims,
                self.g.agent.rank(),
                self.header.dtype,
                self.header.dims
            );
            self.abort_all(&why).await;
            return Err(CollectiveError::Failed {
                op: self.name,
                members: self.g.ranks.to_vec(),
                message: why,
            });
        }
        Ok(t)
    }

    pub(super) async fn abort_all(&self, why: &str) {
        let agent = &self.g.agent;
        mailbox(agent).abort(self.g.id, self.seq, why.to_owned());
        let calls = self
            .g
            .ranks
            .iter()
            .filter(|&&r| r != agent.rank())
            .map(|&r| {
                rpc_core::ext::with_call_meta(
                    autograd_dist::CTX_KEY,
                    None,
                    agent.rpc_async(r, Abort, (self.g.id, self.seq, why.to_owned())),
                )
            });
        let _ = futures::future::join_all(calls).await;
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
        Ok(Op {
            g: self,
            name,
            seq,
            me,
            header: Header {
                dims,
                dtype: dtype.to_owned(),
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
