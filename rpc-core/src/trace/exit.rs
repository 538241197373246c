//! A part for every way a traced worker ends (TR-5). A worker writes its part as it shuts
//! down; a job that fails mostly ends otherwise: the failing program returns its error (or
//! calls `std::process::exit`, or panics) without shutting down, and its launcher stops the
//! others with SIGTERM; a user stops a slow job with Ctrl-C. Those are the runs whose trace is
//! wanted most, so a traced worker's part is also written
//! - as its process exits, if shutdown has not written it (an `atexit` handler: `main`
//!   returning, `std::process::exit`, a panic that ends `main`), or before, when the worker
//!   is dropped (its runtime with it, as `main` returns an error);
//! - on SIGTERM, SIGINT or SIGHUP, after which the signal's default action ends the process as
//!   it would have (the exit status is the signal's); a program that handled the signal
//!   before the worker started keeps its handling, which then decides. With
//!   [`Config::signal_grace`](crate::Config::signal_grace) the grace's own handler ends the
//!   process with `exit`, so the handler above writes the part. A signal the process ignores
//!   (a background job's SIGINT) stays ignored.
//!
//! A part is written once: whichever path comes first writes it, the others wait for it to
//! be whole and skip it, so a process never ends in the middle of writing its part. That
//! holds also when the path writing it is the ring's drop on another thread (one still
//! winding down as the process exits): the exit handler cannot reach a ring whose
//! last owner is dropping it, so it waits on the ring's written flag instead, up to
//! [`DROP_WRITE_WAIT`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use super::{chrome, part_path, ClockEstimate, Ring, Who};

/// A traced worker's ring, with its written flag (which outlives the ring).
type Entry = (Weak<Ring>, Arc<Mutex<bool>>);

/// The rings of this process's traced workers whose part may still need writing.
static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// How long the exit paths wait for a part that a ring's drop, on another thread, is writing
/// (a part is written in milliseconds; this bounds a writer stuck on a full disk, say).
const DROP_WRITE_WAIT: Duration = Duration::from_secs(5);

