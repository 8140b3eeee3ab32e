//! The out-of-memory flight recorder: when a request of libtorch's CPU or
//! CUDA allocator fails, memlab writes what was asked, what held the memory
//! and why the request failed, before the error reaches the caller.
//!
//! ```rust,no_run
//! memlab::OomRecorder::new("oom_reports").arm()?;   // or run with MEMLAB_OOM_DIR=oom_reports
//! let _recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true))?; // optional
//! // ... train; a request that fails still returns libtorch's error ...
//! if let Some(report) = memlab::last_oom() {
//!     println!("{}", report.diagnosis.verdict.title());
//! }
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! Arm it once, with [`OomRecorder::arm`](crate::OomRecorder::arm) or
//! `MEMLAB_OOM_DIR=dir` (read as the program loads). Until a request fails it
//! costs nothing: the counting CPU allocator and an observer on the CUDA
//! caching allocator call in only then. Then, on the failing thread, before the
//! error reaches your code:
//!
//! - the reserve (see below) is given back, so that what follows cannot fail
//!   for want of memory;
//! - the facts are taken first: the request, as the allocator saw it (on CUDA
//!   rounded to the segment it tried to reserve, and said so), the device, the
//!   thread's current stream, the profiled statement that was running and the
//!   Rust frames of the failing call; the allocator's figures: allocated,
//!   reserved, free in the cache, its largest free block and the fragmentation
//!   (free in the cache minus the largest free block, and its share of free);
//!   the driver's free and total, this process's and other processes' use
//!   (NVML), or why one could not be read (for the CPU, the kernel's and the
//!   process's limits' figures);
//! - what holds the memory is named: the registered var stores, gradients,
//!   optimizer state and tensors (or those of the model given to
//!   [`of`](crate::OomRecorder::of)) by name (largest first, exact bytes), by a
//!   walk that waits for no lock and never asks libtorch for a gradient (see
//!   "Threads" below), and the rest by the site that allocated it while a
//!   [`Recording`](crate::Recording) runs, with its frames;
//! - a [`Verdict`] with its figures and what to do: **the request alone
//!   exceeds the device** (a shape bug), **fragmentation** (free in the cache
//!   ≥ the request, but no block that large), **other processes hold the
//!   memory**, or **not enough free memory** (naming the largest holders to
//!   shrink);
//! - on CUDA, advice on the caching allocator's settings
//!   ([`SettingsAdvice`]), never one the process already has (its settings
//!   are in the report: [`OomReport::allocator_settings`]). While a
//!   `Recording` runs, the report replays the recording's history through
//!   memlab's model of the allocator under the settings people try
//!   (`memlab replay --compare`), on the memory the allocator had, and
//!   advises a setting only where its replay avoids the failure; where none
//!   does, it says what would: the bytes to free, the largest holders, and an
//!   `empty_cache()` at a point of the history where the replay shows it
//!   avoiding the failure, if there is one. A program that caught an earlier
//!   failure and went on gets no setting from the replay (what it asked for
//!   after it depended on the error). Without a recording, the setting the
//!   figures suggest (`expandable_segments:True` for memory in pieces) is
//!   labelled untested, with how to test it. On an H200, a fragmentation
//!   failure (8 MiB blocks to 93% of the device, every other freed, 40 GiB
//!   asked) gets "no setting avoids it" under libtorch's defaults and under
//!   expandable segments alike, as PyTorch's own runs of the pattern under
//!   the three settings did (`fixtures/oom/`). On a history of a million
//!   entries the replay and the advice take about a second (BENCHMARKS.md);
//! - `DIR/memlab_oom_<host>_<start>_<pid>_<n>.txt` is written, named after the
//!   host, the process's start (`YYYYMMDDTHHMMSS`, UTC), its id and the
//!   report's number. Two containers sharing a report volume may both be PID 1,
//!   started in one second on hosts of one name: the name is created
//!   exclusively, and a process that finds its name taken writes under
//!   `<pid>-<tag>` (eight random hexadecimal digits, kept for its later
//!   reports), so no report is lost and no file is ever overwritten. Beside it
//!   go `.json` (the [`OomReport`] as data, verdict included, for other tools)
//!   and, while a `Recording` runs, `.pickle` and `.html` (the recording's
//!   PyTorch memory snapshot, and a page that opens with this report, then
//!   the recording's own: memory over time, what was live at the peak); the
//!   report is kept for
//!   [`last_oom`]. With a rank (see [`crate::run`]) the name ends in
//!   `_rank{N}`;
//! - a one-paragraph summary goes to memlab's warnings (standard error by
//!   default).
//!
//! `cargo run --release --example oom -- --out DIR` trains a small attention
//! model whose scores hide a shape bug; at step 3 a batch of long sequences asks
//! for 512 GiB. From the CPU run:
//!
//! ```text
//! memlab: out of memory on cpu: 512.00G requested, 22.21G free on cpu at oom::Attention::forward (examples/oom.rs:46): let scores = q.unsqueeze(2).f_mul(&k.unsqueeze(1))?.sum_dim_intlist(-1, false, Kind::Float);. Verdict: the request alone exceeds the device. Report: DIR/memlab_oom_vm_20261123T144519_3753_1.txt (and .json, .pickle, .html).
//! step 3: failed: Internal torch error: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 549755813952 bytes. Error code 12 (Cannot allocate memory)
//!   memlab's verdict: the request alone exceeds the device
//! step 4: loss 0.03531
//! ...
//! continued after OOM
//! ```
//!
//! and the report begins:
//!
//! ```text
//! Requested...................................   512.00G
//!   549755813888 bytes, as asked
//! While running oom::Attention::forward (examples/oom.rs:46): let scores = q.unsqueeze(2).f_mul(&k.unsqueeze(1))?.sum_dim_intlist(-1, false, Kind::Float);
//! The failing call, innermost first:
//!   forward at .../examples/oom.rs:46
//!   train_step at .../examples/oom.rs:54
//!   main at .../examples/oom.rs:85
//!
//! Verdict: the request alone exceeds the device
//! The request alone (512.00G, 549755813888 bytes: 137438953472 float32 elements) is larger than all of cpu (23.54G): no amount of freeing makes it fit. Look at the shape of the tensor made on this line: ...
//! ```
//!
//! The failing call still gets its `Err` (`f_` calls; a panic for calls
//! without `f_`), and the process goes on. A second failure writes a second
//! report, up to [`max_reports`](crate::OomRecorder::max_reports) per process
//! (3 by default), so a retry loop cannot fill a disk; later failures are
//! counted ([`ooms_seen`]). The line profile marks the failing line in its
//! `ooms` column. [`find_batch_size`](crate::find_batch_size)'s deliberate
//! failures are neither counted nor written: its result says why its first
//! failing batch failed (`BatchSearch::first_oom`, the same verdict). (While
//! one of its tries runs, every failure on its device is taken as the try's,
//! on any thread: the autograd engine runs a CUDA backward pass on threads of
//! its own.)
//!
//! What it never does: wait for a lock that code allocating tensor memory may
//! hold (the walk over var stores and memlab's registry only tries their locks,
//! since tch holds a store's lock while `set_device`, `load` and `copy`
//! allocate; a store held then is listed as busy), or run your code inside the
//! allocator (a warnings sink set with `set_warnings` gets the summary later,
//! from a thread of memlab's). A directory that cannot be written is an error
//! from `arm()`; a bad `MEMLAB_OOM_DIR` is one warning on standard error, and
//! the program runs on.
//!
//! # Which failures can be seen
//!
//! Every failed request of memlab's counting CPU allocator; on CUDA, every
//! failed request of libtorch's caching allocator once memlab's observer is
//! attached. libtorch attaches observers only to an allocator that exists,
//! which happens at the first CUDA allocation: arming attaches it at once when
//! CUDA memory was allocated already; otherwise a thread asks libtorch every
//! 10 ms (every 100 ms after ten seconds; the question never initialises CUDA)
//! and attaches it one look after the allocator appears, so a failure in the
//! first milliseconds of CUDA use can be missed (the report counts, per device,
//! those the allocator had counted before: [`OomReport::missed_before`]).
//! [`init_cuda(true)`](crate::OomRecorder::init_cuda) initialises CUDA at
//! arming so that nothing is missed. The free memory of the cache that a report
//! shows is what could serve the request: free blocks of its stream and of its
//! pool (small or large blocks). Memory CUDA libraries take outside libtorch's
//! allocator (cuBLAS and cuDNN workspaces, the CUDA context itself) fails
//! without telling any observer: such failures are not recorded.
//!
//! # When the host's memory runs out
//!
//! A CPU request fails when the host has no memory left, or when the process
//! reaches its address-space limit (`ulimit -v`, `RLIMIT_AS`, common on shared
//! clusters and under batch schedulers). Writing a report takes memory too,
//! exactly when there is none, so arming does beforehand what the failure path
//! needs, and the failure path is bounded:
//!
//! - a **reserve** of address space is kept aside
//!   ([`reserve(bytes)`](crate::OomRecorder::reserve), 64 MiB by default, 0
//!   for none): a mapping no page backs, so it costs no memory, only room
//!   under an address-space limit. A failure gives it back before anything
//!   else, and takes it again after the report, as far as the report's own
//!   memory allows without taking what the program had left;
//! - the threads the failure path uses are started, and the program's unwind
//!   tables and debug information read, at arming (libraries that hold no code
//!   of yours, libtorch's and the system's, are never read);
//! - the text report and its JSON are written first. Before each part that
//!   grows with the recording (the unnamed holders by site, the HTML report,
//!   the snapshot) the recorder compares an estimate of what it takes (an upper
//!   estimate, measured per event and per live allocation: see BENCHMARKS.md)
//!   with what the process can still obtain, and leaves it out when it would
//!   not fit. The report then lists it under "Left out", with both figures
//!   ([`OomReport::left_out`]), and says "This report is partial" when a
//!   section of its own is missing;
//! - the report's figures are those of the limit: under `ulimit -v` "free" is
//!   the limit minus the process's mapped address space, "total" the limit, and
//!   a request larger than the limit is the verdict "the request alone exceeds
//!   the device".
//!
//! Tested in child processes with the address space limited to what they map
//! plus 8, 32 and 256 MiB, armed and not, with a recording of a million events
//! and without: the failing call gets its `Err`, the process trains on, and the
//! report is written (with a million events, the HTML and the snapshot are left
//! out and listed; with a hundred thousand and 256 MiB they are written).
//!
//! Under a **cgroup memory limit** (containers, Kubernetes, Slurm) nothing fails
//! that could be reported: at the limit the kernel's out-of-memory killer ends
//! the process with SIGKILL, asking no one. What memlab offers there is a
//! warning before it happens: while the recorder is armed by
//! [`arm`](crate::OomRecorder::arm) (`MEMLAB_OOM_DIR` alone does not start it)
//! and a cgroup memory limit (or an address-space limit) applies, a thread of
//! memlab's reads the use ten times a second and warns once when it crosses
//! [`watermark(Some(share))`](crate::OomRecorder::watermark) (90% of the limit
//! by default; `None` turns it off), and again after the use fell back and rose
//! again:
//!
//! ```text
//! memlab: this process's cgroup uses 92% of the cgroup's memory limit (memory.max) (7.36G of 8.00G). At the limit the kernel's out-of-memory killer ends the process without a failed request, so no out-of-memory report can be written: free memory, or raise the limit.
//! ```
//!
//! # Threads
//!
//! The handler runs on whatever thread failed, possibly an autograd thread while
//! a backward pass writes gradients on another. Reading a parameter's gradient
//! then races with libtorch (plain tch's `grad()` would too), so the handler
//! never asks libtorch for one: it names the gradients the last walk outside a
//! handler saw (a report, an export, a monitor's record, a step of a
//! [`RegisteredOptimizer`](crate::RegisteredOptimizer)), held weakly by their
//! parameter, whatever that walk named it; a gradient made since (every
//! step's `zero_grad` sets them to none) counts
//! among the unnamed bytes, by site while a recording runs.
//!
//! Which memlab reads race with a concurrent `backward_step` on another thread:
//!
//! - walks that read gradients: `MemReporter` reports, `where_gpu_memory_went`,
//!   exports, `TrainingMonitor` records, `track!()`, dispose scopes and
//!   `check_step` (run them on the thread that steps, or between steps);
//! - reading an optimizer's state: `MemReporter::optimizer(&opt)` and the like
//!   borrow it, so the borrow checker keeps them from overlapping a step;
//!   registered optimizers are read only by their own step methods;
//! - nothing else: allocation events, the line profiler, allocator figures and
//!   the out-of-memory handler read no tensor that a step writes.

