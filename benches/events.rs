//! The cost of allocation events: one allocation and free of a 256-byte
//! tensor with recording off, on, and on with backtraces, on the CPU and on
//! CUDA when there is one (without CUDA the `cuda` benchmarks are skipped).
//!
//!     source scripts/env.sh && cargo bench --bench events
//!
//! divan times each allocation and free and prints its sample statistics.
//! First the benchmark prints how many events each mode records per
//! allocation and free (2 on the CPU, the allocation and the free; 3 on CUDA,
//! also the free's completion): what recording costs per event is the
//! difference of a mode's median to the median with recording off, divided
//! by that count. (`cargo bench --bench hotpaths` measures that difference
//! directly, in alternating rounds.)

use std::hint::black_box;

use divan::Bencher;
use tch::{Device, Kind, Tensor};

/// The recording modes, as the benchmarks' arguments name them.
const MODES: [&str; 3] = ["off", "on", "on, backtraces"];

/// The recording a mode runs under: `None` when recording is off.
fn recording(mode: &str) -> Option<memlab::Recording> {
    let settings = match mode {
        "off" => return None,
        "on" => memlab::events::Settings::default(),
        "on, backtraces" => memlab::events::Settings::default().backtraces(true).capacity(10_000),
        _ => unreachable!("no mode {mode}"),
    };
    Some(memlab::Recording::start(settings).expect("a recording starts"))
}

fn alloc_free(device: Device) {
    drop(black_box(Tensor::empty([64], (Kind::Float, device))));
}

fn bench(bencher: Bencher, device: Device, mode: &str) {
    let _recording = recording(mode);
    bencher.bench_local(|| alloc_free(device));
}

// 1,000 samples of 200 allocations and frees each: divan's own tuning would
// settle on one per sample, whose timing the clock's overhead blurs.
#[divan::bench(args = MODES, sample_count = 1000, sample_size = 200)]
fn cpu(bencher: Bencher, mode: &str) {
    bench(bencher, Device::Cpu, mode);
}

#[divan::bench(args = MODES, sample_count = 1000, sample_size = 200)]
fn cuda(bencher: Bencher, mode: &str) {
    bench(bencher, Device::Cuda(0), mode);
}

/// Events recorded per allocation and free, over 1,000 of them.
fn events_per_iteration(device: Device, mode: &str) -> f64 {
    const N: u32 = 1_000;
    let _recording = recording(mode);
    let before = memlab::events::history().1.recorded;
    for _ in 0..N {
        alloc_free(device);
    }
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    (memlab::events::history().1.recorded - before) as f64 / f64::from(N)
}

fn main() {
    let mut divan = divan::Divan::from_args();
    let mut devices = vec![Device::Cpu];
    if memlab::gpu::cuda_is_available() {
        devices.push(Device::Cuda(0));
    } else {
        println!("no CUDA device: the cuda benchmarks are skipped");
        divan = divan.skip_regex("::cuda::");
    }
    for device in devices {
        let counts: Vec<String> =
            MODES[1..].iter().map(|&mode| format!("{mode}: {:.2}", events_per_iteration(device, mode))).collect();
        println!("{device:?}: events per allocation and free, {}", counts.join("; "));
    }
    println!();
    divan.main();
}
