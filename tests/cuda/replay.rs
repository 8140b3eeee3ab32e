//! memlab's own CUDA recordings replayed through the model of libtorch's
//! caching allocator (`memlab_core::replay`): each recording, made in a
//! child under one allocator setting, carries the settings, the device's
//! memory and fraction, and a history that starts on an empty allocator, so
//! that its replay under those settings makes every segment event the
//! allocator made and reaches the allocator's own reserved peak. With
//! `MEMLAB_REPLAY_OUT` set, each child also leaves its snapshot there.

use super::*;

use memlab_core::export::Snapshot;
use memlab_core::replay::{replay_device, AllocatorConfig, Card};
use tch::nn::{self, Module, OptimizerConfig};

/// The settings each child records under, with a name for its file.
const SETTINGS: [(&str, &str); 4] = [
    ("default", ""),
    ("expandable", "expandable_segments:True"),
    ("mss128", "max_split_size_mb:128"),
    ("both", "expandable_segments:True,max_split_size_mb:128"),
];

/// A training loop of an MLP over batches of varying size, then
/// pytorch#123548's pattern: 30 cycles of 91 MiB and 45.5 MiB freed around
/// 2 MiB kept.
fn workload() {
    let vs = nn::VarStore::new(GPU);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 512, 2048, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 2048, 10, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    for step in 0..16 {
        let batch = [64, 1024, 256, 4096][step % 4];
        let x = Tensor::randn([batch, 512], (Kind::Float, GPU));
        let loss = net.forward(&x).square().mean(Kind::Float);
        opt.backward_step(&loss);
    }
    let mut kept = Vec::new();
    for _ in 0..30 {
        let a = floats(91 * MIB / 4);
        let b = floats(91 * MIB / 8);
        kept.push(floats(2 * MIB / 4));
        drop((a, b));
    }
    tch::Cuda::synchronize(0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memlabs_own_recordings_replay_event_for_event() {
    let name = "replay::memlabs_own_recordings_replay_event_for_event";
    if common::child(name) {
        let _s = serial();
        let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default();
        // Before anything of CUDA's is allocated in this process.
        let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(false)).unwrap();
        workload();
        let stats = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
        let snapshot = memlab::export::Exporter::registered().snapshot().unwrap();
        drop(recording);
        // Through the file, as `memlab replay` reads it.
        let dir = std::env::var_os("MEMLAB_REPLAY_OUT").map_or_else(std::env::temp_dir, Into::into);
        let label = SETTINGS.iter().find(|(_, c)| *c == conf).map_or("other", |(l, _)| l);
        let path = dir.join(format!("memlab_mlp_123548__{label}.pickle"));
        snapshot.write_pickle(&path).unwrap();
        let file = Snapshot::read_pickle(&path).unwrap();
        let settings = file.snapshot.allocator_settings.as_ref().expect("the allocator's settings are recorded");
        let mut config = AllocatorConfig::from_snapshot(settings).unwrap();
        assert_eq!(config, AllocatorConfig::parse(&conf).unwrap(), "{settings}");
        let info = file.snapshot.memlab.as_ref().unwrap();
        let memory = info.device_memory.iter().find(|m| m.device == "cuda:0").expect("cuda:0's memory is recorded");
        assert_eq!(memory.total, memlab::gpu::cuda_mem_info(0).unwrap().1);
        assert_eq!(memory.memory_fraction, 1.0);
        config.memory_fraction = memory.memory_fraction;
        let card = Card { capacity: memory.total, total: memory.total };
        let r = replay_device(&file.snapshot, 0, &config, &config, card).unwrap();
        println!(
            "REPLAY {label}: segment events {}/{}, peak reserved {} (allocator {}), peak allocated {} (allocator {})",
            r.segment_events_matched,
            r.segment_events,
            r.peak_reserved,
            stats.reserved_bytes.all.peak,
            r.peak_allocated,
            stats.allocated_bytes.all.peak
        );
        assert_eq!((r.reserved_before, r.unknown_frees), (0, 0), "the history starts on an empty allocator");
        assert!(r.segment_events > 0);
        assert_eq!(r.segment_events_matched, r.segment_events, "first difference {:?}", r.first_mismatch);
        assert_eq!(r.peak_reserved, stats.reserved_bytes.all.peak as u64, "the allocator's reserved peak");
        assert_eq!(r.peak_allocated, stats.allocated_bytes.all.peak as u64, "the allocator's allocated peak");
        if std::env::var_os("MEMLAB_REPLAY_OUT").is_none() {
            std::fs::remove_file(&path).ok();
        }
        return;
    }
    let _s = serial();
    for (_, conf) in SETTINGS {
        let (stdout, _) = common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", conf)]);
        println!("{}", stdout.lines().filter(|l| l.starts_with("REPLAY")).collect::<Vec<_>>().join("\n"));
    }
}
