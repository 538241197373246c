//! Recording the autograd graph across calls: the per-worker state of every distributed
//! autograd context, and the send and recv functions the tensor codec records as tensors
//! cross workers inside a context (the hooks `tensor.rs` calls while encoding and decoding).
//! `engine.rs` runs backward over what is recorded here.

use candle_core::{Tensor, TensorId, Var};
use rpc_core::ext::{AgentExt, MessageContext, MessageKind};
use rpc_core::Agent;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Autograd tag of a tensor sent inside a context: which send function it came from.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Tag {
    pub ctx: u64,
    pub sender: u32,
    pub msg: u64,
}

/// The call-metadata key carrying the current context id.
pub const CTX_KEY: &str = "autograd.ctx";

/// One context's state on one worker.
#[derive(Default)]
pub(crate) struct CtxState {
    /// Tensors this worker sent, by message id (send functions).
    pub sends: HashMap<u64, Tensor>,
    /// Leaves made from tensors received: (sender, message id) (recv functions).
    pub recvs: HashMap<TensorId, (u32, u64)>,
    /// Accumulated gradients of this worker's variables: (variable, gradient) (AD-1).
    pub grads: HashMap<TensorId, (Tensor, Tensor)>,
    /// Workers this context exchanged tensors with.
    pub peers: BTreeSet<u32>,
    /// A backward pass is executing on this worker in this context (AD-6).
    pub running: bool,
    /// Gradients for this worker's sends that arrived while it was running: (sent tensor,
    /// gradient), folded into its next local pass.
    pub pending: Vec<(Tensor, Tensor)>,
}

/// Every context's state on one worker, and its id counters.
pub(crate) struct Container {
    pub me: u32,
    /// The top 32 bits of every id this worker makes: its rank and its incarnation (mod
    /// 2^16), so that a replacement never reuses an id of its predecessor (AD-8).
    id_base: u64,
    next_ctx: AtomicU64,
    next_msg: AtomicU64,
    pub contexts: Mutex<HashMap<u64, CtxState>>,
    /// The creators (`id >> 32`) declared failed: their contexts are released and must not
    /// come back when a late message names one (taken under `contexts`' lock).
    failed: Mutex<HashSet<u64>>,
}

/// Who made an id of [`Container::next_id`]: the top 32 bits, its rank and incarnation.
pub(crate) fn creator(id: u64) -> u64 {
    id >> 32
}

/// The creator tag of incarnation `incarnation` of rank `rank`.
pub(crate) fn creator_of(rank: u32, incarnation: u64) -> u64 {
    (u64::from(rank) << 16) | (incarnation & 0xffff)
}

/// The autograd state of `agent`'s worker (created on first use).
pub(crate) fn container(agent: &Agent) -> Arc<Container> {
    let mut created = false;
    let c = agent.extension(|| {
        created = true;
        Container {
            me: agent.rank(),
            id_base: creator_of(agent.rank(), agent.incarnation()) << 32,
            next_ctx: AtomicU64::new(1),
            next_msg: AtomicU64::new(1),
            contexts: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashSet::new()),
        }
    });
    if created {
        // AD-7: the contexts a failed worker started are released here.
        let weak = Arc::downgrade(&c);
        agent.on_worker_failed(move |f| {
            if let Some(c) = weak.upgrade() {
                c.release_started_by(creator_of(f.rank, f.incarnation));
            }
        });
    }
    c
}

