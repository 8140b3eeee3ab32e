//! Dispose scopes: which tensors outlived a stretch of code that should have
//! left nothing behind, and where they came from.
//!
//! In Rust, ownership frees tensors; what goes wrong is that something keeps
//! them: a loss accumulated with its graph, a cache that grows every step, a
//! tensor pushed into a `Vec`:
//!
//! ```rust
//! use tch::{Kind, Tensor};
//!
//! let scope = memlab::DisposeScope::new("validation")?;
//! let mut history = Vec::new();
//! for _ in 0..3 {
//!     let batch = Tensor::ones([256], (Kind::Float, tch::Device::Cpu));
//!     history.push(&batch * 2.0); // kept by mistake
//! }
//! let report = scope.finish();        // or let it drop: it warns on stderr
//! assert_eq!(report.escaped_bytes(memlab::Device::Cpu), 3 * 1024);
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! A [`DisposeScope`] sees every allocation made on its thread while it is the
//! innermost scope, and when it closes it reports those still alive (with where
//! they were allocated), except the ones it was told to keep:
//! `scope.keep(&t)` ([`keep`](crate::DisposeScope::keep)) exempts a tensor
//! meant to escape (it moves to the enclosing scope), `scope.detach(&t)` frees
//! it from every scope; nested scopes hand their escapes outwards (to the
//! nearest scope still open). A scope belongs to the thread that opened it (it
//! is not `Send`). `.on_escape(OnEscape::Fail)` panics, for tests;
//! `memlab::check_step(|| step())` runs a step and lets a test assert
//! `.assert_no_escapes()` and `.assert_peak_below(device, bytes)`.
//!
//! # Model state is not a leak
//!
//! A training step replaces the model's gradients every time (`backward_step`
//! sets them to none, backward makes new ones): those are the model's state, not
//! leaks. Scopes list new gradients of registered var stores, or of the var store
//! named with `DisposeScope::model(&vs)` / `memlab::check_step_with(&vs, || step())`,
//! as replaced model state, apart from the escapes:
//!
//! ```rust
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch::{Kind, Tensor};
//!
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::linear(vs.root(), 64, 8, Default::default());
//! let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
//! let x = Tensor::ones([16, 64], (Kind::Float, tch::Device::Cpu));
//! opt.backward_step(&net.forward(&x).mean(Kind::Float)); // the first step creates Adam's state
//! let check = memlab::check_step_with(&vs, || opt.backward_step(&net.forward(&x).mean(Kind::Float)))?;
//! check.assert_no_escapes();
//! assert_eq!(check.scope.model_state.len(), 2); // new gradients of the weight and the bias
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The optimizer's state is model state too: Adam's moments, created by the
//! first step, would otherwise look like a leak. Give the optimizer to the check
//! (`memlab::check_step_with_optimizer(&vs, &mut opt, |opt| opt.backward_step(&loss))`),
//! close a scope with `scope.finish_with(&opt)`, or register it where it is
//! built with `memlab::register_optimizer`.
//!
//! # Requirements
//!
//! Scopes need memlab's counting CPU allocator: with it turned off
//! (`MEMLAB_CPU_ALLOCATOR=0`, see "Allocator figures" in the crate docs) they
//! return an error rather than a silent zero. Scopes read gradients, so run them
//! on the thread that steps the model, or between steps (see the "Threads"
//! section of [`crate::oom`]).
//!
//! `cargo run --release --example leak_hunt` catches the classic validation-loop
//! leak (`total_loss = total_loss + loss` with autograd on) by its line.

use serde::Serialize;
use std::collections::{BTreeMap, HashSet};

use memlab_core::events::{self, by_site, LiveAllocation, ScopeCounts, ScopeOutcome, SiteGroup};
use memlab_core::profiler::PeakWatch;
use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::{Device, Error, Result};

use tch::nn::VarStore;

use memlab_tch::{storage_info, Recording, BACKEND};

use crate::named::{Model, OptimizerStates};

/// What a scope does when allocations escaped it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnEscape {
    /// Print the report whether or not anything escaped.
    Report,
    /// Print the report as a warning (standard error unless redirected with
    /// `memlab::profiler::set_warnings`) only when something escaped (the default).
    Warn,
    /// Panic with the report when something escaped (for tests). A scope
    /// dropped while its thread is already panicking only prints.
    Fail,
    /// Do nothing on drop; call [`DisposeScope::finish`] to see the report.
    Silent,
}

