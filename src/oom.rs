//! The out-of-memory flight recorder: when a request of libtorch's CPU or
//! CUDA allocator fails, memlab writes what was asked, what held the memory
//! and why the request failed, before the error reaches the caller.
//!
//! Arm it once, with [`OomRecorder::arm`] or `MEMLAB_OOM_DIR=dir` (read as
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
//!   report's number: two containers that share a report volume never write
//!   the same name, and no file is ever overwritten), with a `.json` sibling
//!   (the [`OomReport`] as data) and, while a `Recording` runs, `.html` and
//!   `.pickle` (the recording's report and PyTorch memory snapshot); the
//!   report is kept for [`last_oom`];
//! - a one-paragraph summary goes to memlab's warnings (standard error by
//!   default). A sink set with `set_warnings` runs later, on a thread of
//!   memlab's, never inside the allocator.
//!
//! The failing call still returns libtorch's error (`f_` calls an `Err`,
//! others a panic), and the process goes on. At most
//! [`max_reports`](OomRecorder::max_reports) reports are written per process
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
//! ([`OomRecorder::reserve`], 64 MiB by default: a mapping no page backs,
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
//! by [`arm`](OomRecorder::arm) (`MEMLAB_OOM_DIR` alone does not start it)
//! and a cgroup memory limit (or an address-space limit) applies, a thread
//! of memlab's reads the use ten times a second and warns once when it
//! crosses [`watermark`](OomRecorder::watermark) (90% of the limit by
//! default), with the figures, and again after the use fell back and rose
//! again.
//!
//! # Which failures can be seen
//!
//! Every failed request of the counting CPU allocator; on CUDA, every failed
//! request of libtorch's caching allocator once memlab's observer is attached
//! to it, which libtorch allows only after the first CUDA allocation. Arming
//! attaches it then, or at once when CUDA memory was allocated already (or
//! with [`init_cuda`](OomRecorder::init_cuda)); a failure in the first
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

use memlab_core::sync::LockExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use memlab_core::events::{self, Backtrace, Frame, LiveAllocation};
use memlab_core::oom::Failure;
pub use memlab_core::oom::{CacheFree, DeviceMemory, HostLimit, MemoryFigures, Serving, Verdict};
use memlab_core::render::{Cell as Kind, Column, Document, Render, Table};
use memlab_core::{format_bytes, Backend, Device, Error, Result};
use memlab_tch::BACKEND;
use serde::Serialize;

use crate::attribution::{attribute, site_label};
use crate::named::{self, Sources};

/// Reports written per process unless [`OomRecorder::max_reports`] says otherwise.
pub const DEFAULT_MAX_REPORTS: usize = 3;
/// Address space kept aside for the failure path unless
/// [`OomRecorder::reserve`] says otherwise: 64 MiB.
pub const DEFAULT_RESERVE: u64 = memlab_tch::oom::reserve::DEFAULT_BYTES;
/// The share of a memory limit at which the recorder warns unless
/// [`OomRecorder::watermark`] says otherwise.
pub const DEFAULT_WATERMARK: f64 = 0.9;
/// Holders listed by name and by site (each); the rest are added up.
const TOP_HOLDERS: usize = 20;
/// Frames shown under an unnamed site.
const SITE_FRAMES: usize = 6;
/// The segment libtorch's CUDA allocator reserves for a small request.
const SMALL_SEGMENT: u64 = 2 << 20;

/// Arms the out-of-memory recorder (see the [module docs](self)).
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

static CONFIG: Mutex<Option<Config>> = Mutex::new(None);
/// Set by [`OomRecorder::disarm`]: `MEMLAB_OOM_DIR` no longer arms either.
static DISARMED: AtomicBool = AtomicBool::new(false);
/// Failures seen while armed, written or not.
static SEEN: AtomicU64 = AtomicU64::new(0);
static LAST: Mutex<Option<Arc<OomReport>>> = Mutex::new(None);

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
        let dir = std::path::absolute(&self.dir).map_err(|e| {
            Error::InvalidArgument(format!(
                "{} cannot be made absolute ({e}); give an absolute path",
                self.dir.display()
            ))
        })?;
        memlab_tch::oom::usable_dir(&dir).map_err(|why| {
            Error::InvalidArgument(format!(
                "out-of-memory reports cannot be written in {}: {why}; give a directory this process can write",
                dir.display()
            ))
        })?;
        if self.init_cuda && memlab_tch::cuda_is_available() {
            let device = tch::Device::Cuda(Backend::current_cuda_device(&BACKEND).unwrap_or(0));
            let first = tch::Tensor::f_zeros([1], (tch::Kind::Float, device)).map_err(memlab_tch::torch_error)?;
            drop(first);
        }
        memlab_tch::oom::reserve::set(self.reserve).map_err(|e| {
            Error::InvalidArgument(format!(
                "{} of address space cannot be kept aside for out-of-memory reports ({e}); give a smaller \
                 OomRecorder::reserve",
                format_bytes(self.reserve as i64)
            ))
        })?;
        memlab_tch::oom::prepare_failure_path();
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
    memlab_tch::oom::environment_dir().map(|dir| Config { dir: dir.clone(), max_reports: DEFAULT_MAX_REPORTS })
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

