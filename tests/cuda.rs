//! The CUDA paths, on a GPU machine: `cargo test --release --test cuda --
//! --include-ignored`. Each test asserts that CUDA is there, so it cannot pass
//! without one. Runs one test at a time: the allocator is process-wide.

mod common;

use common::pytorch::{bytes_as_pytorch_prints, python, VALIDATE};

use std::sync::{Mutex, MutexGuard};

use memlab::{
    profiler::{FunctionReport, LineStats},
    Device,
};
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;
const GPU: tch::Device = tch::Device::Cuda(0);

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    memlab::profiler::set_print_at_exit(false);
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memlab::gpu::cuda_is_available(), "these tests need a CUDA GPU");
    guard
}

fn floats(n: i64) -> Tensor {
    Tensor::zeros([n], (Kind::Float, GPU))
}

fn allocated() -> i64 {
    memlab::stats::device_stats(Device::Cuda(0)).unwrap().allocated_bytes.all.current
}

fn line<'a>(f: &'a FunctionReport, code: &str) -> &'a LineStats {
    f.find(code).and_then(|l| l.stats.as_ref()).unwrap_or_else(|| panic!("{code:?} ran"))
}

fn stat(s: &LineStats, name: &str) -> i64 {
    match name.parse::<memlab::profiler::Column>().unwrap() {
        memlab::profiler::Column::Stat(i) => s.values[i],
        other => panic!("{other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_is_visible_without_linker_flags() {
    let _s = serial();
    assert!(tch::Cuda::is_available(), "tch sees CUDA: libtorch_cuda stayed linked");
    assert!(memlab::gpu::built_with_cuda());
    assert!(memlab::gpu::cuda_device_count() >= 1);
    assert_eq!(memlab::gpu::auto_device(), Device::Cuda(0));
    println!("cuda devices: {}", memlab::gpu::cuda_device_count());
}

#[memlab::profile(device = "cuda:0")]
fn cuda_known_allocations() -> Tensor {
    let weight = Tensor::zeros([1024, 1024], (Kind::Float, GPU));
    let transient = floats(2 * 1024 * 1024).numel();
    assert_eq!(transient, 2 * 1024 * 1024);
    weight
}

#[memlab::profile(device = "cuda:0")]
fn cuda_inner_spike() -> usize {
    let spike = floats(4 * 1024 * 1024);
    spike.numel()
}

#[memlab::profile]
fn cuda_outer() -> usize {
    let kept = floats(1024 * 1024);
    let n = cuda_inner_spike();
    n + kept.numel()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn exact_line_figures_on_cuda() {
    let _s = serial();
    memlab::reset();
    let base = allocated();
    let w = cuda_known_allocations();
    let f = memlab::report().function("cuda_known_allocations").unwrap().clone();
    assert_eq!(f.device, Some(Device::Cuda(0)));
    let l = line(&f, "let weight");
    // 4 MiB is a multiple of the caching allocator's 512-byte rounding: exact.
    assert_eq!(l.increment, 4 * MIB);
    assert_eq!(stat(l, "allocated_bytes.all.current"), base + 4 * MIB);
    assert_eq!(stat(l, "requested_bytes.all.allocated"), 4 * MIB);
    let t = line(&f, "let transient");
    assert_eq!(t.increment, 0);
    assert_eq!(stat(t, "allocated_bytes.all.peak"), base + 12 * MIB);
    assert!(stat(t, "reserved_bytes.all.peak") >= base + 12 * MIB);
    assert_eq!(memlab::stats::storage_info(&w).unwrap().device, Some(Device::Cuda(0)));
    println!("{}", memlab::report().filter("cuda_known_allocations"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nested_calls_keep_the_callers_peak_on_cuda() {
    let _s = serial();
    memlab::reset();
    memlab::profiler::set_target_device(memlab::profiler::DeviceSelector::Auto);
    let base = allocated();
    assert_eq!(cuda_outer(), 5 * 1024 * 1024);
    let outer = memlab::report().function("cuda_outer").unwrap().clone();
    assert_eq!(outer.device, Some(Device::Cuda(0)), "auto picks the GPU");
    let call = line(&outer, "let n = cuda_inner_spike()");
    assert_eq!(stat(call, "allocated_bytes.all.peak"), base + 20 * MIB);
    assert_eq!(call.increment, 0);
    println!("{}", memlab::report().filter("cuda_outer"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_statistics_and_cache_control() {
    let _s = serial();
    let before = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    let t = floats(64 * 1024 * 1024); // 256 MiB: a large-pool block
    let during = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(during.allocated_bytes.all.current - before.allocated_bytes.all.current, 256 * MIB);
    assert_eq!(during.allocated_bytes.large_pool.current - before.allocated_bytes.large_pool.current, 256 * MIB);
    assert_eq!(during.allocation.all.current - before.allocation.all.current, 1);
    assert!(during.reserved_bytes.all.current >= during.allocated_bytes.all.current);
    drop(t);
    memlab::gpu::empty_cache().unwrap();
    let after = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert!(after.reserved_bytes.all.current < during.reserved_bytes.all.current);
    memlab::stats::reset_peak_stats(Device::Cuda(0)).unwrap();
    let reset = memlab::stats::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(reset.allocated_bytes.all.peak, reset.allocated_bytes.all.current);
    let (free, total) = memlab::gpu::cuda_mem_info(0).unwrap();
    assert!(total > 0 && free <= total);
    println!(
        "cuda:0 total {} free {} reserved {} allocated {}",
        memlab::stats::format_bytes(total as i64),
        memlab::stats::format_bytes(free as i64),
        memlab::stats::format_bytes(after.reserved_bytes.all.current),
        memlab::stats::format_bytes(after.allocated_bytes.all.current)
    );
}

fn cuda_model(vs: &tch::nn::VarStore, width: i64) -> tch::nn::Sequential {
    use tch::nn;
    nn::seq()
        .add(nn::linear(vs.root() / "a", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "c", width, 10, Default::default()))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_gives_reserved_memory_back() {
    let _s = serial();
    memlab::gpu::empty_cache().unwrap();
    // What earlier tests left (cuBLAS workspaces stay once a matmul ran).
    let base = allocated();
    let reserved_base = memlab::stats::device_stats(Device::Cuda(0)).unwrap().reserved_bytes.all.current;
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    let weights: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::only().var_store(&vs);
    let report = courtesy.yield_memory().unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!(c.moved_bytes, (2 * 2048 * 2048 + 2 * 2048 + 2048 * 10 + 10) * 4);
    assert_eq!(c.parameters, c.moved_bytes);
    assert_eq!(c.still_allocated, base, "only what was there before the model stays");
    assert!(c.reserved_after <= reserved_base + 2 * MIB, "reserved after yield: {}", c.reserved_after);
    assert!(vs.trainable_variables().iter().all(|t| t.device() == tch::Device::Cpu));
    assert_eq!(courtesy.restore().unwrap(), 6);
    for (t, w) in vs.trainable_variables().iter().zip(&weights) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(w));
    }
}

fn train(steps: usize, yield_at: Option<usize>) -> Vec<f64> {
    use tch::nn::{Module, OptimizerConfig};
    tch::manual_seed(7);
    let vs = tch::nn::VarStore::new(GPU);
    let model = cuda_model(&vs, 512);
    let mut opt = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([256, 512], (Kind::Float, GPU));
    let y = Tensor::randint(10, [256], (Kind::Int64, GPU));
    let mut courtesy = memlab::Courtesy::only().var_store(&vs);
    let mut losses = Vec::new();
    for step in 0..steps {
        if Some(step) == yield_at {
            let report = courtesy.yield_memory().unwrap();
            println!("{report}");
            assert!(report.moved > 0);
            courtesy.restore().unwrap();
        }
        let loss = model.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
        losses.push(loss.double_value(&[]));
    }
    losses
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_mid_training_gives_bit_identical_losses() {
    let _s = serial();
    let plain = train(12, None);
    let yielded = train(12, Some(6));
    println!("losses without yield: {plain:?}\nlosses with yield at step 6: {yielded:?}");
    assert_eq!(
        plain.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        yielded.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_restore_survives_a_full_gpu() {
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    let weights: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::only().var_store(&vs);
    courtesy.yield_memory().unwrap();
    // Someone else takes (nearly) the whole GPU.
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let hog = Tensor::empty([free as i64 - 8 * MIB], (Kind::Uint8, GPU));
    let err = courtesy.restore().unwrap_err();
    println!("restore on a full GPU: {err}");
    assert!(err.to_string().contains("valid on the CPU; call restore() again"));
    assert!(courtesy.is_yielded());
    for t in vs.trainable_variables() {
        let _ = t.sum(Kind::Float).double_value(&[]); // every tensor is usable wherever it is
    }
    drop(hog);
    assert!(courtesy.restore().unwrap() > 0);
    for (t, w) in vs.trainable_variables().iter().zip(&weights) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(w));
    }
}

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
fn reporter_rows_add_up_on_cuda() {
    let _s = serial();
    let _recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let _layer = tch::nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
    let odd = floats(1000); // 4000 bytes, a 4096-byte block
    let report = memlab::MemReporter::new(&vs).tensor("odd", &odd).device(Device::Cuda(0)).report().unwrap();
    println!("{report}");
    let cuda = report.device(Device::Cuda(0)).unwrap();
    assert_eq!(cuda.rows.iter().find(|r| r.name == "fc.weight").unwrap().bytes, 4 << 20);
    assert_eq!(cuda.rows.iter().find(|r| r.name == "odd").unwrap().bytes, 4000);
    let total: i64 = cuda.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cuda.allocated_bytes);
    let rounding = cuda.rows.iter().find(|r| r.kind == memlab::reporter::RowKind::Rounding).expect("a rounding row");
    assert!(rounding.bytes >= 96, "{report}");
}

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
fn model_size_and_batch_search_on_cuda() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let net = cuda_model(&vs, 1024);
    let sample = Tensor::randn([64, 1024], (Kind::Float, GPU));
    let size = memlab::measure_model(&vs, |x| net.forward(x), &sample, &[memlab::StepOptimizer::Adam]).unwrap();
    println!("{size}");
    let params = (2 * (1024 * 1024 + 1024) + 1024 * 10 + 10) * 4;
    assert_eq!(size.parameter_bytes, params as u64);
    // Read from the optimizer: the state tensors' own bytes, two moments.
    assert_eq!(size.optimizer_state, vec![(memlab::StepOptimizer::Adam, 2 * params)]);
    // The search meets real CUDA out-of-memory errors and the process stays healthy.
    let mut opt = tch::nn::Adam::default().build(&vs, 1e-4).unwrap();
    let search = memlab::find_batch_size(Device::Cuda(0), memlab::Budget::FreeDeviceMemory, 1 << 24, |batch| {
        let x = Tensor::randn([batch as i64, 1024], (Kind::Float, GPU));
        opt.backward_step(&net.forward(&x).mean(Kind::Float));
        Ok(())
    })
    .unwrap();
    print!("{search}");
    assert!(search.largest.is_some_and(|n| n > 1000));
    // Its out-of-memory failures (some on the autograd engine's own thread)
    // are the search's: it says why the first failed.
    let (batch, why) = search.first_oom.as_ref().expect("the first failing batch's verdict");
    assert!(*batch > 1000 && why.device == Device::Cuda(0), "{batch} {why:?}");
    let after = floats(1024);
    assert_eq!(after.sum(Kind::Float).double_value(&[]), 0.0, "CUDA still works");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn where_the_gpu_memory_went() {
    let _s = serial();
    let _recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    memlab::register_var_store("model", &vs);
    let stray = floats(1 << 20);
    let account = memlab::where_gpu_memory_went(0).unwrap();
    println!("{account}");
    let sum: i64 = account.parts.iter().map(|p| p.bytes).sum();
    assert_eq!(sum, account.total as i64, "the parts add up to the device's total");
    assert!(account.named >= (2 * 2048 * 2048 * 4) as i64);
    assert!(account.parts.iter().any(|p| p.label.starts_with("allocated, not named") && p.bytes >= 4 << 20));
    memlab::clear_registry();
    drop(stray);
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
        memlab::TrainingMonitor::new(&vs).print_period(0).optimizer(memlab::monitor::OptimizerKind::Adam).csv_dir(&dir);
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
        assert_eq!(r.weight_rows, vec![("fc.bias".to_string(), 512), ("fc.weight".to_string(), 256 * 128 * 4)]);
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
    assert!(header.ends_with(&memlab::stats::format_bytes(allocated())), "{header}");
    assert!(first.contains("  + 1 × [16, 32] Float parameter 2.00K"), "{first}");
    assert!(first.contains("  + 1 × [16] Float parameter 64.00B"), "{first}");

    let mut cache = Vec::new();
    cuda_grow(&mut cache);
    cuda_grow(&mut cache);
    let second = memlab::track!(tracker).to_text();
    println!("{second}");
    let growth: Vec<&str> = second.lines().filter(|l| l.starts_with("  +")).collect();
    assert_eq!(growth.len(), 1, "{second}");
    assert!(growth[0].starts_with("  + 2 × other 16.00K, allocated at cuda::cuda_grow"), "{second}");
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
    assert!(fourth.contains("  - 2 × other 16.00K"), "{fourth}");
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    memlab::clear_registry();
}

fn spike_then_reset_peaks_on_cuda() {
    drop(floats(MIB));
    memlab::stats::reset_peak_stats(Device::Cuda(0)).unwrap();
}

fn allocate_then_reset_totals_on_cuda() -> Tensor {
    let kept = floats(MIB);
    memlab::stats::reset_accumulated_stats(Device::Cuda(0)).unwrap();
    kept
}

#[memlab::profile(device = "cuda:0")]
fn cuda_resets_inside_a_line() -> Tensor {
    spike_then_reset_peaks_on_cuda();
    allocate_then_reset_totals_on_cuda()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn user_resets_keep_the_running_lines_figures_on_cuda() {
    let _s = serial();
    memlab::reset();
    let base = allocated();
    let kept = cuda_resets_inside_a_line();
    let f = memlab::report().function("cuda_resets_inside_a_line").unwrap().clone();
    println!("{}", memlab::report().filter("cuda_resets_inside_a_line"));
    let spike = line(&f, "spike_then_reset_peaks_on_cuda()");
    assert_eq!(stat(spike, "allocated_bytes.all.peak"), base + 4 * MIB, "the reset kept the line's peak");
    let totals = line(&f, "allocate_then_reset_totals_on_cuda()");
    assert_eq!(stat(totals, "allocated_bytes.all.allocated"), 4 * MIB, "the reset kept the line's totals");
    assert_eq!(stat(totals, "allocation.all.allocated"), 1);
    drop(kept);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gpu_this_process_lacks_is_named_with_the_count() {
    let _s = serial();
    let count = memlab::gpu::cuda_device_count();
    for missing in [count, count + 5] {
        for err in [
            memlab::gpu::driver_memory(missing).unwrap_err(),
            memlab::where_gpu_memory_went(missing).unwrap_err(),
            memlab::gpu::process_gpu_memory(missing).unwrap_err(),
        ] {
            println!("{err}");
            assert_eq!(err, memlab::Error::DeviceUnavailable { device: Device::Cuda(missing), count });
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_flattened_lstm_storage_has_a_row_of_its_own() {
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let lstm = tch::nn::lstm(vs.root() / "lstm", 1024, 1024, Default::default());
    let input = Tensor::zeros([2, 4, 1024], (Kind::Float, GPU));
    let _ = tch::nn::RNN::seq(&lstm, &input);
    let report = memlab::MemReporter::new(&vs).device(Device::Cuda(0)).report().unwrap();
    println!("{report}");
    let cuda = report.device(Device::Cuda(0)).unwrap();
    let storage = cuda.rows.iter().find(|r| r.kind == memlab::reporter::RowKind::Storage).expect("a storage row");
    let views: Vec<_> = cuda.rows.iter().filter(|r| r.name.contains("(->storage #1)")).collect();
    assert_eq!(views.len(), 4, "weights and biases of one layer:\n{report}");
    for view in &views {
        let elements: i64 = view.shape.iter().product();
        assert_eq!(view.bytes, elements * 4, "a view's bytes are its own size: {view:?}");
        assert!(!view.counted);
    }
    let packed: i64 = views.iter().map(|v| v.bytes).sum();
    assert!(storage.bytes >= packed, "the storage holds its views:\n{report}");
    let total: i64 = cuda.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cuda.allocated_bytes, "rows add up:\n{report}");
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

/// A model of 16 bias-free 4096×4096 layers: 1 GiB of parameters.
fn gib_model(vs: &tch::nn::VarStore) -> Vec<tch::nn::Linear> {
    let config = tch::nn::LinearConfig { bias: false, ..Default::default() };
    (0..16).map(|i| tch::nn::linear(vs.root() / format!("l{i}"), 4096, 4096, config)).collect()
}

fn gib_step(layers: &[tch::nn::Linear], opt: &mut tch::nn::Optimizer, x: &Tensor) -> f64 {
    use tch::nn::Module;
    let out = layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).tanh());
    let loss = out.square().mean(Kind::Float);
    opt.backward_step(&loss);
    loss.double_value(&[])
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_moves_adam_state_and_training_goes_on_bit_identically() {
    use tch::nn::OptimizerConfig;
    const GIB: u64 = 1 << 30;
    let _s = serial();
    memlab::gpu::empty_cache().unwrap();
    let build = || {
        tch::manual_seed(11);
        let vs = tch::nn::VarStore::new(GPU);
        let layers = gib_model(&vs);
        let opt = tch::nn::Adam::default().build(&vs, 1e-4).unwrap();
        (vs, layers, opt)
    };
    let (vs_a, layers_a, mut opt_a) = build();
    let (vs_b, layers_b, mut opt_b) = build();
    tch::manual_seed(12);
    let x = Tensor::randn([64, 4096], (Kind::Float, GPU));
    gib_step(&layers_a, &mut opt_a, &x);
    gib_step(&layers_b, &mut opt_b, &x);

    // The state is named and exact on the GPU too.
    let report = memlab::MemReporter::new(&vs_a).optimizer(&opt_a).device(Device::Cuda(0)).report().unwrap();
    let rows = &report.device(Device::Cuda(0)).unwrap().rows;
    let state: Vec<_> = rows.iter().filter(|r| r.kind == memlab::reporter::RowKind::OptimizerState).collect();
    assert_eq!(state.len(), 32);
    assert!(state.iter().all(|r| r.bytes == 4096 * 4096 * 4), "{report}");
    assert!(rows.iter().any(|r| r.name == "l0.weight.exp_avg_sq"), "{report}");

    let mut courtesy = memlab::Courtesy::only().var_store(&vs_a);
    let report = courtesy.yield_memory_with(&mut opt_a).unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!((c.parameters, c.gradients, c.optimizer_state), (GIB, GIB, 2 * GIB), "{report}");
    assert!(c.returned() >= 4 * GIB as i64, "{report}");
    assert!(vs_a.trainable_variables().iter().all(|t| t.device() == tch::Device::Cpu));
    assert_eq!(courtesy.restore().unwrap(), 64);

    let (mut losses_a, mut losses_b) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        losses_a.push(gib_step(&layers_a, &mut opt_a, &x).to_bits());
        losses_b.push(gib_step(&layers_b, &mut opt_b, &x).to_bits());
    }
    assert_eq!(losses_a, losses_b, "20 steps after the yield match a run without it");
    for (a, b) in vs_a.trainable_variables().iter().zip(vs_b.trainable_variables()) {
        assert!(a.equal(&b), "weights bit-identical after 20 steps");
    }
    let after = memlab::MemReporter::new(&vs_a).optimizer(&opt_a).device(Device::Cuda(0)).report().unwrap();
    let state_a: i64 = after.devices[0]
        .rows
        .iter()
        .filter(|r| r.kind == memlab::reporter::RowKind::OptimizerState)
        .map(|r| r.bytes)
        .sum();
    assert_eq!(state_a, 2 * GIB as i64, "the state came back to the GPU");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_registered_optimizer_is_named_on_cuda() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    memlab::clear_registry();
    let vs = tch::nn::VarStore::new(GPU);
    let net = cuda_model(&vs, 1024);
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(tch::nn::Adam::default().build(&vs, 1e-4).unwrap()).unwrap();
    let x = Tensor::randn([64, 1024], (Kind::Float, GPU));
    opt.backward_step(&net.forward(&x).mean(Kind::Float));
    let params = (2 * (1024 * 1024 + 1024) + 1024 * 10 + 10) * 4;
    assert_eq!(opt.registered_states(), 12);
    // where_gpu_memory_went counts the state as named: weights, gradients, moments.
    let account = memlab::where_gpu_memory_went(0).unwrap();
    println!("{account}");
    assert_eq!(account.named, 4 * params, "{account}");
    // Courtesy::new moves the registered state with the model.
    let mut courtesy = memlab::Courtesy::new();
    let report = courtesy.yield_memory().unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!((c.parameters, c.gradients, c.optimizer_state), (params as u64, params as u64, 2 * params as u64));
    courtesy.restore().unwrap();
    opt.backward_step(&net.forward(&x).mean(Kind::Float));
    memlab::clear_registry();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cuda_snapshot_opens_in_pytorchs_reader() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let kept: Vec<Tensor> = (0..4).map(|i| floats(1 << (10 + 2 * i))).collect();
    drop(floats(1 << 20));
    let snapshot = memlab::export::Exporter::registered().snapshot().unwrap();
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
    assert!(files.iter().any(|f| f == "cuda.rs"), "the user's .rs file in the frames: {files:?}");
    // `stats` adds up every segment the file holds (the CPU's live
    // allocations too): the same total, in PyTorch's units.
    let all_segments: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
    let total = stats_view.lines().find(|l| l.starts_with("total_reserved:")).unwrap_or_default();
    assert!(total.contains(&bytes_as_pytorch_prints(all_segments)), "{total} vs {all_segments}\n{stats_view}");
    std::fs::remove_file(&path).ok();
    drop((kept, recording));
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
    if common::child("expandable_segments_are_mapped_and_unmapped_in_the_events_and_the_snapshot") {
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
    let name = "expandable_segments_are_mapped_and_unmapped_in_the_events_and_the_snapshot";
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
    assert_eq!(last.driver_used, vec![(0, now)], "the last reading is the driver's figure now");
    let first = trace.readings.iter().find(|r| !r.driver_used.is_empty()).unwrap();
    println!("driver used: first reading {} B, last {} B, now {now} B", first.driver_used[0].1, last.driver_used[0].1);
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
fn asks_the_gpu_too_much() -> Result<Tensor, tch::TchError> {
    let t = Tensor::f_empty([1i64 << 40], (Kind::Float, GPU))?; // 4 TiB
    Ok(t)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cuda_oom_is_counted_on_its_line_and_training_goes_on() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    let before = memlab::stats::device_stats(Device::Cuda(0)).unwrap().num_ooms;
    let err = asks_the_gpu_too_much().expect_err("4 TiB cannot be allocated");
    assert!(err.to_string().contains("out of memory"), "{err}");
    assert_eq!(memlab::stats::device_stats(Device::Cuda(0)).unwrap().num_ooms - before, 1);
    let report = memlab::report();
    let f = report.function("asks_the_gpu_too_much").unwrap();
    let ooms: Vec<(String, u64)> = f
        .lines
        .iter()
        .filter_map(|l| l.stats.as_ref().filter(|s| s.ooms > 0).map(|s| (l.code.trim().to_string(), s.ooms)))
        .collect();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert!(ooms[0].0.contains("f_empty") && ooms[0].1 == 1, "{ooms:?}");
    let text = report.to_text();
    let table = text.split("## ").find(|t| t.contains("asks_the_gpu_too_much")).unwrap();
    println!("{table}");
    assert!(table.contains("ooms"));
    // The device still serves.
    assert_eq!(floats(1024).size(), [1024]);
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
    let html = report.to_html();
    assert!(html.contains("cuda:0: memory over time") && html.contains("<svg class=\"flame\""));
    println!("cuda:0 peak {} B over {} points; top row {:?}", cuda.peak_bytes, cuda.points.len(), cuda.live_at_peak[0]);
    drop(kept);
}

// The out-of-memory recorder on CUDA: an oversize request and a model too
// large for the device get different verdicts; a failure while tch moves a
// var store to the GPU (holding the store's lock) gives a report, not a deadlock.

fn oom_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("memlab-cuda-oom-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_oom_reports_tell_an_oversize_request_from_a_model_too_large() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    memlab::clear_registry();
    let dir = oom_dir("verdicts");
    memlab::OomRecorder::new(&dir).max_reports(100).init_cuda(true).arm().unwrap();
    let (_, total) = memlab::gpu::cuda_mem_info(0).unwrap();

    // 1. An oversize request: a shape bug.
    let err = asks_the_gpu_too_much().expect_err("4 TiB cannot be allocated");
    assert!(err.to_string().contains("out of memory"), "{err}");
    let oversize = memlab::last_oom().expect("a report of the oversize request");
    let d = &oversize.diagnosis;
    assert_eq!((d.device, d.verdict, d.rounded), (Device::Cuda(0), memlab::oom::Verdict::RequestExceedsDevice, true));
    assert!(d.requested >= 4 << 40, "the allocator's rounding of 4 TiB: {}", d.requested);
    let driver = d.figures.device.expect("the allocator's free and total bytes");
    assert_eq!(driver.total, total);
    assert!(oversize.statement.as_deref().is_some_and(|s| s.contains("f_empty")), "{:?}", oversize.statement);
    println!("{}", oversize.to_text());

    // 2. A model too large for the device: 4 GiB layers until one fails.
    let vs = tch::nn::VarStore::new(GPU);
    memlab::register_var_store("huge", &vs);
    let mut layers = Vec::new();
    let failed = loop {
        match vs.root().f_zeros(&format!("layer{}", layers.len()), &[1 << 30]) {
            Ok(t) => layers.push(t),
            Err(e) => break e,
        }
        assert!(layers.len() < 1024, "the device never filled");
    };
    assert!(failed.to_string().contains("out of memory"), "{failed}");
    let full = memlab::last_oom().expect("a report of the model that did not fit");
    assert_eq!(full.number, oversize.number + 1, "a second failure, a second report");
    let d = &full.diagnosis;
    assert_eq!(d.verdict, memlab::oom::Verdict::NotEnoughFree, "{}", full.to_text());
    assert_eq!(d.requested, 4 << 30, "a 4 GiB layer: its own segment");
    assert_eq!(full.holders.named_bytes, layers.len() as u64 * (4 << 30), "every layer made so far, by name");
    assert!(full.holders.named.iter().all(|n| n.name.starts_with("huge.layer")), "{:?}", full.holders.named);
    assert!(d.advice.contains("The largest holders: huge.layer"), "{}", d.advice);
    assert!(full.files[0].exists());
    println!("{}", full.to_text());
    drop((layers, vs));
    memlab::gpu::empty_cache().unwrap();

    // The device still serves, and training-sized work goes on.
    let x = floats(1 << 20);
    assert_eq!((&x + 1.0).sum(Kind::Float).double_value(&[]), (1 << 20) as f64);
    memlab::OomRecorder::disarm();
    memlab::clear_registry();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memlab_oom_dir_alone_reports_a_cuda_failure() {
    if common::child("memlab_oom_dir_alone_reports_a_cuda_failure") {
        // No memlab call: the variable armed the recorder as the program
        // loaded, and its watcher attaches the observer after the first CUDA
        // allocation.
        let first = floats(1);
        let waited = std::time::Instant::now();
        while !memlab_tch::oom::watching_cuda() {
            assert!(waited.elapsed() < std::time::Duration::from_secs(5), "the observer was never attached");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(asks_the_gpu_too_much().is_err());
        let report = memlab::last_oom().expect("a report of the CUDA failure");
        assert_eq!(report.diagnosis.device, Device::Cuda(0));
        assert_eq!(report.diagnosis.verdict, memlab::oom::Verdict::RequestExceedsDevice);
        let dir = std::path::PathBuf::from(std::env::var("MEMLAB_OOM_DIR").unwrap());
        assert!(report.files.iter().all(|f| f.starts_with(&dir)), "{:?}", report.files);
        drop(first);
        return;
    }
    let dir = oom_dir("environment");
    let (_, stderr) = common::check_child(
        "memlab_oom_dir_alone_reports_a_cuda_failure",
        &[("MEMLAB_OOM_DIR", dir.to_str().unwrap())],
    );
    assert!(stderr.contains("memlab: out of memory on cuda:0"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_oom_while_a_var_store_moves_to_the_gpu_is_reported_not_deadlocked() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    memlab::clear_registry();
    let dir = oom_dir("set-device");
    memlab::OomRecorder::new(&dir).max_reports(100).init_cuda(true).arm().unwrap();
    memlab::gpu::empty_cache().unwrap();
    // Leave about 1 GiB free on the device, then move a 2 GiB model there.
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let blocker = Tensor::zeros([(free as i64 - (1 << 30)) / 4], (Kind::Float, GPU));
    let report = common::within(std::time::Duration::from_secs(120), || {
        let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
        for i in 0..4 {
            let _ = vs.root().zeros(&format!("w{i}"), &[1 << 27]); // 512 MiB each
        }
        memlab::register_var_store("moving", &vs);
        // tch holds the store's lock while it copies each variable over.
        let moved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vs.set_device(GPU)));
        assert!(moved.is_err(), "2 GiB cannot fit in 1 GiB");
        memlab::last_oom().expect("a report")
    });
    assert!(
        report.holders.busy.iter().any(|b| b.starts_with("moving (its lock was held")),
        "{:?}",
        report.holders.busy
    );
    println!("{}", report.to_text());
    drop(blocker);
    memlab::OomRecorder::disarm();
    memlab::clear_registry();
    memlab::gpu::empty_cache().unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_restore_with_optimizer_state_survives_a_full_gpu() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    tch::manual_seed(5);
    let vs = tch::nn::VarStore::new(GPU);
    let model = cuda_model(&vs, 2048);
    let mut adam = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([32, 2048], (Kind::Float, GPU));
    adam.backward_step(&model.forward(&x).square().mean(Kind::Float));
    // What the next step gives without any yield, from copies of everything.
    let state_before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::only().var_store(&vs);
    let report = courtesy.yield_memory_with(&mut adam).unwrap();
    assert!(report.to_text().contains("optimizer state"), "{report}");
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let hog = Tensor::empty([free as i64 - 8 * MIB], (Kind::Uint8, GPU));
    let err = courtesy.restore().unwrap_err();
    println!("restore with Adam's state on a full GPU: {err}");
    assert!(err.to_string().contains("valid on the CPU; call restore() again"), "{err}");
    drop(hog);
    let restored = courtesy.restore().unwrap();
    assert!(restored > 0);
    for (t, before) in vs.trainable_variables().iter().zip(&state_before) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(before), "weights came back bit for bit");
    }
    // Adam's moments came back too: its next step runs on the GPU and moves the weights.
    let loss = model.forward(&x).square().mean(Kind::Float);
    adam.backward_step(&loss);
    assert!(loss.double_value(&[]).is_finite());
    let moved =
        vs.trainable_variables().iter().zip(&state_before).any(|(t, b)| !t.to_device(tch::Device::Cpu).equal(b));
    assert!(moved, "the optimizer stepped");
    // The hog's memory stays in libtorch's cache: give it back to the device.
    drop((model, adam, vs, x));
    memlab::gpu::empty_cache().unwrap();
}
