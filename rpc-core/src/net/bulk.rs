//! The bulk path: large blobs bypass the control connection and serde entirely.
//!
//! Each worker keeps, per peer, one outgoing *bulk* connection (authenticated like every other)
//! and a writer task that sends records on it (`bulk_conn.rs`): a blob's bytes straight from
//! its memory, read on the other side into a buffer allocated at its exact size (no growth, no
//! re-copy); or, where the peer shares the host and has mapped this worker's shared-memory
//! arena (`shm.rs`), only its place in the arena, the bytes copied once into it (or built there
//! by `blob_for`) and handed to the receiver without a copy. Either way the blob is filed in an
//! inbox under `(sender, id)`. The control envelope names the blob by id; whichever of the two
//! arrives first waits for the other.
//!
//! Invariants:
//! - BULK-1: a blob is handed to exactly one receiver; an unclaimed one (its call was
//!   cancelled) is dropped after `ORPHAN_TTL`.
//! - BULK-2: a receiver waits for a blob at most until its call's deadline (or `MAX_WAIT`
//!   without one), then fails the call with an error instead of hanging.
//! - BULK-3: a record longer than the frame limit closes that bulk connection; other
//!   connections are unaffected.
//! - BULK-4: receive buffers are recycled through a pool bounded by `bulk_pool_bytes`: a blob
//!   hands its buffer back when the last `Bytes` referring to it is dropped, so a steady stream
//!   of large messages does not pay for fresh pages (large allocations are fresh `mmap`s).

use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

use super::auth::ConnKind;
use super::buffers::BufPool;
use super::bulk_conn::{self, lock_arena, write_loop, ArenaState, Counters, SharedArena};
use super::config::NetConfig;
use super::dial::Dialer;
use super::shm::{self, Arena};
use super::transport::Conn;
use crate::lifecycle::Lifecycle;
use crate::wire::WireBlob;

const ORPHAN_TTL: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(300);
/// Records queued per outgoing bulk connection (each holds a reference, not a copy).
const QUEUE: usize = 64;

enum Slot {
    Arrived(Bytes, Instant),
    Waiting(oneshot::Sender<Bytes>),
}

/// How this worker's large blobs have travelled so far: on the bulk connections' byte
/// streams or through shared memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BulkStats {
    /// Blobs sent on a bulk connection's byte stream.
    pub streamed_blobs: u64,
    /// Their bytes.
    pub streamed_bytes: u64,
    /// Blobs sent through a shared-memory arena (see [`Config::shm_arena_bytes`]).
    ///
    /// [`Config::shm_arena_bytes`]: crate::Config::shm_arena_bytes
    pub shared_blobs: u64,
    /// Their bytes.
    pub shared_bytes: u64,
}

/// The queue feeding one outgoing bulk connection's writer task.
type Outbox = mpsc::Sender<(u64, Bytes)>;

/// The bulk path of one worker: its outgoing bulk connections, the inbox of blobs that
/// arrived, the pool of receive buffers.
pub(crate) struct Bulk {
    cfg: Arc<NetConfig>,
    dialer: Arc<Dialer>,
    life: Arc<Lifecycle>,
    pool: Arc<BufPool>,
    next_id: AtomicU64,
    inbox: Mutex<Inbox>,
    outboxes: Vec<tokio::sync::Mutex<Option<Outbox>>>,
    /// The arena state of each peer's current bulk connection.
    arenas: Vec<Mutex<Option<SharedArena>>>,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Inbox {
    slots: HashMap<(u32, u64), Slot>,
    last_sweep: Option<Instant>,
}

impl Bulk {
    pub(crate) fn new(cfg: Arc<NetConfig>, dialer: Arc<Dialer>, life: Arc<Lifecycle>) -> Self {
        let capacity = cfg.capacity;
        Self {
            pool: BufPool::new(cfg.bulk_pool_bytes),
            next_id: AtomicU64::new(1),
            inbox: Mutex::new(Inbox::default()),
            outboxes: (0..capacity)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            arenas: (0..capacity).map(|_| Mutex::new(None)).collect(),
            counters: Arc::default(),
            cfg,
            dialer,
            life,
        }
    }

    /// The arena the current bulk connection to `to` shares with the peer, once mapped.
    fn ready_arena(&self, to: u32) -> Option<Arc<Arena>> {
        let slot = self.arenas.get(to as usize)?;
        let state = slot.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        let st = lock_arena(&state);
        match &*st {
            ArenaState::Ready(a) => Some(Arc::clone(a)),
            _ => None,
        }
    }

