//! `MemReporter`: what occupies memory, by name, every byte accounted for.
//!
//! ```rust
//! use tch::nn;
//!
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let _fc = nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
//! memlab::register_var_store("model", &vs);            // held weakly
//! let report = memlab::MemReporter::registered().report()?; // or MemReporter::new(&vs)
//! println!("{report}");
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! It walks the var stores and tensors it was given (or that were registered)
//! and sets the total against the allocator's own figure: the rows of each
//! device add up to the allocator's allocated bytes. Every byte the allocator
//! holds lands in a row: named storages; on CUDA the workspaces libtorch keeps
//! for cuBLAS and cuBLASLt, one per handle and stream (the forward pass's
//! thread and autograd's each have theirs; 32 MiB for cuBLAS and 1 MiB for
//! cuBLASLt on an H100), read from libtorch's own tables with their blocks'
//! exact bytes; then the live allocations no named
//! tensor owns, grouped by the statement or backtrace that allocated them while
//! a [`Recording`](crate::Recording) or dispose scope is on; what could not be
//! attributed; and on CUDA the rounding to the allocator's block sizes.
//!
//! Every storage is counted once: a storage that several named tensors view (a
//! tied weight, LSTM weights flattened into one buffer) gets a row of its own,
//! `storage #N: K views`, with its bytes, and each view follows as
//! `name(->storage #N)` with its own size in parentheses, not added again.
//! Gradients appear as `name.grad`, sparse tensors as their indices and values.
//! Memory libtorch's allocator never allocated (`Tensor::from_blob`) is listed
//! below the total, outside the allocator's figures.
//!
//! The report prints with `{}`, and also renders with `to_html()`, `to_csv()`,
//! `to_json()` and `evcxr_display()`. `bash scripts/demo.sh` aside,
//! `cargo run --release --example mem_report` shows it before and after a
//! backward pass, and after an Adam step.
//!
//! # One model for every tool
//!
//! What a tool names memory after is a [`Model`]: the registry
//! (`Model::registered()`), or var stores, named tensors and optimizers given to
//! it. Describe it once and give it to each tool; the tools' own `var_store`,
//! `tensor` and `optimizer` methods add to theirs:
//!
//! ```rust
//! # use tch::nn;
//! # let vs = nn::VarStore::new(tch::Device::Cpu);
//! # let kv_cache = tch::Tensor::zeros([1024], (tch::Kind::Float, tch::Device::Cpu));
//! let model = memlab::Model::new().var_store("model", &vs).tensor("kv_cache", &kv_cache);
//! let report = memlab::MemReporter::of(model.clone()).report()?;
//! let exporter = memlab::export::Exporter::of(model.clone()); // the same names in the exports
//! let courtesy = memlab::Courtesy::of(model);                 // the same tensors move
//! # drop((report, exporter, courtesy));
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! # Optimizer state
//!
//! tch keeps an optimizer's state inside libtorch's C++ object, out of reach of
//! its API; give the optimizer to the reporter and memlab reads it, naming each
//! tensor after its parameter and libtorch's name for it (`exp_avg`,
//! `exp_avg_sq`, `max_exp_avg_sq` with amsgrad, `momentum_buffer`,
//! `square_avg`, `grad_avg`), with exact bytes:
//!
//! ```rust
//! use tch::nn::{self, Module, OptimizerConfig};
//!
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let encoder = nn::linear(vs.root() / "encoder", 1024, 1024, Default::default());
//! memlab::register_var_store("model", &vs);
//! let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
//! let x = tch::Tensor::ones([8, 1024], (tch::Kind::Float, tch::Device::Cpu));
//! adam.backward_step(&encoder.forward(&x).sum(tch::Kind::Float));
//! let report = memlab::MemReporter::registered().optimizer(&adam).report()?;
//! println!("{report}");
//! # use memlab::Render;
//! # assert_eq!(report.to_text().matches(".exp_avg").count(), 4);
//! # Ok::<(), memlab::Error>(())
//! ```
//! ```text
//! Storage on cpu
//! name                                                                          shape  dtype          bytes
//! ---------------------------------------------------------------------------------------------------------
//! model.encoder.bias                                                           [1024]  Float          4.00K
//! model.encoder.bias.grad                                                      [1024]  Float          4.00K
//! model.encoder.weight                                                   [1024, 1024]  Float          4.00M
//! model.encoder.weight.grad                                              [1024, 1024]  Float          4.00M
//! model.encoder.bias.exp_avg                                                   [1024]  Float          4.00K
//! model.encoder.bias.exp_avg_sq                                                [1024]  Float          4.00K
//! model.encoder.weight.exp_avg                                           [1024, 1024]  Float          4.00M
//! model.encoder.weight.exp_avg_sq                                        [1024, 1024]  Float          4.00M
//! not named (activations, temporaries, workspaces): a memlab::Recording                              32.00K
//!     lists them by site
//! ---------------------------------------------------------------------------------------------------------
//! named: 16.02M in 4198400 elements; allocated on cpu: 16.05M (every byte above)
//!
//! Optimizer Adam: 4 state tensor(s), listed above by name
//! ```
//!
//! The optimizer is only borrowed for the call (tch frees it when it drops, and
//! every step changes its state), so the report shows the state as of that call.
//! It must have been built on a var store the reporter knows (given or
//! registered): that is where the names come from, and an optimizer built on
//! another store is an error that says so. Adam, AdamW, SGD and RMSprop are read
//! (tch builds no other). Parameters with no state yet (before the first step,
//! frozen, plain SGD) and variables created after the optimizer (tch takes them
//! in at its next step) are listed below the table rather than guessed.
//!
//! To have every tool that works from the registry name the state
//! (`MemReporter::registered()`, `track!()`, `where_gpu_memory_went`,
//! `Courtesy::new()`, dispose scopes, the out-of-memory recorder), register the
//! optimizer where you build it:
//!
//! ```rust
//! # use tch::nn::{self, Module, OptimizerConfig};
//! # use tch::{Device, Kind, Tensor};
//! # fn train_step(model: &nn::Linear, opt: &mut nn::Optimizer) {
//! #     let x = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
//! #     opt.backward_step(&model.forward(&x).sum(Kind::Float));
//! # }
//! # let vs = nn::VarStore::new(Device::Cpu);
//! # let model = nn::linear(vs.root() / "fc", 8, 8, Default::default());
//! # memlab::register_var_store("model", &vs);
//! # let batches: Vec<Tensor> = (0..2).map(|_| Tensor::ones([4, 8], (Kind::Float, Device::Cpu))).collect();
//! let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
//! for batch in &batches {
//!     opt.backward_step(&model.forward(batch).sum(Kind::Float)); // registers the state the step made
//! }
//! // Code written for `&mut nn::Optimizer` runs inside `with_mut`:
//! opt.with_mut(|opt| train_step(&model, opt));
//! assert_eq!(opt.registered_states(), 4); // Adam's two moments of the weight and the bias
//! # memlab::clear_registry();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`register_optimizer`](crate::register_optimizer) takes the optimizer and
//! gives back a [`RegisteredOptimizer`](crate::RegisteredOptimizer): the same
//! optimizer (it derefs to tch's, for reading), whose step methods register the
//! state libtorch creates at the first step. memlab reads the optimizer only
//! there, on the thread that steps it: reading its state while a step changes it
//! on another thread would race with libtorch (see the "Threads" section of
//! [`crate::oom`] for which reads race with a step).

