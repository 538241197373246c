//! The state behind every clone of one [`RRef`](crate::RRef) on one worker: one fork of the
//! value, where it stands with its owner, and the delete its drop sends (G1).

use rpc_core::RpcError;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::context::Ctx;
use crate::id::{ForkId, RRefId};
use crate::protocol::DeleteFork;

/// Where a handle stands with its owner.
#[derive(Clone, Debug)]
pub(crate) enum HState {
    Confirmed,
    Unconfirmed,
    /// The constructor failed on the owner (which keeps the failure).
    Failed(String),
    /// The creating call never reached the owner: there is nothing to delete.
    Lost(String),
}

/// The state shared by all clones of one handle: one fork.
pub(crate) struct Handle {
    pub ctx: Arc<Ctx>,
    pub id: RRefId,
    pub fork: ForkId,
    pub owner: u32,
    /// The owner's incarnation when the value was made: once another incarnation holds the
    /// owner's rank, the value is gone.
    pub owner_incarnation: u64,
    /// Made by `remote`: the owner registers this fork together with the value.
    pub creator: bool,
    state: Mutex<HState>,
}

impl Handle {
    pub(crate) fn new(
        ctx: &Arc<Ctx>,
        id: RRefId,
        fork: ForkId,
        owner: (u32, u64),
        state: HState,
    ) -> Arc<Self> {
        Self::with_creator(ctx, id, fork, owner, state, false)
    }

    pub(crate) fn with_creator(
        ctx: &Arc<Ctx>,
        id: RRefId,
        fork: ForkId,
        (owner, owner_incarnation): (u32, u64),
        state: HState,
        creator: bool,
    ) -> Arc<Self> {
        if owner != ctx.me {
            ctx.user_refs.fetch_add(1, Ordering::AcqRel);
        }
        if matches!(state, HState::Unconfirmed) {
            ctx.unconfirmed.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(Self {
            ctx: ctx.clone(),
            id,
            fork,
            owner,
            owner_incarnation,
            creator,
            state: Mutex::new(state),
        })
    }

    /// The incarnation that holds the owner's rank now, if it is not the one that made the
    /// value (the owner failed and was replaced: the value is gone).
    pub(crate) fn owner_replaced(&self, agent: &rpc_core::Agent) -> Option<u64> {
        let now = agent.incarnation_of(self.owner).ok()?;
        (now != self.owner_incarnation).then_some(now)
    }

    pub(crate) fn state(&self) -> HState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records the owner's answer to this handle's creation or registration.
    pub(crate) fn settle(&self, outcome: Result<(), RpcError>) {
        let next = match outcome {
            Ok(()) => HState::Confirmed,
            Err(e) => {
                let text = rpc_core::error_chain(&e);
                match e {
                    RpcError::Remote(r) => HState::Failed(r.to_string()),
                    RpcError::Unreachable { .. }
                    | RpcError::Encode { .. }
                    | RpcError::TooLarge { .. }
                    | RpcError::Shutdown { .. }
                    | RpcError::UnknownWorker { .. }
                    | RpcError::UnknownFunction { .. }
                    | RpcError::TypeMismatch { .. }
                    | RpcError::PeerShuttingDown { .. } => HState::Lost(text),
                    _ => HState::Failed(text),
                }
            }
        };
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Only the first answer counts (a successful fetch may have confirmed us already).
        if matches!(*s, HState::Unconfirmed) {
            self.ctx.unconfirmed.fetch_sub(1, Ordering::AcqRel);
            *s = next;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let c = &self.ctx;
        if self.owner != c.me {
            c.user_refs.fetch_sub(1, Ordering::AcqRel);
        }
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if matches!(state, HState::Unconfirmed) {
            c.unconfirmed.fetch_sub(1, Ordering::AcqRel);
        }
        if matches!(state, HState::Lost(_)) {
            return;
        }
        if self.owner == c.me {
            c.owner_add(self.id, self.fork, -1, c.me);
            return;
        }
        // G1: tell the owner. Never block in drop: the message goes from a background task.
        let Some(agent) = c.agent.upgrade() else {
            return;
        };
        if self.owner_replaced(&agent).is_some() {
            return; // its value went with the incarnation that owned it
        }
        let (owner, id, fork) = (self.owner, self.id, self.fork);
        let a = agent.clone();
        c.background(&agent, async move {
            if let Err(e) = a.rpc_async(owner, DeleteFork, (id, fork)).await {
                tracing::debug!(%id, cause = %rpc_core::error_chain(&e), "delete of a fork failed");
            }
        });
    }
}
