//! Column tables: one model, rendered as aligned text and as an HTML
//! `<table>`. Every tabular report (the line profile, the storage report,
//! the GPU account, …) builds one of these instead of laying out columns
//! itself.

use std::fmt::Write;

use unicode_width::UnicodeWidthStr;

use super::escape_html;

/// What a column holds, which decides how it is aligned and wrapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    /// Figures: right-aligned, never wrapped.
    Figure,
    /// Prose or names: left-aligned; wrapped at spaces beyond the column's
    /// maximum width.
    Text,
    /// Source code: left-aligned, indentation kept, never wrapped.
    Code,
}

/// A column: its header (one line per part, so `allocated_bytes.all.peak`
/// can stand over three rows) and what its cells hold.
#[derive(Clone, Debug)]
pub struct Column {
    header: Vec<String>,
    cell: Cell,
    min_width: usize,
    max_width: Option<usize>,
    bars: bool,
}

impl Column {
    /// A column headed by `header` (a table whose headers are all empty has
    /// no header row).
    pub fn new(header: &str, cell: Cell) -> Column {
        Column { header: vec![header.to_string()], cell, min_width: 0, max_width: None, bars: false }
    }

    /// A column whose header is split over several lines.
    pub fn stacked<S: AsRef<str>>(parts: &[S], cell: Cell) -> Column {
        Column {
            header: parts.iter().map(|p| p.as_ref().to_string()).collect(),
            cell,
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

    /// In HTML, each cell with a value (see [`Table::row_values`]) draws a
    /// bar behind its figure, as long as the value against the column's
    /// largest (pytorch_memlab's notebook view draws its byte columns so).
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
}

#[derive(Clone, Debug)]
enum Line {
    Cells { cells: Vec<String>, values: Vec<Option<i64>>, indent: usize, idle: bool },
    Rule,
    Note(String),
}

/// A table: columns, then rows, rules and notes in order.
#[derive(Clone, Debug)]
pub struct Table {
    columns: Vec<Column>,
    lines: Vec<Line>,
    rule_under_header: bool,
}

/// The gap between two columns of text.
const GAP: &str = "  ";

impl Table {
    /// An empty table of `columns`.
    pub fn new(columns: Vec<Column>) -> Table {
        Table { columns, lines: Vec::new(), rule_under_header: false }
    }

    /// A dashed rule under the header (text only; HTML has its own).
    pub fn with_header_rule(mut self) -> Table {
        self.rule_under_header = true;
        self
    }

    /// A row of cells, one per column (missing cells are blank).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Table {
        self.push(cells, 0, false)
    }

    /// A row whose first cell is indented by `indent` spaces: a part listed
    /// under its whole.
    pub fn indented_row<S: Into<String>>(&mut self, indent: usize, cells: impl IntoIterator<Item = S>) -> &mut Table {
        self.push(cells, indent, false)
    }

    /// A row that stands for something that did not happen (a line that
    /// never ran): blank figures, greyed in HTML.
    pub fn idle_row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Table {
        self.push(cells, 0, true)
    }

    /// A row whose cells also carry the values they show (`None`: none),
    /// for the bars of columns that draw them.
    pub fn row_values<S: Into<String>>(
        &mut self,
        cells: impl IntoIterator<Item = S>,
        values: Vec<Option<i64>>,
        idle: bool,
    ) -> &mut Table {
        self.push(cells, 0, idle);
        if let Some(Line::Cells { values: v, .. }) = self.lines.last_mut() {
            *v = values;
        }
        self
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

    fn push<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>, indent: usize, idle: bool) -> &mut Table {
        let mut cells: Vec<String> = cells.into_iter().map(Into::into).collect();
        cells.resize(self.columns.len(), String::new());
        self.lines.push(Line::Cells { cells, values: Vec::new(), indent, idle });
        self
    }

    /// Each row's cells, wrapped: the lines a row takes per column.
    fn wrapped(&self, cells: &[String], indent: usize) -> Vec<Vec<String>> {
        cells
            .iter()
            .zip(&self.columns)
            .enumerate()
            .map(|(i, (text, c))| {
                let pad = if i == 0 { indent } else { 0 };
                match (c.cell, c.max_width) {
                    (Cell::Text, Some(max)) => {
                        let mut parts = wrap(text, max.saturating_sub(pad).max(1)).into_iter();
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
                match (c.cell, c.max_width) {
                    (Cell::Text, Some(max)) => wanted.min(max.max(c.min_width).max(head)),
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
            let cells: Vec<&str> =
                self.columns.iter().map(|c| c.header.get(line).map(String::as_str).unwrap_or("")).collect();
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
                Line::Note(text) => writeln!(out, "{text}").unwrap(),
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
            if c.cell == Cell::Figure {
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
            } else {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            }
        }
        writeln!(out, "{}", text.trim_end()).unwrap();
    }

    /// An HTML `<table>` (to go inside [`html_block`](super::html_block)):
    /// header parts stacked with `<br>`, text and code columns classed for
    /// the stylesheet, notes as full-width rows.
    pub fn to_html(&self) -> String {
        let class = |c: &Column| match c.cell {
            Cell::Figure => "",
            Cell::Text => " class=\"text\"",
            Cell::Code => " class=\"code\"",
        };
        // The largest magnitude of each column with bars.
        let scale: Vec<i64> = (0..self.columns.len())
            .map(|i| {
                self.lines
                    .iter()
                    .filter_map(|l| match l {
                        Line::Cells { values, .. } => values.get(i).copied().flatten(),
                        _ => None,
                    })
                    .map(i64::unsigned_abs)
                    .max()
                    .map_or(0, |m| m.min(i64::MAX as u64) as i64)
            })
            .collect();
        let mut out = String::from("<table>\n");
        if self.headed() {
            out.push_str("<tr>");
            for c in &self.columns {
                let header: Vec<String> = c.header.iter().map(|h| escape_html(h)).collect();
                write!(out, "<th{}>{}</th>", class(c), header.join("<br>")).unwrap();
            }
            out.push_str("</tr>\n");
        }
        for l in &self.lines {
            match l {
                Line::Cells { cells, values, indent, idle } => {
                    out.push_str(if *idle { "<tr class=\"idle\">" } else { "<tr>" });
                    for (i, (cell, c)) in cells.iter().zip(&self.columns).enumerate() {
                        let text = escape_html(cell);
                        let value = values.get(i).copied().flatten().filter(|_| c.bars && scale[i] > 0);
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
            Column::new("name", Cell::Text).min_width(6).max_width(12),
            Column::new("bytes", Cell::Figure).min_width(7),
        ])
        .with_header_rule();
        t.row(["fc.weight", "4.00M"]).indented_row(2, ["a much longer name", "(16.00B)"]).rule().note("named: 4.00M");
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
            Column::stacked(&["active_bytes", "all", "peak"], Cell::Figure),
            Column::new("code", Cell::Code),
        ]);
        t.row(["1.00K", "let x = 1;"]).idle_row(["", "    // 名前 <b>"]);
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
        let mut t = Table::new(vec![Column::new("name", Cell::Text), Column::new("bytes", Cell::Figure)]);
        t.row(["名前", "1.00K"]).row(["ab", "2.00K"]);
        assert_eq!(t.to_text(), "name  bytes\n名前  1.00K\nab    2.00K\n");
    }
}
