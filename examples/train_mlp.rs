//! memlab's main demo: builds a small MLP, trains it for a few steps on
//! synthetic data, and prints the line-by-line memory tables of the profiled
//! constructor, forward pass and training loop when the program exits.
//!
//! Runs on the CPU, or on the current CUDA device when there is one (memlab's
//! `auto` target follows the same rule). `--html FILE`, `--csv FILE` and
//! `--json FILE` also write the report in those formats. `--will-it-fit GIB`
//! asks, without a GPU, whether the training step fits a CUDA card of GIB
//! GiB, and the largest batch that does: the step runs on the CPU and is
//! replayed as CUDA's (`memlab::will_it_fit`, `find_batch_size` with
//! `Budget::CudaCard`).
//!
//!     cargo run --release --example train_mlp
//!     cargo run --release --example train_mlp -- --will-it-fit 2

use std::error::Error;

use memlab::Render;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const INPUT: i64 = 1024;
const HIDDEN: i64 = 512;
const CLASSES: i64 = 10;
const BATCH: i64 = 256;

struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Mlp {
    #[memlab::profile]
    fn new(vs: &nn::Path) -> Mlp {
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        let fc1 = nn::linear(vs / "fc1", INPUT, INPUT, no_bias);
        let fc2 = nn::linear(vs / "fc2", INPUT, HIDDEN, Default::default());
        let fc3 = nn::linear(vs / "fc3", HIDDEN, CLASSES, Default::default());
        Mlp { fc1, fc2, fc3 }
    }

    #[memlab::profile]
    fn forward(&self, x: &Tensor) -> Tensor {
        let h1 = self.fc1.forward(x).relu();
        let h2 = self.fc2.forward(&h1).relu();
        self.fc3.forward(&h2)
    }
}

#[memlab::profile]
fn train(model: &Mlp, opt: &mut nn::Optimizer, data: &Tensor, labels: &Tensor, steps: usize) -> f64 {
    let mut last_loss = f64::NAN;
    for _ in 0..steps {
        let logits = model.forward(data);
        let loss = logits.cross_entropy_for_logits(labels);
        opt.backward_step(&loss);
        last_loss = loss.double_value(&[]);
    }
    last_loss
}

fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = Mlp::new(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let data = Tensor::randn([BATCH, INPUT], (Kind::Float, device));
    let labels = Tensor::randint(CLASSES, [BATCH], (Kind::Int64, device));

    let loss = train(&model, &mut opt, &data, &labels, 5);
    println!(
        "memlab demo: trained a {INPUT}-{INPUT}-{HIDDEN}-{CLASSES} MLP for 5 steps on {device:?} (memlab measures {}); final loss {loss:.4}",
        memlab::gpu::auto_device()
    );
    println!(
        "The fc1 line of Mlp::new creates a {INPUT}x{INPUT} f32 weight: its increment is exactly {INPUT}*{INPUT}*4 bytes = +4.00M.\n"
    );

    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let path = args.next().ok_or_else(|| format!("{flag} needs a file name"))?;
        if flag == "--will-it-fit" {
            let gib: u64 =
                path.parse().map_err(|_| format!("--will-it-fit {path}: give the card's memory in GiB (2)"))?;
            will_it_fit(gib << 30)?;
            continue;
        }
        let report = memlab::report();
        let text = match flag.as_str() {
            "--html" => report.to_html(),
            "--csv" => report.to_csv()?,
            "--json" => report.to_json(),
            other => {
                return Err(
                    format!("unknown option {other}: use --html, --csv or --json FILE, or --will-it-fit GIB").into()
                );
            }
        };
        std::fs::write(&path, text).map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("wrote {path}");
    }
    Ok(())
}

/// The demo's training step on a CUDA card of `card` bytes, asked on the
/// CPU: its predicted peaks, and the largest batch that fits.
fn will_it_fit(card: u64) -> Result<(), Box<dyn Error>> {
    let vs = nn::VarStore::new(Device::Cpu);
    memlab::register_var_store("mlp", &vs);
    let model = Mlp::new(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let mut step = |batch: i64| {
        let data = Tensor::randn([batch, INPUT], (Kind::Float, Device::Cpu));
        let labels = Tensor::randint(CLASSES, [batch], (Kind::Int64, Device::Cpu));
        opt.backward_step(&model.forward(&data).cross_entropy_for_logits(&labels));
    };
    let prediction = memlab::will_it_fit(card, || {
        step(BATCH);
        Ok(())
    })?;
    println!("{prediction}");
    let search = memlab::find_batch_size(memlab::Device::Cpu, memlab::Budget::CudaCard(card), 1 << 20, |batch| {
        step(batch as i64);
        Ok(())
    })?;
    match search.largest {
        Some(batch) => println!("The largest batch whose step fits the card: {batch} (an estimate)."),
        None => println!("Not even a batch of 1 fits the card."),
    }
    if let Some(batch) = search.largest_giving_cache_back {
        println!(
            "Up to {batch} may fit: the model fits it with less than its error to spare, or only by the allocator \
             giving its cache back."
        );
    }
    Ok(())
}
