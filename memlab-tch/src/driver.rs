//! Driver-level GPU figures, outside libtorch: free and total memory from the
//! CUDA driver (through `cudarc`, loading libcuda at run time) and this
//! process's own GPU memory from NVML (through `nvml-wrapper`). Both libraries
//! are loaded only when asked for, and on a machine without them every call
//! answers "no GPU" instead of failing hard.

use memlab_core::{Error, Result};

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

#[cfg(any(feature = "cuda-driver", feature = "nvml"))]
fn no_gpu(why: impl std::fmt::Display) -> Error {
    Error::DriverUnavailable(why.to_string())
}

/// The device asked for, if this process can use it: libtorch's count of CUDA
/// devices decides, as it does for every other memlab call.
#[cfg(any(feature = "cuda-driver", feature = "nvml"))]
fn usable(index: usize) -> Result<()> {
    let count = crate::cuda_device_count();
    if index < count {
        Ok(())
    } else {
        Err(Error::DeviceUnavailable { device: memlab_core::Device::Cuda(index), count })
    }
}

/// The error of a figure whose cargo feature this build left out.
#[cfg(not(all(feature = "cuda-driver", feature = "nvml")))]
fn feature_off(feature: &str, what: &str) -> Error {
    Error::DriverUnavailable(format!(
        "memlab was built without its `{feature}` feature, which reads {what}: enable the feature (it is on by default)"
    ))
}

/// Free and total memory of CUDA device `index`, from the driver.
///
/// Asks through the device's primary context, the one libtorch uses, and
/// leaves the calling thread's current context (libtorch's current device)
/// as it was. If libtorch has not touched the device yet, this creates the
/// context (which costs some hundreds of MiB of device memory).
///
/// Needs the `cuda-driver` feature (on by default); a build without it
/// returns [`Error::DriverUnavailable`] naming the feature.
pub fn driver_memory(index: usize) -> Result<DriverMemory> {
    #[cfg(feature = "cuda-driver")]
    return usable(index).and_then(|()| cuda::memory(index));
    #[cfg(not(feature = "cuda-driver"))]
    let _ = index;
    #[cfg(not(feature = "cuda-driver"))]
    Err(feature_off("cuda-driver", "the CUDA driver's free and total memory"))
}

/// GPU memory this process uses on device `index`, as NVML reports it (all of
/// it: libtorch's cache, the CUDA context, libraries' workspaces). `Ok(None)`
/// when NVML works but does not list this process (in a container whose
/// process ids it cannot see, say).
///
/// Needs the `nvml` feature (on by default); a build without it returns
/// [`Error::DriverUnavailable`] naming the feature.
pub fn process_gpu_memory(index: usize) -> Result<Option<u64>> {
    #[cfg(feature = "nvml")]
    return usable(index).and_then(|()| nvml::process_memory(index));
    #[cfg(not(feature = "nvml"))]
    let _ = index;
    #[cfg(not(feature = "nvml"))]
    Err(feature_off("nvml", "this process's GPU memory from NVML"))
}

