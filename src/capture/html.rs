//! The HTML report captured from this process: the recording's history
//! replayed into each device's timeline by site, what was live at its peak
//! by call stack and by name (the walk over the model), and the line
//! profile.

use memlab_core::hash::FastMap;
use std::sync::Arc;

use memlab_core::events::{self, Action, Event};
use memlab_core::export::{DeviceTimeline, FlameNode, Frames, HtmlReport, PeakRow, Point, SnapshotFrame, Stack};
use memlab_core::Report;
use memlab_core::{Device, Result};

use super::trace;
use crate::named::Model;

/// The most points a device's timeline has.
const BUCKETS: usize = 400;
/// Sites drawn as their own layer; the rest are added up.
const TOP_SITES: usize = 8;
/// An allocation whose call stack memlab does not know.
const UNKNOWN: &str = "unknown site (no backtrace: start the Recording with backtraces)";
/// An allocation with a backtrace but no frame of the user's code.
const OUTSIDE: &str = "outside the user's code (libtorch's own threads and workspaces, such as backward's)";
/// Memory allocated before the history begins (no event says by whom).
const BEFORE: &str = "allocated before the recorded history";

fn label_of(frames: &[SnapshotFrame]) -> String {
    frames.first().map_or_else(|| UNKNOWN.to_string(), frame_label)
}

/// `function (file:line)`; a frame without a file (memlab's own labels,
/// such as the one for allocations outside the user's code) is its name.
fn frame_label(f: &SnapshotFrame) -> String {
    if f.filename.is_empty() {
        f.name.clone()
    } else {
        format!("{} ({}:{})", f.name, short(&f.filename), f.line)
    }
}

/// A source path from its crate's folder on (`src/train.rs`, `tests/x.rs`).
fn short(file: &str) -> &str {
    ["/src/", "/tests/", "/examples/", "/benches/"]
        .iter()
        .filter_map(|dir| file.rfind(dir).map(|at| &file[at + 1..]))
        .next()
        .unwrap_or(file)
}

/// A live allocation while replaying the history.
struct Live {
    site: usize,
    size: u64,
    seq: u64,
    frames: usize,
}

