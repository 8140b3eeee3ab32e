//! One self-contained HTML report of a recording: memory over time per device
//! stacked by the sites that held the most at the peak, an icicle graph of
//! what was live at the peak by Rust call stack, what was live at the peak
//! (named by the walk over named tensors at export time, labelled so), and the
//! line profiler's tables with in-cell bars. Everything is drawn in Rust as
//! SVG and HTML; the page has no script and fetches nothing (its content
//! security policy forbids it), so it opens offline and hovering uses the
//! browser's own tooltips. Long recordings are aggregated here, not in the
//! browser: a timeline has at most `BUCKETS` points per device.

use memlab_core::hash::FastMap;
use std::fmt::Write;
use std::path::Path;
use std::sync::Arc;

use memlab_core::events::{self, Action, Event};
use memlab_core::render::{escape_html, format_bytes, STYLESHEET};
use memlab_core::Report;
use memlab_core::{Device, Error, Result};
use serde::Serialize;

use super::snapshot::{Frames, SnapshotFrame, Stack};
use super::trace;
use crate::named::Model;

/// The most points a device's timeline has.
const BUCKETS: usize = 400;
/// Sites drawn as their own layer; the rest are added up.
const TOP_SITES: usize = 8;
/// Rows of a "live at the peak" table; the rest are added up in one row.
const PEAK_ROWS: usize = 50;
/// An allocation whose call stack memlab does not know.
const UNKNOWN: &str = "unknown site (no backtrace: start the Recording with backtraces)";
/// An allocation with a backtrace but no frame of the user's code.
const OUTSIDE: &str = "outside the user's code (libtorch's own threads and workspaces, such as backward's)";
/// Memory allocated before the history begins (no event says by whom).
const BEFORE: &str = "allocated before the recorded history";

/// One point of a device's timeline: the moment a bucket of events peaked.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Point {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// The bytes allocated to tensors then (on CUDA as they asked for
    /// them, see [`Level::allocated`](super::Level::allocated)).
    pub allocated: i64,
    /// Per layer (see [`DeviceTimeline::layers`]): its bytes then.
    pub layers: Vec<i64>,
}

/// What was live at a device's peak, grouped.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
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

/// A node of the icicle graph: a frame and the bytes live under it.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct FlameNode {
    /// `function (file:line)`, or `all` at the root.
    pub name: String,
    /// Bytes live at the peak under this frame.
    pub bytes: u64,
    /// Callees, largest first.
    pub children: Vec<FlameNode>,
}

/// One device of the report.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
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
#[non_exhaustive]
pub struct HtmlReport {
    /// One section per device with events: the CUDA devices, then the CPU.
    pub devices: Vec<DeviceTimeline>,
    /// Whether the recording's bounded history dropped events.
    pub partial: bool,
    /// The line profiler's report, as HTML.
    #[serde(skip)]
    pub profile_html: String,
}

fn label_of(frames: &[SnapshotFrame]) -> String {
    frames.first().map_or_else(|| UNKNOWN.to_string(), frame_label)
}

/// `function (file:line)`, or the placeholder of a frame without a place.
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
pub(crate) fn capture(sources: &Model, profile: &Report) -> Result<HtmlReport> {
    let (history, stats, anchors) = trace::history_with_anchors()?;
    let trace = trace::capture_from(&history, &stats, &anchors)?;
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
    let profile_html = if profile.functions.iter().any(|f| f.calls > 0) { profile.to_html() } else { String::new() };
    Ok(HtmlReport { devices, partial: stats.dropped > 0, profile_html })
}

fn sort_flame(node: &mut FlameNode) {
    node.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    node.children.iter_mut().for_each(sort_flame);
}

/// Layer colours, bottom first: grey for memory from before the history, a
/// qualitative palette for the sites, light grey for the rest.
const COLOURS: [&str; 10] =
    ["#b8b8b8", "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#d9d9d9"];

fn colour(layer: usize, layers: usize) -> &'static str {
    if layer == 0 {
        COLOURS[0]
    } else if layer == layers - 1 {
        COLOURS[9]
    } else {
        COLOURS[1 + (layer - 1) % 8]
    }
}

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 280.0;
const LEFT: f64 = 70.0;

