//! The model: a character encoder (master) and the classifier head (workers).
//!
//! Encoder: embedding → LSTM over the word and LSTM over the reversed word (a bidirectional
//! encoder written as two forward passes over right-padded sequences, each read at the word's
//! last character) → dropout. Head: Linear → ReLU → Linear, as one part (`NetShard1`) or two
//! parts on two devices (`NetShard2`).
//!
//! The LSTM is written for few, large operations: the input projection of every time step is
//! one matmul, and the recurrence one operation with a hand-written backward (`lstm.rs`).
//! Parameters are initialized from seeded generators (PyTorch's
//! schemes), so every process builds identical replicas.

use candle_core::{DType, Device, Module, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::lstm::lstm_last;
use std::sync::Arc;

/// Sizes of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Dims {
    /// Characters (with padding and unknown).
    pub vocab: usize,
    /// Embedding width.
    pub emb: usize,
    /// LSTM state width (per direction).
    pub hidden: usize,
    /// Head's hidden width.
    pub head_hidden: usize,
    /// Classes.
    pub classes: usize,
    /// Two directions (encoding width `2 * hidden`) or one.
    pub bidirectional: bool,
}

impl Dims {
    /// Width of the encoding the head receives.
    pub fn encoding(&self) -> usize {
        if self.bidirectional {
            2 * self.hidden
        } else {
            self.hidden
        }
    }
}

fn uniform(rng: &mut ChaCha8Rng, shape: (usize, usize), bound: f32) -> candle_core::Result<Var> {
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?)
}

fn uniform1(rng: &mut ChaCha8Rng, n: usize, bound: f32) -> candle_core::Result<Var> {
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Var::from_tensor(&Tensor::from_vec(v, n, &Device::Cpu)?)
}

/// A fully connected layer, `y = x Wᵀ + b`, initialized like PyTorch's `nn.Linear`.
pub struct Linear {
    /// `[out, in]`.
    pub w: Var,
    /// `[out]`.
    pub b: Var,
}

impl Linear {
    fn new(rng: &mut ChaCha8Rng, inp: usize, out: usize) -> candle_core::Result<Self> {
        let bound = 1.0 / (inp as f32).sqrt();
        Ok(Self {
            w: uniform(rng, (out, inp), bound)?,
            b: uniform1(rng, out, bound)?,
        })
    }

    /// The layer moved to `device` (new variables, same values).
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        Ok(Self {
            w: Var::from_tensor(&self.w.as_tensor().to_device(device)?)?,
            b: Var::from_tensor(&self.b.as_tensor().to_device(device)?)?,
        })
    }

    fn vars(&self) -> Vec<Var> {
        vec![self.w.clone(), self.b.clone()]
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.w.as_tensor().t()?)?
            .broadcast_add(self.b.as_tensor())
    }
}

/// The head's two layers, created from `seed` (every replica gets the same values).
pub fn head_layers(dims: &Dims, seed: u64) -> candle_core::Result<(Linear, Linear)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let l1 = Linear::new(&mut rng, dims.encoding(), dims.head_hidden)?;
    let l2 = Linear::new(&mut rng, dims.head_hidden, dims.classes)?;
    Ok((l1, l2))
}

/// Names of the head's parameters, in [`Head::vars`] order.
pub const HEAD_PARAMS: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// The classifier head, `Linear → ReLU → Linear`, with its first layer on `devices.0` and the
/// rest on `devices.1` (the same device for `NetShard1`, two for `NetShard2`).
pub struct Head {
    l1: Linear,
    l2: Linear,
    devices: (Device, Device),
}

impl Head {
    /// A head from `seed`, its parts placed on `devices`.
    pub fn new(dims: &Dims, seed: u64, devices: (Device, Device)) -> candle_core::Result<Self> {
        let (l1, l2) = head_layers(dims, seed)?;
        Ok(Self {
            l1: l1.to_device(&devices.0)?,
            l2: l2.to_device(&devices.1)?,
            devices,
        })
    }

    /// The parameters, in [`HEAD_PARAMS`] order.
    pub fn vars(&self) -> Vec<Var> {
        let mut v = self.l1.vars();
        v.extend(self.l2.vars());
        v
    }

    /// Logits for encodings `x` (returned on `x`'s device).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let home = x.device().clone();
        let h = self.l1.forward(&x.to_device(&self.devices.0)?)?;
        let h = h.to_device(&self.devices.1)?.relu()?;
        self.l2.forward(&h)?.to_device(&home)
    }
}

/// One direction of the LSTM. Gates in PyTorch's order: input, forget, cell, output.
pub struct Lstm {
    /// `[4H, E]`.
    pub w_ih: Var,
    /// `[4H, H]`.
    pub w_hh: Var,
    /// `[4H]` (PyTorch's `b_ih + b_hh`).
    pub b: Var,
}

