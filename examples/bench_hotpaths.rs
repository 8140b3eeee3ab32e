//! Benchmark of memlab's hot paths, one figure each, for comparing two builds
//! of memlab on the same machine: a statement probe (CPU, CUDA), an
//! allocation event while recording (CPU without and with backtraces, CUDA),
//! a dispose scope or `check_step` around a one-tensor step (CPU), and a
//! `MemReporter` report of a var store of 2,000 tensors (CPU).
//!
//!     cargo run --release --example bench_hotpaths
//!
//! Prints a Markdown table, then one `HOTPATHS name=ns ...` line that
//! `scripts/compare_hotpaths.sh` reads when it alternates two binaries.
//! Each figure is the median of 9 rounds, in nanoseconds per operation.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

const PROBES: u64 = 200_000;
const ALLOCATIONS: u32 = 20_000;
const SCOPES: u32 = 5_000;
const ROUNDS: usize = 9;

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
fn probe(profiled: fn(u64) -> u64) -> f64 {
    let rounds = (0..ROUNDS)
        .map(|_| {
            let plain = timed(|| {
                black_box(plain_loop(PROBES));
            });
            let with = timed(|| {
                black_box(profiled(PROBES));
            });
            (with.as_secs_f64() - plain.as_secs_f64()) / PROBES as f64 * 1e9
        })
        .collect();
    median(rounds)
}

fn churn(device: Device) -> Duration {
    timed(|| {
        for _ in 0..ALLOCATIONS {
            drop(black_box(Tensor::empty([64], (Kind::Float, device))));
        }
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    })
}

/// Nanoseconds per event (an allocation and its free are two on the CPU,
/// three on CUDA) above the same loop with recording off.
fn event(device: Device, backtraces: bool) -> f64 {
    let per_iteration = if device.is_cuda() { 3.0 } else { 2.0 };
    let rounds = (0..ROUNDS)
        .map(|_| {
            let off = churn(device);
            let settings = memlab::events::Settings::default().capacity(0).backtraces(backtraces);
            let recording = memlab::Recording::start(settings).expect("recording starts");
            let on = churn(device);
            drop(recording);
            (on.as_secs_f64() - off.as_secs_f64()) / (f64::from(ALLOCATIONS) * per_iteration) * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per scope around a step that allocates and frees one tensor.
fn scope() -> f64 {
    let rounds = (0..ROUNDS)
        .map(|_| {
            timed(|| {
                for _ in 0..SCOPES {
                    let scope = memlab::DisposeScope::new("step").expect("a scope opens");
                    drop(black_box(Tensor::empty([64], (Kind::Float, Device::Cpu))));
                    black_box(scope.finish());
                }
            })
            .as_secs_f64()
                / f64::from(SCOPES)
                * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per `check_step` around the same step.
fn check() -> f64 {
    let rounds = (0..ROUNDS)
        .map(|_| {
            timed(|| {
                for _ in 0..SCOPES {
                    let check = memlab::check_step(|| {
                        drop(black_box(Tensor::empty([64], (Kind::Float, Device::Cpu))));
                    })
                    .expect("a check runs");
                    black_box(check);
                }
            })
            .as_secs_f64()
                / f64::from(SCOPES)
                * 1e9
        })
        .collect();
    median(rounds)
}

/// Nanoseconds per report of a var store holding 2,000 small tensors.
fn reporter() -> f64 {
    let vs = tch::nn::VarStore::new(Device::Cpu);
    for i in 0..2_000 {
        let _ = vs.root().zeros(&format!("w{i}"), &[16]);
    }
    let reporter = memlab::MemReporter::new(&vs);
    let rounds = (0..ROUNDS)
        .map(|_| timed(|| drop(black_box(reporter.report().expect("a report")))).as_secs_f64() * 1e9)
        .collect();
    median(rounds)
}

fn main() {
    memlab::profiler::set_print_at_exit(false);
    // A recording that stays on keeps the recorder's hooks installed, so the
    // scope figures measure scopes, not installing hooks.
    let mut figures: Vec<(&str, f64)> = vec![("probe_cpu", probe(cpu_loop))];
    let cuda = memlab::gpu::cuda_is_available();
    if cuda {
        // The first CUDA allocation creates the caching allocator.
        drop(Tensor::zeros([1], (Kind::Float, Device::Cuda(0))));
        figures.push(("probe_cuda", probe(cuda_loop)));
    }
    figures.push(("event_cpu", event(Device::Cpu, false)));
    figures.push(("event_cpu_backtrace", event(Device::Cpu, true)));
    if cuda {
        figures.push(("event_cuda", event(Device::Cuda(0), false)));
        figures.push(("event_cuda_backtrace", event(Device::Cuda(0), true)));
    }
    figures.push(("scope_cpu", scope()));
    figures.push(("check_step_cpu", check()));
    figures.push(("report_2000_tensors_cpu", reporter()));

    println!("| hot path | ns per operation (median of {ROUNDS} rounds) |");
    println!("|---|---:|");
    for (name, ns) in &figures {
        println!("| {name} | {ns:.1} |");
    }
    let line: Vec<String> = figures.iter().map(|(name, ns)| format!("{name}={ns:.2}")).collect();
    println!("HOTPATHS {}", line.join(" "));
}
