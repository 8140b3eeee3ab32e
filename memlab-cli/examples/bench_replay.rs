//! How fast the allocator model replays a history: a synthetic training
//! loop's CUDA history of EVENTS entries (default 1,000,000: allocations
//! of a dozen sizes from 4 KiB to 96 MiB, most freed a few steps later,
//! every fourth kept for a while), replayed under four settings, each the
//! median of ROUNDS runs; then what an out-of-memory report adds on CUDA
//! when that history ends in a failure: the replay under the settings people
//! try and the settings advice decided from it (target: at most 2 s for a
//! million entries). Prints two tables.
//!
//!     cargo run --release -p memlab-cli --example bench_replay [EVENTS] [ROUNDS]

use std::time::Instant;

use memlab_core::events::Action;
use memlab_core::export::{Snapshot, TraceEntry};
use memlab_core::replay::{replay_device, replay_device_at, AllocatorConfig, Card};

/// A history of about `events` entries: allocations and their frees.
fn history(events: usize) -> Snapshot {
    const SIZES: [u64; 12] = [
        4 << 10,
        64 << 10,
        512 << 10,
        1 << 20,
        3 << 20,
        5 << 20,
        12 << 20,
        20 << 20,
        33 << 20,
        48 << 20,
        64 << 20,
        96 << 20,
    ];
    let entry = |action, addr: u64, size, time_us| TraceEntry {
        action,
        addr: Some(addr),
        size,
        stream: 0,
        time_us,
        frames: std::sync::Arc::from(Vec::new()),
        category: None,
        tensor: None,
        device_free: None,
    };
    let mut trace = Vec::with_capacity(events + 64);
    let mut live: std::collections::VecDeque<(u64, u64, usize)> = Default::default();
    let mut next = 1u64 << 32;
    let mut step = 0usize;
    // A linear congruential sequence: the same history every run.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    while trace.len() < events {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let size = SIZES[(seed >> 33) as usize % SIZES.len()];
        let keep = if (seed >> 20).is_multiple_of(4) { 40 } else { 3 };
        trace.push(entry(Action::Alloc, next, size, trace.len() as u64));
        live.push_back((next, size, step + keep));
        next += size.div_ceil(512) * 512;
        step += 1;
        let due: Vec<(u64, u64, usize)> = live.iter().copied().filter(|&(_, _, at)| at <= step).collect();
        live.retain(|&(_, _, at)| at > step);
        for (addr, size, _) in due {
            trace.push(entry(Action::FreeRequested, addr, size, trace.len() as u64));
            trace.push(entry(Action::FreeCompleted, addr, size, trace.len() as u64));
        }
    }
    Snapshot { segments: Vec::new(), device_traces: vec![trace], allocator_settings: None, memlab: None }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let events: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let snapshot = history(events);
    let n = snapshot.device_traces[0].len();
    let card = Card { capacity: 80 << 30, total: 80 << 30 };
    let default = AllocatorConfig::default();
    let recorded = replay_device(&snapshot, 0, &default, &default, card).expect("the history replays");
    println!("| settings | history entries | seconds (median of {rounds}) | entries per second | peak reserved |");
    println!("|---|---:|---:|---:|---:|");
    for conf in [
        "",
        "expandable_segments:True",
        "max_split_size_mb:128",
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5",
    ] {
        let config = AllocatorConfig::parse(conf).expect("settings parse");
        let mut peak = 0;
        let times = (0..rounds)
            .map(|_| {
                let start = Instant::now();
                let r = replay_device_at(&snapshot, 0, &config, card, &recorded.empty_cache_at).expect("replays");
                peak = r.peak_reserved;
                start.elapsed().as_secs_f64()
            })
            .collect();
        let t = median(times);
        let name = if conf.is_empty() { "default" } else { conf };
        println!("| `{name}` | {n} | {t:.3} | {:.0} | {} MiB |", n as f64 / t, peak >> 20);
    }
    report_replay(snapshot, rounds);
}

/// The out-of-memory report's part on CUDA: the history ending the way
/// a fragmentation failure does (1,000 blocks of 8 MiB, every other freed,
/// then a request no setting can place among the holes), on a card as
/// large as the history's reserved peak, replayed under the settings people
/// try (`replay_snapshot` with `compare`, as the recorder runs it), and the
/// settings advice decided from that: none helps, so an `empty_cache` is
/// looked for, four more replays (the most work the advice does).
fn report_replay(mut snapshot: Snapshot, rounds: usize) {
    use memlab_core::oom::{advise_settings, SettingsAdvice, Verdict};
    use memlab_core::replay::{replay_snapshot, ReplayOptions};
    let trace = &mut snapshot.device_traces[0];
    let mut t = trace.len() as u64;
    let mut at = |action, addr, size| {
        t += 1;
        TraceEntry::new(action, addr, size, t)
    };
    let blocks: Vec<u64> = (0..1000u64).map(|i| (1 << 50) + i * (8 << 20)).collect();
    let mut tail: Vec<TraceEntry> = blocks.iter().map(|&a| at(Action::Alloc, Some(a), 8 << 20)).collect();
    for &a in blocks.iter().step_by(2) {
        tail.push(at(Action::FreeRequested, Some(a), 8 << 20));
        tail.push(at(Action::FreeCompleted, Some(a), 8 << 20));
    }
    trace.extend(tail);
    let big = Card { capacity: 80 << 30, total: 80 << 30 };
    let default = AllocatorConfig::default();
    let whole = replay_device(&snapshot, 0, &default, &default, big).expect("the history replays");
    // Room for the request among the tensors, none among the holes.
    let capacity = whole.peak_reserved;
    let request = capacity - whole.peak_allocated;
    let failing = at(Action::Oom, None, request);
    snapshot.device_traces[0].push(failing);
    let n = snapshot.device_traces[0].len();
    let options =
        ReplayOptions { capacity: Some(capacity), total: Some(80 << 30), compare: true, ..Default::default() };
    let mut advice = None;
    let times = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            let replayed = replay_snapshot("bench", &snapshot, &options).expect("replays");
            advice = advise_settings(Verdict::Fragmentation, false, &default, Some((&snapshot, &replayed)), "cuda:0");
            start.elapsed().as_secs_f64()
        })
        .collect();
    let kind = match advice {
        Some(SettingsAdvice::NoSettingHelps { tensors_alone: false, empty_cache, .. }) => {
            format!(
                "none helps; an empty_cache looked for, {}",
                if empty_cache.is_some() { "found" } else { "none found" }
            )
        }
        other => format!("{other:?}"),
    };
    println!(
        "\n| the out-of-memory report's replay and advice | history entries | seconds (median of {rounds}) | advice |"
    );
    println!("|---|---:|---:|---|");
    println!(
        "| {} MiB asked on a card of {} MiB | {n} | {:.3} | {kind} |",
        request >> 20,
        capacity >> 20,
        median(times)
    );
}
