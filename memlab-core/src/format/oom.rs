//! An out-of-memory report's own files: its text and its JSON.

use super::{About, Contents, FileFormat, Input, Registered, Source, WrittenIn};
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
    fn about(&self) -> &'static About {
        &About {
            name: "oom-text",
            description: "an out-of-memory report's text",
            recognised_by: None,
            extension: "txt",
            stem: "memlab_oom",
            written_in: WrittenIn::OOM_REPORTS,
            order: 0,
            made_from_recording: false,
        }
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
    fn about(&self) -> &'static About {
        &About {
            name: "oom-report",
            description: "an out-of-memory report's JSON",
            recognised_by: Some("a `diagnosis` key"),
            extension: "json",
            stem: "memlab_oom",
            written_in: WrittenIn::OOM_REPORTS,
            order: 1,
            made_from_recording: false,
        }
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
            OomReport::from_json(text).map(Contents::new).map_err(|e| input.unreadable(e))
        })
    }
}
