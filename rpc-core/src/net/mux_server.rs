//! The serving end of a multiplexed (control) connection.
//!
//! Each request is handed to the [`Serve`] implementation and polled once as it is read: a
//! handler that finishes without waiting (the common case for small calls) costs no spawn and
//! no wake-up. One that has to wait becomes a task of its own (its next poll registers that
//! task's waker), so it never holds up the connection. Its reply is queued when it is done.
//! tarpc's server is not on this path: its per-request machinery (a deadline queue entry, an
//! abort handle, a response channel, a span) costs more than a whole call's budget.
//!
//! - MUX-3: the serving end answers each request at most once, never after its deadline (a
//!   request past its deadline is dropped unanswered, as tarpc's server does; its caller gives
//!   up at the same deadline), and counts a request that waits as a call in flight for the
//!   shutdown drain ([`Lifecycle::calls`]).
//! - MUX-4: the requests of one connection that wait at once, and their argument bytes, stay
//!   within `max_in_flight` (calls, bytes): one more is refused before it runs ([`Serve::refuse`]),
//!   whatever its depth (nested calls skip the admission permits, not this); a request alone
//!   is never refused for its size. The framework's own functions (`rpc_core::*`: cancels,
//!   the shutdown barrier) are never refused, so a cancel can always free room.
//! - MUX-5: a reply served in place as its request was read is written before the
//!   connection's task yields (the reading half is polled before the writing half), so a task
//!   the request woke, which may go on to compute on the same runtime thread, cannot delay it.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use super::frame::{self, Outbox, PushError};
use super::serve::{callers_deadline, Serve};
use super::spin::Spin;
use super::transport::Conn;
use crate::lifecycle::Lifecycle;
use crate::wire::{CallReply, CallRequest, WireBlob};
use tokio_util::sync::CancellationToken;

/// The requests of one connection that wait, and their bytes (MUX-4).
#[derive(Default)]
struct InFlight {
    calls: AtomicUsize,
    bytes: AtomicUsize,
}

impl InFlight {
    /// Why a request of `size` bytes cannot wait beside those that do, if it cannot.
    fn full(&self, (max_calls, max_bytes): (usize, usize), size: usize) -> Option<String> {
        let (calls, bytes) = (
            self.calls.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        );
        if calls >= max_calls {
            return Some(format!(
                "{calls} calls from this caller are in flight here (limit max_in_flight_calls \
                 = {max_calls})"
            ));
        }
        if bytes > 0 && bytes.saturating_add(size) > max_bytes {
            return Some(format!(
                "{bytes} bytes of this caller's calls are in flight here and this one has \
                 {size} (limit max_in_flight_bytes = {max_bytes})"
            ));
        }
        None
    }
}

/// Counts one waiting request until dropped.
struct Waiting {
    of: Arc<InFlight>,
    size: usize,
}

