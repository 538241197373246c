//! A merged trace read back: its spans by rank, and each call's served span by flow id.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use super::file::TraceFile;

/// One complete span (`ph: X`) of the trace, in microseconds on rank 0's clock.
#[derive(Clone, Debug)]
pub struct Span {
    /// The rank that recorded it (`pid`).
    pub rank: u32,
    /// Its category (`call`, `serve`, `compute`, ...).
    pub cat: String,
    /// Its name.
    pub name: String,
    /// Start, microseconds.
    pub start: f64,
    /// End, microseconds.
    pub end: f64,
    /// The call's flow id, on a call made or served.
    pub flow: Option<u64>,
    /// A step span's number, from its detail (`step 12`): steps of several ranks pair by it.
    pub step: Option<u64>,
}

impl Span {
    /// Its length in microseconds.
    pub fn len(&self) -> f64 {
        self.end - self.start
    }

    /// Whether it has no length.
    pub fn is_empty(&self) -> bool {
        self.len() <= 0.0
    }
}

/// A merged trace, indexed for the report.
#[derive(Debug, Default)]
pub struct Trace {
    /// Every complete span, by start.
    pub spans: Vec<Span>,
    /// Each rank's process name.
    pub names: BTreeMap<u32, String>,
    /// Each flow id's served span (an index into `spans`).
    pub served: HashMap<u64, usize>,
    /// The largest clock error bound of any part aligned on rank 0's clock, microseconds.
    pub clock_error_us: f64,
    /// The ranks whose parts are on their own clocks (they never read rank 0's).
    pub unaligned: Vec<u32>,
    /// The ranks of the group the merge found no part of (`otherData.rpc_trace.missing_ranks`).
    pub missing: Vec<u32>,
    /// After group restarts: each start that lacks parts, with the ranks it lacks
    /// (`missing_by_start`).
    pub missing_by_start: Vec<(u64, Vec<u32>)>,
}

impl Trace {
    /// Indexes a trace (a merged one, or a single part).
    pub fn from_file(f: &TraceFile<'_>) -> Result<Trace, String> {
        let mut t = Trace::default();
        for (i, e) in f.events.iter().enumerate() {
            let bad = |what: &str| format!("event {i} ({}): {what}", e.ph);
            match &*e.ph {
                "M" if e.name == "process_name" => {
                    let pid = e.pid.ok_or_else(|| bad("no pid"))?;
                    t.names
                        .insert(pid as u32, e.arg_name().unwrap_or("").to_owned());
                }
                "X" => {
                    let pid = e.pid.ok_or_else(|| bad("no pid"))?;
                    let ts = e.ts.ok_or_else(|| bad("no ts"))?;
                    let dur = e.dur.ok_or_else(|| bad("no dur"))?;
                    t.spans.push(Span {
                        rank: pid as u32,
                        cat: e.cat.clone().into_owned(),
                        name: e.name.clone().into_owned(),
                        start: ts,
                        end: ts + dur,
                        flow: e.flow(),
                        step: (e.cat == "step")
                            .then(|| e.detail().and_then(super::steps::step_number))
                            .flatten(),
                    });
                }
                _ => {}
            }
        }
        t.spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        for (i, s) in t.spans.iter().enumerate() {
            if let (Some(f), "serve") = (s.flow, s.cat.as_str()) {
                t.served.insert(f, i);
            }
        }
        t.clock_error_us = f
            .rpc_trace("/clock_error_bound_ns")
            .or_else(|| f.rpc_trace("/clock/error_bound_ns"))
            .and_then(Value::as_u64)
            .filter(|&b| b != u64::MAX)
            .unwrap_or(0) as f64
            / 1000.0;
        t.unaligned = unaligned_ranks(f);
        t.missing = (f.rpc_trace("/missing_ranks").and_then(Value::as_array))
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|r| r as u32)
                    .collect()
            })
            .unwrap_or_default();
        t.missing_by_start = missing_by_start(f);
        Ok(t)
    }

    /// Rank `r`'s name as the trace gives it.
    pub fn name(&self, r: u32) -> String {
        self.names
            .get(&r)
            .cloned()
            .unwrap_or_else(|| format!("rank {r}"))
    }

    /// The served span of the call `s`, if `s` is a call made whose callee traced it.
    pub fn callee_of(&self, s: &Span) -> Option<&Span> {
        if s.cat != "call" {
            return None;
        }
        self.served.get(&s.flow?).map(|&i| &self.spans[i])
    }
}

/// The length of the union of `intervals` clipped to `[lo, hi]`.
pub fn covered(mut intervals: Vec<(f64, f64)>, lo: f64, hi: f64) -> f64 {
    intervals.retain_mut(|(a, b)| {
        *a = a.max(lo);
        *b = b.min(hi);
        a < b
    });
    intervals.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
    for (a, b) in intervals {
        if b <= end {
            continue;
        }
        total += b - a.max(end);
        end = b;
    }
    total
}

/// The length of `a`'s union intersected with `b`'s, clipped to `[lo, hi]`.
pub fn overlap(a: &[(f64, f64)], b: &[(f64, f64)], lo: f64, hi: f64) -> f64 {
    let both: Vec<_> = a.iter().chain(b).copied().collect();
    covered(a.to_vec(), lo, hi) + covered(b.to_vec(), lo, hi) - covered(both, lo, hi)
}

/// The ranks a merged trace says are on their own clocks (`otherData.rpc_trace.unaligned_ranks`;
/// a single part's own, if its clock never read rank 0's).
pub(crate) fn unaligned_ranks(f: &TraceFile<'_>) -> Vec<u32> {
    if let Some(Value::Array(a)) = f.rpc_trace("/unaligned_ranks") {
        return a
            .iter()
            .filter_map(Value::as_u64)
            .map(|r| r as u32)
            .collect();
    }
    match (
        f.rpc_trace("/clock/error_bound_ns").and_then(Value::as_u64),
        f.rpc_trace("/rank").and_then(Value::as_u64),
    ) {
        (Some(u64::MAX), Some(r)) => vec![r as u32],
        _ => Vec::new(),
    }
}

/// `otherData.rpc_trace.missing_by_start`: `[{"restart": k, "ranks": [..]}, ..]`.
fn missing_by_start(f: &TraceFile<'_>) -> Vec<(u64, Vec<u32>)> {
    let Some(Value::Array(starts)) = f.rpc_trace("/missing_by_start") else {
        return Vec::new();
    };
    let ranks = |s: &Value| -> Vec<u32> {
        let all = s
            .get("ranks")
            .and_then(Value::as_array)
            .into_iter()
            .flatten();
        all.filter_map(Value::as_u64).map(|r| r as u32).collect()
    };
    (starts.iter())
        .filter_map(|s| Some((s.get("restart")?.as_u64()?, ranks(s))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unions_and_overlaps() {
        let a = [(0.0, 10.0), (5.0, 15.0), (20.0, 30.0)];
        assert_eq!(covered(a.to_vec(), 0.0, 100.0), 25.0);
        assert_eq!(covered(a.to_vec(), 12.0, 25.0), 8.0);
        let b = [(8.0, 22.0)];
        assert_eq!(overlap(&a, &b, 0.0, 100.0), 9.0);
    }
}
