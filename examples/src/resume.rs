//! Where a training run starts: the same command run again goes on from the newest verified
//! checkpoint in its output directory, whatever restarted it (the launcher, a Slurm requeue, a
//! pod restart, a user after a crash); starting over is explicit.
//!
//! - RES-1: a run resumes from the newest checkpoint in its directory that verifies
//!   ([`Tensors::load`]); a damaged or partial one is skipped with a warning naming it, moved
//!   aside as `<name>.damaged` (kept, never deleted), and the next older one is tried.
//! - RES-2: a verified checkpoint written with other flags is refused, naming each flag that
//!   differs and its two values; nothing in the directory changes.
//! - RES-3: `--fresh` (on a first start, not on the launcher's restarts of the same run)
//!   moves every checkpoint and record of the directory into a new `previous-<n>` directory
//!   inside it, and the run starts from the beginning. Nothing is ever deleted but by
//!   pruning, which keeps the newest `--keep-checkpoints` of the run itself.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use crate::checkpoint::{self, Flags, Tensors};
use crate::Fatal;

/// How the user asked the run to start.
#[derive(Clone, Copy, Debug, Default)]
pub struct StartFlags {
    /// `--resume`: there must be a checkpoint to go on from.
    pub resume: bool,
    /// `--fresh`: move the directory's checkpoints aside and start from the beginning.
    pub fresh: bool,
}

/// Where the run starts: the checkpoint it goes on from (verified, with the run's flags; the
/// caller says so, with what it restored), or `None` for the beginning (said here, in one
/// line). `restart` is the launcher's restart count (`--fresh` acts only on the first start).
pub fn start(dir: &Path, flags: &Flags, how: StartFlags, restart: u32) -> Result<Option<Tensors>> {
    ensure!(
        !(how.resume && how.fresh),
        Fatal("--resume and --fresh contradict each other".into())
    );
    if how.fresh && restart == 0 {
        match set_aside(dir)? {
            Some((n, to)) => println!(
                "starting over (--fresh): moved {n} files of the earlier run to {}",
                to.display()
            ),
            None => println!(
                "starting over (--fresh): {} held no earlier run",
                dir.display()
            ),
        }
        return Ok(None);
    }
    let found = newest_verified(dir)?;
    match &found {
        Some(t) => check_flags(t, flags)?,
        None if how.resume => bail!(Fatal(format!(
            "--resume: no checkpoint in {} to go on from",
            dir.display()
        ))),
        None if restart == 0 => println!(
            "no checkpoint in {}: starting from the beginning",
            dir.display()
        ),
        None => println!("resumed from the start, no checkpoint yet (restart {restart})"),
    }
    Ok(found)
}

/// The newest checkpoint in `dir` that verifies (RES-1), moving aside the damaged ones newer
/// than it.
pub fn newest_verified(dir: &Path) -> Result<Option<Tensors>> {
    for path in checkpoint::all(dir)?.into_iter().rev() {
        match Tensors::load(&path) {
            Ok(t) => return Ok(Some(t)),
            Err(e) => {
                let aside = damaged_name(&path);
                let cause = crate::said(&e);
                tracing::warn!(
                    checkpoint = %path.display(),
                    cause = %cause,
                    moved_to = %aside.display(),
                    "skipping a damaged checkpoint",
                );
                eprintln!(
                    "warning: skipping the damaged checkpoint {} ({cause}); kept as {}",
                    path.display(),
                    aside.display()
                );
                std::fs::rename(&path, &aside).with_context(|| {
                    format!("cannot move {} to {}", path.display(), aside.display())
                })?;
            }
        }
    }
    Ok(None)
}

fn damaged_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".damaged");
    path.with_file_name(name)
}

/// RES-2: an error naming every flag in which `flags` differs from the checkpoint's.
fn check_flags(t: &Tensors, flags: &Flags) -> Result<()> {
    let theirs = t.flags();
    let keys: std::collections::BTreeSet<&String> = theirs.keys().chain(flags.keys()).collect();
    let none = String::from("(not set)");
    let diffs: Vec<String> = keys
        .into_iter()
        .filter_map(|k| {
            let (a, b) = (
                theirs.get(k).unwrap_or(&none),
                flags.get(k).unwrap_or(&none),
            );
            (a != b).then(|| format!("{k} {a} (this run: {b})"))
        })
        .collect();
    ensure!(
        diffs.is_empty(),
        Fatal(format!(
            "{} was written by a run with other flags: {}; run with the checkpoint's flags \
             to go on from it, or add --fresh to start over (the earlier run's files are \
             moved aside, not deleted)",
            t.path().display(),
            diffs.join(", ")
        ))
    );
    Ok(())
}

/// The files of a run in its output directory: checkpoints (damaged ones too), their
/// temporaries, and the records of `recovery.rs`.
fn is_run_file(name: &str) -> bool {
    let ckpt = name.starts_with("ckpt-") || name.starts_with(".ckpt-");
    ckpt || matches!(name, "progress" | "recoveries.json")
}

