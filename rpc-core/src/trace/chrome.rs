//! The Trace Event Format (the JSON `chrome://tracing` and Perfetto open): one worker's part,
//! and the merge of a job's parts into one file.
//!
//! A part is itself a valid trace: its events on rank 0's clock (TR-4), one process per rank
//! (`pid` = rank), one track per category and lane (spans that overlap in time, such as calls
//! in flight together, get lanes of their own so that every track nests properly), flows from
//! each call made to the call served (`s` at the caller's span, `f` at the callee's: TR-3).
//! `otherData.rpc_trace` says who wrote it, the clock's offset and error bound, and how many
//! events the ring dropped (TR-2).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::{json, Value};

use super::{Cat, ClockEstimate, Event, Flow, Who};

/// The directory a job's parts go to: `<trace>.parts`.
pub fn parts_dir(trace: &Path) -> PathBuf {
    let mut p = trace.as_os_str().to_owned();
    p.push(".parts");
    PathBuf::from(p)
}

/// The part of rank `rank`'s incarnation `incarnation` of the job traced to `trace`, in the
/// launcher's start `restart` (0: the first; a group restart starts every rank again at
/// incarnation 0, and the earlier start's parts stay beside the new ones).
pub fn part_path(trace: &Path, rank: u32, incarnation: u64, restart: u64) -> PathBuf {
    let name = match restart {
        0 => format!("rank-{rank}-inc-{incarnation}.json"),
        k => format!("rank-{rank}-inc-{incarnation}-restart-{k}.json"),
    };
    parts_dir(trace).join(name)
}

/// Microseconds, the format's unit, from nanoseconds on this rank's clock moved to rank 0's.
fn us(ns: u64, clock: &ClockEstimate) -> f64 {
    clock.to_reference(ns) as f64 / 1000.0
}

/// One event of a part as the format writes it; absent fields are left out.
#[derive(Serialize)]
struct Ev<'a> {
    ph: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bp: Option<&'static str>,
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<Args<'a>>,
}

/// A span's or a metadata event's `args`.
#[derive(Default, Serialize)]
struct Args<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sort_index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer_rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow: Option<u64>,
}

impl<'a> Ev<'a> {
    fn new(ph: &'static str, name: &'a str, pid: u32) -> Self {
        Self {
            ph,
            s: None,
            bp: None,
            name,
            cat: None,
            id: None,
            pid,
            tid: None,
            ts: None,
            dur: None,
            args: None,
        }
    }
}

/// A part's whole: its events, then who wrote it (`otherData.rpc_trace`).
#[derive(Serialize)]
struct Written<'a> {
    #[serde(rename = "traceEvents")]
    trace_events: Vec<Ev<'a>>,
    #[serde(rename = "displayTimeUnit")]
    display_time_unit: &'static str,
    #[serde(rename = "otherData")]
    other_data: Value,
}

