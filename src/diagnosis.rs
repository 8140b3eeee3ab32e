//! Why a request failed, in figures and words: the device's memory at the
//! failure, the [`Verdict`], what held the memory, and advice that names the
//! figures and the largest holders (the model of both, [`Diagnosis`], is `memlab_core`'s). A shared layer: the out-of-memory recorder writes it in
//! its reports, the batch-size search keeps it for its first failing try.

use std::sync::Arc;

use memlab_core::events::{self, Backtrace, Frame, LiveAllocation};
use memlab_core::hash::FastMap;
use memlab_core::oom::{
    DeviceMemory, Diagnosis, Failure, Holders, HostLimit, MemoryFigures, NamedHolder, NamedRest, Serving, SiteHolder,
    Verdict, SMALL_SEGMENT,
};
use memlab_core::render::Cell;
use memlab_core::Device;
use memlab_tch::BACKEND;

use crate::attribution::{attribute, site_label};
use crate::named::{Model, Named};

/// The figures of `failure`'s device and the verdict; with the holders,
/// advice that names the largest of them.
pub(crate) fn diagnose(failure: &Failure, holders: Option<&Holders>) -> (Diagnosis, Vec<String>) {
    let device = failure.device;
    let mut missing = Vec::new();
    // libtorch's CUDA allocator serves a request from its stream's blocks of
    // its pool only; it reserves 2 MiB segments for small requests (≤ 1 MiB)
    // and larger ones for the rest.
    let serving = matches!(device, Device::Cuda(_))
        .then(|| Serving { stream: failure.stream.unwrap_or(0), large: failure.requested != SMALL_SEGMENT });
    let (mut figures, device_missing) = MemoryFigures::read_explained(&BACKEND, device, serving).unwrap_or_else(|e| {
        missing.push(format!("the allocator's figures: {e}"));
        (MemoryFigures::default(), None)
    });
    // The allocator's own figures at the failure beat a reading now.
    if let (Some(free), Some(total)) = (failure.device_free, failure.device_total) {
        let read = figures.device;
        let (this, others, limit) = read.map_or((None, None, None), |d| (d.this_process, d.other_processes, d.limit));
        let given = DeviceMemory::new(free, total, this, others).limited_by(limit);
        // Under a memory fraction libtorch gives the fraction's bytes as the
        // total, beside the driver's free bytes of the whole device, whose
        // total the reading has.
        figures.device = Some(match (device, read) {
            (Device::Cuda(_), Some(read)) => under_fraction(given, figures.reserved, read.total),
            _ => given,
        });
    }
    if let (None, Some(e)) = (figures.device, &device_missing) {
        let which = if device == Device::Cpu { "the host's memory" } else { "the driver's free and total memory" };
        missing.push(format!("{which}: {e}"));
    }
    if let Device::Cuda(i) = device
        && figures.device.is_some_and(|d| d.this_process.is_none())
    {
        match memlab_tch::process_gpu_memory(i) {
            Ok(None) => missing.push("this process's use: NVML does not list this process".to_string()),
            Err(e) => missing.push(format!("this process's and other processes' use (NVML): {e}")),
            Ok(Some(_)) => {}
        }
    }
    let verdict = Verdict::decide(failure.requested, &figures);
    let advice = advice(failure, &figures, verdict, holders);
    (Diagnosis { device, requested: failure.requested, rounded: failure.rounded, figures, verdict, advice }, missing)
}

/// Holders listed by name and by site (each); the rest are added up.
const TOP_HOLDERS: usize = 20;
/// Frames shown under an unnamed site.
const SITE_FRAMES: usize = 6;

