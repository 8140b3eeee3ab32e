//! Sizing on CUDA: `measure_model`, `find_batch_size` and where the GPU's
//! memory went.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn model_size_and_batch_search_on_cuda() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let net = cuda_model(&vs, 1024);
    let sample = Tensor::randn([64, 1024], (Kind::Float, GPU));
    let size = memlab::measure_model(&vs, |x| net.forward(x), &sample, &[memlab::StepOptimizer::Adam]).unwrap();
    println!("{size}");
    let params = (2 * (1024 * 1024 + 1024) + 1024 * 10 + 10) * 4;
    assert_eq!(size.parameter_bytes, params as u64);
    // Read from the optimizer: the state tensors' own bytes, two moments.
    let adam: Vec<(memlab::StepOptimizer, i64)> = size.optimizers.iter().map(|o| (o.optimizer, o.state)).collect();
    assert_eq!(adam, vec![(memlab::StepOptimizer::Adam, 2 * params)]);
    // The search meets real CUDA out-of-memory errors and the process stays healthy.
    let mut opt = tch::nn::Adam::default().build(&vs, 1e-4).unwrap();
    let search = memlab::find_batch_size(Device::Cuda(0), memlab::Budget::FreeDeviceMemory, 1 << 24, |batch| {
        let x = Tensor::randn([batch as i64, 1024], (Kind::Float, GPU));
        opt.backward_step(&net.forward(&x).mean(Kind::Float));
        Ok(())
    })
    .unwrap();
    print!("{search}");
    assert!(search.largest.is_some_and(|n| n > 1000));
    // Its out-of-memory failures (some on the autograd engine's own thread)
    // are the search's: it says why the first failed.
    let memlab::batch_size::FirstOom { batch_size: batch, diagnosis: why, .. } =
        search.first_oom.as_ref().expect("the first failing batch's verdict");
    assert!(*batch > 1000 && why.device == Device::Cuda(0), "{batch} {why:?}");
    let after = floats(1024);
    assert_eq!(after.sum(Kind::Float).double_value(&[]), 0.0, "CUDA still works");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn where_the_gpu_memory_went() {
    let _s = serial();
    let _recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    memlab::register_var_store("model", &vs);
    let stray = floats(1 << 20);
    let account = memlab::where_gpu_memory_went(0).unwrap();
    println!("{account}");
    let sum: i64 = account.parts.iter().map(|p| p.bytes).sum();
    assert_eq!(sum, account.total as i64, "the parts add up to the device's total");
    assert!(account.named >= (2 * 2048 * 2048 * 4) as i64);
    assert!(account.parts.iter().any(|p| p.label.starts_with("allocated, not named") && p.bytes >= 4 << 20));
    memlab::clear_registry();
    drop(stray);
}
