//! memlab's integration tests on the CPU: one test binary, one module per
//! tool, so that the suite links libtorch once (`cargo test --release --test
//! cpu`; one module: `cargo test --release --test cpu -- oom::`).
//!
//! The allocator's counters, the recorder and the OOM recorder are
//! process-wide: a test that allocates tensors or reads the figures in this
//! process takes `common::serial()`, which runs it alone among those that
//! do. What needs a process of its own (settings read as the program loads,
//! address-space limits, another PID namespace, a panic hook's calls) runs
//! in a child: this binary again, with `MEMLAB_CHILD` naming the one test
//! (`common::run_child`). Tests that take no lock only start children,
//! render, or read files.

#[path = "../common/mod.rs"]
mod common;

mod allocator;
mod dispose;
mod export;
mod fit;
mod formats;
mod golden;
mod logger;
mod macro_forms;
mod monitor;
mod notebook;
mod oom;
mod oom_limits;
mod optimizer;
mod profile;
mod ranks;
mod reliability;
mod render;
mod reporter;
mod setup;
mod size;
mod tracker;
