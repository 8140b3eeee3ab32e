//! A report's files, one of every format registered for out-of-memory
//! reports (`memlab_core::format`): the text and JSON of the model
//! (`memlab_core`'s [`OomReport`]), then, while a recording runs, its
//! snapshot and HTML report, under names no other report (of this process
//! or another) has.

use std::path::{Path, PathBuf};

use std::io::Write;

use memlab_core::events;
use memlab_core::export::{HtmlReport, Snapshot, Trace};
use memlab_core::format::{self as format, FileFormat, Source};
use memlab_core::oom::{LeftOut, OomReport};
use memlab_core::sync::LockExt;
use memlab_core::{Backend, Device, Error, Result};
use memlab_tch::BACKEND;

use crate::named::{Model, WeakModel};

/// What this process could still obtain now, in bytes: the host's free
/// memory, or what its address-space or cgroup limit leaves (the reserve,
/// once given back, included); `None` where nothing can be read.
pub(super) fn room() -> Option<u64> {
    BACKEND.device_memory(Device::Cpu).ok().map(|m| m.free)
}

/// Whether a part estimated to take `needed` bytes fits in what is left
/// (with a quarter on top for the allocator's own overhead and the rest
/// of the report); a part fits where nothing can be read.
pub(super) fn fits(needed: u64, available: Option<u64>) -> bool {
    available.is_none_or(|room| needed.saturating_add(needed / 4) <= room)
}

/// `dir/stem.extension`. Not `Path::with_extension`: a stem may hold dots
/// (a host `node1.cluster`), which that would take for an extension.
fn report_file(dir: &Path, stem: &str, extension: &str) -> PathBuf {
    dir.join(format!("{stem}.{extension}"))
}

/// What a report's files are written from: the report, and the recording
/// named after the model.
struct ReportSource<'a> {
    report: &'a OomReport,
    model: &'a Model,
}

impl Source for ReportSource<'_> {
    fn snapshot(&self) -> Result<Snapshot> {
        crate::capture::snapshot::capture(self.model)
    }

    fn trace(&self) -> Result<Trace> {
        crate::capture::trace::capture()
    }

    fn html_report(&self) -> Result<HtmlReport> {
        crate::capture::html::capture(self.model)
    }

    fn oom_report(&self) -> Option<&OomReport> {
        Some(self.report)
    }
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

/// Creates the report's first file (its text) under a name no file has, and
/// returns the name (without extension) and the file. The name is the
/// usual one unless another process's report took it (two containers'
/// pid 1, started in one second on hosts of one name, writing to one
/// directory): then this process's names carry a random tag from then
/// on, drawn again while the name is taken. Created exclusively, so of
/// two processes that race for a name, one gets it and the other draws.
fn claim(report: &mut OomReport, dir: &Path, extension: &str) -> Option<(String, std::fs::File)> {
    let mut tag = TAG.locked().clone();
    for _ in 0..16 {
        let stem = report.file_stem(tag.as_deref());
        let path = report_file(dir, &stem, extension);
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => {
                if tag.is_some() {
                    *TAG.locked() = tag;
                }
                return Some((stem, file));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => tag = Some(random_tag()),
            Err(e) => {
                report.file_errors.push(format!("{}: {e}", path.display()));
                return None;
            }
        }
    }
    report.file_errors.push(format!(
        "{}: every name tried was taken; the report is not written to a file",
        report_file(dir, &report.file_stem(None), extension).display()
    ));
    None
}

/// A report's own file (its text, its JSON), open to be written again.
struct OwnFile {
    format: &'static dyn FileFormat,
    file: Option<std::fs::File>,
    path: PathBuf,
}

/// Writes the files of every format registered for out-of-memory reports:
/// the report's own (its text and JSON) first, then, while a recording
/// runs, those made from the recording (its PyTorch snapshot, then its HTML
/// report) where the memory left suffices for them, then the report's own
/// again with the final list of files. Every file is created anew (never
/// overwriting one); failures to write are kept, never raised. `sources` is
/// what the report walked; the recording's files walk `model` again.
pub(super) fn write(report: &mut OomReport, dir: &Path, model: &WeakModel, sources: &Model) {
    let (own, recorded): (Vec<_>, Vec<_>) =
        format::written_in(|set| set.oom_reports).into_iter().partition(|f| !f.made_from_recording());
    let claimed = own.first().and_then(|first| claim(report, dir, first.extension()));
    let (stem, mut claimed) = match claimed {
        Some((stem, file)) => (stem, Some(file)),
        None => (report.file_stem(None), None),
    };
    let mut files = Vec::new();
    for format in own {
        let path = report_file(dir, &stem, format.extension());
        let file = if files.is_empty() { claimed.take() } else { create(report, &path) };
        if file.is_some() {
            report.files.push(path.clone());
        }
        files.push(OwnFile { format, file, path });
    }
    for busy in sources.busy() {
        if !report.holders.busy.contains(&busy) {
            report.holders.busy.push(busy);
        }
    }
    rewrite(report, &mut files, sources);
    if !events::is_active() {
        return;
    }
    let sources = model.now();
    for format in recorded {
        let path = report_file(dir, &stem, format.extension());
        let (needed, available) = (format.estimate(), room());
        if !fits(needed, available) {
            report.left_out.push(LeftOut {
                part: format.description().to_string(),
                file: Some(path),
                needed_estimate: needed,
                available: available.unwrap_or(0),
            });
            continue;
        }
        let Some(file) = create(report, &path) else { continue };
        let source = ReportSource { report, model: &sources };
        let mut out = std::io::BufWriter::new(file);
        let written = format
            .write(&source, &mut out)
            .and_then(|()| out.flush().map_err(|e| Error::io("write an out-of-memory report's file", e)));
        match written {
            Ok(()) => report.files.push(path),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                report.file_errors.push(format!("{}: {e}", path.display()));
            }
        }
    }
    for busy in sources.busy() {
        if !report.holders.busy.contains(&busy) {
            report.holders.busy.push(busy);
        }
    }
    rewrite(report, &mut files, &sources);
}

/// Creates `path` for this report; `None`, with the reason kept, when it
/// cannot be created or exists already (a report never replaces a file).
fn create(report: &mut OomReport, path: &Path) -> Option<std::fs::File> {
    match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(file) => Some(file),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            report.file_errors.push(format!("{}: a file of that name exists; it is left as it is", path.display()));
            None
        }
        Err(e) => {
            report.file_errors.push(format!("{}: {e}", path.display()));
            None
        }
    }
}

/// Writes the report's own files (from the start) again; a file that
/// cannot be written is left out from then on, with the reason kept.
fn rewrite(report: &mut OomReport, files: &mut [OwnFile], model: &Model) {
    use std::io::Seek;
    let mut failed = Vec::new();
    for own in files.iter_mut() {
        let Some(open) = own.file.as_mut() else { continue };
        let source = ReportSource { report, model };
        let done = open
            .set_len(0)
            .and_then(|()| open.rewind())
            .map_err(|e| Error::io("write an out-of-memory report's file", e))
            .and_then(|()| own.format.write(&source, open));
        if let Err(e) = done {
            own.file = None;
            failed.push((own.path.clone(), e));
        }
    }
    for (path, e) in failed {
        report.files.retain(|f| *f != path);
        report.file_errors.push(format!("{}: {e}", path.display()));
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
