//! Column tables: one model, rendered as aligned text and as an HTML
//! `<table>`. Every tabular report (the line profile, the storage report,
//! the GPU account, …) builds one of these instead of laying out columns
//! itself.

use std::fmt::Write;

use unicode_width::UnicodeWidthStr;

use super::{csv_string, escape_html, Cell};
use crate::error::Result;

/// How a column lays out its cells: aligned and wrapped by what they hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Figures: right-aligned, never wrapped.
    Figure,
    /// Prose or names: left-aligned; wrapped at spaces beyond the column's
    /// maximum width.
    Text,
    /// Source code: left-aligned, indentation kept, never wrapped.
    Code,
}

/// A column: its header (one line per part, so `allocated_bytes.all.peak`
/// can stand over three rows) and how it lays out its cells.
#[derive(Clone, Debug)]
pub struct Column {
    header: Vec<String>,
    layout: Layout,
    min_width: usize,
    max_width: Option<usize>,
    bars: bool,
}

impl Column {
    /// A column headed by `header` (a table whose headers are all empty has
    /// no header row).
    pub fn new(header: &str, layout: Layout) -> Column {
        Column::stacked(&[header], layout)
    }

    /// A column whose header is split over several lines.
    pub fn stacked<S: AsRef<str>>(parts: &[S], layout: Layout) -> Column {
        Column {
            header: parts.iter().map(|p| p.as_ref().to_string()).collect(),
            layout,
            min_width: 0,
            max_width: None,
            bars: false,
        }
    }

    /// The column is at least `width` characters wide.
    pub fn min_width(mut self, width: usize) -> Column {
        self.min_width = width;
        self
    }

    /// In HTML, each figure of the column draws a bar behind it, as long as
    /// the figure against the column's largest (pytorch_memlab's notebook
    /// view draws its byte columns so): growth in blue, shrinkage in red.
    pub fn bars(mut self) -> Column {
        self.bars = true;
        self
    }

    /// Text cells wider than `width` wrap at spaces onto lines of their own
    /// (a word longer than that keeps a line of its own, unbroken).
    pub fn max_width(mut self, width: usize) -> Column {
        self.max_width = Some(width);
        self
    }

    /// The header on one line, its parts joined by dots (CSV and JSON).
    fn name(&self) -> String {
        self.header.join(".")
    }
}

#[derive(Clone, Debug)]
enum Line {
    Cells { cells: Vec<Cell>, indent: usize, idle: bool },
    Rule,
    Note(String),
}

/// A table: columns, then rows, rules and notes in order.
#[derive(Clone, Debug)]
pub struct Table {
    columns: Vec<Column>,
    lines: Vec<Line>,
    rule_under_header: bool,
    shown: Option<usize>,
}

/// The gap between two columns of text.
const GAP: &str = "  ";

impl Table {
    /// An empty table of `columns`.
    pub fn new(columns: Vec<Column>) -> Table {
        Table { columns, lines: Vec::new(), rule_under_header: false, shown: None }
    }

    /// A dashed rule under the header (text only; HTML has its own).
    pub fn with_header_rule(mut self) -> Table {
        self.rule_under_header = true;
        self
    }

    /// In HTML, only the first `rows` rows show (put the largest first);
    /// the rest wait behind a summary row (how many, their bytes added up)
    /// that opens them with a click. Text, CSV and JSON keep every row.
    pub fn collapsed_after(mut self, rows: usize) -> Table {
        self.shown = Some(rows);
        self
    }

    /// [`collapsed_after`](Self::collapsed_after) the rows a list of sites
    /// shows at first: twenty.
    pub fn collapsed(self) -> Table {
        self.collapsed_after(20)
    }

    /// A row of cells, one per column (missing cells are empty).
    pub fn row<C: Into<Cell>>(&mut self, cells: impl IntoIterator<Item = C>) -> &mut Table {
        self.push(cells, 0, false)
    }

    /// A row whose first cell is indented by `indent` spaces: a part listed
    /// under its whole.
    pub fn indented_row<C: Into<Cell>>(&mut self, indent: usize, cells: impl IntoIterator<Item = C>) -> &mut Table {
        self.push(cells, indent, false)
    }

