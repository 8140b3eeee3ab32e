//! `TrainingMonitor`: per-iteration memory of a training loop — cache, weights,
//! gradients, optimizer state, feature maps — printed every few iterations
//! and appended to CSV files.
//!
//! ```rust,no_run
//! # use tch::nn::OptimizerConfig;
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let mut adam = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
//! let mut monitor = memlab::TrainingMonitor::new(&vs)
//!     .print_period(10)                             // a report every 10 iterations
//!     .csv_dir("memlab_csv");                       // memlab_iterations.csv, memlab_variables.csv
//! for epoch in 0..3 {
//!     for batch in 0..100 {
//!         // ... forward, backward, adam.step() ...
//!         monitor.record_stats_with(&adam);         // the optimizer's state, exact, tensor by tensor
//!     }
//!     monitor.epoch_end();
//! }
//! ```
//!
//! Call [`record_stats_with`](crate::TrainingMonitor::record_stats_with) or
//! [`record_stats`](crate::TrainingMonitor::record_stats) after each iteration
//! and [`epoch_end`](crate::TrainingMonitor::epoch_end) after each epoch.
//! Everything is measured from the allocator and the model's storages. Each
//! record has the peak and current reserved ("cached") and allocated bytes, the
//! weights and their gradients in total and per variable, what stays allocated
//! besides them, and the feature maps: how far the iteration's peak rose above
//! what it started with. Calling
//! [`mark_backward`](crate::TrainingMonitor::mark_backward) right before the
//! backward pass splits that into the feature maps forward kept and the
//! intermediate gradients of backward.
//!
//! With `record_stats_with(&opt)` the record also has the optimizer's state,
//! read from the optimizer tensor by tensor (`fc.weight.exp_avg`; tch keeps it
//! inside its C++ optimizer, and memlab reads it under the borrow), and what
//! else stays allocated. With `record_stats()` only the total besides weights
//! and gradients is known, and
//! [`optimizer_kind`](crate::TrainingMonitor::optimizer_kind)
//! (`.optimizer_kind(StepOptimizer::Adam)`) adds an estimate of the state,
//! labelled as one. From `cargo run --release --example monitor` (CPU):
//!
//! ```text
//! Optimizer state.................................     4.09M
//!   fc1.bias.exp_avg..............................     4.00K
//!   fc1.bias.exp_avg_sq...........................     4.00K
//!   fc1.weight.exp_avg............................     2.00M
//!   fc1.weight.exp_avg_sq.........................     2.00M
//!   fc2.bias.exp_avg..............................    40.00B
//!   fc2.bias.exp_avg_sq...........................    40.00B
//!   fc2.weight.exp_avg............................    40.00K
//!   fc2.weight.exp_avg_sq.........................    40.00K
//! Other kept tensors..............................   257.00K
//! ```
//!
//! `memlab_iterations.csv` gets a row per iteration (an `optimizer_state`
//! column, empty without an optimizer); `memlab_variables.csv` a row whenever a
//! variable's weight, gradient or state tensor changes size (all of them at the
//! first record), its `kind` named as every memlab report names it
//! (`parameter` or `buffer`, `gradient`, `optimizer_state`), so a large model
//! does not write hundreds of unchanged rows a step. Rows are written at least
//! once a second, at each epoch's end and when the monitor is dropped (also by
//! a panic). A CSV directory that cannot be written is reported once; training
//! goes on. Each file's rows are a type, [`IterationRow`] and [`VariableRow`],
//! and [`read_rows`] reads them back:
//! `read_rows::<IterationRow>("memlab_csv/memlab_iterations.csv")?`.
//!
//! Records read gradients: take them on the thread that steps the model, or
//! between steps (see the "Threads" section of [`crate::oom`]).

use memlab_core::sync::LockExt;
use serde::Serialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memlab_core::events::SpanKind;
use memlab_core::hash::FastSet;
use memlab_core::profiler::PeakWatch;
use memlab_core::render::{Cell, Document, Render};
use memlab_core::{Device, Error, Result, TensorKind};

use tch::nn::{VarStore, Variables};
use tch::Tensor;

use memlab_tch::storage::storages;

mod csv_files;
use csv_files::CsvFiles;
pub use memlab_core::format::{read_rows, IterationRow, VariableRow};
use memlab_tch::optimizer::StepOptimizer;
use memlab_tch::BACKEND;

use crate::named::{Model, OptimizerStates, Trainable};

