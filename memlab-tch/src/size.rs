//! How much memory a model needs, measured rather than estimated: parameters,
//! activations kept for backward, the peaks of forward (with and without
//! autograd), backward and a whole training step, and the state of common
//! optimizers, each from running the model once on a sample batch. Plus
//! "will it fit?": the largest batch size that stays within a budget, found by
//! trying batch sizes, with out-of-memory failures caught.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use memlab_core::profiler::PeakWatch;
use memlab_core::{format_bytes, Device, Error, Result};
use tch::nn::{self, OptimizerConfig, VarStore};
use tch::{Kind, Tensor};

use crate::BACKEND;

/// An optimizer whose state [`measure_model`] measures with a real step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOptimizer {
    /// SGD without momentum.
    Sgd,
    /// SGD with momentum 0.9.
    SgdMomentum,
    /// Adam.
    Adam,
    /// AdamW.
    AdamW,
}

impl StepOptimizer {
    fn build(self, vs: &VarStore) -> Result<nn::Optimizer> {
        let built = match self {
            StepOptimizer::Sgd => nn::Sgd::default().build(vs, 1e-3),
            StepOptimizer::SgdMomentum => nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, 1e-3),
            StepOptimizer::Adam => nn::Adam::default().build(vs, 1e-3),
            StepOptimizer::AdamW => nn::AdamW::default().build(vs, 1e-3),
        };
        built.map_err(torch)
    }
}

/// What [`measure_model`] found. All byte counts are measured on the model's
/// device, as its allocator counts them (on CUDA every block is rounded up to
/// a multiple of 512 bytes); peaks are above what was allocated before each
/// phase began. `parameter_bytes` is the storages' own size.
#[derive(Clone, Debug)]
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
    /// Per optimizer: the bytes its state takes, from a real step.
    pub optimizer_state: Vec<(StepOptimizer, i64)>,
    /// Per optimizer: the memory a steady-state training step needs at its
    /// peak: parameters, optimizer state, and the highest the step itself
    /// (activations, gradients, temporaries) rose above them.
    pub training_step_peak: Vec<(StepOptimizer, i64)>,
}

/// Measures `forward` on `input` with the variables of `vs`, for the given
/// optimizers. The model is left as it was: its weights are restored after
/// the optimizer steps and its gradients cleared.
///
/// The output of `forward` is reduced with `mean()` for backward.
pub fn measure_model(
    vs: &VarStore,
    forward: impl Fn(&Tensor) -> Tensor,
    input: &Tensor,
    optimizers: &[StepOptimizer],
) -> Result<ModelSize> {
    let device = crate::device_of(vs.device());
    let variables = vs.trainable_variables();
    let parameters: u64 = variables.iter().map(|t| t.numel() as u64).sum();
    let parameter_bytes: u64 =
        variables.iter().map(|t| crate::storage_info(t).map(|i| i.nbytes)).sum::<Result<u64>>()?;
    // Copies to restore the weights from after the optimizer steps (on the
    // CPU, `to_device` would return the tensor itself, not a copy).
    let saved: Vec<Tensor> = variables
        .iter()
        .map(|t| if t.device() == tch::Device::Cpu { t.copy() } else { t.to_device(tch::Device::Cpu) })
        .collect();
    clear_grads(vs)?;

    let (forward_peak_no_grad, _, ()) = peak_of(device, || drop(tch::no_grad(|| forward(input))))?;
    let (forward_peak, activations, output) = peak_of(device, || forward(input))?;
    if !output.requires_grad() {
        return Err(Error::Torch(
            "the forward pass's output does not require grad, so there is no backward pass to measure: \
             give measure_model a forward that uses the var store's trainable variables (not under no_grad, \
             and without detach)"
                .to_string(),
        ));
    }
    let (backward_peak, _, ()) = peak_of(device, || output.mean(Kind::Float).backward())?;
    drop(output);
    let gradient_bytes: i64 = variables
        .iter()
        .filter_map(crate::grad_of)
        .map(|g| crate::storage_info(&g).map(|i| i.nbytes as i64))
        .sum::<Result<i64>>()?;
    clear_grads(vs)?;

    let mut optimizer_state = Vec::new();
    let mut training_step_peak = Vec::new();
    for &kind in optimizers {
        let mut opt = kind.build(vs)?;
        // The first step creates the optimizer's state...
        let before = allocated(device)?;
        opt.backward_step(&forward(input).mean(Kind::Float));
        opt.zero_grad();
        let state = allocated(device)? - before;
        // ...the second is a steady-state step, state already there.
        let (peak, _, ()) = peak_of(device, || opt.backward_step(&forward(input).mean(Kind::Float)))?;
        opt.zero_grad();
        optimizer_state.push((kind, state));
        training_step_peak.push((kind, parameter_bytes as i64 + state + peak));
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
        optimizer_state,
        training_step_peak,
    })
}

