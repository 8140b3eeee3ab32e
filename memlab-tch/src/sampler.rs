//! memlab's one sampler: a thread per process that reads the resident set,
//! the driver's device-wide use and NVML's figure for this process, for
//! whoever asks: a step of the step logger (each step keeps its own peaks,
//! so that a step's own thread reads only the allocator and the clock) and a
//! recording made with `Settings::sampling` (each reading goes to its
//! timeline). It samples at the shortest interval asked for, keeps sampling
//! between steps for a while so that a training loop's steps neither wake it
//! nor wait for it, and parks after a second with nothing to sample.

use memlab_core::sync::LockExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{driver_memory, process_gpu_memory, resident_set, DriverMemory};

/// One step's sampling: its peaks of the resident set and of its device's
/// driver use, from [`StepWindow::start`] to [`StepWindow::stop`]. Steps
/// logged at the same time on several threads each keep their own.
pub struct StepWindow(Arc<Window>);

/// A sampling recording's subscription: while it lives, every reading goes to
/// the recording's timeline at least every `every`.
pub struct RecordingReadings(Arc<Subscriber>);

/// The peaks one step has seen so far.
struct Window {
    gpu: Option<usize>,
    every: Duration,
    rss_peak: AtomicU64,
    driver_peak: AtomicU64,
}

/// A recording that takes readings, and the device it reads.
struct Subscriber {
    gpu: Option<usize>,
    every: Duration,
}

struct SamplerState {
    windows: Mutex<Vec<Arc<Window>>>,
    recordings: Mutex<Vec<Arc<Subscriber>>>,
    /// Set while the thread is parked (or about to park).
    parked: AtomicBool,
    /// The latest driver reading of each device sampled.
    driver: Mutex<Vec<(usize, DriverMemory)>>,
    /// NVML's figure for this process, plus one (0: none yet).
    process: AtomicU64,
    /// The latest resident set, while the thread samples (0: parked).
    rss: AtomicU64,
    thread: std::thread::Thread,
}

/// How long the sampler goes on without steps before it parks.
const IDLE: Duration = Duration::from_secs(1);
/// NVML's process query is slow: at most this often.
const NVML_EVERY: Duration = Duration::from_millis(100);

/// The sampler's latest NVML reading of this process's GPU memory.
pub fn sampled_process_memory() -> Option<u64> {
    sampler().and_then(|s| s.process.load(Ordering::Relaxed).checked_sub(1))
}

/// The sampler's latest reading of the resident set, while it samples.
pub fn sampled_rss() -> Option<u64> {
    sampler().map(|s| s.rss.load(Ordering::Relaxed)).filter(|&r| r > 0)
}

