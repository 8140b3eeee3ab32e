//! A report as a sequence of blocks (headings, lines, label rows, tables)
//! that renders as text, as self-styled HTML, as CSV, as JSON and into an
//! evcxr notebook cell. Reports describe themselves as a [`Document`]; none
//! lays out text, formats a figure or writes HTML itself.

use std::fmt::Write;

use unicode_width::UnicodeWidthStr;

use super::{csv_string, escape_html, html_block, label_row, Cell, Icicle, Table, Timeline, STYLESHEET};
use crate::error::Result;

#[derive(Clone, Debug)]
enum Block {
    Title(String),
    Part(String),
    Heading(String),
    Section(String),
    Banner(String),
    Line { text: String, indent: usize },
    Note(String),
    Caution(String),
    Timeline(Box<Timeline>),
    Icicle(Box<Icicle>),
    Labels { width: usize, rows: Vec<(String, Cell)> },
    Table(Table),
    Blank,
}

/// A rendered report in the making.
#[derive(Clone, Debug, Default)]
pub struct Document {
    blocks: Vec<Block>,
}

impl Document {
    /// An empty document.
    pub fn new() -> Document {
        Document::default()
    }

    /// The title of a page: underlined with `=` in text, an `<h1>` in HTML.
    pub fn title(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Title(text.into()));
        self
    }

    /// The title of a part of a page: underlined with `-` in text, an
    /// `<h2>` in HTML.
    pub fn part(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Part(text.into()));
        self
    }

    /// A title line (an `<h3>` in HTML).
    pub fn heading(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Heading(text.into()));
        self
    }

    /// The title of one of several like parts (a profiled function's
    /// lines): `## title` in text, an `<h3>` in HTML.
    pub fn section(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Section(text.into()));
        self
    }

    /// A title between two rows of stars, as Pytorch-Memory-Utils prints
    /// it (an `<h3>` in HTML).
    pub fn banner(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Banner(text.into()));
        self
    }

    /// A line of prose.
    pub fn line(&mut self, text: impl Into<String>) -> &mut Document {
        self.indented(0, text)
    }

    /// A line of prose indented by `indent` spaces: a detail of the line above.
    pub fn indented(&mut self, indent: usize, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Line { text: text.into(), indent });
        self
    }

    /// A line that explains what follows (greyed in HTML).
    pub fn note(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Note(text.into()));
        self
    }

    /// A line that warns that what follows is incomplete or uncertain (boxed
    /// in HTML).
    pub fn caution(&mut self, text: impl Into<String>) -> &mut Document {
        self.blocks.push(Block::Caution(text.into()));
        self
    }

    /// A timeline: a drawing in HTML, a sparkline in text.
    pub fn timeline(&mut self, timeline: Timeline) -> &mut Document {
        self.blocks.push(Block::Timeline(Box::new(timeline)));
        self
    }

    /// An icicle graph: a drawing in HTML, its heaviest frames in text.
    pub fn icicle(&mut self, icicle: Icicle) -> &mut Document {
        self.blocks.push(Block::Icicle(Box::new(icicle)));
        self
    }

    /// A label and its value: `label` dotted out to `width` columns, the
    /// value right-aligned after it (consecutive rows form one block).
    pub fn label(&mut self, width: usize, label: impl Into<String>, value: impl Into<Cell>) -> &mut Document {
        let row = (label.into(), value.into());
        match self.blocks.last_mut() {
            Some(Block::Labels { width: w, rows }) if *w == width => rows.push(row),
            _ => self.blocks.push(Block::Labels { width, rows: vec![row] }),
        }
        self
    }

    /// A table.
    pub fn table(&mut self, table: Table) -> &mut Document {
        self.blocks.push(Block::Table(table));
        self
    }

    /// Every block of `other`, after this document's: a report that
    /// includes another (the OOM report its diagnosis) as data.
    pub fn append(&mut self, other: Document) -> &mut Document {
        self.blocks.extend(other.blocks);
        self
    }

    /// An empty line between sections (text only).
    pub fn blank(&mut self) -> &mut Document {
        self.blocks.push(Block::Blank);
        self
    }

    /// The text rendering.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        // Every block is one line of text (a table, lines of one): names in
        // it are written with their control characters made visible.
        let v = |text: &str| super::visible(text, false).into_owned();
        for b in &self.blocks {
            match b {
                Block::Title(text) => {
                    let text = v(text);
                    writeln!(out, "{text}\n{}", "=".repeat(text.width())).unwrap()
                }
                Block::Part(text) => {
                    let text = v(text);
                    writeln!(out, "\n{text}\n{}", "-".repeat(text.width())).unwrap()
                }
                Block::Heading(text) | Block::Note(text) | Block::Caution(text) => {
                    writeln!(out, "{}", v(text)).unwrap()
                }
                Block::Timeline(t) => out.push_str(&t.to_text(SPARKLINE)),
                Block::Icicle(i) => out.push_str(&i.to_text()),
                Block::Section(text) => writeln!(out, "## {}", v(text)).unwrap(),
                Block::Banner(text) => {
                    let text = v(text);
                    let stars = "*".repeat(text.width());
                    writeln!(out, "{stars}\n{text}\n{stars}").unwrap()
                }
                Block::Line { text, indent } => writeln!(out, "{}{}", " ".repeat(*indent), v(text)).unwrap(),
                Block::Labels { width, rows } => {
                    for (label, value) in rows {
                        out.push_str(&label_row(&v(label), &v(&value.to_string()), *width));
                    }
                }
                Block::Table(t) => out.push_str(&t.to_text()),
                Block::Blank => out.push('\n'),
            }
        }
        out
    }

    /// The HTML rendering: one self-styled block that reads the same in a
    /// notebook, a browser or a saved file.
    pub fn to_html(&self) -> String {
        html_block(&self.html_body())
    }

    /// The blocks in HTML, without the stylesheet.
    fn html_body(&self) -> String {
        let mut out = String::new();
        for b in &self.blocks {
            match b {
                Block::Title(text) => writeln!(out, "<h1>{}</h1>", prose(text)).unwrap(),
                Block::Part(text) => writeln!(out, "<h2>{}</h2>", prose(text)).unwrap(),
                Block::Heading(text) | Block::Section(text) | Block::Banner(text) => {
                    writeln!(out, "<h3>{}</h3>", prose(text)).unwrap()
                }
                Block::Line { text, indent: 0 } => writeln!(out, "<p>{}</p>", prose(text)).unwrap(),
                Block::Line { text, indent } => {
                    writeln!(out, "<p style=\"margin-left:{}em\">{}</p>", *indent as f64 * 0.5, prose(text)).unwrap()
                }
                Block::Note(text) => writeln!(out, "<p class=\"note\">{}</p>", prose(text)).unwrap(),
                Block::Caution(text) => writeln!(out, "<p class=\"partial\">{}</p>", prose(text)).unwrap(),
                Block::Timeline(t) => out.push_str(&t.to_html()),
                Block::Icicle(i) => out.push_str(&i.to_html()),
                Block::Labels { rows, .. } => {
                    out.push_str("<table>\n");
                    for (label, value) in rows {
                        let indent = label.len() - label.trim_start().len();
                        let style = if indent > 0 {
                            format!(" style=\"padding-left:{}em\"", 0.6 + indent as f64 * 0.5)
                        } else {
                            String::new()
                        };
                        writeln!(
                            out,
                            "<tr><td class=\"text\"{style}>{}</td><td>{}</td></tr>",
                            escape_html(label.trim_start()),
                            escape_html(&value.to_string())
                        )
                        .unwrap();
                    }
                    out.push_str("</table>\n");
                }
                Block::Table(t) => out.push_str(&t.to_html()),
                Block::Blank => {}
            }
        }
        out
    }

    /// The tables and label rows as CSV, figures unrounded: each table with
    /// its header, each block of labels as `label,value` records; blocks
    /// apart by an empty line. Headings and prose are left out.
    pub fn to_csv(&self) -> Result<String> {
        let mut parts = Vec::new();
        for b in &self.blocks {
            match b {
                Block::Table(t) => parts.push(t.to_csv()?),
                Block::Labels { rows, .. } => {
                    let records =
                        rows.iter().map(|(label, value)| vec![label.trim_start().to_string(), value.to_csv()]);
                    parts.push(csv_string("a report", &["label", "value"], records)?);
                }
                _ => {}
            }
        }
        Ok(parts.join("\n"))
    }

    /// The document as JSON: a list of blocks in order, each an object
    /// naming what it is (`heading`, `line`, `labels`, `table`), figures as
    /// exact numbers.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let blocks: Vec<serde_json::Value> = self
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Title(text)
                | Block::Part(text)
                | Block::Heading(text)
                | Block::Section(text)
                | Block::Banner(text) => Some(json!({ "heading": text })),
                Block::Line { text, indent } => Some(json!({ "line": text, "indent": indent })),
                Block::Note(text) | Block::Caution(text) => Some(json!({ "line": text, "indent": 0 })),
                Block::Timeline(t) => Some(json!({ "timeline": {
                    "layers": t.layers,
                    "points": t.points,
                    "peak_time_us": t.peak_time_us,
                    "peak_bytes": t.peak_bytes,
                } })),
                Block::Icicle(i) => Some(json!({ "icicle": i.root })),
                Block::Labels { rows, .. } => Some(json!({
                    "labels": rows
                        .iter()
                        .map(|(label, value)| json!({ "label": label.trim_start(), "value": value.to_json() }))
                        .collect::<Vec<_>>()
                })),
                Block::Table(t) => Some(json!({ "table": t.to_json() })),
                Block::Blank => None,
            })
            .collect();
        serde_json::Value::Array(blocks)
    }

    /// Shows the rendering in an evcxr (Rust Jupyter) notebook cell: HTML,
    /// with the text beside it for a console client.
    pub fn evcxr_display(&self) {
        crate::output::evcxr_show(&self.to_html(), &self.to_text());
    }

    /// The HTML rendering as a whole page titled `title`: one file, styles
    /// inline, no script, nothing fetched (its content security policy
    /// forbids both), so it opens offline.
    pub fn to_page(&self, title: &str) -> String {
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\
             <title>{}</title><style>{STYLESHEET}</style></head>\n\
             <body class=\"memlab-page\"><div class=\"memlab\">\n{}</div></body></html>\n",
            escape_html(title),
            self.html_body()
        )
    }
}

