//! The recording, captured from this process into the models that files are
//! written from: PyTorch's memory snapshot, the trace events and the HTML
//! report, each with its writer (pickle, JSON, one page).
//!
//! A shared layer: the [`Exporter`](crate::export::Exporter) builds files
//! from it on request, the out-of-memory recorder when a request fails. Each
//! capture is given what it names memory after (the model's [`Model`]) and,
//! for the HTML report, the line profile.
//!
//! [`Model`]: crate::named::Model

#[doc(hidden)]
pub mod estimate;
pub(crate) mod html;
mod pickle;
pub(crate) mod snapshot;
pub(crate) mod trace;

pub use html::{DeviceTimeline, FlameNode, HtmlReport, PeakRow, Point};
pub use snapshot::{Block, Segment, Snapshot, SnapshotFrame, SnapshotInfo, Stack, TraceEntry};
pub use trace::{Level, Oom, Sample, Trace};
