//! What the ring keeps of one event: a 64-byte record (asserted below), filled in place by an
//! open span and copied into the ring when it ends. Optional fields are sentinels rather than
//! `Option`s, and what few events own (a name made at run time, a line of detail) sits behind
//! one pointer, so that a span costs no allocation unless it carries text.

use std::borrow::Cow;

use super::{clock, Cat, Event, Flow};

/// `dur` of an instant.
const INSTANT: u64 = u64::MAX;
/// `bytes` when unknown.
const NO_BYTES: u64 = u64::MAX;
/// `peer` when none.
const NO_PEER: u32 = u32::MAX;
/// The bit of `flow` that marks a call served (else made); flow ids never use it (a rank sits
/// in bits 40..63, far below).
const FLOW_IN: u64 = 1 << 63;

/// One event on the raw trace clock (`clock::ticks`).
pub(crate) struct Record {
    name: &'static str,
    pub start: u64,
    dur: u64,
    /// 0: none; else the id, with [`FLOW_IN`] for a call served.
    flow: u64,
    bytes: u64,
    extra: Option<Box<Extra>>,
    peer: u32,
    cat: Cat,
    /// 0: unknown, 1: ok, 2: error.
    ok: u8,
}

const _: () = assert!(std::mem::size_of::<Record>() <= 64);

/// What few events own.
#[derive(Default)]
struct Extra {
    name: Option<String>,
    detail: Option<String>,
}

impl Record {
    /// A span of `cat` named `name`, open since `start`.
    pub fn new(cat: Cat, name: Cow<'static, str>, start: u64) -> Self {
        let (name, extra) = match name {
            Cow::Borrowed(n) => (n, None),
            Cow::Owned(n) => (
                "",
                Some(Box::new(Extra {
                    name: Some(n),
                    detail: None,
                })),
            ),
        };
        Self {
            name,
            start,
            dur: 0,
            flow: 0,
            bytes: NO_BYTES,
            extra,
            peer: NO_PEER,
            cat,
            ok: 0,
        }
    }

    /// An instant event now.
    pub fn instant(cat: Cat, name: Cow<'static, str>, detail: Option<String>) -> Self {
        let mut r = Self::new(cat, name, clock::ticks());
        r.dur = INSTANT;
        if let Some(d) = detail {
            r.set_detail(d);
        }
        r
    }

    /// Ends the span now.
    pub fn end(&mut self) {
        self.dur = clock::ticks().saturating_sub(self.start);
    }

    /// Ends the span at `end` (raw ticks).
    #[cfg(test)]
    pub fn end_at(&mut self, end: u64) {
        self.dur = end.saturating_sub(self.start);
    }

    pub fn set_flow(&mut self, flow: Flow) {
        self.flow = match flow {
            Flow::Out(id) => id & !FLOW_IN,
            Flow::In(id) => (id & !FLOW_IN) | FLOW_IN,
        };
    }

    pub fn set_peer(&mut self, rank: u32) {
        self.peer = rank;
    }

    pub fn set_bytes(&mut self, n: Option<u64>) {
        self.bytes = n.unwrap_or(NO_BYTES);
    }

    pub fn set_ok(&mut self, ok: bool) {
        self.ok = if ok { 1 } else { 2 };
    }

    pub fn set_detail(&mut self, d: String) {
        self.extra.get_or_insert_with(Default::default).detail = Some(d);
    }

    /// The readable form, in nanoseconds of this process's monotonic clock (`clock` maps raw
    /// readings onto it).
    pub fn to_event(&self, clock: &clock::Mapping) -> Event {
        let start = clock.ns(self.start);
        let dur = (self.dur != INSTANT).then(|| {
            clock
                .ns(self.start.saturating_add(self.dur))
                .saturating_sub(start)
        });
        let extra = self.extra.as_deref();
        let id = self.flow & !FLOW_IN;
        Event {
            name: match extra.and_then(|x| x.name.clone()) {
                Some(n) => Cow::Owned(n),
                None => Cow::Borrowed(self.name),
            },
            cat: self.cat,
            start,
            dur,
            flow: match (id, self.flow & FLOW_IN != 0) {
                (0, _) => None,
                (id, true) => Some(Flow::In(id)),
                (id, false) => Some(Flow::Out(id)),
            },
            peer: (self.peer != NO_PEER).then_some(self.peer),
            bytes: (self.bytes != NO_BYTES).then_some(self.bytes),
            ok: match self.ok {
                1 => Some(true),
                2 => Some(false),
                _ => None,
            },
            detail: extra.and_then(|x| x.detail.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field survives the packing: set ones read back, unset ones read as unset.
    #[test]
    fn a_record_reads_back_what_was_set() {
        let mut r = Record::new(Cat::Call, "f".into(), 10);
        r.set_flow(Flow::In(7));
        r.set_peer(0);
        r.set_bytes(Some(0));
        r.set_ok(false);
        r.set_detail("d".into());
        r.end_at(25);
        let e = r.to_event(&clock::Mapping::now());
        assert_eq!((e.name.as_ref(), e.cat), ("f", Cat::Call));
        assert_eq!(e.flow, Some(Flow::In(7)));
        assert_eq!((e.peer, e.bytes, e.ok), (Some(0), Some(0), Some(false)));
        assert_eq!(e.detail.as_deref(), Some("d"));
        assert!(e.dur.is_some());
        let r = Record::instant(Cat::Failure, String::from("owned").into(), None);
        let e = r.to_event(&clock::Mapping::now());
        assert_eq!(e.name, "owned");
        assert_eq!(
            (e.dur, e.flow, e.peer, e.bytes, e.ok),
            (None, None, None, None, None)
        );
        assert!(e.detail.is_none());
        let mut r = Record::new(Cat::Call, "g".into(), 0);
        r.set_flow(Flow::Out(3 << 40 | 5));
        assert_eq!(
            r.to_event(&clock::Mapping::now()).flow,
            Some(Flow::Out(3 << 40 | 5))
        );
    }
}