fn torch(e: tch::TchError) -> Error {
    Error::Torch(e.to_string())
}

fn allocated(device: Device) -> Result<i64> {
    Ok(crate::device_stats(device)?.allocated_bytes.all.current)
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

/// Drops the gradients of the variables of `vs` (they read as undefined
/// again): tch offers no way to do it but an optimizer's `zero_grad`, which
/// sets them to none (libtorch's default).
fn clear_grads(vs: &VarStore) -> Result<()> {
    nn::Sgd::default().build(vs, 0.0).map_err(torch)?.zero_grad();
    Ok(())
}

impl fmt::Display for ModelSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |label: &str, v: i64| format!("{label:.<44}{:>10}\n", format_bytes(v));
        writeln!(f, "Model size on {} (measured on the sample batch)", self.device)?;
        writeln!(f, "{:.<44}{:>10}", "parameters", self.parameters)?;
        f.write_str(&row("parameter bytes", self.parameter_bytes as i64))?;
        f.write_str(&row("forward peak, no grad", self.forward_peak_no_grad))?;
        f.write_str(&row("forward peak, with grad", self.forward_peak))?;
        f.write_str(&row("activations kept for backward (+ output)", self.activations))?;
        f.write_str(&row("backward peak", self.backward_peak))?;
        f.write_str(&row("gradients", self.gradient_bytes))?;
        for (kind, bytes) in &self.optimizer_state {
            f.write_str(&row(&format!("optimizer state, {kind:?}"), *bytes))?;
        }
        for (kind, bytes) in &self.training_step_peak {
            f.write_str(&row(&format!("training step peak, {kind:?}"), *bytes))?;
        }
        Ok(())
    }
}

/// How much memory [`find_batch_size`] may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// At most this many bytes allocated above what was allocated before each try.
    Bytes(i64),
    /// What the CUDA device has free now (driver's free bytes plus the cache's
    /// unused bytes).
    FreeDeviceMemory,
}

/// What [`find_batch_size`] tried and found.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct BatchSearch {
    /// The largest batch size that ran within the budget (`None`: not even 1).
    pub largest: Option<usize>,
    /// The budget in bytes.
    pub budget: i64,
    /// Every try: batch size, and its peak in bytes or why it failed.
    pub tried: Vec<(usize, std::result::Result<i64, String>)>,
}

/// Finds the largest batch size in `1..=max` whose `step` stays within
/// `budget` on `device`, by doubling and then binary search over real runs of
/// `step` (like
/// accelerate's `find_executable_batch_size`, but measured: a try fails when
/// its peak exceeds the budget or when it panics or errs, e.g. CUDA out of
/// memory). Failures are caught and the CUDA cache emptied after each try, so
/// the process stays healthy. Any `max` works, `usize::MAX` included.
///
/// The out-of-memory panics of the tries are caught and not printed; every
/// other panic (of another thread, or a try's panic that is not an
/// out-of-memory error) still reaches the panic hook that was in place when
/// the search began, which is in place again when it returns.
pub fn find_batch_size(
    device: Device,
    budget: Budget,
    max: usize,
    mut step: impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
) -> Result<BatchSearch> {
    let budget = match budget {
        Budget::Bytes(b) => b,
        Budget::FreeDeviceMemory => match device {
            Device::Cuda(i) => {
                let (free, _) = crate::cuda_mem_info(i)?;
                let s = crate::device_stats(device)?;
                free as i64 + s.reserved_bytes.all.current - s.allocated_bytes.all.current
            }
            Device::Cpu => {
                return Err(Error::Torch("FreeDeviceMemory is a CUDA budget; give the CPU a Budget::Bytes".to_string()))
            }
        },
    };
    let mut search = BatchSearch { largest: None, budget, tried: Vec::new() };
    let _quiet = quiet_oom_panics::install();
    let mut run = |n: usize| {
        let outcome = try_once(device, &mut step, n);
        let ok = matches!(outcome, Ok(peak) if peak <= budget);
        search.tried.push((n, outcome));
        ok
    };
    // Double from 1 until a try fails, so that nothing far above the answer
    // is tried (on the CPU a too-large try is not an error but a swap storm);
    // then halve the gap. `fails` is the smallest size known to fail, if any.
    let (mut fits, mut fails) = (0usize, None::<usize>);
    let mut n = 1;
    while n <= max {
        if !run(n) {
            fails = Some(n);
            break;
        }
        fits = n;
        if n == max {
            break;
        }
        n = n.saturating_mul(2).min(max);
    }
    if let Some(mut fails) = fails {
        while fails - fits > 1 {
            let n = fits + (fails - fits) / 2;
            if run(n) {
                fits = n;
            } else {
                fails = n;
            }
        }
    }
    search.largest = (fits > 0).then_some(fits);
    Ok(search)
}

