//! Out-of-memory failures, backend-free: what a backend reports when a
//! request fails ([`Failure`]), the figures of the device at that moment
//! ([`MemoryFigures`], read through a [`Backend`]), why the request
//! failed ([`Verdict`]), decided from those numbers alone so that every
//! verdict can be tested with a scripted backend, and the report the
//! `memlab` crate's recorder writes ([`OomReport`], which `memlab merge`
//! reads back).
//!
//! Backends call the [`Handler`]s that crates submit (with `inventory`) on
//! the thread whose request failed, before the allocator's error reaches
//! the caller; the `memlab` crate's handler writes the report. A try that
//! expects to fail ([`quietly`], the batch-size search's) takes its device's
//! failures as its own instead: no handler sees them.

use std::sync::Arc;

mod advice;
mod report;

pub use crate::backend::{CacheFree, DeviceMemory, HostLimit, Serving};
pub use crate::verdict::Verdict;
pub use advice::{advise_settings, Avoiding, EmptyCachePoint, SettingsAdvice};
pub use report::{
    Diagnosis, FailingThread, Holders, LeftOut, NamedHolder, NamedRest, OomReport, SiteHolder, WorkspaceHolder,
    SMALL_SEGMENT,
};

use crate::backend::Backend;
use crate::device::Device;
use crate::error::Result;
use crate::events::{Backtrace, StatementRef};

/// A request an allocator could not serve, as its backend saw it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Failure {
    /// Where.
    pub device: Device,
    /// The bytes the allocator tried to obtain: the exact request on the CPU;
    /// on CUDA the caching allocator's rounding of it to the segment it tried
    /// to reserve (see [`rounded`](Self::rounded)).
    pub requested: u64,
    /// Whether `requested` is the allocator's rounding rather than the bytes asked for.
    pub rounded: bool,
    /// What the device still had free, as its driver (CUDA) or the kernel
    /// (the host's `MemAvailable`) said then, when known.
    pub device_free: Option<u64>,
    /// The device's memory, or what this process may use of it (CUDA's
    /// per-process memory fraction), when known.
    pub device_total: Option<u64>,
    /// CUDA: the failing thread's current stream (the one the allocation was
    /// for, unless it named another).
    pub stream: Option<u64>,
    /// memlab's number for the failing thread (see [`crate::events::thread_number`]).
    pub thread: u64,
    /// The profiled statement running on that thread, if any.
    pub statement: Option<StatementRef>,
    /// The failing call's stack, when the backend captured it (a handler
    /// runs on the failing thread and can capture it itself).
    pub backtrace: Option<Arc<Backtrace>>,
    /// Bytes of address space the backend gave back for the handlers (the
    /// out-of-memory reserve): what they allocate comes out of it.
    pub reserve: u64,
}

impl Failure {
    /// A failure on `device` of `requested` bytes, on the calling thread:
    /// its thread number and profiled statement are taken now. The call
    /// stack is left to a handler that needs it (it runs on the same thread).
    pub fn here(device: Device, requested: u64) -> Failure {
        Failure {
            device,
            requested,
            rounded: false,
            device_free: None,
            device_total: None,
            stream: None,
            thread: crate::events::thread_number(),
            statement: crate::events::current_statement(),
            backtrace: None,
            reserve: 0,
        }
    }
}

/// What a crate runs when a backend sees an out-of-memory failure: it is
/// called on the failing thread, with no memlab lock held, inside the
/// allocator (libtorch's CUDA allocator has let its lock go): it must not
/// wait on a lock that code allocating memory may hold, and must not unwind.
pub struct Handler(pub fn(&Failure));

inventory::collect!(Handler);

/// Runs every submitted [`Handler`] on `failure`, unless a try running
/// [`quietly`] on its device takes it.
pub fn dispatch(failure: &Failure) {
    if quiet::take(failure) {
        return;
    }
    for handler in inventory::iter::<Handler> {
        (handler.0)(failure);
    }
}