/// A named tensor's bytes in a record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TensorBytes {
    /// Its name (`fc.weight`; `fc.weight.exp_avg` for optimizer state).
    pub name: String,
    /// What it is: a parameter or a buffer among the weights, a gradient,
    /// optimizer state.
    pub kind: TensorKind,
    /// Its storage's bytes.
    pub bytes: i64,
}

/// The memory of one recorded iteration. Byte counts are exact unless the
/// field's name says `estimate`.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct IterationRecord {
    /// Epoch, from 1.
    pub epoch: u64,
    /// Iteration within the epoch, from 1.
    pub iteration: u64,
    /// The device measured.
    pub device: Option<Device>,
    /// Highest reserved ("cached") bytes since the previous record.
    pub peak_reserved: i64,
    /// Reserved bytes now.
    pub current_reserved: i64,
    /// Highest allocated bytes since the previous record.
    pub peak_allocated: i64,
    /// Allocated bytes now.
    pub current_allocated: i64,
    /// Bytes of the model's weights, in total and per variable.
    pub weights: i64,
    /// Per variable (a parameter or a buffer): its name and bytes.
    pub weight_rows: Vec<TensorBytes>,
    /// Bytes of the weights' gradients, in total and per variable.
    pub gradients: i64,
    /// Per variable: the name and bytes of its gradient.
    pub gradient_rows: Vec<TensorBytes>,
    /// With [`TrainingMonitor::record_stats_with`]: the bytes of the
    /// optimizer's state on the device, read from the optimizer (exact).
    pub optimizer_state: Option<i64>,
    /// Per state tensor (`fc.weight.exp_avg`): its name and bytes.
    pub optimizer_state_rows: Vec<TensorBytes>,
    /// Allocated bytes besides weights and gradients that stay between
    /// iterations: the optimizer's state and anything else the loop keeps.
    pub optimizer_state_measured: i64,
    /// What the named optimizer's state should take (an estimate), when the
    /// optimizer itself was not given.
    pub optimizer_state_estimate: Option<i64>,
    /// Feature maps: how far the iteration's peak rose above the memory held
    /// when it began (activations kept for backward, temporaries); with
    /// [`TrainingMonitor::mark_backward`], what the forward pass still held
    /// when backward began.
    pub feature_maps: i64,
    /// With [`TrainingMonitor::mark_backward`]: the transient memory of the
    /// backward pass (intermediate gradients and temporaries), how far it
    /// peaked above what was held both before and after it.
    pub intermediate_gradients: Option<i64>,
}

/// Watches the memory of a training loop. See the module documentation.
///
/// ```
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let model = nn::linear(vs.root() / "fc", 64, 10, Default::default());
/// let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
/// let mut monitor = memlab::TrainingMonitor::new(&vs).print_period(0);
/// for _ in 0..3 {
///     let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
///     opt.backward_step(&model.forward(&x).mean(Kind::Float));
///     monitor.record_stats();
/// }
/// let last = monitor.last().unwrap();
/// assert_eq!((last.weights, last.gradients), ((64 * 10 + 10) * 4, (64 * 10 + 10) * 4));
/// monitor.epoch_end();
/// ```
pub struct TrainingMonitor {
    var_stores: Vec<Arc<Mutex<Variables>>>,
    device: Device,
    print_period: u64,
    optimizer: Option<StepOptimizer>,
    csv_dir: Option<PathBuf>,
    csv_failed: bool,
    /// The CSV files, opened at the first record and kept open.
    csv_files: Option<CsvFiles>,
    /// Each var store's variable names, sorted; sorted again when they change.
    names: Vec<Vec<String>>,
    /// Each var store's trainable storages (parameters; the rest are
    /// buffers), read again when its variables' storages change.
    trainable: Vec<StoreKinds>,
    /// Storages counted in the record being made (reused from record to record).
    seen: FastSet<u64>,
    /// The rows of a record no longer kept, to be filled again.
    spare_rows: (Vec<Row>, Vec<Row>, Vec<Row>),
    epoch: u64,
    iteration: u64,
    watch: Option<PeakWatch>,
    /// Set by `mark_backward`: allocated bytes then, and a watch of the backward pass.
    backward: Option<(i64, PeakWatch)>,
    last: Option<IterationRecord>,
    last_error: Option<Error>,
    /// When the iteration being run began, on the recorder's clock.
    iteration_start_ns: u64,
}