/// How many glyphs a timeline's sparkline takes in text.
const SPARKLINE: usize = 64;

/// Prose and titles in HTML: escaped, and what stands between backticks
/// set as code (a dispose scope's heading shows the scope's name so).
fn prose(text: &str) -> String {
    let parts: Vec<&str> = text.split('`').collect();
    // An odd backtick out is text, not the start of code.
    if parts.len().is_multiple_of(2) {
        return escape_html(text);
    }
    parts
        .iter()
        .enumerate()
        .map(|(i, part)| if i % 2 == 1 { format!("<code>{}</code>", escape_html(part)) } else { escape_html(part) })
        .collect()
}

/// A report that describes itself as a [`Document`]: what every memlab
/// report implements, so each renders as text, HTML, CSV, JSON and in a
/// notebook the same way. Bring it into scope (`use memlab::Render;`) to
/// call these on a report; `{}` prints the text without it.
pub trait Render {
    /// The report's document.
    fn document(&self) -> Document;

    /// The text rendering (also what `{}` prints).
    fn to_text(&self) -> String {
        self.document().to_text()
    }

    /// The HTML rendering: one self-styled block that reads the same in a
    /// notebook, a browser or a saved file.
    fn to_html(&self) -> String {
        self.document().to_html()
    }

    /// The report's tables as CSV, figures unrounded: the document's tables
    /// and label rows ([`Document::to_csv`]), or, for a report that is one
    /// table at heart (the line profile, the storage report), its own rows
    /// with every field.
    fn to_csv(&self) -> Result<String> {
        self.document().to_csv()
    }

