//! Large buffers: allocated on huge pages where the kernel offers them ([`large_vec`]) and, for
//! bulk blobs received, recycled through a bounded pool ([`BufPool`], BULK-4), so a steady
//! stream of large messages does not pay for fresh pages (large allocations are fresh `mmap`s,
//! and a page fault per 4 KiB cost more than sending the bytes over loopback on a VM).

use bytes::Bytes;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// An empty vector with room for `len` elements, for large buffers that are filled right
/// away. Large ones are asked to be backed by transparent huge pages (Linux) before they are
/// touched: a fresh 64 MiB buffer otherwise costs 16,384 page faults, which on a VM took
/// longer than sending it over loopback.
///
/// ```
/// let mut v = rpc_core::ext::large_vec::<f32>(1 << 22);
/// v.resize(1 << 22, 1.0);
/// assert_eq!(v.len(), 1 << 22);
/// ```
pub fn large_vec<T>(len: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = len * std::mem::size_of::<T>();
        if bytes >= 4 * HUGE {
            let start = v.as_ptr() as usize;
            let aligned = (start + HUGE - 1) & !(HUGE - 1);
            let end = (start + bytes) & !(HUGE - 1);
            if end > aligned {
                // SAFETY: advice on pages of this vector's own allocation; it changes how
                // the kernel backs them, never their contents or validity.
                unsafe {
                    libc::madvise(
                        aligned as *mut libc::c_void,
                        end - aligned,
                        libc::MADV_HUGEPAGE,
                    );
                }
            }
        }
    }
    v
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
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
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

    pub(crate) fn clear(&self) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.parked.store(0, Ordering::Relaxed);
    }
}

impl BufPool {
    /// `buf` (from [`BufPool::take`]) as bytes that give it back to `pool` when the last
    /// reference drops.
    pub(crate) fn bytes(pool: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(pool),
        })
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
