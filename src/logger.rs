//! `StepLogger`: RAM, GPU memory and time of a step, a block or a closure, in
//! the manner of ipygpulogger: for general RAM (the process's resident set)
//! and for the GPU, what the step consumed, how far it peaked above that, what
//! is used after it and the total, and how long it took.
//!
//! The GPU figures come from libtorch's allocator (exact, peak included) and,
//! where a driver is present, from the driver: device-wide use and its peak,
//! sampled by a background thread during the step (they catch memory outside
//! libtorch, such as other libraries' workspaces or other processes), and this
//! process's own use from NVML (the `cuda-driver` and `nvml` features, on by
//! default: a build without one leaves those figures `None`). The same
//! thread samples the resident set every millisecond; the RAM figures come
//! from its readings unless
//! [`StepLogger::exact_ram`](crate::StepLogger::exact_ram) reads the resident set at the step's ends and
//! [`StepLogger::exact_ram_peak`](crate::StepLogger::exact_ram_peak) takes the peak from the kernel's
//! high-water mark. By default, then, the step's own thread reads only the
//! allocator and the clock, and logging every step of a training loop costs
//! it a few microseconds.

pub use crate::tools::logger::{host_memory, rss, GpuFigures, RamFigures, StepData};
