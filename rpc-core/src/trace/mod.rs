//! One trace for the whole job: each worker records spans into a bounded ring and writes them
//! as the Trace Event Format (the JSON Perfetto and `chrome://tracing` open); the parts are
//! aligned on rank 0's clock and merged into one file.
//!
//! ```text
//! mod.rs    the recorder: a Tracer handle, its spans, the bounded ring (TR-1, TR-2)
//! clock.rs  the CPU counter on CLOCK_MONOTONIC's scale and rate (TR-12); each rank's
//!           offset from rank 0's clock, estimated over the group's connections
//! exit.rs   the part written however a worker ends: shutdown, exit, a signal (TR-5)
//! ship.rs   parts of other hosts sent to rank 0 at shutdown (TR-8)
//! sink.rs   parts of other nodes sent to node 0's launcher however the job ended (TR-9)
//! chrome.rs the Trace Event Format: a rank's part (TR-3, 4)
//! merge.rs  the merge of a job's parts into one trace, streamed (TR-6, 7)
//! rerun.rs  a rerun's clearing of the parts an earlier run left unmerged (TR-10)
//! layer.rs  spans of the `tracing` ecosystem recorded into the same ring
//! record.rs what the ring keeps of one event (64 bytes)
//! ```
//!
//! Why a recorder of our own and not `tracing` spans for the hot paths: a call made and a call
//! served are each one span, and a `tracing` span in a request's future doubled its size (each
//! is boxed, a connection's task may hold thousands), and a registry span costs an allocation
//! and a slab entry; the recorder's span is two clock reads and one push into the ring. The
//! spans programs already write with `tracing` land in the same ring through [`TraceLayer`].
//!
//! Invariants, cited by the tests:
//! - **TR-1** Off, a tracer records nothing and costs one branch per span.
//! - **TR-2** On, memory is bounded: the ring keeps the newest `capacity` events and counts
//!   what it dropped; the count is in the written file.
//! - **TR-3** Every call made carries a flow id; the callee's span of that call carries the same
//!   id, so the merged trace links each caller span to its callee span.
//! - **TR-4** Timestamps in a written part are on rank 0's clock (monotonic clocks, offset
//!   estimated the NTP way); the part states the offset and its error bound.
//! - **TR-5** A traced worker's part is written once, however the worker ends: at shutdown,
//!   at its process's exit, or on the SIGTERM, SIGINT or SIGHUP that stops it.
//! - **TR-6** A merge never passes off part of a job as the whole: each part lists the ranks
//!   its group had, and those without a part (a worker killed outright writes none) are
//!   named in the merge's summary and in the merged file; after group restarts, per start
//!   (a rank's part from one start does not stand in for the start it has none of).
//! - **TR-7** A merge takes one job's parts: each part names its job (its launcher's
//!   [`JOB_ID_ENV`](crate::JOB_ID_ENV), else the name the rendezvous's host was given by its
//!   own launcher, else the id its rendezvous drew), and the parts an earlier run left at
//!   the same path are left out and named, not merged into this run's.
//! - **TR-8** At a clean shutdown every traced worker whose part rank 0 would not find in its
//!   own parts' directory (another host, another path) sends it to rank 0 before the
//!   barrier, and rank 0 writes it there: node 0's merge needs no shared filesystem.
//! - **TR-9** However a job ends, every part written on a node other than node 0 reaches node
//!   0's parts directory before its launcher merges, if that launcher still waits: node 0's
//!   launcher listens on a [`PartSink`] named to every member through the rendezvous, each part
//!   records it, and each other node's launcher sends its parts there once its processes
//!   have ended ([`send_parts`]); every file is tagged with the group's secret.
//! - **TR-10** A run that clears its parts' directory first merges the parts an earlier run
//!   left unmerged into [`earlier_path`] (or moves them there): a rerun deletes no trace.
//! - **TR-11** A traced worker names node 0's sink on its status pipe as it joins, so a node
//!   whose every process was killed outright can still tell node 0 it has no part.
//! - **TR-12** A span's times are `CLOCK_MONOTONIC`'s at its rate: the CPU counter's readings
//!   are converted at the rate measured between the process's first reading and the
//!   conversion, so the offsets measured at a job's start hold through it.

