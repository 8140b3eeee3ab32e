//! memlab's file formats: one trait, [`FileFormat`], and one registry of
//! the formats, [`formats`]. The exporter writes every format registered
//! for exports, the out-of-memory recorder every format registered for its
//! reports, and `memlab merge` and the other commands recognise a file by
//! asking each registered format whether the file is one of its own.
//!
//! | format | file | written by | read back as |
//! |---|---|---|---|
//! | [`SnapshotPickle`] | `memlab_snapshot.pickle` | the exporter, an OOM report | [`SnapshotFile`](crate::export::SnapshotFile) |
//! | [`TraceJson`] | `memlab_trace.json` | the exporter | [`TraceFile`](crate::export::TraceFile) |
//! | [`HtmlPage`] | `memlab_report.html` | the exporter, an OOM report (the report, then the recording) | — |
//! | [`OomText`] | `memlab_oom_….txt` | an OOM report | — |
//! | [`OomJson`] | `memlab_oom_….json` | an OOM report | [`OomReport`] |
//! | [`IterationsCsv`] | `memlab_iterations.csv` | the training monitor, a row per record | `Vec<IterationRow>` |
//! | [`VariablesCsv`] | `memlab_variables.csv` | the training monitor, a row per change | `Vec<VariableRow>` |
//!
//! A new format is one file: a type that implements [`FileFormat`] (an
//! [`About`] constant, an estimate, a writer, a reader where it has one) and
//! one `inventory::submit! { Registered(&TheFormat) }` beside it (plus the
//! `mod` line that compiles the file). From then on the exporter writes it
//! where it says it belongs to exports, an out-of-memory report writes it
//! where it says it belongs to reports, and every reader recognises it where
//! it has a reader. The tests add one that way (`tests/cpu/formats.rs`).
//!
//! Formats made from the recording are written from a [`Source`]: the
//! `memlab` crate's exporter is one (the recording, its allocations named
//! after a model), an out-of-memory report another (the same, with the
//! report). The training monitor's CSVs are appended to as it records; they
//! are formats here for their names, their rows and their readers.

mod estimate;
mod monitor;
mod oom;
mod page;
mod snapshot;
mod trace;

use std::any::Any;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use estimate::Cost;
pub use monitor::{header as csv_header, read_rows, IterationRow, IterationsCsv, VariableRow, VariablesCsv};
pub use oom::{OomJson, OomText};
pub use page::HtmlPage;
pub use snapshot::SnapshotPickle;
pub use trace::TraceJson;

use crate::export::{HtmlReport, Snapshot, Trace};
use crate::oom::OomReport;
use crate::{Error, Result};

/// A file format memlab writes, and where it has a reader, reads back.
///
/// A format says what it is ([`About`]: its name, how a file of it is
/// recognised, its default file name, which sets of files it belongs to),
/// how much memory writing a file takes (the out-of-memory recorder writes a
/// file only where what is left covers that), how to write a file from a
/// [`Source`] and how to read one back.
pub trait FileFormat: Sync {
    /// What the format is: a constant of its own.
    fn about(&self) -> &'static About;

    /// An upper estimate of the heap memory that writing a file takes now,
    /// in bytes, from the recording's size alone (nothing is built to tell):
    /// an out-of-memory report leaves out a file whose estimate the memory
    /// left does not cover, so a format that builds something of the
    /// recording must count it (see [`Cost`]).
    fn estimate(&self) -> u64;

    /// Writes the file of `source` into `out`, which the caller buffers. The
    /// default says that the format is not written from a source (the
    /// monitor's CSVs).
    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        let _ = (source, out);
        Err(Error::InvalidArgument(format!(
            "{} is written as memlab records, not from a recording",
            self.about().description
        )))
    }

    /// Reads `input` when it is a file of this format: `None` when it is
    /// not (the next format is asked), else what the file holds or why it
    /// cannot be read. The default: the format has no reader (and
    /// [`About::recognised_by`] is `None`).
    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        let _ = input;
        None
    }
}

/// What a format is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct About {
    /// A short name, unique among the formats: `snapshot`, `trace`, `page`.
    pub name: &'static str,
    /// What a file of the format is, as messages and reports name it: `the
    /// PyTorch memory snapshot`.
    pub description: &'static str,
    /// How a file of the format is told from others (`its first byte is
    /// 0x80`), for a format with a reader; `None` for one without.
    pub recognised_by: Option<&'static str>,
    /// The file name's extension, without the dot: `pickle`.
    pub extension: &'static str,
    /// The file's default name without its extension, where the exporter or
    /// the monitor writes it: `memlab_snapshot`. An out-of-memory report's
    /// files are named after the report instead.
    pub stem: &'static str,
    /// The sets of files memlab writes that hold one of this format.
    pub written_in: WrittenIn,
    /// Where the format's file comes in a set: lowest first. A file that
    /// lists the others (the HTML page) comes last.
    pub order: u8,
    /// Whether a file is made from the recording (an out-of-memory report
    /// writes these only while a recording runs, and only where the memory
    /// left covers [`FileFormat::estimate`]); the report's own text and JSON
    /// are not.
    pub made_from_recording: bool,
}

