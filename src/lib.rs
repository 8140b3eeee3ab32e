#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

/// Profiles the memory of a function line by line.
///
/// Put `#[memlab::profile]` on any function or method; every statement of it,
/// including those inside loops, `if`s and `match` arms, gets a row:
///
/// ```
/// #[memlab::profile]
/// fn make_weights() -> tch::Tensor {
///     let w = tch::Tensor::zeros([1024, 1024], (tch::Kind::Float, tch::Device::Cpu));
///     w
/// }
///
/// memlab::profiler::set_print_at_exit(false);
/// let _w = make_weights();
/// let report = memlab::report();
/// let f = report.function("make_weights").unwrap();
/// let line = f.find("let w =").unwrap().stats.as_ref().unwrap();
/// assert_eq!(line.increment, 4 << 20); // shown as +4.00M
/// ```
///
/// # The table
///
/// When the program exits, memlab prints a table per profiled function. This
/// is the training loop of the demo (`bash scripts/demo.sh`) on the CPU:
///
/// ```text
/// ## train_mlp::train  (cpu, 1 call)
///
/// active_bytes  reserved_bytes  allocated_bytes  increment  hits  line  code
///          all             all              all
///         peak            peak          current
///        7.02M           7.02M            7.02M      0.00B     1    46  fn train(model: &Mlp, opt: &mut nn::Optimizer, data: &Tensor, labels: &Tensor, steps: usize) -> f64 {
///        7.02M           7.02M            7.02M      0.00B     1    47      let mut last_loss = f64::NAN;
///        7.02M           7.02M            7.02M      0.00B     1    48      for _ in 0..steps {
///       27.09M          27.09M           26.60M     +1.51M     5    49          let logits = model.forward(data);
///       26.61M          26.61M           26.61M    +10.01K     5    50          let loss = logits.cross_entropy_for_logits(labels);
///       33.10M          33.10M           25.10M    +16.55M     5    51          opt.backward_step(&loss);
///       25.10M          25.10M           25.10M      0.00B     5    52          last_loss = loss.double_value(&[]);
///       25.10M          25.10M           25.09M    -10.00K     5    53      }
///       25.09M          25.09M           25.09M      0.00B     1    54      last_loss
///       25.09M          25.09M           25.09M      0.00B     1    55  }
/// ```
///
/// Each statement shows what it kept; what a block's locals free when it ends
/// (here `logits` and `loss`, every iteration) shows on its closing brace.
/// The first `backward_step` keeps +16.55M: the gradients (6.02M) and Adam's
/// two moment buffers (12.04M) appear, and the step's 1.51M of activations
/// go. Every figure is read from the allocator, so it is exact to the byte
/// (the CSV and JSON exports carry the bytes).
///
/// # What a row means
///
/// Every statement of the function, and of the blocks inside it (loop bodies,
/// `if`/`else`, `match` arms, `unsafe` blocks), starts with a probe. A probe
/// reads the allocator of the profiled device and ends the interval of the
/// statement before it, so each row of the table describes the runs of the
/// statements that start on that source line:
///
/// - `*.peak` columns: the highest level while the statement ran, callees
///   included;
/// - `*.current` columns: the level right after it;
/// - running totals (`*.allocated`, `*.freed`, `num_*`): how much they grew
///   during it;
/// - `increment`: the change of `allocated_bytes.all.current` over one run
///   (the largest of the runs), the figure that tells which line keeps memory;
///   `increment_total` sums it over all runs (a line in a loop that keeps
///   1 MiB per iteration shows `+1.00M` and a total of `+N.00M`);
/// - `hits`: how often the line ran. Lines that never ran stay blank;
/// - `ooms`: requests the allocator could not serve while the statement ran,
///   all runs together (the change of `num_ooms`, which the counting CPU
///   allocator keeps as well). A function's table shows this column as soon
///   as one of its statements ran out of memory, whatever the columns
///   chosen; the statement's own `Err` still reaches the caller.
///
/// The signature line shows the state at entry. What a block's locals free
/// when it ends (the function body, a loop body, an `if` arm, …) counts on the
/// block's closing-brace line, so every statement's increment is its own: a
/// last statement that creates a 4 MiB tensor shows `+4.00M`, and the closing
/// brace shows `-4.00M` when the tensor goes out of scope there. A `return`,
/// `break`, `continue`, `?` or panic ends the statement that was running, so
/// it is recorded too, together with what the locals it drops free. Loop
/// headers evaluated again between iterations count towards the closing brace
/// of the body (or, in a body without locals, its last statement).
///
/// Repeated calls merge per line: every figure keeps its largest value and
/// `hits` counts the runs. A profiled function called from a profiled line
/// shows its own table, and its allocations and peaks count in the caller's
/// line as well: memlab resets the allocator's peak counters at every probe
/// but keeps the peak of every statement still running, so nested calls never
/// erase an enclosing peak. Reading `*.peak` statistics yourself while
/// profiled code runs shows only the peak since the last probe.
///
/// # Columns and renderings
///
/// Any key of `torch.cuda.memory_stats()` can be a column, and so can
/// `increment`, `increment_total`, `hits` and `ooms`
/// ([`profiler::set_default_columns`] sets them for every report):
///
/// ```rust,no_run
/// use memlab::Render;
///
/// let report = memlab::report().with_columns(&["requested_bytes.all.peak", "increment_total", "hits"])?;
/// println!("{report}");                               // text
/// std::fs::write("profile.html", report.to_html())?;  // HTML; report.evcxr_display() in notebooks
/// std::fs::write("profile.csv", report.to_csv()?)?;   // every statistic of every line, in bytes
/// std::fs::write("profile.json", report.to_json())?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`report()`] returns the figures at any time; [`reset()`] clears them.
///
/// # Options
///
/// - `#[profile(device = "cuda:1")]`: the device to measure: `"cpu"`,
///   `"cuda"` (the current CUDA device at each call), `"cuda:N"` or `"auto"`
///   (the current CUDA device when CUDA is available, else the CPU). Without
///   it the function follows [`profiler::set_target_device`] (or
///   [`profiler::set_target_gpu`]), whose default is `auto`.
/// - `#[profile(crate = my_reexport::memlab)]`: where to find memlab when the
///   crate re-exports it under another path.
/// - [`profile_every`] (`#[memlab::profile_every(10)]`) also prints the table
///   of the last 10 calls every 10 calls.
///
/// The tables of all `#[profile]` functions print when the process exits
/// (turn it off with [`profiler::set_print_at_exit`] or `MEMLAB_PRINT_AT_EXIT=0`).
/// Where tables and warnings go, and how to turn every probe off: [`profiler`].
///
/// # Threads and async
///
/// Any number of threads may run profiled functions at once. The allocator's
/// statistics are per device, not per thread, so a line's figures include what
/// other threads allocated while it ran. `async fn` works the same way; a line
/// that awaits counts what ran elsewhere until it resumed. Allocation events
/// (dispose scopes, the reporter's sites, `track!()`) name a statement of an
/// `async fn` only while one of its polls runs, however futures interleave.
///
/// Closures and `async` blocks inside the function are not instrumented (they
/// may run later or on another thread): they count towards the statement that
/// calls or awaits them. Nested items are left alone; `const fn` is rejected.
#[doc(inline)]
pub use memlab_macros::profile;

