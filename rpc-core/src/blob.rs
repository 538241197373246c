//! [`Blob`]: bytes that travel beside the serde payload, never through it.
//!
//! While a message is encoded, every `Blob` inside the arguments or result (at any depth:
//! nested in structs, vectors, options) pushes a reference-counted handle to its bytes into a
//! side table and writes only its index into the payload. The receiver rebuilds the table first
//! (inline bytes from the envelope, large ones from the bulk connection) and each `Blob`
//! deserializes by taking its entry: no element-wise serde and no copy of the bytes on either
//! side beyond the socket. This is the hook the tensor layer builds on.
//!
//! Outside an RPC encode/decode (say, `serde_json::to_string(&blob)`), a `Blob` serializes as
//! plain bytes.

use bytes::Bytes;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::ser::{self, Serializer};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::fmt;
use std::ops::Deref;

use crate::error::CodecError;
use crate::state::{Agent, Inner, MessageContext, MessageKind};
use crate::wire::WorkerId;

/// An immutable, cheaply cloneable byte buffer that crosses RPCs on the fastest path.
///
/// ```
/// use rpc_core::Blob;
/// let b = Blob::from(vec![1u8, 2, 3]);
/// assert_eq!(&b[..], &[1, 2, 3]);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Blob(Bytes);

impl Blob {
    /// Wraps bytes without copying them.
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    /// The underlying bytes handle.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// Unwraps the bytes handle.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        Self(Bytes::from(v))
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Self {
        Self(b)
    }
}

impl From<&'static [u8]> for Blob {
    fn from(b: &'static [u8]) -> Self {
        Self(Bytes::from_static(b))
    }
}

impl fmt::Debug for MessageContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageContext")
            .field("worker", &self.agent.name())
            .field("peer", &self.peer)
            .field("kind", &self.kind)
            .finish()
    }
}

impl MessageContext {
    /// A context for encoding to, or decoding from, `peer`.
    pub fn new(agent: Agent, peer: WorkerId, kind: MessageKind) -> Self {
        Self { agent, peer, kind }
    }

    /// [`MessageContext::new`] for the worker `w`.
    pub(crate) fn for_worker(w: &std::sync::Arc<Inner>, peer: WorkerId, kind: MessageKind) -> Self {
        Self::new(
            Agent {
                inner: std::sync::Arc::clone(w),
            },
            peer,
            kind,
        )
    }

    /// The context of the message being encoded or decoded on this thread, if any.
    pub fn current() -> Option<Self> {
        MESSAGE.with(|m| m.borrow().clone())
    }

    /// The local agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The worker the message goes to (encoding) or comes from (decoding).
    pub fn peer(&self) -> WorkerId {
        self.peer
    }

    /// Request or reply.
    pub fn kind(&self) -> MessageKind {
        self.kind
    }

    /// Registers `f` to run if this request turns out never to have been decoded by its
    /// receiver: it failed before it was sent, or the callee refused it before reading its
    /// arguments (unknown function, signature mismatch, shutting down). A value that lends
    /// something for the message's journey (a remote reference holding its fork until the
    /// receiver has registered its own) takes it back here instead of waiting for an answer
    /// that will never come. Where the outcome stays unknown (the connection broke after
    /// sending, the deadline passed) `f` is dropped without running. Outside the encoding of
    /// a request, `f` is dropped at once.
    pub fn on_undelivered(&self, f: impl FnOnce() + Send + 'static) {
        LENT.with(|u| {
            if let Some(lent) = u.borrow_mut().as_mut() {
                lent.undelivered.push(Box::new(f));
            }
        });
    }

    /// Registers `f` to run once the receiver has answered this request, whatever the answer
    /// (a result or an error), or it is known never to have been decoded. Returns whether it
    /// was registered: only while a request's own arguments are being encoded (not inside a
    /// [`Payload`], which its receiver may decode after answering). Where the outcome stays
    /// unknown (the connection broke, the deadline passed) `f` is dropped without running.
    pub fn on_answered(&self, f: impl FnOnce() + Send + 'static) -> bool {
        LENT.with(|u| match u.borrow_mut().as_mut() {
            Some(lent) if lent.opaque == 0 => {
                lent.answered.push(Box::new(f));
                true
            }
            _ => false,
        })
    }
}

/// What a request's values lent for its journey: work to run when it is known never to have
/// been decoded, and when it has been answered (see [`MessageContext::on_undelivered`],
/// [`MessageContext::on_answered`]).
#[derive(Default)]
pub(crate) struct Lent {
    undelivered: Vec<Box<dyn FnOnce() + Send>>,
    answered: Vec<Box<dyn FnOnce() + Send>>,
    /// Depth of [`Payload`]s being encoded inside the request.
    opaque: u32,
}

