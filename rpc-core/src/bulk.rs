//! The bulk path: large blobs bypass tarpc and serde entirely.
//!
//! Each worker keeps, per peer, one outgoing *bulk* connection (authenticated like every other)
//! and a writer task that sends `[id: u64 LE][len: u64 LE][bytes]` records straight from the
//! blob's memory. The receiving side reads each record into a buffer allocated at its exact
//! size (no growth, no re-copy) and files it in an inbox under `(sender, id)`. The control
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

use crate::agent::Agent;
use crate::auth::{self, ConnKind};
use crate::transport::Conn;
use crate::wire::WireBlob;

const ORPHAN_TTL: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(300);
/// Records queued per outgoing bulk connection (each holds a reference, not a copy).
const QUEUE: usize = 64;

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

/// The queue feeding one outgoing bulk connection's writer task.
type Outbox = mpsc::Sender<(u64, Bytes)>;

/// Bulk state of one agent.
pub(crate) struct Bulk {
    pool: Arc<BufPool>,
    next_id: AtomicU64,
    inbox: Mutex<Inbox>,
    outboxes: Vec<tokio::sync::Mutex<Option<Outbox>>>,
}

#[derive(Default)]
struct Inbox {
    slots: HashMap<(u32, u64), Slot>,
    last_sweep: Option<Instant>,
}

impl Bulk {
    pub(crate) fn new(world_size: u32, pool_bytes: usize) -> Self {
        Self {
            pool: BufPool::new(pool_bytes),
            next_id: AtomicU64::new(1),
            inbox: Mutex::new(Inbox::default()),
            outboxes: (0..world_size)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
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

/// Turns an outgoing side table into wire entries, queueing large blobs on the bulk
/// connection to `to`.
pub(crate) async fn send(
    agent: &Agent,
    to: u32,
    blobs: Vec<Bytes>,
) -> Result<Vec<WireBlob>, String> {
    let inner = &agent.inner;
    let mut out = Vec::with_capacity(blobs.len());
    for b in blobs {
        if b.len() < inner.cfg.bulk_threshold {
            out.push(WireBlob::Inline(b.to_vec()));
            continue;
        }
        if b.len() > inner.cfg.max_frame_bytes {
            return Err(format!(
                "a blob of {} bytes exceeds the frame limit of {}",
                b.len(),
                inner.cfg.max_frame_bytes
            ));
        }
        let id = inner.bulk.next_id.fetch_add(1, Ordering::Relaxed);
        let len = b.len() as u64;
        let tx = outbox(agent, to).await?;
        tx.send((id, b)).await.map_err(|_| {
            format!(
                "bulk connection to `{}` closed",
                inner.workers[to as usize].name
            )
        })?;
        out.push(WireBlob::Bulk { id, len });
    }
    Ok(out)
}

async fn outbox(agent: &Agent, to: u32) -> Result<Outbox, String> {
    let inner = &agent.inner;
    let mut slot = inner.bulk.outboxes[to as usize].lock().await;
    if let Some(tx) = slot.as_ref().filter(|tx| !tx.is_closed()) {
        return Ok(tx.clone());
    }
    let peer = &inner.peers[to as usize];
    let cfg = &inner.cfg;
    let dial = async {
        let (mut conn, _) = inner.cfg.transport.connect(&peer.addr).await?;
        auth::client(&mut conn, &cfg.secret, ConnKind::Bulk, cfg.rank).await?;
        Ok::<_, std::io::Error>(conn)
    };
    let conn = tokio::time::timeout(cfg.connect_timeout + cfg.handshake_timeout, dial)
        .await
        .map_err(|_| format!("bulk connection to `{}` timed out", peer.info.name))?
        .map_err(|e| {
            format!(
                "bulk connection to `{}` at {} failed: {e}",
                peer.info.name, peer.addr
            )
        })?;
    let (tx, rx) = mpsc::channel(QUEUE);
    let name = peer.info.name.clone();
    let stop = inner.stop.clone();
    inner.conns.spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            r = write_loop(conn, rx) => if let Err(e) = r {
                tracing::warn!(peer = %name, cause = %e, "bulk connection failed");
            }
        }
    });
    *slot = Some(tx.clone());
    Ok(tx)
}

async fn write_loop(mut conn: Conn, mut rx: mpsc::Receiver<(u64, Bytes)>) -> std::io::Result<()> {
    while let Some((id, data)) = rx.recv().await {
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&id.to_le_bytes());
        header[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        conn.write_all(&header).await?;
        conn.write_all(&data).await?;
        if rx.is_empty() {
            conn.flush().await?;
        }
    }
    conn.shutdown().await
}

/// Reads records from `from`'s bulk connection into the inbox.
pub(crate) async fn serve_incoming(agent: &Agent, mut conn: Conn, from: u32) {
    let inner = &agent.inner;
    loop {
        let mut header = [0u8; 16];
        if conn.read_exact(&mut header).await.is_err() {
            return;
        }
        let id = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
        if len > inner.cfg.max_frame_bytes as u64 {
            tracing::warn!(
                worker = %agent.name(), from, len, limit = inner.cfg.max_frame_bytes,
                "refused an oversized bulk record; closing that bulk connection"
            );
            return;
        }
        let len = len as usize;
        let mut buf = inner.bulk.pool.take(len);
        let mut record = (&mut conn).take(len as u64);
        while buf.len() < len {
            match record.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
        let pooled = Pooled {
            buf,
            pool: Arc::downgrade(&inner.bulk.pool),
        };
        inner.bulk.deposit(from, id, Bytes::from_owner(pooled));
    }
}

/// Rebuilds an incoming side table, waiting for bulk records as needed.
pub(crate) async fn receive(
    agent: &Agent,
    from: u32,
    wire: Vec<WireBlob>,
    deadline: Option<Instant>,
) -> Result<Vec<Bytes>, String> {
    let bulk: &Arc<Bulk> = &agent.inner.bulk;
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
