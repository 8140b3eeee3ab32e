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

use std::sync::OnceLock;

/// This process among the run's: what every export and out-of-memory report
/// carries. The first call reads the environment (a rank or world-size variable that is
/// no whole number is warned about once and left out), the host and the CUDA
/// devices' UUIDs; later calls copy that.
pub fn this_process() -> RunInfo {
    memlab_core::process::process_wide! {
        static ONCE: OnceLock<RunInfo> = OnceLock::new();
    }
    ONCE.get_or_init(|| {
        let from_env = rank_from_env();
        for why in &from_env.warnings {
            memlab_core::output::warn(&format!("memlab: {why}\n"));
        }
        let devices = (0..memlab_tch::cuda_device_count())
            .map(|i| DeviceId { device: format!("cuda:{i}"), uuid: memlab_tch::device_uuid(i).ok() })
            .collect();
        RunInfo {
            rank: from_env.rank,
            world_size: from_env.world_size,
            host: memlab_tch::host_name(),
            pid: std::process::id(),
            process_start: memlab_tch::process_start(),
            clock_zero_unix_us: memlab_core::events::zero_unix_us(),
            libtorch: Some(memlab_tch::libtorch_version().to_string()),
            devices,
        }
    })
    .clone()
}
