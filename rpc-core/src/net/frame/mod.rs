//! tarpc's frames, for every connection that carries calls: a 4-byte big-endian length, then a
//! bincode message (`ClientMessage<CallRequest>` one way, `Response<CallReply>` the other),
//! refused above the frame limit both ways. The multiplexed connection writes through an
//! [`Outbox`] and reads with [`reader`]; the blocking connection through [`BlockingFrames`].
//! Both encode with [`encode`] and decode with [`decode`], so the bytes are the same.
//!
//! - FRAME-1: a frame above the limit is refused before any byte of it is queued or written
//!   (sending), and ends its connection (receiving).
//! - FRAME-3: no field of a frame can make decoding panic (the deadline is checked here, the
//!   envelope's lists are bounded in `wire.rs`).
//! - FRAME-4: a frame's buffer grows as its bytes arrive, never to the length its header
//!   announces before they do.
//! - FRAME-2: an outbox holds at most `max_queued_bytes` not yet written (plus the frame that
//!   crossed the limit): a peer that stops reading fails new calls instead of growing it.
//! - FRAME-5: a frame's length prefix is the length of the bytes encoded after it, taken
//!   from the encoding written, never from a sizing: two encodings of one message may differ
//!   in size, since tarpc encodes a request's deadline relative to the moment of encoding (a
//!   `Duration` whose varint fields change length as it shrinks). With the prefix from the
//!   sizing, a request of more than 512 bytes now and then came out shorter than its prefix
//!   said, and its receiver ended the connection ("Slice had bytes remaining after
//!   deserialization"; seen in a parameter server test, a push failing over to a backup).

use std::io::{self, Write};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use bincode::Options;
use bytes::{Buf, BufMut, BytesMut};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::codec::FramedRead;

use super::serve::NO_DEADLINE;
use super::transport::Conn;

mod blocking;
pub(crate) use blocking::{left, BlockingFrames};

/// Room an envelope needs besides its payload and inline blobs (names, ids, the deadline):
/// a request or result is refused when payload, blobs and this exceed the frame limit.
pub(crate) const ENVELOPE_ROOM: usize = 1024;

/// A write buffer above this is not kept once written.
const KEEP_BUFFER: usize = 1 << 20;

/// The room a frame is first encoded into, without computing its size: most control frames
/// (requests and replies of small calls, protocol messages) are under a few hundred bytes.
const SMALL_FRAME: usize = 512;

fn codec() -> bincode::DefaultOptions {
    bincode::DefaultOptions::new()
}

/// Room beyond a frame's computed size when it is encoded (FRAME-5).
const SLACK: usize = 16;

/// Whether a message of `size` bytes of payload and inline blobs fits in a frame of `limit`.
pub(crate) fn fits(size: usize, limit: usize) -> bool {
    size.saturating_add(ENVELOPE_ROOM) <= limit
}

