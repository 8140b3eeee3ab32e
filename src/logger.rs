//! `StepLogger`: RAM, GPU memory and time of a step, a block or a closure, in
//! the manner of ipygpulogger: for general RAM (the process's resident set)
//! and for the GPU, what the step consumed, how far it peaked above that, what
//! is used after it and the total, and how long it took.
//!
//! ```rust,no_run
//! let mut logger = memlab::StepLogger::new();            // .compact(true) for one line a step
//! let loss = logger.log("epoch 1", || 0.0 /* train */);  // prints when the step ends
//! println!("{:?}", logger.data());                       // the same figures, as data
//! ```
//!
//! The GPU figures come from libtorch's allocator (exact, peak included) and,
//! where a driver is present, from the driver: device-wide use and its peak,
//! sampled by a background thread during the step (they catch memory outside
//! libtorch, such as other libraries' workspaces or other processes), and this
//! process's own use from NVML (the `cuda-driver` and `nvml` features, on by
//! default: a build without one leaves those figures `None`). The same
//! thread samples the resident set every millisecond; the RAM figures come
//! from its readings unless
//! [`StepLogger::exact_ram`](crate::StepLogger::exact_ram) reads the resident set at the step's ends (two
//! system calls a step) and
//! [`StepLogger::exact_ram_peak`](crate::StepLogger::exact_ram_peak) takes the RAM peak from the kernel's
//! high-water mark; figures that come from samples are labelled "sampled". By
//! default, then, the step's own thread reads only the allocator and the clock,
//! and logging every step of a training loop costs it a few microseconds: under
//! 1% of a millisecond-long GPU step (see `BENCHMARKS.md`).
//!
//! `.clear_cache(true)` empties the CUDA cache before each step;
//! `preinit_cuda()` initialises CUDA up front and reports the context's cost
//! once. Without a GPU the GPU line says so; nothing panics.
//! `cargo run --release --example step_logger`.
//!
//! While a [`Recording`](crate::Recording) runs, each step is a span of the
//! recording's timeline, and the allocations that hold the model's
//! parameters, gradients and optimizer state after it are noted, so that
//! an export names them even once they have died. The model is the
//! registry's, or the one given to [`StepLogger::of`](crate::StepLogger::of).

use std::time::Duration;

use memlab_core::events::SpanKind;
use memlab_core::render::Cell;
use memlab_core::{Backend, Result};
use memlab_tch::{driver_memory, BACKEND};

use crate::named::Model;
pub use crate::step_figures::{host_memory, rss, CpuFigures, GpuFigures, RamFigures, StepData};
use crate::step_figures::{How, Measure};

/// Logs the memory and time of steps. See the module documentation.
///
/// ```
/// let mut logger = memlab::StepLogger::new().compact(true);
/// let sum = logger.log("sum", || tch::Tensor::ones([1 << 20], (tch::Kind::Float, tch::Device::Cpu)).sum(tch::Kind::Float));
/// let data = logger.data().unwrap();
/// assert!(data.ram.total > 0);
/// # drop(sum);
/// ```
pub struct StepLogger {
    compact: bool,
    how: How,
    running: bool,
    last: Option<StepData>,
    context_reported: bool,
    model: Model,
}

impl Default for StepLogger {
    fn default() -> Self {
        StepLogger::new()
    }
}

impl StepLogger {
    /// A logger that prints a report after every step (see [`stop`](Self::stop)).
    pub fn new() -> StepLogger {
        StepLogger {
            compact: false,
            how: How::default(),
            running: true,
            last: None,
            context_reported: false,
            model: Model::registered(),
        }
    }

    /// Names the memory of the steps after `model` (or a var store,
    /// `of(&vs)`) rather than the registry (see [`Model`]). While a
    /// [`Recording`](crate::Recording) runs, the logger notes after each
    /// step which allocations hold the model's parameters, gradients and
    /// optimizer state, so that an export names them as such even once
    /// they have died (a step's gradients, freed by the next `zero_grad`).
    pub fn of(mut self, model: impl Into<Model>) -> StepLogger {
        self.model = model.into();
        self
    }

