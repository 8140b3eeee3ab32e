//! Driver-level GPU figures, outside libtorch: free and total memory from the
//! CUDA driver (through `cudarc`, loading libcuda at run time) and this
//! process's own GPU memory from NVML (through `nvml-wrapper`). Both libraries
//! are loaded only when asked for, and on a machine without them every call
//! answers "no GPU" instead of failing hard.

use std::cell::RefCell;
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::{result, sys};
use memlab_core::{Error, Result};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

/// Free and total memory of a device, as the driver counts it (every
/// process's allocations and every context included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverMemory {
    /// Bytes free on the device.
    pub free: u64,
    /// Bytes the device has.
    pub total: u64,
}

impl DriverMemory {
    /// Bytes in use by all processes.
    pub fn used(&self) -> u64 {
        self.total - self.free
    }
}

fn no_gpu(why: impl std::fmt::Display) -> Error {
    Error::Torch(format!("no GPU: {why}"))
}

/// Loads libcuda and initialises the driver API once; the error says why
/// there is no GPU.
fn driver() -> Result<()> {
    static READY: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| match catch_unwind(result::init) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("the CUDA driver did not initialise ({e})")),
            Err(_) => Err("the CUDA driver library (libcuda) is not installed".to_string()),
        })
        .clone()
        .map_err(no_gpu)
}

thread_local! {
    /// Devices whose primary context this thread has made current.
    static CONTEXTS: RefCell<HashSet<usize>> = RefCell::new(HashSet::new());
}

/// Free and total memory of CUDA device `index`, from the driver.
///
/// Uses the device's primary context, the one libtorch uses: if libtorch has
/// not touched the device yet, this creates it (the CUDA context costs some hundreds of MiB of device memory).
pub fn driver_memory(index: usize) -> Result<DriverMemory> {
    driver()?;
    let run = || -> std::result::Result<DriverMemory, String> {
        let ordinal = i32::try_from(index).map_err(|e| e.to_string())?;
        let fresh = CONTEXTS.with(|c| !c.borrow().contains(&index));
        if fresh {
            let device = result::device::get(ordinal).map_err(|e| e.to_string())?;
            // SAFETY: `device` came from cuDeviceGet; retaining its primary
            // context and making it current touches no memory of ours.
            unsafe {
                let ctx: sys::CUcontext = result::primary_ctx::retain(device).map_err(|e| e.to_string())?;
                result::ctx::set_current(ctx).map_err(|e| e.to_string())?;
            }
            CONTEXTS.with(|c| c.borrow_mut().insert(index));
        }
        let (free, total) = result::mem_get_info().map_err(|e| e.to_string())?;
        Ok(DriverMemory { free: free as u64, total: total as u64 })
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(no_gpu(format!("device {index}: {e}"))),
        Err(_) => Err(no_gpu("the CUDA driver library is missing a function memlab needs")),
    }
}

fn nvml() -> std::result::Result<&'static Nvml, String> {
    static NVML: OnceLock<std::result::Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| match catch_unwind(Nvml::init) {
        Ok(Ok(nvml)) => Ok(nvml),
        Ok(Err(e)) => Err(format!("NVML is not available ({e})")),
        Err(_) => Err("NVML could not be loaded".to_string()),
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// GPU memory this process uses on device `index`, as NVML reports it (all of
/// it: libtorch's cache, the CUDA context, libraries' workspaces). `Ok(None)`
/// when NVML works but does not list this process (in a container whose
/// process ids it cannot see, say).
pub fn process_gpu_memory(index: usize) -> Result<Option<u64>> {
    let nvml = nvml().map_err(no_gpu)?;
    let run = || -> std::result::Result<Option<u64>, String> {
        let device = nvml.device_by_index(index as u32).map_err(|e| e.to_string())?;
        let pid = std::process::id();
        let processes = device.running_compute_processes().map_err(|e| e.to_string())?;
        Ok(processes.into_iter().find(|p| p.pid == pid).and_then(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Some(bytes),
            UsedGpuMemory::Unavailable => None,
        }))
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r.map_err(|e| no_gpu(format!("NVML, device {index}: {e}"))),
        Err(_) => Err(no_gpu("NVML failed")),
    }
}