/// Like [`profile`], and also prints the table of the last `N` calls every
/// `N` calls (the counterpart of pytorch_memlab's `profile_every`).
///
/// ```
/// #[memlab::profile_every(2, device = "cpu")]
/// fn step(x: &tch::Tensor) -> tch::Tensor {
///     x * 2
/// }
///
/// let x = tch::Tensor::ones([8], (tch::Kind::Float, tch::Device::Cpu));
/// for _ in 0..4 {
///     let _ = step(&x); // prints a table after the 2nd and the 4th call
/// }
/// ```
///
/// `profile_every` functions are left out of the table printed at exit, since
/// they print their own; [`report()`] includes them, with all calls merged.
#[doc(inline)]
pub use memlab_macros::profile_every;

pub use memlab_core::render::Render;
pub use memlab_core::{DType, TensorKind};
pub use memlab_core::{Device, Error, Result};
pub use memlab_tch::{clear_registry, register_tensor, register_var_store, Recording};
pub use named::{register_optimizer, Model, RegisteredOptimizer};

/// Gives each report type (which describes itself as a `Document`, see
/// [`Render`]) its `Display`: the text rendering, what `{}` prints, as
/// `memlab_core`'s reports have it.
macro_rules! displayed_as_text {
    ($($report:ty),* $(,)?) => {$(
        impl std::fmt::Display for $report {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&memlab_core::render::Render::to_text(self))
            }
        }
    )*};
}

