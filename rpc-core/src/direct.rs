//! Blocking calls on the calling thread's own connection ([`crate::Config::sync_connections`]).
//!
//! `rpc_sync` from a thread that is not running async code would otherwise hand its request
//! to a runtime thread, which writes it, and sleep until a runtime thread hands the reply
//! back; the callee's runtime thread in turn sleeps in `epoll` between requests. On small or
//! virtualised machines each of those wake-ups costs more than the network round trip itself
//! (a thread blocked in `recv` is woken on the sender's core; a thread in `epoll_wait` or on
//! a futex usually on another, idle one). So blocking calls take the classic thread-per-
//! connection route at both ends, as a raw socket ping-pong would:
//!
//! - the calling thread keeps one authenticated TCP connection per peer (dialled on first use,
//!   in a thread-local table), writes the request frame itself and reads the reply: polling
//!   the socket for up to [`crate::Config::busy_poll`], then blocking;
//!   at most `Config::max_sync_connections` are open from one worker, and threads beyond them
//!   make their blocking calls through the runtime as before;
//! - the callee serves that connection on a thread of its own, which reads each request
//!   (polling for it likewise after each reply), runs it to completion in the runtime's
//!   context (`spin::block_on`: nested calls and timers work as anywhere else) and writes
//!   the reply.
//!
//! Frames are tarpc's (the same codec, frame limit and message types as the control
//! connection). Everything around the round trip is shared with the async path: the envelope,
//! what arguments and results lend (`blob.rs`), bulk blobs (large arguments or results still
//! move on the bulk path, through the runtime), the callee's admission, cancellation tokens and
//! panic isolation (`server::handle`), and the reply's decoding.
//!
//! Invariants:
//! - DIR-1: a connection carries one call at a time and goes back to the table only after
//!   that call's reply was read whole. A call that ends any other way (deadline, I/O error,
//!   a malformed frame) closes its connection, so a late reply can never be read as the reply
//!   of the next call. The serving end drops a request that runs past its deadline without
//!   answering it, as tarpc's server does; its caller gives up at the same deadline.
//! - DIR-2: every wait is bounded: dialling by the connect timeout, the handshake by the
//!   handshake timeout, writing and reading by the call's deadline. A call without a deadline
//!   still ends when the connection closes or the agent closes (checked every `SLICE`).
//! - DIR-3: shutdown treats sync connections like control connections. A request being served
//!   counts as a call in flight for the drain (phase 2), the calling ends are closed with the
//!   other outgoing connections (phase 3), and a serving end is open until its caller closes it,
//!   or until phase 4 shuts it down. A calling end is also closed when its thread ends, and
//!   when next looked at after its agent closed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use crate::agent::{Agent, Inner};
use crate::auth::{self, ConnKind};
use crate::context::NO_DEADLINE;
use crate::error::RpcError;
use crate::registry::RemoteFn;
use crate::wire::{CallReply, CallRequest};

/// The longest a blocking read or write waits before checking the deadline and whether the
/// agent closed.
const SLICE: Duration = Duration::from_millis(200);

/// A connection's receive buffer; it grows for larger frames, and goes back to this size once
/// a frame above `KEEP_BUFFER` has been consumed (send buffers likewise).
const READ_BUFFER: usize = 16 << 10;
const KEEP_BUFFER: usize = 1 << 20;

/// The part of `deadline` left, at least a millisecond (a zero socket timeout means none).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Why a frame could not be sent or received.
#[derive(Debug)]
enum Failure {
    /// Not one byte of the frame was written: the peer cannot have read it.
    NotSent(io::Error),
    /// The connection failed (or carried garbage) part way.
    Lost(io::Error),
    /// The deadline passed.
    Deadline,
    /// The agent closed while waiting.
    Closed,
}

/// Blocking tarpc frames (a 4-byte big-endian length, then the bincode message) on a TCP
/// stream. Socket timeouts are `SLICE` (shorter only near a deadline), so a wait wakes up
/// to check its deadline without a system call per frame to set them.
struct Frames {
    stream: TcpStream,
    /// Received bytes not yet consumed: `rbuf[rpos..rend]`.
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    wbuf: Vec<u8>,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    /// How long a read polls the socket before it blocks ([`crate::Config::busy_poll`]).
    spin: Duration,
}

impl Frames {
    fn new(stream: TcpStream, spin: Duration) -> Self {
        Self {
            spin,
            stream,
            rbuf: vec![0; READ_BUFFER],
            rpos: 0,
            rend: 0,
            wbuf: Vec::new(),
            read_timeout: None,
            write_timeout: None,
        }
    }

