//! [`RTensor`]: a candle tensor that is a valid argument or result of any call.
//!
//! On the wire a tensor is its dtype, shape and device location (plain data) plus its bytes as
//! a [`Blob`], which rides in the envelope's side table: large tensors take the bulk path, and
//! no element goes through serde. Sending gathers the elements once into a new buffer (strided
//! tensors included: the strides are walked directly, with no intermediate contiguous copy);
//! receiving builds the tensor from that buffer with one copy. A tensor on a CUDA device costs
//! the same two: one device-to-host copy into the buffer sent (contiguous tensors; a strided
//! one is first gathered by candle), one host-to-device copy into the tensor received on the
//! mapped device; both from pageable memory, which the driver stages through its own pinned
//! buffers. Inside a distributed autograd
//! context the same hook records the send and recv functions (see `record.rs`).

use bytes::Bytes;
use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor, WithDType};
use rpc_core::ext::MessageContext;
use rpc_core::Blob;
use serde::de::{self, Deserializer};
use serde::ser::{self, Serializer};
use serde::{Deserialize, Serialize};

use crate::device::DeviceSpec;
use crate::devmap;
use crate::record::{self, Tag};

/// A tensor that can be sent in RPC arguments and results (alone or inside any serde type).
///
/// ```
/// use autograd_dist::RTensor;
/// use candle_core::{Device, Tensor};
/// let t = RTensor::from(Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?);
/// assert_eq!(t.dims(), &[2, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct RTensor(pub Tensor);

impl RTensor {
    /// The elements in row-major order as little-endian bytes (what travels on the wire),
    /// gathered in one pass whatever the layout.
    pub fn to_le_bytes(&self) -> candle_core::Result<Bytes> {
        to_bytes(&self.0)
    }
}

impl From<Tensor> for RTensor {
    fn from(t: Tensor) -> Self {
        Self(t)
    }
}

impl From<RTensor> for Tensor {
    fn from(t: RTensor) -> Self {
        t.0
    }
}

impl std::ops::Deref for RTensor {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.0
    }
}

#[derive(Serialize, Deserialize)]
struct Wire {
    dtype: String,
    shape: Vec<usize>,
    device: DeviceSpec,
    data: Blob,
    tag: Option<Tag>,
}

/// Bytes owned by a typed vector, without copying them.
struct VecBytes<T>(Vec<T>);

impl<T: WithDType> AsRef<[u8]> for VecBytes<T> {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `T` is one of candle's plain numeric element types (no padding, every bit
        // pattern initialized); the slice covers exactly the vector's initialized elements.
        unsafe {
            std::slice::from_raw_parts(
                self.0.as_ptr().cast::<u8>(),
                std::mem::size_of_val(self.0.as_slice()),
            )
        }
    }
}

/// Visits the storage offsets of a layout in row-major order.
fn offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let dims = layout.dims();
    let strides = layout.stride();
    let n: usize = dims.iter().product();
    let mut idx = vec![0usize; dims.len()];
    let mut off = layout.start_offset();
    (0..n).map(move |k| {
        let cur = off;
        if k + 1 < n {
            for d in (0..dims.len()).rev() {
                idx[d] += 1;
                off += strides[d];
                if idx[d] < dims[d] {
                    break;
                }
                off -= strides[d] * dims[d];
                idx[d] = 0;
            }
        }
        cur
    })
}

fn gather<T: WithDType>(data: &[T], layout: &Layout) -> Bytes {
    let v: Vec<T> = match layout.contiguous_offsets() {
        Some((a, b)) => data[a..b].to_vec(),
        None => offsets(layout).map(|i| data[i]).collect(),
    };
    Bytes::from_owner(VecBytes(v))
}

/// The tensor's elements in row-major order, gathered once.
pub(crate) fn to_bytes(t: &Tensor) -> candle_core::Result<Bytes> {
    if !matches!(t.device(), Device::Cpu) {
        #[cfg(feature = "cuda")]
        if let Some(b) = cuda::to_bytes(t)? {
            return Ok(b);
        }
        return to_bytes(&t.to_device(&Device::Cpu)?);
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("tensor storage is not on the CPU")
    };
    let raw = |v: &Vec<u8>| -> candle_core::Result<Bytes> {
        match layout.contiguous_offsets() {
            Some((a, b)) => Ok(Bytes::copy_from_slice(&v[a..b])),
            None => candle_core::bail!(
                "non-contiguous tensors of packed dtype {:?} cannot be sent",
                t.dtype()
            ),
        }
    };
    Ok(match cpu {
        CpuStorage::U8(v) => gather(v, layout),
        CpuStorage::U32(v) => gather(v, layout),
        CpuStorage::I16(v) => gather(v, layout),
        CpuStorage::I32(v) => gather(v, layout),
        CpuStorage::I64(v) => gather(v, layout),
        CpuStorage::BF16(v) => gather(v, layout),
        CpuStorage::F16(v) => gather(v, layout),
        CpuStorage::F32(v) => gather(v, layout),
        CpuStorage::F64(v) => gather(v, layout),
        CpuStorage::F8E4M3(v) => gather(v, layout),
        CpuStorage::F6E2M3(v)
        | CpuStorage::F6E3M2(v)
        | CpuStorage::F4(v)
        | CpuStorage::F8E8M0(v) => raw(v)?,
    })
}