pub use memlab_core::oom::{
    Avoiding, CacheFree, DeviceMemory, Diagnosis, EmptyCachePoint, FailingThread, Holders, HostLimit, LeftOut,
    MemoryFigures, NamedHolder, NamedRest, OomReport, SettingsAdvice, SiteHolder, Verdict,
};

mod capture;
mod environment;
mod files;
mod watermark;

use memlab_core::sync::LockExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memlab_core::oom::Failure;
use memlab_core::render::Cell;
use memlab_core::{Backend, Error, Result};
use memlab_tch::BACKEND;

use crate::named::{self, Model, WeakModel};

/// Reports written per process unless [`OomRecorder::max_reports`] says otherwise.
pub const DEFAULT_MAX_REPORTS: usize = 3;
/// Address space kept aside for the failure path unless
/// [`OomRecorder::reserve`] says otherwise: 64 MiB.
pub const DEFAULT_RESERVE: u64 = 64 << 20;
/// The share of a memory limit at which the recorder warns unless
/// [`OomRecorder::watermark`] says otherwise.
pub const DEFAULT_WATERMARK: f64 = 0.9;

/// Arms the out-of-memory recorder (see the [module docs](crate::oom)).
///
/// ```
/// let dir = std::env::temp_dir().join(format!("memlab-oom-doc-{}", std::process::id()));
/// memlab::OomRecorder::new(&dir).max_reports(2).arm()?;
/// let asked = tch::Tensor::f_empty([1i64 << 46], (tch::Kind::Float, tch::Device::Cpu)); // 256 TiB
/// assert!(asked.is_err(), "libtorch's error still reaches the caller");
/// let report = memlab::last_oom().expect("the failure was recorded");
/// assert_eq!(report.diagnosis.requested, 1 << 48);
/// assert_eq!(report.diagnosis.verdict, memlab::oom::Verdict::RequestExceedsDevice);
/// assert!(report.files[0].exists());
/// memlab::OomRecorder::disarm();
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), memlab::Error>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "nothing is armed until `arm()` is called"]
pub struct OomRecorder {
    dir: PathBuf,
    max_reports: usize,
    init_cuda: bool,
    reserve: u64,
    watermark: Option<f64>,
    model: Model,
}

