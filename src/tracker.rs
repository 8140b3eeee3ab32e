//! The call-site tracker behind `memlab::track!()`: at each call it logs when
//! and where it was called, how much the live tensors and the allocator hold,
//! and which storages appeared (`+`) or disappeared (`-`) since the previous
//! call. Put one call before and one after a step, or one per batch, and
//! the log says what grew between them.
//!
//! ```rust,no_run
//! memlab::track!();        // logs the call site, totals, and every storage as `+`
//! // ... batch 1 ...
//! memlab::track!();        // `+`/`-`: what appeared or went away since the last call
//! ```
//!
//! Each call logs a timestamp, the file, line and function, the bytes of live
//! tensors and the allocator's figure, then the storages that appeared or
//! disappeared, grouped by kind (parameter, buffer, gradient, optimizer state,
//! tensor, or unnamed), shape and dtype.
//!
//! Named storages come from the registered var stores, tensors and optimizers
//! (see [`register_var_store`](crate::register_var_store)); every other live
//! allocation comes from the event recorder, which a tracker keeps on. An
//! unnamed storage shows the profiled statement that allocated it or, when a
//! [`Recording`] with backtraces was started before the
//! tracker
//! (`let _r = memlab::Recording::start(memlab::events::Settings::default().backtraces(true))?;`),
//! the innermost of the user's frames, profiled or not.
//!
//! `memlab::Tracker::new().log_file("track.log")` and `track!(tracker)` log to
//! a file as well; `tracker.clear_cache()` empties the CUDA cache. The tracker
//! reads gradients: call it on the thread that steps the model, or between
//! steps (see the "Threads" section of [`crate::oom`]).
//! `cargo run --release --example track` finds a list that keeps every batch's
//! logits.

use memlab_core::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use memlab_core::events;
use memlab_core::render::{Cell, Document, Render};
use memlab_core::{DType, Device, Error, Result};
use serde::Serialize;

use memlab_tch::Recording;

use crate::named::Model;
use memlab_core::TensorKind;

/// Where `track!()` was called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CallSite {
    /// Source file.
    pub file: &'static str,
    /// Source line.
    pub line: u32,
    /// The calling function's path.
    pub function: &'static str,
}

/// What a storage is, as text names it: its kind, or `unnamed`.
fn kind_label(kind: Option<TensorKind>) -> String {
    kind.map_or_else(|| memlab_core::kind::UNNAMED.to_string(), |k| k.to_string())
}

/// A storage's kind as JSON names it: its kind, or `unnamed`.
fn serialize_kind<S: serde::Serializer>(kind: &Option<TensorKind>, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(kind.map_or(memlab_core::kind::UNNAMED, TensorKind::as_str))
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Group {
    kind: Option<TensorKind>,
    shape: Option<Vec<i64>>,
    dtype: Option<DType>,
    site: Option<String>,
}

#[derive(Clone, Debug)]
struct Entry {
    group: Group,
    bytes: u64,
}

/// What one `track!()` call logged: when and where, the totals, and the
/// storages that appeared or went away since the call before, grouped.
/// Prints (`{}`, `to_text()`) as the log's text.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct TrackEntry {
    /// When, in UTC (`YYYY-MM-DD HH:MM:SS.mmm`).
    pub time: String,
    /// Seconds since the tracker was made.
    pub elapsed_s: f64,
    /// Where `track!()` was called.
    pub site: CallSite,
    /// The device measured.
    pub device: Device,
    /// Bytes of the live storages memlab knows (named, and recorded), or
    /// `None` when they could not be walked (see `error`).
    pub live_bytes: Option<u64>,
    /// The allocator's allocated bytes, when it could be read.
    pub allocated_bytes: Option<i64>,
    /// What kept this call from measuring everything, if anything.
    pub error: Option<String>,
    /// The groups of storages that appeared, then those that went away.
    pub changes: Vec<StorageChange>,
}

/// Storages of one kind, shape, dtype and site that appeared or went away
/// between two `track!()` calls.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StorageChange {
    /// True for storages that appeared (`+`), false for those that went away (`-`).
    pub appeared: bool,
    /// How many.
    pub count: u64,
    /// What they are: a kind of named tensor, or `None` for memory no named
    /// tensor holds (`unnamed` in text and JSON).
    #[serde(serialize_with = "serialize_kind")]
    pub kind: Option<TensorKind>,
    /// Their shape and dtype, for named storages.
    pub shape: Option<Vec<i64>>,
    /// Their dtype (`Float`), for named storages.
    pub dtype: Option<DType>,
    /// Their bytes together.
    pub bytes: u64,
    /// Where unnamed ones were allocated, when memlab saw it.
    pub site: Option<String>,
}