    /// One line per step instead of the three-line table.
    pub fn compact(mut self, compact: bool) -> StepLogger {
        self.compact = compact;
        self
    }

    /// Takes the RAM peak from the kernel's high-water mark, reset before each
    /// step (exact, where Linux allows it; costs a few system calls a step),
    /// instead of the background samples.
    pub fn exact_ram_peak(mut self, exact: bool) -> StepLogger {
        self.how.exact_ram_peak = exact;
        self
    }

    /// Reads the resident set at the step's two ends, on the step's own
    /// thread, instead of taking the background thread's latest readings
    /// (at most one sampling period, 1 ms by default, old; the default).
    /// Reading costs two system calls a step, some microseconds right after
    /// a GPU step, over 1% of a millisecond-long step (see `BENCHMARKS.md`);
    /// for steps or blocks of tens of milliseconds and more it makes no
    /// difference either way. The kernel's own resident-set counters lag by
    /// up to some MiB on a many-core machine anyway.
    pub fn exact_ram(mut self, exact: bool) -> StepLogger {
        self.how.exact_ram = exact;
        self
    }

    /// Empties the CUDA cache before each step, so that `driver_used` shows
    /// what the step really holds rather than what the cache kept.
    pub fn clear_cache(mut self, clear: bool) -> StepLogger {
        self.how.clear_cache = clear;
        self
    }

    /// How often the background thread samples the driver and the resident set.
    pub fn sample_every(mut self, every: Duration) -> StepLogger {
        self.how.sample_every = every;
        self
    }

    /// Prints reports again.
    pub fn start(&mut self) {
        self.running = true;
    }

    /// Stops printing; steps are still measured and [`data`](Self::data) still answers.
    pub fn stop(&mut self) {
        self.running = false;
    }

    /// The figures of the last step.
    pub fn data(&self) -> Option<&StepData> {
        self.last.as_ref()
    }

    /// Initialises CUDA (its context) now rather than inside the first step,
    /// and reports once what the context took on the device. Returns those bytes.
    ///
    /// The context's cost is the driver's figure: it needs the `cuda-driver`
    /// feature (on by default), and returns [`Error::DriverUnavailable`]
    /// naming it in a build without.
    ///
    /// [`Error::DriverUnavailable`]: crate::Error::DriverUnavailable
    pub fn preinit_cuda(&mut self) -> Result<u64> {
        let index = BACKEND.current_cuda_device()?;
        let before = driver_memory(index)?.used();
        let warm = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cuda(index)));
        drop(warm);
        let cost = driver_memory(index)?.used().saturating_sub(before);
        if !self.context_reported {
            self.context_reported = true;
            memlab_core::output::emit(&format!(
                "memlab StepLogger: CUDA initialised on cuda:{index}; the context and libtorch's start-up took {} of device memory\n",
                Cell::bytes(cost)
            ));
        }
        Ok(cost)
    }

    /// Runs `step` under measurement, prints a report (while started) and
    /// keeps the figures for [`data`](Self::data).
    pub fn log<R>(&mut self, label: &str, step: impl FnOnce() -> R) -> R {
        let span_start = memlab_core::events::span_start();
        let measure = Measure::start(&self.how);
        let value = step();
        let time = measure.elapsed();
        if memlab_core::events::is_active() {
            // The step on the recording's timeline, and what the model's tensors are now.
            memlab_core::events::span(SpanKind::Step, label.to_string(), span_start);
            crate::named::seen::note(&self.model);
        }
        let data = measure.finish(label, time);
        if self.running {
            let text = if self.compact { data.compact_line() } else { data.to_string() };
            memlab_core::output::emit(&text);
        }
        self.last = Some(data);
        value
    }
}