impl About {
    /// The file's default name, with `suffix` before the extension (a
    /// rank's `_rank1`, or nothing): `memlab_snapshot_rank1.pickle`.
    pub fn file_name(&self, suffix: &str) -> String {
        format!("{}{suffix}.{}", self.stem, self.extension)
    }
}

/// A format's [`About`], field by field.
impl dyn FileFormat {
    /// [`About::name`].
    pub fn name(&self) -> &'static str {
        self.about().name
    }

    /// [`About::description`].
    pub fn description(&self) -> &'static str {
        self.about().description
    }

    /// [`About::recognised_by`].
    pub fn recognised_by(&self) -> Option<&'static str> {
        self.about().recognised_by
    }

    /// [`About::extension`].
    pub fn extension(&self) -> &'static str {
        self.about().extension
    }

    /// [`About::stem`].
    pub fn stem(&self) -> &'static str {
        self.about().stem
    }

    /// [`About::written_in`].
    pub fn written_in(&self) -> WrittenIn {
        self.about().written_in
    }

    /// [`About::order`].
    pub fn order(&self) -> u8 {
        self.about().order
    }

    /// [`About::made_from_recording`].
    pub fn made_from_recording(&self) -> bool {
        self.about().made_from_recording
    }
}

impl std::fmt::Debug for dyn FileFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileFormat({})", self.name())
    }
}

/// The sets of files memlab writes that a format belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrittenIn {
    /// `Exporter::write_files`'s.
    pub exports: bool,
    /// An out-of-memory report's.
    pub oom_reports: bool,
}

impl WrittenIn {
    /// In no set: written on its own by the tool that makes it.
    pub const ITS_TOOL: WrittenIn = WrittenIn { exports: false, oom_reports: false };
    /// The exporter's files.
    pub const EXPORTS: WrittenIn = WrittenIn { exports: true, oom_reports: false };
    /// An out-of-memory report's files.
    pub const OOM_REPORTS: WrittenIn = WrittenIn { exports: false, oom_reports: true };
    /// Both.
    pub const BOTH: WrittenIn = WrittenIn { exports: true, oom_reports: true };
}

/// What a set of files is written from: the recording of this process, its
/// allocations named after a model, and (for an out-of-memory report's
/// files) the report. The `memlab` crate implements it.
pub trait Source {
    /// PyTorch's memory snapshot of the recording so far.
    fn snapshot(&self) -> Result<Snapshot>;
    /// The recording so far as trace events.
    fn trace(&self) -> Result<Trace>;
    /// The HTML report of the recording so far.
    fn html_report(&self) -> Result<HtmlReport>;
    /// The out-of-memory report the files are of, where they are a report's.
    fn oom_report(&self) -> Option<&OomReport> {
        None
    }
}

/// What a file held, once read: [`downcast`](Contents::downcast) it to the
/// type its format reads (the table in the module's documentation).
pub struct Contents(Box<dyn Any + Send>);

impl Contents {
    /// `value` as a file's contents.
    pub fn new<T: Any + Send>(value: T) -> Contents {
        Contents(Box::new(value))
    }

    /// Whether the contents are a `T`.
    pub fn is<T: Any>(&self) -> bool {
        self.0.is::<T>()
    }

    /// The contents as a `T`, or themselves back when they are something else.
    pub fn downcast<T: Any>(self) -> std::result::Result<T, Contents> {
        self.0.downcast::<T>().map(|b| *b).map_err(Contents)
    }
}

impl std::fmt::Debug for Contents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Contents(..)")
    }
}

/// A file being recognised: its path and first bytes, and, read once and
/// only when a format asks, its text and its top-level JSON keys.
pub struct Input {
    path: PathBuf,
    head: Vec<u8>,
    text: OnceLock<std::result::Result<String, String>>,
    keys: OnceLock<Option<BTreeSet<String>>>,
}

/// The bytes of a file every format sees before it reads the file.
const HEAD: usize = 4096;

