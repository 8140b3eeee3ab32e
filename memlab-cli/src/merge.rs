//! `memlab merge FILES… -o DIR`: the files of several processes (ranks) in
//! one Perfetto trace and one page. Snapshots, trace JSONs and out-of-memory
//! report JSONs are grouped by the process that wrote them (memlab's files
//! say which: `run`), or, for PyTorch's snapshots, by the rank in the file's
//! name (`snapshot_rank3.pickle`). Each file's times count from its own clock
//! zero; memlab's files give the wall-clock time of that zero
//! (`run.clock_zero_unix_us`) and PyTorch's times are wall-clock already, so
//! every event is placed on one axis by the wall clock, and `--offset
//! RANK=µs` corrects a rank whose host's clock is off.

use std::collections::BTreeMap;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use memlab_core::export::{
    InstantScope, Phase, Snapshot, SnapshotFile, TraceArgs, TraceEvent, TraceFile, TraceInfo, TraceWriter,
};
use memlab_core::format;
use memlab_core::oom::{OomReport, Verdict};
use memlab_core::render::{Cell, Column, Document, Layout, Mark, Point, Render, Scale, Table, Timeline};
use memlab_core::run::RunInfo;
use serde::Serialize;

use crate::analysis::{self, Offer, Start, Stretches, Summary};

/// The most points a device's timeline on the page has.
const PAGE_POINTS: usize = 400;
/// The most counter samples a snapshot's device gives the merged trace.
const TRACE_POINTS: usize = 10_000;
/// Rows of the table of what differs between ranks at their peaks.
const DIFFERENCE_ROWS: usize = 40;
/// The latest time a run can have: 3000-01-01, in microseconds since the
/// Unix epoch. Every time a file gives (its clock zero, a time after it, a
/// wall-clock time) and every `--offset` lies within this many microseconds
/// of zero, or the file is refused: sums of a few such times never leave
/// `i64`, so no time of one file can wrap another's.
pub const LATEST_US: i64 = 32_503_680_000_000_000;

/// Where the merged files go, and the clock corrections.
pub struct Options {
    /// The directory of `merged_trace.json` and `merged.html`.
    pub out: PathBuf,
    /// Microseconds added to every time of a rank.
    pub offsets: BTreeMap<u32, i64>,
}

/// The merge: one row per process and device, the failures, and where the
/// files went. `--json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct Merged {
    /// The wall-clock time of the merged axis's zero (the earliest event of
    /// any file), in microseconds since the Unix epoch.
    pub origin_unix_us: i64,
    /// One per process, in rank order.
    pub ranks: Vec<RankRow>,
    /// Every out-of-memory failure, earliest first.
    pub ooms: Vec<OomRow>,
    /// What looked wrong in the files without stopping the merge (two
    /// processes that claim one rank), each a sentence.
    pub warnings: Vec<String>,
    /// The merged trace (ui.perfetto.dev).
    pub trace: String,
    /// The page.
    pub page: String,
}

/// One process of the run.
#[derive(Clone, Debug, Serialize)]
pub struct RankRow {
    /// Its rank, where known.
    pub rank: Option<u32>,
    /// `rank 1 (host, cuda:0)`: its process's name in the merged trace.
    pub label: String,
    /// What memlab's files say of it (none for PyTorch's snapshots).
    pub run: Option<RunInfo>,
    /// Its files.
    pub files: Vec<String>,
    /// The correction given with `--offset`, in microseconds.
    pub offset_us: i64,
    /// Its devices' peaks.
    pub devices: Vec<DevicePeak>,
}

/// A device's peak in one process.
#[derive(Clone, Debug, Serialize)]
pub struct DevicePeak {
    /// `cuda:0`, `cpu`.
    pub device: String,
    /// The device's UUID, where the file gives it.
    pub uuid: Option<String>,
    /// The allocated peak, as tensors asked for their bytes.
    pub allocated: u64,
    /// The reserved peak, where the device reserves and the file says.
    pub reserved: Option<u64>,
    /// When the allocated peak was, in microseconds on the merged axis.
    pub at_us: i64,
    /// Whether it is the highest allocated peak of its kind of device (CUDA
    /// or CPU) over all processes.
    pub highest: bool,
    /// What it was read from: `snapshot`, `trace` (the counters), or
    /// `out-of-memory report` (the figures when the request failed).
    pub source: &'static str,
}

/// An out-of-memory failure of one process.
#[derive(Clone, Debug, Serialize)]
pub struct OomRow {
    /// The process's row in [`Merged::ranks`].
    pub process: usize,
    /// The process's rank, where known.
    pub rank: Option<u32>,
    /// The process, as the table names it.
    pub label: String,
    /// The device.
    pub device: String,
    /// Bytes asked for.
    pub requested: u64,
    /// Why it failed, where a report says.
    pub verdict: Option<Verdict>,
    /// Where it failed, where a report says: the profiled statement that
    /// was running, else the innermost frame of the program's own code
    /// (`function (file:line)`).
    pub statement: Option<String>,
    /// When, in microseconds on the merged axis.
    pub at_us: i64,
    /// The file that told.
    pub file: String,
}

/// A file read.
enum Input {
    Snapshot(Box<SnapshotFile>),
    Trace(Box<TraceFile>),
    Oom(Box<OomReport>),
}

