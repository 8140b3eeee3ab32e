//! How much memory a model needs, measured rather than estimated: parameters,
//! activations kept for backward, the peaks of forward (with and without
//! autograd), backward and a whole training step, and the state of common
//! optimizers, each from running the model once on a sample batch. (Whether
//! a batch fits is [`batch_size`](crate::batch_size)'s question.)
//!
//! ```rust,no_run
//! # use tch::nn::Module;
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! # let net = tch::nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
//! # let sample = tch::Tensor::zeros([64, 1024], (tch::Kind::Float, tch::Device::Cpu));
//! let size = memlab::measure_model(&vs, |x| net.forward(x), &sample, &[memlab::StepOptimizer::Adam])?;
//! println!("{size}");   // parameters, activations, forward/backward peaks, optimizer state, step peak
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`measure_model`] runs the model on the sample batch
//! instead of guessing: the parameters, the peaks of a forward pass with and
//! without autograd, what it keeps for backward, the backward peak, the state
//! of each optimizer asked for (SGD with or without momentum, Adam and AdamW
//! with or without amsgrad, RMSprop plain or centred with momentum), read from
//! the optimizer after a real step, and the peak of a steady-state training
//! step (within 1% of a real one in the tests). The model is left as it was.
//! It is a var store, or a [`Model`] of several
//! (`Model::registered()` for those registered).
//! `cargo run --release --example model_size`.

use serde::Serialize;
use std::sync::Arc;

use memlab_core::profiler::PeakWatch;
use memlab_core::render::{Cell, Document, Render};
use memlab_core::{Device, Error, Result};
use tch::nn::{self, OptimizerConfig, VarStore};
use tch::{Kind, Tensor};

use memlab_tch::optimizer::StepOptimizer;
use memlab_tch::BACKEND;

use crate::named::{Model, OptimizerStates};

/// What [`measure_model`] found. All byte counts are measured on the model's
/// device, as its allocator counts them (on CUDA every block is rounded up to
/// a multiple of 512 bytes); peaks are above what was allocated before each
/// phase began. `parameter_bytes` is the storages' own size.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ModelSize {
    /// The device measured.
    pub device: Device,
    /// Number of parameters.
    pub parameters: u64,
    /// Bytes of the parameters.
    pub parameter_bytes: u64,
    /// Peak of a forward pass without autograd.
    pub forward_peak_no_grad: i64,
    /// Peak of a forward pass with autograd.
    pub forward_peak: i64,
    /// What a forward pass with autograd leaves allocated until backward:
    /// the activations saved for it, and the output.
    pub activations: i64,
    /// Peak of the backward pass, above the memory held when it began.
    pub backward_peak: i64,
    /// Bytes of the gradients backward created.
    pub gradient_bytes: i64,
    /// Each optimizer asked for, in the order asked.
    pub optimizers: Vec<OptimizerSize>,
}

/// What one optimizer takes, measured with a real step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OptimizerSize {
    /// The optimizer as configured.
    pub optimizer: StepOptimizer,
    /// The bytes of its state after a real step, read from the optimizer
    /// itself (the state tensors' own size, like `parameter_bytes`).
    pub state: i64,
    /// The memory a steady-state training step needs at its peak:
    /// parameters, optimizer state, and the highest the step itself
    /// (activations, gradients, temporaries) rose above them.
    pub training_step_peak: i64,
}