/// Keeps the panics of a batch search's own out-of-memory tries from being
/// printed. While searches run, the panic hook is a wrapper that passes every
/// panic on to the hook that was in place before, except an out-of-memory
/// panic raised on a thread while it runs a try; when the last search ends,
/// that hook is put back. Panics of every other thread, and of a search's
/// thread outside its tries, are reported as always.
mod quiet_oom_panics {
    use std::cell::Cell;
    use std::panic::PanicHookInfo;
    use std::sync::{Arc, Mutex};

    type Hook = Arc<dyn Fn(&PanicHookInfo<'_>) + Send + Sync>;

    thread_local! {
        static TRYING: Cell<bool> = const { Cell::new(false) };
    }

    /// The searches running, and the hook that was in place before the first.
    static SEARCHES: Mutex<(usize, Option<Hook>)> = Mutex::new((0, None));

    /// The wrapper is in place while the guard lives.
    pub(super) struct Installed(());

    pub(super) fn install() -> Installed {
        let mut searches = SEARCHES.lock().unwrap_or_else(|e| e.into_inner());
        if searches.0 == 0 {
            let previous: Hook = Arc::from(std::panic::take_hook());
            let passed = previous.clone();
            std::panic::set_hook(Box::new(move |info| {
                if !(TRYING.try_with(Cell::get).unwrap_or(false) && is_oom(info)) {
                    passed(info);
                }
            }));
            searches.1 = Some(previous);
        }
        searches.0 += 1;
        Installed(())
    }

    impl Drop for Installed {
        fn drop(&mut self) {
            let mut searches = SEARCHES.lock().unwrap_or_else(|e| e.into_inner());
            searches.0 -= 1;
            if searches.0 == 0 {
                if let Some(previous) = searches.1.take() {
                    drop(std::panic::take_hook());
                    std::panic::set_hook(Box::new(move |info| previous(info)));
                }
            }
        }
    }

    /// Marks the calling thread as running a try while `f` runs.
    pub(super) fn trying<R>(f: impl FnOnce() -> R) -> R {
        struct Reset(bool);
        impl Drop for Reset {
            fn drop(&mut self) {
                let _ = TRYING.try_with(|t| t.set(self.0));
            }
        }
        let _reset = Reset(TRYING.try_with(|t| t.replace(true)).unwrap_or(false));
        f()
    }

    fn is_oom(info: &PanicHookInfo<'_>) -> bool {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        super::is_out_of_memory(message)
    }
}

/// Whether a failure message says memory ran out (libtorch's CUDA and CPU
/// messages, and the allocator's own).
fn is_out_of_memory(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("out of memory") || lower.contains("outofmemory") || lower.contains("failed to allocate")
}

fn try_once(
    device: Device,
    step: &mut impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
    n: usize,
) -> std::result::Result<i64, String> {
    let _ = crate::empty_cache();
    let watch = PeakWatch::start(&BACKEND, device).map_err(|e| e.to_string())?;
    let ran = quiet_oom_panics::trying(|| catch_unwind(AssertUnwindSafe(|| step(n))));
    let measured = watch.finish().map_err(|e| e.to_string());
    let _ = crate::empty_cache();
    match ran {
        Ok(Ok(())) => {
            let (start, end) = measured?;
            Ok(end.to_device_stats().allocated_bytes.all.peak - start.to_device_stats().allocated_bytes.all.current)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the step panicked".to_string())),
    }
}

impl fmt::Display for BatchSearch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.largest {
            Some(n) => writeln!(f, "largest batch size within {}: {n}", format_bytes(self.budget))?,
            None => writeln!(f, "no batch size fits within {}", format_bytes(self.budget))?,
        }
        for (n, outcome) in &self.tried {
            match outcome {
                Ok(peak) => writeln!(f, "  batch {n:>6}: peak {}", format_bytes(*peak))?,
                Err(e) => {
                    // libtorch's messages run on with a C++ stack trace; the first sentence says it.
                    let first = e.split(['\n']).next().unwrap_or("").split("\\n").next().unwrap_or("");
                    let short: String = first.chars().take(160).collect();
                    writeln!(f, "  batch {n:>6}: failed: {short}")?
                }
            }
        }
        Ok(())
    }
}
