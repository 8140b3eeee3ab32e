//! Benchmark of the training-loop tools: a small training step alone, with
//! `TrainingMonitor::record_stats()` after it, and inside `StepLogger::log`,
//! on CUDA when there is one (else the CPU). Prints a Markdown table.
//! Target: each tool adds at most 1% to a small step on the GPU.
//!
//!     cargo run --release --example bench_tools

use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 200;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::set_output(memlab::Output::Sink(Box::new(|_| {})));
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 256, 256, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 256, 10, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let x = Tensor::randn([64, 256], (Kind::Float, device));
    let y = Tensor::randint(10, [64], (Kind::Int64, device));
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let mut step = || opt.backward_step(&net.forward(&x).cross_entropy_for_logits(&y));
    let mut monitor = memlab::TrainingMonitor::new(&vs).print_period(0);
    let mut logger = memlab::StepLogger::new();
    logger.stop();

    let (mut plain, mut monitored, mut logged) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2 {
        step();
    }
    for _ in 0..21 {
        let t = Instant::now();
        for _ in 0..STEPS {
            step();
        }
        sync();
        plain.push(t.elapsed() / STEPS as u32);
        let t = Instant::now();
        for _ in 0..STEPS {
            step();
            monitor.record_stats();
        }
        sync();
        monitored.push(t.elapsed() / STEPS as u32);
        let t = Instant::now();
        for _ in 0..STEPS {
            logger.log("step", &mut step);
        }
        sync();
        logged.push(t.elapsed() / STEPS as u32);
    }
    // Ratios are taken round by round (each round runs the three loops back
    // to back), then their median: drift of the machine hits both sides.
    let ratio = |with: &[Duration]| {
        let mut r: Vec<f64> = with.iter().zip(&plain).map(|(w, p)| w.as_secs_f64() / p.as_secs_f64()).collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let (rm, rl) = (ratio(&monitored), ratio(&logged));
    let (p, m, l) = (median(plain.clone()), median(monitored.clone()), median(logged.clone()));
    println!("| device | plain step | with TrainingMonitor | with StepLogger |");
    println!("|---|---:|---:|---:|");
    println!(
        "| {device:?} | {:.1} µs | {:.1} µs ({rm:.3}×) | {:.1} µs ({rl:.3}×) |",
        p.as_secs_f64() * 1e6,
        m.as_secs_f64() * 1e6,
        l.as_secs_f64() * 1e6,
    );
    Ok(())
}
