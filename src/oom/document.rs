//! The report of a failure as a document: its fields, its text (and HTML)
//! rendering, its JSON, and the files it is written to.

use std::path::{Path, PathBuf};

use memlab_core::events::{self, Frame};
use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::sync::LockExt;
use memlab_core::{Device, Error, Result};
use serde::Serialize;

use super::capture::{fits, room};
use super::{Diagnosis, Holders};
use crate::diagnosis::SMALL_SEGMENT;
use crate::named::Model;

/// A part of a report that memory did not suffice for.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct LeftOut {
    /// What was left out: a section of the text report, or a file.
    pub part: String,
    /// The file it would have been, for files.
    pub file: Option<PathBuf>,
    /// What it would have taken, estimated from the recording's size (an
    /// upper estimate; see BENCHMARKS.md).
    pub needed_estimate: u64,
    /// What this process could still obtain then: the host's free memory,
    /// or what its address-space or cgroup limit left.
    pub available: u64,
}

/// The thread a request failed on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailingThread {
    /// memlab's number for it (as in the recording's events).
    pub number: u64,
    /// Its name, if it has one.
    pub name: Option<String>,
}

/// One out-of-memory failure, as the recorder wrote it.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct OomReport {
    /// Its number in this process (1 for the first).
    pub number: u64,
    /// The process.
    pub pid: u32,
    /// The host's name.
    pub host: String,
    /// When the process started, in UTC (`YYYY-MM-DD HH:MM:SS`), where the
    /// kernel tells.
    pub process_start: Option<String>,
    /// When, in UTC (`YYYY-MM-DD HH:MM:SS.mmm`).
    pub time: String,
    /// When, in microseconds since the Unix epoch (what `memlab merge`
    /// places the failure by).
    pub time_unix_us: u64,
    /// The process among the run's: rank and world size, libtorch's
    /// version, the CUDA devices' UUIDs, the wall-clock time of the
    /// recording's clock zero.
    pub run: memlab_core::run::RunInfo,
    /// The failing thread.
    pub thread: FailingThread,
    /// The request, the figures and the verdict.
    pub diagnosis: Diagnosis,
    /// CUDA: the failing thread's current stream.
    pub stream: Option<u64>,
    /// The profiled statement that was running, if any.
    pub statement: Option<String>,
    /// The user's Rust frames of the failing call, innermost first.
    pub frames: Vec<Frame>,
    /// What held the memory.
    pub holders: Holders,
    /// Why a driver figure is missing, where one is.
    pub missing: Vec<String>,
    /// CUDA failures the allocator counted before memlab's observer was on.
    pub missed_before: Option<u64>,
    /// Address space the reserve gave back for this report.
    pub reserve: u64,
    /// Whether a section of the text report was left out for want of memory.
    pub partial: bool,
    /// What memory did not suffice for: sections and files.
    pub left_out: Vec<LeftOut>,
    /// The files written.
    pub files: Vec<PathBuf>,
    /// Files that could not be written, and why.
    pub file_errors: Vec<String>,
}

/// Writes `bytes` into `file`, a report's file created for them.
fn write_to(mut file: std::fs::File, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    file.write_all(bytes).map_err(|e| Error::io("write an out-of-memory report's file", e))
}

/// `name` with only what file names take everywhere: letters, digits, `.`,
/// `-` and `_`.
fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect()
}

/// `dir/stem.extension`. Not `Path::with_extension`: a stem may hold dots
/// (a host `node1.cluster`), which that would take for an extension.
fn report_file(dir: &Path, stem: &str, extension: &str) -> PathBuf {
    dir.join(format!("{stem}.{extension}"))
}

memlab_core::process::process_wide! {
    /// This process's tag in its reports' names, once another process's
    /// report had taken one of them: the same for every later report, so
    /// that a process's reports stay together.
    static TAG: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
}

/// Eight hexadecimal digits no other process can predict: std's hasher
/// keys come from the system's random source, once per process.
fn random_tag() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    format!("{:08x}", hasher.finish() as u32)
}