/// One rank's part as a trace (see the module's documentation), as JSON. Written straight
/// from the events (no tree of values in between): a full ring (262,144 events) encodes in a
/// fraction of the time a `serde_json::Value` took to build.
pub(crate) fn part(
    who: &Who,
    clock: &ClockEstimate,
    events: &[Event],
    dropped: u64,
) -> serde_json::Result<Vec<u8>> {
    let pid = who.rank;
    let process = format!("{} (rank {})", who.name, who.rank);
    let mut out = Vec::with_capacity(events.len() * 2 + 8);
    let meta = |name, args| {
        let mut e = Ev::new("M", name, pid);
        e.args = Some(args);
        e
    };
    out.push(meta(
        "process_name",
        Args {
            name: Some(&process),
            ..Args::default()
        },
    ));
    out.push(meta(
        "process_sort_index",
        Args {
            sort_index: Some(pid),
            ..Args::default()
        },
    ));
    // Lanes: per category, the first lane free at a span's start (events are in start order).
    let mut order: Vec<&Event> = events.iter().collect();
    order.sort_by_key(|e| e.start);
    let mut lanes: BTreeMap<Cat, Vec<u64>> = BTreeMap::new();
    let mut named: BTreeMap<u32, String> = BTreeMap::new();
    let mut tids = Vec::with_capacity(order.len());
    for e in &order {
        let ends = lanes.entry(e.cat).or_default();
        let end = e.start + e.dur.unwrap_or(0);
        let lane = match ends.iter().position(|&t| t <= e.start) {
            Some(l) => {
                ends[l] = end;
                l
            }
            None => {
                ends.push(end);
                ends.len() - 1
            }
        };
        let tid = (e.cat as u32) * 1000 + lane as u32;
        named.entry(tid).or_insert_with(|| match lane {
            0 => e.cat.as_str().to_owned(),
            l => format!("{} #{l}", e.cat.as_str()),
        });
        tids.push(tid);
    }
    for (tid, lane_name) in &named {
        let mut e = meta(
            "thread_name",
            Args {
                name: Some(lane_name),
                ..Args::default()
            },
        );
        e.tid = Some(*tid);
        out.push(e);
        let mut e = meta(
            "thread_sort_index",
            Args {
                sort_index: Some(*tid),
                ..Args::default()
            },
        );
        e.tid = Some(*tid);
        out.push(e);
    }
    for (e, &tid) in order.iter().zip(&tids) {
        let ts = us(e.start, clock);
        let cat = e.cat.as_str();
        let flow = match e.flow {
            Some(Flow::Out(id) | Flow::In(id)) => Some(id),
            None => None,
        };
        let args = Args {
            peer_rank: e.peer,
            bytes: e.bytes,
            outcome: e.ok.map(|ok| if ok { "ok" } else { "error" }),
            detail: e.detail.as_deref(),
            flow,
            ..Args::default()
        };
        let mut span = Ev::new(if e.dur.is_some() { "X" } else { "i" }, &e.name, pid);
        span.cat = Some(cat);
        span.tid = Some(tid);
        span.ts = Some(ts);
        span.args = Some(args);
        match e.dur {
            Some(d) => span.dur = Some(d as f64 / 1000.0),
            None => span.s = Some("p"),
        }
        out.push(span);
        if let Some(f) = e.flow {
            let mut link = Ev::new("s", "call", pid);
            if let Flow::In(_) = f {
                link.ph = "f";
                link.bp = Some("e");
            }
            link.cat = Some("flow");
            link.id = flow;
            link.tid = Some(tid);
            link.ts = Some(ts);
            out.push(link);
        }
    }
    let other_data = json!({"rpc_trace": {
        "rank": who.rank,
        "name": who.name,
        "incarnation": who.incarnation,
        "restart": who.restart,
        "ranks": who.ranks,
        "job": who.job,
        "group": who.group,
        // TR-7: when it was written, by the wall clock, for the merge to tell the newest
        // job by (a file's modification time is the copy's, for a part copied by hand).
        "written_unix_ms": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        "clock": {"reference_rank": 0, "offset_ns": clock.offset_ns, "at_ns": clock.at_ns,
                  "drift_ppm": clock.drift_ppm, "error_bound_ns": clock.error_bound_ns,
                  "samples": clock.samples},
        "events": events.len(),
        "dropped": dropped,
    }});
    serde_json::to_vec(&Written {
        trace_events: out,
        display_time_unit: "ms",
        other_data,
    })
}

/// Writes `value` to `path` whole or not at all (a temporary file renamed into place).
pub(crate) fn write_atomic(path: &Path, value: &Value) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    write_bytes_atomic(path, &bytes)
}

/// Writes `bytes` to `path` whole or not at all (a temporary file renamed into place).
pub(crate) fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Why parts could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A part, the parts' directory or the output could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A part is not a trace this framework wrote.
    #[error("{path} is not a trace part: {why}")]
    NotAPart {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// No part was found.
    #[error("no trace parts in {0} (was tracing on, and did the workers shut down?)")]
    NoParts(PathBuf),
}

