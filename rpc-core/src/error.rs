//! Error types: [`RpcError`] for calls, [`InitError`] for group formation, and the
//! serializable [`RemoteError`] that crosses the wire.
//!
//! Display strings are short and lowercase; causes live in `#[source]` so a chain printer
//! (see [`error_chain`]) shows the whole story.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// The error type handlers return. Anything that implements `std::error::Error` (including
/// `anyhow::Error` via `?`) converts into it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Longest message a remote error carries (some libraries put whole backtraces in theirs).
const MAX_MESSAGE: usize = 2048;
/// Deepest source chain a remote error carries.
const MAX_CHAIN: usize = 16;

fn bounded(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str(" … (truncated)");
    }
    s
}

/// What went wrong on the remote side of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RemoteErrorKind {
    /// No function of that name is registered on the callee.
    UnknownFunction,
    /// The caller's argument/result types differ from the callee's, or the arguments did not
    /// decode.
    TypeMismatch,
    /// The handler returned an error.
    Handler,
    /// The handler panicked. The worker keeps serving.
    Panic,
    /// The callee is shutting down and refuses new calls.
    ShuttingDown,
    /// The callee could not encode the result, or a bulk payload never arrived.
    Protocol,
    /// The callee refused the call at once: too many of the caller's calls (or their bytes)
    /// wait on it already (`Config::max_in_flight_calls`, `max_in_flight_bytes`).
    Busy,
}

impl fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::UnknownFunction => "unknown function",
            Self::TypeMismatch => "type mismatch",
            Self::Handler => "handler error",
            Self::Panic => "handler panicked",
            Self::ShuttingDown => "callee shutting down",
            Self::Protocol => "protocol error",
            Self::Busy => "callee busy",
        };
        f.write_str(s)
    }
}

/// An error produced on a remote worker, as it travels over the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    /// The category of failure.
    pub kind: RemoteErrorKind,
    /// The registered name of the function that failed.
    pub fn_name: String,
    /// The name of the worker the error happened on.
    pub worker: String,
    /// The top-level message.
    pub message: String,
    /// The `source()` chain below the message, outermost first.
    #[serde(deserialize_with = "crate::bounded::bounded::<_, _, { MAX_CHAIN + 1 }>")]
    pub chain: Vec<String>,
}

impl RemoteError {
    /// A protocol error raised by a layer above the RPC core (for instance a malformed token).
    pub fn new_protocol(fn_name: &str, worker: &str, message: impl Into<String>) -> Self {
        Self::new(RemoteErrorKind::Protocol, fn_name, worker, message)
    }