/// What holds `device`'s memory: the storages of `sources` by name (walked
/// without waiting for any lock when `sources` is a handler's, see
/// [`WeakModel::now`](crate::named::WeakModel::now)), and with `with_sites`,
/// while a recording runs, the rest by the site that allocated it.
pub(crate) fn holders(device: Device, sources: &Model, with_sites: bool) -> Holders {
    let mut out = Holders::default();
    let Ok(stats) = memlab_tch::device_stats(device) else { return out };
    let named = match sources.collect() {
        Ok(named) => named,
        Err(e) => {
            out.busy.push(format!("the named tensors could not be walked: {e}"));
            Named::default()
        }
    };
    let live = (with_sites && events::is_active()).then(events::live);
    let account = attribute(device, &stats, &named, live.as_deref());
    out.named_bytes = account.named;
    out.not_named = account.allocated - account.named as i64;
    out.rounding = account.rounding;
    out.workspaces = account
        .workspaces
        .iter()
        .map(|w| memlab_core::oom::WorkspaceHolder { name: w.label.clone(), bytes: w.bytes })
        .collect();
    let mut rows: Vec<NamedHolder> = named
        .storages(device)
        .iter()
        .filter(|s| s.from_allocator)
        .map(|s| {
            let first = &s.views[0];
            let more = s.views.len() - 1;
            NamedHolder {
                name: if more > 0 { format!("{} (+{more} views)", first.name) } else { first.name.clone() },
                kind: first.kind,
                bytes: s.nbytes,
            }
        })
        .collect();
    // Largest first; equal sizes by name, shorter first (`layer2` before `layer10`).
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| (a.name.len(), &a.name).cmp(&(b.name.len(), &b.name))));
    let rest = rows.split_off(rows.len().min(TOP_HOLDERS));
    out.named_rest = NamedRest { count: rest.len(), bytes: rest.iter().map(|r| r.bytes).sum() };
    out.named = rows;
    if let (Some(groups), Some(live)) = (account.unnamed, live.as_deref()) {
        // Each site's first backtrace, the site of each distinct stack read
        // once (allocations from one call path share their backtrace).
        // A statement hashes by its site's address and line, never by what
        // the site holds.
        #[allow(clippy::mutable_key_type)]
        let mut site_of_stack = FastMap::default();
        let mut first: FastMap<Option<String>, &Arc<Backtrace>> = FastMap::default();
        for a in live.iter().filter(|a: &&LiveAllocation| a.device == device) {
            let Some(backtrace) = a.backtrace.as_ref() else { continue };
            let site = site_of_stack
                .entry((Arc::as_ptr(backtrace), a.statement))
                .or_insert_with(|| memlab_core::export::site_of(a));
            first.entry(site.clone()).or_insert(backtrace);
        }
        let frames_of = |site: &Option<String>| -> Vec<Frame> {
            first.get(site).map(|b| b.frames().iter().take(SITE_FRAMES).cloned().collect()).unwrap_or_default()
        };
        out.by_site = Some(
            groups
                .iter()
                .take(TOP_HOLDERS)
                .map(|g| SiteHolder {
                    site: site_label(g).to_string(),
                    bytes: g.bytes,
                    blocks: g.blocks,
                    frames: frames_of(&g.site),
                })
                .collect(),
        );
    }
    out
}

/// `memory` as a CUDA failure's figures give it (the driver's free bytes,
/// libtorch's total), on a device of `device_total` bytes whose allocator
/// holds `reserved`: where the total is less than the device's, a memory
/// fraction limits this process, and what it could still obtain is the
/// fraction's bytes less what the allocator holds (or the driver's free
/// bytes, where fewer).
fn under_fraction(memory: DeviceMemory, reserved: i64, device_total: u64) -> DeviceMemory {
    if memory.total >= device_total {
        return memory;
    }
    let room = memory.total.saturating_sub(reserved.max(0) as u64);
    let mut limited = memory.limited_by(Some(HostLimit::MemoryFraction));
    limited.free = memory.free.min(room);
    limited
}

