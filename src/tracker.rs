//! The call-site tracker behind `memlab::track!()`: at each call it logs when
//! and where it was called, how much the live tensors and the allocator hold,
//! and which storages appeared (`+`) or disappeared (`-`) since the previous
//! call, grouped by kind, shape and dtype, with where unnamed ones were
//! allocated. Put one call before and one after a step, or one per batch, and
//! the log says what grew between them.
//!
//! Named storages come from the registered var stores and tensors (see
//! [`register_var_store`](crate::register_var_store)); every other live
//! allocation comes from the event recorder, which a tracker keeps on. An
//! unnamed storage shows the profiled statement that allocated it or, when a
//! [`Recording`](crate::Recording) with backtraces was started before the tracker, the
//! innermost of the user's frames.

pub use crate::tools::tracker::{global_tracker, CallSite, StorageChange, TrackEntry};