// The tools' frames are memlab's, not the user's; the tests and examples
// beside `src/` stay the user's.
inventory::submit! { memlab_core::events::SourceRoot(concat!(env!("CARGO_MANIFEST_DIR"), "/src")) }
// The out-of-memory recorder's handler, which libtorch's allocators reach
// through the backend when a request fails (armed or not: it decides).
inventory::submit! { memlab_core::oom::Handler(oom::on_failure) }

mod attribution;
pub mod batch_size;
mod capture;
pub mod courtesy;
mod diagnosis;
pub mod dispose;
pub mod export;
pub mod fit;
pub mod gpu;
pub mod logger;
pub mod model_size;
pub mod monitor;
mod named;
pub mod notebook;
pub mod oom;
mod prediction;
pub mod reporter;
pub mod run;
mod step_figures;
pub mod tracker;

pub use batch_size::{find_batch_size, BatchSizeSearch, Budget};
pub use courtesy::Courtesy;
pub use dispose::{check_step, check_step_with, check_step_with_optimizer, DisposeScope, OnEscape};
pub use export::Exporter;
pub use fit::{record_construction, will_it_fit, WillItFit};
pub use gpu::where_gpu_memory_went;
pub use logger::StepLogger;
pub use memlab_tch::optimizer::StepOptimizer;
pub use model_size::measure_model;
pub use monitor::TrainingMonitor;
pub use oom::{last_oom, OomRecorder};
pub use reporter::MemReporter;
pub use tracker::Tracker;

/// The line profiler's settings and its report, and where memlab's output
/// goes: reports (`set_output`, standard output by default) and warnings
/// (`set_warnings`, standard error by default); no tool prints by itself.
/// What the figures of a report mean is in the docs of
/// [`profile`].
///
/// - `set_print_at_exit(false)` (or `MEMLAB_PRINT_AT_EXIT=0`) keeps the table
///   printed at exit quiet.
/// - `set_output(Output::Sink(..))` sends tables elsewhere (a sink runs with
///   no memlab lock held, so it may call memlab itself), and
///   `set_warnings(..)` does the same for warnings.
/// - `set_enabled(false)` (or `MEMLAB_DISABLE=1`) turns every probe off.
/// - `set_target_device` / `set_target_gpu` change the device every function
///   without a `device` option measures: by default the current CUDA device
///   when CUDA is available, else the CPU.
/// - `set_default_columns` sets the columns of every report that does not
///   choose its own.
///
/// Environment variables that switch something on or off all read the same
/// way: `1`/`true`/`yes`/`on` and `0`/`false`/`no`/`off`, in any case;
/// anything else is warned about once on stderr and ignored. A call
/// (`set_enabled`, `set_print_at_exit`) wins over the variable whenever it is
/// made.
///
/// ```
/// use memlab::profiler::{self, Output};
///
/// profiler::set_print_at_exit(false);
/// profiler::set_output(Output::Sink(Box::new(|_text| { /* a log, a file */ })));
/// ```
pub mod profiler {
    pub use memlab_core::profiler::{
        default_columns, is_enabled, set_default_columns, set_enabled, set_output, set_print_at_exit,
        set_target_device, set_target_gpu, set_warnings, target_device, LineStats, Output,
    };
    pub use memlab_core::{DeviceSelector, FunctionReport, LineReport, ProfileColumn, Report};
}

/// What memlab reads of tch's optimizers: their classes and the tensors of
/// their state, named by libtorch (see [`MemReporter::optimizer`]).
pub mod optimizer {
    pub use memlab_tch::optimizer::{OptimizerKind, StateSlot, TCH_RELEASES};
    pub use memlab_tch::{libtorch_version, tch_release};
}

