//! Recordings of CUDA allocations: the live set, PyTorch's snapshot and its
//! reader, the trace's counters, expandable segments, sampling, the HTML report.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_events_and_the_live_set() {
    let _s = serial();
    let _recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let (_, before) = memlab::events::history();
    let t = floats(1024 * 1024);
    let address = memlab::stats::storage_info(&t).unwrap().data_ptr;
    let live = memlab::events::live();
    let a = live.iter().find(|a| a.device == Device::Cuda(0) && a.address == address).expect("the CUDA tensor is live");
    assert_eq!(a.size, 4 << 20);
    drop(t);
    assert!(memlab::events::live().iter().all(|a| a.address != address || a.device != Device::Cuda(0)));
    let (events, after) = memlab::events::history();
    assert!(after.recorded > before.recorded);
    let mine: Vec<_> =
        events.iter().filter(|e| e.device == Device::Cuda(0) && e.address == address).map(|e| e.action).collect();
    assert!(
        mine.contains(&memlab::events::Action::Alloc) && mine.contains(&memlab::events::Action::FreeRequested),
        "{mine:?}"
    );
    println!("CUDA events for the 4 MiB tensor: {mine:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cuda_snapshot_opens_in_pytorchs_reader() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let kept: Vec<Tensor> = (0..4).map(|i| floats(1 << (10 + 2 * i))).collect();
    drop(floats(1 << 20));
    let vs = tch::nn::VarStore::new(tch::Device::Cuda(0));
    let _fc = tch::nn::linear(vs.root() / "fc", 64, 64, Default::default());
    let snapshot = memlab::export::Exporter::new(&vs).snapshot().unwrap();
    let stats = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    let cuda: Vec<_> = snapshot.segments.iter().filter(|s| s.device == 0).collect();
    let reserved: u64 = cuda.iter().map(|s| s.total_size).sum();
    assert_eq!(reserved as i64, stats.reserved_bytes.all.current, "segments add up to the reserved bytes");
    let allocated: u64 =
        cuda.iter().flat_map(|s| &s.blocks).filter(|b| b.state == "active_allocated").map(|b| b.size).sum();
    assert_eq!(allocated as i64, stats.allocated_bytes.all.current);
    let trace = &snapshot.device_traces[0];
    assert!(trace.iter().any(|e| e.action == "alloc" && e.size == 4 << 20), "the 4 MiB tensor's allocation");
    assert!(trace.iter().any(|e| e.action == "free_completed"), "CUDA frees complete in the trace");
    let path = std::env::temp_dir().join(format!("memlab-cuda-{}.pickle", std::process::id()));
    snapshot.write_pickle(&path).unwrap();
    let file = path.to_str().unwrap();
    let stats_view = python(&["-m", "torch.cuda._memory_viz", "stats", file]);
    let trace_view = python(&["-m", "torch.cuda._memory_viz", "trace", file]);
    println!("{}", stats_view.lines().take(8).collect::<Vec<_>>().join("\n"));
    println!("{}", trace_view.lines().take(8).collect::<Vec<_>>().join("\n"));
    // Every documented key and type; the user's .rs file in the frames.
    let summary: serde_json::Value = serde_json::from_str(&python(&["-c", VALIDATE, file])).unwrap();
    let files = summary["files"].as_array().unwrap();
    assert!(files.iter().any(|f| f == "recording.rs"), "the user's .rs file in the frames: {files:?}");
    // `stats` adds up every segment the file holds (the CPU's live
    // allocations too): the same total, in PyTorch's units.
    let all_segments: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
    let total = stats_view.lines().find(|l| l.starts_with("total_reserved:")).unwrap_or_default();
    assert!(total.contains(&bytes_as_pytorch_prints(all_segments)), "{total} vs {all_segments}\n{stats_view}");
    // Read back: as written, the weight named at its address, libtorch's version.
    let read = memlab::export::Snapshot::read_pickle(&path).unwrap();
    assert_eq!(format!("{:?}", read.snapshot), format!("{snapshot:?}"));
    let weight = &vs.variables()["fc.weight"];
    let named = read.snapshot.device_traces[0].iter().find(|e| e.tensor.as_deref() == Some("fc.weight")).unwrap();
    assert_eq!((named.addr, named.size), (Some(weight.data_ptr() as u64), 64 * 64 * 4));
    let info = read.snapshot.memlab.as_ref().unwrap();
    let run = info.run.as_ref().unwrap();
    assert_eq!(run.libtorch.as_deref(), Some(memlab::optimizer::libtorch_version()));
    assert_eq!(run.devices[0].device, "cuda:0");
    let uuid = run.devices[0].uuid.as_deref().expect("the driver's UUID");
    assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
    std::fs::remove_file(&path).ok();
    drop((kept, recording, vs));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_trace_counters_equal_the_allocators_figures() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let mut marks = Vec::new();
    let mut kept = Vec::new();
    for i in 0..8 {
        // 1000 floats (4000 bytes, a 4096-byte block) among whole MiBs: the
        // caching allocator rounds, the counters stay with what was asked.
        kept.push(if i % 3 == 0 { floats(1000) } else { floats((1 << 18) * (i + 1)) });
        if i % 2 == 1 {
            drop(kept.remove(0));
        }
        if i == 3 {
            memlab::gpu::empty_cache().unwrap(); // segments go back: reserved falls
        }
        let n = memlab::events::history().0.iter().filter(|e| e.device == Device::Cuda(0)).count();
        let s = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
        let requested = s.requested_bytes.all.current;
        let rounding = s.allocated_bytes.all.current - requested;
        marks.push((n, requested, s.reserved_bytes.all.current, rounding));
    }
    assert!(marks.iter().any(|m| m.3 > 0), "a block was rounded up: {marks:?}");
    let trace = memlab::export::Exporter::registered().trace().unwrap();
    let samples = &trace.counters[&Device::Cuda(0)];
    for (n, requested, reserved, _) in &marks {
        let l = samples[n - 1].level;
        // No free waits for a stream here: allocated and active are the requested bytes.
        assert_eq!((l.allocated, l.active, l.reserved), (*requested, *requested, *reserved), "after CUDA event {n}");
    }
    assert!(!trace.partial);
    // The HTML report's band of memory allocated before the history is what
    // was requested before it: never below zero, the same at every point.
    let report = memlab::export::Exporter::registered().html_report().unwrap();
    let cuda = report.devices.iter().find(|d| d.device == Device::Cuda(0)).unwrap();
    let before: Vec<i64> = cuda.points.iter().map(|p| p.layers[0]).collect();
    assert!(before.iter().all(|b| *b == before[0] && *b >= 0), "{before:?}");
    println!("{} CUDA samples; last {:?}", samples.len(), samples.last().unwrap().level);
    drop((kept, recording));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expandable_segments_are_mapped_and_unmapped_in_the_events_and_the_snapshot() {
    // The harness names a test by its module path.
    let name = "recording::expandable_segments_are_mapped_and_unmapped_in_the_events_and_the_snapshot";
    if common::child(name) {
        let _s = serial();
        let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
        let grown: Vec<Tensor> = (0..4).map(|_| floats(64 * MIB / 4)).collect();
        drop(grown);
        memlab::gpu::empty_cache().unwrap(); // unmaps the pages
        let (history, _) = memlab::events::history();
        let actions: Vec<memlab::events::Action> =
            history.iter().filter(|e| e.device == Device::Cuda(0)).map(|e| e.action).collect();
        use memlab::events::Action;
        assert!(actions.contains(&Action::SegmentMap) && actions.contains(&Action::SegmentUnmap), "{actions:?}");
        assert!(!actions.contains(&Action::SegmentAlloc), "one expandable segment grows: {actions:?}");
        let maps = actions.iter().filter(|a| **a == Action::SegmentMap).count();
        let snapshot = memlab::export::Exporter::registered().snapshot().unwrap();
        let trace: Vec<&str> = snapshot.device_traces[0].iter().map(|e| e.action.as_str()).collect();
        assert_eq!(trace.iter().filter(|a| **a == "segment_map").count(), maps, "{trace:?}");
        assert!(trace.contains(&"segment_unmap") && !trace.contains(&"segment_alloc"), "{trace:?}");
        let path = std::env::temp_dir().join(format!("memlab-expandable-{}.pickle", std::process::id()));
        snapshot.write_pickle(&path).unwrap();
        python(&["-c", VALIDATE, path.to_str().unwrap()]);
        let text = python(&["-m", "torch.cuda._memory_viz", "trace", path.to_str().unwrap()]);
        println!("{maps} maps; PyTorch's reader:\n{}", text.lines().take(8).collect::<Vec<_>>().join("\n"));
        std::fs::remove_file(&path).ok();
        drop(recording);
        return;
    }
    // The child's GPU memory must not meet another test's of this process.
    let _s = serial();
    let (stdout, _) = common::check_child(name, &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")]);
    println!("{stdout}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sampling_recording_reads_the_driver_into_the_trace() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    let settings = memlab::events::Settings::default().sampling(std::time::Duration::from_millis(1));
    let recording = memlab::Recording::start(settings).unwrap();
    let big = floats(16 << 20); // 64 MiB: a segment of its own, so the driver's figure moves
    std::thread::sleep(std::time::Duration::from_millis(30));
    let now = memlab::gpu::driver_memory(0).unwrap().used();
    let trace = memlab::export::Exporter::registered().trace().unwrap();
    drop(recording);
    let last = trace.readings.iter().rev().find(|r| !r.driver_used.is_empty()).expect("readings of cuda:0");
    assert_eq!(
        last.driver_used,
        vec![memlab::events::DriverUsed { device: 0, bytes: now }],
        "the last reading is the driver's figure now"
    );
    let first = trace.readings.iter().find(|r| !r.driver_used.is_empty()).unwrap();
    println!(
        "driver used: first reading {} B, last {} B, now {now} B",
        first.driver_used[0].bytes, last.driver_used[0].bytes
    );
    let doc: serde_json::Value = serde_json::from_str(&trace.to_json()).unwrap();
    let counters = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "cuda:0 driver used (all processes)")
        .count();
    assert!(counters >= 10, "{counters} driver counters");
    drop(big);
}

#[memlab::profile(device = "cuda:0")]
fn cuda_leaky_step(kept: &mut Vec<Tensor>) {
    let x = floats(1 << 18);
    let y = &x * 2.0;
    kept.push(y);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_html_report_of_a_cuda_recording() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let mut kept = Vec::new();
    for _ in 0..5 {
        cuda_leaky_step(&mut kept);
    }
    let report = memlab::export::Exporter::registered().html_report().unwrap();
    drop(recording);
    let cuda = report.devices.first().expect("a section per device");
    assert_eq!(cuda.device, Device::Cuda(0), "CUDA devices come first");
    assert_eq!(cuda.points.iter().map(|p| p.allocated).max(), Some(cuda.peak_bytes));
    let rows: u64 = cuda.live_at_peak.iter().map(|r| r.bytes).sum();
    assert_eq!(rows as i64, cuda.peak_bytes, "what was live at the peak adds up to it");
    // The five kept results (1 MiB each) were made on the profiled line.
    let kept_row = cuda.live_at_peak.iter().find(|r| r.label.contains("cuda_leaky_step")).expect("the leak's site");
    assert!(kept_row.bytes >= 5 << 20, "{kept_row:?}");
    let html = report.to_page();
    assert!(html.contains("cuda:0: memory over time") && html.contains("<svg class=\"flame\""));
    println!("cuda:0 peak {} B over {} points; top row {:?}", cuda.peak_bytes, cuda.points.len(), cuda.live_at_peak[0]);
    drop(kept);
}

/// Runs test `name` in a child process and checks that it printed `ran`:
/// libtorch keeps its workspaces for the life of the process, so only a
/// fresh process makes them while the recording runs.
fn in_fresh_process(name: &str, ran: &str) {
    let _s = serial();
    let (stdout, _) = common::check_child(name, &[]);
    assert!(stdout.contains(ran), "the child ran its checks:\n{stdout}");
    println!("{stdout}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_recordings_exports_name_the_blas_workspaces() {
    use tch::nn::{Module, OptimizerConfig};
    let name = "recording::a_recordings_exports_name_the_blas_workspaces";
    if !common::child(name) {
        return in_fresh_process(name, "named workspaces:");
    }
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let layer = tch::nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
    let mut opt = tch::nn::Sgd::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([256, 1024], (Kind::Float, GPU));
    opt.backward_step(&layer.forward(&x).square().mean(Kind::Float));
    let exporter = memlab::export::Exporter::new(&vs);
    let snapshot = exporter.snapshot().unwrap();
    let named: Vec<&str> = snapshot.device_traces[0]
        .iter()
        .filter(|e| e.action == "alloc" && e.category == Some(memlab::export::Category::Workspace))
        .filter_map(|e| e.tensor.as_deref())
        .collect();
    // The forward thread's cuBLAS workspace and the backward thread's, as the reporter lists them.
    let report = memlab::MemReporter::new(&vs).device(Device::Cuda(0)).report().unwrap();
    let listed: Vec<&str> = report
        .device(Device::Cuda(0))
        .unwrap()
        .rows
        .iter()
        .filter(|r| r.kind == memlab::reporter::RowKind::Workspace)
        .map(|r| r.name.as_str())
        .collect();
    println!("named workspaces: {named:?}; the reporter's: {listed:?}");
    assert!(named.iter().filter(|n| n.starts_with("cuBLAS workspace")).count() >= 2, "{named:?}");
    let (mut a, mut b) = (named.clone(), listed.clone());
    a.sort();
    b.sort();
    assert_eq!(a, b, "the snapshot names each workspace the reporter lists");
    // The page lists them by name at the peak.
    let page = exporter.html_report().unwrap();
    let rows: Vec<&str> = page.devices[0].live_at_peak.iter().map(|r| r.label.as_str()).collect();
    assert!(
        rows.iter().any(|r| r.starts_with("cuBLAS workspace (handle") && r.ends_with("(named at export)")),
        "{rows:?}"
    );
    drop(recording);
}

/// Labels of the HTML report's rows at the peak that name nothing.
const UNNAMED_AT_PEAK: [&str; 3] =
    ["outside the user's code", "allocated before the history began", "no stack recorded"];

/// A conv net's training step, recorded with backtraces from a fresh process
/// (so that libtorch's workspaces are made while it records): its HTML
/// report's peak is named to the last percent, by tensor, by the user's line,
/// or by what libtorch made it for (cuDNN's and cuBLAS's workspaces,
/// autograd's backward ops on the engine's thread).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_conv_nets_peak_is_named_to_the_last_percent() {
    use tch::nn::{ModuleT, OptimizerConfig};
    let name = "recording::a_conv_nets_peak_is_named_to_the_last_percent";
    if !common::child(name) {
        return in_fresh_process(name, "named at the peak:");
    }
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let root = vs.root();
    let pad = tch::nn::ConvConfig { padding: 1, ..Default::default() };
    let net = tch::nn::seq_t()
        .add(tch::nn::conv2d(&root / "c1", 3, 64, 3, pad))
        .add(tch::nn::batch_norm2d(&root / "bn1", 64, Default::default()))
        .add_fn(|x| x.relu().max_pool2d_default(2))
        .add(tch::nn::conv2d(&root / "c2", 64, 128, 3, pad))
        .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
        .add(tch::nn::linear(&root / "fc", 128 * 8 * 8, 10, Default::default()));
    let mut opt = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
    for _ in 0..2 {
        let x = Tensor::randn([128, 3, 32, 32], (Kind::Float, GPU));
        let y = Tensor::randint(10, [128], (Kind::Int64, GPU));
        let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    }
    let exporter = memlab::export::Exporter::of(memlab::Model::new().var_store("", &vs).optimizer(&opt));
    let page = exporter.html_report().unwrap();
    let cuda = page.devices.iter().find(|d| d.device == Device::Cuda(0)).expect("the GPU's timeline");
    let rows: Vec<(&str, u64)> = cuda.live_at_peak.iter().map(|r| (r.label.as_str(), r.bytes)).collect();
    let peak = cuda.peak_bytes as u64;
    let named: u64 =
        rows.iter().filter(|(label, _)| !UNNAMED_AT_PEAK.iter().any(|u| label.starts_with(u))).map(|r| r.1).sum();
    println!("named at the peak: {named} of {peak} bytes ({:.2}%)", 100.0 * named as f64 / peak as f64);
    for (label, bytes) in &rows {
        println!("  {bytes:>12}  {label}");
    }
    assert!(named * 100 >= peak * 99, "{named} of {peak} named: {rows:#?}");
    // libtorch's own allocations are named for what they are.
    let labels: Vec<&str> = rows.iter().map(|r| r.0).collect();
    let snapshot = exporter.snapshot().unwrap();
    let sites: std::collections::BTreeSet<String> = snapshot.device_traces[0]
        .iter()
        .filter(|e| e.action == "alloc")
        .filter_map(|e| memlab_core::export::frames::site(&e.frames).map(|s| s.0))
        .collect();
    assert!(sites.contains("libtorch's cuDNN workspace"), "{sites:#?}");
    assert!(sites.iter().any(|s| s.starts_with("autograd's backward pass (ConvolutionBackward0)")), "{sites:#?}");
    assert!(!sites.iter().any(|s| s.starts_with("outside the user's code")), "{sites:#?}\n{labels:?}");
    // The reporter and the out-of-memory report name a live allocation the
    // same way: the first step's gradients were made on autograd's thread.
    let grad = vs.variables()["c1.weight"].grad();
    let live = memlab::events::live();
    let made = live.iter().find(|a| a.address == grad.data_ptr() as u64).expect("the gradient's allocation");
    let site = memlab_core::export::site_of(made);
    assert!(site.as_deref().is_some_and(|s| s.starts_with("autograd's backward pass (")), "{site:?}");
    println!("c1.weight's gradient was made by {}", site.unwrap_or_default());
    drop(recording);
}
