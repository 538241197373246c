//! Which step spans are one step, for the report and the drawing alike.
//!
//! Where several ranks record steps (the replicas of data parallelism, a parameter server's
//! trainers), step `k` is one span of each. Spans that say their step's number (a detail
//! such as `step 12` or `trainer 1 step 12`, as the training loops write) are paired by it:
//! a replica that joined late, or that replayed steps after a recovery, pairs its step 12
//! with the others' step 12, and a number that ran twice (a replay) is two steps, each
//! replica's occurrences in order and a replica that ran it once taking the nearest in time.
//! Spans without numbers are paired by count: the k-th of each rank.

use std::collections::BTreeMap;

/// One step span: its rank, its interval and the number its detail gives, if any.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepSpan {
    pub(crate) rank: u64,
    pub(crate) start: f64,
    pub(crate) end: f64,
    pub(crate) number: Option<u64>,
}

/// The number a step span's detail gives: the integer after its last `step ` (`step 12`,
/// `trainer 1 step 12`).
pub(crate) fn step_number(detail: &str) -> Option<u64> {
    let at = detail.rfind("step ")?;
    let digits: &str = &detail[at + 5..];
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

/// The steps of `spans`, each the indices (into `spans`) of its members, at most one per
/// rank, in the order the steps began.
pub(crate) fn pair(spans: &[StepSpan]) -> Vec<Vec<usize>> {
    let mut steps = if spans.iter().all(|s| s.number.is_some()) {
        by_number(spans)
    } else {
        by_count(spans)
    };
    let begins = |step: &Vec<usize>| {
        let starts = step.iter().map(|&i| spans[i].start);
        starts.fold(f64::INFINITY, f64::min)
    };
    steps.sort_by(|a, b| begins(a).total_cmp(&begins(b)));
    steps
}

/// Each rank's spans by start.
fn per_rank<'a>(spans: &[StepSpan], of: impl Iterator<Item = &'a usize>) -> Vec<Vec<usize>> {
    let mut ranks: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for &i in of {
        ranks.entry(spans[i].rank).or_default().push(i);
    }
    let mut ranks: Vec<Vec<usize>> = ranks.into_values().collect();
    for r in &mut ranks {
        r.sort_by(|&a, &b| spans[a].start.total_cmp(&spans[b].start));
    }
    ranks
}

/// The k-th span of every rank is step k.
fn by_count(spans: &[StepSpan]) -> Vec<Vec<usize>> {
    let ranks = per_rank(spans, (0..spans.len()).collect::<Vec<_>>().iter());
    let count = ranks.iter().map(Vec::len).max().unwrap_or(0);
    (0..count)
        .map(|k| ranks.iter().filter_map(|r| r.get(k)).copied().collect())
        .collect()
}

