//! The HTML report captured from this process: the recording's snapshot
//! (see [`super::snapshot`]), through the one builder that `memlab view`
//! uses for a snapshot's file, so that both give one page.

use memlab_core::export::analysis::Summary;
use memlab_core::export::{HtmlReport, SnapshotFile};
use memlab_core::Result;

use crate::named::Model;

/// What the page's summary calls the snapshot it was made from.
const THIS_RECORDING: &str = "this process's recording";

/// The HTML report of the recording so far, its allocations named after
/// `sources`, with the line profile when a profiled function ran.
pub(crate) fn capture(sources: &Model) -> Result<HtmlReport> {
    // As memlab would write it: the summary then says what the file would.
    let file = SnapshotFile::of(super::snapshot::capture(sources)?);
    let summary = Summary::of(THIS_RECORDING, &file);
    Ok(HtmlReport::of_snapshot(&file, &summary))
}
