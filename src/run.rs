//! Several processes of one run: which rank wrote a file.
//!
//! Training that outgrows one GPU runs one process per GPU (ranks). A process
//! knows its rank from the first of [`RANK_VARIABLES`] that is set, and the
//! world size from the variable its launcher sets beside it:
//!
//! | launcher | rank | world size |
//! |---|---|---|
//! | memlab's own | `MEMLAB_RANK` | `WORLD_SIZE` |
//! | torchrun and most launchers | `RANK` | `WORLD_SIZE` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` |
//! | PMIx | `PMIX_RANK` | (none) |
//! | MPICH, Intel MPI (PMI) | `PMI_RANK` | `PMI_SIZE` |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` |
//! | local ranks, last | `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `SLURM_LOCALID` | `WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`, (none) |
//!
//! Global ranks come before local ones, and an MPI launcher's before Slurm's:
//! `mpirun` inside a Slurm job gives every process the batch script's
//! `SLURM_PROCID`, and torchrun under `srun` gives each node's processes the
//! node's. A rank or world size that is not a whole number is warned about
//! once and left out, each on its own: `RANK=1 WORLD_SIZE=abc` keeps rank 1.
//!
//! [`this_process`] says what memlab read. Every export and out-of-memory
//! report then carries its [`RunInfo`]: the rank, the host, the pid and the
//! process's start, the wall-clock time of the recording's clock zero, the
//! libtorch version and each CUDA device's UUID (`memlab.run` in the snapshot,
//! `otherData.run` in the trace, `run` in the report's JSON), so that
//! `memlab merge` lines up the files of every rank on one time axis. File
//! names get `_rank{N}`: `Exporter::write_files(dir)` writes
//! `memlab_snapshot_rank1.pickle`, `memlab_trace_rank1.json` and
//! `memlab_report_rank1.html`, and the report of a failure is
//! `memlab_oom_<host>_<start>_<pid>_<n>_rank1.txt` (and `.json`).
//!
//! `examples/ranks.rs` is one rank of such a run, and
//! `bash scripts/ranks.sh DIR [N]` runs N of them and merges their files; the
//! merge, and what it prints, is in the docs of the `memlab` command
//! (`memlab-cli`).

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
