//! Process groups and the ring collectives.

use candle_core::{DType, Tensor};
use rpc_core::Agent;
use std::sync::Arc;

use crate::mailbox::{
    effective_timeout, mailbox, send_raw, send_tagged, Abort, Body, Header, P2pError, Tag,
    TakeError,
};

/// How values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the group's members.
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// This worker is not a member of the group.
    #[error("rank {rank} is not a member of group {members:?}")]
    NotMember {
        /// This worker's rank.
        rank: u32,
        /// The group's ranks.
        members: Vec<u32>,
    },
    /// The group's members disagree (COL-1) or the call is invalid.
    #[error("{op} on group {members:?} failed: {message}")]
    Failed {
        /// The collective.
        op: &'static str,
        /// The group's ranks.
        members: Vec<u32>,
        /// What went wrong (the same on every member for a mismatch).
        message: String,
    },
    /// Sending or receiving failed.
    #[error("{op} on group {members:?}: message exchange failed")]
    Exchange {
        /// The collective.
        op: &'static str,
        /// The group's ranks.
        members: Vec<u32>,
        /// The cause.
        #[source]
        source: P2pError,
    },
    /// Local tensor computation failed.
    #[error("tensor operation failed")]
    Candle(#[from] candle_core::Error),
}

/// A set of ranks that run collectives together. Handles on the same ranks share one sequence
/// of operations per worker, so creating the group again continues where the last handle was.
#[derive(Clone)]
pub struct ProcessGroup {
    agent: Agent,
    ranks: Arc<Vec<u32>>,
    /// The incarnation of each member when the group was created.
    incarnations: Arc<Vec<u64>>,
    id: u64,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("ranks", &self.ranks)
            .finish()
    }
}

/// The group of every worker that has joined (in a group that grows, the vacant ranks are
/// not in it).
pub fn world(agent: &Agent) -> ProcessGroup {
    let ranks: Vec<u32> = agent.worker_infos().iter().map(|w| w.id.0).collect();
    new_group(agent, &ranks).expect("the world is a valid group")
}

/// A group of `ranks` (every member must create it with the same ranks). The group is of the
/// members' current incarnations: once a member has been replaced, creating the group again
/// makes a new one (fresh sequence numbers), with the replacement in it (COL-3).
pub fn new_group(agent: &Agent, ranks: &[u32]) -> Result<ProcessGroup, CollectiveError> {
    new_group_tagged(agent, ranks, 0)
}

/// Like [`new_group`], one of several independent groups over the same ranks, told apart by
/// `tag` (every member must give the same one; [`new_group`] is tag 0). Groups with other tags
/// share no sequence numbers and no messages, so a group re-created for a new instance of a
/// model (after a failure abandoned the previous one in the middle of a collective) cannot
/// meet the previous one's leftovers, even when no member was replaced.
pub fn new_group_tagged(
    agent: &Agent,
    ranks: &[u32],
    tag: u64,
) -> Result<ProcessGroup, CollectiveError> {
    let mut r = ranks.to_vec();
    r.sort_unstable();
    r.dedup();
    if r.is_empty() || r.iter().any(|&x| x as usize >= agent.world_size()) {
        return Err(CollectiveError::Failed {
            op: "new_group",
            members: r,
            message: format!(
                "ranks must be non-empty and below the world size {}",
                agent.world_size()
            ),
        });
    }
    if let Some(e) = r.iter().find_map(|&x| agent.get_worker_info(x).err()) {
        return Err(CollectiveError::Failed {
            op: "new_group",
            members: r,
            message: e.to_string(),
        });
    }
    let incs: Vec<u64> = r
        .iter()
        .map(|&x| agent.incarnation_of(x).unwrap_or(0))
        .collect();
    // FNV-1a over the members, their incarnations and the tag: the same id on every member
    // that has heard of the same incarnations; never 0 (point to point). Incarnations 0 and
    // tag 0 add nothing, so a group of first incarnations keeps the id of its ranks alone.
    let nonzero = |v: u64| (v > 0).then(|| v.to_le_bytes()).into_iter().flatten();
    let id = r
        .iter()
        .zip(&incs)
        .flat_map(|(x, &i)| x.to_le_bytes().into_iter().chain(nonzero(i)))
        // Masked, so that a tag never hashes like the last member's incarnation.
        .chain(nonzero(tag).map(|b| b ^ 0x5a))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
        | 1;
    let ranks = Arc::new(r);
    let incarnations = Arc::new(incs);
    mailbox(agent).register_group(id, Arc::clone(&ranks), Arc::clone(&incarnations));
    Ok(ProcessGroup {
        agent: agent.clone(),
        ranks,
        incarnations,
        id,
    })
}