/// Logs the memory at call sites, and what changed between them.
pub struct Tracker {
    model: Model,
    device: Option<Device>,
    stdout: bool,
    file: Option<PathBuf>,
    started: Instant,
    previous: Option<HashMap<u64, Entry>>,
    last_error: Option<Error>,
    _recording: Option<Recording>,
}

crate::named::names_memory_after_its_model!(Tracker, model);

impl Tracker {
    /// A tracker that names memory after everything registered (see
    /// [`register_var_store`](crate::register_var_store)): [`registered`](Self::registered).
    pub fn new() -> Tracker {
        Tracker::registered()
    }

    /// A tracker that names memory after everything registered at each
    /// line, logs to standard output and measures the current CUDA device
    /// when CUDA is available, else the CPU. It keeps allocation events on
    /// while it lives, to see unnamed allocations.
    pub fn registered() -> Tracker {
        Tracker::of(Model::registered())
    }

    /// A tracker like [`registered`](Self::registered)'s that names memory
    /// after `model` (or a var store, `of(&vs)`) instead.
    pub fn of(model: impl Into<Model>) -> Tracker {
        let (recording, last_error) = match Recording::join() {
            Ok(r) => (Some(r), None),
            // Unnamed allocations are not tracked then; named ones still are.
            Err(e) => (None, Some(e)),
        };
        Tracker {
            model: model.into(),
            device: None,
            stdout: true,
            file: None,
            started: Instant::now(),
            previous: None,
            last_error,
            _recording: recording,
        }
    }

    /// Measures `device`.
    pub fn device(mut self, device: Device) -> Tracker {
        self.device = Some(device);
        self
    }

    /// Appends the log to `path` as well (or instead, with `stdout(false)`).
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Tracker {
        self.file = Some(path.into());
        self
    }

    /// Whether the log also goes to the output chosen with `memlab::profiler::set_output`
    /// (standard output by default).
    pub fn stdout(mut self, on: bool) -> Tracker {
        self.stdout = on;
        self
    }

    /// The last problem met (measuring, writing the log, or starting the
    /// recording that sees unnamed allocations), if any.
    pub fn last_error(&self) -> Option<&Error> {
        self.last_error.as_ref()
    }

    /// Empties the CUDA caching allocator's cache (`torch.cuda.empty_cache()`).
    pub fn clear_cache(&self) -> Result<()> {
        memlab_tch::empty_cache()
    }

    fn measured_device(&self) -> Device {
        self.device.unwrap_or_else(memlab_tch::auto_device)
    }

    /// Logs one call site; returns what it logged (as data; `{}` prints the
    /// log's text). Never fails the caller: problems are in the entry and
    /// kept in [`last_error`](Self::last_error).
    pub fn track(&mut self, site: CallSite) -> TrackEntry {
        let entry = self.record(site);
        if self.stdout {
            memlab_core::output::emit(&entry.to_text());
        }
        entry
    }

