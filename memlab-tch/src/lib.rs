//! memlab's libtorch backend, as torch-sys is tch's: exact allocator figures
//! for CPU tensors (through a counting allocator installed when the program
//! loads) and for CUDA devices (through libtorch's caching allocator), the
//! allocator hooks that feed memlab's event recorder, storage facts of `tch`
//! tensors, the weak registry of var stores and tensors, and the driver's and
//! NVML's figures. The tools built on it live in the `memlab` crate.
//!
//! Every call into libtorch goes through a C++ shim that catches every
//! exception and hands it back as [`memlab_core::Error`]; on a machine without
//! CUDA the CUDA calls return an error or report zero devices, never abort.
//!
//! ```
//! use memlab_core::Device;
//! use tch::{Kind, Tensor};
//!
//! let before = memlab_tch::device_stats(Device::Cpu)?.allocated_bytes.all.current;
//! let t = Tensor::zeros([256, 256], (Kind::Float, tch::Device::Cpu));
//! let after = memlab_tch::device_stats(Device::Cpu)?.allocated_bytes.all.current;
//! assert_eq!(after - before, 256 * 256 * 4);
//! assert_eq!(memlab_tch::storage_info(&t)?.nbytes, 256 * 256 * 4);
//! # Ok::<(), memlab_core::Error>(())
//! ```
#![deny(missing_docs)]

mod anchor;
mod driver;
mod events;
mod ffi;
pub mod libtorch_version;
pub mod oom;
pub mod ops;
pub mod optimizer;
pub mod registry;
pub mod sampler;
pub mod segments;
pub mod storage;

use std::sync::OnceLock;

use memlab_core::{Backend, Device, DeviceStats, Error, RawStats, Result};

// This crate's frames (Rust and the C++ shim) are memlab's, not the user's.
memlab_core::inventory::submit! { memlab_core::events::SourceRoot(env!("CARGO_MANIFEST_DIR")) }
// libtorch and the CUDA libraries of its wheel hold no frame of the user's:
// backtraces never read their (large) symbol tables.
memlab_core::inventory::submit! {
    memlab_core::events::ForeignLibraries(&[
        "libtorch", "libc10", "libshm", "libcaffe2", "libcuda.so", "libcudart", "libcublas", "libcudnn", "libcufft",
        "libcufile", "libcurand", "libcusolver", "libcusparse", "libcupti", "libnccl", "libnvrtc", "libnvJitLink",
        "libnvToolsExt", "libnvshmem", "libnvidia",
    ])
}

pub use anchor::{copies, ANCHOR};
pub use driver::{
    address_space, cgroup_memory, device_uuid, driver_memory, host_memory, host_name, process_gpu_memory,
    process_start, resident_set, DriverMemory,
};
pub use events::{testing as events_testing, Recording};
pub use registry::{clear_registry, register_tensor, register_var_store, WeakTensor};
pub use storage::{dtype, storage_info, StorageInfo, StorageLayout};

/// The libtorch backend of memlab's profiler.
#[derive(Debug, Default, Clone, Copy)]
pub struct TchBackend;

/// The one backend instance, for `&'static dyn Backend` users.
pub static BACKEND: TchBackend = TchBackend;

impl Backend for TchBackend {
    fn sample(&self, device: Device, out: &mut RawStats, reset_peaks: bool) -> Result<()> {
        let reset = i32::from(reset_peaks);
        match device {
            Device::Cpu => {
                // SAFETY: `out` holds the 122 fields; the shim writes the CPU
                // ones (CPU_FIELDS) and leaves the others as they are.
                let status = unsafe { ffi::memlab_cpu_stats(reset, out.0.as_mut_ptr()) };
                if status.is_null() {
                    return Ok(());
                }
                ffi::check(status).map_err(|e| Error::CpuAllocatorMissing(message_of(e)))
            }
            Device::Cuda(i) => {
                check_cuda_device(i)?;
                // SAFETY: as above.
                ffi::check(unsafe { ffi::memlab_cuda_stats(i as i64, reset, out.0.as_mut_ptr()) })
            }
        }
    }

    fn reset_totals(&self, device: Device, taken: &mut RawStats) -> Result<()> {
        match device {
            Device::Cpu => {
                // SAFETY: `taken` holds the 122 fields; the shim writes the CPU ones.
                let status = unsafe { ffi::memlab_cpu_take_accumulated_stats(taken.0.as_mut_ptr()) };
                ffi::check(status).map_err(|e| Error::CpuAllocatorMissing(message_of(e)))
            }
            Device::Cuda(i) => {
                check_cuda_device(i)?;
                // SAFETY: as above; the shim writes all 122.
                ffi::check(unsafe { ffi::memlab_cuda_take_accumulated_stats(i as i64, taken.0.as_mut_ptr()) })
            }
        }
    }

