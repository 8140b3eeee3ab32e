//! The one render layer: how every report writes bytes, label rows, column
//! tables, HTML (one escape, one stylesheet), CSV, evcxr cells, and
//! allocations grouped by where they were made. Reports are data; each
//! describes itself as a [`Document`] of headings, lines and [`Table`]s, and
//! these turn it into text and HTML.

mod cell;
mod document;
mod drawing;
mod table;

pub use cell::{Amount, Cell};
pub use document::{Document, Render};
pub use drawing::{FlameNode, Icicle, Mark, Point, Scale, Timeline};
pub use table::{Column, Layout, Table};

use crate::error::{Error, Result};

/// Gives each report type (which describes itself as a `Document`, see
/// [`Render`]) its `Display`: the text rendering, what `{}` prints. The
/// `memlab` crate has the same for its reports.
macro_rules! displayed_as_text {
    ($($report:ty),* $(,)?) => {$(
        impl std::fmt::Display for $report {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&crate::render::Render::to_text(self))
            }
        }
    )*};
}
pub(crate) use displayed_as_text;

/// `label` followed by dots up to `width`, then `value` right-aligned in ten
/// columns: the rows of the summaries (`parameters............  1.00M`).
pub fn label_row(label: &str, value: &str, width: usize) -> String {
    format!("{label:.<width$}{value:>10}\n")
}

/// `text` as one line of a terminal: every control character (a newline, a
/// carriage return, an escape sequence's ESC) written as Rust writes it in a
/// string (`\n`, `\u{1b}`), so that a name read from a file or given by a
/// program (a host, a site, a frame, a tensor's name) can neither forge a
/// line of a report nor move the cursor. Tabs are kept where `keep_tabs`
/// (source lines). What the HTML rendering's [`escape_html`] is to a page.
pub fn visible(text: &str, keep_tabs: bool) -> std::borrow::Cow<'_, str> {
    let hidden = |c: char| c.is_control() && !(keep_tabs && c == '\t');
    if !text.chars().any(hidden) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `text` safe inside HTML elements and attribute values.
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The one stylesheet of every HTML rendering, report blocks and whole
/// pages alike, scoped to `.memlab` (and `.memlab-page`, a page's body).
/// Figures are right-aligned and never wrap; text and code columns (cells
/// and their headers alike) are left-aligned, text may wrap, code keeps its
/// indentation and wraps rather than widen the table past its container.
/// The table rules outrank a notebook's own (JupyterLab's and nbconvert's
/// right-align every cell and centre tables): `div.memlab` counts one more
/// element than their selectors. The drawings' rules (timelines, icicle graphs, legends) are
/// here too (a folded run of frames in an icicle graph links to the list of
/// its frames, shown when targeted; a timeline drawn by event and by time
/// shows the drawing whose radio button is checked, at the width its zoom's
/// radio button picks, in a box that scrolls sideways; finer ticks show as
/// the zoom grows), and those of collapsed tables (a hidden checkbox before the
/// table; its summary row's label opens the rest).
pub const STYLESHEET: &str = "div.memlab table{border-collapse:collapse;font-family:monospace;margin:.2em 0 .6em;\
table-layout:auto;width:auto}\
div.memlab td,div.memlab th{padding:0 .6em;text-align:right;white-space:nowrap;vertical-align:top}\
div.memlab td.text,div.memlab th.text,div.memlab td.code,div.memlab th.code{text-align:left}\
div.memlab td.text{white-space:normal}div.memlab td.code{white-space:pre-wrap;overflow-wrap:anywhere}\
.memlab tr.idle td{color:#999}\
.memlab h3{font-family:sans-serif;margin:.8em 0 .3em}.memlab p{margin:.2em 0}\
.memlab-page{font-family:sans-serif;margin:1.5em;color:#222}\
.memlab h1{font-size:1.4em}.memlab h2{font-size:1.15em;margin-top:1.6em}\
.memlab svg{display:block;font:11px monospace}.memlab svg.flame text{pointer-events:none}\
.memlab .hover:hover{fill:rgba(0,0,0,.06)}.memlab .frame:hover rect{stroke:#000}\
.memlab ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:.4em 1.2em;font:12px monospace}\
.memlab ul.legend span{display:inline-block;width:.9em;height:.9em;margin-right:.4em;vertical-align:-.1em}\
.memlab p.partial{background:#fff3cd;border:1px solid #e0c36a;padding:.5em .8em}.memlab p.note{color:#555}\
.memlab svg text.partial{fill:#8a6d00;font-weight:bold}\
.memlab tr.rest{display:none}.memlab input.more:checked+table tr.rest{display:table-row}\
.memlab input.more:checked+table tr.more{display:none}.memlab tr.more label{cursor:pointer;color:#1a5fb4}\
.memlab div.fold{display:none;font:12px monospace;border-left:3px solid #8aa4c8;padding:.2em .8em;margin:.3em 0}\
.memlab div.fold:target{display:block}.memlab div.fold ol{margin:.2em 0;padding-left:2.5em}\
.memlab div.axes{font:12px sans-serif;width:960px}.memlab div.axes input{margin:0 .25em 0 .9em;vertical-align:-.15em}\
.memlab div.axes span.gap{display:inline-block;width:1.5em}\
.memlab div.axes input.by-event:checked~div.by-time,.memlab div.axes input.by-time:checked~div.by-event{display:none}\
.memlab div.chart{display:flex;margin-top:.3em}\
.memlab div.chart div.bytes{flex:none;width:70px;height:262px;position:relative;font:11px monospace}\
.memlab div.bytes span{position:absolute;right:5px}.memlab div.bytes span.top{top:0}.memlab div.bytes span.zero{top:230px}\
.memlab div.scroll{width:886px;overflow-x:auto;overflow-y:hidden;border-left:1px solid #999}\
.memlab div.plot{position:relative;width:100%;height:262px}\
.memlab input.z4:checked~div.chart div.plot{width:400%}.memlab input.z16:checked~div.chart div.plot{width:1600%}\
.memlab svg.timeline{width:100%;height:240px;border-bottom:1px solid #999}\
.memlab svg.timeline line.peak{stroke:#c00;stroke-dasharray:4 3}.memlab svg.timeline line.oom{stroke:#7a0077;stroke-width:2}\
.memlab div.plot span{position:absolute;font:11px monospace;white-space:nowrap}\
.memlab span.mark{top:2px;padding-left:4px}.memlab span.mark.end{transform:translateX(-100%);padding:0 4px 0 0}\
.memlab span.mark.peak{color:#c00}.memlab span.mark.oom{color:#7a0077;top:17px;font-weight:bold}\
.memlab div.plot span.partial{top:2px;left:35%;color:#8a6d00;font-weight:bold}\
.memlab div.ticks span{top:241px;border-left:1px solid #999;padding:4px 0 0 3px}\
.memlab div.ticks span.end{transform:translateX(-100%);border-left:none;border-right:1px solid #999;padding:4px 3px 0 0}\
.memlab div.ticks span.k4,.memlab div.ticks span.k16{display:none}\
.memlab input.z4:checked~div.chart span.k4,.memlab input.z16:checked~div.chart span.k4,\
.memlab input.z16:checked~div.chart span.k16{display:inline}";

