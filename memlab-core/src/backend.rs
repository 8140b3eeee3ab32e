//! The seam between the backend-free engine and an allocator: a backend reads a
//! device's figures and resets its peaks. The libtorch backend implements it
//! outside this crate; tests use the scripted one below.

use crate::device::Device;
use crate::error::Result;
use crate::stats::RawStats;
use crate::sync::LockExt;

/// A source of allocator statistics.
pub trait Backend: Send + Sync {
    /// Fills `out` with every figure of `device` and, when `reset_peaks` is true,
    /// sets each peak to its current level right after reading it.
    ///
    /// A device whose allocator has not been used yet reads as all zeros.
    fn sample(&self, device: Device, out: &mut RawStats, reset_peaks: bool) -> Result<()>;

    /// Sets the running totals (`*.allocated`, `*.freed`, `num_*`) of `device`
    /// to zero, writing into `taken` the values they had when they were reset.
    fn reset_totals(&self, device: Device, taken: &mut RawStats) -> Result<()>;

    /// The fields of [`RawStats`] that `sample` fills for `device`; the others
    /// always read zero there, and the profiler skips them.
    fn fields(&self, device: Device) -> &'static [usize] {
        let _ = device;
        &crate::stats::ALL_FIELDS
    }

    /// The peak fields among [`Backend::fields`].
    fn peak_fields(&self, device: Device) -> &'static [usize] {
        let _ = device;
        &crate::stats::PEAK_FIELDS
    }

    /// The number of CUDA devices this process can use (0 without CUDA).
    fn cuda_device_count(&self) -> usize;

    /// The calling thread's current CUDA device.
    fn current_cuda_device(&self) -> Result<usize>;

    /// The free blocks of `device`'s cache (none where the allocator keeps
    /// no cache, as on the CPU); with `serving`, only those that could serve
    /// such a request.
    fn cache_free(&self, device: Device, serving: Option<Serving>) -> Result<CacheFree> {
        let _ = (device, serving);
        Ok(CacheFree::default())
    }

    /// `device`'s memory as its driver (or, for the CPU, the kernel) counts
    /// it; the error says why it cannot be read.
    fn device_memory(&self, device: Device) -> Result<DeviceMemory> {
        Err(crate::error::Error::DriverUnavailable(format!("this backend does not read {device}'s driver")))
    }
}

/// What a request could be served from: a caching allocator gives a request
/// only free blocks of its own stream and of its pool (CUDA: blocks of at
/// most 1 MiB for small requests, larger ones for the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Serving {
    /// The stream the request was for.
    pub stream: u64,
    /// Whether it is served from the pool of large blocks.
    pub large: bool,
}

/// The free blocks of a device's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct CacheFree {
    /// Bytes of the cache's free (inactive) blocks.
    pub bytes: u64,
    /// The largest of them: the largest request the cache can serve without
    /// obtaining more memory from the device.
    pub largest_block: u64,
}

impl CacheFree {
    /// The cache's free blocks: their bytes and the largest.
    pub fn new(bytes: u64, largest_block: u64) -> CacheFree {
        CacheFree { bytes, largest_block }
    }
}

/// A device's memory as its driver (or, for the CPU, the kernel) counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeviceMemory {
    /// Free bytes: what this process could still obtain.
    pub free: u64,
    /// All bytes: what this process may use at most.
    pub total: u64,
    /// This process's use, when known (CUDA: NVML; the CPU: the resident set).
    pub this_process: Option<u64>,
    /// Other processes' use, when known (CUDA: NVML).
    pub other_processes: Option<u64>,
    /// The limit that `free` and `total` come from, when one is tighter
    /// than the device's memory (the host's, or CUDA's memory fraction).
    pub limit: Option<HostLimit>,
}

impl DeviceMemory {
    /// Free and total bytes, with what this process and the others use when known.
    pub fn new(free: u64, total: u64, this_process: Option<u64>, other_processes: Option<u64>) -> DeviceMemory {
        DeviceMemory { free, total, this_process, other_processes, limit: None }
    }

    /// The same figures, as `limit` leaves them.
    pub fn limited_by(mut self, limit: Option<HostLimit>) -> DeviceMemory {
        self.limit = limit;
        self
    }
}

/// A limit on what a process may use of a device's memory, tighter than the
/// device: the host's (address space, cgroup), or CUDA's memory fraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLimit {
    /// The address-space limit (`ulimit -v`, `RLIMIT_AS`): free is the
    /// limit minus the process's mapped address space. A request beyond it
    /// fails, and the failure can be reported.
    AddressSpace,
    /// The cgroup's memory limit (`memory.max`): free is the limit minus the
    /// cgroup's use. At the limit the kernel's out-of-memory killer ends a
    /// process without a failed request: no report can be written then.
    Cgroup,
    /// CUDA: the caching allocator's memory fraction
    /// (`set_per_process_memory_fraction`, or `per_process_memory_fraction`
    /// in `PYTORCH_CUDA_ALLOC_CONF`): free is the fraction's bytes minus
    /// what the allocator holds, or the driver's free where that is less. A
    /// request beyond it fails, and the failure can be reported.
    MemoryFraction,
}

impl HostLimit {
    /// How a report names it.
    pub fn describe(self) -> &'static str {
        match self {
            HostLimit::AddressSpace => "the address-space limit (ulimit -v)",
            HostLimit::Cgroup => "the cgroup's memory limit (memory.max)",
            HostLimit::MemoryFraction => "the CUDA memory fraction",
        }
    }
}

