//! A recording replayed through the allocator model: each device's history
//! of a snapshot (memlab's or PyTorch's) request by request, under the
//! settings it was recorded with or others, with the model's segment events
//! checked against the recorded ones.

use std::collections::HashMap;

use super::allocator::{BlockId, CachingAllocator, ModelOom, SegmentAction};
use super::config::AllocatorConfig;
use crate::error::{Error, Result};
use crate::events::Action;
use crate::export::{Snapshot, TraceEntry};

/// How many of the failures only the replay has (the recording served
/// them) a [`DeviceReplay`] lists.
pub const OOMS_KEPT: usize = 16;

/// The card a replay runs on: the bytes for the allocator, and its total.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Card {
    /// The bytes the allocator can obtain in all (`cudaMalloc` fails beyond).
    pub capacity: u64,
    /// The device's memory (`totalGlobalMem`): the base of the memory
    /// fraction, and of an expandable segment's address range.
    pub total: u64,
}

/// One device's history replayed.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeviceReplay {
    /// `cuda:0`.
    pub device: String,
    /// The settings replayed, as `PYTORCH_CUDA_ALLOC_CONF` writes them.
    pub settings: String,
    /// Segment events of the recording (`segment_alloc`, `segment_free`,
    /// `segment_map`, `segment_unmap`).
    pub segment_events: usize,
    /// Of them, how many the model made too, at the same place in the
    /// sequence, with the same action and size (under other settings than
    /// the recording's, a figure of how far they differ, not of fidelity).
    pub segment_events_matched: usize,
    /// The first recorded segment event the model did not make, with what it made there.
    pub first_mismatch: Option<Mismatch>,
    /// The highest reserved bytes.
    pub peak_reserved: u64,
    /// The highest allocated bytes (blocks, as libtorch counts them).
    pub peak_allocated: u64,
    /// The segments at the reserved peak, at their fullest.
    pub at_peak: AtPeak,
    /// Requests the model could not serve, in order: every one the
    /// recording failed too, and the first [`OOMS_KEPT`] others (a history
    /// replayed under settings it does not fit may fail thousands).
    pub ooms: Vec<ReplayOom>,
    /// How many requests the model could not serve, all of them.
    #[serde(default)]
    pub oom_count: usize,
    /// The recording's out-of-memory requests that the model served.
    pub avoided: usize,
    /// The history entry of the recording's first out-of-memory error where
    /// the program went on after it (caught the error and allocated again).
    /// The replay follows the program's requests as recorded, so it is
    /// exact up to that entry; after it, what it says holds only if those
    /// requests did not depend on the error (a loop that allocates until it
    /// fails asks for more wherever more memory is left).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continued_after_oom: Option<usize>,
    /// Where the replay calls `empty_cache`: the recording's segments given
    /// back outside any request, by the index of the history entry after them.
    pub empty_cache_at: Vec<usize>,
    /// Frees of blocks the history never allocated: it starts after they
    /// were (PyTorch keeps only its last `max_entries`), and the replay,
    /// which starts from an empty allocator, misses what they held.
    pub unknown_frees: usize,
    /// Bytes of segments the allocator held before the history began: the
    /// snapshot's final segments less what the history's segment events
    /// added. The replay starts from an empty allocator: requests the real
    /// one served from those segments get new ones in the replay.
    pub reserved_before: u64,
    /// Of those segments, how many the replay rebuilt before its first
    /// entry (from the snapshot's final segments and the history, undone),
    /// and the blocks in use in them then: the replay then starts where the
    /// allocator was. None where the history maps expandable segments.
    pub rebuilt_segments: usize,
    /// The blocks in use in the rebuilt segments when the history began.
    pub rebuilt_blocks: usize,
    /// Requests that found the allocator at its limit, so that it gave
    /// cached blocks back before it served them or failed
    /// ([`CachingAllocator::limit_reached`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub limit_reached: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How full the segments were at the reserved peak: of the moments when