impl Input {
    /// The file at `path`, its first bytes read.
    pub fn open(path: impl AsRef<Path>) -> Result<Input> {
        use std::io::Read;
        let path = path.as_ref();
        let cannot = |why: String| unreadable(path, why);
        let meta = std::fs::metadata(path).map_err(|e| cannot(io_why(&e)))?;
        if meta.is_dir() {
            return Err(cannot("it is a directory; give the files themselves".into()));
        }
        let file = std::fs::File::open(path).map_err(|e| cannot(io_why(&e)))?;
        let mut head = Vec::with_capacity(HEAD);
        file.take(HEAD as u64).read_to_end(&mut head).map_err(|e| cannot(io_why(&e)))?;
        if head.is_empty() {
            return Err(cannot("the file is empty".into()));
        }
        Ok(Input { path: path.to_path_buf(), head, text: OnceLock::new(), keys: OnceLock::new() })
    }

    /// The error of a file recognised but unreadable: why, naming the file.
    pub fn unreadable(&self, why: impl std::fmt::Display) -> Error {
        unreadable(&self.path, why.to_string())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's first bytes (up to 4 KiB).
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// The file's first line, where its first bytes hold one as text.
    pub fn first_line(&self) -> Option<&str> {
        let end = self.head.iter().position(|&b| b == b'\n')?;
        std::str::from_utf8(&self.head[..end]).ok().map(|l| l.trim_end_matches('\r'))
    }

    /// The whole file as text, read once.
    pub fn text(&self) -> Result<&str> {
        let text = self.text.get_or_init(|| {
            std::fs::read(&self.path)
                .map_err(|e| io_why(&e))
                .and_then(|bytes| String::from_utf8(bytes).map_err(|_| "it is not UTF-8 text".to_string()))
        });
        text.as_deref().map_err(|why| unreadable(&self.path, why.clone()))
    }

    /// Whether the file is a JSON object with the top-level key `key`. The
    /// file is parsed once for its keys, whichever format asks first.
    pub fn has_json_key(&self, key: &str) -> bool {
        self.json_keys().is_some_and(|keys| keys.contains(key))
    }

    /// The top-level keys of the JSON object the file is; `None` where it is
    /// not one.
    pub fn json_keys(&self) -> Option<&BTreeSet<String>> {
        self.keys
            .get_or_init(|| {
                let starts_as_json = self.head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
                if !starts_as_json {
                    return None;
                }
                let text = self.text().ok()?;
                let keys: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
                    serde_json::from_str(text).ok()?;
                Some(keys.into_keys().collect())
            })
            .as_ref()
    }

    /// Whether the file parses as JSON at all (for the message when no
    /// format recognises it).
    fn is_json(&self) -> bool {
        self.text().is_ok_and(|t| serde_json::from_str::<serde::de::IgnoredAny>(t).is_ok())
    }
}

fn unreadable(path: &Path, why: String) -> Error {
    Error::UnreadableFile { file: path.display().to_string(), why }
}

fn io_why(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

/// A format in the registry: `inventory::submit! { Registered(&TheFormat) }`
/// beside the format's type.
pub struct Registered(pub &'static dyn FileFormat);

inventory::collect!(Registered);

/// Every registered format, in [`About::order`] (then by name).
pub fn formats() -> Vec<&'static dyn FileFormat> {
    let mut all: Vec<&'static dyn FileFormat> = inventory::iter::<Registered>.into_iter().map(|r| r.0).collect();
    all.sort_by_key(|f| (f.order(), f.name()));
    all.dedup_by_key(|f| f.name());
    all
}

/// The registered formats of one set of files, in order.
pub fn written_in(set: impl Fn(WrittenIn) -> bool) -> Vec<&'static dyn FileFormat> {
    formats().into_iter().filter(|f| set(f.written_in())).collect()
}

/// The registered format named `name`.
pub fn named(name: &str) -> Option<&'static dyn FileFormat> {
    formats().into_iter().find(|f| f.name() == name)
}

/// Reads the file at `path` with the first registered format that
/// recognises it, and says which. A file no format recognises gets an
/// error that lists what memlab reads.
pub fn read(path: impl AsRef<Path>) -> Result<(&'static dyn FileFormat, Contents)> {
    let input = Input::open(path)?;
    for format in formats() {
        if let Some(read) = format.read(&input) {
            return read.map(|contents| (format, contents));
        }
    }
    Err(unrecognised(&input))
}

/// Whether `e` is [`read`]'s error for a file no format recognises.
pub fn is_unrecognised(e: &Error) -> bool {
    matches!(e, Error::UnreadableFile { why, .. } if why.starts_with(UNRECOGNISED))
}

