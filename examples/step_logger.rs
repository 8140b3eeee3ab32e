//! StepLogger: RAM, GPU memory and time of the blocks that build a model (in
//! the table form, RAM read at both ends of each block) and of each step of a
//! small training run (compact lines, RAM from the background samples).
//!
//!     cargo run --release --example step_logger

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::cuda_if_available();
    let mut logger = memlab::StepLogger::new().exact_ram(true);
    if device.is_cuda() {
        logger.preinit_cuda()?;
    }
    let vs = logger.log("build the model", || nn::VarStore::new(device));
    let net = logger.log("layers", || {
        nn::seq()
            .add(nn::linear(vs.root() / "fc1", 2048, 2048, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(vs.root() / "fc2", 2048, 10, Default::default()))
    });
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let mut compact = memlab::StepLogger::new().compact(true);
    for step in 0..5 {
        compact.log(&format!("step {step}"), || {
            let x = Tensor::randn([512, 2048], (Kind::Float, device));
            opt.backward_step(&net.forward(&x).mean(Kind::Float));
        });
    }
    Ok(())
}