/// Makes sure `ring`'s part is written however the process ends (see the module docs);
/// `signals`: also on SIGTERM, SIGINT and SIGHUP (not with a signal grace, whose own handler
/// ends the process with `exit`).
pub(crate) fn write_at_exit(ring: &Arc<Ring>, signals: bool) {
    ring.armed.store(true, Ordering::Relaxed);
    {
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|(r, written)| r.strong_count() > 0 || !is_written(written));
        live.push((Arc::downgrade(ring), Arc::clone(&ring.written)));
    }
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn` that never unwinds (it catches panics).
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::warn!("trace: no exit handler; the part is written only at shutdown");
        }
    });
    if signals {
        static SIGNALS: Once = Once::new();
        SIGNALS.call_once(watch_signals);
    }
}

/// A worker gone without shutting down (its program's runtime dropped as `main` returned an
/// error, say) leaves its part as its ring goes, before the process exits.
impl Drop for Ring {
    fn drop(&mut self) {
        if self.armed.load(Ordering::Relaxed) {
            write_once(self, true);
        }
    }
}

extern "C" fn at_exit() {
    // Thread-locals may be gone by now: no `tracing` here, only stderr.
    let _ = std::panic::catch_unwind(|| write_live(false));
}

/// Writes the part of every live ring that has none yet, and waits for those that a ring's
/// drop is writing on another thread; `log`: through `tracing`.
fn write_live(log: bool) {
    let live: Vec<Entry> = LIVE.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for (ring, written) in live {
        match ring.upgrade() {
            Some(ring) => write_once(&ring, log),
            None => wait_written(&written, DROP_WRITE_WAIT),
        }
    }
}

/// Whether the part behind `written` is whole (false while it is being written).
fn is_written(written: &Mutex<bool>) -> bool {
    written.try_lock().map(|w| *w).unwrap_or(false)
}

/// Waits, up to `bound`, for the part of a ring gone from every owner: its drop writes it
/// (every ring in [`LIVE`] is armed), holding `written` while it does; until the drop takes
/// the lock, the flag is still false.
fn wait_written(written: &Mutex<bool>, bound: Duration) {
    let by = Instant::now() + bound;
    loop {
        if *written.lock().unwrap_or_else(|p| p.into_inner()) || Instant::now() >= by {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Watches SIGTERM, SIGINT and SIGHUP (those the process does not ignore) on a thread of its
/// own: the first writes the parts, then the signal's default action ends the process, unless
/// the program had a handler of its own for it (which then decides, as before).
fn watch_signals() {
    let mut wanted = Vec::new();
    let mut ends = Vec::new();
    for sig in [SIGTERM, SIGINT, SIGHUP] {
        match disposition(sig) {
            Some(libc::SIG_IGN) => {}
            d => {
                wanted.push(sig);
                if d == Some(libc::SIG_DFL) {
                    ends.push(sig);
                }
            }
        }
    }
    let mut signals = match signal_hook::iterator::Signals::new(&wanted) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(cause = %e, "trace: cannot watch signals; a signal loses the part");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("rpc-trace-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                write_live(true);
                if ends.contains(&sig) {
                    // Ends the process as the signal would have.
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(cause = %e, "trace: cannot watch signals; a signal loses the part");
    }
}

/// `sig`'s disposition now: `SIG_DFL`, `SIG_IGN` (inherited from a shell, say) or a handler.
fn disposition(sig: i32) -> Option<libc::sighandler_t> {
    // SAFETY: reads the disposition only (a null new action); `old` is plain data.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, std::ptr::null(), &mut old) == 0).then_some(old.sa_sigaction)
    }
}

impl Ring {
    /// This worker's part as it stands, as JSON: its clock estimate so far (TR-4), every
    /// event kept; with who recorded it, the estimate, how many events it has and how many
    /// were dropped.
    pub(crate) fn part_now(
        &self,
    ) -> (
        serde_json::Result<Vec<u8>>,
        Who,
        ClockEstimate,
        (usize, u64),
    ) {
        let clock = self
            .clock
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .estimate();
        let who = self.who.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (events, dropped) = self.snapshot();
        let part = chrome::part(&who, &clock, &events, dropped);
        (part, who, clock, (events.len(), dropped))
    }

    /// [`Ring::part_now`]'s JSON, and who recorded it.
    pub(crate) fn part_json(&self) -> serde_json::Result<(Vec<u8>, Who)> {
        let (part, who, _, _) = self.part_now();
        Ok((part?, who))
    }
}

/// Writes `ring`'s part unless it was written: its clock estimate kept since the worker joined
/// (TR-4), every event kept. Needs no network. A failure is reported, never fatal: a trace
/// must not fail the job. `log`: through `tracing` (else stderr, for the exit handler).
pub(crate) fn write_once(ring: &Ring, log: bool) {
    let mut written = ring.written.lock().unwrap_or_else(|p| p.into_inner());
    if *written {
        return;
    }
    *written = true;
    let (part, who, clock, (events, dropped)) = ring.part_now();
    if clock.samples == 0 && clock.error_bound_ns == u64::MAX && log {
        tracing::warn!(worker = %who.name,
            "trace: rank 0's clock was never read; this part keeps its own clock");
    }
    let path = part_path(&ring.path, who.rank, who.incarnation, who.restart);
    let written = part
        .map_err(std::io::Error::other)
        .and_then(|bytes| chrome::write_bytes_atomic(&path, &bytes));
    match (written, log) {
        (Ok(()), true) => tracing::info!(worker = %who.name, path = %path.display(),
            events, dropped, "trace part written"),
        (Err(e), true) => tracing::warn!(worker = %who.name, path = %path.display(),
            cause = %e, "trace part not written"),
        (Ok(()), false) => {}
        (Err(e), false) => eprintln!(
            "{}: trace part not written to {}: {e}",
            who.name,
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{merge_parts, Cat, Tracer, Who};
    use super::*;

    fn traced(dir: &std::path::Path, rank: u32, reference: bool) -> Tracer {
        let t = Tracer::on(dir.join("job.json"), 16);
        t.set_who(Who {
            rank,
            name: format!("w{rank}"),
            ..Who::default()
        });
        let ring = t.ring().unwrap();
        ring.clock.lock().unwrap().reference = reference;
        drop(t.span(Cat::Compute, "work"));
        t
    }

    /// TR-5: whichever path comes first writes the part; the others skip it.
    #[test]
    fn a_part_is_written_once() {
        let dir = std::env::temp_dir().join(format!("trace-once-{}", std::process::id()));
        let t = traced(&dir, 1, false);
        let ring = t.ring().unwrap();
        write_once(ring, false);
        let part = part_path(&ring.path, 1, 0, 0);
        assert!(part.exists());
        std::fs::remove_file(&part).unwrap();
        write_once(ring, true);
        assert!(!part.exists(), "written a second time");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// TR-5: the exit paths wait for a part that the ring's drop is writing on another thread
    /// (one still winding down as `main` returns): they cannot reach the ring
    /// any more. They skipped it, and the process ended before the part was whole (rank 0's
    /// part of a failing job was missing about once in ten runs of `trace.rs`).
    #[test]
    fn the_exit_path_waits_for_the_part_a_drop_is_writing() {
        let dir = std::env::temp_dir().join(format!("trace-drop-{}", std::process::id()));
        let t = traced(&dir, 4, false);
        let ring = Arc::clone(t.ring().unwrap());
        drop(t);
        write_at_exit(&ring, false);
        let part = part_path(&ring.path, 4, 0, 0);
        // The drop's write is slow: its lock is held for a while by another thread.
        let written = Arc::clone(&ring.written);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let _slow = written.lock().unwrap();
            held_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        held_rx.recv().unwrap();
        let gone = Arc::downgrade(&ring);
        let dropper = std::thread::spawn(move || drop(ring));
        for _ in 0..1000 {
            if gone.strong_count() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(gone.strong_count(), 0, "the ring is being dropped");
        write_live(false);
        assert!(
            part.exists(),
            "the exit path returned before the part was whole"
        );
        holder.join().unwrap();
        dropper.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// TR-6: the ranks a part lists without a part of their own are named; a group's vacant
    /// ranks (a group that grows: never joined) are not listed, so never named.
    #[test]
    fn the_ranks_without_a_part_are_named_and_vacant_ones_are_not() {
        let dir = std::env::temp_dir().join(format!("trace-missing-{}", std::process::id()));
        let part = |rank: u32, ranks: Vec<u32>| {
            let t = Tracer::on(dir.join("job.json"), 16);
            t.set_who(Who {
                rank,
                name: format!("w{rank}"),
                ranks,
                ..Who::default()
            });
            t.ring().unwrap().clock.lock().unwrap().reference = rank == 0;
            write_once(t.ring().unwrap(), false);
        };
        // Ranks 0 and 1 of a group of capacity 8 that has not grown: nothing is missing.
        part(0, vec![0, 1]);
        part(1, vec![0, 1]);
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!((s.parts, s.missing.clone()), (2, vec![]), "{s:?}");
        assert!(!s.to_string().contains("no part"), "{s}");
        // Rank 2 joined (rank 1's part, written later, lists it) and left no part.
        part(1, vec![0, 1, 2]);
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!(s.missing, vec![2], "{s:?}");
        assert!(s.to_string().contains("no part from ranks [2]"), "{s}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// TR-6 per group the job formed: a rank without a part in one start of a group restart
    /// is named for that start, though the next start has its part (it was not named at
    /// all); processes replaced one by one join the same group, so a replacement's part
    /// counts with the others'.
    #[test]
    fn a_rank_without_a_part_in_one_start_is_named_for_that_start() {
        let dir = std::env::temp_dir().join(format!("trace-starts-{}", std::process::id()));
        let part = |rank: u32, group: &str, incarnation: u64, restart: u64| {
            let t = Tracer::on(dir.join("job.json"), 16);
            t.set_who(Who {
                rank,
                name: format!("w{rank}"),
                incarnation,
                restart,
                ranks: vec![0, 1, 2],
                job: "job".into(),
                group: group.into(),
                sink: None,
            });
            t.ring().unwrap().clock.lock().unwrap().reference = rank == 0;
            write_once(t.ring().unwrap(), false);
        };
        // One by one: rank 1 replaced (incarnation 1) in the same group; nothing missing.
        for (rank, inc) in [(0, 0), (1, 0), (1, 1), (2, 0)] {
            part(rank, "first", inc, inc);
        }
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!((s.parts, s.missing.clone()), (4, vec![]), "{s:?}");
        assert!(s.missing_by_start.is_empty(), "{s:?}");
        // A group restart: rank 2 of the first start left no part, the second start's did.
        std::fs::remove_dir_all(dir.join("job.json.parts")).unwrap();
        part(0, "first", 0, 0);
        part(1, "first", 0, 0);
        for rank in 0..3 {
            part(rank, "second", 0, 1);
        }
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!((s.parts, s.missing.clone()), (5, vec![2]), "{s:?}");
        assert_eq!(s.missing_by_start, vec![(0, vec![2])], "{s:?}");
        let said = s.to_string();
        assert!(
            said.contains("no part from ranks [2] in start 0 (killed"),
            "{said}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// TR-7: a run traced to the path of an earlier run with more ranks does not merge the
    /// part of the rank it no longer has (it did, as this run's: 3 parts, rank 2 of a job
    /// that had ended); the part is left out and named.
    #[test]
    fn the_parts_of_an_earlier_job_at_the_same_path_are_left_out_and_named() {
        let dir = std::env::temp_dir().join(format!("trace-stale-{}", std::process::id()));
        let part = |rank: u32, ranks: Vec<u32>, job: &str| {
            let t = Tracer::on(dir.join("job.json"), 16);
            t.set_who(Who {
                rank,
                name: format!("w{rank}"),
                ranks,
                job: job.into(),
                ..Who::default()
            });
            t.ring().unwrap().clock.lock().unwrap().reference = rank == 0;
            write_once(t.ring().unwrap(), false);
            part_path(&dir.join("job.json"), rank, 0, 0)
        };
        let earlier = [0, 1, 2].map(|r| part(r, vec![0, 1, 2], "earlier"));
        // Written a minute ago (the time each part records), whatever the clock's resolution.
        for p in &earlier {
            let mut v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            let at = &mut v["otherData"]["rpc_trace"]["written_unix_ms"];
            *at = (at.as_u64().unwrap() - 60_000).into();
            std::fs::write(p, serde_json::to_vec(&v).unwrap()).unwrap();
        }
        let later = [0, 1].map(|r| part(r, vec![0, 1], "later"));
        // The earlier job's parts copied by hand now (their files the newest) are still the
        // earlier job's: the merge goes by the time each part records, not its file's.
        for p in &later {
            let f = std::fs::File::options().write(true).open(p).unwrap();
            f.set_modified(std::time::SystemTime::now() - Duration::from_secs(60))
                .unwrap();
        }
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!((s.parts, s.missing.clone()), (2, vec![]), "{s:?}");
        assert_eq!(s.stale, vec![earlier[2].clone()], "{s:?}");
        let said = s.to_string();
        assert!(
            said.ends_with(
                "left out 1 part(s) an earlier job left at this path: \
                                [\"rank-2-inc-0.json\"]"
            ),
            "{said}"
        );
        let merged: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("job.json")).unwrap()).unwrap();
        let listed = &merged["otherData"]["rpc_trace"]["stale_parts"];
        assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A part that cannot be read (cut short, say, or copied over by hand and damaged) is left
    /// out and named, its rank missing: the merge of the others still makes a trace (one
    /// damaged part failed the whole merge, and the job had no trace). With no part readable,
    /// the merge fails, naming the file.
    #[test]
    fn a_damaged_part_is_left_out_and_named_and_the_rest_merged() {
        let dir = std::env::temp_dir().join(format!("trace-damaged-{}", std::process::id()));
        let (t0, t1) = (traced(&dir, 0, true), traced(&dir, 1, false));
        for t in [&t0, &t1] {
            write_once(t.ring().unwrap(), false);
        }
        let p1 = part_path(&dir.join("job.json"), 1, 0, 0);
        let whole = std::fs::read(&p1).unwrap();
        std::fs::write(&p1, &whole[..whole.len() / 2]).unwrap();
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!(s.parts, 1, "{s:?}");
        assert_eq!(s.unreadable.len(), 1, "{s:?}");
        assert_eq!(s.unreadable[0].0, p1);
        let said = s.to_string();
        assert!(
            said.contains("left out 1 unreadable part(s): rank-1-inc-0.json (EOF"),
            "{said}"
        );
        std::fs::remove_file(part_path(&dir.join("job.json"), 0, 0, 0)).unwrap();
        let e = merge_parts(&dir.join("job.json"), None).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank-1-inc-0.json is not a trace part"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A part whose worker never read rank 0's clock is named, not folded into the bound
    /// (the summary said "clocks aligned within 18446744073709552 us").
    #[test]
    fn a_part_on_its_own_clock_is_named_in_the_merge() {
        let dir = std::env::temp_dir().join(format!("trace-unaligned-{}", std::process::id()));
        let (t0, t1) = (traced(&dir, 0, true), traced(&dir, 1, false));
        for t in [&t0, &t1] {
            write_once(t.ring().unwrap(), false);
        }
        let s = merge_parts(&dir.join("job.json"), None).unwrap();
        assert_eq!((s.parts, s.clock_error_bound_ns), (2, 0), "{s:?}");
        assert_eq!(s.unaligned, vec![1]);
        let want = "clocks aligned within 0 us (ranks [1] on their own clocks: rank 0's was \
                    never read)";
        assert!(s.to_string().ends_with(want), "{s}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
