//! The facts of a failure, taken on the failing thread: the request and its
//! figures, the failing call's frames, what held the memory (named without
//! waiting for any lock), and the files, each part only where the memory
//! left covers it.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use memlab_core::events::{self, Backtrace, Frame};
use memlab_core::oom::Failure;
use memlab_core::Device;

use super::files::{fits, room};
use super::{FailingThread, LeftOut, OomReport};
use crate::diagnosis::{diagnose, holders};
use crate::named::WeakModel;

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

/// Takes the facts of `failure`, with the memory named after `model`, and
/// writes the report's files in `dir`.
pub(super) fn capture(failure: &Failure, number: u64, dir: &Path, model: &WeakModel) -> OomReport {
    // On the failing thread: its stack is the failing call's (memlab's
    // own frames are left out when resolved).
    let backtrace = failure.backtrace.clone().unwrap_or_else(|| Arc::new(Backtrace::capture()));
    let sources = model.now();
    let mut left_out = Vec::new();
    // Listing the unnamed allocations by site copies the live set.
    let live = events::stats().live as u64;
    let by_site = events::is_active().then(|| memlab_core::format::Cost::BY_SITE.of(0, live));
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
        replay: None,
        allocator_settings: None,
        settings_advice: None,
    };
    if let Device::Cuda(index) = failure.device {
        advise(&mut report, failure, index);
    }
    super::files::write(&mut report, dir, model, &sources);
    report
}

/// CUDA: the process's allocator settings, the recording's replay where
/// one runs, and what the report advises about the settings, decided after
/// the replay. No advice where the process's settings cannot be read (a
/// setting it has could be advised), or where a recording ran but its
/// replay could not (the advice would be labelled untested for want of a
/// recording that exists).
fn advise(report: &mut OomReport, failure: &Failure, index: usize) {
    use memlab_core::replay::AllocatorConfig;
    let (settings, _) = crate::capture::snapshot::cuda_allocators(index + 1);
    let process = settings.as_ref().and_then(|s| AllocatorConfig::from_snapshot(s).ok());
    report.allocator_settings = process.as_ref().map(AllocatorConfig::to_conf);
    let recording = events::is_active();
    let replayed = recording.then(|| replay(failure, index, report.diagnosis.figures.reserved)).flatten();
    let (Some(process), true) = (process, replayed.is_some() || !recording) else {
        report.replay = replayed.map(|r| r.replayed);
        return;
    };
    let d = &report.diagnosis;
    let advice = memlab_core::oom::advise_settings(
        d.verdict,
        d.figures.would_suffice_in_one_piece(failure.requested),
        &process,
        replayed.as_ref().map(|r| (&r.snapshot, &r.replayed)),
        &Device::Cuda(index).to_string(),
    );
    report.settings_advice = advice.map(|mut advice| {
        // The replay reads no frames: the site of an empty_cache's point is
        // read from the recording's own event, the one it replayed.
        if let (Some(r), memlab_core::oom::SettingsAdvice::NoSettingHelps { empty_cache: Some(point), .. }) =
            (&replayed, &mut advice)
        {
            point.site = r.events.get(point.entry).and_then(|e| {
                let frames = e.backtrace.as_ref().map(|b| b.frames().to_vec()).unwrap_or_default();
                frames.first().map(Frame::to_string).or_else(|| e.statement.map(|s| s.to_string()))
            });
        }
        advice
    });
    report.replay = replayed.map(|r| r.replayed);
}

/// A recording's replay at a failure: the history of the failing device
/// as a snapshot, its replay, and the recording's events it was made of
/// (entry for entry).
struct Replay {
    snapshot: memlab_core::export::Snapshot,
    replayed: memlab_core::replay::Replayed,
    events: Vec<memlab_core::events::Event>,
}

/// CUDA, while a recording runs: its history of device `index` replayed
/// under the settings people try, on the memory the allocator had when it
/// failed (the `reserved` bytes it held, and what the driver still had
/// free), so the report says which setting would have avoided the failure;
/// with the snapshot replayed. `None` where the figures it needs cannot be
/// read, or the model cannot replay them: the report then goes without the
/// answer.
fn replay(failure: &Failure, index: usize, reserved: i64) -> Option<Replay> {
    use crate::capture::snapshot::{cuda_allocators, entry, segment};
    use memlab_core::export::{Snapshot, SnapshotInfo, Stack};
    let device = Device::Cuda(index);
    let (mut history, stats) = events::history();
    history.retain(|e| e.device == device);
    // The replay reads no frames: every entry shares one empty stack.
    let none = Stack::default();
    let trace = history.iter().map(|e| entry(e, none.clone())).collect();
    let cuda_devices = memlab_tch::cuda_device_count();
    let mut device_traces = vec![Vec::new(); cuda_devices];
    *device_traces.get_mut(index)? = trace;
    // The segments held now, with their blocks: what the replay undoes the
    // history against, to rebuild what was held before it began.
    let segments = memlab_tch::segments::cuda_segments()
        .ok()?
        .iter()
        .filter(|s| s.device == index)
        .map(|s| segment(s, |_| none.clone()))
        .collect();
    let (allocator_settings, device_memory) = cuda_allocators(cuda_devices);
    let snapshot = Snapshot {
        segments,
        device_traces,
        allocator_settings,
        memlab: Some(SnapshotInfo {
            devices: (0..cuda_devices).map(|i| Device::Cuda(i).to_string()).collect(),
            partial: stats.dropped > 0,
            dropped: stats.dropped,
            recorded: stats.recorded,
            run: Some(crate::run::this_process()),
            device_memory,
            profile: None,
            ops: None,
            unseen_before: Vec::new(),
            prediction_inputs: None,
        }),
    };
    let options = memlab_core::replay::ReplayOptions {
        capacity: failure.device_free.map(|free| reserved.max(0) as u64 + free),
        compare: true,
        ..Default::default()
    };
    let replayed = memlab_core::replay::replay_snapshot("the recording", &snapshot, &options).ok()?;
    Some(Replay { snapshot, replayed, events: history })
}
