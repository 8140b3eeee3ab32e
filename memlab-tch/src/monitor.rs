//! `TrainingMonitor`: per-iteration memory of a training loop — cache, weights,
//! gradients, optimizer state, feature maps — printed every few iterations
//! and appended to CSV files.
//!
//! Call [`record_stats`](TrainingMonitor::record_stats) after each iteration
//! and [`epoch_end`](TrainingMonitor::epoch_end) after each epoch. Everything
//! is measured from the allocator and the model's storages; the optimizer's
//! state, which tch keeps inside its C++ optimizer, is measured as what stays
//! allocated besides weights and gradients, and an estimate for the optimizer
//! named with [`optimizer`](TrainingMonitor::optimizer) is shown beside it,
//! labelled as one.

use std::fmt::{self, Write as _};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memlab_core::profiler::PeakWatch;
use memlab_core::{format_bytes, Device, Result};

use tch::nn::{VarStore, Variables};

use crate::storage::facts;
use crate::{registry, BACKEND};

/// The optimizers whose state size memlab can estimate from the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one buffer per parameter.
    SgdMomentum,
    /// Adam or AdamW: two buffers per parameter (and a step count).
    Adam,
    /// RMSprop: one buffer per parameter (two when centered).
    RmsProp,
}

impl OptimizerKind {
    fn buffers(self) -> u64 {
        match self {
            OptimizerKind::Sgd => 0,
            OptimizerKind::SgdMomentum | OptimizerKind::RmsProp => 1,
            OptimizerKind::Adam => 2,
        }
    }
}

