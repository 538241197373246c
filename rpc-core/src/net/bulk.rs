//! The bulk path: large blobs bypass the control connection and serde entirely.
//!
//! Each worker keeps, per peer, one outgoing *bulk* connection (authenticated like every other)
//! and a writer task that sends records on it. A `STREAM` record, `[0][id: u64][len: u64]`
//! followed by the bytes, goes straight from the blob's memory; the receiving side reads it
//! into a buffer allocated at its exact size (no growth, no re-copy). Where the peer shares the
//! host, the first large blob also announces a shared-memory arena (`ARENA`, see `shm.rs`);
//! once the peer has mapped it, blobs that fit travel as `SHM` records, `[2][id][len][off:
//! u64]`, their bytes copied once into the arena and handed to the receiver without a copy.
//! The connection's other direction carries the receiver's answers: `[kind][u64]` with
//! `MAPPED`/`NOT_MAPPED` for the probe and `RELEASED off` when a shared blob's last reference
//! is dropped. Either way the blob is filed in an inbox under `(sender, id)`. The control
//! envelope names the blob by id; whichever of the two arrives first waits for the other.
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::auth::ConnKind;
use super::config::NetConfig;
use super::dial::Dialer;
use super::shm::{self, Answer, Arena};
use super::transport::Conn;
use crate::lifecycle::Lifecycle;
use crate::wire::WireBlob;

const ORPHAN_TTL: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(300);
/// Records queued per outgoing bulk connection (each holds a reference, not a copy).
const QUEUE: usize = 64;

/// Record kinds, sender to receiver.
const STREAM: u8 = 0;
const ARENA: u8 = 1;
const SHM: u8 = 2;

enum Slot {
    Arrived(Bytes, Instant),
    Waiting(oneshot::Sender<Bytes>),
}

/// Recycled receive buffers.
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Bytes of capacity currently parked in `free`.
    parked: AtomicUsize,
    cap_bytes: usize,
}

impl BufPool {
    pub(crate) fn new(cap_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(Vec::new()),
            parked: AtomicUsize::new(0),
            cap_bytes,
        })
    }

    /// An empty buffer with capacity for at least `len` bytes (at most twice that, so a huge
    /// parked buffer is not wasted on a small blob).
    fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = free
            .iter()
            .position(|v| v.capacity() >= len && v.capacity() <= len.saturating_mul(2))
        {
            let mut v = free.swap_remove(i);
            self.parked.fetch_sub(v.capacity(), Ordering::Relaxed);
            v.clear();
            return v;
        }
        Vec::with_capacity(len)
    }

    fn give(&self, v: Vec<u8>) {
        let cap = v.capacity();
        if self.parked.load(Ordering::Relaxed) + cap > self.cap_bytes {
            return;
        }
        self.parked.fetch_add(cap, Ordering::Relaxed);
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(v);
    }

    fn clear(&self) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.parked.store(0, Ordering::Relaxed);
    }
}

/// A pooled buffer behind a `Bytes`: returns to the pool when the last reference drops.
struct Pooled {
    buf: Vec<u8>,
    pool: Weak<BufPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.buf));
        }
    }
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

#[derive(Default)]
struct Counters {
    streamed_blobs: AtomicU64,
    streamed_bytes: AtomicU64,
    shared_blobs: AtomicU64,
    shared_bytes: AtomicU64,
}

impl Counters {
    fn count(&self, shared: bool, bytes: usize) {
        let (n, b) = if shared {
            (&self.shared_blobs, &self.shared_bytes)
        } else {
            (&self.streamed_blobs, &self.streamed_bytes)
        };
        n.fetch_add(1, Ordering::Relaxed);
        b.fetch_add(bytes as u64, Ordering::Relaxed);
    }
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
        let world_size = cfg.world_size;
        Self {
            pool: BufPool::new(cfg.bulk_pool_bytes),
            next_id: AtomicU64::new(1),
            inbox: Mutex::new(Inbox::default()),
            outboxes: (0..world_size)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            arenas: (0..world_size).map(|_| Mutex::new(None)).collect(),
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
        let mut v = crate::large_vec::<u8>(len);
        v.resize(len, 0);
        fill(&mut v);
        Bytes::from(v)
    }

