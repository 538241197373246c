//! The network layer: everything between a worker's calls and the bytes on the wire. It never
//! names the agent; it reaches what answers requests through one seam, [`Serve`].
//!
//! ```text
//! transport   TCP and the in-memory network behind one byte stream (`Conn`)
//! auth        the group secret and the HMAC handshake every connection starts with
//! seal        after it: a MAC or encryption on every record (between hosts by default)
//! dial        the directory of peers and the one dialer (control, bulk, blocking)
//! frame       tarpc's frames: the outbox and reader (multiplexed), blocking frames
//! mux_client  the calling end of a multiplexed connection: ids, slots, waiters
//! mux_server  the serving end: each request polled once, a task only if it waits
//! peer        one lazily dialled multiplexed connection per peer
//! blocking    a calling thread's own connection, served by a thread of the peer's
//! bulk        large blobs beside the control connection: the inbox, sending, receiving
//! bulk_conn   one bulk connection's two ends: records, the writer, the reader
//! shm         shared-memory arenas for bulk blobs between workers on one host
//! buffers     large and recycled buffers
//! spin        busy polling before sleeping
//! liveness    the failure detector (its own thread), membership, verdicts
//! serve       the seam: `Serve`, the caller's deadline
//! failure     why a call got no reply (`CallFailed`)
//! fuzz        (tests, feature `fuzzing`) what a peer sends, as fuzz targets read it
//! ```
//!
//! [`Net`] owns the pieces of one worker and its accept loop, which authenticates every
//! incoming connection (bounded by the handshake timeout) before anything is decoded, protects
//! it as agreed in the handshake (`seal`), then serves it by kind: control connections by
//! `mux_server`, bulk connections by `bulk`, blocking connections by `blocking`.

pub(crate) mod auth;
mod blocking;
mod buffers;
mod bulk;
mod bulk_conn;
mod config;
mod dial;
mod events;
mod failure;
mod frame;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzz;
mod liveness;
mod membership;
mod mux_client;
mod mux_server;
mod peer;
mod seal;
mod secret;
mod serve;
pub(crate) mod shm;
mod spin;
pub mod supervisor;
pub(crate) mod transport;
mod watch;

use std::sync::Arc;

use auth::ConnKind;
pub use auth::{Secret, SECRET_ENV, SECRET_FILE_ENV};
pub(crate) use blocking::SyncConn;
pub use buffers::large_vec;
pub use bulk::BulkStats;
pub(crate) use bulk::{bulk_bytes, inline_bytes, Bulk};
pub(crate) use config::NetConfig;
pub(crate) use dial::{DialError, Directory, Endpoint};
pub use events::{MembershipChange, MembershipEvent, WorkerFailed};
pub(crate) use failure::CallFailed;
pub(crate) use frame::{decode as decode_frame, encode as encode_frame, fits};
pub(crate) use membership::{Membership, PeerState, Standing};
pub(crate) use mux_client::{MuxClient, Waiter};
pub(crate) use peer::Peer;
pub use seal::WireProtection;
pub(crate) use serve::{Serve, NO_DEADLINE};
pub(crate) use spin::{block_on, Spin};
pub(crate) use transport::{Conn, Detached, Listener};
pub use transport::{Io, MemoryNetwork, Transport};
pub use watch::{FailureWatch, MembershipWatch};

use blocking::Blocking;
use dial::Dialer;
use liveness::Detector;

use crate::lifecycle::Lifecycle;
use crate::trace::Cat;

/// One worker's network: its configuration, peers, bulk path, blocking connections and
/// failure detector.
pub(crate) struct Net {
    pub cfg: Arc<NetConfig>,
    dialer: Arc<Dialer>,
    /// Outgoing control connections, by rank.
    pub peers: Vec<Arc<Peer>>,
    pub bulk: Arc<Bulk>,
    pub blocking: Arc<Blocking>,
    pub spin: Arc<Spin>,
    pub life: Arc<Lifecycle>,
    /// Which peers are alive; the detector's verdicts.
    pub membership: Arc<Membership>,
    detector: std::sync::Mutex<Option<Detector>>,
    /// Ranks a new incarnation of which joined, for the detector (taken when it starts).
    rejoined: std::sync::Mutex<Option<tokio::sync::mpsc::Receiver<u32>>>,
    /// The runtime every connection's task runs on.
    pub runtime: tokio::runtime::Handle,
    /// This worker's trace recorder (off unless configured).
    pub tracer: crate::trace::Tracer,
}

