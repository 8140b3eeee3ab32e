//! The out-of-memory report as a file model: what the recorder writes
//! (`memlab_oom_….json`, and its text) and what `memlab merge` reads back.
//! The `memlab` crate fills it on the failing thread and writes its files;
//! everything here is data, its renderings and its reading.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{MemoryFigures, Verdict};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::Frame;
use crate::render::{Cell, Column, Document, Layout, Render, Table};
use crate::run::RunInfo;

/// The segment libtorch's CUDA allocator reserves for a small request
/// (one of at most 1 MiB): a failure of this size was in the small pool.
pub const SMALL_SEGMENT: u64 = 2 << 20;

/// Why a request failed: the request, the device's figures then, and the verdict.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Where.
    pub device: Device,
    /// The bytes the allocator tried to obtain (see [`rounded`](Self::rounded)).
    pub requested: u64,
    /// True on CUDA: `requested` is the caching allocator's rounding of the
    /// request to the segment it tried to reserve, not the tensor's bytes.
    pub rounded: bool,
    /// The device's memory at the failure.
    pub figures: MemoryFigures,
    /// Why it failed.
    pub verdict: Verdict,
    /// The verdict in words, with its figures and what to do.
    pub advice: String,
}

/// A named storage holding memory when the request failed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamedHolder {
    /// Its name (the first of its views, with how many more there are).
    pub name: String,
    /// What it is.
    pub kind: crate::kind::TensorKind,
    /// Its bytes.
    pub bytes: u64,
}

/// Unnamed live allocations from one site.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SiteHolder {
    /// The user's frame or profiled statement that made them.
    pub site: String,
    /// Their bytes.
    pub bytes: u64,
    /// How many.
    pub blocks: u64,
    /// The user's frames of one of them, innermost first, when recorded with backtraces.
    #[serde(default)]
    pub frames: Vec<Frame>,
}

impl Holders {
    /// The `n` largest holders, named or by site, largest first: a name
    /// with its kind, or a site, and its bytes.
    pub fn largest(&self, n: usize) -> Vec<(String, u64)> {
        let mut largest: Vec<(String, u64)> =
            self.named.iter().take(n).map(|h| (format!("{} ({})", h.name, h.kind), h.bytes)).collect();
        largest.extend(self.by_site.iter().flatten().take(n).map(|s| (s.site.clone(), s.bytes)));
        largest.sort_by_key(|(_, bytes)| std::cmp::Reverse(*bytes));
        largest.truncate(n);
        largest
    }
}

/// Named storages beyond those a report lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedRest {
    /// How many.
    pub count: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// What held the device's memory when the request failed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Holders {
    /// Bytes of the named storages.
    pub named_bytes: u64,
    /// The largest named storages, largest first.
    #[serde(default)]
    pub named: Vec<NamedHolder>,
    /// Named storages beyond those listed.
    pub named_rest: NamedRest,
    /// Var stores (or the registry) the walk passed by because a lock on
    /// them was held, by this thread or another.
    #[serde(default)]
    pub busy: Vec<String>,
    /// Allocated bytes no named storage accounts for.
    pub not_named: i64,
    /// While a recording runs: the unnamed allocations by site, largest
    /// first (`None` also when memory did not suffice to list them: see
    /// [`OomReport::left_out`]).
    #[serde(default)]
    pub by_site: Option<Vec<SiteHolder>>,
    /// CUDA: what the allocator added by rounding blocks up (part of `not_named`).
    pub rounding: i64,
    /// CUDA: the workspaces libtorch keeps for cuBLAS and cuBLASLt, read
    /// from its own tables (part of `not_named`), largest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workspaces: Vec<WorkspaceHolder>,
}

/// A workspace libtorch keeps for a library on the failing device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceHolder {
    /// `cuBLAS workspace (handle 0x…, stream 0x…)`.
    pub name: String,
    /// What its block was asked for.
    pub bytes: u64,
}

