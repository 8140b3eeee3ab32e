//! What the recorder and the timeline share, below both: the recording's
//! clock and whether a recording runs.
//!
//! The clock is the monotonic clock, read as nanoseconds since its zero (the
//! first time anything read it). Reading the monotonic clock costs about as
//! much as the rest of an allocation event, so where the kernel itself keeps
//! time with the processor's time-stamp counter (Linux on x86-64, an
//! invariant counter, `tsc` the current clock source), the clock reads the
//! counter instead, converted at the rate the counter kept against the
//! monotonic clock since the zero. That rate is measured again at
//! [`CALIBRATIONS`] (10 ms, 0.1 s, 1 s and 10 s after the zero) and every
//! minute after, each time over the whole span so far; the first 10 ms are
//! read from the monotonic clock itself. Each new rate takes over where the
//! last one stood, so the clock never goes back; it stays within a few
//! microseconds of the monotonic clock, plus what the kernel's corrections
//! to the monotonic clock's rate (NTP's, at most 500 parts per million) move
//! it within a minute. Elsewhere every reading comes from the monotonic
//! clock.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

crate::process::process_wide! {
    /// Set while someone holds the recorder (see [`super::retain`]).
    static ACTIVE: AtomicBool = AtomicBool::new(false);
}

crate::process::process_wide! {
    /// The clock's zero.
    static START: OnceLock<Zero> = OnceLock::new();
}

crate::process::process_wide! {
    /// The time-stamp counter's conversion in force (null before the first
    /// calibration, and where the counter is not used). Replaced at each
    /// calibration; the ones replaced are never freed, since a reader may
    /// still hold them (32 bytes each: four in the first 10 s, then one a
    /// minute).
    static COUNTER: AtomicPtr<Counter> = AtomicPtr::new(std::ptr::null_mut());
}

/// When the time-stamp counter's rate is measured, in nanoseconds after the
/// clock's zero: the first is when the clock starts reading the counter.
/// After the last, every [`RECALIBRATION_NS`].
pub(super) const CALIBRATIONS: [u64; 4] = [10_000_000, 100_000_000, 1_000_000_000, 10_000_000_000];

/// How often the rate is measured again after [`CALIBRATIONS`]: a minute.
const RECALIBRATION_NS: u64 = 60_000_000_000;

crate::process::process_wide! {
    /// Set when the counter ran at no plausible rate at its first
    /// calibration: the monotonic clock is read from then on.
    static UNUSABLE: AtomicBool = AtomicBool::new(false);
}

/// The clock's zero: the monotonic and wall clocks then, and the time-stamp
/// counter where it can be used.
#[derive(Clone, Copy)]
struct Zero {
    instant: Instant,
    wall: SystemTime,
    ticks: Option<u64>,
}

/// The time-stamp counter's ticks converted to the clock's nanoseconds: at
/// `ticks` the clock read `ns`, and a tick lasts `ns_per_tick_q32 / 2^32` ns,
/// until the clock reads `until_ns` (the next calibration).
#[derive(Clone, Copy, Debug)]
struct Counter {
    ticks: u64,
    ns: u64,
    ns_per_tick_q32: u64,
    until_ns: u64,
}

impl Counter {
    #[inline]
    fn at(&self, ticks: u64) -> u64 {
        let ticks = ticks.saturating_sub(self.ticks);
        self.ns + ((u128::from(ticks) * u128::from(self.ns_per_tick_q32)) >> 32) as u64
    }
}

fn zero() -> &'static Zero {
    START.get_or_init(|| {
        // The counter is read on both sides of the monotonic clock, and the
        // narrowest of a few tries kept: what lies between the readings is
        // an error in every rate measured from the zero. (The first reads
        // fault in their code: in a debug build, one read 80 µs apart made
        // the first rates 700 parts per million fast.)
        if !counter::usable() {
            return Zero { instant: Instant::now(), wall: SystemTime::now(), ticks: None };
        }
        let (_, ticks, instant) = (0..8)
            .map(|_| {
                let before = counter::read();
                let instant = Instant::now();
                let after = counter::read().max(before);
                (after - before, before + (after - before) / 2, instant)
            })
            .min_by_key(|&(width, _, _)| width)
            .expect("eight tries");
        Zero { instant, wall: SystemTime::now(), ticks: Some(ticks) }
    })
}