#[derive(Clone, Debug)]
struct Config {
    dir: PathBuf,
    max_reports: usize,
    /// What the reports name memory after, held weakly.
    model: Arc<WeakModel>,
}

memlab_core::process::process_wide! {
    static CONFIG: Mutex<Option<Config>> = Mutex::new(None);
}
memlab_core::process::process_wide! {
    /// Set by [`OomRecorder::disarm`]: `MEMLAB_OOM_DIR` no longer arms either.
    static DISARMED: AtomicBool = AtomicBool::new(false);
}
memlab_core::process::process_wide! {
    /// Failures seen while armed, written or not.
    static SEEN: AtomicU64 = AtomicU64::new(0);
}
memlab_core::process::process_wide! {
    static LAST: Mutex<Option<Arc<OomReport>>> = Mutex::new(None);
}

impl OomRecorder {
    /// A recorder that writes its reports in `dir` (made if missing; a
    /// relative path is taken from the working directory at arming).
    pub fn new(dir: impl Into<PathBuf>) -> OomRecorder {
        OomRecorder {
            dir: dir.into(),
            max_reports: DEFAULT_MAX_REPORTS,
            init_cuda: false,
            reserve: DEFAULT_RESERVE,
            watermark: Some(DEFAULT_WATERMARK),
            model: Model::registered(),
        }
    }

