//! The seam between the backend-free engine and an allocator: a backend reads a
//! device's figures and resets its peaks. `memlab-tch` provides the libtorch
//! one; tests provide scripted ones.

use crate::{Device, RawStats, Result};

/// A source of allocator statistics.
pub trait Backend: Send + Sync {
    /// Fills `out` with every figure of `device` and, when `reset_peaks` is true,
    /// sets each peak to its current level right after reading it.
    ///
    /// A device whose allocator has not been used yet reads as all zeros.
    fn sample(&self, device: Device, out: &mut RawStats, reset_peaks: bool) -> Result<()>;

    /// Sets the running totals (`*.allocated`, `*.freed`, `num_*`) of `device`
    /// to zero, writing into `taken` the values they had when they were reset.
    fn reset_totals(&self, device: Device, taken: &mut RawStats) -> Result<()>;

    /// The fields of [`RawStats`] that `sample` fills for `device`; the others
    /// always read zero there, and the profiler skips them.
    fn fields(&self, device: Device) -> &'static [usize] {
        let _ = device;
        &crate::stats::ALL_FIELDS
    }

    /// The peak fields among [`Backend::fields`].
    fn peak_fields(&self, device: Device) -> &'static [usize] {
        let _ = device;
        &crate::profiler::PEAK_FIELDS
    }

    /// The number of CUDA devices this process can use (0 without CUDA).
    fn cuda_device_count(&self) -> usize;

    /// The calling thread's current CUDA device.
    fn current_cuda_device(&self) -> Result<usize>;
}
