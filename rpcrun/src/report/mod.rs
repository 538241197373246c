//! What held each step up: a report over a merged trace (`rpctrace report`).
//!
//! A step is a span of category `step` (the training loops record one per step; without any,
//! the whole trace on rank 0 is one step). Where several ranks record steps (the replicas of
//! data parallelism, a parameter server's trainers) a step is one span of each, paired by the
//! step number their details give (`step 12`), else by count (`steps.rs`), and its critical
//! path is the walk of the one busy longest: the one the others waited for. For each step:
//! - **the critical path**, walked back from the step's end: on a worker, the span that ended
//!   last before the current time holds it up; a call made continues on the callee inside its
//!   served span (the time the call took beyond it is `wire`: the network and the queues); a
//!   span with spans inside is walked the same way, and time no span inside covers is the
//!   span's own (`self`);
//! - **each worker's shares** of the step: busy (compute, optimizer, pipeline, calls served,
//!   less what they spent in calls of their own), communicating (calls made, collectives,
//!   transfers), waiting (neither); the compute-communication overlap (how much of the
//!   communication ran under computation); the pipeline bubble (the step less its pipeline
//!   actions), for ranks that ran some;
//! - **the straggler**: the worker with the most time on the critical path.

mod file;
mod index;
mod model;
#[cfg(test)]
mod robust;
mod steps;
mod svg;
mod text;
mod validate;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use index::Index;
use steps::StepSpan;

pub use file::{Args, Event, TraceFile};
pub use model::{covered, overlap, Span, Trace};
pub use svg::svg;
pub use validate::{validate, Validated};

/// One piece of a step's critical path.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Segment {
    /// The worker's rank.
    pub rank: u32,
    /// The worker's name.
    pub worker: String,
    /// The span that held the step up (for `wire`, the call's name).
    pub span: String,
    /// The span's category, `self` for a span's own time, `wire` for a call's time in flight.
    pub cat: String,
    /// Milliseconds.
    pub ms: f64,
}

/// A worker's shares of a step (fractions of the step's length).
#[derive(Clone, Debug, Serialize)]
pub struct Shares {
    /// The worker's rank.
    pub rank: u32,
    /// The worker's name.
    pub worker: String,
    /// Computing or serving.
    pub busy: f64,
    /// In calls, collectives or transfers.
    pub communicating: f64,
    /// Neither.
    pub waiting: f64,
    /// Of its communication, the fraction that ran under its computation.
    pub overlap: Option<f64>,
    /// The step less its pipeline actions, for a rank that ran some.
    pub pipeline_bubble: Option<f64>,
}

/// One step's analysis.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    /// The step span's name and rank.
    pub name: String,
    /// The rank that recorded the step.
    pub rank: u32,
    /// The step's number, as its span's detail gives it (`step 12`).
    pub number: Option<u64>,
    /// Milliseconds.
    pub ms: f64,
    /// The critical path, from the step's start to its end.
    pub critical_path: Vec<Segment>,
    /// The worker with the most time on the critical path, and that time in milliseconds.
    pub straggler: Option<(String, f64)>,
    /// Every worker's shares of the step.
    pub workers: Vec<Shares>,
}

/// The report over every step.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Steps analysed.
    pub steps: usize,
    /// The median step, milliseconds.
    pub step_ms_median: f64,
    /// The largest clock error bound of the trace's parts on rank 0's clock, microseconds.
    pub clock_error_us: f64,
    /// The ranks whose parts are on their own clocks (they never read rank 0's).
    pub unaligned: Vec<u32>,
    /// The ranks of the group with no part in the trace (killed outright, or their parts were
    /// not merged); after group restarts, with no part in some start.
    pub missing: Vec<u32>,
    /// After group restarts: each start that lacks parts, with the ranks it lacks.
    pub missing_by_start: Vec<(u64, Vec<u32>)>,
    /// The worker most often the straggler, and in how many steps.
    pub straggler: Option<(String, usize)>,
    /// Critical-path time summed over the steps by (worker, span, category), largest first,
    /// with its share of all steps' time.
    pub critical: Vec<(String, String, String, f64, f64)>,
    /// Each worker's shares, averaged over the steps.
    pub workers: Vec<Shares>,
    /// Each step.
    pub per_step: Vec<StepReport>,
}