    pub(crate) fn new(
        kind: RemoteErrorKind,
        fn_name: &str,
        worker: &str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            fn_name: fn_name.to_owned(),
            worker: worker.to_owned(),
            message: bounded(message.into()),
            chain: Vec::new(),
        }
    }

    pub(crate) fn from_error(
        kind: RemoteErrorKind,
        fn_name: &str,
        worker: &str,
        err: &(dyn std::error::Error + 'static),
    ) -> Self {
        let mut chain = Vec::new();
        let mut cur = err.source();
        while let Some(e) = cur {
            if chain.len() == MAX_CHAIN {
                chain.push("…".to_owned());
                break;
            }
            chain.push(bounded(e.to_string()));
            cur = e.source();
        }
        Self {
            kind,
            fn_name: fn_name.to_owned(),
            worker: worker.to_owned(),
            message: bounded(err.to_string()),
            chain,
        }
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in `{}` on worker `{}`: {}",
            self.kind, self.fn_name, self.worker, self.message
        )?;
        for c in &self.chain {
            write!(f, ": {c}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RemoteError {}

/// The error of a remote call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The handler failed on the callee (returned an error or panicked), or the callee
    /// reported another remote failure. The [`RemoteError`] names worker, function and chain.
    #[error("remote call failed")]
    Remote(#[source] RemoteError),
    /// The callee has no function registered under that name.
    #[error("function `{fn_name}` is not registered on worker `{worker}`")]
    UnknownFunction {
        /// Callee name.
        worker: String,
        /// Requested function name.
        fn_name: String,
    },
    /// Caller and callee disagree on the function's argument or result types.
    #[error("type mismatch calling `{fn_name}` on worker `{worker}`: {detail}")]
    TypeMismatch {
        /// The worker on which the mismatch was detected.
        worker: String,
        /// Function name.
        fn_name: String,
        /// Both sides' signatures, or the decoding error.
        detail: String,
    },
    /// The call did not complete within its deadline.
    #[error("call to `{fn_name}` on worker `{worker}` exceeded its deadline of {timeout:?}")]
    DeadlineExceeded {
        /// Callee name.
        worker: String,
        /// Function name.
        fn_name: String,
        /// The timeout that applied (possibly inherited from an enclosing call).
        timeout: Duration,
    },
    /// No connection to the peer could be established.
    #[error("worker `{worker}` at {addr} is unreachable")]
    Unreachable {
        /// Callee name.
        worker: String,
        /// The address that was dialled.
        addr: String,
        /// Why connecting failed.
        #[source]
        source: std::io::Error,
    },
    /// The peer was declared failed by the failure detector (frozen, hung, cut off, or its
    /// process gone): every call to it, and every wait on it, ends with this.
    #[error("worker `{worker}` failed, so `{fn_name}` cannot complete: {cause}")]
    PeerFailed {
        /// The failed worker.
        worker: String,
        /// The function called (or the operation waited for).
        fn_name: String,
        /// Why it was declared failed.
        cause: String,
    },
    /// The peer left the running group gracefully ([`Agent::leave`](crate::Agent::leave)):
    /// calls to it are refused.
    #[error("worker `{worker}` left the group, so `{fn_name}` cannot be called on it")]
    PeerLeft {
        /// The worker that left.
        worker: String,
        /// The function called.
        fn_name: String,
    },
    /// The callee shut down (it told the group so, with the rest of a group's shutdown or
    /// when its own shutdown gave up waiting) and no longer serves: a call to it found its
    /// connection closed. A worker that only serves should wait for the whole group with
    /// [`Agent::wait_for_group`](crate::Agent::wait_for_group).
    #[error(
        "worker `{worker}` has shut down (it said so before closing), so `{fn_name}` cannot be \
         called on it"
    )]
    PeerShutDown {
        /// The worker that shut down.
        worker: String,
        /// The function called.
        fn_name: String,
    },
    /// This worker is stopping on a signal (see
    /// [`Config::signal_grace`](crate::Config::signal_grace)): a launcher stops every process
    /// of a group once one has failed, so the call was not made.
    #[error(
        "worker `{worker}` is stopping on {signal} (its launcher stops the group once a process \
         has failed), so `{fn_name}` was not called"
    )]
    Stopped {
        /// This worker's name.
        worker: String,
        /// The function that was to be called.
        fn_name: String,
        /// The signal's name.
        signal: String,
    },
    /// The connection to the callee closed while the call was in flight.
    #[error("connection to worker `{worker}` closed during call to `{fn_name}`")]
    ConnectionLost {
        /// Callee name.
        worker: String,
        /// Function name.
        fn_name: String,
    },
    /// The peer refused the call because it is shutting down.
    #[error("worker `{worker}` is shutting down and refused `{fn_name}`")]
    PeerShuttingDown {
        /// Callee name.
        worker: String,
        /// Function name.
        fn_name: String,
    },
    /// This agent has been shut down; no further calls are possible.
    #[error("agent `{worker}` is shut down; cannot call `{fn_name}`")]
    Shutdown {
        /// This worker's name.
        worker: String,
        /// Function name.
        fn_name: String,
    },
    /// The target named no worker of this group.
    #[error("no worker {target} in this group of {world_size}")]
    UnknownWorker {
        /// The name or rank given.
        target: String,
        /// The group's size.
        world_size: usize,
    },
    /// The arguments (or result) could not be encoded.
    #[error("cannot encode {what} of `{fn_name}`")]
    Encode {
        /// "arguments" or "result".
        what: &'static str,
        /// Function name.
        fn_name: String,
        /// The serializer's error.
        #[source]
        source: bincode::Error,
    },
    /// The encoded request is larger than the frame limit.
    #[error("request to `{fn_name}` is {size} bytes, above the frame limit of {limit} bytes")]
    TooLarge {
        /// Function name.
        fn_name: String,
        /// Encoded size.
        size: usize,
        /// Configured limit.
        limit: usize,
    },
    /// `rpc_sync` was called where it cannot block.
    #[error("rpc_sync cannot block here: {reason}; use rpc_async(..).await")]
    CannotBlock {
        /// Why blocking is impossible.
        reason: &'static str,
    },
    /// A transport-level failure not covered above.
    #[error("transport failure talking to worker `{worker}`")]
    Transport {
        /// Peer name.
        worker: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
}

impl RpcError {
    /// The remote error, if the failure happened on the callee.
    pub fn as_remote(&self) -> Option<&RemoteError> {
        match self {
            Self::Remote(r) => Some(r),
            _ => None,
        }
    }
}