/// A scope that tells which allocations made inside it survived it. Bind it
/// to a named variable (`let _scope = …`), not to `_`, which drops it at once.
///
/// ```
/// use tch::{Kind, Tensor};
///
/// let mut kept = Vec::new();
/// let scope = memlab::DisposeScope::new("step")?;
/// let temporary = Tensor::ones([1024], (Kind::Float, tch::Device::Cpu)) * 2;
/// let result = temporary.sum(Kind::Float);
/// scope.keep(&result)?;                // meant to escape
/// kept.push(Tensor::zeros([256], (Kind::Float, tch::Device::Cpu))); // a leak
/// drop(temporary);
/// let report = scope.finish();
/// assert_eq!(report.escaped.len(), 1);
/// assert_eq!(report.escaped_bytes(memlab::Device::Cpu), 256 * 4);
/// assert_eq!(report.counts(memlab::Device::Cpu).kept_bytes, 4);
/// # drop((kept, result));
/// # Ok::<(), memlab::Error>(())
/// ```
///
/// A scope belongs to the thread that opened it (it is not `Send`): it sees
/// the allocations of that thread, and closes there.
///
/// New gradients of the model's var stores are the model's state, not leaks:
/// a training step replaces them every time (libtorch's `zero_grad` sets them
/// to none, and backward makes new ones). The scope lists them apart, as
/// replaced model state, for every var store registered with
/// [`register_var_store`](crate::register_var_store), or of the model the
/// scope was opened with ([`of`](Self::of)) or given with
/// [`var_store`](Self::var_store).
#[must_use = "a DisposeScope reports when it is dropped; bind it to a named variable"]
pub struct DisposeScope {
    id: u64,
    name: String,
    on_escape: OnEscape,
    recording: Option<Recording>,
    model: Model,
    /// Scopes are per thread: the thread's stack of open scopes knows them.
    _thread: ThreadBound,
}

crate::named::names_memory_after_its_model!(DisposeScope, model);