mod chrome;
mod clock;
mod exit;
mod layer;
mod merge;
mod record;
mod rerun;
mod ship;
mod sink;

use std::borrow::Cow;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use chrome::{part_path, parts_dir};
pub use clock::{estimate_offset, ClockEstimate};
pub(crate) use clock::{keep_in_sync, TraceClock};
pub use layer::TraceLayer;
pub use merge::{merge_parts, MergeError, MergeSummary};
use record::Record;
pub use rerun::{clear_parts, earlier_path, Kept};
pub(crate) use ship::{send_part_to_rank0, TracePart, TraceWanted};
pub use sink::{send_parts, PartSink, SendPartsError, SentParts, TRACE_SINK_ENV};

/// The environment variable that turns tracing on: the path of the job's trace; each worker
/// writes its part under `<path>.parts/` at shutdown (see [`Config::trace`](crate::Config::trace)).
pub const TRACE_ENV: &str = "RPC_TRACE";

/// Events a worker keeps by default (about 100 bytes each): the newest 262,144.
pub const DEFAULT_TRACE_CAPACITY: usize = 1 << 18;

/// What a span is, one track of the trace per category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cat {
    /// A call this worker made, from its start to its reply.
    Call,
    /// A call this worker served, from its arrival to its reply.
    Serve,
    /// Bulk data moved for a call (a side connection or shared memory).
    Transfer,
    /// Computation: a forward, a backward segment, a user's span.
    Compute,
    /// A collective operation, or one step of its ring.
    Collective,
    /// An optimizer's step.
    Optimizer,
    /// A pipeline schedule's action (a micro-batch's forward or backward on a stage).
    Pipeline,
    /// A checkpoint written or loaded.
    Checkpoint,
    /// A failure verdict, a recovery.
    Failure,
    /// A training step: the unit the report analyses.
    Step,
}

impl Cat {
    /// The name in the trace's `cat` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Cat::Call => "call",
            Cat::Serve => "serve",
            Cat::Transfer => "transfer",
            Cat::Compute => "compute",
            Cat::Collective => "collective",
            Cat::Optimizer => "optimizer",
            Cat::Pipeline => "pipeline",
            Cat::Checkpoint => "checkpoint",
            Cat::Failure => "failure",
            Cat::Step => "step",
        }
    }
}

/// A call's flow: the id that links the caller's span to the callee's (TR-3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Out(u64),
    In(u64),
}

/// One recorded event as a snapshot reads it, in nanoseconds of this process's monotonic
/// clock (the ring keeps a packed [`Record`] on the raw trace clock).
#[derive(Clone, Debug)]
pub(crate) struct Event {
    pub name: Cow<'static, str>,
    pub cat: Cat,
    pub start: u64,
    /// `None`: an instant.
    pub dur: Option<u64>,
    pub flow: Option<Flow>,
    pub peer: Option<u32>,
    pub bytes: Option<u64>,
    pub ok: Option<bool>,
    pub detail: Option<String>,
}

/// The ring a tracer records into (TR-2).
pub(crate) struct Ring {
    events: Mutex<VecDeque<Record>>,
    capacity: usize,
    dropped: AtomicU64,
    next_flow: AtomicU64,
    /// Where this worker's part goes at shutdown.
    pub path: PathBuf,
    /// Who records: filled in when the worker joins its group.
    pub who: Mutex<Who>,
    /// The probes of rank 0's clock so far (TR-4).
    pub clock: Mutex<clock::ClockState>,
    /// Whether this worker's part was written (held while it is written: TR-5). Shared with
    /// the exit handler, which waits on it for a ring whose last owner is writing its part.
    written: Arc<Mutex<bool>>,
    /// Whether the part must be written however the worker ends: set as it joins (TR-5).
    armed: std::sync::atomic::AtomicBool,
}

