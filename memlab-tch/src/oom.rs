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

use memlab_core::sync::LockExt;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use memlab_core::events::Action;
use memlab_core::oom::{dispatch, CacheFree, DeviceMemory, Failure, HostLimit, Serving};
use memlab_core::{Device, Result};

use crate::ffi;

thread_local! {
    /// Set while this thread handles a failure: a failure inside the
    /// handling (its own allocations) is not handled again.
    static HANDLING: Cell<bool> = const { Cell::new(false) };
}

/// The shim calls this for every failed request (see `memlab_shim.h`):
/// the reserve is given back first, so that what follows (the CPU's event,
/// the handlers) allocates out of it, and taken again at the end.
#[no_mangle]
pub extern "C" fn memlab_tch_on_oom(device: i32, requested: u64, device_free: u64, device_total: u64, stream: u64) {
    if HANDLING.try_with(|h| h.replace(true)).unwrap_or(true) {
        return;
    }
    // Under an address-space limit, what the program had left: the reserve
    // taken back afterwards must not come out of it.
    let room_before = address_space_room();
    let released = reserve::release();
    let _ = std::panic::catch_unwind(|| {
        let mut failure;
        if device == ffi::EVENT_DEVICE_CPU {
            failure = Failure::here(Device::Cpu, requested);
            let mut host = device_memory(Device::Cpu).ok();
            if let Some(m) = host.as_mut().filter(|m| m.limit == Some(HostLimit::AddressSpace)) {
                // What was free when the request failed: the reserve, given
                // back since, was not the program's to use.
                m.free = m.free.saturating_sub(released);
            }
            failure.device_free = host.map(|m| m.free);
            failure.device_total = host.map(|m| m.total);
            // The CPU's failure as an event, as libtorch's CUDA trace has its own.
            memlab_core::events::record(Device::Cpu, Action::Oom, failure.device_free.unwrap_or(0), requested, 0);
        } else {
            failure = Failure::here(Device::Cuda(device.max(0) as usize), requested);
            failure.rounded = true;
            failure.device_free = Some(device_free);
            failure.device_total = Some(device_total);
            failure.stream = Some(stream);
        }
        failure.reserve = released;
        dispatch(&failure);
    });
    if released > 0 {
        let most = room_before.zip(address_space_room()).map(|(before, after)| after.saturating_sub(before));
        let kept = reserve::restore(most);
        if kept < released {
            let _ = std::panic::catch_unwind(|| {
                memlab_core::output::warn_outside_user_code(format!(
                    "memlab: memory is short: after the report, {} of the {} out-of-memory reserve could be kept \
                     aside again without taking what the program had left (the report's memory stays with the C \
                     allocator); the next report gets that much until the recorder is armed again\n",
                    memlab_core::render::Cell::bytes(kept),
                    memlab_core::render::Cell::bytes(released)
                ))
            });
        }
    }
    let _ = HANDLING.try_with(|h| h.set(false));
}

/// What the address-space limit leaves this process, if one applies
/// (read without allocating).
fn address_space_room() -> Option<u64> {
    crate::address_space().and_then(|(mapped, limit)| limit.map(|l| l.saturating_sub(mapped)))
}

/// Address space kept aside for the out-of-memory handlers: a mapping that
/// no page backs (it costs no memory, only room under an address-space
/// limit), given back when a request fails so that writing its report
/// cannot fail for want of memory, and taken again afterwards.
pub mod reserve {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use memlab_core::sync::LockExt;

    memlab_core::process::process_wide! {
        /// The mapping held now: (address, bytes); (0, 0) when none.
        static HELD: Mutex<(usize, usize)> = Mutex::new((0, 0));
    }
    memlab_core::process::process_wide! {
        /// The size asked for, which [`restore`] takes again.
        static WANTED: AtomicU64 = AtomicU64::new(0);
    }

