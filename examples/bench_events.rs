//! Benchmark of allocation events: the cost per event of recording (off, on,
//! on with backtraces) for a loop that allocates and frees small tensors, on
//! the CPU and on CUDA when there is one. Prints a Markdown table.
//!
//!     cargo run --release --example bench_events

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

const ALLOCATIONS: usize = 20_000;

fn churn(device: Device) -> Duration {
    let start = Instant::now();
    for _ in 0..ALLOCATIONS {
        let _ = black_box(Tensor::empty([64], (Kind::Float, device)));
    }
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    start.elapsed()
}

fn median(device: Device, rounds: usize) -> Duration {
    let mut t: Vec<Duration> = (0..rounds).map(|_| churn(device)).collect();
    t.sort();
    t[t.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut devices = vec![Device::Cpu];
    if memlab::gpu::cuda_is_available() {
        devices.push(Device::Cuda(0));
    }
    println!("| device | recording | per allocation+free | events per iteration | per event (above off) |");
    println!("|---|---|---:|---:|---:|");
    for device in devices {
        churn(device);
        let off = median(device, 9);
        let per = |d: Duration| d.as_secs_f64() / ALLOCATIONS as f64 * 1e9;
        println!("| {device:?} | off | {:.0} ns | — | — |", per(off));
        for (label, settings) in [
            ("on", memlab::events::Settings::default()),
            ("on, backtraces", memlab::events::Settings::default().backtraces(true).capacity(10_000)),
        ] {
            let recording = memlab::Recording::start(settings)?;
            let (_, before) = memlab::events::history();
            churn(device);
            let (_, after) = memlab::events::history();
            // The CPU reports an allocation and a free; CUDA also the free's
            // completion (and, at first, segment events).
            let per_iteration = (after.recorded - before.recorded) as f64 / ALLOCATIONS as f64;
            let on = median(device, 5);
            drop(recording);
            println!(
                "| {device:?} | {label} | {:.0} ns | {per_iteration:.2} | {:.0} ns |",
                per(on),
                (per(on) - per(off)) / per_iteration
            );
        }
    }
    Ok(())
}
