//! Errors of remote references.

use rpc_core::{CodecError, RpcError};

/// Why an RRef operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RRefError {
    /// The call to the owner failed (unreachable, timeout, remote error...).
    #[error("call to the owner of {id} failed")]
    Rpc {
        /// The RRef.
        id: String,
        /// The cause, naming worker and function.
        #[source]
        source: Box<RpcError>,
    },
    /// The constructor run by `remote` failed on the owner.
    #[error("creating {id} on worker `{owner}` failed: {message}")]
    CreationFailed {
        /// The RRef.
        id: String,
        /// The owner's name.
        owner: String,
        /// The owner's error, with its chain.
        message: String,
    },
    /// `local_value` was called away from the owner.
    #[error(
        "{id} is owned by worker `{owner}`, not by `{worker}`: local_value works on the owner only"
    )]
    NotOwner {
        /// The RRef.
        id: String,
        /// The owner's name.
        owner: String,
        /// This worker's name.
        worker: String,
    },
    /// The value has another type than the handle says.
    #[error("{id} holds a `{actual}`, not a `{expected}`")]
    TypeMismatch {
        /// The RRef.
        id: String,
        /// The handle's type.
        expected: &'static str,
        /// The value's type.
        actual: &'static str,
    },
    /// The value did not become available in time (its creation is still running or lost).
    #[error("{id} was not available on worker `{owner}` within {timeout:?}")]
    Timeout {
        /// The RRef.
        id: String,
        /// The owner's name.
        owner: String,
        /// How long was waited.
        timeout: std::time::Duration,
    },
    /// The fetched value could not be decoded.
    #[error("cannot decode the value of {id}")]
    Decode {
        /// The RRef.
        id: String,
        /// The decoder's error.
        #[source]
        source: CodecError,
    },
    /// The owner failed and a new incarnation (a restarted process) took its place: the value
    /// went with the incarnation that held it.
    #[error(
        "{id} was owned by incarnation {incarnation} of worker `{owner}`, which failed and was \
         replaced by incarnation {now}: the value is gone (restore it from a checkpoint)"
    )]
    OwnerReplaced {
        /// The RRef.
        id: String,
        /// The owner's name.
        owner: String,
        /// The incarnation that held the value.
        incarnation: u64,
        /// The incarnation that holds the rank now.
        now: u64,
    },
    /// The local agent no longer exists.
    #[error("the agent of this RRef has been dropped")]
    AgentGone,
    /// An RRef was serialized or deserialized outside an RPC message.
    #[error("an RRef can only travel inside RPC arguments or results")]
    OutsideRpc,
}
