//! The step logger's background sampler: one thread per process that reads
//! the resident set, the driver's device-wide use and NVML's figure for this
//! process while steps run, so a step's own thread reads only the allocator
//! and the clock.

use memlab_core::sync::LockExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use memlab_tch::{driver_memory, process_gpu_memory, DriverMemory};

use super::rss;

/// Samples the resident set and the driver's device-wide use while steps
/// run. One thread serves every step of the process, also steps logged at the
/// same time on several threads (each keeps its own peaks). It keeps sampling
/// between steps for a while, so a training loop's steps neither wake it nor
/// wait for it, and parks after a second without steps.
pub(super) struct Sampler(Arc<Window>);

/// The peaks one step has seen so far.
struct Window {
    gpu: Option<usize>,
    rss_peak: AtomicU64,
    driver_peak: AtomicU64,
}

struct SamplerState {
    windows: Mutex<Vec<Arc<Window>>>,
    every_ns: AtomicU64,
    /// Set while the thread is parked (or about to park).
    parked: AtomicBool,
    /// The latest driver reading of each device a step has used.
    driver: Mutex<Vec<(usize, DriverMemory)>>,
    /// NVML's figure for this process, plus one (0: none yet).
    process: AtomicU64,
    /// The latest resident set, while the thread samples (0: parked).
    rss: AtomicU64,
    thread: std::thread::Thread,
}

/// How long the sampler goes on without steps before it parks.
const IDLE: Duration = Duration::from_secs(1);

/// The sampler's latest NVML reading of this process's GPU memory.
pub(super) fn sampled_process_memory() -> Option<u64> {
    sampler().and_then(|s| s.process.load(Ordering::Relaxed).checked_sub(1))
}

/// The sampler's latest reading of the resident set, while it samples.
pub(super) fn sampled_rss() -> Option<u64> {
    sampler().map(|s| s.rss.load(Ordering::Relaxed)).filter(|&r| r > 0)
}

/// The sampler's latest driver reading of `device` (read here when it has none).
pub(super) fn latest_driver_memory(device: usize) -> Option<DriverMemory> {
    let Some(state) = sampler() else { return driver_memory(device).ok() };
    let known = state.driver.locked().iter().find(|(d, _)| *d == device).map(|m| m.1);
    known.or_else(|| {
        let read = driver_memory(device).ok()?;
        remember_driver(state, device, read);
        Some(read)
    })
}

fn remember_driver(state: &SamplerState, device: usize, read: DriverMemory) {
    let mut known = state.driver.locked();
    match known.iter_mut().find(|(d, _)| *d == device) {
        Some(slot) => slot.1 = read,
        None => known.push((device, read)),
    }
}

fn sampler() -> Option<&'static SamplerState> {
    static STATE: OnceLock<Option<&'static SamplerState>> = OnceLock::new();
    *STATE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<&'static SamplerState>();
        let spawned = std::thread::Builder::new().name("memlab-step-sampler".into()).spawn(move || {
            if let Ok(state) = rx.recv() {
                sample_forever(state);
            }
        });
        let handle = spawned.ok()?;
        let state: &'static SamplerState = Box::leak(Box::new(SamplerState {
            windows: Mutex::new(Vec::new()),
            every_ns: AtomicU64::new(1_000_000),
            parked: AtomicBool::new(false),
            driver: Mutex::new(Vec::new()),
            process: AtomicU64::new(0),
            rss: AtomicU64::new(0),
            thread: handle.thread().clone(),
        }));
        tx.send(state).ok()?;
        Some(state)
    })
}

/// The sampler thread's loop.
fn sample_forever(state: &'static SamplerState) {
    let mut nvml_read: Option<Instant> = None;
    let mut last_step = Instant::now();
    // Devices steps have used lately: sampled between steps as well, so
    // that a step's end finds a fresh reading.
    let mut gpus: Vec<usize> = Vec::new();
    loop {
        let windows = state.windows.locked().clone();
        if windows.is_empty() {
            if last_step.elapsed() >= IDLE {
                // Park unless a step came in meanwhile: a step pushes its
                // window and then reads `parked`, this thread sets `parked`
                // and then reads the windows, so one of the two sees the other.
                state.rss.store(0, Ordering::Relaxed);
                state.parked.store(true, Ordering::SeqCst);
                if state.windows.locked().is_empty() {
                    std::thread::park();
                }
                state.parked.store(false, Ordering::SeqCst);
                gpus.clear();
                last_step = Instant::now();
                continue;
            }
        } else {
            last_step = Instant::now();
            for gpu in windows.iter().filter_map(|w| w.gpu) {
                if !gpus.contains(&gpu) {
                    gpus.push(gpu);
                }
            }
        }
        let rss = rss();
        state.rss.store(rss, Ordering::Relaxed);
        for w in &windows {
            w.rss_peak.fetch_max(rss, Ordering::Relaxed);
        }
        let mut driver_used = Vec::new();
        for &gpu in &gpus {
            let Ok(read) = driver_memory(gpu) else { continue };
            remember_driver(state, gpu, read);
            for w in windows.iter().filter(|w| w.gpu == Some(gpu)) {
                w.driver_peak.fetch_max(read.used(), Ordering::Relaxed);
            }
            driver_used.push((gpu, read.used()));
        }
        // A recording's timeline gets the readings too (nothing is kept without one).
        if !windows.is_empty() && memlab_core::events::is_active() {
            memlab_core::events::reading(rss, driver_used);
        }
        // NVML's process query is slow: at most every 100 ms.
        if let Some(&index) = gpus.first() {
            if nvml_read.is_none_or(|t| t.elapsed() >= Duration::from_millis(100)) {
                nvml_read = Some(Instant::now());
                let used = process_gpu_memory(index).ok().flatten();
                state.process.store(used.map_or(0, |u| u + 1), Ordering::Relaxed);
            }
        }
        std::thread::sleep(Duration::from_nanos(state.every_ns.load(Ordering::Relaxed)));
    }
}

impl Sampler {
    /// Starts sampling a step that begins with `rss` bytes resident.
    pub(super) fn start(gpu: Option<usize>, rss: u64, every: Duration) -> Sampler {
        let window = Arc::new(Window { gpu, rss_peak: AtomicU64::new(rss), driver_peak: AtomicU64::new(0) });
        if let Some(state) = sampler() {
            state.every_ns.store(every.as_nanos().max(1) as u64, Ordering::Relaxed);
            state.windows.locked().push(window.clone());
            if state.parked.load(Ordering::SeqCst) {
                state.thread.unpark();
            }
        }
        Sampler(window)
    }

    /// Stops sampling this step; returns its sampled peaks (resident set, driver use).
    pub(super) fn stop(self) -> (u64, u64) {
        if let Some(state) = sampler() {
            state.windows.locked().retain(|w| !Arc::ptr_eq(w, &self.0));
        }
        (self.0.rss_peak.load(Ordering::Relaxed), self.0.driver_peak.load(Ordering::Relaxed))
    }
}
