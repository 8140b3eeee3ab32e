//! A recording replayed under the settings it was recorded with and others,
//! side by side: the peaks, the fragmentation at the peak, and whether and
//! why memory runs out under each, for every CUDA device of a snapshot.
//! What `memlab replay` prints and what an out-of-memory report answers
//! "would another setting have avoided it?" with.

use serde::{Deserialize, Serialize};

use super::allocator::ModelOom;
use super::config::AllocatorConfig;
use super::config::ONE_EXABYTE;
use super::run::{replay_device, replay_device_at, Card, DeviceReplay};
use super::Libtorch;
use crate::error::{Error, Result};
use crate::export::Snapshot;
use crate::render::{Cell, Column, Document, Layout, Render, Table};

/// The device memory assumed where neither the file nor the command line
/// gives one: an 80 GiB card.
const ASSUMED_TOTAL: u64 = 80 << 30;

/// The settings a comparison tries, beside the recorded ones (and
/// `garbage_collection_threshold:0.6` under a memory fraction, the only
/// place libtorch applies it).
pub const COMPARED: [&str; 6] = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:512",
    "expandable_segments:True,max_split_size_mb:128",
];

/// What to replay under: `memlab replay`'s flags.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Settings to replay under besides the recorded ones (`PYTORCH_CUDA_ALLOC_CONF` syntax).
    pub settings: Vec<String>,
    /// The bytes the allocator may reserve (what the device had for it).
    pub capacity: Option<u64>,
    /// The memory fraction, of the device's total.
    pub fraction: Option<f64>,
    /// The device's total memory.
    pub total: Option<u64>,
    /// Also the settings people try ([`COMPARED`]; `--compare`).
    pub compare: bool,
    /// The libtorch that made the recording, where the file does not say
    /// (`--libtorch`; PyTorch's snapshots never do): its allocator is replayed.
    pub libtorch: Option<Libtorch>,
}

/// A replay of every CUDA device of a file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Replayed {
    /// The file.
    pub file: String,
    /// The settings it was recorded with (as the file says, else libtorch's defaults).
    pub recorded_settings: String,
    /// The libtorch whose allocator was replayed: the recording's, as it or
    /// `--libtorch` says, else 2.11 (an assumption then).
    #[serde(default)]
    pub libtorch: Libtorch,
    /// What the replay assumed where the file says nothing, each a sentence.
    pub assumptions: Vec<String>,
    /// Settings libtorch 2.11 reads otherwise than written (a value
    /// clamped, wrapped or cut short), the recorded ones and those asked
    /// for, each a sentence: the replay uses them as libtorch would.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// One per CUDA device with a history.
    pub devices: Vec<DeviceReplays>,
}

/// One device (its name is the replay's `device`): the replay under the
/// recorded settings, then the others.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceReplays {
    /// Under the recorded settings.
    #[serde(flatten)]
    pub recorded: DeviceReplay,
    /// The memory fraction every replay of the device ran under (1: none).
    pub memory_fraction: f64,
    /// The device's memory, as the file says or as given or assumed.
    pub total: u64,
    /// What the allocator could reserve in the replays.
    pub capacity: u64,
    /// Under each other setting asked for.
    pub replays: Vec<DeviceReplay>,
}