fn timeline_svg(d: &DeviceTimeline, partial: bool) -> String {
    let mut out = String::new();
    let (t0, t1) = (d.points.first().map_or(0.0, |p| p.time_us), d.points.last().map_or(1.0, |p| p.time_us));
    let span = (t1 - t0).max(1.0);
    let top = d.peak_bytes.max(1) as f64;
    let plot = WIDTH - LEFT - 10.0;
    let x = |t: f64| LEFT + (t - t0) / span * plot;
    let y = |b: f64| 10.0 + (1.0 - b / top) * (HEIGHT - 40.0);
    write!(
        out,
        "<svg class=\"timeline\" width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\" \
         aria-label=\"memory over time on {}\">",
        d.device
    )
    .unwrap();
    // Axes: bytes at the peak and at zero, time at both ends.
    write!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\
         <text x=\"{LEFT}\" y=\"{}\">{:.3} s</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.3} s</text>",
        LEFT - 6.0,
        y(top) + 4.0,
        format_bytes(d.peak_bytes),
        LEFT - 6.0,
        y(0.0),
        HEIGHT - 8.0,
        t0 / 1e6,
        WIDTH - 10.0,
        HEIGHT - 8.0,
        t1 / 1e6
    )
    .unwrap();
    if partial {
        write!(
            out,
            "<text class=\"partial\" x=\"{:.1}\" y=\"22\">partial: older events were dropped</text>",
            LEFT + 6.0
        )
        .unwrap();
    }
    // Stacked areas, bottom first.
    let mut below = vec![0i64; d.points.len()];
    for (layer, name) in d.layers.iter().enumerate() {
        let above: Vec<i64> = d.points.iter().zip(&below).map(|(p, b)| b + p.layers[layer].max(0)).collect();
        if above.iter().zip(&below).all(|(a, b)| a == b) {
            continue;
        }
        let mut points = String::new();
        for (p, a) in d.points.iter().zip(&above) {
            write!(points, "{:.1},{:.1} ", x(p.time_us), y(*a as f64)).unwrap();
        }
        for (p, b) in d.points.iter().zip(&below).rev() {
            write!(points, "{:.1},{:.1} ", x(p.time_us), y(*b as f64)).unwrap();
        }
        let most = d.points.iter().map(|p| p.layers[layer]).max().unwrap_or(0);
        write!(
            out,
            "<polygon class=\"layer\" points=\"{}\" fill=\"{}\"><title>{} (at most {})</title></polygon>",
            points.trim_end(),
            colour(layer, d.layers.len()),
            escape_html(name),
            format_bytes(most)
        )
        .unwrap();
        below = above;
    }
    // The peak.
    let px = x(d.peak_time_us);
    write!(
        out,
        "<line class=\"peak\" x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#c00\">peak {}</text>",
        y(top) - 4.0,
        y(0.0),
        (px + 4.0).min(WIDTH - 120.0),
        y(top) + 12.0,
        format_bytes(d.peak_bytes)
    )
    .unwrap();
    // Hover targets: one column per point, its tooltip the figures then.
    for (i, p) in d.points.iter().enumerate() {
        let left = if i == 0 { x(p.time_us) } else { (x(d.points[i - 1].time_us) + x(p.time_us)) / 2.0 };
        let right = d.points.get(i + 1).map_or(x(p.time_us), |n| (x(p.time_us) + x(n.time_us)) / 2.0);
        let mut tip = format!("{:.3} s: {} allocated", p.time_us / 1e6, format_bytes(p.allocated));
        let mut parts: Vec<(usize, i64)> = p.layers.iter().copied().enumerate().filter(|(_, b)| *b > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        for (layer, bytes) in parts.iter().take(5) {
            write!(tip, "\n{}  {}", format_bytes(*bytes), d.layers[*layer]).unwrap();
        }
        write!(
            out,
            "<rect class=\"hover\" x=\"{left:.1}\" y=\"10\" width=\"{:.1}\" height=\"{:.1}\" fill=\"transparent\">\
             <title>{}</title></rect>",
            (right - left).max(1.0),
            HEIGHT - 40.0,
            escape_html(&tip)
        )
        .unwrap();
    }
    out.push_str("</svg>\n<ul class=\"legend\">");
    for (layer, name) in d.layers.iter().enumerate() {
        write!(
            out,
            "<li><span style=\"background:{}\"></span>{}</li>",
            colour(layer, d.layers.len()),
            escape_html(name)
        )
        .unwrap();
    }
    out.push_str("</ul>\n");
    out
}

fn flame_svg(root: &FlameNode, partial: bool) -> String {
    const ROW: f64 = 18.0;
    fn depth(n: &FlameNode) -> usize {
        1 + n.children.iter().map(depth).max().unwrap_or(0)
    }
    let rows = depth(root);
    let height = rows as f64 * ROW + 2.0;
    let mut out = format!(
        "<svg class=\"flame\" width=\"{WIDTH}\" height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" role=\"img\" \
         aria-label=\"memory live at the peak by call stack\">"
    );
    fn draw(out: &mut String, n: &FlameNode, x: f64, width: f64, row: usize, total: u64) {
        if width < 0.5 {
            return;
        }
        let y = row as f64 * ROW;
        let hue = 20 + (n.name.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) % 40) as i32;
        let tip = format!(
            "{}\n{} ({:.1}% of the peak's recorded allocations)",
            n.name,
            format_bytes(n.bytes as i64),
            n.bytes as f64 * 100.0 / total.max(1) as f64
        );
        write!(
            out,
            "<g class=\"frame\"><title>{}</title><rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
             fill=\"hsl({hue},85%,62%)\" stroke=\"#fff\"/>",
            escape_html(&tip),
            width,
            ROW - 1.0
        )
        .unwrap();
        let chars = ((width - 6.0) / 7.0) as usize;
        if chars >= 4 {
            let text: String = if n.name.chars().count() > chars {
                n.name.chars().take(chars - 1).chain(std::iter::once('…')).collect()
            } else {
                n.name.clone()
            };
            write!(out, "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>", x + 3.0, y + 13.0, escape_html(&text)).unwrap();
        }
        out.push_str("</g>");
        let mut at = x;
        for c in &n.children {
            let w = width * c.bytes as f64 / n.bytes.max(1) as f64;
            draw(out, c, at, w, row + 1, total);
            at += w;
        }
    }
    draw(&mut out, root, 0.0, WIDTH, 0, root.bytes);
    if partial {
        // Over the root row, whose text says only `all`.
        write!(
            out,
            "<text class=\"partial\" x=\"{:.1}\" y=\"13\" text-anchor=\"end\">partial: \
                     allocations made before the history's first event are not here</text>",
            WIDTH - 6.0
        )
        .unwrap();
    }
    out.push_str("</svg>\n");
    out
}

