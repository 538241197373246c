//! What travels on the control connection: worker identity, the call envelope and its reply.
//!
//! An envelope carries the function's stable name, a signature fingerprint (so argument and
//! result type mismatches are detected instead of decoding garbage), the nesting
//! depth, the serde payload, and a side table of [`Blob`](crate::Blob)s. Blobs above the bulk
//! threshold do not ride in the envelope at all: the envelope names them by id and their bytes
//! travel on the bulk connection (see `net/bulk.rs`). On the wire both are the message of a tarpc
//! frame (`net/frame/`); the deadline travels as a relative duration in tarpc's request
//! context. [`CallMeta`], the metadata layers above attach to calls, travels in the envelope.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::bounded::{bounded, MAX_BLOBS, MAX_META};

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
    #[serde(deserialize_with = "bounded::<_, _, MAX_BLOBS>")]
    pub blobs: Vec<WireBlob>,
    /// Keep the result on the callee and hand it to this sink instead of returning it.
    pub keep: Option<KeepTarget>,
    /// The caller's call metadata.
    pub meta: CallMeta,
    /// Set when the caller cancels this call by message (`call/cancel.rs`).
    pub cancel_id: Option<u64>,
    /// The call's flow id when the caller traces (TR-3): the callee's span carries it too.
    pub trace: Option<u64>,
}

/// Where a keep-call's result goes on the callee.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct KeepTarget {
    /// Borrowed when sent (sink names are static), owned when received.
    pub sink: std::borrow::Cow<'static, str>,
    #[serde(with = "serde_bytes")]
    pub token: Vec<u8>,
}

/// Per-call metadata that layers above the RPC core attach to calls (for instance the
/// distributed autograd context id). Set it with [`with_call_meta`](crate::ext::with_call_meta);
/// every call made inside carries it, and the callee's handler (with its argument decoding, its
/// nested calls and its reply encoding) runs with it, so it follows chains of calls in both
/// directions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallMeta(
    #[serde(deserialize_with = "bounded::<_, _, MAX_META>")] Vec<(String, Vec<u8>)>,
);

impl CallMeta {
    /// The value of `key`, if set.
    pub(crate) fn get(&self, key: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    /// A copy with `key` set to `value` (unchanged, with a warning, if it already holds the
    /// most keys a receiver accepts).
    pub(crate) fn with(&self, key: &str, value: Vec<u8>) -> Self {
        let mut m = self.clone();
        let full = m.0.len() >= MAX_META;
        match m.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None if full => {
                tracing::warn!(key, limit = MAX_META, "call metadata full; key not added");
            }
            None => m.0.push((key.to_owned(), value)),
        }
        m
    }

    /// Whether no key is set.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A copy without `key`.
    pub(crate) fn without(&self, key: &str) -> Self {
        Self(self.0.iter().filter(|(k, _)| k != key).cloned().collect())
    }
}

/// A successful reply.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallOk {
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    #[serde(deserialize_with = "bounded::<_, _, MAX_BLOBS>")]
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