/// A backend whose figures a test writes: [`alloc`](Self::alloc) and
/// [`free`](Self::free) move the level of a device the way an allocator
/// without a cache would (allocated, reserved, active and requested bytes
/// alike, one block each), with peaks and running totals kept as libtorch's
/// allocators keep them. It lets the profiler's engine (nested peaks, line
/// records, resets) be tested without libtorch.
#[derive(Debug)]
pub struct ScriptedBackend {
    cuda_devices: usize,
    figures: std::sync::Mutex<Vec<Scripted>>,
    /// Per device: its cache's free blocks and its driver's figures.
    memory: std::sync::Mutex<Vec<(Device, CacheFree, Option<DeviceMemory>)>>,
}

/// One device's scripted figures: bytes, then blocks, each as (current, peak,
/// allocated, freed).
type Scripted = (Device, [i64; 4], [i64; 4]);

impl ScriptedBackend {
    /// A backend that reports `cuda_devices` CUDA devices (all scripted) and the CPU.
    pub const fn new(cuda_devices: usize) -> ScriptedBackend {
        ScriptedBackend {
            cuda_devices,
            figures: std::sync::Mutex::new(Vec::new()),
            memory: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn with_memory<R>(&self, device: Device, f: impl FnOnce(&mut CacheFree, &mut Option<DeviceMemory>) -> R) -> R {
        let mut all = self.memory.locked();
        let at = match all.iter().position(|(d, _, _)| *d == device) {
            Some(at) => at,
            None => {
                all.push((device, CacheFree::default(), None));
                all.len() - 1
            }
        };
        let (_, cache, memory) = &mut all[at];
        f(cache, memory)
    }

    /// Scripts the free blocks of `device`'s cache.
    pub fn set_cache_free(&self, device: Device, cache: CacheFree) {
        self.with_memory(device, |c, _| *c = cache);
    }

    /// Scripts `device`'s driver figures.
    pub fn set_device_memory(&self, device: Device, memory: DeviceMemory) {
        self.with_memory(device, |_, m| *m = Some(memory));
    }

    /// `device`'s driver cannot be read.
    pub fn clear_device_memory(&self, device: Device) {
        self.with_memory(device, |_, m| *m = None);
    }

    fn with<R>(&self, device: Device, f: impl FnOnce(&mut [i64; 4], &mut [i64; 4]) -> R) -> R {
        let mut all = self.figures.locked();
        let at = match all.iter().position(|(d, _, _)| *d == device) {
            Some(at) => at,
            None => {
                all.push((device, [0; 4], [0; 4]));
                all.len() - 1
            }
        };
        let (_, bytes, blocks) = &mut all[at];
        f(bytes, blocks)
    }

    /// One block of `bytes` allocated on `device`.
    pub fn alloc(&self, device: Device, bytes: i64) {
        self.with(device, |b, n| {
            for (c, amount) in [(b, bytes), (n, 1)] {
                c[0] += amount;
                c[1] = c[1].max(c[0]);
                c[2] += amount;
            }
        });
    }

    /// One block of `bytes` freed on `device`.
    pub fn free(&self, device: Device, bytes: i64) {
        self.with(device, |b, n| {
            for (c, amount) in [(b, bytes), (n, 1)] {
                c[0] -= amount;
                c[3] += amount;
            }
        });
    }
}

impl Backend for ScriptedBackend {
    fn sample(&self, device: Device, out: &mut RawStats, reset_peaks: bool) -> Result<()> {
        // The four counters (current, peak, allocated, freed) of a stat's
        // `all` pool follow each other, from its `current` field on.
        let all = |stat: &str| crate::stats::field_index(&format!("{stat}.all.current")).expect("a memory_stats() key");
        self.with(device, |bytes, blocks| {
            for stat in ["allocation", "segment", "active"] {
                out.0[all(stat)..all(stat) + 4].copy_from_slice(blocks);
            }
            for stat in ["allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"] {
                out.0[all(stat)..all(stat) + 4].copy_from_slice(bytes);
            }
            if reset_peaks {
                bytes[1] = bytes[0];
                blocks[1] = blocks[0];
            }
        });
        Ok(())
    }

    fn reset_totals(&self, device: Device, taken: &mut RawStats) -> Result<()> {
        self.sample(device, taken, false)?;
        self.with(device, |bytes, blocks| {
            for c in [bytes, blocks] {
                c[2] = 0;
                c[3] = 0;
            }
        });
        Ok(())
    }

    fn cuda_device_count(&self) -> usize {
        self.cuda_devices
    }

    fn current_cuda_device(&self) -> Result<usize> {
        if self.cuda_devices == 0 {
            return Err(crate::error::Error::DeviceUnavailable { device: Device::Cuda(0), count: 0 });
        }
        Ok(0)
    }

    fn cache_free(&self, device: Device, serving: Option<Serving>) -> Result<CacheFree> {
        let _ = serving;
        Ok(self.with_memory(device, |c, _| *c))
    }

    fn device_memory(&self, device: Device) -> Result<DeviceMemory> {
        let scripted = self.with_memory(device, |_, m| *m);
        scripted
            .ok_or_else(|| crate::error::Error::DriverUnavailable(format!("{device}'s driver is scripted unreadable")))
    }
}
