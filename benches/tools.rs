//! The training-loop tools on a small training step (a 256-256-10 MLP, batch
//! 64, Adam), on CUDA when there is one (else the CPU). Target:
//! `TrainingMonitor::record_stats()` and `StepLogger::log` each add at most 1%
//! to the step on the GPU.
//!
//!     source scripts/env.sh && cargo bench --bench tools [-- ROUNDS]
//!
//! Two measurements in rounds, printed as Markdown tables:
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
//! Both compare loops timed in the same rounds, which a harness timing one
//! closure at a time cannot do, so this benchmark has its own `main`. Then
//! divan times the parts a logged step is made of, one call at a time (the
//! `logged_step` benchmarks; the CUDA driver's and NVML's only with CUDA).
//! The command line gives `ROUNDS`, so divan takes no options from it.
//!
//! Without `--bench` (`cargo test --benches` runs it so) it runs one round
//! and each part once, to show that they work.

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

/// The training step the tools watch.
struct Training {
    vs: nn::VarStore,
    net: nn::Sequential,
    opt: nn::Optimizer,
    x: Tensor,
    y: Tensor,
}

impl Training {
    fn new(device: Device) -> Training {
        let vs = nn::VarStore::new(device);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "fc1", 256, 256, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(vs.root() / "fc2", 256, 10, Default::default()));
        let opt = nn::Adam::default().build(&vs, 1e-3).expect("an optimizer");
        let x = Tensor::randn([64, 256], (Kind::Float, device));
        let y = Tensor::randint(10, [64], (Kind::Int64, device));
        Training { vs, net, opt, x, y }
    }

    fn step(&mut self) {
        self.opt.backward_step(&self.net.forward(&self.x).cross_entropy_for_logits(&self.y));
    }
}

/// The parts of a logged step. Most take about a microsecond, timed in 1,000
/// samples of 10 calls; NVML's takes tens, timed in 200 samples of one.
mod logged_step {
    use std::hint::black_box;

    use divan::Bencher;

    /// The resident set (`rss()`, a read of `/proc/self/statm`).
    #[divan::bench(sample_count = 1000, sample_size = 10)]
    fn rss() -> u64 {
        memlab::logger::rss()
    }

    /// All of the allocator's statistics (`raw_stats`) of the device the
    /// logger measures.
    #[divan::bench(sample_count = 1000, sample_size = 10)]
    fn raw_stats(bencher: Bencher) {
        let device = memlab::gpu::auto_device();
        bencher.bench_local(|| black_box(memlab_tch::raw_stats(device)));
    }

    /// The driver's free and total memory (`driver_memory(0)`, cuMemGetInfo),
    /// which only the logger's sampler thread reads.
    #[divan::bench(sample_count = 1000, sample_size = 10)]
    fn cuda_driver_memory() {
        _ = black_box(memlab::gpu::driver_memory(0));
    }

    /// This process's GPU memory from NVML (`process_gpu_memory(0)`), which
    /// the sampler thread reads every 100 ms.
    #[divan::bench(sample_count = 200, sample_size = 1)]
    fn cuda_process_gpu_memory() {
        _ = black_box(memlab::gpu::process_gpu_memory(0));
    }

    /// `TrainingMonitor::record_stats` with no step between two calls.
    #[divan::bench(sample_count = 1000, sample_size = 10)]
    fn record_stats_without_a_step(bencher: Bencher) {
        // Trained first, so that there are gradients and optimizer state.
        let mut training = super::Training::new(tch::Device::cuda_if_available());
        for _ in 0..20 {
            training.step();
        }
        let mut monitor = memlab::TrainingMonitor::new(&training.vs).print_period(0);
        for _ in 0..20 {
            monitor.record_stats();
        }
        bencher.bench_local(|| {
            black_box(monitor.record_stats());
        });
    }

    /// `StepLogger::log` of an empty closure.
    #[divan::bench(sample_count = 1000, sample_size = 10)]
    fn log_of_an_empty_closure(bencher: Bencher) {
        let mut logger = memlab::StepLogger::new();
        logger.stop();
        for _ in 0..20 {
            logger.log("warm-up", || ());
        }
        bencher.bench_local(|| logger.log("empty", || ()));
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench` (after ROUNDS); `cargo test --benches` does not.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let rounds: usize = if measuring {
        args.iter().find(|a| !a.starts_with("--")).map(|a| a.parse()).transpose()?.unwrap_or(61)
    } else {
        println!("test mode: one round, each part once (`cargo bench --bench tools` measures)\n");
        1
    };
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let device = Device::cuda_if_available();
    let Training { vs, net, mut opt, x, y } = Training::new(device);
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
    let mut divan = divan::Divan::default();
    if !device.is_cuda() {
        divan = divan.skip_regex("cuda_");
    }
    if measuring {
        divan.run_benches();
    } else {
        divan.test_benches();
    }
    Ok(())
}