    /// Names the memory in the reports after `model` (or a var store,
    /// `of(&vs)`) rather than the registry (see [`Model`]):
    ///
    /// ```rust,no_run
    /// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// memlab::OomRecorder::new("oom_reports").of(&vs).arm()?; // its variables and their gradients by name
    /// # Ok::<(), memlab::Error>(())
    /// ```
    ///
    /// From arming on the recorder holds the model weakly, as the registry
    /// holds what is registered: it keeps none of the model's memory alive,
    /// and what the program drops is no longer named. An optimizer given
    /// with [`Model::optimizer`] is named with the state it had then (state
    /// its later steps create is not: register the optimizer for that, see
    /// [`register_optimizer`](crate::register_optimizer)).
    pub fn of(mut self, model: impl Into<Model>) -> OomRecorder {
        self.model = model.into();
        self
    }

    /// Writes at most `n` reports for the whole process (3 by default);
    /// later failures are counted, not written.
    pub fn max_reports(mut self, n: usize) -> OomRecorder {
        self.max_reports = n;
        self
    }

    /// Initialises CUDA now (one small allocation), so that memlab's
    /// observer is on the CUDA allocator before the program's first CUDA
    /// request: only then can a failure of that very request be recorded.
    /// Off by default: arming never initialises CUDA unless asked.
    pub fn init_cuda(mut self, on: bool) -> OomRecorder {
        self.init_cuda = on;
        self
    }

