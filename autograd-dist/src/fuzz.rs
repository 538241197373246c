//! Entry point for fuzzing tensor decoding (the `fuzz/` crate's `tensor` target; `cargo test`
//! replays seeds and mutations of them). Not an API.

use candle_core::{DType, Device, Tensor};
use rpc_core::ext::Payload;

use crate::tensor::{to_bytes, RTensor};

/// A tensor as a receiving worker decodes it: the input is an encoded [`Payload`] (an
/// envelope's bytes and its blob side table); a tensor that decodes must hold exactly the
/// bytes its blob carried, and be usable.
pub fn tensor(data: &[u8]) {
    let Ok(payload) = bincode::deserialize::<Payload>(data) else {
        return;
    };
    let Ok(RTensor(t)) = payload.clone().decode::<RTensor>(None) else {
        return;
    };
    let bytes = to_bytes(&t).expect("a decoded tensor reads back");
    let elems: usize = t.dims().iter().product();
    assert_eq!(bytes.len(), elems * t.dtype().size_in_bytes().max(1));
    if t.dtype().is_float() && !matches!(t.dtype(), DType::F8E4M3) {
        let _ = t.sum_all().and_then(|s| s.to_dtype(DType::F64));
    }
}

/// Well-formed inputs for [`tensor`]: tensors of several dtypes and shapes, encoded.
pub fn seeds() -> Vec<Vec<u8>> {
    let cpu = &Device::Cpu;
    let tensors = [
        Tensor::arange(0f32, 12., cpu).and_then(|t| t.reshape((3, 4))),
        Tensor::arange(0u32, 5, cpu),
        Tensor::arange(0i64, 8, cpu).and_then(|t| t.reshape((2, 2, 2))),
        Tensor::zeros((2, 3), DType::BF16, cpu),
        Tensor::zeros((), DType::F64, cpu),
        Tensor::zeros((0, 4), DType::U8, cpu),
    ];
    tensors
        .into_iter()
        .map(|t| {
            let p = Payload::encode(&RTensor(t.expect("a tensor")), None).expect("encodes");
            bincode::serialize(&p).expect("encodes")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn seeds_and_their_mutations_decode_without_a_finding() {
        let seeds = super::seeds();
        let decoded = seeds
            .iter()
            .filter(|s| {
                bincode::deserialize::<rpc_core::ext::Payload>(s)
                    .ok()
                    .and_then(|p| p.decode::<crate::RTensor>(None).ok())
                    .is_some()
            })
            .count();
        assert_eq!(decoded, seeds.len(), "every seed is a tensor");
        rpc_core::testing::replay_fuzz_target("tensor", &seeds, 3_000, super::tensor);
    }
}