/// What makes a scope stay on its thread: a raw pointer is neither `Send`
/// nor `Sync`. A type of memlab's own rather than `PhantomData<*const ()>`,
/// so that rustc's note on a scope sent to another thread points into
/// memlab's source only (with the standard library's sources installed, it
/// would also quote `PhantomData`'s definition).
struct ThreadBound(#[allow(dead_code)] *const ());

impl DisposeScope {
    /// Opens a scope named `name` on this thread (recording allocation events
    /// for as long as it is open).
    ///
    /// Fails when memlab's counting CPU allocator is off
    /// (`MEMLAB_CPU_ALLOCATOR=0`): the scope could not see CPU allocations.
    pub fn new(name: impl Into<String>) -> Result<DisposeScope> {
        if !memlab_tch::cpu_allocator_installed() {
            // The backend's error says why it is missing (the variable's value, or another allocator).
            let why = match memlab_tch::raw_stats(Device::Cpu) {
                Err(Error::CpuAllocatorMissing(why)) => why,
                _ => "it is not installed".to_string(),
            };
            return Err(Error::CpuAllocatorMissing(format!(
                "dispose scopes cannot see CPU allocations without it: {why}"
            )));
        }
        let recording = Recording::join()?;
        let id = events::scope_open();
        Ok(DisposeScope {
            id,
            name: name.into(),
            on_escape: OnEscape::Warn,
            recording: Some(recording),
            model: Model::registered(),
            _thread: ThreadBound(std::ptr::null()),
        })
    }

    /// Opens a scope named `name` whose model is `model` (or a var store,
    /// `of(name, &vs)`), in place of the registry: its variables, their
    /// gradients and its optimizer state are the model's state, and new ones
    /// alive when the scope closes are listed as replaced model state, not
    /// as escapes. [`new`](Self::new) takes the registry; either adds what
    /// `var_store`, `tensor` and `optimizer` give.
    pub fn of(name: impl Into<String>, model: impl Into<Model>) -> Result<DisposeScope> {
        let mut scope = DisposeScope::new(name)?;
        scope.model = model.into();
        Ok(scope)
    }

    /// Chooses what happens on drop when allocations escaped.
    pub fn on_escape(mut self, on_escape: OnEscape) -> Self {
        self.on_escape = on_escape;
        self
    }

    /// memlab's id of this scope (events carry it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Exempts `tensor` (its storage): it is meant to outlive the scope and is
    /// handed to the enclosing scope, if any (TorchSharp's
    /// `MoveToOuterDisposeScope`). Returns the bytes exempted.
    pub fn keep(&self, tensor: &tch::Tensor) -> Result<u64> {
        self.exempt(tensor, true)
    }

    /// Like [`keep`](Self::keep), but no enclosing scope answers for the
    /// tensor either (TorchSharp's `DetachFromDisposeScope`).
    pub fn detach(&self, tensor: &tch::Tensor) -> Result<u64> {
        self.exempt(tensor, false)
    }

    fn exempt(&self, tensor: &tch::Tensor, to_outer: bool) -> Result<u64> {
        let info = storage_info(tensor)?;
        let device = info.device.ok_or_else(|| {
            Error::InvalidArgument("the tensor is on a device memlab does not track (cpu and cuda only)".into())
        })?;
        events::scope_keep(self.id, device, info.data_ptr, to_outer).ok_or_else(|| Error::NotInScope {
            scope: self.name.clone(),
            why: "it was made before the scope, in another scope or thread, or kept already".into(),
        })
    }

    /// Closes the scope and returns what it found, without printing or panicking.
    pub fn finish(mut self) -> ScopeReport {
        self.close()
    }

    /// Like [`finish`](Self::finish), with the state of `optimizer` (built on
    /// a var store of the model: given with [`of`](Self::of) or
    /// [`var_store`](Self::var_store), or registered) counted as model
    /// state: the moments a first step creates, a momentum buffer, are
    /// listed as replaced model state, not escapes.
    /// The optimizer is read now, under this borrow; when it cannot be read,
    /// the report says so in `model_error` and its state counts as escapes.
    pub fn finish_with(mut self, optimizer: &tch::nn::Optimizer) -> ScopeReport {
        self.model.add_optimizer(optimizer);
        self.close()
    }

    /// Closes the scope; `Err` with the report when anything escaped.
    // Both sides carry the same report, once per scope: boxing one would only
    // make the two cases read differently.
    #[allow(clippy::result_large_err)]
    pub fn check(self) -> std::result::Result<ScopeReport, ScopeReport> {
        let report = self.finish();
        if report.escaped.is_empty() {
            Ok(report)
        } else {
            Err(report)
        }
    }

    fn close(&mut self) -> ScopeReport {
        // The walk reads libtorch; it runs before the recorder's lock is taken.
        let (model, model_error) = match self.model.model_addresses() {
            Ok(model) => (model, None),
            Err(e) => (HashSet::new(), Some(e.to_string())),
        };
        let ScopeOutcome { devices, escaped, model_state, handed_to, .. } = events::scope_close(self.id, &model);
        self.recording = None;
        ScopeReport { name: std::mem::take(&mut self.name), devices, escaped, model_state, handed_to, model_error }
    }
}

impl Drop for DisposeScope {
    fn drop(&mut self) {
        if self.recording.is_none() {
            return;
        }
        let on_escape = self.on_escape;
        let report = self.close();
        let escaped = !report.escaped.is_empty();
        match on_escape {
            OnEscape::Silent => {}
            OnEscape::Report => memlab_core::output::emit(&report.to_string()),
            OnEscape::Warn if escaped => memlab_core::output::warn(&report.to_string()),
            OnEscape::Warn => {}
            OnEscape::Fail if escaped && !std::thread::panicking() => panic!("{report}"),
            OnEscape::Fail if escaped => memlab_core::output::warn(&report.to_string()),
            OnEscape::Fail => {}
        }
    }
}

/// What a dispose scope found when it closed.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ScopeReport {
    /// The scope's name.
    pub name: String,
    /// Byte and block counts per device.
    pub devices: BTreeMap<Device, ScopeCounts>,
    /// The allocations that outlived the scope, oldest first.
    pub escaped: Vec<LiveAllocation>,
    /// The allocations alive at the end that are the model's state (new
    /// gradients of its var stores): replaced, not escaped.
    pub model_state: Vec<LiveAllocation>,
    /// The enclosing scope that now answers for the escapes, if any.
    pub handed_to: Option<u64>,
    /// Why the model's state could not be read, if it could not (its
    /// allocations then count as escapes).
    pub model_error: Option<String>,
}

impl ScopeReport {
    /// The counts of `device` (zeros when the scope saw nothing there).
    pub fn counts(&self, device: Device) -> ScopeCounts {
        self.devices.get(&device).copied().unwrap_or_default()
    }

    /// Bytes that escaped on `device`.
    pub fn escaped_bytes(&self, device: Device) -> u64 {
        self.counts(device).escaped_bytes
    }
}

displayed_as_text!(ScopeReport);

