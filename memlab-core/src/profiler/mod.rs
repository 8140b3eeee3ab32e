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
#[cfg(test)]
mod tests;
mod watch;

pub use crate::output::{emit, set_output, set_warnings, Output};
pub use crate::profiled::{LineStats, ProfiledFn, ProfiledFnMeta, Registered};
pub use crate::report::{default_columns, set_default_columns};
pub use crate::stats::PEAK_FIELDS;
pub use config::{
    env_flag, is_enabled, set_enabled, set_print_at_exit, set_target_device, set_target_gpu, target_device, FLAG_OFF,
    FLAG_ON,
};
pub use frame::{BlockEnd, Busy, Frame, InStatement};
pub use ledger::{read, reset_peaks, reset_totals, MAX_CUDA_DEVICES};
pub use watch::PeakWatch;