/// Categories a worker computes in.
const COMPUTE: [&str; 3] = ["compute", "optimizer", "pipeline"];
/// Categories a worker communicates in.
const COMMUNICATE: [&str; 3] = ["call", "collective", "transfer"];

/// A trace with its spans indexed, and what the report asks of every step.
struct Indexed<'a> {
    t: &'a Trace,
    ix: Index,
    /// The ranks with spans.
    ranks: Vec<u32>,
    /// The ranks with pipeline spans anywhere in the trace.
    pipelined: BTreeSet<u32>,
}

/// Analyses every step of `t`.
pub fn report(t: &Trace) -> Report {
    let ix = Index::new(t);
    let c = Indexed {
        t,
        ranks: ix.ranks().collect(),
        ix,
        pipelined: (t.spans.iter())
            .filter(|s| s.cat == "pipeline")
            .map(|s| s.rank)
            .collect(),
    };
    // The step spans, paired into steps (in data parallelism every replica records its own).
    let recorded: Vec<usize> = (0..t.spans.len())
        .filter(|&i| t.spans[i].cat == "step")
        .collect();
    let per_step: Vec<StepReport> = if recorded.is_empty() {
        let (lo, hi) = t.spans.iter().fold((f64::MAX, f64::MIN), |(a, b), s| {
            (a.min(s.start), b.max(s.end))
        });
        let whole = Span {
            rank: 0,
            cat: "step".into(),
            name: "the whole trace".into(),
            start: lo.min(hi),
            end: hi.max(lo),
            flow: None,
            step: None,
        };
        vec![step(&c, &[(None, &whole)])]
    } else {
        let spans: Vec<StepSpan> = (recorded.iter())
            .map(|&i| {
                let s = &t.spans[i];
                StepSpan {
                    rank: u64::from(s.rank),
                    start: s.start,
                    end: s.end,
                    number: s.step,
                }
            })
            .collect();
        (steps::pair(&spans).iter())
            .map(|m| {
                let members: Vec<_> = (m.iter())
                    .map(|&k| (Some(recorded[k]), &t.spans[recorded[k]]))
                    .collect();
                step(&c, &members)
            })
            .collect()
    };
    summarize(t, per_step)
}

/// One step: a step span of each rank that records steps (`members`). Each member's
/// step is walked on its rank; the step's critical path is the walk of the member that was
/// busy longest, the one the others waited for (in a collective, or for a server that waits
/// for every push), and each member's shares are of its own step span; other ranks' are of
/// the members' spans' union.
fn step(c: &Indexed<'_>, members: &[(Option<usize>, &Span)]) -> StepReport {
    let t = c.t;
    let walked: Vec<(Vec<Segment>, Shares, &Span)> = (members.iter())
        .map(|&(at, s)| {
            let mut path = Vec::new();
            walk(c, at, s, s.start, s.end, 0, &mut path);
            path.reverse();
            (path, shares(c, s.rank, s.start, s.end), s)
        })
        .collect();
    let busy_ms = |(_, sh, s): &(Vec<Segment>, Shares, &Span)| sh.busy * s.len();
    let longest = (0..walked.len())
        .max_by(|&a, &b| {
            busy_ms(&walked[a])
                .total_cmp(&busy_ms(&walked[b]))
                .then(b.cmp(&a))
        })
        .unwrap_or(0);
    let (lo, hi) = (members.iter()).fold((f64::MAX, f64::MIN), |(a, b), (_, s)| {
        (a.min(s.start), b.max(s.end))
    });
    let mut own: BTreeMap<u32, Shares> = BTreeMap::new();
    let mut ms = 0.0f64;
    let mut chosen = None;
    for (i, (path, sh, s)) in walked.into_iter().enumerate() {
        ms = ms.max(s.len() / 1000.0);
        if i == longest {
            chosen = Some((path, s));
        }
        own.insert(s.rank, sh);
    }
    let (path, s) = chosen.expect("a step has a member");
    let mut by_worker: BTreeMap<u32, f64> = BTreeMap::new();
    for seg in &path {
        *by_worker.entry(seg.rank).or_default() += seg.ms;
    }
    let straggler = by_worker
        .iter()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(&r, &ms)| (t.name(r), ms));
    let workers = (c.ranks.iter())
        .map(|&r| own.remove(&r).unwrap_or_else(|| shares(c, r, lo, hi)))
        .collect();
    StepReport {
        name: s.name.clone(),
        rank: s.rank,
        number: s.step,
        ms,
        critical_path: path,
        straggler,
        workers,
    }
}

