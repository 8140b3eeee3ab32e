//! One self-contained HTML report of a recording: memory over time per device
//! stacked by the sites that held the most at the peak, an icicle graph of
//! what was live at the peak by Rust call stack, what was live at the peak
//! (named by the walk over named tensors at export time, labelled so), and the
//! line profiler's tables with in-cell bars. Everything is drawn in Rust as
//! SVG and HTML; the page has no script and fetches nothing (its content
//! security policy forbids it), so it opens offline and hovering uses the
//! browser's own tooltips. Long recordings are aggregated here, not in the
//! browser: a timeline has at most `BUCKETS` points per device.

use std::fmt::Write;
use std::path::Path;

use serde::Serialize;

use crate::render::{escape_html, Cell, Render, STYLESHEET};
use crate::{Device, Error, Result};

/// Rows of a "live at the peak" table; the rest are added up in one row.
const PEAK_ROWS: usize = 50;

/// One point of a device's timeline: the moment a bucket of events peaked.
#[derive(Clone, Debug, Serialize)]
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
    /// The line profiler's report, when a profiled function ran.
    pub profile: Option<crate::report::Report>,
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
        Cell::bytes(d.peak_bytes),
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
            Cell::bytes(most)
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
        Cell::bytes(d.peak_bytes)
    )
    .unwrap();
    // Hover targets: one column per point, its tooltip the figures then.
    for (i, p) in d.points.iter().enumerate() {
        let left = if i == 0 { x(p.time_us) } else { (x(d.points[i - 1].time_us) + x(p.time_us)) / 2.0 };
        let right = d.points.get(i + 1).map_or(x(p.time_us), |n| (x(p.time_us) + x(n.time_us)) / 2.0);
        let mut tip = format!("{:.3} s: {} allocated", p.time_us / 1e6, Cell::bytes(p.allocated));
        let mut parts: Vec<(usize, i64)> = p.layers.iter().copied().enumerate().filter(|(_, b)| *b > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        for (layer, bytes) in parts.iter().take(5) {
            write!(tip, "\n{}  {}", Cell::bytes(*bytes), d.layers[*layer]).unwrap();
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
            Cell::bytes(n.bytes),
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
                Cell::bytes(d.peak_bytes),
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
                    Cell::bytes(bytes),
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
        if let Some(profile) = &self.profile {
            body.push_str("<h2>Line profile</h2>\n");
            body.push_str(&profile.to_html());
        }
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\
             <title>memlab report</title><style>{STYLESHEET}</style></head>\n\
             <body class=\"memlab-page\"><div class=\"memlab\">\n{body}</div></body></html>\n"
        )
    }

    /// Shows the page in an evcxr (Rust Jupyter) notebook cell.
    pub fn evcxr_display(&self) {
        crate::output::evcxr_html(&self.to_html());
    }

    /// Writes the page to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_html()).map_err(|e| Error::io(format!("write {}", path.display()), e))
    }
}
