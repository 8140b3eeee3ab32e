//! A snapshot's history replayed, device by device: the peaks and when they
//! happened, what was live at the allocated peak by category and by site,
//! and how much of the history the file holds.
//!
//! The replay starts from what the file proves was live before its first
//! event (blocks the trace frees without having seen them allocated, and
//! blocks of the final segments the trace never touches) and applies every
//! event. A block is released where the allocator releases it: at
//! `free_completed` when the trace has those (CUDA), else at `free_requested`
//! (memlab's CPU). Reserved bytes follow the segment events, starting from
//! the final segments less what the trace added. At the end the replayed
//! figures are checked against the final segments.
//!
//! Allocated bytes are counted as the tensors asked for them: a trace's
//! `alloc` and `free` carry the size requested (the caching allocator
//! rounds its blocks up from it, and the final segments give each block's
//! `requested_size`). Reserved bytes include that rounding.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::events::Action;
use crate::export::{Block, BlockState, Snapshot, SnapshotFile, SnapshotFrame, Stack, TraceEntry};
use serde::Serialize;

/// Where an allocation was made: the innermost frame of the program's own
/// code (a frame of PyTorch, the standard libraries or C++ is skipped), or
/// for a stack without one, what made it, without a file (`autograd's
/// backward pass (MmBackward0)`; see [`frames::made_by`](super::frames::made_by)).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Site {
    /// The function.
    pub function: String,
    /// The source file, as the frames name it.
    pub file: String,
    /// The line.
    pub line: u32,
}

impl Site {
    /// The site of a stack (innermost frame first): its first frame of the
    /// program's own code, else what made it (see [`frames::site`](super::frames::site)).
    pub fn of(frames: &[SnapshotFrame]) -> Option<Site> {
        let (function, file, line) = super::frames::site(frames)?;
        Some(Site { function, file, line })
    }

    /// The file as tables name it (see [`short_path`]).
    pub fn short_file(&self) -> &str {
        short_path(&self.file)
    }
}

/// A source path as every report names it, short enough for a table: from
/// its crate's folder on (`src/train.rs`, `tests/step.rs`), else its last
/// two components (`proj/train.py`).
pub fn short_path(file: &str) -> &str {
    if let Some(at) = ["/src/", "/tests/", "/examples/", "/benches/"].iter().filter_map(|dir| file.rfind(dir)).max() {
        return &file[at + 1..];
    }
    let mut cut = file.len();
    for _ in 0..2 {
        match file[..cut].rfind('/') {
            Some(i) => cut = i,
            None => return file,
        }
    }
    &file[cut + 1..]
}

impl fmt::Display for Site {
    /// `function (file:line)`; a site without a file (memlab's label for
    /// allocations outside the user's code) is its name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.file.is_empty() {
            return f.write_str(&self.function);
        }
        write!(f, "{} ({}:{})", self.function, self.short_file(), self.line)
    }
}

/// Bytes and the blocks that hold them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Bytes {
    /// Bytes.
    pub bytes: u64,
    /// Blocks (allocations).
    pub blocks: u64,
}

impl Bytes {
    fn add(&mut self, size: u64) {
        self.bytes += size;
        self.blocks += 1;
    }
}

/// A moment of the history and the device's figures then.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Moment {
    /// Bytes allocated then, as the tensors asked for them.
    pub allocated: u64,
    /// Bytes reserved by the allocator then (`None` on the CPU, which
    /// reserves nothing, or where the file cannot tell).
    pub reserved: Option<u64>,
    /// How many of the device's events had happened (0: before the first).
    pub event: u64,
    /// Microseconds after the device's first event.
    pub time_us: u64,
}

/// Bytes live at the peak of one category.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CategoryShare {
    /// The category (`parameter`, `activation`, …), or `uncategorized`.
    pub category: String,
    /// What it held.
    #[serde(flatten)]
    pub held: Bytes,
}

