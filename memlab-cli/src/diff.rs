//! `memlab diff A B`: what changed between two runs, per device: the peaks,
//! and what was live at the peak by category and by site, largest change
//! first. Sites are matched by function, file (its last two components, so
//! that runs from different checkouts match) and line, never by address.

use std::collections::BTreeMap;

use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use serde::Serialize;

use crate::analysis::{Bytes, DeviceSummary, Summary};

/// How a row changed from A to B.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// Only in B.
    New,
    /// Only in A.
    Gone,
    /// More in B.
    Grown,
    /// Less in B.
    Shrunk,
}

impl Change {
    fn of(a: u64, b: u64) -> Option<Change> {
        match (a, b) {
            (0, 0) => None,
            (0, _) => Some(Change::New),
            (_, 0) => Some(Change::Gone),
            (a, b) if b > a => Some(Change::Grown),
            (a, b) if b < a => Some(Change::Shrunk),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Change::New => "new",
            Change::Gone => "gone",
            Change::Grown => "grown",
            Change::Shrunk => "shrunk",
        }
    }
}

/// One row of a comparison: a category or a site in both runs.
#[derive(Clone, Debug, Serialize)]
pub struct Delta {
    /// The category, or the site as `function (file:line)`.
    pub name: String,
    /// At A's peak.
    pub a: Bytes,
    /// At B's peak.
    pub b: Bytes,
    /// B's bytes less A's.
    pub change: i64,
    /// New, gone, grown or shrunk.
    pub kind: Change,
}

/// Two figures and their difference.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Pair {
    /// A's.
    pub a: Option<u64>,
    /// B's.
    pub b: Option<u64>,
}

/// One device of both runs.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceDiff {
    /// The device.
    pub device: String,
    /// The allocated peaks.
    pub peak: Pair,
    /// The reserved peaks, where the device reserves.
    pub reserved_peak: Pair,
    /// Live at the peak by category: what changed, largest change first.
    pub categories: Vec<Delta>,
    /// Live at the peak by site: what changed, largest change first.
    pub sites: Vec<Delta>,
    /// Rows the same in both runs.
    pub unchanged: u64,
}

/// The comparison of two snapshot files.
#[derive(Clone, Debug, Serialize)]
pub struct Diff {
    /// The first file.
    pub a: String,
    /// The second.
    pub b: String,
    /// Devices of either run, by name.
    pub devices: Vec<DeviceDiff>,
}

/// Rows shown per table (`--json` has them all).
const ROWS: usize = 15;

fn rows(
    a: impl Iterator<Item = (String, Bytes)>,
    b: impl Iterator<Item = (String, Bytes)>,
    unchanged: &mut u64,
) -> Vec<Delta> {
    let mut both: BTreeMap<String, (Bytes, Bytes)> = BTreeMap::new();
    for (name, held) in a {
        let e = &mut both.entry(name).or_default().0;
        e.bytes += held.bytes;
        e.blocks += held.blocks;
    }
    for (name, held) in b {
        let e = &mut both.entry(name).or_default().1;
        e.bytes += held.bytes;
        e.blocks += held.blocks;
    }
    let mut deltas: Vec<Delta> = both
        .into_iter()
        .filter_map(|(name, (a, b))| match Change::of(a.bytes, b.bytes) {
            Some(kind) => Some(Delta { name, a, b, change: b.bytes as i64 - a.bytes as i64, kind }),
            None => {
                *unchanged += 1;
                None
            }
        })
        .collect();
    deltas.sort_by(|x, y| y.change.unsigned_abs().cmp(&x.change.unsigned_abs()).then_with(|| x.name.cmp(&y.name)));
    deltas
}

fn site_rows(d: Option<&DeviceSummary>) -> impl Iterator<Item = (String, Bytes)> + '_ {
    d.into_iter().flat_map(|d| &d.by_site).map(|s| {
        let name = match (&s.site, s.before_history) {
            (Some(site), _) => site.to_string(),
            (None, true) => "(allocated before the history began)".to_string(),
            (None, false) => "(no stack recorded)".to_string(),
        };
        (name, s.held)
    })
}

