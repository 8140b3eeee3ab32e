//! The line profiler on CUDA: exact line figures, nested peaks, the device's
//! statistics and resets, an out-of-memory failure counted on its line.

use super::*;

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
        memlab::render::Cell::bytes(total),
        memlab::render::Cell::bytes(free),
        memlab::render::Cell::bytes(after.reserved_bytes.all.current),
        memlab::render::Cell::bytes(after.allocated_bytes.all.current)
    );
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
fn a_cuda_oom_is_counted_on_its_line_and_training_goes_on() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    // Other tests call the same profiled function: its figures start here.
    memlab::reset();
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
