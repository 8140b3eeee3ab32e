//! The backend-free core of memlab: the allocator statistics model, the
//! line-profiler engine and its reports. Users reach all of it through the
//! `memlab` crate; backends (such as `memlab-tch`) implement [`Backend`].
#![deny(missing_docs)]

mod backend;
mod error;
pub mod events;
pub mod hash;
pub mod output;
pub mod profiler;
pub mod render;
pub mod report;
pub mod sites;
pub mod stats;

pub use backend::{Backend, ScriptedBackend};
pub use error::{Error, Result};
pub use report::{format_bytes, reset, Column, FunctionReport, LineReport, Report};
pub use stats::{Device, DeviceSelector, DeviceStats, RawStats, Stat, StatArray};

#[doc(hidden)]
pub use inventory;
