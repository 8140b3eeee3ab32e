//! The devices memlab reads figures for, and how a profiled function picks
//! one. The bottom layer of memlab-core: it imports no other module (a string
//! that is no device is a [`ParseDeviceError`], which [`Error`](crate::error::Error)
//! takes in with `?`).

use std::fmt;
use std::str::FromStr;

/// A memory device that memlab can read figures for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory held by CPU tensors (read from memlab's counting CPU allocator).
    Cpu,
    /// The CUDA device of this ordinal (read from libtorch's caching allocator).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl serde::Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Reads what `Serialize` writes (`cpu`, `cuda:N`).
impl<'de> serde::Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl FromStr for Device {
    type Err = ParseDeviceError;

    /// Parses `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, ParseDeviceError> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("cpu") {
            return Ok(Device::Cpu);
        }
        if s.eq_ignore_ascii_case("cuda") {
            return Ok(Device::Cuda(0));
        }
        if let Some(idx) = s.strip_prefix("cuda:") {
            if let Ok(i) = idx.parse::<usize>() {
                return Ok(Device::Cuda(i));
            }
        }
        Err(ParseDeviceError(s.to_string()))
    }
}

/// Which device a profiled function measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceSelector {
    /// The current CUDA device when CUDA is available, otherwise the CPU.
    Auto,
    /// The CUDA device that is current when the function is entered.
    CurrentCuda,
    /// This exact device.
    Fixed(Device),
}

impl fmt::Display for DeviceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSelector::Auto => f.write_str("auto"),
            DeviceSelector::CurrentCuda => f.write_str("cuda"),
            DeviceSelector::Fixed(d) => d.fmt(f),
        }
    }
}

impl FromStr for DeviceSelector {
    type Err = ParseDeviceError;

    /// Parses `auto`, `cuda` (the current CUDA device), `cuda:N` or `cpu`.
    fn from_str(s: &str) -> Result<Self, ParseDeviceError> {
        match s.trim() {
            t if t.eq_ignore_ascii_case("auto") => Ok(DeviceSelector::Auto),
            t if t.eq_ignore_ascii_case("cuda") => Ok(DeviceSelector::CurrentCuda),
            t => t.parse().map(DeviceSelector::Fixed),
        }
    }
}

/// A string that names no device; [`Error::InvalidDevice`](crate::error::Error::InvalidDevice)
/// once converted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseDeviceError(pub String);

impl fmt::Display for ParseDeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` is not a device: write `cpu`, `cuda` or `cuda:N`", self.0)
    }
}

impl std::error::Error for ParseDeviceError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert_eq!("auto".parse::<DeviceSelector>().unwrap(), DeviceSelector::Auto);
        assert_eq!("cuda".parse::<DeviceSelector>().unwrap(), DeviceSelector::CurrentCuda);
        let wrong = "gpu".parse::<Device>().unwrap_err();
        assert_eq!(wrong.to_string(), "`gpu` is not a device: write `cpu`, `cuda` or `cuda:N`");
        let wrong: crate::error::Error = wrong.into();
        assert_eq!(wrong, crate::error::Error::InvalidDevice("gpu".into()));
        assert_eq!(wrong.to_string(), "`gpu` is not a device: write `cpu`, `cuda` or `cuda:N`");
    }
}
