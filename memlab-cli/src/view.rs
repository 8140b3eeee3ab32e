//! `memlab view`: a snapshot as the self-contained HTML report memlab's
//! exporter writes (the summary, then per device memory over time stacked
//! by site, what was live at the peak by call stack and by site): one
//! builder, [`HtmlReport::of_snapshot`], makes both pages.

use memlab_core::export::{HtmlReport, SnapshotFile};
use memlab_core::render::Render;

use crate::analysis::Summary;

/// The page of the snapshot read from `path`, whose summary is `summary`.
pub fn page(path: &str, file: &SnapshotFile, summary: &Summary) -> String {
    HtmlReport::of_snapshot(file, summary).document().to_page(&format!("memlab: {path}"))
}
