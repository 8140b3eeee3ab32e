//! The out-of-memory flight recorder: when a request of libtorch's CPU or
//! CUDA allocator fails, memlab writes what was asked, what held the memory
//! and why the request failed, before the error reaches the caller.
//!
//! Arm it once, with [`OomRecorder::arm`](crate::OomRecorder::arm) or `MEMLAB_OOM_DIR=dir` (read as
//! the program loads). Until a request fails it costs nothing: the allocators
//! call in only on failure. Then, on the failing thread:
//!
//! - the reserve (see below) is given back, so that what follows cannot fail
//!   for want of memory;
//! - the facts are taken first: the request (as the allocator saw it), the
//!   device, the profiled statement running and the failing call's Rust
//!   frames, the allocator's figures and its cache's free blocks, the
//!   driver's (or, for the CPU, the kernel's and the process's limits')
//!   figures;
//! - what holds the memory is named by a walk over the registered var
//!   stores, optimizer state and tensors that waits for no lock (tch holds a
//!   var store's lock while `set_device`, `load` and `copy` allocate: a store
//!   held then is listed as busy) and never asks libtorch for a gradient
//!   (gradients are named from the walks before, see below); the rest is
//!   listed by the site that allocated it while a [`Recording`](crate::Recording)
//!   runs;
//! - a [`Verdict`] with its figures: the request alone exceeds the device,
//!   fragmentation, other processes, or not enough free memory;
//! - `DIR/memlab_oom_<host>_<start>_<pid>_<n>.txt` is written (the host's
//!   name, the process's start as `YYYYMMDDTHHMMSS` UTC, its id and the
//!   report's number; a process that finds the name taken, by another
//!   container's PID 1 started in the same second, writes under
//!   `<pid>-<tag>` with a random tag: no report is lost, and no file is ever
//!   overwritten), with a `.json` sibling
//!   (the [`OomReport`] as data) and, while a `Recording` runs, `.html` and
//!   `.pickle` (the recording's report and PyTorch memory snapshot); the
//!   report is kept for [`last_oom`];
//! - a one-paragraph summary goes to memlab's warnings (standard error by
//!   default). A sink set with `set_warnings` runs later, on a thread of
//!   memlab's, never inside the allocator.
//!
//! The failing call still returns libtorch's error (`f_` calls an `Err`,
//! others a panic), and the process goes on. At most
//! [`max_reports`](crate::OomRecorder::max_reports) reports are written per process
//! (3 by default), so a retry loop cannot fill a disk; later failures are
//! counted ([`ooms_seen`]). [`find_batch_size`](crate::find_batch_size)'s
//! deliberate failures neither count nor print: it keeps their verdicts.
//! (While one of its tries runs, failures on its device are taken as the
//! try's on every thread: the autograd engine runs a CUDA backward pass on
//! threads of its own.)
//!
//! # When the host's memory runs out
//!
//! A CPU request can fail because the host has no memory left, or because
//! the process reached its address-space limit (`ulimit -v`, `RLIMIT_AS`,
//! common on shared clusters and under batch schedulers). Writing a report
//! takes memory too, exactly when there is none. So arming does beforehand
//! what the failure path needs: it keeps a reserve of address space aside
//! ([`OomRecorder::reserve`](crate::OomRecorder::reserve), 64 MiB by default: a mapping no page backs,
//! which costs no memory, only room under an address-space limit) and gives
//! it back when a request fails; it starts the threads it needs and reads
//! the program's unwind tables and debug information. The failure path is
//! bounded: before each part that grows with the recording (the unnamed
//! holders by site, the HTML report, the snapshot) it compares an estimate
//! of what the part takes with the memory left, and leaves the part out
//! when it would not fit: the report then says so ([`OomReport::left_out`],
//! and the text report is marked partial when one of its own sections is
//! missing). The text report itself is written first. After the report the
//! reserve is taken again.
//!
//! Under a cgroup's memory limit (containers, Kubernetes, Slurm), nothing
//! fails that could be reported: at the limit the kernel's out-of-memory
//! killer ends the process (SIGKILL) without asking anyone. What memlab
//! offers there is a warning before it happens: while the recorder is armed
//! by [`arm`](crate::OomRecorder::arm) (`MEMLAB_OOM_DIR` alone does not start it)
//! and a cgroup memory limit (or an address-space limit) applies, a thread
//! of memlab's reads the use ten times a second and warns once when it
//! crosses [`watermark`](crate::OomRecorder::watermark) (90% of the limit by
//! default), with the figures, and again after the use fell back and rose
//! again.
//!
//! # Which failures can be seen
//!
//! Every failed request of the counting CPU allocator; on CUDA, every failed
//! request of libtorch's caching allocator once memlab's observer is attached
//! to it, which libtorch allows only after the first CUDA allocation. Arming
//! attaches it then, or at once when CUDA memory was allocated already (or
//! with [`init_cuda`](crate::OomRecorder::init_cuda)); a failure in the first
//! milliseconds of CUDA use can be missed, and the reports count those
//! ([`OomReport::missed_before`]). Memory that CUDA libraries take outside
//! libtorch's allocator (cuBLAS and cuDNN workspaces, the CUDA context)
//! fails without any observer being told: those failures are not recorded.
//!
//! # Threads
//!
//! The handler runs on whatever thread failed, possibly an autograd thread
//! while a backward pass writes gradients. It never asks libtorch for a
//! parameter's gradient (that races with the backward pass, in plain tch as
//! well): it names the gradients that the last walk outside a handler saw
//! (a report, an export, a monitor's record, or a step of a
//! [`RegisteredOptimizer`](crate::RegisteredOptimizer)), held weakly; a
//! gradient made since is counted among the unnamed bytes.

pub use crate::diagnosis::{Diagnosis, Holders, NamedHolder, NamedRest, SiteHolder};
pub use memlab_core::oom::{CacheFree, DeviceMemory, HostLimit, MemoryFigures, Verdict};

mod capture;
mod document;
mod environment;
mod watermark;

use memlab_core::sync::LockExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memlab_core::oom::Failure;
use memlab_core::render::Cell;
use memlab_core::{Backend, Error, Result};
use memlab_tch::BACKEND;

use crate::named;

pub use document::{FailingThread, LeftOut, OomReport};

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
}

#[derive(Clone, Debug)]
struct Config {
    dir: PathBuf,
    max_reports: usize,
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
        }
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
    /// directory, the limit, the reserve and the watermark; the count of
    /// reports goes on). Fails, and arms nothing, when `dir` is empty or
    /// cannot be written, or the reserve cannot be kept.
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
        *CONFIG.locked() = Some(Config { dir, max_reports: self.max_reports });
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
    environment::dir().map(|dir| Config { dir: dir.clone(), max_reports: DEFAULT_MAX_REPORTS })
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
    let report = Arc::new(OomReport::capture(failure, number, &config.dir));
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
