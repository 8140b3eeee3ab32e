//! measure_model and find_batch_size on the CPU: exact parameter and optimizer
//! state bytes, a training-step peak within 1% of a real step's, the model
//! left as it was, and a batch-size search that survives failing tries.

use crate::common::serial;
use memlab::{Budget, Device, StepOptimizer};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

fn model(vs: &nn::VarStore) -> nn::Sequential {
    nn::seq().add(nn::linear(vs.root() / "fc1", 256, 512, Default::default())).add_fn(|x| x.relu()).add(nn::linear(
        vs.root() / "fc2",
        512,
        10,
        Default::default(),
    ))
}

const PARAMS: u64 = 256 * 512 + 512 + 512 * 10 + 10;

fn allocated() -> i64 {
    memlab::stats::device_stats(Device::Cpu).unwrap().allocated_bytes.all.current
}

#[test]
fn measures_parameters_activations_and_optimizer_state() {
    let _s = serial();
    tch::manual_seed(0);
    let input = Tensor::randn([128, 256], (Kind::Float, tch::Device::Cpu));
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.copy()).collect();
    let optimizers = [StepOptimizer::Sgd, StepOptimizer::SgdMomentum, StepOptimizer::Adam];
    let size = memlab::measure_model(&vs, |x| net.forward(x), &input, &optimizers).unwrap();
    println!("{size}");
    assert_eq!((size.parameters, size.parameter_bytes), (PARAMS, PARAMS * 4));
    assert_eq!(size.gradient_bytes, (PARAMS * 4) as i64);
    assert_eq!(
        size.optimizers.iter().map(|o| (o.optimizer, o.state)).collect::<Vec<_>>(),
        vec![
            (StepOptimizer::Sgd, 0),
            (StepOptimizer::SgdMomentum, (PARAMS * 4) as i64),
            (StepOptimizer::Adam, (2 * PARAMS * 4) as i64),
        ]
    );
    // Kept for backward: the first layer's 128x512 output (relu keeps its own
    // output, the same size) and the 128x10 logits.
    assert!(size.activations >= 128 * 512 * 4, "{size}");
    assert!(size.forward_peak >= size.activations && size.forward_peak_no_grad > 0);
    assert!(size.backward_peak > 0);
    // The model is left as it was: same weights, no gradients.
    for (t, b) in vs.trainable_variables().iter().zip(&before) {
        assert!(t.equal(b));
        assert!(!t.grad().defined());
    }

    // A real training loop with Adam: its steady-state peak, counted from
    // before the model existed, matches the measured figure within 1%.
    let base = allocated();
    let vs2 = nn::VarStore::new(tch::Device::Cpu);
    let net2 = model(&vs2);
    let mut opt = nn::Adam::default().build(&vs2, 1e-3).unwrap();
    opt.backward_step(&net2.forward(&input).mean(Kind::Float));
    opt.zero_grad();
    let check = memlab::check_step(|| opt.backward_step(&net2.forward(&input).mean(Kind::Float))).unwrap();
    let real =
        check.peak_above_start[&Device::Cpu] + (allocated() - base) - check.scope.escaped_bytes(Device::Cpu) as i64;
    let measured = size.optimizers.iter().find(|o| o.optimizer == StepOptimizer::Adam).unwrap().training_step_peak;
    let error = (measured - real).abs() as f64 / real as f64;
    assert!(error <= 0.01, "measured {measured}, real {real} ({:.2}%)", error * 100.0);
}

