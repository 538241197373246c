//! Calls multiplexed on a control connection: tarpc's frames, our own dispatch.
//!
//! A control connection carries tarpc messages (`ClientMessage<CallRequest>` one way,
//! `Response<CallReply>` the other; bincode, a 4-byte big-endian length before each, refused
//! above the frame limit), the same frames a sync connection carries (`direct.rs`). tarpc's
//! own client and server are not on this path: measured on the 2-vCPU machine, its client
//! channel and dispatch task alone cost about 5 µs of CPU per call and its server's
//! per-request machinery (a deadline queue entry, an abort handle, a response channel, a span)
//! another few, more than the whole budget of the throughput target (236k calls/s is 4.2 µs
//! per call per process). What the framework needs of a dispatcher is small, because
//! cancellation and deadlines are already its own (`cancel.rs`, `context.rs`):
//!
//! - [`Outbox`]: the frames waiting to be written. Senders encode straight into one shared
//!   buffer; the connection's task writes whatever has gathered with one system call, so
//!   calls made together leave together.
//! - [`MuxClient`]: the calling end. [`MuxClient::send`] registers a one-shot slot under a
//!   fresh id and queues the request at once, without waiting; the returned [`Waiter`] waits
//!   for the reply (so a caller can queue now and wait later, as `rpc_keep` does). The
//!   connection's task reads replies and fills the slots.
//! - [`serve`]: the serving end. Each request is polled once as it is read; one that has to
//!   wait becomes a task of its own, and only then is it registered for cancellation (a call
//!   that ended in its first poll cannot have been cancelled: the cancel would come in a later
//!   frame). Its reply is queued when it is done.
//!
//! Invariants:
//! - MUX-1: a call's slot is registered before its request is queued, and removed when its
//!   [`Waiter`] is dropped, so a reply finds its caller or nobody: a reply for an id
//!   nobody waits for (the caller gave up at its deadline) is read and dropped.
//! - MUX-2: when a connection ends (read error, end of stream, a frame above the limit, or
//!   `close`), every call waiting on it fails at once and no further request is queued on it;
//!   a request refused that way was never written ([`CallFailed::NotSent`]).
//! - MUX-3: the serving end answers each request at most once, never after its deadline (a
//!   request past its deadline is dropped unanswered, as tarpc's server does; its caller gives
//!   up at the same deadline), and counts a request that waits as a call in flight for the
//!   shutdown drain.
//! - MUX-4: every wait is bounded by the caller's deadline (the caller's own timer), by the
//!   connection (MUX-2) or by the agent's stop token; the buffers are bounded by what the
//!   callers have in flight, each frame by the frame limit.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::time::Instant;