/// The sampler's latest driver reading of `device` (read here when it has none).
pub fn latest_driver_memory(device: usize) -> Option<DriverMemory> {
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
    memlab_core::process::process_wide! {
        static STATE: OnceLock<Option<&'static SamplerState>> = OnceLock::new();
    }
    *STATE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<&'static SamplerState>();
        let spawned = std::thread::Builder::new().name("memlab-sampler".into()).spawn(move || {
            if let Ok(state) = rx.recv() {
                sample_forever(state);
            }
        });
        let handle = spawned.ok()?;
        let state: &'static SamplerState = Box::leak(Box::new(SamplerState {
            windows: Mutex::new(Vec::new()),
            recordings: Mutex::new(Vec::new()),
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

/// Wakes the thread if it parked: something to sample arrived.
fn wake(state: &SamplerState) {
    if state.parked.load(Ordering::SeqCst) {
        state.thread.unpark();
    }
}

/// The sampler thread's loop.
fn sample_forever(state: &'static SamplerState) {
    let mut nvml_read: Option<Instant> = None;
    let mut last_busy = Instant::now();
    // Devices steps have used lately: sampled between steps as well, so
    // that a step's end finds a fresh reading.
    let mut gpus: Vec<usize> = Vec::new();
    loop {
        let windows = state.windows.locked().clone();
        let recordings = state.recordings.locked().clone();
        let busy = |state: &SamplerState| !state.windows.locked().is_empty() || !state.recordings.locked().is_empty();
        if windows.is_empty() && recordings.is_empty() {
            if last_busy.elapsed() >= IDLE {
                // Park unless a step or a recording came in meanwhile: they
                // push themselves and then read `parked`, this thread sets
                // `parked` and then reads the lists, so one sees the other.
                state.rss.store(0, Ordering::Relaxed);
                state.parked.store(true, Ordering::SeqCst);
                if !busy(state) {
                    std::thread::park();
                }
                state.parked.store(false, Ordering::SeqCst);
                gpus.clear();
                last_busy = Instant::now();
                continue;
            }
        } else {
            last_busy = Instant::now();
            for gpu in windows.iter().map(|w| w.gpu).chain(recordings.iter().map(|r| r.gpu)).flatten() {
                if !gpus.contains(&gpu) {
                    gpus.push(gpu);
                }
            }
        }
        let rss = resident_set();
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
            driver_used.push(memlab_core::events::DriverUsed { device: gpu, bytes: read.used() });
        }
        // A recording's timeline gets the readings (nothing is kept without one).
        if (!windows.is_empty() || !recordings.is_empty()) && memlab_core::events::is_active() {
            memlab_core::events::reading(rss, driver_used);
        }
        if let Some(&index) = gpus.first() {
            if nvml_read.is_none_or(|t| t.elapsed() >= NVML_EVERY) {
                nvml_read = Some(Instant::now());
                let used = process_gpu_memory(index).ok().flatten();
                state.process.store(used.map_or(0, |u| u + 1), Ordering::Relaxed);
            }
        }
        let every = windows.iter().map(|w| w.every).chain(recordings.iter().map(|r| r.every)).min();
        // Woken early when a recording starts or ends (its first reading is then at once).
        std::thread::park_timeout(every.unwrap_or(Duration::from_millis(1)));
    }
}

impl StepWindow {
    /// Starts sampling a step on `gpu` (or the CPU alone) that begins with
    /// `rss` bytes resident, at least every `every`.
    pub fn start(gpu: Option<usize>, rss: u64, every: Duration) -> StepWindow {
        let every = every.max(Duration::from_nanos(1));
        let window = Arc::new(Window { gpu, every, rss_peak: AtomicU64::new(rss), driver_peak: AtomicU64::new(0) });
        if let Some(state) = sampler() {
            state.windows.locked().push(window.clone());
            wake(state);
        }
        StepWindow(window)
    }

    /// Stops sampling this step; returns its sampled peaks (resident set, driver use).
    pub fn stop(self) -> (u64, u64) {
        if let Some(state) = sampler() {
            state.windows.locked().retain(|w| !Arc::ptr_eq(w, &self.0));
        }
        (self.0.rss_peak.load(Ordering::Relaxed), self.0.driver_peak.load(Ordering::Relaxed))
    }
}

impl RecordingReadings {
    /// Readings of the resident set and of `gpu`'s driver use for the
    /// recording, at least every `every`, the first at once.
    pub(crate) fn start(gpu: Option<usize>, every: Duration) -> RecordingReadings {
        let subscriber = Arc::new(Subscriber { gpu, every: every.max(Duration::from_nanos(1)) });
        if let Some(state) = sampler() {
            state.recordings.locked().push(subscriber.clone());
            state.thread.unpark();
        }
        RecordingReadings(subscriber)
    }
}

impl Drop for RecordingReadings {
    fn drop(&mut self) {
        if let Some(state) = sampler() {
            state.recordings.locked().retain(|r| !Arc::ptr_eq(r, &self.0));
        }
    }
}

impl std::fmt::Debug for RecordingReadings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingReadings").field("gpu", &self.0.gpu).field("every", &self.0.every).finish()
    }
}