/// The render layer every memlab report goes through, for reports of your
/// own: a [`Document`](render::Document) of headings, prose, label rows and
/// [`Table`](render::Table)s of typed [`Cell`](render::Cell)s (bytes, counts,
/// durations, shares, text, code) renders as text, HTML, CSV and JSON; a
/// type that implements [`Render`] gets `to_text`, `to_html` and
/// `evcxr_display`.
///
/// ```
/// use memlab::render::{Cell, Column, Document, Layout, Table};
///
/// let mut table = Table::new(vec![Column::new("name", Layout::Text), Column::new("bytes", Layout::Figure)]);
/// table.row([Cell::text("fc.weight"), Cell::bytes(4u64 << 20)]);
/// let mut doc = Document::new();
/// doc.heading("My model").table(table);
/// assert_eq!(doc.to_text(), "My model\nname       bytes\nfc.weight  4.00M\n");
/// assert!(doc.to_csv()?.ends_with("fc.weight,4194304\n"));
/// # Ok::<(), memlab::Error>(())
/// ```
pub mod render {
    pub use memlab_core::render::{Amount, Cell, Column, Document, Layout, Table};
}

/// libtorch's CUDA caching allocator as a model (no GPU, no libtorch): a
/// recording replayed under the settings it was recorded with and others,
/// what `memlab replay` prints and what an out-of-memory report answers
/// "would another setting have avoided it?" with. The guide is
/// `memlab_core::replay`'s.
///
/// ```
/// use memlab::replay::{replay_snapshot, ReplayOptions};
///
/// // PyTorch's recording, on an H100, of a fragmentation failure under a
/// // 1.5 GiB memory fraction.
/// let file = memlab::export::Snapshot::read_pickle("fixtures/replay/fragmentation__default.pickle")?;
/// let options = ReplayOptions {
///     fraction: Some(0.01894448624181354),
///     total: Some(85_017_493_504),
///     compare: true,
///     ..Default::default()
/// };
/// let replayed = replay_snapshot("fragmentation", &file.snapshot, &options)?;
/// let device = &replayed.devices[0];
/// assert!(device.recorded_oom().is_some(), "the failure, replayed");
/// let avoiding: Vec<&str> = device.avoiding().map(|r| r.settings.as_str()).collect();
/// assert!(avoiding.iter().any(|s| s.starts_with("max_split_size_mb:128")));
/// # Ok::<(), memlab::Error>(())
/// ```
pub mod replay {
    pub use memlab_core::ops::{table, Convolution, EmbeddingBackward, Op, OpRecord, Reduction, TensorArg, TensorArgs};
    pub use memlab_core::replay::*;
}

/// memlab's file formats, one trait ([`FileFormat`](format::FileFormat))
/// and one registry ([`formats`](format::formats)): what the exporter and an
/// out-of-memory report write, and what [`format::read`] and the `memlab`
/// command recognise. A format of one's own is one type and one
/// `memlab::format::inventory::submit! { Registered(&MyFormat) }`; the
/// guide is `memlab_core::format`'s.
///
/// ```
/// let names: Vec<&str> = memlab::format::formats().iter().map(|f| f.name()).collect();
/// assert!(names.contains(&"snapshot") && names.contains(&"trace") && names.contains(&"page"));
/// let (format, contents) = memlab::format::read("fixtures/leaky.pickle")?;
/// assert_eq!(format.name(), "snapshot");
/// assert!(contents.is::<memlab::export::SnapshotFile>());
/// # Ok::<(), memlab::Error>(())
/// ```
pub mod format {
    pub use memlab_core::format::*;
    pub use memlab_core::inventory;
}

/// Allocator statistics and storage facts: every `memory_stats()` figure of a
/// device, its resets, and what memory a tensor keeps alive.
pub mod stats {
    pub use memlab_core::{DeviceStats, ParseDeviceError, Stat, StatArray};
    pub use memlab_tch::{
        cpu_allocator_installed, cpu_allocator_installed_at_load, device_stats, dtype, install_cpu_allocator,
        reset_accumulated_stats, reset_peak_stats, storage_info, StorageInfo, StorageLayout, WeakTensor,
    };
}

