//! The drawings of the HTML pages, as SVG drawn in Rust: memory over time
//! stacked by layer (a timeline) and what was live by call stack (an
//! icicle graph). Each is a block of a [`Document`](super::Document); in
//! text a timeline is a one-line sparkline and an icicle graph its heaviest
//! frames. The page has no script: hovering uses the browser's own
//! tooltips (SVG `<title>`), styled by the one stylesheet.

use std::fmt::Write;
use std::hash::Hasher;

use serde::Serialize;

use super::{escape_html, Cell};
use crate::hash::FastHasher;

/// One point of a device's timeline: the moment a bucket of events peaked.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// The bytes allocated to tensors then (on CUDA as they asked for
    /// them, see the export's `Level::allocated`).
    pub allocated: i64,
    /// Per layer (see [`Timeline::layers`]): its bytes then.
    pub layers: Vec<i64>,
    /// How many of the device's events had happened then, where the
    /// timeline comes from one device's history (it can then be drawn by
    /// event as well as by time).
    pub event: Option<u64>,
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
    /// For a run of frames folded into this node (see
    /// `memlab_core::export::frames::fold`): those frames, outermost first;
    /// the HTML lists them when the node is clicked. Empty for a frame.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub folded: Vec<String>,
}

/// Memory over time on one device, stacked by layer, with its peak marked.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// What the drawing shows, for screen readers (`memory over time on cuda:0`).
    pub label: String,
    /// The layers, bottom first.
    pub layers: Vec<String>,
    /// The points, in time order.
    pub points: Vec<Point>,
    /// When the peak was, in microseconds since the recording began.
    pub peak_time_us: f64,
    /// How many events had happened at the peak, where the points say
    /// theirs (see [`Point::event`]).
    pub peak_event: Option<u64>,
    /// The bytes at the peak.
    pub peak_bytes: i64,
    /// Whether older events were dropped (the drawing says so).
    pub partial: bool,
    /// The scale to draw on, when several timelines share one (the ranks of
    /// a merged run); `None`: the points' own times and the peak.
    pub scale: Option<Scale>,
    /// Moments marked on the drawing beside the peak: the failed
    /// allocations (out of memory).
    pub marks: Vec<Mark>,
}

/// A moment marked on a timeline, with its label (`out of memory: 2.00G
/// asked`).
#[derive(Clone, Debug, Serialize)]
pub struct Mark {
    /// Microseconds since the recording began, as the points count them.
    pub time_us: f64,
    /// How many events had happened then, where the points say theirs.
    pub event: Option<u64>,
    /// What happened.
    pub label: String,
}

/// One scale for several timelines: the time the axis spans and the bytes
/// at its top.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scale {
    /// The axis's start, in microseconds.
    pub from_us: f64,
    /// Its end, in microseconds.
    pub to_us: f64,
    /// The bytes at the top.
    pub top_bytes: i64,
}

impl Timeline {
    /// The time the axis spans and the bytes at its top.
    fn bounds(&self) -> (f64, f64, i64) {
        match self.scale {
            Some(s) => (s.from_us, s.to_us, s.top_bytes.max(self.peak_bytes)),
            None => (
                self.points.first().map_or(0.0, |p| p.time_us),
                self.points.last().map_or(1.0, |p| p.time_us),
                self.peak_bytes,
            ),
        }
    }
}

/// What was live by call stack: an icicle graph, outermost frame on top.
#[derive(Clone, Debug)]
pub struct Icicle {
    /// The root (`all`) and its callees.
    pub root: FlameNode,
    /// Whether allocations from before the history are missing (the drawing
    /// says so).
    pub partial: bool,
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

/// Which way a timeline's x axis runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Axis {
    /// Microseconds since the recording began.
    Time,
    /// The events of the device's history, one after another.
    Event,
}

/// The zoom levels a timeline offers: how many times its width the plot is
/// drawn, in a box that scrolls sideways.
const ZOOMS: [u32; 3] = [1, 4, 16];

