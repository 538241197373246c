//! Same-host shared memory for bulk blobs.
//!
//! A sender whose peer runs on the same host copies a large blob once into an *arena*, a memfd
//! it shares with that peer, and sends only the blob's offset and length on the bulk
//! connection. The receiver maps the arena once and hands the blob out as a `Bytes` that points
//! into its mapping: no copy, no socket. When the last reference to it drops, the receiver
//! tells the sender that the range is free again. Over loopback TCP the same blob costs a copy
//! into the kernel, a copy out of it and a wake-up per socket buffer on each side.
//!
//! Whether the peer shares the host is probed, never assumed: the arena is announced with the
//! sender's pid, the memfd's descriptor number and a random token; the receiver opens
//! `/proc/<pid>/fd/<fd>` and checks that it is one of our memfds, of the announced size, whose
//! first bytes are the token. On another host, in another PID namespace or container, or where
//! `/proc` is not visible, the probe fails and the connection keeps streaming bytes.
//!
//! A sender can also build a blob in the arena in the first place ([`Arena::stage`], behind
//! `Agent::blob_for`): the bytes are written once, straight into shared memory, and sending
//! the blob then copies nothing at all.
//!
//! Invariants:
//! - SHM-1: a range of the arena belongs to one blob from its allocation until every holder
//!   has let it go: the receiver's lease of each record naming it, and the sender's own blob
//!   if it was staged there. The sender writes a range only before its first record. If the
//!   connection breaks, the sender drops the arena (the receiver's mappings keep the pages
//!   alive for the blobs still in use there; staged blobs keep the sender's).
//! - SHM-2: the sender never waits for room: a blob that does not fit takes the stream, so a
//!   receiver that keeps its blobs alive slows nothing down and cannot deadlock a sender.
//! - SHM-3: the receiver maps only a memfd of ours that carries the announced token and is
//!   sealed against shrinking and growing (so no process can pull pages from under a lease),
//!   and refuses a range outside the arena (closing that bulk connection, like an oversized
//!   record). It probes on a blocking thread, never on the runtime's.
//! - SHM-4: the sender frees a range on the receiver's release only if a record it sent named
//!   that range and was not released yet; any other release closes the bulk connection.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The name every arena memfd carries (visible in `/proc/<pid>/fd` as `/memfd:<name>`).
const MEMFD_NAME: &str = "rpc-core-shm";
/// Bytes at the start of an arena that hold its token; blobs start after them.
pub(crate) const HEADER: usize = 4096;
/// Blobs start at multiples of this (a page), so their bytes are aligned for any element type.
const ALIGN: usize = 4096;

/// What the receiver needs to map an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Announce {
    pub pid: u32,
    pub fd: u32,
    pub size: u64,
    pub token: [u8; 16],
}

impl Announce {
    pub(crate) const BYTES: usize = 4 + 4 + 8 + 16;

    pub(crate) fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..].copy_from_slice(&self.token);
        b
    }

    pub(crate) fn decode(b: &[u8; Self::BYTES]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Self {
            pid: u32_at(0),
            fd: u32_at(4),
            size: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            token: b[16..].try_into().expect("16 bytes"),
        }
    }
}

/// The receiver's answers on a bulk connection, `[kind][u64]` on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The announced arena is mapped: shared blobs may follow.
    Mapped,
    /// The announced arena could not be mapped: keep streaming.
    NotMapped,
    /// The shared blob at this offset is no longer referenced.
    Released(u64),
}

impl Answer {
    pub(crate) fn encode(self) -> [u8; 9] {
        let (kind, arg) = match self {
            Self::Mapped => (1, 0),
            Self::NotMapped => (2, 0),
            Self::Released(off) => (3, off),
        };
        let mut m = [0u8; 9];
        m[0] = kind;
        m[1..].copy_from_slice(&arg.to_le_bytes());
        m
    }

    pub(crate) fn decode(m: [u8; 9]) -> Option<Self> {
        let arg = u64::from_le_bytes(m[1..].try_into().expect("8 bytes"));
        match m[0] {
            1 => Some(Self::Mapped),
            2 => Some(Self::NotMapped),
            3 => Some(Self::Released(arg)),
            _ => None,
        }
    }
}

