#![doc = include_str!("../docs/notebook.md")]

use std::sync::Mutex;
use std::time::Duration;

use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::sync::LockExt;
use memlab_core::{Error, Result};

use crate::step_figures::{How, Measure, StepData};

/// The variable evcxr sets in the child process that runs a notebook's cells.
const EVCXR_RUNTIME: &str = "EVCXR_IS_RUNTIME";
/// The line on which evcxr's child receives a cell: the cell's library and
/// the function to run.
const CELL_STARTS: &[u8] = b"LOAD_AND_RUN ";
/// The line evcxr's child prints when a cell's code has returned.
const CELL_ENDS: &[u8] = b"EVCXR_EXECUTION_COMPLETE\n";

/// Starts the per-cell logger with its defaults (the table form, the
/// resident set read at each cell's two ends): from this call on, each cell prints its line
/// when it ends. The same as `CellLogger::new().start()`.
///
/// Returns an error outside evcxr's kernel or REPL, where there are no cells
/// (use [`StepLogger`](crate::StepLogger) there), or when the kernel's
/// standard streams cannot be watched.
pub fn log_cells() -> Result<()> {
    CellLogger::new().start()
}

/// The per-cell logger's settings (see the [module](self) documentation).
///
/// ```no_run
/// memlab::notebook::CellLogger::new().compact(true).start()?;  // one line a cell
/// # Ok::<(), memlab::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct CellLogger {
    compact: bool,
    how: How,
}

impl Default for CellLogger {
    fn default() -> CellLogger {
        // Two system calls a cell are nothing at a person's pace, and a
        // short cell can end before the background thread reads again.
        CellLogger { compact: false, how: How { exact_ram: true, ..How::default() } }
    }
}

impl CellLogger {
    /// The default settings: the three-row table after each cell.
    pub fn new() -> CellLogger {
        CellLogger::default()
    }

    /// One line a cell instead of the table.
    pub fn compact(mut self, compact: bool) -> CellLogger {
        self.compact = compact;
        self
    }

    /// Reads the resident set when a cell starts and ends (the default), or,
    /// with `false`, takes the background thread's latest readings, as
    /// [`StepLogger::exact_ram`](crate::StepLogger::exact_ram).
    pub fn exact_ram(mut self, exact: bool) -> CellLogger {
        self.how.exact_ram = exact;
        self
    }

    /// Takes the RAM peak from the kernel's high-water mark, as
    /// [`StepLogger::exact_ram_peak`](crate::StepLogger::exact_ram_peak).
    pub fn exact_ram_peak(mut self, exact: bool) -> CellLogger {
        self.how.exact_ram_peak = exact;
        self
    }

    /// Empties the CUDA cache before each cell, as
    /// [`StepLogger::clear_cache`](crate::StepLogger::clear_cache).
    pub fn clear_cache(mut self, clear: bool) -> CellLogger {
        self.how.clear_cache = clear;
        self
    }

    /// How often the background thread samples the resident set and the
    /// driver during a cell (1 ms by default).
    pub fn sample_every(mut self, every: Duration) -> CellLogger {
        self.how.sample_every = every;
        self
    }

    /// Logs every cell from now on with these settings: the rest of the
    /// calling cell first, then each later one. Called again, it keeps the
    /// cells logged so far and changes the settings: the form from the
    /// calling cell's line on, how cells are measured from the next cell.
    pub fn start(self) -> Result<()> {
        if std::env::var_os(EVCXR_RUNTIME).is_none() {
            return Err(Error::InvalidArgument(
                "memlab::notebook::log_cells() logs the cells of evcxr's Jupyter kernel or REPL, and this process \
                 is not one that runs them; around a step of a program, use memlab::StepLogger"
                    .into(),
            ));
        }
        let mut log = LOG.locked();
        log.compact = self.compact;
        log.how = self.how;
        log.printing = true;
        if log.watching {
            return Ok(());
        }
        streams::watch()?;
        log.watching = true;
        log.begin(", from log_cells()");
        Ok(())
    }
}

/// Stops printing a line after each cell; cells are still measured and
/// [`cells`] still lists them.
pub fn stop() {
    LOG.locked().printing = false;
}

/// Prints a line after each cell again.
pub fn resume() {
    LOG.locked().printing = true;
}

/// Every cell logged so far, in order: a report (`{}` for its text,
/// [`Render`] for HTML, CSV and a notebook display) and the figures as
/// data.
///
/// ```
/// let cells = memlab::notebook::cells();   // none outside a notebook
/// assert!(cells.is_empty());
/// ```
pub fn cells() -> Cells {
    Cells(LOG.locked().cells.clone())
}

