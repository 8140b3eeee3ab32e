//! Recordings as files other tools open: PyTorch's memory snapshot (a pickle
//! that pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read)
//! and a trace-event JSON (ui.perfetto.dev, chrome://tracing).
//!
//! An [`Exporter`] knows the model the way [`MemReporter`](crate::MemReporter)
//! does (registered var stores, tensors and optimizers, or ones given to it),
//! so every allocation still alive is named by the walk over the named
//! tensors at export time (parameter, gradient, optimizer state); others are
//! `other`, with where they were allocated. The recording is memlab's
//! ([`Recording`](crate::Recording)): start one with backtraces to get the
//! Rust call stacks.

pub use crate::tools::export::Exporter;
pub use memlab_core::export::{
    Block, BlockState, Category, DeviceTimeline, FlameNode, HtmlReport, Level, Oom, PeakRow, Point, Sample, Segment,
    SegmentType, Snapshot, SnapshotFrame, SnapshotInfo, Stack, Trace, TraceEntry,
};
