//! The Trace Event Format (the JSON `chrome://tracing` and Perfetto open): one worker's part,
//! written straight from a worker's events (the merge is `merge.rs`).
//!
//! A part is itself a valid trace: its events on rank 0's clock (TR-4), one process per rank
//! (`pid` = rank), one track per category and lane (spans that overlap in time, such as calls
//! in flight together, get lanes of their own so that every track nests properly), flows from
//! each call made to the call served (`s` at the caller's span, `f` at the callee's: TR-3).
//! `otherData.rpc_trace` says who wrote it, the clock's offset and error bound, and how many
//! events the ring dropped (TR-2).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

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
        // TR-9: where this node's launcher sends the part if node 0's has not got it.
        "sink": who.sink,
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

/// Writes `bytes` to `path` whole or not at all (a temporary file renamed into place).
pub(crate) fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Writes what `fill` writes to `path` whole or not at all: into a temporary file beside it
/// (removed if `fill` or a write fails), renamed into place once complete.
pub(crate) fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut w)?;
        w.flush()
    });
    match written {
        Ok(()) => std::fs::rename(&tmp, path),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}
