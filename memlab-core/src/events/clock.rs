//! What the recorder and the timeline share, below both: the recording's
//! clock and whether a recording runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

crate::process::process_wide! {
    /// Set while someone holds the recorder (see [`super::retain`]).
    static ACTIVE: AtomicBool = AtomicBool::new(false);
}

crate::process::process_wide! {
    /// The clock's zero, and the wall-clock time then.
    static START: OnceLock<(Instant, SystemTime)> = OnceLock::new();
}

/// When the clock started: the first time anything read it.
pub(super) fn start() -> Instant {
    START.get_or_init(|| (Instant::now(), SystemTime::now())).0
}

/// The wall-clock time of the recorder's clock zero, in microseconds since
/// the Unix epoch: what turns the times of memlab's events, spans and
/// exports (microseconds since that zero) into times other processes share.
/// Read together with the zero itself, so the two differ by well under a
/// microsecond; starts the clock if nothing read it yet.
pub fn zero_unix_us() -> u64 {
    let wall = START.get_or_init(|| (Instant::now(), SystemTime::now())).1;
    wall.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
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
