//! One call of a profiled function. The macro creates a `Frame` first thing in
//! the body and calls [`Frame::line`] before every statement; each call closes
//! the interval of the statement that ran before it. `Drop` closes the last
//! one, so `return`, `?` and panics record the statement that was running.

use std::cell::{Cell, UnsafeCell};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::task::{Context, Poll};

use super::{config, ledger};
use crate::backend::Backend;
use crate::device::{Device, DeviceSelector};
use crate::error::{Error, Result};
use crate::events::context::{self, StatementRef};
use crate::events::{self, SpanKind};
use crate::profiled::ProfiledFn;
use crate::report::Report;
use crate::stats::RawStats;

struct Open {
    device: Device,
    slot: usize,
    /// The fields the backend fills for `device`, and the peak fields among them.
    fields: &'static [usize],
    peaks: &'static [usize],
    /// Index in the function's table of the statement being measured; `None`
    /// before the first statement.
    line: Option<usize>,
    /// Two sample buffers used in turn: `samples[before]` was taken when the
    /// running statement started, the other receives the next sample.
    samples: [RawStats; 2],
    before: usize,
    /// When the call began, on the recorder's clock, while a recording runs:
    /// the call then becomes a span of the recording's timeline.
    started_ns: Option<u64>,
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

/// Marks a frame's measuring state as in use. A plain `Cell` for the frames
/// of ordinary functions, which never leave their thread; an atomic for the
/// frames of `async fn`s, whose block-end guards live across awaits in
/// futures that may move between threads (their frame must be `Sync`).
pub trait Busy: Default + sealed::Sealed {
    /// Marks the state in use; false if it already was.
    fn take(&self) -> bool;
    /// Marks it free again.
    fn give(&self);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for std::cell::Cell<bool> {}
    impl Sealed for std::sync::atomic::AtomicBool {}
}

impl Busy for Cell<bool> {
    #[inline]
    fn take(&self) -> bool {
        !self.replace(true)
    }
    #[inline]
    fn give(&self) {
        self.set(false);
    }
}

impl Busy for AtomicBool {
    #[inline]
    fn take(&self) -> bool {
        !self.swap(true, Ordering::Acquire)
    }
    #[inline]
    fn give(&self) {
        self.store(false, Ordering::Release);
    }
}

/// The guard of one profiled call. Generated code holds it as `__memlab_frame`:
/// a `Frame` for an ordinary function, a `Frame<AtomicBool>` for an `async fn`.
///
/// It keeps its measuring state in a box (taken from a per-thread pool), so a
/// profiled call adds little to the stack: deep recursion stays possible.
#[must_use = "a profiled call ends when its Frame is dropped"]
pub struct Frame<B: Busy = Cell<bool>> {
    function: &'static ProfiledFn,
    backend: &'static dyn Backend,
    /// Set while a method works on `open`: a probe re-entered from inside a
    /// probe (an allocator hook, say) finds it set and does nothing.
    busy: B,
    /// `None` when profiling is off or the device could not be read.
    open: UnsafeCell<Option<Box<Open>>>,
    /// The statement that was running on this thread when the call began;
    /// `None` when this call did not take part (profiling off).
    caller: Option<Option<StatementRef>>,
}

// SAFETY: with an atomic flag, `open` is only touched between a successful
// `take` (an acquiring swap to true) and the releasing `give` that follows (see
// `with_open`), so no two threads ever reach it at once; everything else is
// immutable or already Sync. (`UnsafeCell` and `Cell` keep every other
// `Frame` from being Sync.)
unsafe impl Sync for Frame<AtomicBool> {}

impl<B: Busy> Frame<B> {
    /// Starts a profiled call of `function`, measuring through `backend`.
    pub fn enter(function: &'static ProfiledFn, backend: &'static dyn Backend) -> Frame<B> {
        let mut frame = Frame { function, backend, busy: B::default(), open: UnsafeCell::new(None), caller: None };
        if !config::is_enabled() {
            return frame;
        }
        frame.caller = Some(context::set_statement(Some(StatementRef::new(function, function.meta.signature_line))));
        register_exit_report();
        let opened = resolve_device(function.meta.device, backend).and_then(|device| {
            let mut open = pool::take();
            if open.device != device {
                // A CPU sample fills only the CPU fields: start from zeros.
                open.samples = [RawStats::default(); 2];
            }
            let peaks = backend.peak_fields(device);
            match ledger::open(backend, device, &mut open.samples[0], peaks) {
                Ok(slot) => {
                    open.device = device;
                    open.slot = slot;
                    open.fields = backend.fields(device);
                    open.peaks = peaks;
                    open.line = None;
                    open.before = 0;
                    open.started_ns = events::is_active().then(events::span_start);
                    Ok(open)
                }
                Err(e) => {
                    pool::give(open);
                    Err(e)
                }
            }
        });
        match opened {
            Ok(open) => {
                function.with_state(|state| {
                    state.device = Some(open.device);
                    state.error = None;
                    let signature = function.line_index(function.meta.signature_line);
                    function.record_entry(state, signature, &open.samples[0], open.fields);
                });
                *frame.open.get_mut() = Some(open);
            }
            Err(e) => function.with_state(|state| state.error = Some(e.to_string())),
        }
        frame
    }

