//! Blocking connections: a calling thread's own connection to a peer, served by a thread of
//! the peer's own ([`crate::Config::sync_connections`]).
//!
//! A blocking call from a thread that is not running async code would otherwise hand its
//! request to a runtime thread, which writes it, and sleep until a runtime thread hands the
//! reply back; the callee's runtime thread in turn sleeps in `epoll` between requests. On small
//! or virtualised machines each of those wake-ups costs more than the network round trip itself
//! (a thread blocked in `recv` is woken on the sender's core; a thread in `epoll_wait` or on a
//! futex usually on another, idle one). So blocking calls take the classic thread-per-
//! connection route at both ends, as a raw socket ping-pong would:
//!
//! - the calling thread keeps one authenticated TCP connection per peer (dialled on first use,
//!   in a thread-local table), writes the request frame itself and reads the reply: polling the
//!   socket for up to [`crate::Config::busy_poll`], then blocking; at most
//!   `Config::max_sync_connections` are open from one worker, and threads beyond them make
//!   their blocking calls through the runtime;
//! - the callee serves that connection on a thread of its own, which reads each request
//!   (polling for it likewise after each reply), runs it to completion through the [`Serve`]
//!   seam in the runtime's context (`spin::block_on`: nested calls and timers work as anywhere
//!   else) and writes the reply.
//!
//! Frames are the multiplexed connection's (`frame/`).
//!
//! Invariants:
//! - DIR-1: a connection carries one call at a time and goes back to the table only after
//!   that call's reply was read whole. A call that ends any other way (deadline, I/O error,
//!   a malformed frame) closes its connection, so a late reply can never be read as the reply
//!   of the next call. The serving end drops a request that runs past its deadline without
//!   answering it, as tarpc's server does; its caller gives up at the same deadline.
//! - DIR-2: every wait is bounded: dialling by the connect timeout, the handshake by the
//!   handshake timeout, writing and reading by the call's deadline. A call without a deadline
//!   still ends when the connection closes or the worker closes (checked every 200 ms).
//! - DIR-3: shutdown treats blocking connections like control connections. A request being
//!   served counts as a call in flight for the drain (phase 2), the calling ends are closed
//!   with the other outgoing connections (phase 3), and a serving end is open until its caller
//!   closes it, or until phase 4 shuts it down. A calling end is also closed when its thread
//!   ends, and when next looked at after its worker closed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use super::auth::ConnKind;
use super::config::NetConfig;
use super::dial::{DialError, Dialer};
use super::failure::CallFailed;
use super::frame::{self, BlockingFrames};
use super::seal::Keys;
use super::serve::{callers_deadline, Serve, NO_DEADLINE};
use super::spin::{self, Spin};
use crate::lifecycle::Lifecycle;
use crate::wire::{CallReply, CallRequest};
use tokio_util::sync::CancellationToken;

/// Open blocking connections of one direction, with the peer at the other end, so shutdown
/// and failure verdicts can close them.
#[derive(Default)]
struct Open {
    next: AtomicU64,
    streams: Mutex<HashMap<u64, (u32, TcpStream)>>,
}

impl Open {
    /// Registers a clone of `stream`, a connection with `peer`; the returned key unregisters
    /// it.
    fn register(&self, peer: u32, stream: &TcpStream) -> io::Result<u64> {
        let clone = stream.try_clone()?;
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(key, (peer, clone));
        Ok(key)
    }

