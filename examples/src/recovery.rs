//! What a failure cost, for the training examples: the master records the last step it
//! completed and when (`progress` in its output directory, overwritten in place after every
//! step), and a restarted master (or one that recovered in its own process), once it has
//! replayed up to that step, appends how long the way back took to `recoveries.json`:
//! detection, restart, restore and replay together.
//!
//! A failure during the replay of an earlier one keeps the earlier record (the progress file
//! is not overwritten until the replay has passed it), so both count as one recovery whose
//! time covers both.
//!
//! [`Holders`] is the other half of a recovery in place (`--restart worker`): which workers
//! holding a model's parts failed, and when their replacements have joined.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context, Result};
use rpc_core::Agent;
use serde::{Deserialize, Serialize};

use crate::checkpoint::replace_durably;

const PROGRESS: &str = "progress";
const RECOVERIES: &str = "recoveries.json";
/// The progress record's fixed width (a shorter one is padded with spaces).
const RECORD: usize = 48;

/// One recovery, as `recoveries.json` and the final JSON line report it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Recovery {
    /// The launcher's restart count of the run that caught up.
    pub restart: u32,
    /// The last step the failed run completed.
    pub failed_after_step: u64,
    /// The checkpoint's step the restarted run began from.
    pub resumed_from_step: u64,
    /// Seconds from the failed run's last completed step to the restarted run's completing
    /// that step again.
    pub time_lost_s: f64,
    /// Of those, the seconds until the restarted run had restored its checkpoint (detection,
    /// restart, group formation, restore); the rest is the replay.
    pub restart_s: f64,
    /// The master kept its process (a worker was replaced, `--restart worker`).
    #[serde(default)]
    pub in_place: bool,
}

