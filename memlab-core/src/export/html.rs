//! One self-contained HTML report of a recording: memory over time per device
//! stacked by the sites that held the most at the peak, an icicle graph of
//! what was live at the peak by Rust call stack, what was live at the peak
//! (named by the walk over named tensors at export time, labelled so), and the
//! line profiler's tables with in-cell bars. The report is data; it describes
//! itself as a document, which the render layer draws (SVG and HTML, no
//! script, nothing fetched: the page opens offline and hovering uses the
//! browser's own tooltips). Long recordings are aggregated before, not in the
//! browser: a timeline has at most a few hundred points per device.

use std::path::Path;

use serde::Serialize;

use crate::render::{Cell, Column, Document, Icicle, Layout, Render, Table, Timeline};
pub use crate::render::{FlameNode, Point};
use crate::{Device, Error, Result};

/// Rows of a "live at the peak" table shown before the rest collapse.
const SHOWN_ROWS: usize = 50;
/// Rows of a "live at the peak" table at most; the rest are added up in one
/// row (a page stays small however many sites a recording has).
const PEAK_ROWS: usize = 1000;

/// What was live at a device's peak, grouped.
#[derive(Clone, Debug, Serialize)]
pub struct PeakRow {
    /// A site (`function (file:line)`), or a tensor's name with
    /// "(named at export)" when the walk over named tensors found it alive
    /// then, still the same allocation.
    pub label: String,
    /// Bytes live at the peak.
    pub bytes: u64,
    /// Allocations.
    pub blocks: u64,
}

/// One device of the report.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceTimeline {
    /// The device.
    pub device: Device,
    /// The layers, bottom first: memory from before the history, the top
    /// sites, then every other site together.
    pub layers: Vec<String>,
    /// The timeline.
    pub points: Vec<Point>,
    /// The peak: when, and how much was allocated.
    pub peak_time_us: f64,
    /// The bytes allocated to tensors at the peak (on CUDA as they asked
    /// for them).
    pub peak_bytes: i64,
    /// What was live at the peak, largest first.
    pub live_at_peak: Vec<PeakRow>,
    /// The icicle graph of what was live at the peak.
    pub flame: FlameNode,
}

/// The report: its data, and the page.
#[derive(Clone, Debug, Serialize)]
pub struct HtmlReport {
    /// One section per device with events: the CUDA devices, then the CPU.
    pub devices: Vec<DeviceTimeline>,
    /// Whether the recording's bounded history dropped events.
    pub partial: bool,
    /// Whether tensors were named by the walk over named tensors at export
    /// (memlab's recordings): the tables then say where names come from.
    pub named: bool,
    /// The line profiler's report, when a profiled function ran.
    pub profile: Option<crate::report::Report>,
}

/// The page: per device its timeline, icicle graph and table of what was
/// live at the peak, then the line profile.
impl Render for HtmlReport {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.title("memlab: memory over time");
        if self.partial {
            doc.caution(
                "The data is partial: the recording's bounded history dropped its oldest events (raise \
                 `Settings::capacity`). Timelines start at the first event kept.",
            );
        }
        if self.devices.is_empty() {
            doc.line("No allocation events: start a `memlab::Recording` before the code to look at.");
        }
        for d in &self.devices {
            // CUDA's events carry what tensors asked for; its blocks are rounded up.
            let counted = match d.device {
                Device::Cpu => format!("Allocated bytes as {}'s allocator counts them", d.device),
                Device::Cuda(_) => format!(
                    "Bytes allocated to tensors on {}, as they asked for them (the caching allocator's \
                     requested_bytes: its blocks are rounded up from these)",
                    d.device
                ),
            };
            doc.part(format!("{}: memory over time", d.device)).note(format!(
                "{counted}, stacked by the sites that held the most at the peak ({}); hover for the figures.",
                Cell::bytes(d.peak_bytes)
            ));
            doc.timeline(Timeline {
                label: format!("memory over time on {}", d.device),
                layers: d.layers.clone(),
                points: d.points.clone(),
                peak_time_us: d.peak_time_us,
                peak_bytes: d.peak_bytes,
                partial: self.partial,
                scale: None,
            });
            doc.part(format!("{}: live at the peak, by call stack", d.device)).note(
                "The allocations live at the peak that the recording saw made, outermost frame on top; hover a \
                 frame for its bytes.",
            );
            doc.icicle(Icicle { root: d.flame.clone(), partial: self.partial });
            doc.part(format!("{}: live at the peak", d.device)).note(if self.named {
                "Names come from the walk over the named tensors at export, for allocations still alive then; \
                 the rest are listed by where they were made."
            } else {
                "Listed by where they were made (the innermost frame of each call stack)."
            });
            let mut table = Table::new(vec![
                Column::new("bytes", Layout::Figure),
                Column::new("blocks", Layout::Figure),
                Column::new("what", Layout::Text),
            ])
            .collapsed_after(SHOWN_ROWS);
            for r in d.live_at_peak.iter().take(PEAK_ROWS) {
                table.row([Cell::bytes(r.bytes), Cell::count(r.blocks), Cell::text(&r.label)]);
            }
            let rest = d.live_at_peak.get(PEAK_ROWS..).unwrap_or_default();
            if !rest.is_empty() {
                let (bytes, blocks) = rest.iter().fold((0, 0), |(b, n), r| (b + r.bytes, n + r.blocks));
                let what = format!("{} more sites and names, each smaller", rest.len());
                table.row([Cell::bytes(bytes), Cell::count(blocks), Cell::text(what)]);
            }
            doc.table(table);
            if self.partial {
                doc.caution(
                    "Partial: what was allocated before the history's first event counts as \"allocated before \
                     the recorded history\".",
                );
            }
        }
        if let Some(profile) = &self.profile {
            doc.part("Line profile").append(profile.document());
        }
        doc
    }
}

impl HtmlReport {
    /// The whole page: one file, styles inline, no script, nothing fetched.
    pub fn to_page(&self) -> String {
        self.document().to_page("memlab report")
    }

    /// Writes the page to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_page()).map_err(|e| Error::io(format!("write {}", path.display()), e))
    }
}