impl Render for ScopeReport {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        let total: u64 = self.escaped.iter().map(|a| a.size).sum();
        doc.heading(format!(
            "DisposeScope `{}`: {} allocation(s) escaped, {}",
            self.name,
            self.escaped.len(),
            Cell::bytes(total)
        ));
        let counted = Cell::bytes_in;
        let with_model = self.devices.values().any(|c| c.model_state > 0);
        let mut columns = vec![
            Column::new("device", Layout::Text),
            Column::new("created", Layout::Figure),
            Column::new("freed", Layout::Figure),
            Column::new("escaped", Layout::Figure),
            Column::new("kept", Layout::Figure),
        ];
        if with_model {
            columns.push(Column::new("model state", Layout::Figure));
        }
        let mut devices = Table::new(columns);
        for (device, c) in &self.devices {
            let mut cells = vec![
                Cell::text(device.to_string()),
                counted(c.created_bytes, c.created),
                counted(c.freed_bytes, c.freed),
                counted(c.escaped_bytes, c.escaped),
                counted(c.kept_bytes, c.kept),
            ];
            if with_model {
                cells.push(counted(c.model_state_bytes, c.model_state));
            }
            devices.row(cells);
        }
        if !devices.is_empty() {
            doc.table(devices);
        }
        if !self.model_state.is_empty() {
            let bytes: u64 = self.model_state.iter().map(|a| a.size).sum();
            doc.indented(
                2,
                format!(
                    "replaced model state (new gradients and optimizer state of the model): {} allocation(s), {}",
                    self.model_state.len(),
                    Cell::bytes(bytes)
                ),
            );
        }
        if let Some(e) = &self.model_error {
            doc.indented(2, format!("the model's state could not be read ({e}); its new tensors count as escapes"));
        }
        // One row per device and allocation site, largest first.
        let mut sites = Table::new(vec![
            Column::new("escaped", Layout::Figure).min_width(9),
            Column::new("device", Layout::Text),
            Column::new("blocks", Layout::Figure),
            Column::new("allocated at", Layout::Code),
        ])
        .collapsed();
        for SiteGroup { device, site, bytes, blocks } in by_site(&self.escaped) {
            let site = site.unwrap_or_else(|| {
                "outside profiled code (profile the function, or record backtraces to see where)".to_string()
            });
            sites.row([Cell::bytes(bytes), Cell::text(device.to_string()), Cell::count(blocks), Cell::code(site)]);
        }
        if !sites.is_empty() {
            doc.table(sites);
        }
        if let Some(outer) = self.handed_to.filter(|_| !self.escaped.is_empty()) {
            doc.indented(2, format!("(handed to the enclosing scope #{outer})"));
        }
        doc
    }
}

/// What [`check_step`] measured.
#[derive(Debug, Serialize)]
#[non_exhaustive]
pub struct StepCheck<R> {
    /// What the step returned.
    pub value: R,
    /// What escaped the step.
    pub scope: ScopeReport,
    /// Per device: the highest allocated bytes during the step above the level
    /// at its start.
    pub peak_above_start: BTreeMap<Device, i64>,
}

impl<R> StepCheck<R> {
    /// Panics with the scope report if anything escaped the step.
    #[track_caller]
    pub fn assert_no_escapes(&self) -> &Self {
        assert!(self.scope.escaped.is_empty(), "{}", self.scope);
        self
    }

    /// Panics if the step's peak on `device` rose more than `bytes` above its start.
    #[track_caller]
    pub fn assert_peak_below(&self, device: Device, bytes: i64) -> &Self {
        let peak = self.peak_above_start.get(&device).copied().unwrap_or(0);
        assert!(
            peak <= bytes,
            "the step's peak on {device} rose {} above its start, more than the {} allowed",
            Cell::bytes(peak),
            Cell::bytes(bytes)
        );
        self
    }
}

/// Runs `step` inside a dispose scope and a peak watch (on the CPU and, where
/// there is one, the current CUDA device): a test can then assert that the
/// step leaked nothing beyond what it returned and kept, and that its peak
/// stayed under a bound.
///
/// ```
/// use tch::{Kind, Tensor};
///
/// let check = memlab::check_step(|| {
///     let x = Tensor::ones([1024], (Kind::Float, tch::Device::Cpu));
///     (&x * 2).sum(Kind::Float).double_value(&[])
/// })?;
/// // `x` and `&x * 2` (4 KiB each) and the sum were alive at once.
/// check.assert_no_escapes().assert_peak_below(memlab::Device::Cpu, 9 * 1024);
/// assert_eq!(check.value, 2048.0);
/// # Ok::<(), memlab::Error>(())
/// ```
///
/// New gradients of registered var stores are replaced model state, not
/// escapes (see [`DisposeScope`]); [`check_step_with`] names the model's var
/// store for the check.
pub fn check_step<R>(step: impl FnOnce() -> R) -> Result<StepCheck<R>> {
    check(None, None, |_| step())
}

