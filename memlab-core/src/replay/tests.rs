//! One test per rule of the allocator model, each on a short hand-made
//! sequence whose outcome is worked out in its comments from libtorch
//! 2.11's source (`CUDACachingAllocator.cpp`).

use super::*;

const GIB: u64 = 1 << 30;

/// A snapshot of one CUDA device, stream 0, whose history is `entries`:
/// (action, address, bytes), one microsecond apart. No segments, no
/// settings, no notes of memlab's: each test adds what it needs.
pub(crate) fn history(entries: &[(crate::events::Action, u64, u64)]) -> crate::export::Snapshot {
    let trace = entries
        .iter()
        .enumerate()
        .map(|(i, &(action, addr, size))| crate::export::TraceEntry {
            action,
            addr: Some(addr),
            size,
            stream: 0,
            time_us: i as u64,
            frames: std::sync::Arc::from(Vec::new()),
            category: None,
            tensor: None,
            device_free: None,
        })
        .collect();
    crate::export::Snapshot { segments: Vec::new(), device_traces: vec![trace], allocator_settings: None, memlab: None }
}

fn gpu(conf: &str) -> CachingAllocator {
    CachingAllocator::new(AllocatorConfig::parse(conf).unwrap(), 80 * GIB, 80 * GIB).unwrap()
}

fn reserved(a: &CachingAllocator) -> u64 {
    a.stats().reserved_bytes.all.current as u64
}

fn allocated(a: &CachingAllocator) -> u64 {
    a.stats().allocated_bytes.all.current as u64
}

fn segments(a: &CachingAllocator) -> Vec<(SegmentAction, u64)> {
    a.segment_events().iter().map(|e| (e.action, e.size)).collect()
}

use SegmentAction::{Alloc, Free};

#[test]
fn requests_round_to_512_bytes_and_to_power_of_two_divisions() {
    let a = gpu("");
    // Below 512: 512. Otherwise up to a multiple of 512.
    assert_eq!((a.round_size(1), a.round_size(512), a.round_size(513)), (512, 512, 1024));
    // 1200 B with 4 divisions: 1200 is not above 512 × 4, so plain 512 rounding: 1536.
    let d = gpu("roundup_power2_divisions:4");
    assert_eq!(d.round_size(1200), 1536);
    // 5 MiB + 1 with 4 divisions: between 4 and 8 MiB the steps are 1 MiB: 6 MiB.
    assert_eq!(d.round_size(5 * MIB + 1), 6 * MIB);
    // A power of two stays.
    assert_eq!(d.round_size(8 * MIB), 8 * MIB);
    // 5 MiB + 1 without divisions: 5 MiB + 512.
    assert_eq!(a.round_size(5 * MIB + 1), 5 * MIB + 512);
}

#[test]
fn segments_are_2_mib_small_20_mib_large_and_rounded_from_10_mib() {
    let a = gpu("");
    // Up to 1 MiB: the small pool's 2 MiB segment; below 10 MiB: 20 MiB;
    // from 10 MiB: the request rounded up to 2 MiB.
    assert_eq!(a.segment_size(MIB), 2 * MIB);
    assert_eq!(a.segment_size(MIB + 512), 20 * MIB);
    assert_eq!(a.segment_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(a.segment_size(10 * MIB), 10 * MIB);
    assert_eq!(a.segment_size(11 * MIB + 1), 12 * MIB);
    // large_segment_size_mb changes the 1-10 MiB segment.
    assert_eq!(gpu("large_segment_size_mb:32").segment_size(5 * MIB), 32 * MIB);
}

#[test]
fn a_small_segment_splits_down_to_512_bytes_and_merges_back() {
    let mut a = gpu("");
    // 1000 B → 1024 B block from a new 2 MiB segment; the rest (2 MiB − 1 KiB) stays free.
    let x = a.malloc(1000, 0).unwrap();
    assert_eq!(segments(&a), [(Alloc, 2 * MIB)]);
    assert_eq!(a.block(x).1, 1024);
    let s = a.stats();
    assert_eq!((s.allocated_bytes.all.current, s.requested_bytes.all.current), (1024, 1000));
    assert_eq!((s.inactive_split.small_pool.current, s.inactive_split_bytes.all.current), (1, 2 * MIB as i64 - 1024));
    // A second request is served from the rest: no new segment, at the next address.
    let y = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.block(y).0, a.block(x).0 + 1024);
    assert_eq!(a.segment_events().len(), 1);
    // Freeing both merges the segment whole: no split block is left.
    a.free(x);
    a.free(y);
    let s = a.stats();
    assert_eq!((s.inactive_split.all.current, s.inactive_split_bytes.all.current, s.active.all.current), (0, 0, 0));
    assert_eq!(reserved(&a), 2 * MIB, "freeing never gives memory back");
}