/// The cells the per-cell logger measured: see [`cells`].
#[derive(Clone, Debug, Default)]
pub struct Cells(pub Vec<StepData>);

impl std::ops::Deref for Cells {
    type Target = [StepData];

    fn deref(&self) -> &[StepData] {
        &self.0
    }
}

displayed_as_text!(Cells);

impl Render for Cells {
    /// One row a cell: its time, then what it consumed, how far it peaked
    /// above its end, and what was used at its end, for the RAM (resident
    /// set), the CPU tensors and the GPU.
    fn document(&self) -> Document {
        let mut doc = Document::new();
        if self.0.is_empty() {
            doc.line("No cell logged: memlab::notebook::log_cells() starts logging in a notebook.");
            return doc;
        }
        let figure = |parts: &[&str]| Column::stacked(parts, Layout::Figure);
        let gpu = self.0.iter().any(|c| c.gpu.is_some());
        let cpu = self.0.iter().any(|c| c.cpu.is_some());
        let mut columns = vec![Column::new("cell", Layout::Text), Column::new("time", Layout::Figure)];
        let mut groups = vec!["RAM"];
        if cpu {
            groups.push("CPU tensors");
        }
        if gpu {
            groups.push("GPU");
        }
        for group in &groups {
            columns.push(figure(&[group, "consumed"]));
            columns.push(figure(&[group, "peaked"]));
            columns.push(figure(&[group, "used"]));
        }
        let mut table = Table::new(columns);
        for c in &self.0 {
            let mut row = vec![Cell::text(c.label.clone()), Cell::Duration(c.time)];
            row.extend([Cell::signed_bytes(c.ram.consumed), Cell::bytes(c.ram.peaked), Cell::bytes(c.ram.used)]);
            let absent = || [Cell::text(""), Cell::text(""), Cell::text("")];
            if cpu {
                row.extend(c.cpu.map_or_else(absent, |f| {
                    [Cell::signed_bytes(f.consumed), Cell::bytes(f.peaked), Cell::bytes(f.used)]
                }));
            }
            if gpu {
                row.extend(c.gpu.map_or_else(absent, |f| {
                    [Cell::signed_bytes(f.consumed), Cell::bytes(f.peaked), Cell::bytes(f.used)]
                }));
            }
            table.row(row);
        }
        doc.table(table);
        doc.note(
            "Times are the cells' runs: from loading a cell's compiled library to the end of its code; \
             compiling it is not seen. RAM is the resident set, its peak sampled unless exact_ram_peak; \
             CPU tensors and GPU are the allocators' exact figures.",
        );
        doc
    }
}

/// The logger's state, shared by every copy of memlab in the kernel's
/// process (each cell loads one).
struct Log {
    compact: bool,
    how: How,
    printing: bool,
    watching: bool,
    /// The cell being measured, and its label.
    running: Option<(Measure, String)>,
    /// How many cells have started since logging began.
    started: usize,
    cells: Vec<StepData>,
}

memlab_core::process::process_wide! {
    static LOG: Mutex<Log> = Mutex::new(Log {
        compact: false,
        how: How { exact_ram: true, ..How::default() },
        printing: true,
        watching: false,
        running: None,
        started: 0,
        cells: Vec::new(),
    });
}

impl Log {
    /// A cell starts: its figures are read before its library loads.
    fn begin(&mut self, note: &str) {
        self.started += 1;
        let label = format!("cell {}{note}", self.started);
        self.running = Some((Measure::start(&self.how), label));
    }

    /// The running cell's code has returned: its figures, and the text to
    /// print, if any.
    fn end(&mut self) -> Option<String> {
        let (measure, label) = self.running.take()?;
        let time = measure.elapsed();
        // The line says what its time leaves out; the data keeps the label.
        let mut data = measure.finish(&format!("{label}, compile not timed"), time);
        let text = self.printing.then(|| if self.compact { data.compact_line() } else { data.to_string() });
        data.label = label;
        self.cells.push(data);
        text
    }
}

/// Watching evcxr's child between the kernel and the cells: its standard
/// input, on which each cell arrives, and its standard output, on which it
/// says that a cell's code has returned.
mod streams {
    use std::fs::File;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

    use memlab_core::sync::LockExt;
    use memlab_core::{Error, Result};

