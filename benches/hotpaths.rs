//! memlab's hot paths, one figure each, for comparing two builds of memlab on
//! the same machine: a statement probe (CPU, CUDA), an allocation event while
//! recording (CPU without and with backtraces, CUDA), a dispose scope or
//! `check_step` around a one-tensor step (CPU), and a `MemReporter` report of
//! a var store of 2,000 tensors (CPU). The CUDA paths are left out when there
//! is no CUDA device.
//!
//!     source scripts/env.sh && cargo bench --bench hotpaths
//!
//! Prints a Markdown table, then one `HOTPATHS name=ns ...` line that
//! `scripts/compare_hotpaths.sh` reads when it runs two builds alternately.
//! Each figure is the median of 9 rounds, in nanoseconds per operation. A
//! probe or an event costs the difference between a loop with memlab and the
//! same loop without, both timed in the same round; a harness times one
//! closure at a time and cannot take that difference, so this benchmark keeps
//! its own `main`. Its line is the one `examples/bench_hotpaths` printed
//! before the benchmarks moved here, measured the same way, so builds from
//! before and after the move compare.
//!
//! Without `--bench` (`cargo test --benches` runs it so) every path runs one
//! short round to show that it works, and no `HOTPATHS` line is printed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

/// How much each measurement does: the benchmark's figures, or a short check.
struct Sizes {
    probes: u64,
    allocations: u32,
    scopes: u32,
    rounds: usize,
}

const MEASURE: Sizes = Sizes { probes: 200_000, allocations: 200_000, scopes: 5_000, rounds: 9 };
const CHECK: Sizes = Sizes { probes: 1_000, allocations: 100, scopes: 10, rounds: 1 };

macro_rules! probe_loop {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        fn $name(n: u64) -> u64 {
            let mut acc = 0u64;
            for i in 0..n {
                acc = black_box(acc.wrapping_add(i));
            }
            acc
        }
    };
}

probe_loop!(plain_loop);
probe_loop!(
    #[memlab::profile(device = "cpu")]
    cpu_loop
);
probe_loop!(
    #[memlab::profile(device = "cuda:0")]
    cuda_loop
);

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// Nanoseconds per probe: the profiled loop minus the plain one, per round.
fn probe(sizes: &Sizes, profiled: fn(u64) -> u64) -> f64 {
    let rounds = (0..sizes.rounds)
        .map(|_| {
            let plain = timed(|| {
                black_box(plain_loop(sizes.probes));
            });
            let with = timed(|| {
                black_box(profiled(sizes.probes));
            });
            (with.as_secs_f64() - plain.as_secs_f64()) / sizes.probes as f64 * 1e9
        })
        .collect();
    median(rounds)
}

fn churn(sizes: &Sizes, device: Device) -> Duration {
    timed(|| {
        for _ in 0..sizes.allocations {
            drop(black_box(Tensor::empty([64], (Kind::Float, device))));
        }
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    })
}

/// Nanoseconds per event (an allocation and its free are two on the CPU,
/// three on CUDA) above the same loop with recording off.
fn event(sizes: &Sizes, device: Device, backtraces: bool) -> f64 {
    let per_iteration = if device.is_cuda() { 3.0 } else { 2.0 };
    let rounds = (0..sizes.rounds)
        .map(|_| {
            let off = churn(sizes, device);
            let settings = memlab::events::Settings::default().capacity(0).backtraces(backtraces);
            let recording = memlab::Recording::start(settings).expect("recording starts");
            let on = churn(sizes, device);
            drop(recording);
            (on.as_secs_f64() - off.as_secs_f64()) / (f64::from(sizes.allocations) * per_iteration) * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per scope around a step that allocates and frees one tensor.
fn scope(sizes: &Sizes) -> f64 {
    let rounds = (0..sizes.rounds)
        .map(|_| {
            timed(|| {
                for _ in 0..sizes.scopes {
                    let scope = memlab::DisposeScope::new("step").expect("a scope opens");
                    drop(black_box(Tensor::empty([64], (Kind::Float, Device::Cpu))));
                    black_box(scope.finish());
                }
            })
            .as_secs_f64()
                / f64::from(sizes.scopes)
                * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per `check_step` around the same step.
fn check(sizes: &Sizes) -> f64 {
    let rounds = (0..sizes.rounds)
        .map(|_| {
            timed(|| {
                for _ in 0..sizes.scopes {
                    let check = memlab::check_step(|| {
                        drop(black_box(Tensor::empty([64], (Kind::Float, Device::Cpu))));
                    })
                    .expect("a check runs");
                    black_box(check);
                }
            })
            .as_secs_f64()
                / f64::from(sizes.scopes)
                * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per report of a var store holding 2,000 small tensors.
fn reporter(sizes: &Sizes) -> f64 {
    let vs = tch::nn::VarStore::new(Device::Cpu);
    for i in 0..2_000 {
        let _ = vs.root().zeros(&format!("w{i}"), &[16]);
    }
    let reporter = memlab::MemReporter::new(&vs);
    let rounds = (0..sizes.rounds)
        .map(|_| timed(|| drop(black_box(reporter.report().expect("a report")))).as_secs_f64() * 1e9)
        .collect();
    median(rounds)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let sizes = if measuring { MEASURE } else { CHECK };
    memlab::profiler::set_print_at_exit(false);
    let mut figures: Vec<(&str, f64)> = vec![("probe_cpu", probe(&sizes, cpu_loop))];
    let cuda = memlab::gpu::cuda_is_available();
    if cuda {
        // The first CUDA allocation creates the caching allocator.
        drop(Tensor::zeros([1], (Kind::Float, Device::Cuda(0))));
        figures.push(("probe_cuda", probe(&sizes, cuda_loop)));
    }
    figures.push(("event_cpu", event(&sizes, Device::Cpu, false)));
    figures.push(("event_cpu_backtrace", event(&sizes, Device::Cpu, true)));
    if cuda {
        figures.push(("event_cuda", event(&sizes, Device::Cuda(0), false)));
        figures.push(("event_cuda_backtrace", event(&sizes, Device::Cuda(0), true)));
    }
    figures.push(("scope_cpu", scope(&sizes)));
    figures.push(("check_step_cpu", check(&sizes)));
    figures.push(("report_2000_tensors_cpu", reporter(&sizes)));

    if !measuring {
        println!("test mode: one short round per hot path (`cargo bench --bench hotpaths` measures them)\n");
    }
    println!("| hot path | ns per operation (median of {} rounds) |", sizes.rounds);
    println!("|---|---:|");
    for (name, ns) in &figures {
        println!("| {name} | {ns:.1} |");
    }
    if measuring {
        let line: Vec<String> = figures.iter().map(|(name, ns)| format!("{name}={ns:.2}")).collect();
        println!("HOTPATHS {}", line.join(" "));
    }
}