/// How deep the walk follows spans inside spans and calls into callees.
const MAX_DEPTH: u32 = 64;

/// The critical path inside `container` (span `at` of the trace, `None` for the whole trace;
/// on its rank, within `[lo, hi]`), pushed end first.
fn walk(
    c: &Indexed<'_>,
    at: Option<usize>,
    container: &Span,
    lo: f64,
    hi: f64,
    depth: u32,
    out: &mut Vec<Segment>,
) {
    let t = c.t;
    let span = |i: usize| &t.spans[i];
    let eps = t.clock_error_us.max(1.0);
    // Strictly inside: shorter, or as long and later in the trace (two spans with the same
    // interval must not contain each other, or the walk would never end).
    let inside = |i: usize| {
        let x = span(i);
        (x.len() < container.len() || (x.len() == container.len() && at.is_some_and(|a| i > a)))
            && x.cat != "serve"
            && x.cat != "step"
            && x.end <= hi + eps
            && !x.is_empty()
    };
    let mut kids: Vec<usize> = (c.ix.starting_in(container.rank, lo - eps, hi + eps).iter())
        .copied()
        .filter(|&i| inside(i))
        .collect();
    // Only the outermost: a span inside another is walked when that one is. By start, the
    // longest first: a kid is inside one that starts earlier and ends no earlier, or one
    // that starts with it and is longer.
    kids.sort_by(|&a, &b| {
        (span(a).start.total_cmp(&span(b).start))
            .then(span(b).end.total_cmp(&span(a).end))
            .then(a.cmp(&b))
    });
    let mut top = Vec::new();
    let (mut earlier_end, mut g) = (f64::NEG_INFINITY, 0);
    while g < kids.len() {
        let start = span(kids[g]).start;
        let h = (kids[g..].iter())
            .position(|&i| span(i).start != start)
            .map_or(kids.len(), |p| g + p);
        let longest = (kids[g..h].iter()).fold(f64::NEG_INFINITY, |m, &i| m.max(span(i).len()));
        for &i in &kids[g..h] {
            if earlier_end < span(i).end && longest <= span(i).len() {
                top.push(i);
            }
        }
        earlier_end = (kids[g..h].iter()).fold(earlier_end, |m, &i| m.max(span(i).end));
        g = h;
    }
    // Walked back from `hi`: the span that ended last before `now` holds it up (the later
    // in the trace of two that end together). `now` only moves back, so a span passed over
    // (it ends after `now`, or starts at or after it) is never the one.
    top.sort_by(|&a, &b| span(a).end.total_cmp(&span(b).end).then(a.cmp(&b)));
    let own = |a: f64, b: f64, out: &mut Vec<Segment>| {
        if b - a > 0.0 {
            out.push(segment(t, container, "self", container.name.clone(), b - a));
        }
    };
    let mut now = hi;
    while let Some(ki) = top.pop() {
        let k = span(ki);
        if k.end > now + eps || k.start >= now {
            continue;
        }
        let end = k.end.min(now);
        own(end, now, out);
        let start = k.start.max(lo);
        let callee = (k.cat == "call")
            .then(|| t.served.get(&k.flow?).copied())
            .flatten();
        match callee.filter(|_| depth < MAX_DEPTH) {
            Some(ci) => {
                let callee = span(ci);
                let (cs, ce) = (callee.start.max(start), callee.end.min(end));
                if end > ce {
                    out.push(segment(t, k, "wire", k.name.clone(), end - ce));
                }
                if ce > cs {
                    walk(c, Some(ci), callee, cs, ce, depth + 1, out);
                }
                if cs > start {
                    out.push(segment(t, k, "wire", k.name.clone(), cs - start));
                }
            }
            None if depth < MAX_DEPTH => walk(c, Some(ki), k, start, end, depth + 1, out),
            None => out.push(segment(t, k, "self", k.name.clone(), end - start)),
        }
        now = start;
        if now <= lo {
            break;
        }
    }
    own(lo, now, out);
}