use bincode::Options;
use bytes::{Buf, BufMut, BytesMut};
use futures::StreamExt;
use serde::Serialize;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{oneshot, Notify};
use tokio_util::codec::{FramedRead, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::transport::Conn;
use crate::wire::{CallReply, CallRequest};

/// What a reply frame carries: the callee's reply, or tarpc's error for a request it refused.
type ReplyMsg = Result<CallReply, tarpc::ServerError>;

/// A write buffer above this is not kept once written.
const KEEP_BUFFER: usize = 1 << 20;

fn codec() -> bincode::DefaultOptions {
    bincode::DefaultOptions::new()
}

/// Reads length-prefixed frames of at most `max` bytes.
fn frames(
    r: tokio::io::ReadHalf<Conn>,
    max: usize,
) -> FramedRead<tokio::io::ReadHalf<Conn>, LengthDelimitedCodec> {
    let codec = LengthDelimitedCodec::builder()
        .max_frame_length(max)
        .new_codec();
    FramedRead::new(r, codec)
}

/// The next message read from `frames`; `None` at the end of the stream.
async fn next_message<T: serde::de::DeserializeOwned>(
    frames: &mut FramedRead<tokio::io::ReadHalf<Conn>, LengthDelimitedCodec>,
) -> Option<io::Result<T>> {
    let frame = match frames.next().await? {
        Ok(f) => f,
        Err(e) => return Some(Err(e)),
    };
    Some(
        codec()
            .deserialize(frame.chunk())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
    )
}

/// Why a frame was not queued.
#[derive(Debug)]
pub(crate) enum PushError {
    /// The connection has ended (MUX-2).
    Closed,
    /// The message could not be encoded, or its frame is above the limit.
    Encode(io::Error),
}

#[derive(Default)]
struct OutState {
    buf: BytesMut,
    closed: bool,
}

/// The frames waiting to be written on one connection.
pub(crate) struct Outbox {
    state: Mutex<OutState>,
    ready: Notify,
    max_frame: usize,
}

impl Outbox {
    fn new(max_frame: usize) -> Self {
        Self {
            state: Mutex::new(OutState::default()),
            ready: Notify::new(),
            max_frame,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Encodes `msg` as one frame at the end of the buffer, into a plain slice (byte by byte
    /// through `BufMut` costs more than the rest of a small call). A frame that fits in
    /// [`SMALL_FRAME`] bytes is encoded straight into room made for it; a larger one has its
    /// size computed first, so a frame above the limit is refused before it is encoded.
    fn push<T: Serialize>(&self, msg: &T) -> Result<(), PushError> {
        {
            let mut s = self.lock();
            if s.closed {
                return Err(PushError::Closed);
            }
            let start = s.buf.len();
            let room = SMALL_FRAME.min(self.max_frame);
            s.buf.resize(start + 4 + room, 0);
            let mut into = SliceWriter {
                buf: &mut s.buf[start + 4..],
                at: 0,
            };
            if codec().serialize_into(&mut into, msg).is_ok() {
                let len = into.at;
                s.buf.truncate(start + 4 + len);
                s.buf[start..start + 4]
                    .copy_from_slice(&u32::try_from(len).expect("small").to_be_bytes());
                drop(s);
                if start == 0 {
                    // The writer may be waiting for the buffer to fill (a stored permit if
                    // not).
                    self.ready.notify_one();
                }
                return Ok(());
            }
            // Larger than the room (or not encodable: sizing it says why).
            s.buf.truncate(start);
        }
        let len = match codec().serialized_size(msg) {
            Err(e) => return Err(PushError::Encode(io::Error::other(e))),
            Ok(n) if n > self.max_frame as u64 => {
                return Err(PushError::Encode(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "frame of {n} bytes is above the limit of {}",
                        self.max_frame
                    ),
                )))
            }
            Ok(n) => usize::try_from(n).expect("below the frame limit"),
        };
        let mut s = self.lock();
        if s.closed {
            return Err(PushError::Closed);
        }
        let start = s.buf.len();
        s.buf.reserve(4 + len);
        s.buf
            .put_u32(u32::try_from(len).expect("below the frame limit"));
        s.buf.resize(start + 4 + len, 0);
        let mut into = SliceWriter {
            buf: &mut s.buf[start + 4..],
            at: 0,
        };
        if let Err(e) = codec().serialize_into(&mut into, msg) {
            s.buf.truncate(start);
            return Err(PushError::Encode(io::Error::other(e)));
        }
        drop(s);
        if start == 0 {
            // The writer may be waiting for the buffer to fill (a stored permit if not).
            self.ready.notify_one();
        }
        Ok(())
    }

    /// No frame is queued from now on; the writer stops.
    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
    }

    /// Writes what gathers until the outbox is closed or a write fails.
    async fn write_loop<W: AsyncWrite + Unpin>(&self, mut w: W) -> io::Result<()> {
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
}

/// The room a frame is first encoded into, without computing its size: most control frames
/// (requests and replies of small calls, protocol messages) are under a few hundred bytes.
const SMALL_FRAME: usize = 512;

/// A writer into a slice sized beforehand. A one-byte write (bincode writes tarpc's trace ids
/// a byte at a time) is a store, not a call to `memcpy`.
struct SliceWriter<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl io::Write for SliceWriter<'_> {
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
fn request_context(deadline: Instant) -> tarpc::context::Context {
    static TEMPLATE: OnceLock<tarpc::context::Context> = OnceLock::new();
    let mut c = *TEMPLATE.get_or_init(tarpc::context::current);
    c.deadline = deadline;
    c
}

/// Why a call got no reply.
#[derive(Debug)]
pub(crate) enum CallFailed {
    /// The request was not queued: the callee cannot have read it.
    NotSent(io::Error),
    /// The connection ended while the call waited (the callee may have run it).
    Lost,
    /// The callee refused the request.
    Server(tarpc::ServerError),
}

/// Hashes a request id (a counter of ours) with one multiplication: the ids are not chosen
/// by anyone who could collide them on purpose, and the table is on every call's path.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Default)]
struct Pending {
    slots: HashMap<u64, oneshot::Sender<ReplyMsg>, std::hash::BuildHasherDefault<IdHasher>>,
    closed: bool,
}

struct ClientShared {
    out: Outbox,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
}

impl ClientShared {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// MUX-2: fails every waiting call and refuses new ones.
    fn end(&self) {
        self.out.close();
        let slots = {
            let mut p = self.pending();
            p.closed = true;
            std::mem::take(&mut p.slots)
        };
        drop(slots);
    }
}

/// The calling end of a control connection. Cloning is cheap; every clone sends on the same
/// connection.
#[derive(Clone)]
pub(crate) struct MuxClient {
    shared: Arc<ClientShared>,
}

/// Ends the connection's calls when the connection's task ends, however it ends.
struct EndOnDrop(Arc<ClientShared>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A queued request's wait for its reply. Dropped before the reply came, it removes the
/// call's slot, so a late reply is discarded (MUX-1).
pub(crate) struct Waiter {
    shared: Arc<ClientShared>,
    id: u64,
    rx: oneshot::Receiver<ReplyMsg>,
    /// The reader took the slot and sent the reply (or the connection ended).
    answered: bool,
}

impl std::future::Future for Waiter {
    type Output = Result<CallReply, CallFailed>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let reply = std::task::ready!(std::pin::Pin::new(&mut self.rx).poll(cx));
        self.answered = true;
        Poll::Ready(match reply {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(CallFailed::Server(e)),
            Err(_) => Err(CallFailed::Lost),
        })
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if !self.answered {
            self.shared.pending().slots.remove(&self.id);
        }
    }
}

impl MuxClient {
    /// Starts the calling end on an authenticated connection. The returned future is the
    /// connection: it reads replies and writes requests until the connection ends, and must
    /// be spawned.
    pub(crate) fn start(
        conn: Conn,
        max_frame: usize,
    ) -> (
        Self,
        impl std::future::Future<Output = io::Result<()>> + Send + 'static,
    ) {
        let shared = Arc::new(ClientShared {
            out: Outbox::new(max_frame),
            pending: Mutex::new(Pending::default()),
            next_id: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let task = async move {
            let _end = EndOnDrop(Arc::clone(&s));
            let (r, w) = tokio::io::split(conn);
            let mut replies = frames(r, max_frame);
            let read = async {
                while let Some(reply) = next_message(&mut replies).await {
                    let reply: tarpc::Response<CallReply> = reply?;
                    let slot = s.pending().slots.remove(&reply.request_id);
                    if let Some(tx) = slot {
                        let _ = tx.send(reply.message);
                    }
                }
                Err::<(), _>(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ))
            };
            tokio::select! {
                r = read => r,
                w = s.out.write_loop(w) => w,
            }
        };
        (Self { shared }, task)
    }

    /// Queues `req` with `deadline` now; the returned [`Waiter`] resolves to its reply. The
    /// deadline is enforced by the caller (and by the callee, which drops the request once it
    /// passes).
    pub(crate) fn send(self, req: CallRequest, deadline: Instant) -> Result<Waiter, CallFailed> {
        let shared = self.shared;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = shared.pending();
            if p.closed {
                return Err(CallFailed::NotSent(closed()));
            }
            p.slots.insert(id, tx);
        }
        // From here on, dropping the waiter removes the slot (MUX-1).
        let waiter = Waiter {
            shared,
            id,
            rx,
            answered: false,
        };
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context: request_context(deadline),
            id,
            message: req,
        });
        match waiter.shared.out.push(&msg) {
            Ok(()) => Ok(waiter),
            Err(PushError::Closed) => Err(CallFailed::NotSent(closed())),
            Err(PushError::Encode(e)) => Err(CallFailed::NotSent(e)),
        }
    }

    /// Ends the connection's calls (the connection's task is aborted by its owner).
    pub(crate) fn end(&self) {
        self.shared.end();
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the connection has ended")
}

/// Serves a control connection from `caller` until it ends.
pub(crate) async fn serve(agent: Agent, conn: Conn, caller: u32) -> io::Result<()> {
    let max = agent.inner.cfg.max_frame_bytes;
    let out = Arc::new(Outbox::new(max));
    let (r, w) = tokio::io::split(conn);
    let mut requests = frames(r, max);
    let read = async {
        while let Some(msg) = next_message(&mut requests).await {
            let msg: tarpc::ClientMessage<CallRequest> = msg?;
            // Our callers cancel by message of their own (`cancel.rs`) and enforce their
            // deadlines themselves; they never send tarpc's cancel.
            let tarpc::ClientMessage::Request(req) = msg else {
                continue;
            };
            let Some((id, mut call, cancel)) = start_call(&agent, req, caller) else {
                continue;
            };
            // Polled once here, in this task's context: a handler that finishes without
            // waiting (the common case for small calls) costs no spawn and no wake-up. One
            // that has to wait becomes a task of its own (its next poll registers that task's
            // waker), so it never holds up the connection.
            match futures::poll!(call.as_mut()) {
                Poll::Ready(Ok(reply)) => respond(&out, id, reply),
                Poll::Ready(Err(_)) => {}
                Poll::Pending => {
                    // Cancellable from now on: registered before the next frame is read, so
                    // a cancel sent after this request finds it (CAN-1).
                    let running = cancel.map(|(cancel_id, token)| {
                        crate::cancel::Cancels::register(&agent, caller, cancel_id, token)
                    });
                    let stop = agent.inner.stop.clone();
                    let out = Arc::clone(&out);
                    agent.inner.calls.spawn(async move {
                        let _running = running;
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            r = call => if let Ok(reply) = r {
                                respond(&out, id, reply);
                            }
                        }
                    });
                }
            }
        }
        Ok(())
    };
    let result = tokio::select! {
        r = read => r,
        w = out.write_loop(w) => w,
    };
    out.close();
    result
}

