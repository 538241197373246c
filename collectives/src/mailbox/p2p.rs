//! Point-to-point messages between workers: [`send`] and [`recv`] matched by (source, tag),
//! and their background forms.

use candle_core::Tensor;
use rpc_core::{Agent, ToWorker};
use std::time::Duration;

use super::{mailbox, send_tagged, Body, Header, Tag, P2P};

/// Why a point-to-point operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// The message could not be delivered.
    #[error("send to worker `{worker}` failed")]
    Send {
        /// The receiver.
        worker: String,
        /// The cause.
        #[source]
        source: Box<rpc_core::RpcError>,
    },
    /// No message arrived in time, or the operation was aborted.
    #[error("receive failed: {0}")]
    Recv(String),
    /// The sender was declared failed (COL-2).
    #[error("receive failed: worker `{worker}` failed: {cause}")]
    PeerFailed {
        /// The failed worker.
        worker: String,
        /// Why it was declared failed.
        cause: String,
    },
    /// The background task failed.
    #[error("the operation's task failed: {0}")]
    Task(String),
}

fn header(t: &Tensor) -> Header {
    Header::of(t)
}

fn rank_of(agent: &Agent, w: impl ToWorker) -> Result<u32, P2pError> {
    agent
        .get_worker_info(w)
        .map(|i| i.id.0)
        .map_err(|e| P2pError::Recv(e.to_string()))
}

/// Sends `t` to `to` under `tag`; returns once it is in the receiver's mailbox.
pub async fn send(agent: &Agent, to: impl ToWorker, tag: u64, t: &Tensor) -> Result<(), P2pError> {
    let to = agent
        .get_worker_info(&to)
        .map_err(|e| P2pError::Send {
            worker: agent.name_of(&to),
            source: Box::new(e),
        })?
        .id
        .0;
    send_tagged(
        agent,
        to,
        Tag {
            group: P2P,
            seq: tag,
            step: 0,
        },
        header(t),
        t.clone(),
    )
    .await
}

/// Receives the next tensor `from` sent under `tag` (within the group's call timeout).
pub async fn recv(agent: &Agent, from: impl ToWorker, tag: u64) -> Result<Tensor, P2pError> {
    let from = rank_of(agent, from)?;
    let timeout = effective_timeout(agent);
    let tag = Tag {
        group: P2P,
        seq: tag,
        step: 0,
    };
    match mailbox(agent).take(from, tag, timeout).await {
        Ok((_, Body::Tensor(t))) => Ok(t),
        Ok((_, Body::Raw(_))) => Err(P2pError::Recv(
            "got raw elements where a tensor was expected".into(),
        )),
        Err(e) => Err(e.into()),
    }
}

/// How long a receive waits: [`Agent::wait_bound`].
pub(crate) fn effective_timeout(agent: &Agent) -> Duration {
    agent.wait_bound()
}

/// A running operation; `wait` for its result.
#[must_use = "an operation's outcome is only known by waiting for it"]
pub struct Handle<T>(tokio::task::JoinHandle<Result<T, P2pError>>);

impl<T> Handle<T> {
    /// Waits for the operation.
    pub async fn wait(self) -> Result<T, P2pError> {
        self.0.await.map_err(|e| P2pError::Task(e.to_string()))?
    }
}

/// Non-blocking [`send`].
pub fn isend(agent: &Agent, to: u32, tag: u64, t: &Tensor) -> Handle<()> {
    let (a, t) = (agent.clone(), t.clone());
    Handle(
        rpc_core::CallScope::current()
            .spawn_on(agent.runtime(), async move { send(&a, to, tag, &t).await }),
    )
}

/// Non-blocking [`recv`].
pub fn irecv(agent: &Agent, from: u32, tag: u64) -> Handle<Tensor> {
    let a = agent.clone();
    Handle(
        rpc_core::CallScope::current()
            .spawn_on(agent.runtime(), async move { recv(&a, from, tag).await }),
    )
}