    /// Whether `blob` rides inside the envelope (below the bulk threshold).
    fn is_inline(&self, blob: &Bytes) -> bool {
        blob.len() < self.cfg.bulk_threshold
    }

    /// `blobs` as they go on the wire when every one rides inside the envelope: sending them
    /// then waits for nothing. `None` when one takes the bulk path ([`Bulk::send`]).
    pub(crate) fn all_inline(&self, blobs: &[Bytes]) -> Option<Vec<WireBlob>> {
        blobs
            .iter()
            .map(|b| self.is_inline(b).then(|| WireBlob::Inline(b.to_vec())))
            .collect()
    }

    /// Turns an outgoing side table into wire entries, queueing large blobs on the bulk
    /// connection to `to`.
    pub(crate) async fn send(&self, to: u32, blobs: Vec<Bytes>) -> Result<Vec<WireBlob>, String> {
        let mut out = Vec::with_capacity(blobs.len());
        for b in blobs {
            if self.is_inline(&b) {
                out.push(WireBlob::Inline(b.to_vec()));
                continue;
            }
            let max = self.cfg.max_frame_bytes;
            if b.len() > max {
                return Err(format!(
                    "a blob of {} bytes exceeds the frame limit of {max}",
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
                r = write_loop(conn, rx, state, arena_bytes, &name, &counters) => if let Err(e) = r {
                    tracing::warn!(peer = %name, cause = %e, "bulk connection failed");
                }
            }
        });
        *slot = Some(tx.clone());
        Ok(tx)
    }
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

/// The sender's view of its shared-memory arena on one bulk connection.
enum ArenaState {
    /// Not created yet (no blob large enough so far).
    None,
    /// Announced; blobs stream until the peer answers.
    Probing(Arc<Arena>),
    /// Mapped by the peer.
    Ready(Arc<Arena>),
    /// Off: not configured, not creatable, or the peer could not map it.
    Off,
}

type SharedArena = Arc<Mutex<ArenaState>>;

fn lock_arena(a: &SharedArena) -> std::sync::MutexGuard<'_, ArenaState> {
    a.lock().unwrap_or_else(|p| p.into_inner())
}

async fn write_loop(
    conn: Conn,
    mut rx: mpsc::Receiver<(u64, Bytes)>,
    state: SharedArena,
    arena_bytes: usize,
    peer: &str,
    counters: &Counters,
) -> std::io::Result<()> {
    let (rd, mut wr) = tokio::io::split(conn);
    let answers = read_answers(rd, Arc::clone(&state), peer);
    let records = async {
        while let Some((id, data)) = rx.recv().await {
            let len = data.len() as u64;
            let placement = place(&state, &data, arena_bytes, peer);
            counters.count(matches!(placement, Placement::Shared(_)), data.len());
            match placement {
                Placement::Shared(off) => {
                    let mut r = [0u8; 25];
                    r[0] = SHM;
                    r[1..9].copy_from_slice(&id.to_le_bytes());
                    r[9..17].copy_from_slice(&len.to_le_bytes());
                    r[17..].copy_from_slice(&(off as u64).to_le_bytes());
                    wr.write_all(&r).await?;
                }
                Placement::Stream(announce) => {
                    if let Some(a) = announce {
                        let mut r = [0u8; 1 + shm::Announce::BYTES];
                        r[0] = ARENA;
                        r[1..].copy_from_slice(&a.encode());
                        wr.write_all(&r).await?;
                    }
                    let mut r = [0u8; 17];
                    r[0] = STREAM;
                    r[1..9].copy_from_slice(&id.to_le_bytes());
                    r[9..].copy_from_slice(&len.to_le_bytes());
                    wr.write_all(&r).await?;
                    wr.write_all(&data).await?;
                }
            }
            if rx.is_empty() {
                wr.flush().await?;
            }
        }
        wr.shutdown().await
    };
    tokio::pin!(answers);
    let out = tokio::select! {
        r = records => r,
        // The peer closed its end (or broke the protocol): nothing more can be delivered.
        r = &mut answers => r.and(Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the receiving side closed the bulk connection",
        ))),
    };
    // The arena goes with the connection (blobs staged in it keep it alive until dropped).
    *lock_arena(&state) = ArenaState::Off;
    out
}