/// Replays every CUDA device of `snapshot` (called `name` in messages) as
/// `options` say: under the settings it was recorded with, then each other.
pub fn replay_snapshot(name: &str, snapshot: &Snapshot, options: &ReplayOptions) -> Result<Replayed> {
    crate::export::check_figures(snapshot).map_err(|why| Error::InvalidArgument(format!("{name}: {why}")))?;
    let mut assumptions = Vec::new();
    let said = snapshot.memlab.as_ref().and_then(|m| m.run.as_ref()).and_then(|r| r.libtorch.clone());
    let libtorch = match (options.libtorch, said) {
        (Some(given), Some(v)) if Libtorch::of_recording(&v).is_some_and(|own| own != given) => {
            return Err(Error::InvalidArgument(format!(
                "{name} says libtorch {v} made it; --libtorch {} contradicts the file: leave --libtorch out",
                given.release()
            )))
        }
        (Some(given), _) => given,
        (None, Some(v)) => Libtorch::of_recording(&v).unwrap_or_else(|| {
            let modelled = Libtorch::default();
            assumptions.push(format!(
                "the recording was made by libtorch {v}, whose allocator memlab does not model: replayed as \
                 {modelled}'s, so figures may differ where the two allocators do"
            ));
            modelled
        }),
        (None, None) => {
            let modelled = Libtorch::default();
            assumptions.push(format!(
                "the file does not say its libtorch version (PyTorch's snapshots do not): replayed as {modelled}'s \
                 allocator (give --libtorch)"
            ));
            modelled
        }
    };
    let mut notes = Vec::new();
    let recorded = match &snapshot.allocator_settings {
        Some(settings) => {
            let read = AllocatorConfig::read_snapshot_as(settings, libtorch)
                .map_err(|e| Error::InvalidArgument(format!("{name}: {e}")))?;
            notes.extend(read.notes);
            read.config
        }
        None => {
            assumptions.push(
                "the file does not say the allocator's settings (PyTorch before 2.5; memlab's, when it could not \
                 read them): replayed as recorded under libtorch's defaults"
                    .to_string(),
            );
            AllocatorConfig::read_as("", libtorch)?.config
        }
    };
    let recorded_settings = recorded.to_conf();
    // Each settings string parsed once; each device then gets its own fraction.
    let mut wanted: Vec<String> = options.settings.clone();
    if options.compare {
        wanted.extend(COMPARED.iter().map(|s| s.to_string()));
    }
    let mut configs_wanted = Vec::new();
    for conf in &wanted {
        let read = AllocatorConfig::read_as(conf, libtorch)?;
        notes.extend(read.notes.into_iter().filter(|n| !notes.contains(n)).collect::<Vec<_>>());
        configs_wanted.push(read.config);
    }
    let wanted = configs_wanted;
    let recorded_memory = snapshot.memlab.as_ref().map(|m| m.device_memory.as_slice()).unwrap_or_default();
    let names = snapshot.devices();
    let mut devices = Vec::new();
    let mut said = std::collections::BTreeSet::new();
    let mut assume = |sentence: String| {
        if said.insert(sentence.clone()) {
            assumptions.push(sentence);
        }
    };
    for (index, device) in names.iter().enumerate().filter(|(_, n)| n.starts_with("cuda")) {
        if snapshot.device_traces.get(index).is_none_or(|t| t.is_empty()) {
            continue;
        }
        let memory = recorded_memory.iter().find(|m| &m.device == device);
        let total = options.total.or(memory.map(|m| m.total)).unwrap_or_else(|| {
            assume(format!(
                "the file does not say the device's memory: {} assumed (give --total)",
                Cell::bytes(ASSUMED_TOTAL)
            ));
            ASSUMED_TOTAL
        });
        let mut recorded = recorded.clone();
        match (options.fraction, memory) {
            (Some(f), _) => recorded.memory_fraction = f,
            // The fraction set at run time wins over the settings' key, as in libtorch.
            (None, Some(m)) => recorded.memory_fraction = m.memory_fraction,
            (None, None) => {}
        }
        let capacity = options.capacity.unwrap_or_else(|| {
            if options.fraction.is_none() && memory.is_none() {
                assume(
                    "the file does not say what the allocator could reserve: replayed without a limit beyond the \
                     device's memory (give --capacity or --fraction to see where memory runs out)"
                        .to_string(),
                );
            } else if options.fraction.is_none() && recorded.memory_fraction >= 1.0 {
                assume(
                    "the allocator could reserve the device's whole memory, less what others held then, which the \
                     file does not say (give --capacity for what was free)"
                        .to_string(),
                );
            }
            total
        });
        let card = Card { capacity, total };
        let mut others: Vec<AllocatorConfig> = Vec::new();
        let mut configs = wanted.clone();
        if options.compare {
            if recorded.memory_fraction < 1.0 {
                configs.push(AllocatorConfig::read_as("garbage_collection_threshold:0.6", libtorch)?.config);
            } else {
                assume(
                    "garbage_collection_threshold is left out of the comparison: libtorch applies it only under a \
                     memory fraction (give --fraction)"
                        .to_string(),
                );
            }
        }
        for mut c in configs {
            if c.memory_fraction == 1.0 {
                c.memory_fraction = recorded.memory_fraction;
            }
            // Keys without effect make no row of their own.
            let same = |o: &AllocatorConfig| o.same_effect(&c) && o.memory_fraction == c.memory_fraction;
            if !same(&recorded) && !others.iter().any(same) {
                others.push(c);
            }
        }
        let as_recorded = replay_device(snapshot, index, &recorded, &recorded, card)
            .map_err(|e| Error::InvalidArgument(format!("{name}: {e}")))?;
        let replays = others
            .iter()
            .map(|c| replay_device_at(snapshot, index, c, card, &as_recorded.empty_cache_at))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| Error::InvalidArgument(format!("{name}: {e}")))?;
        devices.push(DeviceReplays {
            recorded: as_recorded,
            memory_fraction: recorded.memory_fraction,
            total,
            capacity,
            replays,
        });
    }
    if devices.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "cannot replay {name}: it has no CUDA history (record with torch.cuda.memory._record_memory_history, \
             or a memlab Recording on CUDA; a CPU recording predicts a CUDA run with `memlab replay --as-cuda`)"
        )));
    }
    Ok(Replayed { file: name.to_string(), recorded_settings, libtorch, assumptions, notes, devices })
}

