//! RDV-4: the rendezvous declares a member failed only with evidence, never on one member's
//! word: reports from a majority of the other live members (a frozen or dead process is
//! reported by every detector within about a heartbeat interval of the first), or one report
//! while the suspect's own connection to the rendezvous is gone too (a killed process closes
//! it). A link cut between two healthy members makes each report the other, and neither
//! report is confirmed by the third: nobody is evicted for it (each of the two still refuses
//! the other in its own view, and what the program does about that failed call is its own).
//! Only reports from members in good standing count (current incarnation, alive).

use std::collections::{BTreeMap, BTreeSet};

/// A member as the evidence sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seen {
    pub incarnation: u64,
    pub alive: bool,
    /// Its connection to the rendezvous is up.
    pub linked: bool,
}

struct Suspicion {
    incarnation: u64,
    reporters: BTreeSet<u32>,
    cause: String,
}

/// Reports not yet confirmed, by suspected rank.
#[derive(Default)]
pub(super) struct Suspicions(BTreeMap<u32, Suspicion>);

impl Suspicions {
    /// Records that `from` reported incarnation `incarnation` of `rank` failed for `cause`.
    pub(super) fn report(&mut self, rank: u32, incarnation: u64, from: u32, cause: String) {
        let s = self.0.entry(rank).or_insert_with(|| Suspicion {
            incarnation,
            reporters: BTreeSet::new(),
            cause: cause.clone(),
        });
        if s.incarnation != incarnation {
            if incarnation < s.incarnation {
                return; // MEM-1: a report on an older incarnation says nothing now
            }
            *s = Suspicion {
                incarnation,
                reporters: BTreeSet::new(),
                cause,
            };
        }
        s.reporters.insert(from);
    }

    /// The suspicions the evidence confirms now, removed: `(rank, incarnation, cause)`, the
    /// cause saying what confirmed it. `members` is every rank some worker holds; suspicions
    /// on incarnations no longer alive are dropped.
    pub(super) fn confirmed(&mut self, members: &BTreeMap<u32, Seen>) -> Vec<(u32, u64, String)> {
        let live = |r: &u32| members.get(r).is_some_and(|m| m.alive);
        let mut out = Vec::new();
        self.0.retain(|&rank, s| {
            let Some(m) = members.get(&rank) else {
                return false;
            };
            if m.incarnation != s.incarnation || !m.alive {
                return false;
            }
            let others = members.keys().filter(|r| **r != rank && live(r)).count();
            let reporters = s.reporters.iter().filter(|r| live(r)).count();
            let why = if reporters == 0 {
                return true;
            } else if !m.linked {
                "its connection to the rendezvous is gone too".to_owned()
            } else if 2 * reporters > others {
                format!("confirmed by {reporters} of the {others} other live members")
            } else {
                tracing::info!(
                    rank,
                    reporters,
                    others,
                    "a failure report not confirmed (yet) by a majority of the live members"
                );
                return true;
            };
            out.push((rank, s.incarnation, format!("{} ({why})", s.cause)));
            false
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(n: u32) -> BTreeMap<u32, Seen> {
        (0..n)
            .map(|r| {
                let seen = Seen {
                    incarnation: 0,
                    alive: true,
                    linked: true,
                };
                (r, seen)
            })
            .collect()
    }

    /// RDV-4: one member's word evicts nobody; a majority does, and so does one report on a
    /// member whose own link is gone.
    #[test]
    fn a_failure_needs_evidence() {
        let mut g = group(3);
        let mut s = Suspicions::default();
        // A cut between 1 and 2: each reports the other; 0 hears both.
        s.report(2, 0, 1, "no heartbeat".into());
        s.report(1, 0, 2, "no heartbeat".into());
        assert!(s.confirmed(&g).is_empty(), "a cut link evicts nobody");
        // 0 agrees about 2: a majority of 2's other live members (0 and 1).
        s.report(2, 0, 0, "no heartbeat".into());
        let c = s.confirmed(&g);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].0, c[0].1), (2, 0));
        assert!(c[0].2.contains("confirmed by 2 of the 2"), "{}", c[0].2);
        g.get_mut(&2).unwrap().alive = false;
        // The suspicion on 1 (by 2, now failed) no longer counts: 2 is not in good standing.
        assert!(s.confirmed(&g).is_empty());
        // One report, and the suspect's link gone: a process that is gone.
        let mut g = group(4);
        let mut s = Suspicions::default();
        s.report(3, 0, 0, "connection refused".into());
        assert!(s.confirmed(&g).is_empty());
        g.get_mut(&3).unwrap().linked = false;
        let c = s.confirmed(&g);
        assert!(
            c[0].2.contains("connection to the rendezvous is gone"),
            "{}",
            c[0].2
        );
        // Reports on an incarnation replaced since are dropped.
        let mut s = Suspicions::default();
        s.report(1, 0, 0, "x".into());
        g.get_mut(&1).unwrap().incarnation = 1;
        assert!(s.confirmed(&g).is_empty());
        assert!(s.0.is_empty());
        // Two members: the other's word is a majority of one.
        let g = group(2);
        let mut s = Suspicions::default();
        s.report(1, 0, 0, "x".into());
        assert_eq!(s.confirmed(&g).len(), 1);
    }
}