/// Why a request failed: the request, the device's figures then, and the verdict.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Diagnosis {
    /// Where.
    pub device: Device,
    /// The bytes the allocator tried to obtain (see [`rounded`](Self::rounded)).
    pub requested: u64,
    /// True on CUDA: `requested` is the caching allocator's rounding of the
    /// request to the segment it tried to reserve, not the tensor's bytes.
    pub rounded: bool,
    /// The device's memory at the failure.
    pub figures: MemoryFigures,
    /// Why it failed.
    pub verdict: Verdict,
    /// The verdict in words, with its figures and what to do.
    pub advice: String,
}

/// A named storage holding memory when the request failed.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct NamedHolder {
    /// Its name (the first of its views, with how many more there are).
    pub name: String,
    /// `parameter`, `gradient`, `optimizer state` or `tensor`.
    pub kind: &'static str,
    /// Its bytes.
    pub bytes: u64,
}

/// Unnamed live allocations from one site.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct SiteHolder {
    /// The user's frame or profiled statement that made them.
    pub site: String,
    /// Their bytes.
    pub bytes: u64,
    /// How many.
    pub blocks: u64,
    /// The user's frames of one of them, innermost first, when recorded with backtraces.
    pub frames: Vec<Frame>,
}

/// What held the device's memory when the request failed.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct Holders {
    /// Bytes of the named storages.
    pub named_bytes: u64,
    /// The largest named storages, largest first.
    pub named: Vec<NamedHolder>,
    /// Named storages beyond those listed: how many, and their bytes.
    pub named_rest: (usize, u64),
    /// Var stores (or the registry) the walk passed by because a lock on
    /// them was held, by this thread or another.
    pub busy: Vec<String>,
    /// Allocated bytes no named storage accounts for.
    pub not_named: i64,
    /// While a recording runs: the unnamed allocations by site, largest
    /// first (`None` also when memory did not suffice to list them: see
    /// [`OomReport::left_out`]).
    pub by_site: Option<Vec<SiteHolder>>,
    /// CUDA: what the allocator added by rounding blocks up (part of `not_named`).
    pub rounding: i64,
}

/// A part of a report that memory did not suffice for.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct LeftOut {
    /// What was left out: a section of the text report, or a file.
    pub part: String,
    /// The file it would have been, for files.
    pub file: Option<PathBuf>,
    /// What it would have taken, estimated from the recording's size (an
    /// upper estimate; see BENCHMARKS.md).
    pub needed_estimate: u64,
    /// What this process could still obtain then: the host's free memory,
    /// or what its address-space or cgroup limit left.
    pub available: u64,
}

/// One out-of-memory failure, as the recorder wrote it.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct OomReport {
    /// Its number in this process (1 for the first).
    pub number: u64,
    /// The process.
    pub pid: u32,
    /// The host's name.
    pub host: String,
    /// When the process started, in UTC (`YYYY-MM-DD HH:MM:SS`), where the
    /// kernel tells.
    pub process_start: Option<String>,
    /// When, in UTC (`YYYY-MM-DD HH:MM:SS.mmm`).
    pub time: String,
    /// memlab's number for the failing thread, and its name.
    pub thread: (u64, Option<String>),
    /// The request, the figures and the verdict.
    pub diagnosis: Diagnosis,
    /// CUDA: the failing thread's current stream.
    pub stream: Option<u64>,
    /// The profiled statement that was running, if any.
    pub statement: Option<String>,
    /// The user's Rust frames of the failing call, innermost first.
    pub frames: Vec<Frame>,
    /// What held the memory.
    pub holders: Holders,
    /// Why a driver figure is missing, where one is.
    pub missing: Vec<String>,
    /// CUDA failures the allocator counted before memlab's observer was on.
    pub missed_before: Option<u64>,
    /// Address space the reserve gave back for this report.
    pub reserve: u64,
    /// Whether a section of the text report was left out for want of memory.
    pub partial: bool,
    /// What memory did not suffice for: sections and files.
    pub left_out: Vec<LeftOut>,
    /// The files written.
    pub files: Vec<PathBuf>,
    /// Files that could not be written, and why.
    pub file_errors: Vec<String>,
}

/// The `find_batch_size` tries running now: a ticket, the device each
/// searches, and the first failure on that device while it runs. A failure
/// on a device a try runs on is the try's, on any thread: the autograd
/// engine runs a CUDA backward pass on threads of its own.
static QUIET: Mutex<Vec<(u64, Device, Option<Diagnosis>)>> = Mutex::new(Vec::new());

/// Runs `f`, a try on `device`, with that device's out-of-memory failures
/// kept quiet (not counted, not written, not printed) and returns the first
/// one's diagnosis. `f` is given the try's ticket (see [`try_failed`]).
pub(crate) fn quietly<R>(device: Device, f: impl FnOnce(u64) -> R) -> (R, Option<Diagnosis>) {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    /// Takes the try off the list even if `f` unwinds.
    struct Quiet(u64);
    impl Quiet {
        fn take(&self) -> Option<Diagnosis> {
            let mut quiet = QUIET.locked();
            let at = quiet.iter().position(|(ticket, _, _)| *ticket == self.0)?;
            quiet.remove(at).2
        }
    }
    impl Drop for Quiet {
        fn drop(&mut self) {
            self.take();
        }
    }
    memlab_tch::oom::watch_cuda();
    let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
    QUIET.locked().push((ticket, device, None));
    let quiet = Quiet(ticket);
    let out = f(ticket);
    let seen = quiet.take();
    (out, seen)
}

