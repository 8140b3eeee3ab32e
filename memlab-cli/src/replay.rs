//! `memlab replay SNAPSHOT [--setting CONF]… [--capacity BYTES | --fraction F]
//! [--compare] [--json]`: a recording's CUDA history replayed through the
//! model of libtorch 2.11's caching allocator (`memlab_core::replay`), under
//! the settings it was recorded with and others: the peaks, and whether and
//! where memory runs out. Under the recorded settings, how many of the
//! allocator's own segment events the model made too says how far the
//! replay can be trusted.

use memlab_core::export::SnapshotFile;
pub use memlab_core::replay::{DeviceReplays, ReplayOptions as Options, Replayed};

/// Replays `file` (read from `path`) as `options` say.
pub fn replay(path: &str, file: &SnapshotFile, options: &Options) -> Result<Replayed, String> {
    memlab_core::replay::replay_snapshot(path, &file.snapshot, options).map_err(|e| e.to_string())
}