/// A part of a report that memory did not suffice for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeftOut {
    /// What was left out: a section of the text report, or a file.
    pub part: String,
    /// The file it would have been, for files.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// What it would have taken, estimated from the recording's size (an
    /// upper estimate; see BENCHMARKS.md).
    pub needed_estimate: u64,
    /// What this process could still obtain then: the host's free memory,
    /// or what its address-space or cgroup limit left.
    pub available: u64,
}

/// The thread a request failed on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailingThread {
    /// memlab's number for it (as in the recording's events).
    pub number: u64,
    /// Its name, if it has one.
    #[serde(default)]
    pub name: Option<String>,
}

/// One out-of-memory failure, as the recorder wrote it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OomReport {
    /// Its number in this process (1 for the first).
    pub number: u64,
    /// The process.
    pub pid: u32,
    /// The host's name.
    pub host: String,
    /// When the process started, in UTC (`YYYY-MM-DD HH:MM:SS`), where the
    /// kernel tells.
    #[serde(default)]
    pub process_start: Option<String>,
    /// When, in UTC (`YYYY-MM-DD HH:MM:SS.mmm`).
    pub time: String,
    /// When, in microseconds since the Unix epoch (what `memlab merge`
    /// places the failure by).
    pub time_unix_us: u64,
    /// The process among the run's: rank and world size, libtorch's
    /// version, the CUDA devices' UUIDs, the wall-clock time of the
    /// recording's clock zero.
    pub run: RunInfo,
    /// The failing thread.
    pub thread: FailingThread,
    /// The request, the figures and the verdict.
    pub diagnosis: Diagnosis,
    /// CUDA: the failing thread's current stream.
    #[serde(default)]
    pub stream: Option<u64>,
    /// The profiled statement that was running, if any.
    #[serde(default)]
    pub statement: Option<String>,
    /// The user's Rust frames of the failing call, innermost first.
    #[serde(default)]
    pub frames: Vec<Frame>,
    /// What held the memory.
    pub holders: Holders,
    /// Why a driver figure is missing, where one is.
    #[serde(default)]
    pub missing: Vec<String>,
    /// CUDA failures the allocator counted before memlab's observer was on.
    #[serde(default)]
    pub missed_before: Option<u64>,
    /// Address space the reserve gave back for this report.
    pub reserve: u64,
    /// Whether a section of the text report was left out for want of memory.
    #[serde(default)]
    pub partial: bool,
    /// What memory did not suffice for: sections and files.
    #[serde(default)]
    pub left_out: Vec<LeftOut>,
    /// The files written.
    #[serde(default)]
    pub files: Vec<PathBuf>,
    /// Files that could not be written, and why.
    #[serde(default)]
    pub file_errors: Vec<String>,
    /// CUDA, while a recording ran: its history replayed through the model
    /// of the caching allocator under the settings people try, on the
    /// memory the allocator had when it failed: which setting would have
    /// avoided this failure. Figures replayed, not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<crate::replay::Replayed>,
    /// CUDA: the process's allocator settings, as `PYTORCH_CUDA_ALLOC_CONF`
    /// writes what libtorch held (`""`: its defaults), where they could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_settings: Option<String>,
    /// CUDA: what the report advises about the allocator's settings,
    /// decided after the replay where a recording ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings_advice: Option<super::SettingsAdvice>,
}

/// `name` with only what file names take everywhere: letters, digits, `.`,
/// `-` and `_`.
fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect()
}

