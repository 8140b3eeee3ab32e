//! Recordings as files other tools open: one self-contained HTML report,
//! PyTorch's memory snapshot (a pickle that pytorch.org/memory_viz and
//! `python -m torch.cuda._memory_viz` read) and a trace-event JSON
//! (ui.perfetto.dev, chrome://tracing).
//!
//! ```sh
//! cargo run --release --example timeline -- --out memlab_timeline
//! ```
//!
//! trains a small MLP for a few steps with a deliberate leak (a list that keeps
//! every step's logits, and their autograd graph) under a `Recording` with
//! backtraces, and writes the three files from it:
//!
//! ```rust,no_run
//! use std::time::Duration;
//! use memlab::events::Settings;
//!
//! // Backtraces name the Rust frames; sampling reads the resident set and the
//! // driver's figure every millisecond for the trace.
//! let recording = memlab::Recording::start(Settings::default().backtraces(true).sampling(Duration::from_millis(1)))?;
//! // ... train (steps under a StepLogger or TrainingMonitor become slices) ...
//! let exporter = memlab::export::Exporter::registered(); // names from the registry
//! exporter.html_report()?.write("memlab_report.html")?;
//! exporter.snapshot()?.write_pickle("memlab_snapshot.pickle")?;
//! exporter.trace()?.write_json("memlab_trace.json")?;
//! # drop(recording);
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! An [`Exporter`] knows the model the way [`MemReporter`](crate::MemReporter)
//! does (registered var stores, tensors and optimizers, or ones given to it),
//! so every allocation still alive is named by the walk over the named tensors
//! at export time. The recording is memlab's ([`Recording`](crate::Recording)):
//! start one with backtraces to get the Rust call stacks. `Exporter::write_files(dir)`
//! writes the three files under their default names (see [`crate::run`] for
//! the rank in them). Exports read gradients: export on the thread that steps
//! the model, or between steps (see the "Threads" section of [`crate::oom`]).
//!
//! # The HTML report
//!
//! `memlab_report.html` is one file that opens offline (styles inline, no
//! script, a content security policy that blocks any request): per device, the
//! allocated bytes over time stacked by the sites that held the most at the peak
//! (hover for the figures at each moment), drawn by event and by time with a
//! switch between the two (by event first where most of the time passes with
//! few events, such as a long setup before short training steps), an icicle graph of what was live at the
//! peak by Rust call stack, what was live at the peak (named by the walk over the
//! named tensors at export, labelled so; the rest by site; the 50 largest rows
//! show, the rest open with a click on the row that adds them up), and the line
//! profiler's tables with in-cell bars. Long recordings are aggregated in Rust: a
//! timeline has at most 400 points per device. The report is data like every
//! other: `to_page()` is the page as a string (what `write` saves), `to_html()`
//! the same content as a styled block for a notebook cell, and `to_text()` a
//! text form (each timeline as a sparkline, each icicle graph as its heaviest
//! frames). The README shows a picture of it.
//!
//! # PyTorch's memory snapshot
//!
//! `memlab_snapshot.pickle` is PyTorch's memory snapshot, the pickle
//! `torch.cuda.memory._dump_snapshot` writes, so PyTorch's tools open it:
//! drop the file on [pytorch.org/memory_viz](https://pytorch.org/memory_viz)
//! (active memory timeline, allocator state), or read it offline with
//! `python -m torch.cuda._memory_viz stats FILE` (segments) and `trace FILE`
//! (every event). CUDA segments and blocks are the caching allocator's own; the traces are
//! memlab's events with the user's Rust frames (innermost first, the profiled
//! statement's line in its function's frame), streams and times.
//!
//! Each allocation is categorised by the walk over the named tensors, by the
//! names every memlab report gives these kinds (`parameter`, `buffer`,
//! `gradient`, `optimizer_state`, `tensor`; everything else `unnamed`): at
//! export for what is still alive, and, for what died before, at each
//! `StepLogger::log` and `TrainingMonitor` record that saw it alive while the
//! recording ran (so a gradient freed by the next step's `zero_grad` is still a
//! gradient).
//!
//! Devices are numbered as PyTorch's own converters do: the CUDA devices, then
//! the CPU (`snapshot.devices()` names them). The CPU has no segments of its
//! own: each live allocation the recording saw made is a segment of one block
//! (CPU memory allocated before the recording started is in no segment), and a
//! CPU free completes at once. Export while the `Recording` is still alive:
//! when the last one drops, the live set is cleared, so a later export has the
//! history but no live allocations to draw segments and names from. When the
//! bounded history dropped events, `memlab.partial` says so (memory_viz itself
//! shows no such note), the trace names its process "memlab (partial: …)", and
//! every drawing and table of the HTML report is marked.
//!
//! The pickle also carries what `memlab view` needs to draw the whole HTML
//! report from the file alone, under keys PyTorch's readers ignore: each
//! allocation still alive at export has its tensor's name (`tensor`, beside
//! `category`), and `memlab` holds the libtorch version and, when a profiled
//! function ran, the line profile as plain dicts and lists (`Report::from_json`
//! reads the same data from `Report::to_json`).
//!
//! # The trace
//!
//! `memlab_trace.json` holds trace events that
//! [ui.perfetto.dev](https://ui.perfetto.dev) and `chrome://tracing` open: a
//! counter track per device with the allocator's allocated, active and (CUDA)
//! reserved bytes after every event (read from the allocator at export and
//! walked back, so allocations from before the recording count); a slice for
//! every profiled function call, `StepLogger` step and `TrainingMonitor`
//! iteration, on the track of the thread that ran it; counters of the process's
//! resident set and (CUDA) the driver's used memory, read by memlab's one
//! sampling thread while a `StepLogger` step runs or, with `Settings::sampling`,
//! for as long as the recording runs (`memlab::events::timeline()` gives the
//! same spans and readings as data); and an instant event for each
//! out-of-memory failure.
//!
//! # Scale and cost
//!
//! All three scale to long runs: a recording of 1,000,000 events exports in
//! under a second per format, and the HTML report stays under 1 MB, from one
//! call site (0.1 MB) or from 8,192 distinct 13-deep call stacks (0.6 MB; see
//! `BENCHMARKS.md`: `cargo bench --bench export`). Recording with backtraces
//! costs about 0.4–0.6 µs of memlab's own work per event, 1.01–1.05× a small
//! training step on a GPU host's CPU and on its GPU, where PyTorch's own
//! `_record_memory_history` costs 1.16–1.25× with its default stacks
//! (`cargo bench --bench recording`).
//!
//! A stack with no frame of the program's own (autograd's engine runs the
//! backward pass on a thread of its own on CUDA) is named from libtorch's
//! symbol table for what made it, `autograd's backward pass
//! (ConvolutionBackward0)`; and memory libtorch allocates for itself under the
//! program's line, a cuDNN or cuBLAS workspace, for what it is.

