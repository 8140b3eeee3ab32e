//! The line profile as a document, in the layout pytorch_memlab users
//! know: a `## function` heading, a header whose stat names are split over
//! three rows, then one row per source line with its figures (empty where
//! nothing ran) and its code.

use std::fmt::Write;

use super::{FunctionReport, ProfileColumn, Report};
use crate::render::{Cell, Column as TableColumn, Document, Layout, Render, Table};

/// A figure of `column`: bytes (signed for increments) or a count.
pub(super) fn cell(column: &ProfileColumn, value: i64) -> Cell {
    match (column.is_bytes(), column.signed()) {
        (true, true) => Cell::SignedBytes(value.into()),
        (true, false) => Cell::Bytes(value.into()),
        (false, _) => Cell::Count(value.into()),
    }
}

/// The function's heading, shared by the renderings.
pub(super) fn heading(f: &FunctionReport) -> String {
    let mut out = f.title();
    let calls = if f.calls == 1 { "1 call".to_string() } else { format!("{} calls", f.calls) };
    match f.device {
        Some(d) => write!(out, "  ({d}, {calls})").unwrap(),
        None => write!(out, "  ({calls})").unwrap(),
    }
    out
}

/// The lines of a function's code without the indentation they all share.
pub(super) fn dedented(f: &FunctionReport) -> Vec<&str> {
    let indent = f
        .lines
        .iter()
        .filter(|l| !l.code.trim().is_empty())
        .map(|l| l.code.len() - l.code.trim_start().len())
        .min()
        .unwrap_or(0);
    f.lines.iter().map(|l| l.code.get(indent..).unwrap_or(l.code.trim_start()).trim_end()).collect()
}

/// One section per function that ran (its table, or why it was not
/// measured), then a line naming the profiled functions that never ran.
impl Render for Report {
    /// Every line that ran, one CSV row each, with all statistics in bytes or counts.
    fn to_csv(&self) -> crate::error::Result<String> {
        super::export::csv(self)
    }

    fn document(&self) -> Document {
        let mut doc = Document::new();
        for f in &self.functions {
            if let Some(e) = &f.error {
                doc.section(f.title()).blank().line(format!("not measured: {e}")).blank();
            } else if f.ran() {
                doc.section(heading(f)).blank().table(table(f, self.columns())).blank();
            }
        }
        let idle: Vec<String> =
            self.functions.iter().filter(|f| !f.ran() && f.error.is_none()).map(FunctionReport::title).collect();
        if !idle.is_empty() {
            doc.line(format!("Profiled, never called: {}", idle.join(", "))).blank();
        }
        doc
    }
}

/// A function's lines as a table: the chosen statistics (their names split
/// at the dots over up to three header rows), the line number and the code.
fn table(f: &FunctionReport, columns: &[ProfileColumn]) -> Table {
    // A function that ran out of memory says where, whatever the columns.
    let had_oom = f.lines.iter().any(|l| l.stats.as_ref().is_some_and(|s| s.ooms > 0));
    let with_ooms: Vec<ProfileColumn>;
    let columns = if had_oom && !columns.contains(&ProfileColumn::Ooms) {
        with_ooms = columns.iter().copied().chain([ProfileColumn::Ooms]).collect();
        &with_ooms[..]
    } else {
        columns
    };
    let mut header: Vec<TableColumn> = columns
        .iter()
        .map(|c| {
            let column = TableColumn::stacked(&c.name().splitn(3, '.').collect::<Vec<_>>(), Layout::Figure);
            if c.is_bytes() {
                column.bars()
            } else {
                column
            }
        })
        .collect();
    header.push(TableColumn::new("line", Layout::Figure).min_width(4));
    header.push(TableColumn::new("code", Layout::Code));
    let mut table = Table::new(header);
    for (l, code) in f.lines.iter().zip(dedented(f)) {
        let figures = columns.iter().map(|c| l.stats.as_ref().map_or(Cell::Empty, |s| cell(c, c.value(s))));
        let cells = figures.chain([Cell::count(l.line), Cell::code(code)]);
        match l.stats {
            Some(_) => table.row(cells),
            None => table.idle_row(cells),
        };
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_of_each_column_kind() {
        let text = |c: &ProfileColumn, v: i64| cell(c, v).to_string();
        assert_eq!(text(&ProfileColumn::Increment, 4 << 20), "+4.00M");
        assert_eq!(text(&ProfileColumn::Increment, -(4 << 20)), "-4.00M");
        assert_eq!(text(&ProfileColumn::Increment, 0), "0.00B");
        assert_eq!(text(&ProfileColumn::Hits, 12), "12");
    }
}