    fn fields(&self, device: Device) -> &'static [usize] {
        match device {
            Device::Cpu => &CPU_FIELDS,
            Device::Cuda(_) => &memlab_core::stats::ALL_FIELDS,
        }
    }

    fn peak_fields(&self, device: Device) -> &'static [usize] {
        match device {
            Device::Cpu => &CPU_PEAKS,
            Device::Cuda(_) => &memlab_core::profiler::PEAK_FIELDS,
        }
    }

    fn cuda_device_count(&self) -> usize {
        cuda_device_count()
    }

    fn current_cuda_device(&self) -> Result<usize> {
        let mut index = 0i64;
        // SAFETY: the shim writes one i64.
        ffi::check(unsafe { ffi::memlab_cuda_current_device(&mut index) })?;
        Ok(index as usize)
    }

    fn cache_free(
        &self,
        device: Device,
        serving: Option<memlab_core::oom::Serving>,
    ) -> Result<memlab_core::oom::CacheFree> {
        match device {
            Device::Cpu => Ok(memlab_core::oom::CacheFree::default()),
            Device::Cuda(i) => {
                check_cuda_device(i)?;
                oom::cuda_cache_free(i, serving)
            }
        }
    }

    fn device_memory(&self, device: Device) -> Result<memlab_core::oom::DeviceMemory> {
        oom::device_memory(device)
    }
}

/// The fields the counting CPU allocator fills: the `all` pool of the block
/// counts (allocation, segment, active) and of the byte counts (allocated,
/// reserved, active, requested bytes), the device alloc/free totals, and the
/// requests that failed.
static CPU_FIELDS: [usize; 31] = {
    let mut out = [0; 31];
    let arrays = [
        ffi::STAT_ALLOCATION,
        ffi::STAT_SEGMENT,
        ffi::STAT_ACTIVE,
        ffi::STAT_ALLOCATED_BYTES,
        ffi::STAT_RESERVED_BYTES,
        ffi::STAT_ACTIVE_BYTES,
        ffi::STAT_REQUESTED_BYTES,
    ];
    let mut a = 0;
    while a < arrays.len() {
        let mut c = 0;
        while c < 4 {
            out[a * 4 + c] = memlab_core::stats::array_index(arrays[a], 0, c);
            c += 1;
        }
        a += 1;
    }
    out[28] = ffi::SLOT_NUM_DEVICE_ALLOC;
    out[29] = ffi::SLOT_NUM_DEVICE_FREE;
    out[30] = ffi::SLOT_NUM_OOMS;
    out
};

/// The peak fields among [`CPU_FIELDS`].
static CPU_PEAKS: [usize; 7] = {
    let mut out = [0; 7];
    let mut k = 0;
    while k < 7 {
        out[k] = CPU_FIELDS[k * 4 + 1];
        k += 1;
    }
    out
};

/// The libtorch memlab was built against (`2.11.0`), as its headers said;
/// `unknown` in documentation builds, which have none.
pub fn libtorch_version() -> &'static str {
    option_env!("MEMLAB_LIBTORCH_VERSION").unwrap_or("unknown")
}

/// The tch release that binds [`libtorch_version()`] (`0.24`): torch-sys
/// refuses any other pairing unless its check is bypassed.
pub fn tch_release() -> &'static str {
    let mut parts = libtorch_version().split('.').map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next().flatten(), parts.next().flatten());
    let found = libtorch_version::SUPPORTED.iter().find(|((a, b), _)| Some(*a) == major && Some(*b) == minor);
    found.map_or("unknown", |(_, tch)| *tch)
}

fn message_of(e: Error) -> String {
    match e {
        Error::Backend(m) => m,
        other => other.to_string(),
    }
}

/// The number of CUDA devices this process can use; 0 on a machine without
/// CUDA or with a CPU-only libtorch. Read once, then cached.
pub fn cuda_device_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        // Touching the shim keeps libtorch_cuda linked (see memlab_built_with_cuda).
        // SAFETY: no arguments.
        if unsafe { ffi::memlab_built_with_cuda() } == 0 {
            return 0;
        }
        let mut n = 0i64;
        // SAFETY: the shim writes one i64.
        match ffi::check(unsafe { ffi::memlab_cuda_device_count(&mut n) }) {
            Ok(()) => n.max(0) as usize,
            Err(_) => 0,
        }
    })
}

