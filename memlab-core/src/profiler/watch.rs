//! A peak watch: the highest allocator levels of one device over a stretch of
//! code, kept right while profiled functions (which reset the allocator's
//! peaks at every statement) run inside it.

use super::ledger;
use crate::backend::Backend;
use crate::stats::RawStats;
use crate::{Device, Result};

/// Watches the peaks of one device from `start` to `finish`.
#[must_use = "a PeakWatch measures until finish() is called"]
pub struct PeakWatch {
    backend: &'static dyn Backend,
    device: Device,
    slot: Option<usize>,
    start: RawStats,
}

impl PeakWatch {
    /// Starts watching `device`.
    pub fn start(backend: &'static dyn Backend, device: Device) -> Result<PeakWatch> {
        let mut start = RawStats::default();
        let slot = ledger::open(backend, device, &mut start, backend.peak_fields(device))?;
        Ok(PeakWatch { backend, device, slot: Some(slot), start })
    }

    /// Stops watching. Returns the figures at the start, and at the end with
    /// every `*.peak` field holding the highest level reached in between.
    pub fn finish(mut self) -> Result<(RawStats, RawStats)> {
        let slot = self.slot.take().expect("a watch is finished once");
        let mut end = RawStats::default();
        ledger::probe(self.backend, self.device, slot, &mut end, self.backend.peak_fields(self.device), false)?;
        Ok((self.start, end))
    }
}

impl Drop for PeakWatch {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let mut end = RawStats::default();
            let peaks = self.backend.peak_fields(self.device);
            let _ = ledger::probe(self.backend, self.device, slot, &mut end, peaks, false);
        }
    }
}