    /// A row that stands for something that did not happen (a line that
    /// never ran): empty figures, greyed in HTML.
    pub fn idle_row<C: Into<Cell>>(&mut self, cells: impl IntoIterator<Item = C>) -> &mut Table {
        self.push(cells, 0, true)
    }

    /// A dashed rule across the table.
    pub fn rule(&mut self) -> &mut Table {
        self.lines.push(Line::Rule);
        self
    }

    /// A line of prose across the whole table, between its rows.
    pub fn note(&mut self, text: impl Into<String>) -> &mut Table {
        self.lines.push(Line::Note(text.into()));
        self
    }

    /// Whether any column has a header (a table of labelled rows may have none).
    fn headed(&self) -> bool {
        self.columns.iter().any(|c| c.header.iter().any(|h| !h.is_empty()))
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        !self.lines.iter().any(|l| matches!(l, Line::Cells { .. }))
    }

    fn push<C: Into<Cell>>(&mut self, cells: impl IntoIterator<Item = C>, indent: usize, idle: bool) -> &mut Table {
        let mut cells: Vec<Cell> = cells.into_iter().map(Into::into).collect();
        cells.resize(self.columns.len(), Cell::Empty);
        self.lines.push(Line::Cells { cells, indent, idle });
        self
    }

    fn rows(&self) -> impl Iterator<Item = &[Cell]> {
        self.lines.iter().filter_map(|l| match l {
            Line::Cells { cells, .. } => Some(&cells[..]),
            _ => None,
        })
    }

    /// Each row's cells as text, wrapped: the lines a row takes per column.
    fn wrapped(&self, cells: &[Cell], indent: usize) -> Vec<Vec<String>> {
        cells
            .iter()
            .zip(&self.columns)
            .enumerate()
            .map(|(i, (cell, c))| {
                let pad = if i == 0 { indent } else { 0 };
                let text = cell.to_string();
                let text = super::visible(&text, matches!(cell, Cell::Code(_))).into_owned();
                match (c.layout, c.max_width) {
                    (Layout::Text, Some(max)) => {
                        let mut parts = wrap(&text, max.saturating_sub(pad).max(1)).into_iter();
                        let first = format!("{}{}", " ".repeat(pad), parts.next().unwrap_or_default());
                        std::iter::once(first).chain(parts.map(|p| format!("{}{p}", " ".repeat(pad + 4)))).collect()
                    }
                    _ => vec![format!("{}{text}", " ".repeat(pad))],
                }
            })
            .collect()
    }