use memlab_core::events;
use memlab_core::render::{csv_string, Cell, Column, Document, Layout, Render, Table};
use memlab_core::{DType, Device, Result};
use serde::Serialize;
use tch::nn::VarStore;

use crate::attribution::{attribute, site_label};
use crate::named::{Model, Named};
use memlab_core::TensorKind;

/// What a row of the report is: a named tensor of one of the kinds every
/// tool names, or what accounts for the rest of the allocator's figure.
/// JSON and CSV write each by [`as_str`](RowKind::as_str): a named tensor by
/// its kind's name (`optimizer_state`), the others by their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// A named tensor: a parameter, a buffer, a gradient, optimizer state
    /// (named after its parameter and libtorch's name for it:
    /// `fc.weight.exp_avg`, `fc.weight.momentum_buffer`, …) or a tensor
    /// added or registered by name.
    Named(TensorKind),
    /// A storage that several named tensors view, or that one named tensor
    /// views only part of: its bytes, once. The views follow it as rows of
    /// their own kind, named `name(->storage #N)`, with their own size, not
    /// counted again.
    Storage,
    /// A named storage whose memory did not come from the allocator
    /// (`Tensor::from_blob`, or a CPU tensor made before memlab's allocator
    /// was installed): listed outside the allocator's sum.
    External,
    /// A live allocation no named tensor owns (activations, autograd
    /// buffers, temporaries, workspaces), grouped by allocation site.
    Unnamed,
    /// CUDA: a workspace libtorch keeps for itself, named by what it is for
    /// (`cuBLAS workspace (handle 0x…, stream 0x…)`): read from libtorch's
    /// own tables, its bytes those its allocator's block was asked for.
    Workspace,
    /// Bytes the allocator holds that memlab could not attribute.
    Unattributed,
    /// CUDA: what the caching allocator added by rounding blocks up.
    Rounding,
}

