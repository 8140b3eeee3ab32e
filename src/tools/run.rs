//! This process's [`RunInfo`]: its rank and world size from the launcher's
//! variables, host, pid, start, the recorder's clock zero on the wall clock,
//! libtorch's version and each CUDA device's UUID. What cannot change while
//! the process runs is read once.

use std::sync::OnceLock;

use memlab_core::run::{rank_from_env, DeviceId, RunInfo};

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
