//! The collectives with a root and the exchange of every member with every other:
//! `broadcast` (from one member), `reduce` (to one member), `gather` (to one member),
//! `scatter` (from one member) and `all_to_all`.
//!
//! `reduce` is the ring's reduce-scatter followed by each member's chunk sent to the root, so
//! each member sends about `(n-1)/n + 1/n` of the data and the root receives no more than
//! an all-reduce would make it. `gather`, `scatter` and `all_to_all` send each part directly
//! to the member it is for: the data leave each member once, which is what they cost anyway.
//! A gather's members wait for the root's word that every part matched (one small message),
//! and a scatter's root waits for every member's header before it sends the parts, so that
//! a mismatch fails every member (COL-1), not only the root.
//!
//! ROOT-1: members that name different roots fail the operation on every member with one
//! verdict naming both roots, where each would otherwise wait for a root that does not send
//! (or sends to others) until its timeout. Every message carries its sender's root in its
//! call. In a broadcast, gather or scatter no member can end the operation while members
//! disagree: its root waits for every member (a broadcast's and a scatter's headers, a
//! gather's parts) and the others for the root. So a member still waiting after a second
//! sends the next member its call and compares the previous one's ([`Op::with_root_check`]):
//! any disagreement lies between two neighbours somewhere around the group, and the later of
//! them finds it. An operation that ends sooner sends nothing more. A reduce needs no extra
//! message: its reduce-scatter already compares every member's call with its predecessor's
//! at each step, and every member's last chunk waits on every other member.

use candle_core::{DType, Device, Tensor};

use super::op::Op;
use super::ring::mean_of;
use super::{CollectiveError, ProcessGroup, ReduceOp};
use crate::mailbox::Header;

impl ProcessGroup {
    /// Each member first sends the root its header (shape and dtype, no data); the root
    /// sends its tensor once every header matched, so a mismatch, or a root that is not a
    /// member, fails every member with one verdict (COL-1) and none gets the data.
    pub(super) async fn broadcast_at(
        &self,
        t: &Tensor,
        root: u32,
        seq: u64,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.begin_at("broadcast", t, seq)?.rooted(root);
        let others = || self.ranks.iter().copied().filter(|&r| r != root);
        let body = async {
            if self.agent.rank() != root {
                let header_only = Tensor::zeros(0, DType::U8, &Device::Cpu)?;
                o.send(root, 0, header_only).await?;
                return o.recv(root, 1).await;
            }
            futures::future::try_join_all(others().map(|r| o.recv(r, 0))).await?;
            futures::future::try_join_all(others().map(|r| o.send(r, 1, t.clone()))).await?;
            Ok(t.clone())
        };
        let out = o.with_root_check(root, body).await;
        self.end(&o);
        out
    }

    pub(super) async fn reduce_at(
        &self,
        t: &Tensor,
        op: ReduceOp,
        root: u32,
        seq: u64,
    ) -> Result<Option<Tensor>, CollectiveError> {
        // ROOT-1 without a message of its own: see the module's documentation.
        let o = self.begin_at("reduce", t, seq)?.reducing(op).rooted(root);
        let out = async {
            o.check_root(root).await?;
            let n = o.n();
            let mut chunks = self.split(t, n)?;
            if n > 1 {
                self.reduce_scatter_steps(&o, &mut chunks, op).await?;
            }
            // Member `i` holds the reduced chunk `i`; the root collects them (step `n`).
            let step = n as u32;
            if self.agent.rank() != root {
                o.send(root, step, chunks.swap_remove(o.me)).await?;
                return Ok(None);
            }
            for (i, &r) in self.ranks.iter().enumerate() {
                if i != o.me {
                    chunks[i] = o.recv(r, step).await?;
                }
            }
            let mut out = Tensor::cat(&chunks, 0)?.reshape(t.dims())?;
            if op == ReduceOp::Mean {
                out = mean_of(out, n)?;
            }
            Ok(Some(out))
        }
        .await;
        self.end(&o);
        out
    }

    pub(super) async fn gather_at(
        &self,
        t: &Tensor,
        root: u32,
        seq: u64,
    ) -> Result<Option<Vec<Tensor>>, CollectiveError> {
        let o = self.begin_at("gather", t, seq)?.rooted(root);
        let out = o.with_root_check(root, self.gather_body(&o, t, root)).await;
        self.end(&o);
        out
    }

    async fn gather_body(
        &self,
        o: &Op<'_>,
        t: &Tensor,
        root: u32,
    ) -> Result<Option<Vec<Tensor>>, CollectiveError> {
        if self.agent.rank() != root {
            o.send(root, 0, t.clone()).await?;
            // The root's word that every part matched (COL-1: a mismatch fails every
            // member, these included).
            o.recv_part(root, 1, |_| Ok(())).await?;
            return Ok(None);
        }
        let mut all = Vec::with_capacity(o.n());
        for &r in self.ranks.iter() {
            all.push(if r == root {
                t.clone()
            } else {
                o.recv(r, 0).await?
            });
        }
        let done = Tensor::zeros(0, DType::U8, &Device::Cpu)?;
        let acks = self
            .ranks
            .iter()
            .filter(|&&r| r != root)
            .map(|&r| o.send_part(r, 1, done.clone()));
        futures::future::try_join_all(acks).await?;
        Ok(Some(all))
    }