/// A contiguous CUDA tensor's elements copied from the device straight into the buffer that
/// is sent (one device-to-host copy; through candle's `to_device` and the gather it would be
/// two). Strided tensors and packed dtypes take candle's path (`None`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    pub(super) fn to_bytes(t: &Tensor) -> candle_core::Result<Option<Bytes>> {
        let (storage, layout) = t.storage_and_layout();
        let (Storage::Cuda(cs), Some((a, b))) = (&*storage, layout.contiguous_offsets()) else {
            return Ok(None);
        };
        let stream = cs.device.cuda_stream();
        macro_rules! dtoh {
            ($t:ty) => {{
                let view = cs.as_cuda_slice::<$t>()?.slice(a..b);
                let v = stream.clone_dtoh(&view).map_err(candle_core::Error::wrap)?;
                Bytes::from_owner(VecBytes(v))
            }};
        }
        Ok(Some(match t.dtype() {
            DType::U8 => dtoh!(u8),
            DType::U32 => dtoh!(u32),
            DType::I16 => dtoh!(i16),
            DType::I32 => dtoh!(i32),
            DType::I64 => dtoh!(i64),
            DType::BF16 => dtoh!(half::bf16),
            DType::F16 => dtoh!(half::f16),
            DType::F32 => dtoh!(f32),
            DType::F64 => dtoh!(f64),
            _ => return Ok(None),
        }))
    }
}

/// The name candle parses back with `DType::from_str`.
fn dtype_name(d: DType) -> &'static str {
    d.as_str()
}

impl Serialize for RTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let data = to_bytes(&self.0).map_err(ser::Error::custom)?;
        let here = DeviceSpec::of(self.0.device());
        let (tag, device) = match MessageContext::current() {
            Some(msg) => {
                record::check_unrecorded(&msg, &self.0).map_err(ser::Error::custom)?;
                (
                    record::record_send(&msg, &self.0),
                    devmap::target(msg.agent(), msg.peer().0, msg.kind(), here),
                )
            }
            None => (None, here),
        };
        Wire {
            dtype: dtype_name(self.0.dtype()).to_owned(),
            shape: self.0.dims().to_vec(),
            device,
            data: Blob::new(data),
            tag,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for RTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        let dtype: DType = w
            .dtype
            .parse()
            .map_err(|e| de::Error::custom(format!("unknown dtype {:?}: {e}", w.dtype)))?;
        let device = w.device.device().map_err(de::Error::custom)?;
        // Candle stores its packed formats (size 0: F4, F6) a byte per element.
        let size = dtype.size_in_bytes().max(1);
        let expected = w
            .shape
            .iter()
            .try_fold(size, |n, &d| n.checked_mul(d))
            .ok_or_else(|| de::Error::custom(format!("tensor shape {:?} is too large", w.shape)))?;
        if w.data.len() != expected {
            return Err(de::Error::custom(format!(
                "tensor data has {} bytes, shape {:?} of {} needs {expected}",
                w.data.len(),
                w.shape,
                w.dtype
            )));
        }
        let t = Tensor::from_raw_buffer(&w.data, dtype, &w.shape, &device)
            .map_err(de::Error::custom)?;
        let t = match (w.tag, MessageContext::current()) {
            (Some(tag), Some(msg)) => {
                record::record_recv(&msg, tag, t).map_err(de::Error::custom)?
            }
            _ => t,
        };
        Ok(Self(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::IndexOp;

    #[test]
    fn strided_offsets_follow_row_major_order() {
        let t = Tensor::arange(0u32, 24, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let p = t.permute((2, 0, 1)).unwrap().i((1.., .., 1..)).unwrap();
        assert!(!p.is_contiguous());
        let bytes = to_bytes(&p).unwrap();
        let got: Vec<u32> = bytes
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, p.flatten_all().unwrap().to_vec1::<u32>().unwrap());
    }
}
