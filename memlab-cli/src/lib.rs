//! The `memlab` command's parts, as a library: reading snapshots into
//! summaries ([`analysis`], [`summary`]), the HTML page ([`view`]), the
//! comparison of two runs ([`diff`]) and the merge of several processes'
//! files ([`merge`]). The binary is a thin layer of arguments over these;
//! tests drive them directly. No libtorch.

pub mod diff;
pub mod merge;
pub mod view;

pub use memlab_core::export::{analysis, summary};