/// What one process's files hold, once read.
struct Part {
    rank: Option<u32>,
    run: Option<RunInfo>,
    files: Vec<String>,
    offset_us: i64,
    /// Per device: its summary and the wall-clock base of its times.
    snapshot: Option<(Summary, Vec<Levels>)>,
    /// The trace.
    trace: Option<TraceFile>,
    /// Out-of-memory reports, with their file.
    ooms: Vec<(String, OomReport)>,
    /// Its name in the table and the trace, once every file is read.
    label: String,
}

/// One device's allocated (and reserved) bytes over time, at most a given
/// number of points, each the highest of its stretch of events.
struct Levels {
    device: String,
    /// (time as the file gives it, allocated, reserved).
    points: Vec<(i64, u64, Option<u64>)>,
}

impl Part {
    /// Microseconds to add to a time of `file_time` kind to put it on the
    /// wall clock: memlab's files count from their clock zero.
    fn base_us(&self) -> i64 {
        // Both within LATEST_US (`check_run`, `parse_offset`).
        self.run.as_ref().map_or(0, |r| r.clock_zero_unix_us as i64) + self.offset_us
    }

    /// `rank 1 (host, cuda:0)`, naming the devices the files have data of.
    fn name(&self) -> String {
        match (&self.run, self.rank) {
            (Some(run), _) => {
                let mut used: Vec<String> = Vec::new();
                if let Some((summary, _)) = &self.snapshot {
                    used.extend(summary.devices.iter().filter(|d| d.events > 0).map(|d| d.device.clone()));
                }
                if let Some(trace) = &self.trace {
                    used.extend(trace_levels(&trace.events).into_iter().map(|l| l.device));
                }
                used.sort();
                used.dedup();
                run.label_with(&used.iter().map(String::as_str).collect::<Vec<_>>())
            }
            (None, Some(rank)) => format!("rank {rank}"),
            (None, None) => format!("process of {}", self.files[0]),
        }
    }
}

/// Reads `files` and writes the merged trace and page into `options.out`.
pub fn merge(files: &[String], options: &Options) -> Result<Merged, String> {
    if files.is_empty() {
        return Err(
            "nothing to merge: give the snapshots, trace JSONs and out-of-memory report JSONs of the ranks".into()
        );
    }
    let mut parts: Vec<Part> = Vec::new();
    for path in files {
        let input = read(path)?;
        let run = match &input {
            Input::Snapshot(file) => {
                check_snapshot(&file.snapshot, path)?;
                check_run(file.snapshot.memlab.as_ref().and_then(|m| m.run.clone()), path, "memlab.run")?
            }
            Input::Trace(trace) => check_run(trace.info.run.clone(), path, "otherData.run")?,
            Input::Oom(report) => {
                check_oom(report, path)?;
                check_run(Some(report.run.clone()), path, "run")?
            }
        };
        let rank = run.as_ref().and_then(|r| r.rank).or_else(|| rank_in_name(path));
        // One part per process: memlab's files by host, pid and the start of
        // the process's clock (two containers' processes may both be pid 1
        // on hosts of one name), the others by rank.
        let same = |p: &Part| match (&p.run, &run) {
            (Some(a), Some(b)) => {
                a.host == b.host
                    && a.pid == b.pid
                    && a.rank == b.rank
                    && a.clock_zero_unix_us == b.clock_zero_unix_us
                    && a.process_start == b.process_start
            }
            (None, None) => rank.is_some() && p.rank == rank,
            _ => false,
        };
        let at = match parts.iter().position(same) {
            Some(at) => at,
            None => {
                let offset_us = rank.and_then(|r| options.offsets.get(&r).copied()).unwrap_or(0);
                parts.push(Part {
                    rank,
                    run,
                    files: Vec::new(),
                    offset_us,
                    snapshot: None,
                    trace: None,
                    ooms: Vec::new(),
                    label: String::new(),
                });
                parts.len() - 1
            }
        };
        let part = &mut parts[at];
        part.files.push(path.clone());
        // A process may leave several of a kind (an out-of-memory report's
        // snapshot beside the final export): the longest history is kept.
        match input {
            Input::Snapshot(file) => {
                let summary = Summary::of(path, &file);
                let events = |s: &Summary| s.devices.iter().map(|d| d.events).sum::<u64>();
                if part.snapshot.as_ref().is_none_or(|(kept, _)| events(&summary) > events(kept)) {
                    let levels = snapshot_levels(&file.snapshot, TRACE_POINTS);
                    part.snapshot = Some((summary, levels));
                }
            }
            Input::Trace(trace) => {
                check_events(&trace.events, path)?;
                if part.trace.as_ref().is_none_or(|kept| trace.events.len() > kept.events.len()) {
                    part.trace = Some(*trace);
                }
            }
            Input::Oom(report) => part.ooms.push((path.clone(), *report)),
        }
    }
    for rank in options.offsets.keys() {
        if !parts.iter().any(|p| p.rank == Some(*rank)) {
            return Err(format!("--offset {rank}=…: no file is of rank {rank}"));
        }
    }
    parts.sort_by_key(|p| (p.rank.is_none(), p.rank, p.files[0].clone()));
    let origin = parts.iter().filter_map(first_us).min().unwrap_or(0);
    let warnings = name_parts(&mut parts, origin);
    let mut ranks: Vec<RankRow> = parts.iter().map(|p| rank_row(p, origin)).collect();
    mark_highest(&mut ranks);
    let mut ooms: Vec<OomRow> = parts.iter().enumerate().flat_map(|(i, p)| oom_rows(i, p, origin)).collect();
    ooms.sort_by_key(|o| o.at_us);

    std::fs::create_dir_all(&options.out)
        .map_err(|e| format!("cannot make the directory {}: {e}", options.out.display()))?;
    let trace_path = options.out.join("merged_trace.json");
    write_trace(&trace_path, &parts, origin).map_err(|e| format!("cannot write {}: {e}", trace_path.display()))?;
    let page_path = options.out.join("merged.html");
    let merged = Merged {
        origin_unix_us: origin,
        ranks,
        ooms,
        warnings,
        trace: trace_path.to_string_lossy().into_owned(),
        page: page_path.to_string_lossy().into_owned(),
    };
    let page = Page { merged: &merged, parts: &parts }.document().to_page("memlab merge");
    std::fs::write(&page_path, page).map_err(|e| format!("cannot write {}: {e}", page_path.display()))?;
    Ok(merged)
}