impl OomReport {
    /// The reports' common file name, without extension:
    /// `memlab_oom_<host>_<start>_<pid>_<n>`, then `_rank<N>` for a rank;
    /// with a `tag`, `<pid>-<tag>`.
    fn base_name(&self, tag: Option<&str>) -> String {
        let start = self.process_start.as_deref().map_or_else(
            || "unknown".to_string(),
            |s| {
                s.chars().filter(char::is_ascii_digit).enumerate().fold(String::new(), |mut out, (i, c)| {
                    if i == 8 {
                        out.push('T');
                    }
                    out.push(c);
                    out
                })
            },
        );
        let rank = self.run.file_suffix();
        let tag = tag.map(|t| format!("-{t}")).unwrap_or_default();
        format!("memlab_oom_{}_{start}_{}{tag}_{}{rank}", file_safe(&self.host), self.pid, self.number)
    }

    /// Creates the text report's file under a name no file has, and
    /// returns the name (without extension) and the file. The name is the
    /// usual one unless another process's report took it (two containers'
    /// pid 1, started in one second on hosts of one name, writing to one
    /// directory): then this process's names carry a random tag from then
    /// on, drawn again while the name is taken. Created exclusively, so of
    /// two processes that race for a name, one gets it and the other draws.
    fn claim(&mut self, dir: &Path) -> Option<(String, std::fs::File)> {
        let mut tag = TAG.locked().clone();
        for _ in 0..16 {
            let stem = self.base_name(tag.as_deref());
            let path = report_file(dir, &stem, "txt");
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => {
                    if tag.is_some() {
                        *TAG.locked() = tag;
                    }
                    return Some((stem, file));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => tag = Some(random_tag()),
                Err(e) => {
                    self.file_errors.push(format!("{}: {e}", path.display()));
                    return None;
                }
            }
        }
        self.file_errors.push(format!(
            "{}: every name tried was taken; the report is not written to a file",
            report_file(dir, &self.base_name(None), "txt").display()
        ));
        None
    }

