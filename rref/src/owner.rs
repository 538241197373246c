//! The owner's table: for every value this worker owns, its slot and the signed count of each
//! fork. A pure, synchronous state machine; the protocol code around it only feeds it events.
//!
//! Events: `add(id, fork, +1)` when the owner learns of a fork, `add(id, fork, -1)` when a
//! fork is deleted, `set(id, result)` when the constructor finishes. They may arrive in any
//! order: a delete that overtakes its fork's add leaves the count at -1, which keeps the entry
//! alive until the add cancels it.
//!
//! Invariants (cited by the tests):
//! - OWN-1: an entry is removed (its value dropped) only when every fork count is zero and its
//!   slot is no longer pending.
//! - OWN-2: once every fork count is zero and the slot is settled, the entry is removed at
//!   that event, not later.
//! - OWN-3: a value is set at most once; a second `set` is refused and its value returned to
//!   the caller to drop.
//! - OWN-4: removed values are returned to the caller, who drops them after releasing the
//!   table's lock (a value may hold remote references whose drop re-enters the table).
//! - OWN-5: every fork count is kept with the worker that holds the fork (who registered or
//!   deleted it); when that worker is declared failed, its forks are dropped, so a value kept
//!   only by a failed worker is released ([`OwnerTable::drop_holder`]).
//! - OWN-6: an entry still pending (its value never set: an id no constructor will settle,
//!   as a peer may name) is given up [`Limits::pending_ttl`] after it was made
//!   ([`OwnerTable::expire_pending`]): removed, its id remembered (the most recent 65,536) so
//!   that a value set for it later is refused rather than kept uncounted. Peers cannot make
//!   more than [`Limits::max_pending`] pending entries at once (`context.rs` refuses, naming
//!   the limit).

use rpc_core::ext::KeptValue;
use rpc_core::RemoteError;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

use crate::id::{ForkId, RRefId};

/// A settled value: exclusive access through an async mutex.
pub(crate) type Value = Arc<tokio::sync::Mutex<KeptValue>>;

pub(crate) enum Slot {
    Pending,
    Ready(Value),
    Failed(RemoteError),
}

pub(crate) struct Entry {
    pub slot: Slot,
    /// Each fork's signed count and the worker holding it.
    forks: HashMap<ForkId, (i64, u32)>,
    settled: watch::Sender<bool>,
    /// When the entry was made.
    since: Instant,
}

impl Entry {
    fn new() -> Self {
        Self {
            slot: Slot::Pending,
            forks: HashMap::new(),
            settled: watch::channel(false).0,
            since: Instant::now(),
        }
    }
}

/// The bounds of a worker's owner table (OWN-6), set with [`set_limits`](crate::set_limits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// How long an entry may stay pending (a fork or a fetch named it, its value never came)
    /// before it is given up. Default: one hour.
    pub pending_ttl: Duration,
    /// Pending entries peers may make at once; one more is refused. Default: 100,000.
    pub max_pending: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            pending_ttl: Duration::from_secs(3600),
            max_pending: 100_000,
        }
    }
}

impl Limits {
    /// Limits with `pending_ttl` and `max_pending`.
    pub fn new(pending_ttl: Duration, max_pending: usize) -> Self {
        Self {
            pending_ttl,
            max_pending,
        }
    }
}

/// Ids given up while pending, remembered at most this many (OWN-6).
const GIVEN_UP_KEPT: usize = 65_536;

/// What a lookup found.
pub(crate) enum Lookup {
    Ready(Value),
    Failed(RemoteError),
    /// Not settled yet: wait on the receiver, then look again.
    Pending(watch::Receiver<bool>),
}

/// The table itself.
#[derive(Default)]
pub(crate) struct OwnerTable {
    entries: HashMap<RRefId, Entry>,
    /// Entries whose slot is pending.
    pending: usize,
    /// Ids given up while pending, most recent last (OWN-6).
    given_up: VecDeque<RRefId>,
    given_up_set: HashSet<RRefId>,
}

/// Something removed from the table, to be dropped outside its lock (OWN-4).
pub(crate) type Removed = Option<Entry>;

