//! The self-contained HTML page: the recording drawn, and for an
//! out-of-memory report, the report above it.

use super::{About, Cost, FileFormat, Registered, Source, WrittenIn};
use crate::{Error, Result};

/// `memlab_report.html`: one page that opens offline. Of an out-of-memory
/// report's files, the report then the recording, with the list of the
/// report's files: it comes last.
pub struct HtmlPage;

inventory::submit! { Registered(&HtmlPage) }

impl FileFormat for HtmlPage {
    fn about(&self) -> &'static About {
        &About {
            name: "page",
            description: "the HTML report",
            recognised_by: None,
            extension: "html",
            stem: "memlab_report",
            written_in: WrittenIn::BOTH,
            order: 90,
            made_from_recording: true,
        }
    }

    fn estimate(&self) -> u64 {
        Cost::HTML.now()
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        let recording = source.html_report()?;
        let page = match source.oom_report() {
            Some(report) => report.to_page(Some(&recording)),
            None => recording.to_page(),
        };
        out.write_all(page.as_bytes()).map_err(|e| Error::io("write the HTML report", e))
    }
}
