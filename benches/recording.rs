//! What recording costs in a real training step: a 4-layer 256-wide MLP,
//! batch 64, forward + backward + SGD step, run plain, under a `Recording`
//! without backtraces, and under one with backtraces. On the CPU, and on
//! CUDA when there is one. Prints a Markdown table: the median step time of
//! each mode over rounds whose order rotates, its ratio to the plain step's,
//! the median of each round's ratio to the same round's plain block (which
//! the step's drift over a run does not move), the events per step, and what
//! each mode costs per event; then memlab's own work per event, timed.
//!
//!     source scripts/env.sh && cargo bench --bench recording [-- ROUNDS]
//!
//! `scripts/bench_recording_pytorch.py` times the same step in PyTorch, with
//! and without `torch.cuda.memory._record_memory_history`, for comparison.
//! The figures are ratios of medians over rotating rounds, which a harness
//! timing one closure at a time cannot take, so this benchmark keeps its own
//! `main`. Without `--bench` (`cargo test --benches` runs it so) it runs one
//! round to show that it works.

use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 256;
const LAYERS: usize = 4;
const BATCH: i64 = 64;
/// Steps per timed block.
const STEPS: usize = 50;

struct Setup {
    model: nn::Sequential,
    opt: nn::Optimizer,
    x: Tensor,
    y: Tensor,
    device: Device,
}

fn setup(device: Device) -> Setup {
    let vs = nn::VarStore::new(device);
    let mut model = nn::seq();
    for i in 0..LAYERS {
        let out = if i + 1 == LAYERS { 10 } else { WIDTH };
        model = model.add(nn::linear(vs.root() / format!("fc{i}"), WIDTH, out, Default::default()));
        if i + 1 < LAYERS {
            model = model.add_fn(|x| x.relu());
        }
    }
    let opt = nn::Sgd::default().build(&vs, 1e-3).expect("an optimizer");
    let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, device));
    let y = Tensor::randint(10, [BATCH], (Kind::Int64, device));
    Setup { model, opt, x, y, device }
}

fn step(s: &mut Setup) {
    let loss = s.model.forward(&s.x).cross_entropy_for_logits(&s.y);
    s.opt.backward_step(&loss);
}

fn block(s: &mut Setup) -> Duration {
    let start = Instant::now();
    for _ in 0..STEPS {
        step(s);
    }
    if let Device::Cuda(i) = s.device {
        tch::Cuda::synchronize(i as i64);
    }
    start.elapsed()
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    Events,
    Backtraces,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Events => "recording",
            Mode::Backtraces => "recording, backtraces",
        }
    }

    fn settings(self) -> Option<memlab::events::Settings> {
        let settings = memlab::events::Settings::default().capacity(100_000);
        match self {
            Mode::Plain => None,
            Mode::Events => Some(settings),
            Mode::Backtraces => Some(settings.backtraces(true)),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench` (after ROUNDS); `cargo test --benches` does not.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let rounds: usize = if measuring {
        args.iter().find(|a| !a.starts_with("--")).map(|a| a.parse()).transpose()?.unwrap_or(21)
    } else {
        println!("test mode: one round (`cargo bench --bench recording` measures)\n");
        1
    };
    let mut devices = vec![Device::Cpu];
    if memlab::gpu::cuda_is_available() {
        devices.push(Device::Cuda(0));
    }
    let modes = [Mode::Plain, Mode::Events, Mode::Backtraces];
    let mut notes = Vec::new();
    println!(
        "{LAYERS}-layer {WIDTH}-wide MLP, batch {BATCH}, forward + backward + SGD step; {rounds} rounds of {STEPS} steps per mode\n"
    );
    println!("| device | mode | step (median) | × plain | × plain, paired by round | events per step | per event |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for device in devices {
        let mut s = setup(device);
        // Warm up every mode: the unwinder's tables, the caches, libtorch's kernels.
        for mode in modes {
            let recording = mode.settings().map(memlab::Recording::start).transpose()?;
            block(&mut s);
            drop(recording);
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        let mut events_per_step = vec![0.0; modes.len()];
        for round in 0..rounds {
            for k in 0..modes.len() {
                let m = (round + k) % modes.len();
                let recording = modes[m].settings().map(memlab::Recording::start).transpose()?;
                let before = memlab::events::history().1.recorded;
                let t = block(&mut s);
                let after = memlab::events::history().1.recorded;
                drop(recording);
                times[m].push(t.as_secs_f64() / STEPS as f64 * 1e6);
                if modes[m] != Mode::Plain {
                    events_per_step[m] = (after - before) as f64 / STEPS as f64;
                }
            }
        }
        // memlab's own work per event, timed in one more block per mode
        // (apart from the rounds: timing costs a little itself).
        for mode in [Mode::Events, Mode::Backtraces] {
            let recording = mode.settings().map(memlab::Recording::start).transpose()?;
            let before = memlab::events::time_own_work(true);
            block(&mut s);
            let after = memlab::events::time_own_work(false);
            drop(recording);
            let d: Vec<f64> = before.iter().zip(after).map(|(b, a)| (a - b) as f64).collect();
            let mut note = format!(
                "{device:?}, {}: memlab's own work {:.2} µs per event ({:.0} events)",
                mode.label(),
                d[1] / d[0].max(1.0) / 1e3,
                d[0]
            );
            if d[2] > 0.0 {
                note += &format!(
                    ", of which the backtrace {:.2} µs ({:.0} backtraces of {:.1} frames, {:.1}% given by an earlier walk)",
                    d[3] / d[2] / 1e3,
                    d[2],
                    d[4] / d[2],
                    100.0 * d[5] / d[2]
                );
            }
            notes.push(note);
        }
        let (hits, collisions, first) = memlab_core_stats();
        let plain = median(times[0].clone());
        for (m, mode) in modes.iter().enumerate() {
            let t = median(times[m].clone());
            let per_event = if *mode == Mode::Plain {
                "—".to_string()
            } else {
                format!("{:.2} µs", (t - plain) / events_per_step[m])
            };
            let events = if *mode == Mode::Plain { "—".to_string() } else { format!("{:.0}", events_per_step[m]) };
            // Each round's block against the same round's plain block: the
            // step's drift over the run cancels out.
            let paired = median(times[m].iter().zip(&times[0]).map(|(t, p)| t / p).collect());
            println!(
                "| {device:?} | {} | {t:.1} µs | {:.3} | {paired:.3} | {events} | {per_event} |",
                mode.label(),
                t / plain
            );
        }
        let lookups = (hits + collisions + first).max(1) as f64;
        notes.push(format!(
            "{device:?}: unwinder rule caches of the stepping thread: {:.2}% hits, {:.2}% misses by slot collision, {:.2}% first uses ({} lookups)",
            100.0 * hits as f64 / lookups,
            100.0 * collisions as f64 / lookups,
            100.0 * first as f64 / lookups,
            hits + collisions + first
        ));
    }
    println!();
    for note in notes {
        println!("{note}");
    }
    Ok(())
}

/// The stepping thread's unwinder cache counts (the CUDA backward runs on
/// autograd's device thread, whose counts are not here).
fn memlab_core_stats() -> (u64, u64, u64) {
    memlab::events::unwind_cache_stats()
}
