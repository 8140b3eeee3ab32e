//! The line profiler's cost: one statement probe, and the slowdown of a
//! profiled training step against the same step unprofiled, for a small and a
//! large MLP, on the CPU and (when there is one) on CUDA.
//!
//!     source scripts/env.sh && cargo bench --bench profiler
//!
//! Prints Markdown tables (the profiler's figures in BENCHMARKS.md come from
//! here). A probe costs the difference between a profiled loop and the same
//! loop plain, and a slowdown is a ratio of the profiled step's median to the
//! plain step's, both taken over alternating rounds so that drift hits both
//! sides, with the median of each round's own ratio beside it; a harness
//! times one closure at a time and cannot pair them, so this benchmark keeps
//! its own `main`. On CUDA it also times what a probe asks libtorch for.
//!
//! Without `--bench` (`cargo test --benches` runs it so) every measurement
//! runs one short round to show that it works.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Probes per timed loop.
const PROBES: u64 = 200_000;
/// Probes per loop in a short check (test mode).
const CHECK_PROBES: u64 = 1_000;

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

struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Mlp {
    fn new(vs: &nn::Path, widths: &[i64]) -> Mlp {
        let layers =
            widths.windows(2).enumerate().map(|(i, w)| nn::linear(vs / i, w[0], w[1], Default::default())).collect();
        Mlp { layers }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let last = self.layers.len() - 1;
        self.layers.iter().enumerate().fold(x.shallow_clone(), |h, (i, l)| {
            let y = l.forward(&h);
            if i == last {
                y
            } else {
                y.relu()
            }
        })
    }
}

macro_rules! train_step {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        fn $name(model: &Mlp, opt: &mut nn::Optimizer, x: &Tensor, y: &Tensor) -> Tensor {
            let logits = model.forward(x);
            let loss = logits.cross_entropy_for_logits(y);
            opt.backward_step(&loss);
            loss
        }
    };
}

train_step!(plain_step);
train_step!(
    #[memlab::profile]
    profiled_step
);

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time(mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// Per-probe cost in ns: (best round, median round), each the profiled loop's
/// time per iteration minus the plain loop's.
fn probe_cost(device: &str, profiled: fn(u64) -> u64, probes: u64, rounds: usize) -> (f64, f64) {
    let (mut plain, mut prof) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(time(|| {
            black_box(plain_loop(black_box(probes)));
        }));
        prof.push(time(|| {
            black_box(profiled(black_box(probes)));
        }));
    }
    let per_probe = |p: Duration, q: Duration| (q.as_secs_f64() - p.as_secs_f64()) / probes as f64 * 1e9;
    let best = per_probe(*plain.iter().min().unwrap(), *prof.iter().min().unwrap());
    let (p, q) = (median(plain), median(prof));
    eprintln!("probe loop on {device}: plain {p:?}, profiled {q:?} for {probes} probes");
    (best, per_probe(p, q))
}

/// One training-step measurement: a model on a device.
struct Case {
    device: Device,
    name: &'static str,
    widths: &'static [i64],
    batch: i64,
    steps: usize,
    rounds: usize,
}

struct StepResult {
    plain: Duration,
    profiled: Duration,
    /// The median of each round's profiled block over its own plain block:
    /// drift between rounds (a GPU's clocks, the host's other work) cancels.
    paired: f64,
}

fn step_slowdown(device: Device, widths: &[i64], batch: i64, steps: usize, rounds: usize) -> StepResult {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = Mlp::new(&vs.root(), widths);
    let mut opt = nn::Adam::default().build(&vs, 1e-4).expect("optimizer");
    let x = Tensor::randn([batch, widths[0]], (Kind::Float, device));
    let y = Tensor::randint(*widths.last().unwrap(), [batch], (Kind::Int64, device));
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    for _ in 0..steps {
        let _ = plain_step(&model, &mut opt, &x, &y);
        let _ = profiled_step(&model, &mut opt, &x, &y);
    }
    sync();
    let (mut plain, mut prof) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(time(|| {
            for _ in 0..steps {
                let _ = plain_step(&model, &mut opt, &x, &y);
            }
            sync();
        }));
        prof.push(time(|| {
            for _ in 0..steps {
                let _ = profiled_step(&model, &mut opt, &x, &y);
            }
            sync();
        }));
    }
    let mut ratios: Vec<f64> = plain.iter().zip(&prof).map(|(p, q)| q.as_secs_f64() / p.as_secs_f64()).collect();
    ratios.sort_by(f64::total_cmp);
    let paired = ratios[ratios.len() / 2];
    StepResult { plain: median(plain) / steps as u32, profiled: median(prof) / steps as u32, paired }
}