/// The HTML report of the recording so far, its allocations named after
/// `sources`, with `profile` (the line profiler's figures) as its last part
/// when any profiled function ran.
pub(crate) fn capture(sources: &Model, profile: Report) -> Result<HtmlReport> {
    let (history, stats, anchors) = trace::history_with_anchors()?;
    let trace = memlab_core::export::Trace::from_history(&history, &stats, &anchors)?;
    let live_now: FastMap<(Device, u64), u64> = events::live().iter().map(|a| ((a.device, a.address), a.seq)).collect();
    let named = sources.collect()?;
    let mut frames = Frames::default();
    let mut stacks: Vec<Stack> = Vec::new();
    let mut sites: Vec<String> = Vec::new();
    let mut site_ids: FastMap<String, usize> = FastMap::default();
    // Each distinct stack once: its site and index, keyed by the shared stack.
    let mut seen: FastMap<*const SnapshotFrame, (usize, usize)> = FastMap::default();
    let outside: Stack = Arc::from(vec![SnapshotFrame { filename: String::new(), line: 0, name: OUTSIDE.to_string() }]);
    // Per alloc event (by seq): its site and stack.
    let mut alloc_info: FastMap<u64, (usize, usize)> = FastMap::default();
    for e in history.iter().filter(|e| e.action == Action::Alloc) {
        let mut f = frames.of(e.backtrace.as_deref(), e.statement.as_ref());
        if f.is_empty() && e.backtrace.is_some() {
            f = outside.clone();
        }
        let info = *seen.entry(f.as_ptr()).or_insert_with(|| {
            let label = label_of(&f);
            let next = sites.len();
            let site = *site_ids.entry(label.clone()).or_insert(next);
            if site == next {
                sites.push(label);
            }
            stacks.push(f.clone());
            (site, stacks.len() - 1)
        });
        alloc_info.insert(e.seq, info);
    }
    let mut devices = Vec::new();
    for (device, samples) in &trace.counters {
        let events: Vec<&Event> = history.iter().filter(|e| e.device == *device).collect();
        if events.is_empty() {
            continue;
        }
        let peak_index = samples
            .iter()
            .enumerate()
            .max_by_key(|(i, s)| (s.level.allocated, std::cmp::Reverse(*i)))
            .map_or(0, |(i, _)| i);
        // Replay to the peak: what was live then.
        let mut live: FastMap<u64, Live> = FastMap::default();
        let replay = |live: &mut FastMap<u64, Live>, e: &Event| match e.action {
            Action::Alloc => {
                if let Some(&(site, stack)) = alloc_info.get(&e.seq) {
                    live.insert(e.address, Live { site, size: e.size, seq: e.seq, frames: stack });
                }
            }
            Action::FreeRequested => {
                live.remove(&e.address);
            }
            _ => {}
        };
        for e in &events[..=peak_index] {
            replay(&mut live, e);
        }
        let mut by_site: FastMap<usize, u64> = FastMap::default();
        for l in live.values() {
            *by_site.entry(l.site).or_default() += l.size;
        }
        let mut ranked: Vec<(usize, u64)> = by_site.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let top: Vec<usize> = ranked.iter().take(TOP_SITES).map(|(s, _)| *s).collect();
        let layer_of: FastMap<usize, usize> = top.iter().enumerate().map(|(i, s)| (*s, i + 1)).collect();
        let mut layers = vec![BEFORE.to_string()];
        layers.extend(top.iter().map(|s| sites[*s].clone()));
        layers.push("every other site".to_string());
        let others = layers.len() - 1;

        // The timeline: per bucket, the event where allocated memory peaked.
        let per_bucket = events.len().div_ceil(BUCKETS).max(1);
        let mut points: Vec<Point> = Vec::new();
        let mut running = vec![0i64; layers.len()];
        let mut sizes: FastMap<u64, (usize, i64)> = FastMap::default();
        for (i, (e, s)) in events.iter().zip(samples).enumerate() {
            match e.action {
                Action::Alloc => {
                    let layer =
                        alloc_info.get(&e.seq).map_or(others, |(site, _)| *layer_of.get(site).unwrap_or(&others));
                    running[layer] += e.size as i64;
                    sizes.insert(e.address, (layer, e.size as i64));
                }
                Action::FreeRequested => {
                    if let Some((layer, size)) = sizes.remove(&e.address) {
                        running[layer] -= size;
                    }
                }
                _ => {}
            }
            let bucket = i / per_bucket;
            if points.len() == bucket {
                points.push(Point { time_us: s.time_us, allocated: i64::MIN, layers: vec![0; layers.len()] });
            }
            let p = &mut points[bucket];
            if p.allocated < s.level.allocated {
                // The bucket's highest level so far: copied in place, no allocation per event.
                p.time_us = s.time_us;
                p.allocated = s.level.allocated;
                p.layers.copy_from_slice(&running);
                p.layers[0] = s.level.allocated - running[1..].iter().sum::<i64>();
            }
        }

        // Live at the peak: named (still the same allocation now) or by site.
        let mut names: FastMap<u64, String> = FastMap::default();
        for storage in named.storages(*device) {
            if let Some(v) = storage.views.first() {
                names.insert(storage.data_ptr, v.name.clone());
            }
        }
        let mut rows: FastMap<String, (u64, u64)> = FastMap::default();
        for (address, l) in &live {
            let same_now = live_now.get(&(*device, *address)) == Some(&l.seq);
            let label = match names.get(address).filter(|_| same_now) {
                Some(name) => format!("{name} (named at export)"),
                None => sites[l.site].clone(),
            };
            let row = rows.entry(label).or_default();
            row.0 += l.size;
            row.1 += 1;
        }
        let before = samples[peak_index].level.allocated - live.values().map(|l| l.size as i64).sum::<i64>();
        if before > 0 {
            rows.insert(BEFORE.to_string(), (before as u64, 0));
        }
        let mut live_at_peak: Vec<PeakRow> =
            rows.into_iter().map(|(label, (bytes, blocks))| PeakRow { label, bytes, blocks }).collect();
        live_at_peak.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));

        // The icicle graph: stacks outermost first.
        let mut flame = FlameNode { name: "all".into(), ..FlameNode::default() };
        for l in live.values() {
            flame.bytes += l.size;
            let mut node = &mut flame;
            let stack = &stacks[l.frames];
            let path: Vec<String> = if stack.is_empty() {
                vec![UNKNOWN.to_string()]
            } else {
                stack.iter().rev().map(frame_label).collect()
            };
            for name in path {
                let at = match node.children.iter().position(|c| c.name == name) {
                    Some(at) => at,
                    None => {
                        node.children.push(FlameNode { name, ..FlameNode::default() });
                        node.children.len() - 1
                    }
                };
                node = &mut node.children[at];
                node.bytes += l.size;
            }
        }
        sort_flame(&mut flame);
        devices.push(DeviceTimeline {
            device: *device,
            layers,
            points,
            peak_time_us: samples[peak_index].time_us,
            peak_bytes: samples[peak_index].level.allocated,
            live_at_peak,
            flame,
        });
    }
    // CUDA devices first, then the CPU, as PyTorch's snapshot numbers them.
    devices.sort_by_key(|d| d.device == Device::Cpu);
    let profile = profile.functions.iter().any(|f| f.calls > 0).then_some(profile);
    Ok(HtmlReport { devices, partial: stats.dropped > 0, named: true, profile })
}

fn sort_flame(node: &mut FlameNode) {
    node.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    node.children.iter_mut().for_each(sort_flame);
}
