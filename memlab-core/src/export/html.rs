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

use std::collections::HashMap;

use super::analysis::{Offer, OomAt, Origin, Site, Start, Stretches, Summary};
use super::frames::Level as FoldLevel;
use super::{SnapshotFile, SnapshotFrame};
use crate::events::Action;
use crate::render::{Cell, Column, Document, Icicle, Layout, Mark, Render, Table, Timeline};
pub use crate::render::{FlameNode, Point};
use crate::{Device, Error, Result};

/// Rows of a "live at the peak" table shown before the rest collapse.
const SHOWN_ROWS: usize = 50;
/// Rows of a "live at the peak" table at most; the rest are added up in one
/// row (a page stays small however many sites a recording has).
const PEAK_ROWS: usize = 1000;
/// The most points a device's timeline has.
const BUCKETS: usize = 400;
/// Sites drawn as their own layer; the rest are added up.
const TOP_SITES: usize = 8;
/// The layer and row of blocks allocated before the history.
const BEFORE: &str = "allocated before the history began";
/// Allocations without a stack.
const NO_STACK: &str = "no stack recorded";

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
    /// How many of the device's events had happened at the peak.
    pub peak_event: u64,
    /// The bytes allocated to tensors at the peak (on CUDA as they asked
    /// for them).
    pub peak_bytes: i64,
    /// What was live at the peak, largest first.
    pub live_at_peak: Vec<PeakRow>,
    /// The icicle graph of what was live at the peak.
    pub flame: FlameNode,
    /// The failed allocations, marked on the timeline.
    pub ooms: Vec<OomAt>,
}

