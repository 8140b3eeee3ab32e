//! `MemReporter::report()` on a var store of 1,000 linear layers (2,000
//! tensors), on CUDA when there is one (else the CPU): with parameters only,
//! with gradients, and with gradients while an allocation recording runs.
//!
//!     source scripts/env.sh && cargo bench --bench reporter
//!
//! divan times each report and prints its sample statistics; first the
//! benchmark prints the device and how many rows each case's report has.

use divan::Bencher;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CASES: [&str; 3] = ["parameters only", "with gradients", "with gradients, recording on"];

/// A var store of 1,000 16-by-16 linear layers, with gradients after one
/// backward pass when `gradients` is set.
fn model(gradients: bool) -> nn::VarStore {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let layers: Vec<nn::Linear> =
        (0..1000).map(|i| nn::linear(vs.root() / format!("layer{i}"), 16, 16, Default::default())).collect();
    if gradients {
        let x = Tensor::ones([4, 16], (Kind::Float, device));
        layers.iter().fold(x, |h, l| l.forward(&h)).sum(Kind::Float).backward();
    }
    vs
}

#[divan::bench(args = CASES)]
fn report(bencher: Bencher, case: &str) {
    let vs = model(case != "parameters only");
    let reporter = memlab::MemReporter::new(&vs);
    let _recording = (case == "with gradients, recording on")
        .then(|| memlab::Recording::start(memlab::events::Settings::default()).expect("a recording starts"));
    // The report is dropped inside the timing, as the figures in BENCHMARKS.md were taken.
    bencher.bench_local(|| drop(reporter.report().expect("a report")));
}

fn main() {
    memlab::profiler::set_print_at_exit(false);
    for gradients in [false, true] {
        let vs = model(gradients);
        let report = memlab::MemReporter::new(&vs).report().expect("a report");
        let rows: usize = report.devices.iter().map(|d| d.rows.len()).sum();
        let case = if gradients { "with gradients" } else { "parameters only" };
        println!("{case}, {:?}: {} tensors, {rows} rows", vs.device(), vs.variables().len());
    }
    println!();
    divan::main();
}