/// Whether the try with `ticket` has seen an out-of-memory failure of its
/// device (the allocator's own report of it, whatever the error's words).
pub(crate) fn try_failed(ticket: u64) -> bool {
    QUIET.locked().iter().any(|(t, _, seen)| *t == ticket && seen.is_some())
}

/// Whether a try runs on `device` now.
fn quiet_on(device: Device) -> bool {
    QUIET.locked().iter().any(|(_, d, _)| *d == device)
}

/// memlab's handler of failures (submitted in `lib.rs`).
pub(crate) fn on_failure(failure: &Failure) {
    if quiet_on(failure.device) {
        // Diagnosed with no lock held, then given to the tries on that device still without one.
        let diagnosis = diagnose(failure, None).0;
        let mut quiet = QUIET.locked();
        for (_, _, seen) in quiet.iter_mut().filter(|(_, d, seen)| *d == failure.device && seen.is_none()) {
            *seen = Some(diagnosis.clone());
        }
        return;
    }
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

/// What this process could still obtain now, in bytes: the host's free
/// memory, or what its address-space or cgroup limit leaves (the reserve,
/// once given back, included); `None` where nothing can be read.
fn room() -> Option<u64> {
    BACKEND.device_memory(Device::Cpu).map(|m| m.free)
}

/// Whether a part estimated to take `needed` bytes fits in what is left
/// (with a quarter on top for the allocator's own overhead and the rest
/// of the report); a part fits where nothing can be read.
fn fits(needed: u64, available: Option<u64>) -> bool {
    available.is_none_or(|room| needed.saturating_add(needed / 4) <= room)
}

/// This process's part of every report's file name: the host's name and
/// the process's start, `host_YYYYMMDDTHHMMSS` (read once: the reports of
/// a process share it).
fn identity() -> &'static (String, Option<String>) {
    static IDENTITY: OnceLock<(String, Option<String>)> = OnceLock::new();
    IDENTITY.get_or_init(|| {
        let host = memlab_tch::host_name().unwrap_or_else(|| "host".to_string());
        (host, memlab_tch::process_start().map(|start| crate::tracker::utc(start, 0)[..19].to_string()))
    })
}

/// Writes `bytes` into `file`, a report's file created for them.
fn write_to(mut file: std::fs::File, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    file.write_all(bytes).map_err(|e| Error::io("write an out-of-memory report's file", e))
}

/// `name` with only what file names take everywhere: letters, digits, `.`,
/// `-` and `_`.
fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect()
}

/// The figures of `failure`'s device and the verdict; with the holders,
/// advice that names the largest of them.
fn diagnose(failure: &Failure, holders: Option<&Holders>) -> (Diagnosis, Vec<String>) {
    let device = failure.device;
    let mut missing = Vec::new();
    // libtorch's CUDA allocator serves a request from its stream's blocks of
    // its pool only; it reserves 2 MiB segments for small requests (≤ 1 MiB)
    // and larger ones for the rest.
    let serving = matches!(device, Device::Cuda(_))
        .then(|| Serving { stream: failure.stream.unwrap_or(0), large: failure.requested != SMALL_SEGMENT });
    let mut figures = MemoryFigures::read(&BACKEND, device, serving).unwrap_or_else(|e| {
        missing.push(format!("the allocator's figures: {e}"));
        MemoryFigures::default()
    });
    // The allocator's own figures at the failure beat a reading now.
    if let (Some(free), Some(total)) = (failure.device_free, failure.device_total) {
        let (this, others, limit) =
            figures.device.map_or((None, None, None), |d| (d.this_process, d.other_processes, d.limit));
        figures.device = Some(DeviceMemory::new(free, total, this, others).limited_by(limit));
    }
    if let Device::Cuda(i) = device {
        if figures.device.is_none() {
            missing.push(format!("the driver's free and total memory: {}", error_of(memlab_tch::driver_memory(i))));
        }
        if figures.device.is_some_and(|d| d.this_process.is_none()) {
            match memlab_tch::process_gpu_memory(i) {
                Ok(None) => missing.push("this process's use: NVML does not list this process".to_string()),
                Err(e) => missing.push(format!("this process's and other processes' use (NVML): {e}")),
                Ok(Some(_)) => {}
            }
        }
    } else if figures.device.is_none() {
        missing.push("the host's memory: /proc/meminfo could not be read".to_string());
    }
    let verdict = Verdict::decide(failure.requested, &figures);
    let advice = advice(failure, &figures, verdict, holders);
    (Diagnosis { device, requested: failure.requested, rounded: failure.rounded, figures, verdict, advice }, missing)
}

fn error_of<T>(r: Result<T>) -> String {
    r.err().map_or_else(|| "unknown".to_string(), |e| e.to_string())
}