/// The page's own styles, after the reports' shared stylesheet.
const PAGE_STYLE: &str = "body{font-family:sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}svg{display:block;font:11px monospace}\
svg.flame text{pointer-events:none}.hover:hover{fill:rgba(0,0,0,.06)}.frame:hover rect{stroke:#000}\
ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:.4em 1.2em;font:12px monospace}\
ul.legend span{display:inline-block;width:.9em;height:.9em;margin-right:.4em;vertical-align:-.1em}\
p.partial{background:#fff3cd;border:1px solid #e0c36a;padding:.5em .8em}p.note{color:#555}\
svg text.partial{fill:#8a6d00;font-weight:bold}";

impl HtmlReport {
    /// The page: one file, styles inline, no script, nothing fetched.
    pub fn to_html(&self) -> String {
        let mut body = String::new();
        body.push_str("<h1>memlab: memory over time</h1>\n");
        if self.partial {
            body.push_str(
                "<p class=\"partial\">The data is partial: the recording's bounded history dropped its oldest \
                 events (raise <code>Settings::capacity</code>). Timelines start at the first event kept.</p>\n",
            );
        }
        if self.devices.is_empty() {
            body.push_str(
                "<p>No allocation events: start a <code>memlab::Recording</code> before the code to look at.</p>\n",
            );
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
            write!(
                body,
                "<h2>{0}: memory over time</h2>\n<p class=\"note\">{counted}, stacked by the sites that held the \
                 most at the peak ({1}); hover for the figures.</p>\n{2}",
                d.device,
                format_bytes(d.peak_bytes),
                timeline_svg(d, self.partial)
            )
            .unwrap();
            write!(
                body,
                "<h2>{}: live at the peak, by call stack</h2>\n<p class=\"note\">The allocations live at the peak that \
                 the recording saw made, outermost frame on top; hover a frame for its bytes.</p>\n{}",
                d.device,
                flame_svg(&d.flame, self.partial)
            )
            .unwrap();
            write!(
                body,
                "<h2>{}: live at the peak</h2>\n<p class=\"note\">Names come from the walk over the named tensors at \
                 export, for allocations still alive then; the rest are listed by where they were made.</p>\n\
                 <table><tr><th>bytes</th><th>blocks</th><th class=\"text\">what</th></tr>\n",
                d.device
            )
            .unwrap();
            let row = |body: &mut String, bytes: u64, blocks: u64, label: &str| {
                writeln!(
                    body,
                    "<tr><td>{}</td><td>{blocks}</td><td class=\"text\">{}</td></tr>",
                    format_bytes(bytes as i64),
                    escape_html(label)
                )
                .unwrap()
            };
            for r in d.live_at_peak.iter().take(PEAK_ROWS) {
                row(&mut body, r.bytes, r.blocks, &r.label);
            }
            let rest = d.live_at_peak.get(PEAK_ROWS..).unwrap_or_default();
            if !rest.is_empty() {
                let (bytes, blocks) = rest.iter().fold((0, 0), |(b, n), r| (b + r.bytes, n + r.blocks));
                row(&mut body, bytes, blocks, &format!("{} more sites and names, each smaller", rest.len()));
            }
            body.push_str("</table>\n");
            if self.partial {
                body.push_str(
                    "<p class=\"partial\">Partial: what was allocated before the history's first event counts as \
                     \"allocated before the recorded history\".</p>\n",
                );
            }
        }
        if !self.profile_html.is_empty() {
            body.push_str("<h2>Line profile</h2>\n");
            body.push_str(&self.profile_html);
        }
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\
             <title>memlab report</title><style>{STYLESHEET}{PAGE_STYLE}</style></head>\n\
             <body><div class=\"memlab\">\n{body}</div></body></html>\n"
        )
    }

    /// Shows the page in an evcxr (Rust Jupyter) notebook cell.
    pub fn evcxr_display(&self) {
        memlab_core::output::evcxr_html(&self.to_html());
    }

    /// Writes the page to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_html()).map_err(|e| Error::io(format!("write {}", path.display()), e))
    }
}
