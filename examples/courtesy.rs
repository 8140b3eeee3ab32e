//! Courtesy with an optimizer: train a model with Adam on the GPU, give the
//! GPU back (parameters, gradients and Adam's moments go to the CPU), take it
//! again and train on from exactly where it was.
//!
//!     cargo run --release --example courtesy

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    if !tch::Cuda::is_available() {
        println!("no CUDA device: nothing to give back (Courtesy moves GPU memory only)");
        return Ok(());
    }
    let device = Device::Cuda(0);
    tch::manual_seed(1);
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "encoder", 2048, 2048, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "hidden", 2048, 2048, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "head", 2048, 10, Default::default()));
    let mut adam = nn::Adam::default().build(&vs, 1e-4)?;
    let x = Tensor::randn([256, 2048], (Kind::Float, device));
    let y = Tensor::randint(10, [256], (Kind::Int64, device));
    let train = |adam: &mut nn::Optimizer, steps: usize| -> f64 {
        let mut last = 0.0;
        for _ in 0..steps {
            let loss = model.forward(&x).cross_entropy_for_logits(&y);
            adam.backward_step(&loss);
            last = loss.double_value(&[]);
        }
        last
    };
    println!("loss after 5 steps: {:.6}", train(&mut adam, 5));

    let mut courtesy = memlab::Courtesy::of(&vs);
    // The optimizer is borrowed for the call; restore() needs only the guard.
    let report = courtesy.yield_memory_with(&mut adam)?;
    print!("{report}");
    let restored = courtesy.restore()?;
    println!("restored {restored} tensors to {device:?}");
    println!("loss after 5 more steps: {:.6}", train(&mut adam, 5));
    Ok(())
}