/// What a merge put together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergeSummary {
    /// Parts merged (one per rank, incarnation and launcher's start).
    pub parts: usize,
    /// Events in the merged trace.
    pub events: usize,
    /// The largest clock error bound of any part aligned on rank 0's clock, in nanoseconds.
    pub clock_error_bound_ns: u64,
    /// The ranks of the parts whose worker never read rank 0's clock (rank 0 failed before
    /// the first probe, say): their times are on their own clocks, not aligned.
    pub unaligned: Vec<u32>,
    /// Events the workers' rings dropped.
    pub dropped: u64,
    /// The ranks of the group (as its parts list them) with no part (TR-6): killed outright
    /// (SIGKILL, a crash), or their parts are on another host. After group restarts, those
    /// without a part in some start.
    pub missing: Vec<u32>,
    /// When the trace holds several starts of a group (the launcher's group restarts): for
    /// each start that lacks a part, its restart count and the ranks without one.
    pub missing_by_start: Vec<(u64, Vec<u32>)>,
    /// The parts left out because another job wrote them (TR-7): an earlier run traced to
    /// the same path left them, and this run wrote no part of that name over them.
    pub stale: Vec<PathBuf>,
    /// The files that could not be read as parts (damaged, cut short, not a part), each with
    /// why: left out, and named, so that the rest still makes a trace (their ranks count as
    /// missing, TR-6).
    pub unreadable: Vec<(PathBuf, String)>,
}

impl std::fmt::Display for MergeSummary {
    /// `3 parts, 2121 events, clocks aligned within 191 us` (and the dropped events, if any).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} parts, {} events, clocks aligned within {} us",
            self.parts,
            self.events,
            self.clock_error_bound_ns.div_ceil(1000)
        )?;
        if !self.unaligned.is_empty() {
            write!(
                f,
                " (ranks {:?} on their own clocks: rank 0's was never read)",
                self.unaligned
            )?;
        }
        if self.dropped > 0 {
            write!(f, ", {} oldest events dropped (ring full)", self.dropped)?;
        }
        if !self.missing_by_start.is_empty() {
            let each: Vec<String> = (self.missing_by_start.iter())
                .map(|(start, ranks)| format!("{ranks:?} in start {start}"))
                .collect();
            write!(f, "; no part from ranks {}", each.join(", "))?;
        } else if !self.missing.is_empty() {
            write!(f, "; no part from ranks {:?}", self.missing)?;
        }
        if !self.missing.is_empty() {
            write!(f, " (killed outright, or their parts are on another host)")?;
        }
        if !self.unreadable.is_empty() {
            let each: Vec<String> = (self.unreadable.iter())
                .map(|(path, why)| {
                    let name = path.file_name().unwrap_or(path.as_os_str());
                    format!("{} ({why})", name.to_string_lossy())
                })
                .collect();
            write!(
                f,
                "; left out {} unreadable part(s): {}",
                self.unreadable.len(),
                each.join("; ")
            )?;
        }
        if !self.stale.is_empty() {
            let names: Vec<_> = self.stale.iter().filter_map(|p| p.file_name()).collect();
            write!(
                f,
                "; left out {} part(s) an earlier job left at this path: {names:?}",
                self.stale.len()
            )?;
        }
        Ok(())
    }
}

/// A part read: its metadata (`otherData.rpc_trace`) and its events.
struct Part {
    meta: Value,
    events: Vec<Value>,
}

/// A part read, with its file and the file's modification time.
type Dated = (PathBuf, SystemTime, Part);

/// A file that could not be read as a part, and why.
type Unreadable = (PathBuf, String);