/// When the clock started: the first time anything read it.
pub(super) fn start() -> Instant {
    zero().instant
}

/// The wall-clock time of the recorder's clock zero, in microseconds since
/// the Unix epoch: what turns the times of memlab's events, spans and
/// exports (microseconds since that zero) into times other processes share.
/// Read together with the zero itself, so the two differ by well under a
/// microsecond; starts the clock if nothing read it yet.
pub fn zero_unix_us() -> u64 {
    zero().wall.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The recorder's clock: nanoseconds since it was first turned on.
#[inline]
pub(super) fn now_ns() -> u64 {
    // SAFETY: a non-null pointer is one `calibrating_now_ns` published
    // (Release, paired here) and never frees.
    if let Some(counter) = unsafe { COUNTER.load(Ordering::Acquire).as_ref() } {
        let ns = counter.at(counter::read());
        if ns < counter.until_ns {
            return ns;
        }
    }
    calibrating_now_ns()
}

/// The recorder's clock now, in microseconds since its zero: the unit of
/// the `time_us` of memlab's exports, so that a reader can keep the events
/// after a moment it took.
pub fn clock_us() -> u64 {
    now_ns() / 1000
}

/// The clock where the counter is not in use, or a calibration is due.
#[inline(never)]
fn calibrating_now_ns() -> u64 {
    let zero = zero();
    let monotonic = || zero.instant.elapsed().as_nanos() as u64;
    let Some(zero_ticks) = zero.ticks.filter(|_| !UNUSABLE.load(Ordering::Relaxed)) else {
        return monotonic();
    };
    let current = COUNTER.load(Ordering::Acquire);
    // SAFETY: as in `now_ns`.
    let last = unsafe { current.as_ref() };
    match last {
        // Another thread calibrated since the caller looked.
        Some(last) => {
            let ns = last.at(counter::read());
            if ns < last.until_ns {
                return ns;
            }
        }
        None => {
            let ns = monotonic();
            if ns < CALIBRATIONS[0] {
                return ns;
            }
        }
    }
    // The counter read on both sides of the monotonic clock: the reading's
    // tick is between them. The narrowest of a few tries, so that a thread
    // switched out between the readings does not set the rate.
    let (ticks, ns) = (0..8)
        .map(|_| {
            let before = counter::read();
            let ns = monotonic();
            let after = counter::read().max(before);
            (after - before, before + (after - before) / 2, ns)
        })
        .min()
        .map(|(_, ticks, ns)| (ticks, ns))
        .unwrap_or_default();
    // Not a rate a counter runs at: the last rate goes on, or, before any,
    // the monotonic clock from now on.
    let Some(rate) = rate(ticks.saturating_sub(zero_ticks), ns).or(last.map(|l| l.ns_per_tick_q32)) else {
        UNUSABLE.store(true, Ordering::Relaxed);
        return ns;
    };
    // The new rate takes over where the last one stands (a little after, for
    // the rounding of readings made with the last one meanwhile): the clock
    // never goes back.
    let from = last.map_or(ns, |last| ns.max(last.at(ticks) + 2));
    let due = CALIBRATIONS
        .iter()
        .copied()
        .find(|&at| at > from)
        .unwrap_or_else(|| (from / RECALIBRATION_NS + 1).saturating_mul(RECALIBRATION_NS));
    let next = Box::into_raw(Box::new(Counter { ticks, ns: from, ns_per_tick_q32: rate, until_ns: due }));
    if COUNTER.compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // Another thread calibrated first; this one's was never published.
        // SAFETY: made by `Box::into_raw` just above and seen by no one else.
        drop(unsafe { Box::from_raw(next) });
    }
    now_ns()
}