/// Settings without the memory fraction where it is the device's
/// (`fraction`, the same for every such row, said above the table). A row
/// with a fraction of its own keeps it.
fn without_fraction(conf: &str, fraction: f64) -> String {
    let device_fraction = |key: &str| {
        key.strip_prefix("per_process_memory_fraction:").and_then(|v| v.parse::<f64>().ok()) == Some(fraction)
    };
    conf.split(',').filter(|k| !k.is_empty() && !device_fraction(k)).collect::<Vec<_>>().join(",")
}

/// Settings as the table names them: [`without_fraction`], `default` for none.
fn settings_name(conf: &str, fraction: f64) -> String {
    let kept = without_fraction(conf, fraction);
    if kept.is_empty() {
        "default".into()
    } else {
        kept
    }
}

/// What `memlab replay` prints.
impl Render for Replayed {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        doc.title(format!("memlab replay: {}", self.file));
        doc.line(format!(
            "A replay through the model of {}'s CUDA caching allocator (figures replayed, not measured).",
            self.libtorch
        ));
        doc.line(format!("Recorded with: {}", settings_name(&self.recorded_settings, 1.0)));
        for n in &self.notes {
            doc.note(format!("Read as {} reads it: {n}.", self.libtorch));
        }
        for a in &self.assumptions {
            doc.note(format!("Assumed: {a}."));
        }
        for d in &self.devices {
            doc.part(d.recorded.device.clone());
            if d.memory_fraction < 1.0 {
                doc.line(format!(
                    "Memory fraction {} of {}: the allocator may hold {}.",
                    d.memory_fraction,
                    Cell::bytes(d.total),
                    Cell::bytes((d.memory_fraction * d.total as f64) as u64)
                ));
            } else if d.capacity < d.total {
                doc.line(format!("The allocator may reserve {} of {}.", Cell::bytes(d.capacity), Cell::bytes(d.total)));
            }
            let r = &d.recorded;
            if r.reserved_before > 0 && r.rebuilt_segments > 0 {
                doc.line(format!(
                    "The allocator held {} of segments before the history began: the replay rebuilt them ({} \
                     segment(s), {} block(s) in use) from the snapshot's segments, undoing the history, and \
                     starts from there.",
                    Cell::bytes(r.reserved_before),
                    r.rebuilt_segments,
                    r.rebuilt_blocks
                ));
            } else if r.reserved_before > 0 {
                doc.caution(format!(
                    "The allocator held {} of segments before the history began (the snapshot's segments less \
                     what the history added), which the replay cannot rebuild (expandable segments): it starts \
                     from an empty allocator, so requests served from those segments get new ones here, and the \
                     figures below are of the history alone.",
                    Cell::bytes(r.reserved_before)
                ));
            }
            if r.unknown_frees > 0 {
                doc.caution(format!(
                    "The history starts mid-run: it frees {} block(s) it never saw allocated and the replay could \
                     not place (PyTorch keeps only its last max_entries; record with a larger one): what those \
                     blocks held is missing from every figure below.",
                    r.unknown_frees
                ));
            }
            doc.line(format!(
                "Under the recorded settings the model made {} of the allocator's {} segment events{}.",
                r.segment_events_matched,
                r.segment_events,
                match &r.first_mismatch {
                    None => String::new(),
                    Some(m) => format!(
                        "; the first difference is event {}: recorded {} of {}, replayed {}",
                        m.index,
                        m.recorded.0,
                        Cell::bytes(m.recorded.1),
                        m.replayed
                            .as_ref()
                            .map_or("nothing".to_string(), |(a, s)| format!("{a} of {}", Cell::bytes(*s)))
                    ),
                }
            ));
            let mut table = Table::new(vec![
                Column::new("settings", Layout::Text),
                Column::new("peak reserved", Layout::Figure),
                Column::new("peak allocated", Layout::Figure),
                Column::new("free at peak", Layout::Figure),
                Column::new("of reserved", Layout::Figure),
                Column::new("largest free", Layout::Figure),
                Column::new("out of memory", Layout::Text),
            ]);
            let recorded_oom = r.ooms.iter().any(|o| o.recorded);
            for (i, x) in std::iter::once(r).chain(&d.replays).enumerate() {
                let oom = match x.ooms.first() {
                    Some(o) => format!(
                        "at history entry {}, asking {}: {}",
                        o.entry,
                        Cell::bytes(o.oom.requested),
                        why(&o.oom)
                    ),
                    None if i > 0 && recorded_oom && r.continued_after_oom.is_some() => {
                        "no: avoids the recorded errors, as recorded (the program went on after its first: see below)"
                            .to_string()
                    }
                    None if i > 0 && recorded_oom => "no: avoids the recorded error".to_string(),
                    None => "no".to_string(),
                };
                let label = if i == 0 { format!("{} (recorded)", d.name(x)) } else { d.name(x) };
                table.row([
                    Cell::text(label),
                    Cell::bytes(x.peak_reserved),
                    Cell::bytes(x.peak_allocated),
                    Cell::bytes(x.at_peak.free()),
                    Cell::Percent(x.at_peak.free_share()),
                    Cell::bytes(x.at_peak.largest_free),
                    Cell::text(oom),
                ]);
            }
            doc.table(table);
            doc.append(d.verdict());
        }
        doc.note(
            "Free at peak: of the moments reserved stood at its peak, the one the most was allocated; the bytes \
             inside the segments no tensor used then, and the largest of the free blocks.",
        );
        doc
    }
}

