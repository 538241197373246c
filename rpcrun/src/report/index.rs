//! Each rank's spans ordered by start, for the report's two questions about a window: which
//! spans start inside it, and which overlap it. Both are answered without a scan of the whole
//! trace (the report asked them once per step and per span on the critical path, and scanned
//! every span each time: an hour's trace took minutes).

use std::collections::BTreeMap;

use super::model::{Span, Trace};

/// One rank's spans by start, with the latest end over each block of a segment tree, so that
/// the spans ending after a time are found by descending only into blocks that hold one.
struct Rank {
    /// Starts, ascending.
    starts: Vec<f64>,
    /// The spans (indices into the trace's), in the same order.
    ids: Vec<usize>,
    /// `tree[width + i]` is the `i`-th span's end (`-inf` past the last); `tree[k]` the
    /// latest of `tree[2k]` and `tree[2k + 1]`.
    tree: Vec<f64>,
    /// The number of leaves: the number of spans rounded up to a power of two.
    width: usize,
}

impl Rank {
    fn new(spans: &[Span], mut ids: Vec<usize>) -> Self {
        ids.sort_by(|&a, &b| spans[a].start.total_cmp(&spans[b].start).then(a.cmp(&b)));
        let width = ids.len().next_power_of_two();
        let mut tree = vec![f64::NEG_INFINITY; 2 * width];
        for (i, &s) in ids.iter().enumerate() {
            tree[width + i] = spans[s].end;
        }
        for k in (1..width).rev() {
            tree[k] = tree[2 * k].max(tree[2 * k + 1]);
        }
        let starts = ids.iter().map(|&s| spans[s].start).collect();
        Self {
            starts,
            ids,
            tree,
            width,
        }
    }

    /// The spans whose start lies in `[a, b]`, by start.
    fn starting_in(&self, a: f64, b: f64) -> &[usize] {
        let from = self.starts.partition_point(|&s| s < a);
        let to = self.starts.partition_point(|&s| s <= b);
        &self.ids[from..to.max(from)]
    }

    /// Pushes the spans that start before `hi` and end after `lo` onto `out`.
    fn overlapping(&self, lo: f64, hi: f64, out: &mut Vec<usize>) {
        let count = self.starts.partition_point(|&s| s < hi);
        if count == 0 {
            return;
        }
        // Nodes with the leaves they cover, `[first, first + len)`.
        let mut stack = vec![(1usize, 0usize, self.width)];
        while let Some((k, first, len)) = stack.pop() {
            if first >= count || self.tree[k] <= lo {
                continue;
            }
            if len == 1 {
                out.push(self.ids[first]);
                continue;
            }
            let half = len / 2;
            stack.push((2 * k + 1, first + half, half));
            stack.push((2 * k, first, half));
        }
    }
}

/// Every rank's spans, indexed.
pub(super) struct Index(BTreeMap<u32, Rank>);

impl Index {
    pub(super) fn new(t: &Trace) -> Self {
        let mut by_rank: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, s) in t.spans.iter().enumerate() {
            by_rank.entry(s.rank).or_default().push(i);
        }
        Self(
            by_rank
                .into_iter()
                .map(|(r, ids)| (r, Rank::new(&t.spans, ids)))
                .collect(),
        )
    }

    /// The ranks with spans, ascending.
    pub(super) fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.keys().copied()
    }

    /// Rank `r`'s spans that start in `[a, b]`, by start.
    pub(super) fn starting_in(&self, r: u32, a: f64, b: f64) -> &[usize] {
        self.0.get(&r).map_or(&[], |x| x.starting_in(a, b))
    }

    /// Rank `r`'s spans that start before `hi` and end after `lo`, in no particular order.
    pub(super) fn overlapping(&self, r: u32, lo: f64, hi: f64) -> Vec<usize> {
        let mut out = Vec::new();
        if let Some(x) = self.0.get(&r) {
            x.overlapping(lo, hi, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both queries return exactly what a scan of every span returns, on spans of every
    /// length (long ones crossing many windows), ties and empty spans included.
    #[test]
    fn the_queries_match_a_scan() {
        let mut seed = 7u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let mut spans = Vec::new();
        for _ in 0..600 {
            let start = next(1000) as f64;
            let len = match next(4) {
                0 => 0.0,
                1 => next(500) as f64,
                _ => next(20) as f64,
            };
            spans.push(Span {
                rank: next(3) as u32,
                cat: "compute".into(),
                name: "x".into(),
                start,
                end: start + len,
                flow: None,
                step: None,
            });
        }
        let t = Trace {
            spans,
            ..Trace::default()
        };
        let ix = Index::new(&t);
        assert_eq!(ix.ranks().collect::<Vec<_>>(), [0, 1, 2]);
        for _ in 0..300 {
            let (r, a) = (next(4) as u32, next(1100) as f64 - 50.0);
            let b = a + next(200) as f64;
            let mut got = ix.starting_in(r, a, b).to_vec();
            let want: Vec<usize> = (0..t.spans.len())
                .filter(|&i| t.spans[i].rank == r && (a..=b).contains(&t.spans[i].start))
                .collect();
            assert!(got
                .windows(2)
                .all(|w| t.spans[w[0]].start <= t.spans[w[1]].start));
            got.sort_unstable();
            assert_eq!(got, want, "starting in [{a}, {b}] on rank {r}");
            let mut got = ix.overlapping(r, a, b);
            got.sort_unstable();
            let want: Vec<usize> = (0..t.spans.len())
                .filter(|&i| {
                    let s = &t.spans[i];
                    s.rank == r && s.start < b && s.end > a
                })
                .collect();
            assert_eq!(got, want, "overlapping ({a}, {b}) on rank {r}");
        }
    }
}