fn segment(t: &Trace, on: &Span, cat: &str, span: String, us: f64) -> Segment {
    Segment {
        rank: on.rank,
        worker: t.name(on.rank),
        span,
        cat: cat.into(),
        ms: us / 1000.0,
    }
}

/// Rank `r`'s shares of `[lo, hi]`.
fn shares(c: &Indexed<'_>, r: u32, lo: f64, hi: f64) -> Shares {
    let t = c.t;
    let near = c.ix.overlapping(r, lo, hi);
    let of = |cats: &[&str]| -> Vec<(f64, f64)> {
        (near.iter().map(|&i| &t.spans[i]))
            .filter(|s| cats.contains(&s.cat.as_str()))
            .map(|s| (s.start, s.end))
            .collect()
    };
    let len = (hi - lo).max(f64::MIN_POSITIVE);
    let comm = of(&COMMUNICATE);
    let compute = of(&COMPUTE);
    let mut working = compute.clone();
    working.extend(of(&["serve"]));
    let comm_len = covered(comm.clone(), lo, hi);
    let all: Vec<_> = comm.iter().chain(&working).copied().collect();
    let any = covered(all, lo, hi);
    let pipeline = of(&["pipeline"]);
    Shares {
        rank: r,
        worker: t.name(r),
        busy: (any - comm_len) / len,
        communicating: comm_len / len,
        waiting: (len - any).max(0.0) / len,
        overlap: (comm_len > 0.0).then(|| overlap(&compute, &comm, lo, hi) / comm_len),
        pipeline_bubble: (c.pipelined.contains(&r))
            .then(|| (len - covered(pipeline, lo, hi)).max(0.0) / len),
    }
}

fn summarize(t: &Trace, per_step: Vec<StepReport>) -> Report {
    let mut ms: Vec<f64> = per_step.iter().map(|s| s.ms).collect();
    ms.sort_by(f64::total_cmp);
    let total: f64 = ms.iter().sum();
    let mut stragglers: BTreeMap<String, usize> = BTreeMap::new();
    let mut critical: BTreeMap<(String, String, String), f64> = BTreeMap::new();
    let mut sums: BTreeMap<u32, (Shares, usize)> = BTreeMap::new();
    for s in &per_step {
        if let Some((w, _)) = &s.straggler {
            *stragglers.entry(w.clone()).or_default() += 1;
        }
        for seg in &s.critical_path {
            let key = (seg.worker.clone(), seg.span.clone(), seg.cat.clone());
            *critical.entry(key).or_default() += seg.ms;
        }
        for w in &s.workers {
            let e = sums.entry(w.rank).or_insert_with(|| (zero(w), 0));
            add(&mut e.0, w);
            e.1 += 1;
        }
    }
    let mut critical: Vec<_> = critical
        .into_iter()
        .map(|((w, s, c), ms)| (w, s, c, ms, ms / total.max(f64::MIN_POSITIVE)))
        .collect();
    critical.sort_by(|a, b| b.3.total_cmp(&a.3));
    Report {
        steps: per_step.len(),
        step_ms_median: ms.get(ms.len() / 2).copied().unwrap_or(0.0),
        clock_error_us: t.clock_error_us,
        unaligned: t.unaligned.clone(),
        missing: t.missing.clone(),
        missing_by_start: t.missing_by_start.clone(),
        straggler: stragglers.into_iter().max_by_key(|(_, n)| *n),
        critical,
        workers: sums.into_values().map(|(s, n)| scale(s, n)).collect(),
        per_step,
    }
}