/// The UUID of CUDA device `index` as `nvidia-smi -L` prints it
/// (`GPU-8c3f…`), from the driver: the same device has the same UUID in every
/// process, whatever `CUDA_VISIBLE_DEVICES` numbers it there.
///
/// Needs the `cuda-driver` feature (on by default); a build without it
/// returns [`Error::DriverUnavailable`] naming the feature.
pub fn device_uuid(index: usize) -> Result<String> {
    #[cfg(feature = "cuda-driver")]
    return usable(index).and_then(|()| cuda::uuid(index));
    #[cfg(not(feature = "cuda-driver"))]
    let _ = index;
    #[cfg(not(feature = "cuda-driver"))]
    Err(feature_off("cuda-driver", "the CUDA driver's device UUIDs"))
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of a UUID's 16 bytes.
#[cfg_attr(not(feature = "cuda-driver"), allow(dead_code))]
fn uuid_text(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// The CUDA driver through cudarc, loaded at run time (feature `cuda-driver`).
#[cfg(feature = "cuda-driver")]
mod cuda {
    use memlab_core::sync::LockExt;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::{Mutex, OnceLock};

    use cudarc::driver::{result, sys};
    use memlab_core::Result;

    use super::{no_gpu, DriverMemory};

    /// Whether the CUDA driver library can be loaded. cudarc panics when it
    /// cannot load it, and a panic would reach the user's panic hook even when
    /// caught, so memlab looks for the library itself first.
    fn driver_library_present() -> bool {
        ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
            let name = std::ffi::CString::new(*name).expect("no NUL in a library name");
            // SAFETY: dlopen with a valid C string; the handle is closed at once.
            unsafe {
                let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
                if handle.is_null() {
                    false
                } else {
                    libc::dlclose(handle);
                    true
                }
            }
        })
    }

    /// Loads libcuda and initialises the driver API once; the error says why
    /// there is no GPU.
    fn driver() -> Result<()> {
        static READY: OnceLock<std::result::Result<(), String>> = OnceLock::new();
        READY
            .get_or_init(|| {
                if !driver_library_present() {
                    return Err("the CUDA driver library (libcuda.so.1) is not installed".to_string());
                }
                match catch_unwind(result::init) {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("the CUDA driver did not initialise ({e})")),
                    Err(_) => Err("the CUDA driver library could not be loaded".to_string()),
                }
            })
            .clone()
            .map_err(no_gpu)
    }

    /// The primary context of each device memlab has asked about, retained once
    /// for the life of the process (libtorch uses the same contexts).
    fn primary_context(ordinal: i32) -> std::result::Result<sys::CUcontext, String> {
        /// A context handle; the driver's handles may be used from any thread.
        #[derive(Clone, Copy)]
        struct Ctx(sys::CUcontext);
        // SAFETY: a CUcontext is an opaque handle the driver accepts on every thread.
        unsafe impl Send for Ctx {}
        static CONTEXTS: Mutex<Vec<(i32, Ctx)>> = Mutex::new(Vec::new());
        let mut known = CONTEXTS.locked();
        if let Some((_, ctx)) = known.iter().find(|(o, _)| *o == ordinal) {
            return Ok(ctx.0);
        }
        let device = result::device::get(ordinal).map_err(|e| e.to_string())?;
        // SAFETY: `device` came from cuDeviceGet; retaining its primary context
        // touches no memory of ours.
        let ctx = unsafe { result::primary_ctx::retain(device) }.map_err(|e| e.to_string())?;
        known.push((ordinal, Ctx(ctx)));
        Ok(ctx)
    }

    pub(super) fn uuid(index: usize) -> Result<String> {
        driver()?;
        let run = || -> std::result::Result<String, String> {
            let ordinal = i32::try_from(index).map_err(|e| e.to_string())?;
            let device = result::device::get(ordinal).map_err(|e| e.to_string())?;
            let uuid = result::device::get_uuid(device).map_err(|e| e.to_string())?;
            Ok(super::uuid_text(uuid.bytes.map(|b| b as u8)))
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(uuid)) => Ok(uuid),
            Ok(Err(e)) => Err(no_gpu(format!("device {index}: {e}"))),
            Err(_) => Err(no_gpu("the CUDA driver library is missing a function memlab needs")),
        }
    }

    pub(super) fn memory(index: usize) -> Result<DriverMemory> {
        driver()?;
        let run = || -> std::result::Result<DriverMemory, String> {
            let ordinal = i32::try_from(index).map_err(|e| e.to_string())?;
            let ctx = primary_context(ordinal)?;
            let current = result::ctx::get_current().map_err(|e| e.to_string())?;
            let (free, total) = if current == Some(ctx) {
                result::mem_get_info().map_err(|e| e.to_string())?
            } else {
                // SAFETY: `ctx` is a retained primary context; it is pushed for
                // this one query and popped again, so the thread's own current
                // context comes back whatever the query answers.
                unsafe {
                    sys::cuCtxPushCurrent_v2(ctx).result().map_err(|e| e.to_string())?;
                    let info = result::mem_get_info();
                    let mut popped: sys::CUcontext = std::ptr::null_mut();
                    sys::cuCtxPopCurrent_v2(&mut popped).result().map_err(|e| e.to_string())?;
                    info.map_err(|e| e.to_string())?
                }
            };
            Ok(DriverMemory { free: free as u64, total: total as u64 })
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(m)) => Ok(m),
            Ok(Err(e)) => Err(no_gpu(format!("device {index}: {e}"))),
            Err(_) => Err(no_gpu("the CUDA driver library is missing a function memlab needs")),
        }
    }
}

/// NVML through nvml-wrapper, loaded at run time (feature `nvml`).
#[cfg(feature = "nvml")]
mod nvml {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::OnceLock;

    use memlab_core::Result;
    use nvml_wrapper::enums::device::UsedGpuMemory;
    use nvml_wrapper::Nvml;

