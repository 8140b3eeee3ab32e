//! What memlab's walks over the named tensors found while a recording ran.
//!
//! An export names what is alive at export time; an allocation that died
//! before then is named only if a walk saw it alive. `StepLogger::log` and
//! `TrainingMonitor`'s records walk the model at every step while a
//! recording runs, and note here which allocation (by its event's sequence
//! number) held a parameter, a gradient or optimizer state.

use memlab_core::sync::LockExt;
use std::collections::BTreeMap;

use memlab_core::hash::FastMap;
use std::sync::Mutex;

use memlab_core::events;

use super::{Model, TensorKind};

/// The most allocations remembered; the oldest are forgotten past it.
const CAPACITY: usize = 1 << 20;

memlab_core::process::process_wide! {
    static SEEN: Mutex<BTreeMap<u64, TensorKind>> = Mutex::new(BTreeMap::new());
}

/// Walks `sources` and notes what each live allocation they own is, while a
/// recording runs (else does nothing). A walk that fails (a var store freed
/// meanwhile, an optimizer memlab cannot read) notes nothing: names are a help
/// to the reader, never a reason to disturb training.
pub(crate) fn note(sources: &Model) {
    if !events::is_active() {
        return;
    }
    let Ok(kinds) = sources.kinds() else { return };
    let keys: Vec<_> = kinds.iter().map(|&(device, address, _)| (device, address)).collect();
    let seqs = events::live_seqs(&keys);
    let mut seen = SEEN.locked();
    for ((_, _, kind), seq) in kinds.into_iter().zip(seqs) {
        if let Some(seq) = seq {
            // A storage both a variable and a named tensor keeps the model's name.
            let slot = seen.entry(seq).or_insert(kind);
            *slot = (*slot).min(kind);
        }
    }
    while seen.len() > CAPACITY {
        seen.pop_first();
    }
}

/// What the walks during the recording found, by allocation event.
pub(crate) fn by_event() -> FastMap<u64, TensorKind> {
    SEEN.locked().iter().map(|(&s, &k)| (s, k)).collect()
}