fn zero(w: &Shares) -> Shares {
    Shares {
        rank: w.rank,
        worker: w.worker.clone(),
        busy: 0.0,
        communicating: 0.0,
        waiting: 0.0,
        overlap: None,
        pipeline_bubble: None,
    }
}

fn add(a: &mut Shares, b: &Shares) {
    a.busy += b.busy;
    a.communicating += b.communicating;
    a.waiting += b.waiting;
    let sum = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (None, None) => None,
        (x, y) => Some(x.unwrap_or(0.0) + y.unwrap_or(0.0)),
    };
    a.overlap = sum(a.overlap, b.overlap);
    a.pipeline_bubble = sum(a.pipeline_bubble, b.pipeline_bubble);
}

fn scale(mut s: Shares, n: usize) -> Shares {
    let n = n.max(1) as f64;
    s.busy /= n;
    s.communicating /= n;
    s.waiting /= n;
    s.overlap = s.overlap.map(|x| x / n);
    s.pipeline_bubble = s.pipeline_bubble.map(|x| x / n);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(rank: u32, cat: &str, name: &str, start: f64, end: f64, flow: Option<u64>) -> Span {
        Span {
            rank,
            cat: cat.into(),
            name: name.into(),
            start,
            end,
            flow,
            step: None,
        }
    }

    fn trace(spans: Vec<Span>) -> Trace {
        let mut t = Trace {
            spans,
            ..Trace::default()
        };
        for (i, s) in t.spans.iter().enumerate() {
            if let (Some(f), "serve") = (s.flow, s.cat.as_str()) {
                t.served.insert(f, i);
            }
        }
        t
    }

    /// A call's time splits into the wire and the callee's spans; the callee with the most
    /// time on the path is the straggler.
    #[test]
    fn the_critical_path_follows_calls_into_their_callees() {
        let t = trace(vec![
            span(0, "step", "step", 0.0, 100.0, None),
            span(0, "call", "f", 10.0, 90.0, Some(1)),
            span(1, "serve", "f", 15.0, 85.0, Some(1)),
            span(1, "compute", "forward", 20.0, 80.0, None),
        ]);
        let r = report(&t);
        let path: Vec<_> = r.per_step[0]
            .critical_path
            .iter()
            .map(|s| {
                (
                    s.rank,
                    s.span.as_str(),
                    s.cat.as_str(),
                    (s.ms * 1000.0).round(),
                )
            })
            .collect();
        assert_eq!(
            path,
            [
                (0, "step", "self", 10.0),
                (0, "f", "wire", 5.0),
                (1, "f", "self", 5.0),
                (1, "forward", "self", 60.0),
                (1, "f", "self", 5.0),
                (0, "f", "wire", 5.0),
                (0, "step", "self", 10.0),
            ]
        );
        assert_eq!(r.straggler, Some(("rank 1".into(), 1)));
        // The step's own 20 ms of 100 are a fifth of the path: the text says how to trace them.
        assert!(r.text().contains("20 % is `step (self)`"), "{}", r.text());
    }

    /// Replicas that each record their steps: the k-th step of each is one step, and the
    /// straggler is the replica the others waited for in the all-reduce (the one busy
    /// longest), whatever its rank. The report counted each replica's steps as steps of
    /// their own (6 here), each walked on its own rank, so every replica led "its" steps and
    /// the straggler was the tie's last name (rank 1).
    #[test]
    fn replicas_steps_are_one_step_and_the_slow_replica_is_the_straggler() {
        let mut spans = Vec::new();
        for k in 0..3 {
            let t0 = 100.0 * f64::from(k);
            for (r, compute) in [(0u32, 70.0), (1, 20.0)] {
                spans.push(span(r, "step", "step", t0, t0 + 90.0, None));
                spans.push(span(r, "compute", "backward", t0, t0 + compute, None));
                spans.push(span(
                    r,
                    "collective",
                    "all_reduce",
                    t0 + compute,
                    t0 + 90.0,
                    None,
                ));
            }
        }
        let r = report(&trace(spans));
        assert!(!r.text().contains("no span covers"), "{}", r.text());
        assert_eq!(r.steps, 3, "{}", r.text());
        assert_eq!(r.straggler, Some(("rank 0".into(), 3)), "{}", r.text());
        let (who, span, cat, ms, _) = &r.critical[0];
        assert_eq!(
            (who.as_str(), span.as_str(), cat.as_str()),
            ("rank 0", "backward", "self")
        );
        assert!((ms - 0.21).abs() < 1e-9, "{}", r.text());
        let busy: Vec<f64> = r.workers.iter().map(|w| (w.busy * 90.0).round()).collect();
        assert_eq!(busy, [70.0, 20.0], "{}", r.text());
    }

    /// A replacement replica that joined at step 1 after a failure at step 2 (the others
    /// rolled back and replayed 1 and 2): its steps are the replayed steps of the same
    /// numbers. The report paired by count: the replacement's step 1 (15 ms) was the others'
    /// step 0, 60 ms before it began, and the replayed steps were the replacement's 2, 3 and
    /// none.
    #[test]
    fn a_replacements_steps_pair_with_the_replay() {
        let mut spans = Vec::new();
        let mut step = |r: u32, n: u64, start: f64, len: f64| {
            let mut s = span(r, "step", "step", start, start + len, None);
            s.step = Some(n);
            spans.push(s);
        };
        for r in 0..2 {
            for (k, n) in [0, 1, 2, 1, 2, 3].into_iter().enumerate() {
                step(r, n, 20_000.0 * k as f64, 10_000.0);
            }
        }
        for (k, n) in [1, 2, 3].into_iter().enumerate() {
            step(2, n, 60_000.0 + 20_000.0 * k as f64, 15_000.0);
        }
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        let r = report(&trace(spans));
        let ms: Vec<f64> = r.per_step.iter().map(|s| s.ms).collect();
        assert_eq!(ms, [10.0, 10.0, 10.0, 15.0, 15.0, 15.0], "{}", r.text());
        let numbers: Vec<_> = r.per_step.iter().filter_map(|s| s.number).collect();
        assert_eq!(numbers, [0, 1, 2, 1, 2, 3]);
        assert!(
            r.text()
                .contains("slowest: step 3 (recorded as step 1), 15.00 ms"),
            "{}",
            r.text()
        );
    }

    /// Two spans with the same interval do not contain each other (the walk used to recurse
    /// between them until the stack overflowed).
    #[test]
    fn spans_with_the_same_interval_end_the_walk() {
        let t = trace(vec![
            span(0, "step", "step", 0.0, 10.0, None),
            span(0, "compute", "a", 2.0, 8.0, None),
            span(0, "transfer", "b", 2.0, 8.0, None),
        ]);
        let r = report(&t);
        let total: f64 = r.per_step[0].critical_path.iter().map(|s| s.ms).sum();
        assert!(
            (total - 0.010).abs() < 1e-9,
            "{:?}",
            r.per_step[0].critical_path
        );
    }

    /// Prints what a report of a long job costs: 5000 steps of three workers, a call and
    /// its served span, a compute span inside, per worker and step (run with `--release
    /// --ignored --nocapture`).
    #[test]
    #[ignore]
    fn report_cost() {
        let mut spans = Vec::new();
        for k in 0..5000u64 {
            let t0 = k as f64 * 100.0;
            spans.push(span(0, "step", "step", t0, t0 + 90.0, None));
            for w in 1..3u32 {
                let flow = Some(2 * k + u64::from(w));
                let at = t0 + 10.0 * f64::from(w);
                spans.push(span(0, "call", "f", at, at + 30.0, flow));
                spans.push(span(w, "serve", "f", at + 2.0, at + 28.0, flow));
                spans.push(span(w, "compute", "forward", at + 4.0, at + 26.0, None));
            }
            spans.push(span(0, "compute", "backward", t0 + 50.0, t0 + 85.0, None));
        }
        let n = spans.len();
        let t = trace(spans);
        let start = std::time::Instant::now();
        let r = report(&t);
        println!(
            "{} steps, {n} spans: report in {:.0} ms",
            r.steps,
            start.elapsed().as_secs_f64() * 1e3
        );
    }
}
