//! A plugin that links memlab statically, for `tests/copies_cpu.rs`: the test
//! loads several copies of it, and of its twin (the same source built as
//! another crate), into one process with `dlopen`, and drives memlab through
//! each copy by these C functions. Nothing unwinds out of them: a panic
//! becomes the fallback value.

use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, UnwindSafe};

use memlab::Device;
use tch::{Kind, Tensor};

fn guard<T>(fallback: T, f: impl FnOnce() -> T + UnwindSafe) -> T {
    catch_unwind(f).unwrap_or(fallback)
}

fn c_string(text: String) -> *mut c_char {
    CString::new(text).map_or(std::ptr::null_mut(), CString::into_raw)
}

/// Frees a string this plugin returned.
///
/// # Safety
/// `text` came from this plugin's `c_string`, or is null.
#[no_mangle]
pub unsafe extern "C" fn plugin_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: the caller passes a string of `c_string`'s.
        drop(unsafe { CString::from_raw(text) });
    }
}

/// How many copies of memlab share the process's state, as this copy sees it.
#[no_mangle]
pub extern "C" fn plugin_copies() -> u32 {
    guard(0, memlab::run::copies)
}

/// Whether the counting CPU allocator went in when the process loaded memlab.
#[no_mangle]
pub extern "C" fn plugin_installed_at_load() -> i32 {
    guard(-1, || i32::from(memlab::stats::cpu_allocator_installed_at_load()))
}

/// The CPU's allocated bytes as this copy reads them (-1: an error).
#[no_mangle]
pub extern "C" fn plugin_cpu_allocated() -> i64 {
    guard(-1, || memlab::stats::device_stats(Device::Cpu).map_or(-1, |s| s.allocated_bytes.all.current))
}

/// A CPU tensor of `bytes` bytes, made by this copy's code.
#[no_mangle]
pub extern "C" fn plugin_tensor_new(bytes: i64) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        Box::into_raw(Box::new(Tensor::zeros([bytes], (Kind::Uint8, tch::Device::Cpu)))) as *mut c_void
    })
}

/// Drops a tensor made by any copy.
///
/// # Safety
/// `tensor` came from `plugin_tensor_new` of any copy and is dropped once.
#[no_mangle]
pub unsafe extern "C" fn plugin_tensor_free(tensor: *mut c_void) {
    // SAFETY: the caller passes a boxed tensor; every copy builds Tensor
    // from the same tch.
    let _ = catch_unwind(|| drop(unsafe { Box::from_raw(tensor as *mut Tensor) }));
}

#[memlab::profile(device = "cpu")]
fn work(bytes: i64) -> i64 {
    let kept = Tensor::zeros([bytes], (Kind::Uint8, tch::Device::Cpu));
    kept.numel() as i64
}

/// Calls this copy's profiled `work`, which holds `bytes` bytes on one line.
#[no_mangle]
pub extern "C" fn plugin_work(bytes: i64) -> i64 {
    guard(-1, || work(bytes))
}

/// The line profile of every profiled function, as JSON, as this copy sees it.
#[no_mangle]
pub extern "C" fn plugin_report() -> *mut c_char {
    guard(std::ptr::null_mut(), || c_string(memlab::Render::to_json(&memlab::profiler::Report::collect())))
}

/// Starts a recording, with backtraces if `backtraces` is not 0 (a boxed
/// `Recording`; null on an error).
#[no_mangle]
pub extern "C" fn plugin_record_start(backtraces: i32) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        memlab::Recording::start(memlab::events::Settings::default().backtraces(backtraces != 0))
            .map_or(std::ptr::null_mut(), |r| Box::into_raw(Box::new(r)) as *mut c_void)
    })
}

/// Ends a recording started by any copy.
///
/// # Safety
/// `recording` came from `plugin_record_start` of any copy, once.
#[no_mangle]
pub unsafe extern "C" fn plugin_record_stop(recording: *mut c_void) {
    // SAFETY: the caller passes a boxed recording.
    let _ = catch_unwind(|| drop(unsafe { Box::from_raw(recording as *mut memlab::Recording) }));
}

