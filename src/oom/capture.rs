//! The facts of a failure, taken on the failing thread: the request and its
//! figures, the failing call's frames, what held the memory (named without
//! waiting for any lock), and the files, each part only where the memory
//! left covers it.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use memlab_core::events::{self, Backtrace, Frame, LiveAllocation};
use memlab_core::oom::Failure;
use memlab_core::Device;

use super::files::{fits, room};
use super::{FailingThread, Holders, LeftOut, NamedHolder, NamedRest, OomReport, SiteHolder};
use crate::attribution::{attribute, site_label};
use crate::diagnosis::diagnose;
use crate::named::{self, Model};

/// Holders listed by name and by site (each); the rest are added up.
const TOP_HOLDERS: usize = 20;
/// Frames shown under an unnamed site.
const SITE_FRAMES: usize = 6;

/// This process's part of every report's file name: the host's name and
/// the process's start, `host_YYYYMMDDTHHMMSS` (read once: the reports of
/// a process share it).
fn identity() -> &'static (String, Option<String>) {
    static IDENTITY: OnceLock<(String, Option<String>)> = OnceLock::new();
    IDENTITY.get_or_init(|| {
        let host = memlab_tch::host_name().unwrap_or_else(|| "host".to_string());
        (host, memlab_tch::process_start().map(|start| memlab_core::time::utc(start, 0)[..19].to_string()))
    })
}

/// Takes the facts of `failure` and writes the report's files in `dir`.
pub(super) fn capture(failure: &Failure, number: u64, dir: &Path) -> OomReport {
    // On the failing thread: its stack is the failing call's (memlab's
    // own frames are left out when resolved).
    let backtrace = failure.backtrace.clone().unwrap_or_else(|| Arc::new(Backtrace::capture()));
    let sources = Model::registered_now();
    let mut left_out = Vec::new();
    // Listing the unnamed allocations by site copies the live set.
    let live = events::stats().live as u64;
    let by_site = events::is_active().then(|| crate::capture::estimate::by_site(live));
    let available = room();
    let with_sites = match by_site {
        Some(needed) if !fits(needed, available) => {
            left_out.push(LeftOut {
                part: "the unnamed holders by site".to_string(),
                file: None,
                needed_estimate: needed,
                available: available.unwrap_or(0),
            });
            false
        }
        _ => true,
    };
    let holders = holders(failure.device, &sources, with_sites);
    let (diagnosis, missing) = diagnose(failure, Some(&holders));
    let (host, process_start) = identity().clone();
    let mut report = OomReport {
        number,
        pid: std::process::id(),
        host,
        process_start,
        time: memlab_core::time::utc_now(),
        time_unix_us: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64),
        run: crate::run::this_process(),
        thread: FailingThread { number: failure.thread, name: std::thread::current().name().map(str::to_string) },
        diagnosis,
        stream: failure.stream,
        statement: failure.statement.map(|s| s.to_string()),
        frames: backtrace.frames().to_vec(),
        holders,
        missing,
        missed_before: match failure.device {
            Device::Cuda(i) => memlab_tch::oom::ooms_before_watching(i),
            Device::Cpu => None,
        },
        reserve: failure.reserve,
        partial: !left_out.is_empty(),
        left_out,
        files: Vec::new(),
        file_errors: Vec::new(),
    };
    super::files::write(&mut report, dir, &sources);
    report
}

/// What holds `device`'s memory, named without waiting for any lock.
fn holders(device: Device, sources: &Model, with_sites: bool) -> Holders {
    let mut out = Holders::default();
    let Ok(stats) = memlab_tch::device_stats(device) else { return out };
    let named = match sources.collect() {
        Ok(named) => named,
        Err(e) => {
            out.busy.push(format!("the named tensors could not be walked: {e}"));
            named::Named::default()
        }
    };
    let live = (with_sites && events::is_active()).then(events::live);
    let account = attribute(device, &stats, &named, live.as_deref());
    out.named_bytes = account.named;
    out.not_named = account.allocated - account.named as i64;
    out.rounding = account.rounding;
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
        let frames_of = |site: &Option<String>| -> Vec<Frame> {
            live.iter()
                .filter(|a: &&LiveAllocation| a.device == device && &a.site() == site)
                .find_map(|a| a.backtrace.as_ref())
                .map(|b| b.frames().iter().take(SITE_FRAMES).cloned().collect())
                .unwrap_or_default()
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