impl OomReport {
    /// The reports' common file name, without extension:
    /// `memlab_oom_<host>_<start>_<pid>_<n>`, then `_rank<N>` for a rank;
    /// with a `tag`, `<pid>-<tag>`.
    pub fn file_stem(&self, tag: Option<&str>) -> String {
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

    /// A report read back from the JSON [`Render::to_json`] writes (the
    /// `.json` beside every text report: every field, the verdict as
    /// `snake_case`, `request_exceeds_device`).
    pub fn from_json(json: &str) -> Result<OomReport> {
        serde_json::from_str(json).map_err(|e| {
            Error::InvalidArgument(format!(
                "not an out-of-memory report memlab wrote ({e}); give the report's `.json` file, unchanged"
            ))
        })
    }

    /// The report in the JSON file `path`.
    pub fn read(path: impl AsRef<Path>) -> Result<OomReport> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        OomReport::from_json(&text)
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

crate::render::displayed_as_text!(OomReport);

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
            crate::time::utc(zero / 1_000_000, ((zero / 1000) % 1000) as u32)
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
        self.settings_advice_document(&mut doc);
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
        for w in &h.workspaces {
            doc.indented(2, format!("of which {}: {}", w.name, Cell::bytes(w.bytes)));
        }
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
        if let Some(replayed) = &self.replay {
            doc.blank();
            doc.heading("Would another allocator setting have avoided it?");
            doc.line(
                "The recording replayed through memlab's model of libtorch's caching allocator, on the memory it \
                 had when it failed (figures replayed, not measured):",
            );
            for d in &replayed.devices {
                doc.table(d.outcomes());
                doc.append(d.verdict());
            }
            doc.line("`memlab replay` on the snapshot adds each setting's fragmentation at its peak.");
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

impl OomReport {
    /// The report's HTML page: the report first (the verdict, the advice,
    /// what held the memory, the replay), then the recording's own report
    /// (its summary, memory over time, what was live at the peak), where a
    /// recording ran. One file, styles inline, nothing fetched.
    pub fn to_page(&self, recording: Option<&crate::export::HtmlReport>) -> String {
        let mut doc = Document::new();
        doc.title("memlab: out-of-memory report");
        doc.append(self.document());
        if let Some(recording) = recording {
            // It opens with its own title, its summary's.
            doc.append(recording.document());
        }
        doc.to_page(&format!("memlab: out of memory on {} (report {})", self.diagnosis.device, self.number))
    }

    /// The advice on the allocator's settings, right after the verdict's.
    fn settings_advice_document(&self, doc: &mut Document) {
        use super::SettingsAdvice;
        let Some(advice) = &self.settings_advice else {
            if let Some(conf) = self.allocator_settings.as_deref().filter(|c| !c.is_empty()) {
                doc.line(format!("This process runs with PYTORCH_CUDA_ALLOC_CONF={conf}."));
            }
            return;
        };
        let named = |conf: &str| {
            if conf.is_empty() {
                "libtorch's default settings (PYTORCH_CUDA_ALLOC_CONF unset)".to_string()
            } else {
                format!("PYTORCH_CUDA_ALLOC_CONF={conf}")
            }
        };
        let process = self.allocator_settings.as_deref().map(|c| format!(" (this process: {})", named(c)));
        doc.blank();
        doc.heading(format!("Allocator settings{}", process.unwrap_or_default()));
        match advice {
            SettingsAdvice::Replayed { avoiding } => {
                for a in avoiding {
                    doc.line(format!(
                        "{} would have avoided this failure: the recording's replay under it runs out of memory \
                         nowhere, with a peak of {} reserved. Set it before the process starts.",
                        named(&a.settings),
                        Cell::bytes(a.peak_reserved)
                    ));
                }
            }
            SettingsAdvice::NoSettingHelps { free, tensors_alone, empty_cache } => {
                doc.line(
                    "No allocator setting avoids this failure: the recording's replay runs out of memory under \
                     each one tried (the table below). What would:",
                );
                if *tensors_alone {
                    doc.indented(2, format!("free at least {} of tensors before this request", Cell::bytes(*free)));
                } else {
                    doc.indented(
                        2,
                        format!(
                            "free tensors so that the allocator can give back at least {} of its segments for this \
                             request (a segment goes back only when no tensor uses it)",
                            Cell::bytes(*free)
                        ),
                    );
                }
                let largest = self.holders.largest(3);
                if !largest.is_empty() {
                    let list: Vec<String> = largest.iter().map(|(n, b)| format!("{n}: {}", Cell::bytes(*b))).collect();
                    doc.indented(2, format!("the largest holders: {}", list.join("; ")));
                }
                if let Some(p) = empty_cache {
                    doc.indented(
                        2,
                        format!(
                            "or memlab::gpu::empty_cache() before history entry {} (+{:.3}s{}, {} allocated then): \
                             the replay with it there runs out of memory nowhere",
                            p.entry,
                            p.time_us as f64 / 1e6,
                            p.site.as_ref().map(|s| format!(", where {s} allocates")).unwrap_or_default(),
                            Cell::bytes(p.allocated)
                        ),
                    );
                }
            }
            SettingsAdvice::NotReproduced => {
                doc.line(
                    "The recording's replay under this process's settings does not reproduce the failure, so it \
                     backs no setting.",
                );
            }
            SettingsAdvice::WentOnAfterError { entry } => {
                doc.line(format!(
                    "The program caught an earlier out-of-memory error (history entry {entry}) and went on: what \
                     it asked for after it depended on that error, which another setting would move, so the \
                     recording's replay backs no setting."
                ));
            }
            SettingsAdvice::Untested { setting } => {
                doc.line(format!(
                    "Untested: {} may avoid it (segments then grow instead of splitting). No recording ran, so it was \
                 not replayed: start a memlab::Recording before the failing code and the next report replays it \
                 under the settings people try, or run `memlab replay SNAPSHOT --compare` on a recording \
                 (memlab's, or PyTorch's torch.cuda.memory._record_memory_history).",
                    named(setting)
                ));
            }
        }
    }
}

crate::render::displayed_as_text!(Diagnosis);

impl Render for Diagnosis {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.heading(format!("Verdict: {}", self.verdict.title()));
        doc.line(self.advice.clone());
        doc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report memlab's CPU run wrote for rank 1 (`fixtures/`).
    fn fixture() -> OomReport {
        OomReport::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/memlab_oom_rank1.json")).unwrap()
    }

    #[test]
    fn a_report_reads_back_as_it_was_written() {
        let report = fixture();
        assert_eq!((report.number, report.pid, report.run.rank), (1, 9137, Some(1)));
        assert_eq!((report.diagnosis.device, report.diagnosis.requested), (Device::Cpu, 1 << 48));
        assert_eq!(report.diagnosis.verdict, Verdict::RequestExceedsDevice);
        let again = OomReport::from_json(&report.to_json()).unwrap();
        assert_eq!(again.to_json(), report.to_json());
        assert_eq!(again.to_text(), report.to_text());
        let as_written: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/memlab_oom_rank1.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&report.to_json()).unwrap(), as_written, "nothing lost");
    }

    #[test]
    fn a_report_with_a_replay_says_which_setting_avoids_the_failure_and_reads_back() {
        // PyTorch's recording of a fragmentation failure on an H100 under a
        // 1.5 GiB memory fraction (fixtures/replay), as the report of a
        // CUDA failure would carry its replay.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/replay/fragmentation__default.pickle");
        let file = crate::export::Snapshot::read_pickle(path).unwrap();
        let options = crate::replay::ReplayOptions {
            fraction: Some(0.01894448624181354),
            total: Some(85_017_493_504),
            compare: true,
            ..Default::default()
        };
        let mut report = fixture();
        report.replay = Some(crate::replay::replay_snapshot("the recording", &file.snapshot, &options).unwrap());
        let text = report.to_text();
        assert!(text.contains("Would another allocator setting have avoided it?"), "{text}");
        for mss in [64, 128, 512] {
            let line = format!(
                "max_split_size_mb:{mss} would have avoided the error at history entry 204, with a peak of 1.50G reserved."
            );
            assert!(text.contains(&line), "{line}\n{text}");
        }
        assert!(!text.contains("expandable_segments:True would have"), "{text}");
        // Each setting's replayed peak, as the GPU had them under each (fixtures/replay/results.jsonl).
        let rows: Vec<String> = text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        for row in [
            "default (recorded) 1.00G yes, at history entry 204",
            "expandable_segments:True 1.02G yes, at history entry 204",
            "max_split_size_mb:128 1.50G no",
            "garbage_collection_threshold:0.6 1.00G yes, at history entry 204",
        ] {
            assert!(rows.iter().any(|r| r == row), "{row}\n{text}");
        }
        // The settings advice follows the replay: the three settings it
        // backs, and never expandable segments, which it refutes.
        let process = crate::replay::AllocatorConfig::default();
        report.allocator_settings = Some(String::new());
        report.settings_advice = super::super::advise_settings(
            report.diagnosis.verdict,
            false,
            &process,
            Some((&file.snapshot, report.replay.as_ref().unwrap())),
            "cuda:0",
        );
        let advised = report.to_text();
        for mss in [64, 128, 512] {
            let line = format!("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{mss} would have avoided this failure");
            assert!(advised.contains(&line), "{line}\n{advised}");
        }
        assert!(!advised.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would"), "{advised}");
        assert!(advised.contains("Allocator settings (this process: libtorch's default settings"), "{advised}");
        let again = OomReport::from_json(&report.to_json()).unwrap();
        assert_eq!(again.to_text(), advised, "the replay and the advice read back as they were written");
    }

    /// The H200's recording of a program that caught an out-of-memory error
    /// and went on (`fixtures/replay/caught__default.pickle`), carried by a
    /// report: its text and its page both say the program went on, at
    /// which entry, and that no setting is backed; the JSON keeps it.
    #[test]
    fn a_report_of_a_program_that_went_on_after_an_error_says_so_in_every_file() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/replay/caught__default.pickle");
        let file = crate::export::Snapshot::read_pickle(path).unwrap();
        let options = crate::replay::ReplayOptions {
            fraction: Some(0.021459116915775848),
            total: Some(150_109_880_320),
            compare: true,
            ..Default::default()
        };
        let mut report = fixture();
        report.replay = Some(crate::replay::replay_snapshot("the recording", &file.snapshot, &options).unwrap());
        report.allocator_settings = Some(String::new());
        report.settings_advice = super::super::advise_settings(
            Verdict::Fragmentation,
            false,
            &crate::replay::AllocatorConfig::default(),
            Some((&file.snapshot, report.replay.as_ref().unwrap())),
            "cuda:0",
        );
        let first = file.snapshot.device_traces[0].iter().position(|e| e.action == crate::events::Action::Oom).unwrap();
        let line = format!("The program caught an earlier out-of-memory error (history entry {first}) and went on");
        let text = report.to_text();
        assert!(text.contains(&line), "{line}\n{text}");
        assert!(text.contains("backs no setting"), "{text}");
        assert!(
            !text.contains("would have avoided this failure"),
            "nothing advised from a replay that went on: {text}"
        );
        let page = report.to_page(None);
        assert!(page.contains(&line), "the page says it too");
        let again = OomReport::from_json(&report.to_json()).unwrap();
        assert_eq!(again.settings_advice, Some(super::super::SettingsAdvice::WentOnAfterError { entry: first }));
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["replay"]["devices"][0]["continued_after_oom"], serde_json::json!(first));
    }

