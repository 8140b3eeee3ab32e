//! How the out-of-memory recorder works; what users see of it is `crate::oom` (and the
//! root's re-exports).

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

use crate::diagnosis::{Diagnosis, Holders, NamedHolder, SiteHolder};
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