/// The recorded CPU allocations of `bytes` bytes, as JSON: each one's
/// profiled statement's function (null when none ran).
#[no_mangle]
pub extern "C" fn plugin_allocations_of(bytes: u64) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let (events, _) = memlab::events::history();
        let found: Vec<Option<&str>> = events
            .iter()
            .filter(|e| e.device == Device::Cpu && e.action == memlab::events::Action::Alloc && e.size == bytes)
            .map(|e| e.statement.as_ref().map(|s| s.function()))
            .collect();
        c_string(serde_json::to_string(&found).unwrap_or_default())
    })
}

/// The recorded CPU allocations of `bytes` bytes, as JSON: each one's
/// backtrace, as the functions of its user frames, innermost first.
#[no_mangle]
pub extern "C" fn plugin_frames_of(bytes: u64) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let (events, _) = memlab::events::history();
        let found: Vec<Vec<String>> = events
            .iter()
            .filter(|e| e.device == Device::Cpu && e.action == memlab::events::Action::Alloc && e.size == bytes)
            .map(|e| {
                e.backtrace.as_ref().map_or_else(Vec::new, |b| b.frames().iter().map(|f| f.function.clone()).collect())
            })
            .collect();
        c_string(serde_json::to_string(&found).unwrap_or_default())
    })
}

/// Arms the OOM recorder on `dir` (0: armed).
///
/// # Safety
/// `dir` is a NUL-terminated path.
#[no_mangle]
pub unsafe extern "C" fn plugin_oom_arm(dir: *const c_char) -> i32 {
    // SAFETY: the caller passes a C string.
    let dir = unsafe { CStr::from_ptr(dir) }.to_string_lossy().into_owned();
    guard(-1, || match memlab::OomRecorder::new(dir).arm() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("arming the OOM recorder: {e}");
            1
        }
    })
}

/// Asks for 2^48 bytes of CPU memory, which fails (1: it failed as it should).
#[no_mangle]
pub extern "C" fn plugin_oom_fail() -> i32 {
    guard(-1, || i32::from(Tensor::f_empty([1i64 << 46], (Kind::Float, tch::Device::Cpu)).is_err()))
}

/// What this copy's output sink received (see `plugin_sink_set`).
static SUNK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sends memlab's reports to a sink of this copy's code, which counts the
/// bytes it receives; returns 0.
#[no_mangle]
pub extern "C" fn plugin_sink_set() -> i32 {
    guard(-1, || {
        memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|text| {
            SUNK.fetch_add(text.len(), std::sync::atomic::Ordering::Relaxed);
        })));
        0
    })
}

/// Sends memlab's reports to standard output again; returns 0.
#[no_mangle]
pub extern "C" fn plugin_sink_unset() -> i32 {
    guard(-1, || {
        memlab::profiler::set_output(memlab::profiler::Output::Stdout);
        0
    })
}

#[memlab::profile_every(1, device = "cpu")]
fn printed(bytes: i64) -> i64 {
    let kept = Tensor::zeros([bytes], (Kind::Uint8, tch::Device::Cpu));
    kept.numel() as i64
}

/// Calls a function that prints its line profile after every call, to the
/// output memlab's reports go to.
#[no_mangle]
pub extern "C" fn plugin_printed(bytes: i64) -> i64 {
    guard(-1, || printed(bytes))
}

/// Whether this copy takes a tensor made by any copy for one of the
/// counting allocator's (1) or not (0); -1: an error.
///
/// # Safety
/// `tensor` came from `plugin_tensor_new` of any copy and is alive.
#[no_mangle]
pub unsafe extern "C" fn plugin_from_allocator(tensor: *const c_void) -> i32 {
    // SAFETY: the caller passes a live boxed tensor; every copy builds
    // Tensor from the same tch.
    let tensor = unsafe { &*(tensor as *const Tensor) };
    guard(-1, || memlab::stats::storage_info(tensor).map_or(-1, |s| i32::from(s.from_allocator)))
}

/// This copy's reporter over a var store of its own with `bytes` bytes of
/// weights, as JSON: the CPU section's named and external bytes.
#[no_mangle]
pub extern "C" fn plugin_reported(bytes: i64) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _weight = vs.root().zeros("weight", &[bytes / 4]);
        let report = memlab::MemReporter::new(&vs).report().expect("the report");
        let cpu = report.device(Device::Cpu).expect("a CPU section");
        c_string(serde_json::json!({"named": cpu.named_bytes, "external": cpu.external_bytes}).to_string())
    })
}
