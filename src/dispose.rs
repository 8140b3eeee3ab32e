//! Dispose scopes: which tensors outlived a stretch of code that should have
//! left nothing behind.
//!
//! In Rust, ownership frees tensors; what goes wrong is that something keeps
//! them: a loss accumulated with its graph, a cache that grows every step, a
//! tensor pushed into a `Vec`. A [`DisposeScope`](crate::DisposeScope) sees every allocation made
//! on its thread while it is the innermost scope, and when it closes it
//! reports those still alive (with where they were allocated), except the
//! ones it was told to [`keep`](crate::DisposeScope::keep).

pub use crate::tools::dispose::{ScopeReport, StepCheck};