/// reserved stood at its peak, the one when the most was allocated. What is
/// free then is what the allocator held beyond the tensors at their fullest:
/// the fragmentation and caching the peak paid for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AtPeak {
    /// The history entry after which it was so.
    pub entry: usize,
    /// Reserved bytes (the peak).
    pub reserved: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// The largest free block in the segments.
    pub largest_free: u64,
}

impl AtPeak {
    /// Bytes inside the reserved segments that no tensor used.
    pub fn free(&self) -> u64 {
        self.reserved - self.allocated
    }

    /// [`free`](Self::free) as a share of reserved (0 with nothing reserved).
    pub fn free_share(&self) -> f64 {
        if self.reserved == 0 {
            0.0
        } else {
            self.free() as f64 / self.reserved as f64
        }
    }
}

/// A recorded segment event against the model's.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mismatch {
    /// Its place among the recording's segment events.
    pub index: usize,
    /// The recording's: action and bytes.
    pub recorded: (String, u64),
    /// The model's at that place, if it made one.
    pub replayed: Option<(String, u64)>,
}

/// A request the replay could not serve.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayOom {
    /// Its history entry.
    pub entry: usize,
    /// Whether the recording failed it too.
    pub recorded: bool,
    /// The model's figures then.
    pub oom: ModelOom,
}

fn name(action: SegmentAction) -> &'static str {
    match action {
        SegmentAction::Alloc => "segment_alloc",
        SegmentAction::Free => "segment_free",
        SegmentAction::Map => "segment_map",
        SegmentAction::Unmap => "segment_unmap",
    }
}

fn segment_action(action: Action) -> Option<SegmentAction> {
    match action {
        Action::SegmentAlloc => Some(SegmentAction::Alloc),
        Action::SegmentFree => Some(SegmentAction::Free),
        Action::SegmentMap => Some(SegmentAction::Map),
        Action::SegmentUnmap => Some(SegmentAction::Unmap),
        _ => None,
    }
}

/// Replays device `index` of `snapshot` under `config` on `card`. The
/// points where the recording gave segments back outside any request (an
/// `empty_cache`) are found by replaying under `recorded` (the recording's
/// own settings) first, unless they are given.
pub fn replay_device(
    snapshot: &Snapshot,
    index: usize,
    recorded: &AllocatorConfig,
    config: &AllocatorConfig,
    card: Card,
) -> Result<DeviceReplay> {
    let empty_cache_at =
        if recorded == config { None } else { Some(run(snapshot, index, recorded, card, None, 0)?.empty_cache_at) };
    run(snapshot, index, config, card, empty_cache_at.as_deref(), 0)
}

/// Replays device `index` of `snapshot` under `config` on `card`, calling
/// `empty_cache` where a replay under the recorded settings found the
/// recording did ([`DeviceReplay::empty_cache_at`]): for several settings
/// after one replay under the recorded ones, each history read once.
pub fn replay_device_at(
    snapshot: &Snapshot,
    index: usize,
    config: &AllocatorConfig,
    card: Card,
    empty_cache_at: &[usize],
) -> Result<DeviceReplay> {
    run(snapshot, index, config, card, Some(empty_cache_at), 0)
}

/// [`replay_device_at`] with the figures of the history's part from entry
/// `from` on: the peaks, the segments at the reserved peak and the requests
/// that found the allocator at its limit are counted from there (a batch
/// search's last try, after the cache given back before it), whatever the
/// earlier part reached, and so are the failures the model alone makes.
pub fn replay_device_part(
    snapshot: &Snapshot,
    index: usize,
    config: &AllocatorConfig,
    card: Card,
    empty_cache_at: &[usize],
    from: usize,
) -> Result<DeviceReplay> {
    run(snapshot, index, config, card, Some(empty_cache_at), from)
}

