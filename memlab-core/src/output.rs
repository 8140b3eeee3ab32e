//! The one output layer. memlab writes two kinds of text by itself: reports
//! (tables printed at exit or every N calls, a dispose scope's report when
//! asked for, the monitor's and the logger's lines, `track!()`) go to the
//! output set with [`set_output`], standard output by default; warnings (an
//! escape a scope caught, a CSV directory that cannot be written, an ignored
//! environment variable) go to the one set with [`set_warnings`], standard
//! error by default. No tool prints by itself. No memlab lock is held while a
//! sink runs, so a sink may call memlab.

use crate::sync::LockExt;
use std::io::Write;
use std::sync::{Arc, Mutex};

/// Where a kind of memlab's text goes.
pub enum Output {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
    /// A function that receives each piece of text, e.g. to log it. memlab
    /// holds none of its locks while calling it, so it may call memlab
    /// (even `set_output`); it may be called from several threads at once.
    Sink(Box<dyn Fn(&str) + Send + Sync>),
}

crate::process::process_wide! {
    static REPORTS: Mutex<Option<Arc<Output>>> = Mutex::new(None);
}
crate::process::process_wide! {
    static WARNINGS: Mutex<Option<Arc<Output>>> = Mutex::new(None);
}

/// Sets where memlab's reports go (standard output by default).
pub fn set_output(output: Output) {
    *REPORTS.locked() = Some(Arc::new(output));
}

/// Sets where memlab's warnings go (standard error by default).
pub fn set_warnings(output: Output) {
    *WARNINGS.locked() = Some(Arc::new(output));
}

/// Writes a report to the output chosen with [`set_output`]. Best effort: a
/// closed stream must not turn a profiled call into a panic, least of all
/// while unwinding.
pub fn emit(text: &str) {
    write(&REPORTS, text, Output::Stdout, true);
}

/// Writes a report as [`emit`] does, except that where reports go to
/// standard output, `to_stdout` writes it: for a writer that holds the
/// process's standard output itself (the notebook's cell logger).
pub fn emit_or(text: &str, to_stdout: impl FnOnce(&str)) {
    let chosen = REPORTS.locked().clone();
    match chosen.as_deref() {
        None | Some(Output::Stdout) => to_stdout(text),
        Some(_) => emit(text),
    }
}

/// Writes a warning to the output chosen with [`set_warnings`].
pub fn warn(text: &str) {
    write(&WARNINGS, text, Output::Stderr, true);
}

/// Writes a warning now if warnings go to standard error or output, and
/// returns true; returns false and writes nothing when they go to a sink,
/// which the caller then runs later, outside the code that must not run user
/// code (an allocator's failure path).
pub fn warn_to_stream(text: &str) -> bool {
    write(&WARNINGS, text, Output::Stderr, false)
}

/// Writes a warning from code that must not run user code, such as an
/// allocator's failure path: now when warnings go to a stream (so that it is
/// out even if the process ends with the error), else later, from a thread
/// of memlab's that hands it to the sink (see [`prepare_later`]). Anything
/// still queued when the process exits is delivered then.
pub fn warn_outside_user_code(text: String) {
    if !warn_to_stream(&text) {
        later::warn(text);
    }
}

/// Starts the thread that delivers [`warn_outside_user_code`]'s warnings
/// to a sink, if it is not running: code that may warn while memory has
/// run out starts it beforehand, since starting a thread then can fail.
/// Returns whether it runs.
pub fn prepare_later() -> bool {
    later::start()
}

/// Warnings for a sink, delivered from a thread of memlab's (a sink is user
/// code, which must not run inside an allocator), and at exit whatever is
/// still queued (a failure that ends the program with a panic must still be
/// told).
mod later {
    use std::sync::{Condvar, Mutex};

    use crate::sync::LockExt;

    crate::process::process_wide! {
        static QUEUE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    }
    crate::process::process_wide! {
        static READY: Condvar = Condvar::new();
    }
    crate::process::process_wide! {
        static STARTED: Mutex<bool> = Mutex::new(false);
    }

    pub(super) fn warn(text: String) {
        QUEUE.locked().push(text);
        if start() {
            READY.notify_one();
        }
    }

    /// Starts the delivering thread and the exit hook once; whether the
    /// thread runs (if it could not start, the exit hook still delivers).
    pub(super) fn start() -> bool {
        let mut started = STARTED.locked();
        if !*started {
            let spawned = crate::thread::spawn_started("memlab-warnings", || {
                // The queue's first growth happens here, not when memory ran out.
                QUEUE.locked().reserve(8);
                loop {
                    let texts = {
                        let mut queue = QUEUE.locked();
                        while queue.is_empty() {
                            queue = READY.wait(queue).unwrap_or_else(|e| e.into_inner());
                        }
                        std::mem::take(&mut *queue)
                    };
                    for text in texts {
                        super::warn(&text);
                    }
                }
            });
            if spawned.is_err() {
                return false;
            }
            extern "C" {
                fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
            }
            // SAFETY: registers a function that delivers the queue and never unwinds.
            unsafe { atexit(deliver_at_exit) };
            *started = true;
        }
        true
    }

    extern "C" fn deliver_at_exit() {
        let _ = std::panic::catch_unwind(|| {
            let texts = std::mem::take(&mut *QUEUE.locked());
            for text in texts {
                super::warn(&text);
            }
        });
    }
}

/// Writes `text` where `target` says (`default` when unset); with
/// `to_sink` false, a sink is not called and false is returned.
fn write(target: &Mutex<Option<Arc<Output>>>, text: &str, default: Output, to_sink: bool) -> bool {
    // What the process-wide table could not say when it was chosen (it
    // comes before the sinks it holds): said first, once, by a caller that
    // may run a sink (never from an allocator's failure path).
    if to_sink {
        for warning in crate::process::take_warnings() {
            write(&WARNINGS, &format!("{warning}\n"), Output::Stderr, true);
        }
    }
    if text.is_empty() {
        return true;
    }
    let chosen = target.locked().clone();
    match chosen.as_deref().unwrap_or(&default) {
        Output::Stdout => drop(std::io::stdout().lock().write_all(text.as_bytes())),
        Output::Stderr => drop(std::io::stderr().lock().write_all(text.as_bytes())),
        Output::Sink(_) if !to_sink => return false,
        Output::Sink(f) => f(text),
    }
    true
}

/// Shows a rendering in an evcxr (Rust Jupyter) notebook cell, as `html`
/// and as `text` together: evcxr reads rich output from standard output,
/// between its markers, whatever `set_output` says, and sends a cell's
/// contents as one display bundle, keyed by mime type, so that a notebook
/// shows the HTML and a console client the text. It keeps the last content
/// of each mime type a cell prints: a cell shows its last display.
pub fn evcxr_show(html: &str, text: &str) {
    drop(std::io::stdout().lock().write_all(evcxr_bundle(html, text).as_bytes()));
}

/// What [`evcxr_show`] prints.
pub fn evcxr_bundle(html: &str, text: &str) -> String {
    let text = text.trim_end_matches('\n');
    format!(
        "EVCXR_BEGIN_CONTENT text/html\n{html}\nEVCXR_END_CONTENT\n\
         EVCXR_BEGIN_CONTENT text/plain\n{text}\nEVCXR_END_CONTENT\n"
    )
}