impl Lent {
    /// The receiver certainly never read the arguments.
    pub(crate) fn never_decoded(self) {
        for f in self.undelivered.into_iter().chain(self.answered) {
            f();
        }
    }

    /// The receiver answered after reading the arguments.
    pub(crate) fn answered(self) {
        for f in self.answered {
            f();
        }
    }
}

/// A value encoded for the wire together with its blobs. Lets a layer above the RPC core ship a
/// value whose type only the receiver names (for instance a remote reference's `to_here`): the
/// sender encodes it into a `Payload`, which travels like any other argument or result (its
/// blobs on the bulk path), and the receiver decodes the type it expects.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Payload {
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
    blobs: Vec<Blob>,
}

impl Payload {
    /// Encodes `value` as a message to `ctx.peer()` would be.
    pub fn encode<T: Serialize + ?Sized>(
        value: &T,
        ctx: Option<MessageContext>,
    ) -> Result<Self, CodecError> {
        encode_opaque(value, ctx).map(Self::from_encoded)
    }

    /// A payload of encoded bytes and their side table.
    pub(crate) fn from_encoded((bytes, blobs): crate::state::Encoded) -> Self {
        Self {
            bytes,
            blobs: blobs.into_iter().map(Blob).collect(),
        }
    }

    /// Decodes a `T`, as a message from `ctx.peer()` would be.
    pub fn decode<T: DeserializeOwned>(self, ctx: Option<MessageContext>) -> Result<T, CodecError> {
        decode(
            &self.bytes,
            self.blobs.into_iter().map(Blob::into_bytes).collect(),
            ctx,
        )
        .map_err(CodecError)
    }
}

/// Encodes `value` as a message to `ctx.peer()` would be, opaque to the request that may
/// carry it: its receiver may decode it long after answering that request, so no value inside
/// may count on the answer (see `MessageContext::on_answered`).
pub(crate) fn encode_opaque<T: Serialize + ?Sized>(
    value: &T,
    ctx: Option<MessageContext>,
) -> Result<crate::state::Encoded, CodecError> {
    LENT.with(|u| {
        if let Some(lent) = u.borrow_mut().as_mut() {
            lent.opaque += 1;
        }
    });
    let out = encode(value, ctx);
    LENT.with(|u| {
        if let Some(lent) = u.borrow_mut().as_mut() {
            lent.opaque -= 1;
        }
    });
    out.map_err(CodecError)
}

thread_local! {
    static MESSAGE: RefCell<Option<MessageContext>> = const { RefCell::new(None) };
    static ENCODE_TABLE: RefCell<Option<Vec<Bytes>>> = const { RefCell::new(None) };
    static DECODE_TABLE: RefCell<Option<Vec<Option<Bytes>>>> = const { RefCell::new(None) };
    static LENT: RefCell<Option<Lent>> = const { RefCell::new(None) };
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let idx = ENCODE_TABLE.with(|t| {
            t.borrow_mut().as_mut().map(|table| {
                table.push(self.0.clone());
                table.len() - 1
            })
        });
        match idx {
            Some(i) => {
                let i = u32::try_from(i).map_err(|_| ser::Error::custom("too many blobs"))?;
                s.serialize_u32(i)
            }
            None => s.serialize_bytes(&self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let in_rpc = DECODE_TABLE.with(|t| t.borrow().is_some());
        if in_rpc {
            let idx = u32::deserialize(d)? as usize;
            DECODE_TABLE.with(|t| {
                let mut t = t.borrow_mut();
                let table = t.as_mut().expect("checked above");
                table
                    .get_mut(idx)
                    .and_then(Option::take)
                    .map(Blob)
                    .ok_or_else(|| de::Error::custom(format!("blob {idx} missing from side table")))
            })
        } else {
            d.deserialize_byte_buf(BytesVisitor)
        }
    }
}

struct BytesVisitor;

impl Visitor<'_> for BytesVisitor {
    type Value = Blob;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("bytes")
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Blob, E> {
        Ok(Blob::from(v.to_vec()))
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
        Ok(Blob::from(v))
    }
}

/// Restores the previous table on drop, so encodes nest and unwind cleanly.
struct Restore<T: 'static>(
    &'static std::thread::LocalKey<RefCell<Option<T>>>,
    Option<T>,
);

impl<T> Drop for Restore<T> {
    fn drop(&mut self) {
        let prev = self.1.take();
        self.0.with(|t| *t.borrow_mut() = prev);
    }
}

