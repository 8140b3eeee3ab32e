//! Connects memlab's event recorder to libtorch: the counting CPU allocator's
//! hook and, on CUDA machines, a trace tracker on the caching allocator.

use memlab_core::sync::LockExt;
use std::sync::{Mutex, MutexGuard};

use memlab_core::events::{self, Action, Settings};
use memlab_core::{Device, Result};

use crate::ffi;

/// Keeps allocation events recorded while it lives (several may live at
/// once: recording stops when the last one is dropped). Bind it to a named
/// variable (`let _recording = …`), not to `_`, which drops it at once.
///
/// ```
/// # mod memlab {
/// #     pub use memlab_core::{events, Error};
/// #     pub use memlab_tch::Recording;
/// # }
/// let recording = memlab::Recording::start(memlab::events::Settings::default())?;
/// let t = tch::Tensor::zeros([256], (tch::Kind::Float, tch::Device::Cpu));
/// let live = memlab::events::live();
/// assert!(live.iter().any(|a| a.size == 1024));
/// drop((t, recording));
/// # Ok::<(), memlab::Error>(())
/// ```
#[must_use = "recording stops when the Recording is dropped"]
#[derive(Debug)]
pub struct Recording {
    user: Option<events::User>,
    sampler: Option<crate::sampler::RecordingReadings>,
    ops: Option<crate::ops::OpWatch>,
}

impl Recording {
    /// Starts recording (or joins a recording already on) with at least
    /// `settings` for as long as this `Recording` lives: while several are
    /// live, the recorder keeps the largest capacity any of them asked for,
    /// and backtraces if any asked for them.
    ///
    /// On a CUDA machine this attaches memlab's tracker to the caching
    /// allocator, creating it with a first (1-element) CUDA allocation if no
    /// CUDA memory was allocated yet.
    ///
    /// With [`Settings::sampling`], a thread reads the process's resident
    /// set and the driver's use of the current CUDA device (when CUDA is in
    /// use) at that interval while this `Recording` lives; traces draw the
    /// readings as counters beside the allocator's. With [`Settings::ops`],
    /// it watches the ops whose CUDA kernels allocate otherwise ([`crate::ops`]),
    /// which snapshots then carry.
    pub fn start(settings: Settings) -> Result<Recording> {
        let user = acquire(Some(settings))?;
        // The device whose context libtorch uses: reading another would create one.
        let gpu = match crate::auto_device() {
            Device::Cuda(i) => Some(i),
            Device::Cpu => None,
        };
        let sampler = settings.sample_every.map(|every| crate::sampler::RecordingReadings::start(gpu, every));
        let ops = match settings.ops {
            true => match crate::ops::watch_ops() {
                Ok(watch) => Some(watch),
                Err(e) => {
                    release(user);
                    return Err(e);
                }
            },
            false => None,
        };
        Ok(Recording { user: Some(user), sampler, ops })
    }

    /// Joins the recording, or starts one with the settings in force, without
    /// asking for any: for tools that need the events while they live (dispose
    /// scopes, trackers) but leave the settings to the user's recordings.
    pub fn join() -> Result<Recording> {
        Ok(Recording { user: Some(acquire(None)?), sampler: None, ops: None })
    }

    /// The settings in force now (the union of what live recordings asked for).
    pub fn settings(&self) -> Settings {
        events::current_settings()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        drop(self.sampler.take());
        drop(self.ops.take());
        if let Some(user) = self.user.take() {
            release(user);
        }
    }
}

memlab_core::process::process_wide! {
    /// Held while the recorder's users and the backends' hooks change, so that
    /// the hooks are on exactly when the recorder has users: one thread's last
    /// release can never clear the hooks another thread's first acquire just set.
    /// Allocator hooks never take it.
    static HOOKS: Mutex<()> = Mutex::new(());
}

fn hooks_lock() -> MutexGuard<'static, ()> {
    HOOKS.locked()
}

/// Adds a user of the recorder, turning the hooks on for the first one.
pub(crate) fn acquire(settings: Option<Settings>) -> Result<events::User> {
    let _hooks = hooks_lock();
    let user = events::retain(settings);
    if user.first {
        // SAFETY: `on_event` is an `extern "C"` function that never unwinds.
        unsafe { ffi::memlab_set_cpu_event_hook(Some(on_event)) };
        if crate::cuda_is_available() {
            // SAFETY: as above.
            if let Err(e) = ffi::check(unsafe { ffi::memlab_cuda_set_event_hook(Some(on_event)) }) {
                if events::release(user) {
                    // SAFETY: clearing a hook is always allowed.
                    unsafe { ffi::memlab_set_cpu_event_hook(None) };
                }
                return Err(e);
            }
        }
    }
    Ok(user)
}

/// Removes a user; the last one turns the hooks off.
pub(crate) fn release(user: events::User) {
    let _hooks = hooks_lock();
    if events::release(user) {
        testing::pause_after_last_release();
        // SAFETY: clearing a hook is always allowed.
        unsafe { ffi::memlab_set_cpu_event_hook(None) };
        if crate::cuda_is_available() {
            // SAFETY: as above; clearing cannot fail.
            let _ = ffi::check(unsafe { ffi::memlab_cuda_set_event_hook(None) });
        }
    }
}

/// A point where tests can stop a thread between the recorder's last release
/// and the hooks going off, to check that no other thread's acquire can slip
/// in between. Not public API.
#[doc(hidden)]
pub mod testing {
    use std::sync::Mutex;

    use memlab_core::sync::LockExt;

    memlab_core::process::process_wide! {
        static PAUSE: Mutex<Option<fn()>> = Mutex::new(None);
    }

    /// Calls `pause` (once) the next time the last user of the recorder leaves,
    /// before the hooks are turned off.
    pub fn pause_after_next_last_release(pause: fn()) {
        *PAUSE.locked() = Some(pause);
    }

    pub(super) fn pause_after_last_release() {
        let pause = PAUSE.locked().take();
        if let Some(pause) = pause {
            pause();
        }
    }
}

/// The hook the shim calls for every event. Runs inside libtorch's allocator
/// (on CUDA under its lock): it only records, and never unwinds.
extern "C" fn on_event(code: i32, device: i32, address: u64, size: u64, stream: u64) {
    let Some(action) = Action::from_code(code) else { return };
    let _ = std::panic::catch_unwind(|| {
        if device == ffi::EVENT_DEVICE_CPU {
            // The CPU's counters move under the recorder's lock, with the
            // event (see memlab_cpu_count), whether or not it is kept.
            // SAFETY: counts one allocation or free of `size` bytes.
            events::record_counted(Device::Cpu, action, address, size, stream, &|| unsafe {
                ffi::memlab_cpu_count(code, size)
            })
        } else {
            events::record(Device::Cuda(device as usize), action, address, size, stream)
        }
    });
}