/// The device memlab measures on this machine when told `auto`: the current
/// CUDA device when CUDA is available, else the CPU.
pub fn auto_device() -> Device {
    if cuda_is_available() {
        if let Ok(i) = BACKEND.current_cuda_device() {
            return Device::Cuda(i);
        }
    }
    Device::Cpu
}

/// memlab's name for a tch device (devices memlab does not measure map to the CPU).
pub fn device_of(device: tch::Device) -> Device {
    match device {
        tch::Device::Cuda(i) => Device::Cuda(i),
        _ => Device::Cpu,
    }
}

/// The gradient of `tensor`, if it has one. Only leaves (and tensors that
/// retain theirs) have a gradient field: asking any other tensor makes
/// libtorch print a warning every time.
pub fn grad_of(tensor: &tch::Tensor) -> Option<tch::Tensor> {
    storage::count_gradient_read();
    let has_field = tensor.f_is_leaf().unwrap_or(false) || tensor.f_retains_grad().unwrap_or(false);
    if !has_field {
        return None;
    }
    tensor.f_grad().ok().filter(tch::Tensor::defined)
}

/// tch's error as memlab's: the one place a `TchError` is converted. Its
/// message is libtorch's (or tch's), kept whole.
pub fn torch_error(e: tch::TchError) -> Error {
    Error::Backend(e.to_string())
}

/// Whether this process can use CUDA.
pub fn cuda_is_available() -> bool {
    cuda_device_count() > 0
}

/// Whether memlab was built against a libtorch with CUDA (and keeps its CUDA
/// library linked, so `tch::Cuda::is_available()` works without linker flags).
pub fn built_with_cuda() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::memlab_built_with_cuda() != 0 }
}

/// Whether memlab's CUDA parts (allocation events, the caching allocator's
/// snapshot, its out-of-memory observer) were compiled: they need the CUDA
/// runtime's headers beside libtorch's (scripts/env.sh installs them).
pub fn cuda_events_built() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::memlab_cuda_events_built() != 0 }
}

fn check_cuda_device(index: usize) -> Result<()> {
    let count = cuda_device_count();
    if index < count {
        Ok(())
    } else {
        Err(Error::DeviceUnavailable { device: Device::Cuda(index), count })
    }
}

/// Every allocator statistic of `device` (the set of `torch.cuda.memory_stats()`).
pub fn device_stats(device: Device) -> Result<DeviceStats> {
    raw_stats(device).map(|raw| raw.to_device_stats())
}

/// Every allocator statistic of `device` as a flat record (fields the device
/// does not have read zero).
///
/// Each `*.peak` is the highest level since the process started or since
/// your last [`reset_peak_stats`], whatever memlab's tools measured in
/// between: the profiler, the cell logger and the monitors reset the
/// allocator's peak counters to measure their spans (the only way libtorch
/// offers), and memlab keeps what they reset for these reads.
pub fn raw_stats(device: Device) -> Result<RawStats> {
    let mut raw = RawStats::default();
    memlab_core::profiler::read(&BACKEND, device, &mut raw)?;
    Ok(raw)
}

/// Sets every peak statistic of `device` to its current level.
///
/// Profiled lines running now keep the peaks they reached: memlab folds them
/// into its own records first.
pub fn reset_peak_stats(device: Device) -> Result<()> {
    memlab_core::profiler::reset_peaks(&BACKEND, device)
}

/// Sets the running totals (`*.allocated`, `*.freed`, `num_*`) of `device` to
/// zero. Profiled lines running now keep counting from where they were.
pub fn reset_accumulated_stats(device: Device) -> Result<()> {
    memlab_core::profiler::reset_totals(&BACKEND, device)
}

/// Returns the CUDA caching allocator's unused cached blocks to the device
/// (`torch.cuda.empty_cache()`). Does nothing without CUDA.
pub fn empty_cache() -> Result<()> {
    if !cuda_is_available() {
        return Ok(());
    }
    // SAFETY: no arguments.
    ffi::check(unsafe { ffi::memlab_cuda_empty_cache() })
}