    /// The timeout for the next wait; `Err` once the deadline has passed.
    fn slice(deadline: Option<Instant>) -> Result<Duration, Failure> {
        match deadline {
            Some(d) if Instant::now() >= d => Err(Failure::Deadline),
            Some(d) => Ok(left(d).min(SLICE)),
            None => Ok(SLICE),
        }
    }

    fn send<T: Serialize>(
        &mut self,
        msg: &T,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<(), Failure> {
        self.wbuf.clear();
        self.wbuf.extend_from_slice(&[0; 4]);
        bincode::DefaultOptions::new()
            .serialize_into(&mut self.wbuf, msg)
            .map_err(|e| Failure::NotSent(io::Error::other(e)))?;
        let len = u32::try_from(self.wbuf.len() - 4)
            .map_err(|_| Failure::NotSent(io::Error::other("frame above 4 GiB")))?;
        self.wbuf[..4].copy_from_slice(&len.to_be_bytes());
        let mut done = 0;
        while done < self.wbuf.len() {
            let t = Some(Self::slice(deadline)?);
            if self.write_timeout != t {
                self.stream.set_write_timeout(t).map_err(Failure::NotSent)?;
                self.write_timeout = t;
            }
            match self.stream.write(&self.wbuf[done..]) {
                Ok(0) => {
                    let e = io::Error::new(io::ErrorKind::WriteZero, "connection closed");
                    return Err(if done == 0 {
                        Failure::NotSent(e)
                    } else {
                        Failure::Lost(e)
                    });
                }
                Ok(n) => done += n,
                Err(e) if is_timeout(&e) => {
                    if closed() {
                        return Err(Failure::Closed);
                    }
                }
                Err(e) if done == 0 => return Err(Failure::NotSent(e)),
                Err(e) => return Err(Failure::Lost(e)),
            }
        }
        if self.wbuf.capacity() > KEEP_BUFFER {
            self.wbuf = Vec::new();
        }
        Ok(())
    }

    /// Receives one frame of at most `max` bytes.
    fn recv<T: DeserializeOwned>(
        &mut self,
        max: usize,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<T, Failure> {
        self.fill(4, deadline, closed)?;
        let head: [u8; 4] = self.rbuf[self.rpos..self.rpos + 4]
            .try_into()
            .expect("4 bytes");
        let len = u32::from_be_bytes(head) as usize;
        if len > max {
            return Err(Failure::Lost(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes is above the limit of {max}"),
            )));
        }
        self.fill(4 + len, deadline, closed)?;
        let body = &self.rbuf[self.rpos + 4..self.rpos + 4 + len];
        let msg = bincode::DefaultOptions::new()
            .deserialize(body)
            .map_err(|e| Failure::Lost(io::Error::new(io::ErrorKind::InvalidData, e)));
        self.rpos += 4 + len;
        // A connection that once carried a large frame does not keep its buffer.
        if self.rpos == self.rend && self.rbuf.len() > KEEP_BUFFER {
            self.rbuf = vec![0; READ_BUFFER];
            (self.rpos, self.rend) = (0, 0);
        }
        msg
    }

    /// Ensures `n` unconsumed bytes are buffered.
    fn fill(
        &mut self,
        n: usize,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<(), Failure> {
        if self.rend - self.rpos >= n {
            return Ok(());
        }
        // Move what is left to the front, and make room for `n`.
        self.rbuf.copy_within(self.rpos..self.rend, 0);
        self.rend -= self.rpos;
        self.rpos = 0;
        if self.rbuf.len() < n {
            self.rbuf.resize(n, 0);
        }
        self.poll_for(n)?;
        while self.rend < n {
            let t = Some(Self::slice(deadline)?);
            if self.read_timeout != t {
                self.stream.set_read_timeout(t).map_err(Failure::Lost)?;
                self.read_timeout = t;
            }
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => {
                    return Err(Failure::Lost(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    )))
                }
                Ok(k) => self.rend += k,
                Err(e) if is_timeout(&e) => {
                    if closed() {
                        return Err(Failure::Closed);
                    }
                }
                Err(e) => return Err(Failure::Lost(e)),
            }
        }
        Ok(())
    }