/// The report: its data, and the page. Built from a snapshot, memlab's or
/// PyTorch's ([`of_snapshot`](Self::of_snapshot)): the page of a live
/// recording (`Exporter::html_report`, which captures the snapshot first)
/// and `memlab view`'s page of that snapshot's file are one page.
#[derive(Clone, Debug, Serialize)]
pub struct HtmlReport {
    /// The snapshot's summary: the page's first part.
    pub summary: Summary,
    /// What the snapshot does not carry, each a sentence: the page's last part.
    pub missing: Vec<String>,
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
        let mut doc = self.summary.document();
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
                peak_event: Some(d.peak_event),
                peak_bytes: d.peak_bytes,
                partial: self.partial,
                scale: None,
                marks: d
                    .ooms
                    .iter()
                    .map(|o| Mark {
                        time_us: o.time_us as f64,
                        event: Some(o.event),
                        label: format!("out of memory: {} asked", Cell::bytes(o.requested)),
                    })
                    .collect(),
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
        if !self.missing.is_empty() {
            doc.part("Not in this file");
            for line in &self.missing {
                doc.line(line.clone());
            }
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

fn label(site: Option<&Site>, before: bool) -> String {
    match site {
        Some(site) => site.to_string(),
        None if before => BEFORE.to_string(),
        None => NO_STACK.to_string(),
    }
}

/// `function (file:line)`; a frame without a file (memlab's own labels,
/// such as the one for allocations outside the user's code) is its name.
fn frame_label(f: &SnapshotFrame) -> String {
    if f.filename.is_empty() {
        f.name.clone()
    } else {
        format!("{} ({}:{})", f.name, super::analysis::short_path(&f.filename), f.line)
    }
}

impl HtmlReport {
    /// The report of a snapshot file (memlab's or PyTorch's),
    /// whose summary is `summary`: per device the replay of its history
    /// into a timeline stacked by the sites that held the most at the
    /// peak, and what was live at the peak by call stack and by name (where
    /// memlab's exporter named the allocation) or site. The call stacks show
    /// the program's own frames, each run of other frames between them
    /// folded into one node that lists them when clicked (see
    /// [`frames::fold`](super::frames::fold)).
    pub fn of_snapshot(file: &SnapshotFile, summary: &Summary) -> HtmlReport {
        HtmlReport::of_snapshot_with(file, summary, false)
    }

    /// [`of_snapshot`](Self::of_snapshot), with every frame of the call
    /// stacks shown when `all_frames` is true.
    pub fn of_snapshot_with(file: &SnapshotFile, summary: &Summary, all_frames: bool) -> HtmlReport {
        let s = &file.snapshot;
        let names = s.devices();
        let mut devices = Vec::new();
        for d in &summary.devices {
            let Some(index) = names.iter().position(|n| *n == d.device) else { continue };
            let Ok(device) = d.device.parse::<Device>() else { continue };
            let start = Start::of(s, index);
            // Layers: before the history, the sites that held the most at the peak, the rest.
            let top: Vec<&Site> = d.by_site.iter().filter_map(|x| x.site.as_ref()).take(TOP_SITES).collect();
            let mut layers = vec![BEFORE.to_string()];
            layers.extend(top.iter().map(|site| site.to_string()));
            layers.push("every other site".to_string());
            let others = layers.len() - 1;
            let layer_of_site: HashMap<&Site, usize> = top.iter().enumerate().map(|(i, site)| (*site, i + 1)).collect();
            let mut by_stack: HashMap<usize, usize> = HashMap::new();
            let mut layer = |origin: &Origin| -> usize {
                let frames = match origin {
                    Origin::Event(i) => &start.trace[*i].frames,
                    Origin::Before(Some(frames)) => frames,
                    Origin::Before(None) => return 0,
                };
                *by_stack.entry(frames.as_ptr() as usize).or_insert_with(|| {
                    Site::of(frames).and_then(|site| layer_of_site.get(&site).copied()).unwrap_or(others)
                })
            };

            // The timeline: per stretch of events, the moment allocated memory peaked.
            let mut stretches = Stretches::new(start.trace.len(), BUCKETS);
            let mut running = vec![0i64; layers.len()];
            let mut live = start.live.clone();
            for (size, origin) in live.values() {
                running[layer(origin)] += *size as i64;
            }
            let t0 = start.trace.first().map_or(0, |e| e.time_us);
            for (i, e) in start.trace.iter().enumerate() {
                match (e.action, e.addr) {
                    (Action::Alloc, Some(addr)) => {
                        let origin = Origin::Event(i);
                        running[layer(&origin)] += e.size as i64;
                        if let Some((old, was)) = live.insert(addr, (e.size, origin)) {
                            running[layer(&was)] -= old as i64;
                        }
                    }
                    (action, Some(addr)) if action == start.release => {
                        if let Some((old, was)) = live.remove(&addr) {
                            running[layer(&was)] -= old as i64;
                        }
                    }
                    _ => {}
                }
                let allocated: i64 = running.iter().sum();
                let blank = || Point { time_us: 0.0, allocated, layers: vec![0; layers.len()], event: None };
                if let Offer::Highest(p) = stretches.offer(i, i128::from(allocated), blank) {
                    p.time_us = e.time_us.saturating_sub(t0) as f64;
                    p.event = Some(i as u64 + 1);
                    p.allocated = allocated;
                    p.layers.copy_from_slice(&running);
                }
            }
            let points = stretches.points();

            // Live at the peak: by the tensor's name where memlab's exporter
            // named the allocation (still alive at export), else by site.
            let at_peak = start.live_after(d.peak.event as usize);
            let mut rows: HashMap<String, (u64, u64)> = HashMap::new();
            for (size, origin) in at_peak.values() {
                let label = match origin {
                    Origin::Event(i) => match &start.trace[*i].tensor {
                        Some(name) => format!("{name} (named at export)"),
                        None => label(Site::of(&start.trace[*i].frames).as_ref(), false),
                    },
                    Origin::Before(frames) => label(frames.as_deref().and_then(Site::of).as_ref(), true),
                };
                let row = rows.entry(label).or_default();
                row.0 += size;
                row.1 += 1;
            }
            let mut live_at_peak: Vec<PeakRow> =
                rows.into_iter().map(|(label, (bytes, blocks))| PeakRow { label, bytes, blocks }).collect();
            live_at_peak.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));
            live_at_peak.truncate(PEAK_ROWS);

            // The icicle graph of what was live at the peak, outermost frame on top.
            let mut flame = FlameNode { name: "all".into(), ..FlameNode::default() };
            for (size, origin) in at_peak.values() {
                flame.bytes += size;
                let (frames, before) = match origin {
                    Origin::Event(i) => (Some(&start.trace[*i].frames), false),
                    Origin::Before(frames) => (frames.as_ref(), true),
                };
                let path: Vec<FoldLevel> = match frames {
                    Some(frames) if !frames.is_empty() => super::frames::fold(frames, all_frames, frame_label),
                    _ => vec![FoldLevel::Frame(if before { BEFORE } else { NO_STACK }.to_string())],
                };
                let mut node = &mut flame;
                for level in path {
                    let (name, folded) = match level {
                        FoldLevel::Frame(name) => (name, Vec::new()),
                        FoldLevel::Folded { label, frames } => (label, frames),
                    };
                    let at = match node.children.iter().position(|c| c.name == name && c.folded == folded) {
                        Some(at) => at,
                        None => {
                            node.children.push(FlameNode { name, folded, ..FlameNode::default() });
                            node.children.len() - 1
                        }
                    };
                    node = &mut node.children[at];
                    node.bytes += size;
                }
            }
            sort_flame(&mut flame);
            devices.push(DeviceTimeline {
                device,
                layers,
                points,
                peak_time_us: d.peak.time_us as f64,
                peak_event: d.peak.event,
                peak_bytes: d.peak.allocated as i64,
                live_at_peak,
                flame,
                ooms: d.ooms.clone(),
            });
        }
        let partial = summary.devices.iter().any(|d| !d.partial.is_empty());
        let named = s.device_traces.iter().flatten().any(|e| e.tensor.is_some());
        let profile = s.memlab.as_ref().and_then(|m| m.profile.clone());
        let missing = match &s.memlab {
            None => {
                vec!["Names of tensors, the line profile and the libtorch version: PyTorch's snapshots do not carry \
                 them; memlab's do (`Exporter::write_snapshot`)."
                    .to_string()]
            }
            Some(info) => {
                let mut missing = Vec::new();
                if !named {
                    missing.push(
                        "Names of tensors: the exporter knew no model (register a var store, or give it one with \
                         `Exporter::new`), or nothing it named was alive at export."
                            .to_string(),
                    );
                }
                if info.profile.is_none() {
                    missing.push("The line profile: no `#[memlab::profile]` function had run at export.".to_string());
                }
                missing
            }
        };
        HtmlReport { summary: summary.clone(), missing, devices, partial, named, profile }
    }
}

fn sort_flame(node: &mut FlameNode) {
    node.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    node.children.iter_mut().for_each(sort_flame);
}