fn advice(failure: &Failure, f: &MemoryFigures, verdict: Verdict, holders: Option<&Holders>) -> String {
    let b = |n: u64| format_bytes(n as i64);
    let asked = b(failure.requested);
    let total = f.device.map(|d| d.total).unwrap_or(0);
    let device_free = f.device.map(|d| d.free).unwrap_or(0);
    // Under a host limit, the limit is what this process has.
    let limit = f.device.and_then(|d| d.limit);
    let all_of = match limit {
        Some(limit) => format!("all that {} allows this process", limit.describe()),
        None => format!("all of {}", failure.device),
    };
    match verdict {
        Verdict::RequestExceedsDevice => format!(
            "The request alone ({asked}, {} bytes: {} float32 elements) is larger than {all_of} ({}): no amount \
             of freeing makes it fit. Look at the shape of the tensor made on this line: a batch, sequence or \
             vocabulary size where a feature size belongs, or a dimension multiplied twice, is the usual cause.",
            failure.requested,
            failure.requested / 4,
            b(total)
        ),
        Verdict::Fragmentation => format!(
            "The cache holds {} free, enough for the {asked} request, but its largest free block is {}: the free \
             memory is in pieces ({} of it, {:.0}%, is in blocks too small to use here). Set \
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts (segments then grow \
             instead of splitting), or call memlab::gpu::empty_cache() where few tensors are alive.",
            b(f.cache_free.bytes),
            b(f.cache_free.largest_block),
            b(f.fragmentation()),
            f.fragmentation_share().unwrap_or(0.0) * 100.0
        ),
        Verdict::OtherProcesses => format!(
            "Other processes hold {} of {}; with {} free on the device and {} in the cache, the {asked} request \
             would fit without them. Free the device (nvidia-smi lists them), or run where it is free.",
            b(f.device.and_then(|d| d.other_processes).unwrap_or(0)),
            failure.device,
            b(device_free),
            b(f.cache_free.bytes)
        ),
        Verdict::NotEnoughFree => {
            let has = match (failure.device, limit) {
                (Device::Cuda(_), _) => format!("{} free and its cache {}", b(device_free), b(f.cache_free.bytes)),
                (Device::Cpu, Some(limit)) => format!("{} free under {}", b(device_free), limit.describe()),
                (Device::Cpu, None) => format!("{} free", b(device_free)),
            };
            let mut text = format!(
                "{} has {has}, and {asked} was asked: this process holds too much ({} allocated by tensors).",
                failure.device,
                format_bytes(f.allocated)
            );
            if let Some(h) = holders {
                let mut largest: Vec<(String, u64)> =
                    h.named.iter().take(3).map(|n| (format!("{} ({})", n.name, n.kind), n.bytes)).collect();
                largest.extend(h.by_site.iter().flatten().take(3).map(|s| (s.site.clone(), s.bytes)));
                largest.sort_by_key(|(_, bytes)| std::cmp::Reverse(*bytes));
                if !largest.is_empty() {
                    let list: Vec<String> =
                        largest.iter().take(3).map(|(n, bytes)| format!("{n}: {}", b(*bytes))).collect();
                    text.push_str(&format!(" The largest holders: {}.", list.join("; ")));
                }
            }
            text.push_str(
                " Shrink what they hold: a smaller batch or sequence, fewer or smaller layers, mixed precision, \
                 or tensors an earlier step kept (a list of outputs or losses with their graphs).",
            );
            if f.cache_free.bytes > 0 && device_free + f.cache_free.bytes >= failure.requested {
                text.push_str(&format!(
                    " Free memory would have sufficed in one piece: the device's and the cache's ({} in blocks of \
                     at most {}) are apart; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the cache grow \
                     its segments instead.",
                    b(f.cache_free.bytes),
                    b(f.cache_free.largest_block)
                ));
            }
            text
        }
    }
}

impl OomReport {
    /// Takes the facts of `failure` and writes the report's files in `dir`.
    fn capture(failure: &Failure, number: u64, dir: &Path) -> OomReport {
        // On the failing thread: its stack is the failing call's (memlab's
        // own frames are left out when resolved).
        let backtrace = failure.backtrace.clone().unwrap_or_else(|| Arc::new(Backtrace::capture()));
        let sources = Sources::registered_now();
        let mut left_out = Vec::new();
        // Listing the unnamed allocations by site copies the live set.
        let live = events::stats().live as u64;
        let by_site = events::is_active().then(|| crate::export::estimate::by_site(live));
        let available = room();
        let with_sites = match by_site {
            Some(needed) if !fits(needed, available) => {
                left_out.push(LeftOut {
                    part: "the unnamed holders by site".to_string(),
                    file: None,
                    needed_estimate: needed,
                    available: available.unwrap_or(0),
                });
                false
            }
            _ => true,
        };
        let holders = holders(failure.device, &sources, with_sites);
        let (diagnosis, missing) = diagnose(failure, Some(&holders));
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let (host, process_start) = identity().clone();
        let mut report = OomReport {
            number,
            pid: std::process::id(),
            host,
            process_start,
            time: crate::tracker::utc(now.as_secs(), now.subsec_millis()),
            thread: (failure.thread, std::thread::current().name().map(str::to_string)),
            diagnosis,
            stream: failure.stream,
            statement: failure.statement.map(|s| s.to_string()),
            frames: backtrace.frames().to_vec(),
            holders,
            missing,
            missed_before: match failure.device {
                Device::Cuda(i) => memlab_tch::oom::ooms_before_watching(i),
                Device::Cpu => None,
            },
            reserve: failure.reserve,
            partial: !left_out.is_empty(),
            left_out,
            files: Vec::new(),
            file_errors: Vec::new(),
        };
        report.write(dir, &sources);
        report
    }