impl RowKind {
    /// The kind as CSV and JSON name it (`optimizer_state`, `unnamed`).
    pub fn as_str(self) -> &'static str {
        match self {
            RowKind::Named(kind) => kind.as_str(),
            RowKind::Storage => "storage",
            RowKind::External => "external",
            RowKind::Unnamed => memlab_core::kind::UNNAMED,
            RowKind::Workspace => "workspace",
            RowKind::Unattributed => "unattributed",
            RowKind::Rounding => "rounding",
        }
    }
}

/// Written by its name, as in CSV.
impl Serialize for RowKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// One row of a device's section.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Row {
    /// What it is.
    pub kind: RowKind,
    /// The tensor's name, `name(->storage #N)` for a view of a shared
    /// storage, or a description for the other kinds.
    pub name: String,
    /// The tensor's shape (empty for the other kinds).
    pub shape: Vec<i64>,
    /// The element type (`None` for the other kinds).
    pub dtype: Option<DType>,
    /// Elements (for blocks: how many).
    pub count: u64,
    /// Bytes: a storage's bytes for a tensor that is its whole storage and for
    /// a [`RowKind::Storage`] row; a view's own size (elements × element size)
    /// for the views listed under a storage row.
    pub bytes: i64,
    /// Whether `bytes` is part of the device's sum, which equals the
    /// allocator's allocated bytes. Views (their storage row counts them) and
    /// [`RowKind::External`] rows are not.
    pub counted: bool,
}

/// The report of one device.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct DeviceReport {
    /// The device.
    pub device: Device,
    /// Named tensors first (in the order they were found), then the rows that
    /// account for the rest of the allocator's figure.
    pub rows: Vec<Row>,
    /// Bytes of the named storages the allocator allocated.
    pub named_bytes: u64,
    /// Elements of those storages.
    pub named_elements: u64,
    /// Bytes of named storages the allocator did not allocate
    /// ([`RowKind::External`] rows), not part of its figures.
    pub external_bytes: u64,
    /// What the allocator says is allocated (`allocated_bytes.all.current`).
    pub allocated_bytes: i64,
}

/// What occupies memory, per device.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct MemReport {
    /// One section per device, CPU first.
    pub devices: Vec<DeviceReport>,
    /// The optimizers given, with the variables they keep no state for.
    pub optimizers: Vec<OptimizerReport>,
}