impl Waiting {
    fn new(of: &Arc<InFlight>, size: usize) -> Self {
        of.calls.fetch_add(1, Ordering::Relaxed);
        of.bytes.fetch_add(size, Ordering::Relaxed);
        Self {
            of: Arc::clone(of),
            size,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.of.calls.fetch_sub(1, Ordering::Relaxed);
        self.of.bytes.fetch_sub(self.size, Ordering::Relaxed);
    }
}

/// The bytes a request's arguments take (or will, once its bulk blobs arrive).
fn request_bytes(req: &CallRequest) -> usize {
    let blobs: u64 = req
        .blobs
        .iter()
        .map(|b| match b {
            WireBlob::Inline(v) => v.len() as u64,
            WireBlob::Bulk { len, .. } => *len,
        })
        .sum();
    req.payload.len().saturating_add(blobs as usize)
}

/// Serves a control connection from `caller` until it ends.
pub(crate) async fn serve<S: Serve>(
    service: Arc<S>,
    conn: Conn,
    caller: u32,
    (max_frame, max_queued, max_in_flight): (usize, usize, (usize, usize)),
    life: &Lifecycle,
    spin: &Spin,
    gone: &CancellationToken,
) -> io::Result<()> {
    let out = Arc::new(Outbox::new(max_frame, max_queued));
    let in_flight = Arc::new(InFlight::default());
    let (r, w) = tokio::io::split(conn);
    let mut requests = frame::reader(r, max_frame);
    let read = async {
        while let Some(msg) = frame::next_message(&mut requests).await {
            let msg: frame::InMessage<CallRequest> = msg?;
            // Our callers cancel by message of their own (`call/cancel.rs`) and enforce their
            // deadlines themselves; they never send tarpc's cancel.
            let frame::InMessage::Request(req) = msg else {
                continue;
            };
            spin.touch();
            let now = Instant::now();
            let deadline = req.deadline(now);
            if now >= deadline {
                continue;
            }
            let id = req.id;
            let size = request_bytes(&req.message);
            let internal = req.message.fn_name.starts_with("rpc_core::");
            if let Some(why) = in_flight.full(max_in_flight, size).filter(|_| !internal) {
                respond(&out, id, service.refuse(caller, &req.message, why));
                continue;
            }
            let run = service.serve(caller, callers_deadline(deadline, now), req.message);
            let mut call = Box::pin(tokio::time::timeout_at(deadline.into(), run));
            match futures::poll!(call.as_mut()) {
                Poll::Ready(Ok(reply)) => respond(&out, id, reply),
                Poll::Ready(Err(_)) => {}
                Poll::Pending => {
                    let (stop, gone) = (life.stop.clone(), gone.clone());
                    let out = Arc::clone(&out);
                    let waiting = Waiting::new(&in_flight, size);
                    life.calls.spawn(async move {
                        let _waiting = waiting;
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            // The caller was declared failed: nobody waits for the reply.
                            _ = gone.cancelled() => {}
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
    // MUX-5: reading first, so the replies of requests served inline as they were read are
    // written in the same poll, before this task yields: a task they woke (a collective's
    // member waiting for this message) may go on to compute on this runtime thread, and the
    // reply must not wait for that.
    let result = tokio::select! {
        biased;
        r = read => r,
        w = out.write_loop(w) => w,
    };
    out.close();
    result
}

/// Queues the reply to request `id`.
fn respond(out: &Outbox, id: u64, reply: CallReply) {
    let resp = tarpc::Response {
        request_id: id,
        message: Ok::<_, tarpc::ServerError>(reply),
    };
    match out.push(&resp) {
        // A caller that stopped reading loses its replies, not this worker's memory.
        Ok(()) | Err(PushError::Closed) | Err(PushError::Full(_)) => {}
        Err(PushError::Encode(e)) => {
            // The callee refuses results above the frame limit; an error this large still
            // gets an answer, so its caller does not wait for its deadline.
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A service that sleeps as many milliseconds as the request's payload says, then echoes
    /// the payload.
    struct Nap;

    impl Serve for Nap {
        #[allow(clippy::manual_async_fn)]
        fn serve(
            self: &Arc<Self>,
            _caller: u32,
            _deadline: Option<Instant>,
            req: CallRequest,
        ) -> impl std::future::Future<Output = CallReply> + Send + 'static {
            async move {
                let ms = u64::from_le_bytes(req.payload[..8].try_into().expect("8 bytes"));
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(CallOk {
                    payload: req.payload,
                    blobs: Vec::new(),
                })
            }
        }

        fn refuse(self: &Arc<Self>, _caller: u32, _req: &CallRequest, why: String) -> CallReply {
            Err(crate::RemoteError::new_protocol("nap", "test", why))
        }
    }

    /// A service that wakes a waiting task and answers at once.
    struct Wakes(Arc<tokio::sync::Notify>);

    impl Serve for Wakes {
        #[allow(clippy::manual_async_fn)]
        fn serve(
            self: &Arc<Self>,
            _caller: u32,
            _deadline: Option<Instant>,
            req: CallRequest,
        ) -> impl std::future::Future<Output = CallReply> + Send + 'static {
            self.0.notify_one();
            async move {
                Ok(CallOk {
                    payload: req.payload,
                    blobs: Vec::new(),
                })
            }
        }

        fn refuse(self: &Arc<Self>, _caller: u32, _req: &CallRequest, why: String) -> CallReply {
            Err(crate::RemoteError::new_protocol("wakes", "test", why))
        }
    }

    /// MUX-5: a reply served inline is written before the connection's task yields, so a
    /// task its request woke, which then computes on the runtime's only thread (a collective's
    /// member leaving a barrier for its backward pass), does not hold it back. Before, the
    /// read and write halves were polled in random order: in about half of the requests the
    /// reply waited the whole 400 ms the woken task blocked (seen in `rpc-bench ddp`'s
    /// after-backward step as a barrier ending 130 ms late on one rank; here in 8 tries).
    #[test]
    fn an_inline_reply_leaves_before_the_task_it_woke_runs() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (a, mut peer) = tokio::io::duplex(1 << 16);
        let woke = Arc::new(tokio::sync::Notify::new());
        const TRIES: usize = 8;
        let _serving = {
            let woke = Arc::clone(&woke);
            rt.spawn(async move {
                let (life, gone) = (Lifecycle::new(), CancellationToken::new());
                let spin = Spin::new(Duration::ZERO);
                let limits = (1 << 20, 1 << 20, (usize::MAX, usize::MAX));
                serve(
                    Arc::new(Wakes(woke)),
                    Box::new(a),
                    0,
                    limits,
                    &life,
                    &spin,
                    &gone,
                )
                .await
            })
        };
        let blocker = rt.spawn(async move {
            for _ in 0..TRIES {
                woke.notified().await;
                std::thread::sleep(Duration::from_millis(400));
            }
        });
        // The calling end runs on a thread and runtime of its own.
        let caller = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut took = Vec::new();
                for id in 0..TRIES as u64 {
                    let t = Instant::now();
                    send(&mut peer, id, 0, t + Duration::from_secs(20)).await;
                    let r = tokio::time::timeout(Duration::from_secs(10), recv(&mut peer))
                        .await
                        .expect("answered");
                    assert_eq!(r.request_id, id);
                    took.push(t.elapsed());
                    // The woken task's 400 ms end before the next request.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                took
            })
        });
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), blocker)
                .await
                .expect("the blocking task woke for every request")
                .expect("joined");
        });
        let took = caller.join().expect("the caller's thread");
        assert!(
            took.iter().all(|t| *t < Duration::from_millis(200)),
            "replies waited for the task their request woke: {took:?}"
        );
    }

    /// Serves `Nap` on one end of a pipe with `max_in_flight`; the other end.
    fn nap_server(
        max_in_flight: (usize, usize),
    ) -> (
        tokio::io::DuplexStream,
        Arc<Lifecycle>,
        tokio::task::JoinHandle<io::Result<()>>,
    ) {
        let life = Arc::new(Lifecycle::new());
        let spin = Arc::new(Spin::new(Duration::ZERO));
        let (a, peer) = tokio::io::duplex(1 << 16);
        let serving = {
            let (life, spin) = (Arc::clone(&life), Arc::clone(&spin));
            tokio::spawn(async move {
                let gone = CancellationToken::new();
                let limits = (1 << 20, 1 << 20, max_in_flight);
                serve(Arc::new(Nap), Box::new(a), 0, limits, &life, &spin, &gone).await
            })
        };
        (peer, life, serving)
    }

    async fn send(peer: &mut tokio::io::DuplexStream, id: u64, ms: u64, deadline: Instant) {
        let req = CallRequest {
            fn_name: "nap".into(),
            sig: 0,
            depth: 0,
            payload: ms.to_le_bytes().to_vec(),
            blobs: Vec::new(),
            keep: None,
            meta: Default::default(),
            cancel_id: None,
            trace: None,
        };
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context: frame::request_context(deadline),
            id,
            message: req,
        });
        let mut buf = bytes::BytesMut::new();
        frame::encode(&mut buf, &msg, usize::MAX).expect("encodes");
        peer.write_all(&buf).await.expect("frame");
    }

    async fn recv(peer: &mut tokio::io::DuplexStream) -> tarpc::Response<CallReply> {
        let len = peer.read_u32().await.expect("length");
        let mut body = vec![0; len as usize];
        peer.read_exact(&mut body).await.expect("body");
        frame::decode(&body).expect("a reply frame")
    }

    /// MUX-3: a request past its deadline, or one whose handler is still waiting at its
    /// deadline, is dropped unanswered; a handler that waits does not hold up the next request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_are_answered_once_and_never_after_their_deadline() {
        let (mut peer, life, serving) = nap_server((usize::MAX, usize::MAX));
        let now = Instant::now();
        send(&mut peer, 1, 0, now).await; // already expired
        send(&mut peer, 2, 600, now + Duration::from_millis(150)).await; // outlives it
        send(&mut peer, 3, 300, now + Duration::from_secs(20)).await; // waits, answered
        send(&mut peer, 4, 0, now + Duration::from_secs(20)).await; // at once
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
        assert_eq!(ok.payload, 300u64.to_le_bytes());
        // Nothing else comes: not request 1, not request 2 (whose deadline passed).
        let more = tokio::time::timeout(Duration::from_millis(1000), recv(&mut peer)).await;
        assert!(more.is_err(), "an expired request was answered: {more:?}");
        assert!(life.calls.is_empty(), "answered calls are not in flight");
        drop(peer);
        let ended = tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("the connection ended with its peer")
            .expect("joined");
        assert!(ended.is_ok(), "{ended:?}");
    }

    /// MUX-4: with two calls allowed to wait, a third and a fourth are refused at once, and
    /// once the two are answered the next waits again; a request's bytes count too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_requests_past_the_limit_are_refused_at_once() {
        let (mut peer, _life, _serving) = nap_server((2, usize::MAX));
        let later = Instant::now() + Duration::from_secs(20);
        for id in 1..=4 {
            send(&mut peer, id, 300, later).await;
        }
        let mut got = Vec::new();
        for _ in 0..4 {
            let r = tokio::time::timeout(Duration::from_secs(10), recv(&mut peer))
                .await
                .expect("answered");
            let refused = r.message.expect("a reply").is_err();
            got.push((r.request_id, refused));
        }
        got[2..].sort();
        assert_eq!(got, [(3, true), (4, true), (1, false), (2, false)]);
        send(&mut peer, 5, 0, later).await;
        let r = recv(&mut peer).await;
        assert_eq!(r.request_id, 5);
        assert!(r.message.expect("a reply").is_ok(), "room again");

        // Bytes: 8 bytes each, 12 allowed: the second waiting request does not fit.
        let (mut peer, _life, _serving) = nap_server((usize::MAX, 12));
        send(&mut peer, 1, 300, later).await;
        send(&mut peer, 2, 300, later).await;
        let r = recv(&mut peer).await;
        assert_eq!(r.request_id, 2);
        let e = r.message.expect("a reply").unwrap_err();
        assert!(e.message.contains("max_in_flight_bytes = 12"), "{e}");
        assert_eq!(recv(&mut peer).await.request_id, 1);
    }
}