/// Decodes one frame's body.
pub(crate) fn decode<T: DeserializeOwned>(body: &[u8]) -> io::Result<T> {
    codec()
        .deserialize(body)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Appends `msg` as one frame to `buf`, into a plain slice (byte by byte through `BufMut`
/// costs more than the rest of a small call). A frame that fits in [`SMALL_FRAME`] bytes is
/// encoded straight into room made for it; a larger one has its size computed first, so a
/// frame above `max` is refused before it is encoded (FRAME-1), and is then encoded once more,
/// its prefix set from what was written (FRAME-5). On error `buf` is as it was.
pub(crate) fn encode<T: Serialize>(buf: &mut BytesMut, msg: &T, max: usize) -> io::Result<()> {
    let start = buf.len();
    let room = SMALL_FRAME.min(max);
    buf.resize(start + 4 + room, 0);
    let mut into = SliceWriter {
        buf: &mut buf[start + 4..],
        at: 0,
    };
    if codec().serialize_into(&mut into, msg).is_ok() {
        let len = into.at;
        buf.truncate(start + 4 + len);
        buf[start..start + 4].copy_from_slice(&u32::try_from(len).expect("small").to_be_bytes());
        return Ok(());
    }
    // Larger than the room (or not encodable: sizing it says why).
    buf.truncate(start);
    let len = match codec().serialized_size(msg) {
        Err(e) => return Err(io::Error::other(e)),
        Ok(n) if n > max as u64 => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("frame of {n} bytes is above the limit of {max}"),
            ))
        }
        Ok(n) => usize::try_from(n).expect("below the frame limit"),
    };
    // FRAME-5: encoded again into room for what the sizing said and a little more (a
    // request's deadline, a `Duration` in varints, is at most 12 bytes longer), the prefix
    // from what was written.
    buf.reserve(4 + len + SLACK);
    buf.put_u32(0);
    buf.resize(start + 4 + len + SLACK, 0);
    let mut into = SliceWriter {
        buf: &mut buf[start + 4..],
        at: 0,
    };
    let encoded = codec().serialize_into(&mut into, msg);
    let written = into.at;
    if let Err(e) = encoded {
        buf.truncate(start);
        return Err(io::Error::other(e));
    }
    if written > max {
        buf.truncate(start);
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("frame of {written} bytes is above the limit of {max}"),
        ));
    }
    buf.truncate(start + 4 + written);
    let prefix = u32::try_from(written).expect("below the frame limit");
    buf[start..start + 4].copy_from_slice(&prefix.to_be_bytes());
    Ok(())
}

/// A writer into a slice sized beforehand. A one-byte write (bincode writes tarpc's trace ids
/// a byte at a time) is a store, not a call to `memcpy`.
struct SliceWriter<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Write for SliceWriter<'_> {
    #[inline]
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write_all(data).map(|()| data.len())
    }

    #[inline]
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        let end = self.at + data.len();
        let Some(dst) = self.buf.get_mut(self.at..end) else {
            return Err(io::ErrorKind::WriteZero.into());
        };
        match data {
            [b] => dst[0] = *b,
            _ => dst.copy_from_slice(data),
        }
        self.at = end;
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The request context sent with every call: only its deadline is read (tarpc's trace context
/// is not used by either end).
pub(crate) fn request_context(deadline: Instant) -> tarpc::context::Context {
    static TEMPLATE: OnceLock<tarpc::context::Context> = OnceLock::new();
    let mut c = *TEMPLATE.get_or_init(tarpc::context::current);
    c.deadline = deadline;
    c
}

/// A request frame as it arrives: tarpc's `ClientMessage` field for field, except that the
/// deadline stays the relative duration it is on the wire (FRAME-3: tarpc's own decoding adds
/// it to `Instant::now()`, which panics on overflow: a frame with a huge deadline would kill
/// its connection's task or thread).
#[derive(serde::Deserialize)]
pub(crate) enum InMessage<T> {
    Request(InRequest<T>),
    #[allow(dead_code)]
    Cancel {
        trace_context: tarpc::trace::Context,
        request_id: u64,
    },
}

/// A request as it arrives (see [`InMessage`]).
#[derive(serde::Deserialize)]
pub(crate) struct InRequest<T> {
    context: InContext,
    pub id: u64,
    pub message: T,
}

#[derive(serde::Deserialize)]
struct InContext {
    deadline: Duration,
    #[allow(dead_code)]
    trace_context: tarpc::trace::Context,
}

impl<T> InRequest<T> {
    /// When the caller stops waiting, as of `now`: at most [`NO_DEADLINE`] away.
    pub(crate) fn deadline(&self, now: Instant) -> Instant {
        now + self.context.deadline.min(NO_DEADLINE)
    }
}

/// Reads length-prefixed frames of at most `max` bytes from a connection's read half.
pub(crate) type FrameReader = FramedRead<tokio::io::ReadHalf<Conn>, FrameCodec>;

/// A [`FrameReader`] on `r`.
pub(crate) fn reader(r: tokio::io::ReadHalf<Conn>, max: usize) -> FrameReader {
    FramedRead::new(r, FrameCodec::new(max))
}

/// How much a frame's buffer grows at a time while its bytes arrive (FRAME-4).
const READ_CHUNK: usize = 64 << 10;

/// Splits length-prefixed frames of at most `max` bytes off a read buffer. Unlike tokio's
/// length-delimited codec it makes room for a frame as its bytes arrive, not for the length
/// its header announces (FRAME-4: a header alone cannot make a worker allocate).
pub(crate) struct FrameCodec {
    max: usize,
}

impl FrameCodec {
    /// A codec for frames of at most `max` bytes.
    pub(crate) fn new(max: usize) -> Self {
        Self { max }
    }
}

impl tokio_util::codec::Decoder for FrameCodec {
    type Item = BytesMut;
    type Error = io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> io::Result<Option<BytesMut>> {
        let Some(head) = src.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
        if len > self.max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes is above the limit of {}", self.max),
            ));
        }
        if src.len() < 4 + len {
            src.reserve((4 + len - src.len()).min(READ_CHUNK));
            return Ok(None);
        }
        src.advance(4);
        Ok(Some(src.split_to(len)))
    }
}