    pub(crate) fn stats(&self) -> BulkStats {
        let c = &self.counters;
        BulkStats {
            streamed_blobs: c.streamed_blobs.load(Ordering::Relaxed),
            streamed_bytes: c.streamed_bytes.load(Ordering::Relaxed),
            shared_blobs: c.shared_blobs.load(Ordering::Relaxed),
            shared_bytes: c.shared_bytes.load(Ordering::Relaxed),
        }
    }

    fn inbox(&self) -> std::sync::MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn deposit(&self, from: u32, id: u64, data: Bytes) {
        let mut inbox = self.inbox();
        let now = Instant::now();
        if inbox
            .last_sweep
            .is_none_or(|t| now - t > Duration::from_secs(10))
        {
            inbox.last_sweep = Some(now);
            inbox.slots.retain(|_, s| match s {
                Slot::Arrived(_, t) => now - *t < ORPHAN_TTL,
                Slot::Waiting(tx) => !tx.is_closed(),
            });
        }
        match inbox.slots.remove(&(from, id)) {
            Some(Slot::Waiting(tx)) => {
                let _ = tx.send(data);
            }
            _ => {
                inbox.slots.insert((from, id), Slot::Arrived(data, now));
            }
        }
    }

    /// `peer` was declared failed: what waits for its blobs fails, the bulk connection to it
    /// and its arena are dropped.
    pub(crate) fn peer_failed(&self, peer: u32) {
        self.inbox()
            .slots
            .retain(|(from, _), s| *from != peer || matches!(s, Slot::Arrived(..)));
        if let Some(o) = self.outboxes.get(peer as usize) {
            if let Ok(mut o) = o.try_lock() {
                o.take();
            }
        }
        if let Some(a) = self.arenas.get(peer as usize) {
            a.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    /// A new incarnation holds `peer`'s rank: nothing the previous one sent may be taken
    /// for the new one's (their blob ids start over).
    pub(crate) fn peer_replaced(&self, peer: u32) {
        self.inbox().slots.retain(|(from, _), _| *from != peer);
        self.peer_failed(peer);
    }

    pub(crate) fn close(&self) {
        self.inbox().slots.clear();
        self.pool.clear();
        for o in &self.outboxes {
            if let Ok(mut o) = o.try_lock() {
                o.take();
            }
        }
        for a in &self.arenas {
            a.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }
}

impl Bulk {
    /// A blob of `len` bytes written by `fill`, built where sending it to `to` costs least:
    /// in the shared-memory arena of the bulk connection to `to` when there is one with room
    /// (sending it then copies nothing), else in ordinary memory.
    pub(crate) fn blob_for(&self, to: u32, len: usize, fill: impl FnOnce(&mut [u8])) -> Bytes {
        let fill = match self.ready_arena(to) {
            Some(a) if len >= self.cfg.bulk_threshold && to != self.cfg.rank => {
                match a.stage(len, fill) {
                    Ok(b) => return b,
                    Err(fill) => fill,
                }
            }
            _ => fill,
        };
        let mut v = super::buffers::large_vec::<u8>(len);
        v.resize(len, 0);
        fill(&mut v);
        Bytes::from(v)
    }

    /// Whether `blob` rides inside the envelope: below the bulk threshold, and while the
    /// envelope's inline blobs so far (`inline`) stay within half the frame limit, so many
    /// small blobs never make a frame too large to send.
    fn is_inline(&self, blob: &Bytes, inline: &mut usize) -> bool {
        let fits = blob.len() < self.cfg.bulk_threshold
            && *inline + blob.len() <= self.cfg.max_frame_bytes / 2;
        if fits {
            *inline += blob.len();
        }
        fits
    }

    /// `blobs` as they go on the wire when every one rides inside the envelope: sending them
    /// then waits for nothing. `None` when one takes the bulk path ([`Bulk::send`]).
    pub(crate) fn all_inline(&self, blobs: &[Bytes]) -> Option<Vec<WireBlob>> {
        let mut inline = 0;
        blobs
            .iter()
            .map(|b| {
                self.is_inline(b, &mut inline)
                    .then(|| WireBlob::Inline(b.to_vec()))
            })
            .collect()
    }

    /// Turns an outgoing side table into wire entries, queueing large blobs on the bulk
    /// connection to `to`.
    pub(crate) async fn send(&self, to: u32, blobs: Vec<Bytes>) -> Result<Vec<WireBlob>, String> {
        let mut out = Vec::with_capacity(blobs.len());
        let mut inline = 0;
        for b in blobs {
            if self.is_inline(&b, &mut inline) {
                out.push(WireBlob::Inline(b.to_vec()));
                continue;
            }
            let max = self.cfg.max_blob_bytes;
            if b.len() > max {
                return Err(format!(
                    "a blob of {} bytes exceeds the blob limit of {max}",
                    b.len(),
                ));
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let len = b.len() as u64;
            let tx = self.outbox(to).await?;
            tx.send((id, b)).await.map_err(|_| {
                format!(
                    "bulk connection to `{}` closed",
                    self.dialer.directory().name(to)
                )
            })?;
            out.push(WireBlob::Bulk { id, len });
        }
        Ok(out)
    }

    async fn outbox(&self, to: u32) -> Result<Outbox, String> {
        let mut slot = self.outboxes[to as usize].lock().await;
        if let Some(tx) = slot.as_ref().filter(|tx| !tx.is_closed()) {
            return Ok(tx.clone());
        }
        let conn = self
            .dialer
            .dial(to, ConnKind::Bulk)
            .await
            .map_err(|e| format!("bulk {e}"))?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let name = self.dialer.directory().name(to).to_owned();
        let stop = self.life.stop.clone();
        let arena_bytes = self.cfg.shm_arena_bytes;
        let counters = Arc::clone(&self.counters);
        let state: SharedArena = Arc::new(Mutex::new(if arena_bytes > shm::HEADER {
            ArenaState::None
        } else {
            ArenaState::Off
        }));
        *self.arenas[to as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&state));
        self.life.conns.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                r = write_loop(conn, rx, state, arena_bytes, &name, &counters) => {
                    if let Err(e) = r {
                        tracing::warn!(peer = %name, cause = %e, "bulk connection failed");
                    }
                }
            }
        });
        *slot = Some(tx.clone());
        Ok(tx)
    }
}

/// Bytes of a side table that travel on the bulk path (for the trace).
pub(crate) fn bulk_bytes(blobs: &[WireBlob]) -> u64 {
    blobs
        .iter()
        .map(|b| match b {
            WireBlob::Inline(_) => 0,
            WireBlob::Bulk { len, .. } => *len,
        })
        .sum()
}

/// Bytes of a side table that ride inline in the envelope.
pub(crate) fn inline_bytes(blobs: &[WireBlob]) -> usize {
    blobs
        .iter()
        .map(|b| match b {
            WireBlob::Inline(v) => v.len() + 16,
            WireBlob::Bulk { .. } => 24,
        })
        .sum()
}

impl Bulk {
    /// Reads records from `from`'s bulk connection into the inbox (see `bulk_conn.rs`).
    pub(crate) async fn serve_incoming(&self, conn: Conn, from: u32) {
        let max = self.cfg.max_blob_bytes;
        bulk_conn::serve(conn, from, max, &self.pool, |id, b| {
            self.deposit(from, id, b)
        })
        .await;
    }