/// An optimizer given to the reporter: its state tensors are rows of the
/// device sections; here is what it holds no state for, and why.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct OptimizerReport {
    /// Its class.
    pub kind: memlab_tch::optimizer::OptimizerKind,
    /// How many state tensors it holds.
    pub state_tensors: usize,
    /// Parameters it has taken in but holds no state for: no step since
    /// they joined, no gradient (frozen), or an optimizer without state
    /// (SGD without momentum).
    pub stateless: Vec<String>,
    /// Trainable variables it has not taken in yet: created after it was
    /// built (tch adds them at its next step or `zero_grad`).
    pub absent: Vec<String>,
}

/// Builds [`MemReport`]s from var stores and named tensors.
///
/// ```
/// use tch::{nn, Device, Kind};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _linear = nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
/// let report = memlab::MemReporter::default().var_store("model", &vs).report()?;
/// let cpu = report.device(memlab::Device::Cpu).unwrap();
/// assert_eq!(cpu.rows[0].name, "model.fc.bias");
/// assert_eq!(cpu.named_bytes, (1024 * 1024 + 1024) * 4);
/// println!("{report}");
/// # Ok::<(), memlab::Error>(())
/// ```
#[derive(Default)]
pub struct MemReporter {
    sources: Model,
    device: Option<Device>,
}

crate::named::names_memory_after_its_model!(MemReporter, sources);

impl MemReporter {
    /// A reporter over `vs` (its variables keep their own names); add more
    /// var stores, with a prefix, and named tensors to it.
    pub fn new(vs: &VarStore) -> MemReporter {
        MemReporter::default().var_store("", vs)
    }

    /// A reporter over everything registered with
    /// [`register_var_store`](crate::register_var_store) and
    /// [`register_tensor`](crate::register_tensor), plus what is added to it.
    pub fn registered() -> MemReporter {
        MemReporter::of(Model::registered())
    }

    /// A reporter that names memory after `model` (or a var store, `of(&vs)`).
    /// Its state rows are exact, tensor by tensor, with an optimizer given:
    ///
    /// ```
    /// use tch::nn::{self, Module, OptimizerConfig};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let fc = nn::linear(vs.root() / "fc", 64, 64, Default::default());
    /// let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    /// opt.backward_step(&fc.forward(&Tensor::ones([8, 64], (Kind::Float, Device::Cpu))).sum(Kind::Float));
    /// let report = memlab::MemReporter::new(&vs).optimizer(&opt).report()?;
    /// let rows = &report.device(memlab::Device::Cpu).unwrap().rows;
    /// let moment = rows.iter().find(|r| r.name == "fc.weight.exp_avg_sq").unwrap();
    /// assert_eq!(moment.bytes, 64 * 64 * 4);
    /// # Ok::<(), memlab::Error>(())
    /// ```
    pub fn of(model: impl Into<Model>) -> MemReporter {
        MemReporter { sources: model.into(), device: None }
    }

    /// Reports only `device`.
    pub fn device(mut self, device: Device) -> MemReporter {
        self.device = Some(device);
        self
    }

    /// The report as it stands now.
    pub fn report(&self) -> Result<MemReport> {
        let mut named = self.sources.collect()?;
        let mut devices: Vec<Device> = vec![Device::Cpu];
        devices.extend((0..memlab_tch::cuda_device_count()).map(Device::Cuda));
        devices.retain(|d| self.device.is_none_or(|only| only == *d));
        let live = if events::is_active() { Some(events::live()) } else { None };
        let mut out = Vec::new();
        for device in devices {
            let section = section(device, &mut named, live.as_deref())?;
            if section.allocated_bytes != 0 || !section.rows.is_empty() {
                out.push(section);
            }
        }
        let optimizers = self
            .sources
            .optimizers()
            .iter()
            .map(|o| OptimizerReport {
                kind: o.kind,
                state_tensors: o.tensors.len(),
                stateless: o.stateless.clone(),
                absent: o.absent.clone(),
            })
            .collect();
        Ok(MemReport { devices: out, optimizers })
    }
}

