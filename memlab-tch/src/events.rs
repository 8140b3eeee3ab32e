//! Connects memlab's event recorder to libtorch: the counting CPU allocator's
//! hook and, on CUDA machines, a trace tracker on the caching allocator.

use memlab_core::events::{self, Action, Settings};
use memlab_core::{Device, Result};

use crate::ffi;

/// Keeps allocation events recorded while it lives (several may live at
/// once: recording stops when the last one is dropped). Bind it to a named
/// variable (`let _recording = …`), not to `_`, which drops it at once.
///
/// ```
/// let recording = memlab_tch::Recording::start(memlab_core::events::Settings::default())?;
/// let t = tch::Tensor::zeros([256], (tch::Kind::Float, tch::Device::Cpu));
/// let live = memlab_core::events::live();
/// assert!(live.iter().any(|a| a.size == 1024));
/// drop((t, recording));
/// # Ok::<(), memlab_core::Error>(())
/// ```
#[must_use = "recording stops when the Recording is dropped"]
#[derive(Debug)]
pub struct Recording {
    _private: (),
}

impl Recording {
    /// Applies `settings` and starts recording (or joins a recording already on).
    ///
    /// On a CUDA machine this attaches memlab's tracker to the caching
    /// allocator, creating it with a first (1-element) CUDA allocation if no
    /// CUDA memory was allocated yet.
    pub fn start(settings: Settings) -> Result<Recording> {
        events::settings(settings);
        acquire()?;
        Ok(Recording { _private: () })
    }
}

impl Recording {
    /// Joins the recording, or starts one with the current settings, without
    /// changing them (for memlab's own tools).
    pub(crate) fn join() -> Result<Recording> {
        acquire()?;
        Ok(Recording { _private: () })
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        release();
    }
}

/// Adds a user of the recorder, turning the hooks on for the first one.
pub(crate) fn acquire() -> Result<()> {
    if events::retain() {
        // SAFETY: `on_event` is an `extern "C"` function that never unwinds.
        unsafe { ffi::memlab_set_cpu_event_hook(Some(on_event)) };
        if crate::cuda_is_available() {
            // SAFETY: as above.
            if let Err(e) = ffi::check(unsafe { ffi::memlab_cuda_set_event_hook(Some(on_event)) }) {
                release();
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Removes a user; the last one turns the hooks off.
pub(crate) fn release() {
    if events::release() {
        // SAFETY: clearing a hook is always allowed.
        unsafe { ffi::memlab_set_cpu_event_hook(None) };
        if crate::cuda_is_available() {
            // SAFETY: as above; clearing cannot fail.
            let _ = ffi::check(unsafe { ffi::memlab_cuda_set_event_hook(None) });
        }
    }
}

/// The hook the shim calls for every event. Runs inside libtorch's allocator
/// (on CUDA under its lock): it only records, and never unwinds.
extern "C" fn on_event(action: i32, device: i32, address: u64, size: u64) {
    let action = match action {
        0 => Action::Alloc,
        1 => Action::FreeRequested,
        2 => Action::FreeCompleted,
        3 => Action::SegmentAlloc,
        4 => Action::SegmentFree,
        5 => Action::Oom,
        _ => return,
    };
    let device = if device < 0 { Device::Cpu } else { Device::Cuda(device as usize) };
    let _ = std::panic::catch_unwind(|| events::record(device, action, address, size));
}