/// Measures `forward` on `input` with the trainable variables of the var
/// stores of `model` (a var store is a model, `measure_model(&vs, ..)`;
/// `Model::registered()` takes the registered ones: see [`Model`]), for the
/// given optimizers. The model's named tensors and optimizer state are not
/// its parameters, and are left out. The model is left as it was: its
/// weights are restored after the optimizer steps and its gradients cleared.
///
/// The output of `forward` is reduced with `mean()` for backward. tch builds
/// an optimizer over one var store: each optimizer asked for is built over
/// each var store, and a step steps them all, as a training loop over
/// several var stores does.
pub fn measure_model(
    model: impl Into<Model>,
    forward: impl Fn(&Tensor) -> Tensor,
    input: &Tensor,
    optimizers: &[StepOptimizer],
) -> Result<ModelSize> {
    let stores = var_stores(model.into());
    if stores.is_empty() {
        return Err(Error::InvalidArgument(
            "the model has no var store to measure: give measure_model a var store (`&vs`), or a Model with one"
                .to_string(),
        ));
    }
    let variables: Vec<Tensor> = stores.iter().flat_map(VarStore::trainable_variables).collect();
    let device = memlab_tch::device_of(variables.first().map_or(input.device(), Tensor::device));
    let parameters: u64 = variables.iter().map(|t| t.numel() as u64).sum();
    let parameter_bytes: u64 =
        variables.iter().map(|t| memlab_tch::storage_info(t).map(|i| i.nbytes)).sum::<Result<u64>>()?;
    // Copies to restore the weights from after the optimizer steps (on the
    // CPU, `to_device` would return the tensor itself, not a copy).
    let saved: Vec<Tensor> = variables
        .iter()
        .map(|t| if t.device() == tch::Device::Cpu { t.copy() } else { t.to_device(tch::Device::Cpu) })
        .collect();
    clear_grads(&stores)?;

    let (forward_peak_no_grad, _, ()) = peak_of(device, || drop(tch::no_grad(|| forward(input))))?;
    let (forward_peak, activations, output) = peak_of(device, || forward(input))?;
    if !output.requires_grad() {
        return Err(Error::InvalidArgument(
            "the forward pass's output does not require grad, so there is no backward pass to measure: \
             give measure_model a forward that uses the model's trainable variables (not under no_grad, \
             and without detach)"
                .to_string(),
        ));
    }
    let (backward_peak, _, ()) = peak_of(device, || output.mean(Kind::Float).backward())?;
    drop(output);
    let gradient_bytes: i64 = variables
        .iter()
        .filter_map(memlab_tch::grad_of)
        .map(|g| memlab_tch::storage_info(&g).map(|i| i.nbytes as i64))
        .sum::<Result<i64>>()?;
    clear_grads(&stores)?;

    let mut sizes = Vec::new();
    for &kind in optimizers {
        let mut opts = stores.iter().map(|vs| kind.build(vs)).collect::<Result<Vec<_>>>()?;
        // The first step creates the optimizer's state: what it holds is read
        // from the optimizer; what it costs the allocator (block rounding
        // included) counts towards the step's peak...
        let before = allocated(device)?;
        backward_step(&mut opts, &forward(input).mean(Kind::Float));
        opts.iter_mut().for_each(nn::Optimizer::zero_grad);
        let state_allocated = allocated(device)? - before;
        let mut seen = std::collections::HashSet::new();
        let mut state = 0i64;
        for (opt, vs) in opts.iter().zip(&stores) {
            let states = OptimizerStates::read(opt, &[(String::new(), vs.variables_.clone())])?;
            for (_, tensor) in &states.tensors {
                let info = memlab_tch::storage_info(tensor)?;
                if info.device == Some(device) && seen.insert(info.storage_id) {
                    state += info.nbytes as i64;
                }
            }
        }
        // ...the second is a steady-state step, state already there.
        let (peak, _, ()) = peak_of(device, || backward_step(&mut opts, &forward(input).mean(Kind::Float)))?;
        opts.iter_mut().for_each(nn::Optimizer::zero_grad);
        sizes.push(OptimizerSize {
            optimizer: kind,
            state,
            training_step_peak: parameter_bytes as i64 + state_allocated + peak,
        });
    }
    tch::no_grad(|| {
        for (t, s) in variables.iter().zip(&saved) {
            let mut t = t.shallow_clone();
            t.copy_(s);
        }
    });
    Ok(ModelSize {
        device,
        parameters,
        parameter_bytes,
        forward_peak_no_grad,
        forward_peak,
        activations,
        backward_peak,
        gradient_bytes,
        optimizers: sizes,
    })
}

/// The var stores of `model`, each once (a store given and registered too
/// is one store), as tch's `VarStore`s sharing their variables, which is
/// what tch builds optimizers over. Their `device()` is not the store's:
/// nothing here reads it or makes a variable.
fn var_stores(model: Model) -> Vec<VarStore> {
    let mut stores: Vec<VarStore> = Vec::new();
    for (_, variables) in model.stores() {
        if !stores.iter().any(|vs| Arc::ptr_eq(&vs.variables_, &variables)) {
            let mut vs = VarStore::new(tch::Device::Cpu);
            vs.variables_ = variables;
            stores.push(vs);
        }
    }
    stores
}

/// tch's `backward_step` over several optimizers: their gradients cleared,
/// one backward pass, each optimizer stepped.
fn backward_step(optimizers: &mut [nn::Optimizer], loss: &Tensor) {
    optimizers.iter_mut().for_each(nn::Optimizer::zero_grad);
    loss.backward();
    optimizers.iter_mut().for_each(nn::Optimizer::step);
}

fn allocated(device: Device) -> Result<i64> {
    Ok(memlab_tch::device_stats(device)?.allocated_bytes.all.current)
}

/// Runs `f` and returns how far allocated memory peaked above where it began,
/// where it ended relative to that, and what `f` returned.
fn peak_of<R>(device: Device, f: impl FnOnce() -> R) -> Result<(i64, i64, R)> {
    let watch = PeakWatch::start(&BACKEND, device)?;
    let value = f();
    let (start, end) = watch.finish()?;
    let (start, end) = (start.to_device_stats(), end.to_device_stats());
    Ok((
        end.allocated_bytes.all.peak - start.allocated_bytes.all.current,
        end.allocated_bytes.all.current - start.allocated_bytes.all.current,
        value,
    ))
}

/// Drops the gradients of the variables of `stores` (they read as undefined
/// again): tch offers no way to do it but an optimizer's `zero_grad`, which
/// sets them to none (libtorch's default).
fn clear_grads(stores: &[VarStore]) -> Result<()> {
    for vs in stores {
        nn::Sgd::default().build(vs, 0.0).map_err(memlab_tch::torch_error)?.zero_grad();
    }
    Ok(())
}

displayed_as_text!(ModelSize);

impl Render for ModelSize {
    fn document(&self) -> Document {
        const WIDTH: usize = 44;
        let mut doc = Document::new();
        doc.heading(format!("Model size on {} (measured on the sample batch)", self.device));
        doc.label(WIDTH, "parameters", self.parameters.to_string());
        let rows = [
            ("parameter bytes", self.parameter_bytes as i64),
            ("forward peak, no grad", self.forward_peak_no_grad),
            ("forward peak, with grad", self.forward_peak),
            ("activations kept for backward (+ output)", self.activations),
            ("backward peak", self.backward_peak),
            ("gradients", self.gradient_bytes),
        ];
        for (label, bytes) in rows {
            doc.label(WIDTH, label, Cell::bytes(bytes));
        }
        for o in &self.optimizers {
            doc.label(WIDTH, format!("optimizer state, {:?}", o.optimizer), Cell::bytes(o.state));
        }
        for o in &self.optimizers {
            doc.label(WIDTH, format!("training step peak, {:?}", o.optimizer), Cell::bytes(o.training_step_peak));
        }
        doc
    }
}
