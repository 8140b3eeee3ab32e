//! libtorch 2.11's CUDA caching allocator (the native backend) as a model:
//! the same rounding, pools, best fit, splitting and merging, segment sizes,
//! `max_split_size` rules, garbage collection, free-and-retry path and
//! statistics, over a device of a given capacity. Read in PyTorch's
//! `c10/cuda/CUDACachingAllocator.cpp` as shipped in 2.11.0 (git 70d99e99);
//! the comments name the function each part follows
//! (`DeviceCachingAllocator::malloc` and the functions it calls).
//!
//! Expandable segments are one virtual range per pool and stream, mapped
//! and unmapped in pages (2 MiB small, the large segment size large).
//! Not modelled: CUDA graph pools and `MemPool`s, IPC, and the setting
//! changed while the allocator runs. Stream work is instantaneous unless a
//! free is deferred ([`CachingAllocator::free_deferred`]).

use std::collections::BTreeSet;

use super::config::{AllocatorConfig, MIB, MIN_LARGE_ALLOC, ONE_EXABYTE};
use crate::error::{Error, Result};
use crate::stats::{DeviceStats, Stat, StatArray};

/// `kMinBlockSize`: every block is a multiple of it.
pub const MIN_BLOCK: u64 = 512;
/// `kSmallSize`: requests up to it use the small pool.
pub const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: the small pool's segment.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// `kRoundLarge`: large segments from 10 MiB are multiples of it.
pub const ROUND_LARGE: u64 = 2 * MIB;
/// Where the model's addresses start: away from 0, aligned as the driver
/// aligns large allocations.
const FIRST_ADDRESS: u64 = 1 << 32;
/// The top of the driver's first range in the model's address space
/// (`driver.rs`): above every address the expandable segments' ranges take
/// going up from [`FIRST_ADDRESS`] in any history the model runs.
const DRIVER_TOP: u64 = 1 << 62;

/// A block the model handed out, by its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(usize);

/// What the model's device did with a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentAction {
    /// `cudaMalloc` of a segment.
    Alloc,
    /// `cudaFree` of a segment.
    Free,
    /// Pages of an expandable segment mapped.
    Map,
    /// Pages of an expandable segment unmapped.
    Unmap,
}

/// A segment obtained or given back, in the order the allocator did it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentEvent {
    /// Obtained or given back.
    pub action: SegmentAction,
    /// The model's address of the segment.
    pub address: u64,
    /// Its bytes.
    pub size: u64,
    /// The stream it serves.
    pub stream: u64,
}

/// A request the model could not serve: what libtorch's out-of-memory
/// error would say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelOom {
    /// The bytes asked for.
    pub requested: u64,
    /// The segment the allocator tried to obtain for it.
    pub segment: u64,
    /// The stream.
    pub stream: u64,
    /// Reserved bytes then (after the allocator gave back what it could).
    pub reserved: u64,
    /// Allocated bytes then.
    pub allocated: u64,
    /// What the allocator may hold: the capacity, or the memory fraction's limit.
    pub limit: u64,
    /// The largest free block then, in either pool, on any stream: beside
    /// `reserved - allocated` free in all, how fragmented that memory is.
    pub largest_free: u64,
}

/// One block of a segment: free (in its pool) or handed out.
#[derive(Clone, Debug)]
struct Block {
    address: u64,
    size: u64,
    /// The request's bytes (`requested_size`), while allocated.
    requested: u64,
    stream: u64,
    small: bool,
    allocated: bool,
    /// Freed by its owner, waiting for the streams that used it.
    waiting: bool,
    prev: Option<usize>,
    next: Option<usize>,
    /// The pool's `get_free_block` count when the block became free (`gc_count_base`).
    gc_base: u64,
    /// Whether the slot holds a block (slots are reused).
    live: bool,
    /// Part of an expandable segment: its start, and its page.
    expandable: Option<(u64, u64)>,
    /// Backed by memory (always, outside expandable segments).
    mapped: bool,
    /// How many segments were made before its own (`registration_counter`,
    /// which libtorch 2.13 orders free blocks of one size by).
    segment: u64,
}

impl Block {
    /// A whole segment, free, as the device gave it: mapped, or (an
    /// expandable segment's range, with its start and page) not yet.
    fn segment(
        address: u64,
        size: u64,
        stream: u64,
        small: bool,
        expandable: Option<(u64, u64)>,
        segment: u64,
    ) -> Block {
        Block {
            address,
            size,
            requested: 0,
            stream,
            small,
            allocated: false,
            waiting: false,
            prev: None,
            next: None,
            gc_base: 0,
            live: true,
            expandable,
            mapped: expandable.is_none(),
            segment,
        }
    }

    fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Free blocks ordered as libtorch's comparator orders them: stream, size,
/// then [`Libtorch::free_order`] (2.11's `BlockComparatorSize`: address;
/// 2.13's `BlockComparatorSizeCounterAddress`: the segment's age, address);
/// unmapped parts of expandable segments as `BlockComparatorAddress`.
#[derive(Clone, Default, Debug)]
struct Pool {
    free: BTreeSet<(u64, u64, u128, usize)>,
    unmapped: BTreeSet<(u64, u64, usize)>,
    /// `get_free_blocks_call_count`: the garbage collector's clock.
    calls: u64,
}

/// The allocator of one device.
#[derive(Clone, Debug)]
pub struct CachingAllocator {
    config: AllocatorConfig,
    /// The bytes `cudaMalloc` can obtain in all: what the device has for this allocator.
    capacity: u64,
    /// The memory fraction's limit (`allowed_memory_maximum`), below 1 only.
    allowed: Option<u64>,
    /// The device's memory (`totalGlobalMem`): an expandable segment reserves
    /// 1.125 times it of address space.
    total: u64,
    blocks: Vec<Block>,
    spare: Vec<usize>,
    /// Segments made so far (`cudaMalloc`s, expandable segments, and those
    /// rebuilt before a history).
    segments_made: u64,
    small: Pool,
    large: Pool,
    /// `total_allocated_memory`: the bytes of the segments held.
    reserved: u64,
    next_address: u64,
    /// Once a recording has said where the driver put a segment: where the
    /// next the model places itself ends, going down, below the lowest so far.
    next_below: Option<u64>,
    /// The driver's address space, where the model places every segment
    /// until a recording says where one went.
    space: super::driver::DriverSpace,
    /// The driver's address for the next segment of so many bytes, where a
    /// recording says it ([`next_segment_at`](Self::next_segment_at)).
    driver_said: Option<(u64, u64)>,
    /// Requests that found the allocator at its limit (see
    /// [`limit_reached`](Self::limit_reached)).
    limit_reached: u64,
    stats: DeviceStats,
    segments: Vec<SegmentEvent>,
}

/// The pools a block's figures count in: all, and its own.
fn bump(array: &mut StatArray, small: bool, by: i64) {
    for stat in [&mut array.all, if small { &mut array.small_pool } else { &mut array.large_pool }] {
        change(stat, by);
    }
}

fn change(stat: &mut Stat, by: i64) {
    stat.current += by;
    // The running totals grow with every request of a history, without
    // bound: they stop at i64::MAX rather than wrap.
    if by > 0 {
        stat.allocated = stat.allocated.saturating_add(by);
        stat.peak = stat.peak.max(stat.current);
    } else {
        stat.freed = stat.freed.saturating_sub(by);
    }
}

impl CachingAllocator {
    /// An allocator with `config` on a device whose allocator can obtain
    /// `capacity` bytes in all (what `cudaMalloc` can get before it fails),
    /// of `total` bytes (`totalGlobalMem`, the base of the memory fraction).
    /// Refuses the settings it does not model, and a device of more than
    /// [`ONE_EXABYTE`].
    pub fn new(config: AllocatorConfig, capacity: u64, total: u64) -> Result<CachingAllocator> {
        for (what, bytes) in [("capacity", capacity), ("total memory", total)] {
            if bytes > ONE_EXABYTE {
                return Err(Error::InvalidArgument(format!(
                    "a device {what} of {bytes} bytes: the allocator's model takes at most 1 EiB ({ONE_EXABYTE} \
                     bytes), more than any device has; give the card's real memory"
                )));
            }
        }
        let mut allocator = CachingAllocator {
            capacity,
            allowed: None,
            total,
            blocks: Vec::new(),
            spare: Vec::new(),
            segments_made: 0,
            small: Pool::default(),
            large: Pool::default(),
            reserved: 0,
            next_address: FIRST_ADDRESS,
            next_below: None,
            space: super::driver::DriverSpace::new(DRIVER_TOP),
            driver_said: None,
            limit_reached: 0,
            stats: DeviceStats::default(),
            segments: Vec::new(),
            config,
        };
        allocator.stats.max_split_size = allocator.config.max_split_size.map_or(-1, |m| m as i64);
        let fraction = allocator.config.memory_fraction;
        allocator.set_memory_fraction(fraction, total)?;
        Ok(allocator)
    }