/// A collective running in the background; `wait` for its result.
#[must_use = "a collective's outcome is only known by waiting for it"]
pub struct Work<T>(tokio::task::JoinHandle<Result<T, CollectiveError>>);

impl<T> Work<T> {
    /// Waits for the collective.
    pub async fn wait(self) -> Result<T, CollectiveError> {
        self.0.await.map_err(|e| CollectiveError::Exchange {
            op: "task",
            members: Vec::new(),
            source: P2pError::Task(e.to_string()),
        })?
    }
}

fn combine(op: ReduceOp, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Max => a.maximum(b),
        ReduceOp::Min => a.minimum(b),
    }
}

/// One collective call's bookkeeping.
struct Op<'a> {
    g: &'a ProcessGroup,
    name: &'static str,
    seq: u64,
    me: usize,
    header: Header,
}

impl Op<'_> {
    fn n(&self) -> usize {
        self.g.ranks.len()
    }

    fn peer(&self, offset: isize) -> u32 {
        let n = self.n() as isize;
        self.g.ranks[((self.me as isize + offset) % n + n) as usize % self.n()]
    }

    fn tag(&self, step: u32) -> Tag {
        Tag {
            group: self.g.id,
            seq: self.seq,
            step,
        }
    }

    fn exchange_err(&self, source: P2pError) -> CollectiveError {
        CollectiveError::Exchange {
            op: self.name,
            members: self.g.ranks.to_vec(),
            source,
        }
    }

    async fn send(&self, to: u32, step: u32, t: Tensor) -> Result<(), CollectiveError> {
        send_tagged(&self.g.agent, to, self.tag(step), self.header.clone(), t)
            .await
            .map_err(|e| self.exchange_err(e))
    }

    /// Receives a tensor and checks the sender's header against ours (COL-1).
    async fn recv(&self, from: u32, step: u32) -> Result<Tensor, CollectiveError> {
        match self.recv_body(from, step).await? {
            Body::Tensor(t) => Ok(t),
            Body::Raw(_) => Err(self.failed("got raw elements where a tensor was expected".into())),
        }
    }

    /// Receives raw elements (the fast path).
    async fn recv_raw(&self, from: u32, step: u32) -> Result<bytes::Bytes, CollectiveError> {
        match self.recv_body(from, step).await? {
            Body::Raw(b) => Ok(b),
            Body::Tensor(_) => {
                Err(self.failed("got a tensor where raw elements were expected".into()))
            }
        }
    }

    fn failed(&self, message: String) -> CollectiveError {
        CollectiveError::Failed {
            op: self.name,
            members: self.g.ranks.to_vec(),
            message,
        }
    }

    async fn send_raw(
        &self,
        to: u32,
        step: u32,
        data: bytes::Bytes,
    ) -> Result<(), CollectiveError> {
        send_raw(&self.g.agent, to, self.tag(step), self.header.clone(), data)
            .await
            .map_err(|e| self.exchange_err(e))
    }

    async fn recv_body(&self, from: u32, step: u32) -> Result<Body, CollectiveError> {
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

    async fn abort_all(&self, why: &str) {
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
    /// The group's ranks, sorted.
    pub fn ranks(&self) -> &[u32] {
        &self.ranks
    }

    /// The incarnation of each member (in the order of [`ProcessGroup::ranks`]) when the
    /// group was created.
    pub fn incarnations(&self) -> &[u64] {
        &self.incarnations
    }

    /// The worker this handle belongs to.
    pub(crate) fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    fn begin(&self, name: &'static str, t: &Tensor) -> Result<Op<'_>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.begin_at(name, t, seq)
    }

    fn begin_at(
        &self,
        name: &'static str,
        t: &Tensor,
        seq: u64,
    ) -> Result<Op<'_>, CollectiveError> {
        self.begin_header(name, t.dims().to_vec(), t.dtype().as_str(), seq)
    }

    fn begin_header(
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

    fn end(&self, op: &Op<'_>) {
        mailbox(&self.agent).finish(self.id, op.seq);
    }

    /// Reduces `t` element-wise over the group; every member gets the same result.
    ///
    /// The ring: `n - 1` reduce-scatter steps, then `n - 1` all-gather steps, each sending one
    /// `1/n` chunk to the next rank while receiving one from the previous.
    pub async fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CollectiveError> {
        let o = self.begin("all_reduce", t)?;
        let out = self.ring_all_reduce(&o, t, op).await;
        self.end(&o);
        out
    }

    async fn ring_all_reduce(
        &self,
        o: &Op<'_>,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let n = o.n();
        if n == 1 {
            return Ok(t.clone());
        }
        if matches!(t.device(), candle_core::Device::Cpu) {
            match t.dtype() {
                DType::F32 => return self.ring_flat::<f32>(o, t, op).await,
                DType::F64 => return self.ring_flat::<f64>(o, t, op).await,
                _ => {}
            }
        }
        let mut chunks = self.split(t, n)?;
        self.reduce_scatter_steps(o, &mut chunks, op).await?;
        self.all_gather_steps(o, &mut chunks, n as u32 - 1).await?;
        let mut out = Tensor::cat(&chunks, 0)?.reshape(t.dims())?;
        if op == ReduceOp::Mean {
            out = (out / n as f64)?;
        }
        Ok(out)
    }

    /// The fast ring for CPU floats: one flat buffer, chunks sent as raw elements, received
    /// chunks reduced in place straight from the receive buffer, the result built from the
    /// buffer without a copy.
    async fn ring_flat<T: Element>(
        &self,
        o: &Op<'_>,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let mut buf: Vec<T> = copy_out(t)?;
        self.ring_slice(o, &mut buf, op).await?;
        Ok(Tensor::from_vec(buf, t.dims(), t.device())?)
    }

    /// The ring over a flat buffer, in place (`Mean` divides at the end).
    ///
    /// `2(n - 1)` steps; at step `s` each member sends one chunk to the next member and
    /// receives one from the previous, and the chunk received at step `s` is the one sent at
    /// step `s + 1`. So the ring runs as a pipeline of pieces (of [`PIECE_BYTES`]): each piece
    /// received is folded and sent on at once, while later pieces are still travelling. In the
    /// reduce-scatter steps before the last, the sum is written straight into the outgoing
    /// blob (in shared memory with a peer on this host) and never into `buf`: those chunks are
    /// overwritten by the all-gather anyway; that saves two of the five passes over the data
    /// that a fold followed by a copy would make. The other steps fill `buf` and the outgoing
    /// piece in one pass ([`Element::fold_tee`]).
    async fn ring_slice<T: Element>(
        &self,
        o: &Op<'_>,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (base, extra) = (buf.len() / n, buf.len() % n);
        let mut ranges = Vec::with_capacity(n);
        let mut start = 0;
        for i in 0..n {
            let size = base + usize::from(i < extra);
            ranges.push(start..start + size);
            start += size;
        }
        let (next, prev) = (o.peer(1), o.peer(-1));
        let steps = 2 * (n - 1);
        // Reduce-scatter steps come first; in both phases the chunk sent at step `s + 1` is
        // the one received at step `s`.
        let received = |s: usize| {
            let back = if s < n - 1 { s + 2 } else { s - (n - 1) + 1 };
            (o.me + 2 * n - back) % n
        };
        let per = (PIECE_BYTES / std::mem::size_of::<T>()).max(1);
        let elem = std::mem::size_of::<T>();
        let tag = |s: usize, j: usize| s as u32 * MAX_PIECES + j as u32;
        let stage = |len: usize, fill: &mut dyn FnMut(&mut [u8])| {
            o.g.agent.blob_for(next, len, fill).map_err(|e| {
                o.exchange_err(P2pError::Send {
                    worker: o.g.agent.name_of(next),
                    source: Box::new(e),
                })
            })
        };
        let send = |s: usize, j: usize, blob: rpc_core::Blob| {
            o.send_raw(next, tag(s, j), blob.into_bytes())
        };
        use futures::StreamExt as _;
        let mut sending = futures::stream::FuturesUnordered::new();
        // Step 0 sends this member's own copy of the chunk before the one it receives first.
        let first = ranges[(o.me + n - 1) % n].clone();
        for (j, p) in buf[first].chunks(per).enumerate() {
            let blob = stage(std::mem::size_of_val(p), &mut |d| T::write_le(p, d))?;
            sending.push(send(0, j, blob));
        }
        for s in 0..steps {
            let r = ranges[received(s)].clone();
            for (j, lo) in r.clone().step_by(per).enumerate() {
                let hi = (lo + per).min(r.end);
                let recv = o.recv_raw(prev, tag(s, j));
                tokio::pin!(recv);
                // Sends in flight make progress while this member waits.
                let got = loop {
                    tokio::select! {
                        got = &mut recv => break got?,
                        Some(sent) = sending.next() => sent?,
                    }
                };
                check_len::<T>(o, hi - lo, got.len())?;
                let bytes = (hi - lo) * elem;
                if s + 2 < n {
                    // Reduce-scatter before its last step: the sum goes out, not into `buf`.
                    let mine = &buf[lo..hi];
                    let blob = stage(bytes, &mut |d| T::fold_le(op, mine, &got, d))?;
                    sending.push(send(s + 1, j, blob));
                    continue;
                }
                let fold = (s < n - 1).then_some(op);
                if s + 1 < steps {
                    // Into `buf` and into the outgoing piece in one pass.
                    let mine = &mut buf[lo..hi];
                    let blob = stage(bytes, &mut |d| T::fold_tee(fold, mine, &got, d))?;
                    sending.push(send(s + 1, j, blob));
                } else {
                    T::copy_into(&mut buf[lo..hi], &got);
                }
            }
        }
        while let Some(sent) = sending.next().await {
            sent?;
        }
        if op == ReduceOp::Mean {
            for x in buf.iter_mut() {
                *x = x.div_by(n);
            }
        }
        Ok(())
    }

    /// `n` chunks of the flattened tensor, sizes differing by at most one element.
    fn split(&self, t: &Tensor, n: usize) -> candle_core::Result<Vec<Tensor>> {
        let flat = t.flatten_all()?;
        let len = flat.elem_count();
        let (base, extra) = (len / n, len % n);
        let mut start = 0;
        (0..n)
            .map(|i| {
                let size = base + usize::from(i < extra);
                let c = flat.narrow(0, start, size);
                start += size;
                c
            })
            .collect()
    }

    /// After these steps member `i` holds the fully reduced chunk `i`.
    async fn reduce_scatter_steps(
        &self,
        o: &Op<'_>,
        chunks: &mut [Tensor],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (next, prev) = (o.peer(1), o.peer(-1));
        for s in 0..n - 1 {
            let send_idx = (o.me + 2 * n - s - 1) % n;
            let recv_idx = (o.me + 2 * n - s - 2) % n;
            let (sent, got) = tokio::join!(
                o.send(next, s as u32, chunks[send_idx].clone()),
                o.recv(prev, s as u32)
            );
            sent?;
            chunks[recv_idx] = combine(op, &chunks[recv_idx], &got?)?;
        }
        Ok(())
    }

    /// Circulates the chunks: after these steps every member holds every chunk.
    async fn all_gather_steps(
        &self,
        o: &Op<'_>,
        chunks: &mut [Tensor],
        first_step: u32,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (next, prev) = (o.peer(1), o.peer(-1));
        for s in 0..n - 1 {
            let send_idx = (o.me + n - s) % n;
            let recv_idx = (o.me + 2 * n - s - 1) % n;
            let step = first_step + s as u32;
            let (sent, got) = tokio::join!(
                o.send(next, step, chunks[send_idx].clone()),
                o.recv(prev, step)
            );
            sent?;
            chunks[recv_idx] = got?;
        }
        Ok(())
    }

    /// Reduces `t` over the group and returns this member's `1/n` chunk of the flattened
    /// result (member `i` gets chunk `i`; chunk sizes differ by at most one element).
    pub async fn reduce_scatter(
        &self,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.reduce_scatter_at(t, op, seq).await
    }

    async fn reduce_scatter_at(
        &self,
        t: &Tensor,
        op: ReduceOp,
        seq: u64,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.begin_at("reduce_scatter", t, seq)?;
        let out = async {
            let n = o.n();
            let mut chunks = self.split(t, n)?;
            if n > 1 {
                self.reduce_scatter_steps(&o, &mut chunks, op).await?;
            }
            let mine = chunks.swap_remove(o.me);
            Ok(if op == ReduceOp::Mean {
                (mine / n as f64)?
            } else {
                mine
            })
        }
        .await;
        self.end(&o);
        out
    }

    /// Every member's `t`, in member order (all must have the same shape and dtype).
    pub async fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.all_gather_at(t, seq).await
    }

    async fn all_gather_at(&self, t: &Tensor, seq: u64) -> Result<Vec<Tensor>, CollectiveError> {
        let o = self.begin_at("all_gather", t, seq)?;
        let out = async {
            let n = o.n();
            let mut all: Vec<Tensor> = vec![t.clone(); n];
            if n > 1 {
                self.all_gather_steps(&o, &mut all, 0).await?;
            }
            Ok(all)
        }
        .await;
        self.end(&o);
        out
    }

    /// `root`'s `t` on every member (`t` gives the shape and dtype on the others).
    pub async fn broadcast(&self, t: &Tensor, root: u32) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.broadcast_at(t, root, seq).await
    }

    async fn broadcast_at(
        &self,
        t: &Tensor,
        root: u32,
        seq: u64,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.begin_at("broadcast", t, seq)?;
        let out = async {
            if !self.ranks.contains(&root) {
                return Err(CollectiveError::Failed {
                    op: "broadcast",
                    members: self.ranks.to_vec(),
                    message: format!("root {root} is not a member"),
                });
            }
            if self.agent.rank() == root {
                let sends = self
                    .ranks
                    .iter()
                    .filter(|&&r| r != root)
                    .map(|&r| o.send(r, 0, t.clone()));
                futures::future::try_join_all(sends).await?;
                Ok(t.clone())
            } else {
                o.recv(root, 0).await
            }
        }
        .await;
        self.end(&o);
        out
    }

    /// Returns once every member has called it.
    pub async fn barrier(&self) -> Result<(), CollectiveError> {
        let token = Tensor::zeros(1, DType::U8, &candle_core::Device::Cpu)?;
        self.all_reduce(&token, ReduceOp::Max).await.map(|_| ())
    }

    /// Reduces `data` element-wise over the group, in place: the ring runs on the caller's
    /// buffer, with no copy of the input or the result (every member passes a buffer of the
    /// same length and element type).
    pub async fn all_reduce_in_place<T: Element>(
        &self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        let o = self.begin_header(
            "all_reduce_in_place",
            vec![data.len()],
            T::DTYPE.as_str(),
            seq,
        )?;
        let out = if o.n() == 1 {
            Ok(())
        } else {
            self.ring_slice(&o, data, op).await
        };
        self.end(&o);
        out
    }

    /// [`ProcessGroup::broadcast`] in the background.
    pub fn broadcast_async(&self, t: &Tensor, root: u32) -> Work<Tensor> {
        let (g, t) = (self.clone(), t.clone());
        let seq = mailbox(&self.agent).next_seq(self.id);
        Work(
            rpc_core::CallScope::current().spawn_on(self.agent.runtime(), async move {
                g.broadcast_at(&t, root, seq).await
            }),
        )
    }

    /// [`ProcessGroup::all_gather`] in the background.
    pub fn all_gather_async(&self, t: &Tensor) -> Work<Vec<Tensor>> {
        let (g, t) = (self.clone(), t.clone());
        let seq = mailbox(&self.agent).next_seq(self.id);
        Work(
            rpc_core::CallScope::current().spawn_on(self.agent.runtime(), async move {
                g.all_gather_at(&t, seq).await
            }),
        )
    }

    /// [`ProcessGroup::reduce_scatter`] in the background.
    pub fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Work<Tensor> {
        let (g, t) = (self.clone(), t.clone());
        let seq = mailbox(&self.agent).next_seq(self.id);
        Work(
            rpc_core::CallScope::current().spawn_on(self.agent.runtime(), async move {
                g.reduce_scatter_at(&t, op, seq).await
            }),
        )
    }

    /// [`ProcessGroup::all_reduce`] in the background, so communication overlaps computation.
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Work<Tensor> {
        let (g, t) = (self.clone(), t.clone());
        // The sequence number is taken now, in call order, not when the task first runs:
        // every member must pair this call with the same call on the others.
        let seq = mailbox(&self.agent).next_seq(self.id);
        Work(
            rpc_core::CallScope::current().spawn_on(self.agent.runtime(), async move {
                let o = g.begin_at("all_reduce", &t, seq)?;
                let out = g.ring_all_reduce(&o, &t, op).await;
                g.end(&o);
                out
            }),
        )
    }
}

