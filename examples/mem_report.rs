//! MemReporter on a small model: what occupies memory, by name, before and
//! after a backward pass, with the activations the autograd graph keeps listed
//! by the statement that allocated them, and after an Adam step, with the
//! optimizer's moments named after their parameters.
//!
//!     cargo run --release --example mem_report [-- --verbose]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[memlab::profile]
fn forward(model: &nn::Sequential, x: &Tensor) -> Tensor {
    let logits = model.forward(x);
    let loss = logits.mean(Kind::Float);
    loss
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    let device = Device::cuda_if_available();
    // Recording from the start lets the reporter name the site of every
    // allocation that no named tensor owns.
    let _recording = memlab::Recording::start(memlab::events::Settings::default())?;
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "encoder", 1024, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "head", 1024, 16, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut adam = nn::Adam::default().build(&vs, 1e-3)?;
    let input = Tensor::randn([512, 1024], (Kind::Float, device));
    memlab::register_tensor("input", &input)?;

    let loss = forward(&model, &input);
    println!("========= before backward =========");
    print!("{}", memlab::MemReporter::registered().report()?);
    loss.backward();
    println!("========= after backward =========");
    print!("{}", memlab::MemReporter::registered().report()?);
    adam.step();
    drop(loss);
    println!("========= after an Adam step =========");
    // The optimizer is borrowed for this call only: its state is read now.
    print!("{}", memlab::MemReporter::registered().optimizer(&adam).report()?);
    Ok(())
}
