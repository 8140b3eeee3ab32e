//! Out-of-memory failures of libtorch's allocators, seen before their error
//! reaches Rust code: the counting CPU allocator calls in when its inner
//! allocator fails, and an observer attached to the CUDA caching allocator
//! calls in when a CUDA request fails (libtorch calls observers on the
//! failing thread, after its allocator let its lock go, then throws). Both
//! become a [`Failure`] handed to the handlers crates submit
//! ([`memlab_core::oom::Handler`]). Nothing runs until a request fails.
//!
//! libtorch attaches observers only to a CUDA allocator that exists, and it
//! comes into being with the first CUDA allocation. [`watch_cuda`] attaches
//! memlab's at once when it does; otherwise a thread asks libtorch whether
//! the allocator exists every 10 ms (every 100 ms after ten seconds; the
//! question never initialises CUDA) and attaches it one look after it does.
//! A failure in the few milliseconds before is not seen; the allocator's own
//! count of them is ([`ooms_before_watching`]).
//! Failures outside libtorch's allocators (cuBLAS or cuDNN workspaces, the
//! CUDA context itself) cannot be observed.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use memlab_core::oom::{dispatch, CacheFree, DeviceMemory, Failure, Serving};
use memlab_core::{Device, Result};

use crate::ffi;

thread_local! {
    /// Set while this thread handles a failure: a failure inside the
    /// handling (its own allocations) is not handled again.
    static HANDLING: Cell<bool> = const { Cell::new(false) };
}

/// The shim calls this for every failed request (see `memlab_shim.h`).
#[no_mangle]
pub extern "C" fn memlab_tch_on_oom(device: i32, requested: u64, device_free: u64, device_total: u64, stream: u64) {
    if HANDLING.try_with(|h| h.replace(true)).unwrap_or(true) {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        let mut failure;
        if device == ffi::EVENT_DEVICE_CPU {
            failure = Failure::here(Device::Cpu, requested);
            let host = crate::host_memory();
            failure.device_free = host.map(|(available, _)| available);
            failure.device_total = host.map(|(_, total)| total);
        } else {
            failure = Failure::here(Device::Cuda(device.max(0) as usize), requested);
            failure.rounded = true;
            failure.device_free = Some(device_free);
            failure.device_total = Some(device_total);
            failure.stream = Some(stream);
        }
        dispatch(&failure);
    });
    let _ = HANDLING.try_with(|h| h.set(false));
}

/// The shim calls this while the program loads when `MEMLAB_OOM_DIR` is set.
#[no_mangle]
pub extern "C" fn memlab_tch_oom_from_environment() {
    let _ = std::panic::catch_unwind(|| {
        if environment_dir().is_some() {
            watch_cuda();
        }
    });
}

/// The directory `MEMLAB_OOM_DIR` names, created if missing; `None` when it
/// is unset or cannot be used, which is said once on standard error (the
/// variable is read as the program loads, before it could choose where
/// memlab's warnings go).
pub fn environment_dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let raw = std::env::var_os("MEMLAB_OOM_DIR")?;
        if raw.is_empty() {
            return None;
        }
        // Absolute: a later change of the working directory must not move the reports.
        let dir = std::path::absolute(PathBuf::from(&raw)).unwrap_or_else(|_| PathBuf::from(raw));
        match usable_dir(&dir) {
            Ok(()) => Some(dir),
            Err(why) => {
                memlab_core::output::warn(&format!(
                    "memlab: ignoring MEMLAB_OOM_DIR={}: {why}; out-of-memory reports are off until \
                     memlab::OomRecorder arms them\n",
                    dir.display()
                ));
                None
            }
        }
    })
    .as_ref()
}