fn check_len<T>(o: &Op<'_>, elems: usize, bytes: usize) -> Result<(), CollectiveError> {
    if bytes == elems * std::mem::size_of::<T>() {
        Ok(())
    } else {
        Err(o.failed(format!(
            "a chunk of {bytes} bytes arrived where {elems} elements were expected"
        )))
    }
}

/// Bytes per message of the fast ring: big enough to amortize a message, small enough that
/// building one piece overlaps with the receiver reducing the previous one. Measured on 2
/// cores at 64 MiB: through shared memory 8 and 16 MiB pieces are within noise of each other
/// and 4 MiB slower with 4 ranks; over TCP 16 MiB beat whole chunks and 4 MiB pieces.
const PIECE_BYTES: usize = 8 << 20;
/// Pieces per ring step that the step numbering leaves room for (chunks up to 256 GiB).
const MAX_PIECES: u32 = 1 << 16;

/// A CPU tensor's elements in a fresh buffer (from [`rpc_core::ext::large_vec`]).
fn copy_out<T: Element>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    let t = t.flatten_all()?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return t.to_vec1::<T>();
    };
    let all = T::cpu_storage_as_slice(cpu)?;
    let Some((a, b)) = layout.contiguous_offsets() else {
        return t.to_vec1::<T>();
    };
    let mut v = rpc_core::ext::large_vec::<T>(b - a);
    v.extend_from_slice(&all[a..b]);
    Ok(v)
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// Element types the ring reduces directly (`f32`, `f64`).
pub trait Element:
    sealed::Sealed
    + candle_core::WithDType
    + Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
{
    /// `self / n`.
    fn div_by(self, n: usize) -> Self;

    /// Reads a little-endian element.
    fn from_le(b: &[u8]) -> Self;

    /// Combines two elements under `op` (`Mean` sums; the division comes at the end).
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => a + b,
            ReduceOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
            ReduceOp::Min => {
                if b < a {
                    b
                } else {
                    a
                }
            }
        }
    }

    /// `dst[i] = combine(dst[i], src[i])`, reading `src` as little-endian elements.
    fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
        // SAFETY: reinterpreting initialized bytes as f32/f64 is sound for any bit pattern;
        // `align_to` only yields the aligned middle part.
        let (pre, mid, post) = unsafe { src.align_to::<Self>() };
        if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
            // One loop per operation, so the compiler vectorizes it.
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    for (d, s) in dst.iter_mut().zip(mid) {
                        *d += *s;
                    }
                }
                _ => {
                    for (d, s) in dst.iter_mut().zip(mid) {
                        *d = Self::combine(op, *d, *s);
                    }
                }
            }
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(w)) {
                *d = Self::combine(op, *d, Self::from_le(s));
            }
        }
    }

    /// Writes `src` into `dst` as little-endian elements (`dst` is exactly as long).
    fn write_le(src: &[Self], dst: &mut [u8]) {
        // SAFETY: f32/f64 are plain data without padding; on a little-endian target their
        // in-memory bytes are their little-endian encoding.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        };
        if cfg!(target_endian = "little") {
            dst.copy_from_slice(bytes);
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.chunks_exact_mut(w).zip(bytes.chunks_exact(w)) {
                d.copy_from_slice(s);
                d.reverse();
            }
        }
    }

    /// Writes `combine(mine[i], theirs[i])` into `dst` as little-endian elements, reading
    /// `theirs` as little-endian elements (`theirs` and `dst` are as long as `mine`).
    fn fold_le(op: ReduceOp, mine: &[Self], theirs: &[u8], dst: &mut [u8]) {
        // SAFETY: as in `reduce_into`; every bit pattern is a valid f32/f64 and `align_to_mut`
        // only yields the aligned middle part.
        let (tp, tm, tq) = unsafe { theirs.align_to::<Self>() };
        let (dp, dm, dq) = unsafe { dst.align_to_mut::<Self>() };
        let aligned = tp.is_empty() && tq.is_empty() && dp.is_empty() && dq.is_empty();
        if aligned && cfg!(target_endian = "little") {
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    for ((d, a), b) in dm.iter_mut().zip(mine).zip(tm) {
                        *d = *a + *b;
                    }
                }
                _ => {
                    for ((d, a), b) in dm.iter_mut().zip(mine).zip(tm) {
                        *d = Self::combine(op, *a, *b);
                    }
                }
            }
        } else {
            let w = std::mem::size_of::<Self>();
            let folded: Vec<Self> = mine
                .iter()
                .zip(theirs.chunks_exact(w))
                .map(|(a, b)| Self::combine(op, *a, Self::from_le(b)))
                .collect();
            Self::write_le(&folded, dst);
        }
    }

    /// `buf[i] = combine(buf[i], theirs[i])` (or `theirs[i]` when `op` is `None`), also
    /// written into `dst` as little-endian elements, in one pass (`theirs` and `dst` are as
    /// long as `buf`).
    fn fold_tee(op: Option<ReduceOp>, buf: &mut [Self], theirs: &[u8], dst: &mut [u8]) {
        // SAFETY: as in `fold_le`.
        let (tp, tm, tq) = unsafe { theirs.align_to::<Self>() };
        let (dp, dm, dq) = unsafe { dst.align_to_mut::<Self>() };
        let aligned = tp.is_empty() && tq.is_empty() && dp.is_empty() && dq.is_empty();
        if aligned && cfg!(target_endian = "little") {
            match op {
                None => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a = *b;
                        *d = *b;
                    }
                }
                Some(ReduceOp::Sum | ReduceOp::Mean) => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a += *b;
                        *d = *a;
                    }
                }
                Some(op) => {
                    for ((d, a), b) in dm.iter_mut().zip(buf.iter_mut()).zip(tm) {
                        *a = Self::combine(op, *a, *b);
                        *d = *a;
                    }
                }
            }
        } else {
            match op {
                None => Self::copy_into(buf, theirs),
                Some(op) => Self::reduce_into(op, buf, theirs),
            }
            Self::write_le(buf, dst);
        }
    }

    /// Overwrites `dst` with the little-endian elements in `src`.
    fn copy_into(dst: &mut [Self], src: &[u8]) {
        // SAFETY: as in `reduce_into`.
        let (pre, mid, post) = unsafe { src.align_to::<Self>() };
        if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
            let n = dst.len().min(mid.len());
            dst[..n].copy_from_slice(&mid[..n]);
        } else {
            let w = std::mem::size_of::<Self>();
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(w)) {
                *d = Self::from_le(s);
            }
        }
    }
}

impl Element for f32 {
    fn div_by(self, n: usize) -> Self {
        self / n as f32
    }

    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
}

impl Element for f64 {
    fn div_by(self, n: usize) -> Self {
        self / n as f64
    }

    fn from_le(b: &[u8]) -> Self {
        f64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
}
