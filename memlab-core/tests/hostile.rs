//! The allocator model and its readers on hostile input: settings strings
//! made of every key and the values at libtorch's edges, snapshots whose
//! numbers sit at the edges of u64 and i64, CPU histories replayed as
//! CUDA's on cards of every size. Each is read or refused with an error,
//! never a panic (run in debug too, where an overflow panics), and what is
//! read keeps its figures consistent: nothing allocated beyond what is
//! reserved, nothing reserved beyond the card, no "fits" without room.

use memlab_core::events::Action;
use memlab_core::export::{
    analysis::Summary, check_figures, Segment, SegmentType, Snapshot, SnapshotFile, SnapshotInfo, TraceEntry,
};
use memlab_core::replay::{
    predict_cuda, replay_snapshot, AllocatorConfig, CachingAllocator, Fit, PredictOptions, ReplayOptions, MAX_MB, MIB,
};
use proptest::prelude::*;

const KEYS: [&str; 17] = [
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "no_such_key",
];

const VALUES: [&str; 28] = [
    "0",
    "1",
    "-1",
    "3",
    "10",
    "11",
    "20",
    "128",
    "256",
    "17592186044415",
    "17592186044416",
    "17592186044436",
    "18446744073709551615",
    "18446744073709551616",
    "36028797018963968",
    "nan",
    "inf",
    "1e-400",
    "0.5",
    "True",
    "False",
    "maybe",
    "[1:2,>:4]",
    "[>:4]",
    "[]",
    "[48:2]",
    "[256:4:8]",
    "30abc",
];

/// Sizes at the edges: of blocks, of the model's limit (1 EiB), of i64 and u64.
const SIZES: [u64; 14] = [
    0,
    1,
    511,
    512,
    1 << 20,
    (1 << 20) + 1,
    20 << 20,
    1 << 40,
    (1 << 60) - 1,
    1 << 60,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
];

fn settings() -> impl Strategy<Value = String> {
    let entry = (0..KEYS.len(), prop_oneof![Just(":"), Just(","), Just("=")], 0..VALUES.len())
        .prop_map(|(k, sep, v)| format!("{}{sep}{}", KEYS[k], VALUES[v]));
    proptest::collection::vec(entry, 0..4).prop_map(|entries| entries.join(","))
}

fn entry(action: Action, addr: u64, size: u64, time_us: u64) -> TraceEntry {
    TraceEntry::new(action, (action != Action::Oom).then_some(addr), size, time_us)
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => Just(Action::Alloc),
        2 => Just(Action::FreeRequested),
        2 => Just(Action::FreeCompleted),
        1 => Just(Action::SegmentAlloc),
        1 => Just(Action::SegmentFree),
        1 => Just(Action::Oom),
    ]
}