    /// `set_per_process_memory_fraction(fraction)`: the allocator may hold
    /// at most `fraction` of `total` bytes; 1 takes the limit away
    /// (`setMemoryFraction`).
    pub fn set_memory_fraction(&mut self, fraction: f64, total: u64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!("memory fraction {fraction} is not between 0 and 1")));
        }
        self.allowed = (fraction < 1.0).then_some(self.config.libtorch.fraction_limit(fraction, total));
        Ok(())
    }

    /// The settings.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// The statistics, as `torch.cuda.memory_stats()` gives them.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// Every segment obtained and given back, in order.
    pub fn segment_events(&self) -> &[SegmentEvent] {
        &self.segments
    }

    /// The address and size of a block handed out.
    pub fn block(&self, id: BlockId) -> (u64, u64) {
        let b = &self.blocks[id.0];
        (b.address, b.size)
    }

    /// `round_size`: a request's block size.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        let divisions = self.config.divisions(size);
        // In `size_t`, as libtorch multiplies: from 2^55 divisions the
        // product wraps (to 0), and every request rounds to a power of two.
        if divisions > 1 && size > MIN_BLOCK.wrapping_mul(divisions) {
            return next_division(size, divisions);
        }
        size.div_ceil(MIN_BLOCK) * MIN_BLOCK
    }

    /// `get_allocation_size`: the segment obtained for a block of `size`.
    pub fn segment_size(&self, size: u64) -> u64 {
        if size <= SMALL_SIZE {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            self.config.large_segment_size
        } else {
            size.div_ceil(ROUND_LARGE) * ROUND_LARGE
        }
    }

    fn max_split(&self) -> u64 {
        self.config.max_split_size.unwrap_or(u64::MAX)
    }

    fn gc_enabled(&self) -> bool {
        self.allowed.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    fn pool(&mut self, small: bool) -> &mut Pool {
        if small {
            &mut self.small
        } else {
            &mut self.large
        }
    }

    /// The count a new segment's blocks carry: the segments made before it.
    fn next_segment(&mut self) -> u64 {
        self.segments_made += 1;
        self.segments_made - 1
    }

    fn insert_free(&mut self, id: usize) {
        let (small, key) = {
            let b = &self.blocks[id];
            (b.small, (b.stream, b.size, self.config.libtorch.free_order(b.segment, b.address), id))
        };
        let pool = self.pool(small);
        let calls = pool.calls;
        pool.free.insert(key);
        self.blocks[id].gc_base = calls;
    }

    fn remove_free(&mut self, id: usize) {
        let b = &self.blocks[id];
        let key = (b.stream, b.size, self.config.libtorch.free_order(b.segment, b.address), id);
        let small = b.small;
        self.pool(small).free.remove(&key);
    }

    /// Takes a block out of whichever set holds it: the free blocks, or the
    /// unmapped parts of expandable segments.
    fn detach(&mut self, id: usize) {
        let b = &self.blocks[id];
        if b.mapped {
            self.remove_free(id);
        } else {
            let (small, key) = (b.small, (b.stream, b.address, id));
            self.pool(small).unmapped.remove(&key);
        }
    }

    fn insert_unmapped(&mut self, id: usize) {
        let b = &self.blocks[id];
        let (small, key) = (b.small, (b.stream, b.address, id));
        self.pool(small).unmapped.insert(key);
    }

    fn new_block(&mut self, block: Block) -> usize {
        match self.spare.pop() {
            Some(slot) => {
                self.blocks[slot] = block;
                slot
            }
            None => {
                self.blocks.push(block);
                self.blocks.len() - 1
            }
        }
    }

    /// Whether `bytes` more keep what the allocator holds within `limit`.
    fn room_for(&self, limit: u64, bytes: u64) -> bool {
        self.reserved.checked_add(bytes).is_some_and(|reserved| reserved <= limit)
    }

    /// The address the driver gave the segment the next request makes, if
    /// it makes one of `bytes`: what a recording's `segment_alloc` says,
    /// for a replay to follow. Forgotten after that request.
    pub fn next_segment_at(&mut self, address: u64, bytes: u64) {
        self.driver_said = Some((address, bytes));
    }

    /// The address of a new `cudaMalloc` segment of `bytes`: the driver's,
    /// where a recording gave it; else where the driver would put it
    /// (`driver.rs`: its first range filled going up, then chunks going
    /// down); once a recording has been followed, below every segment
    /// before it.
    ///
    /// Addresses matter beyond telling blocks apart: of two free blocks of
    /// one size the allocator takes the one at the lower address (2.11's
    /// `BlockComparatorSize`), and which one it splits shapes every segment
    /// after. Following the H200's driver so, 99 of the zoo's 102
    /// predictions (`examples/zoo.rs`) give the GPU's peak reserved to the
    /// byte.
    fn driver_address(&mut self, bytes: u64) -> u64 {
        // What the recording said, unless the model holds memory there (its
        // history has parted from the recording's).
        let said = self.driver_said.take().filter(|&(address, said)| {
            said == bytes
                && address.checked_add(bytes).is_some_and(|end| {
                    !self.blocks.iter().any(|b| b.live && b.address < end && address < b.address + b.size)
                })
        });
        if let Some((address, _)) = said {
            // The next the model places itself go below it.
            let lowest = self.next_below.unwrap_or(u64::MAX).min(self.space.floor());
            self.next_below = Some(lowest.min(address / ROUND_LARGE * ROUND_LARGE));
            return address;
        }
        let Some(next_below) = self.next_below else {
            return self.space.place(bytes);
        };
        let step = bytes.checked_next_multiple_of(ROUND_LARGE).unwrap_or(bytes);
        // Down to the expandable segments' ranges (recorded addresses lie
        // far below the model's own); a history that would cross them
        // starts again below what the model placed itself.
        let below = match next_below.checked_sub(step) {
            Some(below) if below >= self.next_address => below,
            _ => self.space.floor().saturating_sub(step),
        };
        self.next_below = Some(below);
        below
    }

    /// `bytes` of the model's address space, aligned to `align`, for a new
    /// expandable segment's range, going up. No history holds the address
    /// space at once: where a long one would run past its end, they start
    /// again from the first.
    fn addresses(&mut self, bytes: u64, align: u64) -> u64 {
        let room = |base: u64| base.checked_add(bytes).map(|end| (base, end));
        let (base, end) = self
            .next_address
            .checked_next_multiple_of(align)
            .and_then(room)
            .or_else(|| room(FIRST_ADDRESS))
            .unwrap_or((0, bytes));
        self.next_address = end.checked_next_multiple_of(ROUND_LARGE).unwrap_or(FIRST_ADDRESS);
        base
    }

    /// A segment the allocator held before the replay began (rebuilt from a
    /// snapshot): `size` bytes of `stream` in the small or large pool,
    /// whole and free, reserved but made by no segment event. Returns the
    /// model's address of it, for [`restore_block`](Self::restore_block).
    pub fn restore_segment(&mut self, size: u64, stream: u64, small: bool) -> u64 {
        let address = self.driver_address(size);
        self.reserved += size;
        bump(&mut self.stats.segment, small, 1);
        bump(&mut self.stats.reserved_bytes, small, size as i64);
        if size >= self.max_split() {
            change(&mut self.stats.oversize_segments, 1);
        }
        let segment = self.next_segment();
        let id = self.new_block(Block::segment(address, size, stream, small, None, segment));
        self.insert_free(id);
        address
    }

    /// A block in use when the replay began: `size` bytes at `address` (the
    /// model's) inside a segment [`restore_segment`](Self::restore_segment)
    /// made, cut out of the free block that covers it. `None` where no free
    /// block covers it (an overlap with another restored block), or for a
    /// block of no bytes.
    pub fn restore_block(&mut self, address: u64, size: u64) -> Option<BlockId> {
        // No allocator hands out a block of nothing (libtorch's smallest is 512 bytes).
        if size == 0 {
            return None;
        }
        let id = (0..self.blocks.len()).find(|&i| {
            let b = &self.blocks[i];
            b.live && !b.allocated && !b.waiting && b.address <= address && address + size <= b.address + b.size
        })?;
        self.remove_free(id);
        // The free block leaves the inactive-split figures; its free pieces join them.
        self.count_inactive_split(id, -1);
        // [start, address) stays free; [address, address + size) is the
        // block; the rest stays free.
        let id = if self.blocks[id].address < address {
            let upper = self.cut(id, address - self.blocks[id].address);
            self.insert_free(id);
            self.count_inactive_split(id, 1);
            upper
        } else {
            id
        };
        if self.blocks[id].size > size {
            let rest = self.cut(id, size);
            self.insert_free(rest);
            self.count_inactive_split(rest, 1);
        }
        let b = &mut self.blocks[id];
        b.allocated = true;
        b.requested = size;
        let small = b.small;
        bump(&mut self.stats.allocation, small, 1);
        bump(&mut self.stats.allocated_bytes, small, size as i64);
        bump(&mut self.stats.active, small, 1);
        bump(&mut self.stats.active_bytes, small, size as i64);
        bump(&mut self.stats.requested_bytes, small, size as i64);
        if size >= self.max_split() {
            change(&mut self.stats.oversize_allocations, 1);
        }
        Some(BlockId(id))
    }

    /// Cuts block `id` (out of the free lists) after its first `at` bytes:
    /// the first part stays `id`, the second is returned, both out of the
    /// lists for the caller to place.
    fn cut(&mut self, id: usize, at: u64) -> usize {
        let old = self.blocks[id].clone();
        let upper = self.new_block(Block {
            address: old.address + at,
            size: old.size - at,
            prev: Some(id),
            next: old.next,
            ..old
        });
        if let Some(n) = old.next {
            self.blocks[n].prev = Some(upper);
        }
        let lower = &mut self.blocks[id];
        lower.size = at;
        lower.next = Some(upper);
        upper
    }

    /// Counts free block `id` into (`sign` 1) or out of (-1) the
    /// inactive-split figures, where it is part of a split segment
    /// (expandable segments keep none): what [`restore_block`](Self::restore_block)
    /// does outside the rules `hand_out` and `free` keep them by.
    fn count_inactive_split(&mut self, id: usize, sign: i64) {
        let b = &self.blocks[id];
        if b.expandable.is_none() && b.is_split() {
            let (small, size) = (b.small, b.size as i64);
            bump(&mut self.stats.inactive_split, small, sign);
            bump(&mut self.stats.inactive_split_bytes, small, sign * size);
        }
    }

    /// `malloc`: a block of at least `size` bytes for `stream`, or the
    /// out-of-memory error libtorch would raise (counted in `num_ooms`).
    pub fn malloc(&mut self, size: u64, stream: u64) -> std::result::Result<BlockId, ModelOom> {
        if size >= ONE_EXABYTE {
            // `NativeCachingAllocator::allocate` refuses these at once, counting nothing.
            return Err(self.oom(size, size, stream));
        }
        let rounded = self.round_size(size);
        let small = rounded <= SMALL_SIZE;
        let segment = self.segment_size(rounded);
        let found = match self.free_block(small, stream, rounded) {
            Some(id) => Some(id),
            None => {
                if self.gc_enabled() {
                    self.collect_garbage();
                }
                self.alloc_block(small, stream, segment, rounded, false).or_else(|| {
                    // At the limit: what follows gives cached blocks back.
                    self.limit_reached += 1;
                    self.release_available(small, stream, rounded)
                        .then(|| self.alloc_block(small, stream, segment, rounded, false))
                        .flatten()
                        .or_else(|| {
                            self.release_cached();
                            self.alloc_block(small, stream, segment, rounded, true)
                        })
                })
            }
        };
        self.driver_said = None;
        let Some(id) = found else {
            self.stats.num_ooms += 1;
            return Err(self.oom(size, segment, stream));
        };
        Ok(BlockId(self.hand_out(id, rounded, size)))
    }

    /// How many requests found no free block and no room for a new segment
    /// under the limit (the card's memory or the memory fraction's), so that
    /// the allocator gave cached blocks back before it served them or failed
    /// (libtorch's retry, which synchronises the device each time).
    pub fn limit_reached(&self) -> u64 {
        self.limit_reached
    }

    /// The error of a request of `requested` bytes that needed a `segment`.
    fn oom(&self, requested: u64, segment: u64, stream: u64) -> ModelOom {
        ModelOom {
            requested,
            segment,
            stream,
            reserved: self.reserved,
            allocated: self.stats.allocated_bytes.all.current as u64,
            limit: self.allowed.unwrap_or(self.capacity),
            largest_free: self.largest_free_block(),
        }
    }

    /// The largest free block in either pool, on any stream: mapped memory
    /// inside the segments held that no tensor uses (blocks freed but
    /// still waiting for a stream are not free yet).
    pub fn largest_free_block(&self) -> u64 {
        // Ordered by stream, then size: each stream's largest is the last
        // of its run, one step back from the next stream's first.
        let mut largest = 0;
        for pool in [&self.small, &self.large] {
            let mut below = pool.free.last().copied();
            while let Some((stream, size, _, _)) = below {
                largest = largest.max(size);
                below = pool.free.range(..(stream, 0, 0, 0)).next_back().copied();
            }
        }
        largest
    }

    /// `get_free_block`: the smallest free block of the pool on `stream`
    /// that fits, unless the `max_split_size` rules refuse it.
    fn free_block(&mut self, small: bool, stream: u64, size: u64) -> Option<usize> {
        let gc = self.gc_enabled();
        let (mss, rounding) = (self.max_split(), self.config.max_non_split_rounding);
        if gc {
            self.pool(small).calls += 1;
        }
        let pool = if small { &self.small } else { &self.large };
        let mut after = pool.free.range((stream, size, 0, 0)..).peekable();
        let &(s, mut block_size, _, mut id) = after.next()?;
        if s != stream {
            // Blocks of other streams are never handed out.
            return None;
        }
        if self.blocks[id].expandable.is_some() {
            // Best fit counting the unmapped space after a block as its own.
            let blocks = &self.blocks;
            let room = |id: usize| {
                let b = &blocks[id];
                b.size + b.next.filter(|&n| !blocks[n].mapped).map_or(0, |n| blocks[n].size)
            };
            while let Some(&&(s, next_size, _, next)) = after.peek() {
                if s != stream || blocks[id].expandable.is_none() || room(next) >= room(id) {
                    break;
                }
                (id, block_size) = (next, next_size);
                after.next();
            }
        }
        // An oversize block never serves a request below max_split_size; an
        // oversize request takes a block at most max_non_split_rounding larger.
        // The sum in `size_t`, as libtorch adds it: a rounding near 2^64
        // wraps it, and then no cached block serves an oversize request.
        if (size < mss && block_size >= mss) || (size >= mss && block_size >= size.wrapping_add(rounding)) {
            return None;
        }
        self.remove_free(id);
        Some(id)
    }

    /// `alloc_block`: a new segment of `bytes` for `stream` (or, with
    /// expandable segments, `size` bytes mapped), unless the memory fraction
    /// or the device's capacity refuses it. The fraction is checked against
    /// the whole segment's bytes even where less would be mapped.
    fn alloc_block(&mut self, small: bool, stream: u64, bytes: u64, size: u64, retry: bool) -> Option<usize> {
        if retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.allowed.is_some_and(|allowed| !self.room_for(allowed, bytes)) {
            return None;
        }
        if self.config.expandable_segments {
            return self.expandable_block(small, stream, size);
        }
        if !self.room_for(self.capacity, bytes) {
            return None;
        }
        let address = self.driver_address(bytes);
        self.reserved += bytes;
        bump(&mut self.stats.segment, small, 1);
        bump(&mut self.stats.reserved_bytes, small, bytes as i64);
        if bytes >= self.max_split() {
            change(&mut self.stats.oversize_segments, 1);
        }
        self.stats.num_device_alloc += 1;
        self.segments.push(SegmentEvent { action: SegmentAction::Alloc, address, size: bytes, stream });
        let segment = self.next_segment();
        Some(self.new_block(Block::segment(address, bytes, stream, small, None, segment)))
    }

    /// `alloc_found_block`: hands out `id` for a request of `size` bytes
    /// (`requested` before rounding), splitting off the rest where
    /// `should_split` says so.
    fn hand_out(&mut self, id: usize, size: u64, requested: u64) -> usize {
        let (small, block_size, already_split, expandable) = {
            let b = &self.blocks[id];
            (b.small, b.size, b.is_split(), b.expandable.is_some())
        };
        let remaining = block_size - size;
        // `should_split`: the setting, not the block, decides (a block of an
        // ordinary segment splits down to 512 B too while it is on).
        let split = if small || self.config.expandable_segments {
            remaining >= MIN_BLOCK
        } else {
            size < self.max_split() && remaining > SMALL_SIZE
        };
        // Expandable segments keep no inactive-split figures.
        let counted = !expandable;
        let id = if split {
            // The request takes the low addresses; the old block keeps the rest.
            let old = self.blocks[id].clone();
            let taken = self.new_block(Block { size, prev: old.prev, next: Some(id), ..old });
            if let Some(p) = old.prev {
                self.blocks[p].next = Some(taken);
            }
            let rest = &mut self.blocks[id];
            rest.address += size;
            rest.size -= size;
            rest.prev = Some(taken);
            self.insert_free(id);
            if !counted {
            } else if already_split {
                bump(&mut self.stats.inactive_split_bytes, small, -(size as i64));
            } else {
                bump(&mut self.stats.inactive_split_bytes, small, remaining as i64);
                bump(&mut self.stats.inactive_split, small, 1);
            }
            taken
        } else {
            if already_split && counted {
                bump(&mut self.stats.inactive_split_bytes, small, -(block_size as i64));
                bump(&mut self.stats.inactive_split, small, -1);
            }
            id
        };
        let b = &mut self.blocks[id];
        b.allocated = true;
        b.requested = requested;
        let size = b.size as i64;
        bump(&mut self.stats.allocation, small, 1);
        bump(&mut self.stats.allocated_bytes, small, size);
        bump(&mut self.stats.active, small, 1);
        bump(&mut self.stats.active_bytes, small, size);
        bump(&mut self.stats.requested_bytes, small, requested as i64);
        if size as u64 >= self.max_split() {
            change(&mut self.stats.oversize_allocations, 1);
        }
        id
    }

    /// `free`: the block's owner lets it go, and it is free at once.
    /// Returns false, changing nothing, for a block not handed out.
    pub fn free(&mut self, id: BlockId) -> bool {
        self.free_deferred(id) && self.complete_free(id)
    }

    /// `free` of a block that another stream still uses (`record_stream`):
    /// no longer allocated, but active, and not reusable until
    /// [`complete_free`](Self::complete_free) (the streams' events done) or
    /// an `empty_cache` (which waits for them).
    ///
    /// Returns false, changing nothing, for a block not handed out.
    pub fn free_deferred(&mut self, id: BlockId) -> bool {
        let mss = self.max_split();
        let Some(b) = self.blocks.get_mut(id.0).filter(|b| b.live && b.allocated) else { return false };
        b.allocated = false;
        b.waiting = true;
        let (small, size) = (b.small, b.size);
        bump(&mut self.stats.allocation, small, -1);
        bump(&mut self.stats.allocated_bytes, small, -(size as i64));
        if size >= mss {
            change(&mut self.stats.oversize_allocations, -1);
        }
        true
    }

    /// The streams that used a block deferred by
    /// [`free_deferred`](Self::free_deferred) are done: it goes back to its
    /// pool. Returns false, changing nothing, for a block not waiting.
    pub fn complete_free(&mut self, id: BlockId) -> bool {
        if !self.blocks.get(id.0).is_some_and(|b| b.live && b.waiting) {
            return false;
        }
        self.release_to_pool(id.0);
        true
    }

    /// `free_block`: merges a freed block with its free neighbours and puts
    /// it in its pool.
    fn release_to_pool(&mut self, id: usize) {
        let (small, original, requested) = {
            let b = &mut self.blocks[id];
            b.waiting = false;
            (b.small, b.size, b.requested)
        };
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        for neighbour in [self.blocks[id].prev, self.blocks[id].next] {
            let merged = self.merge(id, neighbour);
            if merged > 0 {
                net_blocks -= 1;
                net_bytes -= merged as i64;
            }
        }
        self.insert_free(id);
        let b = &self.blocks[id];
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        if b.expandable.is_none() {
            bump(&mut self.stats.inactive_split, small, net_blocks);
            bump(&mut self.stats.inactive_split_bytes, small, net_bytes);
        }
        bump(&mut self.stats.active, small, -1);
        bump(&mut self.stats.active_bytes, small, -(original as i64));
        bump(&mut self.stats.requested_bytes, small, -(requested as i64));
    }

    /// `try_merge_blocks`: absorbs `other` into `id` when it is free;
    /// returns the bytes absorbed.
    fn merge(&mut self, id: usize, other: Option<usize>) -> u64 {
        let Some(other) = other else { return 0 };
        let o = &self.blocks[other];
        if o.allocated || o.waiting || o.mapped != self.blocks[id].mapped {
            return 0;
        }
        let (o_address, o_size, o_prev, o_next) = (o.address, o.size, o.prev, o.next);
        self.detach(other);
        let b = &mut self.blocks[id];
        if b.prev == Some(other) {
            b.address = o_address;
            b.prev = o_prev;
            if let Some(p) = o_prev {
                self.blocks[p].next = Some(id);
            }
        } else {
            b.next = o_next;
            if let Some(n) = o_next {
                self.blocks[n].prev = Some(id);
            }
        }
        self.blocks[id].size += o_size;
        self.blocks[other].live = false;
        self.spare.push(other);
        o_size
    }

    /// `release_block`: gives a whole free segment back to the device.
    fn release_segment(&mut self, id: usize) {
        debug_assert!(self.blocks[id].expandable.is_none() && !self.blocks[id].is_split(), "a whole segment");
        self.remove_free(id);
        let b = &mut self.blocks[id];
        b.live = false;
        let (small, size, address, stream) = (b.small, b.size, b.address, b.stream);
        self.spare.push(id);
        self.reserved -= size;
        bump(&mut self.stats.segment, small, -1);
        bump(&mut self.stats.reserved_bytes, small, -(size as i64));
        if size >= self.max_split() {
            change(&mut self.stats.oversize_segments, -1);
        }
        self.stats.num_device_free += 1;
        self.space.release(address);
        self.segments.push(SegmentEvent { action: SegmentAction::Free, address, size, stream });
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, gives
    /// back the pool's oversize free blocks of `stream` to make room for a
    /// request of `size`: the smallest one large enough, else the largest
    /// first until enough is given back.
    fn release_available(&mut self, small: bool, stream: u64, size: u64) -> bool {
        let Some(mss) = self.config.max_split_size else { return false };
        let key = size.max(mss);
        let pool = if small { &self.small } else { &self.large };
        // Only whole segments go back. libtorch never splits a block of
        // max_split_size or more; a replay can meet one split all the same,
        // in a segment rebuilt under other settings with blocks in use.
        let whole = |b: &Block| b.expandable.is_none() && !b.is_split();
        if let Some(&(s, _, _, id)) = pool.free.range((stream, key, 0, 0)..).next() {
            if s == stream && whole(&self.blocks[id]) {
                self.release_segment(id);
                return true;
            }
        }
        // Below the key, largest first: oversize blocks of this stream.
        let below: Vec<(u64, u64, u128, usize)> = pool
            .free
            .range(..(stream, key, 0, 0))
            .rev()
            .take_while(|&&(s, block_size, _, _)| s == stream && block_size >= mss)
            .copied()
            .collect();
        let mut released = 0;
        for (_, block_size, _, id) in below {
            if released >= key {
                break;
            }
            if whole(&self.blocks[id]) {
                released += block_size;
                self.release_segment(id);
            }
        }
        released >= key
    }

    /// `release_cached_blocks`: waits for every stream (deferred frees
    /// complete), then gives back every free block that is a whole segment.
    fn release_cached(&mut self) {
        let waiting: Vec<usize> =
            (0..self.blocks.len()).filter(|&i| self.blocks[i].live && self.blocks[i].waiting).collect();
        for id in waiting {
            self.release_to_pool(id);
        }
        self.stats.num_sync_all_streams += 1;
        for small in [false, true] {
            let pool = if small { &self.small } else { &self.large };
            let free: Vec<usize> = pool.free.iter().map(|&(_, _, _, id)| id).collect();
            let (expandable, ordinary): (Vec<usize>, Vec<usize>) =
                free.into_iter().partition(|&id| self.blocks[id].expandable.is_some());
            let whole: Vec<usize> = ordinary.into_iter().filter(|&id| !self.blocks[id].is_split()).collect();
            for id in whole {
                self.release_segment(id);
            }
            // `release_blocks`' second pass: the whole pages of free
            // expandable blocks are unmapped.
            for id in expandable {
                self.unmap(id);
            }
        }
    }

    /// `emptyCache`: gives back every cached segment nothing uses.
    pub fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// `try_allocate_expandable_block`: `size` bytes of the stream's
    /// expandable segment, mapping what is not mapped yet; `None` when the
    /// device cannot back them (pages mapped before the failure stay).
    fn expandable_block(&mut self, small: bool, stream: u64, size: u64) -> Option<usize> {
        let mut candidate = self.find_expandable(small, stream, size)?;
        if !self.blocks[candidate].mapped {
            let want = self.blocks[candidate].size.min(size);
            candidate = self.map(candidate, want)?;
        }
        while self.blocks[candidate].size < size {
            let remaining = size - self.blocks[candidate].size;
            let next = self.blocks[candidate].next.expect("space was found after the candidate");
            if self.blocks[next].mapped {
                // A free mapped block after a gap mapped again: one block.
                self.merge(candidate, Some(next));
                continue;
            }
            let want = remaining.min(self.blocks[next].size);
            candidate = self.map(next, want)?;
        }
        self.remove_free(candidate);
        Some(candidate)
    }

    /// `find_expandable_block`: the lowest unmapped part of the stream's
    /// expandable segments (with the free block before it) with room for
    /// `size` bytes, or a new segment: 1.125 times the device's memory of
    /// address space, nothing mapped. `None` for a request larger than a
    /// whole segment's range: no device can back it (libtorch would fail
    /// mapping it; only a replay with a card larger than its device gets here).
    fn find_expandable(&mut self, small: bool, stream: u64, size: u64) -> Option<usize> {
        let free = |b: &Block| b.live && !b.allocated && !b.waiting;
        let pool = if small { &self.small } else { &self.large };
        let gaps: Vec<usize> =
            pool.unmapped.range((stream, 0, 0)..=(stream, u64::MAX, usize::MAX)).map(|&(_, _, id)| id).collect();
        for gap in gaps {
            let mut start = gap;
            if let Some(p) = self.blocks[gap].prev.filter(|&p| free(&self.blocks[p])) {
                start = p;
            }
            let (mut room, mut at) = (0, Some(start));
            while let Some(id) = at.filter(|&id| free(&self.blocks[id])) {
                room += self.blocks[id].size;
                at = self.blocks[id].next;
            }
            if room >= size {
                return Some(start);
            }
        }
        let page = if small { SMALL_BUFFER } else { self.config.large_segment_size };
        let pages = (self.total + self.total / 8).div_ceil(page);
        if pages.saturating_mul(page) < size {
            return None;
        }
        let base = self.addresses(pages * page, page);
        let segment = self.next_segment();
        let id = self.new_block(Block::segment(base, pages * page, stream, small, Some((base, page)), segment));
        self.insert_unmapped(id);
        Some(id)
    }

    /// `map_block`: backs the first pages of unmapped block `id` covering
    /// `size` bytes, all or none; the mapped part is merged with free mapped
    /// neighbours and becomes free. Returns the merged block.
    fn map(&mut self, id: usize, size: u64) -> Option<usize> {
        let b = &self.blocks[id];
        let (base, page) = b.expandable.expect("an expandable segment's block");
        debug_assert!(!b.mapped && (b.address - base).is_multiple_of(page));
        let bytes = size.div_ceil(page) * page;
        if !self.room_for(self.capacity, bytes) {
            return None;
        }
        self.detach(id);
        let b = self.blocks[id].clone();
        if bytes < b.size {
            let rest =
                self.new_block(Block { address: b.address + bytes, size: b.size - bytes, prev: Some(id), ..b.clone() });
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[id].next = Some(rest);
            self.insert_unmapped(rest);
        }
        let block = &mut self.blocks[id];
        block.size = bytes;
        block.mapped = true;
        self.reserved += bytes;
        bump(&mut self.stats.reserved_bytes, b.small, bytes as i64);
        self.stats.num_device_alloc += 1;
        self.segments.push(SegmentEvent {
            action: SegmentAction::Map,
            address: b.address,
            size: bytes,
            stream: b.stream,
        });
        for neighbour in [self.blocks[id].prev, self.blocks[id].next] {
            self.merge(id, neighbour);
        }
        self.insert_free(id);
        Some(id)
    }

    /// `unmap_block`: gives back the whole pages inside free block `id` of
    /// an expandable segment; what is left before and after them stays free
    /// and mapped. A segment left with nothing mapped gives back its range.
    fn unmap(&mut self, id: usize) {
        let b = self.blocks[id].clone();
        let (base, page) = b.expandable.expect("an expandable segment's block");
        let start = base + (b.address - base).div_ceil(page) * page;
        let end = base + (b.address + b.size - base) / page * page;
        if end <= start {
            return;
        }
        self.remove_free(id);
        if start > b.address {
            let before = self.new_block(Block { size: start - b.address, next: Some(id), ..b.clone() });
            if let Some(p) = b.prev {
                self.blocks[p].next = Some(before);
            }
            self.blocks[id].prev = Some(before);
            self.insert_free(before);
        }
        if end < b.address + b.size {
            let after =
                self.new_block(Block { address: end, size: b.address + b.size - end, prev: Some(id), ..b.clone() });
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(after);
            }
            self.blocks[id].next = Some(after);
            self.insert_free(after);
        }
        let block = &mut self.blocks[id];
        block.address = start;
        block.size = end - start;
        block.mapped = false;
        self.reserved -= end - start;
        bump(&mut self.stats.reserved_bytes, b.small, -((end - start) as i64));
        self.stats.num_device_free += 1;
        self.segments.push(SegmentEvent {
            action: SegmentAction::Unmap,
            address: start,
            size: end - start,
            stream: b.stream,
        });
        for neighbour in [self.blocks[id].prev, self.blocks[id].next] {
            self.merge(id, neighbour);
        }
        if self.blocks[id].is_split() {
            self.insert_unmapped(id);
        } else {
            // `release_expandable_segment`: the range goes; no figure moves.
            self.blocks[id].live = false;
            self.spare.push(id);
        }
    }

    /// `garbage_collect_cached_blocks`: above the threshold share of the
    /// memory fraction's limit, gives back the large pool's unsplit free
    /// segments that have waited longest (at least the average wait), pass
    /// after pass, until enough is given back.
    fn collect_garbage(&mut self) {
        let Some(allowed) = self.allowed else { return };
        let threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.reserved <= threshold {
            return;
        }
        let target = self.reserved - threshold;
        let calls = self.large.calls;
        let age = |b: &Block| calls.saturating_sub(b.gc_base);
        let candidates = |this: &CachingAllocator| -> Vec<usize> {
            this.large.free.iter().map(|&(_, _, _, id)| id).filter(|&id| !this.blocks[id].is_split()).collect()
        };
        let first = candidates(self);
        let mut total_age: u64 = first.iter().map(|&id| age(&self.blocks[id])).sum();
        let mut count = first.len() as u64;
        let mut reclaimed = 0;
        let mut freed = true;
        while reclaimed < target && freed && count > 0 {
            let average = total_age as f64 / count as f64;
            freed = false;
            for id in candidates(self) {
                let b = &self.blocks[id];
                // Unsplit expandable blocks count in the average, and stay.
                if b.expandable.is_none() && age(b) as f64 >= average {
                    freed = true;
                    reclaimed += b.size;
                    total_age -= age(b);
                    count -= 1;
                    self.release_segment(id);
                }
            }
        }
    }
}

/// `roundup_power2_next_division`: `size` rounded up to the next of
/// `divisions` equal steps between two powers of two.
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}