/// Runs `f`, a try on `device` that may run out of memory on purpose, with
/// that device's failures kept from the [`Handler`]s (nothing counted,
/// written or printed) and returns what `inspect` made of the first of them.
/// `inspect` runs at the failure, on the failing thread, with no lock of
/// memlab's held: the figures it reads are the failure's. A failure on
/// `device` while `f` runs is the try's on every thread (the autograd engine
/// runs a CUDA backward pass on threads of its own). `f` is given the try's
/// ticket (see [`try_failed`]).
///
/// ```
/// use memlab_core::oom::{dispatch, quietly, try_failed, Failure};
/// use memlab_core::Device;
///
/// let (failed, first) = quietly(Device::Cpu, |f: &Failure| f.requested, |ticket| {
///     dispatch(&Failure::here(Device::Cpu, 4096)); // as a backend does
///     try_failed(ticket)
/// });
/// assert_eq!((failed, first), (true, Some(4096)));
/// ```
pub fn quietly<R, T: Send + 'static>(
    device: Device,
    inspect: impl Fn(&Failure) -> T + Send + Sync + 'static,
    f: impl FnOnce(u64) -> R,
) -> (R, Option<T>) {
    let ticket = quiet::start(device, Arc::new(move |failure: &Failure| Box::new(inspect(failure)) as quiet::Seen));
    /// Takes the try off the list once: when it returns, or as `f` unwinds.
    struct Guard(u64);
    impl Guard {
        fn finish(self) -> Option<quiet::Seen> {
            let seen = quiet::end(self.0);
            std::mem::forget(self);
            seen
        }
    }
    impl Drop for Guard {
        fn drop(&mut self) {
            quiet::end(self.0);
        }
    }
    let guard = Guard(ticket);
    let out = f(ticket);
    let seen = guard.finish();
    (out, seen.and_then(|s| s.downcast::<T>().ok()).map(|t| *t))
}

/// Whether the try with `ticket` (see [`quietly`]) has seen an
/// out-of-memory failure of its device: the allocator's own report of it,
/// whatever the error's words.
pub fn try_failed(ticket: u64) -> bool {
    quiet::failed(ticket)
}

/// The tries running [`quietly`] now.
mod quiet {
    use std::any::Any;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use super::Failure;
    use crate::device::Device;
    use crate::sync::LockExt;

    pub(super) type Seen = Box<dyn Any + Send>;
    pub(super) type Inspect = Arc<dyn Fn(&Failure) -> Seen + Send + Sync>;

    struct Try {
        ticket: u64,
        device: Device,
        inspect: Inspect,
        seen: Option<Seen>,
    }

    crate::process::process_wide! {
        static TRIES: Mutex<Vec<Try>> = Mutex::new(Vec::new());
    }
    crate::process::process_wide! {
        static NEXT: AtomicU64 = AtomicU64::new(1);
    }

    pub(super) fn start(device: Device, inspect: Inspect) -> u64 {
        let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
        TRIES.locked().push(Try { ticket, device, inspect, seen: None });
        ticket
    }

    /// Takes the try off the list (once), with what it saw.
    pub(super) fn end(ticket: u64) -> Option<Seen> {
        let mut tries = TRIES.locked();
        let at = tries.iter().position(|t| t.ticket == ticket)?;
        tries.remove(at).seen
    }

    pub(super) fn failed(ticket: u64) -> bool {
        TRIES.locked().iter().any(|t| t.ticket == ticket && t.seen.is_some())
    }

    /// Gives `failure` to the tries on its device that saw none yet; whether
    /// a try runs on that device (the failure is then theirs).
    pub(super) fn take(failure: &Failure) -> bool {
        let waiting: Vec<(u64, Inspect)> = {
            let tries = TRIES.locked();
            if !tries.iter().any(|t| t.device == failure.device) {
                return false;
            }
            let unseen = tries.iter().filter(|t| t.device == failure.device && t.seen.is_none());
            unseen.map(|t| (t.ticket, t.inspect.clone())).collect()
        };
        // Inspected with no lock held: an inspection reads the allocator.
        let seen: Vec<(u64, Seen)> = waiting.into_iter().map(|(ticket, inspect)| (ticket, inspect(failure))).collect();
        let mut tries = TRIES.locked();
        for (ticket, seen) in seen {
            if let Some(t) = tries.iter_mut().find(|t| t.ticket == ticket && t.seen.is_none()) {
                t.seen = Some(seen);
            }
        }
        true
    }
}

/// A device's memory when a request failed: the allocator's figures, its
/// cache, and the driver's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct MemoryFigures {
    /// Bytes of live tensors (`allocated_bytes.all.current`).
    pub allocated: i64,
    /// Bytes the allocator holds (`reserved_bytes.all.current`; the CPU keeps no cache).
    pub reserved: i64,
    /// The cache's free blocks.
    pub cache_free: CacheFree,
    /// The driver's figures, when they could be read.
    pub device: Option<DeviceMemory>,
}