/// The next message read from `frames`; `None` at the end of the stream.
pub(crate) async fn next_message<T: DeserializeOwned>(
    frames: &mut FrameReader,
) -> Option<io::Result<T>> {
    let frame = match frames.next().await? {
        Ok(f) => f,
        Err(e) => return Some(Err(e)),
    };
    Some(decode(frame.chunk()))
}

/// Why a frame was not queued.
#[derive(Debug)]
pub(crate) enum PushError {
    /// The outbox is closed: its connection has ended.
    Closed,
    /// The outbox holds its limit of bytes not yet written: the peer is not reading.
    Full(usize),
    /// The message could not be encoded, or its frame is above the limit.
    Encode(io::Error),
}

#[derive(Default)]
struct OutState {
    buf: BytesMut,
    closed: bool,
}

/// The frames waiting to be written on one multiplexed connection. Senders encode straight
/// into one shared buffer; the connection's task writes whatever has gathered with one system
/// call, so calls made together leave together.
pub(crate) struct Outbox {
    state: Mutex<OutState>,
    ready: Notify,
    max_frame: usize,
    /// Bytes waiting to be written above which nothing more is queued (FRAME-2).
    max_queued: usize,
}

impl Outbox {
    pub(crate) fn new(max_frame: usize, max_queued: usize) -> Self {
        Self {
            state: Mutex::new(OutState::default()),
            ready: Notify::new(),
            max_frame,
            max_queued,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Encodes `msg` as one frame at the end of the buffer.
    pub(crate) fn push<T: Serialize>(&self, msg: &T) -> Result<(), PushError> {
        let mut s = self.lock();
        if s.closed {
            return Err(PushError::Closed);
        }
        let start = s.buf.len();
        if start >= self.max_queued {
            return Err(PushError::Full(start));
        }
        encode(&mut s.buf, msg, self.max_frame).map_err(PushError::Encode)?;
        drop(s);
        if start == 0 {
            // The writer may be waiting for the buffer to fill (a stored permit if not).
            self.ready.notify_one();
        }
        Ok(())
    }

    /// No frame is queued from now on; the writer stops.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
    }

    /// Writes what gathers until the outbox is closed or a write fails.
    pub(crate) async fn write_loop<W: AsyncWrite + Unpin>(&self, mut w: W) -> io::Result<()> {
        let mut spare = BytesMut::with_capacity(8 << 10);
        loop {
            {
                let mut s = self.lock();
                if s.closed {
                    return Ok(());
                }
                std::mem::swap(&mut s.buf, &mut spare);
            }
            if spare.is_empty() {
                self.ready.notified().await;
                continue;
            }
            w.write_all(&spare).await?;
            w.flush().await?;
            spare.clear();
            if spare.capacity() > KEEP_BUFFER {
                spare = BytesMut::with_capacity(8 << 10);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A message whose encoding is shorter each time it is encoded, as a request's deadline
    /// is (tarpc encodes it relative to the moment): 400 ms, then 300 (3 bytes as a varint),
    /// then 200 (1 byte), beside 600 bytes of payload.
    struct Shrinking(std::sync::atomic::AtomicU32, Vec<u8>);

    impl serde::Serialize for Shrinking {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeTuple;
            let ms = self.0.fetch_sub(100, std::sync::atomic::Ordering::Relaxed);
            let mut t = s.serialize_tuple(2)?;
            t.serialize_element(&ms)?;
            t.serialize_element(&self.1)?;
            t.end()
        }
    }

    /// FRAME-5: the prefix is the length of what follows, however often the message was
    /// encoded. Before, the frame said 606 bytes and held 604 and two zeros, which decoding
    /// refused ("Slice had bytes remaining after deserialization").
    #[test]
    fn a_frame_s_prefix_is_what_was_encoded_after_it() {
        let msg = Shrinking(std::sync::atomic::AtomicU32::new(400), vec![7; 600]);
        let mut buf = BytesMut::new();
        encode(&mut buf, &msg, 1 << 20).expect("encodes");
        let len = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, buf.len() - 4);
        let (ms, body): (u32, Vec<u8>) = decode(&buf[4..]).expect("decodes");
        assert_eq!((ms, body), (200, vec![7; 600]));
    }

    #[tokio::test]
    async fn queued_frames_leave_length_prefixed_and_in_order() {
        let out = Outbox::new(1 << 20, 1 << 20);
        for t in 0..3u8 {
            out.push(&t).expect("queued");
        }
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            let out = out;
            let r = tokio::time::timeout(Duration::from_millis(200), out.write_loop(a)).await;
            assert!(
                r.is_err(),
                "the writer waits for more once the buffer is written"
            );
        });
        let mut got = vec![0u8; 3 * 5];
        tokio::time::timeout(Duration::from_secs(10), b.read_exact(&mut got))
            .await
            .expect("written")
            .expect("read");
        assert_eq!(got, [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 2]);
        writer.await.expect("joined");
    }

