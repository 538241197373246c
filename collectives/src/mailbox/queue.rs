//! Messages delivered before anyone asked for them: kept by (sender, tag) until received, and
//! bounded, since a peer decides how many it sends.
//!
//! - MB-1: the bytes queued from one sender stay within [`Limits::max_bytes_per_sender`]: a
//!   message that would pass it is refused (its sender's send fails, naming the receiver, the
//!   bytes and the limit); one message alone is never refused for its size.
//! - MB-2: a message queued longer than [`Limits::max_age`] is dropped, with a warning naming
//!   its sender, tag and size (a receive for it then times out as one for a message never
//!   sent would); so is the record of an aborted operation.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::{Body, Header, Tag};

/// The bounds of a worker's mailbox (set with [`set_mailbox_limits`](crate::set_mailbox_limits)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MailboxLimits {
    /// Bytes of messages from one sender that no receive has taken yet (MB-1). Default: 1 GiB.
    pub max_bytes_per_sender: usize,
    /// How long such a message is kept (MB-2). Default: 10 minutes.
    pub max_age: Duration,
}

impl Default for MailboxLimits {
    fn default() -> Self {
        Self {
            max_bytes_per_sender: 1 << 30,
            max_age: Duration::from_secs(600),
        }
    }
}

impl MailboxLimits {
    /// Limits with `max_bytes_per_sender` and `max_age`.
    pub fn new(max_bytes_per_sender: usize, max_age: Duration) -> Self {
        Self {
            max_bytes_per_sender,
            max_age,
        }
    }
}

/// What a worker's mailbox holds, from [`mailbox_stats`](crate::mailbox_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MailboxStats {
    /// Messages delivered and not received yet.
    pub queued_messages: usize,
    /// Their bytes.
    pub queued_bytes: usize,
    /// Messages dropped for their age since the mailbox was made (MB-2).
    pub expired_messages: u64,
}

struct Item {
    header: Header,
    body: Body,
    at: Instant,
    size: usize,
}

/// The bytes a message's body takes.
pub(crate) fn size_of(body: &Body) -> usize {
    match body {
        Body::Tensor(t) => t.elem_count() * t.dtype().size_in_bytes(),
        Body::Raw(b) => b.len(),
    }
}

#[derive(Default)]
pub(crate) struct Queued {
    items: HashMap<(u32, Tag), VecDeque<Item>>,
    /// Bytes queued per sender.
    bytes: HashMap<u32, usize>,
    expired: u64,
}

impl Queued {
    /// Queues a message from `key.0` (MB-1: refused past the sender's bound).
    pub(crate) fn push(
        &mut self,
        key: (u32, Tag),
        header: Header,
        body: Body,
        limits: &MailboxLimits,
        now: Instant,
    ) -> Result<(), String> {
        let size = size_of(&body);
        let held = self.bytes.get(&key.0).copied().unwrap_or(0);
        if held > 0 && held.saturating_add(size) > limits.max_bytes_per_sender {
            return Err(format!(
                "{held} bytes of this sender's messages wait here for a receive, and this one \
                 has {size} (limit max_bytes_per_sender = {}): a receive is missing, or this \
                 worker is behind",
                limits.max_bytes_per_sender
            ));
        }
        *self.bytes.entry(key.0).or_default() += size;
        let item = Item {
            header,
            body,
            at: now,
            size,
        };
        self.items.entry(key).or_default().push_back(item);
        Ok(())
    }

    /// The oldest message queued under `key`.
    pub(crate) fn pop(&mut self, key: (u32, Tag)) -> Option<(Header, Body)> {
        let q = self.items.get_mut(&key)?;
        let item = q.pop_front()?;
        if q.is_empty() {
            self.items.remove(&key);
        }
        self.forget_bytes(key.0, item.size);
        Some((item.header, item.body))
    }

    fn forget_bytes(&mut self, sender: u32, size: usize) {
        if let Some(b) = self.bytes.get_mut(&sender) {
            *b -= size;
            if *b == 0 {
                self.bytes.remove(&sender);
            }
        }
    }

