//! The shim's C API. Functions returning `*mut c_char` return null on success
//! or an error message to be freed with `memlab_free_error`.

use std::ffi::{c_char, c_void};

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct StorageInfo {
    pub storage_id: u64,
    pub data_ptr: u64,
    pub nbytes: i64,
    pub numel: i64,
    pub element_size: i64,
    pub device_type: i32,
    pub device_index: i32,
    pub layout: i32,
    pub has_storage: i32,
    pub from_allocator: i32,
    pub reserved: i32,
}

/// The shim's event hook: action code, device (-1 = CPU), address, size.
pub type EventHook = extern "C" fn(action: i32, device: i32, address: u64, size: u64);

/// The most dimensions `TensorFacts` carries.
pub const MAX_DIMS: usize = 16;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct TensorFacts {
    pub storage: StorageInfo,
    pub dtype: i32,
    pub ndim: i32,
    pub dims: [i64; MAX_DIMS],
}

extern "C" {
    pub fn memlab_tensor_facts(tensor: *const c_void, out: *mut TensorFacts, grad: *mut TensorFacts) -> *mut c_char;
    pub fn memlab_set_cpu_event_hook(hook: Option<EventHook>);
    pub fn memlab_cuda_set_event_hook(hook: Option<EventHook>) -> *mut c_char;
    pub fn memlab_free_error(error: *mut c_char);
    pub fn memlab_built_with_cuda() -> i32;
    pub fn memlab_cuda_device_count(out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_current_device(out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_stats(device: i64, reset_peaks: i32, out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_take_accumulated_stats(device: i64, out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_empty_cache() -> *mut c_char;
    pub fn memlab_cuda_mem_info(device: i64, free: *mut u64, total: *mut u64) -> *mut c_char;
    pub fn memlab_cpu_install() -> *mut c_char;
    pub fn memlab_cpu_installed() -> i32;
    pub fn memlab_cpu_installed_at_load() -> i32;
    pub fn memlab_cpu_stats(reset_peaks: i32, out: *mut i64) -> *mut c_char;
    pub fn memlab_cpu_take_accumulated_stats(out: *mut i64) -> *mut c_char;
    pub fn memlab_weak_tensor_new(tensor: *const c_void, out: *mut *mut c_void) -> *mut c_char;
    pub fn memlab_weak_tensor_lock(weak: *mut c_void) -> *mut c_void;
    pub fn memlab_weak_tensor_expired(weak: *mut c_void) -> i32;
    pub fn memlab_weak_tensor_free(weak: *mut c_void);
    pub fn memlab_tensor_storage(tensor: *const c_void, out: *mut StorageInfo) -> *mut c_char;
}

/// Turns a shim status into a `Result`, freeing the message.
pub fn check(status: *mut c_char) -> memlab_core::Result<()> {
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string malloc'd by the
    // shim, read once here and then handed back to it to free.
    let message = unsafe { std::ffi::CStr::from_ptr(status) }.to_string_lossy().into_owned();
    unsafe { memlab_free_error(status) };
    Err(memlab_core::Error::Backend(message))
}