impl DeviceReplays {
    /// A replay's settings as its row names them: the device's memory
    /// fraction, said above the table, left out; `default` for none.
    pub fn name(&self, replay: &DeviceReplay) -> String {
        settings_name(&replay.settings, self.memory_fraction)
    }

    /// A replay's settings as `PYTORCH_CUDA_ALLOC_CONF` would set them in
    /// the device's process: its memory fraction (set at run time, or by
    /// the recorded settings) left out.
    pub fn conf(&self, replay: &DeviceReplay) -> String {
        without_fraction(&replay.settings, self.memory_fraction)
    }

    /// The recording's out-of-memory error as the replay under the
    /// recorded settings reproduced it, if it did.
    pub fn recorded_oom(&self) -> Option<&super::ReplayOom> {
        self.recorded.ooms.iter().find(|o| o.recorded)
    }

    /// The other settings whose replay runs out of memory nowhere: those
    /// that would have avoided the recorded error.
    pub fn avoiding(&self) -> impl Iterator<Item = &DeviceReplay> {
        self.replays.iter().filter(|r| r.ooms.is_empty())
    }

    /// Each setting's replayed peak and whether it runs out of memory, the
    /// recorded settings first: the short table an out-of-memory report
    /// shows (`memlab replay` shows the long one).
    pub fn outcomes(&self) -> Table {
        let mut table = Table::new(vec![
            Column::new("settings (replayed)", Layout::Text),
            Column::new("peak reserved", Layout::Figure),
            Column::new("out of memory", Layout::Text),
        ]);
        for (i, x) in std::iter::once(&self.recorded).chain(&self.replays).enumerate() {
            let name = self.name(x);
            let oom = match x.ooms.first() {
                Some(o) => format!("yes, at history entry {}", o.entry),
                None => "no".to_string(),
            };
            table.row([
                Cell::text(if i == 0 { format!("{name} (recorded)") } else { name }),
                Cell::bytes(x.peak_reserved),
                Cell::text(oom),
            ]);
        }
        table
    }

