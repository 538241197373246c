//! The calling end of a multiplexed (control) connection: tarpc's frames, our own dispatch.
//!
//! tarpc's own client is not on this path: measured on the 2-vCPU machine, its client channel
//! and dispatch task alone cost about 5 µs of CPU per call, more than the whole budget of the
//! throughput target (236k calls/s is 4.2 µs per call per process). What a dispatcher needs to
//! do here is small, because cancellation and deadlines are the caller's own (`call/`):
//! [`MuxClient::send`] registers a one-shot slot under a fresh id and queues the request at
//! once through the connection's [`Outbox`], without waiting; the returned [`Waiter`] waits for
//! the reply (so a caller can queue now and wait later). The connection's task reads replies
//! and fills the slots.
//!
//! Invariants:
//! - MUX-1: a call's slot is registered before its request is queued, and removed when its
//!   [`Waiter`] is dropped, so a reply finds its caller or nobody: a reply for an id nobody
//!   waits for (the caller gave up at its deadline) is read and dropped.
//! - MUX-2: when a connection ends (read error, end of stream, a frame above the limit, or
//!   `end`), every call waiting on it fails at once and no further request is queued on it; a
//!   request refused that way was never written ([`CallFailed::NotSent`]).
//! - MUX-4: every wait is bounded by the caller's deadline (the caller's own timer) or by the
//!   connection (MUX-2); the buffers are bounded by what the callers have in flight, each frame
//!   by the frame limit. (MUX-3 is the serving end's, `mux_server.rs`.)

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Instant;

use tokio::sync::oneshot;

use super::failure::CallFailed;
use super::frame::{self, Outbox, PushError};
use super::transport::Conn;
use crate::wire::{CallReply, CallRequest};

/// What a reply frame carries: the callee's reply, or tarpc's error for a request it refused.
type ReplyMsg = Result<CallReply, tarpc::ServerError>;

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
            Ok(Err(e)) => Err(CallFailed::Refused(e)),
            Err(_) => Err(CallFailed::Lost(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the connection ended while the call waited",
            ))),
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
        max_queued: usize,
    ) -> (
        Self,
        impl std::future::Future<Output = io::Result<()>> + Send + 'static,
    ) {
        let shared = Arc::new(ClientShared {
            out: Outbox::new(max_frame, max_queued),
            pending: Mutex::new(Pending::default()),
            next_id: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let task = async move {
            let _end = EndOnDrop(Arc::clone(&s));
            let (r, w) = tokio::io::split(conn);
            let mut replies = frame::reader(r, max_frame);
            let read = async {
                while let Some(reply) = frame::next_message(&mut replies).await {
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
                return Err(CallFailed::closed_connection());
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
            context: frame::request_context(deadline),
            id,
            message: req,
        });
        match waiter.shared.out.push(&msg) {
            Ok(()) => Ok(waiter),
            Err(PushError::Closed) => Err(CallFailed::closed_connection()),
            Err(PushError::Full(n)) => Err(CallFailed::NotSent {
                cause: io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{n} bytes are queued for the peer, which is not reading them"),
                ),
                broken: false,
            }),
            Err(PushError::Encode(cause)) => Err(CallFailed::NotSent {
                cause,
                broken: false,
            }),
        }
    }

    /// Ends the connection's calls (the connection's task is aborted by its owner).
    pub(crate) fn end(&self) {
        self.shared.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CallOk;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

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
            trace: None,
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
        let (c, task) = MuxClient::start(Box::new(a), max, 1 << 20);
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
        match frame::decode(&body).expect("a request frame") {
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
        let mut frame = bytes::BytesMut::new();
        frame::encode(&mut frame, &resp, usize::MAX).expect("encodes");
        peer.write_all(&frame).await.expect("frame");
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
        assert!(matches!(got, Err(CallFailed::Lost(_))), "{got:?}");
        let ended = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the task ended")
            .expect("joined");
        assert!(ended.is_err(), "the end of stream is reported");
        let refused = tokio::time::timeout(Duration::from_secs(10), call(&c, request(2), far()));
        match refused.await.expect("refused at once") {
            Err(CallFailed::NotSent { cause, broken }) => {
                assert_eq!(cause.kind(), io::ErrorKind::NotConnected);
                assert!(broken);
            }
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
        let mut frame = bytes::BytesMut::new();
        frame::encode(&mut frame, &resp, usize::MAX).expect("encodes");
        peer.write_all(&frame).await.expect("frame");
        let got = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("failed at once")
            .expect("joined");
        assert!(matches!(got, Err(CallFailed::Lost(_))), "{got:?}");
    }

    #[tokio::test]
    async fn a_request_above_the_limit_is_refused_before_it_is_queued() {
        let (c, _task, _peer) = client(64);
        let mut big = request(1);
        big.payload = vec![0; 1000];
        let refused = tokio::time::timeout(Duration::from_secs(10), call(&c, big, far()));
        match refused.await.expect("refused at once") {
            Err(CallFailed::NotSent { cause, broken }) => {
                assert_eq!(cause.kind(), io::ErrorKind::InvalidInput);
                assert!(!broken);
            }
            other => panic!("expected NotSent, got {other:?}"),
        }
        assert!(c.shared.pending().slots.is_empty());
        assert!(c.shared.out.is_empty(), "nothing half-queued");
    }
}