impl TrainingMonitor {
    /// A monitor of `vs`, measuring the current CUDA device when CUDA is
    /// available and the CPU otherwise, printing every iteration. Create it
    /// right before the training loop: the first iteration's peak counts from here.
    pub fn new(vs: &VarStore) -> TrainingMonitor {
        TrainingMonitor::with_stores(vec![vs.variables_.clone()])
    }

    /// A monitor of every registered var store (see
    /// [`register_var_store`](crate::register_var_store)).
    pub fn registered() -> TrainingMonitor {
        TrainingMonitor::of(Model::registered())
    }

    /// A monitor of the var stores of `model` (or of a var store, `of(&vs)`),
    /// as they are now: their variables' weights and gradients are measured
    /// (optimizer state is given per record: see
    /// [`record_stats_with`](Self::record_stats_with)).
    pub fn of(model: impl Into<Model>) -> TrainingMonitor {
        let stores = model.into().stores().into_iter().map(|(_, variables)| variables).collect();
        TrainingMonitor::with_stores(stores)
    }

    fn with_stores(var_stores: Vec<Arc<Mutex<Variables>>>) -> TrainingMonitor {
        let device = memlab_tch::auto_device();
        let mut monitor = TrainingMonitor {
            var_stores,
            device,
            print_period: 1,
            optimizer: None,
            csv_dir: None,
            csv_failed: false,
            csv_files: None,
            names: Vec::new(),
            trainable: Vec::new(),
            seen: HashSet::default(),
            spare_rows: Default::default(),
            epoch: 1,
            iteration: 0,
            watch: None,
            backward: None,
            last: None,
            last_error: None,
            iteration_start_ns: memlab_core::events::span_start(),
        };
        monitor.start_interval();
        monitor
    }

    /// Measures `device` instead.
    pub fn device(mut self, device: Device) -> TrainingMonitor {
        self.device = device;
        self.start_interval();
        self
    }

    /// Prints a report every `n` iterations (0: never).
    pub fn print_period(mut self, n: u64) -> TrainingMonitor {
        self.print_period = n;
        self
    }

    /// Names the optimizer as configured, so that reports show an estimate
    /// of its state: [`StepOptimizer::state_buffers`] times the weights'
    /// bytes (for exact figures, give the optimizer itself to
    /// [`record_stats_with`](Self::record_stats_with)).
    pub fn optimizer_kind(mut self, kind: StepOptimizer) -> TrainingMonitor {
        self.optimizer = Some(kind);
        self
    }

    /// Appends every record to `dir/memlab_iterations.csv` (one row per
    /// iteration) and `dir/memlab_variables.csv` (a row for a variable's
    /// weight or gradient whenever its bytes change: all of them at the
    /// monitor's first record, 0 bytes when one goes away; the size at any
    /// iteration is the last row before it). Existing files with the same columns are appended to; give
    /// each monitor that runs at the same time a directory of its own. Rows
    /// are written at least once a second and at every epoch's end (see
    /// [`flush`](Self::flush)). A directory that cannot be written is reported
    /// once, on standard error and by [`last_error`](Self::last_error);
    /// training goes on.
    pub fn csv_dir(mut self, dir: impl Into<PathBuf>) -> TrainingMonitor {
        self.csv_dir = Some(dir.into());
        self.csv_files = None;
        self.csv_failed = false;
        self
    }

    /// The last record.
    pub fn last(&self) -> Option<&IterationRecord> {
        self.last.as_ref()
    }

    /// The last problem met (measuring or writing CSV), if any.
    pub fn last_error(&self) -> Option<&Error> {
        self.last_error.as_ref()
    }

    fn start_interval(&mut self) {
        self.watch = None;
        match PeakWatch::start(&BACKEND, self.device) {
            Ok(watch) => self.watch = Some(watch),
            Err(e) => self.last_error = Some(e),
        }
    }

    /// Records the iteration that just ended: measures, prints when the
    /// period says so, appends to the CSV files. Never interrupts training:
    /// problems are kept in [`last_error`](Self::last_error).
    pub fn record_stats(&mut self) -> Option<&IterationRecord> {
        self.record(None)
    }