impl Lstm {
    fn new(rng: &mut ChaCha8Rng, inp: usize, hidden: usize) -> candle_core::Result<Self> {
        let bound = 1.0 / (hidden as f32).sqrt();
        Ok(Self {
            w_ih: uniform(rng, (4 * hidden, inp), bound)?,
            w_hh: uniform(rng, (4 * hidden, hidden), bound)?,
            b: uniform1(rng, 4 * hidden, bound)?,
        })
    }

    /// Runs over `x` (`[T*B, E]`, time-major) and returns the state after each word's last
    /// character: `last` is `[T, B, 1]`, 1 at (length - 1, word) and 0 elsewhere.
    fn forward(
        &self,
        x: &Tensor,
        t: usize,
        b: usize,
        last: &Arc<Vec<u32>>,
    ) -> candle_core::Result<Tensor> {
        let hidden = self.w_hh.dims()[1];
        // Every time step's input projection in one matmul.
        let xp = x
            .matmul(&self.w_ih.as_tensor().t()?)?
            .reshape((t, b, 4 * hidden))?;
        lstm_last(
            &xp,
            self.w_hh.as_tensor(),
            self.b.as_tensor(),
            Arc::clone(last),
        )
    }

    fn vars(&self) -> Vec<Var> {
        vec![self.w_ih.clone(), self.w_hh.clone(), self.b.clone()]
    }
}

/// Names of the encoder's parameters, in [`Encoder::vars`] order.
pub fn encoder_param_names(dims: &Dims) -> Vec<&'static str> {
    let mut v = vec![
        "embedding.weight",
        "lstm.weight_ih",
        "lstm.weight_hh",
        "lstm.bias",
    ];
    if dims.bidirectional {
        v.extend([
            "lstm_reverse.weight_ih",
            "lstm_reverse.weight_hh",
            "lstm_reverse.bias",
        ]);
    }
    v
}

/// A batch of words, encoded for the encoder (see [`crate::data::Batch`]).
pub struct EncoderInput<'a> {
    /// Character ids, `[T*B]`, time-major, right-padded with 0.
    pub ids: &'a Tensor,
    /// The same words reversed.
    pub rev_ids: &'a Tensor,
    /// `[B]`: each word's last character's time step.
    pub last: &'a Arc<Vec<u32>>,
    /// Time steps.
    pub t: usize,
    /// Words.
    pub b: usize,
    /// Dropout keep-mask over the encoding, scaled by 1/(1-p); `None` to evaluate.
    pub dropout: Option<&'a Tensor>,
}

/// The master's part: embedding and LSTM encoder.
pub struct Encoder {
    emb: Var,
    fwd: Lstm,
    rev: Option<Lstm>,
}

impl Encoder {
    /// An encoder from `seed`: embedding N(0, 1) (row 0, padding, zero), LSTM U(±1/√H).
    pub fn new(dims: &Dims, seed: u64) -> candle_core::Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let normal = rand_distr::StandardNormal;
        let mut e: Vec<f32> = (0..dims.vocab * dims.emb)
            .map(|_| rng.sample::<f32, _>(normal))
            .collect();
        e[..dims.emb].fill(0.0);
        let emb = Var::from_tensor(&Tensor::from_vec(e, (dims.vocab, dims.emb), &Device::Cpu)?)?;
        let fwd = Lstm::new(&mut rng, dims.emb, dims.hidden)?;
        let rev = if dims.bidirectional {
            Some(Lstm::new(&mut rng, dims.emb, dims.hidden)?)
        } else {
            None
        };
        Ok(Self { emb, fwd, rev })
    }

    /// The parameters, in [`encoder_param_names`] order.
    pub fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.emb.clone()];
        v.extend(self.fwd.vars());
        if let Some(r) = &self.rev {
            v.extend(r.vars());
        }
        v
    }

    /// Encodings `[B, encoding]`.
    pub fn forward(&self, x: &EncoderInput<'_>) -> candle_core::Result<Tensor> {
        let embed = |ids: &Tensor| self.emb.as_tensor().index_select(ids, 0);
        let mut enc = self.fwd.forward(&embed(x.ids)?, x.t, x.b, x.last)?;
        if let Some(rev) = &self.rev {
            let r = rev.forward(&embed(x.rev_ids)?, x.t, x.b, x.last)?;
            enc = Tensor::cat(&[enc, r], D::Minus1)?;
        }
        match x.dropout {
            Some(mask) => enc.mul(mask),
            None => Ok(enc),
        }
    }
}

/// Mean cross-entropy of `logits` `[B, C]` against `labels` `[B]` (u32).
pub fn loss(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(logits, labels)
}

/// Number of rows whose arg-max equals the label, and the arg-maxes.
pub fn predictions(logits: &Tensor) -> candle_core::Result<Vec<u32>> {
    logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()
}