/// The plot's coordinates: `PLOT_WIDTH` across whatever width the zoom gives
/// it (the SVG stretches sideways only; its text is HTML over it, which does
/// not stretch), `PLOT_HEIGHT` high.
const PLOT_WIDTH: f64 = 1000.0;
const PLOT_HEIGHT: f64 = 240.0;

/// A short id for a page element made from `text` (several timelines and
/// icicle graphs share one page).
fn element_id(text: &str) -> u64 {
    let mut hasher = FastHasher::default();
    hasher.write(text.as_bytes());
    hasher.finish()
}

/// A timeline: drawn by time, and where its points come from one device's
/// history, by event as well, with a switch between the two, and zoomed
/// 1×, 4× or 16× in a box that scrolls sideways. No script: radio buttons
/// and rules that show the drawing and the width they pick. By event first
/// where the history's time is mostly idle.
fn timeline_html(d: &Timeline) -> String {
    let by_event = d.scale.is_none()
        && d.peak_event.is_some()
        && !d.points.is_empty()
        && d.points.iter().all(|p| p.event.is_some());
    let first = if by_event && mostly_idle(&d.points) { Axis::Event } else { Axis::Time };
    let id = format!("tl-{:016x}", element_id(&d.label));
    let mut out = String::from("<div class=\"axes\">");
    if by_event {
        out.push_str("x axis:");
        for (axis, class, text) in [(Axis::Event, "by-event", "by event"), (Axis::Time, "by-time", "by time")] {
            let checked = if axis == first { " checked" } else { "" };
            write!(
                out,
                "<input type=\"radio\" name=\"{id}-axis\" id=\"{id}-{class}\" class=\"{class}\"{checked}>\
                 <label for=\"{id}-{class}\">{text}</label>"
            )
            .unwrap();
        }
        out.push_str("<span class=\"gap\"></span>");
    }
    out.push_str("zoom:");
    for zoom in ZOOMS {
        let checked = if zoom == 1 { " checked" } else { "" };
        write!(
            out,
            "<input type=\"radio\" name=\"{id}-zoom\" id=\"{id}-z{zoom}\" class=\"z{zoom}\"{checked}>\
             <label for=\"{id}-z{zoom}\">{zoom}×</label>"
        )
        .unwrap();
    }
    out.push('\n');
    if by_event {
        out += &drawing(d, Axis::Event);
    }
    out += &drawing(d, Axis::Time);
    out.push_str("</div>\n");
    out + &legend(d)
}

/// Whether most of a history's time passes with few of its events: the
/// busiest half of its events take under a tenth of its span (each point
/// holds an equal share of the events, see the export's timelines).
fn mostly_idle(points: &[Point]) -> bool {
    let (Some(first), Some(last)) = (points.first(), points.last()) else { return false };
    let span = last.time_us - first.time_us;
    if points.len() < 4 || span <= 0.0 {
        return false;
    }
    let mut gaps: Vec<f64> = points.windows(2).map(|w| w[1].time_us - w[0].time_us).collect();
    gaps.sort_by(f64::total_cmp);
    gaps[..gaps.len() / 2].iter().sum::<f64>() < 0.1 * span
}

/// A step of 1, 2 or 5 times a power of ten, near `span / count`.
fn nice_step(span: f64, count: f64) -> f64 {
    let raw = (span / count).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(raw.log10().floor());
    let m = raw / power;
    power
        * if m < 1.5 {
            1.0
        } else if m < 3.5 {
            2.0
        } else if m < 7.5 {
            5.0
        } else {
            10.0
        }
}