    use super::{CELL_ENDS, CELL_STARTS, LOG};

    /// Puts a pipe with a thread of memlab's at each end between the kernel
    /// and the cells: standard input and output go through it unchanged, and
    /// the threads note where each cell starts and ends.
    pub(super) fn watch() -> Result<()> {
        let fail =
            |what: &str| Error::io(format!("watch the notebook's cells: {what}"), std::io::Error::last_os_error());
        // Whatever this copy of the standard library holds goes out first.
        let _ = std::io::stdout().flush();
        let (from_kernel, to_cells) = pipe().ok_or_else(|| fail("make a pipe"))?;
        let (from_cells, to_kernel) = pipe().ok_or_else(|| fail("make a pipe"))?;
        let kernel_in = copy_of(0).ok_or_else(|| fail("copy standard input"))?;
        let kernel_out = copy_of(1).ok_or_else(|| fail("copy standard output"))?;
        let (kernel_in_fd, kernel_out_fd) = (kernel_in.as_raw_fd(), kernel_out.as_raw_fd());
        // Both threads start before the streams are taken over; the input's
        // reads only once they are, so that nothing is read twice or lost
        // if they cannot be.
        let (go, wait) = std::sync::mpsc::sync_channel::<bool>(1);
        let (kernel_in, to_cells) = (File::from(kernel_in), File::from(to_cells));
        memlab_core::thread::spawn_started("memlab-cell-in", move || {
            if wait.recv() == Ok(true) {
                relay_input(kernel_in, to_cells);
            }
        })
        .map_err(|e| Error::io("start the thread that watches cells arrive", e))?;
        let (from_cells, kernel_out) = (File::from(from_cells), File::from(kernel_out));
        if let Err(e) =
            memlab_core::thread::spawn_started("memlab-cell-out", move || relay_output(from_cells, kernel_out))
        {
            let _ = go.send(false);
            return Err(Error::io("start the thread that watches cells end", e));
        }
        // SAFETY: dup2 onto this process's standard streams from descriptors
        // it holds (the pipes' ends here, the copies in the threads' Files).
        unsafe {
            if libc::dup2(from_kernel.as_raw_fd(), 0) < 0 {
                let _ = go.send(false);
                return Err(fail("take over standard input"));
            }
            if libc::dup2(to_kernel.as_raw_fd(), 1) < 0 {
                let error = fail("take over standard output");
                libc::dup2(kernel_in_fd, 0);
                let _ = go.send(false);
                return Err(error);
            }
            KERNEL_OUT.store(kernel_out_fd, std::sync::atomic::Ordering::Release);
            libc::atexit(hand_back_output);
        }
        let _ = go.send(true);
        // Descriptors 0 and 1 are the pipes' ends now; these copies go.
        drop((from_kernel, to_kernel));
        Ok(())
    }