impl MemoryFigures {
    /// Reads `device`'s figures through `backend`; with `serving`, the
    /// cache's free blocks are those that could serve such a request.
    pub fn read(backend: &dyn Backend, device: Device, serving: Option<Serving>) -> Result<MemoryFigures> {
        MemoryFigures::read_explained(backend, device, serving).map(|(figures, _)| figures)
    }

    /// [`read`](Self::read), with why the driver's figures are missing when
    /// they are (`device` is then `None`): the backend is asked once.
    pub fn read_explained(
        backend: &dyn Backend,
        device: Device,
        serving: Option<Serving>,
    ) -> Result<(MemoryFigures, Option<crate::error::Error>)> {
        let mut raw = crate::stats::RawStats::default();
        backend.sample(device, &mut raw, false)?;
        let stats = raw.to_device_stats();
        let (memory, missing) = match backend.device_memory(device) {
            Ok(memory) => (Some(memory), None),
            Err(e) => (None, Some(e)),
        };
        let figures = MemoryFigures {
            allocated: stats.allocated_bytes.all.current,
            reserved: stats.reserved_bytes.all.current,
            cache_free: backend.cache_free(device, serving)?,
            device: memory,
        };
        Ok((figures, missing))
    }

    /// Fragmentation: the cache's free bytes that are not in its largest free
    /// block, which no request larger than that block can use.
    pub fn fragmentation(&self) -> u64 {
        self.cache_free.bytes.saturating_sub(self.cache_free.largest_block)
    }

    /// [`fragmentation`](Self::fragmentation) as a share of the cache's free
    /// bytes (0 to 1); `None` when the cache has nothing free.
    pub fn fragmentation_share(&self) -> Option<f64> {
        (self.cache_free.bytes > 0).then(|| self.fragmentation() as f64 / self.cache_free.bytes as f64)
    }

    /// Whether a request of `requested` bytes would have fitted in the free
    /// memory the device and the cache have apart, had it been in one piece:
    /// the cache has free blocks, and they and the device's free bytes add
    /// up to the request.
    pub fn would_suffice_in_one_piece(&self, requested: u64) -> bool {
        let device_free = self.device.map_or(0, |d| d.free);
        self.cache_free.bytes > 0 && device_free.saturating_add(self.cache_free.bytes) >= requested
    }
}