    /// Shuts down every connection with `peer`; blocked reads and writes on them return.
    fn close_peer(&self, peer: u32) {
        for (_, (p, s)) in self.lock().iter() {
            if *p == peer {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn unregister(&self, key: u64) {
        self.lock().remove(&key);
    }

    /// Shuts every registered connection down; blocked reads and writes on them return.
    fn close_all(&self) {
        for (_, (_, s)) in self.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (u32, TcpStream)>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One worker's blocking connections: the calling ends its threads opened, the serving ends
/// its peers' threads opened.
pub(crate) struct Blocking {
    cfg: Arc<NetConfig>,
    dialer: Arc<Dialer>,
    life: Arc<Lifecycle>,
    spin: Arc<Spin>,
    runtime: tokio::runtime::Handle,
    outgoing: Open,
    incoming: Open,
    /// Calling ends open or being dialled (`Config::max_sync_connections`).
    reserved: AtomicUsize,
}

/// One thread's connection to one peer; holds one of its worker's places for calling ends.
pub(crate) struct SyncConn {
    owner: Weak<Blocking>,
    to: u32,
    key: u64,
    frames: BlockingFrames,
    next_id: u64,
}

impl Drop for SyncConn {
    fn drop(&mut self) {
        if let Some(b) = self.owner.upgrade() {
            b.outgoing.unregister(self.key);
            b.release();
        }
    }
}

thread_local! {
    static CONNS: RefCell<Vec<SyncConn>> = const { RefCell::new(Vec::new()) };
}

impl Blocking {
    pub(crate) fn new(
        cfg: Arc<NetConfig>,
        dialer: Arc<Dialer>,
        life: Arc<Lifecycle>,
        spin: Arc<Spin>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Self {
            cfg,
            dialer,
            life,
            spin,
            runtime,
            outgoing: Open::default(),
            incoming: Open::default(),
            reserved: AtomicUsize::new(0),
        }
    }

    /// Takes one of `max` places for a calling end; false if none is free.
    fn try_reserve(&self) -> bool {
        let max = self.cfg.max_sync_connections;
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn release(&self) {
        self.reserved.fetch_sub(1, Ordering::AcqRel);
    }

    /// This thread's connection to `to`: its own, or a new one if a place is free
    /// (`Config::max_sync_connections`); `None`: make the call through the runtime.
    pub(crate) fn conn(
        self: &Arc<Self>,
        to: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<SyncConn>, DialError> {
        if let Some(c) = self.take(to) {
            return Ok(Some(c));
        }
        if !self.try_reserve() {
            return Ok(None);
        }
        let by = deadline.unwrap_or_else(|| Instant::now() + self.cfg.connect_timeout);
        let dialled = self.dial(to, by);
        if dialled.is_err() {
            self.release();
        }
        dialled.map(Some)
    }

    /// Dials `to` on a place already reserved.
    fn dial(self: &Arc<Self>, to: u32, deadline: Instant) -> Result<SyncConn, DialError> {
        let (stream, keys) = self.dialer.dial_blocking(to, ConnKind::Sync, deadline)?;
        let key = self
            .outgoing
            .register(to, &stream)
            .map_err(|e| self.dialer.failed(to, e))?;
        Ok(SyncConn {
            owner: Arc::downgrade(self),
            to,
            key,
            frames: BlockingFrames::new(stream, keys, self.cfg.max_frame_bytes, self.cfg.busy_poll),
            next_id: 0,
        })
    }

    /// Takes this thread's connection to `to` out of the table (DIR-1: it is put back only
    /// after a complete round trip), dropping those of workers that are closed or gone (DIR-3).
    fn take(self: &Arc<Self>, to: u32) -> Option<SyncConn> {
        CONNS.with(|c| {
            let mut c = c.borrow_mut();
            c.retain(|x| x.owner.upgrade().is_some_and(|b| !b.life.is_closed()));
            let i = c
                .iter()
                .position(|x| x.to == to && std::ptr::eq(x.owner.as_ptr(), Arc::as_ptr(self)))?;
            Some(c.swap_remove(i))
        })
    }

    /// Shuts down the calling ends this worker's threads opened (shutdown phase 3).
    pub(crate) fn close_outgoing(&self) {
        self.outgoing.close_all();
    }

    /// Shuts down the serving ends (shutdown phase 4).
    pub(crate) fn close_incoming(&self) {
        self.incoming.close_all();
    }

    /// Shuts down every blocking connection with `peer`, both ways (it was declared failed):
    /// calls waiting on it fail at once, its serving threads end.
    pub(crate) fn close_peer(&self, peer: u32) {
        self.outgoing.close_peer(peer);
        self.incoming.close_peer(peer);
    }

    /// Serves a blocking connection from `caller` on a thread of its own (DIR-3: the
    /// connection counts as open until that thread ends; shutdown's last phase closes it).
    /// Between requests the thread holds only a weak reference to `service`.
    pub(crate) async fn serve<S: Serve>(
        self: &Arc<Self>,
        stream: TcpStream,
        keys: Option<Keys>,
        caller: u32,
        service: Weak<S>,
        gone: CancellationToken,
    ) {
        let key = match self.incoming.register(caller, &stream) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(caller, cause = %e, "refused a sync connection");
                return;
            }
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let this = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("rpc-sync-{caller}"))
            .spawn(move || {
                this.serve_thread(&service, stream, keys, caller, &gone);
                this.incoming.unregister(key);
                drop(done_tx);
            });
        if let Err(e) = spawned {
            self.incoming.unregister(key);
            tracing::warn!(caller, cause = %e, "cannot start a thread for a sync connection");
            return;
        }
        let _ = done_rx.await;
    }

    /// The serving thread: one request at a time, each run to completion before the next is
    /// read.
    fn serve_thread<S: Serve>(
        &self,
        service: &Weak<S>,
        stream: TcpStream,
        keys: Option<Keys>,
        caller: u32,
        caller_gone: &CancellationToken,
    ) {
        let mut frames =
            BlockingFrames::new(stream, keys, self.cfg.max_frame_bytes, self.cfg.busy_poll);
        let gone =
            || service.strong_count() == 0 || self.life.is_closed() || caller_gone.is_cancelled();
        loop {
            let msg: frame::InMessage<CallRequest> = match frames.recv(None, &gone) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(caller, cause = ?e, "sync connection ended");
                    return;
                }
            };
            let frame::InMessage::Request(req) = msg else {
                // The calling thread waits for each reply; it never cancels by tarpc message.
                continue;
            };
            let Some(service) = service.upgrade() else {
                return;
            };
            self.spin.touch();
            let deadline = req.deadline(Instant::now());
            let id = req.id;
            // Counted as a call in flight for shutdown's drain until its reply is written;
            // abandoned when the worker aborts what is left.
            let token = self.life.calls.token();
            let stop = self.life.stop.clone();
            let caller_gone = caller_gone.clone();
            let run = service.serve(
                caller,
                callers_deadline(deadline, Instant::now()),
                req.message,
            );
            let reply = spin::block_on(&self.runtime, self.cfg.busy_poll, async {
                tokio::select! {
                    r = tokio::time::timeout_at(deadline.into(), run) => Some(r),
                    () = stop.cancelled() => None,
                    () = caller_gone.cancelled() => None,
                }
            });
            let reply = match reply {
                Some(Ok(reply)) => reply,
                // As tarpc's server does: a call past its deadline is dropped unanswered. Its
                // caller stops waiting at the same deadline and closes the connection (DIR-1).
                Some(Err(_)) => continue,
                None => return,
            };
            let resp = tarpc::Response {
                request_id: id,
                message: Ok::<_, tarpc::ServerError>(reply),
            };
            // A caller that stopped reading does not hold this thread for long.
            let write_by = Some(Instant::now() + self.cfg.handshake_timeout);
            let sent = frames.send(&resp, write_by, &gone);
            drop(token);
            drop(service);
            if let Err(e) = sent {
                tracing::debug!(caller, cause = ?e, "sync connection ended");
                return;
            }
        }
    }
}

impl SyncConn {
    /// Writes `req` and reads its reply (DIR-1): on success the connection goes back to this
    /// thread's table, on failure it is closed. Blocks the thread.
    pub(crate) fn call(
        mut self,
        req: CallRequest,
        deadline: Option<Instant>,
    ) -> Result<CallReply, CallFailed> {
        let Some(owner) = self.owner.upgrade() else {
            return Err(CallFailed::Closed);
        };
        let closed = || owner.life.is_closed();
        let id = self.next_id;
        self.next_id += 1;
        let by = deadline.unwrap_or_else(|| Instant::now() + NO_DEADLINE);
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context: frame::request_context(by),
            id,
            message: req,
        });
        self.frames.send(&msg, deadline, &closed)?;
        let reply: tarpc::Response<CallReply> = self.frames.recv(deadline, &closed)?;
        if reply.request_id != id {
            return Err(CallFailed::Lost(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "reply to request {} while waiting for {id}",
                    reply.request_id
                ),
            )));
        }
        drop(owner);
        self.put_back();
        reply.message.map_err(CallFailed::Refused)
    }

    /// Gives the connection back to this thread's table unused.
    pub(crate) fn put_back(self) {
        CONNS.with(|c| c.borrow_mut().push(self));
    }
}
