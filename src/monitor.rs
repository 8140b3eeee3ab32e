//! `TrainingMonitor`: per-iteration memory of a training loop — cache, weights,
//! gradients, optimizer state, feature maps — printed every few iterations
//! and appended to CSV files.
//!
//! Call [`record_stats`](crate::TrainingMonitor::record_stats) after each iteration
//! and [`epoch_end`](crate::TrainingMonitor::epoch_end) after each epoch. Everything
//! is measured from the allocator and the model's storages; the optimizer's
//! state, which tch keeps inside its C++ optimizer, is measured as what stays
//! allocated besides weights and gradients, and an estimate for the optimizer
//! named with [`optimizer`](crate::TrainingMonitor::optimizer) is shown beside it,
//! labelled as one.

pub use crate::tools::monitor::{IterationRecord, TensorBytes};
