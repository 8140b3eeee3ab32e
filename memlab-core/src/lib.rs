//! The backend-free core of memlab: the allocator statistics model, the
//! line-profiler engine and its reports. Users reach all of it through the
//! `memlab` crate; a backend (the libtorch one, or a scripted one in tests)
//! implements [`Backend`].
#![deny(missing_docs)]

mod backend;
pub mod device;
mod error;
pub mod events;
pub mod export;
pub mod hash;
pub mod kind;
pub mod oom;
pub mod output;
pub mod process;
pub mod profiler;
pub mod render;
pub mod report;
pub mod run;
pub mod sites;
pub mod stats;
pub mod sync;
pub mod thread;
pub mod time;

pub use backend::{Backend, ScriptedBackend};
pub use device::{Device, DeviceSelector, ParseDeviceError};
pub use error::{Error, Result};
pub use kind::TensorKind;
pub use report::{reset, Column, FunctionReport, LineReport, Report};
pub use stats::{DeviceStats, RawStats, Stat, StatArray};

#[doc(hidden)]
pub use inventory;
