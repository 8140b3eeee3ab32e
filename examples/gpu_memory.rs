//! Where the GPU memory went: trains a few steps, then reconciles the device
//! total, the driver's and NVML's figures, libtorch's cache and allocations and
//! the named tensors, explaining every gap. Needs a CUDA GPU.
//!
//!     cargo run --release --example gpu_memory

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !memlab::gpu::cuda_is_available() {
        println!("no CUDA device here: this example needs one");
        return Ok(());
    }
    let _recording = memlab::Recording::start(memlab::events::Settings::default())?;
    let device = Device::Cuda(0);
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 4096, 4096, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 4096, 10, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-4)?;
    for _ in 0..3 {
        let x = Tensor::randn([1024, 4096], (Kind::Float, device));
        opt.backward_step(&net.forward(&x).mean(Kind::Float));
    }
    print!("{}", memlab::where_gpu_memory_went(0)?);
    Ok(())
}