/// Parses `RANK=MICROSECONDS`.
pub fn parse_offset(text: &str) -> Result<(u32, i64), String> {
    let (rank, us) =
        text.split_once('=').ok_or_else(|| format!("--offset {text}: write RANK=MICROSECONDS, e.g. 1=-2500"))?;
    let rank = rank.trim().parse().map_err(|_| format!("--offset {text}: {rank:?} is not a rank (0, 1, …)"))?;
    let us: i64 = us.trim().parse().map_err(|_| format!("--offset {text}: {us:?} is not a number of microseconds"))?;
    if us.unsigned_abs() > LATEST_US as u64 {
        return Err(format!(
            "--offset {text}: a clock off by more than a thousand years is no clock a run has; give the \
             microseconds by which the rank's host's clock is off (e.g. 1=-2500)"
        ));
    }
    Ok((rank, us))
}

/// Refuses a trace whose times are not times a run can have (see
/// [`LATEST_US`]), naming the file and the event.
fn check_events(events: &[TraceEvent], path: &str) -> Result<(), String> {
    for (i, e) in events.iter().enumerate() {
        match e.ts {
            None => {}
            Some(ts) if ts.abs() <= LATEST_US as f64 => {}
            Some(ts) => {
                return Err(format!(
                    "cannot read {path}: event {i} of its `traceEvents` has `ts` {}, not a time a run can have \
                     (microseconds after the recording's clock zero)",
                    serde_json::Value::from(ts)
                ))
            }
        }
    }
    Ok(())
}

/// Refuses a clock zero that is not a time a run can have.
fn check_run(run: Option<RunInfo>, path: &str, field: &str) -> Result<Option<RunInfo>, String> {
    match run {
        Some(r) if r.clock_zero_unix_us > LATEST_US as u64 => Err(format!(
            "cannot read {path}: its `{field}.clock_zero_unix_us` is {}, not a time a run can have (microseconds \
             since 1970, before the year 3000); give the file memlab wrote, unchanged",
            r.clock_zero_unix_us
        )),
        run => Ok(run),
    }
}

/// Refuses a snapshot whose history holds a time a run cannot have.
fn check_snapshot(s: &Snapshot, path: &str) -> Result<(), String> {
    let names = s.devices();
    for (device, trace) in s.device_traces.iter().enumerate() {
        if let Some((i, e)) = trace.iter().enumerate().find(|(_, e)| e.time_us > LATEST_US as u64) {
            return Err(format!(
                "cannot read {path}: entry {i} of {}'s history has the time {} µs, not a time a run can have",
                names.get(device).map_or("a device", String::as_str),
                e.time_us
            ));
        }
    }
    Ok(())
}

/// Refuses an out-of-memory report whose time is not a time a run can have.
fn check_oom(report: &OomReport, path: &str) -> Result<(), String> {
    match report.time_unix_us {
        t if t <= LATEST_US as u64 => Ok(()),
        t => Err(format!(
            "cannot read {path}: its `time_unix_us` is {t}, not a time a run can have (microseconds since 1970, \
             before the year 3000)"
        )),
    }
}

/// When `report`'s request failed, in microseconds since the Unix epoch
/// (within [`LATEST_US`]: `check_oom`).
fn oom_us(report: &OomReport) -> i64 {
    report.time_unix_us as i64
}

/// Names every part (`rank 1 (host, cuda:0)`), telling apart processes
/// whose names would be the same (two that claim one rank on one host) by
/// their pid, and where that is the same too (two containers), by when
/// their clock started on the merged axis. Returns a warning for each rank
/// claimed by several processes.
fn name_parts(parts: &mut [Part], origin: i64) -> Vec<String> {
    for p in parts.iter_mut() {
        p.label = p.name();
    }
    let mut warnings = Vec::new();
    let mut claimed: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, p) in parts.iter().enumerate() {
        if let (Some(rank), Some(_)) = (p.rank, &p.run) {
            claimed.entry(rank).or_default().push(i);
        }
    }
    for (rank, claims) in claimed.into_iter().filter(|(_, c)| c.len() > 1) {
        let who: Vec<String> = claims
            .iter()
            .filter_map(|&i| parts[i].run.as_ref())
            .map(|r| format!("pid {} on {}", r.pid, r.host.as_deref().unwrap_or("an unnamed host")))
            .collect();
        warnings.push(format!(
            "{} processes claim rank {rank} ({}): each is named by its pid below; give every process of the run a \
             rank of its own (MEMLAB_RANK, RANK, …)",
            claims.len(),
            who.join(", ")
        ));
    }
    let twins = |parts: &mut [Part], more: &dyn Fn(&Part) -> String| {
        let labels: Vec<String> = parts.iter().map(|p| p.label.clone()).collect();
        for (i, p) in parts.iter_mut().enumerate() {
            if labels.iter().filter(|l| **l == labels[i]).count() > 1 {
                let extra = more(p);
                p.label = match p.label.strip_suffix(')') {
                    Some(open) => format!("{open}, {extra})"),
                    None => format!("{} ({extra})", p.label),
                };
            }
        }
    };
    twins(parts, &|p| p.run.as_ref().map_or_else(|| p.files[0].clone(), |r| format!("pid {}", r.pid)));
    twins(parts, &|p| format!("clock from {}", seconds(p.base_us() - origin)));
    warnings
}