    /// "Would another setting have avoided the recorded error?", answered
    /// in sentences: which would, at what peak, or that none would and why;
    /// nothing where the recording has no error. Said with the caution the
    /// replay needs where it cannot be trusted.
    pub fn verdict(&self) -> Document {
        let mut doc = Document::new();
        let r = &self.recorded;
        let recorded_errors = r.ooms.iter().filter(|o| o.recorded).count() + r.avoided;
        if recorded_errors == 0 {
            return doc;
        }
        if let Some(entry) = r.continued_after_oom {
            doc.caution(format!(
                "The program went on after the error at history entry {entry}: it caught the error and asked for \
                 memory again. The replay follows its requests as recorded, so it is exact up to that entry; what \
                 it says after it, each error avoided included, holds only if the program's requests did not \
                 depend on the error (a loop that allocates until it fails asks for more wherever more is left)."
            ));
        }

        let Some(oom) = self.recorded_oom() else {
            doc.caution(format!(
                "Under the recorded settings the replay serves the request the recording failed ({} of {} \
                 segment events as the allocator made them): the model does not reproduce this failure, so it \
                 gives no verdict on other settings.",
                r.segment_events_matched, r.segment_events
            ));
            return doc;
        };
        let avoiding: Vec<&DeviceReplay> = self.avoiding().collect();
        if avoiding.is_empty() {
            doc.line(format!(
                "None of the {} other settings replayed would have avoided the error at history entry {}: {}.",
                self.replays.len(),
                oom.entry,
                why(&oom.oom)
            ));
        } else {
            for x in avoiding {
                doc.line(format!(
                    "{} would have avoided the error at history entry {}, with a peak of {} reserved.",
                    self.name(x),
                    oom.entry,
                    Cell::bytes(x.peak_reserved)
                ));
            }
        }
        let unrebuilt = r.reserved_before > 0 && r.rebuilt_segments == 0;
        if r.unknown_frees > 0 || unrebuilt || r.segment_events_matched < r.segment_events {
            doc.caution(
                "The history does not cover the whole run, or the model did not follow it event for event (see \
                 above): take these answers as estimates.",
            );
        }
        doc
    }
}