/// The recording worker, for the part's metadata.
#[derive(Clone, Debug, Default)]
pub(crate) struct Who {
    pub rank: u32,
    pub name: String,
    pub incarnation: u64,
    /// The launcher's start it belongs to (its restart count; 0: the first start).
    pub restart: u64,
    /// The ranks its group had when it joined (a group that grows: not its vacant ones).
    pub ranks: Vec<u32>,
    /// The job it belongs to: its launcher's name for it, else the one the rendezvous's host
    /// was given, else the rendezvous's own id (TR-7).
    pub job: String,
    /// The group it joined: the id its rendezvous drew. A group restart starts a new one; a
    /// process replaced one by one joins the same (TR-6 counts the ranks per group).
    pub group: String,
    /// Node 0's launcher's sink for the parts of other nodes (TR-9), if it has one.
    pub sink: Option<String>,
}

impl Ring {
    fn push(&self, e: Record) {
        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= self.capacity {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(e);
    }

    /// Everything recorded so far, oldest first, in nanoseconds, and how many were dropped.
    pub(crate) fn snapshot(&self) -> (Vec<Event>, u64) {
        let q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let clock = clock::Mapping::now();
        let events = q.iter().map(|r| r.to_event(&clock)).collect();
        (events, self.dropped.load(Ordering::Relaxed))
    }
}

/// A worker's trace recorder: a cheap handle (clone it into tasks and layers). Off unless
/// [`Config::trace`](crate::Config::trace) or [`TRACE_ENV`] named a path; off, every span
/// is one branch (TR-1). Get it with [`Agent::tracer`](crate::Agent::tracer).
///
/// ```
/// # fn demo(agent: &rpc_core::Agent) {
/// use rpc_core::trace::Cat;
/// let tracer = agent.tracer();
/// {
///     let _forward = tracer.span(Cat::Compute, "forward");
///     // ... the forward pass; the span ends when the guard drops
/// }
/// tracer.instant(Cat::Checkpoint, "checkpoint written", Some("ckpt-000100".into()));
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Tracer(Option<Arc<Ring>>);

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(r) => write!(f, "Tracer(on, {})", r.path.display()),
            None => f.write_str("Tracer(off)"),
        }
    }
}

impl Tracer {
    /// A tracer that records nothing.
    pub fn off() -> Self {
        Self(None)
    }

    /// A tracer that keeps the newest `capacity` events, for the job trace at `path`.
    pub(crate) fn on(path: PathBuf, capacity: usize) -> Self {
        Self(Some(Arc::new(Ring {
            events: Mutex::new(VecDeque::with_capacity(capacity.min(1 << 16))),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
            next_flow: AtomicU64::new(1),
            path,
            who: Mutex::new(Who::default()),
            clock: Mutex::new(clock::ClockState::default()),
            written: Arc::new(Mutex::new(false)),
            armed: std::sync::atomic::AtomicBool::new(false),
        })))
    }

