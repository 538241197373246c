//! The merge of a job's parts into one trace (TR-6, TR-7), streamed: one part's file in
//! memory at a time, its events copied as they were written, never parsed into values (a
//! full ring's part is 63 MB of JSON; as `serde_json::Value`s four took 6 GB).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::chrome::{parts_dir, write_atomic_with};

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

/// A part as its file holds it: its events, each as written, and its metadata.
#[derive(Deserialize)]
struct View<'a> {
    #[serde(rename = "traceEvents", borrow)]
    events: Vec<&'a RawValue>,
    #[serde(rename = "otherData")]
    other: Other,
}

/// A part's `otherData`: the framework's metadata (other keys are ignored).
#[derive(Deserialize)]
struct Other {
    rpc_trace: Value,
}

/// Parses `bytes`, the contents of `path`, as a part.
fn view<'a>(path: &Path, bytes: &'a [u8]) -> Result<View<'a>, MergeError> {
    serde_json::from_slice(bytes).map_err(|e| MergeError::NotAPart {
        path: path.to_owned(),
        why: e.to_string(),
    })
}

/// Reads `path` whole.
fn read(path: &Path) -> Result<Vec<u8>, MergeError> {
    std::fs::read(path).map_err(|source| MergeError::Io {
        path: path.to_owned(),
        source,
    })
}

/// A part read: its file, when it was written, its metadata and how many events it holds
/// (the events stay in the file until the merge copies them out).
struct Part {
    path: PathBuf,
    written: SystemTime,
    meta: Value,
    events: usize,
}

impl Part {
    /// Reads `path` as a part, with when it was written: the time it records (TR-7), else
    /// (a part from before parts recorded one) the file's modification time.
    fn read(path: &Path) -> Result<Part, MergeError> {
        let bytes = read(path)?;
        let modified = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map_err(|source| MergeError::Io {
                path: path.to_owned(),
                source,
            })?;
        let View { events, other } = view(path, &bytes)?;
        let meta = other.rpc_trace;
        let written = (meta.get("written_unix_ms").and_then(Value::as_u64))
            .map_or(modified, |ms| {
                SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
            });
        Ok(Part {
            path: path.to_owned(),
            written,
            meta,
            events: events.len(),
        })
    }

    /// The job that wrote it ("" for a part from before parts named their job).
    fn job(&self) -> &str {
        self.meta.get("job").and_then(Value::as_str).unwrap_or("")
    }

    /// Writes its events to `out`, each preceded by a comma unless `*first`.
    fn copy_events(&self, out: &mut dyn Write, first: &mut bool) -> std::io::Result<()> {
        let bytes = std::fs::read(&self.path)?;
        let View { events, .. } = view(&self.path, &bytes).map_err(std::io::Error::other)?;
        if events.len() != self.events {
            return Err(std::io::Error::other(format!(
                "{} changed while it was merged ({} events, then {})",
                self.path.display(),
                self.events,
                events.len()
            )));
        }
        for e in events {
            if !std::mem::take(first) {
                out.write_all(b",")?;
            }
            out.write_all(e.get().as_bytes())?;
        }
        Ok(())
    }
}

/// A file that could not be read as a part, and why.
type Unreadable = (PathBuf, String);

