//! A device's allocated bytes, accounted for as numbers: the named storages,
//! the live allocations no named tensor owns (by the site that made them,
//! while allocation events are recorded), what memlab could not attribute,
//! and on CUDA the caching allocator's rounding. The reporter and the GPU
//! account render from this one model, so their figures cannot disagree.

use memlab_core::events::LiveAllocation;
use memlab_core::render::by_site;
use memlab_core::{Device, Result};

use crate::named::Named;

/// Live allocations of one site that no named tensor owns.
#[derive(Clone, Debug)]
pub(crate) struct Site {
    /// The user's frame or profiled statement that made them, or a phrase
    /// saying it is not known.
    pub(crate) site: String,
    pub(crate) bytes: u64,
    pub(crate) blocks: u64,
}

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
    pub(crate) unnamed: Option<Vec<Site>>,
    /// Requested bytes neither named nor listed by site.
    pub(crate) unattributed: i64,
    /// CUDA: allocated minus requested, the rounding to block sizes.
    pub(crate) rounding: i64,
}

/// Accounts for the allocated bytes of `device`, given the named storages and,
/// when events are recorded, the live allocations.
pub(crate) fn attribute(device: Device, named: &Named, live: Option<&[LiveAllocation]>) -> Result<Attribution> {
    let stats = memlab_tch::device_stats(device)?;
    let allocated = stats.allocated_bytes.all.current;
    let requested = stats.requested_bytes.all.current;
    let (named_bytes, external) = named.bytes(device);
    let unnamed: Option<Vec<Site>> = live.map(|live| {
        by_site(live.iter().filter(|a| a.device == device && !named.owns(device, a.address)))
            .into_iter()
            .map(|g| Site {
                site: g.site.unwrap_or_else(|| "allocated outside profiled code".to_string()),
                bytes: g.bytes,
                blocks: g.blocks,
            })
            .collect()
    });
    let listed: u64 = unnamed.iter().flatten().map(|s| s.bytes).sum();
    Ok(Attribution {
        allocated,
        named: named_bytes,
        external,
        unattributed: requested - named_bytes as i64 - listed as i64,
        rounding: allocated - requested,
        unnamed,
    })
}
