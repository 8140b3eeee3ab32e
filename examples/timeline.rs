//! Memory over time as pictures: trains a small MLP for a few steps with a
//! deliberate leak (a list that keeps every step's logits, and with them the
//! autograd graph) under a Recording with backtraces, then writes exactly
//! three files:
//!
//! - `DIR/memlab_report.html`: one self-contained page (timeline stacked by
//!   site, icicle graph of the peak, what was live then, the line profile);
//! - `DIR/memlab_snapshot.pickle`: PyTorch's memory snapshot, for
//!   pytorch.org/memory_viz or `python -m torch.cuda._memory_viz`;
//! - `DIR/memlab_trace.json`: trace events for ui.perfetto.dev: the
//!   allocator's counters, the resident set and (CUDA) the driver's figure
//!   read every millisecond, and slices for each logged step and each
//!   profiled call.
//!
//! On the CPU by default, on the current CUDA device when there is one.
//!
//!     cargo run --release --example timeline -- --out DIR

use std::error::Error;
use std::path::PathBuf;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Mlp {
    fn new(vs: &nn::Path) -> Mlp {
        let widths = [256, 512, 512, 256, 10];
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| nn::linear(vs / format!("fc{i}"), w[0], w[1], Default::default()))
            .collect();
        Mlp { layers }
    }

    #[memlab::profile]
    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let out = layer.forward(&h);
            h = if i + 1 < self.layers.len() { out.relu() } else { out };
        }
        h
    }
}

#[memlab::profile]
fn train_step(model: &Mlp, opt: &mut nn::Optimizer, x: &Tensor, y: &Tensor, history: &mut Vec<Tensor>) -> f64 {
    let logits = model.forward(x);
    let loss = logits.cross_entropy_for_logits(y);
    opt.backward_step(&loss);
    history.push(logits); // the leak: each step's logits keep their graph alive
    loss.double_value(&[])
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mut out = PathBuf::from("memlab_timeline");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            other => return Err(format!("unknown argument {other:?}; use --out DIR").into()),
        }
    }
    std::fs::create_dir_all(&out)?;
    memlab::profiler::set_print_at_exit(false);
    let device = Device::cuda_if_available();
    let settings = memlab::events::Settings::default().backtraces(true).sampling(std::time::Duration::from_millis(1));
    let recording = memlab::Recording::start(settings)?;

    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = Mlp::new(&vs.root());
    memlab::register_var_store("model", &vs);
    let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
    let x = Tensor::randn([512, 256], (Kind::Float, device));
    let y = Tensor::randint(10, [512], (Kind::Int64, device));
    let mut history = Vec::new();
    // Each step becomes a slice of the trace (the logger prints nothing here).
    let mut logger = memlab::StepLogger::new();
    logger.stop();
    for step in 0..8 {
        let loss = logger
            .log(&format!("step {step}"), || adam.with_mut(|adam| train_step(&model, adam, &x, &y, &mut history)));
        println!("step {step}: loss {loss:.4}");
    }

    let exporter = memlab::export::Exporter::registered();
    // memlab_snapshot.pickle, memlab_trace.json, memlab_report.html (with
    // _rank{N} in each name where MEMLAB_RANK, RANK or LOCAL_RANK is set).
    let written = exporter.write_files(&out)?;
    let report = exporter.html_report()?;
    for d in &report.devices {
        println!(
            "{}: peak {} allocated; the largest at the peak:",
            d.device,
            memlab::render::Cell::bytes(d.peak_bytes)
        );
        for row in d.live_at_peak.iter().take(4) {
            println!("  {:>10}  {}", memlab::render::Cell::bytes(row.bytes), row.label);
        }
    }
    let names: Vec<String> =
        written.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
    println!("wrote {} to {}", names.join(", "), out.display());
    drop((history, recording));
    Ok(())
}