    /// The reports' common file name, without extension:
    /// `memlab_oom_<host>_<start>_<pid>_<n>`.
    fn base_name(&self) -> String {
        let start = self.process_start.as_deref().map_or_else(
            || "unknown".to_string(),
            |s| {
                s.chars().filter(char::is_ascii_digit).enumerate().fold(String::new(), |mut out, (i, c)| {
                    if i == 8 {
                        out.push('T');
                    }
                    out.push(c);
                    out
                })
            },
        );
        format!("memlab_oom_{}_{start}_{}_{}", file_safe(&self.host), self.pid, self.number)
    }

    /// Writes the text report and its JSON first, then, while a recording
    /// runs, its HTML report and PyTorch snapshot where the memory left
    /// suffices for them, then the text and JSON again with the final list
    /// of files. Every file is created anew (never overwriting one);
    /// failures to write are kept, never raised.
    fn write(&mut self, dir: &Path, sources: &Sources) {
        let base = dir.join(self.base_name());
        let (text_path, json_path) = (base.with_extension("txt"), base.with_extension("json"));
        let mut reports = [(self.create(&text_path), text_path), (self.create(&json_path), json_path)];
        for (file, path) in &reports {
            if file.is_some() {
                self.files.push(path.clone());
            }
        }
        for busy in sources.busy() {
            if !self.holders.busy.contains(&busy) {
                self.holders.busy.push(busy);
            }
        }
        self.rewrite(&mut reports);
        if !events::is_active() {
            return;
        }
        let exporter = crate::export::Exporter::from_sources(Sources::registered_now());
        let exports = [
            ("the HTML report", "html", crate::export::estimate::html()),
            ("the PyTorch memory snapshot", "pickle", crate::export::estimate::snapshot()),
        ];
        for (part, extension, needed) in exports {
            let path = base.with_extension(extension);
            let available = room();
            if !fits(needed, available) {
                self.left_out.push(LeftOut {
                    part: part.to_string(),
                    file: Some(path),
                    needed_estimate: needed,
                    available: available.unwrap_or(0),
                });
                continue;
            }
            let Some(file) = self.create(&path) else { continue };
            let written = if extension == "html" {
                exporter.html_report().and_then(|r| write_to(file, r.to_html().as_bytes()))
            } else {
                exporter.snapshot().and_then(|s| s.to_pickle()).and_then(|bytes| write_to(file, &bytes))
            };
            match written {
                Ok(()) => self.files.push(path),
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    self.file_errors.push(format!("{}: {e}", path.display()));
                }
            }
        }
        for busy in exporter.sources().busy() {
            if !self.holders.busy.contains(&busy) {
                self.holders.busy.push(busy);
            }
        }
        self.rewrite(&mut reports);
    }

    /// Creates `path` for this report; `None`, with the reason kept, when it
    /// cannot be created or exists already (a report never replaces a file).
    fn create(&mut self, path: &Path) -> Option<std::fs::File> {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(file) => Some(file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                self.file_errors.push(format!("{}: a file of that name exists; it is left as it is", path.display()));
                None
            }
            Err(e) => {
                self.file_errors.push(format!("{}: {e}", path.display()));
                None
            }
        }
    }

    /// Writes the text report and its JSON (from the start) into the files
    /// made for them; a file that cannot be written is left out from then on,
    /// with the reason kept.
    fn rewrite(&mut self, reports: &mut [(Option<std::fs::File>, PathBuf); 2]) {
        use std::io::{Seek, Write};
        let contents = [self.to_text(), self.to_json()];
        for ((file, path), text) in reports.iter_mut().zip(contents) {
            let Some(open) = file.as_mut() else { continue };
            let done = open.set_len(0).and_then(|()| open.rewind()).and_then(|()| open.write_all(text.as_bytes()));
            if let Err(e) = done {
                *file = None;
                self.files.retain(|f| f != path);
                self.file_errors.push(format!("{}: {e}", path.display()));
            }
        }
    }

    /// The report as JSON: every field of [`OomReport`], the verdict as
    /// `snake_case` (`request_exceeds_device`, ...).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The one paragraph the recorder prints.
    pub fn summary(&self) -> String {
        let d = &self.diagnosis;
        let free = d.figures.device.map(|m| format!(", {} free on {}", format_bytes(m.free as i64), d.device));
        let place = self.statement.clone().or_else(|| self.frames.first().map(Frame::to_string));
        let mut text = format!(
            "memlab: out of memory on {}: {} requested{}{}. Verdict: {}. ",
            d.device,
            format_bytes(d.requested as i64),
            free.unwrap_or_default(),
            place.map(|p| format!(" at {p}")).unwrap_or_default(),
            d.verdict.title()
        );
        match self.files.first() {
            Some(first) => {
                text.push_str(&format!("Report: {}", first.display()));
                let others: Vec<String> = self.files[1..]
                    .iter()
                    .filter_map(|f| f.extension().map(|e| e.to_string_lossy().into_owned()))
                    .collect();
                if !others.is_empty() {
                    text.push_str(&format!(" (and .{})", others.join(", .")));
                }
                text.push('.');
            }
            None => text.push_str(&format!("The report could not be written: {}.", self.file_errors.join("; "))),
        }
        if !self.left_out.is_empty() {
            let parts: Vec<&str> = self.left_out.iter().map(|l| l.part.as_str()).collect();
            text.push_str(&format!(" Left out for want of memory: {}.", parts.join(", ")));
        }
        text.push('\n');
        text
    }
}