/// The axis's ticks from `from` to `to`: (value, the lowest zoom that shows
/// it), about six across the plot at each zoom.
fn ticks(from: f64, to: f64, whole: bool) -> Vec<(f64, u32)> {
    let mut out: Vec<(f64, u32)> = Vec::new();
    for zoom in ZOOMS {
        let mut step = nice_step(to - from, 6.0 * f64::from(zoom));
        if whole {
            step = step.max(1.0).round();
        }
        let mut k = (from / step).ceil();
        while k * step <= to + step * 1e-9 {
            let v = k * step;
            if !out.iter().any(|(w, _)| (w - v).abs() < step * 1e-6) {
                out.push((v, zoom));
            }
            k += 1.0;
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// A tick's label: seconds with the decimals its step needs, or an event.
fn tick_label(v: f64, axis: Axis, step_us: f64) -> String {
    match axis {
        Axis::Event => format!("{}", v.round() as u64),
        Axis::Time => {
            let decimals = (-(step_us / 1e6).log10().floor()).clamp(0.0, 6.0) as usize;
            format!("{:.*} s", decimals, v / 1e6)
        }
    }
}

/// One drawing of a timeline, along `axis`: the bytes on the left, the
/// plot (an SVG that stretches with the zoom, the peak and every mark as
/// lines on it, one hover target per point), and over it in HTML the ticks
/// and the marks' labels.
fn drawing(d: &Timeline, axis: Axis) -> String {
    let mut out = String::new();
    let (t0, t1, top) = d.bounds();
    let event = |p: &Point| p.event.unwrap_or(0) as f64;
    let (from, to) = match axis {
        Axis::Time => (t0, t1),
        Axis::Event => (0.0, d.points.last().map_or(1.0, event)),
    };
    let along = |p: &Point| match axis {
        Axis::Time => p.time_us,
        Axis::Event => event(p),
    };
    let span = (to - from).max(1.0);
    let top = top.max(1) as f64;
    let x = |v: f64| (v - from) / span * PLOT_WIDTH;
    let percent = |v: f64| ((v - from) / span * 100.0).clamp(0.0, 100.0);
    let y = |b: f64| 4.0 + (1.0 - b / top) * (PLOT_HEIGHT - 4.0);
    let (class, label) = match axis {
        Axis::Time => ("by-time", d.label.clone()),
        Axis::Event => ("by-event", format!("{} by event", d.label)),
    };
    write!(
        out,
        "<div class=\"chart {class}\"><div class=\"bytes\"><span class=\"top\">{}</span><span class=\"zero\">0</span>\
         </div><div class=\"scroll\"><div class=\"plot\">",
        Cell::bytes(top as i64)
    )
    .unwrap();
    write!(
        out,
        "<svg class=\"timeline {class}\" viewBox=\"0 0 {PLOT_WIDTH} {PLOT_HEIGHT}\" preserveAspectRatio=\"none\" \
         role=\"img\" aria-label=\"{}\">",
        escape_html(&label)
    )
    .unwrap();
    // Stacked areas, bottom first.
    let mut below = vec![0i64; d.points.len()];
    for (layer, name) in d.layers.iter().enumerate() {
        let above: Vec<i64> = d.points.iter().zip(&below).map(|(p, b)| b + p.layers[layer].max(0)).collect();
        if above.iter().zip(&below).all(|(a, b)| a == b) {
            continue;
        }
        let mut points = String::new();
        for (p, a) in d.points.iter().zip(&above) {
            write!(points, "{:.2},{:.1} ", x(along(p)), y(*a as f64)).unwrap();
        }
        for (p, b) in d.points.iter().zip(&below).rev() {
            write!(points, "{:.2},{:.1} ", x(along(p)), y(*b as f64)).unwrap();
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
    // Hover targets: one column per point, its tooltip the figures then.
    for (i, p) in d.points.iter().enumerate() {
        let at = x(along(p));
        let left = if i == 0 { at } else { (x(along(&d.points[i - 1])) + at) / 2.0 };
        let right = d.points.get(i + 1).map_or(at, |n| (at + x(along(n))) / 2.0);
        let mut tip = match axis {
            Axis::Time => format!("{:.3} s: {} allocated", p.time_us / 1e6, Cell::bytes(p.allocated)),
            Axis::Event => {
                format!("event {} at {:.3} s: {} allocated", event(p) as u64, p.time_us / 1e6, Cell::bytes(p.allocated))
            }
        };
        let mut parts: Vec<(usize, i64)> = p.layers.iter().copied().enumerate().filter(|(_, b)| *b > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        for (layer, bytes) in parts.iter().take(5) {
            write!(tip, "\n{}  {}", Cell::bytes(*bytes), d.layers[*layer]).unwrap();
        }
        write!(
            out,
            "<rect class=\"hover\" x=\"{left:.2}\" y=\"0\" width=\"{:.2}\" height=\"{PLOT_HEIGHT}\" \
             fill=\"transparent\"><title>{}</title></rect>",
            (right - left).max(0.5),
            escape_html(&tip)
        )
        .unwrap();
    }
    // The peak and the marks: lines on the plot, their labels in HTML.
    let peak_at = match axis {
        Axis::Time => d.peak_time_us,
        Axis::Event => d.peak_event.unwrap_or(0) as f64,
    };
    let mut labels = String::new();
    let mut line = |out: &mut String, at: f64, class: &str, text: &str, tip: &str| {
        write!(
            out,
            "<line class=\"{class}\" x1=\"{0:.2}\" x2=\"{0:.2}\" y1=\"0\" y2=\"{PLOT_HEIGHT}\" \
             vector-effect=\"non-scaling-stroke\"/>",
            x(at)
        )
        .unwrap();
        let side = if percent(at) > 75.0 { " end" } else { "" };
        write!(
            labels,
            "<span class=\"mark {class}{side}\" style=\"left:{:.3}%\" title=\"{}\">{}</span>",
            percent(at),
            escape_html(tip),
            escape_html(text)
        )
        .unwrap();
    };
    let peak_text = format!("peak {}", Cell::bytes(d.peak_bytes));
    let peak_tip = match (axis, d.peak_event) {
        (Axis::Event, Some(e)) => format!("{peak_text} after event {e}, at {:.3} s", d.peak_time_us / 1e6),
        _ => format!("{peak_text} at {:.3} s", d.peak_time_us / 1e6),
    };
    line(&mut out, peak_at, "peak", &peak_text, &peak_tip);
    for m in &d.marks {
        let at = match axis {
            Axis::Time => m.time_us,
            Axis::Event => m.event.unwrap_or(0) as f64,
        };
        let tip = format!("{} at {:.3} s", m.label, m.time_us / 1e6);
        line(&mut out, at, "oom", &m.label, &tip);
    }
    out.push_str("</svg>");
    out.push_str(&labels);
    if d.partial {
        out.push_str("<span class=\"partial\">partial: older events were dropped</span>");
    }
    // The ticks, finer ones shown as the zoom grows.
    out.push_str("<div class=\"ticks\">");
    let finest = nice_step(span, 6.0 * f64::from(ZOOMS[ZOOMS.len() - 1]));
    for (v, zoom) in ticks(from, to, axis == Axis::Event) {
        let side = if percent(v) > 95.0 { " end" } else { "" };
        write!(
            out,
            "<span class=\"k{zoom}{side}\" style=\"left:{:.3}%\">{}</span>",
            percent(v),
            tick_label(v, axis, finest)
        )
        .unwrap();
    }
    out.push_str("</div></div></div></div>\n");
    out
}

/// The layers' colours and names, under a timeline.
fn legend(d: &Timeline) -> String {
    let mut out = String::new();
    out.push_str("<ul class=\"legend\">");
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

fn icicle_svg(icicle: &Icicle) -> String {
    let (root, partial) = (&icicle.root, icicle.partial);
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
    /// Draws `n` and its callees; a folded run's node links to the list of
    /// its frames, which `folds` gathers for after the drawing.
    fn draw(out: &mut String, folds: &mut String, n: &FlameNode, at: (f64, f64, usize), path: u64, total: u64) {
        let (x, width, row) = at;
        if width < 0.5 {
            return;
        }
        let y = row as f64 * ROW;
        let path = {
            let mut hasher = FastHasher::default();
            hasher.write_u64(path);
            hasher.write(n.name.as_bytes());
            hasher.finish()
        };
        let (hue, saturation) = if n.folded.is_empty() {
            (20 + (n.name.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) % 40) as i32, 85)
        } else {
            (210, 25)
        };
        let tip = format!(
            "{}\n{} ({:.1}% of the peak's recorded allocations){}",
            n.name,
            Cell::bytes(n.bytes),
            n.bytes as f64 * 100.0 / total.max(1) as f64,
            if n.folded.is_empty() { "" } else { "\nclick to list them" }
        );
        if !n.folded.is_empty() {
            let id = format!("fold-{path:016x}");
            write!(out, "<a href=\"#{id}\">").unwrap();
            write!(
                folds,
                "<div class=\"fold\" id=\"{id}\"><p>{} ({}):</p><ol>",
                escape_html(&n.name),
                Cell::bytes(n.bytes)
            )
            .unwrap();
            for frame in &n.folded {
                write!(folds, "<li>{}</li>", escape_html(frame)).unwrap();
            }
            folds.push_str("</ol></div>\n");
        }
        write!(
            out,
            "<g class=\"frame\"><title>{}</title><rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
             fill=\"hsl({hue},{saturation}%,62%)\" stroke=\"#fff\"/>",
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
        if !n.folded.is_empty() {
            out.push_str("</a>");
        }
        let mut at = x;
        for c in &n.children {
            let w = width * c.bytes as f64 / n.bytes.max(1) as f64;
            draw(out, folds, c, (at, w, row + 1), path, total);
            at += w;
        }
    }
    let mut folds = String::new();
    draw(&mut out, &mut folds, root, (0.0, WIDTH, 0), root.bytes, root.bytes);
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
    out.push_str(&folds);
    out
}

/// Sparkline glyphs, lowest first.
const SPARKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

impl Timeline {
    /// The text form: the allocated bytes over time as a sparkline of at
    /// most `width` glyphs (each the highest level of its stretch), then the
    /// span and the peak.
    pub(super) fn to_text(&self, width: usize) -> String {
        let (t0, t1, top) = self.bounds();
        let top = top.max(1) as f64;
        let n = self.points.len();
        let columns = n.min(width).max(1);
        let line: String = (0..columns)
            .map(|c| {
                let stretch = &self.points[c * n / columns..((c + 1) * n / columns).max(c * n / columns + 1).min(n)];
                let most = stretch.iter().map(|p| p.allocated).max().unwrap_or(0).max(0) as f64;
                SPARKS[(((most / top) * (SPARKS.len() - 1) as f64).round() as usize).min(SPARKS.len() - 1)]
            })
            .collect();
        let marks: String = self.marks.iter().map(|m| format!("; {} at {:.3} s", m.label, m.time_us / 1e6)).collect();
        format!(
            "{line}\n{:.3} s to {:.3} s; peak {} at {:.3} s{marks}{}\n",
            t0 / 1e6,
            t1 / 1e6,
            Cell::bytes(self.peak_bytes),
            self.peak_time_us / 1e6,
            if self.partial { " (partial: older events were dropped)" } else { "" }
        )
    }

    pub(super) fn to_html(&self) -> String {
        timeline_html(self)
    }
}

impl Icicle {
    /// The text form: the frames that hold at least a twentieth of the
    /// root's bytes, indented by depth, with their bytes.
    pub(super) fn to_text(&self) -> String {
        fn walk(out: &mut String, n: &FlameNode, depth: usize, floor: u64) {
            writeln!(
                out,
                "{:>10}  {}{}",
                Cell::bytes(n.bytes).to_string(),
                "  ".repeat(depth),
                super::visible(&n.name, false)
            )
            .unwrap();
            for c in n.children.iter().filter(|c| c.bytes >= floor) {
                walk(out, c, depth + 1, floor);
            }
        }
        let mut out = String::new();
        walk(&mut out, &self.root, 0, (self.root.bytes / 20).max(1));
        if self.partial {
            out.push_str("(partial: allocations made before the history's first event are not here)\n");
        }
        out
    }

    pub(super) fn to_html(&self) -> String {
        icicle_svg(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(time_us: f64, allocated: i64) -> Point {
        Point { time_us, allocated, layers: vec![allocated], event: None }
    }

    #[test]
    fn a_timeline_reads_as_a_sparkline() {
        let timeline = Timeline {
            label: "memory over time on cpu".into(),
            layers: vec!["site".into()],
            points: (0..8).map(|i| point(i as f64 * 1e6, i << 20)).collect(),
            peak_time_us: 7e6,
            peak_event: None,
            peak_bytes: 7 << 20,
            partial: false,
            scale: None,
            marks: Vec::new(),
        };
        assert_eq!(timeline.to_text(64), "▁▂▃▄▅▆▇█\n0.000 s to 7.000 s; peak 7.00M at 7.000 s\n");
        // On a scale shared with a timeline twice as high and long.
        let shared =
            Timeline { scale: Some(Scale { from_us: 0.0, to_us: 14e6, top_bytes: 14 << 20 }), ..timeline.clone() };
        assert_eq!(shared.to_text(64), "▁▂▂▃▃▄▄▅\n0.000 s to 14.000 s; peak 7.00M at 7.000 s\n");
        assert!(shared.to_html().contains(">14.00M</span>") && shared.to_html().contains(">14.0 s</span>"));
        // Narrower than the points: each glyph is the highest of its stretch.
        assert_eq!(timeline.to_text(4).lines().next(), Some("▂▄▆█"));
        let svg = timeline.to_html();
        assert!(
            svg.contains("<svg class=\"timeline by-time\"") && svg.contains("aria-label=\"memory over time on cpu\""),
            "{svg}"
        );
        assert_eq!(svg.matches("<rect class=\"hover\"").count(), 8, "one hover target per point");
    }

    #[test]
    fn a_history_mostly_idle_is_drawn_by_event_first() {
        // 8 points of equal shares of events: a long setup, then a burst.
        let times = [0.0, 4e6, 8e6, 8.01e6, 8.02e6, 8.03e6, 8.04e6, 8.05e6];
        let points: Vec<Point> = times
            .iter()
            .enumerate()
            .map(|(i, t)| Point { event: Some(100 * (i as u64 + 1)), ..point(*t, (i as i64 + 1) << 20) })
            .collect();
        assert!(mostly_idle(&points));
        let timeline = Timeline {
            label: "memory over time on cuda:0".into(),
            layers: vec!["site".into()],
            points: points.clone(),
            peak_time_us: 8.05e6,
            peak_event: Some(800),
            peak_bytes: 8 << 20,
            partial: false,
            scale: None,
            marks: Vec::new(),
        };
        let html = timeline.to_html();
        assert!(html.contains("class=\"by-event\" checked>"), "by event first: {html}");
        assert_eq!(html.matches("<svg class=\"timeline ").count(), 2);
        assert!(html.contains(">800</span>") && html.contains("event 400 at 8.010 s: 4.00M allocated"));
        // Evenly busy: by time first.
        let even: Vec<Point> =
            points.iter().enumerate().map(|(i, p)| Point { time_us: i as f64 * 1e6, ..p.clone() }).collect();
        assert!(!mostly_idle(&even));
        let html = Timeline { points: even, ..timeline.clone() }.to_html();
        assert!(html.contains("class=\"by-time\" checked>"));
        // Without events (a merged run's points), by time alone.
        let html = Timeline { peak_event: None, ..timeline }.to_html();
        assert!(!html.contains("by-event") && html.matches("<svg").count() == 1);
    }

    #[test]
    fn a_timeline_zooms_and_marks_each_failure() {
        let timeline = Timeline {
            label: "memory over time on cuda:0".into(),
            layers: vec!["site".into()],
            points: (0..8).map(|i| Point { event: Some(i + 1), ..point(i as f64 * 1e5, (i as i64) << 20) }).collect(),
            peak_time_us: 7e5,
            peak_event: Some(8),
            peak_bytes: 7 << 20,
            partial: false,
            scale: None,
            marks: vec![Mark { time_us: 6e5, event: Some(7), label: "out of memory: 2.00G asked".into() }],
        };
        let html = timeline.to_html();
        // Both drawings mark the failure where it happened.
        let lines: Vec<&str> =
            html.split("<line class=\"oom\" x1=\"").skip(1).map(|r| &r[..r.find('"').unwrap()]).collect();
        assert_eq!(lines, ["875.00", "857.14"], "by event (7 of 8 events) and by time (0.6 s of 0.7 s)");
        assert_eq!(html.matches(">out of memory: 2.00G asked</span>").count(), 2);
        assert!(timeline.to_text(8).contains("; out of memory: 2.00G asked at 0.600 s"));
        // Zoom: three radio buttons per timeline; finer ticks for the larger zooms.
        for zoom in ["z1", "z4", "z16"] {
            assert_eq!(html.matches(&format!("class=\"{zoom}\"")).count(), 1, "{zoom}");
        }
        let ticks = |zoom: &str| {
            html.matches(&format!("<span class=\"{zoom}\"")).count()
                + html.matches(&format!("<span class=\"{zoom} end\"")).count()
        };
        let (k1, k4, k16) = (ticks("k1"), ticks("k4"), ticks("k16"));
        assert!(k1 >= 2 * 3 && k4 > k1 && k16 > k4, "{k1} {k4} {k16}");
        // Ticks of whole events only, and seconds with the decimals their step needs.
        assert!(!html.contains(".5</span>") && html.contains(">0.700 s</span>"), "{html}");
    }

    #[test]
    fn ticks_are_round_and_finer_as_the_zoom_grows() {
        assert_eq!(nice_step(1.0, 6.0), 0.2);
        assert_eq!(nice_step(700_000.0, 6.0), 100_000.0);
        assert_eq!(nice_step(7.0, 96.0), 0.05);
        let t = ticks(0.0, 10.0, true);
        let at = |zoom: u32| t.iter().filter(|(_, z)| *z == zoom).map(|(v, _)| *v).collect::<Vec<_>>();
        assert_eq!(at(1), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(at(4), [1.0, 3.0, 5.0, 7.0, 9.0], "whole events only: no half ticks");
        assert!(at(16).is_empty());
        assert_eq!(tick_label(1.5e6, Axis::Time, 1e5), "1.5 s");
        assert_eq!(tick_label(2e6, Axis::Time, 2e6), "2 s");
    }

    #[test]
    fn an_icicle_lists_its_heavy_frames() {
        let leaf = |name: &str, bytes: u64| FlameNode { name: name.into(), bytes, ..FlameNode::default() };
        let icicle = Icicle {
            root: FlameNode {
                name: "all".into(),
                bytes: 100 << 10,
                children: vec![leaf("step (src/a.rs:3)", 96 << 10), leaf("tiny (src/a.rs:9)", 4 << 10)],
                ..FlameNode::default()
            },
            partial: true,
        };
        assert_eq!(
            icicle.to_text(),
            "   100.00K  all\n    96.00K    step (src/a.rs:3)\n\
             (partial: allocations made before the history's first event are not here)\n"
        );
        assert_eq!(icicle.to_html().matches("<g class=\"frame\">").count(), 3);
    }
}
