//! One call of a profiled function. The macro creates a `Frame` first thing in
//! the body and calls [`Frame::line`] before every statement; each call closes
//! the interval of the statement that ran before it. `Drop` closes the last
//! one, so `return`, `?` and panics record the statement that was running.

use std::cell::RefCell;
use std::sync::Once;

use super::{config, ledger, site::Site};
use crate::backend::Backend;
use crate::events::context::{self, StatementRef};
use crate::report::Report;
use crate::stats::RawStats;
use crate::{Device, DeviceSelector, Error, Result};

struct Open {
    device: Device,
    slot: usize,
    /// The fields the backend fills for `device`, and the peak fields among them.
    fields: &'static [usize],
    peaks: &'static [usize],
    /// Index in the site's table of the statement being measured; `None`
    /// before the first statement.
    line: Option<usize>,
    /// Two sample buffers used in turn: `samples[before]` was taken when the
    /// running statement started, the other receives the next sample.
    samples: [RawStats; 2],
    before: usize,
}

impl Open {
    /// Takes the next sample; on success returns (before, after) and makes
    /// `after` the start of the next interval.
    fn step(&mut self, backend: &dyn Backend, reopen: bool) -> Result<(&RawStats, &RawStats)> {
        let next = 1 - self.before;
        ledger::probe(backend, self.device, self.slot, &mut self.samples[next], self.peaks, reopen)?;
        let before = std::mem::replace(&mut self.before, next);
        Ok((&self.samples[before], &self.samples[next]))
    }
}

/// The guard of one profiled call. Generated code holds it as `__memlab_frame`.
#[must_use = "a profiled call ends when its Frame is dropped"]
pub struct Frame {
    site: &'static Site,
    backend: &'static dyn Backend,
    /// `None` when profiling is off or the device could not be read.
    open: RefCell<Option<Open>>,
    /// The statement that was running on this thread when the call began;
    /// `None` when this call did not take part (profiling off).
    caller: Option<Option<StatementRef>>,
}

impl Frame {
    /// Starts a profiled call of `site`, measuring through `backend`.
    pub fn enter(site: &'static Site, backend: &'static dyn Backend) -> Frame {
        if !config::is_enabled() {
            return Frame { site, backend, open: RefCell::new(None), caller: None };
        }
        let caller = Some(context::set_statement(Some(StatementRef::new(site, site.meta.signature_line))));
        let frame = Frame { site, backend, open: RefCell::new(None), caller };
        register_exit_report();
        let opened = resolve_device(site.meta.device, backend).and_then(|device| {
            let mut samples = [RawStats::default(); 2];
            let peaks = backend.peak_fields(device);
            let slot = ledger::open(backend, device, &mut samples[0], peaks)?;
            Ok(Open { device, slot, fields: backend.fields(device), peaks, line: None, samples, before: 0 })
        });
        match opened {
            Ok(open) => {
                site.with_state(|state| {
                    state.device = Some(open.device);
                    state.error = None;
                    let signature = site.line_index(site.meta.signature_line);
                    site.record_entry(state, signature, &open.samples[0], open.fields);
                });
                *frame.open.borrow_mut() = Some(open);
            }
            Err(e) => site.with_state(|state| state.error = Some(e.to_string())),
        }
        frame
    }

    /// Marks the start of the statement on source line `line`, ending the
    /// interval of the statement before it.
    #[inline]
    pub fn line(&self, line: u32) {
        let Ok(mut slot) = self.open.try_borrow_mut() else { return };
        let Some(open) = slot.as_mut() else { return };
        context::set_statement(Some(StatementRef::new(self.site, line)));
        // The entry sample already opened the first statement's interval.
        let Some(running) = open.line.replace(self.site.line_index(line)) else { return };
        let fields = open.fields;
        match open.step(self.backend, true) {
            Ok((before, after)) => {
                self.site.with_state(|state| self.site.record_run(state, running, before, after, fields))
            }
            Err(e) => {
                self.site.with_state(|state| state.error = Some(e.to_string()));
                *slot = None;
            }
        }
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        if let Some(caller) = self.caller {
            context::set_statement(caller);
        }
        let Some(mut open) = self.open.get_mut().take() else { return };
        let every = self.site.meta.every as u64;
        let (running, fields) = (open.line, open.fields);
        let read = open.step(self.backend, false);
        let due = self.site.with_state(|state| {
            match (read, running) {
                (Ok((before, after)), Some(running)) => self.site.record_run(state, running, before, after, fields),
                (Ok(_), None) => {}
                (Err(e), _) => state.error = Some(e.to_string()),
            }
            state.total.calls += 1;
            state.window.calls += 1;
            every > 0 && state.window.calls >= every
        });
        if due {
            config::emit(&Report::window_of(self.site).to_text());
        }
    }
}

fn resolve_device(chosen: Option<DeviceSelector>, backend: &dyn Backend) -> Result<Device> {
    let selector = chosen.unwrap_or_else(config::target_device);
    let count = backend.cuda_device_count();
    match selector {
        DeviceSelector::Fixed(Device::Cpu) => Ok(Device::Cpu),
        DeviceSelector::Auto if count == 0 => Ok(Device::Cpu),
        DeviceSelector::Auto | DeviceSelector::CurrentCuda => {
            if count == 0 {
                return Err(Error::DeviceUnavailable { device: Device::Cuda(0), count });
            }
            backend.current_cuda_device().map(Device::Cuda)
        }
        DeviceSelector::Fixed(Device::Cuda(i)) if i < count && i < ledger::MAX_CUDA_DEVICES => Ok(Device::Cuda(i)),
        DeviceSelector::Fixed(device) => Err(Error::DeviceUnavailable { device, count }),
    }
}

/// Prints the tables of every `#[profile]` function that ran, when the process
/// exits, unless turned off with [`config::set_print_at_exit`].
fn register_exit_report() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        extern "C" fn print_report() {
            // Nothing may unwind out of an atexit handler.
            let _ = std::panic::catch_unwind(|| {
                if config::print_at_exit() {
                    config::emit(&Report::at_exit().to_text());
                }
            });
        }
        // SAFETY: `atexit` only stores the pointer; `print_report` is a plain
        // `extern "C"` function that lives as long as the program.
        unsafe {
            atexit(print_report);
        }
    });
}
