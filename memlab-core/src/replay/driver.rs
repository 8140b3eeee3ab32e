//! Where the CUDA driver puts a process's `cudaMalloc` segments: a model of
//! its address space, as an H200 (CUDA 13, driver 580.159.04) showed it to
//! `cuMemAlloc` and `cuMemFree` sequences run in torch 2.11 processes and in
//! the zoo's recordings (`fixtures/zoo/`).
//!
//! Addresses matter to the caching allocator beyond telling blocks apart: of
//! two free blocks of one size it takes the one at the lower address, and
//! which one it splits shapes every segment after. The driver's placement,
//! in this model:
//!
//! - The context reserves a first range of 512 MiB below a top `T`. Before
//!   the process's first kernel only two slots of it are usable,
//!   `[T − 98, T − 96)` and `[T − 24, T)` MiB; a segment larger goes to a
//!   chunk below the range.
//! - The first kernel takes 2 MiB of those slots and reserves a second
//!   range of 512 MiB below everything, of which the top 6 MiB (a slice)
//!   are usable. Then, as a rule, the rest of the first range,
//!   `[T − 512, T − 98)` MiB, opens and is filled going up, each segment at
//!   the lowest address where it fits (freed ranges too), above what the
//!   libraries' code takes of it. But where a chunk made before the
//!   first kernel was left part empty by a segment over 2 MiB, the first
//!   range is given back instead, and chunks go into it from its top.
//! - A segment no open range holds gets a chunk of its size rounded up to
//!   32 MiB, 32 MiB-aligned: in the highest range given back that holds it
//!   with 32 MiB to spare, else right below every chunk so far. What the
//!   segment leaves of its chunk serves later segments.
//! - Ranges are searched newest first, each at its lowest address. A chunk
//!   whose every segment was freed is given back.
//!
//! So a process whose segments fit the first range lays them out going up,
//! and one that outgrows it, going down in 32 MiB chunks. What libraries
//! load outside the allocator (cuBLAS's, cuDNN's code: tens of MiB at their
//! first call) takes room in the same ranges: the model sets a figure aside
//! for it at the first range's bottom ([`LIBRARIES`]; where the first range
//! is given back, nothing), so where the first range fills is an estimate.

use std::collections::HashMap;

const MIB: u64 = 1 << 20;
/// Every segment takes whole 2 MiB pages of address space.
const PAGE: u64 = 2 * MIB;
/// A chunk's size is a multiple of it, and its address too.
const CHUNK: u64 = 32 * MIB;
/// The context's first range, and the second the first kernel reserves.
const RANGE: u64 = 512 * MIB;
/// The usable top of the second range.
const SLICE: u64 = 6 * MIB;
/// What code loaded outside the allocator takes of the first range, from
/// its bottom, in a training step: the first kernel's (8 MiB), cuBLAS's at
/// the first product (64–74 MiB), cuDNN's at the first convolution, RNN or
/// attention (6–10 MiB), as the H200's recordings showed. An estimate: it
/// sets where the first range fills, and every prediction of the zoo is the
/// same for any figure from 64 to 200 MiB.
const LIBRARIES: u64 = 82 * MIB;

/// A range the driver hands segments out of.
#[derive(Clone, Debug)]
struct Heap {
    /// Its bounds.
    low: u64,
    high: u64,
    /// Free ranges in it, by address, apart.
    free: Vec<(u64, u64)>,
    /// Segments in it.
    live: u64,
    /// A chunk, given back once empty (the first range and the slice stay).
    chunk: bool,
    /// The first segment made in it.
    first: u64,
}

impl Heap {
    /// `[low, high)`, free in `free`.
    fn new(low: u64, high: u64, chunk: bool, free: Vec<(u64, u64)>) -> Heap {
        Heap { low, high, free, live: 0, chunk, first: 0 }
    }

    /// The lowest free address with `bytes` free above it.
    fn lowest_fit(&self, bytes: u64) -> Option<u64> {
        self.free.iter().find(|&&(low, high)| high - low >= bytes).map(|&(low, _)| low)
    }

    fn take(&mut self, at: u64, bytes: u64) {
        take(&mut self.free, at, at.saturating_add(bytes));
        self.live += 1;
        if self.first == 0 {
            self.first = bytes;
        }
    }

    fn give(&mut self, at: u64, bytes: u64) {
        give(&mut self.free, at, at.saturating_add(bytes));
        self.live = self.live.saturating_sub(1);
    }

    fn free_bytes(&self) -> u64 {
        self.free.iter().map(|(low, high)| high - low).sum()
    }
}

/// Takes `[low, high)` out of the sorted, disjoint `ranges`.
fn take(ranges: &mut Vec<(u64, u64)>, low: u64, high: u64) {
    let mut kept = Vec::with_capacity(ranges.len() + 1);
    for &(a, b) in ranges.iter() {
        if b <= low || a >= high {
            kept.push((a, b));
            continue;
        }
        if a < low {
            kept.push((a, low));
        }
        if high < b {
            kept.push((high, b));
        }
    }
    *ranges = kept;
}

