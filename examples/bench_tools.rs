//! Benchmark of the training-loop tools on a small training step (a
//! 256-256-10 MLP, batch 64, Adam), on CUDA when there is one (else the CPU).
//! Target: `TrainingMonitor::record_stats()` and `StepLogger::log` each add at
//! most 1% to the step on the GPU.
//!
//! Two measurements, printed as Markdown tables:
//!
//! 1. The host time each tool spends per step, timed around its own calls
//!    (for the logger: the whole `log` call minus the step inside it). On a
//!    small GPU step the host thread is the bottleneck (it launches kernels
//!    while the GPU waits), so this is what the tool adds to the step, and it
//!    is nearly free of the machine's noise.
//! 2. Whole-loop times: rounds of plain, monitored and logged loops run back
//!    to back, in an order that rotates every round, and the median of the
//!    per-round ratios. It also catches what the first misses (the logger's
//!    sampler thread competing with the step), but carries the noise of the
//!    step itself.
//!
//! A third table gives the parts a logged step is made of.
//!
//!     cargo run --release --example bench_tools [-- ROUNDS]

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Steps per loop in a round.
const STEPS: u32 = 50;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn quartiles(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 4], v[v.len() * 3 / 4])
}

/// The median time of one call of `f`, over `n` calls, in µs.
fn per_call(n: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    median(&mut t)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(61);
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
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
    let csv_dir = std::env::temp_dir().join(format!("memlab-bench-tools-{}", std::process::id()));
    std::fs::create_dir_all(&csv_dir)?;
    let mut csv_monitor = memlab::TrainingMonitor::new(&vs).print_period(0).csv_dir(&csv_dir);
    let mut logger = memlab::StepLogger::new();
    logger.stop();
    let mut exact_logger = memlab::StepLogger::new().exact_ram(true);
    exact_logger.stop();

    for _ in 0..20 {
        step();
        monitor.record_stats();
        csv_monitor.record_stats();
        logger.log("warm-up", &mut step);
        exact_logger.log("warm-up", &mut step);
    }
    sync();

    const LOOPS: [&str; 5] = [
        "plain",
        "with TrainingMonitor",
        "with TrainingMonitor writing CSV",
        "with StepLogger",
        "with StepLogger, exact RAM",
    ];
    // Per loop: its time per step in each round (µs), and the host time of
    // the tool inside it.
    let mut times: [Vec<f64>; 5] = Default::default();
    let mut costs: [Vec<f64>; 5] = Default::default();
    for round in 0..rounds {
        for which in (0..LOOPS.len()).map(|k| (k + round) % LOOPS.len()) {
            let started = Instant::now();
            let mut tool = Duration::ZERO;
            match which {
                0 => (0..STEPS).for_each(|_| step()),
                1 | 2 => {
                    let monitor = if which == 1 { &mut monitor } else { &mut csv_monitor };
                    for _ in 0..STEPS {
                        step();
                        let t = Instant::now();
                        black_box(monitor.record_stats());
                        tool += t.elapsed();
                    }
                }
                _ => {
                    let logger = if which == 3 { &mut logger } else { &mut exact_logger };
                    for _ in 0..STEPS {
                        let mut inside = Duration::ZERO;
                        let t = Instant::now();
                        logger.log("step", || {
                            let s = Instant::now();
                            step();
                            inside = s.elapsed();
                        });
                        tool += t.elapsed() - inside;
                    }
                }
            }
            sync();
            times[which].push(started.elapsed().as_secs_f64() * 1e6 / STEPS as f64);
            costs[which].push(tool.as_secs_f64() * 1e6 / STEPS as f64);
        }
    }
    std::fs::remove_dir_all(&csv_dir)?;

    let p = median(&mut times[0].clone());
    println!("{rounds} rounds of {STEPS} steps per loop on {device:?}; plain step median {p:.1} µs\n");
    println!("| tool | host time per step | share of the plain step |");
    println!("|---|---:|---:|");
    let names = [
        "",
        "TrainingMonitor::record_stats",
        "TrainingMonitor::record_stats, writing CSV",
        "StepLogger::log",
        "StepLogger::log, exact_ram(true)",
    ];
    for k in 1..LOOPS.len() {
        let c = median(&mut costs[k]);
        println!("| {} | {c:.2} µs | {:.2}% |", names[k], 100.0 * c / p);
    }
    println!();
    println!("| loop | step (median of rounds) | ratio to plain (median) | ratio, quartiles |");
    println!("|---|---:|---:|---:|");
    println!("| plain | {p:.1} µs | 1.000 | |");
    for k in 1..LOOPS.len() {
        let mut r: Vec<f64> = times[k].iter().zip(&times[0]).map(|(w, p)| w / p).collect();
        let (q1, q3) = quartiles(&mut r);
        println!(
            "| {} | {:.1} µs | {:.3} | {q1:.3}–{q3:.3} |",
            LOOPS[k],
            median(&mut times[k].clone()),
            median(&mut r)
        );
    }

    // The parts of a logged step.
    println!();
    println!("| part of a logged step | median per call |");
    println!("|---|---:|");
    let mdev = memlab::gpu::auto_device();
    println!("| resident set (`rss()`) | {:.2} µs |", per_call(2000, || _ = black_box(memlab::logger::rss())));
    println!(
        "| allocator statistics (`raw_stats({mdev})`) | {:.2} µs |",
        per_call(2000, || _ = black_box(memlab_tch::raw_stats(mdev)))
    );
    if let Device::Cuda(i) = device {
        println!(
            "| driver free/total (`driver_memory({i})`) | {:.2} µs |",
            per_call(2000, || _ = black_box(memlab::gpu::driver_memory(i)))
        );
        println!(
            "| NVML process memory (`process_gpu_memory({i})`, sampler thread, every 100 ms) | {:.2} µs |",
            per_call(50, || _ = black_box(memlab::gpu::process_gpu_memory(i)))
        );
    }
    println!(
        "| `TrainingMonitor::record_stats` with no step between | {:.2} µs |",
        per_call(2000, || _ = black_box(monitor.record_stats()))
    );
    println!("| `StepLogger::log` of an empty closure | {:.2} µs |", per_call(2000, || logger.log("empty", || ())));
    Ok(())
}