/// Free and total memory of CUDA device `index` in bytes, as the driver reports it.
pub fn cuda_mem_info(index: usize) -> Result<(u64, u64)> {
    check_cuda_device(index)?;
    let (mut free, mut total) = (0u64, 0u64);
    // SAFETY: the shim writes two u64s.
    ffi::check(unsafe { ffi::memlab_cuda_mem_info(index as i64, &mut free, &mut total) })?;
    Ok((free, total))
}

/// The CUDA caching allocator's settings as libtorch holds them, with one
/// device's memory fraction and total memory: what a replay of a recording
/// needs to run the allocator as it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaAllocatorSettings {
    /// The settings string libtorch parsed last (`PYTORCH_ALLOC_CONF`, its
    /// older name `PYTORCH_CUDA_ALLOC_CONF`, or a change at run time).
    pub conf: String,
    /// `garbage_collection_threshold` (0: off).
    pub garbage_collection_threshold: f64,
    /// `max_split_size` in bytes (`u64::MAX`: unlimited).
    pub max_split_size: u64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `roundup_power2_divisions`, per power-of-two bucket from 1 MiB.
    pub roundup_power2_divisions: Vec<u64>,
    /// The device's memory fraction (1: none set).
    pub memory_fraction: f64,
    /// The device's total memory.
    pub total_memory: u64,
}

/// The CUDA caching allocator's settings and device `index`'s fraction and
/// memory; `None` while the allocator does not exist yet (nothing was
/// allocated on CUDA) or memlab was built without the CUDA runtime headers.
pub fn cuda_allocator_settings(index: usize) -> Result<Option<CudaAllocatorSettings>> {
    check_cuda_device(index)?;
    let mut initialized = 0i32;
    let mut raw = ffi::AllocatorSettings {
        conf: std::ptr::null_mut(),
        garbage_collection_threshold: 0.0,
        max_split_size: 0,
        expandable_segments: 0,
        division_count: 0,
        roundup_power2_divisions: [0; 64],
        memory_fraction: 1.0,
    };
    // SAFETY: the shim writes the flag and the struct; `conf`, when it is
    // set, is a malloc'd NUL-terminated string handed back to it below.
    ffi::check(unsafe { ffi::memlab_cuda_allocator_settings(index as i64, &mut initialized, &mut raw) })?;
    let conf = if raw.conf.is_null() {
        String::new()
    } else {
        // SAFETY: as above; read once, then freed by the shim.
        let text = unsafe { std::ffi::CStr::from_ptr(raw.conf) }.to_string_lossy().into_owned();
        unsafe { ffi::memlab_free_error(raw.conf) };
        text
    };
    if initialized == 0 {
        return Ok(None);
    }
    let (_, total_memory) = cuda_mem_info(index)?;
    let count = (raw.division_count.max(0) as usize).min(raw.roundup_power2_divisions.len());
    Ok(Some(CudaAllocatorSettings {
        conf,
        garbage_collection_threshold: raw.garbage_collection_threshold,
        max_split_size: raw.max_split_size,
        expandable_segments: raw.expandable_segments != 0,
        roundup_power2_divisions: raw.roundup_power2_divisions[..count].to_vec(),
        memory_fraction: raw.memory_fraction,
        total_memory,
    }))
}

/// Installs memlab's counting CPU allocator if it is not in place yet. It is
/// normally installed when the program loads; this matters only after
/// `MEMLAB_CPU_ALLOCATOR=0`. Tensors allocated before it was installed are not
/// counted, neither when made nor when freed.
pub fn install_cpu_allocator() -> Result<()> {
    // SAFETY: no arguments.
    ffi::check(unsafe { ffi::memlab_cpu_install() }).map_err(|e| Error::CpuAllocatorMissing(message_of(e)))
}

/// Whether CPU figures are available (the counting allocator is in place).
pub fn cpu_allocator_installed() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::memlab_cpu_installed() != 0 }
}

/// Whether the counting CPU allocator was installed when the program loaded,
/// before any tensor existed, so that it counts every CPU tensor.
pub fn cpu_allocator_installed_at_load() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::memlab_cpu_installed_at_load() != 0 }
}

#[cfg(test)]
mod build_tests {
    #[test]
    fn the_cuda_parts_compiled_against_this_libtorch() {
        // Both supported PyPI torches carry CUDA, and scripts/env.sh adds the
        // runtime headers: the CUDA parts must have compiled against them.
        assert!(super::built_with_cuda(), "libtorch {} has CUDA", super::libtorch_version());
        assert!(super::cuda_events_built(), "the CUDA parts compiled against libtorch {}", super::libtorch_version());
    }
}