    /// Like [`record_stats`](Self::record_stats), with the state of
    /// `optimizer` (built on a var store of this monitor) measured exactly,
    /// tensor by tensor, in place of the estimate. The optimizer is read now,
    /// under this borrow; memlab never keeps it.
    ///
    /// ```
    /// use tch::nn::{self, Module, OptimizerConfig};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let model = nn::linear(vs.root() / "fc", 64, 10, Default::default());
    /// let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
    /// let mut monitor = memlab::TrainingMonitor::new(&vs).print_period(0);
    /// let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
    /// adam.backward_step(&model.forward(&x).mean(Kind::Float));
    /// let record = monitor.record_stats_with(&adam).unwrap();
    /// assert_eq!(record.optimizer_state, Some(2 * (64 * 10 + 10) * 4)); // two moments
    /// assert_eq!(record.optimizer_state_rows[0].name, "fc.bias.exp_avg");
    /// assert_eq!(record.optimizer_state_rows[0].bytes, 10 * 4);
    /// ```
    pub fn record_stats_with(&mut self, optimizer: &tch::nn::Optimizer) -> Option<&IterationRecord> {
        self.record(Some(optimizer))
    }

    fn record(&mut self, optimizer: Option<&tch::nn::Optimizer>) -> Option<&IterationRecord> {
        self.iteration += 1;
        if memlab_core::events::is_active() {
            // The iteration on the recording's timeline, and what the model's tensors are now.
            let name = format!("epoch {} iteration {}", self.epoch, self.iteration);
            memlab_core::events::span(SpanKind::Iteration, name, self.iteration_start_ns);
            let mut sources = Model::default();
            for variables in &self.var_stores {
                sources.add_variables(variables.clone());
            }
            if let Some(optimizer) = optimizer {
                sources.add_optimizer(optimizer);
            }
            crate::named::seen::note(&sources);
        }
        self.iteration_start_ns = memlab_core::events::span_start();
        match self.measure(optimizer) {
            Ok(record) => {
                if self.print_period > 0 && self.iteration.is_multiple_of(self.print_period) {
                    memlab_core::output::emit(&record.to_string());
                }
                self.write_csv(&record);
                if let Some(old) = self.last.replace(record) {
                    self.spare_rows = (old.weight_rows, old.gradient_rows, old.optimizer_state_rows);
                }
            }
            Err(e) => self.last_error = Some(e),
        }
        if self.watch.is_none() {
            self.start_interval();
        }
        self.last.as_ref()
    }

    /// Marks the start of the backward pass of this iteration (call it right
    /// before `backward()` or `backward_step`'s backward): the record then
    /// separates the feature maps that forward kept from the intermediate
    /// gradients of backward.
    pub fn mark_backward(&mut self) {
        match PeakWatch::start(&BACKEND, self.device) {
            Ok(w) => self.backward = Some((w.started().allocated_bytes().current, w)),
            Err(e) => self.last_error = Some(e),
        }
    }

    /// Ends an epoch: iterations count from 1 again, and the CSV rows of the
    /// epoch are written out.
    pub fn epoch_end(&mut self) {
        self.flush();
        self.epoch += 1;
        self.iteration = 0;
    }

