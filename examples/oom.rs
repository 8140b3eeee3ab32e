//! The out-of-memory recorder at work: a small attention model trains on
//! short sequences. Its attention scores hide a shape bug: an elementwise
//! product broadcast to `[batch, seq, seq, hidden]`, then summed, where a
//! matrix product was meant. On 256-long sequences that wastes 256 MiB a step
//! and goes unnoticed; at step 3 a batch of 4096-long sequences asks for
//! 512 GiB. The recorder, armed once, writes its report before libtorch's
//! error reaches the step (the summary goes to standard error), the step
//! returns the error, and training goes on.
//!
//! Writes `DIR/memlab_oom_<pid>_1.txt`, and `.html` and `.pickle` beside it
//! (a `Recording` runs). On the CPU by default, on the current CUDA device
//! when there is one.
//!
//!     cargo run --release --example oom -- --out DIR

use std::error::Error;
use std::path::PathBuf;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const HIDDEN: i64 = 256;

struct Attention {
    query: nn::Linear,
    key: nn::Linear,
    out: nn::Linear,
}

impl Attention {
    fn new(vs: &nn::Path) -> Attention {
        let c = Default::default();
        Attention {
            query: nn::linear(vs / "query", HIDDEN, HIDDEN, c),
            key: nn::linear(vs / "key", HIDDEN, HIDDEN, c),
            out: nn::linear(vs / "out", HIDDEN, 1, c),
        }
    }

    #[memlab::profile]
    fn forward(&self, x: &Tensor) -> Result<Tensor, tch::TchError> {
        let q = self.query.forward(x);
        let k = self.key.forward(x);
        // The bug: [batch, seq, seq, HIDDEN] floats, then summed over the
        // hidden dimension; `q.matmul(&k.transpose(-2, -1))` was meant.
        let scores = q.unsqueeze(2).f_mul(&k.unsqueeze(1))?.sum_dim_intlist(-1, false, Kind::Float);
        let weights = (scores / (HIDDEN as f64).sqrt()).softmax(-1, Kind::Float);
        Ok(self.out.forward(&weights.matmul(x)))
    }
}

#[memlab::profile]
fn train_step(model: &Attention, opt: &mut memlab::RegisteredOptimizer, x: &Tensor) -> Result<f64, tch::TchError> {
    let y = model.forward(x)?;
    let loss = y.square().mean(Kind::Float);
    opt.backward_step(&loss);
    Ok(loss.double_value(&[]))
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mut out = PathBuf::from("memlab_oom");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            other => return Err(format!("unknown argument {other:?}; use --out DIR").into()),
        }
    }
    memlab::profiler::set_print_at_exit(false);
    memlab::OomRecorder::new(&out).arm()?;
    let device = Device::cuda_if_available();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true))?;

    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = Attention::new(&vs.root());
    memlab::register_var_store("model", &vs);
    // Registered where it is built: its state is named from the first step on.
    let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
    let short = Tensor::randn([4, 256, HIDDEN], (Kind::Float, device));
    let long = Tensor::randn([32, 4096, HIDDEN], (Kind::Float, device));
    println!("training on {device:?}");
    for step in 0..6 {
        let x = if step == 3 { &long } else { &short };
        match train_step(&model, &mut adam, x) {
            Ok(loss) => println!("step {step}: loss {loss:.5}"),
            Err(e) => {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                println!("step {step}: failed: {first}");
                if let Some(report) = memlab::last_oom() {
                    println!("  memlab's verdict: {}", report.diagnosis.verdict.title());
                    for f in &report.files {
                        println!("  wrote {}", f.display());
                    }
                }
            }
        }
    }
    println!("continued after OOM");
    drop(recording);
    Ok(())
}