    /// FRAME-2: an outbox nobody writes out takes frames up to its limit, then refuses.
    #[test]
    fn an_outbox_refuses_frames_past_its_limit() {
        let out = Outbox::new(1 << 20, 1000);
        let mut queued = 0;
        loop {
            match out.push(&vec![1u8; 300]) {
                Ok(()) => queued += 1,
                Err(PushError::Full(n)) => {
                    assert!(n >= 1000, "{n}");
                    break;
                }
                Err(e) => panic!("{e:?}"),
            }
            assert!(queued < 10, "never refused");
        }
        assert_eq!(
            queued, 4,
            "the frame that crosses the limit is the last one taken"
        );
    }

    /// FRAME-1: small and large frames encode to the same bytes as bincode's own encoding,
    /// and a frame above the limit leaves the buffer as it was.
    #[test]
    fn frames_of_any_size_encode_alike_and_the_limit_holds() {
        for len in [0usize, 10, 600, 5000] {
            let msg = vec![7u8; len];
            let mut buf = BytesMut::from(&b"xy"[..]);
            encode(&mut buf, &msg, 1 << 20).expect("encodes");
            let body = codec().serialize(&msg).expect("bincode");
            assert_eq!(&buf[..2], b"xy");
            assert_eq!(&buf[2..6], &(body.len() as u32).to_be_bytes());
            assert_eq!(&buf[6..], &body[..]);
            assert_eq!(decode::<Vec<u8>>(&buf[6..]).expect("decodes"), msg);
        }
        let mut buf = BytesMut::from(&b"xy"[..]);
        let err = encode(&mut buf, &vec![0u8; 5000], 1000).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(&buf[..], b"xy", "nothing half-encoded");
        assert!(fits(1000, 1000 + ENVELOPE_ROOM));
        assert!(!fits(1001, 1000 + ENVELOPE_ROOM));
        assert!(!fits(usize::MAX, 10));
    }
}
