//! The trace-event JSON that ui.perfetto.dev and chrome://tracing open.

use super::{About, Contents, Cost, FileFormat, Input, Registered, Source, WrittenIn};
use crate::export::TraceFile;
use crate::{Error, Result};

/// `memlab_trace.json`: the recording as trace events. Reads memlab's (and
/// `memlab merge`'s) as [`TraceFile`].
pub struct TraceJson;

inventory::submit! { Registered(&TraceJson) }

impl FileFormat for TraceJson {
    fn about(&self) -> &'static About {
        &About {
            name: "trace",
            description: "the trace JSON",
            recognised_by: Some("a `traceEvents` key"),
            extension: "json",
            stem: "memlab_trace",
            written_in: WrittenIn::EXPORTS,
            order: 20,
            made_from_recording: true,
        }
    }

    /// The history copied with its figures, written event by event.
    fn estimate(&self) -> u64 {
        Cost::SNAPSHOT.now()
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        source.trace()?.write_to(out).map_err(|e| Error::io("write the trace", e))
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        input.has_json_key("traceEvents").then(|| {
            let text = input.text()?;
            TraceFile::from_json(text).map(Contents::new).map_err(|e| input.unreadable(e))
        })
    }
}
