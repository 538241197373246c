//! A new run traced to the path of an earlier one (TR-10): its parts are cleared, but not the
//! parts an earlier run left unmerged, the only record of that run.

use std::io;
use std::path::{Path, PathBuf};

use super::{merge_parts, parts_dir, MergeSummary};

/// What [`clear_parts`] kept of an earlier run before clearing.
#[derive(Debug)]
pub enum Kept {
    /// Its unmerged parts, merged into `trace` (the earlier run's trace; see [`earlier_path`]).
    Merged {
        /// Where the parts were, now cleared.
        from: PathBuf,
        /// The earlier run's trace.
        trace: PathBuf,
        /// How the merge went.
        summary: MergeSummary,
    },
    /// Its unmerged parts, which could not be merged at all, moved to `dir` (the parts
    /// directory of [`earlier_path`]).
    Moved {
        /// Where the parts were.
        from: PathBuf,
        /// Where they are.
        dir: PathBuf,
        /// Why they could not be merged.
        why: String,
    },
}

impl std::fmt::Display for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kept::Merged {
                from,
                trace,
                summary,
            } => write!(
                f,
                "an earlier run left its trace parts in {} unmerged; merged them into {} \
                 ({summary}) before clearing them",
                from.display(),
                trace.display()
            ),
            Kept::Moved { from, dir, why } => write!(
                f,
                "an earlier run left its trace parts in {} unmerged, and they could not be \
                 merged ({why}); moved them to {}",
                from.display(),
                dir.display()
            ),
        }
    }
}

/// Where [`clear_parts`] keeps an earlier run's trace: `job.prev.json` beside `job.json`
/// (`job.prev` beside `job`).
pub fn earlier_path(trace: &Path) -> PathBuf {
    let stem = trace.file_stem().unwrap_or_default().to_string_lossy();
    let name = match trace.extension() {
        Some(ext) => format!("{stem}.prev.{}", ext.to_string_lossy()),
        None => format!("{stem}.prev"),
    };
    trace.with_file_name(name)
}

/// Clears `trace`'s parts directory for a new run. With `keep_unmerged` (the process that
/// merges the job's trace), TR-10: the parts an earlier run left unmerged (whoever was to
/// merge them ended first: killed, its host lost; `trace` is missing or older than the
/// newest part) are first merged into [`earlier_path`] (replacing an earlier one), or, if
/// none can be read as a part, moved to its parts directory: the only record of that run is
/// not deleted without a word. Fails only where the directory can be neither kept nor
/// cleared.
pub fn clear_parts(trace: &Path, keep_unmerged: bool) -> io::Result<Option<Kept>> {
    let dir = parts_dir(trace);
    let kept = if keep_unmerged {
        keep(trace, &dir)?
    } else {
        None
    };
    if !matches!(kept, Some(Kept::Moved { .. })) {
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(kept)
}

/// TR-10's keeping, if there is anything to keep.
fn keep(trace: &Path, dir: &Path) -> io::Result<Option<Kept>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let (mut parts, mut newest) = (Vec::new(), None);
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "json") {
            newest = newest.max(Some(entry.metadata()?.modified()?));
            parts.push(path);
        }
    }
    let Some(newest) = newest else {
        return Ok(None);
    };
    // Written after its parts by the merge (a part that came later is not in it).
    let merged = std::fs::metadata(trace).and_then(|m| m.modified());
    if merged.is_ok_and(|at| at >= newest) {
        return Ok(None);
    }
    parts.sort();
    let earlier = earlier_path(trace);
    let from = dir.to_owned();
    Ok(Some(match merge_parts(&earlier, Some(&parts)) {
        Ok(summary) => Kept::Merged {
            from,
            trace: earlier,
            summary,
        },
        Err(e) => {
            let to = parts_dir(&earlier);
            match std::fs::remove_dir_all(&to) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            std::fs::rename(dir, &to)?;
            Kept::Moved {
                from,
                dir: to,
                why: e.to_string(),
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rerun-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// TR-10: parts that cannot be merged at all (damaged) are moved beside, not deleted; a
    /// trace written after its parts, or no parts at all, leave nothing to keep; without
    /// `keep_unmerged` (a node that does not merge) they are cleared.
    #[test]
    fn unmerged_parts_are_kept_and_merged_ones_cleared() {
        let d = dir("kept");
        let trace = d.join("job.json");
        let parts = parts_dir(&trace);
        assert!(clear_parts(&trace, true).unwrap().is_none(), "no directory");
        std::fs::create_dir_all(&parts).unwrap();
        std::fs::write(parts.join("rank-0-inc-0.json"), b"{\"traceEv").unwrap();
        let kept = clear_parts(&trace, true).unwrap();
        let Some(Kept::Moved { dir: to, .. }) = &kept else {
            panic!("{kept:?}")
        };
        assert_eq!(to, &parts_dir(&d.join("job.prev.json")));
        assert!(to.join("rank-0-inc-0.json").exists() && !parts.exists());
        assert!(kept.unwrap().to_string().contains("could not be merged"));

        std::fs::create_dir_all(&parts).unwrap();
        std::fs::write(parts.join("rank-0-inc-0.json"), b"{}").unwrap();
        std::fs::write(&trace, b"{}").unwrap();
        assert!(clear_parts(&trace, true).unwrap().is_none(), "merged");
        assert!(!parts.exists(), "cleared");

        std::fs::create_dir_all(&parts).unwrap();
        std::fs::write(parts.join("rank-0-inc-0.json"), b"{}").unwrap();
        std::fs::remove_file(&trace).unwrap();
        assert!(clear_parts(&trace, false).unwrap().is_none());
        assert!(!parts.exists(), "cleared where nothing is merged");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_earlier_trace_sits_beside_the_trace() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(earlier_path(&p("/t/job.json")), p("/t/job.prev.json"));
        assert_eq!(earlier_path(&p("/t/job")), p("/t/job.prev"));
        assert_eq!(earlier_path(&p("/t/a.b.json")), p("/t/a.b.prev.json"));
    }
}