/// The rows of `device`: its named storages (a shared storage as a row of its
/// own with its views under it), then what accounts for the rest of the
/// allocator's figure, then storages outside the allocator.
fn section(device: Device, named: &mut Named, live: Option<&[events::LiveAllocation]>) -> Result<DeviceReport> {
    let attribution = attribute(device, &memlab_tch::device_stats(device)?, named, live);
    let (mut rows, mut external) = (Vec::new(), Vec::new());
    let mut named_elements = 0u64;
    let mut shared = 0;
    let kind_of = RowKind::Named;
    for storage in named.take_storages(device) {
        let out = if storage.from_allocator { &mut rows } else { &mut external };
        if storage.from_allocator {
            named_elements += storage.nbytes / storage.element_size;
        }
        if storage.is_single() {
            let view = storage.views.into_iter().next().expect("a single view");
            out.push(Row {
                kind: if storage.from_allocator { kind_of(view.kind) } else { RowKind::External },
                name: view.name,
                shape: view.shape,
                dtype: Some(view.dtype),
                count: view.numel,
                bytes: storage.nbytes as i64,
                counted: storage.from_allocator,
            });
            continue;
        }
        shared += 1;
        let label = format!("storage #{shared}");
        let views = storage.views.len();
        out.push(Row {
            kind: if storage.from_allocator { RowKind::Storage } else { RowKind::External },
            name: format!("{label}: {views} view{}", if views == 1 { "" } else { "s" }),
            // A storage is a flat buffer of elements.
            shape: vec![(storage.nbytes / storage.element_size) as i64],
            dtype: Some(storage.views[0].dtype),
            count: storage.nbytes / storage.element_size,
            bytes: storage.nbytes as i64,
            counted: storage.from_allocator,
        });
        for view in storage.views {
            out.push(Row {
                kind: kind_of(view.kind),
                name: format!("{}(->{label})", view.name),
                shape: view.shape,
                dtype: Some(view.dtype),
                count: view.numel,
                bytes: view.own_bytes as i64,
                counted: false,
            });
        }
    }
    let other = |kind: RowKind, name: String, count: u64, bytes: i64| Row {
        kind,
        name,
        shape: Vec::new(),
        dtype: None,
        count,
        bytes,
        counted: true,
    };
    for w in &attribution.workspaces {
        rows.push(other(RowKind::Workspace, w.label.clone(), 1, w.bytes as i64));
    }
    for site in attribution.unnamed.iter().flatten() {
        rows.push(other(RowKind::Unnamed, format!("not named: {}", site_label(site)), site.blocks, site.bytes as i64));
    }
    let rest = attribution.unattributed;
    if rest != 0 {
        let why = if rest < 0 {
            "named storages the allocator no longer counts (its totals were reset or it was replaced)"
        } else if attribution.unnamed.is_some() {
            "not named, allocated before recording began"
        } else {
            "not named (activations, temporaries, workspaces): a memlab::Recording lists them by site"
        };
        rows.push(other(RowKind::Unattributed, why.to_string(), 0, rest));
    }
    if attribution.rounding != 0 {
        rows.push(other(
            RowKind::Rounding,
            "the caching allocator's rounding to its block sizes".to_string(),
            0,
            attribution.rounding,
        ));
    }
    rows.extend(external);
    Ok(DeviceReport {
        device,
        rows,
        named_bytes: attribution.named,
        named_elements,
        external_bytes: attribution.external,
        allocated_bytes: attribution.allocated,
    })
}

impl MemReport {
    /// The section of `device`.
    pub fn device(&self, device: Device) -> Option<&DeviceReport> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// One CSV row per report row, bytes unrounded (what
    /// [`Render::to_csv`] gives).
    fn rows_csv(&self) -> Result<String> {
        let mut rows = Vec::new();
        for d in &self.devices {
            for r in &d.rows {
                rows.push(vec![
                    d.device.to_string(),
                    r.kind.as_str().to_string(),
                    r.name.clone(),
                    r.shape.iter().map(i64::to_string).collect::<Vec<_>>().join("x"),
                    r.dtype.map(|d| d.to_string()).unwrap_or_default(),
                    r.count.to_string(),
                    r.bytes.to_string(),
                    r.counted.to_string(),
                ]);
            }
        }
        let header = ["device", "kind", "name", "shape", "dtype", "count", "bytes", "counted"];
        csv_string("the memory report", &header, rows)
    }
}

