//! The render layer as people see it: a long table collapsed in HTML shows
//! its largest rows and a summary row, and a click on that row opens the
//! rest, in a real browser, with no script on the page.

mod common;

use common::chromium::Browser;
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
