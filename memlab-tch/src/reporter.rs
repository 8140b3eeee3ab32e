//! `MemReporter`: what occupies memory, by name.
//!
//! It walks the var stores and tensors it was given (or that were registered),
//! counts each storage once (views share one), adds gradients as
//! `<name>.grad`, and sets the total against the allocator's own figure. Every
//! byte the allocator holds lands in a row: named storages, unnamed live
//! allocations (listed with where they were allocated while a
//! [`Recording`](crate::Recording) or dispose scope is on), what could not be
//! attributed, and on CUDA the rounding to the allocator's block sizes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write};
use std::sync::{Arc, Mutex};

use memlab_core::events;
use memlab_core::{format_bytes, Device, Error, Result};
use serde::Serialize;
use tch::nn::{VarStore, Variables};
use tch::Tensor;

use crate::registry;
use crate::storage::{facts, Facts, Layout};

/// What a row of the report is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RowKind {
    /// A variable of a var store.
    Parameter,
    /// The gradient of a variable.
    Gradient,
    /// A tensor added or registered by name.
    Tensor,
    /// A live allocation no named tensor owns (activations, autograd
    /// buffers, temporaries, workspaces), grouped by allocation site.
    Unnamed,
    /// Bytes the allocator holds that memlab could not attribute.
    Unattributed,
    /// CUDA: what the caching allocator added by rounding blocks up.
    Rounding,
}

/// One row of a device's section.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Row {
    /// What it is.
    pub kind: RowKind,
    /// The tensor's name, `name(->owner)` for a tensor that shares an earlier
    /// row's storage, or a description for the other kinds.
    pub name: String,
    /// The tensor's shape (empty for the other kinds).
    pub shape: Vec<i64>,
    /// The element type (empty for the other kinds).
    pub dtype: &'static str,
    /// Elements (for blocks: how many).
    pub count: u64,
    /// Bytes counted in this row: a storage's bytes for its first owner, 0
    /// for tensors sharing it. Negative only in the correction row for named
    /// storages that the allocator did not allocate (see [`RowKind::Unattributed`]).
    pub bytes: i64,
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
    /// Bytes of the named storages.
    pub named_bytes: u64,
    /// Elements of the named tensors.
    pub named_elements: u64,
    /// What the allocator says is allocated (`allocated_bytes.all.current`).
    pub allocated_bytes: i64,
}

/// What occupies memory, per device.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct MemReport {
    /// One section per device, CPU first.
    pub devices: Vec<DeviceReport>,
    /// Whether tensors sharing a storage are listed (with 0 bytes).
    pub verbose: bool,
}