fn read(path: &str) -> Result<Input, String> {
    let (format, contents) = format::read(path).map_err(|e| e.to_string())?;
    let contents = match contents.downcast::<SnapshotFile>() {
        Ok(snapshot) => return Ok(Input::Snapshot(Box::new(snapshot))),
        Err(other) => other,
    };
    let contents = match contents.downcast::<TraceFile>() {
        Ok(trace) => return Ok(Input::Trace(Box::new(trace))),
        Err(other) => other,
    };
    match contents.downcast::<OomReport>() {
        Ok(report) => Ok(Input::Oom(Box::new(report))),
        Err(_) => Err(format!(
            "cannot merge {path}: it is {}; give the ranks' snapshots, trace JSONs and out-of-memory report JSONs",
            format.description()
        )),
    }
}

/// The rank a file's name gives: the digits after its last `rank`
/// (`snapshot_rank3.pickle`, `rank-3.json`).
fn rank_in_name(path: &str) -> Option<u32> {
    let name = Path::new(path).file_name()?.to_str()?.to_ascii_lowercase();
    let after = &name[name.rfind("rank")? + 4..];
    let digits: String = after.trim_start_matches(['_', '-', '=']).chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Each device's allocated and reserved bytes over a snapshot's history,
/// at most `points` points per device (each the highest of its stretch).
fn snapshot_levels(s: &Snapshot, points: usize) -> Vec<Levels> {
    let names = s.devices();
    let mut out = Vec::new();
    for (index, device) in names.iter().enumerate() {
        let start = Start::of(s, index);
        if start.trace.is_empty() {
            continue;
        }
        let mut live = start.live.clone();
        let mut allocated: u64 = live.values().map(|(size, _)| size).sum();
        let mut reserved = analysis::reserved_before(s, index, start.trace);
        let reserves = device.starts_with("cuda");
        // Per stretch: the moment allocated peaked, with the stretch's highest reserved.
        let mut stretches: Stretches<(i64, u64, Option<u64>)> = Stretches::new(start.trace.len(), points);
        for (i, e) in start.trace.iter().enumerate() {
            analysis::apply(e, i, start.release, &mut live, &mut allocated, &mut reserved);
            let r = reserves.then(|| u64::try_from(reserved).unwrap_or(0));
            match stretches.offer(i, i128::from(allocated), || (0, 0, None)) {
                Offer::Highest(last) => *last = (e.time_us as i64, allocated, r.max(last.2)),
                Offer::Lower(last) => last.2 = r.max(last.2),
            }
        }
        out.push(Levels { device: device.clone(), points: stretches.points() });
    }
    out
}

/// A trace's counter samples of one device (`cuda:0 memory`) as levels.
fn trace_levels(events: &[TraceEvent]) -> Vec<Levels> {
    let mut by_device: BTreeMap<String, Vec<(i64, u64, Option<u64>)>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.ph == Phase::Counter) {
        let Some(device) = e.name.strip_suffix(" memory") else { continue };
        let bytes = |n: Option<i64>| n.and_then(|n| u64::try_from(n).ok());
        let (Some(ts), Some(allocated)) = (e.ts, bytes(e.args.allocated)) else { continue };
        by_device.entry(device.to_string()).or_default().push((ts as i64, allocated, bytes(e.args.reserved)));
    }
    by_device.into_iter().map(|(device, points)| Levels { device, points }).collect()
}

/// The earliest wall-clock time a part's files give.
fn first_us(p: &Part) -> Option<i64> {
    let base = p.base_us();
    let from_snapshot = p
        .snapshot
        .iter()
        .flat_map(|(s, _)| &s.devices)
        .filter(|d| d.events > 0)
        .map(|d| base + d.first_us as i64)
        .min();
    let from_trace = p.trace.as_ref().and_then(|trace| {
        trace.events.iter().filter(|e| e.ph != Phase::Metadata).filter_map(|e| e.ts).map(|ts| base + ts as i64).min()
    });
    let from_ooms = p.ooms.iter().map(|(_, report)| oom_us(report) + p.offset_us).min();
    [from_snapshot, from_trace, from_ooms].into_iter().flatten().min()
}

