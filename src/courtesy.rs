//! `Courtesy`: give the GPU back without a checkpoint.
//!
//! ```rust,no_run
//! use tch::nn::{self, OptimizerConfig};
//!
//! let vs = nn::VarStore::new(tch::Device::Cuda(0));
//! let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
//! let mut courtesy = memlab::Courtesy::of(&vs);
//! println!("{}", courtesy.yield_memory_with(&mut adam)?); // weights, gradients, Adam's moments to the CPU
//! // ... someone else uses the GPU ...
//! courtesy.restore()?;                                     // back, bit for bit
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! [`Courtesy::yield_memory`](crate::Courtesy::yield_memory) moves the CUDA
//! tensors of the var stores and tensors it knows (and their gradients) to the
//! CPU in place, with `set_data`, so every handle to them (layers, an
//! `nn::Optimizer`) stays valid and training goes on bit-identically; then it
//! empties the CUDA cache and says how many bytes the devices got back and what
//! stayed. [`Courtesy::yield_memory_with`](crate::Courtesy::yield_memory_with)
//! moves the optimizer's state too (Adam's moments, momentum buffers), in place:
//! tch keeps it inside libtorch's C++ optimizer, and memlab reads it under the
//! borrow, as the reporter does; `yield_memory()` moves only the var stores and
//! tensors. [`Courtesy::restore`](crate::Courtesy::restore), or dropping the
//! guard, moves everything back.
//!
//! The report says what each part gave back, device by device
//! (`cargo run --release --example courtesy`, on an H100):
//!
//! ```text
//! Courtesy: moved 24 tensor(s) to the CPU
//! device  parameters  gradients  optimizer state    tensors      moved  reserved before  reserved after   returned  still allocated
//! cuda:0      32.09M     32.09M           64.19M      0.00B    128.38M          230.00M          86.00M    144.00M           67.00M
//! ```
//!
//! What stays allocated belongs to tensors memlab was not given (the batch,
//! activations, cuBLAS workspaces). Nothing is lost on failure: if the GPU is
//! full when restoring, a tensor that cannot go back stays valid and usable on
//! the CPU, and `restore()` can be called again.

use serde::Serialize;
use std::collections::BTreeMap;

use memlab_core::events::by_site;
use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::{events, Device, Error, Result};
use tch::Tensor;

use crate::attribution::site_label;
use crate::named::Model;
use memlab_core::TensorKind;

/// A tensor moved to the CPU, and where it came from.
struct Moved {
    name: String,
    tensor: Tensor,
    home: tch::Device,
    bytes: u64,
    part: Part,
}

/// What a moved tensor is to the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Parameter,
    Gradient,
    OptimizerState,
    Tensor,
}

/// Moves models off the GPU and back. Bind it to a named variable
/// (`let mut courtesy = …`), not to `_`, which drops it at once.
///
/// ```no_run
/// use tch::nn::{self, OptimizerConfig};
///
/// let vs = nn::VarStore::new(tch::Device::Cuda(0));
/// let _layer = nn::linear(vs.root() / "fc", 4096, 4096, Default::default());
/// let mut courtesy = memlab::Courtesy::of(&vs);
/// let report = courtesy.yield_memory()?;   // the GPU is free for someone else
/// println!("{report}");
/// courtesy.restore()?;                      // and back, to go on training
/// # Ok::<(), memlab::Error>(())
/// ```
#[must_use = "a Courtesy moves everything back when it is dropped"]
pub struct Courtesy {
    sources: Model,
    moved: Vec<Moved>,
}

crate::named::names_memory_after_its_model!(Courtesy, sources);

impl Default for Courtesy {
    fn default() -> Self {
        Courtesy::new()
    }
}

impl Courtesy {
    /// A Courtesy over every registered var store and tensor (see
    /// [`register_var_store`](crate::register_var_store)), plus what is
    /// added: [`registered`](Self::registered).
    pub fn new() -> Courtesy {
        Courtesy::registered()
    }

    /// A Courtesy over every registered var store and tensor (see
    /// [`register_var_store`](crate::register_var_store)), plus what is added.
    pub fn registered() -> Courtesy {
        Courtesy::of(Model::registered())
    }

    /// A Courtesy over only what is added to it (not the registry).
    pub fn only() -> Courtesy {
        Courtesy::of(Model::new())
    }

    /// A Courtesy over `model` (or a var store, `of(&vs)`): its variables,
    /// tensors, their gradients and its optimizers' state move.
    pub fn of(model: impl Into<Model>) -> Courtesy {
        Courtesy { sources: model.into(), moved: Vec::new() }
    }

    /// Whether tensors are on the CPU now, waiting for [`restore`](Self::restore).
    pub fn is_yielded(&self) -> bool {
        !self.moved.is_empty()
    }