#[test]
fn measures_a_model_of_several_var_stores() {
    let _s = serial();
    memlab::clear_registry();
    let input = Tensor::randn([16, 256], (Kind::Float, tch::Device::Cpu));
    let (encoder, decoder) = (nn::VarStore::new(tch::Device::Cpu), nn::VarStore::new(tch::Device::Cpu));
    let first = nn::linear(encoder.root() / "fc", 256, 512, Default::default());
    let second = nn::linear(decoder.root() / "fc", 512, 10, Default::default());
    let forward = |x: &Tensor| second.forward(&first.forward(x).relu());
    let before: Vec<Tensor> =
        [&encoder, &decoder].iter().flat_map(|vs| vs.trainable_variables()).map(|t| t.copy()).collect();
    // Both stores, the decoder both given and registered: measured once.
    memlab::register_var_store("decoder", &decoder);
    let model = memlab::Model::registered().var_store("encoder", &encoder).var_store("decoder", &decoder);
    let size = memlab::measure_model(model, forward, &input, &[StepOptimizer::Adam]).unwrap();
    assert_eq!((size.parameters, size.parameter_bytes), (PARAMS, PARAMS * 4));
    assert_eq!(size.gradient_bytes, (PARAMS * 4) as i64);
    assert_eq!(size.optimizers[0].state, (2 * PARAMS * 4) as i64, "Adam's two moments of both stores");
    // Both left as they were: same weights, no gradients.
    let after: Vec<Tensor> = [&encoder, &decoder].iter().flat_map(|vs| vs.trainable_variables()).collect();
    for (t, b) in after.iter().zip(&before) {
        assert!(t.equal(b) && !t.grad().defined());
    }
    // The registry alone: the decoder's parameters only.
    let decoder_only = memlab::measure_model(memlab::Model::registered(), forward, &input, &[]).unwrap();
    assert_eq!(decoder_only.parameters, 512 * 10 + 10);
    memlab::clear_registry();
    let err = memlab::measure_model(memlab::Model::registered(), forward, &input, &[]).unwrap_err();
    assert!(err.to_string().contains("no var store"), "{err}");
}

#[test]
fn batch_size_search_within_a_byte_budget() {
    let _s = serial();
    // A step that holds 4 KiB per sample at its peak.
    let search = memlab::find_batch_size(Device::Cpu, Budget::Bytes(1 << 20), 10_000, |n| {
        let activations = Tensor::zeros([n as i64, 1024], (Kind::Float, tch::Device::Cpu));
        drop(activations);
        Ok(())
    })
    .unwrap();
    assert_eq!(search.largest, Some(256), "{search}");
    assert!(search.tried.len() <= 2 * 14, "{search}");
    assert!(search.tried.iter().all(|t| t.batch_size <= 512), "nothing far above the answer is tried: {search}");
}

/// The calling thread's CUDA autocast, read from libtorch: whether it is
/// on, and how deeply its regions nest.
fn cuda_autocast() -> (i32, i32) {
    // SAFETY: libtorch's own entry points, which catch its exceptions.
    unsafe {
        let nesting = torch_sys::at_autocast_increment_nesting() - 1;
        torch_sys::at_autocast_decrement_nesting();
        (torch_sys::at_autocast_is_enabled(), nesting)
    }
}

/// Where CUDA is there, `tch::autocast` turns autocast on and opens a
/// region before it runs its closure, and closes it after, without
/// unwinding: a try that runs out inside it would leave autocast on, and
/// the cast weights cached, for every later try and the program after the
/// search. The search puts the thread's autocast back after each try.
#[test]
fn a_try_that_runs_out_inside_autocast_leaves_it_as_it_was() {
    let _s = serial();
    let before = cuda_autocast();
    let search = memlab::find_batch_size(Device::Cpu, Budget::Bytes(1 << 30), 1000, |n| {
        // SAFETY: as tch::autocast calls them, before and after its closure.
        unsafe {
            torch_sys::at_autocast_set_enabled(1);
            torch_sys::at_autocast_increment_nesting();
        }
        assert!(n <= 300, "CUDA out of memory (simulated) at batch {n}");
        unsafe {
            if torch_sys::at_autocast_decrement_nesting() == 0 {
                torch_sys::at_autocast_clear_cache();
            }
            torch_sys::at_autocast_set_enabled(before.0);
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(search.largest, Some(300), "{search}");
    assert_eq!(cuda_autocast(), before, "autocast as the search found it");
}

#[test]
fn batch_size_search_survives_failures() {
    let _s = serial();
    // A step that "runs out of memory" above 300 samples, as CUDA would.
    let search = memlab::find_batch_size(Device::Cpu, Budget::Bytes(1 << 30), 1000, |n| {
        assert!(n <= 300, "CUDA out of memory (simulated) at batch {n}");
        Ok(())
    })
    .unwrap();
    assert_eq!(search.largest, Some(300), "{search}");
    assert!(search.tried.iter().any(|t| t.outcome.as_ref().is_err_and(|e| e.contains("out of memory"))));
    assert!(search.to_string().contains("failed: CUDA out of memory (simulated)"));
    let err = memlab::find_batch_size(Device::Cpu, Budget::FreeDeviceMemory, 10, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("give the CPU a Budget::Bytes"));
}
