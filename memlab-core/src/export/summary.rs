//! `memlab summary`: a snapshot's peaks and what made them, per device.

use std::time::Duration;

use crate::render::{Cell, Column, Document, Layout, Render, Table};

use super::analysis::{DeviceSummary, Moment, Summary};

/// Sites shown per device (`--json` has them all).
pub const SITES: usize = 10;

fn when(m: &Moment) -> String {
    if m.event == 0 {
        "before the first event".into()
    } else {
        format!("at +{} (event {})", Cell::Duration(Duration::from_micros(m.time_us)), m.event)
    }
}

fn share(part: u64, whole: u64) -> Cell {
    if whole == 0 {
        Cell::Empty
    } else {
        Cell::Percent(part as f64 / whole as f64)
    }
}

fn device(doc: &mut Document, d: &DeviceSummary, sites: usize) {
    doc.part(format!("{}: {} events over {}", d.device, d.events, Cell::Duration(Duration::from_micros(d.span_us))));
    let mut figures = Table::new(vec![
        Column::new("", Layout::Text),
        Column::new("bytes", Layout::Figure),
        Column::new("when", Layout::Text),
    ]);
    if d.unseen_before > 0 {
        // The allocator's figures (a trace's) count what the recording never saw.
        figures.row([
            Cell::text("peak allocated, since the recording began"),
            Cell::bytes(d.peak.allocated),
            Cell::text(when(&d.peak)),
        ]);
        figures.row([
            Cell::text("peak allocated, with what lived before"),
            Cell::bytes(d.peak.allocated.saturating_add(d.unseen_before)),
            Cell::text(format!(
                "{} allocated before the recording began and still allocated, which it never saw (the \
                 allocator's figures, and a trace's, count it)",
                Cell::bytes(d.unseen_before)
            )),
        ]);
    } else {
        figures.row([Cell::text("peak allocated"), Cell::bytes(d.peak.allocated), Cell::text(when(&d.peak))]);
    }
    if let (Some(reserved), Some(unallocated)) = (d.peak.reserved, d.unallocated_at_peak()) {
        figures.row([
            Cell::text("reserved then"),
            Cell::bytes(reserved),
            Cell::text(format!(
                "{} of it not allocated ({} of reserved)",
                Cell::bytes(unallocated),
                share(unallocated, reserved)
            )),
        ]);
    }
    if let Some(rp) = &d.reserved_peak {
        figures.row([Cell::text("peak reserved"), Cell::bytes(rp.reserved.unwrap_or(0)), Cell::text(when(rp))]);
    }
    figures.row([Cell::text("allocated at the end"), Cell::bytes(d.end.allocated), Cell::text("after the last event")]);
    if let Some(r) = d.end.reserved {
        figures.row([Cell::text("reserved at the end"), Cell::bytes(r), Cell::text("after the last event")]);
    }
    if d.before.blocks > 0 {
        figures.row([
            Cell::text("live before"),
            Cell::bytes(d.before.bytes),
            Cell::text(format!("in {} blocks allocated before the first event", d.before.blocks)),
        ]);
    }
    for oom in &d.ooms {
        let free = oom.device_free.map_or(String::new(), |f| format!(", {} free", Cell::bytes(f)));
        figures.row([
            Cell::text("out of memory"),
            Cell::bytes(oom.requested),
            Cell::text(format!("asked for at +{}{free}", Cell::Duration(Duration::from_micros(oom.time_us)))),
        ]);
    }
    doc.table(figures);
    if d.partial.is_empty() {
        doc.line("The history is complete: the replay ends where the final segments are.");
    } else {
        for why in &d.partial {
            doc.caution(format!("Partial history: {why}."));
        }
    }

    if d.by_category.iter().all(|c| c.category == "uncategorized") {
        doc.line("No allocation has a category (PyTorch's snapshots carry none; memlab's name what its walks saw).");
    } else {
        category_table(doc, d);
    }

    doc.heading("live at the peak, by site");
    let mut table = Table::new(vec![
        Column::new("bytes", Layout::Figure),
        Column::new("blocks", Layout::Figure),
        Column::new("share", Layout::Figure),
        Column::new("site", Layout::Text),
    ]);
    for s in d.by_site.iter().take(sites) {
        let site = s.site.as_ref().map_or_else(|| no_site(s.before_history).to_string(), |s| s.to_string());
        table.row([
            Cell::bytes(s.held.bytes),
            Cell::count(s.held.blocks),
            share(s.held.bytes, d.peak.allocated),
            Cell::text(site),
        ]);
    }
    let rest = d.by_site.get(sites..).unwrap_or_default();
    if !rest.is_empty() {
        let (bytes, blocks) = rest.iter().fold((0, 0), |(b, n), s| (b + s.held.bytes, n + s.held.blocks));
        table.row([
            Cell::bytes(bytes),
            Cell::count(blocks),
            share(bytes, d.peak.allocated),
            Cell::text(format!("{} more sites, each smaller", rest.len())),
        ]);
    }
    doc.table(table);
}

/// What a share without a site stands for.
fn no_site(before_history: bool) -> &'static str {
    if before_history {
        "(allocated before the history began)"
    } else {
        "(no stack recorded)"
    }
}

fn category_table(doc: &mut Document, d: &DeviceSummary) {
    doc.heading("live at the peak, by category");
    let mut table = Table::new(vec![
        Column::new("bytes", Layout::Figure),
        Column::new("blocks", Layout::Figure),
        Column::new("share", Layout::Figure),
        Column::new("category", Layout::Text),
    ]);
    for c in &d.by_category {
        table.row([
            Cell::bytes(c.held.bytes),
            Cell::count(c.held.blocks),
            share(c.held.bytes, d.peak.allocated),
            Cell::text(&c.category),
        ]);
    }
    doc.table(table);
}

impl Render for Summary {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        let writer = if self.writer == "memlab" { "memlab's snapshot" } else { "PyTorch's snapshot" };
        doc.title(format!("memlab summary: {}", self.file));
        let ignored: u64 = self.ignored.values().sum();
        let mut about = match &self.run {
            Some(run) => {
                let mut who: Vec<String> = run.libtorch.iter().map(|l| format!("libtorch {l}")).collect();
                if let Some(rank) = run.rank {
                    let of = run.world_size.map(|n| format!(" of {n}")).unwrap_or_default();
                    who.push(format!("rank {rank}{of}"));
                }
                who.extend(run.host.iter().map(|h| format!("on {h}")));
                format!("{writer} ({}), pickle protocol {}", who.join(", "), self.protocol)
            }
            None => format!("{writer}, pickle protocol {}", self.protocol),
        };
        if ignored > 0 {
            about += &format!("; {} keys read past ({} kinds, listed by --json)", ignored, self.ignored.len());
        }
        doc.line(about);
        doc.line(
            "Allocated bytes are what the tensors asked for (trace events carry that size); reserved bytes \
             include the caching allocator's rounding.",
        );
        if self.devices.is_empty() {
            doc.line("No device has events or segments in this file.");
        }
        for d in &self.devices {
            device(&mut doc, d, SITES);
        }
        doc
    }
}