    /// Keeps `bytes` of address space aside for writing reports
    /// ([`DEFAULT_RESERVE`], 64 MiB, by default; 0 keeps none): a mapping no
    /// page backs, so it costs no memory, only room under an address-space
    /// limit. When a request fails it is given back before anything else,
    /// and what the report needs comes out of it (and out of whatever else
    /// is free); parts estimated to need more are left out and listed. The
    /// larger it is, the more of a large recording's HTML report and
    /// snapshot can still be written when memory has run out.
    pub fn reserve(mut self, bytes: u64) -> OomRecorder {
        self.reserve = bytes;
        self
    }

    /// Warns once when this process's cgroup memory use (or its address
    /// space, under `ulimit -v`) crosses `share` of the limit (0.9 by
    /// default; `None`: never), and again after it fell back under it. At
    /// a cgroup's limit the kernel's out-of-memory killer ends the process
    /// without a failure anyone could report. Without such a limit no
    /// thread is started.
    pub fn watermark(mut self, share: Option<f64>) -> OomRecorder {
        self.watermark = share;
        self
    }

    /// Arms the recorder for the whole process (arming again replaces the
    /// directory, the limit, the reserve, the watermark and the model; the
    /// count of reports goes on). Fails, and arms nothing, when `dir` is
    /// empty or cannot be written, the reserve cannot be kept, or an
    /// optimizer of the model could not be read.
    pub fn arm(self) -> Result<()> {
        if self.dir.as_os_str().is_empty() {
            return Err(Error::InvalidArgument(
                "the out-of-memory reports' directory is an empty path; give the directory to write them in \
                 (\".\" for the working directory)"
                    .to_string(),
            ));
        }
        if let Some(share) = self.watermark.filter(|s| !(s.is_finite() && *s > 0.0 && *s <= 1.0)) {
            return Err(Error::InvalidArgument(format!(
                "a watermark of {share} is not a share of a limit; give one above 0 and at most 1 (0.9 is 90%)"
            )));
        }
        // Absolute: a later change of the working directory must not move the reports.
        let dir = std::path::absolute(&self.dir)
            .map_err(|e| Error::io(format!("make {} absolute (give an absolute path)", self.dir.display()), e))?;
        environment::usable_dir(&dir)?;
        let model = Arc::new(self.model.downgrade()?);
        if self.init_cuda && memlab_tch::cuda_is_available() {
            let device = tch::Device::Cuda(Backend::current_cuda_device(&BACKEND).unwrap_or(0));
            let first = tch::Tensor::f_zeros([1], (tch::Kind::Float, device)).map_err(memlab_tch::torch_error)?;
            drop(first);
        }
        memlab_tch::oom::reserve::set(self.reserve).map_err(|e| {
            let bytes = Cell::bytes(self.reserve);
            Error::io(format!("keep {bytes} of address space aside for out-of-memory reports (give a smaller OomRecorder::reserve)"), e)
        })?;
        memlab_tch::oom::prepare_failure_path();
        // Read now, while memory is plentiful: every report carries it.
        let _ = crate::run::this_process();
        *CONFIG.locked() = Some(Config { dir, max_reports: self.max_reports, model });
        DISARMED.store(false, Ordering::Relaxed);
        named::gradients::keep(true);
        watermark::watch(self.watermark);
        memlab_tch::oom::watch_cuda();
        Ok(())
    }