    /// Keeps only the messages whose key `keep` accepts.
    pub(crate) fn retain(&mut self, keep: impl Fn(&(u32, Tag)) -> bool) {
        let gone: Vec<(u32, Tag)> = self.items.keys().filter(|k| !keep(k)).copied().collect();
        for k in gone {
            for item in self.items.remove(&k).unwrap_or_default() {
                self.forget_bytes(k.0, item.size);
            }
        }
    }

    /// MB-2: drops the messages queued before `now - max_age`; what it dropped, by key, with
    /// each one's bytes and age.
    pub(crate) fn expire(
        &mut self,
        now: Instant,
        max_age: Duration,
    ) -> Vec<((u32, Tag), usize, Duration)> {
        let mut out = Vec::new();
        let keys: Vec<(u32, Tag)> = self.items.keys().copied().collect();
        for k in keys {
            let q = self.items.get_mut(&k).expect("listed");
            while q
                .front()
                .is_some_and(|i| now.duration_since(i.at) > max_age)
            {
                let i = q.pop_front().expect("checked");
                out.push((k, i.size, now.duration_since(i.at)));
            }
            if q.is_empty() {
                self.items.remove(&k);
            }
        }
        for (k, size, _) in &out {
            self.forget_bytes(k.0, *size);
        }
        self.expired += out.len() as u64;
        out
    }

    pub(crate) fn stats(&self) -> MailboxStats {
        MailboxStats {
            queued_messages: self.items.values().map(VecDeque::len).sum(),
            queued_bytes: self.bytes.values().sum(),
            expired_messages: self.expired,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(seq: u64) -> Tag {
        Tag {
            group: 0,
            seq,
            step: 0,
        }
    }

    fn raw(n: usize) -> (Header, Body) {
        let h = Header {
            dims: vec![n],
            dtype: "u8".into(),
            call: Default::default(),
        };
        (h, Body::Raw(bytes::Bytes::from(vec![0u8; n])))
    }

    /// MB-1: per sender; one message alone always fits; receiving makes room.
    #[test]
    fn a_sender_past_its_bytes_is_refused_and_receives_make_room() {
        let limits = MailboxLimits::new(100, Duration::from_secs(60));
        let now = Instant::now();
        let mut q = Queued::default();
        let (h, b) = raw(150);
        q.push((1, tag(1)), h, b, &limits, now)
            .expect("alone, whatever its size");
        let (h, b) = raw(1);
        let e = q.push((1, tag(2)), h, b, &limits, now).unwrap_err();
        assert!(e.contains("150 bytes") && e.contains("= 100"), "{e}");
        let (h, b) = raw(60);
        q.push((2, tag(1)), h, b, &limits, now)
            .expect("another sender");
        assert_eq!(q.stats().queued_bytes, 210);
        assert!(q.pop((1, tag(1))).is_some());
        let (h, b) = raw(90);
        q.push((1, tag(2)), h, b, &limits, now).expect("room again");
        assert_eq!(q.stats().queued_messages, 2);
    }

    /// MB-2: only messages older than the age go, and their bytes with them.
    #[test]
    fn old_messages_expire() {
        let limits = MailboxLimits::new(1000, Duration::from_secs(60));
        let t0 = Instant::now();
        let mut q = Queued::default();
        let (h, b) = raw(10);
        q.push((1, tag(1)), h, b, &limits, t0).unwrap();
        let (h, b) = raw(20);
        let later = t0 + Duration::from_secs(30);
        q.push((1, tag(1)), h, b, &limits, later).unwrap();
        assert!(q.expire(t0 + Duration::from_secs(61), limits.max_age).len() == 1);
        assert_eq!(
            q.stats(),
            MailboxStats {
                queued_messages: 1,
                queued_bytes: 20,
                expired_messages: 1
            }
        );
        assert_eq!(q.pop((1, tag(1))).map(|(h, _)| h.dims), Some(vec![20]));
        assert_eq!(q.stats().queued_bytes, 0);
    }
}
