//! `memlab view`: a snapshot as the self-contained HTML report memlab's
//! exporter writes (per device: memory over time stacked by site, what was
//! live at the peak by call stack and by site), after the summary.

use std::collections::HashMap;

use memlab_core::export::{DeviceTimeline, FlameNode, HtmlReport, PeakRow, Point, SnapshotFile, SnapshotFrame};
use memlab_core::render::{Document, Render};
use memlab_core::Device;

use memlab_core::events::Action;

use crate::analysis::{Origin, Site, Start, Summary};

/// The most points a device's timeline has.
const BUCKETS: usize = 400;
/// Sites drawn as their own layer; the rest are added up.
const TOP_SITES: usize = 8;
/// Rows kept in a device's table of what was live at the peak.
const PEAK_ROWS: usize = 1000;
/// The layer and row of blocks allocated before the history.
const BEFORE: &str = "allocated before the history began";
/// Allocations without a stack.
const NO_STACK: &str = "no stack recorded";

/// The page: the summary, then the report of every device, then a line for
/// each section the file cannot give.
pub fn page(path: &str, file: &SnapshotFile, summary: &Summary) -> String {
    let report = report(file, summary);
    let mut doc = Document::new();
    doc.append(summary.document());
    doc.append(report.document());
    let missing = match &file.snapshot.memlab {
        None => vec!["Names of tensors, the line profile and the libtorch version: PyTorch's snapshots do not carry \
             them; memlab's do (`Exporter::write_snapshot`)."
            .to_string()],
        Some(info) => {
            let mut missing = Vec::new();
            if !report.named {
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
    if !missing.is_empty() {
        doc.part("Not in this file");
        for line in missing {
            doc.line(line);
        }
    }
    doc.to_page(&format!("memlab: {path}"))
}

fn label(site: Option<&Site>, before: bool) -> String {
    match site {
        Some(site) => site.to_string(),
        None if before => BEFORE.to_string(),
        None => NO_STACK.to_string(),
    }
}

fn frame_label(f: &SnapshotFrame) -> String {
    format!("{} ({}:{})", f.name, f.filename.rsplit('/').next().unwrap_or(&f.filename), f.line)
}

/// The HTML report's model, from the snapshot's replay.
fn report(file: &SnapshotFile, summary: &Summary) -> HtmlReport {
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

        // The timeline: per bucket of events, the moment allocated memory peaked.
        let per_bucket = start.trace.len().div_ceil(BUCKETS).max(1);
        let mut points: Vec<Point> = Vec::new();
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
            let bucket = i / per_bucket;
            if points.len() == bucket {
                points.push(Point { time_us: 0.0, allocated: i64::MIN, layers: vec![0; layers.len()] });
            }
            let allocated: i64 = running.iter().sum();
            let p = &mut points[bucket];
            if p.allocated < allocated {
                p.time_us = e.time_us.saturating_sub(t0) as f64;
                p.allocated = allocated;
                p.layers.copy_from_slice(&running);
            }
        }

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
            let path: Vec<String> = match frames {
                Some(frames) if !frames.is_empty() => frames.iter().rev().map(frame_label).collect(),
                _ => vec![if before { BEFORE } else { NO_STACK }.to_string()],
            };
            let mut node = &mut flame;
            for name in path {
                let at = match node.children.iter().position(|c| c.name == name) {
                    Some(at) => at,
                    None => {
                        node.children.push(FlameNode { name, ..FlameNode::default() });
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
            peak_bytes: d.peak.allocated as i64,
            live_at_peak,
            flame,
        });
    }
    let partial = summary.devices.iter().any(|d| !d.partial.is_empty());
    let named = s.device_traces.iter().flatten().any(|e| e.tensor.is_some());
    let profile = s.memlab.as_ref().and_then(|m| m.profile.clone());
    HtmlReport { devices, partial, named, profile }
}

fn sort_flame(node: &mut FlameNode) {
    node.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    node.children.iter_mut().for_each(sort_flame);
}
