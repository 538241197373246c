//! The word-language dataset shipped in `data/wordlang` (built from Debian's word lists by
//! `data/prepare_wordlang.py`): lines of `word<TAB>language`, a fixed 80/20 split.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

/// The languages, in label order.
pub const LANGS: [&str; 8] = [
    "american-english",
    "french",
    "ngerman",
    "spanish",
    "italian",
    "dutch",
    "polish",
    "swedish",
];

/// Where the dataset is: `$WORDLANG_DIR`, else the repository's `data/wordlang`.
pub fn data_dir() -> PathBuf {
    std::env::var_os("WORDLANG_DIR")
        .map(Into::into)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/wordlang"))
}

/// Reads `dir/name` as (word, label) pairs; a missing file or a bad line is an error naming
/// the file and the line.
pub fn load(dir: &Path, name: &str) -> Result<Vec<(String, usize)>> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read the dataset at {} (rebuild it with data/prepare_wordlang.py, or point \
             WORDLANG_DIR at a copy)",
            path.display()
        )
    })?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let (w, lang) = l.split_once('\t').with_context(|| {
                format!("{}:{}: expected `word<TAB>language`", path.display(), i + 1)
            })?;
            let y = LANGS.iter().position(|x| *x == lang).with_context(|| {
                format!("{}:{}: unknown language {lang:?}", path.display(), i + 1)
            })?;
            anyhow::ensure!(!w.is_empty(), "{}:{}: empty word", path.display(), i + 1);
            Ok((w.to_owned(), y))
        })
        .collect()
}

/// The width of the hashed n-gram features.
pub const DIM: usize = 4096;

/// Hashed character 1–3-grams of `^word$`, as indices below [`DIM`].
pub fn features(word: &str) -> Vec<usize> {
    let chars: Vec<char> = std::iter::once('^')
        .chain(word.chars())
        .chain(std::iter::once('$'))
        .collect();
    let mut out = Vec::new();
    for n in 1..=3 {
        for w in chars.windows(n) {
            let h = w.iter().fold(0xcbf2_9ce4_8422_2325u64 ^ n as u64, |h, c| {
                (h ^ u64::from(*c as u32)).wrapping_mul(0x100_0000_01b3)
            });
            out.push((h % DIM as u64) as usize);
        }
    }
    out
}

/// A batch as a dense count matrix of [`features`] (`batch × DIM`) and its labels.
pub fn dense(batch: &[(String, usize)]) -> Result<(Tensor, Tensor)> {
    let mut x = vec![0f32; batch.len() * DIM];
    for (i, (w, _)) in batch.iter().enumerate() {
        for f in features(w) {
            x[i * DIM + f] += 1.0;
        }
    }
    let y: Vec<u32> = batch.iter().map(|(_, y)| *y as u32).collect();
    Ok((
        Tensor::from_vec(x, (batch.len(), DIM), &Device::Cpu)?,
        Tensor::new(y.as_slice(), &Device::Cpu)?,
    ))
}

/// A softmax regression's logits: `x · w + b`.
pub fn logits(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(w)?.broadcast_add(b)
}
