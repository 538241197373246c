//! Process groups and their collectives.
//!
//! Layout: this file the API ([`ProcessGroup`] and its operations); `op.rs` one operation's
//! messages (tags, sends, receives, the one verdict of a mismatch); `ring.rs` the ring
//! algorithms; `rooted.rs` reduce, gather, scatter and all-to-all; `element.rs` the element
//! kernels of the fast ring (`f32`, `f64` folded straight from received bytes); `nccl.rs`
//! (feature `nccl`) the same operations for tensors on CUDA devices, through NCCL, and
//! `generation.rs` how its members agree on their communicator.

mod element;
mod generation;
mod lanes;
#[cfg(feature = "nccl")]
mod nccl;
mod op;
mod ring;
mod rooted;

use candle_core::{DType, Tensor};
use rpc_core::Agent;
use std::sync::Arc;

use crate::mailbox::{mailbox, P2pError};

pub use element::Element;
pub(crate) use lanes::{per_lane, run as run_lanes};
pub(crate) use op::Verdict;

/// How values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum (of integers: wrapping on overflow, as PyTorch's and NCCL's).
    Sum,
    /// Element-wise mean over the group's members (of integers: the sum divided by the
    /// number of members, rounded toward zero, as NCCL's average).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product (of integers: wrapping on overflow).
    Product,
}

impl ReduceOp {
    /// Its name in messages: `sum`, `mean`, `max`, `min`, `product`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::Mean => "mean",
            Self::Max => "max",
            Self::Min => "min",
            Self::Product => "product",
        }
    }
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
    /// Threads the ring's passes over a piece run on (`lanes.rs`).
    lanes: usize,
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
    let local = std::env::var("LOCAL_WORLD_SIZE").ok();
    let on_host = lanes::members_on_host(ranks.len(), local.as_deref());
    let lanes = lanes::default_lanes(lanes::cores(), on_host);
    Ok(ProcessGroup {
        agent: agent.clone(),
        ranks,
        incarnations,
        id,
        lanes,
    })
}

/// A collective running in the background; `wait` for its result.
#[must_use = "a collective's outcome is only known by waiting for it"]
pub struct Work<T>(WorkState<T>);

enum WorkState<T> {
    Running(tokio::task::JoinHandle<Result<T, CollectiveError>>),
    Ready(Result<T, CollectiveError>),
}

