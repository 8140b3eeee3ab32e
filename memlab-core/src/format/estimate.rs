//! Upper estimates of the heap memory that building a file of the recording
//! takes, from the recording's size alone (events kept, allocations alive):
//! the out-of-memory recorder writes a file only where the memory left
//! covers its estimate. The figures per event were measured with a counting
//! allocator on recordings of several shapes (one call site, and thousands
//! of distinct deep stacks; `tests/cpu/oom_limits.rs` checks that each
//! estimate stays above what the file really took) and carry a margin; they
//! are estimates, and every report that uses one says so.

use crate::events;

/// What building something of the recording costs: bytes per event kept
/// in the history, per allocation alive, and fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Bytes per event kept in the history.
    pub per_event: u64,
    /// Bytes per allocation alive.
    pub per_live: u64,
    /// Bytes whatever the recording's size.
    pub fixed: u64,
}

impl Cost {
    /// The PyTorch snapshot: the history copied, a trace entry per event
    /// (two per CPU free), the stacks, and the pickle's bytes.
    pub const SNAPSHOT: Cost = Cost { per_event: 640, per_live: 1024, fixed: 4 << 20 };
    /// The HTML report: the history copied, the timelines, the icicle and the page.
    pub const HTML: Cost = Cost { per_event: 640, per_live: 1024, fixed: 4 << 20 };
    /// The unnamed holders by site: the live set copied and grouped.
    pub const BY_SITE: Cost = Cost { per_event: 0, per_live: 512, fixed: 1 << 20 };

    /// The cost for `events` kept and `live` allocations alive.
    pub fn of(&self, events: u64, live: u64) -> u64 {
        self.fixed
            .saturating_add(self.per_event.saturating_mul(events))
            .saturating_add(self.per_live.saturating_mul(live))
    }

    /// The cost for the recording so far.
    pub fn now(&self) -> u64 {
        let stats = events::stats();
        self.of(stats.kept as u64, stats.live as u64)
    }
}