/// The parts of `files` that could be read, with their modification times, and those that
/// could not, with why; an error only when none could (the first one's).
fn read_parts(files: &[PathBuf]) -> Result<(Vec<Dated>, Vec<Unreadable>), MergeError> {
    let (mut read, mut unreadable, mut first) = (Vec::new(), Vec::new(), None);
    for f in files {
        match read_part(f) {
            Ok((written, part)) => read.push((f.clone(), written, part)),
            Err(e) => {
                let why = match &e {
                    MergeError::NotAPart { why, .. } => why.clone(),
                    MergeError::Io { source, .. } => source.to_string(),
                    other => other.to_string(),
                };
                unreadable.push((f.clone(), why));
                first.get_or_insert(e);
            }
        }
    }
    match first {
        Some(e) if read.is_empty() => Err(e),
        _ => Ok((read, unreadable)),
    }
}

/// Reads `f` as a part, with when it was written: the time it records (TR-7), else (a part
/// from before parts recorded one) the file's modification time.
fn read_part(f: &Path) -> Result<(SystemTime, Part), MergeError> {
    let bad = |why: String| MergeError::NotAPart {
        path: f.to_owned(),
        why,
    };
    let io = |source| MergeError::Io {
        path: f.to_owned(),
        source,
    };
    let text = std::fs::read(f).map_err(io)?;
    let modified = std::fs::metadata(f)
        .and_then(|m| m.modified())
        .map_err(io)?;
    let mut v: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let meta = v
        .pointer("/otherData/rpc_trace")
        .cloned()
        .ok_or_else(|| bad("no otherData.rpc_trace".into()))?;
    let written = (meta.get("written_unix_ms").and_then(Value::as_u64)).map_or(modified, |ms| {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    });
    let Some(Value::Array(events)) = v.get_mut("traceEvents").map(Value::take) else {
        return Err(bad("no traceEvents array".into()));
    };
    Ok((written, Part { meta, events }))
}

/// TR-7: the parts of the job that wrote the newest part, and the paths of the others (left
/// by an earlier run traced to the same path: a rank or a restart this run did not have).
/// Parts written before parts named their job count as one job of their own.
fn this_job(parts: Vec<Dated>) -> (Vec<Part>, Vec<PathBuf>) {
    let job = |p: &Part| {
        p.meta
            .get("job")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let newest = parts
        .iter()
        .max_by_key(|(_, written, _)| *written)
        .map(|(_, _, p)| job(p));
    let (mut mine, mut stale) = (Vec::new(), Vec::new());
    for (path, _, part) in parts {
        if Some(job(&part)) == newest {
            mine.push(part);
        } else {
            stale.push(path);
        }
    }
    (mine, stale)
}

/// The parts in `<trace>.parts/`, by name.
fn listed_parts(trace: &Path) -> Result<Vec<PathBuf>, MergeError> {
    let dir = parts_dir(trace);
    let io = |source| MergeError::Io {
        path: dir.clone(),
        source,
    };
    let mut v = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.extension().is_some_and(|x| x == "json") {
            v.push(p);
        }
    }
    v.sort();
    Ok(v)
}

/// TR-6: per group the job formed (one per start of the launcher's group restarts; processes
/// replaced one by one join the same), its first restart count, the ranks its parts list and
/// the ranks with a part.
#[derive(Default)]
struct Coverage(BTreeMap<String, (u64, BTreeSet<u64>, BTreeSet<u64>)>);

impl Coverage {
    fn add(&mut self, meta: &Value) {
        let group = meta.get("group").and_then(Value::as_str).unwrap_or("");
        let restart = meta.get("restart").and_then(Value::as_u64).unwrap_or(0);
        let (start, listed, present) = (self.0.entry(group.to_owned()))
            .or_insert_with(|| (restart, BTreeSet::new(), BTreeSet::new()));
        *start = (*start).min(restart);
        if let Some(Value::Array(ranks)) = meta.get("ranks") {
            listed.extend(ranks.iter().filter_map(Value::as_u64));
        }
        present.extend(meta.get("rank").and_then(Value::as_u64));
    }

