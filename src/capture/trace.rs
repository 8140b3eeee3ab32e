//! The trace captured from this process: each device's figures read from
//! libtorch consistently with the recording's history, walked back by
//! [`Trace::from_history`].

use std::collections::BTreeMap;

use memlab_core::events::{self, Event};
use memlab_core::export::{Anchor, Trace};
use memlab_core::{Device, Result};

/// The recording's history and its counts, with each device's figures read
/// consistently with it (see [`Anchor`]). CUDA's allocator records its
/// events under its own lock, which the recorder's hook takes under it: its
/// figures are read outside the recorder's lock, between two equal counts of
/// events. The CPU's counters move under the recorder's lock while it
/// records: they are read under it.
pub(crate) fn history_with_anchors() -> Result<(Vec<Event>, events::Stats, BTreeMap<Device, Anchor>)> {
    /// Tries before the figures are taken as they are (a device whose
    /// events never pause for a microsecond).
    const TRIES: usize = 10_000;
    let mut anchors = BTreeMap::new();
    for index in 0..memlab_tch::cuda_device_count() {
        let device = Device::Cuda(index);
        let mut anchor = None;
        for _ in 0..TRIES {
            let before = events::recorded();
            let stats = memlab_tch::device_stats(device)?;
            anchor = Some(Anchor::new(stats, before));
            if events::recorded() == before {
                break;
            }
        }
        anchors.extend(anchor.map(|a| (device, a)));
    }
    let (history, stats, cpu) = events::history_with(|| memlab_tch::device_stats(Device::Cpu));
    // Without memlab's CPU allocator there are no CPU events to walk.
    if let Ok(cpu) = cpu {
        anchors.insert(Device::Cpu, Anchor::new(cpu, u64::MAX));
    }
    Ok((history, stats, anchors))
}

pub(crate) fn capture() -> Result<Trace> {
    let (history, stats, anchors) = history_with_anchors()?;
    let trace = Trace::from_history(&history, &stats, &anchors)?;
    Ok(Trace { run: Some(crate::run::this_process()), ..trace })
}
