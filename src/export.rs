//! Recordings as files other tools open: PyTorch's memory snapshot (a pickle
//! that pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read)
//! and a trace-event JSON (ui.perfetto.dev, chrome://tracing).
//!
//! An [`Exporter`] knows the model the way [`MemReporter`](crate::MemReporter)
//! does (registered var stores, tensors and optimizers, or ones given to it),
//! so every allocation still alive is named by the walk over the named
//! tensors at export time (parameter, gradient, optimizer state); others are
//! `other`, with where they were allocated. The recording is memlab's
//! ([`Recording`](crate::Recording)): start one with backtraces to get the
//! Rust call stacks.

pub use memlab_core::export::{
    Block, BlockState, Category, DeviceTimeline, FlameNode, HtmlReport, Level, Oom, PeakRow, Point, Sample, Segment,
    SegmentType, Snapshot, SnapshotFrame, SnapshotInfo, Stack, Trace, TraceEntry,
};

use memlab_core::Result;
use tch::nn::VarStore;
use tch::Tensor;

use crate::capture::{html, snapshot, trace};
use crate::named::Model;

/// Builds exports of the current recording.
///
/// ```
/// use tch::{Device, Kind, Tensor};
///
/// let recording = memlab::Recording::start(memlab::events::Settings::default())?;
/// let kept = Tensor::ones([256], (Kind::Float, Device::Cpu));
/// let snapshot = memlab::export::Exporter::registered().snapshot()?;
/// let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
/// assert!(snapshot.device_traces[cpu].iter().any(|e| e.action == "alloc" && e.size == 1024));
/// let path = std::env::temp_dir().join(format!("memlab-doc-{}.pickle", std::process::id()));
/// snapshot.write_pickle(&path)?; // opens in pytorch.org/memory_viz
/// # std::fs::remove_file(&path).ok();
/// # drop((kept, recording));
/// # Ok::<(), memlab::Error>(())
/// ```
#[derive(Default)]
pub struct Exporter {
    sources: Model,
}

impl Exporter {
    /// An exporter that names memory after everything registered (see
    /// [`register_var_store`](crate::register_var_store) and
    /// [`register_optimizer`](crate::register_optimizer)), plus what is added.
    pub fn registered() -> Exporter {
        Exporter::of(Model::registered())
    }

    /// An exporter that names memory after `model`.
    pub fn of(model: Model) -> Exporter {
        Exporter { sources: model }
    }

    /// An exporter that names memory after `vs` (no prefix), plus what is added.
    pub fn new(vs: &VarStore) -> Exporter {
        Exporter::default().var_store("", vs)
    }

    /// Adds a var store to the model (see [`Model::var_store`]).
    pub fn var_store(mut self, prefix: impl Into<String>, vs: &VarStore) -> Exporter {
        self.sources = self.sources.var_store(prefix, vs);
        self
    }

    /// Adds a tensor to the model (see [`Model::tensor`]).
    pub fn tensor(mut self, name: impl Into<String>, tensor: &Tensor) -> Exporter {
        self.sources = self.sources.tensor(name, tensor);
        self
    }

    /// Adds the state of `optimizer` to the model, read now (see
    /// [`Model::optimizer`]).
    pub fn optimizer(mut self, optimizer: &tch::nn::Optimizer) -> Exporter {
        self.sources = self.sources.optimizer(optimizer);
        self
    }

    /// PyTorch's memory snapshot of the recording so far.
    pub fn snapshot(&self) -> Result<Snapshot> {
        snapshot::capture(&self.sources)
    }

    /// One self-contained HTML page of the recording so far: memory over
    /// time per device, what was live at the peak by call stack and by name,
    /// and the line profiler's tables.
    pub fn html_report(&self) -> Result<HtmlReport> {
        html::capture(&self.sources)
    }

    /// The recording so far as trace events: each device's allocated,
    /// active and reserved bytes over time, and its out-of-memory failures.
    pub fn trace(&self) -> Result<Trace> {
        trace::capture()
    }

    /// Writes the three files into `dir` (made if missing) under their
    /// default names, `memlab_snapshot.pickle`, `memlab_trace.json` and
    /// `memlab_report.html`, each with `_rank{N}` before its extension when
    /// the process has a rank (see [`crate::run`]), so that the ranks of a
    /// run can write into one directory and `memlab merge` read them all.
    /// Returns the paths written.
    pub fn write_files(&self, dir: impl AsRef<std::path::Path>) -> Result<Vec<std::path::PathBuf>> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| memlab_core::Error::io(format!("make {}", dir.display()), e))?;
        let rank = crate::run::this_process().file_suffix();
        let path = |stem: &str, extension: &str| dir.join(format!("{stem}{rank}.{extension}"));
        let (snapshot, trace, page) =
            (path("memlab_snapshot", "pickle"), path("memlab_trace", "json"), path("memlab_report", "html"));
        self.snapshot()?.write_pickle(&snapshot)?;
        self.trace()?.write_json(&trace)?;
        self.html_report()?.write(&page)?;
        Ok(vec![snapshot, trace, page])
    }
}
