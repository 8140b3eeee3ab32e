//! Upper estimates of the heap memory that building an export of the
//! recording takes, from the recording's size alone (events kept, allocations
//! alive): the out-of-memory recorder writes an export only where the memory
//! left covers its estimate. The figures per event were measured with a
//! counting allocator on recordings of several shapes (one call site, and
//! thousands of distinct deep stacks; see `tests/cpu/oom_limits.rs`, which
//! checks that each estimate stays above what the export really took) and
//! carry a margin; they are estimates, and every report that uses one says so.
//! Reached by that test through `memlab::testing` (the `testing` feature):
//! not part of memlab's API.

use memlab_core::events;

/// Bytes per event kept in the history, per allocation alive, and fixed.
struct Cost {
    per_event: u64,
    per_live: u64,
    fixed: u64,
}

impl Cost {
    fn of(&self, events: u64, live: u64) -> u64 {
        self.fixed
            .saturating_add(self.per_event.saturating_mul(events))
            .saturating_add(self.per_live.saturating_mul(live))
    }
}

/// The PyTorch snapshot: the history copied, a trace entry per event (two
/// per CPU free), the stacks, and the pickle's bytes.
const SNAPSHOT: Cost = Cost { per_event: 640, per_live: 1024, fixed: 4 << 20 };
/// The HTML report: the history copied, the timelines, the icicle and the page.
const HTML: Cost = Cost { per_event: 640, per_live: 1024, fixed: 4 << 20 };
/// The unnamed holders by site: the live set copied and grouped.
const BY_SITE: Cost = Cost { per_event: 0, per_live: 512, fixed: 1 << 20 };

fn sizes() -> (u64, u64) {
    let stats = events::stats();
    (stats.kept as u64, stats.live as u64)
}

/// What the PyTorch snapshot of the recording so far takes to build and write.
pub fn snapshot() -> u64 {
    let (kept, live) = sizes();
    SNAPSHOT.of(kept, live)
}

/// What the HTML report of the recording so far takes to build and write.
pub fn html() -> u64 {
    let (kept, live) = sizes();
    HTML.of(kept, live)
}

/// What listing `live` allocations by site takes.
pub fn by_site(live: u64) -> u64 {
    BY_SITE.of(0, live)
}