/// First-fit allocation of page-aligned ranges of `[HEADER, size)`.
#[derive(Debug)]
struct Ranges {
    /// Free ranges: start → length; never two adjacent ones.
    free: BTreeMap<usize, usize>,
    /// Allocated ranges: start → (length, holders).
    used: HashMap<usize, (usize, u32)>,
}

impl Ranges {
    fn new(size: usize) -> Self {
        let mut free = BTreeMap::new();
        if size > HEADER {
            free.insert(HEADER, size - HEADER);
        }
        Self {
            free,
            used: HashMap::new(),
        }
    }

    fn take(&mut self, len: usize) -> Option<usize> {
        let want = len.max(1).div_ceil(ALIGN).checked_mul(ALIGN)?;
        let (&start, &have) = self.free.iter().find(|(_, &l)| l >= want)?;
        self.free.remove(&start);
        if have > want {
            self.free.insert(start + want, have - want);
        }
        self.used.insert(start, (want, 1));
        Some(start)
    }

    /// One more holder of the range starting at `start`; false if none is allocated there.
    fn hold(&mut self, start: usize) -> bool {
        match self.used.get_mut(&start) {
            Some((_, holders)) => {
                *holders += 1;
                true
            }
            None => false,
        }
    }

    /// One holder fewer; the last one frees the range. False if none is allocated there.
    fn give(&mut self, start: usize) -> bool {
        let Some((len, holders)) = self.used.get_mut(&start) else {
            return false;
        };
        *holders -= 1;
        if *holders > 0 {
            return true;
        }
        let mut len = *len;
        self.used.remove(&start);
        let mut start = start;
        if let Some(next) = self.free.remove(&(start + len)) {
            len += next;
        }
        if let Some((&prev, &plen)) = self.free.range(..start).next_back() {
            if prev + plen == start {
                self.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        self.free.insert(start, len);
        true
    }
}

/// The sending side's arena for one peer.
pub(crate) struct Arena {
    file: std::fs::File,
    map: memmap2::MmapRaw,
    token: [u8; 16],
    ranges: std::sync::Mutex<Ranges>,
    /// Records sent naming each offset and not yet released by the receiver (SHM-4).
    leases: std::sync::Mutex<HashMap<usize, u32>>,
}

impl Arena {
    /// A new arena of `size` bytes (pages are allocated as blobs touch them).
    pub(crate) fn create(size: usize) -> io::Result<Self> {
        if size <= HEADER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an arena of {size} bytes has no room after its {HEADER}-byte header"),
            ));
        }
        let file = std::fs::File::from(memfd()?);
        file.set_len(size as u64)?;
        seal(&file)?;
        let map = memmap2::MmapOptions::new().len(size).map_raw(&file)?;
        let mut token = [0u8; 16];
        super::auth::fill_random(&mut token);
        // SAFETY: the mapping is `size > HEADER >= 16` bytes long and nothing else writes it
        // yet: the arena has not been announced.
        unsafe { std::ptr::copy_nonoverlapping(token.as_ptr(), map.as_mut_ptr(), token.len()) };
        Ok(Self {
            file,
            map,
            token,
            ranges: std::sync::Mutex::new(Ranges::new(size)),
            leases: std::sync::Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn announce(&self) -> Announce {
        use std::os::fd::AsRawFd;
        Announce {
            pid: std::process::id(),
            fd: self.file.as_raw_fd() as u32,
            size: self.map.len() as u64,
            token: self.token,
        }
    }

    fn ranges(&self) -> std::sync::MutexGuard<'_, Ranges> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The offset of `data` if it is a blob staged in this arena (its first byte is the start
    /// of a range), taking one more hold on it for the receiver's lease.
    pub(crate) fn hold_staged(&self, data: &[u8]) -> Option<usize> {
        let base = self.map.as_ptr() as usize;
        let off = (data.as_ptr() as usize).checked_sub(base)?;
        if off >= self.map.len() || !self.ranges().hold(off) {
            return None;
        }
        Some(off)
    }

    /// A blob of `len` bytes built in the arena by `fill`; gives `fill` back if no range is
    /// free that is large enough.
    pub(crate) fn stage<F: FnOnce(&mut [u8])>(
        self: &Arc<Self>,
        len: usize,
        fill: F,
    ) -> Result<Bytes, F> {
        let Some(off) = self.ranges().take(len) else {
            return Err(fill);
        };
        // SAFETY: `take` returned a range inside the mapping, at least `len` long, that nothing
        // else holds and that no record has named yet (SHM-1), so nobody else reads or writes
        // it while `fill` runs; the bytes may be uninitialized memory of the memfd, which the
        // kernel zero-fills, so they are initialized.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) };
        fill(dst);
        Ok(Bytes::from_owner(Staged {
            arena: Arc::clone(self),
            off,
            len,
        }))
    }

    /// Copies `data` into a free range and returns its offset; `None` if nothing is free that
    /// is large enough (SHM-2: the caller streams the blob instead).
    pub(crate) fn put(&self, data: &[u8]) -> Option<usize> {
        let off = self.ranges().take(data.len())?;
        // SAFETY: `take` returned a range inside the mapping, at least `data.len()` long, that
        // no other blob holds and that the receiver does not read until it has the record
        // naming it (SHM-1). The receiver's mapping is read-only.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_mut_ptr().add(off), data.len())
        };
        Some(off)
    }

    /// A holder is done with the range at `off`; false if no range is allocated there.
    pub(crate) fn release(&self, off: usize) -> bool {
        self.ranges().give(off)
    }

    /// A record naming the range at `off` went to the receiver: it holds a lease on it.
    pub(crate) fn lent(&self, off: usize) {
        *self
            .leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(off)
            .or_insert(0) += 1;
    }

    /// The receiver released a lease on the range at `off`; false if it held none there
    /// (SHM-4: a duplicate or invented release never frees a range still in use).
    pub(crate) fn returned(&self, off: usize) -> bool {
        {
            let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            match leases.get_mut(&off) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    leases.remove(&off);
                }
                None => return false,
            }
        }
        self.release(off)
    }
}

