//! memlab's error type. Every failure the allocators or the CUDA runtime report
//! comes back as one of these, with a message that says what to do.

/// An error from memlab.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device string did not parse.
    #[error("`{0}` is not a device: write `cpu`, `cuda` or `cuda:N`")]
    InvalidDevice(String),
    /// A CUDA device was asked for, but this process cannot use it.
    #[error("{device} is not available: this process sees {count} CUDA device(s); profile `cpu`, or use `auto` to pick CUDA only where it exists")]
    DeviceUnavailable {
        /// The device asked for.
        device: crate::Device,
        /// How many CUDA devices the process sees.
        count: usize,
    },
    /// CPU figures were asked for but memlab's counting CPU allocator is not in place.
    #[error("memlab's counting CPU allocator is not installed ({0})")]
    CpuAllocatorMissing(String),
    /// libtorch raised an exception; its message is kept.
    #[error("libtorch: {0}")]
    Torch(String),
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
    /// Writing a report failed.
    #[error("could not write the report: {0}")]
    Io(String),
}

/// memlab's result type.
pub type Result<T> = std::result::Result<T, Error>;