    /// Whether this tracer records.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn ring(&self) -> Option<&Arc<Ring>> {
        self.0.as_ref()
    }

    /// Names the recording worker (at init, and again for a new incarnation). Its flow ids
    /// (TR-3) are unique in the job: the rank in the high bits, and a counter that each
    /// incarnation of a rank, in each of the launcher's starts, starts far from the others'
    /// (a replaced worker's part and its replacement's, or an earlier start's, can all be in
    /// the trace, TR-5).
    pub(crate) fn set_who(&self, who: Who) {
        if let Some(r) = &self.0 {
            // Below 2^39: at least 2^39 calls before the counter could reach the rank's bits.
            const START: u64 = (1 << 39) - 1;
            let mix = who.incarnation.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ who.restart.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
            let start = mix & START;
            r.next_flow.store(
                (u64::from(who.rank) << 40) | start.max(1),
                Ordering::Relaxed,
            );
            *r.who.lock().unwrap_or_else(|p| p.into_inner()) = who;
        }
    }

    /// A span from now until the returned guard drops.
    pub fn span(&self, cat: Cat, name: impl Into<Cow<'static, str>>) -> Span {
        match &self.0 {
            None => Span(None),
            Some(r) => Span(Some(Open {
                ring: Arc::clone(r),
                rec: Record::new(cat, name.into(), clock::ticks()),
            })),
        }
    }

    /// A span of a call this worker makes to `peer`, with a fresh flow id (TR-3), which the
    /// request carries to the callee. `None` when off.
    pub(crate) fn call_made(&self, fn_name: &'static str, peer: u32) -> Option<(Span, u64)> {
        let r = self.0.as_ref().filter(|_| !internal(fn_name))?;
        // Unique in the job: the rank in the high bits (set when the worker joins).
        let id = r.next_flow.fetch_add(1, Ordering::Relaxed);
        let mut s = self.span(Cat::Call, fn_name);
        if let Some(o) = s.0.as_mut() {
            o.rec.set_flow(Flow::Out(id));
            o.rec.set_peer(peer);
        }
        Some((s, id))
    }

    /// The trace clock now (raw), when this tracer records: a span's start taken before its
    /// name is known (see [`Tracer::call_served`]).
    pub(crate) fn now(&self) -> Option<u64> {
        self.0.as_ref().map(|_| clock::ticks())
    }

    /// A span of a call this worker serves for `peer`, linked to its caller's by `flow`,
    /// started at `arrived` (from [`Tracer::now`]) or now.
    pub(crate) fn call_served(
        &self,
        fn_name: &'static str,
        peer: u32,
        flow: Option<u64>,
        arrived: Option<u64>,
    ) -> Span {
        if flow.is_none() && internal(fn_name) {
            return Span(None);
        }
        let mut s = self.span(Cat::Serve, fn_name);
        if let Some(o) = s.0.as_mut() {
            if let Some(id) = flow {
                o.rec.set_flow(Flow::In(id));
            }
            o.rec.set_peer(peer);
            if let Some(t) = arrived {
                o.rec.start = t;
            }
        }
        s
    }

    /// A span of bulk data moved to or from `peer` for a call.
    pub(crate) fn transfer(&self, name: &'static str, peer: u32, bytes: Option<u64>) -> Span {
        let mut s = self.span(Cat::Transfer, name);
        if let Some(o) = s.0.as_mut() {
            o.rec.set_peer(peer);
            o.rec.set_bytes(bytes);
        }
        s
    }

    /// An instant event (a verdict, a checkpoint written), with a detail shown in the viewer.
    pub fn instant(&self, cat: Cat, name: impl Into<Cow<'static, str>>, detail: Option<String>) {
        if let Some(r) = &self.0 {
            r.push(Record::instant(cat, name.into(), detail));
        }
    }

    /// Events recorded so far and how many the ring dropped (TR-2).
    pub fn counts(&self) -> (usize, u64) {
        match &self.0 {
            None => (0, 0),
            Some(r) => {
                let n = r.events.lock().unwrap_or_else(|p| p.into_inner()).len();
                (n, r.dropped.load(Ordering::Relaxed))
            }
        }
    }
}

/// The framework's own functions (the shutdown barrier, clock probes, cancels) are not
/// traced: a worker that serves calls waits in the barrier for the whole job, which would read
/// as one call as long as the job.
fn internal(fn_name: &str) -> bool {
    fn_name.starts_with("rpc_core::")
}

/// An open span: recorded when dropped. Annotate it with what the viewer should show.
#[must_use = "a span ends when this guard drops"]
pub struct Span(Option<Open>);

/// Held inline (72 bytes), not boxed: an allocation per span cost more than the copy.
struct Open {
    ring: Arc<Ring>,
    rec: Record,
}

impl Span {
    /// Bytes this span moved.
    pub fn bytes(&mut self, n: u64) -> &mut Self {
        if let Some(o) = self.0.as_mut() {
            o.rec.set_bytes(Some(n));
        }
        self
    }

    /// The span's outcome.
    pub fn ok(&mut self, ok: bool) -> &mut Self {
        if let Some(o) = self.0.as_mut() {
            o.rec.set_ok(ok);
        }
        self
    }

    /// The worker at the other end (a rank).
    pub fn peer(&mut self, rank: u32) -> &mut Self {
        if let Some(o) = self.0.as_mut() {
            o.rec.set_peer(rank);
        }
        self
    }