fn advice(failure: &Failure, f: &MemoryFigures, verdict: Verdict, holders: Option<&Holders>) -> String {
    let b = |n: u64| Cell::bytes(n);
    let asked = b(failure.requested);
    let total = f.device.map(|d| d.total).unwrap_or(0);
    let device_free = f.device.map(|d| d.free).unwrap_or(0);
    // Under a host limit, the limit is what this process has.
    let limit = f.device.and_then(|d| d.limit);
    let all_of = match limit {
        Some(limit) => format!("all that {} allows this process", limit.describe()),
        None => format!("all of {}", failure.device),
    };
    match verdict {
        Verdict::RequestExceedsDevice => format!(
            "The request alone ({asked}, {} bytes: {} float32 elements) is larger than {all_of} ({}): no amount \
             of freeing makes it fit. Look at the shape of the tensor made on this line: a batch, sequence or \
             vocabulary size where a feature size belongs, or a dimension multiplied twice, is the usual cause.",
            failure.requested,
            failure.requested / 4,
            b(total)
        ),
        Verdict::Fragmentation => format!(
            "The cache holds {} free, enough for the {asked} request, but its largest free block is {}: the free \
             memory is in pieces ({} of it, {:.0}%, is in blocks too small to use here).",
            b(f.cache_free.bytes),
            b(f.cache_free.largest_block),
            b(f.fragmentation()),
            f.fragmentation_share().unwrap_or(0.0) * 100.0
        ),
        Verdict::OtherProcesses => format!(
            "Other processes hold {} of {}; with {} free on the device and {} in the cache, the {asked} request \
             would fit without them. Free the device (nvidia-smi lists them), or run where it is free.",
            b(f.device.and_then(|d| d.other_processes).unwrap_or(0)),
            failure.device,
            b(device_free),
            b(f.cache_free.bytes)
        ),
        Verdict::NotEnoughFree => {
            let has = match (failure.device, limit) {
                (Device::Cuda(_), Some(limit)) => format!(
                    "{} free under {} and its cache {}",
                    b(device_free),
                    limit.describe(),
                    b(f.cache_free.bytes)
                ),
                (Device::Cuda(_), None) => {
                    format!("{} free and its cache {}", b(device_free), b(f.cache_free.bytes))
                }
                (Device::Cpu, Some(limit)) => format!("{} free under {}", b(device_free), limit.describe()),
                (Device::Cpu, None) => format!("{} free", b(device_free)),
            };
            let mut text = format!(
                "{} has {has}, and {asked} was asked: this process holds too much ({} allocated by tensors).",
                failure.device,
                Cell::bytes(f.allocated)
            );
            if let Some(largest) = holders.map(|h| h.largest(3)).filter(|l| !l.is_empty()) {
                let list: Vec<String> = largest.iter().map(|(n, bytes)| format!("{n}: {}", b(*bytes))).collect();
                text.push_str(&format!(" The largest holders: {}.", list.join("; ")));
            }
            text.push_str(
                " Shrink what they hold: a smaller batch or sequence, fewer or smaller layers, mixed precision, \
                 or tensors an earlier step kept (a list of outputs or losses with their graphs).",
            );
            if f.would_suffice_in_one_piece(failure.requested) {
                text.push_str(&format!(
                    " Free memory would have sufficed in one piece: the device's and the cache's ({} in blocks of \
                     at most {}) are apart.",
                    b(f.cache_free.bytes),
                    b(f.cache_free.largest_block)
                ));
            }
            text
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_a_memory_fraction_free_is_what_the_fraction_leaves() {
        // The H100's failure under a 1.5 GiB fraction: libtorch gave the
        // fraction's bytes as the total and the driver's 77 GiB as free,
        // with 1 GiB reserved. What this process could still obtain was
        // 0.5 GiB.
        use memlab_core::units::MIB;
        let (reserved, device_total) = (1024 * MIB, 85_017_493_504);
        let given = DeviceMemory::new(82_741_248_000, 1536 * MIB, Some(1640 * MIB), None);
        let limited = under_fraction(given, reserved as i64, device_total);
        assert_eq!(
            (limited.free, limited.total, limited.limit),
            (512 * MIB, 1536 * MIB, Some(HostLimit::MemoryFraction))
        );
        let mut failure = Failure::here(Device::Cuda(0), 600 * MIB);
        failure.rounded = true;
        let mut figures = MemoryFigures::default();
        figures.allocated = 500 * MIB as i64;
        figures.reserved = reserved as i64;
        figures.cache_free = memlab_core::oom::CacheFree::new(524 * MIB, 24 * MIB);
        figures.device = Some(limited);
        let text = advice(&failure, &figures, Verdict::decide(600 * MIB, &figures), None);
        assert!(
            text.starts_with("cuda:0 has 512.00M free under the CUDA memory fraction and its cache 524.00M"),
            "{text}"
        );
        // Without a fraction (libtorch's total is the device's), nothing changes.
        let whole = DeviceMemory::new(82_741_248_000, device_total, None, None);
        assert_eq!(under_fraction(whole, reserved as i64, device_total), whole);
    }

    #[test]
    fn advice_names_the_figures_of_each_verdict() {
        let mut failure = Failure::here(Device::Cuda(0), 1 << 30);
        failure.rounded = true;
        let gib = 1u64 << 30;
        let mut figures = MemoryFigures::default();
        figures.cache_free = memlab_core::oom::CacheFree::new(3 * gib, 256 << 20);
        figures.device = Some(DeviceMemory::new(gib / 2, 80 * gib, Some(70 * gib), Some(9 * gib)));
        let frag = advice(&failure, &figures, Verdict::Fragmentation, None);
        assert!(frag.contains("3.00G free") && frag.contains("256.00M"), "{frag}");
        // Settings are the report's to advise, after its replay.
        assert!(!frag.contains("expandable_segments"), "{frag}");
        assert!(frag.contains("(2.75G of it, 92%"), "{frag}");
        let others = advice(&failure, &figures, Verdict::OtherProcesses, None);
        assert!(others.contains("Other processes hold 9.00G of cuda:0"), "{others}");
        let holders = Holders {
            named: vec![NamedHolder {
                name: "model.fc.weight".into(),
                kind: memlab_core::TensorKind::Parameter,
                bytes: 40 * gib,
            }],
            ..Holders::default()
        };
        let short = advice(&failure, &figures, Verdict::NotEnoughFree, Some(&holders));
        assert!(short.contains("The largest holders: model.fc.weight (parameter): 40.00G."), "{short}");
        // 0.5 GiB free on the device and 3 GiB in the cache: enough together, not apart.
        assert!(short.contains("in one piece") && short.contains("(3.00G in blocks of at most 256.00M)"), "{short}");
        failure.requested = 8 * gib;
        let more = advice(&failure, &figures, Verdict::NotEnoughFree, None);
        assert!(!more.contains("in one piece"), "{more}");
        failure.requested = 4 << 40;
        let huge = advice(&failure, &figures, Verdict::RequestExceedsDevice, None);
        assert!(huge.contains("(4.00T, 4398046511104 bytes: 1099511627776 float32 elements)"), "{huge}");
        assert!(huge.contains("all of cuda:0 (80.00G)"), "{huge}");
    }
}