    fn widths(&self, rows: &[Vec<Vec<String>>]) -> Vec<usize> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let head = c.header.iter().map(|h| h.width()).max().unwrap_or(0);
                let cells = rows.iter().flat_map(|r| r[i].iter()).map(|s| s.width()).max().unwrap_or(0);
                let wanted = head.max(cells).max(c.min_width);
                // A wrapped column is as wide as its widest line, at most its maximum
                // (a single long word may still stick out).
                match (c.layout, c.max_width) {
                    (Layout::Text, Some(max)) => wanted.min(max.max(c.min_width).max(head)),
                    _ => wanted,
                }
            })
            .collect()
    }

    /// The aligned text: columns two spaces apart, no trailing spaces.
    pub fn to_text(&self) -> String {
        let rows: Vec<Vec<Vec<String>>> = self
            .lines
            .iter()
            .filter_map(|l| match l {
                Line::Cells { cells, indent, .. } => Some(self.wrapped(cells, *indent)),
                _ => None,
            })
            .collect();
        let widths = self.widths(&rows);
        let total = widths.iter().sum::<usize>() + GAP.len() * widths.len().saturating_sub(1);
        let mut out = String::new();
        let header_lines =
            if self.headed() { self.columns.iter().map(|c| c.header.len()).max().unwrap_or(0) } else { 0 };
        for line in 0..header_lines {
            let cells: Vec<std::borrow::Cow<'_, str>> = self
                .columns
                .iter()
                .map(|c| super::visible(c.header.get(line).map(String::as_str).unwrap_or(""), false))
                .collect();
            let cells: Vec<&str> = cells.iter().map(|c| &**c).collect();
            self.write_line(&mut out, &cells, &widths);
        }
        if self.rule_under_header {
            writeln!(out, "{}", "-".repeat(total)).unwrap();
        }
        let mut rows = rows.iter();
        for l in &self.lines {
            match l {
                Line::Cells { .. } => {
                    let row = rows.next().expect("one wrapped row per row");
                    let height = row.iter().map(Vec::len).max().unwrap_or(1);
                    for k in 0..height {
                        let cells: Vec<&str> = row.iter().map(|c| c.get(k).map(String::as_str).unwrap_or("")).collect();
                        self.write_line(&mut out, &cells, &widths);
                    }
                }
                Line::Rule => writeln!(out, "{}", "-".repeat(total)).unwrap(),
                Line::Note(text) => writeln!(out, "{}", super::visible(text, false)).unwrap(),
            }
        }
        out
    }

    fn write_line(&self, out: &mut String, cells: &[&str], widths: &[usize]) {
        let mut text = String::new();
        for (i, ((cell, c), width)) in cells.iter().zip(&self.columns).zip(widths).enumerate() {
            if i > 0 {
                text.push_str(GAP);
            }
            let pad = width.saturating_sub(cell.width());
            // Headers of figures sit over the figures' right edge, other headers
            // over the text's left edge, as the cells below them.
            if c.layout == Layout::Figure {
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
            } else {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            }
        }
        writeln!(out, "{}", text.trim_end()).unwrap();
    }

    /// The rows as CSV: a header of the columns' names (parts joined by
    /// dots), then one record per row with its figures unrounded. Rules and
    /// notes are left out.
    pub fn to_csv(&self) -> Result<String> {
        let header: Vec<String> = self.columns.iter().map(Column::name).collect();
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        csv_string("a table", &header, self.rows().map(|r| r.iter().map(Cell::to_csv).collect::<Vec<_>>()))
    }

    /// The table as JSON: `columns` (their names), `rows` (arrays of
    /// values, figures as exact numbers) and `notes`.
    pub fn to_json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> =
            self.rows().map(|r| r.iter().map(Cell::to_json).collect::<Vec<_>>().into()).collect();
        let notes: Vec<&str> = self
            .lines
            .iter()
            .filter_map(|l| match l {
                Line::Note(text) => Some(text.as_str()),
                _ => None,
            })
            .collect();
        let columns: Vec<String> = self.columns.iter().map(Column::name).collect();
        serde_json::json!({ "columns": columns, "rows": rows, "notes": notes })
    }

    /// How many rows show before the summary row, if the table collapses.
    fn collapse_at(&self) -> Option<usize> {
        let rows = self.rows().count();
        // Hiding a single row behind a row of its own saves nothing.
        self.shown.filter(|&shown| rows >= shown + 2)
    }

    /// An HTML `<table>` (to go inside [`html_block`](super::html_block)):
    /// header parts stacked with `<br>`, text and code columns classed for
    /// the stylesheet, notes as full-width rows; a collapsed table's rest
    /// behind a summary row.
    pub fn to_html(&self) -> String {
        let class = |c: &Column| match c.layout {
            Layout::Figure => "",
            Layout::Text => " class=\"text\"",
            Layout::Code => " class=\"code\"",
        };
        // The largest magnitude of each column with bars.
        let scale: Vec<u128> = (0..self.columns.len())
            .map(|i| self.rows().filter_map(|r| r[i].magnitude()).map(i128::unsigned_abs).max().unwrap_or(0))
            .collect();
        let collapse = self.collapse_at();
        let id = collapse.map(|_| self.html_id());
        let mut out = String::new();
        if let Some(id) = &id {
            writeln!(out, "<input type=\"checkbox\" class=\"more\" id=\"{id}\" hidden>").unwrap();
        }
        out.push_str("<table>\n");
        if self.headed() {
            out.push_str("<tr>");
            for c in &self.columns {
                let header: Vec<String> = c.header.iter().map(|h| escape_html(h)).collect();
                write!(out, "<th{}>{}</th>", class(c), header.join("<br>")).unwrap();
            }
            out.push_str("</tr>\n");
        }
        let mut row = 0;
        for l in &self.lines {
            match l {
                Line::Cells { cells, indent, idle } => {
                    let hidden = collapse.is_some_and(|shown| row >= shown);
                    if collapse == Some(row) {
                        self.summary_row(&mut out, id.as_deref().unwrap_or_default(), row);
                    }
                    row += 1;
                    out.push_str(match (*idle, hidden) {
                        (_, true) => "<tr class=\"rest\">",
                        (true, false) => "<tr class=\"idle\">",
                        (false, false) => "<tr>",
                    });
                    for (i, (cell, c)) in cells.iter().zip(&self.columns).enumerate() {
                        let text = escape_html(&cell.to_string());
                        let value = cell.magnitude().filter(|_| c.bars && scale[i] > 0);
                        if let Some(v) = value {
                            // Growth in blue, shrinkage in red, as long as the value.
                            let share = v.unsigned_abs() as f64 * 100.0 / scale[i] as f64;
                            let colour = if v < 0 { "#f3c4c4" } else { "#c9dcf2" };
                            write!(
                                out,
                                "<td style=\"background:linear-gradient(to left,{colour} {share:.1}%,transparent {share:.1}%)\">{text}</td>"
                            )
                            .unwrap();
                        } else if i == 0 && *indent > 0 {
                            write!(
                                out,
                                "<td{} style=\"padding-left:{}em\">{text}</td>",
                                class(c),
                                0.6 + *indent as f64 * 0.5
                            )
                            .unwrap();
                        } else {
                            write!(out, "<td{}>{text}</td>", class(c)).unwrap();
                        }
                    }
                    out.push_str("</tr>\n");
                }
                Line::Rule => {}
                Line::Note(text) => writeln!(
                    out,
                    "<tr><td class=\"text note\" colspan=\"{}\">{}</td></tr>",
                    self.columns.len(),
                    escape_html(text)
                )
                .unwrap(),
            }
        }
        out.push_str("</table>\n");
        out
    }

    /// The row that stands for the hidden rows from `shown` on: how many
    /// (in the first column of text), and under each column of bytes their
    /// sum; a click on it shows them.
    fn summary_row(&self, out: &mut String, id: &str, shown: usize) {
        let hidden: Vec<&[Cell]> = self.rows().skip(shown).collect();
        let label = self.columns.iter().position(|c| c.layout != Layout::Figure).unwrap_or(0);
        out.push_str("<tr class=\"more\">");
        for (i, c) in self.columns.iter().enumerate() {
            if i == label {
                write!(out, "<td class=\"text\"><label for=\"{id}\">&#9656; {} more rows</label></td>", hidden.len())
                    .unwrap();
                continue;
            }
            let sum = hidden.iter().try_fold(0i128, |sum, r| match r[i] {
                Cell::Bytes(n) => Some(sum.saturating_add(n)),
                // A view's bytes are its storage's, which another row counts.
                Cell::SharedBytes(_) => Some(sum),
                Cell::BytesIn { bytes, .. } => Some(sum.saturating_add(bytes)),
                _ => None,
            });
            match sum.filter(|_| c.layout == Layout::Figure) {
                Some(bytes) => write!(out, "<td>{}</td>", Cell::Bytes(bytes)).unwrap(),
                None => out.push_str("<td></td>"),
            }
        }
        out.push_str("</tr>\n");
    }

    /// An id for the collapsing checkbox, the same for the same table (a
    /// page renders the same way every time) and told apart by content.
    fn html_id(&self) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for cell in self.rows().flatten() {
            for byte in cell.to_string().bytes().chain([0]) {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("memlab-more-{hash:016x}")
    }
}