/// Seals an arena's size: neither its creator nor anyone who opens it through `/proc` can
/// shrink it under a receiver's mapping (which would kill the receiver with SIGBUS on its
/// next touch of a leased page) or grow it, and the seals themselves are final (SHM-3).
#[cfg(target_os = "linux")]
fn seal(file: &std::fs::File) -> io::Result<()> {
    use rustix::fs::SealFlags;
    rustix::fs::fcntl_add_seals(file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn seal(_file: &std::fs::File) -> io::Result<()> {
    Ok(())
}

/// Whether `file` carries the seals [`seal`] sets.
#[cfg(target_os = "linux")]
fn sealed(file: &std::fs::File) -> io::Result<bool> {
    use rustix::fs::SealFlags;
    let need = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    Ok(rustix::fs::fcntl_get_seals(file)?.contains(need))
}

#[cfg(not(target_os = "linux"))]
fn sealed(_file: &std::fs::File) -> io::Result<bool> {
    Ok(false)
}

/// A blob the sender built in its arena; holds its range until dropped.
struct Staged {
    arena: Arc<Arena>,
    off: usize,
    len: usize,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range is inside the mapping and held by this blob, so nobody writes it
        // any more (SHM-1).
        unsafe { std::slice::from_raw_parts(self.arena.map.as_ptr().add(self.off), self.len) }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.arena.release(self.off);
    }
}

#[cfg(target_os = "linux")]
fn memfd() -> io::Result<std::os::fd::OwnedFd> {
    Ok(rustix::fs::memfd_create(
        MEMFD_NAME,
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )?)
}

#[cfg(not(target_os = "linux"))]
fn memfd() -> io::Result<std::os::fd::OwnedFd> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "shared-memory arenas need Linux",
    ))
}

/// The receiving side's read-only mapping of a peer's arena.
pub(crate) struct Mapping {
    map: memmap2::Mmap,
}

