//! Several processes of one run: which rank wrote a file. A process knows
//! its rank from the first of [`RANK_VARIABLES`] that is set (memlab's own
//! `MEMLAB_RANK`, then torchrun's `RANK`, Open MPI's, PMIx's, PMI's, Slurm's
//! `SLURM_PROCID`, then the local ranks), and the world size from the
//! variable its launcher sets beside it (`WORLD_SIZE`,
//! `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS`). Exports
//! (the snapshot's `memlab.run`, the trace's `otherData.run`) and
//! out-of-memory reports carry [`this_process`]'s [`RunInfo`]: the rank, the
//! host, the process's start, the wall-clock time of the recording's clock
//! zero, the libtorch version and each CUDA device's UUID, so that
//! `memlab merge` lines up the files of every rank on one time axis.

pub use crate::tools::run::this_process;
pub use memlab_core::run::{rank_from_env, DeviceId, RankFromEnv, RunInfo, RANK_VARIABLES, WORLD_SIZE_VARIABLE};

/// How many copies of memlab share this process's state, this one included:
/// 1 for a program that links memlab once. A notebook (evcxr) compiles every
/// cell into a library of its own with memlab linked in, and a process may
/// load two plugins that each carry memlab: every copy finds the first one's
/// state through libtorch when it loads (the counting CPU allocator and its
/// figures, recordings, profiled functions, the OOM recorder, settings), so
/// any copy reports what all of them did.
///
/// ```
/// assert!(memlab::run::copies() >= 1);
/// ```
pub use memlab_tch::copies;