/// What holds `device`'s memory, named without waiting for any lock.
fn holders(device: Device, sources: &Sources, with_sites: bool) -> Holders {
    let mut out = Holders::default();
    let Ok(stats) = memlab_tch::device_stats(device) else { return out };
    let named = match sources.collect() {
        Ok(named) => named,
        Err(e) => {
            out.busy.push(format!("the named tensors could not be walked: {e}"));
            named::Named::default()
        }
    };
    let live = (with_sites && events::is_active()).then(events::live);
    let account = attribute(device, &stats, &named, live.as_deref());
    out.named_bytes = account.named;
    out.not_named = account.allocated - account.named as i64;
    out.rounding = account.rounding;
    let mut rows: Vec<NamedHolder> = named
        .storages(device)
        .iter()
        .filter(|s| s.from_allocator)
        .map(|s| {
            let first = &s.views[0];
            let more = s.views.len() - 1;
            NamedHolder {
                name: if more > 0 { format!("{} (+{more} views)", first.name) } else { first.name.clone() },
                kind: named::kind_label(first.kind),
                bytes: s.nbytes,
            }
        })
        .collect();
    // Largest first; equal sizes by name, shorter first (`layer2` before `layer10`).
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| (a.name.len(), &a.name).cmp(&(b.name.len(), &b.name))));
    let rest = rows.split_off(rows.len().min(TOP_HOLDERS));
    out.named_rest = (rest.len(), rest.iter().map(|r| r.bytes).sum());
    out.named = rows;
    if let (Some(groups), Some(live)) = (account.unnamed, live.as_deref()) {
        let frames_of = |site: &Option<String>| -> Vec<Frame> {
            live.iter()
                .filter(|a: &&LiveAllocation| a.device == device && &a.site() == site)
                .find_map(|a| a.backtrace.as_ref())
                .map(|b| b.frames().iter().take(SITE_FRAMES).cloned().collect())
                .unwrap_or_default()
        };
        out.by_site = Some(
            groups
                .iter()
                .take(TOP_HOLDERS)
                .map(|g| SiteHolder {
                    site: site_label(g).to_string(),
                    bytes: g.bytes,
                    blocks: g.blocks,
                    frames: frames_of(&g.site),
                })
                .collect(),
        );
    }
    out
}

rendered!(OomReport, Diagnosis);

impl Render for Diagnosis {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.heading(format!("Verdict: {}", self.verdict.title()));
        doc.line(self.advice.clone());
        doc
    }
}

