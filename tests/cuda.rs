//! The CUDA paths, on a GPU machine: `cargo test --release --test cuda --
//! --include-ignored`. Each test asserts that CUDA is there, so it cannot pass
//! without one. Runs one test at a time: the allocator is process-wide.

use std::sync::{Mutex, MutexGuard};

use memlab::{Device, FunctionReport, LineStats};
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;
const GPU: tch::Device = tch::Device::Cuda(0);

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    memlab::set_print_at_exit(false);
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memlab::cuda_is_available(), "these tests need a CUDA GPU");
    guard
}

fn floats(n: i64) -> Tensor {
    Tensor::zeros([n], (Kind::Float, GPU))
}

fn allocated() -> i64 {
    memlab::device_stats(Device::Cuda(0)).unwrap().allocated_bytes.all.current
}

fn line<'a>(f: &'a FunctionReport, code: &str) -> &'a LineStats {
    f.find(code).and_then(|l| l.stats.as_ref()).unwrap_or_else(|| panic!("{code:?} ran"))
}

fn stat(s: &LineStats, name: &str) -> i64 {
    match name.parse::<memlab::Column>().unwrap() {
        memlab::Column::Stat(i) => s.values[i],
        other => panic!("{other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_is_visible_without_linker_flags() {
    let _s = serial();
    assert!(tch::Cuda::is_available(), "tch sees CUDA: libtorch_cuda stayed linked");
    assert!(memlab::built_with_cuda());
    assert!(memlab::cuda_device_count() >= 1);
    assert_eq!(memlab::auto_device(), Device::Cuda(0));
    println!("cuda devices: {}", memlab::cuda_device_count());
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
    assert_eq!(memlab::storage_info(&w).unwrap().device, Some(Device::Cuda(0)));
    println!("{}", memlab::report().filter("cuda_known_allocations"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nested_calls_keep_the_callers_peak_on_cuda() {
    let _s = serial();
    memlab::reset();
    memlab::set_target_device(memlab::DeviceSelector::Auto);
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
    let before = memlab::device_stats(Device::Cuda(0)).unwrap();
    let t = floats(64 * 1024 * 1024); // 256 MiB: a large-pool block
    let during = memlab::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(during.allocated_bytes.all.current - before.allocated_bytes.all.current, 256 * MIB);
    assert_eq!(during.allocated_bytes.large_pool.current - before.allocated_bytes.large_pool.current, 256 * MIB);
    assert_eq!(during.allocation.all.current - before.allocation.all.current, 1);
    assert!(during.reserved_bytes.all.current >= during.allocated_bytes.all.current);
    drop(t);
    memlab::empty_cache().unwrap();
    let after = memlab::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert!(after.reserved_bytes.all.current < during.reserved_bytes.all.current);
    memlab::reset_peak_stats(Device::Cuda(0)).unwrap();
    let reset = memlab::device_stats(Device::Cuda(0)).unwrap();
    assert_eq!(reset.allocated_bytes.all.peak, reset.allocated_bytes.all.current);
    let (free, total) = memlab::cuda_mem_info(0).unwrap();
    assert!(total > 0 && free <= total);
    println!(
        "cuda:0 total {} free {} reserved {} allocated {}",
        memlab::format_bytes(total as i64),
        memlab::format_bytes(free as i64),
        memlab::format_bytes(after.reserved_bytes.all.current),
        memlab::format_bytes(after.allocated_bytes.all.current)
    );
}
