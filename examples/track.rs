//! `track!()`: what grew between batch 1 and batch 2. A training loop that
//! keeps every batch's loss tensor (and with it the batch's graph) in a list
//! shows, call after call, the storages it leaves behind, grouped by shape and
//! kind, with the profiled line that allocated them.
//!
//!     cargo run --release --example track

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[memlab::profile]
fn train_batch(model: &nn::Sequential, opt: &mut nn::Optimizer, losses: &mut Vec<Tensor>) {
    let x = Tensor::randn([64, 256], (Kind::Float, Device::Cpu));
    let logits = model.forward(&x);
    let loss = logits.mean(Kind::Float);
    opt.backward_step(&loss);
    losses.push(logits); // the mistake: keeps every batch's logits
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq().add(nn::linear(vs.root() / "fc", 256, 512, Default::default())).add_fn(|x| x.relu());
    let mut opt = nn::Sgd::default().build(&vs, 1e-2)?;
    memlab::register_var_store("model", &vs);

    let mut losses = Vec::new();
    memlab::track!(); // before training: the model
    for _batch in 0..3 {
        train_batch(&model, &mut opt, &mut losses);
        memlab::track!(); // after each batch: what appeared since the last call
    }
    losses.clear();
    memlab::track!(); // and what went away once the list is emptied
    Ok(())
}