impl Mapping {
    /// Maps the arena `a` names, checking that it is ours and carries its token (SHM-3).
    pub(crate) fn open(a: &Announce) -> io::Result<Arc<Self>> {
        let path = format!("/proc/{}/fd/{}", a.pid, a.fd);
        let target = std::fs::read_link(&path)?;
        if !target
            .to_string_lossy()
            .starts_with(&format!("/memfd:{MEMFD_NAME}"))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} is {target:?}, not an arena"),
            ));
        }
        let file = std::fs::File::open(&path)?;
        if !sealed(&file)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} is not sealed: its size could change under our mapping"),
            ));
        }
        let size = file.metadata()?.len();
        if size != a.size || size <= HEADER as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} has {size} bytes, {} announced", a.size),
            ));
        }
        // SAFETY: a read-only shared mapping of a memfd whose size only its creator changes,
        // and it never does after announcing it. Its contents change under us only in ranges
        // that no lease covers (SHM-1).
        let map = unsafe { memmap2::MmapOptions::new().len(size as usize).map(&file)? };
        if map[..16] != a.token {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} does not carry the announced token"),
            ));
        }
        Ok(Arc::new(Self { map }))
    }

    /// The blob at `off..off + len` as bytes that release their range (send
    /// [`Answer::Released`] on `release`) when the last reference drops; `None` if the range is
    /// outside the arena.
    pub(crate) fn lease(
        self: &Arc<Self>,
        off: usize,
        len: usize,
        release: mpsc::UnboundedSender<Answer>,
    ) -> Option<Bytes> {
        let end = off.checked_add(len)?;
        if off < HEADER || end > self.map.len() {
            return None;
        }
        Some(Bytes::from_owner(Lease {
            map: Arc::clone(self),
            off,
            len,
            release,
        }))
    }
}