/// Whether `row` is a view listed under its storage's row.
fn is_view(row: &Row) -> bool {
    !row.counted && row.kind != RowKind::External
}

displayed_as_text!(MemReport);

impl Render for MemReport {
    /// One CSV row per report row (storages and their views), bytes unrounded.
    fn to_csv(&self) -> Result<String> {
        self.rows_csv()
    }

    fn document(&self) -> Document {
        let mut doc = Document::new();
        for d in &self.devices {
            let bytes = |r: &Row| {
                // A view's own size is shown, not added: its storage row counts the bytes.
                if is_view(r) {
                    Cell::SharedBytes(r.bytes.into())
                } else {
                    Cell::bytes(r.bytes)
                }
            };
            let shape = |r: &Row| if r.shape.is_empty() { String::new() } else { format!("{:?}", r.shape) };
            let mut table = Table::new(vec![
                Column::new("name", Layout::Text).min_width(12).max_width(72),
                Column::new("shape", Layout::Figure).min_width(5),
                Column::new("dtype", Layout::Text).min_width(8),
                Column::new("bytes", Layout::Figure).min_width(10),
            ])
            .with_header_rule();
            let add = |table: &mut Table, r: &Row| {
                let cells = [
                    Cell::text(&r.name),
                    Cell::text(shape(r)),
                    Cell::text(r.dtype.map(|d| d.to_string()).unwrap_or_default()),
                    bytes(r),
                ];
                table.indented_row(if is_view(r) { 2 } else { 0 }, cells);
            };
            let (inside, outside): (Vec<&Row>, Vec<&Row>) = d.rows.iter().partition(|r| r.kind != RowKind::External);
            for r in &inside {
                add(&mut table, r);
            }
            table.rule().note(format!(
                "named: {} in {} elements; allocated on {}: {} (every byte above)",
                Cell::bytes(d.named_bytes),
                d.named_elements,
                d.device,
                Cell::bytes(d.allocated_bytes)
            ));
            if !outside.is_empty() {
                table.note(format!(
                    "not from the allocator, outside its figures (from_blob memory, or made before memlab's CPU \
                     allocator): {}",
                    Cell::bytes(d.external_bytes)
                ));
                for r in &outside {
                    add(&mut table, r);
                }
            }
            doc.heading(format!("Storage on {}", d.device)).table(table).blank();
        }
        for o in &self.optimizers {
            let kind = format!("{:?}", o.kind);
            doc.line(format!("Optimizer {kind}: {} state tensor(s), listed above by name", o.state_tensors));
            if !o.stateless.is_empty() {
                doc.indented(
                    2,
                    format!(
                        "no state for {} (no step since they joined, no gradient or frozen, or an optimizer \
                         that keeps none)",
                        o.stateless.join(", ")
                    ),
                );
            }
            if !o.absent.is_empty() {
                doc.indented(
                    2,
                    format!(
                        "not in the optimizer yet: {} (created after it was built; tch adds them at its next \
                         step)",
                        o.absent.join(", ")
                    ),
                );
            }
        }
        if !self.optimizers.is_empty() {
            doc.blank();
        }
        doc
    }
}

#[cfg(test)]
mod tests {
    use super::RowKind;
    use memlab_core::TensorKind;

    #[test]
    fn csv_names_kinds_as_json_does() {
        use RowKind::*;
        let named = TensorKind::ALL.map(Named);
        for kind in named.into_iter().chain([Storage, External, Workspace, Unnamed, Unattributed, Rounding]) {
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str(), "{kind:?}");
        }
        assert_eq!(Named(TensorKind::OptimizerState).as_str(), "optimizer_state");
    }
}