    /// The report's data as JSON, every figure exact: its own fields (its
    /// `Serialize`), not the rendering. What memlab's files hold where
    /// a report is one.
    fn to_json(&self) -> String
    where
        Self: serde::Serialize + Sized,
    {
        // Plain data with string keys: serialising cannot fail.
        serde_json::to_string_pretty(self).expect("a report serialises")
    }

    /// Shows the rendering in an evcxr (Rust Jupyter) notebook cell: HTML,
    /// with the text beside it for a console client.
    fn evcxr_display(&self) {
        crate::output::evcxr_show(&self.to_html(), &self.to_text());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a notebook a rendering goes out as HTML and text together, which
    /// evcxr merges by mime type into one display bundle: a notebook shows
    /// the HTML, a console client the text.
    #[test]
    fn a_notebook_gets_the_html_and_the_text_together() {
        let mut doc = Document::new();
        doc.title("Peaks");
        doc.line("one line");
        let (html, text) = (doc.to_html(), doc.to_text());
        let bundle = crate::output::evcxr_bundle(&html, &text);
        let blocks: Vec<&str> = bundle.split_inclusive("EVCXR_END_CONTENT\n").collect();
        assert_eq!(
            blocks,
            [
                format!("EVCXR_BEGIN_CONTENT text/html\n{html}\nEVCXR_END_CONTENT\n"),
                format!("EVCXR_BEGIN_CONTENT text/plain\n{}\nEVCXR_END_CONTENT\n", text.trim_end()),
            ]
        );
        assert!(text.contains("one line") && html.contains("one line"));
    }
    use crate::render::{Column, Layout};

    #[test]
    fn blocks_render_as_text_and_html() {
        let mut table = Table::new(vec![Column::new("bytes", Layout::Figure)]);
        table.row([Cell::bytes(1024u64)]);
        let mut doc = Document::new();
        doc.heading("Title <1>").indented(2, "detail").label(12, "weights", Cell::bytes(4u64 << 20)).label(
            12,
            "  fc",
            Cell::bytes(4u64 << 20),
        );
        doc.blank().table(table);
        assert_eq!(
            doc.to_text(),
            "Title <1>\n  detail\nweights.....     4.00M\n  fc........     4.00M\n\nbytes\n1.00K\n"
        );
        let html = doc.to_html();
        assert!(html.starts_with("<div class=\"memlab\"><style>"), "{html}");
        assert!(html.contains("<h3>Title &lt;1&gt;</h3>\n<p style=\"margin-left:1em\">detail</p>"), "{html}");
        assert!(html.contains("<td class=\"text\" style=\"padding-left:1.6em\">fc</td><td>4.00M</td>"), "{html}");
        assert!(html.contains("<th>bytes</th></tr>\n<tr><td>1.00K</td></tr>"), "{html}");
    }

    #[test]
    fn an_appended_document_keeps_its_blocks() {
        let mut inner = Document::new();
        inner.heading("Verdict").line("advice");
        let mut doc = Document::new();
        doc.line("before").append(inner);
        assert_eq!(doc.to_text(), "before\nVerdict\nadvice\n");
        assert!(doc.to_html().contains("<p>before</p>\n<h3>Verdict</h3>\n<p>advice</p>"), "{}", doc.to_html());
    }

    #[test]
    fn a_document_as_csv_and_json() {
        let mut table = Table::new(vec![Column::new("name", Layout::Text), Column::new("bytes", Layout::Figure)]);
        table.row([Cell::text("fc.weight"), Cell::bytes(4096u64)]);
        let mut doc = Document::new();
        doc.section("f").label(10, "peak", Cell::bytes(1u64 << 20)).label(10, "  of it", Cell::Percent(0.5));
        doc.line("prose").blank().table(table);
        assert_eq!(
            doc.to_text(),
            "## f\npeak......     1.00M\n  of it...       50%\nprose\n\nname       bytes\nfc.weight  4.00K\n"
        );
        assert_eq!(doc.to_csv().unwrap(), "label,value\npeak,1048576\nof it,0.5\n\nname,bytes\nfc.weight,4096\n");
        assert_eq!(
            doc.to_json(),
            serde_json::json!([
                {"heading": "f"},
                {"labels": [{"label": "peak", "value": 1_048_576}, {"label": "of it", "value": 0.5}]},
                {"line": "prose", "indent": 0},
                {"table": {"columns": ["name", "bytes"], "rows": [["fc.weight", 4096]], "notes": []}},
            ])
        );
    }

    #[test]
    fn a_report_renders_in_every_format_from_one_document_and_its_data() {
        #[derive(serde::Serialize)]
        struct Held {
            name: &'static str,
            bytes: u64,
        }
        impl Render for Held {
            fn document(&self) -> Document {
                let mut table =
                    Table::new(vec![Column::new("name", Layout::Text), Column::new("bytes", Layout::Figure)]);
                table.row([Cell::text(self.name), Cell::bytes(self.bytes)]);
                let mut doc = Document::new();
                doc.heading("held").table(table);
                doc
            }
        }
        let held = Held { name: "fc.weight", bytes: 4096 };
        assert_eq!(held.to_text(), "held\nname       bytes\nfc.weight  4.00K\n");
        assert_eq!(held.to_csv().unwrap(), "name,bytes\nfc.weight,4096\n", "the tables, figures unrounded");
        assert_eq!(
            held.to_json(),
            "{\n  \"name\": \"fc.weight\",\n  \"bytes\": 4096\n}",
            "the data, not the rendering"
        );
        assert!(held.to_html().contains("<td class=\"text\">fc.weight</td><td>4.00K</td>"), "{}", held.to_html());
    }

    #[test]
    fn backticks_set_code_in_html() {
        let mut doc = Document::new();
        doc.heading("DisposeScope `step` <1>").line("raise `Settings::capacity`").line("an odd ` stays");
        let html = doc.to_html();
        assert!(html.contains("<h3>DisposeScope <code>step</code> &lt;1&gt;</h3>"), "{html}");
        assert!(html.contains("<p>raise <code>Settings::capacity</code></p>\n<p>an odd ` stays</p>"), "{html}");
        assert_eq!(doc.to_text(), "DisposeScope `step` <1>\nraise `Settings::capacity`\nan odd ` stays\n");
    }
}
