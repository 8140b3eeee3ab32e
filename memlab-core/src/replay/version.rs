//! The libtorch versions whose CUDA caching allocator the replay models, and
//! everything in which they differ: one value of [`Libtorch`] per version.
//!
//! libtorch 2.13 (git cf30153c) against 2.11 (git 70d99e99), in what
//! `memlab replay` uses (read from both releases' headers and compiled
//! allocators, and the pull requests that changed them):
//!
//! | | 2.11 | 2.13 |
//! |---|---|---|
//! | size rounding, `roundup_power2_divisions` | | same |
//! | pools, 1 MiB / 2 MiB / 10 MiB / 20 MiB thresholds, `large_segment_size_mb` | | same |
//! | best fit, `max_split_size`, splitting and merging | | same |
//! | free blocks of one size, one stream | by address | by their segment's age (its `cudaMalloc`, or its expandable segment's creation), then address (pytorch#183591) |
//! | the memory fraction's limit | `fraction × total`, truncated | rounded to the nearest byte (pytorch#179444) |
//! | a failed `cudaMalloc` | free the cache, retry | the same; with `throw_on_cudamalloc_oom:True` under a memory fraction, refused at once (not modelled: memlab refuses the setting) |
//! | expandable segments, `empty_cache` | | same |
//! | keys | | adds `throw_on_cudamalloc_oom`, `pinned_free_catch_all`, `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb` (the pinned ones move no device memory) |
//! | the snapshot's `allocator_settings` | | adds `max_round_threshold`, `max_cached_size` (pinned memory) |
//!
//! What a version's CUDA libraries allocate beside the tensors, which a CPU
//! run replayed as CUDA's adds ([`KernelTables`], `Libtorch::kernels`: cuDNN's
//! workspaces, cuBLAS's, the reductions' staging, what the process holds
//! outside the allocator), was measured and read with 2.11's libraries on
//! an H100. 2.13's tables are 2.11's until they are measured with 2.13's;
//! a prediction for 2.13 says so.

use super::kernels::{Measured, H100_MEASURED};
use super::reduction::ReductionDevice;
use crate::error::{Error, Result};
use crate::units::MIB;

/// What a libtorch version's CUDA kernels and libraries allocate that the
/// CPU's do not, as a CPU run replayed as CUDA's models it, and where the
/// figures come from.
#[derive(Debug, PartialEq)]
pub struct KernelTables {
    /// The libtorch whose libraries (cuDNN, cuBLAS) the figures were
    /// measured and read with.
    pub measured_with: Libtorch,
    /// The GPU they were measured on.
    pub measured_on: &'static str,
    /// cuDNN's workspaces of the convolutions measured, table by table
    /// (see [`cudnn_workspaces`](super::cudnn_workspaces) for the others).
    pub cudnn: &'static [&'static [Measured]],
    /// The device whose figures size the reductions' staging buffers.
    pub reduction_device: ReductionDevice,
    /// cuBLAS's workspace of one handle: on compute capability 9.0 and
    /// later (libtorch's `:4096:8`), and before (`:4096:2:16:8`).
    pub cublas_workspace: [u64; 2],
    /// The handles that make one: the forward pass's thread's and autograd's.
    pub cublas_handles: u32,
    /// cuBLASLt's workspace, made once.
    pub cublaslt_workspace: u64,
    /// What the process holds on the device outside the allocator (the CUDA
    /// context, the kernels' modules, the libraries' own memory).
    pub outside_allocator: u64,
}

/// libtorch 2.11 (CUDA 13) on an H100, measured 2026-11-26, and cuDNN's
/// convolutions on an H200 (the same heuristics: the two agree on every
/// shape both measured), 2026-11-29: the grid of common shapes, and the
/// zoo's image models' shapes at every batch to 256.
const TABLES_2_11: KernelTables = KernelTables {
    measured_with: Libtorch::V2_11,
    measured_on: "NVIDIA H100 80GB HBM3",
    cudnn: &[H100_MEASURED, super::cudnn_h200::H200_GRID, super::cudnn_h200::H200_DENSE],
    reduction_device: ReductionDevice::H100,
    cublas_workspace: [32 * MIB, 8 * MIB + 128 * 1024],
    cublas_handles: 2,
    cublaslt_workspace: MIB,
    outside_allocator: 742 * MIB,
};

/// A libtorch version whose CUDA caching allocator memlab models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Libtorch {
    /// libtorch 2.11 (git 70d99e99), the version memlab's CUDA figures are
    /// verified on.
    #[default]
    #[serde(rename = "2.11")]
    V2_11,
    /// libtorch 2.13 (git cf30153c): free blocks of one size taken oldest
    /// segment first, the memory fraction's limit rounded.
    #[serde(rename = "2.13")]
    V2_13,
}

impl Libtorch {
    /// Every version modelled, oldest first.
    pub const ALL: [Libtorch; 2] = [Libtorch::V2_11, Libtorch::V2_13];

