//! Devices as plain data on the wire (`cpu`, `cuda:N`), and their creation.
//!
//! CUDA sits behind the `cuda` feature (off by default). Without it, asking for a CUDA device
//! is an error, never a panic; with it, the driver is probed before any CUDA call.

use candle_core::Device;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Where a tensor lives: plain identity data, never a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

/// Why a device could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The text is not `cpu` or `cuda:N`.
    #[error("{0:?} is not a device (expected cpu or cuda:N)")]
    Parse(String),
    /// This build has no CUDA support.
    #[error(
        "cuda:{0} was requested but this build has no CUDA support (enable the `cuda` feature)"
    )]
    CudaNotCompiled(usize),
    /// This build has CUDA, but the driver or the device is missing; `cause` is the driver's
    /// answer (from `cuInit` and `cuDeviceGetCount`).
    #[error("cuda:{device} was requested but this machine cannot use it: {cause}")]
    CudaUnavailable {
        /// The device asked for.
        device: usize,
        /// Why not: the driver's error, or how many devices there are.
        cause: String,
    },
    /// The backend refused.
    #[error("cannot open {0}")]
    Backend(DeviceSpec, #[source] candle_core::Error),
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| DeviceError::Parse(s.to_owned())),
        }
    }
}

impl DeviceSpec {
    /// The spec of a candle device.
    pub fn of(d: &Device) -> Self {
        match d.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => Self::Cuda(gpu_id),
            _ => Self::Cpu,
        }
    }

    /// Opens the device. A CUDA device is probed first (the driver initialised, the ordinal
    /// below the device count), so a machine without a driver or GPU gets
    /// [`DeviceError::CudaUnavailable`] naming the driver's answer, never a panic.
    ///
    /// DEV-1: `cuda:N` is one device per process, on a stream of its own: every call returns
    /// the same candle device (so tensors received for `cuda:N` and a module's parameters on it
    /// combine without a copy), and its work is ordered on one stream whatever thread runs it.
    /// Use this rather than candle's `Device::new_cuda`, which makes a new device each call,
    /// on the calling thread's default stream: under tokio a kernel launched on one thread and
    /// a copy on another are then not ordered (seen on an H200 as diverging replicas and
    /// `CUDA_ERROR_INVALID_CONTEXT`).
    pub fn device(&self) -> Result<Device, DeviceError> {
        match *self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => {
                let count = cuda_devices().map_err(|e| e.for_device(n))?;
                if n >= count {
                    return Err(DeviceError::CudaUnavailable {
                        device: n,
                        cause: format!("the driver reports {count} CUDA device(s)"),
                    });
                }
                cuda::open(n)
            }
        }
    }

    /// `cuda:N` where this process can use it, else the CPU (PyTorch's
    /// `cuda if torch.cuda.is_available() else cpu`, per local rank).
    pub fn cuda_if_usable(n: usize) -> Self {
        match cuda_devices() {
            Ok(count) if n < count => Self::Cuda(n),
            _ => Self::Cpu,
        }
    }
}

impl DeviceError {
    fn for_device(self, n: usize) -> Self {
        match self {
            Self::CudaNotCompiled(_) => Self::CudaNotCompiled(n),
            Self::CudaUnavailable { cause, .. } => Self::CudaUnavailable { device: n, cause },
            other => other,
        }
    }
}

/// How many CUDA devices this process can use: the driver's count once `cuInit` succeeded.
/// Fails with [`DeviceError::CudaNotCompiled`] in a build without the `cuda` feature and with
/// [`DeviceError::CudaUnavailable`] (the driver's error) where the driver cannot start, such
/// as a machine without one running a CUDA build on the stub library of
/// `scripts/cuda-toolkit.sh`. Probed once per process.
pub fn cuda_devices() -> Result<usize, DeviceError> {
    cuda::count()
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cudarc::driver::{result, DriverError};
    use std::sync::OnceLock;

    fn describe(e: DriverError) -> String {
        let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
        let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
        match (name, text) {
            (Ok(name), Ok(text)) => format!("{name}: {text}"),
            _ => format!("CUDA driver error {}", e.0 as i32),
        }
    }

    pub(super) fn count() -> Result<usize, DeviceError> {
        static PROBE: OnceLock<Result<usize, String>> = OnceLock::new();
        let probed = PROBE.get_or_init(|| {
            result::init().map_err(|e| format!("cuInit failed: {}", describe(e)))?;
            let n = result::device::get_count()
                .map_err(|e| format!("cuDeviceGetCount failed: {}", describe(e)))?;
            Ok(usize::try_from(n).unwrap_or(0))
        });
        probed
            .clone()
            .map_err(|cause| DeviceError::CudaUnavailable { device: 0, cause })
    }

    /// DEV-1: one device per ordinal for the process's life, made on first use with a stream
    /// of its own (never the per-thread default stream).
    pub(super) fn open(n: usize) -> Result<Device, DeviceError> {
        static OPEN: OnceLock<std::sync::Mutex<Vec<Option<Device>>>> = OnceLock::new();
        let mut open = OPEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(Some(d)) = open.get(n) {
            return Ok(d.clone());
        }
        let d = candle_core::CudaDevice::new_with_stream(n)
            .map(Device::Cuda)
            .map_err(|e| DeviceError::Backend(DeviceSpec::Cuda(n), e))?;
        if open.len() <= n {
            open.resize(n + 1, None);
        }
        open[n] = Some(d.clone());
        Ok(d)
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;
    pub(super) fn count() -> Result<usize, DeviceError> {
        Err(DeviceError::CudaNotCompiled(0))
    }
    pub(super) fn open(n: usize) -> Result<Device, DeviceError> {
        Err(DeviceError::CudaNotCompiled(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_errors() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(1));
        assert!("tpu".parse::<DeviceSpec>().is_err());
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            DeviceSpec::Cuda(0).device(),
            Err(DeviceError::CudaNotCompiled(0))
        ));
        assert!(matches!(DeviceSpec::Cpu.device(), Ok(Device::Cpu)));
    }

    /// Without a usable GPU (no `cuda` feature, or a CUDA build on a machine without a driver
    /// or device), every CUDA request fails naming the device and the cause, and
    /// `cuda_if_usable` falls back to the CPU. With a GPU, the count is the driver's.
    #[test]
    fn cuda_requests_name_the_device_and_the_cause() {
        match cuda_devices() {
            Ok(count) => {
                assert_eq!(DeviceSpec::cuda_if_usable(0), DeviceSpec::Cuda(0));
                let err = DeviceSpec::Cuda(count).device().unwrap_err();
                assert!(err.to_string().contains(&format!("cuda:{count}")), "{err}");
                assert!(err.to_string().contains("device(s)"), "{err}");
            }
            Err(e) => {
                eprintln!("no usable CUDA here: {e}");
                assert_eq!(DeviceSpec::cuda_if_usable(0), DeviceSpec::Cpu);
                let err = DeviceSpec::Cuda(2).device().unwrap_err();
                assert!(err.to_string().starts_with("cuda:2 was requested"), "{err}");
                #[cfg(feature = "cuda")]
                assert!(
                    matches!(err, DeviceError::CudaUnavailable { device: 2, .. }),
                    "{err}"
                );
            }
        }
    }
}
