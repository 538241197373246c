//! Words to tensors: the character vocabulary, batches, the epoch order and dropout masks.
//!
//! Everything random here is a function of the run's seed and the step (or epoch), so the
//! distributed run, the one-process run and a resumed run see the same batches and masks.

use std::collections::BTreeMap;
use std::sync::Arc;

use std::path::Path;

use super::wordlang;
use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Words longer than this are truncated (as in the PyTorch reference).
pub const MAX_LEN: usize = 24;
const PAD: u32 = 0;
const UNK: u32 = 1;

/// Character ids: 0 is padding, 1 unknown, then the training set's characters in order.
pub struct Vocab(BTreeMap<char, u32>);

impl Vocab {
    /// The characters of `words`.
    pub fn new<'a>(words: impl IntoIterator<Item = &'a str>) -> Self {
        let mut chars: Vec<char> = words.into_iter().flat_map(str::chars).collect();
        chars.sort_unstable();
        chars.dedup();
        Self(chars.into_iter().zip(2..).collect())
    }

    /// Ids including padding and unknown.
    pub fn len(&self) -> usize {
        self.0.len() + 2
    }

    /// Never: padding and unknown always have ids.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn ids(&self, word: &str) -> Vec<u32> {
        word.chars()
            .take(MAX_LEN)
            .map(|c| self.0.get(&c).copied().unwrap_or(UNK))
            .collect()
    }
}

/// A dataset as character ids and labels.
pub struct Split {
    words: Vec<Vec<u32>>,
    labels: Vec<u32>,
}

impl Split {
    /// Encodes `pairs` with `vocab`.
    pub fn new(vocab: &Vocab, pairs: &[(String, usize)]) -> Self {
        Self {
            words: pairs.iter().map(|(w, _)| vocab.ids(w)).collect(),
            labels: pairs.iter().map(|(_, y)| *y as u32).collect(),
        }
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Whether it has no word.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Labels, in order.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// Keeps the first `n` words.
    pub fn truncate(&mut self, n: usize) {
        self.words.truncate(n);
        self.labels.truncate(n);
    }

    /// The words at `idx` as one batch.
    pub fn batch(&self, idx: &[usize]) -> Result<Batch> {
        let b = idx.len();
        let t = idx
            .iter()
            .map(|&i| self.words[i].len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut ids = vec![PAD; t * b];
        let mut rev = vec![PAD; t * b];
        let mut last = vec![0u32; b];
        for (j, &i) in idx.iter().enumerate() {
            let w = &self.words[i];
            for (k, &c) in w.iter().enumerate() {
                ids[k * b + j] = c;
                rev[k * b + j] = w[w.len() - 1 - k];
            }
            last[j] = (w.len().max(1) - 1) as u32;
        }
        let labels: Vec<u32> = idx.iter().map(|&i| self.labels[i]).collect();
        let dev = Device::Cpu;
        Ok(Batch {
            ids: Tensor::from_vec(ids, t * b, &dev)?,
            rev_ids: Tensor::from_vec(rev, t * b, &dev)?,
            last: Arc::new(last),
            labels: Tensor::from_vec(labels, b, &dev)?,
            t,
            b,
        })
    }
}

/// One batch, time-major and right-padded (see [`crate::model::EncoderInput`]).
pub struct Batch {
    /// `[T*B]` character ids.
    pub ids: Tensor,
    /// `[T*B]` ids of the reversed words.
    pub rev_ids: Tensor,
    /// `[B]`: each word's last position (time step).
    pub last: Arc<Vec<u32>>,
    /// `[B]` labels.
    pub labels: Tensor,
    /// Time steps.
    pub t: usize,
    /// Words.
    pub b: usize,
}

/// The dataset, encoded: `train.tsv` and `test.tsv` of `dir` (default: the bundled data),
/// cut to the first `train_limit` / `test_limit` words, with at least one `batch` to train on.
pub struct Data {
    /// The training words.
    pub train: Split,
    /// The test words.
    pub test: Split,
    /// The vocabulary's size.
    pub vocab: usize,
}

impl Data {
    /// Loads and encodes the data set.
    pub fn load(
        dir: Option<&Path>,
        train_limit: Option<usize>,
        test_limit: Option<usize>,
        batch: usize,
    ) -> Result<Self> {
        let dir = dir.map_or_else(wordlang::data_dir, Path::to_path_buf);
        let train = wordlang::load(&dir, "train.tsv")?;
        let test = wordlang::load(&dir, "test.tsv")?;
        let vocab = Vocab::new(train.iter().map(|(w, _)| w.as_str()));
        let mut tr = Split::new(&vocab, &train);
        let mut te = Split::new(&vocab, &test);
        if let Some(n) = train_limit {
            tr.truncate(n);
        }
        if let Some(n) = test_limit {
            te.truncate(n);
        }
        ensure!(
            tr.len() >= batch,
            "{} training words are fewer than one batch of {batch}",
            tr.len(),
        );
        ensure!(!te.is_empty(), "the test set is empty");
        Ok(Self {
            train: tr,
            test: te,
            vocab: vocab.len(),
        })
    }
}

fn mix(seed: u64, a: u64, b: u64) -> u64 {
    // SplitMix64 finalizer over the three inputs: distinct streams per (seed, a, b).
    let mut z =
        seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The training batches of `epoch`: a permutation of `0..n` from the seed and the epoch, cut
/// into batches of `batch` (the last partial batch dropped).
pub fn epoch_batches(n: usize, batch: usize, seed: u64, epoch: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix(seed, 1, epoch)));
    order.chunks_exact(batch).map(<[usize]>::to_vec).collect()
}

/// The dropout keep-mask of global step `step`: `[b, width]`, each entry 0 with probability
/// `p`, else `1 / (1 - p)`. `None` when `p` is 0.
pub fn dropout_mask(
    p: f32,
    b: usize,
    width: usize,
    seed: u64,
    step: u64,
) -> Result<Option<Tensor>> {
    if p <= 0.0 {
        return Ok(None);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, 2, step));
    let keep = 1.0 / (1.0 - p);
    let v: Vec<f32> = (0..b * width)
        .map(|_| if rng.random::<f32>() < p { 0.0 } else { keep })
        .collect();
    Ok(Some(Tensor::from_vec(v, (b, width), &Device::Cpu)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_time_major_with_reversed_words_and_last_positions() {
        let vocab = Vocab::new(["abc", "ba"]);
        let split = Split::new(&vocab, &[("abc".into(), 0), ("ba".into(), 1)]);
        let b = split.batch(&[0, 1]).unwrap();
        assert_eq!((b.t, b.b), (3, 2));
        // a=2, b=3, c=4; time-major: [a b | b a | c pad]
        assert_eq!(b.ids.to_vec1::<u32>().unwrap(), vec![2, 3, 3, 2, 4, 0]);
        assert_eq!(b.rev_ids.to_vec1::<u32>().unwrap(), vec![4, 2, 3, 3, 2, 0]);
        assert_eq!(*b.last, vec![2, 1]);
    }

    #[test]
    fn epoch_order_and_masks_depend_only_on_seed_and_step() {
        let a = epoch_batches(100, 10, 7, 3);
        assert_eq!(a, epoch_batches(100, 10, 7, 3));
        assert_ne!(a, epoch_batches(100, 10, 7, 4));
        assert_eq!(a.len(), 10);
        let m = |s| {
            dropout_mask(0.5, 4, 8, 1, s)
                .unwrap()
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        };
        assert_eq!(m(5), m(5));
        assert_ne!(m(5), m(6));
    }
}
