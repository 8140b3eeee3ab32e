//! Who wrote a file, among several processes: the rank and world size a
//! launcher gave the process, its host, pid and start, the wall-clock time of
//! the recorder's clock zero (so that files of processes whose clocks started
//! apart line up), the libtorch it ran on and its CUDA devices' UUIDs (so that
//! two processes on one GPU, or one process on several, are told apart).
//! Exports and out-of-memory reports carry one [`RunInfo`].

use serde::{Deserialize, Serialize};

/// Where a rank (and the world size beside it) is read from, first set
/// wins: memlab's own, torchrun's global rank, Open MPI's, PMIx's, MPICH's
/// and Intel MPI's (PMI), Slurm's task id, then the local ranks (torchrun's,
/// Open MPI's, Slurm's). Global ranks come before local ones, and an MPI
/// launcher's before Slurm's: `mpirun` inside a Slurm allocation gives
/// every process the batch script's `SLURM_PROCID`, and `srun` of several
/// torchrun agents gives each node's processes the node's.
///
/// Each rank variable is paired with the world size its launcher sets
/// beside it; `None` where it sets none.
pub const RANK_VARIABLES: [(&str, Option<&str>); 9] = [
    ("MEMLAB_RANK", Some(WORLD_SIZE_VARIABLE)),
    ("RANK", Some(WORLD_SIZE_VARIABLE)),
    ("OMPI_COMM_WORLD_RANK", Some("OMPI_COMM_WORLD_SIZE")),
    ("PMIX_RANK", None),
    ("PMI_RANK", Some("PMI_SIZE")),
    ("SLURM_PROCID", Some("SLURM_NTASKS")),
    ("LOCAL_RANK", Some(WORLD_SIZE_VARIABLE)),
    ("OMPI_COMM_WORLD_LOCAL_RANK", Some("OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("SLURM_LOCALID", None),
];

/// The world size beside `MEMLAB_RANK`, `RANK` and `LOCAL_RANK` (torchrun's).
pub const WORLD_SIZE_VARIABLE: &str = "WORLD_SIZE";

/// What the environment says of this process's rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankFromEnv {
    /// The rank, from the first variable of [`RANK_VARIABLES`] that is set.
    pub rank: Option<u32>,
    /// The variable it came from.
    pub rank_variable: Option<&'static str>,
    /// The world size, from the variable paired with the rank's.
    pub world_size: Option<u32>,
    /// What was set but could not be read, each a sentence saying what to
    /// set instead; the rank or world size it spoke of is left out, the
    /// other is kept.
    pub warnings: Vec<String>,
}

/// A process's place among the processes of one run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunInfo {
    /// Its rank (see [`RANK_VARIABLES`]), when a launcher gave it one.
    pub rank: Option<u32>,
    /// How many ranks the run has (`WORLD_SIZE`), when set.
    pub world_size: Option<u32>,
    /// The host's name, when known.
    pub host: Option<String>,
    /// The process id.
    pub pid: u32,
    /// When the process started, in seconds since the Unix epoch, when known.
    pub process_start: Option<u64>,
    /// The wall-clock time of the file's time zero, in microseconds since
    /// the Unix epoch: a time `t` (µs) in the file happened at
    /// `clock_zero_unix_us + t`.
    pub clock_zero_unix_us: u64,
    /// The libtorch the process ran on (`2.11.0`).
    pub libtorch: Option<String>,
    /// Each CUDA device the process saw, with its UUID where the driver
    /// gave it (`GPU-…`, as `nvidia-smi -L` prints it).
    pub devices: Vec<DeviceId>,
}

/// A CUDA device of a process, by its index there and its UUID.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceId {
    /// `cuda:N` in the process.
    pub device: String,
    /// The device's UUID, when the driver gave it.
    pub uuid: Option<String>,
}

impl RunInfo {
    /// The name of a rank's part of a merged file: `rank 1 (host, cuda:0)`,
    /// or `pid 1234 (host)` without a rank, with every CUDA device the
    /// process saw.
    pub fn label(&self) -> String {
        let devices: Vec<&str> = self.devices.iter().map(|d| d.device.as_str()).collect();
        self.label_with(&devices)
    }

    /// [`label`](Self::label) naming only `devices` (those the process
    /// used, say: a rank on the CPU of a GPU machine names none).
    pub fn label_with(&self, devices: &[&str]) -> String {
        let mut within: Vec<String> = self.host.iter().cloned().collect();
        within.extend(devices.iter().filter(|d| d.starts_with("cuda")).map(|d| d.to_string()));
        let who = match self.rank {
            Some(rank) => format!("rank {rank}"),
            None => format!("pid {}", self.pid),
        };
        if within.is_empty() {
            who
        } else {
            format!("{who} ({})", within.join(", "))
        }
    }

    /// `_rank{N}` for a file name, or nothing without a rank.
    pub fn file_suffix(&self) -> String {
        self.rank.map(|rank| format!("_rank{rank}")).unwrap_or_default()
    }
}

