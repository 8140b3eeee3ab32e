//! A device's allocated bytes, accounted for as numbers: the named storages,
//! on CUDA the workspaces libtorch keeps for cuBLAS and cuBLASLt (read from
//! its own tables), the live allocations no named tensor owns (by the site
//! that made them, while allocation events are recorded), what memlab could
//! not attribute, and on CUDA the caching allocator's rounding. The reporter and the GPU
//! account render from this one model, so their figures cannot disagree.

use memlab_core::events::{by_site_with, LiveAllocation, SiteGroup};
use memlab_core::hash::FastMap;
use memlab_core::{Device, DeviceStats};
use memlab_tch::segments::{BlasWorkspace, BlockState, CudaSegment};

use crate::named::Named;

/// Every allocated byte of one device, attributed.
#[derive(Clone, Debug)]
pub(crate) struct Attribution {
    /// `allocated_bytes.all.current`: what the parts below add up to.
    pub(crate) allocated: i64,
    /// Bytes of named storages the allocator allocated.
    pub(crate) named: u64,
    /// Bytes of named storages it did not allocate (outside its figures).
    pub(crate) external: u64,
    /// With events recorded: the unnamed live allocations by site, largest first.
    pub(crate) unnamed: Option<Vec<SiteGroup>>,
    /// Requested bytes neither named nor listed by site.
    pub(crate) unattributed: i64,
    /// CUDA: allocated minus requested, the rounding to block sizes.
    pub(crate) rounding: i64,
    /// CUDA: the BLAS workspaces libtorch keeps on this device, read from
    /// its own tables, their bytes the allocator's blocks' requested sizes.
    pub(crate) workspaces: Vec<Workspace>,
}

/// A workspace libtorch keeps for itself on a device: memory no tensor
/// holds, named by what it is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Workspace {
    /// `cuBLAS workspace (handle 0x…, stream 0x…)`.
    pub(crate) label: String,
    /// Its address: a block of the caching allocator.
    pub(crate) address: u64,
    /// What it asked the allocator for.
    pub(crate) bytes: u64,
}

/// The BLAS workspaces on CUDA device `index`, with their sizes from the
/// allocator's blocks. Empty where they cannot be read now (a build without
/// the CUDA headers, another thread making one): they stay unnamed then.
fn workspaces(index: usize) -> Vec<Workspace> {
    let Ok(tables) = memlab_tch::segments::blas_workspaces() else { return Vec::new() };
    if !tables.iter().any(|w| w.device == index) {
        return Vec::new();
    }
    let Ok(segments) = memlab_tch::segments::cuda_segments() else { return Vec::new() };
    sized_workspaces(&tables, &segments).into_iter().filter(|(device, _)| *device == index).map(|(_, w)| w).collect()
}

/// libtorch's BLAS workspaces (`tables`, as `blas_workspaces` read them)
/// with their sizes from the allocator's `segments`, by device: each a live
/// block, named once (cuBLASLt may share cuBLAS's buffer), largest first.
pub(crate) fn sized_workspaces(tables: &[BlasWorkspace], segments: &[CudaSegment]) -> Vec<(usize, Workspace)> {
    let blocks: FastMap<(usize, u64), u64> = segments
        .iter()
        .flat_map(|s| s.blocks.iter().map(move |b| (s.device, b)))
        .filter(|(_, b)| b.state == BlockState::ActiveAllocated)
        .map(|(device, b)| ((device, b.address), b.requested_size))
        .collect();
    let mut out: Vec<(usize, Workspace)> = Vec::new();
    for w in tables {
        let Some(&bytes) = blocks.get(&(w.device, w.address)) else { continue };
        if out.iter().any(|(device, o)| *device == w.device && o.address == w.address) {
            continue;
        }
        let label = format!("{} workspace (handle {:#x}, stream {:#x})", w.kind.name(), w.handle, w.stream);
        out.push((w.device, Workspace { label, address: w.address, bytes }));
    }
    out.sort_by(|(_, a), (_, b)| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));
    out
}

/// Accounts for the allocated bytes of `device`, as the caller read them in
/// `stats`, given the named storages and, when events are recorded, the live
/// allocations.
pub(crate) fn attribute(
    device: Device,
    stats: &DeviceStats,
    named: &Named,
    live: Option<&[LiveAllocation]>,
) -> Attribution {
    let allocated = stats.allocated_bytes.all.current;
    let requested = stats.requested_bytes.all.current;
    let (named_bytes, external) = named.bytes(device);
    let workspaces = match device {
        Device::Cuda(index) => workspaces(index),
        Device::Cpu => Vec::new(),
    };
    let is_workspace = |address: u64| workspaces.iter().any(|w| w.address == address);
    let unnamed = live.map(|live| {
        by_site_with(
            live.iter().filter(|a| a.device == device && !named.owns(device, a.address) && !is_workspace(a.address)),
            memlab_core::export::site_of,
        )
    });
    let listed: u64 = unnamed.iter().flatten().map(|s| s.bytes).sum();
    let in_workspaces: u64 = workspaces.iter().map(|w| w.bytes).sum();
    Attribution {
        allocated,
        named: named_bytes,
        external,
        unattributed: requested - named_bytes as i64 - listed as i64 - in_workspaces as i64,
        rounding: allocated - requested,
        unnamed,
        workspaces,
    }
}

/// How a site reads in a row: its frame or statement, or why it is not known.
pub(crate) fn site_label(group: &SiteGroup) -> &str {
    group.site.as_deref().unwrap_or("allocated outside profiled code")
}