/// Encodes `value`, collecting its blobs into the side table.
pub(crate) fn encode<T: Serialize + ?Sized>(
    value: &T,
    ctx: Option<MessageContext>,
) -> bincode::Result<(Vec<u8>, Vec<Bytes>)> {
    let prev_msg = MESSAGE.with(|m| m.replace(ctx));
    let _msg = Restore(&MESSAGE, prev_msg);
    let prev = ENCODE_TABLE.with(|t| t.borrow_mut().replace(Vec::new()));
    let guard = Restore(&ENCODE_TABLE, prev);
    // `serialize_into`, not `serialize`: the latter runs a sizing pass first, which would
    // push every blob into the table twice.
    let mut payload = Vec::with_capacity(128);
    bincode::serialize_into(&mut payload, value)?;
    let blobs = ENCODE_TABLE
        .with(|t| t.borrow_mut().take())
        .unwrap_or_default();
    drop(guard);
    Ok((payload, blobs))
}

/// What a request lent, until the request is handed to the connection: dropped before that
/// (a failure, or a caller that gave up), the request certainly was never decoded, and what
/// was lent is given back.
pub(crate) struct Unsent(Option<Lent>);

impl Unsent {
    pub(crate) fn new(lent: Lent) -> Self {
        Self(Some(lent))
    }

    /// The request is being sent: from now on its outcome decides.
    pub(crate) fn sent(mut self) -> Lent {
        self.0.take().unwrap_or_default()
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if let Some(lent) = self.0.take() {
            lent.never_decoded();
        }
    }
}

/// A message's serde payload and its blob side table.
pub(crate) type Encoded = (Vec<u8>, Vec<Bytes>);

/// [`encode`] for a request: also collects what its values registered with
/// [`MessageContext::on_undelivered`] (including values nested in inner encodes).
pub(crate) fn encode_request<T: Serialize + ?Sized>(
    value: &T,
    ctx: Option<MessageContext>,
) -> (bincode::Result<Encoded>, Lent) {
    let prev = LENT.with(|u| u.borrow_mut().replace(Lent::default()));
    let guard = Restore(&LENT, prev);
    let out = encode(value, ctx);
    let lent = LENT.with(|u| u.borrow_mut().take()).unwrap_or_default();
    drop(guard);
    (out, lent)
}

/// Decodes a `T` whose blobs are in `blobs`.
pub(crate) fn decode<T: DeserializeOwned>(
    payload: &[u8],
    blobs: Vec<Bytes>,
    ctx: Option<MessageContext>,
) -> bincode::Result<T> {
    let prev_msg = MESSAGE.with(|m| m.replace(ctx));
    let _msg = Restore(&MESSAGE, prev_msg);
    let table = blobs.into_iter().map(Some).collect();
    let prev = DECODE_TABLE.with(|t| t.borrow_mut().replace(table));
    let _guard = Restore(&DECODE_TABLE, prev);
    // A type's own `Deserialize` may panic on bytes it does not expect: that is a decoding
    // error of this message, not the end of the task or thread decoding it (FRAME-3).
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bincode::deserialize(payload)
    }))
    .unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".to_owned());
        Err(Box::new(bincode::ErrorKind::Custom(format!(
            "decoding panicked: {why}"
        ))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Nested {
        a: Vec<Blob>,
        b: Option<(u8, Blob)>,
    }

    #[test]
    fn blobs_go_to_the_side_table_not_the_payload() {
        let big = Blob::from(vec![7u8; 100_000]);
        let v = Nested {
            a: vec![big.clone(), Blob::from(vec![1, 2])],
            b: Some((3, Blob::default())),
        };
        let (payload, blobs) = encode(&v, None).unwrap();
        assert!(
            payload.len() < 64,
            "payload holds indices only: {}",
            payload.len()
        );
        assert_eq!(blobs.len(), 3);
        // Zero copy: the table shares the blob's memory.
        assert_eq!(blobs[0].as_ptr(), big.as_ptr());
        let back: Nested = decode(&payload, blobs, None).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn missing_blob_is_an_error() {
        let (payload, _) = encode(&Blob::from(vec![1u8]), None).unwrap();
        let err = decode::<Blob>(&payload, Vec::new(), None).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn outside_rpc_blob_is_plain_bytes() {
        let b = Blob::from(vec![1u8, 2, 3]);
        let enc = bincode::serialize(&b).unwrap();
        assert_eq!(enc.len(), 8 + 3);
        let back: Blob = bincode::deserialize(&enc).unwrap();
        assert_eq!(back, b);
    }
}