const UNRECOGNISED: &str = "none of the formats memlab reads";

fn unrecognised(input: &Input) -> Error {
    let readable: Vec<String> = formats()
        .into_iter()
        .filter_map(|f| f.recognised_by().map(|how| format!("{} ({how})", f.description())))
        .collect();
    let what = if input.json_keys().is_some() {
        " (a JSON object without their keys)"
    } else if input.is_json() {
        " (JSON, but not an object)"
    } else {
        ""
    };
    unreadable(input.path(), format!("{UNRECOGNISED}{what}; give {}", list(&readable)))
}

/// `a, b or c`.
fn list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{SnapshotFile, TraceFile};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
    }

    #[test]
    fn the_registry_holds_every_format_once_in_order() {
        let names: Vec<&str> = formats().iter().map(|f| f.name()).collect();
        assert_eq!(
            names,
            ["oom-text", "oom-report", "snapshot", "trace", "iterations-csv", "variables-csv", "page"],
            "each format once, the report's own first, the page last"
        );
        let files = |set: fn(WrittenIn) -> bool| -> Vec<String> {
            written_in(set).iter().map(|f| format!("{}.{}", f.stem(), f.extension())).collect()
        };
        assert_eq!(files(|s| s.exports), ["memlab_snapshot.pickle", "memlab_trace.json", "memlab_report.html"]);
        // A report's files share its name: their extensions tell them apart.
        let report: Vec<&str> = written_in(|s| s.oom_reports).iter().map(|f| f.extension()).collect();
        assert_eq!(report, ["txt", "json", "pickle", "html"]);
        assert_eq!(named("trace").map(|f| f.extension()), Some("json"));
    }

    #[test]
    fn each_file_is_read_by_its_format() {
        let read_as = |name: &str| {
            let (format, contents) = read(fixture(name)).unwrap();
            (format.name(), contents)
        };
        let (name, contents) = read_as("leaky.pickle");
        assert_eq!(name, "snapshot");
        assert!(contents.downcast::<SnapshotFile>().is_ok_and(|f| !f.snapshot.device_traces.is_empty()));
        let (name, contents) = read_as("memlab_trace_rank0.json");
        assert_eq!(name, "trace");
        assert!(contents.downcast::<TraceFile>().is_ok_and(|t| !t.events.is_empty()));
        let (name, contents) = read_as("memlab_oom_rank1.json");
        assert_eq!(name, "oom-report");
        assert!(contents.is::<OomReport>() && !contents.is::<TraceFile>());
        let (name, contents) = read_as("golden/monitor_iterations.csv");
        assert_eq!(name, "iterations-csv");
        let rows = contents.downcast::<Vec<IterationRow>>().unwrap();
        assert_eq!(rows.len(), 3, "the golden monitor's records");
        let (name, contents) = read_as("golden/monitor_variables.csv");
        assert_eq!(name, "variables-csv");
        assert!(contents.downcast::<Vec<VariableRow>>().is_ok_and(|rows| !rows.is_empty()));
    }

    #[test]
    fn a_file_of_no_format_is_told_what_memlab_reads() {
        let dir = std::env::temp_dir().join(format!("memlab-format-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            ("keys.json", "{\"a\": 1}", "(a JSON object without their keys)"),
            ("list.json", "[1, 2]", "(JSON, but not an object)"),
            ("notes.txt", "just words\n", "none of the formats memlab reads; give "),
            ("empty.bin", "", "the file is empty"),
        ];
        for (name, text, why) in cases {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let e = read(&path).unwrap_err();
            assert!(e.to_string().contains(why), "{name}: {e}");
            assert_eq!(is_unrecognised(&e), name != "empty.bin", "{name}: {e}");
        }
        let e = read(&dir).unwrap_err().to_string();
        assert!(e.contains("it is a directory"), "{e}");
        let e = read(dir.join("notes.txt")).unwrap_err().to_string();
        for format in formats().iter().filter(|f| f.recognised_by().is_some()) {
            assert!(e.contains(format.description()), "{} in {e}", format.name());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_file_of_a_format_is_that_formats_error() {
        let dir = std::env::temp_dir().join(format!("memlab-format-broken-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("trace.json");
        std::fs::write(&trace, "{\"traceEvents\": 3}").unwrap();
        let e = read(&trace).unwrap_err();
        assert!(!is_unrecognised(&e), "recognised as a trace, then refused: {e}");
        let pickle = dir.join("cut.pickle");
        std::fs::write(&pickle, &std::fs::read(fixture("leaky.pickle")).unwrap()[..100]).unwrap();
        let e = read(&pickle).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
