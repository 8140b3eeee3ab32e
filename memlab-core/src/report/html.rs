//! The HTML rendering: a heading and a `<table>` per function, self-styled so
//! it reads the same in a notebook, a browser or a saved file.

use std::fmt::Write;

use super::text::{heading, table};
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
        writeln!(out, "<h3>{}</h3>", escape(&heading(f))).unwrap();
        out.push_str(&table(f, report.columns()).to_html());
    }
    html_block(&out)
}