/// `text` cut at spaces into lines of at most `width` columns (a word longer
/// than that gets a line of its own): every cell reads in full.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let needed = if line.is_empty() { word.width() } else { line.width() + 1 + word.width() };
        if needed > width && !line.is_empty() {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_text_wraps() {
        let mut t = Table::new(vec![
            Column::new("name", Layout::Text).min_width(6).max_width(12),
            Column::new("bytes", Layout::Figure).min_width(7),
        ])
        .with_header_rule();
        t.row([Cell::text("fc.weight"), Cell::bytes(4u64 << 20)])
            .indented_row(2, [Cell::text("a much longer name"), Cell::SharedBytes(16)])
            .rule()
            .note("named: 4.00M");
        assert_eq!(
            t.to_text(),
            "name             bytes\n\
             ----------------------\n\
             fc.weight        4.00M\n  \
             a much      (16.00B)\n      \
             longer\n      \
             name\n\
             ----------------------\n\
             named: 4.00M\n"
        );
        let html = t.to_html();
        assert!(html.contains("<th class=\"text\">name</th><th>bytes</th>"), "{html}");
        assert!(html.contains("<td class=\"text note\" colspan=\"2\">named: 4.00M</td>"), "{html}");
    }

    #[test]
    fn stacked_headers_idle_rows_and_wide_characters() {
        let mut t = Table::new(vec![
            Column::stacked(&["active_bytes", "all", "peak"], Layout::Figure),
            Column::new("code", Layout::Code),
        ]);
        t.row([Cell::bytes(1024u64), Cell::code("let x = 1;")]).idle_row([Cell::Empty, Cell::code("    // 名前 <b>")]);
        assert_eq!(
            t.to_text(),
            "active_bytes  code\n         all\n        peak\n       1.00K  let x = 1;\n                  // 名前 <b>\n"
        );
        let html = t.to_html();
        assert!(html.contains("<th>active_bytes<br>all<br>peak</th>"), "{html}");
        assert!(
            html.contains("<tr class=\"idle\"><td></td><td class=\"code\">    // 名前 &lt;b&gt;</td></tr>"),
            "{html}"
        );
        // A double-width name still lines up its figures.
        let mut t = Table::new(vec![Column::new("name", Layout::Text), Column::new("bytes", Layout::Figure)]);
        t.row([Cell::text("名前"), Cell::bytes(1024u64)]).row([Cell::text("ab"), Cell::bytes(2048u64)]);
        assert_eq!(t.to_text(), "name  bytes\n名前  1.00K\nab    2.00K\n");
    }

    #[test]
    fn figures_stay_exact_in_csv_and_json() {
        let mut t = Table::new(vec![
            Column::new("name", Layout::Text),
            Column::stacked(&["active_bytes", "all", "peak"], Layout::Figure),
        ]);
        t.row([Cell::text("fc, weight"), Cell::bytes(4_194_305u64)]).note("a note").row(["only a name"]);
        assert_eq!(t.to_csv().unwrap(), "name,active_bytes.all.peak\n\"fc, weight\",4194305\nonly a name,\n");
        assert_eq!(
            t.to_json(),
            serde_json::json!({
                "columns": ["name", "active_bytes.all.peak"],
                "rows": [["fc, weight", 4_194_305], ["only a name", null]],
                "notes": ["a note"],
            })
        );
    }

    #[test]
    fn a_collapsed_table_hides_its_rest_in_html_only() {
        let table = |rows: u64| {
            let mut t = Table::new(vec![Column::new("bytes", Layout::Figure), Column::new("name", Layout::Text)])
                .collapsed_after(2);
            for i in 0..rows {
                t.row([Cell::bytes((10 - i) << 10), Cell::text(format!("t{i}"))]);
            }
            t
        };
        let html = table(5).to_html();
        let id = html.split("id=\"").nth(1).and_then(|r| r.split('"').next()).expect("a checkbox id");
        assert!(html.starts_with(&format!("<input type=\"checkbox\" class=\"more\" id=\"{id}\" hidden>\n<table>")));
        // Two rows show, then the summary of the three others (8 + 7 + 6 KiB).
        let summary = format!("<tr class=\"more\"><td>21.00K</td><td class=\"text\"><label for=\"{id}\">&#9656; 3 more rows</label></td></tr>");
        assert!(
            html.contains(&format!(
                "<td>9.00K</td><td class=\"text\">t1</td></tr>\n{summary}\n<tr class=\"rest\"><td>8.00K</td>"
            )),
            "{html}"
        );
        assert_eq!(html.matches("<tr class=\"rest\">").count(), 3, "{html}");
        // The text keeps every row; a table one row longer than shown does not collapse.
        assert_eq!(table(5).to_text().lines().count(), 6);
        assert!(!table(3).to_html().contains("more"), "{}", table(3).to_html());
        assert_ne!(table(4).html_id(), table(5).html_id());
    }
}