/// [`check_step`] of a training step of the model in `vs`: the variables of
/// `vs` and their new gradients are the model's state, listed in
/// [`ScopeReport::model_state`], not escapes. With an optimizer that keeps
/// state, see [`check_step_with_optimizer`].
///
/// ```
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Kind, Tensor};
///
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::linear(vs.root(), 8, 1, Default::default());
/// let mut opt = nn::Sgd::default().build(&vs, 1e-2).unwrap();
/// let x = Tensor::ones([4, 8], (Kind::Float, tch::Device::Cpu));
/// for _ in 0..3 {
///     // backward_step drops the old gradients and makes new ones.
///     let check = memlab::check_step_with(&vs, || opt.backward_step(&net.forward(&x).mean(Kind::Float)))?;
///     check.assert_no_escapes();
///     assert_eq!(check.scope.model_state.len(), 2); // weight and bias gradients
/// }
/// # Ok::<(), memlab::Error>(())
/// ```
pub fn check_step_with<R>(vs: &VarStore, step: impl FnOnce() -> R) -> Result<StepCheck<R>> {
    check(Some(vs), None, |_| step())
}

/// [`check_step_with`] for a step that uses `optimizer` (built on `vs`): the
/// step gets the optimizer, and afterwards its state (Adam's moments, created
/// by the first step, or a momentum buffer) counts as model state too. An
/// optimizer memlab cannot read (built on another var store) is an
/// [`Error::Optimizer`] before the step runs.
///
/// ```
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Kind, Tensor};
///
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::linear(vs.root(), 8, 1, Default::default());
/// let mut adam = nn::Adam::default().build(&vs, 1e-2).unwrap();
/// let x = Tensor::ones([4, 8], (Kind::Float, tch::Device::Cpu));
/// // The first step creates Adam's state: model state, not a leak.
/// let check = memlab::check_step_with_optimizer(&vs, &mut adam, |adam| {
///     adam.backward_step(&net.forward(&x).mean(Kind::Float))
/// })?;
/// check.assert_no_escapes();
/// assert_eq!(check.scope.model_state.len(), 2 + 4); // gradients, then 2 moments per variable
/// # Ok::<(), memlab::Error>(())
/// ```
pub fn check_step_with_optimizer<R>(
    vs: &VarStore,
    optimizer: &mut tch::nn::Optimizer,
    step: impl FnOnce(&mut tch::nn::Optimizer) -> R,
) -> Result<StepCheck<R>> {
    let mut value = None;
    let check = check(Some(vs), Some(&mut *optimizer), |opt: Option<&mut tch::nn::Optimizer>| {
        value = opt.map(step);
    })?;
    let value = value.expect("the step ran with the optimizer");
    Ok(StepCheck { value, scope: check.scope, peak_above_start: check.peak_above_start })
}

fn check<R>(
    model: Option<&VarStore>,
    mut optimizer: Option<&mut tch::nn::Optimizer>,
    step: impl FnOnce(Option<&mut tch::nn::Optimizer>) -> R,
) -> Result<StepCheck<R>> {
    let mut devices = vec![Device::Cpu];
    if memlab_tch::cuda_is_available() {
        use memlab_core::Backend;
        devices.push(Device::Cuda(BACKEND.current_cuda_device()?));
    }
    let watches = devices.iter().map(|d| PeakWatch::start(&BACKEND, *d)).collect::<Result<Vec<_>>>()?;
    let mut scope = DisposeScope::new("check_step")?.on_escape(OnEscape::Silent);
    if let Some(vs) = model {
        scope = scope.var_store("", vs);
    }
    if let Some(opt) = optimizer.as_deref() {
        // An optimizer memlab cannot read is an error before the step runs,
        // not escapes after it.
        OptimizerStates::read(opt, &scope.model.stores())?;
    }
    let value = step(optimizer.as_deref_mut());
    let scope = match optimizer {
        Some(opt) => scope.finish_with(opt),
        None => scope.finish(),
    };
    let mut peak_above_start = BTreeMap::new();
    for (device, watch) in devices.into_iter().zip(watches) {
        let (start, end) = watch.finish()?;
        let stats = (start.to_device_stats(), end.to_device_stats());
        peak_above_start.insert(device, stats.1.allocated_bytes.all.peak - stats.0.allocated_bytes.all.current);
    }
    Ok(StepCheck { value, scope, peak_above_start })
}