/// The parts of `files` that could be read and those that could not, with why; an error
/// only when none could (the first one's).
fn read_parts(files: &[PathBuf]) -> Result<(Vec<Part>, Vec<Unreadable>), MergeError> {
    let (mut read, mut unreadable, mut first) = (Vec::new(), Vec::new(), None);
    for f in files {
        match Part::read(f) {
            Ok(part) => read.push(part),
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

/// TR-7: the parts of the job that wrote the newest part, and the paths of the others (left
/// by an earlier run traced to the same path: a rank or a restart this run did not have).
/// Parts written before parts named their job count as one job of their own.
fn this_job(parts: Vec<Part>) -> (Vec<Part>, Vec<PathBuf>) {
    let newest = (parts.iter().max_by_key(|p| p.written)).map(|p| p.job().to_owned());
    let (mine, stale): (Vec<Part>, Vec<Part>) =
        (parts.into_iter()).partition(|p| Some(p.job()) == newest.as_deref());
    (mine, stale.into_iter().map(|p| p.path).collect())
}

/// TR-9: the parts in `<trace>.parts/` of the job that wrote the newest one (those an earlier
/// run left are not this run's to send), and the sink the newest of them names, if any.
pub(super) fn this_jobs_parts(trace: &Path) -> Result<(Vec<PathBuf>, Option<String>), MergeError> {
    let files = listed_parts(trace)?;
    let (read, _) = read_parts(&files)?;
    let (mut mine, _) = this_job(read);
    mine.sort_by_key(|p| std::cmp::Reverse(p.written));
    let sink = (mine.iter())
        .find_map(|p| p.meta.get("sink").and_then(Value::as_str))
        .map(str::to_owned);
    Ok((mine.into_iter().map(|p| p.path).collect(), sink))
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
/// One part's file is in memory at a time, with the metadata of every part.
pub fn merge_parts(trace: &Path, parts: Option<&[PathBuf]>) -> Result<MergeSummary, MergeError> {
    let files = match parts {
        Some(p) => p.to_vec(),
        None => listed_parts(trace)?,
    };
    if files.is_empty() {
        return Err(MergeError::NoParts(parts_dir(trace)));
    }
    let (read, unreadable) = read_parts(&files)?;
    let (parts, stale) = this_job(read);
    let (mut bound, mut dropped, mut unaligned) = (0u64, 0u64, Vec::new());
    let mut coverage = Coverage::default();
    for Part { meta, .. } in &parts {
        match meta
            .pointer("/clock/error_bound_ns")
            .and_then(Value::as_u64)
        {
            Some(u64::MAX) => unaligned.push(meta.get("rank").and_then(Value::as_u64).unwrap_or(0)),
            b => bound = bound.max(b.unwrap_or(0)),
        }
        dropped += meta.get("dropped").and_then(Value::as_u64).unwrap_or(0);
        coverage.add(meta);
    }
    unaligned.sort_unstable();
    unaligned.dedup();
    let unaligned: Vec<u32> = unaligned.into_iter().map(|r| r as u32).collect();
    let (missing, missing_by_start) = coverage.missing();
    let summary = MergeSummary {
        parts: parts.len(),
        events: parts.iter().map(|p| p.events).sum(),
        clock_error_bound_ns: bound,
        unaligned: unaligned.clone(),
        dropped,
        missing: missing.clone(),
        missing_by_start: missing_by_start.clone(),
        stale: stale.clone(),
        unreadable: unreadable.clone(),
    };
    let other = json!({"rpc_trace": {
        "parts": parts.iter().map(|p| &p.meta).collect::<Vec<_>>(),
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
    }});
    write_atomic_with(trace, |out| {
        out.write_all(b"{\"traceEvents\":[")?;
        let mut first = true;
        for p in &parts {
            p.copy_events(out, &mut first)?;
        }
        out.write_all(b"],\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        serde_json::to_writer(&mut *out, &other)?;
        out.write_all(b"}")
    })
    .map_err(|source| MergeError::Io {
        path: trace.to_owned(),
        source,
    })?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::super::{part_path, Cat, Tracer, Who};
    use super::*;

    /// The merged file is one valid trace holding every event of every part as it was
    /// written, in part order, parts without events included (no stray comma), with each
    /// part's metadata.
    #[test]
    fn the_merge_copies_every_event_verbatim() {
        let dir = std::env::temp_dir().join(format!("trace-merge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let trace = dir.join("job.json");
        for (rank, spans) in [(0u32, 3usize), (1, 0), (2, 2)] {
            let t = Tracer::on(trace.clone(), 16);
            t.set_who(Who {
                rank,
                name: format!("w{rank}"),
                ranks: vec![0, 1, 2],
                ..Who::default()
            });
            for i in 0..spans {
                drop(t.span(Cat::Compute, format!("r{rank}s{i}")));
            }
            let (bytes, _) = t.ring().unwrap().part_json().unwrap();
            std::fs::create_dir_all(parts_dir(&trace)).unwrap();
            std::fs::write(part_path(&trace, rank, 0, 0), bytes).unwrap();
        }
        let want: Vec<Value> = (0..3)
            .flat_map(|r| {
                let bytes = std::fs::read(part_path(&trace, r, 0, 0)).unwrap();
                let v: Value = serde_json::from_slice(&bytes).unwrap();
                v["traceEvents"].as_array().unwrap().clone()
            })
            .collect();
        let s = merge_parts(&trace, None).unwrap();
        assert_eq!((s.parts, s.events), (3, want.len()), "{s:?}");
        let merged: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        assert_eq!(merged["traceEvents"].as_array().unwrap(), &want);
        assert_eq!(merged["displayTimeUnit"], "ms");
        let metas = merged["otherData"]["rpc_trace"]["parts"]
            .as_array()
            .unwrap();
        let ranks: Vec<_> = metas.iter().map(|m| m["rank"].as_u64().unwrap()).collect();
        assert_eq!(ranks, [0, 1, 2]);
        let names = (want.iter()).filter(|e| e["name"].as_str().unwrap_or("").starts_with('r'));
        assert!(names.count() >= 5, "{want:#?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
