//! CUDA devices: which this process sees, the caching allocator's cache, the
//! driver's and NVML's figures, and where a device's memory went.
//!
//! ```rust,no_run
//! print!("{}", memlab::where_gpu_memory_went(0)?);
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! Where the GPU memory went: one call,
//! [`where_gpu_memory_went`], sets the figures
//! users see side by side (device total, what the driver says is used, what
//! NVML says this process uses, libtorch's reserved cache, allocated bytes,
//! named tensors), nvidia-smi's figures beside libtorch's, and explains every
//! gap between them in bytes and words: free memory, other processes, this
//! process's CUDA context and libraries (NVML's figure minus libtorch's cache),
//! the cache's fragmentation and free blocks, allocations no registered model
//! owns (by line while recording), block rounding, and the named tensors. The
//! parts add up to the device's total. It reads gradients: call it on the
//! thread that steps the model, or between steps (see the "Threads" section of
//! [`crate::oom`]). `cargo run --release --example gpu_memory`.

pub use memlab_tch::{
    auto_device, built_with_cuda, cuda_allocator_settings, cuda_device_count, cuda_is_available, cuda_mem_info,
    driver_memory, empty_cache, process_gpu_memory, CudaAllocatorSettings, DriverMemory,
};

use serde::Serialize;

use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::{Device, Result};

use memlab_core::events;

use crate::attribution::{attribute, site_label};
use crate::named::Model;

/// One part of the device's memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Part {
    /// What it is.
    pub label: String,
    /// Bytes.
    pub bytes: i64,
    /// Why it is there, and what to do about it.
    pub why: String,
}

/// The device's memory, split into parts that add up to its total.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct GpuAccount {
    /// The CUDA device.
    pub device: usize,
    /// The device's memory.
    pub total: u64,
    /// Used by all processes, from the driver.
    pub driver_used: u64,
    /// Used by this process, from NVML (`None` when NVML does not list it).
    pub process_used: Option<u64>,
    /// Reserved by libtorch's caching allocator.
    pub reserved: i64,
    /// Allocated to tensors by it.
    pub allocated: i64,
    /// Bytes of the named storages (registered var stores, optimizer state and tensors).
    pub named: i64,
    /// The parts, largest gaps explained; they add up to `total`.
    pub parts: Vec<Part>,
}

/// Accounts for the memory of CUDA device `index`. Named tensors are those of
/// the registered var stores and tensors (see
/// [`register_var_store`](crate::register_var_store)); with a recording on,
/// unnamed allocations are listed by the line that made them.
///
/// Needs the `cuda-driver` feature (on by default) for the driver's figures;
/// without the `nvml` feature the context and other processes are one part.
pub fn where_gpu_memory_went(index: usize) -> Result<GpuAccount> {
    GpuAccount::of(Model::registered(), index)
}

impl GpuAccount {
    /// [`where_gpu_memory_went`] with the named tensors those of `model` (or
    /// a var store, `of(&vs, index)`) instead of the registry's.
    pub fn of(model: impl Into<Model>, index: usize) -> Result<GpuAccount> {
        account(&model.into(), index)
    }
}

fn account(model: &Model, index: usize) -> Result<GpuAccount> {
    let device = Device::Cuda(index);
    let driver = driver_memory(index)?;
    let process = process_gpu_memory(index).ok().flatten();
    let stats = memlab_tch::device_stats(device)?;
    let live = if events::is_active() { Some(events::live()) } else { None };
    let attribution = attribute(device, &stats, &model.collect()?, live.as_deref());
    let reserved = stats.reserved_bytes.all.current;
    let allocated = attribution.allocated;
    let inactive = stats.inactive_split_bytes.all.current;
    let named = attribution.named as i64;
    let used = driver.used() as i64;

    let mut parts = Vec::new();
    let mut part = |label: &str, bytes: i64, why: String| parts.push(Part { label: label.to_string(), bytes, why });
    part("free", driver.free as i64, "not in use by anyone".into());
    match process {
        Some(mine) => {
            let mine = mine as i64;
            part(
                "other processes",
                used - mine,
                "memory of other processes on this device (nvidia-smi lists them)".into(),
            );
            part(
                "CUDA context and libraries (this process)",
                mine - reserved,
                "the CUDA context, kernels and libraries' own memory (cuDNN, NCCL), outside libtorch's \
                 cache: paid once per process and device"
                    .into(),
            );
        }
        None => part(
            "outside libtorch's cache",
            used - reserved,
            "this process's CUDA context and libraries, and other processes (NVML does not list this \
             process here, so the two cannot be told apart)"
                .into(),
        ),
    }
    part(
        "cache: fragmentation",
        inactive,
        "unused pieces of split blocks: free, but only for requests that fit them; \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces this"
            .into(),
    );
    part(
        "cache: free blocks",
        reserved - allocated - inactive,
        "memory libtorch keeps cached for reuse; empty_cache() returns it to the device".into(),
    );
    for w in &attribution.workspaces {
        part(
            &format!("allocated, {}", w.label),
            w.bytes as i64,
            "libtorch's own buffer for the library on this handle and stream, read from its tables: kept as long \
             as the handle, made by the first matrix product a thread runs on a stream"
                .into(),
        );
    }
    const UNNAMED: &str = "tensors no registered model owns: activations, autograd buffers, temporaries, \
                           workspaces libtorch does not list (cuDNN's, for one)";
    for site in attribution.unnamed.iter().flatten() {
        part(&format!("allocated, not named: {}", site_label(site)), site.bytes as i64, UNNAMED.into());
    }
    if attribution.unattributed != 0 {
        let label = if attribution.unnamed.is_some() {
            "allocated, not named, allocated before recording began"
        } else {
            "allocated, not named"
        };
        part(
            label,
            attribution.unattributed,
            format!(
                "{UNNAMED}; register the model with memlab::register_var_store (and its optimizer with register_optimizer) to name it"
            ),
        );
    }
    if attribution.rounding != 0 {
        part(
            "allocated, the caching allocator's rounding",
            attribution.rounding,
            "the allocator rounds every block up to a multiple of 512 bytes".into(),
        );
    }
    part("named tensors", named, "the registered models' weights, gradients, optimizer state and tensors".into());
    Ok(GpuAccount {
        device: index,
        total: driver.total,
        driver_used: driver.used(),
        process_used: process,
        reserved,
        allocated,
        named,
        parts,
    })
}

displayed_as_text!(GpuAccount);

impl Render for GpuAccount {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.heading(format!("Where the memory of cuda:{} went", self.device)).indented(
            2,
            format!(
                "total {}; used {} (driver, all processes){}; reserved {} and allocated {} (libtorch); named {}",
                Cell::bytes(self.total),
                Cell::bytes(self.driver_used),
                self.process_used.map(|p| format!(", {} by this process (NVML)", Cell::bytes(p))).unwrap_or_default(),
                Cell::bytes(self.reserved),
                Cell::bytes(self.allocated),
                Cell::bytes(self.named)
            ),
        );
        let mut table = Table::new(vec![
            Column::new("bytes", Layout::Figure).min_width(10),
            Column::new("part", Layout::Text),
            Column::new("why", Layout::Text).max_width(80),
        ]);
        for p in &self.parts {
            table.row([Cell::bytes(p.bytes), Cell::text(&p.label), Cell::text(&p.why)]);
        }
        let sum: i64 = self.parts.iter().map(|p| p.bytes).sum();
        table.rule().row([Cell::bytes(sum), Cell::text("in all"), Cell::text("the device's total")]);
        doc.table(table);
        doc
    }
}
