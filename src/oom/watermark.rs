//! The watermark warning: while the recorder is armed and a memory limit
//! applies (the cgroup's, or the address-space limit), a thread of memlab's
//! reads the use ten times a second and warns once when it crosses the
//! watermark, and again after it fell 5 points under it and rose again.

use super::*;
use memlab_core::oom::HostLimit;
use memlab_core::render::Cell;
use std::time::Duration;

memlab_core::process::process_wide! {
    /// The watermark in force, as `f64` bits (0: none).
    static SHARE: AtomicU64 = AtomicU64::new(0);
}
memlab_core::process::process_wide! {
    static RUNNING: AtomicBool = AtomicBool::new(false);
}

/// Watches with `share` from now on (`None`: stops watching).
pub(super) fn watch(share: Option<f64>) {
    SHARE.store(share.map_or(0, f64::to_bits), Ordering::Relaxed);
    if share.is_none() || readings().iter().all(Option::is_none) || RUNNING.swap(true, Ordering::Relaxed) {
        return;
    }
    let spawned = memlab_core::thread::spawn_started("memlab-oom-watermark", || {
        let mut above = [false; 2];
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let bits = SHARE.load(Ordering::Relaxed);
            if bits == 0 {
                RUNNING.store(false, Ordering::Relaxed);
                return;
            }
            for (reading, above) in readings().into_iter().zip(&mut above) {
                if let Some(text) = reading.and_then(|r| observe(above, r, f64::from_bits(bits))) {
                    say(text);
                }
            }
        }
    });
    if spawned.is_err() {
        RUNNING.store(false, Ordering::Relaxed);
    }
}

/// One reading of a limit: which, the use and the limit in bytes.
pub(super) type Reading = (HostLimit, u64, u64);

/// The cgroup's reading and the address space's, where each has a limit.
fn readings() -> [Option<Reading>; 2] {
    let cgroup = memlab_tch::cgroup_memory().map(|(used, max)| (HostLimit::Cgroup, used, max));
    let address_space =
        memlab_tch::address_space().and_then(|(mapped, limit)| limit.map(|l| (HostLimit::AddressSpace, mapped, l)));
    [cgroup, address_space]
}

/// The warning for `reading`, when it crosses `share` of its limit
/// (`above` says whether an earlier one did, until it falls 5 points
/// under).
pub(super) fn observe(above: &mut bool, (limit, used, max): Reading, share: f64) -> Option<String> {
    let at = used as f64 / max.max(1) as f64;
    if *above {
        *above = at >= share - 0.05;
        return None;
    }
    if at < share {
        return None;
    }
    *above = true;
    let figures = format!("{:.0}% of {} ({} of {})", at * 100.0, limit.describe(), b(used), b(max));
    Some(match limit {
        HostLimit::Cgroup => format!(
            "memlab: this process's cgroup uses {figures}. At the limit the kernel's out-of-memory killer \
             ends the process without a failed request, so no out-of-memory report can be written: free \
             memory, or raise the limit.\n"
        ),
        HostLimit::AddressSpace | HostLimit::MemoryFraction => format!(
            "memlab: this process has mapped {figures}. A request beyond the limit fails (and is reported): \
             free memory, or raise the limit.\n"
        ),
    })
}

fn b(n: u64) -> Cell {
    Cell::bytes(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_warns_once_per_crossing() {
        let gib = 1u64 << 30;
        let mut above = false;
        let reading = |used: u64| (HostLimit::Cgroup, used, 10 * gib);
        assert_eq!(watermark::observe(&mut above, reading(8 * gib), 0.9), None);
        let warned = watermark::observe(&mut above, reading(9 * gib + gib / 5), 0.9).expect("92% crosses 90%");
        assert!(warned.contains("92% of the cgroup's memory limit (memory.max) (9.20G of 10.00G)"), "{warned}");
        assert!(warned.contains("out-of-memory killer"), "{warned}");
        // Still above, or a little under: once is enough.
        assert_eq!(watermark::observe(&mut above, reading(9 * gib + gib / 2), 0.9), None);
        assert_eq!(watermark::observe(&mut above, reading(8 * gib + gib / 2), 0.9), None);
        // Down by more than 5 points, then up again: a new warning.
        assert_eq!(watermark::observe(&mut above, reading(8 * gib), 0.9), None);
        assert!(watermark::observe(&mut above, reading(9 * gib), 0.9).is_some());
        let mut above = false;
        let space = watermark::observe(&mut above, (HostLimit::AddressSpace, 95, 100), 0.9).unwrap();
        assert!(space.contains("95% of the address-space limit (ulimit -v)"), "{space}");
    }
}