    /// Measures one call site and appends it to the log file; leaves printing
    /// to the caller, which may first let go of its locks.
    fn record(&mut self, site: CallSite) -> TrackEntry {
        let device = self.measured_device();
        let mut entry = TrackEntry {
            time: memlab_core::time::utc_now(),
            elapsed_s: self.started.elapsed().as_secs_f64(),
            site,
            device,
            live_bytes: None,
            allocated_bytes: None,
            error: None,
            changes: Vec::new(),
        };
        match self.snapshot(device) {
            Ok(now) => {
                entry.live_bytes = Some(now.values().map(|e| e.bytes).sum());
                match memlab_tch::device_stats(device) {
                    Ok(stats) => entry.allocated_bytes = Some(stats.allocated_bytes.all.current),
                    Err(e) => {
                        entry.error = Some(format!("the allocator of {device} could not be read: {e}"));
                        self.last_error = Some(e);
                    }
                }
                entry.changes = self.changes(&now);
                self.previous = Some(now);
            }
            Err(e) => {
                entry.error = Some(format!("not measured: {e}"));
                self.last_error = Some(e);
            }
        }
        let text = entry.to_text();
        if let Some(path) = &self.file {
            let written =
                OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| f.write_all(text.as_bytes()));
            if let Err(e) = written {
                if self.last_error.is_none() {
                    memlab_core::output::warn(&format!(
                        "memlab tracker: cannot append to {}: {e}; tracking goes on\n",
                        path.display()
                    ));
                }
                self.last_error = Some(Error::io(format!("append to {}", path.display()), e));
            }
        }
        entry
    }

    /// The storages on `device` now, by data address.
    fn snapshot(&self, device: Device) -> Result<HashMap<u64, Entry>> {
        let mut out: HashMap<u64, Entry> = HashMap::new();
        let mut add = |address: u64, entry: Entry| {
            out.entry(address).or_insert(entry);
        };
        let named = self.model.collect()?;
        for storage in named.storages(device) {
            // A storage is grouped as its first view (the tensor that made it
            // known); it counts once, whatever views it has.
            let first = &storage.views[0];
            let group = Group {
                kind: Some(first.kind),
                shape: Some(first.shape.clone()),
                dtype: Some(first.dtype),
                site: None,
            };
            add(storage.data_ptr, Entry { group, bytes: storage.nbytes });
        }
        for a in events::live().into_iter().filter(|a| a.device == device) {
            let group = Group { kind: None, shape: None, dtype: None, site: a.site() };
            add(a.address, Entry { group, bytes: a.size });
        }
        Ok(out)
    }

    /// The groups of storages that appeared since the last call, then of
    /// those that went away.
    fn changes(&self, now: &HashMap<u64, Entry>) -> Vec<StorageChange> {
        let empty = HashMap::new();
        let before = self.previous.as_ref().unwrap_or(&empty);
        let mut out = Vec::new();
        for (appeared, from, to) in [(true, now, before), (false, before, now)] {
            let mut groups: BTreeMap<&Group, (u64, u64)> = BTreeMap::new();
            for (address, entry) in from {
                if !to.contains_key(address) {
                    let g = groups.entry(&entry.group).or_default();
                    g.0 += 1;
                    g.1 += entry.bytes;
                }
            }
            out.extend(groups.into_iter().map(|(group, (count, bytes))| StorageChange {
                appeared,
                count,
                kind: group.kind,
                shape: group.shape.clone(),
                dtype: group.dtype,
                bytes,
                site: group.site.clone(),
            }));
        }
        out
    }
}

displayed_as_text!(TrackEntry);

impl Render for TrackEntry {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        let CallSite { file, line, function } = self.site;
        let stamp = format!("[{} +{:.3}s] {file}:{line} {function}", self.time, self.elapsed_s);
        let Some(live) = self.live_bytes else {
            doc.line(format!("{stamp} — {}", self.error.as_deref().unwrap_or("not measured")));
            return doc;
        };
        let allocator = match (self.allocated_bytes, &self.error) {
            (Some(bytes), _) => Cell::bytes(bytes).to_string(),
            (None, Some(e)) => format!("unknown ({e})"),
            (None, None) => "unknown".to_string(),
        };
        doc.line(format!("{stamp} — live tensors {} on {}, allocator {allocator}", Cell::bytes(live), self.device));
        for change in &self.changes {
            let mut line = format!("{} {} × ", if change.appeared { "+" } else { "-" }, change.count);
            if let Some(shape) = &change.shape {
                line.push_str(&format!("{shape:?} {} ", change.dtype.map(DType::as_str).unwrap_or_default()));
            }
            line.push_str(&format!("{} {}", kind_label(change.kind), Cell::bytes(change.bytes)));
            if let Some(site) = &change.site {
                line.push_str(&format!(", allocated at {site}"));
            }
            doc.indented(2, line);
        }
        doc
    }
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker::new()
    }
}

memlab_core::process::process_wide! {
    /// The tracker `track!()` without an argument uses, made on first use.
    static GLOBAL: Mutex<Option<Tracker>> = Mutex::new(None);
}

/// Makes `tracker` the one `track!()` without an argument uses (by
/// default a `Tracker::new()`, made on its first use), and returns the one
/// it used before, if it had made one. memlab's lock stays with memlab.
///
/// ```
/// let quiet = memlab::Tracker::new().device(memlab::Device::Cpu).stdout(false);
/// memlab::tracker::set_global_tracker(quiet);
/// let entry = memlab::track!(); // logged, not printed
/// assert_eq!(entry.device, memlab::Device::Cpu);
/// ```
pub fn set_global_tracker(tracker: Tracker) -> Option<Tracker> {
    GLOBAL.locked().replace(tracker)
}

/// Logs `site` with the global tracker (creating it on first use). The
/// tracker's lock is let go before the text is printed, so an output sink may
/// call `track!()` itself. What `track!()` expands to (through
/// `__private`); not API.
#[doc(hidden)]
pub fn track_global(site: CallSite) -> TrackEntry {
    let (entry, print) = {
        let mut global = GLOBAL.locked();
        let tracker = global.get_or_insert_with(Tracker::new);
        (tracker.record(site), tracker.stdout)
    };
    if print {
        memlab_core::output::emit(&entry.to_text());
    }
    entry
}
