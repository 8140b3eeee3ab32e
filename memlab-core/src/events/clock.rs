//! What the recorder and the timeline share, below both: the recording's
//! clock and whether a recording runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

crate::process::process_wide! {
    /// Set while someone holds the recorder (see [`super::retain`]).
    static ACTIVE: AtomicBool = AtomicBool::new(false);
}

/// When the clock started: the first time anything read it.
pub(super) fn start() -> Instant {
    crate::process::process_wide! {
        static START: OnceLock<Instant> = OnceLock::new();
    }
    *START.get_or_init(Instant::now)
}

/// The recorder's clock: nanoseconds since it was first turned on.
#[inline]
pub(super) fn now_ns() -> u64 {
    start().elapsed().as_nanos() as u64
}

/// Whether events are being recorded (someone holds [`super::retain`]).
#[inline]
pub fn is_active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Marks recording on or off (the recorder, under its lock).
pub(super) fn set_active(on: bool) {
    ACTIVE.store(on, Ordering::Relaxed);
}