/// Whether reports can be written in `dir`: it exists (made if missing), is
/// a directory, and takes a file.
pub fn usable_dir(dir: &std::path::Path) -> std::result::Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("it cannot be created ({e})"))?;
    let probe = dir.join(format!(".memlab-oom-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| format!("no file can be written there ({e})"))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

static WATCHING: AtomicBool = AtomicBool::new(false);
static WATCHER: AtomicBool = AtomicBool::new(false);
/// Per CUDA device, the allocator's count of failures just before memlab's
/// observer went on (`None`: not on yet). Held while attaching.
static OOMS_BEFORE: Mutex<Option<Vec<u64>>> = Mutex::new(None);

/// Attaches memlab's out-of-memory observer to the CUDA caching allocator now
/// if CUDA memory was allocated already, else starts a thread that attaches
/// it as soon as it is (see the module's docs). Returns whether it is on now.
/// Without CUDA it does nothing.
pub fn watch_cuda() -> bool {
    if (allocator_exists() && try_attach()) || !crate::built_with_cuda() {
        return WATCHING.load(Ordering::Relaxed);
    }
    if !WATCHER.swap(true, Ordering::Relaxed) {
        // SAFETY: registers a function that takes a lock and sets a flag.
        unsafe { libc::atexit(stop_watching) };
        let spawned = std::thread::Builder::new().name("memlab-oom-watch".into()).spawn(|| {
            let (mut waited, mut seen) = (Duration::ZERO, false);
            while !poll(&mut seen) {
                // Every 10 ms at first, then every 100 ms: a process that never
                // touches CUDA keeps a thread that wakes ten times a second.
                let step = if waited < Duration::from_secs(10) { 10 } else { 100 };
                std::thread::sleep(Duration::from_millis(step));
                waited += Duration::from_millis(step);
            }
        });
        if spawned.is_err() {
            WATCHER.store(false, Ordering::Relaxed);
        }
    }
    false
}

/// Held by the watcher while it asks libtorch, and for good once the
/// process exits: libtorch's allocators are destroyed then, and a call into
/// one from the watcher would abort the process ("pure virtual method
/// called"). The `bool` says the process is exiting.
static POLL: Mutex<bool> = Mutex::new(false);

/// Runs at exit, before libtorch's static objects are destroyed (it was
/// registered after they were made): stops the watcher for good.
extern "C" fn stop_watching() {
    let mut exiting = POLL.lock().unwrap_or_else(|e| e.into_inner());
    *exiting = true;
    std::mem::forget(exiting);
}

/// One look of the watcher: whether it is done (the observer is on, or the
/// process is exiting). libtorch marks its allocator as existing before it
/// has made every device's part, on another thread; attaching walks those
/// parts, so the watcher attaches only on the look after the one that saw
/// the allocator exist (`seen`), when the start-up is long over.
fn poll(seen: &mut bool) -> bool {
    let exiting = POLL.lock().unwrap_or_else(|e| e.into_inner());
    if *exiting {
        return true;
    }
    if *seen {
        return try_attach();
    }
    *seen = allocator_exists();
    false
}

/// Whether the CUDA caching allocator exists (never initialises CUDA).
fn allocator_exists() -> bool {
    let mut exists = 0i32;
    // SAFETY: the shim writes one int.
    ffi::check(unsafe { ffi::memlab_cuda_allocator_initialized(&mut exists) }).is_ok() && exists != 0
}

/// Attaches the observer if the CUDA allocator exists; whether it is on.
/// Called from a thread that made CUDA memory itself (or by the watcher a
/// look after it saw the allocator exist), so the allocator is complete.
fn try_attach() -> bool {
    if WATCHING.load(Ordering::Relaxed) {
        return true;
    }
    let mut before = OOMS_BEFORE.lock().unwrap_or_else(|e| e.into_inner());
    if before.is_some() {
        return true;
    }
    // What the allocator counted before memlab watched, per device, read first.
    let counts: Vec<u64> = (0..crate::cuda_device_count())
        .map(|i| crate::device_stats(Device::Cuda(i)).map_or(0, |s| s.num_ooms.max(0) as u64))
        .collect();
    let mut attached = 0i32;
    // SAFETY: the shim writes one int and never initialises CUDA.
    if ffi::check(unsafe { ffi::memlab_cuda_watch_ooms(&mut attached) }).is_err() || attached == 0 {
        return false;
    }
    *before = Some(counts);
    WATCHING.store(true, Ordering::Relaxed);
    true
}

/// Whether memlab's observer is on the CUDA allocator.
pub fn watching_cuda() -> bool {
    WATCHING.load(Ordering::Relaxed)
}

/// Out-of-memory failures of CUDA device `index` that its allocator counted
/// before memlab's observer went on, which memlab therefore did not see
/// (`None` while it is not on).
pub fn ooms_before_watching(index: usize) -> Option<u64> {
    OOMS_BEFORE.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|v| v.get(index).copied().unwrap_or(0))
}

/// The free blocks of CUDA device `index`'s cache, from the allocator's own
/// snapshot; with `serving`, only those of its stream and pool.
pub(crate) fn cuda_cache_free(index: usize, serving: Option<Serving>) -> Result<CacheFree> {
    let (mut bytes, mut largest) = (0u64, 0u64);
    let serves =
        |s: &crate::segments::CudaSegment| serving.is_none_or(|w| s.stream == w.stream && s.is_large == w.large);
    for s in crate::segments::cuda_segments()?.into_iter().filter(|s| s.device == index && serves(s)) {
        for b in s.blocks.iter().filter(|b| b.state == crate::segments::BlockState::Inactive) {
            bytes += b.size;
            largest = largest.max(b.size);
        }
    }
    Ok(CacheFree::new(bytes, largest))
}

/// What the driver (CUDA) or the kernel (the CPU) says of `device`'s memory.
pub(crate) fn device_memory(device: Device) -> Option<DeviceMemory> {
    match device {
        Device::Cpu => {
            let (available, total) = crate::host_memory()?;
            Some(DeviceMemory::new(available, total, Some(crate::resident_set()), None))
        }
        Device::Cuda(i) => {
            let driver = crate::driver_memory(i).ok()?;
            let this = crate::process_gpu_memory(i).ok().flatten();
            let others = this.map(|mine| driver.used().saturating_sub(mine));
            Some(DeviceMemory::new(driver.free, driver.total, this, others))
        }
    }
}