#[test]
fn a_large_block_splits_only_when_more_than_1_mib_would_remain() {
    let mut a = gpu("");
    // 11 MiB → a 12 MiB segment; 1 MiB would remain, not more: no split,
    // and the block counts all 12 MiB as allocated.
    let x = a.malloc(11 * MIB, 0).unwrap();
    assert_eq!((a.block(x).1, allocated(&a)), (12 * MIB, 12 * MIB));
    assert_eq!(a.stats().requested_bytes.all.current as u64, 11 * MIB);
    // 3 MiB → a 20 MiB segment, split: 17 MiB remain free.
    let y = a.malloc(3 * MIB, 0).unwrap();
    assert_eq!(a.block(y).1, 3 * MIB);
    assert_eq!(a.stats().inactive_split_bytes.large_pool.current as u64, 17 * MIB);
}

#[test]
fn of_two_equal_free_blocks_the_newer_segments_is_taken() {
    // The driver puts the first segment in its first range's top slot and
    // the next one up from that range's bottom, below it; the allocator
    // takes the lower address of two blocks of one size.
    let mut a = gpu("");
    let older = a.malloc(20 * MIB, 0).unwrap();
    let newer = a.malloc(20 * MIB, 0).unwrap();
    let (older_at, newer_at) = (a.block(older).0, a.block(newer).0);
    assert!(newer_at < older_at);
    a.free(older);
    a.free(newer);
    let x = a.malloc(12 * MIB, 0).unwrap();
    assert_eq!(a.block(x).0, newer_at);
    // Where a recording says where the driver put a segment, the model puts
    // it there, whichever way that goes; said for another size, or for an
    // earlier request, it is not used.
    let mut b = gpu("");
    let first = b.malloc(20 * MIB, 0).unwrap();
    let above = b.block(first).0 + (1 << 40);
    b.next_segment_at(above, 20 * MIB);
    let second = b.malloc(20 * MIB, 0).unwrap();
    assert_eq!(b.block(second).0, above);
    b.next_segment_at(above + (1 << 40), 30 * MIB);
    let third = b.malloc(20 * MIB, 0).unwrap();
    assert!(b.block(third).0 < b.block(first).0);
    let third_at = b.block(third).0;
    b.next_segment_at(above + (2 << 40), 20 * MIB);
    b.free(third);
    b.malloc(20 * MIB, 0).unwrap();
    let fourth = b.malloc(20 * MIB, 0).unwrap();
    assert!(b.block(fourth).0 < third_at, "what was said lasts one request");
    // Said below the model's own, the next it places itself go below that.
    let low = b.block(fourth).0 - (1 << 40);
    b.next_segment_at(low, 20 * MIB);
    let fifth = b.malloc(20 * MIB, 0).unwrap();
    assert_eq!(b.block(fifth).0, low);
    let sixth = b.malloc(20 * MIB, 0).unwrap();
    assert!(b.block(sixth).0 < low);
    // Said where the model holds memory (its history parted from the
    // recording's), it is not followed.
    b.next_segment_at(low, 20 * MIB);
    let seventh = b.malloc(20 * MIB, 0).unwrap();
    assert!(b.block(seventh).0 < b.block(sixth).0);
    // After an address as a recording gives them (far below the model's
    // own), the next the model places itself go below it, clear of every
    // segment it holds.
    let mut d = gpu("");
    let own = d.malloc(20 * MIB, 0).unwrap();
    let recorded = 0x7fb4_3a00_0000;
    d.next_segment_at(recorded, 20 * MIB);
    let followed = d.malloc(20 * MIB, 0).unwrap();
    assert_eq!(d.block(followed).0, recorded);
    let placed = d.malloc(20 * MIB, 0).unwrap();
    let (own_at, placed_at) = (d.block(own).0, d.block(placed).0);
    assert!(placed_at + 20 * MIB <= recorded, "{placed_at:#x} below {recorded:#x}");
    assert!(placed_at + 20 * MIB <= own_at || placed_at >= own_at + 20 * MIB, "apart from the model's own");
    // A segment larger than the model's address space below its top does
    // not wrap into nonsense or panic.
    let mut c = gpu("");
    c.restore_segment(1 << 63, 0, false);
}

#[test]
fn a_replay_puts_segments_where_the_recording_says_the_driver_did() {
    // A U-Net's 5 training steps on an H200 (examples/zoo.rs, batch 16,
    // default settings), with the driver's addresses going up and down: the
    // model makes every segment event and the GPU's peak reserved,
    // 696,254,464 bytes. With addresses of its own it took another free
    // block at one tie, made a 72 MiB segment where the GPU made 98, and
    // peaked 26 MiB low.
    let path = format!("{}/../fixtures/zoo/cuda/unet_16_default.pickle", env!("CARGO_MANIFEST_DIR"));
    let snapshot = crate::export::Snapshot::read_pickle(&path).unwrap().snapshot;
    let config = AllocatorConfig::parse("").unwrap();
    let card = Card { capacity: ONE_EXABYTE, total: ONE_EXABYTE };
    let replay = replay_device(&snapshot, 0, &config, &config, card).unwrap();
    assert_eq!((replay.segment_events_matched, replay.segment_events), (12, 12), "{:?}", replay.first_mismatch);
    assert_eq!(replay.peak_reserved, 696_254_464);
}