/// The error of forming a group ([`crate::init`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The configuration is incomplete or inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// No shared secret was configured.
    #[error("no group secret: set {env} or {file_env} (or Config::secret)")]
    MissingSecret {
        /// The env var holding the secret.
        env: &'static str,
        /// The env var naming a file holding the secret.
        file_env: &'static str,
    },
    /// Reading the secret file failed.
    #[error("cannot read secret file {path}")]
    SecretFile {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Binding the worker's listener failed.
    #[error("cannot bind {addr}")]
    Bind {
        /// Requested address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The rendezvous could not be reached before the deadline.
    #[error("rendezvous at {addr} unreachable within {timeout:?}")]
    RendezvousUnreachable {
        /// Rendezvous address.
        addr: String,
        /// The init timeout.
        timeout: Duration,
        /// The last connection error.
        #[source]
        source: std::io::Error,
    },
    /// Not every rank joined before the deadline.
    #[error("rendezvous timed out after {timeout:?}: ranks {missing:?} never arrived")]
    RendezvousTimeout {
        /// Ranks that never joined.
        missing: Vec<u32>,
        /// The init timeout.
        timeout: Duration,
    },
    /// The rendezvous refused this worker (duplicate name or rank, world size disagreement).
    #[error("rendezvous refused worker: {0}")]
    Refused(String),
    /// The job whose rendezvous this is has ended (RDV-10): nothing is left to join.
    #[error("the job of the rendezvous at {addr} has ended: nothing is left to join")]
    JobEnded {
        /// Rendezvous address.
        addr: String,
    },
    /// Authentication with the rendezvous failed.
    #[error("authentication with rendezvous at {addr} failed")]
    Auth {
        /// Rendezvous address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A protocol or I/O error talking to the rendezvous.
    #[error("rendezvous protocol error with {addr}")]
    Rendezvous {
        /// Rendezvous address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// A value could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[error("cannot encode or decode a payload")]
pub struct CodecError(#[source] pub(crate) bincode::Error);

/// Renders an error and its whole `source()` chain on one line, separated by `: `. A cause
/// whose text the line already ends with is said once: an error that prints its source in
/// its own message and also returns it as its `source()` (`#[error("I/O error: {0}")]` with
/// `#[from]`, as `safetensors` and others do) would otherwise repeat it.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut s = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let said = e.to_string();
        if !s.ends_with(&said) {
            s.push_str(": ");
            s.push_str(&said);
        }
        cur = e.source();
    }
    s
}

#[cfg(test)]
mod chain_tests {
    /// An error whose message holds its source, which it also returns as its source.
    #[derive(Debug, thiserror::Error)]
    enum Saving {
        #[error("I/O error: {0}")]
        Io(#[from] std::io::Error),
    }

    /// Wraps a cause with a message of its own (as `anyhow`'s context does).
    #[derive(Debug, thiserror::Error)]
    #[error("cannot write the checkpoint ckpt-10")]
    struct Checkpoint(#[source] Saving);

    /// Each cause once: "No space left on device" appeared twice, as "I/O error: No space
    /// left on device (os error 28): No space left on device (os error 28)".
    #[test]
    fn a_cause_its_parent_already_says_is_said_once() {
        let io = std::io::Error::from_raw_os_error(28);
        let said = super::error_chain(&Checkpoint(Saving::Io(io)));
        assert_eq!(
            said,
            "cannot write the checkpoint ckpt-10: I/O error: No space left on device (os error 28)"
        );
        let io = std::io::Error::other("disk gone");
        assert_eq!(
            super::error_chain(&Checkpoint(Saving::Io(io)))
                .matches("disk gone")
                .count(),
            1
        );
    }
}

/// Why [`Agent::leave`](crate::Agent::leave) could not leave the running group.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaveError {
    /// Rank 0 hosts the group's shutdown barrier: it leaves with the whole group.
    #[error(
        "rank 0 (`{worker}`) cannot leave the running group: it hosts the group's shutdown \
         barrier; shut the group down instead"
    )]
    RankZero {
        /// This worker's name.
        worker: String,
    },
    /// The rendezvous, which tells the group, cannot be reached.
    #[error(
        "worker `{worker}` cannot leave gracefully: it lost its connection to the rendezvous, \
         which tells the group"
    )]
    NoRendezvous {
        /// This worker's name.
        worker: String,
    },
    /// The rendezvous did not confirm the leave in time.
    #[error("the rendezvous did not confirm within {timeout:?} that `{worker}` left")]
    Unconfirmed {
        /// This worker's name.
        worker: String,
        /// How long was waited.
        timeout: Duration,
    },
    /// Shutdown (or a leave) already began.
    #[error("worker `{worker}` is already shutting down")]
    ShuttingDown {
        /// This worker's name.
        worker: String,
    },
}