/// The memory of one recorded iteration. Byte counts are exact unless the
/// field's name says `estimate`.
#[derive(Clone, Debug, Default)]
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
    /// Per variable: name and bytes.
    pub weight_rows: Vec<(String, i64)>,
    /// Bytes of the weights' gradients, in total and per variable.
    pub gradients: i64,
    /// Per variable: name and bytes of its gradient.
    pub gradient_rows: Vec<(String, i64)>,
    /// Allocated bytes besides weights and gradients that stay between
    /// iterations: the optimizer's state and anything else the loop keeps.
    pub optimizer_state_measured: i64,
    /// What the named optimizer's state should take (an estimate).
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
/// let mut monitor = memlab_tch::TrainingMonitor::new(&vs).print_period(0);
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
    optimizer: Option<OptimizerKind>,
    csv_dir: Option<PathBuf>,
    csv_failed: bool,
    epoch: u64,
    iteration: u64,
    watch: Option<PeakWatch>,
    /// Set by `mark_backward`: allocated bytes then, and a watch of the backward pass.
    backward: Option<(i64, PeakWatch)>,
    last: Option<IterationRecord>,
    last_error: Option<String>,
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
        let stores = registry::var_stores().into_iter().filter_map(|vs| vs.variables.upgrade()).collect();
        TrainingMonitor::with_stores(stores)
    }

    fn with_stores(var_stores: Vec<Arc<Mutex<Variables>>>) -> TrainingMonitor {
        let device = crate::auto_device();
        let mut monitor = TrainingMonitor {
            var_stores,
            device,
            print_period: 1,
            optimizer: None,
            csv_dir: None,
            csv_failed: false,
            epoch: 1,
            iteration: 0,
            watch: None,
            backward: None,
            last: None,
            last_error: None,
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

    /// Names the optimizer, so that reports show an estimate of its state.
    pub fn optimizer(mut self, kind: OptimizerKind) -> TrainingMonitor {
        self.optimizer = Some(kind);
        self
    }

    /// Appends every record to `dir/memlab_iterations.csv` (one row per
    /// iteration) and `dir/memlab_variables.csv` (one row per variable and
    /// iteration). A directory that cannot be written is reported once, on
    /// standard error and by [`last_error`](Self::last_error); training goes on.
    pub fn csv_dir(mut self, dir: impl Into<PathBuf>) -> TrainingMonitor {
        self.csv_dir = Some(dir.into());
        self
    }

    /// The last record.
    pub fn last(&self) -> Option<&IterationRecord> {
        self.last.as_ref()
    }

    /// The last problem met (measuring or writing CSV), if any.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    fn start_interval(&mut self) {
        self.watch = None;
        match PeakWatch::start(&BACKEND, self.device) {
            Ok(watch) => self.watch = Some(watch),
            Err(e) => self.last_error = Some(e.to_string()),
        }
    }

    /// Records the iteration that just ended: measures, prints when the
    /// period says so, appends to the CSV files. Never interrupts training:
    /// problems are kept in [`last_error`](Self::last_error).
    pub fn record_stats(&mut self) -> Option<&IterationRecord> {
        self.iteration += 1;
        match self.measure() {
            Ok(record) => {
                if self.print_period > 0 && self.iteration.is_multiple_of(self.print_period) {
                    memlab_core::profiler::emit(&record.to_string());
                }
                self.write_csv(&record);
                self.last = Some(record);
            }
            Err(e) => self.last_error = Some(e.to_string()),
        }
        self.start_interval();
        self.last.as_ref()
    }

    /// Marks the start of the backward pass of this iteration (call it right
    /// before `backward()` or `backward_step`'s backward): the record then
    /// separates the feature maps that forward kept from the intermediate
    /// gradients of backward.
    pub fn mark_backward(&mut self) {
        let allocated = crate::device_stats(self.device).map(|s| s.allocated_bytes.all.current);
        match (allocated, PeakWatch::start(&BACKEND, self.device)) {
            (Ok(a), Ok(w)) => self.backward = Some((a, w)),
            (Err(e), _) | (_, Err(e)) => self.last_error = Some(e.to_string()),
        }
    }

    /// Ends an epoch: iterations count from 1 again.
    pub fn epoch_end(&mut self) {
        self.epoch += 1;
        self.iteration = 0;
    }

    fn measure(&mut self) -> Result<IterationRecord> {
        let backward = match self.backward.take() {
            Some((at_mark, watch)) => Some((at_mark, watch.finish()?.1.to_device_stats())),
            None => None,
        };
        // The watch's first sample is the level the iteration began at.
        let (start, end) = match self.watch.take() {
            Some(watch) => watch.finish()?,
            None => {
                let now = crate::raw_stats(self.device)?;
                (now, now)
            }
        };
        let start_allocated = start.to_device_stats().allocated_bytes.all.current;
        let end = end.to_device_stats();
        let mut record = IterationRecord {
            epoch: self.epoch,
            iteration: self.iteration,
            device: Some(self.device),
            peak_reserved: end.reserved_bytes.all.peak,
            current_reserved: end.reserved_bytes.all.current,
            peak_allocated: end.allocated_bytes.all.peak,
            current_allocated: end.allocated_bytes.all.current,
            ..IterationRecord::default()
        };
        let mut seen = std::collections::HashSet::new();
        for variables in &self.var_stores {
            let variables = variables.lock().unwrap_or_else(|e| e.into_inner());
            let mut names: Vec<&String> = variables.named_variables.keys().collect();
            names.sort();
            for name in names {
                let (param, grad) = facts(&variables.named_variables[name], true)?;
                if param.info.device == Some(self.device) && seen.insert(param.info.storage_id) {
                    record.weights += param.info.nbytes as i64;
                    record.weight_rows.push((name.clone(), param.info.nbytes as i64));
                }
                if let Some(grad) = grad.filter(|g| g.info.device == Some(self.device)) {
                    if seen.insert(grad.info.storage_id) {
                        record.gradients += grad.info.nbytes as i64;
                        record.gradient_rows.push((name.clone(), grad.info.nbytes as i64));
                    }
                }
            }
        }
        record.optimizer_state_measured = record.current_allocated - record.weights - record.gradients;
        record.optimizer_state_estimate = self.optimizer.map(|k| k.buffers() as i64 * record.weights);
        match backward {
            Some((at_mark, during)) => {
                record.feature_maps = at_mark - start_allocated;
                let held = at_mark.max(record.current_allocated);
                record.intermediate_gradients = Some((during.allocated_bytes.all.peak - held).max(0));
            }
            None => record.feature_maps = record.peak_allocated - start_allocated,
        }
        Ok(record)
    }

    fn write_csv(&mut self, record: &IterationRecord) {
        let Some(dir) = self.csv_dir.clone() else { return };
        if self.csv_failed {
            return;
        }
        if let Err(e) = append_csv(&dir, record) {
            let message = format!(
                "memlab TrainingMonitor: cannot write CSV files in {}: {e}; monitoring goes on without them",
                dir.display()
            );
            eprintln!("{message}");
            self.last_error = Some(message);
            self.csv_failed = true;
        }
    }
}