    pub(super) async fn scatter_at(
        &self,
        parts: Option<Vec<Tensor>>,
        root: u32,
        seq: u64,
    ) -> Result<Tensor, CollectiveError> {
        let me_root = self.agent.rank() == root;
        // The root's header names the parts it sends; the others learn theirs on arrival.
        let header = match (&parts, me_root) {
            (Some(p), true) if !p.is_empty() => Header::of(&p[0]),
            _ => Header::any(),
        };
        let o = self
            .begin_header("scatter", header.dims, &header.dtype, seq)?
            .rooted(root);
        let out = o
            .with_root_check(root, self.scatter_body(&o, parts, root))
            .await;
        self.end(&o);
        out
    }

    /// The root sends the parts once every member's header (its call, no data) has come, so
    /// that no member gets its part from an operation that fails elsewhere (COL-1).
    async fn scatter_body(
        &self,
        o: &Op<'_>,
        parts: Option<Vec<Tensor>>,
        root: u32,
    ) -> Result<Tensor, CollectiveError> {
        if self.agent.rank() != root {
            if parts.is_some() {
                let why = format!(
                    "rank {} passed parts to scatter; only the root (rank {root}) passes them",
                    self.agent.rank()
                );
                return Err(o.mismatch(why).await);
            }
            let header_only = Tensor::zeros(0, DType::U8, &Device::Cpu)?;
            o.send_part(root, 1, header_only).await?;
            return o.recv_part(root, 0, |_| Ok(())).await;
        }
        let Some(mut parts) = parts else {
            let why = format!("the root (rank {root}) passed no parts");
            return Err(o.mismatch(why).await);
        };
        if parts.len() != o.n() {
            let why = format!(
                "the root (rank {root}) passed {} parts for {} members",
                parts.len(),
                o.n()
            );
            return Err(o.mismatch(why).await);
        }
        let others = || self.ranks.iter().copied().filter(|&r| r != root);
        let headers = others().map(|r| o.recv_part(r, 1, |_| Ok(())));
        futures::future::try_join_all(headers).await?;
        let sends = self
            .ranks
            .iter()
            .zip(&parts)
            .filter(|(&r, _)| r != root)
            .map(|(&r, p)| o.send_part(r, 0, p.clone()));
        futures::future::try_join_all(sends).await?;
        Ok(parts.swap_remove(o.me))
    }

    pub(super) async fn all_to_all_at(
        &self,
        mut parts: Vec<Tensor>,
        seq: u64,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        // Parts may differ in their first dimension (unequal splits), not in their element
        // type or the rest of their shape.
        let header = parts.first().map_or_else(Header::any, Header::of);
        let o = self.begin_header("all_to_all", header.dims.clone(), &header.dtype, seq)?;
        let out = async {
            let n = o.n();
            if parts.len() != n {
                let why = format!(
                    "rank {} passed {} parts for {n} members",
                    self.agent.rank(),
                    parts.len()
                );
                return Err(o.mismatch(why).await);
            }
            if let Some(p) = parts.iter().find(|p| !same_kind(&Header::of(p), &header)) {
                let why = format!(
                    "rank {}'s parts differ: a {} part of shape {:?} beside a {} part of \
                     shape {:?}",
                    self.agent.rank(),
                    p.dtype().as_str(),
                    p.dims(),
                    header.dtype,
                    header.dims
                );
                return Err(o.mismatch(why).await);
            }
            let sends = self
                .ranks
                .iter()
                .zip(&parts)
                .enumerate()
                .filter(|(i, _)| *i != o.me)
                .map(|(_, (&r, p))| o.send_part(r, 0, p.clone()));
            let recvs = self
                .ranks
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != o.me)
                .map(|(_, &r)| {
                    let header = &header;
                    let o = &o;
                    async move {
                        o.recv_part(r, 0, |h| {
                            if same_kind(h, header) {
                                Ok(())
                            } else {
                                Err(format!(
                                    "rank {r} sends a {} part of shape {:?}, rank {} a {} \
                                     part of shape {:?}",
                                    h.dtype,
                                    h.dims,
                                    self.agent.rank(),
                                    header.dtype,
                                    header.dims
                                ))
                            }
                        })
                        .await
                    }
                });
            let (sent, got) = tokio::join!(
                futures::future::try_join_all(sends),
                futures::future::try_join_all(recvs)
            );
            sent?;
            let mut got = got?;
            got.insert(o.me, parts.swap_remove(o.me));
            Ok(got)
        }
        .await;
        self.end(&o);
        out
    }
}

/// Whether two parts may travel in one all-to-all: the same element type and the same shape
/// but for the first dimension.
fn same_kind(a: &Header, b: &Header) -> bool {
    a.dtype == b.dtype
        && a.dims.len() == b.dims.len()
        && a.dims.iter().skip(1).eq(b.dims.iter().skip(1))
}

impl Op<'_> {
    /// Sends a part whose header is its own (not the operation's).
    pub(super) async fn send_part(
        &self,
        to: u32,
        step: u32,
        t: Tensor,
    ) -> Result<(), CollectiveError> {
        let header = Header {
            call: self.header.call.clone(),
            ..Header::of(&t)
        };
        crate::mailbox::send_tagged(&self.g.agent, to, self.tag(step), header, t)
            .await
            .map_err(|e| self.exchange_err(e))
    }
}