impl Container {
    /// A new id for a context or a pipeline: this worker's rank and incarnation, then a
    /// counter (which wraps after 2^32 ids, long after those ids were released).
    pub(crate) fn next_id(&self) -> u64 {
        self.id_base | (self.next_ctx.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
    }

    /// Drops the state of every context `creator` (a failed incarnation) started, and keeps
    /// them from coming back: nobody will release them.
    fn release_started_by(&self, creator: u64) {
        let dropped: Vec<CtxState> = {
            let mut m = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
            self.failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(creator);
            let ids: Vec<u64> = m
                .keys()
                .copied()
                .filter(|&id| self::creator(id) == creator)
                .collect();
            ids.into_iter().filter_map(|id| m.remove(&id)).collect()
        };
        if !dropped.is_empty() {
            tracing::info!(
                rank = creator >> 16,
                incarnation = creator & 0xffff,
                contexts = dropped.len(),
                "released the autograd contexts of a failed worker"
            );
        }
    }

    /// Context `ctx`'s state in `m` (this container's `contexts`, locked), created if new;
    /// `None` if the worker that started it was declared failed (its state was released).
    pub(crate) fn entry<'a>(
        &self,
        m: &'a mut HashMap<u64, CtxState>,
        ctx: u64,
    ) -> Option<&'a mut CtxState> {
        let failed = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&creator(ctx));
        (!failed).then(|| m.entry(ctx).or_default())
    }

    /// Runs `f` on context `ctx`'s state (created if new; a scratch state, dropped after, if
    /// the worker that started it failed).
    pub(crate) fn with<R>(&self, ctx: u64, f: impl FnOnce(&mut CtxState) -> R) -> R {
        let mut m = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        match self.entry(&mut m, ctx) {
            Some(st) => f(st),
            None => f(&mut CtxState::default()),
        }
    }
}

/// The context id in the current task's call metadata, if any.
pub fn current_context_id() -> Option<u64> {
    rpc_core::ext::call_meta(CTX_KEY)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
}

pub(crate) fn record_send(msg: &MessageContext, t: &Tensor) -> Option<Tag> {
    let ctx = current_context_id()?;
    if !t.track_op() {
        return None;
    }
    let c = container(msg.agent());
    let id = c.next_msg.fetch_add(1, Ordering::Relaxed);
    c.with(ctx, |s| {
        s.sends.insert(id, t.clone());
        s.peers.insert(msg.peer().0);
    });
    Some(Tag {
        ctx,
        sender: c.me,
        msg: id,
    })
}

/// AD-10: a request that carries no context may not send a tensor computed from a leaf this
/// worker received in a live context: the graph would end there without a word (backward
/// returns `Ok`, and everything the tensor reaches gets no gradient). The typical cause is a
/// call made from a bare `tokio::spawn` inside a handler, whose task has no call scope. A
/// detached tensor (no graph) and replies (a value fetched outside the context, to look at
/// it) are sent as they are. Costs nothing unless a live context on this worker has received
/// tensors; then one walk of the tensor's graph.
pub(crate) fn check_unrecorded(msg: &MessageContext, t: &Tensor) -> Result<(), String> {
    if msg.kind() != MessageKind::Request || !t.track_op() || current_context_id().is_some() {
        return Ok(());
    }
    let c = container(msg.agent());
    let leaves: HashMap<TensorId, u64> = {
        let m = c.contexts.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .flat_map(|(ctx, st)| st.recvs.keys().map(move |id| (*id, *ctx)))
            .collect()
    };
    if leaves.is_empty() {
        return Ok(());
    }
    let Some(ctx) = t
        .sorted_nodes()
        .iter()
        .find_map(|n| leaves.get(&n.id()).copied())
    else {
        return Ok(());
    };
    let agent = msg.agent();
    Err(format!(
        "a tensor computed from one `{}` received in autograd context {ctx:#x} is sent to \
         `{}` by a call that carries no autograd context, so its gradient would never flow \
         back (AD-10). Make the call inside the context: from a handler's task, spawn it \
         with `rpc_core::spawn`, not `tokio::spawn`; or send `tensor.detach()` to send its \
         value alone",
        agent.name(),
        agent.name_of(msg.peer().0),
    ))
}

pub(crate) fn record_recv(
    msg: &MessageContext,
    tag: Tag,
    t: Tensor,
) -> candle_core::Result<Tensor> {
    let c = container(msg.agent());
    let var = Var::from_tensor(&t)?;
    let leaf = var.as_tensor().clone();
    c.with(tag.ctx, |s| {
        s.recvs.insert(leaf.id(), (tag.sender, tag.msg));
        s.peers.insert(tag.sender);
    });
    Ok(leaf)
}