/// `body` wrapped as a self-styled block: it reads the same in a notebook, a
/// browser or a saved file.
pub fn html_block(body: &str) -> String {
    format!("<div class=\"memlab\"><style>{STYLESHEET}</style>\n{body}</div>")
}

/// A CSV document of `header` and `rows`; `what` names the report in errors.
pub fn csv_string<R, F>(what: &str, header: &[&str], rows: R) -> Result<String>
where
    R: IntoIterator<Item = Vec<F>>,
    F: AsRef<[u8]>,
{
    let io = |e: csv::Error| Error::io(format!("write {what} as CSV"), e);
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(header).map_err(io)?;
    for row in rows {
        w.write_record(&row).map_err(io)?;
    }
    let bytes = w.into_inner().map_err(|e| Error::io(format!("write {what} as CSV"), e.into_error()))?;
    String::from_utf8(bytes)
        .map_err(|e| Error::io(format!("write {what} as CSV"), std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_escapes() {
        assert_eq!(label_row("parameters", "42", 14), "parameters....        42\n");
        assert_eq!(escape_html("<a href=\"x\">'&'</a>"), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
        assert_eq!(visible("node1\nrank 9 (forged)\r\u{1b}[2J", false), "node1\\nrank 9 (forged)\\r\\u{1b}[2J");
        assert_eq!(visible("\tlet x = 1;", true), "\tlet x = 1;");
        assert_eq!(visible("a\tb", false), "a\\tb");
        assert!(matches!(visible("plain ünïcode", false), std::borrow::Cow::Borrowed(_)));
        let csv = csv_string("t", &["a", "b"], [vec!["1", "x,y"]]).unwrap();
        assert_eq!(csv, "a,b\n1,\"x,y\"\n");
    }
}
