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
    /// No usable CUDA driver or device.
    #[error("cuda:{0} was requested but no CUDA driver or device is available")]
    CudaUnavailable(usize),
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

    /// Opens the device.
    pub fn device(&self) -> Result<Device, DeviceError> {
        match *self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => cuda::open(n),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    pub(super) fn open(n: usize) -> Result<Device, DeviceError> {
        if !candle_core::utils::cuda_is_available() {
            return Err(DeviceError::CudaUnavailable(n));
        }
        Device::new_cuda(n).map_err(|e| DeviceError::Backend(DeviceSpec::Cuda(n), e))
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;
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
}
