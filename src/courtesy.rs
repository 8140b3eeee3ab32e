//! `Courtesy`: give the GPU back without a checkpoint.
//!
//! [`Courtesy::yield_memory`](crate::Courtesy::yield_memory) moves the CUDA tensors of the var stores and
//! tensors it knows (and their gradients) to the CPU in place, with
//! `set_data`, so every handle to them (layers, an `nn::Optimizer`) stays
//! valid; then it empties the CUDA cache and says how many bytes the devices
//! got back and what stayed. [`Courtesy::yield_memory_with`](crate::Courtesy::yield_memory_with) moves an
//! optimizer's state (Adam's moments, momentum buffers) too, in place, so
//! training goes on bit-identically. [`Courtesy::restore`](crate::Courtesy::restore), or dropping the guard,
//! moves everything back. Nothing is lost on failure: a tensor that cannot
//! go back (out of memory) stays valid on the CPU, and `restore` can be
//! called again.

pub use crate::tools::courtesy::{Stayed, YieldCounts, YieldReport};