impl<T: Send + 'static> Work<T> {
    /// Work whose outcome is already known (a hook that failed before it could start).
    pub fn ready(outcome: Result<T, CollectiveError>) -> Self {
        Self(WorkState::Ready(outcome))
    }

    /// Waits for the collective.
    pub async fn wait(self) -> Result<T, CollectiveError> {
        match self.0 {
            WorkState::Ready(outcome) => outcome,
            WorkState::Running(task) => task.await.map_err(|e| CollectiveError::Exchange {
                op: "task",
                members: Vec::new(),
                source: P2pError::Task(e.to_string()),
            })?,
        }
    }

    /// Work that applies `f` to this one's result once it is there (in the background, in
    /// the caller's scope).
    pub fn map<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U, CollectiveError> + Send + 'static,
    ) -> Work<U> {
        Work(WorkState::Running(rpc_core::spawn(async move {
            f(self.wait().await?)
        })))
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

    /// Runs the ring's passes over memory (on the CPU) on up to `threads` threads per
    /// operation (1 to 16). The default leaves half of the machine's cores to compute:
    /// `cores / (2 × members on this host)`, from 1 to 4 (the members on this host: the
    /// group's size, or the launcher's `LOCAL_WORLD_SIZE` where smaller). Results are the same,
    /// bit for bit, whatever the number (LANE-1).
    pub fn with_ring_threads(mut self, threads: usize) -> Self {
        self.lanes = threads.clamp(1, lanes::MAX_LANES * 4);
        self
    }

    /// The threads the ring's passes run on (see [`ProcessGroup::with_ring_threads`]).
    pub fn ring_threads(&self) -> usize {
        self.lanes
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Reduces `t` element-wise over the group; every member gets the same result.
    ///
    /// The ring: `n - 1` reduce-scatter steps, then `n - 1` all-gather steps, each sending one
    /// `1/n` chunk to the next rank while receiving one from the previous.
    pub async fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CollectiveError> {
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            let seq = mailbox(&self.agent).next_seq(self.id);
            return self.nccl_all_reduce(seq, turn, t, op).await;
        }
        let o = self.begin("all_reduce", t)?.reducing(op);
        let out = self.ring_all_reduce(&o, t, op).await;
        self.end(&o);
        out
    }

    /// Reduces `t` over the group and returns this member's `1/n` chunk of the flattened
    /// result (member `i` gets chunk `i`; chunk sizes differ by at most one element).
    pub async fn reduce_scatter(
        &self,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            return self.nccl_reduce_scatter(seq, turn, t, op).await;
        }
        self.reduce_scatter_at(t, op, seq).await
    }

    /// Every member's `t`, in member order (all must have the same shape and dtype).
    pub async fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            return self.nccl_all_gather(seq, turn, t).await;
        }
        self.all_gather_at(t, seq).await
    }

    /// `root`'s `t` on every member (`t` gives the shape and dtype on the others). The members
    /// send the root their shapes first, so a mismatch, or a root that is not a member, fails
    /// every member with one message (COL-1) and no data moves; so do members that pass
    /// different roots (ROOT-1).
    pub async fn broadcast(&self, t: &Tensor, root: u32) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            return self.nccl_broadcast(seq, turn, t, root).await;
        }
        self.broadcast_at(t, root, seq).await
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
        self.reduce_slice(seq, data, op).await
    }

    /// Reduces `t` element-wise over the group onto `root`, which gets `Some(result)`; the
    /// others get `None` (every member passes the same shape, dtype and root: ROOT-1).
    pub async fn reduce(
        &self,
        t: &Tensor,
        op: ReduceOp,
        root: u32,
    ) -> Result<Option<Tensor>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            return self.nccl_reduce(seq, turn, t, op, root).await;
        }
        self.reduce_at(t, op, root, seq).await
    }

    /// Every member's `t` on `root`, in member order (`Some` there, `None` elsewhere; all
    /// must have the same shape and dtype, and pass the same root: ROOT-1).
    pub async fn gather(
        &self,
        t: &Tensor,
        root: u32,
    ) -> Result<Option<Vec<Tensor>>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, t) {
            return self.nccl_gather(seq, turn, t, root).await;
        }
        self.gather_at(t, root, seq).await
    }

    /// `root`'s `parts[i]` on the group's `i`-th member. The root passes `Some(parts)`, one
    /// per member in member order (of any shapes); the others pass `None`. The root sends
    /// the parts once every member has said it takes part (one small message each), so
    /// that a wrong call anywhere (parts passed by another member, another root: ROOT-1)
    /// fails every member with one message and no member gets its part.
    pub async fn scatter(
        &self,
        parts: Option<Vec<Tensor>>,
        root: u32,
    ) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.scatter_at(parts, root, seq).await
    }

    /// Each member sends its `parts[j]` to the group's `j`-th member and gets, in member
    /// order, the part each member meant for it. Parts may differ in their first dimension
    /// (unequal splits), not in element type or the rest of their shape.
    pub async fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        self.all_to_all_at(parts, seq).await
    }

    /// [`ProcessGroup::all_to_all`] of one tensor split along its first dimension: rows
    /// `splits[0]` go to the first member, the next `splits[1]` to the second, and so on
    /// (`None`: equal splits); the parts received are concatenated in member order. Splits
    /// that do not fit this member's tensor fail the operation on every member, naming it
    /// (COL-4).
    pub async fn all_to_all_single(
        &self,
        t: &Tensor,
        splits: Option<&[usize]>,
    ) -> Result<Tensor, CollectiveError> {
        let seq = mailbox(&self.agent).next_seq(self.id);
        // COL-4: splits that do not fit fail the operation on every member, in its place.
        let parts = match self.split_rows(t, splits) {
            Ok(parts) => parts,
            Err(why) => return Err(self.fail_at("all_to_all", seq, why).await),
        };
        let got = self.all_to_all_at(parts, seq).await?;
        Ok(Tensor::cat(&got, 0)?)
    }

    /// `t`'s rows in `splits` (or equal parts), one per member; why not, naming this member.
    fn split_rows(&self, t: &Tensor, splits: Option<&[usize]>) -> Result<Vec<Tensor>, String> {
        let (n, me) = (self.size(), self.agent.rank());
        let rows = t.dims().first().copied().unwrap_or(0);
        let sizes: Vec<usize> = match splits {
            Some(s) => s.to_vec(),
            None if rows % n == 0 => vec![rows / n; n],
            None => {
                return Err(format!(
                    "rank {me}'s {rows} rows do not split equally over {n} members"
                ))
            }
        };
        if sizes.len() != n || sizes.iter().sum::<usize>() != rows {
            return Err(format!(
                "rank {me}'s splits {sizes:?} do not fit its {rows} rows over {n} members"
            ));
        }
        let mut at = 0;
        sizes
            .iter()
            .map(|&k| {
                let p = t.narrow(0, at, k);
                at += k;
                p.map_err(|e| format!("rank {me} cannot split its tensor: {e}"))
            })
            .collect()
    }

    /// Runs `op` in the background under the next sequence number, taken now (in call order,
    /// not when the task first runs: every member pairs this call with the same call on the
    /// others), in the caller's scope.
    /// The in-place all-reduce of `data` as operation `seq` of this group (both the awaited
    /// and the background form).
    async fn reduce_slice<T: Element>(
        &self,
        seq: u64,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let o = self
            .begin_header(
                "all_reduce_in_place",
                vec![data.len()],
                T::DTYPE.as_str(),
                seq,
            )?
            .reducing(op);
        let out = if o.n() == 1 {
            Ok(())
        } else {
            self.ring_slice(&o, data, op).await
        };
        self.end(&o);
        out
    }

    fn background<T, F>(&self, op: impl FnOnce(ProcessGroup, u64) -> F) -> Work<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T, CollectiveError>> + Send + 'static,
    {
        let seq = mailbox(&self.agent).next_seq(self.id);
        let fut = op(self.clone(), seq);
        Work(WorkState::Running(
            rpc_core::CallScope::current().spawn_on(self.agent.runtime(), fut),
        ))
    }

    /// COL-4 for an operation this member cannot even start (its input could not be made):
    /// takes the operation's place in the group's order, as calling it would have, and fails
    /// it on every member with `why`.
    pub(crate) fn fail_async<T: Send + 'static>(&self, op: &'static str, why: String) -> Work<T> {
        self.background(move |g, seq| async move { Err(g.fail_at(op, seq, why).await) })
    }

    /// [`ProcessGroup::all_reduce`] in the background, so communication overlaps computation.
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Work<Tensor> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self
                .background(|g, seq| async move { g.nccl_all_reduce(seq, turn, &t, op).await });
        }
        self.background(|g, seq| async move {
            let o = g.begin_at("all_reduce", &t, seq)?.reducing(op);
            let out = g.ring_all_reduce(&o, &t, op).await;
            g.end(&o);
            out
        })
    }

    /// [`ProcessGroup::all_reduce_in_place`] in the background, on a buffer it owns until
    /// the work is done (then handed back, reduced).
    pub fn all_reduce_vec_async<T: Element + Send + 'static>(
        &self,
        mut data: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.background(
            |g, seq| async move { g.reduce_slice(seq, &mut data, op).await.map(|()| data) },
        )
    }

    /// [`ProcessGroup::all_reduce_vec_async`] of a buffer still to be made: the operation
    /// takes its place in the group's order now (so operations pair up across members as
    /// they were called, whichever buffer is ready first), and `fill` makes the buffer on a
    /// blocking thread, so the caller goes on meanwhile. `fill` gets the threads the ring's
    /// passes may use ([`ProcessGroup::ring_threads`]). A failed or panicking `fill` fails
    /// the operation on every member at once, naming this member and the cause (COL-4).
    ///
    /// For a buffer gathered from many tensors while the caller has other work:
    /// `DistributedDataParallel` copies each bucket's gradients this way while backward goes
    /// on with the next segment.
    pub fn all_reduce_fill_async<T, F>(&self, fill: F, op: ReduceOp) -> Work<Vec<T>>
    where
        T: Element + Send + 'static,
        F: FnOnce(usize) -> Result<Vec<T>, CollectiveError> + Send + 'static,
    {
        let lanes = self.lanes;
        self.background(|g, seq| async move {
            let mut span = g
                .agent
                .tracer()
                .span(rpc_core::trace::Cat::Collective, "fill");
            span.detail(|| format!("seq {seq}"));
            let why = match rpc_core::spawn_blocking(move || fill(lanes)).await {
                Ok(Ok(mut data)) => {
                    drop(span);
                    return g.reduce_slice(seq, &mut data, op).await.map(|()| data);
                }
                Ok(Err(e)) => rpc_core::error_chain(&e),
                Err(e) => e.to_string(),
            };
            drop(span);
            // COL-4: the others would wait for this member's part until their timeout.
            let why = format!(
                "filling the buffer failed on rank {}: {why}",
                g.agent.rank()
            );
            Err(g.fail_at("all_reduce_in_place", seq, why).await)
        })
    }

    /// [`ProcessGroup::broadcast`] in the background.
    pub fn broadcast_async(&self, t: &Tensor, root: u32) -> Work<Tensor> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self
                .background(|g, seq| async move { g.nccl_broadcast(seq, turn, &t, root).await });
        }
        self.background(|g, seq| async move { g.broadcast_at(&t, root, seq).await })
    }

    /// [`ProcessGroup::all_gather`] in the background.
    pub fn all_gather_async(&self, t: &Tensor) -> Work<Vec<Tensor>> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self.background(|g, seq| async move { g.nccl_all_gather(seq, turn, &t).await });
        }
        self.background(|g, seq| async move { g.all_gather_at(&t, seq).await })
    }

    /// [`ProcessGroup::reduce_scatter`] in the background.
    pub fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Work<Tensor> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self.background(|g, seq| async move {
                g.nccl_reduce_scatter(seq, turn, &t, op).await
            });
        }
        self.background(|g, seq| async move { g.reduce_scatter_at(&t, op, seq).await })
    }

    /// [`ProcessGroup::reduce`] in the background.
    pub fn reduce_async(&self, t: &Tensor, op: ReduceOp, root: u32) -> Work<Option<Tensor>> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self
                .background(|g, seq| async move { g.nccl_reduce(seq, turn, &t, op, root).await });
        }
        self.background(|g, seq| async move { g.reduce_at(&t, op, root, seq).await })
    }

    /// [`ProcessGroup::gather`] in the background.
    pub fn gather_async(&self, t: &Tensor, root: u32) -> Work<Option<Vec<Tensor>>> {
        let t = t.clone();
        #[cfg(feature = "nccl")]
        if let Some(turn) = nccl::turn(self, &t) {
            return self
                .background(|g, seq| async move { g.nccl_gather(seq, turn, &t, root).await });
        }
        self.background(|g, seq| async move { g.gather_at(&t, root, seq).await })
    }

    /// [`ProcessGroup::scatter`] in the background.
    pub fn scatter_async(&self, parts: Option<Vec<Tensor>>, root: u32) -> Work<Tensor> {
        self.background(|g, seq| async move { g.scatter_at(parts, root, seq).await })
    }

    /// [`ProcessGroup::all_to_all`] in the background.
    pub fn all_to_all_async(&self, parts: Vec<Tensor>) -> Work<Vec<Tensor>> {
        self.background(|g, seq| async move { g.all_to_all_at(parts, seq).await })
    }
}
