//! "Will it fit?": the largest batch size whose real training step stays
//! within a memory budget, found by trying batch sizes, with out-of-memory
//! failures caught so the process stays healthy.

pub use crate::tools::batch_size::{BatchSearch, FirstOom, Try};
