//! Training-loop tools on CUDA: dispose scopes and concurrent step checks,
//! `StepLogger` with the driver's figures, `TrainingMonitor`, `track!()`.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn dispose_scope_on_cuda() {
    let _s = serial();
    let mut stash = Vec::new();
    let scope = memlab::DisposeScope::new("cuda step").unwrap();
    let temporary = floats(1024);
    stash.push(floats(2048));
    drop(temporary);
    let report = scope.finish();
    println!("{report}");
    assert_eq!(report.escaped_bytes(Device::Cuda(0)), 8192);
    assert_eq!(report.counts(Device::Cuda(0)).freed_bytes, 4096);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn step_logger_and_driver_figures_on_cuda() {
    let _s = serial();
    let driver = memlab::gpu::driver_memory(0).unwrap();
    assert!(driver.total > 70 << 30 && driver.free <= driver.total);
    println!(
        "driver: {} used of {}; NVML, this process: {:?}",
        driver.used(),
        driver.total,
        memlab::gpu::process_gpu_memory(0)
    );
    let mut logger = memlab::StepLogger::new();
    let kept = logger.log("cuda step", || {
        let spike = floats(64 << 20); // 256 MiB, freed
        drop(spike);
        floats(16 << 20) // 64 MiB, kept
    });
    let g = logger.data().unwrap().gpu.expect("GPU figures");
    assert_eq!(g.consumed, 64 * MIB);
    // Peaked is counted above the level after the step: 256 MiB at the top, 64 MiB kept.
    assert_eq!(g.peaked, 192 * MIB);
    assert!(g.driver_used.is_some() && g.total == driver.total);
    drop(kept);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_monitor_on_cuda() {
    use tch::nn::{self, Module, OptimizerConfig};
    let _s = serial();
    const PARAMS: i64 = (256 * 128 + 128) * 4;
    let dir = std::env::temp_dir().join(format!("memlab-monitor-cuda-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let vs = nn::VarStore::new(GPU);
    let model = nn::linear(vs.root() / "fc", 256, 128, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([64, 256], (Kind::Float, GPU));
    let mut monitor =
        memlab::TrainingMonitor::new(&vs).print_period(0).optimizer_kind(memlab::StepOptimizer::Adam).csv_dir(&dir);
    for i in 0..3 {
        let loss = model.forward(&x).relu().mean(Kind::Float);
        if i == 2 {
            monitor.mark_backward();
        }
        opt.backward_step(&loss);
        drop(loss);
        let r = monitor.record_stats().expect("a record").clone();
        println!("{r}");
        assert_eq!(r.device, Some(Device::Cuda(0)), "the monitor follows the GPU by default");
        assert_eq!((r.weights, r.gradients), (PARAMS, PARAMS), "{r}");
        let rows: Vec<(&str, i64)> = r.weight_rows.iter().map(|r| (r.name.as_str(), r.bytes)).collect();
        assert_eq!(rows, [("fc.bias", 512), ("fc.weight", 256 * 128 * 4)]);
        assert_eq!(r.current_allocated, allocated(), "the allocator, read again");
        assert!(r.peak_reserved >= r.current_reserved && r.current_reserved >= r.current_allocated, "{r}");
        // Adam's two moments, besides the input and cuBLAS's workspace.
        assert!(r.optimizer_state_measured >= 2 * PARAMS, "{r}");
        assert_eq!(r.optimizer_state_estimate, Some(2 * PARAMS));
        // Forward kept the 64x128 output of the layer and of relu for backward.
        assert!(r.feature_maps >= 64 * 128 * 4, "{r}");
    }
    let r = monitor.last().unwrap();
    assert!(r.intermediate_gradients.expect("the last iteration was marked") >= 64 * 128 * 4, "{r}");
    assert!(monitor.last_error().is_none(), "{:?}", monitor.last_error());
    monitor.flush();
    let text = std::fs::read_to_string(dir.join("memlab_iterations.csv")).unwrap();
    let records: Vec<csv::StringRecord> =
        csv::Reader::from_reader(text.as_bytes()).records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| &r[2] == "cuda:0" && r[7] == PARAMS.to_string()), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[memlab::profile(device = "cuda:0")]
fn cuda_grow(cache: &mut Vec<Tensor>) {
    let entry = floats(2048);
    cache.push(entry);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tracker_on_cuda() {
    use tch::nn::{self, Module};
    let _s = serial();
    memlab::clear_registry();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let vs = nn::VarStore::new(GPU);
    let fc = nn::linear(vs.root() / "fc", 32, 16, Default::default());
    memlab::register_var_store("model", &vs);
    let mut tracker = memlab::Tracker::new();

    let first = memlab::track!(tracker).to_text();
    println!("{first}");
    let header = first.lines().next().unwrap();
    assert!(header.contains(" on cuda:0, allocator "), "the tracker follows the GPU by default: {header}");
    assert!(header.ends_with(&memlab::render::Cell::bytes(allocated()).to_string()), "{header}");
    assert!(first.contains("  + 1 × [16, 32] Float parameter 2.00K"), "{first}");
    assert!(first.contains("  + 1 × [16] Float parameter 64.00B"), "{first}");

    let mut cache = Vec::new();
    cuda_grow(&mut cache);
    cuda_grow(&mut cache);
    let second = memlab::track!(tracker).to_text();
    println!("{second}");
    let growth: Vec<&str> = second.lines().filter(|l| l.starts_with("  +")).collect();
    assert_eq!(growth.len(), 1, "{second}");
    assert!(growth[0].starts_with("  + 2 × unnamed 16.00K, allocated at cuda::training::cuda_grow"), "{second}");
    assert!(growth[0].contains("let entry = floats(2048);"), "{second}");

    let x = Tensor::randn([8, 32], (Kind::Float, GPU));
    fc.forward(&x).sum(Kind::Float).backward();
    let third = memlab::track!(tracker).to_text();
    println!("{third}");
    assert!(third.contains("  + 1 × [16, 32] Float gradient 2.00K"), "{third}");
    assert!(third.contains("  + 1 × [16] Float gradient 64.00B"), "{third}");

    cache.clear();
    let fourth = memlab::track!(tracker).to_text();
    println!("{fourth}");
    assert!(fourth.contains("  - 2 × unnamed 16.00K"), "{fourth}");
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    memlab::clear_registry();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn concurrent_checks_catch_every_cuda_leak() {
    let _s = serial();
    // 128 floats: 512 bytes, exactly one block of the caching allocator.
    let checks = common::concurrent_checks_catch_every_leak(3, Device::Cuda(0), 512, || floats(128));
    println!("{checks} concurrent checks on cuda:0, every leak caught");
    assert!(checks > 100);
}