/// The rank and world size from the process's environment (see
/// [`RANK_VARIABLES`]).
pub fn rank_from_env() -> RankFromEnv {
    rank_from(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
}

fn rank_from(var: impl Fn(&str) -> Option<String>) -> RankFromEnv {
    let mut found = RankFromEnv::default();
    // A variable set to something other than a whole number: its name and value.
    let number = |name: &str| -> Result<Option<u32>, String> {
        match var(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| v),
        }
    };
    let Some((name, size)) = RANK_VARIABLES.iter().find(|(name, _)| var(name).is_some_and(|v| !v.trim().is_empty()))
    else {
        return found;
    };
    match number(name) {
        Ok(rank) => {
            found.rank = rank;
            found.rank_variable = Some(name);
        }
        Err(v) => found.warnings.push(format!(
            "{name}={v:?} is not a whole number: set it to this process's rank (0, 1, …) or unset it; files will \
             carry no rank"
        )),
    }
    if let Some(size) = size {
        match number(size) {
            Ok(world_size) => found.world_size = world_size,
            Err(v) => found.warnings.push(format!(
                "{size}={v:?} is not a whole number: set it to how many processes the run has (1, 2, …) or unset \
                 it; files will carry no world size"
            )),
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    fn read(pairs: &[(&str, &str)]) -> (Option<u32>, Option<u32>) {
        let found = rank_from(env(pairs));
        assert!(found.warnings.is_empty(), "{:?}", found.warnings);
        (found.rank, found.world_size)
    }

    #[test]
    fn the_first_rank_variable_set_wins() {
        assert_eq!(read(&[]), (None, None));
        assert_eq!(read(&[("LOCAL_RANK", "3"), ("WORLD_SIZE", "8")]), (Some(3), Some(8)));
        assert_eq!(read(&[("LOCAL_RANK", "3"), ("RANK", "11")]), (Some(11), None));
        assert_eq!(read(&[("MEMLAB_RANK", "1"), ("RANK", "11")]), (Some(1), None));
        assert_eq!(read(&[("MEMLAB_RANK", " "), ("RANK", "2")]), (Some(2), None));
        let found = rank_from(env(&[("RANK", "zero")]));
        assert_eq!((found.rank, found.warnings.len()), (None, 1));
        assert!(found.warnings[0].starts_with("RANK=\"zero\" is not a whole number"), "{:?}", found.warnings);
    }

    #[test]
    fn a_bad_world_size_is_left_out_on_its_own() {
        let found = rank_from(env(&[("RANK", "1"), ("WORLD_SIZE", "abc")]));
        assert_eq!((found.rank, found.world_size), (Some(1), None), "the rank is kept");
        assert_eq!(found.warnings.len(), 1);
        let w = &found.warnings[0];
        assert!(w.starts_with("WORLD_SIZE=\"abc\" is not a whole number"), "{w}");
        assert!(w.contains("how many processes the run has") && !w.contains("rank (0, 1"), "{w}");
    }

    #[test]
    fn ranks_under_slurm_and_mpi() {
        // srun: every task has its id and the count.
        assert_eq!(read(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")]), (Some(5), Some(8)));
        // Open MPI's mpirun inside a Slurm allocation: the batch script's
        // SLURM_PROCID (0 for every process) loses to Open MPI's rank.
        let ompi = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("PMIX_RANK", "3"),
        ];
        assert_eq!(read(&ompi), (Some(3), Some(4)));
        // MPICH / Intel MPI (Hydra): PMI.
        assert_eq!(read(&[("PMI_RANK", "2"), ("PMI_SIZE", "6")]), (Some(2), Some(6)));
        // PMIx alone gives no size.
        assert_eq!(read(&[("PMIX_RANK", "7"), ("WORLD_SIZE", "9")]), (Some(7), None));
        // torchrun under srun: torchrun's global rank wins over the node's task id.
        assert_eq!(read(&[("SLURM_PROCID", "1"), ("RANK", "9"), ("WORLD_SIZE", "16")]), (Some(9), Some(16)));
        // Local ranks only where no global one is set.
        assert_eq!(
            read(&[("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")]),
            (Some(1), Some(2))
        );
        assert_eq!(read(&[("SLURM_LOCALID", "3")]), (Some(3), None));
        let found = rank_from(env(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "eight")]));
        assert_eq!((found.rank, found.rank_variable, found.world_size), (Some(4), Some("SLURM_PROCID"), None));
        assert!(found.warnings[0].starts_with("SLURM_NTASKS=\"eight\""), "{:?}", found.warnings);
    }

    #[test]
    fn labels_and_file_names() {
        let mut run = RunInfo { pid: 42, host: Some("node7".into()), ..RunInfo::default() };
        assert_eq!((run.label(), run.file_suffix()), ("pid 42 (node7)".to_string(), String::new()));
        run.rank = Some(1);
        run.devices.push(DeviceId { device: "cuda:0".into(), uuid: None });
        assert_eq!((run.label(), run.file_suffix()), ("rank 1 (node7, cuda:0)".to_string(), "_rank1".to_string()));
        assert_eq!(run.label_with(&["cpu"]), "rank 1 (node7)");
    }
}