/// Bytes live at the peak of one site.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteShare {
    /// The site; `None` for allocations without a stack.
    pub site: Option<Site>,
    /// Whether these are blocks allocated before the history (with no stack
    /// in the final segments either).
    pub before_history: bool,
    /// What it held.
    #[serde(flatten)]
    pub held: Bytes,
}

/// A failed allocation in the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OomAt {
    /// Bytes asked for.
    pub requested: u64,
    /// What the device had free, as the allocator saw it.
    pub device_free: Option<u64>,
    /// Microseconds after the device's first event.
    pub time_us: u64,
    /// How many of the device's events had happened then, the failure's
    /// own included (as [`Moment::event`] counts).
    pub event: u64,
}

/// One device's history, replayed.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceSummary {
    /// The device (`cuda:0`, `cpu`).
    pub device: String,
    /// Events in its history.
    pub events: u64,
    /// Microseconds from its first event to its last.
    pub span_us: u64,
    /// The first event's time as the file gives it: in memlab's files
    /// microseconds since the process's clock zero (`run.clock_zero_unix_us`),
    /// in PyTorch's since the Unix epoch.
    pub first_us: u64,
    /// The allocated peak (the first moment it was reached).
    pub peak: Moment,
    /// The reserved peak, where the device reserves.
    pub reserved_peak: Option<Moment>,
    /// The figures after the last event, as the final segments give them.
    pub end: Moment,
    /// Blocks live before the history's first event.
    pub before: Bytes,
    /// Why the history is partial (events are missing); empty when it is not.
    pub partial: Vec<String>,
    /// What was live at the peak, by category, largest first.
    pub by_category: Vec<CategoryShare>,
    /// What was live at the peak, by site, largest first.
    pub by_site: Vec<SiteShare>,
    /// Failed allocations.
    pub ooms: Vec<OomAt>,
    /// Bytes allocated before the recording began and still allocated,
    /// which neither the history nor the segments show (memlab's CPU
    /// segments are what its recording saw made): not in `peak`, in the
    /// allocator's own figures (and so a trace's).
    #[serde(skip_serializing_if = "is_zero")]
    pub unseen_before: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl DeviceSummary {
    /// Reserved but unallocated bytes at the allocated peak, where known.
    pub fn unallocated_at_peak(&self) -> Option<u64> {
        self.peak.reserved.map(|r| r.saturating_sub(self.peak.allocated))
    }
}

/// The summary of a snapshot file.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The file.
    pub file: String,
    /// Who wrote it: `memlab` or `pytorch`.
    pub writer: &'static str,
    /// Its pickle protocol.
    pub protocol: u8,
    /// The process that wrote it, where the file says (memlab's do): rank,
    /// host, libtorch's version, the wall-clock time of its clock zero.
    pub run: Option<crate::run::RunInfo>,
    /// One per device with events or segments.
    pub devices: Vec<DeviceSummary>,
    /// Keys the reader read past, by where they occur, with how often.
    pub ignored: BTreeMap<String, u64>,
}

impl Summary {
    /// Replays every device of `file`, read from `path`.
    pub fn of(path: &str, file: &SnapshotFile) -> Summary {
        let s = &file.snapshot;
        let names = s.devices();
        let devices = (0..names.len().max(s.device_traces.len()))
            .filter_map(|index| {
                let name = names.get(index).cloned().unwrap_or_else(|| format!("device {index}"));
                replay(s, index, name)
            })
            .collect();
        Summary {
            file: path.to_string(),
            writer: if s.memlab.is_some() { "memlab" } else { "pytorch" },
            protocol: file.protocol,
            run: s.memlab.as_ref().and_then(|m| m.run.clone()),
            devices,
            ignored: file.ignored.clone(),
        }
    }
}

/// Where a live block came from.
#[derive(Clone)]
pub enum Origin {
    /// The trace's event at this index.
    Event(usize),
    /// Before the history; the final segment's stack for it, if it lived on.
    Before(Option<Stack>),
}

/// A live block: its bytes (as requested) and where it came from.
pub type Live = HashMap<u64, (u64, Origin)>;

