//! The text table, in the layout pytorch_memlab users know: a `## function`
//! heading, a header whose stat names are split over three rows, then one row
//! per source line with its figures (blank where nothing ran) and its code.

use std::fmt::Write;

use super::{Column, FunctionReport, Report};
use crate::render::{format_bytes, signed_bytes, Cell, Column as TableColumn, Table};

/// A cell's text: sizes for byte columns (signed for increments), plain
/// numbers for counts.
pub(super) fn cell(column: &Column, value: i64) -> String {
    match (column.is_bytes(), column.signed()) {
        (true, true) => signed_bytes(value),
        (true, false) => format_bytes(value),
        (false, _) => value.to_string(),
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

pub(super) fn render(report: &Report) -> String {
    let mut out = String::new();
    for f in &report.functions {
        if let Some(e) = &f.error {
            writeln!(out, "## {}\n\nnot measured: {e}\n", f.title()).unwrap();
        } else if f.ran() {
            render_function(&mut out, f, report.columns());
        }
    }
    let idle: Vec<String> =
        report.functions.iter().filter(|f| !f.ran() && f.error.is_none()).map(FunctionReport::title).collect();
    if !idle.is_empty() {
        writeln!(out, "Profiled, never called: {}\n", idle.join(", ")).unwrap();
    }
    out
}

fn render_function(out: &mut String, f: &FunctionReport, columns: &[Column]) {
    writeln!(out, "## {}\n", heading(f)).unwrap();
    out.push_str(&table(f, columns).to_text());
    out.push('\n');
}

/// A function's lines as a table: the chosen statistics (their names split
/// at the dots over up to three header rows), the line number and the code.
pub(super) fn table(f: &FunctionReport, columns: &[Column]) -> Table {
    // A function that ran out of memory says where, whatever the columns.
    let had_oom = f.lines.iter().any(|l| l.stats.as_ref().is_some_and(|s| s.ooms > 0));
    let with_ooms: Vec<Column>;
    let columns = if had_oom && !columns.contains(&Column::Ooms) {
        with_ooms = columns.iter().copied().chain([Column::Ooms]).collect();
        &with_ooms[..]
    } else {
        columns
    };
    let mut header: Vec<TableColumn> = columns
        .iter()
        .map(|c| {
            let column = TableColumn::stacked(&c.name().splitn(3, '.').collect::<Vec<_>>(), Cell::Figure);
            if c.is_bytes() {
                column.bars()
            } else {
                column
            }
        })
        .collect();
    header.push(TableColumn::new("line", Cell::Figure).min_width(4));
    header.push(TableColumn::new("code", Cell::Code));
    let mut table = Table::new(header);
    for (l, code) in f.lines.iter().zip(dedented(f)) {
        let figures = columns.iter().map(|c| l.stats.as_ref().map(|s| cell(c, c.value(s))).unwrap_or_default());
        let cells = figures.chain([l.line.to_string(), code.to_string()]);
        let values = columns.iter().map(|c| l.stats.as_ref().map(|s| c.value(s))).collect();
        table.row_values(cells, values, l.stats.is_none());
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_base_1024_and_two_decimals() {
        assert_eq!(format_bytes(0), "0.00B");
        assert_eq!(format_bytes(512), "512.00B");
        assert_eq!(format_bytes(40 * 1024), "40.00K");
        assert_eq!(format_bytes(4 * 1024 * 1024), "4.00M");
        assert_eq!(format_bytes(-3 * 1024 * 1024 * 1024), "-3.00G");
        assert_eq!(cell(&Column::Increment, 4 << 20), "+4.00M");
        assert_eq!(cell(&Column::Increment, -(4 << 20)), "-4.00M");
        assert_eq!(cell(&Column::Increment, 0), "0.00B");
        assert_eq!(cell(&Column::Hits, 12), "12");
    }
}