impl Net {
    /// The network of a worker whose group is `directory` (each rank standing as `standing`
    /// says, at view `generation`), on the current runtime. A peer declared failed has every
    /// connection to it closed and every wait on them failed; a new incarnation of a peer is
    /// dialled at its new address.
    pub(crate) fn new(
        cfg: NetConfig,
        directory: Arc<Directory>,
        life: Arc<Lifecycle>,
        generation: u64,
        standing: &[Standing],
        tracer: crate::trace::Tracer,
    ) -> Self {
        let cfg = Arc::new(cfg);
        let runtime = tokio::runtime::Handle::current();
        let n = directory.capacity();
        let peers: Vec<Arc<Peer>> = (0..n as u32).map(Peer::new).collect();
        let membership = Arc::new(Membership::new(
            Arc::clone(&directory),
            generation,
            standing,
        ));
        let dialer = Arc::new(Dialer::new(Arc::clone(&cfg), directory));
        let spin = Arc::new(Spin::new(cfg.busy_poll));
        let bulk = Arc::new(Bulk::new(
            Arc::clone(&cfg),
            Arc::clone(&dialer),
            Arc::clone(&life),
        ));
        let blocking = Arc::new(Blocking::new(
            Arc::clone(&cfg),
            Arc::clone(&dialer),
            Arc::clone(&life),
            Arc::clone(&spin),
            runtime.clone(),
        ));
        {
            let (peers, bulk, blocking) = (peers.clone(), Arc::clone(&bulk), Arc::clone(&blocking));
            let tracer = tracer.clone();
            membership.on_failure(Arc::new(move |f: &WorkerFailed| {
                let detail = || format!("{} (rank {}): {}", f.name, f.rank, f.cause);
                tracer.instant(Cat::Failure, "worker declared failed", Some(detail()));
                if let Some(p) = peers.get(f.rank as usize) {
                    p.close();
                }
                blocking.close_peer(f.rank);
                bulk.peer_failed(f.rank);
            }));
        }
        // Bounded: one message per rejoin, which are rare; a full queue means the detector
        // stopped, and then nothing is watched anyway.
        let (rejoined_tx, rejoined) = tokio::sync::mpsc::channel(4 * n.max(16));
        {
            let (peers, bulk, tracer) = (peers.clone(), Arc::clone(&bulk), tracer.clone());
            membership.on_rejoin(Arc::new(move |rank| {
                let detail = format!("a new incarnation of rank {rank} joined");
                tracer.instant(Cat::Failure, "worker replaced", Some(detail));
                if let Some(p) = peers.get(rank as usize) {
                    p.close();
                }
                bulk.peer_replaced(rank);
                let _ = rejoined_tx.try_send(rank);
            }));
        }
        Self {
            bulk,
            blocking,
            peers,
            spin,
            dialer,
            life,
            membership,
            detector: std::sync::Mutex::new(None),
            rejoined: std::sync::Mutex::new(Some(rejoined)),
            runtime,
            cfg,
            tracer,
        }
    }

    /// The group's directory: every worker's name and address.
    pub(crate) fn directory(&self) -> &Directory {
        self.dialer.directory()
    }