/// Why a request failed: libtorch refuses it at once, the tensors alone
/// fill the limit, or the memory held is too broken up for it. Added in
/// `u128`: a request may be any `u64`.
fn why(oom: &ModelOom) -> String {
    if oom.requested >= ONE_EXABYTE {
        return format!(
            "libtorch refuses a request of {} or more at once ({} bytes asked)",
            Cell::bytes(ONE_EXABYTE),
            oom.requested
        );
    }
    let free = oom.reserved.saturating_sub(oom.allocated);
    if u128::from(oom.allocated) + u128::from(oom.requested) > u128::from(oom.limit) {
        format!(
            "the tensors alone need more ({} allocated + {} > {} the allocator may hold)",
            Cell::bytes(oom.allocated),
            Cell::bytes(oom.requested),
            Cell::bytes(oom.limit)
        )
    } else if oom.segment > oom.limit {
        format!(
            "the segment the settings give this request ({}) is larger than the {} the allocator may hold",
            Cell::bytes(oom.segment),
            Cell::bytes(oom.limit)
        )
    } else {
        format!(
            "fragmentation ({} free in the segments, the largest block {}; a new {} segment would pass the {} \
             limit)",
            Cell::bytes(free),
            Cell::bytes(oom.largest_free),
            Cell::bytes(oom.segment),
            Cell::bytes(oom.limit)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Action;
    use crate::export::SnapshotInfo;
    use crate::replay::MIB;

    /// One CUDA device whose history is `entries` (action, address, bytes),
    /// on a device of `total` bytes that the allocator may fill, recorded
    /// under the default settings.
    fn snapshot(entries: &[(Action, u64, u64)], total: u64) -> Snapshot {
        let mut s = crate::replay::tests::history(entries);
        s.allocator_settings =
            Some(crate::export::AllocatorSettings { conf: Some(String::new()), ..Default::default() });
        s.memlab = Some(SnapshotInfo {
            devices: vec!["cuda:0".into()],
            partial: false,
            dropped: 0,
            recorded: entries.len() as u64,
            run: None,
            device_memory: vec![crate::export::DeviceMemory { device: "cuda:0".into(), total, memory_fraction: 1.0 }],
            profile: None,
            ops: None,
            unseen_before: Vec::new(),
            prediction_inputs: None,
        });
        s
    }

    fn compare() -> ReplayOptions {
        ReplayOptions { compare: true, ..ReplayOptions::default() }
    }

    #[test]
    fn the_verdict_names_the_settings_that_would_have_avoided_the_error() {
        use Action::*;
        // 40 MiB in all. 5 MiB holds a 20 MiB segment; 30 MiB more needs a
        // 30 MiB segment: 20 + 30 > 40, and the held segment cannot go back.
        // An expandable segment would fit them: it maps 20 MiB pages, the
        // 30 MiB going on from the 5 MiB's page into one more, 40 MiB in all
        // (with or without max_split_size).
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 30 * MIB)], 40 * MIB);
        let r = replay_snapshot("pattern", &s, &compare()).unwrap();
        let d = &r.devices[0];
        assert_eq!(d.recorded_oom().map(|o| o.entry), Some(2));
        let avoiding: Vec<String> = d.avoiding().map(|x| d.name(x)).collect();
        assert_eq!(avoiding, ["expandable_segments:True", "max_split_size_mb:128,expandable_segments:True"]);
        let text = d.verdict().to_text();
        assert!(
            text.contains("expandable_segments:True would have avoided the error at history entry 2, with a peak of 40.00M reserved."),
            "{text}"
        );
        // Without a fraction, the comparison says it left the collector out.
        assert!(r.assumptions.iter().any(|a| a.starts_with("garbage_collection_threshold is left out")));
    }

    #[test]
    fn the_verdict_says_none_would_when_the_tensors_alone_exceed_the_memory() {
        use Action::*;
        // 5 MiB held, 50 MiB asked for, on 40 MiB: no setting helps.
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 50 * MIB)], 40 * MIB);
        let r = replay_snapshot("pattern", &s, &compare()).unwrap();
        assert_eq!(r.devices[0].avoiding().count(), 0);
        let text = r.devices[0].verdict().to_text();
        assert!(
            text.contains("None of the 5 other settings replayed would have avoided the error at history entry 2: the tensors alone need more (5.00M allocated + 50.00M > 40.00M"),
            "{text}"
        );
    }

    #[test]
    fn a_failure_the_model_does_not_reproduce_gets_no_verdict() {
        use Action::*;
        // The recording failed 5 MiB with room to spare: the model serves it.
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 5 * MIB)], 40 * MIB);
        let r = replay_snapshot("pattern", &s, &compare()).unwrap();
        let text = r.devices[0].verdict().to_text();
        assert!(text.contains("does not reproduce this failure, so it gives no verdict"), "{text}");
        // No error, no verdict.
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB)], 40 * MIB);
        assert!(replay_snapshot("pattern", &s, &compare()).unwrap().devices[0].verdict().to_text().is_empty());
    }

    #[test]
    fn a_row_with_a_memory_fraction_of_its_own_is_named_for_it() {
        use Action::*;
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB)], 40 * MIB);
        let options =
            ReplayOptions { settings: vec!["per_process_memory_fraction:0.0001".into()], ..Default::default() };
        let r = replay_snapshot("pattern", &s, &options).unwrap();
        let d = &r.devices[0];
        let names: Vec<String> = std::iter::once(&d.recorded).chain(&d.replays).map(|x| d.name(x)).collect();
        assert_eq!(names, ["default", "per_process_memory_fraction:0.0001"]);
        let text = r.to_text();
        assert_eq!(text.matches("default").count(), 2, "the recorded row and the line above the table:\n{text}");
        // The device's own fraction, said above the table, stays out of the rows.
        let options = ReplayOptions {
            fraction: Some(0.5),
            settings: vec!["expandable_segments:True".into()],
            ..Default::default()
        };
        let r = replay_snapshot("pattern", &s, &options).unwrap();
        let d = &r.devices[0];
        assert_eq!(d.name(&d.recorded), "default");
        assert_eq!(d.name(&d.replays[0]), "expandable_segments:True");
    }

    #[test]
    fn requests_near_the_top_of_u64_are_explained_without_wrapping() {
        use Action::*;
        // 2 MiB allocated, then u64::MAX asked: libtorch refuses it at once,
        // whatever is free. Added in 64 bits, 2 MiB + u64::MAX wrapped to
        // 2 MiB - 1 and read as fragmentation.
        let s = snapshot(&[(SegmentAlloc, 1, 2 * MIB), (Alloc, 1, 2 * MIB), (Oom, 0, u64::MAX)], 80 << 30);
        let r = replay_snapshot("huge", &s, &ReplayOptions::default()).unwrap();
        let text = r.to_text();
        assert!(text.contains("asking 16.00E: libtorch refuses a request of 1.00E or more at once"), "{text}");
        assert!(!text.contains("fragmentation"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(json["devices"][0]["ooms"][0]["oom"]["requested"], serde_json::json!(u64::MAX));
        // Below 1 EiB, on a card where the sum of 64-bit figures would wrap:
        // the tensors alone need more.
        let oom = ModelOom {
            requested: (1 << 60) - 1,
            segment: 1 << 60,
            stream: 0,
            reserved: 2 * MIB,
            allocated: u64::MAX - MIB,
            limit: u64::MAX,
            largest_free: 0,
        };
        assert!(why(&oom).starts_with("the tensors alone need more"), "{}", why(&oom));
    }
}