    fn measure(&mut self, optimizer: Option<&tch::nn::Optimizer>) -> Result<IterationRecord> {
        let backward = match self.backward.take() {
            Some((at_mark, watch)) => Some((at_mark, watch.finish()?.1.allocated_bytes())),
            None => None,
        };
        // The watch's first sample is the level the iteration began at; one
        // read of the allocator ends this iteration and starts the next.
        let (start, end) = match self.watch.take().map(PeakWatch::lap) {
            Some(Ok((start, end, next))) => {
                self.watch = Some(next);
                (start, end)
            }
            Some(Err(e)) => return Err(e),
            None => {
                let now = memlab_tch::raw_stats(self.device)?;
                (now, now)
            }
        };
        let start_allocated = start.allocated_bytes().current;
        let (allocated, reserved) = (end.allocated_bytes(), end.reserved_bytes());
        let mut record = IterationRecord {
            epoch: self.epoch,
            iteration: self.iteration,
            device: Some(self.device),
            peak_reserved: reserved.peak,
            current_reserved: reserved.current,
            peak_allocated: allocated.peak,
            current_allocated: allocated.current,
            ..IterationRecord::default()
        };
        // The monitor walks its var stores itself rather than through
        // `named::Model`: it runs every iteration within 1% of a small GPU
        // step, so it keeps the sorted names and the rows of earlier records
        // and reads storage facts only, where the shared walk builds every
        // name, shape and dtype anew for reports read by a person.
        // The rows of the record before last, their names' buffers reused.
        let (mut weight_rows, mut gradient_rows, mut state_rows) = std::mem::take(&mut self.spare_rows);
        let (mut n_weights, mut n_gradients) = (0, 0);
        self.names.resize_with(self.var_stores.len(), Vec::new);
        self.trainable.resize_with(self.var_stores.len(), StoreKinds::default);
        self.seen.clear();
        for ((variables, names), trainable) in self.var_stores.iter().zip(&mut self.names).zip(&mut self.trainable) {
            let variables = variables.locked();
            let vars = &variables.named_variables;
            // One lookup per variable; the names are sorted again only when
            // the store's variables changed.
            let tensors = match names.iter().map(|n| vars.get(n)).collect::<Option<Vec<_>>>() {
                Some(tensors) if tensors.len() == vars.len() => tensors,
                _ => {
                    *names = vars.keys().cloned().collect();
                    names.sort();
                    names.iter().map(|n| &vars[n]).collect()
                }
            };
            trainable.refresh(&variables);
            for (name, tensor) in names.iter().zip(tensors) {
                let (param, grad) = storages(tensor)?;
                if param.device == Some(self.device) && param.storage_id.is_none_or(|id| self.seen.insert(id)) {
                    let kind = trainable.kind(tensor);
                    put_row(&mut weight_rows, &mut n_weights, name, kind, param.nbytes as i64);
                }
                if let Some(grad) = grad.filter(|g| g.device == Some(self.device))
                    && grad.storage_id.is_none_or(|id| self.seen.insert(id))
                {
                    put_row(&mut gradient_rows, &mut n_gradients, name, TensorKind::Gradient, grad.nbytes as i64);
                }
            }
        }
        weight_rows.truncate(n_weights);
        gradient_rows.truncate(n_gradients);
        record.weights = weight_rows.iter().map(|r| r.bytes).sum();
        record.gradients = gradient_rows.iter().map(|r| r.bytes).sum();
        (record.weight_rows, record.gradient_rows) = (weight_rows, gradient_rows);
        record.optimizer_state_measured = record.current_allocated - record.weights - record.gradients;
        match optimizer {
            Some(optimizer) => {
                let stores: Vec<(String, Arc<Mutex<Variables>>)> =
                    self.var_stores.iter().map(|v| (String::new(), v.clone())).collect();
                let states = OptimizerStates::read(optimizer, &stores)?;
                let mut n_states = 0;
                for (name, tensor) in &states.tensors {
                    let (info, _) = storages(tensor)?;
                    if info.device == Some(self.device) && info.storage_id.is_none_or(|id| self.seen.insert(id)) {
                        put_row(&mut state_rows, &mut n_states, name, TensorKind::OptimizerState, info.nbytes as i64);
                    }
                }
                state_rows.truncate(n_states);
                record.optimizer_state = Some(state_rows.iter().map(|r| r.bytes).sum());
                record.optimizer_state_rows = state_rows;
            }
            None => {
                record.optimizer_state_estimate = self.optimizer.map(|k| k.state_buffers() as i64 * record.weights);
            }
        }
        match backward {
            Some((at_mark, during)) => {
                record.feature_maps = at_mark - start_allocated;
                let held = at_mark.max(record.current_allocated);
                record.intermediate_gradients = Some((during.peak - held).max(0));
            }
            None => record.feature_maps = record.peak_allocated - start_allocated,
        }
        Ok(record)
    }

    fn write_csv(&mut self, record: &IterationRecord) {
        let Some(dir) = &self.csv_dir else { return };
        if self.csv_failed {
            return;
        }
        let written = match &mut self.csv_files {
            Some(files) => files.append(record),
            None => CsvFiles::open(dir).and_then(|mut files| files.append(record).map(|()| files)).map(|files| {
                self.csv_files = Some(files);
            }),
        };
        if let Err(e) = written {
            self.csv_failure(e);
        }
    }

    /// Writes the CSV rows still buffered (they are written at least once a
    /// second, at every [`epoch_end`](Self::epoch_end) and when the monitor is
    /// dropped anyway). A failure is reported like any CSV failure.
    pub fn flush(&mut self) {
        if let Some(Err(e)) = self.csv_files.as_mut().map(CsvFiles::flush) {
            self.csv_failure(e);
        }
    }

    fn csv_failure(&mut self, e: std::io::Error) {
        let dir = self.csv_dir.as_deref().unwrap_or(Path::new(""));
        let message = format!(
            "memlab TrainingMonitor: cannot write CSV files in {}: {e}; monitoring goes on without them",
            dir.display()
        );
        memlab_core::output::warn(&format!("{message}\n"));
        self.last_error = Some(Error::io(format!("write CSV files in {}", dir.display()), e));
        self.csv_failed = true;
        self.csv_files = None;
    }
}

