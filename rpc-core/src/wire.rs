//! What travels on the control connection: worker identity, the call envelope and its reply.
//!
//! An envelope carries the function's stable name, a signature fingerprint (so argument and
//! result type mismatches are detected instead of decoding garbage), the nesting
//! depth, the serde payload, and a side table of [`Blob`](crate::Blob)s. Blobs above the bulk
//! threshold do not ride in the envelope at all: the envelope names them by id and their bytes
//! travel on the bulk connection (see `bulk.rs`). On the wire both are the message of a tarpc
//! frame (`mux.rs`, `direct.rs`); the deadline travels as a relative duration in tarpc's
//! request context.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::error::RemoteError;

/// A worker's id: its rank in the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId(pub u32);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// A worker's identity: unique name and rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's unique name within the group.
    pub name: String,
    /// The worker's rank.
    pub id: WorkerId,
}

/// One entry of an envelope's blob side table.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireBlob {
    /// Small blobs ride inside the envelope.
    Inline(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Large blobs travel on the sender's bulk connection under this id.
    Bulk { id: u64, len: u64 },
}

/// A call request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallRequest {
    /// Borrowed from the function's `NAME` when sent, owned when received.
    pub fn_name: std::borrow::Cow<'static, str>,
    pub sig: u64,
    pub depth: u32,
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    pub blobs: Vec<WireBlob>,
    /// Keep the result on the callee and hand it to this sink instead of returning it.
    pub keep: Option<KeepTarget>,
    /// The caller's call metadata (see `context::CallMeta`).
    pub meta: crate::context::CallMeta,
    /// Set when the caller cancels this call by message (`cancel.rs`).
    pub cancel_id: Option<u64>,
}

/// Where a keep-call's result goes on the callee.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct KeepTarget {
    /// Borrowed when sent (sink names are static), owned when received.
    pub sink: std::borrow::Cow<'static, str>,
    #[serde(with = "serde_bytes")]
    pub token: Vec<u8>,
}

/// A successful reply.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallOk {
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    pub blobs: Vec<WireBlob>,
}

/// What the callee sends back.
pub(crate) type CallReply = Result<CallOk, RemoteError>;

/// FNV-1a over the argument and result type names: a fingerprint that is identical across
/// processes built from the same source by the same compiler.
pub(crate) fn signature(args: &str, output: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in args.bytes().chain([0u8]).chain(output.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_distinguishes_args_from_output() {
        assert_ne!(signature("i32", "u8"), signature("i32u8", ""));
        assert_ne!(
            signature("(i32, i32)", "i32"),
            signature("(i32, i64)", "i32")
        );
        assert_eq!(signature("a", "b"), signature("a", "b"));
    }
}
