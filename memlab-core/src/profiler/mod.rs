//! The line-profiler engine behind `#[memlab::profile]`.
//!
//! Each call of a profiled function is a [`Frame`]; generated code marks the
//! start of every statement, and each mark closes the interval of the statement
//! before it. For every interval memlab keeps, per allocator field, the level
//! after it, the highest level during it, and how much running totals grew.
//! Peaks of enclosing intervals survive the peak resets that inner intervals
//! need (see `ledger`), so a caller's line includes what its callees reached.

mod config;
mod frame;
mod ledger;
pub mod site;
mod watch;

pub use crate::output::{emit, set_output, set_warnings, Output};
pub use config::{
    default_columns, env_flag, is_enabled, set_default_columns, set_enabled, set_print_at_exit, set_target_device,
    set_target_gpu, target_device,
};
pub use frame::{BlockEnd, Busy, Frame, InStatement};
pub use ledger::{reset_peaks, reset_totals, MAX_CUDA_DEVICES, PEAK_FIELDS};
pub use site::{LineStats, Registered, Site, SiteMeta};
pub use watch::PeakWatch;