impl OwnerTable {
    /// Applies `delta` to `fork`'s count; `holder` is the worker holding the fork.
    pub(crate) fn add(&mut self, id: RRefId, fork: ForkId, delta: i64, holder: u32) -> Removed {
        let entry = Self::entry(&mut self.entries, &mut self.pending, id);
        let c = entry.forks.entry(fork).or_insert((0, holder));
        c.0 += delta;
        c.1 = holder;
        if c.0 == 0 {
            entry.forks.remove(&fork);
        }
        self.collect(id)
    }

    /// OWN-5: drops every fork `holder` holds (it was declared failed); returns what that
    /// frees, to be dropped outside the lock.
    pub(crate) fn drop_holder(&mut self, holder: u32) -> Vec<Entry> {
        let mut touched = Vec::new();
        for (id, e) in &mut self.entries {
            let before = e.forks.len();
            e.forks.retain(|_, (_, h)| *h != holder);
            if e.forks.len() != before {
                touched.push(*id);
            }
        }
        touched
            .into_iter()
            .filter_map(|id| self.collect(id))
            .collect()
    }

    /// `id`'s entry, made pending (and counted) if new.
    fn entry<'a>(
        entries: &'a mut HashMap<RRefId, Entry>,
        pending: &mut usize,
        id: RRefId,
    ) -> &'a mut Entry {
        entries.entry(id).or_insert_with(|| {
            *pending += 1;
            Entry::new()
        })
    }

    /// Whether `id` has an entry.
    pub(crate) fn contains(&self, id: RRefId) -> bool {
        self.entries.contains_key(&id)
    }

    /// Entries whose value has not been set yet.
    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    /// Settles the slot (OWN-3); a value for an id given up while pending is refused too
    /// (OWN-6), and returned.
    pub(crate) fn set(
        &mut self,
        id: RRefId,
        result: Result<KeptValue, RemoteError>,
    ) -> Result<Removed, KeptValue> {
        if self.given_up_set.contains(&id) && !self.entries.contains_key(&id) {
            return match result {
                Ok(v) => Err(v),
                Err(_) => Ok(None),
            };
        }
        let entry = Self::entry(&mut self.entries, &mut self.pending, id);
        if !matches!(entry.slot, Slot::Pending) {
            return match result {
                Ok(v) => Err(v),
                Err(_) => Ok(None),
            };
        }
        self.pending -= 1;
        entry.slot = match result {
            Ok(v) => Slot::Ready(Arc::new(tokio::sync::Mutex::new(v))),
            Err(e) => Slot::Failed(e),
        };
        entry.settled.send_replace(true);
        Ok(self.collect(id))
    }

    /// Looks a value up; an unknown id gets a pending entry (its creation may still be on its
    /// way). Call [`OwnerTable::forget_if_idle`] if the wait is abandoned.
    pub(crate) fn lookup(&mut self, id: RRefId) -> Lookup {
        let entry = Self::entry(&mut self.entries, &mut self.pending, id);
        match &entry.slot {
            Slot::Ready(v) => Lookup::Ready(v.clone()),
            Slot::Failed(e) => Lookup::Failed(e.clone()),
            Slot::Pending => Lookup::Pending(entry.settled.subscribe()),
        }
    }

    /// Drops a pending entry nobody counts on (a lookup for an id that never came).
    pub(crate) fn forget_if_idle(&mut self, id: RRefId) -> Removed {
        match self.entries.get(&id) {
            Some(e) if matches!(e.slot, Slot::Pending) && e.forks.is_empty() => {
                self.pending -= 1;
                self.entries.remove(&id)
            }
            _ => None,
        }
    }

    /// OWN-6: gives up the entries pending for longer than `ttl` as of `now`; returns them,
    /// to be dropped outside the lock (their waiters then find no value).
    pub(crate) fn expire_pending(&mut self, now: Instant, ttl: Duration) -> Vec<(RRefId, Entry)> {
        let old: Vec<RRefId> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.slot, Slot::Pending) && now.duration_since(e.since) > ttl)
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(old.len());
        for id in old {
            if let Some(e) = self.entries.remove(&id) {
                self.pending -= 1;
                if self.given_up_set.insert(id) {
                    self.given_up.push_back(id);
                }
                out.push((id, e));
            }
        }
        while self.given_up.len() > GIVEN_UP_KEPT {
            if let Some(id) = self.given_up.pop_front() {
                self.given_up_set.remove(&id);
            }
        }
        out
    }

    /// OWN-1/OWN-2: remove the entry once nothing counts on it.
    fn collect(&mut self, id: RRefId) -> Removed {
        match self.entries.get(&id) {
            Some(e) if e.forks.is_empty() && !matches!(e.slot, Slot::Pending) => {
                self.entries.remove(&id)
            }
            _ => None,
        }
    }

    /// Number of entries (values owned, settled or not).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Removes everything (shutdown), returning it to be dropped outside the lock.
    pub(crate) fn drain(&mut self) -> Vec<Entry> {
        self.pending = 0;
        self.entries.drain().map(|(_, e)| e).collect()
    }

    #[cfg(test)]
    fn count(&self, id: RRefId, fork: ForkId) -> i64 {
        self.entries
            .get(&id)
            .and_then(|e| e.forks.get(&fork).map(|(c, _)| *c))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rid(n: u64) -> RRefId {
        RRefId {
            created_on: 0,
            local: n,
        }
    }
    fn fid(w: u32, n: u64) -> ForkId {
        ForkId {
            created_on: w,
            local: n,
        }
    }

    #[test]
    fn delete_overtaking_its_fork_keeps_the_entry_until_the_add() {
        // OWN-1: creation, then the child's delete before the child's add.
        let mut t = OwnerTable::default();
        let (a, b) = (fid(1, 1), fid(2, 1));
        assert!(t.add(rid(1), a, 1, 0).is_none());
        assert!(t.set(rid(1), Ok(KeptValue::new(5u32))).unwrap().is_none());
        assert!(
            t.add(rid(1), b, -1, 0).is_none(),
            "child delete arrives first"
        );
        assert_eq!(t.count(rid(1), b), -1);
        assert!(
            t.add(rid(1), a, -1, 0).is_none(),
            "parent gone, child's debt keeps it"
        );
        assert!(
            t.add(rid(1), b, 1, 0).is_some(),
            "OWN-2: removed at the balancing add"
        );
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn forks_settled_before_the_value_wait_for_it() {
        let mut t = OwnerTable::default();
        let f = fid(3, 9);
        assert!(t.add(rid(2), f, -1, 0).is_none());
        assert!(
            t.add(rid(2), f, 1, 0).is_none(),
            "OWN-1: pending slot keeps the entry"
        );
        assert_eq!(t.len(), 1);
        let removed = t.set(rid(2), Ok(KeptValue::new("v".to_string()))).unwrap();
        assert!(
            removed.is_some(),
            "OWN-2: settled with no forks: removed at once"
        );
    }

    /// OWN-5: a failed holder's forks go; a value kept only by them is released, one also
    /// held by another worker stays.
    #[test]
    fn forks_of_a_failed_holder_are_dropped() {
        let mut t = OwnerTable::default();
        t.add(rid(4), fid(0, 1), 1, 2);
        assert!(t.set(rid(4), Ok(KeptValue::new(4u8))).unwrap().is_none());
        t.add(rid(5), fid(0, 2), 1, 2);
        t.add(rid(5), fid(1, 3), 1, 1);
        assert!(t.set(rid(5), Ok(KeptValue::new(5u8))).unwrap().is_none());
        // A delete that overtook its add, from the same holder: the add will never come.
        t.add(rid(5), fid(2, 4), -1, 2);
        let freed = t.drop_holder(2);
        assert_eq!(
            freed.len(),
            1,
            "only the value held by the failed worker alone"
        );
        assert_eq!(t.len(), 1);
        assert_eq!(
            t.count(rid(5), fid(1, 3)),
            1,
            "the other holder's fork stays"
        );
        assert_eq!(
            t.count(rid(5), fid(2, 4)),
            0,
            "its overtaken delete goes too"
        );
        assert!(t.drop_holder(2).is_empty());
    }

    /// OWN-6: only pending entries older than the ttl go; a value set for one given up is
    /// refused; the pending count follows.
    #[test]
    fn entries_pending_too_long_are_given_up() {
        let mut t = OwnerTable::default();
        t.add(rid(1), fid(5, 1), 1, 5); // a fork of a value that never comes
        t.add(rid(2), fid(5, 2), 1, 5);
        assert!(t.set(rid(2), Ok(KeptValue::new(1u8))).unwrap().is_none());
        assert_eq!((t.len(), t.pending()), (2, 1));
        let now = Instant::now();
        assert!(t.expire_pending(now, Duration::from_secs(60)).is_empty());
        let gone = t.expire_pending(now + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [rid(1)]);
        assert_eq!((t.len(), t.pending()), (1, 0), "the settled value stays");
        match t.set(rid(1), Ok(KeptValue::new(9u8))) {
            Err(v) => assert_eq!(v.downcast_ref::<u8>(), Some(&9)),
            Ok(_) => panic!("a value for an id given up is refused"),
        }
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_value_is_set_once() {
        let mut t = OwnerTable::default();
        t.add(rid(3), fid(0, 1), 1, 0);
        assert!(t.set(rid(3), Ok(KeptValue::new(1u8))).is_ok());
        let again = t.set(rid(3), Ok(KeptValue::new(2u8)));
        match again {
            Err(v) => assert_eq!(v.downcast_ref::<u8>(), Some(&2), "OWN-3"),
            Ok(_) => panic!("OWN-3: a second set must be refused"),
        }
    }

    /// Exhaustive check over every order of the messages of a user→user share: the owner's
    /// creation (set + creator's fork), the creator forking a child to a third worker, the
    /// child's registration, the creator releasing its fork once the child is confirmed, and
    /// the child's delete. Causal constraints: the creator's release follows the child's
    /// registration (G2); the child's delete follows its registration's send (it may still be
    /// processed first). The value must exist whenever a live fork exists and be gone at the end.
    #[test]
    fn every_interleaving_of_a_user_to_user_share_is_safe() {
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Ev {
            Create,
            AddChild,
            DeleteParent,
            DeleteChild,
        }
        let evs = [Ev::Create, Ev::AddChild, Ev::DeleteParent, Ev::DeleteChild];
        let mut orders = 0;
        let mut perm = vec![0usize, 1, 2, 3];
        // Heap's algorithm over 4 events: 24 orders.
        fn permute(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if k == 1 {
                out.push(a.clone());
                return;
            }
            for i in 0..k {
                permute(k - 1, a, out);
                if k % 2 == 0 {
                    a.swap(i, k - 1);
                } else {
                    a.swap(0, k - 1);
                }
            }
        }
        let mut all = Vec::new();
        permute(4, &mut perm, &mut all);
        for order in all {
            let seq: Vec<Ev> = order.iter().map(|&i| evs[i]).collect();
            let pos = |e: Ev| seq.iter().position(|x| *x == e).unwrap();
            // G2: the parent releases only after the owner accepted the child.
            if pos(Ev::DeleteParent) < pos(Ev::AddChild) {
                continue;
            }
            orders += 1;
            let mut t = OwnerTable::default();
            let (parent, child) = (fid(1, 1), fid(2, 1));
            let mut removed_at = None;
            for (step, ev) in seq.iter().enumerate() {
                let r = match ev {
                    Ev::Create => {
                        let r1 = t.add(rid(7), parent, 1, 0);
                        assert!(r1.is_none());
                        t.set(rid(7), Ok(KeptValue::new(42u64))).unwrap()
                    }
                    Ev::AddChild => t.add(rid(7), child, 1, 0),
                    Ev::DeleteParent => t.add(rid(7), parent, -1, 0),
                    Ev::DeleteChild => t.add(rid(7), child, -1, 0),
                };
                if r.is_some() {
                    assert!(removed_at.is_none(), "removed twice in {seq:?}");
                    removed_at = Some(step);
                }
            }
            assert_eq!(
                removed_at,
                Some(3),
                "value must go exactly at the last event: {seq:?}"
            );
            assert_eq!(t.len(), 0);
        }
        assert_eq!(orders, 12, "orders allowed by G2");
    }
}
