//! Recording the autograd graph across calls: the per-worker state of every distributed
//! autograd context, and the send and recv functions the tensor codec records as tensors
//! cross workers inside a context (the hooks `tensor.rs` calls while encoding and decoding).
//! `engine.rs` runs backward over what is recorded here.

use candle_core::{Tensor, TensorId, Var};
use rpc_core::ext::{AgentExt, MessageContext};
use rpc_core::Agent;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
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
    pub next_ctx: AtomicU64,
    next_msg: AtomicU64,
    pub contexts: Mutex<HashMap<u64, CtxState>>,
}

/// The autograd state of `agent`'s worker (created on first use).
pub(crate) fn container(agent: &Agent) -> Arc<Container> {
    let mut created = false;
    let c = agent.extension(|| {
        created = true;
        Container {
            me: agent.rank(),
            next_ctx: AtomicU64::new(1),
            next_msg: AtomicU64::new(1),
            contexts: Mutex::new(HashMap::new()),
        }
    });
    if created {
        // AD-7: the contexts a failed worker started are released here.
        let weak = Arc::downgrade(&c);
        agent.on_worker_failed(move |f| {
            if let Some(c) = weak.upgrade() {
                c.release_started_by(f.rank);
            }
        });
    }
    c
}

impl Container {
    /// Drops the state of every context worker `rank` started (its id's top 16 bits), once
    /// `rank` was declared failed: nobody will release them.
    fn release_started_by(&self, rank: u32) {
        let dropped: Vec<CtxState> = {
            let mut m = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<u64> = m
                .keys()
                .copied()
                .filter(|id| id >> 48 == u64::from(rank))
                .collect();
            ids.into_iter().filter_map(|id| m.remove(&id)).collect()
        };
        if !dropped.is_empty() {
            tracing::info!(
                rank,
                contexts = dropped.len(),
                "released the autograd contexts of a failed worker"
            );
        }
    }

    /// Runs `f` on context `ctx`'s state (created if new).
    pub(crate) fn with<R>(&self, ctx: u64, f: impl FnOnce(&mut CtxState) -> R) -> R {
        let mut m = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry(ctx).or_default())
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
