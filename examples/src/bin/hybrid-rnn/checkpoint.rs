//! Checkpoints: every parameter, every optimizer state and the training history in one
//! safetensors file per checkpoint (`ckpt-<step>.safetensors`, written every
//! `--checkpoint-every` steps and at the end of every epoch; the newest `--keep-checkpoints`
//! are kept), readable by any safetensors loader.
//!
//! Names: `encoder.<param>`, `head.<param>` (the replicas are identical; one copy is kept),
//! `optimizer.<rank>.{steps,params}` and `optimizer.<rank>.{m,v}.<i>` per parameter owner,
//! `train.{epoch,step}` (completed epochs and steps), `train.progress` (the running sums of
//! the epoch in progress), `history.*`, and `config` (the flags that shape the run, checked
//! on resume). The data order and the dropout masks are functions of the seed (in `config`),
//! the epoch and the step (`data::epoch_batches`, `data::dropout_mask`): they hold no state
//! of their own, so these numbers restore them exactly.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use autograd_dist::{OptimizerState, RTensor};
use candle_core::{DType, Device, Tensor};

use crate::report::History;

/// Everything a resumed run needs.
pub struct Checkpoint {
    /// Completed epochs.
    pub epoch: u64,
    /// Completed steps.
    pub step: u64,
    /// The flags that shape the run (see `Args::shape`).
    pub config: Vec<f64>,
    /// Encoder parameters by name.
    pub encoder: Vec<(String, Tensor)>,
    /// Head parameters by name.
    pub head: Vec<(String, Tensor)>,
    /// Optimizer state per owner rank.
    pub optim: Vec<(u32, OptimizerState)>,
    /// Curves so far.
    pub history: History,
    /// The running sums of the epoch in progress (zero at an epoch's end).
    pub progress: EpochProgress,
}

/// The running sums of an epoch in progress, for its report (kept bit-exact across a resume).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochProgress {
    /// Sum of this epoch's step losses.
    pub loss_sum: f64,
    /// Sum of the losses of the current window of 50 steps.
    pub window: f64,
    /// Steps in that window.
    pub window_n: u64,
    /// Training words classified correctly this epoch.
    pub hits: u64,
    /// Training words seen this epoch.
    pub seen: u64,
}

impl EpochProgress {
    fn to_vec(self) -> Vec<f64> {
        vec![
            self.loss_sum,
            self.window,
            self.window_n as f64,
            self.hits as f64,
            self.seen as f64,
        ]
    }

    fn from_vec(v: &[f64]) -> Result<Self> {
        let [loss_sum, window, window_n, hits, seen] = v else {
            bail!(
                "checkpoint tensor `train.progress` has {} values, not 5",
                v.len()
            );
        };
        Ok(Self {
            loss_sum: *loss_sum,
            window: *window,
            window_n: *window_n as u64,
            hits: *hits as u64,
            seen: *seen as u64,
        })
    }
}

fn scalar(x: u64) -> Result<Tensor> {
    Ok(Tensor::new(&[x as i64], &Device::Cpu)?)
}

fn floats(v: &[f64]) -> Result<Tensor> {
    Ok(Tensor::new(v, &Device::Cpu)?)
}

