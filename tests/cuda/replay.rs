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

/// What follows `marker` on each line of a child's output that has it (the
/// harness may have printed the test's name before it on the same line).
fn marked<'a>(output: &'a str, marker: &str) -> Vec<&'a str> {
    output.lines().filter_map(|l| l.find(marker).map(|at| &l[at + marker.len()..])).collect()
}

/// With `MEMLAB_REPLAY_OUT` set, leaves `snapshot` there as a fixture of
/// `fixtures/replay/` (`WORKLOAD__SETTING.pickle`), with the allocator's own
/// figures of the run as a line of its `results.jsonl`
/// (`WORKLOAD__SETTING.json`).
fn save_fixture(workload: &str, setting: &str, conf: &str, snapshot: &memlab::export::Snapshot, oom: Option<String>) {
    let Some(dir) = std::env::var_os("MEMLAB_REPLAY_OUT").map(std::path::PathBuf::from) else { return };
    let stats = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    let settings = memlab::gpu::cuda_allocator_settings(0).unwrap().unwrap();
    snapshot.write_pickle(dir.join(format!("{workload}__{setting}.pickle"))).unwrap();
    let line = serde_json::json!({
        "workload": workload,
        "setting": setting,
        "conf": conf,
        "recorder": "memlab",
        "torch": memlab_tch::libtorch_version(),
        "total_memory": settings.total_memory,
        "fraction": settings.memory_fraction,
        "peak_reserved": stats.reserved_bytes.all.peak,
        "peak_allocated": stats.allocated_bytes.all.peak,
        "num_ooms": stats.num_ooms,
        "num_alloc_retries": stats.num_alloc_retries,
        "oom": oom,
    });
    std::fs::write(dir.join(format!("{workload}__{setting}.json")), format!("{line}\n")).unwrap();
}

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
fn mlp_123548() {
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

/// A training loop of a small conv net (two 3x3 convolutions, pooling, a
/// linear head) over batches of 32 to 128 images of 64x64.
fn conv() {
    let vs = nn::VarStore::new(GPU);
    let root = vs.root();
    let c1 = nn::conv2d(&root / "c1", 3, 32, 3, nn::ConvConfig { padding: 1, ..Default::default() });
    let c2 = nn::conv2d(&root / "c2", 32, 64, 3, nn::ConvConfig { padding: 1, ..Default::default() });
    let head = nn::linear(&root / "head", 64 * 16 * 16, 10, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    for step in 0..12 {
        let batch = [32, 128, 64][step % 3];
        let x = Tensor::randn([batch, 3, 64, 64], (Kind::Float, GPU));
        let y = x.apply(&c1).relu().max_pool2d_default(2).apply(&c2).relu().max_pool2d_default(2);
        let loss = y.flatten(1, -1).apply(&head).square().mean(Kind::Float);
        opt.backward_step(&loss);
    }
    tch::Cuda::synchronize(0);
}

/// A training loop of a small transformer block (one attention head of
/// width 256, layer norms, a 1024-wide MLP) over sequences of 64 to 512
/// tokens, 8 at a time.
fn transformer() {
    let vs = nn::VarStore::new(GPU);
    let root = vs.root();
    let d = 256;
    let qkv = nn::linear(&root / "qkv", d, 3 * d, Default::default());
    let out = nn::linear(&root / "out", d, d, Default::default());
    let up = nn::linear(&root / "up", d, 4 * d, Default::default());
    let down = nn::linear(&root / "down", 4 * d, d, Default::default());
    let (ln1, ln2) = (
        nn::layer_norm(&root / "ln1", vec![d], Default::default()),
        nn::layer_norm(&root / "ln2", vec![d], Default::default()),
    );
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    for step in 0..12 {
        let tokens = [64, 512, 128, 256][step % 4];
        let x = Tensor::randn([8, tokens, d], (Kind::Float, GPU));
        let parts = x.apply(&ln1).apply(&qkv).chunk(3, -1);
        let scores = parts[0].matmul(&parts[1].transpose(-2, -1)) / (d as f64).sqrt();
        let attended = scores.softmax(-1, Kind::Float).matmul(&parts[2]).apply(&out);
        let h = &x + attended;
        let y = &h + h.apply(&ln2).apply(&up).gelu("none").apply(&down);
        let loss = y.square().mean(Kind::Float);
        opt.backward_step(&loss);
    }
    tch::Cuda::synchronize(0);
}

/// memlab's recorded workloads: a name for their files, the program, and
/// how many of [`SETTINGS`] they run under (the #123548 pattern's growth
/// needs both settings at once).
const WORKLOADS: [(&str, fn(), usize); 3] =
    [("memlab_mlp_123548", mlp_123548, 4), ("memlab_conv", conv, 3), ("memlab_transformer", transformer, 3)];

#[test]
#[ignore = "needs a CUDA GPU"]
fn memlabs_own_recordings_replay_event_for_event() {
    let name = "replay::memlabs_own_recordings_replay_event_for_event";
    if common::child(name) {
        let _s = serial();
        let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default();
        let workload = std::env::var("MEMLAB_WORKLOAD").unwrap();
        let (workload, program, _) = *WORKLOADS.iter().find(|(w, _, _)| *w == workload).unwrap();
        // Before anything of CUDA's is allocated in this process.
        let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(false)).unwrap();
        program();
        let stats = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
        let snapshot = memlab::export::Exporter::registered().snapshot().unwrap();
        drop(recording);
        let label = SETTINGS.iter().find(|(_, c)| *c == conf).map_or("other", |(l, _)| l);
        save_fixture(workload, label, &conf, &snapshot, None);
        // Through the file, as `memlab replay` reads it.
        let path = std::env::temp_dir().join(format!("{workload}__{label}-{}.pickle", std::process::id()));
        snapshot.write_pickle(&path).unwrap();
        let file = Snapshot::read_pickle(&path).unwrap();
        let settings = file.snapshot.allocator_settings.as_ref().expect("the allocator's settings are recorded");
        let mut config = AllocatorConfig::from_snapshot(settings).unwrap();
        assert_eq!(config, AllocatorConfig::parse(&conf).unwrap(), "{settings:?}");
        let info = file.snapshot.memlab.as_ref().unwrap();
        let memory = info.device_memory.iter().find(|m| m.device == "cuda:0").expect("cuda:0's memory is recorded");
        assert_eq!(memory.total, memlab::gpu::cuda_mem_info(0).unwrap().1);
        assert_eq!(memory.memory_fraction, 1.0);
        config.memory_fraction = memory.memory_fraction;
        let card = Card { capacity: memory.total, total: memory.total };
        let r = replay_device(&file.snapshot, 0, &config, &config, card).unwrap();
        println!(
            "REPLAY {workload} {label}: segment events {}/{}, peak reserved {} (allocator {}), peak allocated {} (allocator {})",
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
        std::fs::remove_file(&path).ok();
        return;
    }
    let _s = serial();
    for (workload, _, settings) in WORKLOADS {
        for (_, conf) in &SETTINGS[..settings] {
            let (stdout, _) =
                common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", conf), ("MEMLAB_WORKLOAD", workload)]);
            println!("{}", marked(&stdout, "REPLAY ").join("\n"));
        }
    }
}

/// The bytes of the memory fraction the fragmentation failure runs under:
/// 1.5 GiB, as in PyTorch's fixture (scripts/replay_fixtures.py).
const FRACTION_BYTES: f64 = 1.5 * (1u64 << 30) as f64;

/// PyTorch's fragmentation fixture's program: 1 GiB freed, 100 pieces of
/// 10 MiB with every other one freed, then 600 MiB in one piece. Whether
/// the last request ran out of memory.
fn fragmentation() -> Option<String> {
    let bytes = |n: i64| Tensor::f_empty([n], (Kind::Uint8, GPU));
    drop(bytes(1 << 30).unwrap());
    let pieces: Vec<Tensor> = (0..100).map(|_| bytes(10 * MIB).unwrap()).collect();
    let kept: Vec<Tensor> = pieces.into_iter().skip(1).step_by(2).collect();
    let failed = bytes(600 * MIB).err().map(|e| e.to_string());
    drop(kept);
    failed
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_oom_reports_replay_verdict_agrees_with_rerunning_under_each_setting() {
    let name = "replay::the_oom_reports_replay_verdict_agrees_with_rerunning_under_each_setting";
    if common::child(name) {
        let _s = serial();
        if std::env::var_os("MEMLAB_RERUN").is_some() {
            // The program again under the setting the parent names: no recording.
            println!("RERUN oom={}", fragmentation().is_some());
            return;
        }
        let dir = std::env::temp_dir().join(format!("memlab-replay-oom-{}", std::process::id()));
        memlab::OomRecorder::new(&dir).max_reports(10).init_cuda(true).arm().unwrap();
        let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(false)).unwrap();
        let message = fragmentation().expect("the program runs out of memory under its fraction");
        let report = memlab::last_oom().expect("a report of the failure");
        let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap();
        save_fixture(
            "memlab_fragmentation",
            "default",
            &conf,
            &memlab::export::Exporter::registered().snapshot().unwrap(),
            Some(message),
        );
        drop(recording);
        memlab::OomRecorder::disarm();
        println!("{}", report.to_text());
        // The diagnosis reads the fraction: 1.5 GiB less the 1 GiB held
        // (the free 2 MiB segment went back in the retry) was what was free.
        let device = report.diagnosis.figures.device.expect("the device's figures");
        assert_eq!(device.limit, Some(memlab::oom::HostLimit::MemoryFraction), "{device:?}");
        assert_eq!(device.free, 512 << 20, "{device:?}");
        assert!(report.diagnosis.advice.contains("free under the CUDA memory fraction"), "{}", report.diagnosis.advice);
        let replayed = report.replay.as_ref().expect("a CUDA failure while recording is replayed");
        let device = &replayed.devices[0];
        let oom = device.recorded_oom().expect("the replay reproduces the failure");
        let r = &device.recorded;
        assert_eq!((r.segment_events_matched, r.unknown_frees), (r.segment_events, 0), "{:?}", r.first_mismatch);
        // The recorder's CUDA set-up holds a segment before the recording
        // starts: the replay rebuilds it.
        assert!(r.reserved_before == 0 || r.rebuilt_segments > 0, "{r:?}");
        assert_eq!(oom.oom.requested, 600 << 20);
        for x in &device.replays {
            println!("VERDICT {} avoids={}", x.settings, x.ooms.is_empty());
        }
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    let _s = serial();
    let total = memlab::gpu::cuda_mem_info(0).unwrap().1;
    let fraction = format!("per_process_memory_fraction:{}", FRACTION_BYTES / total as f64);
    let (stdout, _) = common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", fraction.as_str())]);
    println!("{}", stdout.lines().filter(|l| !l.contains("VERDICT ")).collect::<Vec<_>>().join("\n"));
    let verdicts: Vec<(String, bool)> = marked(&stdout, "VERDICT ")
        .into_iter()
        .map(|l| {
            let (settings, avoids) = l.rsplit_once(" avoids=").unwrap();
            (settings.to_string(), avoids == "true")
        })
        .collect();
    assert!(verdicts.len() >= 5, "{stdout}");
    for (settings, avoids) in &verdicts {
        let (rerun, _) =
            common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", settings.as_str()), ("MEMLAB_RERUN", "1")]);
        let failed = rerun.contains("RERUN oom=true");
        assert!(failed || rerun.contains("RERUN oom=false"), "{rerun}");
        println!("REPLAYED {settings}: avoids {avoids}; rerun on the GPU: out of memory {failed}");
        assert_eq!(*avoids, !failed, "{settings}: the report's verdict and the GPU disagree");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_oom_reports_replay_rebuilds_the_blocks_held_before_the_recording() {
    let name = "replay::an_oom_reports_replay_rebuilds_the_blocks_held_before_the_recording";
    if common::child(name) {
        let _s = serial();
        let dir = std::env::temp_dir().join(format!("memlab-replay-warm-{}", std::process::id()));
        memlab::OomRecorder::new(&dir).max_reports(10).init_cuda(true).arm().unwrap();
        // 3 MiB held in a 20 MiB segment before the recording starts: the
        // replay must rebuild the segment with the block in use, or it
        // would give the segment back in the failing request's retry.
        let warm = floats(3 * MIB / 4);
        let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(false)).unwrap();
        assert!(fragmentation().is_some(), "the program runs out of memory under its fraction");
        let report = memlab::last_oom().expect("a report of the failure");
        drop(recording);
        memlab::OomRecorder::disarm();
        let r = &report.replay.as_ref().expect("a CUDA failure while recording is replayed").devices[0].recorded;
        println!(
            "REBUILT {} segment(s), {} block(s); segment events {}/{}",
            r.rebuilt_segments, r.rebuilt_blocks, r.segment_events_matched, r.segment_events
        );
        assert!(r.rebuilt_blocks >= 1, "{r:?}");
        assert_eq!((r.segment_events_matched, r.unknown_frees), (r.segment_events, 0), "{:?}", r.first_mismatch);
        assert!(r.ooms.iter().any(|o| o.recorded), "the failure, replayed: {r:?}");
        drop(warm);
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    let _s = serial();
    let total = memlab::gpu::cuda_mem_info(0).unwrap().1;
    let fraction = format!("per_process_memory_fraction:{}", FRACTION_BYTES / total as f64);
    let (stdout, _) = common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", fraction.as_str())]);
    println!("{}", marked(&stdout, "REBUILT ").join("\n"));
}