/// Builds [`MemReport`]s from var stores and named tensors.
///
/// ```
/// use tch::{nn, Device, Kind};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _linear = nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
/// let report = memlab_tch::MemReporter::default().var_store("model", &vs).report()?;
/// let cpu = report.device(memlab_core::Device::Cpu).unwrap();
/// assert_eq!(cpu.rows[0].name, "model.fc.bias");
/// assert_eq!(cpu.named_bytes, (1024 * 1024 + 1024) * 4);
/// println!("{report}");
/// # Ok::<(), memlab_core::Error>(())
/// ```
#[derive(Default)]
pub struct MemReporter {
    var_stores: Vec<(String, Arc<Mutex<Variables>>)>,
    tensors: Vec<(String, Tensor)>,
    use_registry: bool,
    verbose: bool,
    device: Option<Device>,
}

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
        MemReporter { use_registry: true, ..MemReporter::default() }
    }

    /// Adds a var store; its variables are named `prefix.variable` (no prefix
    /// when `prefix` is empty).
    pub fn var_store(mut self, prefix: impl Into<String>, vs: &VarStore) -> MemReporter {
        self.var_stores.push((prefix.into(), vs.variables_.clone()));
        self
    }

    /// Adds a tensor under `name`.
    pub fn tensor(mut self, name: impl Into<String>, tensor: &Tensor) -> MemReporter {
        self.tensors.push((name.into(), tensor.shallow_clone()));
        self
    }

    /// Lists tensors that share another row's storage, as `name(->owner)` with 0 bytes.
    pub fn verbose(mut self, verbose: bool) -> MemReporter {
        self.verbose = verbose;
        self
    }

    /// Reports only `device`.
    pub fn device(mut self, device: Device) -> MemReporter {
        self.device = Some(device);
        self
    }

    /// The report as it stands now.
    pub fn report(&self) -> Result<MemReport> {
        let mut named = Collector::default();
        let mut stores: Vec<(String, Arc<Mutex<Variables>>)> = self.var_stores.clone();
        let mut tensors: Vec<(String, Tensor)> =
            self.tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        if self.use_registry {
            stores.extend(
                registry::var_stores().into_iter().filter_map(|vs| vs.variables.upgrade().map(|v| (vs.name, v))),
            );
            tensors.extend(registry::tensors());
        }
        for (prefix, variables) in &stores {
            let variables = variables.lock().unwrap_or_else(|e| e.into_inner());
            let mut names: Vec<&String> = variables.named_variables.keys().collect();
            names.sort();
            for name in names {
                let tensor = &variables.named_variables[name];
                let full = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
                let (facts, grad) = facts(tensor, true)?;
                named.add(&full, Source::Tensor(tensor), facts, RowKind::Parameter)?;
                if let Some(grad) = grad {
                    named.add(&format!("{full}.grad"), Source::GradOf(tensor), grad, RowKind::Gradient)?;
                }
            }
        }
        for (name, tensor) in &tensors {
            named.add(name, Source::Tensor(tensor), facts(tensor, false)?.0, RowKind::Tensor)?;
        }

        let mut devices: Vec<Device> = vec![Device::Cpu];
        devices.extend((0..crate::cuda_device_count()).map(Device::Cuda));
        devices.retain(|d| self.device.is_none_or(|only| only == *d));
        let live = if events::is_active() { Some(events::live()) } else { None };
        let mut out = Vec::new();
        for device in devices {
            let section = named.take_section(device, self.verbose, live.as_deref())?;
            if section.allocated_bytes != 0 || !section.rows.is_empty() {
                out.push(section);
            }
        }
        Ok(MemReport { devices: out, verbose: self.verbose })
    }
}

/// Where a row's tensor comes from: the tensor, or the gradient of one (made
/// into a tensor handle only when needed, for sparse gradients).
#[derive(Clone, Copy)]
enum Source<'a> {
    Tensor(&'a Tensor),
    GradOf(&'a Tensor),
}

impl Source<'_> {
    fn get(self) -> Tensor {
        match self {
            Source::Tensor(t) => t.shallow_clone(),
            Source::GradOf(t) => t.grad(),
        }
    }
}

/// The named tensors found, grouped by device, each storage counted once.
#[derive(Default)]
struct Collector {
    rows: BTreeMap<Device, Vec<Row>>,
    /// Per storage: the index in its device's rows of the row that owns it.
    owners: HashMap<(Device, u64), usize>,
    addresses: HashSet<(Device, u64)>,
    bytes: BTreeMap<Device, (u64, u64)>,
}