fn run(
    snapshot: &Snapshot,
    index: usize,
    config: &AllocatorConfig,
    card: Card,
    empty_cache_at: Option<&[usize]>,
    from: usize,
) -> Result<DeviceReplay> {
    // Replayed under the recorded settings (the caller asks where the
    // cache was given back under others): the driver's addresses hold.
    let as_recorded = empty_cache_at.is_none();
    let names = snapshot.devices();
    let name_of = names.get(index).cloned().unwrap_or_else(|| format!("device {index}"));
    if !name_of.starts_with("cuda") {
        return Err(Error::InvalidArgument(format!("{name_of} has no caching allocator to replay")));
    }
    let trace: &[TraceEntry] = snapshot
        .device_traces
        .get(index)
        .ok_or_else(|| Error::InvalidArgument(format!("the snapshot has no history of {name_of}")))?;
    let mut model = CachingAllocator::new(config.clone(), card.capacity, card.total)?;
    let recorded: Vec<(SegmentAction, u64)> =
        trace.iter().filter_map(|e| segment_action(e.action).map(|a| (a, e.size))).collect();
    let mut live: HashMap<u64, BlockId> = HashMap::new();
    let mut out = DeviceReplay {
        device: name_of,
        settings: config.to_conf(),
        segment_events: recorded.len(),
        segment_events_matched: 0,
        first_mismatch: None,
        peak_reserved: 0,
        peak_allocated: 0,
        at_peak: AtPeak::default(),
        ooms: Vec::new(),
        oom_count: 0,
        avoided: 0,
        continued_after_oom: continued_after_oom(trace),
        empty_cache_at: Vec::new(),
        unknown_frees: 0,
        reserved_before: 0,
        rebuilt_segments: 0,
        rebuilt_blocks: 0,
        limit_reached: 0,
    };
    out.reserved_before = u64::try_from(crate::export::analysis::reserved_before(snapshot, index, trace)).unwrap_or(0);
    if out.reserved_before > 0 {
        (out.rebuilt_segments, out.rebuilt_blocks) = rebuild(snapshot, index, trace, &mut model, &mut live);
    }
    // Recorded segment events seen so far, and those the model has made.
    let mut seen = 0;
    // Whether the figures are counted yet (from the first request at or
    // after `from`), and what the part before left in the allocator's count.
    let (mut counting, mut limit_reached_before) = (false, 0);
    let made = |m: &CachingAllocator| m.segment_events().len();
    let gives_back = |a: SegmentAction| matches!(a, SegmentAction::Free | SegmentAction::Unmap);
    for (i, e) in trace.iter().enumerate() {
        if segment_action(e.action).is_some() {
            seen += 1;
            continue;
        }
        // Segments the recording gave back that no request explains yet: an
        // `empty_cache` before this entry, or the frees of this request's
        // own retry. Under the recorded settings the model tells which.
        let pending = &recorded[made(&model).min(seen)..seen];
        let call_empty_cache = match empty_cache_at {
            // In history order: sorted.
            Some(points) => points.binary_search(&i).is_ok(),
            None => {
                !pending.is_empty()
                    && gives_back(pending[0].0)
                    && !(matches!(e.action, Action::Alloc | Action::Oom) && {
                        let mut trial = model.clone();
                        let before = made(&trial);
                        let _ = trial.malloc(e.size, e.stream);
                        let new: Vec<(SegmentAction, u64)> =
                            trial.segment_events()[before..].iter().map(|s| (s.action, s.size)).collect();
                        new == pending
                    })
            }
        };
        if call_empty_cache {
            model.empty_cache();
            out.empty_cache_at.push(i);
        }
        if !counting && i >= from {
            counting = true;
            limit_reached_before = model.limit_reached();
        }
        // The segment the request made, where the recording says so, under
        // the settings it was made with: at the driver's address.
        let made = i.checked_sub(1).map(|p| &trace[p]).filter(|p| p.action == Action::SegmentAlloc);
        if let (Some(made), true, Action::Alloc | Action::Oom) = (made, as_recorded, e.action) {
            if let Some(address) = made.addr {
                model.next_segment_at(address, made.size);
            }
        }
        match e.action {
            Action::Alloc => match model.malloc(e.size, e.stream) {
                Ok(id) => {
                    if let Some(addr) = e.addr {
                        live.insert(addr, id);
                    }
                }
                // The part's own failures only.
                Err(_) if !counting => {}
                Err(oom) => {
                    out.oom_count += 1;
                    if out.ooms.iter().filter(|o| !o.recorded).count() < OOMS_KEPT {
                        out.ooms.push(ReplayOom { entry: i, recorded: false, oom });
                    }
                }
            },
            Action::Oom => match model.malloc(e.size, e.stream) {
                // The program got its error there: what the model served is given back.
                Ok(id) => {
                    out.avoided += 1;
                    model.free(id);
                }
                Err(oom) => {
                    out.oom_count += 1;
                    out.ooms.push(ReplayOom { entry: i, recorded: true, oom });
                }
            },
            Action::FreeRequested => match e.addr.as_ref().and_then(|a| live.get(a)) {
                Some(&id) => drop(model.free_deferred(id)),
                None => out.unknown_frees += 1,
            },
            Action::FreeCompleted => {
                if let Some(id) = e.addr.and_then(|a| live.remove(&a)) {
                    model.complete_free(id);
                }
            }
            _ => {}
        }
        if counting {
            note_peak(&mut out, &model, i);
        }
    }
    // Segments given back after the last request: an `empty_cache` at the end.
    let at_end = match empty_cache_at {
        Some(points) => points.binary_search(&trace.len()).is_ok(),
        None => made(&model) < seen && gives_back(recorded[made(&model)].0),
    };
    if at_end {
        model.empty_cache();
        out.empty_cache_at.push(trace.len());
    }
    if !counting {
        // A part with no request: what the allocator holds at its start.
        note_peak(&mut out, &model, trace.len());
        limit_reached_before = model.limit_reached();
    }
    out.limit_reached = model.limit_reached() - limit_reached_before;
    let replayed: Vec<(SegmentAction, u64)> = model.segment_events().iter().map(|s| (s.action, s.size)).collect();
    out.segment_events_matched = recorded.iter().zip(&replayed).filter(|(r, m)| r == m).count();
    let first = recorded.iter().zip(&replayed).take_while(|(r, m)| r == m).count();
    let at = first;
    if at < recorded.len() {
        out.first_mismatch = Some(Mismatch {
            index: at,
            recorded: (name(recorded[at].0).to_string(), recorded[at].1),
            replayed: replayed.get(at).map(|(a, s)| (name(*a).to_string(), *s)),
        });
    }
    Ok(out)
}