/// One device's trace and what was live before its first event.
pub struct Start<'s> {
    /// The device's events.
    pub trace: &'s [TraceEntry],
    /// The action that gives a block back: CUDA's `free_completed` where
    /// the trace has them, else `free_requested`.
    pub release: Action,
    /// What was live before the first event.
    pub live: Live,
    /// Of that, the blocks the trace frees without having seen them made.
    pub missing_frees: Bytes,
}

impl<'s> Start<'s> {
    /// Device `index` of `s`.
    pub fn of(s: &'s Snapshot, index: usize) -> Start<'s> {
        let trace: &[TraceEntry] = s.device_traces.get(index).map_or(&[], |t| t.as_slice());
        let release = if trace.iter().any(|e| e.action == Action::FreeCompleted) {
            Action::FreeCompleted
        } else {
            Action::FreeRequested
        };
        // Blocks whose first event frees them, and blocks of the final
        // segments the trace never touches.
        let mut first: HashMap<u64, Action> = HashMap::new();
        let mut live: Live = HashMap::new();
        let mut missing_frees = Bytes::default();
        for e in trace {
            let Some(addr) = e.addr else { continue };
            if !matches!(e.action, Action::Alloc | Action::FreeRequested | Action::FreeCompleted) {
                continue;
            }
            let first_action = *first.entry(addr).or_insert(e.action);
            if first_action != Action::Alloc && e.action == release && !live.contains_key(&addr) {
                live.insert(addr, (e.size, Origin::Before(None)));
                missing_frees.add(e.size);
            }
        }
        for block in live_blocks(s, index) {
            if !first.contains_key(&block.address) {
                let frames = (!block.frames.is_empty()).then(|| block.frames.clone());
                live.insert(block.address, (block.requested_size, Origin::Before(frames)));
            }
        }
        Start { trace, release, live, missing_frees }
    }

    /// The live set after the first `events` events.
    pub fn live_after(&self, events: usize) -> Live {
        let mut live = self.live.clone();
        let (mut allocated, mut reserved) = (0u64, 0i128);
        for (i, e) in self.trace.iter().enumerate().take(events) {
            apply(e, i, self.release, &mut live, &mut allocated, &mut reserved);
        }
        live
    }
}

/// Device `index`'s reserved bytes before `trace` (its history) began: what
/// its final segments hold less what the history's segment events added
/// (allocations and maps, less frees and unmaps). Below 0 where the events
/// add up to more than the final segments: the history is partial then, and
/// the bytes before it unknown. The one computation the summary, the replay
/// and `memlab merge` share.
pub fn reserved_before(s: &Snapshot, index: usize, trace: &[TraceEntry]) -> i128 {
    let at_end: i128 = s.segments.iter().filter(|seg| seg.device == index).map(|seg| i128::from(seg.total_size)).sum();
    let added: i128 = trace
        .iter()
        .map(|e| match e.action {
            Action::SegmentAlloc | Action::SegmentMap => i128::from(e.size),
            Action::SegmentFree | Action::SegmentUnmap => -i128::from(e.size),
            _ => 0,
        })
        .sum();
    at_end - added
}

/// A long history drawn as at most a given number of points: its events cut
/// into consecutive stretches of equal count, each kept as the moment its
/// rank (allocated bytes) was highest, the first of equals. The HTML
/// report's timelines and `memlab merge`'s levels both keep their points so.
pub struct Stretches<T> {
    per: usize,
    kept: Vec<(i128, T)>,
}

/// Where an event offered to [`Stretches`] stands in its stretch.
pub enum Offer<'a, T> {
    /// The highest of its stretch so far: the caller writes its moment here.
    Highest(&'a mut T),
    /// Below what the stretch keeps, which the caller may still update.
    Lower(&'a mut T),
}

impl<T> Stretches<T> {
    /// Stretches for a history of `events` events, at most `points` of them.
    pub fn new(events: usize, points: usize) -> Stretches<T> {
        Stretches { per: events.div_ceil(points.max(1)).max(1), kept: Vec::new() }
    }

    /// Event `i` (offered in order, each once) with its `rank`; `new` makes
    /// the moment of a stretch's first event, which is then its highest.
    pub fn offer(&mut self, i: usize, rank: i128, new: impl FnOnce() -> T) -> Offer<'_, T> {
        if self.kept.len() <= i / self.per {
            self.kept.push((i128::MIN, new()));
        }
        let (best, kept) = self.kept.last_mut().expect("a stretch");
        if rank > *best {
            *best = rank;
            Offer::Highest(kept)
        } else {
            Offer::Lower(kept)
        }
    }

    /// The moments kept, one per stretch, in order.
    pub fn points(self) -> Vec<T> {
        self.kept.into_iter().map(|(_, moment)| moment).collect()
    }
}

/// The blocks of device `index`'s final segments that are not free.
fn live_blocks(s: &Snapshot, index: usize) -> impl Iterator<Item = &Block> {
    s.segments
        .iter()
        .filter(move |seg| seg.device == index)
        .flat_map(|seg| &seg.blocks)
        .filter(|b| b.state != BlockState::Inactive)
}

fn replay(s: &Snapshot, index: usize, device: String) -> Option<DeviceSummary> {
    let segments: Vec<_> = s.segments.iter().filter(|seg| seg.device == index).collect();
    let Start { trace, release, live: start, missing_frees } = Start::of(s, index);
    if trace.is_empty() && segments.is_empty() {
        return None;
    }
    let cpu = device == "cpu";
    let before = start.values().fold(Bytes::default(), |mut b, (size, _)| {
        b.add(*size);
        b
    });
    let final_reserved: u64 = segments.iter().map(|seg| seg.total_size).sum();
    let mut partial = Vec::new();
    if let Some(info) = s.memlab.as_ref().filter(|i| i.partial) {
        partial.push(format!(
            "memlab's recording dropped {} of its {} events (its history is bounded: raise `Settings::capacity`)",
            info.dropped, info.recorded
        ));
    }
    if missing_frees.blocks > 0 {
        partial.push(format!(
            "the history frees {} block(s) ({} bytes) it never saw allocated: it starts after they were (PyTorch \
             keeps the last `max_entries` events)",
            missing_frees.blocks, missing_frees.bytes
        ));
    }
    let start_reserved = reserved_before(s, index, trace);
    let reserved_known = !cpu && start_reserved >= 0;
    if !cpu && start_reserved < 0 {
        partial.push("the segment events add up to more than the final segments: reserved bytes are unknown".into());
    }
    let t0 = trace.first().map_or(0, |e| e.time_us);
    let when = |i: usize| trace.get(i).map_or(0, |e| e.time_us.saturating_sub(t0));

    // First pass: the peaks.
    let mut live = start.clone();
    let mut allocated: u64 = before.bytes;
    let mut reserved: i128 = start_reserved;
    let reserved_now = |r: i128| reserved_known.then_some(r.max(0) as u64);
    let mut peak = Moment { allocated, reserved: reserved_now(reserved), event: 0, time_us: 0 };
    let mut reserved_peak = peak;
    let mut peak_index = 0usize;
    let mut ooms = Vec::new();
    for (i, e) in trace.iter().enumerate() {
        apply(e, i, release, &mut live, &mut allocated, &mut reserved);
        if e.action == Action::Oom {
            ooms.push(OomAt { requested: e.size, device_free: e.device_free, time_us: when(i), event: i as u64 + 1 });
        }
        if allocated > peak.allocated {
            peak = Moment { allocated, reserved: reserved_now(reserved), event: i as u64 + 1, time_us: when(i) };
            peak_index = i + 1;
        }
        if reserved_known && reserved > i128::from(reserved_peak.reserved.unwrap_or(0)) {
            reserved_peak =
                Moment { allocated, reserved: reserved_now(reserved), event: i as u64 + 1, time_us: when(i) };
        }
    }
    // The replay's end against the final segments.
    let final_allocated: u64 = live_blocks(s, index).map(|b| b.requested_size).sum();
    if allocated != final_allocated {
        partial.push(format!(
            "the replayed history ends with {allocated} bytes allocated where the final segments hold {final_allocated}"
        ));
    }
    let end = Moment {
        allocated: final_allocated,
        reserved: (!cpu).then_some(final_reserved),
        event: trace.len() as u64,
        time_us: when(trace.len().saturating_sub(1)),
    };

    // Second pass: what was live at the peak.
    let mut live = start;
    let (mut allocated, mut reserved) = (before.bytes, start_reserved);
    for (i, e) in trace.iter().enumerate().take(peak_index) {
        apply(e, i, release, &mut live, &mut allocated, &mut reserved);
    }
    let mut categories: HashMap<String, Bytes> = HashMap::new();
    let mut sites: HashMap<(Option<Site>, bool), Bytes> = HashMap::new();
    let mut site_of_stack: HashMap<usize, Option<Site>> = HashMap::new();
    for (size, origin) in live.values() {
        let (category, frames) = match origin {
            Origin::Event(i) => (trace[*i].category.map(|c| c.as_str()), Some(&trace[*i].frames)),
            Origin::Before(frames) => (None, frames.as_ref()),
        };
        categories.entry(category.unwrap_or("uncategorized").to_string()).or_default().add(*size);
        let site = match frames {
            Some(frames) => site_of_stack.entry(frames.as_ptr() as usize).or_insert_with(|| Site::of(frames)).clone(),
            None => None,
        };
        let before_history = site.is_none() && matches!(origin, Origin::Before(_));
        sites.entry((site, before_history)).or_default().add(*size);
    }
    let mut by_category: Vec<CategoryShare> =
        categories.into_iter().map(|(category, held)| CategoryShare { category, held }).collect();
    by_category.sort_by(|a, b| b.held.bytes.cmp(&a.held.bytes).then_with(|| a.category.cmp(&b.category)));
    let mut by_site: Vec<SiteShare> =
        sites.into_iter().map(|((site, before_history), held)| SiteShare { site, before_history, held }).collect();
    by_site.sort_by(|a, b| b.held.bytes.cmp(&a.held.bytes).then_with(|| a.site.cmp(&b.site)));

    let unseen_before =
        s.memlab.iter().flat_map(|m| &m.unseen_before).find(|u| u.device == device).map_or(0, |u| u.bytes);
    Some(DeviceSummary {
        device,
        events: trace.len() as u64,
        span_us: when(trace.len().saturating_sub(1)),
        first_us: t0,
        peak,
        reserved_peak: reserved_known.then_some(reserved_peak),
        end,
        before,
        partial,
        by_category,
        by_site,
        ooms,
        unseen_before,
    })
}

/// Applies event `i` (`e`) to the live set and the levels.
pub fn apply(e: &TraceEntry, i: usize, release: Action, live: &mut Live, allocated: &mut u64, reserved: &mut i128) {
    match e.action {
        Action::Alloc => {
            if let Some(addr) = e.addr {
                if let Some((old, _)) = live.insert(addr, (e.size, Origin::Event(i))) {
                    *allocated -= old;
                }
                *allocated += e.size;
            }
        }
        a if a == release => {
            if let Some((old, _)) = e.addr.and_then(|addr| live.remove(&addr)) {
                *allocated -= old;
            }
        }
        Action::SegmentAlloc | Action::SegmentMap => *reserved += i128::from(e.size),
        Action::SegmentFree | Action::SegmentUnmap => *reserved -= i128::from(e.size),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::short_path;

    #[test]
    fn one_way_to_shorten_a_path() {
        assert_eq!(short_path("/home/u/proj/src/model/train.rs"), "src/model/train.rs");
        assert_eq!(short_path("/home/u/proj/tests/step.rs"), "tests/step.rs");
        // The innermost crate folder: a crate inside another's tests.
        assert_eq!(short_path("/w/memlab/tests/copies/src/lib.rs"), "src/lib.rs");
        assert_eq!(short_path("/home/u/proj/train.py"), "proj/train.py");
        assert_eq!(short_path("train.py"), "train.py");
        assert_eq!(short_path("a/b.py"), "a/b.py");
    }
}