impl Collector {
    /// Adds a row for `tensor`, whose facts are `facts`. The tensor itself is
    /// only touched for sparse layouts, whose parts are added one by one.
    fn add(&mut self, name: &str, source: Source<'_>, facts: Facts, kind: RowKind) -> Result<()> {
        let Facts { info, dtype, shape } = facts;
        let Some(device) = info.device else { return Ok(()) };
        let part = |this: &mut Self, suffix: &str, t: std::result::Result<Tensor, tch::TchError>| -> Result<()> {
            let t = t.map_err(|e| Error::Torch(e.to_string()))?;
            let f = crate::storage::facts(&t, false)?.0;
            this.add(&format!("{name}.{suffix}"), Source::Tensor(&t), f, kind)
        };
        let tensor = || source.get();
        match info.layout {
            Layout::SparseCoo => {
                let tensor = tensor();
                part(self, "indices", tensor.f_internal_indices())?;
                return part(self, "values", tensor.f_internal_values());
            }
            Layout::SparseCompressed => {
                // CSR and BSR keep compressed rows; CSC and BSC compressed columns.
                let tensor = tensor();
                if tensor.f_crow_indices().is_ok() {
                    part(self, "crow_indices", tensor.f_crow_indices())?;
                    part(self, "col_indices", tensor.f_col_indices())?;
                } else {
                    part(self, "ccol_indices", tensor.f_ccol_indices())?;
                    part(self, "row_indices", tensor.f_row_indices())?;
                }
                return part(self, "values", tensor.f_values());
            }
            Layout::Strided | Layout::Other => {}
        }
        let Some(storage) = info.storage_id else {
            return Err(Error::Torch(format!("`{name}` has no storage of its own, and a layout memlab cannot size")));
        };
        let rows = self.rows.entry(device).or_default();
        let (label, bytes) = match self.owners.get(&(device, storage)) {
            Some(&owner) => (format!("{name}(->{})", rows[owner].name), 0i64),
            None => {
                self.owners.insert((device, storage), rows.len());
                self.addresses.insert((device, info.data_ptr));
                (name.to_string(), info.nbytes as i64)
            }
        };
        let totals = self.bytes.entry(device).or_default();
        totals.0 += bytes as u64;
        totals.1 += info.numel;
        self.rows.entry(device).or_default().push(Row { kind, name: label, shape, dtype, count: info.numel, bytes });
        Ok(())
    }

    /// The section of `device`, taking its rows out of the collector.
    fn take_section(
        &mut self,
        device: Device,
        verbose: bool,
        live: Option<&[events::LiveAllocation]>,
    ) -> Result<DeviceReport> {
        let stats = crate::device_stats(device)?;
        let allocated = stats.allocated_bytes.all.current;
        let requested = stats.requested_bytes.all.current;
        let (named_bytes, named_elements) = self.bytes.get(&device).copied().unwrap_or_default();
        let mut rows: Vec<Row> =
            self.rows.remove(&device).into_iter().flatten().filter(|r| verbose || r.bytes > 0).collect();
        let other = |kind: RowKind, name: String, count: u64, bytes: i64| Row {
            kind,
            name,
            shape: Vec::new(),
            dtype: "",
            count,
            bytes,
        };

        let mut listed: u64 = 0;
        if let Some(live) = live {
            let mut sites: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            for a in live.iter().filter(|a| a.device == device && !self.addresses.contains(&(device, a.address))) {
                let site = a.site().unwrap_or_else(|| "allocated outside profiled code".to_string());
                let entry = sites.entry(site).or_default();
                entry.0 += a.size;
                entry.1 += 1;
            }
            let mut sites: Vec<_> = sites.into_iter().collect();
            sites.sort_by_key(|(_, (bytes, _))| std::cmp::Reverse(*bytes));
            for (site, (bytes, blocks)) in sites {
                listed += bytes;
                rows.push(other(RowKind::Unnamed, format!("not named: {site}"), blocks, bytes as i64));
            }
        }
        let rest = requested - named_bytes as i64 - listed as i64;
        if rest != 0 {
            let why = if rest < 0 {
                "named storages the allocator did not count (from_blob memory, or made before memlab's CPU allocator was installed)"
            } else if live.is_some() {
                "not named, allocated before recording began"
            } else {
                "not named (activations, autograd buffers, temporaries, workspaces): start a memlab::Recording to list them by site"
            };
            rows.push(other(RowKind::Unattributed, why.to_string(), 0, rest));
        }
        if allocated != requested {
            rows.push(other(
                RowKind::Rounding,
                "the caching allocator's rounding to its block sizes".to_string(),
                0,
                allocated - requested,
            ));
        }
        Ok(DeviceReport { device, rows, named_bytes, named_elements, allocated_bytes: allocated })
    }
}