/// RES-3: moves the run files of `dir` into a new `dir/previous-<n>`; how many, and where
/// (`None` when there were none).
pub fn set_aside(dir: &Path) -> Result<Option<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    let mut files = Vec::new();
    for e in entries {
        let e = e?;
        if e.file_name().to_str().is_some_and(is_run_file) {
            files.push(e.path());
        }
    }
    if files.is_empty() {
        return Ok(None);
    }
    let to = (1..)
        .map(|n| dir.join(format!("previous-{n}")))
        .find(|p| !p.exists())
        .expect("a free name");
    std::fs::create_dir(&to).with_context(|| format!("cannot create {}", to.display()))?;
    for f in &files {
        let dest = to.join(f.file_name().expect("a listed file"));
        std::fs::rename(f, &dest)
            .with_context(|| format!("cannot move {} to {}", f.display(), dest.display()))?;
    }
    Ok(Some((files.len(), to)))
}

/// Says so when a run resumed from its checkpoint has nothing left to train (`done` of
/// `epochs` epochs): the same command run again after a run finished only evaluates.
pub fn say_if_complete(dir: &Path, done: u64, epochs: u64) {
    if done >= epochs {
        println!(
            "the run in {} is complete ({done} of {epochs} epochs): nothing to train; \
             --fresh starts over, --epochs N trains on",
            dir.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("examples-resume-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn flags(hidden: &str) -> Flags {
        Flags::from([
            ("--hidden".to_string(), hidden.to_string()),
            ("--seed".to_string(), "0".to_string()),
        ])
    }

    fn save(d: &Path, step: u64, f: &Flags) -> PathBuf {
        let m = HashMap::from([("x".to_string(), checkpoint::count(step).unwrap())]);
        checkpoint::save(d, step, &m, f).unwrap()
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// RES-1: the newest verified checkpoint is chosen; a flipped byte and a truncated file
    /// newer than it are moved aside (kept), not loaded.
    #[test]
    fn the_newest_verified_checkpoint_is_chosen_and_damaged_ones_are_kept_aside() {
        let d = scratch("newest");
        let f = flags("8");
        save(&d, 10, &f);
        let p20 = save(&d, 20, &f);
        let p30 = save(&d, 30, &f);
        let mut b = std::fs::read(&p30).unwrap();
        let n = b.len();
        b[n - 3] ^= 1;
        std::fs::write(&p30, &b).unwrap();
        let b = std::fs::read(&p20).unwrap();
        std::fs::write(&p20, &b[..b.len() - 5]).unwrap();
        let t = start(&d, &f, StartFlags::default(), 0).unwrap().unwrap();
        assert_eq!(t.step(), 10);
        assert_eq!(t.count("x").unwrap(), 10);
        assert_eq!(
            names(&d),
            [
                "ckpt-000000010.safetensors",
                "ckpt-000000020.safetensors.damaged",
                "ckpt-000000030.safetensors.damaged"
            ]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// RES-2: other flags are refused, naming the flag and both values; nothing moves.
    #[test]
    fn a_checkpoint_of_other_flags_is_refused_naming_the_difference() {
        let d = scratch("flags");
        save(&d, 5, &flags("8"));
        let e = start(&d, &flags("16"), StartFlags::default(), 0).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("--hidden 8 (this run: 16)"), "{msg}");
        assert!(
            e.downcast_ref::<Fatal>().is_some(),
            "a restart would not help"
        );
        assert_eq!(names(&d), ["ckpt-000000005.safetensors"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// RES-3: --fresh moves the earlier run's files aside on a first start, and only then;
    /// --resume needs a checkpoint.
    #[test]
    fn fresh_moves_the_earlier_run_aside_and_resume_needs_a_checkpoint() {
        let d = scratch("fresh");
        let f = flags("8");
        let fresh = StartFlags {
            fresh: true,
            resume: false,
        };
        let resume = StartFlags {
            fresh: false,
            resume: true,
        };
        assert!(start(&d, &f, resume, 0).is_err(), "nothing to resume");
        save(&d, 5, &f);
        std::fs::write(d.join("progress"), "5").unwrap();
        std::fs::write(d.join("training.png"), "p").unwrap();
        // A restart of a --fresh run goes on from its own checkpoint.
        assert_eq!(start(&d, &f, fresh, 1).unwrap().unwrap().step(), 5);
        assert!(start(&d, &f, fresh, 0).unwrap().is_none());
        assert_eq!(names(&d), ["previous-1", "training.png"]);
        assert_eq!(
            names(&d.join("previous-1")),
            ["ckpt-000000005.safetensors", "progress"]
        );
        save(&d, 7, &f);
        assert!(start(&d, &f, fresh, 0).unwrap().is_none());
        assert_eq!(names(&d), ["previous-1", "previous-2", "training.png"]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
