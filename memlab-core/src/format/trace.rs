//! The trace-event JSON that ui.perfetto.dev and chrome://tracing open.

use super::{Contents, Cost, FileFormat, Input, Registered, Source, WrittenIn};
use crate::export::TraceFile;
use crate::{Error, Result};

/// `memlab_trace.json`: the recording as trace events. Reads memlab's (and
/// `memlab merge`'s) as [`TraceFile`].
pub struct TraceJson;

inventory::submit! { Registered(&TraceJson) }

impl FileFormat for TraceJson {
    fn name(&self) -> &'static str {
        "trace"
    }

    fn description(&self) -> &'static str {
        "the trace JSON"
    }

    fn recognised_by(&self) -> Option<&'static str> {
        Some("a `traceEvents` key")
    }

    fn extension(&self) -> &'static str {
        "json"
    }

    fn stem(&self) -> &'static str {
        "memlab_trace"
    }

    fn written_in(&self) -> WrittenIn {
        WrittenIn::EXPORTS
    }

    fn order(&self) -> u8 {
        20
    }

    /// The history copied with its figures, written event by event.
    fn estimate(&self) -> u64 {
        Cost::SNAPSHOT.now()
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        let mut out = std::io::BufWriter::new(out);
        source.trace()?.write_to(&mut out).map_err(|e| Error::io("write the trace", e))?;
        std::io::Write::flush(&mut out).map_err(|e| Error::io("write the trace", e))
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        input.has_json_key("traceEvents").then(|| {
            let text = input.text()?;
            TraceFile::from_json(text)
                .map(Contents::new)
                .map_err(|e| Error::UnreadableFile { file: input.path().display().to_string(), why: e.to_string() })
        })
    }
}