/// Nanoseconds per tick, as a 32.32 fixed-point number, of a counter that
/// ran `ticks` in `ns`; `None` outside the rates counters run at (100 MHz to
/// 100 GHz).
fn rate(ticks: u64, ns: u64) -> Option<u64> {
    let q32 = u64::try_from((u128::from(ns) << 32) / u128::from(ticks.max(1))).ok()?;
    ((1u64 << 32) / 100..=(1u64 << 32) * 10).contains(&q32).then_some(q32)
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

/// The processor's time-stamp counter.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod counter {
    /// The counter's ticks.
    #[inline]
    pub(super) fn read() -> u64 {
        // SAFETY: every x86-64 processor has `rdtsc`, and Linux lets user
        // code run it unless a process turns that off for itself.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    /// Whether the counter keeps time: invariant (the same rate in every
    /// power state), and trusted by the kernel as its clock source (which it
    /// is only where the counters of all processors agree).
    pub(super) fn usable() -> bool {
        use core::arch::x86_64::__cpuid;
        let invariant = __cpuid(0x8000_0000).eax >= 0x8000_0007 && __cpuid(0x8000_0007).edx & (1 << 8) != 0;
        invariant
            && std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
                .is_ok_and(|source| source.trim() == "tsc")
    }
}

/// No counter the clock uses: every reading comes from the monotonic clock.
#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod counter {
    pub(super) fn read() -> u64 {
        0
    }

    pub(super) fn usable() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once the counter is in use, the clock still follows the monotonic
    /// clock: read side by side, the two agree to within a few microseconds
    /// (what the first, shortest calibration can be off by).
    #[test]
    fn the_clock_follows_the_monotonic_clock() {
        let zero = zero();
        let wait = std::time::Duration::from_nanos(CALIBRATIONS[1] + 20_000_000).saturating_sub(zero.instant.elapsed());
        std::thread::sleep(wait);
        let mut worst = 0i64;
        for _ in 0..200 {
            let before = zero.instant.elapsed().as_nanos() as i64;
            let clock = now_ns() as i64;
            let after = zero.instant.elapsed().as_nanos() as i64;
            worst = worst.max(if clock < before { before - clock } else { (clock - after).max(0) });
            std::thread::sleep(std::time::Duration::from_micros(500));
        }
        assert!(worst < 50_000, "the clock is {worst} ns away from the monotonic clock");
        // SAFETY: as in `now_ns`.
        if let Some(counter) = unsafe { COUNTER.load(Ordering::Acquire).as_ref() } {
            eprintln!("time-stamp counter in use: {counter:?}, at most {worst} ns from the monotonic clock");
        }
    }

    /// Threads reading the clock while it calibrates never see it go back.
    #[test]
    fn the_clock_never_goes_back_on_any_thread() {
        let until = std::time::Instant::now() + std::time::Duration::from_millis(150);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let mut last = now_ns();
                    while std::time::Instant::now() < until {
                        let now = now_ns();
                        assert!(now >= last, "the clock went back from {last} to {now}");
                        last = now;
                    }
                });
            }
        });
    }

    /// The conversion is the rate measured: a counter that ran three ticks a
    /// nanosecond converts its ticks to a third as many nanoseconds, from
    /// where the last rate left off.
    #[test]
    fn a_counter_converts_ticks_at_its_rate() {
        let ns_per_tick_q32 = rate(3_000_000_000, 1_000_000_000).unwrap();
        let counter = Counter { ticks: 1_000, ns: 5, ns_per_tick_q32, until_ns: u64::MAX };
        assert_eq!(counter.at(1_000), 5);
        assert_eq!(counter.at(500), 5, "ticks before the anchor read as the anchor");
        let ns = counter.at(3_000_001_000);
        assert!((1_000_000_004..=1_000_000_005).contains(&ns), "3e9 ticks at 3 GHz read {ns} ns");
        assert_eq!(rate(10, 1_000_000_000), None, "a counter of 10 Hz is no clock");
    }
}
