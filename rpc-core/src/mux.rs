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
//! - [`MuxClient`]: the calling end. A call registers a one-shot slot under a fresh id,
//!   queues its request and waits; the connection's task reads replies and fills the slots.
//! - [`serve`]: the serving end. Each request is polled once as it is read; one that has to
//!   wait becomes a task of its own. Its reply is queued when it is done.
//!
//! Invariants:
//! - MUX-1: a call's slot is registered before its request is queued, and removed when the
//!   call's future is dropped, so a reply finds its caller or nobody: a reply for an id
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

    /// Encodes `msg` as one frame at the end of the buffer.
    fn push<T: Serialize>(&self, msg: &T) -> Result<(), PushError> {
        let mut s = self.lock();
        if s.closed {
            return Err(PushError::Closed);
        }
        let start = s.buf.len();
        s.buf.put_u32(0);
        let encoded = codec().serialize_into((&mut s.buf).writer(), msg);
        let len = s.buf.len() - start - 4;
        let failed = match encoded {
            Err(e) => Some(io::Error::other(e)),
            Ok(()) if len > self.max_frame => Some(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "frame of {len} bytes is above the limit of {}",
                    self.max_frame
                ),
            )),
            Ok(()) => None,
        };
        if let Some(e) = failed {
            s.buf.truncate(start);
            return Err(PushError::Encode(e));
        }
        let len = u32::try_from(len).expect("below the frame limit");
        s.buf[start..start + 4].copy_from_slice(&len.to_be_bytes());
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

#[derive(Default)]
struct Pending {
    slots: HashMap<u64, oneshot::Sender<ReplyMsg>>,
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

/// Removes a call's slot when its future is dropped (MUX-1).
struct Slot<'a> {
    shared: &'a ClientShared,
    id: u64,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.shared.pending().slots.remove(&self.id);
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
                while let Some(frame) = replies.next().await {
                    let frame = frame?;
                    let reply: tarpc::Response<CallReply> = codec()
                        .deserialize(frame.chunk())
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
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

    /// Sends `req` with `deadline` and waits for its reply. The deadline is enforced by the
    /// caller (and by the callee, which drops the request once it passes).
    pub(crate) async fn call(
        &self,
        req: CallRequest,
        deadline: Instant,
    ) -> Result<CallReply, CallFailed> {
        let shared = &*self.shared;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = shared.pending();
            if p.closed {
                return Err(CallFailed::NotSent(closed()));
            }
            p.slots.insert(id, tx);
        }
        let slot = Slot { shared, id };
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context: request_context(deadline),
            id,
            message: req,
        });
        match shared.out.push(&msg) {
            Ok(()) => {}
            Err(PushError::Closed) => return Err(CallFailed::NotSent(closed())),
            Err(PushError::Encode(e)) => return Err(CallFailed::NotSent(e)),
        }
        let reply = rx.await;
        std::mem::forget(slot);
        match reply {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(CallFailed::Server(e)),
            Err(_) => Err(CallFailed::Lost),
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
        while let Some(frame) = requests.next().await {
            let frame = frame?;
            let msg: tarpc::ClientMessage<CallRequest> = codec()
                .deserialize(frame.chunk())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            // Our callers cancel by message of their own (`cancel.rs`) and enforce their
            // deadlines themselves; they never send tarpc's cancel.
            let tarpc::ClientMessage::Request(req) = msg else {
                continue;
            };
            let Some((id, mut call)) = start_call(&agent, req, caller) else {
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
                    let stop = agent.inner.stop.clone();
                    let out = Arc::clone(&out);
                    agent.inner.calls.spawn(async move {
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

/// A request's id and its run, bounded by its deadline; `None` if the deadline has passed
/// (MUX-3: dropped unanswered).
#[allow(clippy::type_complexity)]
fn start_call(
    agent: &Agent,
    req: tarpc::Request<CallRequest>,
    caller: u32,
) -> Option<(
    u64,
    std::pin::Pin<Box<tokio::time::Timeout<impl std::future::Future<Output = CallReply> + Send>>>,
)> {
    let deadline = req.context.deadline;
    if Instant::now() >= deadline {
        return None;
    }
    let run = crate::server::handle(agent.clone(), deadline, req.message, caller);
    Some((
        req.id,
        Box::pin(tokio::time::timeout_at(deadline.into(), run)),
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
