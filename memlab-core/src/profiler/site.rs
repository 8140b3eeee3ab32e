//! A profiled function as the program knows it: what the macro captured at
//! compile time (name, file, source lines, options) and the per-line figures
//! gathered at run time. Every site registers itself through `inventory`, so
//! reports can list profiled functions that never ran.

use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::stats::{FieldKind, RawStats, ALLOCATED_BYTES_CURRENT, FIELDS, N_FIELDS};
use crate::{Device, DeviceSelector};

/// What `#[memlab::profile]` knows about a function when it compiles it.
#[derive(Debug)]
pub struct SiteMeta {
    /// Returns the type name of an item nested in the function; the function's
    /// path is that name without its last segment.
    pub name: fn() -> &'static str,
    /// The source file, as `file!()` gives it.
    pub file: &'static str,
    /// Line number of the first entry of `source`.
    pub first_line: u32,
    /// Line number of the function's signature (`fn` keyword).
    pub signature_line: u32,
    /// The function's source lines, from its first attribute to its closing brace.
    pub source: &'static [&'static str],
    /// The device chosen in the attribute; `None` follows the global target.
    pub device: Option<DeviceSelector>,
    /// `profile_every(N)`: print the figures of the last N calls every N calls; 0 = never.
    pub every: u32,
}

/// Figures of one source line, merged over every time it ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineStats {
    /// How many times the line's statements ran (for the signature line: calls).
    pub hits: u64,
    /// Per field of [`FIELDS`]: the largest per-run value seen. A run's value is
    /// the level after it for `current` fields, the highest level during it for
    /// `peak` fields, and what it added for running totals.
    pub values: [i64; N_FIELDS],
    /// Largest change of `allocated_bytes.all.current` over one run of the line.
    pub increment: i64,
    /// Sum of that change over all runs: what the line has kept, all runs together.
    pub increment_total: i64,
}

impl LineStats {
    fn first(values: [i64; N_FIELDS], increment: i64) -> Self {
        LineStats {
            hits: 1,
            values,
            increment,
            increment_total: increment,
        }
    }

    fn merge_run(&mut self, values: &[i64; N_FIELDS], increment: i64) {
        self.hits += 1;
        for (mine, theirs) in self.values.iter_mut().zip(values) {
            *mine = (*mine).max(*theirs);
        }
        self.increment = self.increment.max(increment);
        self.increment_total += increment;
    }

    /// Folds another record of the same line into this one.
    pub fn merge(&mut self, other: &LineStats) {
        self.hits += other.hits;
        for (mine, theirs) in self.values.iter_mut().zip(&other.values) {
            *mine = (*mine).max(*theirs);
        }
        self.increment = self.increment.max(other.increment);
        self.increment_total += other.increment_total;
    }
}

/// Per-line figures of one site.
#[derive(Clone, Debug, Default)]
pub(crate) struct Table {
    pub(crate) calls: u64,
    pub(crate) lines: Vec<Option<LineStats>>,
}