    fn held() -> std::sync::MutexGuard<'static, (usize, usize)> {
        HELD.locked()
    }

    /// Maps `bytes` of address space (rounded up to pages), or `None`.
    fn map(bytes: usize) -> Option<usize> {
        // SAFETY: an anonymous private mapping without access, which nothing
        // reads or writes; MAP_NORESERVE keeps it out of the commit charge.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (at != libc::MAP_FAILED).then_some(at as usize)
    }

    /// Keeps `bytes` aside from now on (0: none), in place of what was kept
    /// before. Fails, keeping none, when the address space has no such room.
    pub fn set(bytes: u64) -> std::io::Result<()> {
        let mut held = held();
        if held.1 > 0 {
            // SAFETY: the mapping was made by `map` and is unmapped once.
            unsafe { libc::munmap(held.0 as *mut libc::c_void, held.1) };
            *held = (0, 0);
        }
        WANTED.store(bytes, Ordering::Relaxed);
        if bytes == 0 {
            return Ok(());
        }
        let len = usize::try_from(bytes).map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        let at = map(len).ok_or_else(std::io::Error::last_os_error)?;
        *held = (at, len);
        Ok(())
    }

    /// Gives the reserve back to the system; returns its bytes (0 when
    /// another failure has it, or none is kept). Allocates nothing.
    pub(crate) fn release() -> u64 {
        let mut held = held();
        let (at, len) = std::mem::take(&mut *held);
        if len > 0 {
            // SAFETY: as in `set`.
            unsafe { libc::munmap(at as *mut libc::c_void, len) };
        }
        len as u64
    }

    /// Takes the reserve again after a release, as much of it as the
    /// address space has room for and at most `most` bytes (halving down to
    /// 1 MiB); the bytes held now.
    pub(crate) fn restore(most: Option<u64>) -> u64 {
        let wanted = WANTED.load(Ordering::Relaxed).min(most.unwrap_or(u64::MAX)) as usize;
        let mut held = held();
        let mut size = wanted;
        while held.1 == 0 && size >= 1 << 20 {
            if let Some(at) = map(size) {
                *held = (at, size);
            }
            size /= 2;
        }
        held.1 as u64
    }

    /// The bytes kept aside now.
    pub fn bytes() -> u64 {
        held().1 as u64
    }
}

/// Does now what a failure path would otherwise do when memory has run
/// out: reads the unwind tables and the program's debug information (for
/// the failing call's frames) and starts the thread that hands warnings to
/// a sink. Arming calls it.
pub fn prepare_failure_path() {
    memlab_core::events::prepare_backtraces();
    memlab_core::output::prepare_later();
}

memlab_core::process::process_wide! {
    static WATCHING: AtomicBool = AtomicBool::new(false);
}
memlab_core::process::process_wide! {
    static WATCHER: AtomicBool = AtomicBool::new(false);
}
memlab_core::process::process_wide! {
    /// Per CUDA device, the allocator's count of failures just before memlab's
    /// observer went on (`None`: not on yet). Held while attaching.
    static OOMS_BEFORE: Mutex<Option<Vec<u64>>> = Mutex::new(None);
}

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
        let spawned = memlab_core::thread::spawn_started("memlab-oom-watch", || {
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

memlab_core::process::process_wide! {
    /// Held by the watcher while it asks libtorch, and for good once the
    /// process exits: libtorch's allocators are destroyed then, and a call into
    /// one from the watcher would abort the process ("pure virtual method
    /// called"). The `bool` says the process is exiting.
    static POLL: Mutex<bool> = Mutex::new(false);
}

/// Runs at exit, before libtorch's static objects are destroyed (it was
/// registered after they were made): stops the watcher for good.
extern "C" fn stop_watching() {
    let mut exiting = POLL.locked();
    *exiting = true;
    std::mem::forget(exiting);
}

/// One look of the watcher: whether it is done (the observer is on, or the
/// process is exiting). libtorch marks its allocator as existing before it
/// has made every device's part, on another thread; attaching walks those
/// parts, so the watcher attaches only on the look after the one that saw
/// the allocator exist (`seen`), when the start-up is long over.
fn poll(seen: &mut bool) -> bool {
    let exiting = POLL.locked();
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
    let mut before = OOMS_BEFORE.locked();
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
    OOMS_BEFORE.locked().as_ref().map(|v| v.get(index).copied().unwrap_or(0))
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
/// On the CPU, what this process may use: the host's free and total memory,
/// or the address-space limit's or the cgroup's where they leave less. The
/// error says why the figures cannot be read.
pub(crate) fn device_memory(device: Device) -> memlab_core::Result<DeviceMemory> {
    match device {
        Device::Cpu => {
            let unreadable = || {
                let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
                memlab_core::Error::io("read /proc/meminfo", missing)
            };
            let (mut free, mut total) = crate::host_memory().ok_or_else(unreadable)?;
            let mut limit = None;
            let address_space =
                crate::address_space().and_then(|(mapped, limit)| limit.map(|l| (l.saturating_sub(mapped), l)));
            let cgroup = crate::cgroup_memory().map(|(used, max)| (max.saturating_sub(used), max));
            for (room, which) in [(address_space, HostLimit::AddressSpace), (cgroup, HostLimit::Cgroup)] {
                if let Some((room_free, room_total)) = room.filter(|(f, _)| *f < free) {
                    (free, total, limit) = (room_free, room_total.min(total), Some(which));
                }
            }
            Ok(DeviceMemory::new(free, total, Some(crate::resident_set()), None).limited_by(limit))
        }
        Device::Cuda(i) => {
            let driver = crate::driver_memory(i)?;
            let this = crate::process_gpu_memory(i).ok().flatten();
            let others = this.map(|mine| driver.used().saturating_sub(mine));
            Ok(DeviceMemory::new(driver.free, driver.total, this, others))
        }
    }
}
