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

use std::io;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use super::frame::{self, Outbox, PushError};
use super::serve::{callers_deadline, Serve};
use super::spin::Spin;
use super::transport::Conn;
use crate::lifecycle::Lifecycle;
use crate::wire::{CallReply, CallRequest};
use tokio_util::sync::CancellationToken;

/// Serves a control connection from `caller` until it ends.
pub(crate) async fn serve<S: Serve>(
    service: Arc<S>,
    conn: Conn,
    caller: u32,
    (max_frame, max_queued): (usize, usize),
    life: &Lifecycle,
    spin: &Spin,
    gone: &CancellationToken,
) -> io::Result<()> {
    let out = Arc::new(Outbox::new(max_frame, max_queued));
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
            let run = service.serve(caller, callers_deadline(deadline, now), req.message);
            let mut call = Box::pin(tokio::time::timeout_at(deadline.into(), run));
            match futures::poll!(call.as_mut()) {
                Poll::Ready(Ok(reply)) => respond(&out, id, reply),
                Poll::Ready(Err(_)) => {}
                Poll::Pending => {
                    let (stop, gone) = (life.stop.clone(), gone.clone());
                    let out = Arc::clone(&out);
                    life.calls.spawn(async move {
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
    let result = tokio::select! {
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
        let life = Arc::new(Lifecycle::new());
        let spin = Arc::new(Spin::new(Duration::ZERO));
        let (a, mut peer) = tokio::io::duplex(1 << 16);
        let serving = {
            let (life, spin) = (Arc::clone(&life), Arc::clone(&spin));
            tokio::spawn(async move {
                let gone = CancellationToken::new();
                serve(
                    Arc::new(Nap),
                    Box::new(a),
                    0,
                    (1 << 20, 1 << 20),
                    &life,
                    &spin,
                    &gone,
                )
                .await
            })
        };
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
}
