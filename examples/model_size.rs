//! Model size, measured: parameters, activations, forward/backward peaks,
//! optimizer state and training-step peaks of an MLP on a sample batch, then
//! the largest batch size that fits a budget (on CUDA: the free memory).
//!
//!     cargo run --release --example model_size

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 1024, 4096, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(vs.root() / "fc2", 4096, 1024, Default::default()));
    let sample = Tensor::randn([64, 1024], (Kind::Float, device));
    let optimizers = [memlab::StepOptimizer::Sgd, memlab::StepOptimizer::SgdMomentum, memlab::StepOptimizer::Adam];
    let size = memlab::measure_model(&vs, |x| net.forward(x), &sample, &optimizers)?;
    println!("{size}");

    let measured = match device {
        Device::Cuda(i) => memlab::Device::Cuda(i),
        _ => memlab::Device::Cpu,
    };
    let budget = match measured {
        memlab::Device::Cuda(_) => memlab::Budget::FreeDeviceMemory,
        memlab::Device::Cpu => memlab::Budget::Bytes(256 << 20),
    };
    let mut opt = nn::Adam::default().build(&vs, 1e-4)?;
    let search = memlab::find_batch_size(measured, budget, 1 << 16, |batch| {
        let x = Tensor::randn([batch as i64, 1024], (Kind::Float, device));
        opt.backward_step(&net.forward(&x).mean(Kind::Float));
        Ok(())
    })?;
    print!("{search}");
    Ok(())
}
