//! Checkpoint files shared by the training examples: one safetensors file per checkpoint
//! (`ckpt-<step, 9 digits>.safetensors` in a directory), written so that a crash never leaves a
//! truncated one ([`replace_durably`]), listed by step ([`all`], [`latest`]), pruned to the
//! newest few ([`prune`]); helpers for the tensors every checkpoint holds (counts, float lists,
//! an optimizer owner's state), and [`params_sha256`], which lets two runs compare their final
//! parameters without their checkpoints.
//!
//! Each file's safetensors metadata holds the step, the flags of the run that wrote it
//! ([`Flags`]) and a SHA-256 digest of everything else in the file: every tensor's name,
//! dtype, shape and bytes, and the rest of the metadata. [`Tensors::load`] checks it, so a
//! damaged or partial file is an error naming it, never a checkpoint with other values
//! (CKPT-1). Which checkpoint a run goes on from is `resume.rs`'s business; what a checkpoint
//! holds is each example's own (hybrid-rnn's `checkpoint.rs`, pipeline's `main.rs`); any
//! safetensors loader reads the files.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use autograd_dist::{OptimizerState, RTensor};
use candle_core::{DType, Device, Tensor};
use safetensors::{Dtype, SafeTensors, View};
use sha2::{Digest, Sha256};

/// Checkpoint file names: `ckpt-<step, 9 digits>.safetensors`.
const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";
/// The metadata's keys.
const FORMAT_KEY: &str = "format";
const FORMAT: &str = "remote-exec checkpoint 1";
const STEP_KEY: &str = "step";
const FLAGS_KEY: &str = "flags";
const DIGEST_KEY: &str = "sha256";

/// The flags that shape a run, by name (`--hidden` → `128`): a checkpoint continues only a
/// run with the same ones.
pub type Flags = BTreeMap<String, String>;

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