    /// A line of detail (a step number, a file name, an error). On a [`Cat::Step`] span, `step
    /// N` (as in `trainer 1 step N`) is the step's number: `rpctrace report` pairs the step
    /// spans of several ranks by it.
    pub fn detail(&mut self, d: impl FnOnce() -> String) -> &mut Self {
        if let Some(o) = self.0.as_mut() {
            o.rec.set_detail(d());
        }
        self
    }

    /// Whether this span records (its tracer is on).
    pub fn is_recording(&self) -> bool {
        self.0.is_some()
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(Open { ring, mut rec }) = self.0.take() {
            rec.end();
            ring.push(rec);
        }
    }
}

/// Writes this worker's part of the job's trace, if its tracer is on and the part is not
/// written yet (see `exit.rs`).
pub(crate) fn write_part(tracer: &Tracer) {
    if let Some(ring) = tracer.ring() {
        exit::write_once(ring, true);
    }
}

/// Makes sure this worker's part is written however its process ends (TR-5, `exit.rs`);
/// `signals`: also on SIGTERM, SIGINT and SIGHUP.
pub(crate) fn write_at_exit(tracer: &Tracer, signals: bool) {
    if let Some(ring) = tracer.ring() {
        exit::write_at_exit(ring, signals);
    }
}

/// The tracer a worker's configuration asks for: [`Config::trace`](crate::Config::trace),
/// else `from_env` ([`TRACE_ENV`]'s value); off when neither names a path. A path that
/// cannot be written is refused now ([`prepare`]), not found out as the worker ends.
pub(crate) fn from_config(
    path: Option<PathBuf>,
    from_env: Option<String>,
    capacity: usize,
) -> Result<Tracer, PrepareError> {
    let path = path.or_else(|| from_env.filter(|v| !v.is_empty()).map(PathBuf::from));
    match path {
        Some(p) => {
            prepare(&p)?;
            Ok(Tracer::on(p, capacity))
        }
        None => Ok(Tracer::off()),
    }
}