    use super::no_gpu;

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

    pub(super) fn process_memory(index: usize) -> Result<Option<u64>> {
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
}

#[cfg(all(test, feature = "cuda-driver"))]
mod tests {
    use cudarc::driver::result;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn asking_the_driver_keeps_the_threads_context() {
        let answered = std::thread::spawn(|| {
            let memory = super::driver_memory(0).expect("a GPU");
            assert!(memory.total > 0 && memory.free <= memory.total);
            assert_eq!(result::ctx::get_current().unwrap(), None, "a thread without a context stays without one");
        });
        answered.join().unwrap();
    }
}

#[cfg(all(test, not(feature = "cuda-driver"), not(feature = "nvml")))]
mod without_features {
    #[test]
    fn figures_name_the_feature_they_need() {
        let driver = super::driver_memory(0).unwrap_err().to_string();
        assert!(driver.contains("without its `cuda-driver` feature"), "{driver}");
        let nvml = super::process_gpu_memory(0).unwrap_err().to_string();
        assert!(nvml.contains("without its `nvml` feature"), "{nvml}");
    }
}

/// The process's resident set in bytes, from `/proc/self/statm` (0 where
/// there is no such file).
pub fn resident_set() -> u64 {
    use std::sync::OnceLock;
    static PAGE: OnceLock<u64> = OnceLock::new();
    // SAFETY: sysconf only reads a configuration value.
    let page = *PAGE.get_or_init(|| u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096));
    // One descriptor kept open and read from offset 0 (procfs regenerates
    // the text) spares an open and a close per reading.
    static STATM: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let Some(file) = STATM.get_or_init(|| std::fs::File::open("/proc/self/statm").ok()) else { return 0 };
    let mut buf = [0u8; 128];
    let n = std::os::unix::fs::FileExt::read_at(file, &mut buf, 0).unwrap_or(0);
    std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |pages| pages * page)
}

/// The host's memory as the kernel counts it: what it could still give
/// (`MemAvailable`) and its total (`MemTotal`), in bytes, from
/// `/proc/meminfo`; `None` where there is no such file.
pub fn host_memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    };
    Some((field("MemAvailable:")?, field("MemTotal:")?))
}

/// When this process started, in seconds since the Unix epoch (from the
/// kernel: its start in clock ticks after boot, and the boot time); `None`
/// where `/proc` cannot tell.
pub fn process_start() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces: fields count from its ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&hz| hz > 0)?;
    Some(boot + ticks / hz)
}

/// The host's name (`gethostname`), or `None`.
pub fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned()).filter(|h| !h.is_empty())
}

/// This process's mapped address space (`VmSize`) and its limit (`ulimit
/// -v`, `RLIMIT_AS`; `None` when unlimited), in bytes. Read without
/// allocating: an out-of-memory handler reads it when memory has run out.
pub fn address_space() -> Option<(u64, Option<u64>)> {
    // SAFETY: getrlimit fills the struct; open, read and close work on a
    // descriptor of this function's and a buffer on its stack.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_AS, &mut limit) != 0 {
            return None;
        }
        let limit = (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u64);
        let fd = libc::open(c"/proc/self/statm".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return None;
        }
        let mut buf = [0u8; 128];
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        let text = &buf[..usize::try_from(n).ok()?];
        let digits = text.iter().take_while(|b| b.is_ascii_digit());
        let pages = digits.fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        let page = u64::try_from(libc::sysconf(libc::_SC_PAGESIZE)).unwrap_or(4096);
        Some((pages * page, limit))
    }
}

/// The memory use and limit of this process's cgroup (the tightest limit
/// among it and its ancestors: `memory.current` and `memory.max` in cgroup
/// v2, `memory.usage_in_bytes` and `memory.limit_in_bytes` in v1); `None`
/// without a limit, or where the files cannot be read. The kernel's
/// out-of-memory killer ends a process of a cgroup at its limit without a
/// failed request anyone could see.
pub fn cgroup_memory() -> Option<(u64, u64)> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_memory_at(std::path::Path::new("/sys/fs/cgroup"), &membership)
}

