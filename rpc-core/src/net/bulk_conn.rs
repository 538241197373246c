//! One bulk connection, both ends: the record format, the sender's writer (with the
//! shared-memory arena it announces and fills) and the receiver's reader.
//!
//! Records, sender to receiver: `STREAM` `[0][id: u64][len: u64]` and the bytes, straight from
//! the blob's memory; `ARENA` `[1]` and an announcement (`shm::Announce`); `SHM`
//! `[2][id][len][off: u64]`, a blob the sender copied into the arena (or built there). Answers,
//! receiver to sender: `[kind][u64]`, `MAPPED`/`NOT_MAPPED` for the probe and `RELEASED off`
//! when a shared blob's last reference is dropped (`shm::Answer`).

use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::buffers::BufPool;
use super::shm::{self, Answer, Arena};
use super::transport::Conn;

/// Record kinds, sender to receiver.
const STREAM: u8 = 0;
const ARENA: u8 = 1;
const SHM: u8 = 2;

/// How many blobs and bytes went each way, counted by the writers.
#[derive(Default)]
pub(crate) struct Counters {
    pub streamed_blobs: AtomicU64,
    pub streamed_bytes: AtomicU64,
    pub shared_blobs: AtomicU64,
    pub shared_bytes: AtomicU64,
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

/// The sender's view of its shared-memory arena on one bulk connection.
pub(crate) enum ArenaState {
    /// Not created yet (no blob large enough so far).
    None,
    /// Announced; blobs stream until the peer answers.
    Probing(Arc<Arena>),
    /// Mapped by the peer.
    Ready(Arc<Arena>),
    /// Off: not configured, not creatable, or the peer could not map it.
    Off,
}

pub(crate) type SharedArena = Arc<Mutex<ArenaState>>;

pub(crate) fn lock_arena(a: &SharedArena) -> std::sync::MutexGuard<'_, ArenaState> {
    a.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) async fn write_loop(
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
                Some(off) => {
                    a.lent(off);
                    Placement::Shared(off)
                }
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
                if usize::try_from(off).is_ok_and(|off| a.returned(off)) => {}
            (answer, _) => return Err(bad(format!("unexpected bulk answer {answer:?} ({m:?})"))),
        }
    }
}

/// Reads the records of `from`'s bulk connection, handing each blob to `deposit` (under its
/// id) and answering on the same connection. Stream records are read into buffers of `pool`;
/// one longer than `max` closes the connection (BULK-3).
pub(crate) async fn serve(
    conn: Conn,
    from: u32,
    max: usize,
    pool: &Arc<BufPool>,
    deposit: impl Fn(u64, Bytes),
) {
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
        _ = read_records(rd, from, max, pool, &deposit, answer) => {}
        r = write_answers => if let Err(e) = r {
            tracing::debug!(from, cause = %e, "bulk answers failed");
        }
    }
}

async fn read_records(
    mut conn: tokio::io::ReadHalf<Conn>,
    from: u32,
    max: usize,
    pool: &Arc<BufPool>,
    deposit: &impl Fn(u64, Bytes),
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
                // SHM-3: file-system work and mmap, off the runtime's threads.
                let opened = tokio::task::spawn_blocking(move || shm::Mapping::open(&a)).await;
                let m = match opened {
                    Ok(Ok(map)) => {
                        mapping = Some(map);
                        Answer::Mapped
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(from, cause = %e, "cannot map the peer's arena");
                        Answer::NotMapped
                    }
                    Err(e) => {
                        tracing::debug!(from, cause = %e, "the arena probe failed");
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
                let at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
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
                        from,
                        off,
                        len,
                        "refused a shared blob outside the mapped arena; \
                         closing that bulk connection"
                    );
                    return;
                };
                deposit(id, bytes);
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
        if len > max as u64 {
            tracing::warn!(
                from,
                len,
                limit = max,
                "refused an oversized bulk record; closing that bulk connection"
            );
            return;
        }
        let len = len as usize;
        let mut buf = pool.take(len);
        let mut record = (&mut conn).take(len as u64);
        while buf.len() < len {
            match record.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
        deposit(id, BufPool::bytes(pool, buf));
    }
}