/// One blob's range of a mapped arena.
struct Lease {
    map: Arc<Mapping>,
    off: usize,
    len: usize,
    /// Bounded by the number of leases alive at once (at most one per page of the arena).
    release: mpsc::UnboundedSender<Answer>,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        &self.map.map[self.off..self.off + self.len]
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // The connection may be gone; the sender has then dropped its arena already.
        let _ = self.release.send(Answer::Released(self.off as u64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_first_fit_page_aligned_and_coalesce() {
        let mut r = Ranges::new(HEADER + 4 * ALIGN);
        let a = r.take(1).unwrap();
        let b = r.take(ALIGN + 1).unwrap();
        let c = r.take(ALIGN).unwrap();
        assert_eq!((a, b, c), (HEADER, HEADER + ALIGN, HEADER + 3 * ALIGN));
        assert_eq!(r.take(1), None, "full");
        assert!(r.give(b));
        assert!(!r.give(b), "a range is released once");
        assert_eq!(r.take(3 * ALIGN), None, "only two pages are free");
        assert!(r.give(a));
        assert!(r.give(c));
        assert_eq!(r.free.len(), 1, "neighbours coalesce: {:?}", r.free);
        assert_eq!(r.take(4 * ALIGN), Some(HEADER));
        assert!(r.hold(HEADER));
        assert!(r.give(HEADER));
        assert_eq!(r.take(1), None, "one holder is left");
        assert!(r.give(HEADER));
        assert!(!r.hold(HEADER), "freed");
        assert_eq!(r.take(1), Some(HEADER));
    }

    #[test]
    fn a_staged_blob_is_sent_without_a_copy_and_freed_by_its_last_holder() {
        let arena = Arc::new(Arena::create(HEADER + 2 * ALIGN).unwrap());
        let map = Mapping::open(&arena.announce()).unwrap();
        let staged = arena
            .stage(ALIGN + 1, |b| b.fill(7))
            .unwrap_or_else(|_| panic!("room for one blob"));
        assert!(staged.iter().all(|&b| b == 7));
        assert_eq!(
            arena.hold_staged(&staged[1..]),
            None,
            "only a range's start"
        );
        assert_eq!(arena.hold_staged(&[1, 2]), None, "not in the arena");
        let off = arena.hold_staged(&staged).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let lease = map.lease(off, staged.len(), tx).unwrap();
        assert_eq!(lease, staged);
        drop(staged);
        assert!(
            arena.stage(ALIGN, |_| ()).is_err(),
            "the receiver still holds it"
        );
        drop(lease);
        let Answer::Released(off) = rx.try_recv().unwrap() else {
            panic!("a release")
        };
        assert!(arena.release(off as usize));
        assert!(arena.stage(2 * ALIGN, |_| ()).is_ok(), "free again");
    }

    #[test]
    fn a_blob_crosses_through_the_arena_and_its_range_comes_back() {
        let arena = Arena::create(HEADER + 2 * ALIGN).unwrap();
        let map = Mapping::open(&arena.announce()).unwrap();
        let data: Vec<u8> = (0..ALIGN + 10).map(|i| (i % 251) as u8).collect();
        let off = arena.put(&data).unwrap();
        assert_eq!(arena.put(&[1]), None, "no room for a second blob");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let bytes = map.lease(off, data.len(), tx.clone()).unwrap();
        assert_eq!(&bytes[..], &data[..]);
        assert!(map.lease(off, 3 * ALIGN, tx.clone()).is_none(), "outside");
        assert!(map.lease(0, 16, tx).is_none(), "the header is not a blob");
        let copy = bytes.clone();
        drop(bytes);
        assert!(rx.try_recv().is_err(), "still referenced");
        drop(copy);
        assert_eq!(rx.try_recv().unwrap(), Answer::Released(off as u64));
        assert!(arena.release(off));
        assert!(arena.put(&data).is_some(), "the range is free again");
    }

    #[test]
    fn the_probe_refuses_a_wrong_token_or_size() {
        let arena = Arena::create(HEADER + ALIGN).unwrap();
        let mut a = arena.announce();
        a.token[0] ^= 1;
        assert!(Mapping::open(&a).is_err());
        let mut a = arena.announce();
        a.size += 1;
        assert!(Mapping::open(&a).is_err());
        let mut a = arena.announce();
        a.fd = 0; // stdin: not an arena
        assert!(Mapping::open(&a).is_err());
        assert_eq!(
            Announce::decode(&arena.announce().encode()),
            arena.announce()
        );
        for a in [Answer::Mapped, Answer::NotMapped, Answer::Released(1 << 40)] {
            assert_eq!(Answer::decode(a.encode()), Some(a));
        }
        assert_eq!(Answer::decode([9; 9]), None);
    }

    /// SHM-3: an arena is sealed; nobody, through `/proc` or its own descriptor, can shrink
    /// it under a receiver's mapping, and a memfd of ours without the seals is not mapped.
    #[test]
    fn arenas_are_sealed_and_unsealed_ones_are_refused() {
        let arena = Arena::create(HEADER + 2 * ALIGN).unwrap();
        let a = arena.announce();
        let other = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{}/fd/{}", a.pid, a.fd))
            .unwrap();
        let err = other.set_len(HEADER as u64).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        assert!(
            arena.file.set_len(u64::MAX >> 2).is_err(),
            "it cannot grow either"
        );
        assert!(Mapping::open(&a).is_ok());
        // The same kind of memfd, carrying a token, but never sealed.
        let raw = std::fs::File::from(memfd().unwrap());
        raw.set_len((HEADER + ALIGN) as u64).unwrap();
        use std::io::Write;
        (&raw).write_all(&[7u8; 16]).unwrap();
        use std::os::fd::AsRawFd;
        let forged = Announce {
            pid: std::process::id(),
            fd: raw.as_raw_fd() as u32,
            size: (HEADER + ALIGN) as u64,
            token: [7u8; 16],
        };
        let err = Mapping::open(&forged).err().expect("refused");
        assert!(err.to_string().contains("not sealed"), "{err}");
    }

    /// SHM-4: a release frees a range only against a record sent for it; a duplicate one is
    /// refused.
    #[test]
    fn releases_are_matched_against_leases() {
        let arena = Arena::create(HEADER + 2 * ALIGN).unwrap();
        let off = arena.put(&[1u8; 100]).unwrap();
        assert!(!arena.returned(off), "no record named it yet");
        arena.lent(off);
        assert!(arena.returned(off));
        assert!(!arena.returned(off), "a duplicate release");
        // The range was freed once, by the one real release.
        assert_eq!(arena.put(&[2u8; 2 * ALIGN]), Some(HEADER));
    }
}