fn rank_row(p: &Part, origin: i64) -> RankRow {
    let base = p.base_us();
    let uuid = |device: &str| {
        p.run.as_ref().and_then(|r| r.devices.iter().find(|d| d.device == device).and_then(|d| d.uuid.clone()))
    };
    let mut devices: Vec<DevicePeak> = Vec::new();
    if let Some((summary, _)) = &p.snapshot {
        for d in summary.devices.iter().filter(|d| d.events > 0) {
            devices.push(DevicePeak {
                device: d.device.clone(),
                uuid: uuid(&d.device),
                allocated: d.peak.allocated,
                reserved: d.reserved_peak.map(|m| m.reserved.unwrap_or(0)),
                at_us: base + (d.first_us + d.peak.time_us) as i64 - origin,
                highest: false,
                source: "snapshot",
            });
        }
    }
    if let Some(trace) = &p.trace {
        for levels in trace_levels(&trace.events) {
            if devices.iter().any(|d| d.device == levels.device) {
                continue;
            }
            let Some(&(ts, allocated, _)) = levels.points.iter().max_by_key(|(ts, a, _)| (*a, std::cmp::Reverse(*ts)))
            else {
                continue;
            };
            // Counters that never left zero: nothing was recorded there.
            if allocated == 0 && levels.points.iter().all(|(_, _, r)| r.unwrap_or(0) == 0) {
                continue;
            }
            devices.push(DevicePeak {
                device: levels.device.clone(),
                uuid: uuid(&levels.device),
                allocated,
                reserved: levels.points.iter().filter_map(|(_, _, r)| *r).max(),
                at_us: base + ts - origin,
                highest: false,
                source: "trace",
            });
        }
    }
    for (_, report) in &p.ooms {
        let d = &report.diagnosis;
        let device = d.device.to_string();
        if devices.iter().any(|x| x.device == device) {
            continue;
        }
        devices.push(DevicePeak {
            uuid: uuid(&device),
            allocated: u64::try_from(d.figures.allocated).unwrap_or(0),
            reserved: u64::try_from(d.figures.reserved)
                .ok()
                .filter(|_| matches!(d.device, memlab_core::Device::Cuda(_))),
            device,
            at_us: oom_us(report) + p.offset_us - origin,
            highest: false,
            source: "out-of-memory report",
        });
    }
    devices.sort_by(|a, b| a.device.cmp(&b.device));
    RankRow {
        rank: p.rank,
        label: p.label.clone(),
        run: p.run.clone(),
        files: p.files.clone(),
        offset_us: p.offset_us,
        devices,
    }
}

/// Marks the highest allocated peak among CUDA devices, and among CPUs,
/// where one is lower (equal peaks have no highest).
fn mark_highest(ranks: &mut [RankRow]) {
    for cuda in [true, false] {
        let kind = |d: &DevicePeak| d.device.starts_with("cuda") == cuda;
        let top = ranks.iter().flat_map(|r| &r.devices).filter(|d| kind(d)).map(|d| d.allocated).max();
        let Some(top) = top.filter(|t| *t > 0) else { continue };
        if !ranks.iter().flat_map(|r| &r.devices).any(|d| kind(d) && d.allocated < top) {
            continue;
        }
        for d in ranks.iter_mut().flat_map(|r| &mut r.devices).filter(|d| kind(d) && d.allocated == top) {
            d.highest = true;
        }
    }
}

fn oom_rows(process: usize, p: &Part, origin: i64) -> Vec<OomRow> {
    let mut rows: Vec<OomRow> = p
        .ooms
        .iter()
        .map(|(file, report)| {
            let d = &report.diagnosis;
            OomRow {
                process,
                rank: p.rank,
                label: p.label.clone(),
                device: d.device.to_string(),
                requested: d.requested,
                verdict: Some(d.verdict),
                statement: report.statement.clone().or_else(|| {
                    let f = report.frames.first()?;
                    Some(format!("{} ({}:{})", f.function, analysis::short_path(&f.file), f.line))
                }),
                at_us: oom_us(report) + p.offset_us - origin,
                file: file.clone(),
            }
        })
        .collect();
    // Failures only a snapshot tells of (PyTorch's, or memlab's without a report).
    if rows.is_empty() {
        if let Some((summary, _)) = &p.snapshot {
            for d in &summary.devices {
                for o in &d.ooms {
                    rows.push(OomRow {
                        process,
                        rank: p.rank,
                        label: p.label.clone(),
                        device: d.device.clone(),
                        requested: o.requested,
                        verdict: None,
                        statement: None,
                        at_us: p.base_us() + (d.first_us + o.time_us) as i64 - origin,
                        file: summary.file.clone(),
                    });
                }
            }
        }
    }
    rows
}

