//! The recording, captured from this process into the export models of
//! `memlab_core::export`: PyTorch's memory snapshot, the trace events and
//! the HTML report.
//!
//! A shared layer: the [`Exporter`](crate::export::Exporter) builds files
//! from it on request, the out-of-memory recorder when a request fails. Each
//! capture is given what it names memory after (a [`Model`]) and, for the
//! HTML report, the line profile.
//!
//! [`Model`]: crate::Model

pub(crate) mod html;
pub(crate) mod snapshot;
pub(crate) mod trace;