enum Placement {
    /// In the arena at this offset.
    Shared(usize),
    /// On the stream, after announcing a new arena if one is given.
    Stream(Option<shm::Announce>),
}

/// Where a blob goes: the arena when the peer has mapped it (where it already is, if it was
/// staged there, else copied in if there is room; SHM-2: never waits for room), else the
/// stream. The first blob large enough creates the arena.
fn place(state: &SharedArena, data: &[u8], arena_bytes: usize, peer: &str) -> Placement {
    let mut st = lock_arena(state);
    match &*st {
        ArenaState::Ready(a) => {
            let a = Arc::clone(a);
            drop(st);
            match a.hold_staged(data).or_else(|| a.put(data)) {
                Some(off) => Placement::Shared(off),
                None => Placement::Stream(None),
            }
        }
        ArenaState::None if data.len() <= arena_bytes - shm::HEADER => {
            match Arena::create(arena_bytes) {
                Ok(a) => {
                    let announce = a.announce();
                    *st = ArenaState::Probing(Arc::new(a));
                    Placement::Stream(Some(announce))
                }
                Err(e) => {
                    tracing::debug!(peer, cause = %e, "no shared-memory arena; bulk blobs stream");
                    *st = ArenaState::Off;
                    Placement::Stream(None)
                }
            }
        }
        _ => Placement::Stream(None),
    }
}

/// Reads the receiver's answers until it closes its end.
async fn read_answers(
    mut rd: tokio::io::ReadHalf<Conn>,
    state: SharedArena,
    peer: &str,
) -> std::io::Result<()> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    loop {
        let mut m = [0u8; 9];
        match rd.read_exact(&mut m).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let mut st = lock_arena(&state);
        match (Answer::decode(m), &*st) {
            (Some(Answer::Mapped), ArenaState::Probing(a)) => {
                tracing::debug!(
                    peer,
                    bytes = a.announce().size,
                    "bulk blobs go through shared memory"
                );
                *st = ArenaState::Ready(Arc::clone(a));
            }
            (Some(Answer::NotMapped), ArenaState::Probing(_)) => {
                tracing::debug!(
                    peer,
                    "the peer cannot map our arena (another host?); bulk blobs stream"
                );
                *st = ArenaState::Off;
            }
            (Some(Answer::Released(off)), ArenaState::Ready(a))
                if usize::try_from(off).is_ok_and(|off| a.release(off)) => {}
            (answer, _) => return Err(bad(format!("unexpected bulk answer {answer:?} ({m:?})"))),
        }
    }
}

impl Bulk {
    /// Reads records from `from`'s bulk connection into the inbox, answering on the same
    /// connection.
    pub(crate) async fn serve_incoming(&self, conn: Conn, from: u32) {
        let (rd, mut wr) = tokio::io::split(conn);
        // Unbounded, but bounded in practice: one message per probe and one per shared blob
        // dropped, and at most one shared blob per page of the arena is alive at once.
        let (answer, mut answers) = mpsc::unbounded_channel::<Answer>();
        let write_answers = async move {
            while let Some(m) = answers.recv().await {
                wr.write_all(&m.encode()).await?;
                if answers.is_empty() {
                    wr.flush().await?;
                }
            }
            Ok::<_, std::io::Error>(())
        };
        tokio::select! {
            _ = self.read_records(rd, from, answer) => {}
            r = write_answers => if let Err(e) = r {
                tracing::debug!(from, cause = %e, "bulk answers failed");
            }
        }
    }