    /// Runs `f` on the measuring state, unless another probe of this frame
    /// is running (then it does nothing).
    #[inline]
    fn with_open(&self, f: impl FnOnce(&mut Option<Box<Open>>)) {
        if !self.busy.take() {
            return;
        }
        // SAFETY: `take` made this the only code touching `open` until `give`
        // (a `Cell` frame never leaves its thread; see the `Sync` impl).
        f(unsafe { &mut *self.open.get() });
        self.busy.give();
    }

    /// Marks the start of the statement on source line `line`, ending the
    /// interval of the statement before it.
    #[inline]
    pub fn line(&self, line: u32) {
        self.with_open(|slot| {
            let Some(open) = slot.as_mut() else { return };
            context::set_statement(Some(StatementRef::new(self.function, line)));
            // The entry sample already opened the first statement's interval.
            let Some(running) = open.line.replace(self.function.line_index(line)) else { return };
            let fields = open.fields;
            match open.step(self.backend, true) {
                Ok((before, after)) => {
                    self.function.with_state(|state| self.function.record_run(state, running, before, after, fields))
                }
                Err(e) => {
                    self.function.with_state(|state| state.error = Some(e.to_string()));
                    if let Some(open) = slot.take() {
                        pool::give(open);
                    }
                }
            }
        });
    }

    /// A guard that generated code declares after a block's statements: when
    /// the block ends it is dropped before the block's other locals, and
    /// starts the interval of the closing brace on `line`, so that what the
    /// locals free counts there rather than in the block's last statement.
    #[inline]
    pub fn block_end(&self, line: u32) -> BlockEnd<'_, B> {
        BlockEnd { frame: self, line, armed: Cell::new(true) }
    }

    /// Like [`block_end`](Self::block_end), for a block that ends in a tail
    /// expression: the guard does nothing until the tail has produced the
    /// block's value ([`BlockEnd::arm`]). A `return`, `break`, `?` or panic
    /// inside the tail leaves it unarmed, so what the locals free as the
    /// block is left counts on the statement that left it.
    #[inline]
    pub fn block_end_after_tail(&self, line: u32) -> BlockEnd<'_, B> {
        BlockEnd { frame: self, line, armed: Cell::new(false) }
    }
}

/// See [`Frame::block_end`].
pub struct BlockEnd<'a, B: Busy> {
    frame: &'a Frame<B>,
    line: u32,
    armed: Cell<bool>,
}

impl<B: Busy> BlockEnd<'_, B> {
    /// Arms the guard and passes the block's `value` through: generated code
    /// wraps a block's tail expression in it.
    #[inline]
    pub fn arm<T>(&self, value: T) -> T {
        self.armed.set(true);
        value
    }
}

impl<B: Busy> Drop for BlockEnd<'_, B> {
    #[inline]
    fn drop(&mut self) {
        if self.armed.get() {
            self.frame.line(self.line);
        }
    }
}

