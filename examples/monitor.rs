//! TrainingMonitor on a small MLP: per-iteration cache, weights, gradients,
//! optimizer state and feature maps, printed every 4 iterations and appended
//! to CSV files in `memlab_csv/`.
//!
//!     cargo run --release --example monitor

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 512, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 1024, 10, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    std::fs::create_dir_all("memlab_csv")?;
    let mut monitor = memlab::TrainingMonitor::new(&vs).print_period(4).csv_dir("memlab_csv");
    for _epoch in 0..2 {
        for _batch in 0..8 {
            let x = Tensor::randn([128, 512], (Kind::Float, device));
            let y = Tensor::randint(10, [128], (Kind::Int64, device));
            let loss = model.forward(&x).cross_entropy_for_logits(&y);
            monitor.mark_backward(); // separates feature maps from intermediate gradients
            opt.backward_step(&loss);
            monitor.record_stats_with(&opt); // Adam's moments, exact, tensor by tensor
        }
        monitor.epoch_end();
    }
    if let Some(e) = monitor.last_error() {
        eprintln!("{e}");
    }
    println!("CSV files: memlab_csv/memlab_iterations.csv, memlab_csv/memlab_variables.csv");
    Ok(())
}