/// Why a job cannot be traced to a path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The path is a directory; the merged trace is a file.
    #[error("{0} is a directory: give the path of the file to write")]
    Directory(PathBuf),
    /// The parts' directory (`<path>.parts`) cannot be created.
    #[error("{trace}: cannot create {parts}: {source}")]
    Parts {
        /// The trace's path.
        trace: PathBuf,
        /// Its parts' directory.
        parts: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Makes sure a job can be traced to `trace`: refuses a directory as the path (the merged
/// trace is a file) and creates the parts' directory ([`parts_dir`]). A traced worker calls
/// it as it starts and `rpcrun --trace` before it starts any process, so a path that cannot
/// be written fails at once, not after the job has run.
pub fn prepare(trace: &Path) -> Result<(), PrepareError> {
    if trace.is_dir() {
        return Err(PrepareError::Directory(trace.to_owned()));
    }
    let parts = parts_dir(trace);
    std::fs::create_dir_all(&parts).map_err(|source| PrepareError::Parts {
        trace: trace.to_owned(),
        parts,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TR-1: off records nothing.
    #[test]
    fn off_records_nothing() {
        let t = Tracer::off();
        drop(t.span(Cat::Compute, "x"));
        t.instant(Cat::Failure, "y", None);
        assert!(t.call_made("f", 1).is_none());
        assert_eq!(t.counts(), (0, 0));
    }

    /// TR-3: the flow ids of a rank's incarnations, and of its starts by a launcher, do not
    /// meet (they all started at the same id, so a replaced worker's calls and its
    /// replacement's, or an earlier start's, were linked to each other's).
    #[test]
    fn incarnations_and_restarts_of_a_rank_make_distinct_flow_ids() {
        let ids = |incarnation: u64, restart: u64| {
            let t = Tracer::on(PathBuf::from("unused"), 16);
            t.set_who(Who {
                rank: 1,
                name: "w1".into(),
                incarnation,
                restart,
                ranks: vec![0, 1],
                ..Who::default()
            });
            let first = t.call_made("f", 0).unwrap().1;
            (first, first + 1_000_000)
        };
        let all = [
            ids(0, 0),
            ids(1, 0),
            ids(2, 0),
            ids(0, 1),
            ids(1, 1),
            ids(0, 2),
        ];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert!(x.1 < y.0 || y.1 < x.0, "{x:?} and {y:?} overlap");
                assert_eq!(
                    (x.0 >> 40, y.0 >> 40),
                    (1, 1),
                    "the rank stays in the high bits"
                );
            }
        }
    }

    /// TR-2: the ring keeps the newest events and counts the dropped ones.
    #[test]
    fn the_ring_is_bounded_and_counts_what_it_drops() {
        let t = Tracer::on(PathBuf::from("unused"), 3);
        for i in 0..5 {
            let mut s = t.span(Cat::Compute, format!("s{i}"));
            s.bytes(i);
        }
        assert_eq!(t.counts(), (3, 2));
        let (events, dropped) = t.ring().unwrap().snapshot();
        assert_eq!(dropped, 2);
        let names: Vec<_> = events.iter().map(|e| e.name.to_string()).collect();
        assert_eq!(names, ["s2", "s3", "s4"]);
    }
}

#[cfg(test)]
mod cost {
    use super::*;

    /// Prints what a span costs (run with `--release --ignored --nocapture`).
    #[test]
    #[ignore]
    fn span_cost() {
        for cap in [1 << 10, 1 << 18] {
            let t = Tracer::on(PathBuf::from("unused"), cap);
            let n = 2_000_000u32;
            let start = std::time::Instant::now();
            for i in 0..n {
                let (mut s, _) = t.call_made("some::function", i % 3).unwrap();
                s.ok(true);
                let mut r = t.call_served("some::function", 1, Some(u64::from(i)), None);
                r.bytes(10);
            }
            let ns = start.elapsed().as_nanos() as f64 / f64::from(n);
            println!("capacity {cap}: {ns:.0} ns per call made + served");
            let start = std::time::Instant::now();
            for _ in 0..n {
                drop(t.span(Cat::Compute, "x"));
            }
            let ns = start.elapsed().as_nanos() as f64 / f64::from(n);
            println!("capacity {cap}: {ns:.0} ns per static span");
            let start = std::time::Instant::now();
            for _ in 0..n {
                std::hint::black_box(clock::ticks());
            }
            let ns = start.elapsed().as_nanos() as f64 / f64::from(n);
            println!("{ns:.0} ns per clock read");
        }
    }

    /// Prints what encoding a full part costs, as TR-8 sends it to rank 0 at shutdown (run
    /// with `--release --ignored --nocapture`).
    #[test]
    #[ignore]
    fn full_part_cost() {
        let cap = DEFAULT_TRACE_CAPACITY;
        let t = Tracer::on(PathBuf::from("unused"), cap);
        for i in 0..cap as u32 / 2 {
            let (mut s, _) = t.call_made("some::function", i % 3).unwrap();
            s.ok(true);
            let mut r = t.call_served("some::function", 1, Some(u64::from(i)), None);
            r.bytes(10);
        }
        let ring = t.ring().unwrap();
        let start = std::time::Instant::now();
        let (bytes, _) = ring.part_json().unwrap();
        println!(
            "{} events: {:.1} MB of JSON in {:.0} ms",
            ring.snapshot().0.len(),
            bytes.len() as f64 / 1e6,
            start.elapsed().as_secs_f64() * 1e3
        );
        let dir = std::env::temp_dir().join(format!("merge-cost-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let trace = dir.join("trace.json");
        let parts = parts_dir(&trace);
        std::fs::create_dir_all(&parts).unwrap();
        for r in 0..4 {
            std::fs::write(parts.join(format!("rank{r}.json")), &bytes).unwrap();
        }
        let peak = || {
            let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            let kb = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .unwrap_or("0 kB");
            kb.trim()
                .trim_end_matches(" kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0)
                / 1024
        };
        let before = peak();
        let start = std::time::Instant::now();
        let summary = merge_parts(&trace, None).unwrap();
        println!(
            "merging 4 such parts ({} events): {:.0} ms, peak RSS {} MB -> {} MB",
            summary.events,
            start.elapsed().as_secs_f64() * 1e3,
            before,
            peak()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