    /// Writes the text report and its JSON first, then, while a recording
    /// runs, its HTML report and PyTorch snapshot where the memory left
    /// suffices for them, then the text and JSON again with the final list
    /// of files. Every file is created anew (never overwriting one);
    /// failures to write are kept, never raised.
    pub(super) fn write(&mut self, dir: &Path, sources: &Model) {
        let (stem, text_file) = match self.claim(dir) {
            Some((stem, file)) => (stem, Some(file)),
            None => (self.base_name(None), None),
        };
        let (text_path, json_path) = (report_file(dir, &stem, "txt"), report_file(dir, &stem, "json"));
        let mut reports = [(text_file, text_path), (self.create(&json_path), json_path)];
        for (file, path) in &reports {
            if file.is_some() {
                self.files.push(path.clone());
            }
        }
        for busy in sources.busy() {
            if !self.holders.busy.contains(&busy) {
                self.holders.busy.push(busy);
            }
        }
        self.rewrite(&mut reports);
        if !events::is_active() {
            return;
        }
        let sources = Model::registered_now();
        let exports = [
            ("the HTML report", "html", crate::capture::estimate::html()),
            ("the PyTorch memory snapshot", "pickle", crate::capture::estimate::snapshot()),
        ];
        for (part, extension, needed) in exports {
            let path = report_file(dir, &stem, extension);
            let available = room();
            if !fits(needed, available) {
                self.left_out.push(LeftOut {
                    part: part.to_string(),
                    file: Some(path),
                    needed_estimate: needed,
                    available: available.unwrap_or(0),
                });
                continue;
            }
            let Some(file) = self.create(&path) else { continue };
            let written = if extension == "html" {
                crate::capture::html::capture(&sources).and_then(|r| write_to(file, r.to_page().as_bytes()))
            } else {
                crate::capture::snapshot::capture(&sources)
                    .and_then(|s| s.to_pickle())
                    .and_then(|bytes| write_to(file, &bytes))
            };
            match written {
                Ok(()) => self.files.push(path),
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    self.file_errors.push(format!("{}: {e}", path.display()));
                }
            }
        }
        for busy in sources.busy() {
            if !self.holders.busy.contains(&busy) {
                self.holders.busy.push(busy);
            }
        }
        self.rewrite(&mut reports);
    }

    /// Creates `path` for this report; `None`, with the reason kept, when it
    /// cannot be created or exists already (a report never replaces a file).
    fn create(&mut self, path: &Path) -> Option<std::fs::File> {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(file) => Some(file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                self.file_errors.push(format!("{}: a file of that name exists; it is left as it is", path.display()));
                None
            }
            Err(e) => {
                self.file_errors.push(format!("{}: {e}", path.display()));
                None
            }
        }
    }

    /// Writes the text report and its JSON (from the start) into the files
    /// made for them; a file that cannot be written is left out from then on,
    /// with the reason kept.
    fn rewrite(&mut self, reports: &mut [(Option<std::fs::File>, PathBuf); 2]) {
        use std::io::{Seek, Write};
        let contents = [self.to_text(), self.to_json()];
        for ((file, path), text) in reports.iter_mut().zip(contents) {
            let Some(open) = file.as_mut() else { continue };
            let done = open.set_len(0).and_then(|()| open.rewind()).and_then(|()| open.write_all(text.as_bytes()));
            if let Err(e) = done {
                *file = None;
                self.files.retain(|f| f != path);
                self.file_errors.push(format!("{}: {e}", path.display()));
            }
        }
    }

    /// The report as JSON: every field of [`OomReport`], the verdict as
    /// `snake_case` (`request_exceeds_device`, ...).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The one paragraph the recorder prints.
    pub fn summary(&self) -> String {
        let d = &self.diagnosis;
        let free = d.figures.device.map(|m| format!(", {} free on {}", Cell::bytes(m.free), d.device));
        let place = self.statement.clone().or_else(|| self.frames.first().map(Frame::to_string));
        let mut text = format!(
            "memlab: out of memory on {}: {} requested{}{}. Verdict: {}. ",
            d.device,
            Cell::bytes(d.requested),
            free.unwrap_or_default(),
            place.map(|p| format!(" at {p}")).unwrap_or_default(),
            d.verdict.title()
        );
        match self.files.first() {
            Some(first) => {
                text.push_str(&format!("Report: {}", first.display()));
                let others: Vec<String> = self.files[1..]
                    .iter()
                    .filter_map(|f| f.extension().map(|e| e.to_string_lossy().into_owned()))
                    .collect();
                if !others.is_empty() {
                    text.push_str(&format!(" (and .{})", others.join(", .")));
                }
                text.push('.');
            }
            None => text.push_str(&format!("The report could not be written: {}.", self.file_errors.join("; "))),
        }
        if !self.left_out.is_empty() {
            let parts: Vec<&str> = self.left_out.iter().map(|l| l.part.as_str()).collect();
            text.push_str(&format!(" Left out for want of memory: {}.", parts.join(", ")));
        }
        text.push('\n');
        text
    }
}

displayed_as_text!(OomReport);

