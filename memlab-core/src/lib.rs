//! The backend-free core of memlab: the allocator statistics model, the
//! line-profiler engine and its reports. Users reach all of it through the
//! `memlab` crate; a backend (the libtorch one, or a scripted one in tests)
//! implements [`Backend`].
#![deny(missing_docs)]

mod backend;
pub mod device;
mod dtype;
mod error;
pub mod events;
pub mod export;
pub mod format;
pub mod kind;
pub mod oom;
pub mod ops;
pub mod profiler;
pub mod render;
pub mod replay;
pub mod report;
pub mod run;
pub mod stats;
pub mod units;
mod verdict;

// memlab's own plumbing, public because memlab's other crates use it (and
// every copy of memlab must reach the same process-wide state through it),
// not API: process-wide state, the output layer, the profiler's tables
// of profiled functions, the fast hasher, locks, threads and time stamps.
#[doc(hidden)]
pub mod hash;
#[doc(hidden)]
pub mod output;
#[doc(hidden)]
pub mod process;
#[doc(hidden)]
pub mod profiled;
#[doc(hidden)]
pub mod sync;
#[doc(hidden)]
pub mod thread;
#[doc(hidden)]
pub mod time;

pub use backend::{Backend, ScriptedBackend};
pub use device::{Device, DeviceSelector, ParseDeviceError};
pub use dtype::DType;
pub use error::{Error, Result};
pub use kind::TensorKind;
pub use report::{reset, FunctionReport, LineReport, ProfileColumn, Report};
pub use stats::{DeviceStats, RawStats, Stat, StatArray};

#[doc(hidden)]
pub use inventory;
