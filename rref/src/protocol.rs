//! The protocol's messages, served like any registered function (`install` adds them).

use rpc_core::ext::{KeepSink, KeptValue, MessageContext, MessageKind, Payload};
use rpc_core::{BoxError, CallContext, RemoteError, RemoteFn};
use std::sync::Arc;
use std::time::Instant;

use crate::context::{ctx, Settled};
use crate::id::{ForkId, RRefId};

/// The keep sink that stores `remote` results on the owner.
pub(crate) const KEEP_SINK: &str = "rref::keep";

/// Receiver → owner: register a child fork; the owner then releases the parent's hold.
pub(crate) struct AddFork;

impl RemoteFn for AddFork {
    const NAME: &'static str = "rref::add_fork";
    type Args = (RRefId, ForkId, u32);
    type Output = ();
    async fn call(
        cx: CallContext,
        (id, child, parent): (RRefId, ForkId, u32),
    ) -> Result<(), BoxError> {
        let agent = cx.agent().clone();
        let c = ctx(&agent);
        c.owner_add_from_peer(id, child, 1, cx.caller().id.0)?;
        if parent == c.me {
            c.release_child(child);
        } else {
            let a = agent.clone();
            c.background(&agent, async move {
                if let Err(e) = a.rpc_async(parent, ChildAccepted, (child,)).await {
                    tracing::debug!(
                        %child, cause = %rpc_core::error_chain(&e), "child acceptance not delivered"
                    );
                }
            });
        }
        Ok(())
    }
}

/// Owner → parent: the child fork is registered; drop the hold on the parent.
pub(crate) struct ChildAccepted;

impl RemoteFn for ChildAccepted {
    const NAME: &'static str = "rref::child_accepted";
    type Args = (ForkId,);
    type Output = ();
    async fn call(cx: CallContext, (child,): (ForkId,)) -> Result<(), BoxError> {
        ctx(cx.agent()).release_child(child);
        Ok(())
    }
}

/// User → owner: a fork was deleted.
pub(crate) struct DeleteFork;

impl RemoteFn for DeleteFork {
    const NAME: &'static str = "rref::delete_fork";
    type Args = (RRefId, ForkId);
    type Output = ();
    async fn call(cx: CallContext, (id, fork): (RRefId, ForkId)) -> Result<(), BoxError> {
        ctx(cx.agent()).owner_add_from_peer(id, fork, -1, cx.caller().id.0)?;
        Ok(())
    }
}

/// User → owner: a copy of the value (`Err` carries the constructor's failure).
pub(crate) struct Fetch;

impl RemoteFn for Fetch {
    const NAME: &'static str = "rref::fetch";
    type Args = (RRefId,);
    type Output = Result<Payload, String>;
    async fn call(cx: CallContext, (id,): (RRefId,)) -> Result<Result<Payload, String>, BoxError> {
        let agent = cx.agent().clone();
        let c = ctx(&agent);
        c.may_wait_for(id)?;
        let deadline = cx
            .deadline()
            .unwrap_or_else(|| Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600));
        let v = match c.settled(id, deadline).await {
            Ok(v) => v,
            Err(Settled::Failed(message)) => return Ok(Err(message)),
            Err(Settled::Timeout) => {
                return Err(format!(
                    "{id} is not available on this worker (never created, or already deleted)"
                )
                .into())
            }
        };
        let guard = v.lock().await;
        let msg = MessageContext::new(agent.clone(), cx.caller().id, MessageKind::Reply);
        Ok(Ok(guard.encode(Some(msg))?))
    }
}

/// Encodes the `(id, fork)` of a keep-call.
pub(crate) fn token(id: RRefId, fork: ForkId) -> Vec<u8> {
    let mut t = Vec::with_capacity(24);
    t.extend_from_slice(&id.created_on.to_le_bytes());
    t.extend_from_slice(&id.local.to_le_bytes());
    t.extend_from_slice(&fork.created_on.to_le_bytes());
    t.extend_from_slice(&fork.local.to_le_bytes());
    t
}

fn untoken(t: &[u8]) -> Option<(RRefId, ForkId)> {
    if t.len() != 24 {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(t[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(t[i..i + 8].try_into().expect("8 bytes"));
    Some((
        RRefId {
            created_on: u32_at(0),
            local: u64_at(4),
        },
        ForkId {
            created_on: u32_at(12),
            local: u64_at(16),
        },
    ))
}

/// Stores the result of a `remote` constructor under its id and counts the creator's fork.
pub(crate) fn keep_sink() -> KeepSink {
    Arc::new(
        |cx: CallContext, token: Vec<u8>, result: Result<KeptValue, RemoteError>| {
            let Some((id, fork)) = untoken(&token) else {
                return Err(RemoteError::new_protocol(
                    KEEP_SINK,
                    cx.agent().name(),
                    "malformed rref token",
                ));
            };
            let c = ctx(cx.agent());
            let outcome = {
                let mut t = c.owner.lock().unwrap_or_else(|p| p.into_inner());
                let added = t.add(id, fork, 1, cx.caller().id.0);
                let set = t.set(id, result);
                (added, set)
            };
            if outcome.1.is_err() {
                tracing::warn!(
                    %id, "a value came for an id already given up (OWN-3/OWN-6); dropped"
                );
            }
            drop(outcome);
            Ok(())
        },
    )
}