impl Render for OomReport {
    fn document(&self) -> Document {
        const W: usize = 44;
        let d = &self.diagnosis;
        let b = |n: u64| Cell::bytes(n);
        let mut doc = Document::new();
        doc.banner(format!("memlab: out of memory on {} (report {} of process {})", d.device, self.number, self.pid));
        let thread = match &self.thread.name {
            Some(name) => format!("thread {} ({name})", self.thread.number),
            None => format!("thread {}", self.thread.number),
        };
        doc.line(format!("{} UTC, {thread}", self.time));
        let started = self.process_start.as_deref().map(|s| format!(", started {s} UTC")).unwrap_or_default();
        doc.line(format!("process {} on {}{started}", self.pid, self.host));
        // Which process of the run, for `memlab merge` and for people.
        let mut run: Vec<String> = Vec::new();
        if let Some(rank) = self.run.rank {
            let of = self.run.world_size.map(|n| format!(" of {n}")).unwrap_or_default();
            run.push(format!("rank {rank}{of}"));
        }
        run.extend(self.run.libtorch.as_deref().map(|l| format!("libtorch {l}")));
        for d in &self.run.devices {
            run.push(format!("{} {}", d.device, d.uuid.as_deref().unwrap_or("(no UUID)")));
        }
        let zero = self.run.clock_zero_unix_us;
        run.push(format!(
            "recording's clock zero {} UTC",
            memlab_core::time::utc(zero / 1_000_000, ((zero / 1000) % 1000) as u32)
        ));
        doc.line(run.join("; "));
        if self.partial {
            doc.line("This report is partial: memory did not suffice for all of it (see \"Left out\" below).");
        }
        doc.blank();
        doc.label(W, "Requested", b(d.requested));
        let how = if d.rounded {
            "as the CUDA caching allocator rounded the request to the segment it tried to reserve"
        } else {
            "as asked"
        };
        doc.indented(2, format!("{} bytes, {how}", d.requested));
        if let Some(stream) = self.stream {
            doc.indented(2, format!("on the thread's current stream {stream:#x}"));
        }
        match &self.statement {
            Some(st) => doc.line(format!("While running {st}")),
            None => doc.line("No profiled statement was running (#[memlab::profile] names the line)."),
        };
        if !self.frames.is_empty() {
            doc.line("The failing call, innermost first:");
            for f in &self.frames {
                doc.indented(2, f.to_string());
            }
        }
        doc.blank();
        doc.append(Render::document(d));
        doc.blank();
        doc.heading(format!("Allocator ({})", d.device));
        doc.label(W, "allocated (live tensors)", Cell::bytes(d.figures.allocated));
        doc.label(W, "reserved", Cell::bytes(d.figures.reserved));
        if matches!(d.device, Device::Cuda(_)) {
            let c = d.figures.cache_free;
            let pool = if d.requested == SMALL_SEGMENT { "small" } else { "large" };
            doc.label(W, "free in the cache", b(c.bytes));
            doc.indented(2, format!("that could serve this request: its stream's free blocks of the {pool} pool"));
            doc.label(W, "largest free block", b(c.largest_block));
            doc.label(W, "fragmentation", b(d.figures.fragmentation()));
            let share = d.figures.fragmentation_share().map(|s| format!(", {:.0}% of it", s * 100.0));
            doc.indented(2, format!("free in the cache minus its largest free block{}", share.unwrap_or_default()));
        } else {
            doc.indented(2, "the CPU allocator keeps no cache: what is freed goes back at once");
        }
        if let Some(n) = self.missed_before.filter(|n| *n > 0) {
            doc.indented(2, format!("{n} earlier failure(s) happened before memlab watched this allocator"));
        }
        doc.blank();
        let source = if matches!(d.device, Device::Cuda(_)) { "driver" } else { "kernel" };
        doc.heading(format!("Device ({source})"));
        match d.figures.device {
            Some(m) => {
                doc.label(W, "free", b(m.free));
                doc.label(W, "total", b(m.total));
                if let Some(limit) = m.limit {
                    doc.indented(2, format!("what {} allows this process", limit.describe()));
                }
                if let Some(this) = m.this_process {
                    doc.label(
                        W,
                        if source == "driver" { "this process (NVML)" } else { "this process (resident set)" },
                        b(this),
                    );
                }
                if let Some(others) = m.other_processes {
                    doc.label(W, "other processes (NVML)", b(others));
                }
            }
            None => {
                doc.indented(2, "not read");
            }
        }
        for why in &self.missing {
            doc.indented(2, format!("not read: {why}"));
        }
        doc.blank();
        doc.heading("What holds the memory");
        let h = &self.holders;
        doc.label(W, "named", b(h.named_bytes));
        doc.indented(2, "registered var stores, their gradients, optimizer state and tensors, by name:");
        if !h.named.is_empty() {
            let mut table = Table::new(vec![
                Column::new("name", Layout::Text).max_width(70),
                Column::new("kind", Layout::Text),
                Column::new("bytes", Layout::Figure).min_width(9),
            ]);
            for n in &h.named {
                table.row([Cell::text(&n.name), Cell::text(n.kind.to_string()), b(n.bytes)]);
            }
            if h.named_rest.count > 0 {
                table.row([
                    Cell::text(format!("{} more, each smaller", h.named_rest.count)),
                    Cell::Empty,
                    b(h.named_rest.bytes),
                ]);
            }
            doc.table(table);
        }
        for busy in &h.busy {
            doc.indented(2, format!("not walked: {busy}"));
        }
        doc.label(W, "not named", Cell::bytes(h.not_named));
        match &h.by_site {
            Some(sites) if !sites.is_empty() => {
                let mut table = Table::new(vec![
                    Column::new("where allocated", Layout::Text).max_width(90),
                    Column::new("blocks", Layout::Figure),
                    Column::new("bytes", Layout::Figure).min_width(9),
                ])
                .collapsed();
                for s in sites {
                    table.row([Cell::text(&s.site), Cell::count(s.blocks), b(s.bytes)]);
                }
                doc.table(table);
                for s in sites.iter().filter(|s| s.frames.len() > 1) {
                    doc.indented(2, format!("{}:", s.site));
                    for f in &s.frames {
                        doc.indented(4, f.to_string());
                    }
                }
            }
            Some(_) => {
                doc.indented(2, "no live allocation the recording saw is unnamed");
            }
            None if self.left_out.iter().any(|l| l.file.is_none()) => {
                doc.indented(2, "by where they were allocated: left out for want of memory (see below)");
            }
            None => {
                doc.indented(
                    2,
                    "start a memlab::Recording (with backtraces) to list these by where they were allocated",
                );
            }
        }
        if h.rounding > 0 {
            doc.indented(2, format!("of which {} is the allocator's rounding of blocks", Cell::bytes(h.rounding)));
        }
        doc.blank();
        if !self.files.is_empty() {
            let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
            doc.line(format!("Files: {}", files.join(", ")));
        }
        for e in &self.file_errors {
            doc.line(format!("Not written: {e}"));
        }
        if self.reserve > 0 {
            doc.line(format!("The recorder's reserve gave back {} of address space for this report.", b(self.reserve)));
        }
        if !self.left_out.is_empty() {
            doc.blank();
            doc.heading("Left out");
            for l in &self.left_out {
                let file = l.file.as_ref().map(|f| format!(" ({})", f.display())).unwrap_or_default();
                doc.indented(
                    2,
                    format!(
                        "{}{file}: needs about {} (estimated), {} could still be obtained",
                        l.part,
                        b(l.needed_estimate),
                        b(l.available)
                    ),
                );
            }
            doc.indented(2, "a larger OomRecorder::reserve (or a smaller recording) makes room for them");
        }
        doc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_with_dots_keeps_the_whole_name() {
        let dir = Path::new("/reports");
        let stem = "memlab_oom_node1.cluster.example_20261126T061827_1_1_rank0";
        assert_eq!(report_file(dir, stem, "json"), dir.join(format!("{stem}.json")));
        assert_ne!(
            Path::new(stem).with_extension("json"),
            Path::new(&format!("{stem}.json")),
            "why not with_extension"
        );
    }

    #[test]
    fn tags_differ() {
        let tags: std::collections::HashSet<String> = (0..64).map(|_| random_tag()).collect();
        assert_eq!(tags.len(), 64);
        assert!(tags.iter().all(|t| t.len() == 8 && t.chars().all(|c| c.is_ascii_hexdigit())));
    }
}