#[test]
fn best_fit_takes_the_smallest_free_block_of_the_same_stream_only() {
    let mut a = gpu("");
    // Two free whole segments on stream 0: 12 MiB and 20 MiB.
    let big = a.malloc(20 * MIB, 0).unwrap();
    let mid = a.malloc(12 * MIB, 0).unwrap();
    a.free(big);
    a.free(mid);
    // 11 MiB fits both; the smallest (12 MiB) is taken.
    let x = a.malloc(11 * MIB, 0).unwrap();
    assert_eq!(a.block(x), a.block(mid));
    // The same request on stream 7 cannot use stream 0's 20 MiB: a new segment.
    a.malloc(11 * MIB, 7).unwrap();
    assert_eq!(segments(&a), [(Alloc, 20 * MIB), (Alloc, 12 * MIB), (Alloc, 12 * MIB)]);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole_and_away_from_small_requests() {
    let mut a = gpu("max_split_size_mb:40");
    // A free 60 MiB block is oversize (≥ 40 MiB): a 30 MiB request may not
    // use it, and gets a segment of its own.
    let big = a.malloc(60 * MIB, 0).unwrap();
    a.free(big);
    a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(segments(&a), [(Alloc, 60 * MIB), (Alloc, 30 * MIB)]);
    // A 50 MiB request may use it (60 < 50 + 20, the non-split rounding),
    // whole: 60 MiB allocated, no split.
    let x = a.malloc(50 * MIB, 0).unwrap();
    assert_eq!(a.block(x).1, 60 * MIB);
    assert_eq!(a.stats().oversize_allocations.current, 1);
    a.free(x);
    // A 40 MiB request may not (60 ≥ 40 + 20): a new 40 MiB segment.
    a.malloc(40 * MIB, 0).unwrap();
    assert_eq!(a.segment_events().last().map(|e| e.size), Some(40 * MIB));
    assert_eq!(a.stats().oversize_segments.current, 2);
    // max_non_split_rounding_mb widens that.
    let mut b = gpu("max_split_size_mb:40,max_non_split_rounding_mb:30");
    let big = b.malloc(60 * MIB, 0).unwrap();
    b.free(big);
    let x = b.malloc(40 * MIB, 0).unwrap();
    assert_eq!(b.block(x).1, 60 * MIB, "60 < 40 + 30");
}

#[test]
fn a_full_device_frees_its_cache_and_retries_before_it_fails() {
    // 100 MiB of capacity. 60 MiB held by a free segment of stream 1, then a
    // 60 MiB request on stream 0: no segment fits (60 + 60 > 100), so the
    // allocator gives back its whole free segments and retries: it succeeds.
    let mut a = CachingAllocator::new(AllocatorConfig::default(), 100 * MIB, 80 * GIB).unwrap();
    let other = a.malloc(60 * MIB, 1).unwrap();
    a.free(other);
    let x = a.malloc(60 * MIB, 0).unwrap();
    assert_eq!(segments(&a), [(Alloc, 60 * MIB), (Free, 60 * MIB), (Alloc, 60 * MIB)]);
    assert_eq!((a.stats().num_alloc_retries, a.stats().num_sync_all_streams), (1, 1));
    // Another 60 MiB: nothing free to give back; out of memory, counted.
    let oom = a.malloc(60 * MIB, 0).unwrap_err();
    assert_eq!((oom.requested, oom.segment, oom.reserved, oom.limit), (60 * MIB, 60 * MIB, 60 * MIB, 100 * MIB));
    assert_eq!((a.stats().num_ooms, a.stats().num_alloc_retries), (1, 2));
    a.free(x);
}

#[test]
fn with_max_split_size_oversize_blocks_go_back_first_largest_first() {
    // 200 MiB capacity, max_split_size 40 MiB. Free oversize segments of
    // 50 and 70 MiB on stream 0, 60 MiB allocated: 180 MiB reserved. A 45 MiB
    // request on stream 1 needs a new 46 MiB segment (45 rounded to 2 MiB
    // is 46): 180 + 46 > 200. release_available_cached_blocks looks on the
    // request's own stream only (stream 1 has nothing), so the allocator
    // falls through to giving back every free segment, then retries.
    let mut a = CachingAllocator::new(AllocatorConfig::parse("max_split_size_mb:40").unwrap(), 200 * MIB, GIB).unwrap();
    let b50 = a.malloc(50 * MIB, 0).unwrap();
    let b70 = a.malloc(70 * MIB, 0).unwrap();
    let _held = a.malloc(60 * MIB, 0).unwrap();
    a.free(b50);
    a.free(b70);
    a.malloc(45 * MIB, 1).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    // On the same stream: a 100 MiB request; no free block ≥ 100 MiB, so
    // the oversize free blocks below go back largest first until 100 MiB
    // are given back: first 70 (not enough), then 50: 120.
    let mut b = CachingAllocator::new(AllocatorConfig::parse("max_split_size_mb:40").unwrap(), 200 * MIB, GIB).unwrap();
    let b50 = b.malloc(50 * MIB, 0).unwrap();
    let b70 = b.malloc(70 * MIB, 0).unwrap();
    let _held = b.malloc(60 * MIB, 0).unwrap();
    b.free(b50);
    b.free(b70);
    b.malloc(100 * MIB, 0).unwrap();
    let tail: Vec<_> = segments(&b).into_iter().skip(3).collect();
    assert_eq!(tail, [(Free, 70 * MIB), (Free, 50 * MIB), (Alloc, 100 * MIB)]);
    assert_eq!(b.stats().num_alloc_retries, 0, "no full flush was needed");
}

#[test]
fn the_memory_fraction_limits_what_the_allocator_holds() {
    // 0.5 of 100 MiB: 50 MiB. Two 15 MiB requests take a 16 MiB segment
    // each (from 10 MiB, rounded to 2 MiB; 1 MiB left is too little to
    // split off): 32 MiB. A 5 MiB request needs a 20 MiB segment: 52 > 50.
    let mut a =
        CachingAllocator::new(AllocatorConfig::parse("per_process_memory_fraction:0.5").unwrap(), GIB, 100 * MIB)
            .unwrap();
    a.malloc(15 * MIB, 0).unwrap();
    a.malloc(15 * MIB, 0).unwrap();
    let oom = a.malloc(5 * MIB, 0).unwrap_err();
    assert_eq!((oom.segment, oom.reserved, oom.limit), (20 * MIB, 32 * MIB, 50 * MIB));
    // A fraction of 1 takes the limit away.
    a.set_memory_fraction(1.0, 100 * MIB).unwrap();
    a.malloc(5 * MIB, 0).unwrap();
    assert_eq!(reserved(&a), 52 * MIB);
}

#[test]
fn garbage_collection_needs_a_fraction_and_frees_the_longest_waiting_segments() {
    // Fraction 0.5 of 200 MiB (100 MiB), threshold 0.5: collection starts
    // above 50 MiB reserved. Three 20 MiB segments are freed in turn;
    // the GC clock ticks once per free-block search of the large pool.
    let config = AllocatorConfig::parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5").unwrap();
    let mut a = CachingAllocator::new(config, GIB, 200 * MIB).unwrap();
    let x = a.malloc(20 * MIB, 0).unwrap(); // search 1; segment 1, whole
    let y = a.malloc(20 * MIB, 0).unwrap(); // search 2; segment 2
    let z = a.malloc(20 * MIB, 0).unwrap(); // search 3; segment 3
    a.free(x); // free since clock 3
    a.free(y); // free since clock 3
    a.free(z); // free since clock 3
               // 60 MiB reserved, above 50. A 30 MiB request (search 4) finds no block
               // of 30 MiB: the collector runs with target 60 − 50 = 10 MiB. Every
               // segment has waited 1 search, the average: each pass frees all of
               // them that reach it; all three go (it does not stop at the target).
    a.malloc(30 * MIB, 0).unwrap();
    let frees = segments(&a).iter().filter(|(action, _)| *action == Free).count();
    assert_eq!(frees, 3);
    assert_eq!(reserved(&a), 30 * MIB);
    // Without a fraction the same threshold does nothing (libtorch applies it only under one).
    let mut b =
        CachingAllocator::new(AllocatorConfig::parse("garbage_collection_threshold:0.5").unwrap(), GIB, 200 * MIB)
            .unwrap();
    let held: Vec<BlockId> = (0..3).map(|_| b.malloc(20 * MIB, 0).unwrap()).collect();
    for x in held {
        b.free(x);
    }
    b.malloc(30 * MIB, 0).unwrap();
    assert_eq!(reserved(&b), 90 * MIB);
    assert!(segments(&b).iter().all(|(action, _)| *action == Alloc));
}

#[test]
fn a_deferred_free_stays_active_until_its_streams_are_done() {
    let mut a = gpu("");
    let x = a.malloc(3 * MIB, 0).unwrap();
    a.free_deferred(x); // used by another stream: not allocated, still active
    let s = a.stats();
    assert_eq!((s.allocated_bytes.all.current, s.active_bytes.all.current as u64), (0, 3 * MIB));
    // Not reusable yet: a 3 MiB request takes the free rest of the segment.
    let y = a.malloc(3 * MIB, 0).unwrap();
    assert_ne!(a.block(y).0, a.block(x).0);
    a.complete_free(x);
    assert_eq!(a.stats().active_bytes.all.current as u64, 3 * MIB, "y only");
    // empty_cache waits for every stream: a deferred block is freed, merged and given back.
    let z = a.malloc(30 * MIB, 0).unwrap();
    a.free_deferred(z);
    a.empty_cache();
    assert_eq!(a.segment_events().last().map(|e| (e.action, e.size)), Some((Free, 30 * MIB)));
    a.free(y);
}

#[test]
fn empty_cache_gives_back_whole_segments_only() {
    let mut a = gpu("");
    let x = a.malloc(3 * MIB, 0).unwrap(); // 20 MiB segment, split
    let y = a.malloc(30 * MIB, 0).unwrap(); // 30 MiB segment, whole
    a.free(y);
    a.empty_cache();
    // The 30 MiB segment goes; the 20 MiB one stays (x lives in it).
    assert_eq!(segments(&a), [(Alloc, 20 * MIB), (Alloc, 30 * MIB), (Free, 30 * MIB)]);
    assert_eq!(reserved(&a), 20 * MIB);
    a.free(x);
    a.empty_cache();
    assert_eq!(reserved(&a), 0);
    let s = a.stats();
    assert_eq!((s.segment.all.current, s.segment.all.peak, s.num_device_alloc, s.num_device_free), (0, 2, 2, 2));
}

#[test]
fn the_figures_are_memory_stats_figures() {
    let mut a = gpu("max_split_size_mb:64");
    let x = a.malloc(100, 0).unwrap();
    let y = a.malloc(5 * MIB, 0).unwrap();
    let s = a.stats();
    // Small pool: a 2 MiB segment, a 512 B block. Large: a 20 MiB segment, a 5 MiB block.
    assert_eq!((s.reserved_bytes.small_pool.current, s.reserved_bytes.large_pool.current), (2 << 20, 20 << 20));
    assert_eq!((s.allocated_bytes.small_pool.current, s.allocated_bytes.large_pool.current), (512, 5 << 20));
    assert_eq!((s.requested_bytes.all.current, s.allocation.all.current), (100 + (5 << 20), 2));
    assert_eq!(s.max_split_size, 64 << 20);
    a.free(x);
    a.free(y);
    let s = a.stats();
    assert_eq!(
        (s.allocated_bytes.all.current, s.allocated_bytes.all.peak, s.allocated_bytes.all.freed),
        (0, 512 + (5 << 20), 512 + (5 << 20))
    );
    assert_eq!(gpu("").stats().max_split_size, -1, "unlimited reads -1, as in memory_stats()");
}

#[test]
fn an_expandable_segment_maps_pages_as_it_grows_and_unmaps_only_on_empty_cache() {
    let mut a = gpu("expandable_segments:True");
    // 30 MiB: a new expandable segment (address space only), then 2 large
    // pages of 20 MiB mapped: 40 MiB reserved; the 10 MiB left over is a
    // free block (with the setting on, any rest of 512 B or more splits off).
    let x = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(segments(&a), [(SegmentAction::Map, 40 * MIB)]);
    assert_eq!((reserved(&a), a.block(x).1), (40 * MIB, 30 * MIB));
    // 5 MiB: from the 10 MiB free block, nothing mapped.
    let y = a.malloc(5 * MIB, 0).unwrap();
    assert_eq!(a.block(y).0, a.block(x).0 + 30 * MIB);
    assert_eq!(a.segment_events().len(), 1);
    // 20 MiB: the 5 MiB free block at the mapped end grows by one page
    // (15 MiB more are needed): 25 MiB, of which 20 are handed out.
    let z = a.malloc(20 * MIB, 0).unwrap();
    assert_eq!(segments(&a), [(SegmentAction::Map, 40 * MIB), (SegmentAction::Map, 20 * MIB)]);
    assert_eq!((a.block(z).0, reserved(&a)), (a.block(y).0 + 5 * MIB, 60 * MIB));
    // Freeing maps nothing back: 60 MiB stay reserved, one free block of 60 MiB.
    for b in [x, y, z] {
        a.free(b);
    }
    assert_eq!(reserved(&a), 60 * MIB);
    // empty_cache unmaps its 3 whole pages; the segment has nothing mapped and goes.
    a.empty_cache();
    assert_eq!(a.segment_events().last().map(|e| (e.action, e.size)), Some((SegmentAction::Unmap, 60 * MIB)));
    let s = a.stats();
    assert_eq!((reserved(&a), s.segment.all.peak, s.inactive_split.all.peak), (0, 0, 0), "no segment or split figures");
    assert_eq!((s.num_device_alloc, s.num_device_free), (2, 1));
}

#[test]
fn unmapping_keeps_the_parts_of_pages_still_in_use() {
    let mut a = gpu("expandable_segments:True");
    // Three 15 MiB blocks: 45 MiB in 3 pages of 20 (60 MiB mapped, 15 free at the end).
    let b: Vec<BlockId> = (0..3).map(|_| a.malloc(15 * MIB, 0).unwrap()).collect();
    assert_eq!(reserved(&a), 60 * MIB);
    // The middle one freed: [0,15) used, [15,30) free, [30,45) used, [45,60) free.
    // No page lies wholly inside a free block: empty_cache unmaps nothing.
    a.free(b[1]);
    a.empty_cache();
    assert_eq!(reserved(&a), 60 * MIB);
    // The last one freed too: it merges with both free neighbours into
    // [15,60), which holds pages [20,40) and [40,60): unmapped, 40 MiB;
    // [15,20) stays mapped and free.
    a.free(b[2]);
    a.empty_cache();
    assert_eq!(reserved(&a), 20 * MIB);
    assert_eq!(a.segment_events().last().map(|e| (e.action, e.size)), Some((SegmentAction::Unmap, 40 * MIB)));
    // A 12 MiB request: the free [15,20) block before the unmapped range
    // grows by one page again, [15,40), and the request takes [15,27).
    let c = a.malloc(12 * MIB, 0).unwrap();
    assert_eq!((a.block(c).0 - a.block(b[0]).0, reserved(&a)), (15 * MIB, 40 * MIB));
}

/// pytorch#123548's pattern: per cycle, 91 MiB and 45.5 MiB, then 2 MiB
/// kept alive, then the first two freed. Reserved bytes after 30 cycles.
fn pattern_123548(conf: &str) -> Vec<u64> {
    let mut a = gpu(conf);
    let mut kept = Vec::new();
    let mut reserved_after = Vec::new();
    for _ in 0..30 {
        let x = a.malloc(91 * MIB, 0).unwrap();
        let y = a.malloc(91 * MIB / 2, 0).unwrap();
        kept.push(a.malloc(2 * MIB, 0).unwrap());
        a.free(x);
        a.free(y);
        reserved_after.push(reserved(&a));
    }
    reserved_after
}

#[test]
fn expandable_segments_with_max_split_size_grow_without_bound_on_pytorch_123548() {
    // Both settings: each cycle's freed 91 + 45.5 MiB merge into a 136.5 MiB
    // free block at or above max_split_size (128 MiB), which no request
    // below it may use; the next cycle maps new pages for 91 and 45.5 MiB
    // instead: 7 pages of 20 MiB, or 6 where the few MiB left free at the
    // mapped end (by the 2 MiB blocks and the rounding to pages) save one.
    let both = pattern_123548("expandable_segments:True,max_split_size_mb:128");
    let growth: Vec<u64> = both.windows(2).map(|w| (w[1] - w[0]) / MIB).collect();
    assert!(growth.iter().all(|g| *g == 140 || *g == 120), "{growth:?}");
    assert!(both[29] > 3900 * MIB, "{} MiB", both[29] / MIB);
    // Either alone, or neither: no growth after the first cycles.
    for conf in ["", "expandable_segments:True", "max_split_size_mb:128"] {
        let alone = pattern_123548(conf);
        assert!(alone[29] < 400 * MIB, "{conf}: {} MiB", alone[29] / MIB);
        assert!(both[29] > 10 * alone[29], "{conf}");
    }
}

#[test]
fn with_expandable_segments_the_fraction_is_checked_against_the_segment_not_the_pages() {
    // Fraction 0.55 of 100 MiB: 55 MiB. 30 MiB: 0 + 30 (its segment size)
    // ≤ 55, and 2 pages are mapped: 40 MiB reserved, 10 free at the end.
    let config = AllocatorConfig::parse("expandable_segments:True,per_process_memory_fraction:0.55").unwrap();
    let mut a = CachingAllocator::new(config, GIB, 100 * MIB).unwrap();
    a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(reserved(&a), 40 * MIB);
    // 14 MiB: 40 + 14 ≤ 55 passes the check; 4 MiB more are needed, a
    // whole 20 MiB page is mapped: 60 MiB, above the limit, as libtorch does.
    a.malloc(14 * MIB, 0).unwrap();
    assert_eq!(reserved(&a), 60 * MIB);
    // It took [30,44) of the merged free [30,60): 16 MiB stay free at the
    // end. 20 MiB: 60 + 20 > 55, refused without looking at the pages; the
    // flush unmaps nothing (no whole page is free), and the retry fails too.
    let oom = a.malloc(20 * MIB, 0).unwrap_err();
    assert_eq!((oom.segment, oom.reserved, oom.limit), (20 * MIB, 60 * MIB, 55 * MIB));
    assert_eq!(a.stats().num_alloc_retries, 1);
}

#[test]
fn a_block_freed_twice_or_never_handed_out_changes_nothing() {
    let mut a = gpu("");
    let x = a.malloc(MIB, 0).unwrap();
    assert!(a.free(x));
    let before = *a.stats();
    assert!(!a.free(x), "freed already");
    assert!(!a.free_deferred(x) && !a.complete_free(x));
    assert_eq!(*a.stats(), before);
    // An exabyte or more fails at once and is counted nowhere, as in libtorch.
    assert!(a.malloc(ONE_EXABYTE, 0).is_err());
    assert_eq!((a.stats().num_ooms, a.stats().num_alloc_retries), (0, 0));
}

#[test]
fn the_largest_free_block_is_found_across_pools_and_streams() {
    let mut a = gpu("");
    assert_eq!(a.largest_free_block(), 0);
    // Stream 0: a 20 MiB segment, 3 MiB used: a 17 MiB free block.
    let x = a.malloc(3 * MIB, 0).unwrap();
    // Stream 1: another 20 MiB segment, 4 MiB used: 16 MiB free.
    let y = a.malloc(4 * MIB, 1).unwrap();
    // The small pool, stream 2: a 2 MiB segment less 512 B.
    let z = a.malloc(100, 2).unwrap();
    assert_eq!(a.largest_free_block(), 17 * MIB);
    // Stream 0's whole segment free again: 20 MiB, the largest.
    a.free(x);
    assert_eq!(a.largest_free_block(), 20 * MIB);
    // Under a 33 MiB cap, with 22 MiB held (a 20 MiB segment, 4 MiB used, and
    // a 2 MiB small one), a 15 MiB request on stream 0 needs a 16 MiB segment:
    // 22 + 16 > 33, and no segment is whole to give back. It fails with 18 MiB
    // less 512 B free in the segments but no block over 16 MiB: fragmentation.
    let mut b = CachingAllocator::new(AllocatorConfig::default(), 33 * MIB, 80 * GIB).unwrap();
    let kept = b.malloc(4 * MIB, 1).unwrap();
    let _small = b.malloc(100, 2).unwrap();
    let oom = b.malloc(15 * MIB, 0).unwrap_err();
    assert_eq!((oom.reserved, oom.allocated, oom.largest_free), (22 * MIB, 4 * MIB + 512, 16 * MIB));
    b.free(kept);
    a.free(y);
    a.free(z);
}

#[test]
fn segment_sizes_near_the_top_of_u64_never_wrap_the_figures() {
    // A large segment size that no setting string can give any more (the
    // parser refuses it), set directly: a 2 MiB request wants a segment of
    // almost 16 EiB. The model refuses it as a device would, instead of
    // wrapping its sum of what it holds: allocated never passes reserved.
    let config = AllocatorConfig { large_segment_size: u64::MAX - MIB + 1, ..AllocatorConfig::default() };
    let mut a = CachingAllocator::new(config, 80 * GIB, 80 * GIB).unwrap();
    let small = a.malloc(512, 0).unwrap();
    let oom = a.malloc(2 * MIB, 0).unwrap_err();
    assert_eq!((oom.reserved, oom.limit), (2 * MIB, 80 * GIB));
    assert!(allocated(&a) <= reserved(&a) && reserved(&a) <= 80 * GIB);
    a.free(small);
    // Under a memory fraction the same.
    let config =
        AllocatorConfig { large_segment_size: u64::MAX - MIB + 1, memory_fraction: 0.5, ..AllocatorConfig::default() };
    let mut b = CachingAllocator::new(config, 80 * GIB, 80 * GIB).unwrap();
    let _small = b.malloc(512, 0).unwrap();
    assert!(b.malloc(2 * MIB, 0).is_err());
    assert!(reserved(&b) <= 40 * GIB);
}

#[test]
fn a_device_beyond_one_exabyte_is_refused_and_one_at_it_replays() {
    let e = CachingAllocator::new(AllocatorConfig::default(), ONE_EXABYTE + 1, 80 * GIB).unwrap_err().to_string();
    assert!(e.contains("at most 1 EiB"), "{e}");
    assert!(CachingAllocator::new(AllocatorConfig::default(), 80 * GIB, u64::MAX).is_err());
    // The largest device the model takes: expandable segments of 1.125 times
    // it, one after another, and ordinary segments over a long history, all
    // get addresses without running past the top of the address space.
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let mut a = CachingAllocator::new(config, ONE_EXABYTE, ONE_EXABYTE).unwrap();
    for stream in 0..40 {
        let x = a.malloc(3 * MIB, stream).unwrap();
        a.free(x);
    }
    let mut b = CachingAllocator::new(AllocatorConfig::default(), ONE_EXABYTE, ONE_EXABYTE).unwrap();
    for _ in 0..40 {
        let x = b.malloc(ONE_EXABYTE / 2, 0).unwrap();
        b.free(x);
        b.empty_cache();
    }
    assert_eq!((reserved(&a), reserved(&b)), (40 * 20 * MIB, 0));
    // The running totals of a long history stop at i64::MAX.
    assert_eq!(b.stats().allocated_bytes.all.allocated, i64::MAX);
}

#[test]
fn a_request_larger_than_an_expandable_segments_range_fails_without_mapping_it() {
    // Found by the property tests: an expandable segment is 1.125 times the
    // device's memory of address space; on a card larger than its device (a
    // prediction's unlimited replay), a request beyond that range used to
    // walk off the segment's end. libtorch cannot map it either: it fails,
    // and nothing is mapped for it.
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let mut a = CachingAllocator::new(config, 1 << 40, 80 * GIB).unwrap();
    let oom = a.malloc(100 * GIB, 0).unwrap_err();
    assert_eq!((oom.requested, reserved(&a)), (100 * GIB, 0));
    // Within the range, the same card serves it.
    assert!(a.malloc(85 * GIB, 0).is_ok());
}

// libtorch 2.13 against 2.11 (see `Libtorch`).

#[test]
fn libtorch_2_13_rounds_the_memory_fraction_where_2_11_truncates() {
    // 0.3 of 6,990,506 bytes is 2,097,151.8: 2.11 may hold 2,097,151 bytes,
    // one short of the 2 MiB segment a 512-byte request takes; 2.13 rounds
    // to 2,097,152 and makes it.
    let run = |libtorch: Libtorch| {
        let config = AllocatorConfig::read_as("per_process_memory_fraction:0.3", libtorch).unwrap().config;
        let mut a = CachingAllocator::new(config, GIB, 6_990_506).unwrap();
        a.malloc(512, 0).map(|_| reserved(&a)).map_err(|oom| oom.limit)
    };
    assert_eq!(run(Libtorch::V2_11), Err(2_097_151));
    assert_eq!(run(Libtorch::V2_13), Ok(2 * MIB));
}

#[test]
fn libtorch_2_13_orders_free_blocks_of_one_size_by_their_segments_age() {
    // A block of an older segment at a higher address: 2.11 takes the
    // lower address first, 2.13 the older segment.
    let (older_high, newer_low) = ((0, 7 << 40), (1, 3 << 40));
    let order = |v: Libtorch, (segment, address): (u64, u64)| v.free_order(segment, address);
    assert!(order(Libtorch::V2_11, newer_low) < order(Libtorch::V2_11, older_high));
    assert!(order(Libtorch::V2_13, older_high) < order(Libtorch::V2_13, newer_low));
    // Within one segment both go by address.
    assert!(order(Libtorch::V2_13, (4, 1 << 30)) < order(Libtorch::V2_13, (4, 2 << 30)));
}

#[test]
fn libtorch_2_13_reads_its_own_keys_and_2_11_refuses_them() {
    for conf in ["pinned_max_cached_size_mb:64", "pinned_max_round_threshold_mb:8", "pinned_free_catch_all:True"] {
        let e = AllocatorConfig::read(conf).unwrap_err().to_string();
        assert!(e.contains("libtorch 2.11 refuses it") && e.contains("Unrecognized key"), "{e}");
        let read = AllocatorConfig::read_as(conf, Libtorch::V2_13).unwrap();
        assert_eq!(read.config.without_effect, [conf], "kept, moving no device memory");
        assert!(read.config.same_effect(&AllocatorConfig::read_as("", Libtorch::V2_13).unwrap().config));
    }
    let e = AllocatorConfig::read_as("pinned_free_catch_all:maybe", Libtorch::V2_13).unwrap_err().to_string();
    assert!(e.contains("libtorch 2.13 refuses it"), "{e}");
    // Refusing a request before the cache is freed is not modelled: said, not ignored.
    let e = AllocatorConfig::read_as("throw_on_cudamalloc_oom:True", Libtorch::V2_13).unwrap_err().to_string();
    assert!(e.contains("does not model") && e.contains("libtorch 2.13"), "{e}");
    assert!(AllocatorConfig::read_as("throw_on_cudamalloc_oom:False", Libtorch::V2_13).is_ok());
    assert!(AllocatorConfig::read("throw_on_cudamalloc_oom:False").is_err(), "2.11 has no such key");
    // The same words under two versions are two settings.
    let (old, new) = (AllocatorConfig::default(), AllocatorConfig::read_as("", Libtorch::V2_13).unwrap().config);
    assert!(!old.same_effect(&new));
}

#[test]
fn a_recording_names_the_allocator_it_replays_and_a_file_that_does_not_is_told() {
    use crate::events::Action::{Alloc, FreeCompleted};
    use crate::render::Render;
    let mut snapshot = history(&[(Alloc, 1 << 32, 512), (FreeCompleted, 1 << 32, 512)]);
    let (none, asked_13) =
        (ReplayOptions::default(), ReplayOptions { libtorch: Some(Libtorch::V2_13), ..Default::default() });
    // A file that says nothing: 2.11, assumed and said; or what --libtorch says.
    let r = replay_snapshot("pytorch", &snapshot, &none).unwrap();
    assert_eq!(r.libtorch, Libtorch::V2_11);
    assert!(r.assumptions.iter().any(|a| a.contains("does not say its libtorch version")), "{:?}", r.assumptions);
    let r = replay_snapshot("pytorch", &snapshot, &asked_13).unwrap();
    assert_eq!(r.libtorch, Libtorch::V2_13);
    assert!(
        !r.assumptions.iter().any(|a| a.contains("libtorch version") || a.contains("libtorch 2.")),
        "{:?}",
        r.assumptions
    );
    assert!(r.to_text().contains("model of libtorch 2.13's CUDA caching allocator"), "{}", r.to_text());
    // A recording that names 2.13 replays as 2.13 with no caveat.
    let run = crate::run::RunInfo { libtorch: Some("2.13.0+cu130".into()), ..Default::default() };
    let devices = vec!["cuda:0".to_string()];
    snapshot.memlab = Some(crate::export::SnapshotInfo { run: Some(run), devices, ..Default::default() });
    let r = replay_snapshot("memlab's", &snapshot, &none).unwrap();
    assert_eq!(r.libtorch, Libtorch::V2_13);
    assert!(
        !r.assumptions.iter().any(|a| a.contains("libtorch version") || a.contains("libtorch 2.")),
        "{:?}",
        r.assumptions
    );
    // --libtorch against the file's own word is refused.
    let asked_11 = ReplayOptions { libtorch: Some(Libtorch::V2_11), ..Default::default() };
    let e = replay_snapshot("memlab's", &snapshot, &asked_11).unwrap_err().to_string();
    assert!(e.contains("2.13.0+cu130") && e.contains("leave --libtorch out"), "{e}");
    // A version memlab does not model replays as 2.11's, said.
    snapshot.memlab.as_mut().unwrap().run.as_mut().unwrap().libtorch = Some("2.12.1".into());
    let r = replay_snapshot("memlab's", &snapshot, &none).unwrap();
    assert_eq!(r.libtorch, Libtorch::V2_11);
    assert!(r.assumptions.iter().any(|a| a.contains("2.12.1") && a.contains("does not model")), "{:?}", r.assumptions);
}
