//! The HTML rendering: a heading and a `<table>` per function, self-styled so
//! it reads the same in a notebook, a browser or a saved file.

use std::fmt::Write;

use super::text::{cell, dedented, heading};
use super::Report;
use crate::render::{escape_html as escape, html_block};

pub(super) fn render(report: &Report) -> String {
    let mut out = String::new();
    for f in &report.functions {
        if let Some(e) = &f.error {
            writeln!(out, "<h3>{}</h3><p>not measured: {}</p>", escape(&f.title()), escape(e)).unwrap();
            continue;
        }
        if !f.ran() {
            continue;
        }
        writeln!(out, "<h3>{}</h3>\n<table>\n<tr>", escape(&heading(f))).unwrap();
        for c in report.columns() {
            write!(out, "<th>{}</th>", escape(c.name()).replace('.', "<br>")).unwrap();
        }
        out.push_str("<th>line</th><th class=\"code\">code</th></tr>\n");
        for (l, code) in f.lines.iter().zip(dedented(f)) {
            out.push_str(if l.stats.is_some() { "<tr>" } else { "<tr class=\"idle\">" });
            for c in report.columns() {
                let text = l.stats.as_ref().map(|s| cell(c, c.value(s))).unwrap_or_default();
                write!(out, "<td>{text}</td>").unwrap();
            }
            writeln!(out, "<td>{}</td><td class=\"code\">{}</td></tr>", l.line, escape(code)).unwrap();
        }
        out.push_str("</table>\n");
    }
    html_block(&out)
}
