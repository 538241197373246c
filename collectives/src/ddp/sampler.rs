//! [`DistributedSampler`]: which items of a dataset each replica takes, per epoch.

/// Splits a dataset's indices across a group's members, reshuffled each epoch.
///
/// Like PyTorch's `DistributedSampler`: the permutation depends only on `seed` and the epoch,
/// so every member computes the same one; it is padded (by repeating its start) to a multiple
/// of the number of replicas, and member `rank` takes every `replicas`-th index from `rank`.
///
/// ```
/// let s = collectives::DistributedSampler::new(10, 3, 1, 42);
/// let mine = s.indices(0);
/// assert_eq!(mine.len(), 4);
/// ```
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    replicas: usize,
    rank: usize,
    seed: u64,
}

impl DistributedSampler {
    /// A sampler over `len` items for member `rank` of `replicas`.
    ///
    /// # Panics
    ///
    /// If `replicas` is 0 or `rank` is not below it (as slicing out of bounds does: the
    /// caller's arithmetic is wrong, and no later step could mend it).
    pub fn new(len: usize, replicas: usize, rank: usize, seed: u64) -> Self {
        assert!(
            replicas > 0 && rank < replicas,
            "rank {rank} must be below replicas {replicas}"
        );
        Self {
            len,
            replicas,
            rank,
            seed,
        }
    }

    /// The whole epoch's permutation (the same on every member).
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.len).collect();
        let mut s = (self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        for i in (1..p.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            p.swap(i, (s % (i as u64 + 1)) as usize);
        }
        p
    }

    /// This member's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut p = self.permutation(epoch);
        if p.is_empty() {
            return p;
        }
        let total = p.len().div_ceil(self.replicas) * self.replicas;
        let mut k = 0;
        while p.len() < total {
            p.push(p[k]);
            k += 1;
        }
        p.into_iter()
            .skip(self.rank)
            .step_by(self.replicas)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_partitions_the_epoch_and_reshuffles() {
        let n = 3;
        let parts: Vec<Vec<usize>> = (0..n)
            .map(|r| DistributedSampler::new(10, n, r, 7).indices(0))
            .collect();
        assert!(parts.iter().all(|p| p.len() == 4));
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>(), "every item is served");
        let s = DistributedSampler::new(10, n, 0, 7);
        assert_ne!(s.permutation(0), s.permutation(1), "a new order each epoch");
        assert_eq!(
            s.permutation(3),
            DistributedSampler::new(10, n, 2, 7).permutation(3),
            "same on every rank"
        );
    }
}
