//! memlab's error type. Every failure comes back as one of these, one variant
//! per cause, with a message that says what went wrong and what to do.

use std::sync::Arc;

use crate::device::{Device, ParseDeviceError};

/// An error from memlab.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device string did not parse.
    #[error("`{0}` is not a device: write `cpu`, `cuda` or `cuda:N`")]
    InvalidDevice(String),
    /// A CUDA device was asked for, but this process cannot use it.
    #[error("{device} is not available: this process sees {count} CUDA device(s); profile `cpu`, or use `auto` to pick CUDA only where it exists")]
    DeviceUnavailable {
        /// The device asked for.
        device: Device,
        /// How many CUDA devices the process sees.
        count: usize,
    },
    /// CPU figures were asked for but memlab's counting CPU allocator is not in place.
    #[error("memlab's counting CPU allocator is not installed ({0})")]
    CpuAllocatorMissing(String),
    /// libtorch raised an exception or returned an error; its message is kept.
    #[error("libtorch: {0}")]
    Backend(String),
    /// An argument memlab cannot work with; the message says what it takes.
    #[error("{0}")]
    InvalidArgument(String),
    /// A tensor that a dispose scope does not answer for.
    #[error("scope `{scope}` did not allocate this tensor's storage ({why})")]
    NotInScope {
        /// The scope's name.
        scope: String,
        /// Why not, and what to do.
        why: String,
    },
    /// The CUDA driver or NVML cannot be used here.
    #[error("no GPU driver figures: {0}")]
    DriverUnavailable(String),
    /// A statistic name is not one of `torch.cuda.memory_stats()`'s keys.
    #[error(
        "`{0}` is not a statistic: use a memory_stats() key such as `active_bytes.all.peak`, or `increment` / `hits`"
    )]
    UnknownStat(String),
    /// No profiled function has this name.
    #[error("no profiled function is named `{name}`; profiled functions: {known}")]
    UnknownFunction {
        /// The name asked for.
        name: String,
        /// The profiled functions, comma-separated.
        known: String,
    },
    /// Several profiled functions end with this name.
    #[error("`{name}` names several profiled functions; write more of the path: {}", candidates.join(", "))]
    AmbiguousFunction {
        /// The name asked for.
        name: String,
        /// The functions it matches.
        candidates: Vec<String>,
    },
    /// An optimizer's state cannot be read: its var store was not given, or
    /// it is not an optimizer memlab knows how to read.
    #[error("memlab cannot read this optimizer's state: {0}")]
    Optimizer(String),
    /// A file is not a memory snapshot memlab can read.
    #[error("cannot read {file}: {why}")]
    UnreadableSnapshot {
        /// The file.
        file: String,
        /// What is wrong with it, and what to do.
        why: String,
    },
    /// A file is none that memlab reads, or cannot be opened (see
    /// `memlab_core::format`).
    #[error("cannot read {file}: {why}")]
    UnreadableFile {
        /// The file.
        file: String,
        /// What is wrong with it, and what to do.
        why: String,
    },
    /// Reading or writing failed.
    #[error("could not {what}: {source}")]
    Io {
        /// What memlab was doing, e.g. `write the report as CSV`.
        what: String,
        /// The I/O error.
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl Error {
    /// An [`Error::Io`] for `what` memlab was doing.
    pub fn io(what: impl Into<String>, source: impl Into<std::io::Error>) -> Error {
        Error::Io { what: what.into(), source: Arc::new(source.into()) }
    }
}

impl From<ParseDeviceError> for Error {
    fn from(e: ParseDeviceError) -> Error {
        Error::InvalidDevice(e.0)
    }
}

/// Errors compare by cause and message; I/O errors by what was being done and
/// the error's kind and text.
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        match (self, other) {
            (Error::Io { what: a, source: x }, Error::Io { what: b, source: y }) => {
                a == b && x.kind() == y.kind() && x.to_string() == y.to_string()
            }
            (Error::Io { .. }, _) | (_, Error::Io { .. }) => false,
            _ => std::mem::discriminant(self) == std::mem::discriminant(other) && self.to_string() == other.to_string(),
        }
    }
}

impl Eq for Error {}

/// memlab's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_keep_their_source_and_compare() {
        let err = Error::io("write the report as CSV", std::io::Error::new(std::io::ErrorKind::WriteZero, "full"));
        assert_eq!(err.to_string(), "could not write the report as CSV: full");
        let source = std::error::Error::source(&err).expect("the I/O error is kept");
        assert_eq!(source.to_string(), "full");
        assert_eq!(err.clone(), err);
        assert_ne!(err, Error::io("read", std::io::Error::new(std::io::ErrorKind::WriteZero, "full")));
        assert_ne!(Error::Backend("x".into()), Error::InvalidArgument("x".into()), "the cause is part of the error");
    }
}
