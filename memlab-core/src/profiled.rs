//! A profiled function as the program knows it: what the macro captured at
//! compile time (name, file, source lines, options) and the per-line figures
//! gathered at run time. Every one registers itself through `inventory`, so
//! reports can list profiled functions that never ran.
//!
//! A process may hold the same function more than once: a notebook compiles
//! the items of earlier cells again into each new cell's library, each with a
//! static [`ProfiledFn`] of its own. The figures of a function (its path and
//! its source text) are one table for the whole process, whichever copy's
//! static ran.

use crate::sync::LockExt;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::device::{Device, DeviceSelector};
use crate::stats::{FieldKind, RawStats, ALLOCATED_BYTES_CURRENT, FIELDS, NUM_OOMS, N_FIELDS};

/// What `#[memlab::profile]` knows about a function when it compiles it.
#[derive(Debug)]
pub struct ProfiledFnMeta {
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

/// Figures of one source line, merged over every time it ran. As data, its
/// `values` are a map from each `memory_stats()` key to its figure.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Requests the allocator could not serve while the line ran, all runs
    /// together (the change of `num_ooms`).
    pub ooms: u64,
}

impl serde::Serialize for LineStats {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        /// The figures by their `memory_stats()` names.
        struct ByName<'a>(&'a [i64; N_FIELDS]);
        impl serde::Serialize for ByName<'_> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
                serializer.collect_map(FIELDS.iter().map(|f| f.name).zip(self.0.iter()))
            }
        }
        let mut s = serializer.serialize_struct("LineStats", 5)?;
        s.serialize_field("hits", &self.hits)?;
        s.serialize_field("increment", &self.increment)?;
        s.serialize_field("increment_total", &self.increment_total)?;
        s.serialize_field("ooms", &self.ooms)?;
        s.serialize_field("stats", &ByName(&self.values))?;
        s.end()
    }
}

impl LineStats {
    fn empty() -> Self {
        LineStats { hits: 0, values: [0; N_FIELDS], increment: 0, increment_total: 0, ooms: 0 }
    }

    /// Adds one run: `values` gives each field of `fields` its value for the run.
    #[inline]
    fn add_run(&mut self, fields: &[usize], value: impl Fn(usize) -> i64, increment: i64, ooms: u64) {
        if self.hits == 0 {
            for &i in fields {
                self.values[i] = value(i);
            }
            self.increment = increment;
        } else {
            for &i in fields {
                self.values[i] = self.values[i].max(value(i));
            }
            self.increment = self.increment.max(increment);
        }
        self.hits += 1;
        self.increment_total += increment;
        self.ooms += ooms;
    }

    /// Folds another record of the same line into this one.
    pub fn merge(&mut self, other: &LineStats) {
        self.hits += other.hits;
        for (mine, theirs) in self.values.iter_mut().zip(&other.values) {
            *mine = (*mine).max(*theirs);
        }
        self.increment = self.increment.max(other.increment);
        self.increment_total += other.increment_total;
        self.ooms += other.ooms;
    }
}

/// Per-line figures of one function.
#[derive(Clone, Debug, Default)]
pub(crate) struct Table {
    pub(crate) calls: u64,
    pub(crate) lines: Vec<Option<LineStats>>,
}

