//! An out-of-memory report's own files: its text and its JSON.

use super::{Contents, FileFormat, Input, Registered, Source, WrittenIn};
use crate::oom::OomReport;
use crate::render::Render;
use crate::{Error, Result};

/// The report as text, what the recorder prints (`memlab_oom_….txt`).
pub struct OomText;

/// The report as JSON, every field (`memlab_oom_….json`); reads back as
/// [`OomReport`].
pub struct OomJson;

inventory::submit! { Registered(&OomText) }
inventory::submit! { Registered(&OomJson) }

fn report(source: &dyn Source) -> Result<&OomReport> {
    source.oom_report().ok_or_else(|| Error::InvalidArgument("an out-of-memory report's files need the report".into()))
}

fn write(out: &mut dyn std::io::Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes()).map_err(|e| Error::io("write an out-of-memory report's file", e))
}

impl FileFormat for OomText {
    fn name(&self) -> &'static str {
        "oom-text"
    }

    fn description(&self) -> &'static str {
        "an out-of-memory report's text"
    }

    fn extension(&self) -> &'static str {
        "txt"
    }

    fn stem(&self) -> &'static str {
        "memlab_oom"
    }

    fn written_in(&self) -> WrittenIn {
        WrittenIn::OOM_REPORTS
    }

    fn order(&self) -> u8 {
        0
    }

    fn made_from_recording(&self) -> bool {
        false
    }

    /// The report is built before its files: writing it takes its text.
    fn estimate(&self) -> u64 {
        0
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        write(out, &report(source)?.to_text())
    }
}

impl FileFormat for OomJson {
    fn name(&self) -> &'static str {
        "oom-report"
    }

    fn description(&self) -> &'static str {
        "an out-of-memory report's JSON"
    }

    fn recognised_by(&self) -> Option<&'static str> {
        Some("a `diagnosis` key")
    }

    fn extension(&self) -> &'static str {
        "json"
    }

    fn stem(&self) -> &'static str {
        "memlab_oom"
    }

    fn written_in(&self) -> WrittenIn {
        WrittenIn::OOM_REPORTS
    }

    fn order(&self) -> u8 {
        1
    }

    fn made_from_recording(&self) -> bool {
        false
    }

    /// The report is built before its files: writing it takes its text.
    fn estimate(&self) -> u64 {
        0
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        write(out, &report(source)?.to_json())
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        input.has_json_key("diagnosis").then(|| {
            let text = input.text()?;
            OomReport::from_json(text)
                .map(Contents::new)
                .map_err(|e| Error::UnreadableFile { file: input.path().display().to_string(), why: e.to_string() })
        })
    }
}