/// Writes the merged trace: each part a process, its times moved onto the
/// merged axis.
fn write_trace(path: &Path, parts: &[Part], origin: i64) -> std::io::Result<()> {
    let info = TraceInfo {
        producer: "memlab merge".into(),
        partial: parts.iter().any(|p| p.trace.as_ref().is_some_and(|t| t.info.partial)),
        run: None,
        origin_unix_us: Some(origin),
    };
    let mut w = TraceWriter::start(BufWriter::new(std::fs::File::create(path)?), &info)?;
    for (index, p) in parts.iter().enumerate() {
        let pid = index as u64 + 1;
        let shift = p.base_us() - origin;
        let in_process = |mut e: TraceEvent<'static>| {
            e.pid = pid;
            e
        };
        let args = |name: Option<String>, sort_index: Option<u64>| TraceArgs {
            name: name.map(Into::into),
            sort_index,
            ..TraceArgs::default()
        };
        w.event(&in_process(TraceEvent::new(Phase::Metadata, "process_name").with(args(Some(p.label.clone()), None))))?;
        w.event(&in_process(
            TraceEvent::new(Phase::Metadata, "process_sort_index").with(args(None, Some(index as u64))),
        ))?;
        let traced: Vec<String> = match &p.trace {
            Some(trace) => {
                for e in &trace.events {
                    if e.ph == Phase::Metadata && e.name == "process_name" {
                        continue;
                    }
                    let mut e = in_process(e.clone());
                    e.ts = e.ts.map(|ts| ts + shift as f64);
                    w.event(&e)?;
                }
                trace_levels(&trace.events).into_iter().map(|l| l.device).collect()
            }
            None => Vec::new(),
        };
        // A device only the snapshot tells of: its levels as counters.
        if let Some((_, levels)) = &p.snapshot {
            for l in levels.iter().filter(|l| !traced.contains(&l.device)) {
                let name = format!("{} memory (snapshot: the highest of each stretch of events)", l.device);
                for &(ts, allocated, reserved) in &l.points {
                    let args = TraceArgs {
                        allocated: i64::try_from(allocated).ok(),
                        reserved: reserved.and_then(|r| i64::try_from(r).ok()),
                        ..TraceArgs::default()
                    };
                    let e = TraceEvent::new(Phase::Counter, name.clone()).at((ts + shift) as f64).with(args);
                    w.event(&in_process(e))?;
                }
            }
        }
        for (_, report) in &p.ooms {
            let d = &report.diagnosis;
            let name =
                format!("out of memory on {}: {} asked ({})", d.device, Cell::bytes(d.requested), d.verdict.as_str());
            let ts = oom_us(report) + p.offset_us - origin;
            let args =
                TraceArgs { statement: report.statement.clone(), verdict: Some(d.verdict), ..TraceArgs::default() };
            let mut e = in_process(TraceEvent::new(Phase::Instant, name).at(ts as f64).with(args));
            e.s = Some(InstantScope::Process);
            w.event(&e)?;
        }
    }
    w.finish().map(drop)
}

/// Seconds on the merged axis.
fn seconds(us: i64) -> String {
    format!("{:+.3} s", us as f64 / 1e6)
}

/// The table of peaks and the lines of the failures: the page's first
/// parts, and what the command prints.
fn peaks_and_failures(doc: &mut Document, m: &Merged) {
    for warning in &m.warnings {
        doc.caution(format!("Warning: {warning}."));
    }
    doc.part("Peaks").note(
        "Per process and device: the allocated peak (as tensors asked for their bytes), the reserved peak, and \
         when; the highest allocated peak of the CUDA devices and of the CPUs is marked.",
    );
    let mut table = Table::new(vec![
        Column::new("process", Layout::Text),
        Column::new("device", Layout::Text),
        Column::new("peak allocated", Layout::Figure),
        Column::new("peak reserved", Layout::Figure),
        Column::new("when", Layout::Figure),
        Column::new("", Layout::Text),
        Column::new("from", Layout::Text),
    ]);
    for (process, r) in m.ranks.iter().enumerate() {
        for d in &r.devices {
            let failed = m.ooms.iter().any(|o| o.process == process && o.device == d.device);
            let mut marks: Vec<&str> = Vec::new();
            if d.highest {
                marks.push("highest");
            }
            if failed {
                marks.push("out of memory");
            }
            table.row([
                Cell::text(&r.label),
                Cell::text(&d.device),
                Cell::bytes(d.allocated),
                d.reserved.map_or_else(|| Cell::text(""), Cell::bytes),
                Cell::text(seconds(d.at_us)),
                Cell::text(marks.join(", ")),
                Cell::text(d.source),
            ]);
        }
    }
    doc.table(table);

    doc.part("Out of memory");
    if m.ooms.is_empty() {
        doc.line("No process ran out of memory.");
    }
    for o in &m.ooms {
        let verdict = o.verdict.map(|v| format!("; verdict: {}", v.as_str().replace('_', " "))).unwrap_or_default();
        let statement = o.statement.as_deref().map(|s| format!("; at {s}")).unwrap_or_default();
        doc.line(format!(
            "{} ran out of memory on {} at {}: {} asked{verdict}{statement}.",
            o.label,
            o.device,
            seconds(o.at_us),
            Cell::bytes(o.requested)
        ));
    }
}

/// What `memlab merge` prints: the peaks, the failures, where the files went.
impl Render for Merged {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.title(format!("memlab merge: {} processes", self.ranks.len()));
        peaks_and_failures(&mut doc, self);
        doc.blank();
        doc.line(format!("wrote {} (open it in ui.perfetto.dev) and {}", self.trace, self.page));
        doc
    }
}

/// The page: the table of peaks, the failures, each process's memory over
/// time on one axis, and what differed at the peaks.
struct Page<'a> {
    merged: &'a Merged,
    parts: &'a [Part],
}