    async fn read_records(
        &self,
        mut conn: tokio::io::ReadHalf<Conn>,
        from: u32,
        answer: mpsc::UnboundedSender<Answer>,
    ) {
        let mut mapping: Option<Arc<shm::Mapping>> = None;
        loop {
            let mut kind = [0u8; 1];
            if conn.read_exact(&mut kind).await.is_err() {
                return;
            }
            match kind[0] {
                STREAM => {}
                ARENA => {
                    let mut a = [0u8; shm::Announce::BYTES];
                    if conn.read_exact(&mut a).await.is_err() {
                        return;
                    }
                    let a = shm::Announce::decode(&a);
                    let m = match shm::Mapping::open(&a) {
                        Ok(map) => {
                            mapping = Some(map);
                            Answer::Mapped
                        }
                        Err(e) => {
                            tracing::debug!(from, cause = %e, "cannot map the peer's arena");
                            Answer::NotMapped
                        }
                    };
                    if answer.send(m).is_err() {
                        return;
                    }
                    continue;
                }
                SHM => {
                    let mut r = [0u8; 24];
                    if conn.read_exact(&mut r).await.is_err() {
                        return;
                    }
                    let at =
                        |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
                    let (id, len, off) = (at(0), at(8), at(16));
                    let leased = mapping.as_ref().and_then(|m| {
                        m.lease(
                            usize::try_from(off).ok()?,
                            usize::try_from(len).ok()?,
                            answer.clone(),
                        )
                    });
                    let Some(bytes) = leased else {
                        tracing::warn!(
                        from, off, len,
                        "refused a shared blob outside the mapped arena; closing that bulk connection"
                    );
                        return;
                    };
                    self.deposit(from, id, bytes);
                    continue;
                }
                other => {
                    tracing::warn!(
                        from,
                        kind = other,
                        "unknown bulk record; closing that bulk connection"
                    );
                    return;
                }
            }
            let mut header = [0u8; 16];
            if conn.read_exact(&mut header).await.is_err() {
                return;
            }
            let id = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
            if len > self.cfg.max_frame_bytes as u64 {
                tracing::warn!(
                    from,
                    len,
                    limit = self.cfg.max_frame_bytes,
                    "refused an oversized bulk record; closing that bulk connection"
                );
                return;
            }
            let len = len as usize;
            let mut buf = self.pool.take(len);
            let mut record = (&mut conn).take(len as u64);
            while buf.len() < len {
                match record.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
            let pooled = Pooled {
                buf,
                pool: Arc::downgrade(&self.pool),
            };
            self.deposit(from, id, Bytes::from_owner(pooled));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_recycles_within_its_cap_and_size_band() {
        let pool = BufPool::new(3 << 20);
        let mut v = pool.take(1 << 20);
        v.resize(1 << 20, 7);
        let ptr = v.as_ptr();
        let b = Bytes::from_owner(Pooled {
            buf: v,
            pool: Arc::downgrade(&pool),
        });
        let b2 = b.clone();
        drop(b);
        assert_eq!(pool.parked.load(Ordering::Relaxed), 0, "still referenced");
        drop(b2);
        assert!(pool.parked.load(Ordering::Relaxed) >= 1 << 20);
        // Too small a request does not take a buffer more than twice its size.
        let small = pool.take(100);
        assert_ne!(small.as_ptr(), ptr);
        let again = pool.take((1 << 20) - 10);
        assert_eq!(again.as_ptr(), ptr, "the parked buffer is reused");
        assert!(again.is_empty());
        // Over the cap, buffers are freed instead of parked.
        pool.give(Vec::with_capacity(4 << 20));
        assert_eq!(pool.parked.load(Ordering::Relaxed), 0);
    }
}