/// The master's record of its progress in `dir`.
pub struct Tracker {
    dir: PathBuf,
    file: std::fs::File,
    restart: u32,
    resumed_from: u64,
    /// The failed run's last step and its time (ms since the epoch), until caught up.
    pending: Option<(u64, u64)>,
    /// When the first step was ready to run (ms since the epoch).
    ready_at: Option<u64>,
    /// The last step this tracker completed, and when.
    last: Option<(u64, u64)>,
    /// The pending recovery is one in this process.
    in_place: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Tracker {
    /// A tracker for a run starting fresh (`resumed_from` is `None`: earlier records are
    /// removed) or resuming from a checkpoint at step `resumed_from`. Only a launcher's restart
    /// (`restart` > 0) is a recovery whose time is measured: a run started again by hand goes
    /// on from its checkpoint, but the time since the earlier run stopped is not the
    /// framework's to report (nor is there any when the earlier run had finished).
    pub fn open(dir: &Path, restart: u32, resumed_from: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(PROGRESS);
        let pending = match resumed_from {
            Some(_) if restart == 0 => None,
            Some(_) => read_progress(&path),
            None => {
                for f in [PROGRESS, RECOVERIES] {
                    match std::fs::remove_file(dir.join(f)) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(e).with_context(|| format!("cannot remove {f}"))
                        }
                        _ => {}
                    }
                }
                None
            }
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self {
            dir: dir.to_owned(),
            file,
            restart,
            resumed_from: resumed_from.unwrap_or(0),
            pending,
            ready_at: None,
            last: None,
            in_place: false,
        })
    }

    /// This process lost part of the run and goes on from a checkpoint at step
    /// `resumed_from`: the recovery is recorded once the replay passes the last step
    /// completed (a failure during the replay of an earlier one joins that one).
    pub fn interrupted(&mut self, resumed_from: u64) {
        if self.pending.is_none() {
            self.pending = self.last;
            self.in_place = true;
        }
        self.resumed_from = resumed_from;
        self.ready_at = None;
    }

    /// Notes that `step` steps are complete (called first once the run is ready to train, after
    /// a restore with the checkpoint's step).
    pub fn completed(&mut self, step: u64) -> Result<()> {
        let ready_at = *self.ready_at.get_or_insert_with(now_ms);
        if let Some((last, at)) = self.pending {
            if step < last {
                return Ok(());
            }
            self.pending = None;
            let mut all = self.recoveries()?;
            all.push(Recovery {
                restart: self.restart,
                failed_after_step: last,
                resumed_from_step: self.resumed_from,
                time_lost_s: now_ms().saturating_sub(at) as f64 / 1e3,
                restart_s: ready_at.saturating_sub(at) as f64 / 1e3,
                in_place: std::mem::take(&mut self.in_place),
            });
            let path = self.dir.join(RECOVERIES);
            replace_durably(&path, |tmp| {
                let mut f = std::fs::File::create(tmp)?;
                f.write_all(&serde_json::to_vec_pretty(&all)?)?;
                Ok(())
            })?;
        }
        let now = now_ms();
        self.last = Some((step, now));
        let mut rec = format!("{step} {now}").into_bytes();
        rec.resize(RECORD - 1, b' ');
        rec.push(b'\n');
        // Overwritten in place: no fsync (a process crash keeps the page cache; this only
        // measures time).
        self.file
            .write_all_at(&rec, 0)
            .context("cannot write the progress record")
    }

    /// Every recovery of this run so far.
    pub fn recoveries(&self) -> Result<Vec<Recovery>> {
        let path = self.dir.join(RECOVERIES);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .with_context(|| format!("{} is not a list of recoveries", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }
}

/// What the final JSON line of a training example says of `r`, this run's recoveries:
/// `recoveries`, `recovered_in_place`, and per recovery `time_lost_s`, `restart_s` and
/// `replayed_steps`.
pub fn report(r: &[Recovery]) -> serde_json::Map<String, serde_json::Value> {
    let v = serde_json::json!({
        "recoveries": r.len(),
        "recovered_in_place": r.iter().filter(|r| r.in_place).count(),
        "time_lost_s": r.iter().map(|r| crate::round(r.time_lost_s, 2)).collect::<Vec<_>>(),
        "restart_s": r.iter().map(|r| crate::round(r.restart_s, 2)).collect::<Vec<_>>(),
        "replayed_steps": r
            .iter()
            .map(|r| r.failed_after_step - r.resumed_from_step)
            .collect::<Vec<_>>(),
    });
    match v {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("an object"),
    }
}

/// How long a master waits, after an error in training, for the verdict that a worker failed
/// (a killed one is found at once, a frozen one within the failure timeout); with none, the
/// error is not a worker's failure and ends the run.
pub const VERDICT_WAIT: Duration = Duration::from_secs(10);

/// The workers that hold a model's parts, with the incarnation of each when the parts were
/// made (a replacement is a later incarnation of the same rank, and holds nothing).
pub struct Holders {
    agent: Agent,
    held: Vec<(u32, u64)>,
}

impl Holders {
    /// The current incarnations of `ranks`.
    pub fn take(agent: &Agent, ranks: impl IntoIterator<Item = u32>) -> Self {
        Self {
            agent: agent.clone(),
            held: ranks
                .into_iter()
                .map(|r| (r, agent.incarnation_of(r).unwrap_or(0)))
                .collect(),
        }
    }

    /// The holders whose incarnation has failed or been replaced since.
    pub fn lost(&self) -> Vec<u32> {
        self.held
            .iter()
            .filter(|&&(r, inc)| {
                self.agent.incarnation_of(r).ok() != Some(inc)
                    || !self.agent.is_live(r).unwrap_or(false)
            })
            .map(|&(r, _)| r)
            .collect()
    }

    /// After `err` ended training: the holders that failed, once a replacement of each has
    /// joined the group. Fails with `err` if no holder was declared failed within
    /// [`VERDICT_WAIT`] (the error was not a worker's failure), and names the worker if its
    /// replacement does not join within `timeout`. `who` prefixes the line telling the user.
    pub async fn await_replacements(
        &self,
        err: &anyhow::Error,
        timeout: Duration,
        who: &str,
    ) -> Result<Vec<u32>> {
        let said = crate::said(err);
        let deadline = Instant::now() + VERDICT_WAIT;
        let lost = loop {
            let lost = self.lost();
            if !lost.is_empty() {
                break lost;
            }
            if Instant::now() >= deadline {
                anyhow::bail!("{said}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        eprintln!(
            "{who}: lost {} ({said}); waiting for the launcher's replacement",
            lost.iter()
                .map(|r| self.agent.name_of(*r))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let deadline = Instant::now() + timeout;
        for &(r, held) in &self.held {
            if !lost.contains(&r) {
                continue;
            }
            while self.agent.incarnation_of(r)? == held || !self.agent.is_live(r)? {
                ensure!(
                    Instant::now() < deadline,
                    "{} failed and no replacement joined within {} s: {said}",
                    self.agent.name_of(r),
                    timeout.as_secs()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The others hear of the replacement in their own time: they all know it before
            // they are asked to work with it (VIEW-1).
            let me = self.agent.rank();
            let others: Vec<u32> = (0..self.agent.world_size() as u32)
                .filter(|&w| w != me && w != r && self.agent.is_live(w).unwrap_or(false))
                .collect();
            let new = self.agent.incarnation_of(r)?;
            let left = deadline.saturating_duration_since(Instant::now());
            let late = self.agent.await_known(others, r, new, left).await?;
            ensure!(
                late.is_empty(),
                "workers {late:?} did not hear of {}'s replacement within {} s: {said}",
                self.agent.name_of(r),
                timeout.as_secs()
            );
        }
        Ok(lost)
    }
}

/// The step and time of a progress record, if there is a readable one.
fn read_progress(path: &Path) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(path).ok()?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("examples-rec-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_recovery_is_recorded_once_the_replay_passes_the_failed_step() {
        let d = scratch("rec");
        let mut t = Tracker::open(&d, 0, None).unwrap();
        for s in 1..=7 {
            t.completed(s).unwrap();
        }
        drop(t); // the failure
        let mut t = Tracker::open(&d, 1, Some(5)).unwrap();
        t.completed(5).unwrap();
        t.completed(6).unwrap();
        assert!(t.recoveries().unwrap().is_empty(), "not caught up yet");
        drop(t); // a second failure during the replay: the first record stays
        let mut t = Tracker::open(&d, 2, Some(5)).unwrap();
        for s in 5..=8 {
            t.completed(s).unwrap();
        }
        let r = t.recoveries().unwrap();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(
            (r[0].restart, r[0].failed_after_step, r[0].resumed_from_step),
            (2, 7, 5)
        );
        assert!(r[0].time_lost_s >= 0.0 && r[0].time_lost_s < 60.0);
        assert!(r[0].restart_s <= r[0].time_lost_s);
        drop(t);
        // The next failure is measured from step 8.
        let mut t = Tracker::open(&d, 3, Some(8)).unwrap();
        t.completed(8).unwrap();
        assert_eq!(t.recoveries().unwrap().len(), 2);
        assert_eq!(t.recoveries().unwrap()[1].failed_after_step, 8);
        // A recovery in this process: recorded once the replay passes step 12.
        for s in 9..=12 {
            t.completed(s).unwrap();
        }
        t.interrupted(10);
        t.completed(10).unwrap();
        t.completed(11).unwrap();
        t.interrupted(10); // again during the replay: one recovery
        for s in 10..=12 {
            t.completed(s).unwrap();
        }
        let r = t.recoveries().unwrap();
        assert_eq!(r.len(), 3, "{r:?}");
        assert_eq!(
            (
                r[2].failed_after_step,
                r[2].resumed_from_step,
                r[2].in_place
            ),
            (12, 10, true)
        );
        assert!(!r[1].in_place);
        drop(t);
        // A fresh run forgets them.
        let t = Tracker::open(&d, 0, None).unwrap();
        assert!(t.recoveries().unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A run started again by hand (restart count 0) goes on from its checkpoint without
    /// counting a recovery: it used to report one whose `time_lost_s` was the whole time
    /// since the earlier run stopped (728 s for a finished run run again 12 minutes later).
    #[test]
    fn a_run_started_again_by_hand_is_no_recovery() {
        let d = scratch("byhand");
        let mut t = Tracker::open(&d, 0, None).unwrap();
        for s in 1..=7 {
            t.completed(s).unwrap();
        }
        drop(t);
        let mut t = Tracker::open(&d, 0, Some(5)).unwrap();
        for s in 5..=9 {
            t.completed(s).unwrap();
        }
        assert!(t.recoveries().unwrap().is_empty());
        drop(t);
        // A launcher's restart of that run is one, measured from its last step.
        let mut t = Tracker::open(&d, 1, Some(8)).unwrap();
        t.completed(8).unwrap();
        t.completed(9).unwrap();
        let r = t.recoveries().unwrap();
        assert_eq!((r.len(), r[0].failed_after_step), (1, 9), "{r:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