/// Adds `[low, high)` to the sorted, disjoint `ranges`, joining neighbours.
fn give(ranges: &mut Vec<(u64, u64)>, mut low: u64, mut high: u64) {
    if high <= low {
        return;
    }
    let mut kept = Vec::with_capacity(ranges.len() + 1);
    for &(a, b) in ranges.iter() {
        if b < low || a > high {
            kept.push((a, b));
        } else {
            low = low.min(a);
            high = high.max(b);
        }
    }
    kept.push((low, high));
    kept.sort_unstable();
    *ranges = kept;
}

/// The driver's address space as the model keeps it (see the module docs).
#[derive(Clone, Debug)]
pub(super) struct DriverSpace {
    /// The first range's top.
    top: u64,
    /// Newest last; the first range first.
    heaps: Vec<Heap>,
    /// Ranges given back, by address, apart.
    given_back: Vec<(u64, u64)>,
    /// Below it, nothing is held.
    floor: u64,
    /// Where a chunk too large for the room below goes, above the first range.
    above: u64,
    /// The first kernel has run (after the process's first segment).
    launched: bool,
    /// Each segment's bytes, by address.
    live: HashMap<u64, u64>,
}

impl DriverSpace {
    /// A process's address space whose first range ends at `top` (a
    /// multiple of 32 MiB, with room for ranges below it).
    pub(super) fn new(top: u64) -> DriverSpace {
        let slots = vec![(top - 98 * MIB, top - 96 * MIB), (top - 24 * MIB, top)];
        let first = Heap::new(top - RANGE, top, false, slots);
        DriverSpace {
            top,
            above: top,
            heaps: vec![first],
            given_back: Vec::new(),
            floor: top - RANGE,
            launched: false,
            live: HashMap::new(),
        }
    }

    /// Where the driver puts a new segment of `bytes`.
    pub(super) fn place(&mut self, bytes: u64) -> u64 {
        let size = bytes.div_ceil(PAGE).saturating_mul(PAGE).max(PAGE);
        let found = self.heaps.iter().enumerate().rev().find_map(|(i, h)| Some((i, h.lowest_fit(size)?)));
        let (heap, at) = match found {
            Some(found) => found,
            None => self.chunk(size),
        };
        self.heaps[heap].take(at, size);
        self.live.insert(at, size);
        // The process's first kernel follows its first segment (the tensor
        // it makes is filled).
        if !self.launched {
            self.launch();
        }
        at
    }

    /// A new chunk for a segment of `size`: in the highest range given back
    /// that holds it, else below every chunk so far.
    fn chunk(&mut self, size: u64) -> (usize, u64) {
        let bytes = size.div_ceil(CHUNK).saturating_mul(CHUNK);
        let in_given_back = self.given_back.iter().rev().find_map(|&(low, high)| {
            let base = high.checked_sub(bytes)? / CHUNK * CHUNK;
            (base.checked_sub(CHUNK)? >= low).then_some(base)
        });
        let base = match in_given_back {
            Some(base) => {
                take(&mut self.given_back, base, base.saturating_add(bytes));
                base
            }
            None => match self.floor.checked_sub(bytes).filter(|&base| base >= self.top / 2) {
                Some(base) => {
                    self.floor = base / CHUNK * CHUNK;
                    self.floor
                }
                // No room below (a chunk of exabytes, from a hostile
                // snapshot): above everything instead.
                None => {
                    let base = self.above;
                    self.above = base.saturating_add(bytes).checked_next_multiple_of(CHUNK).unwrap_or(u64::MAX);
                    base
                }
            },
        };
        let high = base.saturating_add(bytes);
        self.heaps.push(Heap::new(base, high, true, vec![(base, high)]));
        (self.heaps.len() - 1, base)
    }

    /// The process's first kernel.
    fn launch(&mut self) {
        self.launched = true;
        let top = self.top;
        let first = &mut self.heaps[0];
        let slot = if first.free.iter().any(|&(low, high)| low <= top - 98 * MIB && top - 96 * MIB <= high) {
            top - 98 * MIB
        } else {
            top - 24 * MIB
        };
        take(&mut first.free, slot, slot + PAGE);
        let part_empty = self.heaps.iter().any(|h| h.chunk && h.first > PAGE && h.free_bytes() > 0);
        if part_empty {
            // As the H200 gave it back: all of it but the top slot (what the
            // libraries' code takes then was not seen to follow a rule).
            give(&mut self.given_back, top - RANGE, top - 96 * MIB);
        } else {
            give(&mut self.heaps[0].free, top - RANGE + LIBRARIES, top - 98 * MIB);
        }
        let below = self.floor.saturating_sub(SLICE);
        self.heaps.push(Heap::new(below, self.floor, false, vec![(below, self.floor)]));
        self.floor = self.floor.saturating_sub(RANGE);
    }