fn category_rows(d: Option<&DeviceSummary>) -> impl Iterator<Item = (String, Bytes)> + '_ {
    d.into_iter().flat_map(|d| &d.by_category).map(|c| (c.category.clone(), c.held))
}

impl Diff {
    /// A against B, device by device.
    pub fn of(a: &Summary, b: &Summary) -> Diff {
        let mut names: Vec<&str> = a.devices.iter().map(|d| d.device.as_str()).collect();
        for d in &b.devices {
            if !names.contains(&d.device.as_str()) {
                names.push(&d.device);
            }
        }
        let devices = names
            .into_iter()
            .map(|name| {
                let da = a.devices.iter().find(|d| d.device == name);
                let db = b.devices.iter().find(|d| d.device == name);
                let mut unchanged = 0;
                let categories = rows(category_rows(da), category_rows(db), &mut unchanged);
                let sites = rows(site_rows(da), site_rows(db), &mut unchanged);
                DeviceDiff {
                    device: name.to_string(),
                    peak: Pair { a: da.map(|d| d.peak.allocated), b: db.map(|d| d.peak.allocated) },
                    reserved_peak: Pair {
                        a: da.and_then(|d| d.reserved_peak).and_then(|m| m.reserved),
                        b: db.and_then(|d| d.reserved_peak).and_then(|m| m.reserved),
                    },
                    categories,
                    sites,
                    unchanged,
                }
            })
            .collect();
        Diff { a: a.file.clone(), b: b.file.clone(), devices }
    }
}

fn figure(v: Option<u64>) -> Cell {
    v.map_or(Cell::Empty, Cell::bytes)
}

fn table(doc: &mut Document, title: &str, deltas: &[Delta]) {
    doc.heading(title);
    if deltas.is_empty() {
        doc.line("No change.");
        return;
    }
    let mut t = Table::new(vec![
        Column::new("change", Layout::Figure),
        Column::new("A", Layout::Figure),
        Column::new("B", Layout::Figure),
        Column::new("", Layout::Text),
        Column::new("what", Layout::Text),
    ]);
    for d in deltas.iter().take(ROWS) {
        t.row([
            Cell::signed_bytes(d.change),
            Cell::bytes(d.a.bytes),
            Cell::bytes(d.b.bytes),
            Cell::text(d.kind.as_str()),
            Cell::text(&d.name),
        ]);
    }
    let rest = deltas.get(ROWS..).unwrap_or_default();
    if !rest.is_empty() {
        let change: i64 = rest.iter().map(|d| d.change).sum();
        t.row([
            Cell::signed_bytes(change),
            Cell::Empty,
            Cell::Empty,
            Cell::Empty,
            Cell::text(format!("{} more, each a smaller change", rest.len())),
        ]);
    }
    doc.table(t);
}

impl Render for Diff {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.title("memlab diff");
        doc.line(format!("A: {}", self.a));
        doc.line(format!("B: {}", self.b));
        for d in &self.devices {
            doc.part(d.device.clone());
            let mut peaks = Table::new(vec![
                Column::new("", Layout::Text),
                Column::new("A", Layout::Figure),
                Column::new("B", Layout::Figure),
                Column::new("change", Layout::Figure),
            ]);
            let change = |p: &Pair| match (p.a, p.b) {
                (Some(a), Some(b)) => Cell::signed_bytes(b as i64 - a as i64),
                _ => Cell::Empty,
            };
            peaks.row([Cell::text("peak allocated"), figure(d.peak.a), figure(d.peak.b), change(&d.peak)]);
            if d.reserved_peak.a.is_some() || d.reserved_peak.b.is_some() {
                peaks.row([
                    Cell::text("peak reserved"),
                    figure(d.reserved_peak.a),
                    figure(d.reserved_peak.b),
                    change(&d.reserved_peak),
                ]);
            }
            doc.table(peaks);
            table(&mut doc, "live at the peak, by site (largest change first)", &d.sites);
            if d.categories.iter().any(|c| c.name != "uncategorized") {
                table(&mut doc, "live at the peak, by category", &d.categories);
            }
        }
        doc
    }
}
