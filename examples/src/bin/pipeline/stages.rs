//! The pipeline's stages: the encoder (embedding and LSTM, hybrid-rnn's) and blocks of fully
//! connected layers, as `autograd_dist::Module`s so that they can be built on stage workers.
//!
//! Layer `i` of the fully connected part is initialized from `seed` and `i` alone, so the model
//! is the same however it is cut into stages (and in one process).

use std::sync::Arc;

use autograd_dist::{DeviceSpec, Module};
use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use examples::lang::model::{Dims, Encoder, EncoderInput};

/// The first stage. Its input is `[words, T + 1]` u32: each row a word's character ids,
/// right-padded with 0, then the position of its last character.
pub struct EncoderStage(Encoder);

impl Module for EncoderStage {
    const NAME: &'static str = "pipeline::EncoderStage";
    type Init = (Dims, u64);

    fn new((dims, seed): (Dims, u64), device: &Device) -> candle_core::Result<Self> {
        if !device.is_cpu() {
            return Err(candle_core::Error::Msg(
                "the encoder's LSTM runs on the CPU only".into(),
            ));
        }
        Ok(Self(Encoder::new(&dims, seed)?))
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t1) = x.dims2()?;
        let t = t1.saturating_sub(1).max(1);
        let rows: Vec<Vec<u32>> = x.to_vec2()?;
        let (mut ids, mut rev) = (vec![0u32; t * b], vec![0u32; t * b]);
        let mut last = Vec::with_capacity(b);
        for (j, row) in rows.iter().enumerate() {
            let l = row[t1 - 1] as usize;
            for k in 0..t {
                ids[k * b + j] = row[k];
                if k <= l && l < t {
                    rev[k * b + j] = row[l - k];
                }
            }
            last.push(l as u32);
        }
        let dev = Device::Cpu;
        self.0.forward(&EncoderInput {
            ids: &Tensor::from_vec(ids, t * b, &dev)?,
            rev_ids: &Tensor::from_vec(rev, t * b, &dev)?,
            last: &Arc::new(last),
            t,
            b,
            dropout: None,
        })
    }

    fn parameters(&self) -> Vec<Var> {
        self.0.vars()
    }
}

/// What builds an [`MlpStage`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MlpInit {
    /// Widths: input, then each layer's output.
    pub widths: Vec<usize>,
    /// The index of this block's first layer in the whole fully connected part (its seeds).
    pub first_layer: usize,
    /// ReLU after the block's last layer too (every block but the classifier's).
    pub relu_last: bool,
    /// The model's seed.
    pub seed: u64,
    /// A second device for the block's second half (`NetShard2`'s split), if any.
    pub second: Option<DeviceSpec>,
}

/// A block of fully connected layers, `Linear → ReLU → …`, optionally split over two devices.
pub struct MlpStage {
    layers: Vec<(Var, Var, Device)>,
    relu_last: bool,
}

impl MlpStage {
    /// The block, on `device` (its second half on `init.second`).
    pub fn build(init: MlpInit, device: &Device) -> candle_core::Result<Self> {
        let n = init.widths.len().saturating_sub(1);
        let second = match &init.second {
            Some(d) => d
                .device()
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?,
            None => device.clone(),
        };
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let (inp, out) = (init.widths[i], init.widths[i + 1]);
            let mut rng = ChaCha8Rng::seed_from_u64(
                init.seed ^ (0x5eed_0000 + (init.first_layer + i) as u64),
            );
            let bound = 1.0 / (inp as f32).sqrt();
            let mut draw = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-bound..bound)).collect()
            };
            let dev = if 2 * i < n { device } else { &second };
            // Kept as `[in, out]` (the same values as PyTorch's `[out, in]`, transposed once):
            // the forward multiplies by it directly, and its gradient comes out in its layout.
            let w = Tensor::from_vec(draw(out * inp), (out, inp), &Device::Cpu)?
                .t()?
                .contiguous()?
                .to_device(dev)?;
            let b = Tensor::from_vec(draw(out), out, &Device::Cpu)?.to_device(dev)?;
            layers.push((Var::from_tensor(&w)?, Var::from_tensor(&b)?, dev.clone()));
        }
        Ok(Self {
            layers,
            relu_last: init.relu_last,
        })
    }
}

impl Module for MlpStage {
    const NAME: &'static str = "pipeline::MlpStage";
    type Init = MlpInit;

    fn new(init: MlpInit, device: &Device) -> candle_core::Result<Self> {
        Self::build(init, device)
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let home = x.device().clone();
        let mut h = x.clone();
        for (i, (w, b, dev)) in self.layers.iter().enumerate() {
            // The weight's gradient written once by the stage's backward (`grad_once`).
            h = autograd_dist::grad_once::matmul(&h.to_device(dev)?, w.as_tensor())?
                .broadcast_add(b.as_tensor())?;
            if i + 1 < self.layers.len() || self.relu_last {
                h = h.relu()?;
            }
        }
        h.to_device(&home)
    }

    fn parameters(&self) -> Vec<Var> {
        self.layers
            .iter()
            .flat_map(|(w, b, _)| [w.clone(), b.clone()])
            .collect()
    }
}

/// The fully connected part's widths (`encoding`, `layers` x `width`, `classes`) cut into
/// `blocks` contiguous blocks of layers, as even as can be: each block's widths.
pub fn mlp_blocks(
    encoding: usize,
    width: usize,
    layers: usize,
    classes: usize,
    blocks: usize,
) -> Vec<(usize, Vec<usize>)> {
    let mut widths = vec![encoding];
    widths.extend(std::iter::repeat_n(width, layers));
    widths.push(classes);
    let n = widths.len() - 1; // linear layers
    let blocks = blocks.clamp(1, n);
    let (base, extra) = (n / blocks, n % blocks);
    let mut at = 0;
    (0..blocks)
        .map(|k| {
            let len = base + usize::from(k < extra);
            let block = (at, widths[at..=at + len].to_vec());
            at += len;
            block
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_layer_once_in_order() {
        let b = mlp_blocks(128, 512, 4, 7, 3);
        assert_eq!(
            b,
            vec![
                (0, vec![128, 512, 512]),
                (2, vec![512, 512, 512]),
                (4, vec![512, 7])
            ]
        );
        assert_eq!(
            mlp_blocks(8, 4, 1, 2, 5),
            vec![(0, vec![8, 4]), (1, vec![4, 2])]
        );
    }

    #[test]
    fn a_model_cut_in_blocks_computes_what_the_whole_does() {
        let init = |first_layer, widths: Vec<usize>, relu_last| MlpInit {
            widths,
            first_layer,
            relu_last,
            seed: 3,
            second: Some(DeviceSpec::Cpu),
        };
        let whole = MlpStage::build(init(0, vec![6, 5, 4, 3], false), &Device::Cpu).unwrap();
        let a = MlpStage::build(init(0, vec![6, 5], true), &Device::Cpu).unwrap();
        let b = MlpStage::build(init(1, vec![5, 4, 3], false), &Device::Cpu).unwrap();
        let x = Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((2, 6))
            .unwrap();
        let y1 = whole.forward(&x).unwrap();
        let y2 = b.forward(&a.forward(&x).unwrap()).unwrap();
        let d: f32 = (y1 - y2)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(d, 0.0);
    }
}
