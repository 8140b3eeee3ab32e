//! A peak watch: the highest allocator levels of one device over a stretch of
//! code, kept right while profiled functions (which reset the allocator's
//! peaks at every statement) run inside it.

use super::ledger;
use crate::backend::Backend;
use crate::device::Device;
use crate::error::Result;
use crate::stats::RawStats;

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

    /// The figures when the watch (or its last lap) started.
    pub fn started(&self) -> &RawStats {
        &self.start
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

impl PeakWatch {
    /// Ends the stretch watched so far and starts the next one at once, with
    /// one read of the allocator instead of the two of `finish` and `start`.
    /// Returns the figures of the stretch that ended, like
    /// [`finish`](Self::finish), and the watch of the next stretch; after an
    /// error there is no next stretch.
    pub fn lap(mut self) -> Result<(RawStats, RawStats, PeakWatch)> {
        let slot = self.slot.take().expect("an unfinished watch has a slot");
        let peaks = self.backend.peak_fields(self.device);
        let mut end = RawStats::default();
        // On an error the ledger frees the slot.
        ledger::probe(self.backend, self.device, slot, &mut end, peaks, true)?;
        // The next stretch starts at the current levels: right after the
        // reset every peak equals its level, which sits just before it.
        let mut next = end;
        for &i in peaks {
            next.0[i] = next.0[i - 1];
        }
        let start = std::mem::replace(&mut self.start, next);
        self.slot = Some(slot);
        Ok((start, end, self))
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