/// What one CUDA probe is made of, in ns per call: the allocator's figures
/// read and its peaks reset through the shim (what a probe asks libtorch
/// for), and the same read without the reset.
fn cuda_read_cost(calls: u64, rounds: usize) -> (f64, f64) {
    use memlab_core::Backend;
    let device = memlab::Device::Cuda(0);
    let mut raw = memlab_core::stats::RawStats::default();
    let mut per_call = |reset: bool| {
        let rounds: Vec<Duration> = (0..rounds)
            .map(|_| {
                time(|| {
                    for _ in 0..calls {
                        memlab_tch::BACKEND.sample(device, black_box(&mut raw), reset).unwrap();
                    }
                })
            })
            .collect();
        median(rounds).as_secs_f64() / calls as f64 * 1e9
    };
    (per_call(true), per_call(false))
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let (probes, probe_rounds) = if measuring { (PROBES, 15) } else { (CHECK_PROBES, 1) };
    memlab::profiler::set_print_at_exit(false);
    let cuda = memlab::gpu::cuda_is_available();
    if !measuring {
        println!("test mode: one short round per measurement (`cargo bench --bench profiler` measures)\n");
    }
    println!("## Statement probe\n");
    println!("| device | probe cost, best round (ns) | probe cost, median round (ns) |");
    println!("|---|---:|---:|");
    let (best, median) = probe_cost("cpu", cpu_loop, probes, probe_rounds);
    println!("| cpu | {best:.1} | {median:.1} |");
    if cuda {
        // A first CUDA allocation initialises the caching allocator, so the
        // probes read real statistics rather than the "no allocator yet" zeros.
        let _warm = Tensor::zeros([1], (Kind::Float, Device::Cuda(0)));
        let (best, median) = probe_cost("cuda:0", cuda_loop, probes, probe_rounds);
        println!("| cuda:0 | {best:.1} | {median:.1} |");
        let (read_reset, read) = cuda_read_cost(probes / 4, probe_rounds);
        println!(
            "\nOf a CUDA probe: libtorch's figures read and peaks reset through the shim {read_reset:.1} ns a call (read alone {read:.1} ns); the rest is memlab's own."
        );
    }

    println!("\n## Training step, profiled (4 statements) vs plain\n");
    println!("Medians over rounds that alternate a block of plain steps and a block of profiled ones; the");
    println!("paired ratio is the median of each round's profiled block over its own plain block.\n");
    println!("| device | model | batch | rounds | plain step | profiled step | ratio of medians | paired ratio |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mut cases = vec![
        Case {
            device: Device::Cpu,
            name: "small 256-256-10",
            widths: &[256, 256, 10],
            batch: 64,
            steps: 50,
            rounds: 31,
        },
        Case {
            device: Device::Cpu,
            name: "large 2048-2048-2048-10",
            widths: &[2048, 2048, 2048, 10],
            batch: 256,
            steps: 5,
            rounds: 31,
        },
    ];
    if cuda {
        let gpu = Device::Cuda(0);
        cases.push(Case {
            device: gpu,
            name: "small 4 x Linear(256)",
            widths: &[256, 256, 256, 256, 256],
            batch: 64,
            steps: 200,
            rounds: 41,
        });
        cases.push(Case {
            device: gpu,
            name: "large 4096x4-10",
            widths: &[4096, 4096, 4096, 4096, 10],
            batch: 1024,
            steps: 50,
            rounds: 31,
        });
    }
    for case in cases {
        let Case { device, name, widths, batch, steps, rounds } = case;
        let (steps, rounds) = if measuring { (steps, rounds) } else { (1, 1) };
        let measured = match device {
            Device::Cuda(i) => memlab::Device::Cuda(i),
            _ => memlab::Device::Cpu,
        };
        memlab::profiler::set_target_device(memlab::profiler::DeviceSelector::Fixed(measured));
        let r = step_slowdown(device, widths, batch, steps, rounds);
        println!(
            "| {} | {name} | {batch} | {rounds} | {:.1} µs | {:.1} µs | {:.3}× | {:.3}× |",
            measured,
            r.plain.as_secs_f64() * 1e6,
            r.profiled.as_secs_f64() * 1e6,
            r.profiled.as_secs_f64() / r.plain.as_secs_f64(),
            r.paired
        );
    }
}