    /// Below it, the model has placed nothing.
    pub(super) fn floor(&self) -> u64 {
        self.floor
    }

    /// The segment at `address` freed (`cudaFree`); an address the model did
    /// not place is ignored.
    pub(super) fn release(&mut self, address: u64) {
        let Some(size) = self.live.remove(&address) else { return };
        // The newest range holding it: a chunk made inside the first range
        // after it was given back, before the first range itself.
        let Some(i) = self.heaps.iter().rposition(|h| h.low <= address && address < h.high) else { return };
        self.heaps[i].give(address, size);
        let heap = &self.heaps[i];
        if !(heap.chunk && heap.live == 0) {
            return;
        }
        let (low, high) = (heap.low, heap.high);
        self.heaps.remove(i);
        if low <= self.floor {
            // The lowest chunk: the floor rises, over what was given back above it.
            self.floor = high;
            while let Some(&(a, b)) = self.given_back.iter().find(|&&(a, b)| a <= self.floor && self.floor <= b) {
                take(&mut self.given_back, a, b);
                self.floor = b;
            }
        } else {
            give(&mut self.given_back, low, high);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOP: u64 = 1 << 40;

    fn mib(address: u64) -> i64 {
        (address as i64 - TOP as i64) / MIB as i64
    }

    /// A process whose segments fit the first range lays them out going up
    /// from its bottom, above what the libraries take; the first segment
    /// sits in the top slot.
    #[test]
    fn segments_that_fit_the_first_range_go_up() {
        let mut space = DriverSpace::new(TOP);
        let placed: Vec<i64> = [20, 16, 16, 34, 16].map(|m| mib(space.place(m * MIB))).to_vec();
        assert_eq!(placed, [-24, -430, -414, -398, -364]);
    }

    /// Past the first range, 32 MiB chunks going down; what a segment leaves
    /// of its chunk serves the next that fits.
    #[test]
    fn segments_past_the_first_range_go_down_in_chunks() {
        let mut space = DriverSpace::new(TOP);
        space.place(2 * MIB);
        // The first range (332 MiB above the libraries' 82) is filled.
        assert_eq!(mib(space.place(330 * MIB)), -430);
        // The slice below the first range serves a small one.
        assert_eq!(mib(space.place(6 * MIB)), -518);
        // The top slot's rest serves one more.
        assert_eq!(mib(space.place(20 * MIB)), -22);
        // The second range's 512 MiB lie below: chunks go below them.
        assert_eq!(mib(space.place(30 * MIB)), -1024 - 32);
        assert_eq!(mib(space.place(50 * MIB)), -1024 - 32 - 64);
        assert_eq!(mib(space.place(10 * MIB)), -1024 - 32 - 64 + 50);
    }

    /// A first segment over 24 MiB and not a whole chunk leaves its chunk
    /// part empty: the first range is given back, and chunks go into it
    /// from its top, each below the last.
    #[test]
    fn a_part_empty_chunk_before_the_first_kernel_gives_the_first_range_back() {
        let mut space = DriverSpace::new(TOP);
        assert_eq!(mib(space.place(50 * MIB)), -576);
        let next: Vec<i64> = [50, 50, 50].map(|m| mib(space.place(m * MIB))).to_vec();
        assert_eq!(next, [-160, -224, -288]);
    }

    /// Chunks made inside the given-back first range are given back once
    /// empty, and the next go where they were, each below the last again.
    #[test]
    fn chunks_inside_the_given_back_range_are_given_back_when_empty() {
        let mut space = DriverSpace::new(TOP);
        space.place(50 * MIB);
        let chunks: Vec<u64> = (0..3).map(|_| space.place(50 * MIB)).collect();
        for &c in &chunks {
            space.release(c);
        }
        let again: Vec<i64> = [50, 50, 50].map(|m| mib(space.place(m * MIB))).to_vec();
        assert_eq!(again, [-160, -224, -288]);
    }

    /// A chunk larger than the room below the first range goes above it,
    /// apart from every other.
    #[test]
    fn a_chunk_too_large_for_the_room_below_goes_above() {
        let mut space = DriverSpace::new(TOP);
        space.place(2 * MIB);
        let huge = space.place(1 << 41);
        assert!(huge >= TOP, "{huge:#x}");
        let next = space.place(64 * MIB);
        assert!(next + 64 * MIB <= huge || next >= huge + (1 << 41));
    }

    /// A freed range of the first range is used again, lowest first; an
    /// empty chunk is given back and the next chunk takes its place.
    #[test]
    fn freed_ranges_are_used_again() {
        let mut space = DriverSpace::new(TOP);
        space.place(2 * MIB);
        let a = space.place(50 * MIB);
        let b = space.place(50 * MIB);
        space.release(a);
        assert_eq!(space.place(38 * MIB), a);
        space.place(200 * MIB);
        let chunk = space.place(40 * MIB);
        space.release(chunk);
        assert_eq!(space.place(60 * MIB), chunk);
        let _ = b;
    }
}