impl Render for OomReport {
    fn document(&self) -> Document {
        const W: usize = 44;
        let d = &self.diagnosis;
        let b = |n: u64| format_bytes(n as i64);
        let mut doc = Document::new();
        doc.banner(format!("memlab: out of memory on {} (report {} of process {})", d.device, self.number, self.pid));
        let thread = match &self.thread.1 {
            Some(name) => format!("thread {} ({name})", self.thread.0),
            None => format!("thread {}", self.thread.0),
        };
        doc.line(format!("{} UTC, {thread}", self.time));
        let started = self.process_start.as_deref().map(|s| format!(", started {s} UTC")).unwrap_or_default();
        doc.line(format!("process {} on {}{started}", self.pid, self.host));
        if self.partial {
            doc.line("This report is partial: memory did not suffice for all of it (see \"Left out\" below).");
        }
        doc.blank();
        doc.label(W, "Requested", b(d.requested));
        let how = if d.rounded {
            "as the CUDA caching allocator rounded the request to the segment it tried to reserve"
        } else {
            "as asked"
        };
        doc.indented(2, format!("{} bytes, {how}", d.requested));
        if let Some(stream) = self.stream {
            doc.indented(2, format!("on the thread's current stream {stream:#x}"));
        }
        match &self.statement {
            Some(st) => doc.line(format!("While running {st}")),
            None => doc.line("No profiled statement was running (#[memlab::profile] names the line)."),
        };
        if !self.frames.is_empty() {
            doc.line("The failing call, innermost first:");
            for f in &self.frames {
                doc.indented(2, f.to_string());
            }
        }
        doc.blank();
        for block in Render::document(d).to_text().lines() {
            doc.line(block.to_string());
        }
        doc.blank();
        doc.heading(format!("Allocator ({})", d.device));
        doc.label(W, "allocated (live tensors)", format_bytes(d.figures.allocated));
        doc.label(W, "reserved", format_bytes(d.figures.reserved));
        if matches!(d.device, Device::Cuda(_)) {
            let c = d.figures.cache_free;
            let pool = if d.requested == SMALL_SEGMENT { "small" } else { "large" };
            doc.label(W, "free in the cache", b(c.bytes));
            doc.indented(2, format!("that could serve this request: its stream's free blocks of the {pool} pool"));
            doc.label(W, "largest free block", b(c.largest_block));
            doc.label(W, "fragmentation", b(d.figures.fragmentation()));
            let share = d.figures.fragmentation_share().map(|s| format!(", {:.0}% of it", s * 100.0));
            doc.indented(2, format!("free in the cache minus its largest free block{}", share.unwrap_or_default()));
        } else {
            doc.indented(2, "the CPU allocator keeps no cache: what is freed goes back at once");
        }
        if let Some(n) = self.missed_before.filter(|n| *n > 0) {
            doc.indented(2, format!("{n} earlier failure(s) happened before memlab watched this allocator"));
        }
        doc.blank();
        let source = if matches!(d.device, Device::Cuda(_)) { "driver" } else { "kernel" };
        doc.heading(format!("Device ({source})"));
        match d.figures.device {
            Some(m) => {
                doc.label(W, "free", b(m.free));
                doc.label(W, "total", b(m.total));
                if let Some(limit) = m.limit {
                    doc.indented(2, format!("what {} allows this process", limit.describe()));
                }
                if let Some(this) = m.this_process {
                    doc.label(
                        W,
                        if source == "driver" { "this process (NVML)" } else { "this process (resident set)" },
                        b(this),
                    );
                }
                if let Some(others) = m.other_processes {
                    doc.label(W, "other processes (NVML)", b(others));
                }
            }
            None => {
                doc.indented(2, "not read");
            }
        }
        for why in &self.missing {
            doc.indented(2, format!("not read: {why}"));
        }
        doc.blank();
        doc.heading("What holds the memory");
        let h = &self.holders;
        doc.label(W, "named", b(h.named_bytes));
        doc.indented(2, "registered var stores, their gradients, optimizer state and tensors, by name:");
        if !h.named.is_empty() {
            let mut table = Table::new(vec![
                Column::new("name", Kind::Text).max_width(70),
                Column::new("kind", Kind::Text),
                Column::new("bytes", Kind::Figure).min_width(9),
            ]);
            for n in &h.named {
                table.row([n.name.clone(), n.kind.to_string(), b(n.bytes)]);
            }
            if h.named_rest.0 > 0 {
                table.row([format!("{} more, each smaller", h.named_rest.0), String::new(), b(h.named_rest.1)]);
            }
            doc.table(table);
        }
        for busy in &h.busy {
            doc.indented(2, format!("not walked: {busy}"));
        }
        doc.label(W, "not named", format_bytes(h.not_named));
        match &h.by_site {
            Some(sites) if !sites.is_empty() => {
                let mut table = Table::new(vec![
                    Column::new("where allocated", Kind::Text).max_width(90),
                    Column::new("blocks", Kind::Figure),
                    Column::new("bytes", Kind::Figure).min_width(9),
                ]);
                for s in sites {
                    table.row([s.site.clone(), s.blocks.to_string(), b(s.bytes)]);
                }
                doc.table(table);
                for s in sites.iter().filter(|s| s.frames.len() > 1) {
                    doc.indented(2, format!("{}:", s.site));
                    for f in &s.frames {
                        doc.indented(4, f.to_string());
                    }
                }
            }
            Some(_) => {
                doc.indented(2, "no live allocation the recording saw is unnamed");
            }
            None if self.left_out.iter().any(|l| l.file.is_none()) => {
                doc.indented(2, "by where they were allocated: left out for want of memory (see below)");
            }
            None => {
                doc.indented(
                    2,
                    "start a memlab::Recording (with backtraces) to list these by where they were allocated",
                );
            }
        }
        if h.rounding > 0 {
            doc.indented(2, format!("of which {} is the allocator's rounding of blocks", format_bytes(h.rounding)));
        }
        doc.blank();
        if !self.files.is_empty() {
            let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
            doc.line(format!("Files: {}", files.join(", ")));
        }
        for e in &self.file_errors {
            doc.line(format!("Not written: {e}"));
        }
        if self.reserve > 0 {
            doc.line(format!("The recorder's reserve gave back {} of address space for this report.", b(self.reserve)));
        }
        if !self.left_out.is_empty() {
            doc.blank();
            doc.heading("Left out");
            for l in &self.left_out {
                let file = l.file.as_ref().map(|f| format!(" ({})", f.display())).unwrap_or_default();
                doc.indented(
                    2,
                    format!(
                        "{}{file}: needs about {} (estimated), {} could still be obtained",
                        l.part,
                        b(l.needed_estimate),
                        b(l.available)
                    ),
                );
            }
            doc.indented(2, "a larger OomRecorder::reserve (or a smaller recording) makes room for them");
        }
        doc
    }
}

/// The watermark warning: while the recorder is armed and a memory limit
/// applies (the cgroup's, or the address-space limit), a thread of memlab's
/// reads the use ten times a second and warns once when it crosses the
/// watermark, and again after it fell 5 points under it and rose again.
mod watermark {
    use super::*;
    use std::time::Duration;

    /// The watermark in force, as `f64` bits (0: none).
    static SHARE: AtomicU64 = AtomicU64::new(0);
    static RUNNING: AtomicBool = AtomicBool::new(false);