impl Table {
    #[inline]
    fn line(&mut self, line: usize) -> &mut LineStats {
        if self.lines.len() <= line {
            self.lines.resize(line + 1, None);
        }
        self.lines[line].get_or_insert_with(LineStats::empty)
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
pub struct ProfiledFn {
    pub(crate) meta: ProfiledFnMeta,
    name: OnceLock<(String, Option<String>)>,
    /// The function's figures in the process's table, found on first use.
    shared: OnceLock<&'static Shared>,
}

/// The figures of one function, shared by every copy's static of it.
#[derive(Debug)]
struct Shared {
    /// The static that registered the function first: reports show its meta.
    first: &'static ProfiledFn,
    /// The copies whose static of the function joined (see `copy_id`).
    copies: Mutex<Vec<usize>>,
    state: Mutex<Option<SiteState>>,
}

crate::process::process_wide! {
    /// Every function with a registered static, in the order they registered.
    static FUNCTIONS: Mutex<Vec<&'static Shared>> = Mutex::new(Vec::new());
}

/// An id of the copy of memlab this code belongs to: the address of a static
/// of its own.
fn copy_id() -> usize {
    static MARK: u8 = 0;
    &MARK as *const u8 as usize
}

impl ProfiledFn {
    /// The static of the function `meta` describes.
    pub const fn new(meta: ProfiledFnMeta) -> Self {
        ProfiledFn { meta, name: OnceLock::new(), shared: OnceLock::new() }
    }

    /// The function's figures in the process's table: this copy's static joins
    /// another copy's static of the same function (same path, same source
    /// text), or registers the function.
    fn shared(&'static self) -> &'static Shared {
        self.shared.get_or_init(|| {
            let copy = copy_id();
            let mut functions = FUNCTIONS.locked();
            let same = |f: &&&'static Shared| {
                f.first.name() == self.name()
                    && f.first.trait_name() == self.trait_name()
                    && f.first.meta.source == self.meta.source
            };
            for function in functions.iter().filter(same) {
                let mut copies = function.copies.locked();
                // Two statics of one copy are two functions (a test's scripted
                // ones may share a name); another copy's is the same one.
                if !copies.contains(&copy) {
                    copies.push(copy);
                    return function;
                }
            }
            let function: &'static Shared =
                Box::leak(Box::new(Shared { first: self, copies: Mutex::new(vec![copy]), state: Mutex::new(None) }));
            functions.push(function);
            function
        })
    }

    /// The function's path, e.g. `my_crate::model::Net::forward`, without
    /// generic arguments (`Holder<T>::make` is `Holder::make`); for a method
    /// of a trait impl, the implementing type's path (`Net::step`).
    pub fn name(&self) -> &str {
        &self.names().0
    }

    /// The trait a method implements, by its last path segment (`Step` for
    /// `<Net as Step>::step`); `None` for other functions.
    pub fn trait_name(&self) -> Option<&str> {
        self.names().1.as_deref()
    }

    fn names(&self) -> &(String, Option<String>) {
        self.name.get_or_init(|| display_path(&function_path((self.meta.name)())))
    }

    /// What the macro captured.
    pub fn meta(&self) -> &ProfiledFnMeta {
        &self.meta
    }

    pub(crate) fn state(&'static self) -> MutexGuard<'static, Option<SiteState>> {
        // Figures only grow by merging whole records, so a panic elsewhere
        // while the lock was held leaves nothing inconsistent behind.
        self.shared().state.locked()
    }

    pub(crate) fn with_state<R>(&'static self, f: impl FnOnce(&mut SiteState) -> R) -> R {
        f(self.state().get_or_insert_with(SiteState::default))
    }

    /// Index in the function's line table of source line `line`.
    pub(crate) fn line_index(&self, line: u32) -> usize {
        line.saturating_sub(self.meta.first_line) as usize
    }

    /// Records one run of a line: `before` is the sample when it started, and
    /// `after` the sample when it ended, its peak fields holding the interval's
    /// peaks. Only `fields` are merged: the backend leaves the others at zero.
    pub(crate) fn record_run(
        &self,
        state: &mut SiteState,
        line: usize,
        before: &RawStats,
        after: &RawStats,
        fields: &[usize],
    ) {
        let value = |i: usize| after.0[i] - before.0[i] * CUMULATIVE[i];
        let increment = after.0[ALLOCATED_BYTES_CURRENT] - before.0[ALLOCATED_BYTES_CURRENT];
        // A backend that does not count OOMs leaves both at zero.
        let ooms = (after.0[NUM_OOMS] - before.0[NUM_OOMS]).max(0) as u64;
        state.total.line(line).add_run(fields, value, increment, ooms);
        if self.meta.every > 0 {
            state.window.line(line).add_run(fields, value, increment, ooms);
        }
    }

    /// Records the signature line: the state at entry, with peaks equal to levels.
    pub(crate) fn record_entry(&self, state: &mut SiteState, line: usize, entry: &RawStats, fields: &[usize]) {
        let value = |i: usize| match FIELDS[i].kind {
            FieldKind::Current => entry.0[i],
            FieldKind::Peak => entry.0[i - 1],
            FieldKind::Cumulative => 0,
        };
        state.total.line(line).add_run(fields, value, 0, 0);
        if self.meta.every > 0 {
            state.window.line(line).add_run(fields, value, 0, 0);
        }
    }
}

/// 1 for running totals, whose per-run value is a difference; 0 for levels and peaks.
static CUMULATIVE: [i64; N_FIELDS] = {
    let mut out = [0; N_FIELDS];
    let mut i = 0;
    while i < N_FIELDS {
        out[i] = matches!(FIELDS[i].kind, FieldKind::Cumulative) as i64;
        i += 1;
    }
    out
};

/// How a function registers itself for reports.
#[derive(Debug)]
pub struct Registered(pub &'static ProfiledFn);

inventory::collect!(Registered);

/// Every profiled function of the process, each once: those linked into
/// this copy of memlab's program and those other copies registered, each by
/// the static that registered it first.
pub fn profiled_fns() -> impl Iterator<Item = &'static ProfiledFn> {
    register_this_copy();
    let functions: Vec<&'static ProfiledFn> = FUNCTIONS.locked().iter().map(|f| f.first).collect();
    functions.into_iter()
}

/// Registers the functions linked into this copy with the process (once per copy).
pub(crate) fn register_this_copy() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        for registered in inventory::iter::<Registered> {
            registered.0.shared();
        }
    });
}

/// Turns the type name of the marker item nested in a profiled function into
/// the function's path: drops the marker's own segment and the `{{closure}}`
/// segments that `async fn` bodies add.
fn function_path(marker: &str) -> String {
    let trimmed = marker.rsplit_once("::").map_or(marker, |(head, _)| head);
    trimmed.split("::").filter(|seg| *seg != "{{closure}}").collect::<Vec<_>>().join("::")
}