    /// Disarms the recorder (`MEMLAB_OOM_DIR` included) until the next
    /// [`arm`](Self::arm), and gives the reserve back.
    pub fn disarm() {
        *CONFIG.locked() = None;
        DISARMED.store(true, Ordering::Relaxed);
        named::gradients::keep(false);
        watermark::watch(None);
        let _ = memlab_tch::oom::reserve::set(0);
    }

    /// The directory reports go to now, if the recorder is armed (by a call
    /// or by `MEMLAB_OOM_DIR`).
    pub fn armed_dir() -> Option<PathBuf> {
        config().map(|c| c.dir)
    }
}

fn config() -> Option<Config> {
    if DISARMED.load(Ordering::Relaxed) {
        return None;
    }
    if let Some(c) = CONFIG.locked().clone() {
        return Some(c);
    }
    environment::dir().map(|dir| Config {
        dir: dir.clone(),
        max_reports: DEFAULT_MAX_REPORTS,
        model: Arc::new(WeakModel::registered()),
    })
}

/// The last out-of-memory report written in this process, if any.
pub fn last_oom() -> Option<Arc<OomReport>> {
    LAST.locked().clone()
}

/// Out-of-memory failures seen while the recorder was armed, written or not
/// (those of [`find_batch_size`](crate::find_batch_size)'s tries excluded).
pub fn ooms_seen() -> u64 {
    SEEN.load(Ordering::Relaxed)
}

/// memlab's handler of failures (submitted in `lib.rs`).
pub(crate) fn on_failure(failure: &Failure) {
    let Some(config) = config() else { return };
    let number = SEEN.fetch_add(1, Ordering::Relaxed) + 1;
    if number > config.max_reports as u64 {
        if number == config.max_reports as u64 + 1 {
            say(format!(
                "memlab: {} out-of-memory reports written, the most for this process; later failures are \
                 counted (memlab::oom::ooms_seen()), not written\n",
                config.max_reports
            ));
        }
        return;
    }
    let report = Arc::new(capture::capture(failure, number, &config.dir, &config.model));
    let summary = report.summary();
    {
        // Reports of two threads may finish out of order: the last is the highest number.
        let mut last = LAST.locked();
        if last.as_ref().is_none_or(|l| l.number < report.number) {
            *last = Some(report);
        }
    }
    say(summary);
}

/// Says `text` through memlab's warnings: now when they go to a stream (so
/// that it is out even if the process ends with the error), later from a
/// thread of memlab's when they go to a sink.
fn say(text: String) {
    memlab_core::output::warn_outside_user_code(text);
}