impl Verdict {
    /// Decides why `requested` bytes failed, given `figures`, in this order:
    /// larger than the device; enough free in the cache but in pieces
    /// (free in cache ≥ request > largest free block); room taken by other
    /// processes (free on the device and in the cache < request ≤ that plus
    /// what other processes hold); otherwise not enough free memory.
    pub fn decide(requested: u64, figures: &MemoryFigures) -> Verdict {
        let device = figures.device;
        if device.is_some_and(|d| d.total > 0 && requested > d.total) {
            return Verdict::RequestExceedsDevice;
        }
        let cache = figures.cache_free;
        if cache.bytes >= requested && cache.largest_block < requested {
            return Verdict::Fragmentation;
        }
        if let Some(d) = device {
            let free = d.free + cache.bytes;
            if free < requested && d.other_processes.is_some_and(|others| free + others >= requested) {
                return Verdict::OtherProcesses;
            }
        }
        Verdict::NotEnoughFree
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ScriptedBackend;

    use crate::units::{GIB, MIB};

    /// A scripted 80 GiB device holding `allocated` bytes, with a cache and driver figures.
    fn device(allocated: u64, cache: CacheFree, memory: DeviceMemory) -> (ScriptedBackend, Device) {
        let backend = ScriptedBackend::new(1);
        let gpu = Device::Cuda(0);
        backend.alloc(gpu, allocated as i64);
        backend.set_cache_free(gpu, cache);
        backend.set_device_memory(gpu, memory);
        (backend, gpu)
    }

    fn verdict(backend: &ScriptedBackend, device: Device, requested: u64) -> (Verdict, MemoryFigures) {
        let figures = MemoryFigures::read(backend, device, None).unwrap();
        (Verdict::decide(requested, &figures), figures)
    }

    #[test]
    fn a_quiet_try_takes_the_failures_of_its_device_only() {
        let ((), seen) = quietly(
            Device::Cuda(7),
            |f: &Failure| f.requested,
            |ticket| {
                assert!(!try_failed(ticket));
                dispatch(&Failure::here(Device::Cuda(6), 1));
                assert!(!try_failed(ticket), "another device's failure is not the try's");
                dispatch(&Failure::here(Device::Cuda(7), 2));
                dispatch(&Failure::here(Device::Cuda(7), 3));
                assert!(try_failed(ticket));
            },
        );
        assert_eq!(seen, Some(2), "the first failure's inspection");
        // A try that unwinds leaves the list: the device's failures are no one's again.
        let unwound = std::panic::catch_unwind(|| quietly(Device::Cuda(7), |_| (), |_| panic!("the try fails")));
        assert!(unwound.is_err());
        assert!(!quiet::take(&Failure::here(Device::Cuda(7), 4)));
    }

    #[test]
    fn a_request_larger_than_the_device() {
        let (backend, gpu) = device(GIB, CacheFree::default(), DeviceMemory::new(70 * GIB, 80 * GIB, None, None));
        let (v, figures) = verdict(&backend, gpu, 4 << 40);
        assert_eq!(v, Verdict::RequestExceedsDevice);
        assert_eq!(figures.allocated, GIB as i64, "the allocator's figure, read through the backend");
        // Just below the device's size, it is a matter of free memory.
        assert_eq!(verdict(&backend, gpu, 79 * GIB).0, Verdict::NotEnoughFree);
    }

    #[test]
    fn free_cache_in_pieces_is_fragmentation() {
        // 6 GiB free in the cache, the largest block 512 MiB, 1 GiB asked.
        let cache = CacheFree::new(6 * GIB, 512 * MIB);
        let (backend, gpu) = device(70 * GIB, cache, DeviceMemory::new(200 * MIB, 80 * GIB, None, Some(0)));
        let (v, figures) = verdict(&backend, gpu, GIB);
        assert_eq!(v, Verdict::Fragmentation);
        // The formula: free in cache minus the largest free block, and its share.
        assert_eq!(figures.fragmentation(), 6 * GIB - 512 * MIB);
        assert_eq!(figures.fragmentation_share(), Some((6 * GIB - 512 * MIB) as f64 / (6 * GIB) as f64));
        // A request the largest block can serve never fails for fragmentation.
        assert_ne!(verdict(&backend, gpu, 256 * MIB).0, Verdict::Fragmentation);
        // Nor one larger than all the cache has free.
        assert_ne!(verdict(&backend, gpu, 7 * GIB).0, Verdict::Fragmentation);
    }

    #[test]
    fn room_held_by_other_processes() {
        // 1 GiB free, 30 GiB held by others, 2 GiB asked.
        let memory = DeviceMemory::new(GIB, 80 * GIB, Some(49 * GIB), Some(30 * GIB));
        let (backend, gpu) = device(48 * GIB, CacheFree::new(100 * MIB, 100 * MIB), memory);
        assert_eq!(verdict(&backend, gpu, 2 * GIB).0, Verdict::OtherProcesses);
        // More than the others hold would free: this process must shrink.
        assert_eq!(verdict(&backend, gpu, 40 * GIB).0, Verdict::NotEnoughFree);
    }

    #[test]
    fn not_enough_free_memory_otherwise() {
        let memory = DeviceMemory::new(GIB, 80 * GIB, Some(79 * GIB), Some(0));
        let (backend, gpu) = device(78 * GIB, CacheFree::new(64 * MIB, 64 * MIB), memory);
        assert_eq!(verdict(&backend, gpu, 4 * GIB).0, Verdict::NotEnoughFree);
        // Without driver figures the verdict still stands on the cache alone.
        let (backend, gpu) = device(GIB, CacheFree::default(), DeviceMemory::default());
        backend.clear_device_memory(gpu);
        let (v, figures) = verdict(&backend, gpu, 4 * GIB);
        assert_eq!((v, figures.device, figures.fragmentation_share()), (Verdict::NotEnoughFree, None, None));
        // Why the driver's figures are missing comes with them, from the one reading.
        let (figures, why) = MemoryFigures::read_explained(&backend, gpu, None).unwrap();
        assert_eq!(figures.device, None);
        assert!(why.is_some_and(|e| e.to_string().contains("cuda:0's driver is scripted unreadable")));
        let (_, why) = MemoryFigures::read_explained(&backend, Device::Cpu, None).unwrap();
        assert!(why.is_some(), "a device never scripted has no driver figures either");
    }
}