/// A path as people write it, and the trait of a trait method: generic
/// arguments dropped (`a::Holder<_>::make` is `a::Holder::make`), and a
/// qualified path `<a::Net as a::Step>::step` read as `a::Net::step` with
/// trait `Step`.
pub fn display_path(path: &str) -> (String, Option<String>) {
    let path = path.trim();
    if let Some(inner_start) = path.strip_prefix('<') {
        if let Some(close) = matching_angle(inner_start) {
            let inner = &inner_start[..close];
            let rest = inner_start[close + 1..].trim_start_matches("::");
            if let Some((ty, tr)) = split_top_level(inner, " as ") {
                let ty = strip_generics(ty);
                let tr = strip_generics(tr);
                let trait_name = tr.rsplit("::").next().unwrap_or(&tr).to_string();
                let joined = if rest.is_empty() { ty } else { format!("{ty}::{rest}") };
                return (strip_generics(&joined), Some(trait_name));
            }
            let joined = if rest.is_empty() { inner.to_string() } else { format!("{inner}::{rest}") };
            return (strip_generics(&joined), None);
        }
    }
    (strip_generics(path), None)
}

/// The index in `text` of the `>` that closes an `<` just before it.
fn matching_angle(text: &str) -> Option<usize> {
    let mut depth = 1usize;
    for (i, c) in text.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `text` split at the first `sep` outside angle brackets.
fn split_top_level<'a>(text: &'a str, sep: &str) -> Option<(&'a str, &'a str)> {
    let mut depth = 0i32;
    for (i, c) in text.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 && text[i..].starts_with(sep) => return Some((&text[..i], &text[i + sep.len()..])),
            _ => {}
        }
    }
    None
}

/// `text` without anything inside angle brackets (and the brackets).
fn strip_generics(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut depth = 0i32;
    for c in text.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_paths_read_as_written() {
        assert_eq!(display_path("t::Holder<_>::make"), ("t::Holder::make".into(), None));
        assert_eq!(display_path("t::Holder<alloc::vec::Vec<u8>>::make"), ("t::Holder::make".into(), None));
        assert_eq!(display_path("<t::Net as t::Step>::step"), ("t::Net::step".into(), Some("Step".into())));
        assert_eq!(
            display_path("<t::Pair<u8, i8> as t::Step<f32>>::step"),
            ("t::Pair::step".into(), Some("Step".into()))
        );
        assert_eq!(display_path("t::plain"), ("t::plain".into(), None));
    }

    #[test]
    fn function_path_drops_marker_and_closures() {
        assert_eq!(function_path("demo::train::__memlab_here"), "demo::train");
        assert_eq!(function_path("demo::Net::forward::__memlab_here"), "demo::Net::forward");
        assert_eq!(function_path("demo::fetch::{{closure}}::__memlab_here"), "demo::fetch");
    }

    #[test]
    fn merge_takes_maxima_and_sums_increments_and_ooms() {
        let mut t = Table::default();
        t.line(2).add_run(&[0, 1], |i| [5, -7][i], 10, 1);
        t.line(2).add_run(&[0, 1], |i| [3, -9][i], -4, 2);
        let s = t.lines[2].as_ref().unwrap();
        assert_eq!((s.hits, s.values[0], s.values[1], s.increment, s.increment_total), (2, 5, -7, 10, 6));
        assert_eq!(s.ooms, 3, "OOMs add up over runs");
        let mut merged = s.clone();
        merged.merge(s);
        assert_eq!((merged.hits, merged.ooms), (4, 6));
        assert!(t.lines[0].is_none());
    }

    #[test]
    fn a_run_reports_levels_peaks_and_growth() {
        let function = ProfiledFn::new(ProfiledFnMeta {
            name: || "t::f::__memlab_here",
            file: "t.rs",
            first_line: 1,
            signature_line: 1,
            source: &["fn f() {", "}"],
            device: None,
            every: 0,
        });
        let (mut before, mut after) = (RawStats::default(), RawStats::default());
        let cur = crate::stats::ALLOCATED_BYTES_CURRENT;
        before.0[cur] = 100;
        after.0[cur] = 40;
        after.0[cur + 1] = 500; // the interval's peak
        before.0[cur + 2] = 1000; // allocated so far
        after.0[cur + 2] = 1300;
        (before.0[NUM_OOMS], after.0[NUM_OOMS]) = (2, 3); // one request failed
        let mut state = SiteState::default();
        function.record_run(&mut state, 0, &before, &after, &crate::stats::ALL_FIELDS);
        let s = state.total.lines[0].as_ref().unwrap();
        assert_eq!((s.values[cur], s.values[cur + 1], s.values[cur + 2]), (40, 500, 300));
        assert_eq!((s.increment, s.hits, s.ooms), (-60, 1, 1));
        assert!(state.window.lines.is_empty(), "no window without profile_every");
    }
}