impl Drop for TrainingMonitor {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A variable's name and bytes.
type Row = TensorBytes;

/// Sets row `*n` of `rows` to (`name`, `bytes`), reusing the row's string
/// when there is one, and counts it.
fn put_row(rows: &mut Vec<Row>, n: &mut usize, name: &str, kind: TensorKind, bytes: i64) {
    match rows.get_mut(*n) {
        Some(row) => {
            row.name.clear();
            row.name.push_str(name);
            row.kind = kind;
            row.bytes = bytes;
        }
        None => rows.push(TensorBytes { name: name.to_string(), kind, bytes }),
    }
    *n += 1;
}

/// A var store's trainable tensors (the named walk's rule: a variable is a
/// parameter if tch trains it, else a buffer), read again only when a list
/// changes length: a variable's tensor stays the same object wherever its
/// data moves, and tch never removes one.
#[derive(Default)]
struct StoreKinds {
    /// How many variables and trainable variables the store had when read.
    counts: Option<(usize, usize)>,
    /// What tch trains.
    trainable: Trainable,
}

impl StoreKinds {
    /// Reads the trainable tensors again if the store's lists changed length.
    fn refresh(&mut self, variables: &Variables) {
        let counts = (variables.named_variables.len(), variables.trainable_variables.len());
        if self.counts != Some(counts) {
            self.trainable = Trainable::of(variables);
            self.counts = Some(counts);
        }
    }

    /// What `tensor`, a variable of the store, is.
    fn kind(&self, tensor: &Tensor) -> TensorKind {
        self.trainable.kind(tensor)
    }
}

displayed_as_text!(IterationRecord);

impl Render for IterationRecord {
    fn document(&self) -> Document {
        const WIDTH: usize = 48;
        let mut doc = Document::new();
        doc.banner(format!(
            "Memory of iteration {} of epoch {} on {}",
            self.iteration,
            self.epoch,
            self.device.map(|d| d.to_string()).unwrap_or_default()
        ));
        doc.label(WIDTH, "Peak reserved (cached)", Cell::bytes(self.peak_reserved))
            .label(WIDTH, "Current reserved (cached)", Cell::bytes(self.current_reserved))
            .label(WIDTH, "Peak allocated", Cell::bytes(self.peak_allocated))
            .label(WIDTH, "Current allocated", Cell::bytes(self.current_allocated));
        match self.intermediate_gradients {
            Some(ig) => {
                doc.label(WIDTH, "Feature maps (held when backward began)", Cell::bytes(self.feature_maps));
                doc.label(WIDTH, "Intermediate gradients (backward's transient)", Cell::bytes(ig));
            }
            None => {
                doc.label(WIDTH, "Feature maps (peak above start)", Cell::bytes(self.feature_maps));
            }
        }
        doc.blank().label(WIDTH, "Weights", Cell::bytes(self.weights));
        for TensorBytes { name, kind, bytes } in &self.weight_rows {
            let buffer = if *kind == TensorKind::Buffer { " (buffer)" } else { "" };
            doc.label(WIDTH, format!("  {name}{buffer}"), Cell::bytes(*bytes));
        }
        doc.blank().label(WIDTH, "Weight gradients", Cell::bytes(self.gradients));
        for TensorBytes { name, bytes, .. } in &self.gradient_rows {
            doc.label(WIDTH, format!("  {name} grad"), Cell::bytes(*bytes));
        }
        doc.blank();
        match self.optimizer_state {
            Some(state) => {
                doc.label(WIDTH, "Optimizer state", Cell::bytes(state));
                for TensorBytes { name, bytes, .. } in &self.optimizer_state_rows {
                    doc.label(WIDTH, format!("  {name}"), Cell::bytes(*bytes));
                }
                doc.label(WIDTH, "Other kept tensors", Cell::bytes(self.optimizer_state_measured - state));
            }
            None => {
                doc.label(WIDTH, "Optimizer state and kept tensors", Cell::bytes(self.optimizer_state_measured));
                if let Some(estimate) = self.optimizer_state_estimate {
                    doc.label(WIDTH, "  optimizer state (estimate)", Cell::bytes(estimate));
                }
            }
        }
        doc
    }
}