    /// Reads without blocking until `n` bytes are buffered or `spin` has passed, giving way
    /// to any other thread runnable on this core between tries: a reply that comes within
    /// the window is read by a thread that never slept, so the sender wakes nobody.
    fn poll_for(&mut self, n: usize) -> Result<(), Failure> {
        if self.spin.is_zero() {
            return Ok(());
        }
        let until = Instant::now() + self.spin;
        while self.rend < n {
            match rustix::net::recv(
                &self.stream,
                &mut self.rbuf[self.rend..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((0, _)) => {
                    return Err(Failure::Lost(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    )))
                }
                Ok((k, _)) => self.rend += k,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {
                    if Instant::now() >= until {
                        return Ok(());
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(Failure::Lost(e.into())),
            }
        }
        Ok(())
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// A registry of open sync connections (an agent keeps one for each end), so shutdown can
/// close them.
#[derive(Default)]
pub(crate) struct SyncConns {
    next: std::sync::atomic::AtomicU64,
    open: Mutex<HashMap<u64, TcpStream>>,
    /// Calling ends open or being dialled (`Config::max_sync_connections`).
    reserved: std::sync::atomic::AtomicUsize,
}

impl SyncConns {
    /// Takes one of `max` places for a calling end; false if none is free.
    fn try_reserve(&self, max: usize) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        self.reserved
            .fetch_update(AcqRel, Acquire, |n| (n < max).then_some(n + 1))
            .is_ok()
    }

    fn release(&self) {
        self.reserved
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Registers a clone of `stream`; the returned key unregisters it.
    fn register(&self, stream: &TcpStream) -> io::Result<u64> {
        let clone = stream.try_clone()?;
        let key = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(key, clone);
        Ok(key)
    }

    fn unregister(&self, key: u64) {
        self.lock().remove(&key);
    }

    /// Shuts every registered connection down; blocked reads and writes on them return.
    pub(crate) fn close_all(&self) {
        for (_, s) in self.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One thread's connection to one peer of one agent; holds one of the agent's places for
/// calling ends.
pub(crate) struct SyncConn {
    agent: Weak<Inner>,
    to: u32,
    key: u64,
    frames: Frames,
    next_id: u64,
}

impl Drop for SyncConn {
    fn drop(&mut self) {
        if let Some(a) = self.agent.upgrade() {
            a.sync_out.unregister(self.key);
            a.sync_out.release();
        }
    }
}

thread_local! {
    static CONNS: RefCell<Vec<SyncConn>> = const { RefCell::new(Vec::new()) };
}

/// Takes this thread's connection to `to` out of the table (DIR-1: it is put back only after
/// a complete round trip), dropping those of agents that are closed or gone (DIR-3).
fn take(agent: &Arc<Inner>, to: u32) -> Option<SyncConn> {
    CONNS.with(|c| {
        let mut c = c.borrow_mut();
        c.retain(|x| x.agent.upgrade().is_some_and(|a| !a.is_closed()));
        let i = c
            .iter()
            .position(|x| x.to == to && std::ptr::eq(x.agent.as_ptr(), Arc::as_ptr(agent)))?;
        Some(c.swap_remove(i))
    })
}

fn put_back(conn: SyncConn) {
    CONNS.with(|c| c.borrow_mut().push(conn));
}

impl SyncConn {
    /// Dials `to`, on a place the caller reserved (given back if the dial fails).
    fn dial(agent: &Agent, to: u32, deadline: Instant) -> Result<Self, RpcError> {
        let dialled = Self::dial_reserved(agent, to, deadline);
        if dialled.is_err() {
            agent.inner.sync_out.release();
        }
        dialled
    }

    fn dial_reserved(agent: &Agent, to: u32, deadline: Instant) -> Result<Self, RpcError> {
        let inner = &agent.inner;
        let peer = &inner.peers[to as usize];
        let unreachable = |source: io::Error| RpcError::Unreachable {
            worker: peer.info.name.clone(),
            addr: peer.addr.clone(),
            source,
        };
        let cfg = &inner.cfg;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
        let mut stream = None;
        for addr in peer.addr.to_socket_addrs().map_err(unreachable)? {
            match TcpStream::connect_timeout(&addr, cfg.connect_timeout.min(left(deadline))) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let mut stream = stream.ok_or_else(|| unreachable(last))?;
        let setup = |s: &mut TcpStream| -> io::Result<u64> {
            s.set_nodelay(true)?;
            let t = Some(cfg.handshake_timeout.min(left(deadline)));
            s.set_read_timeout(t)?;
            s.set_write_timeout(t)?;
            auth::client_blocking(s, &cfg.secret, ConnKind::Sync, cfg.rank)?;
            inner.sync_out.register(s)
        };
        let key = setup(&mut stream).map_err(unreachable)?;
        let mut frames = Frames::new(stream, cfg.busy_poll);
        // The handshake left its own timeouts set: `Frames` sets its own before waiting.
        frames.read_timeout = Some(Duration::ZERO);
        frames.write_timeout = Some(Duration::ZERO);
        Ok(Self {
            agent: Arc::downgrade(inner),
            to,
            key,
            frames,
            next_id: 0,
        })
    }

    /// Writes `req` and reads its reply.
    fn round_trip(
        &mut self,
        inner: &Inner,
        req: CallRequest,
        deadline: Option<Instant>,
    ) -> Result<Result<CallReply, tarpc::ServerError>, Failure> {
        let id = self.next_id;
        self.next_id += 1;
        let mut context = tarpc::context::current();
        context.deadline = deadline.unwrap_or_else(|| Instant::now() + NO_DEADLINE);
        let msg = tarpc::ClientMessage::Request(tarpc::Request {
            context,
            id,
            message: req,
        });
        let closed = || inner.is_closed();
        self.frames.send(&msg, deadline, &closed)?;
        let reply: tarpc::Response<CallReply> =
            self.frames
                .recv(inner.cfg.max_frame_bytes, deadline, &closed)?;
        if reply.request_id != id {
            return Err(Failure::Lost(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "reply to request {} while waiting for {id}",
                    reply.request_id
                ),
            )));
        }
        Ok(reply.message)
    }
}

impl Agent {
    /// Whether `rpc_sync` to `to` takes this thread's own connection.
    pub(crate) fn sync_connection_applies(&self, to: u32) -> bool {
        let cfg = &self.inner.cfg;
        cfg.sync_connections && to != cfg.rank && matches!(cfg.transport, crate::Transport::Tcp)
    }

    /// This thread's connection to `to`: its own, or a new one if the agent has a place free
    /// (`Config::max_sync_connections`); `None`: make the call through the runtime.
    pub(crate) fn sync_conn(
        &self,
        to: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<SyncConn>, RpcError> {
        let inner = &self.inner;
        if let Some(c) = take(inner, to) {
            return Ok(Some(c));
        }
        if !inner.sync_out.try_reserve(inner.cfg.max_sync_connections) {
            return Ok(None);
        }
        let by = deadline.unwrap_or_else(|| Instant::now() + inner.cfg.connect_timeout);
        SyncConn::dial(self, to, by).map(Some)
    }

    /// A blocking call to `to` (another worker, over TCP) on `conn`, this thread's connection
    /// to it. Must not be called from async code: it blocks the thread.
    pub(crate) fn call_on_thread<F: RemoteFn>(
        &self,
        mut conn: SyncConn,
        to: u32,
        args: F::Args,
        deadline: Option<Instant>,
        depth: u32,
        started: Instant,
    ) -> Result<F::Output, RpcError> {
        let inner = &self.inner;
        let rt = inner.runtime.clone();
        let worker = || inner.peers[to as usize].info.name.clone();
        let lost = || RpcError::ConnectionLost {
            worker: worker(),
            fn_name: F::NAME.to_owned(),
        };
        let prepared = (|| {
            let (payload, blobs, unsent) = self.encode_args::<F>(to, &args)?;
            let blobs = if blobs.is_empty() {
                Vec::new()
            } else if let Some(inline) = crate::bulk::all_inline(self, &blobs) {
                inline
            } else {
                // Large blobs take the bulk path, which the runtime drives.
                let send = crate::bulk::send(self, to, blobs);
                let sent = match deadline {
                    None => rt.block_on(send),
                    Some(d) => rt
                        .block_on(async { tokio::time::timeout_at(d.into(), send).await })
                        .map_err(|_| self.deadline_exceeded::<F>(to, d, started))?,
                };
                sent.map_err(|e| RpcError::Transport {
                    worker: worker(),
                    source: e.into(),
                })?
            };
            self.check_frame::<F>(&payload, &blobs)?;
            Ok((payload, blobs, unsent))
        })();
        // Nothing was written: the connection stays this thread's.
        let (payload, blobs, unsent) = match prepared {
            Ok(p) => p,
            Err(e) => {
                put_back(conn);
                return Err(e);
            }
        };
        let req = self.envelope::<F>(depth, payload, blobs, None, self.outgoing_meta(to), None);
        let lent = unsent.sent();
        // DIR-1: `conn` goes back only after a whole round trip; on failure it is dropped.
        let reply = match conn.round_trip(inner, req, deadline) {
            Ok(r) => {
                put_back(conn);
                r
            }
            Err(Failure::NotSent(e)) => {
                lent.never_decoded();
                tracing::debug!(peer = %worker(), cause = %e, "sync connection failed");
                return Err(lost());
            }
            Err(Failure::Lost(e)) => {
                tracing::debug!(peer = %worker(), cause = %e, "sync connection failed");
                return Err(lost());
            }
            Err(Failure::Deadline) => {
                let d = deadline.unwrap_or(started + NO_DEADLINE);
                return Err(self.deadline_exceeded::<F>(to, d, started));
            }
            Err(Failure::Closed) => {
                return Err(RpcError::Shutdown {
                    worker: self.name().to_owned(),
                    fn_name: F::NAME.to_owned(),
                })
            }
        };
        let reply = match reply {
            Ok(r) => r,
            Err(e)
                if e.kind == io::ErrorKind::TimedOut
                    || deadline.is_some_and(|d| Instant::now() >= d) =>
            {
                let d = deadline.unwrap_or(started + NO_DEADLINE);
                return Err(self.deadline_exceeded::<F>(to, d, started));
            }
            Err(e) => {
                return Err(RpcError::Transport {
                    worker: worker(),
                    source: Box::new(e),
                })
            }
        };
        let meta = crate::context::current_meta();
        let ok = self.answered::<F>(reply, lent)?;
        rt.block_on(self.read_result::<F, F::Output>(to, ok, deadline, meta))
    }
}

/// Serves a sync connection from `caller` on a thread of its own (DIR-3: the connection counts
/// as open until that thread ends; shutdown's last phase closes it).
pub(crate) async fn serve(agent: &Agent, stream: TcpStream, caller: u32) {
    let inner = &agent.inner;
    let key = match inner.sync_in.register(&stream) {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!(worker = %agent.name(), cause = %e, "refused a sync connection");
            return;
        }
    };
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let weak = Arc::downgrade(inner);
    let spawned = std::thread::Builder::new()
        .name(format!("rpc-sync-{caller}"))
        .spawn(move || {
            serve_thread(weak.clone(), stream, caller);
            if let Some(a) = weak.upgrade() {
                a.sync_in.unregister(key);
            }
            drop(done_tx);
        });
    if let Err(e) = spawned {
        inner.sync_in.unregister(key);
        tracing::warn!(worker = %agent.name(), cause = %e, "cannot start a thread for a sync connection");
        return;
    }
    let _ = done_rx.await;
}

/// The serving thread: one request at a time, each run to completion before the next is read.
/// Between requests it holds only a weak reference to the agent.
fn serve_thread(weak: Weak<Inner>, stream: TcpStream, caller: u32) {
    let Some((max, spin)) = weak
        .upgrade()
        .map(|a| (a.cfg.max_frame_bytes, a.cfg.busy_poll))
    else {
        return;
    };
    let mut frames = Frames::new(stream, spin);
    let gone = || weak.upgrade().is_none_or(|a| a.is_closed());
    loop {
        let msg: tarpc::ClientMessage<CallRequest> = match frames.recv(max, None, &gone) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(caller, cause = ?e, "sync connection ended");
                return;
            }
        };
        let tarpc::ClientMessage::Request(req) = msg else {
            // The calling thread waits for each reply; it never cancels by tarpc message.
            continue;
        };
        let Some(inner) = weak.upgrade() else { return };
        let agent = Agent { inner };
        let deadline = req.context.deadline;
        let id = req.id;
        // Counted as a call in flight for shutdown's drain until its reply is written;
        // abandoned when the agent aborts what is left.
        let token = agent.inner.calls.token();
        let stop = agent.inner.stop.clone();
        // The calling thread never cancels (it waits for each reply): not cancellable.
        let run = crate::server::handle(
            agent.clone(),
            crate::server::callers_deadline(deadline, Instant::now()),
            req.message,
            caller,
            None,
        );
        let reply = crate::spin::block_on(&agent.inner.runtime, agent.inner.cfg.busy_poll, async {
            tokio::select! {
                r = tokio::time::timeout_at(deadline.into(), run) => Some(r),
                () = stop.cancelled() => None,
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
        let write_by = Some(Instant::now() + agent.inner.cfg.handshake_timeout);
        let sent = frames.send(&resp, write_by, &gone);
        drop(token);
        drop(agent);
        if let Err(e) = sent {
            tracing::debug!(caller, cause = ?e, "sync connection ended");
            return;
        }
    }
}