impl Render for Page<'_> {
    fn document(&self) -> Document {
        let m = self.merged;
        let mut doc = Document::new();
        doc.title(format!("memlab merge: {} processes", m.ranks.len()));
        doc.line(
            "Times are seconds on one axis: each file's clock zero placed by the wall clock its process recorded \
             (PyTorch's snapshots are on the wall clock already), from the earliest event of any file.",
        );
        let offsets: Vec<String> =
            m.ranks.iter().filter(|r| r.offset_us != 0).map(|r| format!("{}: {:+} µs", r.label, r.offset_us)).collect();
        if !offsets.is_empty() {
            doc.line(format!("Corrected with --offset: {}.", offsets.join("; ")));
        }

        peaks_and_failures(&mut doc, m);

        // Every process's timeline on one scale, each failure marked where
        // it happened; the axis covers the failures too.
        let mut timelines: Vec<(String, Timeline)> = Vec::new();
        for (process, (p, r)) in self.parts.iter().zip(&m.ranks).enumerate() {
            let base = p.base_us() - m.origin_unix_us;
            let mut levels: Vec<Levels> =
                p.snapshot.as_ref().map(|(_, l)| l.iter().map(copy).collect()).unwrap_or_default();
            if let Some(trace) = &p.trace {
                for l in trace_levels(&trace.events) {
                    if !levels.iter().any(|x| x.device == l.device) {
                        levels.push(l);
                    }
                }
            }
            // Only the table's devices: nothing recorded, nothing drawn.
            levels.retain(|l| r.devices.iter().any(|d| d.device == l.device));
            let ooms: Vec<&OomRow> = m.ooms.iter().filter(|o| o.process == process).collect();
            // A device only a failure's report tells of: its figures then.
            let reported: Vec<Levels> = r
                .devices
                .iter()
                .filter(|d| !levels.iter().any(|l| l.device == d.device))
                .map(|d| Levels { device: d.device.clone(), points: vec![(d.at_us - base, d.allocated, d.reserved)] })
                .collect();
            levels.extend(reported);
            for l in levels {
                let stretch = l.points.len().div_ceil(PAGE_POINTS).max(1);
                let points: Vec<Point> = l
                    .points
                    .chunks(stretch)
                    .map(|c| {
                        let top = c.iter().max_by_key(|(_, a, _)| *a).expect("a chunk is not empty");
                        Point {
                            time_us: (base + top.0) as f64,
                            allocated: top.1 as i64,
                            layers: vec![top.1 as i64],
                            event: None,
                        }
                    })
                    .collect();
                // The first point at the highest level, as the table's peak.
                let peak =
                    points.iter().rev().max_by_key(|p| p.allocated).map_or((0, 0.0), |p| (p.allocated, p.time_us));
                let marks: Vec<Mark> = ooms
                    .iter()
                    .filter(|o| o.device == l.device)
                    .map(|o| Mark {
                        time_us: o.at_us as f64,
                        event: None,
                        label: format!("out of memory: {} asked", Cell::bytes(o.requested)),
                    })
                    .collect();
                let label = format!("{}: {}", r.label, l.device);
                let timeline = Timeline {
                    label: format!("memory over time of {label}"),
                    layers: vec!["allocated".into()],
                    points,
                    peak_time_us: peak.1,
                    peak_event: None,
                    peak_bytes: peak.0,
                    partial: false,
                    scale: None,
                    marks,
                };
                timelines.push((label, timeline));
            }
        }
        let last = timelines
            .iter()
            .flat_map(|(_, t)| t.points.last().map(|p| p.time_us).into_iter().chain(t.marks.iter().map(|m| m.time_us)))
            .fold(0.0, f64::max);
        let top = timelines.iter().map(|(_, t)| t.peak_bytes).max().unwrap_or(0);
        // A device whose peak is under a thousandth of the scale's top
        // would be a flat line: named, not drawn, unless it failed.
        let (drawn, small): (Vec<_>, Vec<_>) =
            timelines.into_iter().partition(|(_, t)| !t.marks.is_empty() || t.peak_bytes.saturating_mul(1000) >= top);
        doc.part("Memory over time").note(
            "Each process's allocated bytes on one time axis and one scale (each point the highest of its stretch \
             of events), every failure marked where it happened; hover for the figures.",
        );
        if !small.is_empty() {
            let names: Vec<String> =
                small.iter().map(|(label, t)| format!("{label} (peak {})", Cell::bytes(t.peak_bytes))).collect();
            doc.line(format!(
                "Not drawn, under a thousandth of the scale's {}: {}.",
                Cell::bytes(top),
                names.join("; ")
            ));
        }
        for (label, timeline) in drawn {
            doc.heading(label);
            doc.timeline(Timeline {
                scale: Some(Scale { from_us: 0.0, to_us: last.max(1.0), top_bytes: top }),
                ..timeline
            });
        }

        differences(&mut doc, self.parts, &m.ranks);
        doc
    }
}

fn copy(l: &Levels) -> Levels {
    Levels { device: l.device.clone(), points: l.points.clone() }
}

