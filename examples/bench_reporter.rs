//! Benchmark of `MemReporter::report()` on a model with 2,000 tensors (1,000
//! linear layers' weights and biases), with and without gradients, with and
//! without an allocation recording. Prints a Markdown table.
//!
//!     cargo run --release --example bench_reporter

use std::time::{Duration, Instant};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn median_time(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let layers: Vec<nn::Linear> =
        (0..1000).map(|i| nn::linear(vs.root() / format!("layer{i}"), 16, 16, Default::default())).collect();
    let reporter = memlab::MemReporter::new(&vs);
    let tensors = vs.variables().len();

    println!("| case | tensors | rows | report() median |");
    println!("|---|---:|---:|---:|");
    let rows = reporter.report()?.devices.iter().map(|d| d.rows.len()).sum::<usize>();
    let t = median_time(51, || drop(reporter.report().expect("report")));
    println!("| parameters only, {device:?} | {tensors} | {rows} | {:.3} ms |", t.as_secs_f64() * 1e3);

    let x = Tensor::ones([4, 16], (Kind::Float, device));
    layers.iter().fold(x, |h, l| l.forward(&h)).sum(Kind::Float).backward();
    let rows = reporter.report()?.devices.iter().map(|d| d.rows.len()).sum::<usize>();
    let t = median_time(51, || drop(reporter.report().expect("report")));
    println!("| with gradients, {device:?} | {tensors} | {rows} | {:.3} ms |", t.as_secs_f64() * 1e3);

    let _recording = memlab::Recording::start(memlab::events::Settings::default())?;
    let t = median_time(51, || drop(reporter.report().expect("report")));
    println!("| with gradients, recording on, {device:?} | {tensors} | {rows} | {:.3} ms |", t.as_secs_f64() * 1e3);
    Ok(())
}