/// A tensor's bytes as the file holds them.
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The digest of a checkpoint's contents: every tensor (in name order: name, dtype, shape,
/// bytes) and every metadata entry but the digest itself (in key order).
fn digest<'a>(
    tensors: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
    meta: &HashMap<String, String>,
) -> String {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    for (name, dtype, shape, data) in tensors {
        field(name.as_bytes());
        field(format!("{dtype:?}").as_bytes());
        field(
            &shape
                .iter()
                .flat_map(|d| (*d as u64).to_le_bytes())
                .collect::<Vec<_>>(),
        );
        field(data);
    }
    let meta: BTreeMap<_, _> = meta.iter().filter(|(k, _)| *k != DIGEST_KEY).collect();
    for (k, v) in meta {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// The path of step `step`'s checkpoint in `dir`.
pub fn path_of(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:09}{SUFFIX}"))
}

/// Writes `tensors` as the checkpoint of `step` in `dir` (created if missing), written by a
/// run with `flags`, durably, and returns its path. An error names the file and the cause (a
/// full disk: "No space left on device"), and is [`Fatal`](crate::Fatal).
pub fn save(
    dir: &Path,
    step: u64,
    tensors: &HashMap<String, Tensor>,
    flags: &Flags,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the checkpoint directory {}", dir.display()))?;
    let path = path_of(dir, step);
    let mut raw: BTreeMap<&str, Raw> = BTreeMap::new();
    for (name, t) in tensors {
        let t = t.to_device(&Device::Cpu)?.contiguous()?;
        let data = View::data(&&t).into_owned();
        let r = Raw {
            dtype: View::dtype(&&t),
            shape: t.dims().to_vec(),
            data,
        };
        raw.insert(name, r);
    }
    let mut meta = HashMap::from([
        (FORMAT_KEY.to_owned(), FORMAT.to_owned()),
        (STEP_KEY.to_owned(), step.to_string()),
        (FLAGS_KEY.to_owned(), serde_json::to_string(flags)?),
    ]);
    let sum = digest(
        raw.iter()
            .map(|(n, r)| (*n, r.dtype, r.shape.as_slice(), r.data.as_slice())),
        &meta,
    );
    meta.insert(DIGEST_KEY.to_owned(), sum);
    replace_durably(&path, |tmp| {
        safetensors::serialize_to_file(raw.iter().map(|(n, r)| (*n, r)), Some(meta), tmp)
            .map_err(anyhow::Error::from)
    })
    .with_context(|| {
        crate::Fatal(format!(
            "cannot write the checkpoint {} (the run stops: a restart would fail the same way)",
            path.display()
        ))
    })?;
    Ok(path)
}

/// A checkpoint's tensors, read back and verified; every accessor names the file and the
/// tensor it misses.
#[derive(Debug)]
pub struct Tensors {
    path: PathBuf,
    step: u64,
    flags: Flags,
    map: HashMap<String, Tensor>,
}

impl Tensors {
    /// Reads the checkpoint at `path` and checks its digest (CKPT-1): an error names the file
    /// and what is wrong with it (unreadable, not a checkpoint, cut short, its contents not
    /// those it was written with).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the checkpoint {}", path.display()))?;
        Self::verify(path, &bytes).with_context(|| {
            format!(
                "{} is damaged or not a checkpoint ({} bytes)",
                path.display(),
                bytes.len()
            )
        })
    }

    fn verify(path: &Path, bytes: &[u8]) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).context("not a complete safetensors file")?;
        let (_, header) = SafeTensors::read_metadata(bytes)?;
        let meta = header.metadata().clone().unwrap_or_default();
        ensure!(
            meta.get(FORMAT_KEY).map(String::as_str) == Some(FORMAT),
            "its metadata does not say `{FORMAT}` (written by an older version, or by \
             another program)"
        );
        let Some(want) = meta.get(DIGEST_KEY) else {
            bail!("it has no digest");
        };
        let mut views = st.tensors();
        views.sort_by(|a, b| a.0.cmp(&b.0));
        let got = digest(
            views
                .iter()
                .map(|(n, v)| (n.as_str(), v.dtype(), v.shape(), v.data())),
            &meta,
        );
        ensure!(
            &got == want,
            "its contents do not match the digest it was written with"
        );
        let step = meta
            .get(STEP_KEY)
            .and_then(|s| s.parse().ok())
            .context("its metadata has no step")?;
        let flags = serde_json::from_str(meta.get(FLAGS_KEY).context("no flags")?)
            .context("its flags do not parse")?;
        let map = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)?;
        Ok(Self {
            path: path.to_owned(),
            step,
            flags,
            map,
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The step it was written at.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The flags of the run that wrote it.
    pub fn flags(&self) -> &Flags {
        &self.flags
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

/// Every checkpoint in `dir`, oldest first.
pub fn all(dir: &Path) -> Result<Vec<PathBuf>> {
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
    Ok(hex(&h.finalize()))
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
        let flags = Flags::from([("--hidden".to_string(), "8".to_string())]);
        let path = save(&d, 17, &m, &flags).unwrap();
        assert_eq!(path, d.join("ckpt-000000017.safetensors"));
        let back = Tensors::load(&path).unwrap();
        assert_eq!((back.step(), back.flags()), (17, &flags));
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

    /// CKPT-1: any byte of the file changed, or the file cut short anywhere, fails the load,
    /// naming the file.
    #[test]
    fn a_damaged_or_partial_checkpoint_is_refused() {
        let d = scratch("damaged");
        let mut m = HashMap::new();
        m.insert("w".to_string(), floats(&[0.0275, -1.5, 3.0]).unwrap());
        m.insert("n".to_string(), count(7).unwrap());
        let path = save(&d, 3, &m, &Flags::new()).unwrap();
        let good = std::fs::read(&path).unwrap();
        Tensors::load(&path).unwrap();
        // Every byte flipped in turn (header and data alike), and cuts at every length.
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let e = match Tensors::load(&path) {
                Ok(_) => panic!("a flipped byte {i} of {} loaded", good.len()),
                Err(e) => format!("{e:#}"),
            };
            assert!(e.contains(&path.display().to_string()), "{e}");
        }
        for len in 0..good.len() {
            std::fs::write(&path, &good[..len]).unwrap();
            assert!(Tensors::load(&path).is_err(), "cut at {len} loaded");
        }
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