    /// Every CUDA tensor (and gradient) this Courtesy knows, by name.
    fn cuda_tensors(&self) -> Result<Vec<(String, Tensor, Part)>> {
        let mut out = Vec::new();
        self.sources.for_each(|name, tensor, kind| {
            let part = match kind {
                // A var store's variables, trained or not, move as its parameters.
                TensorKind::Parameter | TensorKind::Buffer => Part::Parameter,
                TensorKind::OptimizerState => Part::OptimizerState,
                TensorKind::Gradient | TensorKind::Tensor => Part::Tensor,
            };
            // Every tensor moves with its gradient (a registered tensor's
            // too, unlike the reporter's rows, which name gradients of
            // variables only): a gradient left on the GPU behind its tensor
            // would fail the next backward pass with a device mismatch.
            if part != Part::OptimizerState
                && let Some(grad) = memlab_tch::grad_of(tensor)
            {
                out.push((format!("{name}.grad"), grad, Part::Gradient));
            }
            out.push((name.to_string(), tensor.shallow_clone(), part));
            Ok(())
        })?;
        out.retain(|(_, t, _)| t.device().is_cuda());
        // A storage shared by two names moves once.
        let mut seen = std::collections::HashSet::new();
        out.retain(|(_, t, _)| memlab_tch::storage_info(t).map(|i| seen.insert(i.storage_id)).unwrap_or(false));
        Ok(out)
    }

    /// Like [`yield_memory`](Self::yield_memory), and moves the state of
    /// `optimizer` too (built on a var store this Courtesy knows): Adam's
    /// moments, momentum buffers and the like, in place, so the optimizer
    /// goes on where it was after [`restore`](Self::restore) (which needs no
    /// optimizer: memlab keeps handles to what it moved, never the
    /// optimizer). The report says how much each part gave back. An
    /// optimizer memlab cannot read is an error, and nothing moves.
    ///
    /// ```no_run
    /// use tch::nn::{self, OptimizerConfig};
    ///
    /// let vs = nn::VarStore::new(tch::Device::Cuda(0));
    /// let _layer = nn::linear(vs.root() / "fc", 4096, 4096, Default::default());
    /// let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
    /// let mut courtesy = memlab::Courtesy::of(&vs);
    /// println!("{}", courtesy.yield_memory_with(&mut adam)?);
    /// courtesy.restore()?;
    /// # Ok::<(), memlab::Error>(())
    /// ```
    pub fn yield_memory_with(&mut self, optimizer: &mut tch::nn::Optimizer) -> Result<YieldReport> {
        self.sources.add_optimizer(optimizer);
        let report = self.yield_memory();
        self.sources.clear_optimizers();
        report
    }

    /// Moves every CUDA tensor this Courtesy knows (and their gradients) to
    /// the CPU, empties the CUDA cache, and reports what the devices got back.
    ///
    /// On an error nothing is half-moved: the tensor that failed stays where
    /// it was, and the ones already moved are on the CPU, valid, and go back
    /// with [`restore`](Self::restore).
    pub fn yield_memory(&mut self) -> Result<YieldReport> {
        let devices: Vec<Device> = (0..memlab_tch::cuda_device_count()).map(Device::Cuda).collect();
        let before = snapshot(&devices)?;
        for (name, tensor, part) in self.cuda_tensors()? {
            let home = tensor.device();
            let bytes = memlab_tch::storage_info(&tensor)?.nbytes;
            let on_cpu = tensor.f_to_device(tch::Device::Cpu).map_err(memlab_tch::torch_error)?;
            let mut handle = tensor.shallow_clone();
            handle.f_set_data(&on_cpu).map_err(memlab_tch::torch_error)?;
            self.moved.push(Moved { name, tensor: handle, home, bytes, part });
        }
        memlab_tch::empty_cache()?;
        let after = snapshot(&devices)?;
        let mut report = YieldReport { devices: BTreeMap::new(), moved: self.moved.len(), stayed: Vec::new() };
        for device in devices {
            let of = |part: Part| -> u64 {
                self.moved
                    .iter()
                    .filter(|m| memlab_tch::device_of(m.home) == device && m.part == part)
                    .map(|m| m.bytes)
                    .sum()
            };
            let (reserved_before, _) = before[&device];
            let (reserved_after, allocated_after) = after[&device];
            let counts = YieldCounts {
                parameters: of(Part::Parameter),
                gradients: of(Part::Gradient),
                optimizer_state: of(Part::OptimizerState),
                tensors: of(Part::Tensor),
                moved_bytes: 0,
                reserved_before,
                reserved_after,
                still_allocated: allocated_after,
            };
            let moved_bytes = counts.parameters + counts.gradients + counts.optimizer_state + counts.tensors;
            report.devices.insert(device, YieldCounts { moved_bytes, ..counts });
        }
        if events::is_active() {
            let live = events::live();
            report.stayed = by_site(live.iter().filter(|a| a.device != Device::Cpu))
                .into_iter()
                .map(|g| Stayed { device: g.device, site: site_label(&g).to_string(), bytes: g.bytes })
                .collect();
        }
        Ok(report)
    }