/// Counts the allocator's state after history entry `entry` into `out`'s
/// peaks.
fn note_peak(out: &mut DeviceReplay, model: &CachingAllocator, entry: usize) {
    let s = model.stats();
    let (reserved, allocated) = (s.reserved_bytes.all.current as u64, s.allocated_bytes.all.current as u64);
    out.peak_allocated = out.peak_allocated.max(allocated);
    if reserved > out.peak_reserved || (reserved == out.peak_reserved && allocated > out.at_peak.allocated) {
        out.peak_reserved = reserved;
        out.at_peak = AtPeak { entry, reserved, allocated, largest_free: model.largest_free_block() };
    }
}

/// The first out-of-memory error of `trace` after which the program asked
/// for memory again.
fn continued_after_oom(trace: &[TraceEntry]) -> Option<usize> {
    let first = trace.iter().position(|e| e.action == Action::Oom)?;
    trace[first + 1..].iter().any(|e| matches!(e.action, Action::Alloc | Action::Oom)).then_some(first)
}

/// The segments the allocator held when the history began, and the blocks
/// in use in them, rebuilt into `model` by undoing the history: the
/// snapshot's final segments the history did not make, and those it gave
/// back without having made them; the blocks it frees without having
/// allocated them, and those held at the end that it never allocated. The
/// blocks go into `live` by their recorded addresses. Returns how many
/// segments and blocks; none where the history maps expandable segments
/// (their pages are not rebuilt).
fn rebuild(
    snapshot: &Snapshot,
    index: usize,
    trace: &[TraceEntry],
    model: &mut CachingAllocator,
    live: &mut HashMap<u64, BlockId>,
) -> (usize, usize) {
    use crate::export::{BlockState, SegmentType};
    use std::collections::{BTreeMap, HashSet};
    // Segments before the history: address → (bytes, stream, small pool).
    let mut before: BTreeMap<u64, (u64, u64, bool)> = BTreeMap::new();
    let mut made: HashSet<u64> = HashSet::new();
    let mut allocated: HashSet<u64> = HashSet::new();
    // Blocks in use before the history: (address, bytes).
    let mut held: Vec<(u64, u64)> = Vec::new();
    for e in trace {
        let Some(addr) = e.addr else { continue };
        // A guard that removes what the history made or allocated itself
        // leaves the rest: what was there before it.
        match e.action {
            Action::SegmentAlloc => {
                made.insert(addr);
            }
            Action::SegmentFree if !made.remove(&addr) => {
                before.insert(addr, (e.size, e.stream, e.size <= super::SMALL_BUFFER));
            }
            Action::SegmentMap | Action::SegmentUnmap => return (0, 0),
            Action::Alloc => {
                allocated.insert(addr);
            }
            Action::FreeRequested if !allocated.remove(&addr) => held.push((addr, e.size)),
            _ => {}
        }
    }
    for s in snapshot.segments.iter().filter(|s| s.device == index) {
        if s.is_expandable {
            return (0, 0);
        }
        if made.contains(&s.address) {
            continue;
        }
        before.insert(s.address, (s.total_size, s.stream, s.segment_type == SegmentType::Small));
        for b in &s.blocks {
            let in_use = matches!(b.state, BlockState::ActiveAllocated | BlockState::ActivePendingFree);
            if in_use && !allocated.contains(&b.address) {
                held.push((b.address, b.size));
            }
        }
    }
    // In the model, in the order of their addresses.
    let placed: Vec<(u64, u64, u64)> = before
        .iter()
        .map(|(&address, &(size, stream, small))| {
            model.next_segment_at(address, size);
            (address, size, model.restore_segment(size, stream, small))
        })
        .collect();
    let mut blocks = 0;
    for (address, size) in held {
        let segment = placed.iter().find(|&&(start, bytes, _)| start <= address && address + size <= start + bytes);
        if let Some(&(start, _, at)) = segment {
            if let Some(id) = model.restore_block(at + (address - start), size) {
                live.insert(address, id);
                blocks += 1;
            }
        }
    }
    (placed.len(), blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::MIB;

    use crate::replay::tests::history as snapshot;

    const CARD: Card = Card { capacity: 80 << 30, total: 80 << 30 };

    #[test]
    fn segments_given_back_outside_a_request_are_an_empty_cache() {
        use Action::*;
        // 30 MiB allocated and freed; then its segment is given back and a
        // 5 MiB request gets a new 20 MiB segment. The model would serve the
        // 5 MiB from the free 30 MiB block, so the recording called
        // empty_cache before it (entry 5).
        let s = snapshot(&[
            (SegmentAlloc, 1, 30 * MIB),
            (Alloc, 1, 30 * MIB),
            (FreeRequested, 1, 30 * MIB),
            (FreeCompleted, 1, 30 * MIB),
            (SegmentFree, 1, 30 * MIB),
            (SegmentAlloc, 2, 20 * MIB),
            (Alloc, 2, 5 * MIB),
        ]);
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        assert_eq!((r.segment_events_matched, r.segment_events, r.empty_cache_at.clone()), (3, 3, vec![6]));
        // Replayed under another setting, empty_cache is called at the same place.
        let other = AllocatorConfig::parse("max_split_size_mb:64").unwrap();
        let r = replay_device(&s, 0, &default, &other, CARD).unwrap();
        assert_eq!(r.empty_cache_at, vec![6]);
    }

    /// A part's figures are its own: on a 40 MiB card a cached 30 MiB
    /// block is given back for a 34 MiB one, then the cache goes back and
    /// 5 MiB follow. The whole history peaks at the 34 MiB; the part after
    /// it at its own 20 MiB segment, and the request that found the
    /// allocator at its limit before is not the part's.
    #[test]
    fn the_figures_of_a_part_are_counted_from_its_start() {
        use Action::*;
        let s = snapshot(&[
            (Alloc, 1, 30 * MIB),
            (FreeRequested, 1, 30 * MIB),
            (FreeCompleted, 1, 30 * MIB),
            (Alloc, 2, 34 * MIB),
            (FreeRequested, 2, 34 * MIB),
            (FreeCompleted, 2, 34 * MIB),
            (Alloc, 3, 5 * MIB),
        ]);
        let default = AllocatorConfig::default();
        let card = Card { capacity: 40 * MIB, total: 80 << 30 };
        let whole = replay_device_at(&s, 0, &default, card, &[6]).unwrap();
        assert_eq!((whole.peak_reserved, whole.peak_allocated, whole.limit_reached), (34 * MIB, 34 * MIB, 1));
        let part = replay_device_part(&s, 0, &default, card, &[6], 6).unwrap();
        assert_eq!((part.peak_reserved, part.peak_allocated, part.limit_reached), (20 * MIB, 5 * MIB, 0));
        assert_eq!((part.at_peak.entry, part.empty_cache_at.clone()), (6, vec![6]));
        // A part with no request holds what the allocator holds at its start.
        let empty = replay_device_part(&s, 0, &default, card, &[6, 7], 7).unwrap();
        assert_eq!((empty.peak_reserved, empty.peak_allocated, empty.limit_reached), (20 * MIB, 5 * MIB, 0));
    }

    #[test]
    fn a_requests_own_flush_is_not_an_empty_cache() {
        use Action::*;
        // On a 40 MiB card: a 34 MiB request after a freed 30 MiB block needs
        // its own 34 MiB segment (30 + 34 > 40): the allocator gives back the
        // free one and retries, in the request; no empty_cache.
        let s = snapshot(&[
            (SegmentAlloc, 1, 30 * MIB),
            (Alloc, 1, 30 * MIB),
            (FreeRequested, 1, 30 * MIB),
            (FreeCompleted, 1, 30 * MIB),
            (SegmentFree, 1, 30 * MIB),
            (SegmentAlloc, 2, 34 * MIB),
            (Alloc, 2, 34 * MIB),
        ]);
        let card = Card { capacity: 40 * MIB, total: 80 << 30 };
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, card).unwrap();
        assert_eq!((r.segment_events_matched, r.segment_events), (3, 3));
        assert!(r.empty_cache_at.is_empty(), "{:?}", r.empty_cache_at);
        // On a card with room for both, the same history reads as an
        // empty_cache before the request: the capacity tells them apart.
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        assert_eq!((r.segment_events_matched, r.empty_cache_at), (3, vec![6]));
    }

    #[test]
    fn at_the_peak_is_the_peaks_fullest_moment() {
        use Action::*;
        // 3 MiB and 5 MiB from one 20 MiB segment: [3][5][12 free]. Freeing
        // the 3 MiB leaves reserved at its peak with less allocated, so the
        // peak's fullest moment stays after the second request (entry 2,
        // the segment event being entry 0): 12 MiB free, all of it one block.
        let s = snapshot(&[
            (SegmentAlloc, 1, 20 * MIB),
            (Alloc, 1, 3 * MIB),
            (Alloc, 2, 5 * MIB),
            (FreeRequested, 1, 3 * MIB),
            (FreeCompleted, 1, 3 * MIB),
        ]);
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        let expected = AtPeak { entry: 2, reserved: 20 * MIB, allocated: 8 * MIB, largest_free: 12 * MIB };
        assert_eq!(r.at_peak, expected);
        assert_eq!((r.at_peak.free(), r.at_peak.free_share()), (12 * MIB, 0.6));
    }

    #[test]
    fn segments_held_before_the_history_are_rebuilt_with_their_blocks_in_use() {
        use crate::export::{Block, BlockState, Segment, SegmentType};
        use Action::*;
        // At the end the allocator holds one 20 MiB segment the history never
        // made, at 0x1000: 5 MiB in use that the history never allocated,
        // then 15 MiB free. The history frees a 3 MiB block it never
        // allocated, right after the 5 MiB, then asks for 12 MiB (at
        // 0x1000 + 5 MiB, where the freed 3 MiB and the free rest meet).
        // Rebuilt, the segment is [5 in use][3 in use][12 free]; the free
        // merges the 3 MiB into 15 MiB, which serves the 12 MiB: no new
        // segment, as none was recorded. An empty allocator would have made a
        // 20 MiB segment for it.
        let base = 0x1000;
        let mut s = snapshot(&[
            (FreeRequested, base + 5 * MIB, 3 * MIB),
            (FreeCompleted, base + 5 * MIB, 3 * MIB),
            (Alloc, base + 5 * MIB, 12 * MIB),
        ]);
        let block =
            |address, size, state| Block { address, size, requested_size: size, state, frames: Default::default() };
        s.segments.push(Segment {
            device: 0,
            address: base,
            total_size: 20 * MIB,
            stream: 0,
            segment_type: SegmentType::Large,
            allocated_size: 17 * MIB,
            active_size: 17 * MIB,
            requested_size: 17 * MIB,
            is_expandable: false,
            blocks: vec![
                block(base, 5 * MIB, BlockState::ActiveAllocated),
                block(base + 5 * MIB, 12 * MIB, BlockState::ActiveAllocated),
                block(base + 17 * MIB, 3 * MIB, BlockState::Inactive),
            ],
        });
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        assert_eq!((r.reserved_before, r.rebuilt_segments, r.rebuilt_blocks), (20 * MIB, 1, 2));
        assert_eq!((r.unknown_frees, r.segment_events, r.first_mismatch), (0, 0, None));
        assert_eq!((r.peak_reserved, r.peak_allocated), (20 * MIB, 17 * MIB));
    }

    #[test]
    fn a_history_that_starts_mid_run_says_so() {
        use Action::*;
        // A block freed that the history never allocated: it began later.
        let s =
            snapshot(&[(FreeRequested, 9, MIB), (FreeCompleted, 9, MIB), (SegmentAlloc, 1, 2 * MIB), (Alloc, 1, 512)]);
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        assert_eq!((r.unknown_frees, r.segment_events_matched), (1, 1));
    }

    #[test]
    fn a_history_the_model_cannot_follow_says_where_it_first_differs() {
        use Action::*;
        // A 5 MiB request takes a 20 MiB segment in libtorch 2.11 (below
        // 10 MiB: the large segment size); a recording that shows 25 MiB was
        // made with another size (large_segment_size_mb:25).
        let s = snapshot(&[(SegmentAlloc, 1, 25 * MIB), (Alloc, 1, 5 * MIB)]);
        let default = AllocatorConfig::default();
        let r = replay_device(&s, 0, &default, &default, CARD).unwrap();
        let m = r.first_mismatch.unwrap();
        assert_eq!(
            (m.index, m.recorded, m.replayed),
            (0, ("segment_alloc".into(), 25 * MIB), Some(("segment_alloc".into(), 20 * MIB)))
        );
        let config = AllocatorConfig::parse("large_segment_size_mb:25").unwrap();
        assert_eq!(replay_device(&s, 0, &config, &config, CARD).unwrap().first_mismatch, None);
    }

    /// Found by the property tests: a history that frees a 1-byte block and
    /// a 1 TiB segment it never saw made, on a card of nothing. The rebuilt
    /// block is cut out of the rebuilt segment; the replay neither panics
    /// nor gives back a segment a block still holds.
    #[test]
    fn a_rebuilt_block_of_odd_bytes_in_a_segment_larger_than_the_card_replays() {
        use Action::*;
        let mut s = snapshot(&[(Oom, 0, MIB + 1), (FreeRequested, 1 << 32, 1), (SegmentFree, 1 << 32, 1 << 40)]);
        s.device_traces[0][0].addr = None;
        let default = AllocatorConfig::default();
        let card = Card { capacity: 0, total: 80 << 30 };
        for conf in ["", "max_split_size_mb:64", "expandable_segments:True"] {
            let config = AllocatorConfig::parse(conf).unwrap();
            let r = replay_device(&s, 0, &default, &config, card).unwrap();
            assert_eq!((r.rebuilt_segments, r.rebuilt_blocks), (1, 1), "{conf}");
        }
    }
}
