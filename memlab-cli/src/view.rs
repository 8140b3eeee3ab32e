//! `memlab view`: a snapshot as the self-contained HTML report memlab's
//! exporter writes (the summary, then per device memory over time stacked
//! by site, what was live at the peak by call stack and by site): one
//! builder, [`HtmlReport::of_snapshot`], makes both pages.

use memlab_core::export::{HtmlReport, SnapshotFile};
use memlab_core::render::Render;

use crate::analysis::Summary;

/// The page of the snapshot read from `path`, whose summary is `summary`:
/// its call stacks show the program's own frames, each run of other frames
/// (CPython, libtorch's dispatcher, the runtime) folded into one node.
pub fn page(path: &str, file: &SnapshotFile, summary: &Summary) -> String {
    page_with(path, file, summary, false)
}

/// [`page`], with every frame of the call stacks shown when `all_frames`.
pub fn page_with(path: &str, file: &SnapshotFile, summary: &Summary, all_frames: bool) -> String {
    HtmlReport::of_snapshot_with(file, summary, all_frames).document().to_page(&format!("memlab: {path}"))
}