    /// Watches with `share` from now on (`None`: stops watching).
    pub(super) fn watch(share: Option<f64>) {
        SHARE.store(share.map_or(0, f64::to_bits), Ordering::Relaxed);
        if share.is_none() || readings().iter().all(Option::is_none) || RUNNING.swap(true, Ordering::Relaxed) {
            return;
        }
        let spawned = memlab_core::oom::spawn_started("memlab-oom-watermark", || {
            let mut above = [false; 2];
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let bits = SHARE.load(Ordering::Relaxed);
                if bits == 0 {
                    RUNNING.store(false, Ordering::Relaxed);
                    return;
                }
                for (reading, above) in readings().into_iter().zip(&mut above) {
                    if let Some(text) = reading.and_then(|r| observe(above, r, f64::from_bits(bits))) {
                        say(text);
                    }
                }
            }
        });
        if spawned.is_err() {
            RUNNING.store(false, Ordering::Relaxed);
        }
    }

    /// One reading of a limit: which, the use and the limit in bytes.
    pub(super) type Reading = (HostLimit, u64, u64);

    /// The cgroup's reading and the address space's, where each has a limit.
    fn readings() -> [Option<Reading>; 2] {
        let cgroup = memlab_tch::cgroup_memory().map(|(used, max)| (HostLimit::Cgroup, used, max));
        let address_space =
            memlab_tch::address_space().and_then(|(mapped, limit)| limit.map(|l| (HostLimit::AddressSpace, mapped, l)));
        [cgroup, address_space]
    }

    /// The warning for `reading`, when it crosses `share` of its limit
    /// (`above` says whether an earlier one did, until it falls 5 points
    /// under).
    pub(super) fn observe(above: &mut bool, (limit, used, max): Reading, share: f64) -> Option<String> {
        let at = used as f64 / max.max(1) as f64;
        if *above {
            *above = at >= share - 0.05;
            return None;
        }
        if at < share {
            return None;
        }
        *above = true;
        let figures = format!("{:.0}% of {} ({} of {})", at * 100.0, limit.describe(), b(used), b(max));
        Some(match limit {
            HostLimit::Cgroup => format!(
                "memlab: this process's cgroup uses {figures}. At the limit the kernel's out-of-memory killer \
                 ends the process without a failed request, so no out-of-memory report can be written: free \
                 memory, or raise the limit.\n"
            ),
            HostLimit::AddressSpace => format!(
                "memlab: this process has mapped {figures}. A request beyond the limit fails (and is reported): \
                 free memory, or raise the limit.\n"
            ),
        })
    }

    fn b(n: u64) -> String {
        format_bytes(n as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_warns_once_per_crossing() {
        let gib = 1u64 << 30;
        let mut above = false;
        let reading = |used: u64| (HostLimit::Cgroup, used, 10 * gib);
        assert_eq!(watermark::observe(&mut above, reading(8 * gib), 0.9), None);
        let warned = watermark::observe(&mut above, reading(9 * gib + gib / 5), 0.9).expect("92% crosses 90%");
        assert!(warned.contains("92% of the cgroup's memory limit (memory.max) (9.20G of 10.00G)"), "{warned}");
        assert!(warned.contains("out-of-memory killer"), "{warned}");
        // Still above, or a little under: once is enough.
        assert_eq!(watermark::observe(&mut above, reading(9 * gib + gib / 2), 0.9), None);
        assert_eq!(watermark::observe(&mut above, reading(8 * gib + gib / 2), 0.9), None);
        // Down by more than 5 points, then up again: a new warning.
        assert_eq!(watermark::observe(&mut above, reading(8 * gib), 0.9), None);
        assert!(watermark::observe(&mut above, reading(9 * gib), 0.9).is_some());
        let mut above = false;
        let space = watermark::observe(&mut above, (HostLimit::AddressSpace, 95, 100), 0.9).unwrap();
        assert!(space.contains("95% of the address-space limit (ulimit -v)"), "{space}");
    }

    #[test]
    fn advice_names_the_figures_of_each_verdict() {
        let mut failure = Failure::here(Device::Cuda(0), 1 << 30);
        failure.rounded = true;
        let gib = 1u64 << 30;
        let mut figures = MemoryFigures::default();
        figures.cache_free = memlab_core::oom::CacheFree::new(3 * gib, 256 << 20);
        figures.device = Some(DeviceMemory::new(gib / 2, 80 * gib, Some(70 * gib), Some(9 * gib)));
        let frag = advice(&failure, &figures, Verdict::Fragmentation, None);
        assert!(
            frag.contains("3.00G free") && frag.contains("256.00M") && frag.contains("expandable_segments:True"),
            "{frag}"
        );
        assert!(frag.contains("(2.75G of it, 92%"), "{frag}");
        let others = advice(&failure, &figures, Verdict::OtherProcesses, None);
        assert!(others.contains("Other processes hold 9.00G of cuda:0"), "{others}");
        let holders = Holders {
            named: vec![NamedHolder { name: "model.fc.weight".into(), kind: "parameter", bytes: 40 * gib }],
            ..Holders::default()
        };
        let short = advice(&failure, &figures, Verdict::NotEnoughFree, Some(&holders));
        assert!(short.contains("The largest holders: model.fc.weight (parameter): 40.00G."), "{short}");
        // 0.5 GiB free on the device and 3 GiB in the cache: enough together, not apart.
        assert!(short.contains("in one piece") && short.contains("(3.00G in blocks of at most 256.00M)"), "{short}");
        failure.requested = 8 * gib;
        let more = advice(&failure, &figures, Verdict::NotEnoughFree, None);
        assert!(!more.contains("in one piece"), "{more}");
        failure.requested = 4 << 40;
        let huge = advice(&failure, &figures, Verdict::RequestExceedsDevice, None);
        assert!(huge.contains("(4.00T, 4398046511104 bytes: 1099511627776 float32 elements)"), "{huge}");
        assert!(huge.contains("all of cuda:0 (80.00G)"), "{huge}");
    }
}
