//! A device's allocated bytes, accounted for as numbers: the named storages,
//! the live allocations no named tensor owns (by the site that made them,
//! while allocation events are recorded), what memlab could not attribute,
//! and on CUDA the caching allocator's rounding. The reporter and the GPU
//! account render from this one model, so their figures cannot disagree.

use memlab_core::events::LiveAllocation;
use memlab_core::render::{by_site, SiteGroup};
use memlab_core::{Device, DeviceStats};

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
    let unnamed =
        live.map(|live| by_site(live.iter().filter(|a| a.device == device && !named.owns(device, a.address))));
    let listed: u64 = unnamed.iter().flatten().map(|s| s.bytes).sum();
    Attribution {
        allocated,
        named: named_bytes,
        external,
        unattributed: requested - named_bytes as i64 - listed as i64,
        rounding: allocated - requested,
        unnamed,
    }
}

/// How a site reads in a row: its frame or statement, or why it is not known.
pub(crate) fn site_label(group: &SiteGroup) -> &str {
    group.site.as_deref().unwrap_or("allocated outside profiled code")
}