impl Checkpoint {
    /// Writes `dir/epoch-<epoch>.safetensors` (see [`replace_durably`]: a crash of the process
    /// or of the machine never leaves a truncated checkpoint) and returns its path.
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the checkpoint directory {}", dir.display()))?;
        let mut m: HashMap<String, Tensor> = HashMap::new();
        m.insert("train.epoch".into(), scalar(self.epoch)?);
        m.insert("train.step".into(), scalar(self.step)?);
        m.insert("config".into(), floats(&self.config)?);
        m.insert("train.progress".into(), floats(&self.progress.to_vec())?);
        for (n, t) in &self.encoder {
            m.insert(format!("encoder.{n}"), t.clone());
        }
        for (n, t) in &self.head {
            m.insert(format!("head.{n}"), t.clone());
        }
        for (rank, st) in &self.optim {
            m.insert(format!("optimizer.{rank}.steps"), scalar(st.steps)?);
            m.insert(
                format!("optimizer.{rank}.params"),
                scalar(st.m.len() as u64)?,
            );
            for (kind, slots) in [("m", &st.m), ("v", &st.v)] {
                for (i, t) in slots.iter().enumerate() {
                    if let Some(RTensor(t)) = t {
                        m.insert(
                            format!("optimizer.{rank}.{kind}.{i}"),
                            t.to_device(&Device::Cpu)?,
                        );
                    }
                }
            }
        }
        self.history.save(&mut m)?;
        let path = dir.join(format!("{PREFIX}{:09}{SUFFIX}", self.step));
        replace_durably(&path, |tmp| {
            candle_core::safetensors::save(&m, tmp)
                .with_context(|| format!("cannot write {}", tmp.display()))
        })?;
        Ok(path)
    }

    /// Reads a checkpoint written by [`Checkpoint::save`], with `encoder` and `head` naming
    /// the parameters expected.
    pub fn load(path: &Path, encoder: &[&str], head: &[&str], owners: &[u32]) -> Result<Self> {
        let m = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("cannot read the checkpoint {}", path.display()))?;
        let get = |name: &str| -> Result<Tensor> {
            m.get(name)
                .cloned()
                .with_context(|| format!("checkpoint {} has no tensor `{name}`", path.display()))
        };
        let int = |name: &str| -> Result<u64> {
            let v = get(name)?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
            match v.as_slice() {
                [x] if *x >= 0 => Ok(*x as u64),
                _ => bail!("checkpoint tensor `{name}` is not a count"),
            }
        };
        let named = |prefix: &str, names: &[&str]| -> Result<Vec<(String, Tensor)>> {
            names
                .iter()
                .map(|n| Ok((n.to_string(), get(&format!("{prefix}.{n}"))?)))
                .collect()
        };
        let mut optim = Vec::new();
        for &rank in owners {
            let n = int(&format!("optimizer.{rank}.params"))? as usize;
            let slot = |kind: &str, i: usize| {
                m.get(&format!("optimizer.{rank}.{kind}.{i}"))
                    .cloned()
                    .map(RTensor)
            };
            optim.push((
                rank,
                OptimizerState {
                    steps: int(&format!("optimizer.{rank}.steps"))?,
                    m: (0..n).map(|i| slot("m", i)).collect(),
                    v: (0..n).map(|i| slot("v", i)).collect(),
                },
            ));
        }
        Ok(Self {
            epoch: int("train.epoch")?,
            step: int("train.step")?,
            config: get("config")?.to_dtype(DType::F64)?.to_vec1()?,
            encoder: named("encoder", encoder)?,
            head: named("head", head)?,
            optim,
            history: History::load(&m)?,
            progress: EpochProgress::from_vec(
                &get("train.progress")?.to_dtype(DType::F64)?.to_vec1()?,
            )?,
        })
    }

    /// The checkpoint of the highest step in `dir`, if any.
    pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
        Ok(Self::all(dir)?.pop())
    }

    /// Every checkpoint in `dir`, oldest first.
    fn all(dir: &Path) -> Result<Vec<PathBuf>> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
        };
        let mut found: Vec<(u64, PathBuf)> = Vec::new();
        for e in entries {
            let path = e?.path();
            let step = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?.parse().ok());
            if let Some(step) = step {
                found.push((step, path));
            }
        }
        found.sort();
        Ok(found.into_iter().map(|(_, p)| p).collect())
    }

    /// Removes all but the newest `keep` checkpoints of `dir`, and temporaries a killed writer
    /// left.
    pub fn prune(dir: &Path, keep: usize) -> Result<()> {
        if !dir.exists() {
            return Ok(());
        }
        let all = Self::all(dir)?;
        let old = all.len().saturating_sub(keep);
        for p in &all[..old] {
            std::fs::remove_file(p).with_context(|| format!("cannot remove {}", p.display()))?;
        }
        for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
            let path = e?.path();
            let stale = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!(".{PREFIX}")) && n.ends_with(".tmp"));
            if stale {
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(())
    }
}

/// Checkpoint file names: `ckpt-<step, 9 digits>.safetensors`.
const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";

