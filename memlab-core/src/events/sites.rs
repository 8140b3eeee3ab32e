//! Live allocations grouped by device and by site: what the dispose
//! scopes, the Courtesy guard and the reports of unnamed memory list.

use std::collections::BTreeMap;

use super::{LiveAllocation, StatementRef};
use crate::device::Device;

/// Live allocations of one device and site, added up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteGroup {
    /// Where they are.
    pub device: Device,
    /// The user's frame or profiled statement that made them, or what libtorch
    /// made them for (see `export::site_of`), if known.
    pub site: Option<String>,
    /// Their bytes.
    pub bytes: u64,
    /// How many.
    pub blocks: u64,
}

/// `allocations` grouped by device and site, largest first (then by device
/// and site, so equal groups keep one order).
pub fn by_site<'a>(allocations: impl IntoIterator<Item = &'a LiveAllocation>) -> Vec<SiteGroup> {
    by_site_with(allocations, LiveAllocation::site)
}

/// [`by_site`], each distinct stack's site given by `site` (once per stack).
pub fn by_site_with<'a>(
    allocations: impl IntoIterator<Item = &'a LiveAllocation>,
    site: impl Fn(&LiveAllocation) -> Option<String>,
) -> Vec<SiteGroup> {
    // By call stack first (no resolution), then each stack's site once.
    type Stack<'s> = (Device, Option<&'s [u64]>, Option<StatementRef>);
    // A statement hashes by its site's address and its line, never by what
    // the site holds, so the key is stable though the site has cells inside.
    #[allow(clippy::mutable_key_type)]
    let mut stacks: crate::hash::FastMap<Stack<'a>, (&'a LiveAllocation, u64, u64)> = Default::default();
    for a in allocations {
        let key = (a.device, a.backtrace.as_deref().map(|b| b.addresses()), a.statement);
        let entry = stacks.entry(key).or_insert((a, 0, 0));
        entry.1 += a.size;
        entry.2 += 1;
    }
    let mut groups: BTreeMap<(Device, Option<String>), (u64, u64)> = BTreeMap::new();
    for (first, bytes, blocks) in stacks.into_values() {
        let entry = groups.entry((first.device, site(first))).or_default();
        entry.0 += bytes;
        entry.1 += blocks;
    }
    let mut out: Vec<SiteGroup> =
        groups.into_iter().map(|((device, site), (bytes, blocks))| SiteGroup { device, site, bytes, blocks }).collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| (a.device, &a.site).cmp(&(b.device, &b.site))));
    out
}