impl<B: Busy> Drop for Frame<B> {
    fn drop(&mut self) {
        if let Some(caller) = self.caller {
            context::set_statement(caller);
        }
        let Some(mut open) = self.open.get_mut().take() else { return };
        let every = self.function.meta.every as u64;
        let (running, fields, started) = (open.line, open.fields, open.started_ns);
        let read = open.step(self.backend, false);
        if let Some(start) = started {
            events::span(SpanKind::Call, self.function.name(), start);
        }
        let due = self.function.with_state(|state| {
            match (read, running) {
                (Ok((before, after)), Some(running)) => self.function.record_run(state, running, before, after, fields),
                (Ok(_), None) => {}
                (Err(e), _) => state.error = Some(e.to_string()),
            }
            state.total.calls += 1;
            state.window.calls += 1;
            every > 0 && state.window.calls >= every
        });
        pool::give(open);
        if due {
            crate::output::emit(&crate::render::Render::to_text(&Report::window_of(self.function)));
        }
    }
}

/// Boxes of measuring state kept per thread for the next calls, so that a
/// profiled call costs no trip to the heap.
mod pool {
    use std::cell::RefCell;

    use super::Open;
    use crate::device::Device;
    use crate::stats::RawStats;

    /// Enough for the profiled calls nested at once in ordinary code.
    const KEEP: usize = 32;

    thread_local! {
        // Boxes, not values: frames hold their state boxed, and a box moves
        // in and out of the pool without copying its 2 KB.
        #[allow(clippy::vec_box)]
        static SPARE: RefCell<Vec<Box<Open>>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn take() -> Box<Open> {
        SPARE.try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop())).ok().flatten().unwrap_or_else(|| {
            Box::new(Open {
                device: Device::Cpu,
                slot: 0,
                fields: &[],
                peaks: &[],
                line: None,
                samples: [RawStats::default(); 2],
                before: 0,
                started_ns: None,
            })
        })
    }

    pub(super) fn give(open: Box<Open>) {
        let _ = SPARE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                if s.len() < KEEP {
                    s.push(open);
                }
            }
        });
    }
}

/// The future of a profiled `async fn`'s body: each time it is polled, the
/// body's running statement becomes the thread's, and when the poll returns
/// (ready, pending or panicking) the statement that was running before comes
/// back. However futures interleave on a thread, allocations are attributed
/// to the statement that really runs, and code outside profiled functions
/// sees none.
pub struct InStatement<F> {
    body: F,
    own: Option<StatementRef>,
}

impl<F> InStatement<F> {
    /// Wraps the body's future.
    pub fn new(body: F) -> Self {
        InStatement { body, own: None }
    }
}

impl<F: Future> Future for InStatement<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        struct Restore<'a> {
            own: &'a mut Option<StatementRef>,
            outer: Option<StatementRef>,
        }
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                *self.own = context::set_statement(self.outer);
            }
        }
        // SAFETY: `body` is structurally pinned: it is never moved out of
        // `self`, and `own` is a plain value that is not pinned.
        let this = unsafe { self.get_unchecked_mut() };
        let outer = context::set_statement(this.own);
        let _restore = Restore { own: &mut this.own, outer };
        // SAFETY: as above.
        unsafe { Pin::new_unchecked(&mut this.body) }.poll(cx)
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
/// exits, unless turned off with [`config::set_print_at_exit`]: once for the
/// process, however many copies of memlab it holds. The first frame of each
/// copy also registers the copy's functions, so that the report lists its
/// functions that never ran.
fn register_exit_report() {
    static THIS_COPY: Once = Once::new();
    THIS_COPY.call_once(|| {
        crate::profiled::register_this_copy();
        EXIT_REPORT.call_once(register_atexit);
    });
}

crate::process::process_wide! {
    static EXIT_REPORT: Once = Once::new();
}

fn register_atexit() {
    extern "C" {
        fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
    }
    extern "C" fn print_report() {
        // Nothing may unwind out of an atexit handler.
        let _ = std::panic::catch_unwind(|| {
            if config::print_at_exit() {
                crate::output::emit(&crate::render::Render::to_text(&Report::at_exit()));
            }
        });
    }
    // SAFETY: `atexit` only stores the pointer; `print_report` is a plain
    // `extern "C"` function that lives as long as the program.
    unsafe {
        atexit(print_report);
    }
}
