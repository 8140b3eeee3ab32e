//! `MemReporter`: what occupies memory, by name.
//!
//! It walks the var stores and tensors it was given (or that were registered),
//! counts each storage once (views share one), adds gradients as
//! `<name>.grad`, and sets the total against the allocator's own figure. Every
//! byte the allocator holds lands in a row: named storages, unnamed live
//! allocations (listed with where they were allocated while a
//! [`Recording`](crate::Recording) or dispose scope is on), what could not be
//! attributed, and on CUDA the rounding to the allocator's block sizes.

pub use crate::tools::reporter::{DeviceReport, MemReport, OptimizerReport, Row, RowKind};