    /// Moves everything [`yield_memory`](Self::yield_memory) moved back to its
    /// device. If a move fails (say, the GPU is still taken), the tensors not
    /// yet moved stay valid on the CPU, the error says how far it got, and a
    /// later call carries on.
    pub fn restore(&mut self) -> Result<usize> {
        let total = self.moved.len();
        let mut restored = 0;
        while let Some(m) = self.moved.last_mut() {
            let back = match m.tensor.f_to_device(m.home) {
                Ok(back) => back,
                Err(e) => {
                    return Err(Error::Backend(format!(
                        "restored {restored} of {total} tensors; `{}` could not go back to {:?} ({e}). The {} \
                         not restored are valid on the CPU; call restore() again once the device has room",
                        m.name,
                        m.home,
                        total - restored
                    )));
                }
            };
            m.tensor.f_set_data(&back).map_err(memlab_tch::torch_error)?;
            self.moved.pop();
            restored += 1;
        }
        Ok(restored)
    }
}

impl Drop for Courtesy {
    fn drop(&mut self) {
        if self.is_yielded()
            && let Err(e) = self.restore()
        {
            memlab_core::output::warn(&format!("memlab Courtesy: {e}\n"));
        }
    }
}

/// Reserved and allocated bytes per device.
fn snapshot(devices: &[Device]) -> Result<BTreeMap<Device, (i64, i64)>> {
    devices
        .iter()
        .map(|d| {
            let s = memlab_tch::device_stats(*d)?;
            Ok((*d, (s.reserved_bytes.all.current, s.allocated_bytes.all.current)))
        })
        .collect()
}

/// What one device got back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct YieldCounts {
    /// Bytes of the storages moved to the CPU: the four parts below.
    pub moved_bytes: u64,
    /// Of those, the var stores' variables.
    pub parameters: u64,
    /// Their gradients.
    pub gradients: u64,
    /// The optimizer's state (with [`Courtesy::yield_memory_with`]).
    pub optimizer_state: u64,
    /// Tensors added or registered by name (and their gradients).
    pub tensors: u64,
    /// Bytes the caching allocator held before.
    pub reserved_before: i64,
    /// Bytes it holds after the move and `empty_cache`.
    pub reserved_after: i64,
    /// Bytes still allocated to tensors memlab was not given.
    pub still_allocated: i64,
}

impl YieldCounts {
    /// What the device got back.
    pub fn returned(&self) -> i64 {
        self.reserved_before - self.reserved_after
    }
}

/// What [`Courtesy::yield_memory`] did.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct YieldReport {
    /// Per CUDA device.
    pub devices: BTreeMap<Device, YieldCounts>,
    /// Tensors moved to the CPU.
    pub moved: usize,
    /// With a recording on: what stayed allocated, by device and site,
    /// largest first.
    pub stayed: Vec<Stayed>,
}

/// Memory that stayed on a CUDA device when the tensors moved: what one
/// allocation site holds there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stayed {
    /// The device.
    pub device: Device,
    /// Where it was allocated: the user's frame or profiled statement.
    pub site: String,
    /// Its bytes.
    pub bytes: u64,
}

displayed_as_text!(YieldReport);

impl Render for YieldReport {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        if self.devices.is_empty() {
            doc.heading("Courtesy: no CUDA device, nothing to yield");
            return doc;
        }
        doc.heading(format!("Courtesy: moved {} tensor(s) to the CPU", self.moved));
        let figure = |header: &str| Column::new(header, Layout::Figure).min_width(9);
        let mut table = Table::new(vec![
            Column::new("device", Layout::Text),
            figure("parameters"),
            figure("gradients"),
            figure("optimizer state"),
            figure("tensors"),
            figure("moved"),
            figure("reserved before"),
            figure("reserved after"),
            figure("returned"),
            figure("still allocated"),
        ]);
        for (device, c) in &self.devices {
            table.row([
                Cell::text(device.to_string()),
                Cell::bytes(c.parameters),
                Cell::bytes(c.gradients),
                Cell::bytes(c.optimizer_state),
                Cell::bytes(c.tensors),
                Cell::bytes(c.moved_bytes),
                Cell::bytes(c.reserved_before),
                Cell::bytes(c.reserved_after),
                Cell::bytes(c.returned()),
                Cell::bytes(c.still_allocated),
            ]);
        }
        doc.table(table);
        for (device, c) in self.devices.iter().filter(|(_, c)| c.still_allocated > 0) {
            doc.indented(
                2,
                format!(
                    "what stays on {device} belongs to tensors memlab was not given (inputs, activations, \
                     cuBLAS workspaces{}){}",
                    if c.optimizer_state == 0 { ", an optimizer not passed to yield_memory_with" } else { "" },
                    if self.stayed.is_empty() { "; record events to see where it was allocated" } else { ":" }
                ),
            );
            let mut sites = Table::new(vec![
                Column::new("bytes", Layout::Figure).min_width(9),
                Column::new("allocated at", Layout::Code),
            ])
            .collapsed();
            for Stayed { site, bytes, .. } in self.stayed.iter().filter(|s| s.device == *device) {
                sites.row([Cell::bytes(*bytes), Cell::code(site)]);
            }
            if !sites.is_empty() {
                doc.table(sites);
            }
        }
        doc
    }
}
