//! The ring's passes over memory on several threads ("lanes").
//!
//! The fast ring's work on a piece (copy into the outgoing blob, fold the received piece into
//! it, copy the result back) is plain passes over memory, and one thread does not reach a
//! large machine's memory bandwidth. gloo moves bytes on its transport's event-loop thread
//! beside the thread that reduces, and on a 16-core host it all-reduced faster than our
//! one-thread ring (docs/data-parallelism.md). Where cores are spare, a piece is split into
//! lanes, each on a thread of its own; the parts are whole 64-byte lines, so every element is
//! computed exactly as one thread would (LANE-1: the result does not depend on the number of
//! lanes, bit for bit; `ring_threads_do_not_change_a_single_bit`).
//!
//! The default leaves half of the machine to compute: `cores / (2 × members on this host)`
//! lanes, at most [`MAX_LANES`], at least 1 (so one lane, the single-threaded path, on 2
//! cores). The members on this host are the group's size, or fewer where the launcher says so
//! (`LOCAL_WORLD_SIZE`, which `rpcrun` sets: one rank per host of an 8-host group gets the
//! lanes of one, not of eight).
//! [`ProcessGroup::with_ring_threads`](super::ProcessGroup::with_ring_threads) sets it.

use std::sync::OnceLock;

use super::element::Element;
use super::ReduceOp;

/// At most this many lanes by default: past a few threads a pass is limited by memory.
pub(crate) const MAX_LANES: usize = 4;

/// A lane gets at least this many bytes; smaller pieces stay on one thread (handing a part
/// to a lane thread costs a wake-up, microseconds; a pass over 1 MiB about a hundred).
const MIN_LANE_BYTES: usize = 1 << 20;

/// Lanes for a group of `n` members on a machine of `cores` cores.
pub(crate) fn default_lanes(cores: usize, n: usize) -> usize {
    (cores / (2 * n.max(1))).clamp(1, MAX_LANES)
}

/// How many of a group of `n` members share this host: `n`, or the launcher's
/// `LOCAL_WORLD_SIZE` (`local`) where it is a smaller positive number.
pub(crate) fn members_on_host(n: usize, local: Option<&str>) -> usize {
    local
        .and_then(|l| l.trim().parse::<usize>().ok())
        .filter(|&l| l >= 1)
        .map_or(n, |l| l.min(n))
}

/// The machine's cores, as the standard library sees them (1 if unknown).
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Elements per lane for `len` elements of `elem` bytes on up to `lanes` lanes: a multiple of
/// 16 elements (whole 64-byte lines for `f32`), all of `len` when one lane does.
pub(crate) fn per_lane(len: usize, elem: usize, lanes: usize) -> usize {
    let by_size = (len * elem / MIN_LANE_BYTES).max(1);
    let lanes = lanes.min(by_size).max(1);
    if lanes == 1 {
        return len.max(1);
    }
    len.div_ceil(lanes).next_multiple_of(16)
}

/// The process's lane threads, started on first use (one per core, at most 16): starting a
/// thread per part cost 200 µs for three on the development VM, as long as a lane's pass.
/// `None` if the threads could not be started (the passes then run on the caller's thread).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores().clamp(1, 16))
            .thread_name(|i| format!("ring-lane-{i}"))
            .build()
            .map_err(|e| tracing::warn!("ring lanes on one thread: {e}"))
            .ok()
    })
    .as_ref()
}

/// Runs `f` on every part, the first on this thread and the others on the lane threads, and
/// returns when all are done (a part's panic comes back here).
pub(crate) fn run<P: Send>(parts: impl Iterator<Item = P>, f: impl Fn(P) + Sync) {
    let mut parts = parts.peekable();
    let Some(first) = parts.next() else { return };
    let Some(pool) = pool().filter(|_| parts.peek().is_some()) else {
        f(first);
        parts.for_each(&f);
        return;
    };
    pool.in_place_scope(|s| {
        let f = &f;
        for p in parts {
            s.spawn(move |_| f(p));
        }
        f(first);
    });
}