/// Allocation events: what a [`Recording`] keeps, the live
/// set, and the accounts of dispose scopes.
pub mod events {
    pub use memlab_core::events::{
        live, stats, thread_number, Action, DriverUsed, Event, Frame, LiveAllocation, Reading, ScopeCounts, Settings,
        Span, SpanKind, StatementRef, Stats, Timeline,
    };

    /// What the recording kept beside the allocations (see [`Timeline`]):
    /// spans, readings, and how many of either were dropped.
    pub fn timeline() -> Timeline {
        memlab_core::events::timeline()
    }

    /// The recorded allocation events, oldest first, and how many were dropped
    /// to stay within [`Settings::capacity`] (see [`Recording`](crate::Recording)).
    pub fn history() -> (Vec<Event>, Stats) {
        memlab_core::events::history()
    }

    #[doc(hidden)]
    pub use memlab_core::events::{time_own_work, unwind_cache_stats};
}

/// Logs the memory at this call site and what changed since the previous
/// call: storages that appeared (`+`) or disappeared (`-`), grouped by kind
/// (parameter, gradient, other), shape and dtype, with where unnamed ones were
/// allocated. `track!()` uses a global [`Tracker`] (standard output, the
/// current CUDA device or the CPU); `track!(tracker)` uses yours. Returns
/// what was logged as a [`tracker::TrackEntry`]: data (`Serialize`), whose
/// `{}` / `to_text()` is the log's text.
///
/// Put calls around a step, or one per batch, to see what grew between
/// batch 1 and batch 2:
///
/// ```
/// use memlab::Render;
///
/// memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
/// let mut tracker = memlab::Tracker::new().device(memlab::Device::Cpu);
/// memlab::track!(tracker);
/// let kept = tch::Tensor::zeros([1024], (tch::Kind::Float, tch::Device::Cpu));
/// let log = memlab::track!(tracker);
/// assert_eq!(log.changes[0].bytes, 4096);
/// assert!(log.to_text().contains("+ 1 × unnamed 4.00K"), "{log}");
/// # drop(kept);
/// ```
#[macro_export]
macro_rules! track {
    () => {
        $crate::__private::track_global($crate::__call_site!())
    };
    ($tracker:expr) => {
        $tracker.track($crate::__call_site!())
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __call_site {
    () => {
        $crate::tracker::CallSite {
            file: ::core::file!(),
            line: ::core::line!(),
            function: {
                fn __memlab_here() {}
                $crate::__private::function_path(::core::any::type_name_of_val(&__memlab_here))
            },
        }
    };
}

/// The figures of every profiled function linked into the program, called or
/// not, at this moment. Render it with `to_text()` (or `{}`), `to_html()`,
/// `to_csv()`, `to_json()` or `evcxr_display()`.
pub fn report() -> profiler::Report {
    profiler::Report::collect()
}

/// Clears the figures of every profiled function.
pub fn reset() {
    memlab_core::reset();
}

/// Hooks memlab's own tests use to force rare interleavings (the `testing`
/// feature). Not API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    pub use memlab_tch::events_testing::*;
    pub use memlab_tch::storage::gradient_reads;
}

/// What code generated by memlab's macros refers to. Not public API: it may
/// change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::tracker::track_global;
    pub use inventory;
    pub use memlab_core::profiler::{Frame, InStatement, ProfiledFn, ProfiledFnMeta, Registered};
    pub use memlab_core::{Device, DeviceSelector};

    /// The path of the function a marker item is nested in (see `track!`).
    pub fn function_path(marker: &'static str) -> &'static str {
        let head = marker.strip_suffix("::__memlab_here").unwrap_or(marker);
        head.strip_suffix("::{{closure}}").unwrap_or(head)
    }

    /// Starts a profiled call measured through libtorch's allocators.
    #[inline]
    pub fn enter(site: &'static ProfiledFn) -> Frame {
        Frame::enter(site, &memlab_tch::BACKEND)
    }

    /// Starts a profiled call of an `async fn`: its frame is `Sync`, so the
    /// body's future stays `Send`.
    #[inline]
    pub fn enter_async(site: &'static ProfiledFn) -> Frame<std::sync::atomic::AtomicBool> {
        Frame::enter(site, &memlab_tch::BACKEND)
    }
}