const ITERATION_HEADER: [&str; 13] = [
    "epoch",
    "iteration",
    "device",
    "peak_reserved",
    "current_reserved",
    "peak_allocated",
    "current_allocated",
    "weights",
    "gradients",
    "optimizer_state_measured",
    "optimizer_state_estimate",
    "feature_maps",
    "intermediate_gradients",
];

const VARIABLE_HEADER: [&str; 6] = ["epoch", "iteration", "device", "variable", "kind", "bytes"];

/// Opens `path` for appending; writes the header when the file is new, and
/// refuses a file whose header is another one.
fn open_csv(path: &Path, header: &[&str]) -> std::io::Result<csv::Writer<File>> {
    let expected = header.join(",");
    let exists = path.exists();
    if exists {
        let first = BufReader::new(File::open(path)?).lines().next().transpose()?.unwrap_or_default();
        if !first.is_empty() && first != expected {
            return Err(std::io::Error::other(format!(
                "{} already exists with other columns; move it away or choose another directory",
                path.display()
            )));
        }
    }
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    let empty = file.metadata()?.len() == 0;
    let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(file);
    if empty {
        w.write_record(header)?;
    }
    Ok(w)
}

fn append_csv(dir: &Path, r: &IterationRecord) -> std::io::Result<()> {
    if !dir.is_dir() {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "the directory does not exist; create it first"));
    }
    let device = r.device.map(|d| d.to_string()).unwrap_or_default();
    let mut w = open_csv(&dir.join("memlab_iterations.csv"), &ITERATION_HEADER)?;
    w.write_record([
        r.epoch.to_string(),
        r.iteration.to_string(),
        device.clone(),
        r.peak_reserved.to_string(),
        r.current_reserved.to_string(),
        r.peak_allocated.to_string(),
        r.current_allocated.to_string(),
        r.weights.to_string(),
        r.gradients.to_string(),
        r.optimizer_state_measured.to_string(),
        r.optimizer_state_estimate.map(|e| e.to_string()).unwrap_or_default(),
        r.feature_maps.to_string(),
        r.intermediate_gradients.map(|e| e.to_string()).unwrap_or_default(),
    ])?;
    w.flush()?;
    let mut w = open_csv(&dir.join("memlab_variables.csv"), &VARIABLE_HEADER)?;
    let rows = r.weight_rows.iter().map(|x| (x, "weight")).chain(r.gradient_rows.iter().map(|x| (x, "gradient")));
    for ((name, bytes), kind) in rows {
        w.write_record([
            r.epoch.to_string(),
            r.iteration.to_string(),
            device.clone(),
            name.clone(),
            kind.to_string(),
            bytes.to_string(),
        ])?;
    }
    w.flush()?;
    Ok(())
}

impl fmt::Display for IterationRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let line = |label: &str, value: String| format!("{label:.<48}{value:>10}\n");
        let mut out = String::new();
        let title = format!(
            "Memory of iteration {} of epoch {} on {}",
            self.iteration,
            self.epoch,
            self.device.map(|d| d.to_string()).unwrap_or_default()
        );
        let stars = "*".repeat(title.len());
        writeln!(out, "{stars}\n{title}\n{stars}").unwrap();
        out += &line("Peak reserved (cached)", format_bytes(self.peak_reserved));
        out += &line("Current reserved (cached)", format_bytes(self.current_reserved));
        out += &line("Peak allocated", format_bytes(self.peak_allocated));
        out += &line("Current allocated", format_bytes(self.current_allocated));
        match self.intermediate_gradients {
            Some(ig) => {
                out += &line("Feature maps (held when backward began)", format_bytes(self.feature_maps));
                out += &line("Intermediate gradients (backward's transient)", format_bytes(ig));
            }
            None => out += &line("Feature maps (peak above start)", format_bytes(self.feature_maps)),
        }
        out.push('\n');
        out += &line("Weights", format_bytes(self.weights));
        for (name, bytes) in &self.weight_rows {
            out += &line(&format!("  {name}"), format_bytes(*bytes));
        }
        out.push('\n');
        out += &line("Weight gradients", format_bytes(self.gradients));
        for (name, bytes) in &self.gradient_rows {
            out += &line(&format!("  {name} grad"), format_bytes(*bytes));
        }
        out.push('\n');
        out += &line("Optimizer state and kept tensors", format_bytes(self.optimizer_state_measured));
        if let Some(estimate) = self.optimizer_state_estimate {
            out += &line("  optimizer state (estimate)", format_bytes(estimate));
        }
        f.write_str(&out)
    }
}