/// A request's id and its run, bounded by its deadline, and the caller's cancel id with the
/// token that cancels it; `None` if the deadline has passed (MUX-3: dropped unanswered).
#[allow(clippy::type_complexity)]
fn start_call(
    agent: &Agent,
    req: tarpc::Request<CallRequest>,
    caller: u32,
) -> Option<(
    u64,
    std::pin::Pin<Box<tokio::time::Timeout<impl std::future::Future<Output = CallReply> + Send>>>,
    Option<(u64, CancellationToken)>,
)> {
    let deadline = req.context.deadline;
    let now = Instant::now();
    if now >= deadline {
        return None;
    }
    let cancel = req
        .message
        .cancel_id
        .map(|id| (id, CancellationToken::new()));
    let token = cancel.as_ref().map(|(_, t)| t.clone());
    let run = crate::server::handle(
        agent.clone(),
        crate::server::callers_deadline(deadline, now),
        req.message,
        caller,
        token,
    );
    Some((
        req.id,
        Box::pin(tokio::time::timeout_at(deadline.into(), run)),
        cancel,
    ))
}

/// Queues the reply to request `id`.
fn respond(out: &Outbox, id: u64, reply: CallReply) {
    let resp = tarpc::Response {
        request_id: id,
        message: Ok::<_, tarpc::ServerError>(reply),
    };
    match out.push(&resp) {
        Ok(()) | Err(PushError::Closed) => {}
        Err(PushError::Encode(e)) => {
            // `server::handle` refuses results above the frame limit; an error this large
            // still gets an answer, so its caller does not wait for its deadline.
            let refused = tarpc::Response::<CallReply> {
                request_id: id,
                message: Err(tarpc::ServerError::new(e.kind(), e.to_string())),
            };
            let _ = out.push(&refused);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CallOk;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, DuplexStream};

    fn request(tag: u8) -> CallRequest {
        CallRequest {
            fn_name: "f".into(),
            sig: 0,
            depth: 0,
            payload: vec![tag],
            blobs: Vec::new(),
            keep: None,
            meta: Default::default(),
            cancel_id: None,
        }
    }

    /// A client on one end of a pipe; the other end is returned raw.
    fn client(
        max: usize,
    ) -> (
        MuxClient,
        tokio::task::JoinHandle<io::Result<()>>,
        DuplexStream,
    ) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (c, task) = MuxClient::start(Box::new(a), max);
        (c, tokio::spawn(task), b)
    }

    async fn read_request(peer: &mut DuplexStream) -> tarpc::Request<CallRequest> {
        let body = tokio::time::timeout(Duration::from_secs(10), async {
            let len = peer.read_u32().await.expect("length");
            let mut body = vec![0; len as usize];
            peer.read_exact(&mut body).await.expect("body");
            body
        })
        .await
        .expect("a request within 10 s");
        match codec().deserialize(&body).expect("a request frame") {
            tarpc::ClientMessage::Request(r) => r,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    async fn reply(peer: &mut DuplexStream, id: u64, tag: u8) {
        let resp = tarpc::Response::<CallReply> {
            request_id: id,
            message: Ok(Ok(CallOk {
                payload: vec![tag],
                blobs: Vec::new(),
            })),
        };
        let body = codec().serialize(&resp).expect("encodes");
        peer.write_u32(body.len() as u32).await.expect("length");
        peer.write_all(&body).await.expect("body");
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// Queues `req` and waits for its reply.
    async fn call(c: &MuxClient, req: CallRequest, d: Instant) -> Result<CallReply, CallFailed> {
        c.clone().send(req, d)?.await
    }

    fn tag(r: Result<CallReply, CallFailed>) -> u8 {
        match r {
            Ok(Ok(ok)) => ok.payload[0],
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn replies_find_their_callers_in_any_order() {
        let (c, _task, mut peer) = client(1 << 20);
        let calls: Vec<_> = (0..3u8)
            .map(|t| {
                let c = c.clone();
                tokio::spawn(async move { call(&c, request(t), far()).await })
            })
            .collect();
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(read_request(&mut peer).await);
        }
        // Answered in reverse order, each with its request's tag.
        for r in seen.iter().rev() {
            reply(&mut peer, r.id, r.message.payload[0] + 100).await;
        }
        for (t, call) in calls.into_iter().enumerate() {
            let got = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("answered")
                .expect("joined");
            assert_eq!(tag(got), t as u8 + 100);
        }
    }

    #[tokio::test]
    async fn a_reply_nobody_waits_for_is_dropped_and_the_connection_goes_on() {
        let (c, _task, mut peer) = client(1 << 20);
        // MUX-1: the caller gives up; its slot goes with its future.
        let gave_up =
            tokio::time::timeout(Duration::from_millis(50), call(&c, request(1), far())).await;
        assert!(gave_up.is_err());
        let first = read_request(&mut peer).await;
        assert!(c.shared.pending().slots.is_empty());
        reply(&mut peer, first.id, 7).await;
        let next = {
            let c = c.clone();
            tokio::spawn(async move { call(&c, request(2), far()).await })
        };
        let second = read_request(&mut peer).await;
        assert_ne!(second.id, first.id);
        reply(&mut peer, second.id, 9).await;
        let got = tokio::time::timeout(Duration::from_secs(10), next)
            .await
            .expect("answered")
            .expect("joined");
        assert_eq!(
            tag(got),
            9,
            "the late reply was not taken for the next call's"
        );
    }

    #[tokio::test]
    async fn the_end_of_the_connection_fails_waiting_calls_and_refuses_new_ones() {
        let (c, task, mut peer) = client(1 << 20);
        let waiting = {
            let c = c.clone();
            tokio::spawn(async move { call(&c, request(1), far()).await })
        };
        let _ = read_request(&mut peer).await;
        drop(peer);
        // MUX-2: at once, not at the deadline 30 s away.
        let got = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("failed at once")
            .expect("joined");
        assert!(matches!(got, Err(CallFailed::Lost)), "{got:?}");
        let ended = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the task ended")
            .expect("joined");
        assert!(ended.is_err(), "the end of stream is reported");
        let refused = tokio::time::timeout(Duration::from_secs(10), call(&c, request(2), far()));
        match refused.await.expect("refused at once") {
            Err(CallFailed::NotSent(e)) => assert_eq!(e.kind(), io::ErrorKind::NotConnected),
            other => panic!("expected NotSent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_reply_frame_above_the_limit_ends_the_connection() {
        let (c, _task, mut peer) = client(64);
        let waiting = {
            let c = c.clone();
            tokio::spawn(async move { call(&c, request(1), far()).await })
        };
        let r = read_request(&mut peer).await;
        let resp = tarpc::Response::<CallReply> {
            request_id: r.id,
            message: Ok(Ok(CallOk {
                payload: vec![0; 1000],
                blobs: Vec::new(),
            })),
        };
        let body = codec().serialize(&resp).expect("encodes");
        peer.write_u32(body.len() as u32).await.expect("length");
        peer.write_all(&body).await.expect("body");
        let got = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("failed at once")
            .expect("joined");
        assert!(matches!(got, Err(CallFailed::Lost)), "{got:?}");
    }

    #[tokio::test]
    async fn a_request_above_the_limit_is_refused_before_it_is_queued() {
        let (c, _task, _peer) = client(64);
        let mut big = request(1);
        big.payload = vec![0; 1000];
        let refused = tokio::time::timeout(Duration::from_secs(10), call(&c, big, far()));
        match refused.await.expect("refused at once") {
            Err(CallFailed::NotSent(e)) => assert_eq!(e.kind(), io::ErrorKind::InvalidInput),
            other => panic!("expected NotSent, got {other:?}"),
        }
        assert!(c.shared.pending().slots.is_empty());
        assert!(c.shared.out.lock().buf.is_empty(), "nothing half-queued");
    }

    #[tokio::test]
    async fn queued_frames_leave_length_prefixed_and_in_order() {
        let out = Outbox::new(1 << 20);
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
}

#[cfg(test)]
mod serving_tests {
    use super::*;
    use crate::{BoxError, CallContext, MemoryNetwork, Registry, Secret, Transport};
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// Sleeps `ms` milliseconds, then returns them.
    #[crate::remote(name = "mux_test::nap")]
    async fn nap(_ctx: CallContext, ms: u64) -> Result<u64, BoxError> {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(ms)
    }

    async fn send(
        peer: &mut tokio::io::DuplexStream,
        agent: &Agent,
        id: u64,
        ms: u64,
        deadline: Instant,
    ) {
        let (payload, blobs, unsent) = agent.encode_args::<nap>(1, &(ms,)).expect("encodes");
        drop(unsent.sent());
        assert!(blobs.is_empty());
        let req = agent.envelope::<nap>(0, payload, Vec::new(), None, Default::default(), None);
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context: request_context(deadline),
            id,
            message: req,
        });
        let body = codec().serialize(&msg).expect("encodes");
        peer.write_u32(body.len() as u32).await.expect("length");
        peer.write_all(&body).await.expect("body");
    }

    async fn recv(peer: &mut tokio::io::DuplexStream) -> tarpc::Response<CallReply> {
        let len = peer.read_u32().await.expect("length");
        let mut body = vec![0; len as usize];
        peer.read_exact(&mut body).await.expect("body");
        codec().deserialize(&body).expect("a reply frame")
    }

    /// MUX-3: a request past its deadline, or one whose handler is still waiting at its
    /// deadline, is dropped unanswered; a handler that waits does not hold up the next request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_are_answered_once_and_never_after_their_deadline() {
        let net = MemoryNetwork::new();
        let agents = crate::testing::start_group(
            2,
            Transport::Memory(net),
            Secret::generate(),
            |_| {
                Registry::builder()
                    .register(nap)
                    .expect("registers")
                    .build()
            },
            |_, c| c,
        )
        .await
        .expect("group");
        let callee = agents[1].clone();
        let (a, mut peer) = tokio::io::duplex(1 << 16);
        let serving = tokio::spawn(serve(callee.clone(), Box::new(a), 0));
        let now = Instant::now();
        send(&mut peer, &callee, 1, 0, now).await; // already expired
        send(&mut peer, &callee, 2, 600, now + Duration::from_millis(150)).await; // outlives it
        send(&mut peer, &callee, 3, 300, now + Duration::from_secs(20)).await; // waits, answered
        send(&mut peer, &callee, 4, 0, now + Duration::from_secs(20)).await; // at once
        let first = tokio::time::timeout(Duration::from_secs(10), recv(&mut peer))
            .await
            .expect("answered");
        assert_eq!(
            first.request_id, 4,
            "the waiting handler held up the next request"
        );
        let second = tokio::time::timeout(Duration::from_secs(10), recv(&mut peer))
            .await
            .expect("answered");
        assert_eq!(second.request_id, 3);
        let ok = second.message.expect("served").expect("ran");
        assert_eq!(bincode::deserialize::<u64>(&ok.payload).ok(), Some(300));
        // Nothing else comes: not request 1, not request 2 (whose deadline passed).
        let more = tokio::time::timeout(Duration::from_millis(1000), recv(&mut peer)).await;
        assert!(more.is_err(), "an expired request was answered: {more:?}");
        drop(peer);
        let ended = tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("the connection ended with its peer")
            .expect("joined");
        assert!(ended.is_ok(), "{ended:?}");
        futures::future::join_all(agents.iter().map(|a| a.shutdown())).await;
    }
}
