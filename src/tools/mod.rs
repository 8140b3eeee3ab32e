//! The tools, side by side: each imports the shared layers (`named`,
//! `attribution`, `capture`, `diagnosis`, core, the backend), never another
//! tool. What users see of a tool is its type at the crate's root and the
//! types of its reports in the public module of its name (`crate::reporter`
//! for `tools::reporter`), so that every public item has one path.

pub(crate) mod batch_size;
pub(crate) mod courtesy;
pub(crate) mod dispose;
pub(crate) mod export;
pub(crate) mod gpu_account;
pub(crate) mod logger;
pub(crate) mod model_size;
pub(crate) mod monitor;
pub(crate) mod oom;
pub(crate) mod reporter;
pub(crate) mod run;
pub(crate) mod tracker;