/// A history of one device: entries of edge sizes at a few addresses (some
/// at the top of the address space), and final segments of edge sizes.
fn snapshot(device: &'static str) -> impl Strategy<Value = Snapshot> {
    let entries = proptest::collection::vec((action(), 0..4u64, 0..SIZES.len()), 0..12);
    let segments = proptest::collection::vec((0..4u64, 0..SIZES.len()), 0..3);
    (entries, segments).prop_map(move |(entries, segments)| {
        let address = |a: u64| if a == 3 { u64::MAX - 4096 } else { (a + 1) << 32 };
        let trace = entries
            .iter()
            .enumerate()
            .map(|(i, &(action, a, s))| entry(action, address(a), SIZES[s], i as u64))
            .collect();
        let segments = segments
            .iter()
            .map(|&(a, s)| Segment {
                device: 0,
                address: address(a),
                total_size: SIZES[s],
                stream: 0,
                segment_type: SegmentType::Large,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                is_expandable: false,
                blocks: Vec::new(),
            })
            .collect();
        Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: Some(memlab_core::export::AllocatorSettings {
                conf: Some(String::new()),
                ..Default::default()
            }),
            memlab: Some(SnapshotInfo { devices: vec![device.into()], ..SnapshotInfo::default() }),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// A settings string is read as libtorch reads it or refused; what is
    /// read keeps libtorch's ranges, and the model runs under it.
    #[test]
    fn settings_strings_are_read_within_libtorchs_ranges_or_refused(text in settings()) {
        if let Ok(read) = AllocatorConfig::read(&text) {
            let c = read.config;
            prop_assert!(c.large_segment_size > 10 * MIB && c.large_segment_size <= MAX_MB * MIB, "{text}");
            prop_assert!(c.max_split_size.is_none_or(|m| m >= c.large_segment_size && m % MIB == 0), "{text}");
            prop_assert!(c.max_non_split_rounding >= c.large_segment_size, "{text}");
            prop_assert!((0.0..=1.0).contains(&c.memory_fraction), "{text}");
            prop_assert!(c.garbage_collection_threshold >= 0.0 && c.garbage_collection_threshold < 1.0, "{text}");
            prop_assert!(c.roundup_power2_divisions.iter().all(|&d| d == 0 || d.is_power_of_two()), "{text}");
            // What it writes back reads back the same.
            let conf = c.to_conf();
            prop_assert_eq!(AllocatorConfig::parse(&conf).unwrap().to_conf(), conf, "{}", text);
            let mut gpu = CachingAllocator::new(c, 80 << 30, 80 << 30).unwrap();
            for size in [1u64, 5 << 20, 3 << 20, 12 << 20, 1 << 30] {
                let block = gpu.malloc(size, 0);
                let s = gpu.stats();
                prop_assert!(s.allocated_bytes.all.current <= s.reserved_bytes.all.current, "{text}");
                prop_assert!(s.reserved_bytes.all.current as u64 <= 80 << 30, "{text}");
                if let Ok(block) = block {
                    gpu.free(block);
                }
            }
        }
    }

    /// A snapshot of edge numbers is refused where its figures cannot be
    /// held, and otherwise summarised and replayed with consistent figures.
    #[test]
    fn snapshots_at_the_edges_of_u64_are_read_or_refused(s in snapshot("cuda:0"), card in 0..SIZES.len()) {
        let file = Snapshot::from_pickle(&s.to_pickle().unwrap());
        prop_assert_eq!(file.is_ok(), check_figures(&s).is_ok());
        let Ok(file) = file else { return Ok(()) };
        let summary = Summary::of("edges", &file);
        for d in &summary.devices {
            prop_assert!(d.end.reserved.is_none_or(|r| r < 1 << 63));
        }
        let options = ReplayOptions { capacity: Some(SIZES[card]), compare: true, ..ReplayOptions::default() };
        if let Ok(replayed) = replay_snapshot("edges", &file.snapshot, &options) {
            for d in &replayed.devices {
                for r in std::iter::once(&d.recorded).chain(&d.replays) {
                    prop_assert!(r.peak_allocated <= r.peak_reserved, "{:?}", r);
                    prop_assert!(r.ooms.len() <= r.oom_count);
                }
                let _ = d.verdict().to_text();
            }
            let _ = memlab_core::render::Render::to_text(&replayed);
        }
    }

    /// A CPU history of edge numbers, replayed as CUDA's on a card of any
    /// size: "fits" only with its room to spare.
    #[test]
    fn cpu_histories_at_the_edges_predict_within_the_card(s in snapshot("cpu"), card in 0..SIZES.len()) {
        let _ = SnapshotFile::of(s.clone());
        let options = PredictOptions { capacity: Some(SIZES[card]), ..PredictOptions::default() };
        if let Ok(p) = predict_cuda("edges", &s, &options) {
            for setting in &p.settings {
                if let Some(Fit::Fits { spare }) = &setting.fit {
                    prop_assert_eq!(setting.peak_device + spare, SIZES[card]);
                }
                prop_assert!(setting.peak_allocated <= setting.peak_reserved);
            }
            let _ = memlab_core::render::Render::to_text(&p);
        }
    }
}