/// The ring's passes over a piece ([`Element`]'s kernels), each on up to this many lanes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lanes(pub usize);

impl Lanes {
    fn per<T>(self, len: usize) -> (usize, usize) {
        let elem = std::mem::size_of::<T>();
        (per_lane(len, elem, self.0), elem)
    }

    /// [`Element::write_le`].
    pub(crate) fn write<T: Element>(self, src: &[T], dst: &mut [u8]) {
        let (k, e) = self.per::<T>(src.len());
        run(src.chunks(k).zip(dst.chunks_mut(k * e)), |(s, d)| {
            T::write_le(s, d)
        });
    }

    /// [`Element::fold_le`].
    pub(crate) fn fold<T: Element>(self, op: ReduceOp, mine: &[T], theirs: &[u8], dst: &mut [u8]) {
        let (k, e) = self.per::<T>(mine.len());
        let parts = mine
            .chunks(k)
            .zip(theirs.chunks(k * e))
            .zip(dst.chunks_mut(k * e));
        run(parts, |((m, t), d)| T::fold_le(op, m, t, d));
    }

    /// [`Element::fold_tee`].
    pub(crate) fn fold_tee<T: Element>(
        self,
        op: Option<ReduceOp>,
        buf: &mut [T],
        theirs: &[u8],
        dst: &mut [u8],
    ) {
        let (k, e) = self.per::<T>(buf.len());
        let parts = buf
            .chunks_mut(k)
            .zip(theirs.chunks(k * e))
            .zip(dst.chunks_mut(k * e));
        run(parts, |((b, t), d)| T::fold_tee(op, b, t, d));
    }

    /// [`Element::copy_into`].
    pub(crate) fn copy<T: Element>(self, dst: &mut [T], src: &[u8]) {
        let (k, e) = self.per::<T>(dst.len());
        run(dst.chunks_mut(k).zip(src.chunks(k * e)), |(d, s)| {
            T::copy_into(d, s)
        });
    }

    /// Every element divided by `n` (a mean's last step).
    pub(crate) fn divide<T: Element>(self, buf: &mut [T], n: usize) {
        let (k, _) = self.per::<T>(buf.len());
        run(buf.chunks_mut(k), |b| {
            for x in b.iter_mut() {
                *x = x.div_by(n);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_leave_half_the_cores_and_stay_within_bounds() {
        assert_eq!(default_lanes(2, 2), 1);
        assert_eq!(default_lanes(16, 2), 4);
        assert_eq!(default_lanes(16, 4), 2);
        assert_eq!(default_lanes(1, 8), 1);
        assert_eq!(default_lanes(256, 1), MAX_LANES);
        assert_eq!(members_on_host(8, None), 8);
        assert_eq!(members_on_host(8, Some("1")), 1);
        assert_eq!(members_on_host(2, Some("4")), 2);
        assert_eq!(members_on_host(8, Some("0")), 8);
        assert_eq!(members_on_host(8, Some("x")), 8);
        assert_eq!(default_lanes(16, members_on_host(8, Some("1"))), 4);
    }

    #[test]
    fn lanes_split_whole_lines_and_cover_every_element() {
        // Small pieces stay whole.
        assert_eq!(per_lane(1000, 4, 4), 1000);
        assert_eq!(per_lane(0, 4, 4), 1);
        // 8 MiB of f32 on 4 lanes: four parts of whole lines.
        let len = 2 << 20;
        let per = per_lane(len + 3, 4, 4);
        assert_eq!(per % 16, 0);
        assert_eq!((len + 3).div_ceil(per), 4);
        let sum = std::sync::atomic::AtomicUsize::new(0);
        let v: Vec<u8> = vec![1; len + 3];
        run(v.chunks(per), |p| {
            sum.fetch_add(p.len(), std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), len + 3);
    }
}
