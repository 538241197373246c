//! Why a call got no reply, as the network layer sees it: one vocabulary for the multiplexed
//! and the blocking connection, mapped to [`RpcError`](crate::RpcError) in one place (the
//! caller's `call/reply.rs`).

use std::io;

/// Why a request got no reply from its connection.
#[derive(Debug)]
pub(crate) enum CallFailed {
    /// The request was not written: the callee cannot have read it. `broken`: because the
    /// connection has ended (else the request itself could not be encoded or is too large).
    NotSent { cause: io::Error, broken: bool },
    /// The connection ended (or carried garbage) after the request was written: the callee
    /// may have run it.
    Lost(io::Error),
    /// The callee refused the request with tarpc's error.
    Refused(tarpc::ServerError),
    /// The caller's deadline passed while writing or waiting (blocking connections; the
    /// multiplexed caller times its wait itself).
    Deadline,
    /// This worker closed while waiting (blocking connections).
    Closed,
}

impl CallFailed {
    /// The connection has ended: nothing more can be sent on it.
    pub(crate) fn closed_connection() -> Self {
        Self::NotSent {
            cause: io::Error::new(io::ErrorKind::NotConnected, "the connection has ended"),
            broken: true,
        }
    }

    /// Whether the connection this call went on is unusable from now on.
    pub(crate) fn broke_connection(&self) -> bool {
        matches!(self, Self::Lost(_) | Self::NotSent { broken: true, .. })
    }
}