    /// The version as libtorch numbers its release (`2.11.0`).
    pub fn release(self) -> &'static str {
        match self {
            Libtorch::V2_11 => "2.11.0",
            Libtorch::V2_13 => "2.13.0",
        }
    }

    /// The version modelled for a recording made by libtorch `version`
    /// (`2.13.0+cu130`, `2.11`): the one of its minor version, if memlab
    /// models it.
    pub fn of_recording(version: &str) -> Option<Libtorch> {
        let mut parts = version.split('+').next()?.trim().split('.');
        let (major, minor) = (parts.next()?, parts.next()?);
        Libtorch::ALL.into_iter().find(|v| {
            let mut own = v.release().split('.');
            own.next() == Some(major) && own.next() == Some(minor)
        })
    }

    /// `--libtorch VERSION`: a version memlab models, or an error that lists them.
    pub fn parse(version: &str) -> Result<Libtorch> {
        Libtorch::of_recording(version).ok_or_else(|| {
            let known: Vec<&str> = Libtorch::ALL.iter().map(|v| v.release()).collect();
            Error::InvalidArgument(format!(
                "libtorch {version:?} is not a version whose allocator memlab models; give one of {}",
                known.join(", ")
            ))
        })
    }

    /// The free blocks' order after stream and size: a block's place among
    /// those of its size. `segment` counts the segments made before its own.
    pub(crate) fn free_order(self, segment: u64, address: u64) -> u128 {
        match self {
            Libtorch::V2_11 => u128::from(address),
            Libtorch::V2_13 => (u128::from(segment) << 64) | u128::from(address),
        }
    }

    /// The most the allocator may hold under memory `fraction` of `total`
    /// bytes (`allowed_memory_maximum`).
    pub(crate) fn fraction_limit(self, fraction: f64, total: u64) -> u64 {
        let exact = fraction * total as f64;
        match self {
            Libtorch::V2_11 => exact as u64,
            Libtorch::V2_13 => exact.round() as u64,
        }
    }

    /// Boolean keys this version accepts that move no device memory: 2.11's,
    /// then what 2.13 adds.
    pub(crate) fn switches_without_effect(self) -> &'static [&'static str] {
        const SWITCHES: [&str; 7] = [
            "release_lock_on_cudamalloc",
            "release_lock_on_hipmalloc",
            "pinned_use_cuda_host_register",
            "pinned_use_hip_host_register",
            "pinned_use_background_threads",
            "graph_capture_record_stream_reuse",
            "pinned_free_catch_all",
        ];
        match self {
            Libtorch::V2_11 => &SWITCHES[..6],
            Libtorch::V2_13 => &SWITCHES,
        }
    }

    /// Size keys (MiB) this version accepts for pinned host memory, which
    /// move no device memory: 2.11's, then what 2.13 adds.
    pub(crate) fn pinned_sizes(self) -> &'static [&'static str] {
        const SIZES: [&str; 3] =
            ["pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"];
        match self {
            Libtorch::V2_11 => &SIZES[..1],
            Libtorch::V2_13 => &SIZES,
        }
    }

    /// What this version's CUDA kernels and libraries allocate beside the
    /// tensors. 2.13's are 2.11's (`measured_with` says so) until measured
    /// with 2.13's libraries.
    pub fn kernels(self) -> &'static KernelTables {
        match self {
            Libtorch::V2_11 | Libtorch::V2_13 => &TABLES_2_11,
        }
    }

    /// Whether this version reads `throw_on_cudamalloc_oom`.
    pub(crate) fn has_preemptive_oom(self) -> bool {
        self >= Libtorch::V2_13
    }
}

impl std::fmt::Display for Libtorch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let release = self.release();
        write!(f, "libtorch {}", release.strip_suffix(".0").unwrap_or(release))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recordings_version_names_the_model_of_its_minor_version() {
        assert_eq!(Libtorch::of_recording("2.11.0+cu130"), Some(Libtorch::V2_11));
        assert_eq!(Libtorch::of_recording("2.13.1"), Some(Libtorch::V2_13));
        assert_eq!(Libtorch::of_recording("2.13"), Some(Libtorch::V2_13));
        assert_eq!(Libtorch::of_recording("2.12.0"), None);
        assert_eq!(Libtorch::of_recording("2.1.0"), None);
        assert_eq!(Libtorch::of_recording(""), None);
        let e = Libtorch::parse("2.9").unwrap_err().to_string();
        assert!(e.contains("2.11.0, 2.13.0"), "{e}");
        assert_eq!(Libtorch::V2_13.to_string(), "libtorch 2.13");
    }

    #[test]
    fn each_versions_kernel_tables_say_what_they_were_measured_with() {
        let (old, new) = (Libtorch::V2_11.kernels(), Libtorch::V2_13.kernels());
        assert_eq!(old.measured_with, Libtorch::V2_11);
        assert_eq!(new.measured_with, Libtorch::V2_11, "2.13's are 2.11's until measured, and say so");
        assert_eq!(old.cudnn[0].len(), 24, "the shapes of examples/cudnn_workspaces.rs");
        assert_eq!(old.cudnn[1].len(), 11805, "the grid of examples/cudnn_workspaces.rs --grid");
        let additions = super::super::CudaAdditions::of(Libtorch::V2_11, 8);
        assert_eq!(additions.cublas_workspace, 8 * MIB + 128 * 1024, "before compute capability 9.0");
    }

    #[test]
    fn the_fraction_is_truncated_by_2_11_and_rounded_by_2_13() {
        // 0.3 × 6,990,506 = 2,097,151.8.
        assert_eq!(Libtorch::V2_11.fraction_limit(0.3, 6_990_506), 2_097_151);
        assert_eq!(Libtorch::V2_13.fraction_limit(0.3, 6_990_506), 2_097_152);
    }
}