/// [`cgroup_memory`] of a process whose `/proc/self/cgroup` reads
/// `membership`, with the cgroup file systems mounted under `root`.
fn cgroup_memory_at(root: &std::path::Path, membership: &str) -> Option<(u64, u64)> {
    let read = |path: std::path::PathBuf| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    // (mount, the process's cgroup under it, the use file, the limit file)
    let mut places = Vec::new();
    for line in membership.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let path = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            places.push((root.to_path_buf(), path, "memory.current", "memory.max"));
            places.push((root.join("unified"), path, "memory.current", "memory.max"));
        } else if controllers.split(',').any(|c| c == "memory") {
            places.push((root.join("memory"), path, "memory.usage_in_bytes", "memory.limit_in_bytes"));
        }
    }
    // A v1 limit of "no limit" is a huge number: anything beyond the
    // machine's memory limits nothing.
    let unlimited = host_memory().map_or(u64::MAX, |(_, total)| total);
    let mut tightest: Option<(u64, u64)> = None;
    for (mount, path, usage, limit) in places {
        // The process's own cgroup and each ancestor up to the mount.
        let mut dir = mount.join(path);
        loop {
            if let (Some(max), Some(used)) = (read(dir.join(limit)), read(dir.join(usage))) {
                if max < unlimited && tightest.is_none_or(|(u, m)| max.saturating_sub(used) < m.saturating_sub(u)) {
                    tightest = Some((used, max));
                }
            }
            if dir == mount || !dir.pop() {
                break;
            }
        }
    }
    tightest
}

#[cfg(test)]
mod host_tests {
    #[test]
    fn uuids_print_as_nvidia_smi_does() {
        let bytes = [0x8c, 0x3f, 0x01, 0x02, 0xab, 0xcd, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x00, 0xff];
        assert_eq!(super::uuid_text(bytes), "GPU-8c3f0102-abcd-1234-5678-9abcdef000ff");
    }

    #[test]
    fn host_memory_is_read_from_the_kernel() {
        let (available, total) = super::host_memory().expect("Linux has /proc/meminfo");
        assert!(total > 0 && available <= total, "{available} of {total}");
    }

    #[test]
    fn the_process_started_before_now_and_the_host_has_a_name() {
        let start = super::process_start().expect("Linux has /proc/self/stat");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        // An independent reading: the kernel's own clock of this process's age is under an hour here.
        assert!(start <= now + 1 && now - start < 3600, "started at {start}, now {now}");
        assert!(super::host_name().is_some_and(|h| !h.is_empty()));
    }

    #[test]
    fn the_address_space_and_its_limit_are_read() {
        let (mapped, _) = super::address_space().expect("Linux has /proc/self/statm");
        // An independent reading: the kernel's VmSize line, in KiB.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        // Both readings of a live process: within 64 MiB of each other.
        assert!(mapped.abs_diff(kib * 1024) < 64 << 20, "{mapped} vs {} bytes", kib * 1024);
    }

    #[test]
    fn cgroup_limits_are_found_in_v1_and_v2_trees_and_the_tightest_wins() {
        let root = std::env::temp_dir().join(format!("memlab-cgroup-{}", std::process::id()));
        let write = |path: &str, text: &str| {
            let file = root.join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        };
        let gib = 1u64 << 30;
        // v2: the job's own cgroup has no limit; its parent allows 2 GiB, 1.5 GiB used.
        write("memory.max", "max\n");
        write("jobs/memory.max", &format!("{}\n", 2 * gib));
        write("jobs/memory.current", &format!("{}\n", 3 * gib / 2));
        write("jobs/42/memory.max", "max\n");
        write("jobs/42/memory.current", "1000\n");
        assert_eq!(super::cgroup_memory_at(&root, "0::/jobs/42\n"), Some((3 * gib / 2, 2 * gib)));
        // v1: 100 MiB of room beside v2's 512 MiB: the tighter one counts.
        write("memory/slurm/job1/memory.limit_in_bytes", &format!("{}", gib));
        write("memory/slurm/job1/memory.usage_in_bytes", &format!("{}", gib - (100 << 20)));
        let both = "4:memory:/slurm/job1\n0::/jobs/42\n";
        assert_eq!(super::cgroup_memory_at(&root, both), Some((gib - (100 << 20), gib)));
        // v1's "no limit" is a huge number, not a limit.
        write("memory/free/memory.limit_in_bytes", "9223372036854771712");
        write("memory/free/memory.usage_in_bytes", "5");
        assert_eq!(super::cgroup_memory_at(&root, "4:memory:/free\n"), None);
        assert_eq!(super::cgroup_memory_at(&root, "garbage"), None);
        std::fs::remove_dir_all(&root).ok();
    }
}