    /// The kernel's standard output, once taken over (-1 before).
    static KERNEL_OUT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    /// Set when the output thread has passed on everything the cells wrote.
    static OUTPUT_DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// At exit: standard output goes straight to the kernel again, after
    /// what the thread still holds (a report printed at exit, say).
    extern "C" fn hand_back_output() {
        let kernel_out = KERNEL_OUT.load(std::sync::atomic::Ordering::Acquire);
        if kernel_out < 0 {
            return;
        }
        let _ = std::io::stdout().flush();
        // SAFETY: closes the pipe's writing end held as descriptor 1, which
        // ends the output thread's reading once it has read the rest.
        unsafe { libc::dup2(kernel_out, 1) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while !OUTPUT_DONE.load(std::sync::atomic::Ordering::Acquire) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A pipe whose ends close on exec: (reading, writing).
    fn pipe() -> Option<(OwnedFd, OwnedFd)> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two new descriptors, owned from here on.
        (unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0)
            .then(|| unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
    }

    /// A copy of descriptor `fd` that closes on exec, above the standard three.
    fn copy_of(fd: RawFd) -> Option<OwnedFd> {
        // SAFETY: fcntl returns a new descriptor, owned from here on, or -1.
        let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        // SAFETY: as above.
        (copy >= 0).then(|| unsafe { OwnedFd::from_raw_fd(copy) })
    }

    /// Passes the kernel's lines on to the cells; a cell starts when its line
    /// arrives, before its library loads. When the kernel closes its end,
    /// so does this thread, and the child ends as it would have.
    fn relay_input(kernel_in: File, mut to_cells: File) {
        let mut lines = BufReader::new(kernel_in);
        let mut line = Vec::new();
        loop {
            line.clear();
            match lines.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line.starts_with(CELL_STARTS) {
                LOG.locked().begin("");
            }
            if to_cells.write_all(&line).is_err() {
                return;
            }
        }
    }

    /// Passes what the cells write on to the kernel; where a cell's code has
    /// returned, its line goes out before the kernel hears of it, so that it
    /// is part of the cell's output.
    fn relay_output(mut from_cells: File, mut kernel_out: File) {
        let mut ends = EndOfCell::default();
        let mut chunk = vec![0u8; 1 << 16];
        let mut out = Vec::with_capacity(1 << 16);
        loop {
            let n = match from_cells.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            out.clear();
            ends.feed(&chunk[..n], &mut out, |out| {
                let text = LOG.locked().end();
                if let Some(text) = text {
                    memlab_core::output::emit_or(&text, |text| out.extend_from_slice(text.as_bytes()));
                }
            });
            if kernel_out.write_all(&out).is_err() {
                break;
            }
        }
        let _ = kernel_out.write_all(&ends.held);
        OUTPUT_DONE.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Finds evcxr's end-of-cell line in a stream that arrives in pieces.
    #[derive(Default)]
    pub(super) struct EndOfCell {
        /// Bytes at the start of a line that may begin the end-of-cell line.
        pub(super) held: Vec<u8>,
        /// Whether the last byte passed on left a line open.
        mid_line: bool,
    }

    impl EndOfCell {
        /// Appends `bytes` to `out`; at each end-of-cell line, first calls
        /// `at_end` with what `out` holds then, and appends the line after
        /// what it added. Bytes that may begin an end-of-cell line are held
        /// back until the next piece tells.
        pub(super) fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>, mut at_end: impl FnMut(&mut Vec<u8>)) {
            for &b in bytes {
                if !self.held.is_empty() || (!self.mid_line && b == CELL_ENDS[0]) {
                    self.held.push(b);
                    if CELL_ENDS.starts_with(&self.held) {
                        if self.held.len() == CELL_ENDS.len() {
                            at_end(out);
                            out.append(&mut self.held);
                            self.mid_line = false;
                        }
                        continue;
                    }
                    out.append(&mut self.held);
                } else {
                    out.push(b);
                }
                self.mid_line = b != b'\n';
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::EndOfCell;

        /// Feeds `pieces` in order; returns what was passed on, with `#`
        /// where each end of a cell was handled, and what is held back.
        fn run(pieces: &[&str]) -> (String, String) {
            let mut ends = EndOfCell::default();
            let mut all = Vec::new();
            for piece in pieces {
                ends.feed(piece.as_bytes(), &mut all, |out| out.push(b'#'));
            }
            (String::from_utf8(all).unwrap(), String::from_utf8(ends.held).unwrap())
        }

        #[test]
        fn finds_end_lines_whole_split_and_repeated() {
            let end = "EVCXR_EXECUTION_COMPLETE\n";
            assert_eq!(run(&["a\n", end]), (format!("a\n#{end}"), String::new()));
            assert_eq!(run(&["a\nEVCXR_EXEC", "UTION_COMPLETE\nb\n"]), (format!("a\n#{end}b\n"), String::new()));
            assert_eq!(run(&[end, end]), (format!("#{end}#{end}"), String::new()));
            // Byte by byte.
            let bytes: Vec<String> = format!("x\n{end}").chars().map(String::from).collect();
            let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
            assert_eq!(run(&pieces), (format!("x\n#{end}"), String::new()));
        }

        #[test]
        fn leaves_everything_else_as_it_came() {
            // Not at the start of a line, cut short, or another line that
            // begins alike: passed on, in order.
            for text in [
                "say EVCXR_EXECUTION_COMPLETE\n",
                "EVCXR_EXECUTION_COMPLETED\n",
                "EVCXR_BEGIN_CONTENT text/plain\nE\nEVCXR_END_CONTENT\n",
                "EEVCXR\nEpoch 1\n",
            ] {
                assert_eq!(run(&[text]), (text.to_string(), String::new()), "{text}");
            }
            // A line that may yet become the end is held until it is told.
            assert_eq!(run(&["a\nEVCXR_EX"]), ("a\n".to_string(), "EVCXR_EX".to_string()));
            assert_eq!(run(&["a\nEVCXR_EX", "IT\n"]), ("a\nEVCXR_EXIT\n".to_string(), String::new()));
        }
    }
}
