//! libtorch's CUDA caching allocator as a model, to replay a recording
//! under other settings: "would `expandable_segments` have avoided this
//! out-of-memory error?", answered without a GPU.
//!
//! [`AllocatorConfig`] parses settings as `PYTORCH_CUDA_ALLOC_CONF` writes
//! them; [`CachingAllocator`] follows libtorch 2.11's allocator request by
//! request, over a device of a given capacity, and keeps the same
//! statistics (`torch.cuda.memory_stats()`) and the segments it obtains and
//! gives back, so that a replay under the recorded settings can be checked
//! against the allocator's own segment events.
//!
//! [`replay_device`] replays one device of a snapshot, memlab's or
//! PyTorch's; [`replay_snapshot`] every CUDA device, under the recorded
//! settings and others ([`COMPARED`] with `compare`), side by side: the
//! peaks, fragmentation at the peak ([`AtPeak`]), each out-of-memory error
//! and why, and which settings would have avoided the recorded one
//! ([`DeviceReplays::verdict`]). This is what `memlab replay` prints, and
//! what memlab's out-of-memory report adds on CUDA while a recording runs.
//!
//! [`predict_cuda`] answers "will it fit?" before a GPU run: a CPU run's
//! recording of the step, its allocations replayed through the model as if
//! they were CUDA's, with what a CUDA run allocates beside them
//! ([`CudaAdditions`]: cuBLAS's workspaces, memory outside the allocator),
//! and with a card's memory, whether it fits or by how much it does not.
//! Every figure is an estimate; [`NOT_MODELLED`] lists what a CUDA run does
//! otherwise (`memlab replay --as-cuda`).
//!
//! What a replay needs, a snapshot records: the allocator's settings as
//! libtorch parsed them (PyTorch's `allocator_settings`, which memlab's own
//! snapshots write too), each device's memory and memory fraction (memlab's
//! `device_memory`), and the history from the allocator's first segment.
//! Where a history begins on a warm allocator (memlab recording started
//! late, PyTorch's `max_entries` too small), the segments held before it are
//! rebuilt from the snapshot's final segments by undoing the history, blocks
//! in use included ([`DeviceReplay::rebuilt_segments`]); where something
//! is missing, the replay says what it assumed.
//!
//! ```
//! use memlab_core::replay::{AllocatorConfig, CachingAllocator};
//!
//! const MIB: u64 = 1 << 20;
//! let config = AllocatorConfig::parse("max_split_size_mb:64")?;
//! let mut gpu = CachingAllocator::new(config, 1 << 30, 80 << 30)?;
//! let a = gpu.malloc(3 * MIB, 0).unwrap();   // a 20 MiB segment, split
//! let b = gpu.malloc(5 * MIB, 0).unwrap();   // from its rest
//! assert_eq!(gpu.stats().reserved_bytes.all.current, 20 * MIB as i64);
//! gpu.free(a);
//! gpu.free(b);
//! gpu.empty_cache();                         // the segment is whole again: given back
//! assert_eq!(gpu.stats().reserved_bytes.all.current, 0);
//! # Ok::<(), memlab_core::Error>(())
//! ```

mod allocator;
mod as_cuda;
pub mod attention;
mod compare;
mod config;
mod cudnn_h200;
mod driver;
mod kernels;
mod reduction;
pub mod rnn;
mod run;
mod steady;
mod version;

pub use allocator::{
    BlockId, CachingAllocator, ModelOom, SegmentAction, SegmentEvent, MIN_BLOCK, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};
pub(crate) use as_cuda::site;
pub use as_cuda::{
    check_settings, check_settings_as, cpu_history_as_cuda, predict_cuda, predicted_history, CudaAdditions,
    CudaPrediction, Fit, PeakRange, Peaks, PredictOptions, SettingPrediction, NOT_MODELLED, NOT_PREDICTABLE,
    NOT_WATCHED,
};
pub use compare::{replay_snapshot, DeviceReplays, ReplayOptions, Replayed, COMPARED};
pub use config::{AllocatorConfig, ReadSettings, DIVISION_BUCKETS, MAX_MB, MIB, MIN_LARGE_ALLOC, ONE_EXABYTE};
pub use kernels::{
    cudnn_measured, cudnn_workspaces, embedding_backward_temporaries, scratch_of_ops, unmodelled, Computing,
    KernelSteps, KernelsModelled, Life, Measured, Unmodelled, Workspace, H100_MEASURED,
};
pub use reduction::{staging as reduction_staging, ReductionDevice};
pub use run::{
    replay_device, replay_device_at, replay_device_part, AtPeak, Card, DeviceReplay, Mismatch, ReplayOom, OOMS_KEPT,
};
pub use version::{KernelTables, Libtorch};

#[cfg(test)]
pub(crate) mod tests;
