//! Checkpoint files shared by the training examples: one safetensors file per checkpoint
//! (`ckpt-<step, 9 digits>.safetensors` in a directory), written so that a crash never leaves a
//! truncated one ([`replace_durably`]), found by step ([`latest`]), pruned to the newest few
//! ([`prune`]); helpers for the tensors every checkpoint holds (counts, float lists, an
//! optimizer owner's state), and [`params_sha256`], which lets two runs compare their final
//! parameters without their checkpoints.
//!
//! What a checkpoint holds is each example's own business (hybrid-rnn's `checkpoint.rs`,
//! pipeline's `main.rs`); any safetensors loader reads the files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use autograd_dist::{OptimizerState, RTensor};
use candle_core::{DType, Device, Tensor};

/// Checkpoint file names: `ckpt-<step, 9 digits>.safetensors`.
const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";

/// A count as a checkpoint tensor (one `i64`).
pub fn count(x: u64) -> Result<Tensor> {
    Ok(Tensor::new(&[x as i64], &Device::Cpu)?)
}

/// Numbers as a checkpoint tensor (`f64`, one dimension).
pub fn floats(v: &[f64]) -> Result<Tensor> {
    Ok(Tensor::new(v, &Device::Cpu)?)
}

/// Adds the optimizer state of the parameters owned by `rank` under `optimizer.<rank>.*`:
/// `steps`, `params` (how many) and the moments `m.<i>` / `v.<i>` that exist.
pub fn put_optimizer(
    m: &mut HashMap<String, Tensor>,
    rank: u32,
    st: &OptimizerState,
) -> Result<()> {
    m.insert(format!("optimizer.{rank}.steps"), count(st.steps)?);
    m.insert(
        format!("optimizer.{rank}.params"),
        count(st.m.len() as u64)?,
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
    Ok(())
}

/// Writes `tensors` as the checkpoint of `step` in `dir` (created if missing), durably, and
/// returns its path.
pub fn save(dir: &Path, step: u64, tensors: &HashMap<String, Tensor>) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the checkpoint directory {}", dir.display()))?;
    let path = dir.join(format!("{PREFIX}{step:09}{SUFFIX}"));
    replace_durably(&path, |tmp| {
        candle_core::safetensors::save(tensors, tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    Ok(path)
}

/// A checkpoint's tensors, read back; every accessor names the file and the tensor it misses.
pub struct Tensors {
    path: PathBuf,
    map: HashMap<String, Tensor>,
}

impl Tensors {
    /// Reads the checkpoint at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let map = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("cannot read the checkpoint {}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            map,
        })
    }

    /// Every tensor by name.
    pub fn map(&self) -> &HashMap<String, Tensor> {
        &self.map
    }

    /// The tensor `name`.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        self.map
            .get(name)
            .cloned()
            .with_context(|| format!("checkpoint {} has no tensor `{name}`", self.path.display()))
    }

    /// The count `name` (written by [`count`]).
    pub fn count(&self, name: &str) -> Result<u64> {
        let v = self.get(name)?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        match v.as_slice() {
            [x] if *x >= 0 => Ok(*x as u64),
            _ => bail!(
                "checkpoint {}: tensor `{name}` is not a count",
                self.path.display()
            ),
        }
    }

    /// The numbers `name` (written by [`floats`]).
    pub fn floats(&self, name: &str) -> Result<Vec<f64>> {
        Ok(self.get(name)?.to_dtype(DType::F64)?.to_vec1()?)
    }

    /// The optimizer state of the parameters owned by `rank` (written by [`put_optimizer`]).
    pub fn optimizer(&self, rank: u32) -> Result<OptimizerState> {
        let n = self.count(&format!("optimizer.{rank}.params"))? as usize;
        let slot = |kind: &str, i: usize| {
            self.map
                .get(&format!("optimizer.{rank}.{kind}.{i}"))
                .cloned()
                .map(RTensor)
        };
        Ok(OptimizerState {
            steps: self.count(&format!("optimizer.{rank}.steps"))?,
            m: (0..n).map(|i| slot("m", i)).collect(),
            v: (0..n).map(|i| slot("v", i)).collect(),
        })
    }
}

/// The checkpoint of the highest step in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(all(dir)?.pop())
}

/// The checkpoint a run resumes from: with `resume` (the user's `--resume`), or when the
/// launcher restarted it (`restart` > 0), the latest in `dir`. `--resume` needs one; a restart
/// before the first checkpoint was written starts from the beginning (`None`).
pub fn to_resume(dir: &Path, resume: bool, restart: u32) -> Result<Option<PathBuf>> {
    if !resume && restart == 0 {
        return Ok(None);
    }
    let latest = latest(dir)?;
    ensure!(
        latest.is_some() || restart > 0,
        "--resume: no checkpoint in {}",
        dir.display()
    );
    Ok(latest)
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
    let all = all(dir)?;
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
        let d = std::env::temp_dir().join(format!("examples-ckpt-{name}-{}", std::process::id()));
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
            latest(&d).unwrap().unwrap(),
            d.join("ckpt-000001000.safetensors")
        );
        prune(&d, 2).unwrap();
        assert_eq!(
            entries(&d),
            [
                "ckpt-000000120.safetensors",
                "ckpt-000001000.safetensors",
                "training.png"
            ]
        );
        prune(&d, 0).unwrap();
        assert_eq!(entries(&d), ["training.png"]);
        assert_eq!(latest(&d).unwrap(), None);
        std::fs::remove_dir_all(&d).unwrap();
        prune(&d, 0).expect("a missing directory holds nothing to prune");
    }

    #[test]
    fn counts_floats_and_optimizer_states_read_back_as_written() {
        let d = scratch("roundtrip");
        let mut m = HashMap::new();
        m.insert("n".to_string(), count(42).unwrap());
        m.insert("x".to_string(), floats(&[0.5, -1.25]).unwrap());
        let t = |v: &[f32]| Some(RTensor(Tensor::new(v, &Device::Cpu).unwrap()));
        let st = OptimizerState {
            steps: 7,
            m: vec![t(&[1.0, 2.0]), None],
            v: vec![t(&[3.0, 4.0]), None],
        };
        put_optimizer(&mut m, 3, &st).unwrap();
        let path = save(&d, 17, &m).unwrap();
        assert_eq!(path, d.join("ckpt-000000017.safetensors"));
        let back = Tensors::load(&path).unwrap();
        assert_eq!(back.count("n").unwrap(), 42);
        assert_eq!(back.floats("x").unwrap(), [0.5, -1.25]);
        let got = back.optimizer(3).unwrap();
        assert_eq!(got.steps, 7);
        assert_eq!(
            got.m[0].as_ref().unwrap().0.to_vec1::<f32>().unwrap(),
            [1.0, 2.0]
        );
        assert_eq!(
            got.v[0].as_ref().unwrap().0.to_vec1::<f32>().unwrap(),
            [3.0, 4.0]
        );
        assert!(got.m[1].is_none() && got.v[1].is_none());
        let e = back.optimizer(4).unwrap_err().to_string();
        assert!(e.contains("optimizer.4.params"), "{e}");
        let e = back.count("x").unwrap_err().to_string();
        assert!(e.contains("not a count"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
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
