//! The render layer as people see it: a long table collapsed in HTML shows
//! its largest rows and a summary row, and a click on that row opens the
//! rest, in a real browser, with no script on the page.

use crate::common::chromium::Browser;
use memlab::render::{Cell, Column, Document, Layout, Table};

/// A page with a table of `rows` sites, largest first, `shown` of them shown.
fn page(rows: u64, shown: usize) -> String {
    let mut table = Table::new(vec![
        Column::new("bytes", Layout::Figure),
        Column::new("blocks", Layout::Figure),
        Column::new("where allocated", Layout::Text),
    ])
    .collapsed_after(shown);
    for i in 0..rows {
        table.row([Cell::bytes((rows - i) << 20), Cell::count(1u64), Cell::text(format!("site {i}"))]);
    }
    let mut doc = Document::new();
    doc.title("Collapsed").table(table).line("after the table");
    doc.to_page("collapsed table")
}

#[test]
fn a_collapsed_table_opens_with_a_click() {
    let path = std::env::temp_dir().join(format!("memlab_collapsed_{}.html", std::process::id()));
    std::fs::write(&path, page(30, 5)).unwrap();
    let Some(mut browser) = Browser::launch(1000, 900) else { return };
    let mut page = browser.open(&format!("file://{}", path.display()));
    assert_eq!(page.console_errors(), Vec::<String>::new(), "no console errors or CSP violations");
    let visible = "[...document.querySelectorAll('tr')].filter(r => r.offsetParent !== null).map(r => r.innerText)";
    let rows = page.eval(visible);
    let rows: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    // The header, the five largest, then one row for the 25 others: 25 + 24 + ... + 1 MiB.
    assert_eq!(rows.len(), 7, "{rows:?}");
    assert!(rows[1].starts_with("30.00M") && rows[5].starts_with("26.00M"), "{rows:?}");
    assert_eq!(rows[6].split('\t').map(str::trim).collect::<Vec<_>>(), ["325.00M", "", "▸ 25 more rows"]);
    page.click("tr.more label");
    let rows = page.eval(visible);
    let rows: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert_eq!(rows.len(), 31, "every row shows, the summary row gone: {rows:?}");
    assert!(rows[30].starts_with("1.00M") && rows[30].ends_with("site 29"), "{rows:?}");
    std::fs::remove_file(&path).ok();
}

/// The rules of a notebook's stylesheet that meet a table in an output
/// (JupyterLab 4's, which nbconvert's lab template also uses): tables
/// centred with a fixed layout, every cell right-aligned and wrapping.
const NOTEBOOK_RULES: &str = ".jp-RenderedHTMLCommon table{border-collapse:collapse;table-layout:fixed;\
margin-left:auto;margin-right:auto}\
.jp-RenderedHTMLCommon td,.jp-RenderedHTMLCommon th,.jp-RenderedHTMLCommon tr{padding:.5em;\
white-space:normal;vertical-align:middle}\
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td,:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th{\
text-align:right}";

#[test]
fn tables_keep_their_layout_inside_a_notebooks_stylesheet() {
    // A profile-like table: figures, a text column, and a code line far
    // wider than the output area.
    let mut table = Table::new(vec![
        Column::new("increment", Layout::Figure),
        Column::new("name", Layout::Text),
        Column::new("code", Layout::Code),
    ]);
    let long = format!("    let logits = model.forward(&x){};", ".relu()".repeat(40));
    table.row([Cell::signed_bytes(2560i64), Cell::text("fc1.weight"), Cell::code(long)]);
    table.row([Cell::bytes(0u64), Cell::text("fc2.weight"), Cell::code("    logits")]);
    let mut doc = Document::new();
    doc.table(table);
    let page = format!(
        "<!DOCTYPE html><html><head><style>{NOTEBOOK_RULES}</style></head><body style=\"margin:0\">\
         <div class=\"jp-OutputArea-output jp-RenderedHTMLCommon\" style=\"width:600px\">{}</div></body></html>",
        doc.to_html()
    );
    let path = std::env::temp_dir().join(format!("memlab_notebook_css_{}.html", std::process::id()));
    std::fs::write(&path, page).unwrap();
    let Some(mut browser) = Browser::launch(1000, 900) else { return };
    let mut tab = browser.open(&format!("file://{}", path.display()));
    let style = |tab: &mut crate::common::chromium::Page<'_>, selector: &str, property: &str| {
        tab.eval(&format!("getComputedStyle(document.querySelector('{selector}')).{property}"))
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(style(&mut tab, "td.text", "textAlign"), "left", "text cells stay left-aligned");
    assert_eq!(style(&mut tab, "th.text", "textAlign"), "left", "and their headers");
    assert_eq!(style(&mut tab, "td.code", "textAlign"), "left", "and code");
    assert_eq!(style(&mut tab, "td:not(.text):not(.code)", "whiteSpace"), "nowrap", "figures never wrap");
    // The table starts at the output's left edge and wraps the code line
    // inside the output's width, its indentation kept.
    let left = tab.eval("document.querySelector('div.memlab table').getBoundingClientRect().left").as_f64().unwrap();
    let width = tab.eval("document.querySelector('div.memlab table').getBoundingClientRect().width").as_f64().unwrap();
    assert!(left < 1.0, "the table is not centred: it starts at {left}px");
    assert!(width <= 600.0, "the table fits the 600px output: {width}px");
    let code = tab.eval("document.querySelector('td.code').getBoundingClientRect().height").as_f64().unwrap();
    let figure = tab.eval("document.querySelector('td').getBoundingClientRect().height").as_f64().unwrap();
    assert!(code > 2.0 * figure.min(20.0), "the long line wraps ({code}px high)");
    assert_eq!(style(&mut tab, "td.code", "whiteSpace"), "pre-wrap");
    std::fs::remove_file(&path).ok();
}