impl Table {
    fn record(&mut self, line: usize, values: &[i64; N_FIELDS], increment: i64) {
        if self.lines.len() <= line {
            self.lines.resize(line + 1, None);
        }
        match &mut self.lines[line] {
            Some(stats) => stats.merge_run(values, increment),
            slot @ None => *slot = Some(LineStats::first(*values, increment)),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct SiteState {
    /// Everything since the start (or the last reset).
    pub(crate) total: Table,
    /// The calls since `profile_every` last printed.
    pub(crate) window: Table,
    pub(crate) device: Option<Device>,
    pub(crate) error: Option<String>,
}

/// A profiled function. The macro puts one in a `static` inside the function.
#[derive(Debug)]
pub struct Site {
    pub(crate) meta: SiteMeta,
    name: OnceLock<String>,
    state: Mutex<Option<SiteState>>,
}

impl Site {
    /// A site for the function `meta` describes.
    pub const fn new(meta: SiteMeta) -> Self {
        Site {
            meta,
            name: OnceLock::new(),
            state: Mutex::new(None),
        }
    }

    /// The function's path, e.g. `my_crate::model::Net::forward`.
    pub fn name(&self) -> &str {
        self.name.get_or_init(|| function_path((self.meta.name)()))
    }

    /// What the macro captured.
    pub fn meta(&self) -> &SiteMeta {
        &self.meta
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, Option<SiteState>> {
        // Figures only grow by merging whole records, so a panic elsewhere
        // while the lock was held leaves nothing inconsistent behind.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut SiteState) -> R) -> R {
        f(self.state().get_or_insert_with(SiteState::default))
    }

    /// Index in the site's line table of source line `line`.
    pub(crate) fn line_index(&self, line: u32) -> usize {
        line.saturating_sub(self.meta.first_line) as usize
    }

    /// Records one run of a line: `before` is the sample when it started, and
    /// `after` the sample when it ended, its peak fields holding the interval's peaks.
    pub(crate) fn record_run(
        &self,
        state: &mut SiteState,
        line: usize,
        before: &RawStats,
        after: &RawStats,
    ) {
        let mut values = [0i64; N_FIELDS];
        for (i, field) in FIELDS.iter().enumerate() {
            values[i] = match field.kind {
                FieldKind::Current | FieldKind::Peak => after.0[i],
                FieldKind::Cumulative => after.0[i] - before.0[i],
            };
        }
        let increment = after.0[ALLOCATED_BYTES_CURRENT] - before.0[ALLOCATED_BYTES_CURRENT];
        state.total.record(line, &values, increment);
        if self.meta.every > 0 {
            state.window.record(line, &values, increment);
        }
    }

    /// Records the signature line: the state at entry, with peaks equal to levels.
    pub(crate) fn record_entry(&self, state: &mut SiteState, line: usize, entry: &RawStats) {
        let mut values = [0i64; N_FIELDS];
        for (i, field) in FIELDS.iter().enumerate() {
            values[i] = match field.kind {
                FieldKind::Current => entry.0[i],
                FieldKind::Peak => entry.0[i - 1],
                FieldKind::Cumulative => 0,
            };
        }
        state.total.record(line, &values, 0);
        if self.meta.every > 0 {
            state.window.record(line, &values, 0);
        }
    }
}

/// How a site registers itself for reports.
#[derive(Debug)]
pub struct Registered(pub &'static Site);

inventory::collect!(Registered);

/// Every profiled function linked into this program.
pub fn sites() -> impl Iterator<Item = &'static Site> {
    inventory::iter::<Registered>.into_iter().map(|r| r.0)
}

/// Turns the type name of the marker item nested in a profiled function into
/// the function's path: drops the marker's own segment and the `{{closure}}`
/// segments that `async fn` bodies add.
fn function_path(marker: &str) -> String {
    let trimmed = marker.rsplit_once("::").map_or(marker, |(head, _)| head);
    trimmed
        .split("::")
        .filter(|seg| *seg != "{{closure}}")
        .collect::<Vec<_>>()
        .join("::")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_path_drops_marker_and_closures() {
        assert_eq!(function_path("demo::train::__memlab_here"), "demo::train");
        assert_eq!(
            function_path("demo::Net::forward::__memlab_here"),
            "demo::Net::forward"
        );
        assert_eq!(
            function_path("demo::fetch::{{closure}}::__memlab_here"),
            "demo::fetch"
        );
    }

    #[test]
    fn merge_takes_maxima_and_sums_increments() {
        let mut t = Table::default();
        let mut a = [0i64; N_FIELDS];
        a[0] = 5;
        t.record(2, &a, 10);
        a[0] = 3;
        t.record(2, &a, -4);
        let s = t.lines[2].as_ref().unwrap();
        assert_eq!(
            (s.hits, s.values[0], s.increment, s.increment_total),
            (2, 5, 10, 6)
        );
        assert!(t.lines[0].is_none());
    }
}