impl MemReport {
    /// The section of `device`.
    pub fn device(&self, device: Device) -> Option<&DeviceReport> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// The text rendering (also what `{}` prints).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for d in &self.devices {
            let name_width = d.rows.iter().map(|r| r.name.len()).max().unwrap_or(0).clamp(12, 72);
            let shape = |r: &Row| {
                if r.shape.is_empty() && r.dtype.is_empty() {
                    String::new()
                } else {
                    format!("{:?}", r.shape)
                }
            };
            let shape_width = d.rows.iter().map(|r| shape(r).len()).max().unwrap_or(0).max(5);
            let rule = "-".repeat(name_width + shape_width + 30);
            writeln!(out, "Storage on {}", d.device).unwrap();
            writeln!(out, "{:<name_width$}  {:>shape_width$}  {:<8}  {:>10}", "name", "shape", "dtype", "bytes")
                .unwrap();
            writeln!(out, "{rule}").unwrap();
            for r in &d.rows {
                let name = if r.name.chars().count() > name_width {
                    format!("{}…", r.name.chars().take(name_width - 1).collect::<String>())
                } else {
                    r.name.clone()
                };
                writeln!(
                    out,
                    "{name:<name_width$}  {:>shape_width$}  {:<8}  {:>10}",
                    shape(r),
                    r.dtype,
                    format_bytes(r.bytes)
                )
                .unwrap();
            }
            writeln!(out, "{rule}").unwrap();
            writeln!(
                out,
                "named: {} in {} elements; allocated on {}: {} (every byte above)\n",
                format_bytes(d.named_bytes as i64),
                d.named_elements,
                d.device,
                format_bytes(d.allocated_bytes)
            )
            .unwrap();
        }
        out
    }

    /// An HTML rendering: a table per device.
    pub fn to_html(&self) -> String {
        let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
        let mut out = String::from("<div class=\"memlab-report\">\n");
        for d in &self.devices {
            writeln!(
                out,
                "<h3>Storage on {}</h3>\n<table>\n<tr><th>name</th><th>shape</th><th>dtype</th><th>bytes</th></tr>",
                d.device
            )
            .unwrap();
            for r in &d.rows {
                writeln!(
                    out,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td style=\"text-align:right\">{}</td></tr>",
                    esc(&r.name),
                    if r.shape.is_empty() { String::new() } else { format!("{:?}", r.shape) },
                    r.dtype,
                    format_bytes(r.bytes)
                )
                .unwrap();
            }
            writeln!(
                out,
                "</table>\n<p>named: {}; allocated on {}: {}</p>",
                format_bytes(d.named_bytes as i64),
                d.device,
                format_bytes(d.allocated_bytes)
            )
            .unwrap();
        }
        out.push_str("</div>");
        out
    }

    /// One CSV row per report row, bytes unrounded.
    pub fn to_csv(&self) -> Result<String> {
        let io = |e: csv::Error| Error::Io(e.to_string());
        let mut w = csv::Writer::from_writer(Vec::new());
        w.write_record(["device", "kind", "name", "shape", "dtype", "count", "bytes"]).map_err(io)?;
        for d in &self.devices {
            for r in &d.rows {
                let kind = serde_json::to_value(r.kind).map_err(|e| Error::Io(e.to_string()))?;
                let shape = r.shape.iter().map(i64::to_string).collect::<Vec<_>>().join("x");
                w.write_record([
                    d.device.to_string(),
                    kind.as_str().unwrap_or_default().to_string(),
                    r.name.clone(),
                    shape,
                    r.dtype.to_string(),
                    r.count.to_string(),
                    r.bytes.to_string(),
                ])
                .map_err(io)?;
            }
        }
        String::from_utf8(w.into_inner().map_err(|e| Error::Io(e.to_string()))?).map_err(|e| Error::Io(e.to_string()))
    }

    /// The report as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report serialises")
    }

    /// Shows the report as HTML in an evcxr (Rust Jupyter) notebook cell.
    pub fn evcxr_display(&self) {
        println!("EVCXR_BEGIN_CONTENT text/html\n{}\nEVCXR_END_CONTENT", self.to_html());
    }
}

impl fmt::Display for MemReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_text())
    }
}