/// Spans of one number are one step, or as many as the most times one rank ran it: the
/// ranks that ran it that often make the steps (their j-th occurrence is step j), and each
/// occurrence of another rank joins the nearest in time of the steps it is not yet in.
fn by_number(spans: &[StepSpan]) -> Vec<Vec<usize>> {
    let mut numbers: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, s) in spans.iter().enumerate() {
        numbers.entry(s.number.unwrap_or(0)).or_default().push(i);
    }
    let mut steps = Vec::new();
    for of in numbers.values() {
        let ranks = per_rank(spans, of.iter());
        let most = ranks.iter().map(Vec::len).max().unwrap_or(0);
        let (full, partial): (Vec<_>, Vec<_>) = ranks.into_iter().partition(|r| r.len() == most);
        let mut these: Vec<Vec<usize>> = (0..most)
            .map(|j| full.iter().map(|r| r[j]).collect())
            .collect();
        let window = |step: &Vec<usize>| {
            let s = step.iter().map(|&i| spans[i]);
            s.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), s| {
                (a.min(s.start), b.max(s.end))
            })
        };
        let windows: Vec<(f64, f64)> = these.iter().map(window).collect();
        for r in partial {
            let mut taken = vec![false; these.len()];
            for i in r {
                let s = spans[i];
                let gap = |&(a, b): &(f64, f64)| (a - s.end).max(s.start - b).max(0.0);
                let nearest = (0..these.len())
                    .filter(|&j| !taken[j])
                    .min_by(|&x, &y| gap(&windows[x]).total_cmp(&gap(&windows[y])));
                if let Some(j) = nearest {
                    taken[j] = true;
                    these[j].push(i);
                }
            }
        }
        steps.extend(these);
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(rank: u64, start: f64, number: Option<u64>) -> StepSpan {
        StepSpan {
            rank,
            start,
            end: start + 10.0,
            number,
        }
    }

    /// Members of each step as (rank, start) pairs, sorted.
    fn members(spans: &[StepSpan]) -> Vec<Vec<(u64, f64)>> {
        let steps = pair(spans);
        let mut out: Vec<Vec<(u64, f64)>> = (steps.iter())
            .map(|m| m.iter().map(|&i| (spans[i].rank, spans[i].start)).collect())
            .collect();
        for m in &mut out {
            m.sort_by(|a, b| a.partial_cmp(b).unwrap());
        }
        out
    }

    #[test]
    fn numbers_are_read_from_details() {
        assert_eq!(step_number("step 12"), Some(12));
        assert_eq!(step_number("trainer 1 step 5"), Some(5));
        assert_eq!(step_number("step 7 (replay)"), Some(7));
        assert_eq!(step_number("warm-up"), None);
        assert_eq!(step_number("step x"), None);
    }

    /// The elastic example's recovery: ranks 0 and 1 ran steps 0-2, rolled back to step 1
    /// and ran 1-3 again with rank 2, a replacement that joined at step 1. The replacement's
    /// steps pair with the replay of the same numbers (by count its step 1 was the others'
    /// step 0, 60 ms earlier).
    #[test]
    fn a_replacement_pairs_with_the_replay_of_its_numbers() {
        let mut spans = Vec::new();
        for r in 0..2 {
            for (k, n) in [0, 1, 2, 1, 2, 3].into_iter().enumerate() {
                spans.push(s(r, 20.0 * k as f64, Some(n)));
            }
        }
        for (k, n) in [1, 2, 3].into_iter().enumerate() {
            spans.push(s(2, 60.0 + 20.0 * k as f64 + 1.0, Some(n)));
        }
        let got = members(&spans);
        let want: Vec<Vec<(u64, f64)>> = vec![
            vec![(0, 0.0), (1, 0.0)],
            vec![(0, 20.0), (1, 20.0)],
            vec![(0, 40.0), (1, 40.0)],
            vec![(0, 60.0), (1, 60.0), (2, 61.0)],
            vec![(0, 80.0), (1, 80.0), (2, 81.0)],
            vec![(0, 100.0), (1, 100.0), (2, 101.0)],
        ];
        assert_eq!(got, want);
    }

    /// Trainers that drift apart (a parameter server without barriers) still pair by number,
    /// however far apart their steps of one number ran.
    #[test]
    fn drifting_ranks_pair_by_number() {
        let spans: Vec<_> = (0..3)
            .flat_map(|k| {
                [
                    s(0, 15.0 * k as f64, Some(k)),
                    s(1, 40.0 * k as f64, Some(k)),
                ]
            })
            .collect();
        let got = members(&spans);
        assert_eq!(got.len(), 3);
        assert_eq!(got[2], [(0, 30.0), (1, 80.0)]);
    }

    /// Without numbers, the k-th span of each rank is step k.
    #[test]
    fn spans_without_numbers_pair_by_count() {
        let spans = [s(0, 0.0, None), s(1, 50.0, None), s(0, 20.0, Some(4))];
        assert_eq!(
            members(&spans),
            [vec![(0, 0.0), (1, 50.0)], vec![(0, 20.0)]]
        );
    }
}