    /// The reports an H200 wrote of a fragmentation failure (8 MiB blocks
    /// until 93% of the device was in use, every other freed, 40 GiB
    /// asked; `tests/cuda/oom.rs`), in a process under libtorch's defaults
    /// and in one under expandable segments, with their recordings
    /// (`fixtures/oom/`). The process under expandable segments was told to
    /// set them, and the default's was told to set them and then that the
    /// replay refuted it. Each report's advice is what its replay backs,
    /// decided again here from its recording; and the GPU agreed with the
    /// replay: PyTorch's runs of the pattern under the three settings ran
    /// out of memory, each (`pytorch_frag93.jsonl`).
    #[test]
    fn the_gpus_fragmentation_reports_advise_only_what_their_replay_backs() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/oom");
        let gpu: Vec<serde_json::Value> = std::fs::read_to_string(format!("{dir}/pytorch_frag93.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(gpu.len(), 3);
        assert!(gpu.iter().all(|run| run["num_ooms"] == 1), "every setting ran out on the GPU");
        for (setting, conf) in [("default", ""), ("expandable", "expandable_segments:True")] {
            let report = OomReport::read(format!("{dir}/frag93_{setting}.json")).unwrap();
            let file = crate::export::Snapshot::read_pickle(format!("{dir}/frag93_{setting}.pickle")).unwrap();
            assert_eq!(report.diagnosis.verdict, Verdict::Fragmentation, "{setting}");
            assert_eq!(report.allocator_settings.as_deref(), Some(conf), "{setting}");
            // The replay again, on the memory the allocator had when it failed.
            let figures = &report.diagnosis.figures;
            let capacity = figures.reserved as u64 + figures.device.unwrap().free;
            let options =
                crate::replay::ReplayOptions { capacity: Some(capacity), compare: true, ..Default::default() };
            let replayed = crate::replay::replay_snapshot("the recording", &file.snapshot, &options).unwrap();
            let (d, written) = (&replayed.devices[0], &report.replay.as_ref().unwrap().devices[0]);
            let outcome = |x: &crate::replay::DeviceReplay| (x.settings.clone(), x.peak_reserved, x.ooms.is_empty());
            let again: Vec<_> = std::iter::once(&d.recorded).chain(&d.replays).map(outcome).collect();
            let then: Vec<_> = std::iter::once(&written.recorded).chain(&written.replays).map(outcome).collect();
            assert_eq!(again, then, "{setting}: the replay is the report's");
            let process = crate::replay::AllocatorConfig::parse(conf).unwrap();
            let advice = super::super::advise_settings(
                Verdict::Fragmentation,
                false,
                &process,
                Some((&file.snapshot, &replayed)),
                "cuda:0",
            );
            assert_eq!(advice, report.settings_advice, "{setting}: the advice follows the replay");
            // No setting avoids it, in the replay as on the GPU.
            let Some(super::super::SettingsAdvice::NoSettingHelps { tensors_alone: false, .. }) = advice else {
                panic!("{setting}: {advice:?}")
            };
            for run in &gpu {
                let row = std::iter::once(&d.recorded).chain(&d.replays).find(|x| d.conf(x) == run["conf"]);
                assert!(
                    row.is_some_and(|x| !x.ooms.is_empty()),
                    "{setting}: {} runs out in the replay too",
                    run["conf"]
                );
            }
            let text = report.to_text();
            assert!(
                !text.contains("Set PYTORCH_CUDA_ALLOC_CONF") && !text.contains("would have avoided this failure"),
                "{text}"
            );
            assert!(text.contains("No allocator setting avoids this failure"), "{text}");
        }
    }

    #[test]
    fn libtorchs_workspaces_are_named_under_not_named_and_read_back() {
        let mut report = fixture();
        report.holders.workspaces =
            vec![WorkspaceHolder { name: "cuBLAS workspace (handle 0x1, stream 0x0)".into(), bytes: 32 << 20 }];
        let text = report.to_text();
        let at = text.find("not named").unwrap();
        assert!(text[at..].contains("of which cuBLAS workspace (handle 0x1, stream 0x0): 32.00M"), "{text}");
        let again = OomReport::from_json(&report.to_json()).unwrap();
        assert_eq!(again.holders.workspaces, report.holders.workspaces);
        assert_eq!(again.to_text(), text);
    }

    #[test]
    fn a_file_that_is_not_a_report_is_refused_saying_what_to_give() {
        let e = OomReport::from_json(r#"{"number": 1}"#).unwrap_err().to_string();
        assert!(e.contains("not an out-of-memory report memlab wrote") && e.contains("missing field"), "{e}");
    }

    #[test]
    fn verdicts_have_one_name() {
        for v in
            [Verdict::RequestExceedsDevice, Verdict::Fragmentation, Verdict::OtherProcesses, Verdict::NotEnoughFree]
        {
            assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{}\"", v.as_str()));
        }
    }
}