pub use memlab_core::export::{
    Block, BlockState, Category, Construction, DeviceTimeline, FlameNode, HtmlReport, Level, Made, Oom, PeakRow, Point,
    PredictionInputs, Sample, Segment, SegmentType, Snapshot, SnapshotFile, SnapshotFrame, SnapshotInfo, Stack, Trace,
    TraceEntry, TraceFile,
};

use memlab_core::{format, Result};
use tch::nn::VarStore;

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

crate::named::names_memory_after_its_model!(Exporter, sources);

impl Exporter {
    /// An exporter that names memory after everything registered (see
    /// [`register_var_store`](crate::register_var_store) and
    /// [`register_optimizer`](crate::register_optimizer)), plus what is added.
    pub fn registered() -> Exporter {
        Exporter::of(Model::registered())
    }

    /// An exporter that names memory after `model` (or a var store, `of(&vs)`).
    pub fn of(model: impl Into<Model>) -> Exporter {
        Exporter { sources: model.into() }
    }

    /// An exporter that names memory after `vs` (no prefix), plus what is added.
    pub fn new(vs: &VarStore) -> Exporter {
        Exporter::default().var_store("", vs)
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

    /// Writes a file of every format registered for exports (see
    /// [`crate::format`]) into `dir` (made if missing) under its default
    /// name: `memlab_snapshot.pickle`, `memlab_trace.json` and
    /// `memlab_report.html`, each with `_rank{N}` before its extension when
    /// the process has a rank (see [`crate::run`]), so that the ranks of a
    /// run can write into one directory and `memlab merge` read them all.
    /// Returns the paths written.
    pub fn write_files(&self, dir: impl AsRef<std::path::Path>) -> Result<Vec<std::path::PathBuf>> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| memlab_core::Error::io(format!("make {}", dir.display()), e))?;
        let rank = crate::run::this_process().file_suffix();
        let mut written = Vec::new();
        for format in format::written_in(|set| set.exports) {
            let path = dir.join(format.about().file_name(&rank));
            let io = |e| memlab_core::Error::io(format!("write {}", path.display()), e);
            let mut file = std::io::BufWriter::new(std::fs::File::create(&path).map_err(io)?);
            format.write(self, &mut file)?;
            std::io::Write::flush(&mut file).map_err(io)?;
            written.push(path);
        }
        Ok(written)
    }
}

/// The exporter is what its files are written from: the recording, named
/// after its model.
impl format::Source for Exporter {
    fn snapshot(&self) -> Result<Snapshot> {
        Exporter::snapshot(self)
    }

    fn trace(&self) -> Result<Trace> {
        Exporter::trace(self)
    }

    fn html_report(&self) -> Result<HtmlReport> {
        Exporter::html_report(self)
    }
}