    /// The ranks without a part in some group; and, when there were several groups (starts),
    /// each start that lacks parts with the ranks it lacks.
    fn missing(self) -> (Vec<u32>, Vec<(u64, Vec<u32>)>) {
        let several = self.0.len() > 1;
        let rank = |r: &u64| u32::try_from(*r).unwrap_or(u32::MAX);
        let mut gaps: Vec<(u64, Vec<u32>)> = (self.0.into_values())
            .map(|(start, listed, present)| {
                (start, listed.difference(&present).map(rank).collect())
            })
            .filter(|(_, ranks): &(u64, Vec<u32>)| !ranks.is_empty())
            .collect();
        gaps.sort_unstable();
        let mut missing: Vec<u32> = gaps.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        missing.sort_unstable();
        missing.dedup();
        (missing, if several { gaps } else { Vec::new() })
    }
}

/// Merges the parts in `<trace>.parts/` (or the files in `parts` if given) into one trace at
/// `trace`, written whole or not at all. The merged file's `otherData.rpc_trace.parts` lists
/// each part's metadata, `clock_error_bound_ns` is the largest bound of any part on rank 0's
/// clock, `unaligned_ranks` the ranks whose parts are not (their clocks never read it), and
/// `missing_ranks` the ranks of the group with no part (TR-6; `missing_by_start`, after group
/// restarts, which start lacks which). Only the parts of the job that wrote the newest part
/// are merged; `stale_parts` lists the others (TR-7). A file that cannot be read as a part is
/// left out and named (`unreadable_parts`); the merge fails only when no part can be read.
pub fn merge_parts(trace: &Path, parts: Option<&[PathBuf]>) -> Result<MergeSummary, MergeError> {
    let files = match parts {
        Some(p) => p.to_vec(),
        None => listed_parts(trace)?,
    };
    if files.is_empty() {
        return Err(MergeError::NoParts(parts_dir(trace)));
    }
    let (read, unreadable) = read_parts(&files)?;
    let (files, stale) = this_job(read);
    let mut events = Vec::new();
    let mut metas = Vec::new();
    let (mut bound, mut dropped, mut unaligned) = (0u64, 0u64, Vec::new());
    let mut coverage = Coverage::default();
    let count = files.len();
    for Part { meta, events: evs } in files {
        match meta
            .pointer("/clock/error_bound_ns")
            .and_then(Value::as_u64)
        {
            Some(u64::MAX) => unaligned.push(meta.get("rank").and_then(Value::as_u64).unwrap_or(0)),
            b => bound = bound.max(b.unwrap_or(0)),
        }
        dropped += meta.get("dropped").and_then(Value::as_u64).unwrap_or(0);
        coverage.add(&meta);
        events.extend(evs);
        metas.push(meta);
    }
    unaligned.sort_unstable();
    unaligned.dedup();
    let unaligned: Vec<u32> = unaligned.into_iter().map(|r| r as u32).collect();
    let (missing, missing_by_start) = coverage.missing();
    let summary = MergeSummary {
        parts: count,
        events: events.len(),
        clock_error_bound_ns: bound,
        unaligned: unaligned.clone(),
        dropped,
        missing: missing.clone(),
        missing_by_start: missing_by_start.clone(),
        stale: stale.clone(),
        unreadable: unreadable.clone(),
    };
    let merged = json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"rpc_trace": {
            "parts": metas,
            "clock_error_bound_ns": bound,
            "unaligned_ranks": unaligned,
            "dropped": dropped,
            "missing_ranks": missing,
            "missing_by_start": missing_by_start.iter()
                .map(|(start, ranks)| json!({"restart": start, "ranks": ranks}))
                .collect::<Vec<_>>(),
            "stale_parts": stale,
            "unreadable_parts": unreadable.iter()
                .map(|(path, why)| json!({"path": path, "why": why}))
                .collect::<Vec<_>>(),
        }},
    });
    write_atomic(trace, &merged).map_err(|source| MergeError::Io {
        path: trace.to_owned(),
        source,
    })?;
    Ok(summary)
}