    /// The live control connection to `to`, dialled if there is none (never to a peer
    /// declared failed; a dial under way ends when it is).
    ///
    /// # Cancel safety
    /// Cancel safe: a dial abandoned half way leaves nothing behind.
    pub(crate) async fn control(&self, to: u32) -> Result<(u64, MuxClient), DialError> {
        if let Some(f) = self.membership.failure(to) {
            return Err(self.dialer.failed(to, std::io::Error::other(f.cause)));
        }
        if self.membership.has_left(to) {
            return Err(self
                .dialer
                .failed(to, std::io::Error::other("it left the group")));
        }
        if self.membership.is_vacant(to) {
            return Err(self.dialer.failed(
                to,
                std::io::Error::other("no worker has joined this rank yet"),
            ));
        }
        // A dial to a peer that is declared failed meanwhile (a connect that hangs on a cut
        // link) ends with the verdict, not with the connect timeout.
        let gone = self.membership.gone(to);
        let declared = || {
            let cause = self
                .membership
                .failure(to)
                .map_or_else(|| "it was declared failed".to_owned(), |f| f.cause);
            Err(self.dialer.failed(to, std::io::Error::other(cause)))
        };
        // DIAL-2: refused or unreachable, a peer not declared failed is dialled again.
        let retry_until = tokio::time::Instant::now() + 2 * self.cfg.failure_timeout;
        let mut pause = std::time::Duration::from_millis(20);
        loop {
            let dial = self.peers[to as usize].client(
                &self.dialer,
                self.cfg.max_frame_bytes,
                self.cfg.max_queued_bytes,
            );
            let tried = tokio::select! {
                biased;
                () = gone.cancelled() => return declared(),
                r = dial => r,
            };
            match tried {
                Err(e)
                    if dial::may_pass(&e.source) && tokio::time::Instant::now() < retry_until =>
                {
                    tokio::select! {
                        biased;
                        () = gone.cancelled() => return declared(),
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(std::time::Duration::from_millis(500));
                }
                r => return r,
            }
        }
    }

    /// This thread's blocking connection to `to`, or `None` if every place is taken.
    pub(crate) fn sync_conn(
        &self,
        to: u32,
        deadline: Option<std::time::Instant>,
    ) -> Result<Option<SyncConn>, DialError> {
        self.blocking.conn(to, deadline)
    }

    /// Starts serving: accepts connections on `listener` until [`Lifecycle::stop_accepting`],
    /// answering requests with `service`, and starts the failure detector on `heartbeats`
    /// (the listener advertised at the rendezvous; `None`: no detector).
    pub(crate) fn serve<S: Serve>(
        self: &Arc<Self>,
        listener: Listener,
        service: Arc<S>,
        heartbeats: Option<Detached>,
    ) {
        tokio::spawn(Arc::clone(self).accept_loop(listener, service));
        if !self.cfg.busy_poll.is_zero() {
            tokio::spawn(Arc::clone(&self.spin).run(self.life.stop.clone()));
        }
        let rejoined = self
            .rejoined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let (Some(l), Some(rejoined)) = (heartbeats, rejoined) {
            let started = Detector::start(
                Arc::clone(&self.cfg),
                Arc::clone(&self.dialer),
                Arc::clone(&self.membership),
                l,
                rejoined,
            );
            match started {
                Ok(d) => *self.detector.lock().unwrap_or_else(|p| p.into_inner()) = Some(d),
                Err(e) => tracing::error!(cause = %e, "no failure detector; peers are not watched"),
            }
        }
    }

    /// This worker is leaving: its detector tells every peer so and stops (shutdown phase 3).
    pub(crate) async fn leave(&self) {
        let detector = self
            .detector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(d) = detector {
            d.leave().await;
        }
    }

    /// Tests: the detector stops (or resumes) sending heartbeats, as a frozen process would.
    pub(crate) fn set_silent(&self, silent: bool) {
        if let Some(d) = &*self.detector.lock().unwrap_or_else(|p| p.into_inner()) {
            d.set_silent(silent);
        }
    }

    /// Closes every outgoing connection (shutdown phase 3).
    pub(crate) fn close_outgoing(&self) {
        for p in &self.peers {
            p.close();
        }
        self.blocking.close_outgoing();
        self.bulk.close();
    }

    /// Closes the serving ends of blocking connections (shutdown phase 4).
    pub(crate) fn close_incoming(&self) {
        self.blocking.close_incoming();
    }

    async fn accept_loop<S: Serve>(self: Arc<Self>, mut listener: Listener, service: Arc<S>) {
        let stop = self.life.stop_accepting.clone();
        let gate = auth::Gate::default();
        loop {
            // Biased: once told to stop, a connection waiting in the backlog is not taken.
            let conn = tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                c = listener.accept() => c,
            };
            match conn {
                Ok(conn) => {
                    let (net, service, gate) =
                        (Arc::clone(&self), Arc::clone(&service), gate.clone());
                    self.life.conns.spawn(async move {
                        let stop = net.life.stop.clone();
                        tokio::select! {
                            biased;
                            _ = stop.cancelled() => {}
                            _ = net.serve_conn(conn, service, &gate) => {}
                        }
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotConnected => break,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(rank = self.cfg.rank, cause = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn serve_conn<S: Serve>(&self, mut conn: Conn, service: Arc<S>, gate: &auth::Gate) {
        let me = self.cfg.rank;
        let hs = gate
            .handshake(
                &mut conn,
                &self.cfg.secret,
                self.cfg.protection,
                self.cfg.handshake_timeout,
                self.cfg.me(),
            )
            .await;
        let auth::Accepted {
            kind,
            rank,
            incarnation,
            session,
        } = match hs {
            Ok(v) => v,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            Err(e) => {
                tracing::warn!(rank = me, cause = %e, "refused a connection");
                return;
            }
        };
        if rank >= self.cfg.capacity {
            tracing::warn!(
                rank = me,
                caller = rank,
                "refused a connection from a rank outside the group"
            );
            return;
        }
        // MEM-1: only the incarnation that holds the rank now, and only while it has not
        // failed; everything served for it ends once it is declared failed.
        let gone = match self
            .membership
            .admit(rank, incarnation, self.cfg.handshake_timeout)
            .await
        {
            Ok(gone) => gone,
            Err(why) => {
                tracing::warn!(rank = me, caller = rank, %why, "refused a connection");
                return;
            }
        };
        tokio::select! {
            biased;
            () = gone.cancelled() => {}
            () = self.serve_kind(kind, conn, session, rank, service, &gone) => {}
        }
    }

    async fn serve_kind<S: Serve>(
        &self,
        kind: ConnKind,
        conn: Conn,
        session: seal::Session,
        rank: u32,
        service: Arc<S>,
        gone: &tokio_util::sync::CancellationToken,
    ) {
        let me = self.cfg.rank;
        match kind {
            ConnKind::Control => {
                let served = mux_server::serve(
                    service,
                    session.wrap(conn),
                    rank,
                    (
                        self.cfg.max_frame_bytes,
                        self.cfg.max_queued_bytes,
                        self.cfg.max_in_flight,
                    ),
                    &self.life,
                    &self.spin,
                    gone,
                )
                .await;
                match served {
                    Ok(()) => {
                        tracing::debug!(rank = me, caller = rank, "control connection closed")
                    }
                    Err(e) => {
                        tracing::warn!(
                            rank = me, caller = rank, cause = %e, "control connection failed"
                        )
                    }
                }
            }
            ConnKind::Bulk => self.bulk.serve_incoming(session.wrap(conn), rank).await,
            ConnKind::Sync => match transport::into_std_tcp(conn) {
                Some(stream) => {
                    let gone = gone.clone();
                    self.blocking
                        .serve(
                            stream,
                            session.into_keys(),
                            rank,
                            Arc::downgrade(&service),
                            gone,
                        )
                        .await
                }
                None => {
                    tracing::warn!(
                        rank = me,
                        "refused a sync connection on a transport other than TCP"
                    )
                }
            },
            ConnKind::Rendezvous | ConnKind::Heartbeat => {
                tracing::warn!(
                    rank = me,
                    ?kind,
                    "refused a connection of this kind on a worker port"
                )
            }
        }
    }
}
