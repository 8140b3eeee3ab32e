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

/// A try that runs out of memory inside `tch::autocast`, which does not
/// unwind: the search puts the thread's autocast back after it, so the cast
/// weights autocast cached are given back and later tries (and the program
/// after the search) run with autocast as it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_try_that_runs_out_inside_autocast_gives_its_cast_weights_back() {
    use tch::nn::Module;
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let linear = tch::nn::linear(vs.root(), 1024, 1024, Default::default());
    let x = Tensor::ones([8, 1024], (Kind::Float, GPU));
    // The thread's cuBLAS workspaces, made at its first product, stay.
    let _ = tch::autocast(true, || linear.forward(&x));
    let before = allocated();
    let search = memlab::find_batch_size(Device::Cuda(0), memlab::Budget::Bytes(i64::MAX), 1 << 12, |batch| {
        tch::autocast(true, || {
            // Casts the weight to f16 and keeps the cast for the region.
            let y = linear.forward(&x);
            assert_eq!(y.kind(), Kind::Half);
            // From 512 on, a GiB a sample: more than the card.
            if batch >= 512 {
                let _huge = Tensor::empty([batch as i64, 1 << 28], (Kind::Float, GPU));
            }
        });
        Ok(())
    })
    .unwrap();
    assert_eq!(search.largest, Some(511), "{search}");
    // SAFETY: libtorch's own entry point, which catches its exceptions.
    assert_eq!(unsafe { torch_sys::at_autocast_is_enabled() }, 0, "autocast is off after the search");
    assert_eq!(allocated(), before, "no cast weight is left cached");
    let y = linear.forward(&x);
    assert_eq!(y.kind(), Kind::Float, "the program's ops run in f32 again");
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