/// SHA-256 of `params` in the order given, as hex: each parameter's name, shape and `f32`
/// bytes (little-endian, row-major), so two runs can be compared without their checkpoints
/// (equal exactly when every parameter is bit-identical, under the same names and order).
pub fn params_sha256(params: &[(String, Tensor)]) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (name, t) in params {
        ensure!(
            t.dtype() == DType::F32,
            "parameter `{name}` is {:?}, not f32",
            t.dtype()
        );
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((t.rank() as u64).to_le_bytes());
        for &d in t.dims() {
            h.update((d as u64).to_le_bytes());
        }
        for x in t.flatten_all()?.to_vec1::<f32>()? {
            h.update(x.to_le_bytes());
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `path` so that after a crash, of the process or of the machine, it holds either its
/// previous content or all of the new: `write` fills a temporary file beside it, which is
/// flushed to the disk, renamed over `path`, and then the directory is flushed, so the rename
/// itself is on the disk when this returns. (A rename alone can reach the disk before the
/// file's data does, leaving an empty or partial file after a power loss.) On an error the
/// temporary file is removed and `path` is untouched.
pub fn replace_durably(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let written = write(&tmp).and_then(|()| {
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot flush {} to the disk", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot flush the directory {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hybrid-rnn-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_parameter_hash_changes_with_any_bit_name_or_order() {
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let p = |a: &[f32], b: &[f32]| vec![("a".to_string(), t(a)), ("b".to_string(), t(b))];
        let base = params_sha256(&p(&[1.0, 2.0], &[3.0])).unwrap();
        assert_eq!(base.len(), 64);
        assert_eq!(base, params_sha256(&p(&[1.0, 2.0], &[3.0])).unwrap());
        let flipped = f32::from_bits(2.0f32.to_bits() ^ 1);
        assert_ne!(base, params_sha256(&p(&[1.0, flipped], &[3.0])).unwrap());
        // The same bytes split differently between parameters.
        assert_ne!(base, params_sha256(&p(&[1.0], &[2.0, 3.0])).unwrap());
        let mut swapped = p(&[1.0, 2.0], &[3.0]);
        swapped.reverse();
        assert_ne!(base, params_sha256(&swapped).unwrap());
        let mut renamed = p(&[1.0, 2.0], &[3.0]);
        renamed[1].0 = "c".into();
        assert_ne!(base, params_sha256(&renamed).unwrap());
        let reshaped = vec![
            ("a".to_string(), t(&[1.0, 2.0]).reshape((2, 1)).unwrap()),
            ("b".to_string(), t(&[3.0])),
        ];
        assert_ne!(base, params_sha256(&reshaped).unwrap());
    }

    #[test]
    fn the_latest_is_the_highest_step_and_pruning_keeps_the_newest() {
        let d = scratch("prune");
        for step in [5u64, 120, 40, 1000] {
            std::fs::write(d.join(format!("ckpt-{step:09}.safetensors")), b"x").unwrap();
        }
        std::fs::write(d.join(".ckpt-000002000.safetensors.tmp"), b"half").unwrap();
        std::fs::write(d.join("training.png"), b"p").unwrap();
        assert_eq!(
            Checkpoint::latest(&d).unwrap().unwrap(),
            d.join("ckpt-000001000.safetensors")
        );
        Checkpoint::prune(&d, 2).unwrap();
        assert_eq!(
            entries(&d),
            [
                "ckpt-000000120.safetensors",
                "ckpt-000001000.safetensors",
                "training.png"
            ]
        );
        Checkpoint::prune(&d, 0).unwrap();
        assert_eq!(entries(&d), ["training.png"]);
        assert_eq!(Checkpoint::latest(&d).unwrap(), None);
        std::fs::remove_dir_all(&d).unwrap();
        Checkpoint::prune(&d, 0).expect("a missing directory holds nothing to prune");
    }

    #[test]
    fn a_replaced_file_holds_the_new_bytes_and_nothing_else_is_left() {
        let d = scratch("replace");
        let p = d.join("a.bin");
        std::fs::write(&p, b"old").unwrap();
        replace_durably(&p, |tmp| Ok(std::fs::write(tmp, b"new bytes")?)).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new bytes");
        assert_eq!(entries(&d), ["a.bin"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let d = scratch("fail");
        let p = d.join("a.bin");
        std::fs::write(&p, b"old").unwrap();
        let r = replace_durably(&p, |tmp| {
            std::fs::write(tmp, b"half")?;
            bail!("the disk is full")
        });
        assert!(r.unwrap_err().to_string().contains("the disk is full"));
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(entries(&d), ["a.bin"]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
