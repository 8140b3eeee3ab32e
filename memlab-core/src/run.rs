//! Who wrote a file, among several processes: the rank and world size a
//! launcher gave the process, its host, pid and start, the wall-clock time of
//! the recorder's clock zero (so that files of processes whose clocks started
//! apart line up), the libtorch it ran on and its CUDA devices' UUIDs (so that
//! two processes on one GPU, or one process on several, are told apart).
//! Exports and out-of-memory reports carry one [`RunInfo`].

use serde::{Deserialize, Serialize};

/// The variables a rank is read from, first found wins: memlab's own, then
/// torchrun's (and most launchers') global rank, then the local rank.
pub const RANK_VARIABLES: [&str; 3] = ["MEMLAB_RANK", "RANK", "LOCAL_RANK"];

/// The variable the world size is read from (torchrun's).
pub const WORLD_SIZE_VARIABLE: &str = "WORLD_SIZE";

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

/// The rank and world size from the process's environment: `Ok((None, _))`
/// when no variable of [`RANK_VARIABLES`] is set; an error naming the
/// variable when one holds something other than a whole number.
pub fn rank_from_env() -> Result<(Option<u32>, Option<u32>), String> {
    rank_from(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
}

fn rank_from(var: impl Fn(&str) -> Option<String>) -> Result<(Option<u32>, Option<u32>), String> {
    let number = |name: &str| -> Result<Option<u32>, String> {
        match var(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| {
                format!("{name}={v:?} is not a whole number: set it to this process's rank (0, 1, …) or unset it")
            }),
        }
    };
    let mut rank = None;
    for name in RANK_VARIABLES {
        if let Some(r) = number(name)? {
            rank = Some(r);
            break;
        }
    }
    Ok((rank, number(WORLD_SIZE_VARIABLE)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_first_rank_variable_set_wins() {
        assert_eq!(rank_from(env(&[])), Ok((None, None)));
        assert_eq!(rank_from(env(&[("LOCAL_RANK", "3"), ("WORLD_SIZE", "8")])), Ok((Some(3), Some(8))));
        assert_eq!(rank_from(env(&[("LOCAL_RANK", "3"), ("RANK", "11")])), Ok((Some(11), None)));
        assert_eq!(rank_from(env(&[("MEMLAB_RANK", "1"), ("RANK", "11")])), Ok((Some(1), None)));
        assert_eq!(rank_from(env(&[("MEMLAB_RANK", " "), ("RANK", "2")])), Ok((Some(2), None)));
        let e = rank_from(env(&[("RANK", "zero")])).unwrap_err();
        assert!(e.starts_with("RANK=\"zero\" is not a whole number"), "{e}");
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