    /// Rebuilds an incoming side table, waiting for bulk records as needed.
    pub(crate) async fn receive(
        &self,
        from: u32,
        wire: Vec<WireBlob>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Bytes>, String> {
        let bulk = self;
        let mut out = Vec::with_capacity(wire.len());
        for w in wire {
            match w {
                WireBlob::Inline(v) => out.push(Bytes::from(v)),
                WireBlob::Bulk { id, len } => {
                    let rx = {
                        let mut inbox = bulk.inbox();
                        match inbox.slots.remove(&(from, id)) {
                            Some(Slot::Arrived(b, _)) => {
                                out.push(b);
                                continue;
                            }
                            _ => {
                                let (tx, rx) = oneshot::channel();
                                inbox.slots.insert((from, id), Slot::Waiting(tx));
                                rx
                            }
                        }
                    };
                    let until = deadline.unwrap_or_else(|| Instant::now() + MAX_WAIT);
                    match tokio::time::timeout_at(until.into(), rx).await {
                        Ok(Ok(b)) if b.len() as u64 == len => out.push(b),
                        Ok(Ok(b)) => {
                            return Err(format!(
                                "bulk blob {id} has {} bytes, expected {len}",
                                b.len()
                            ))
                        }
                        Ok(Err(_)) => {
                            return Err(format!("bulk blob {id} was dropped (shutting down)"))
                        }
                        Err(_) => {
                            bulk.inbox().slots.remove(&(from, id));
                            return Err(format!(
                                "bulk blob {id} ({len} bytes) did not arrive before the deadline"
                            ));
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}