/// What was live at each process's peak, by category and by site, the rows
/// that differ most between processes first (snapshots only: traces carry
/// no sites).
fn differences(doc: &mut Document, parts: &[Part], ranks: &[RankRow]) {
    let with: Vec<(&RankRow, &Summary)> =
        parts.iter().zip(ranks).filter_map(|(p, r)| p.snapshot.as_ref().map(|(s, _)| (r, s))).collect();
    doc.part("What differed at the peaks");
    if with.len() < 2 {
        doc.line("Needs the snapshots of two processes or more: traces and reports do not say what was live by site.");
        return;
    }
    // Each process's devices by kind and order: rank 0's cuda:0 pairs with
    // rank 1's cuda:1 when each trained on its own GPU.
    let own: Vec<Vec<(Slot, &analysis::DeviceSummary)>> = with
        .iter()
        .map(|(_, s)| {
            let mut used: Vec<&analysis::DeviceSummary> = s.devices.iter().filter(|d| d.events > 0).collect();
            used.sort_by_key(|d| slot_order(&d.device));
            let mut seen: BTreeMap<bool, usize> = BTreeMap::new();
            used.into_iter()
                .map(|d| {
                    let cuda = d.device.starts_with("cuda");
                    let n = seen.entry(cuda).or_default();
                    *n += 1;
                    (Slot { cpu: !cuda, nth: *n - 1 }, d)
                })
                .collect()
        })
        .collect();
    let mut slots: Vec<Slot> = own.iter().flatten().map(|(slot, _)| *slot).collect();
    slots.sort();
    slots.dedup();
    for slot in slots {
        let per: Vec<Option<&analysis::DeviceSummary>> =
            own.iter().map(|o| o.iter().find(|(s, _)| *s == slot).map(|(_, d)| *d)).collect();
        let mut names: Vec<&str> = per.iter().flatten().map(|d| d.device.as_str()).collect();
        names.dedup();
        let what = if names.len() == 1 {
            names[0].to_string()
        } else {
            let each: Vec<String> = with
                .iter()
                .zip(&per)
                .filter_map(|((r, _), d)| {
                    let who = r.rank.map_or_else(|| r.label.clone(), |n| format!("rank {n}"));
                    d.map(|d| format!("{who} on {}", d.device))
                })
                .collect();
            format!("each process's {}: {}", slot.name(), each.join(", "))
        };
        for by_site in [false, true] {
            // Per row name: each process's bytes at its peak on this device.
            let mut rows: BTreeMap<String, Vec<u64>> = BTreeMap::new();
            for (i, d) in per.iter().enumerate() {
                let Some(d) = d else { continue };
                let shares: Vec<(String, u64)> = if by_site {
                    d.by_site.iter().map(|x| (site_name(x), x.held.bytes)).collect()
                } else {
                    d.by_category.iter().map(|x| (x.category.clone(), x.held.bytes)).collect()
                };
                for (name, bytes) in shares {
                    rows.entry(name).or_insert_with(|| vec![0; with.len()])[i] += bytes;
                }
            }
            if rows.is_empty() {
                continue;
            }
            let mut rows: Vec<(String, Vec<u64>)> = rows.into_iter().collect();
            let spread = |v: &[u64]| v.iter().max().unwrap_or(&0) - v.iter().min().unwrap_or(&0);
            rows.sort_by(|a, b| spread(&b.1).cmp(&spread(&a.1)).then_with(|| a.0.cmp(&b.0)));
            doc.heading(format!("{what}, by {}", if by_site { "site" } else { "category" }));
            let mut columns = vec![Column::new("spread", Layout::Figure)];
            columns.extend(with.iter().map(|(r, _)| Column::new(&r.label, Layout::Figure)));
            columns.push(Column::new(if by_site { "site" } else { "category" }, Layout::Text));
            let mut table = Table::new(columns).collapsed_after(15);
            for (name, bytes) in rows.into_iter().take(DIFFERENCE_ROWS) {
                let mut cells = vec![Cell::bytes(spread(&bytes))];
                cells.extend(bytes.iter().map(|b| Cell::bytes(*b)));
                cells.push(Cell::text(name));
                table.row(cells);
            }
            doc.table(table);
        }
    }
}

/// A device's place among its process's own: CUDA or CPU, and its order
/// among those of its kind (ordinal order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Slot {
    /// GPUs first.
    cpu: bool,
    nth: usize,
}

impl Slot {
    /// `GPU`, `2nd GPU`, `CPU`.
    fn name(self) -> String {
        let kind = if self.cpu { "CPU" } else { "GPU" };
        match self.nth {
            0 => kind.to_string(),
            1 => format!("2nd {kind}"),
            2 => format!("3rd {kind}"),
            n => format!("{}th {kind}", n + 1),
        }
    }
}

/// GPUs by ordinal (`cuda:2` before `cuda:10`), then the CPU.
fn slot_order(device: &str) -> (bool, u64, String) {
    match device.strip_prefix("cuda:").and_then(|n| n.parse::<u64>().ok()) {
        Some(n) => (false, n, String::new()),
        None => (true, 0, device.to_string()),
    }
}

fn site_name(x: &analysis::SiteShare) -> String {
    match &x.site {
        Some(site) => site.to_string(),
        None if x.before_history => "(allocated before the history began)".into(),
        None => "(no stack recorded)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_in_file_names_and_offsets() {
        assert_eq!(rank_in_name("out/snapshot_rank3.pickle"), Some(3));
        assert_eq!(rank_in_name("trace-rank-12.json"), Some(12));
        assert_eq!(rank_in_name("RANK1.pickle"), Some(1));
        assert_eq!(rank_in_name("snapshot.pickle"), None);
        assert_eq!(rank_in_name("ranking.pickle"), None);
        assert_eq!(parse_offset("1=-2500"), Ok((1, -2500)));
        assert!(parse_offset("1").unwrap_err().contains("RANK=MICROSECONDS"));
        assert!(parse_offset("x=3").unwrap_err().contains("is not a rank"));
    }
}
