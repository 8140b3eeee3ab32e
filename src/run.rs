//! Several processes of one run: which rank wrote a file. A process knows
//! its rank from `MEMLAB_RANK`, else `RANK`, else `LOCAL_RANK` (torchrun's and
//! most launchers' variables), and the world size from `WORLD_SIZE`. Exports
//! (the snapshot's `memlab.run`, the trace's `otherData.run`) and
//! out-of-memory reports carry [`this_process`]'s [`RunInfo`]: the rank, the
//! host, the process's start, the wall-clock time of the recording's clock
//! zero, the libtorch version and each CUDA device's UUID, so that
//! `memlab merge` lines up the files of every rank on one time axis.

pub use crate::tools::run::this_process;
pub use memlab_core::run::{rank_from_env, DeviceId, RunInfo, RANK_VARIABLES, WORLD_SIZE_VARIABLE};
