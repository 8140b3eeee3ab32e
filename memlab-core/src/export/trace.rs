//! A Chrome trace-event file (the JSON that ui.perfetto.dev and
//! chrome://tracing open): per device, counter tracks of the allocator's
//! allocated, active and (CUDA) reserved bytes at every event; the resident
//! set and the driver's device use where they were read; a slice for every
//! profiled function call, logged step and monitor iteration (on the thread
//! that ran it); and an instant event for every out-of-memory failure.
//!
//! The counters are the allocator's own figures: memlab reads each device's
//! figures at export time, consistently with the history (the reading shows
//! exactly the events before a known point), and walks the history back, so
//! every sample is the figure right after its event, allocations made before
//! the recording included. On CUDA the events carry the bytes the tensors
//! asked for, not the caching allocator's rounded blocks: the counters are in
//! those terms (its `requested_bytes`), and the rounding (allocated minus
//! requested) is a figure of the moment, in the reporter and the OOM report.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::events::{self, Action, Event, Reading, Span, SpanKind};
use crate::render::Cell;
use crate::{Device, Error, Result};

/// The allocator's figures of one device at one moment, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Level {
    /// Bytes allocated to tensors. On CUDA, as the tensors asked for them
    /// (the caching allocator's blocks are rounded up from these).
    pub allocated: i64,
    /// Allocated, or freed but still in use by a stream (CUDA; as asked for,
    /// the allocator's `requested_bytes`).
    pub active: i64,
    /// Bytes the allocator holds from the device (CUDA).
    pub reserved: i64,
}

impl Level {
    /// The change `e` makes to the figures.
    fn change(e: &Event) -> Level {
        let size = e.size as i64;
        let cpu = e.device == Device::Cpu;
        match e.action {
            Action::Alloc => Level { allocated: size, active: size, reserved: 0 },
            // The CPU frees at once; CUDA's block stays active until its streams are done.
            Action::FreeRequested => Level { allocated: -size, active: if cpu { -size } else { 0 }, reserved: 0 },
            Action::FreeCompleted => Level { allocated: 0, active: -size, reserved: 0 },
            Action::SegmentAlloc | Action::SegmentMap => Level { reserved: size, ..Level::default() },
            Action::SegmentFree | Action::SegmentUnmap => Level { reserved: -size, ..Level::default() },
            Action::Oom => Level::default(),
        }
    }

    fn minus(self, d: Level) -> Level {
        Level {
            allocated: self.allocated - d.allocated,
            active: self.active - d.active,
            reserved: self.reserved - d.reserved,
        }
    }

    fn plus(self, d: Level) -> Level {
        self.minus(Level::default().minus(d))
    }
}

/// One sample of a device's counters.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// The figures right after the event.
    pub level: Level,
}

/// An out-of-memory failure.
#[derive(Clone, Debug, Serialize)]
pub struct Oom {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// Where.
    pub device: Device,
    /// What was asked for.
    pub requested: u64,
    /// What the device still had free (the CPU: the host's available
    /// memory), when known.
    pub device_free: Option<u64>,
}

/// A recording as trace events.
#[derive(Clone, Debug, Serialize)]
pub struct Trace {
    /// Per device: its figures after every event, oldest first.
    pub counters: BTreeMap<Device, Vec<Sample>>,
    /// The out-of-memory failures.
    pub ooms: Vec<Oom>,
    /// Profiled function calls, logged steps and monitor iterations.
    pub spans: Vec<Span>,
    /// The resident set and the driver's device use, where something read
    /// them (a `StepLogger`'s sampler, or a recording started with sampling).
    pub readings: Vec<Reading>,
    /// Whether the counters are incomplete: the bounded history dropped
    /// events (the counters then start later than the recording) or spans
    /// and readings, or a CUDA free requested before the history began was
    /// still waiting for its stream at export (its bytes are in the
    /// allocator's figures but no event says which, so `allocated` cannot be
    /// told from `active`).
    pub partial: bool,
    /// The process that wrote it (rank, host, the wall-clock time of time
    /// zero, …), written as the document's `otherData.run`.
    pub run: Option<crate::run::RunInfo>,
}

/// The allocator's figures of one device, read consistently with the history:
/// exactly the events numbered below `before` are in them.
#[derive(Clone, Debug)]
pub struct Anchor {
    stats: crate::DeviceStats,
    before: u64,
}

impl Anchor {
    /// `stats` read when the events numbered below `before` (their `seq`)
    /// were in them and no other: `u64::MAX` when every event of the
    /// history was.
    pub fn new(stats: crate::DeviceStats, before: u64) -> Anchor {
        Anchor { stats, before }
    }
}

impl Trace {
    /// The trace of `history` (the recorder's, with its `stats`) and of the
    /// recording's spans and readings, its counters walked back from `anchors`
    /// (each device's figures, read consistently with the history).
    pub fn from_history(history: &[Event], stats: &events::Stats, anchors: &BTreeMap<Device, Anchor>) -> Result<Trace> {
        let events::Timeline { spans, readings, dropped: timeline_dropped } = events::timeline();
        let mut by_device: BTreeMap<Device, Vec<&Event>> = BTreeMap::new();
        for e in history {
            by_device.entry(e.device).or_default().push(e);
        }
        let mut counters = BTreeMap::new();
        let mut waiting_unseen = false;
        for (device, events) in by_device {
            let Some(anchor) = anchors.get(&device) else {
                return Err(Error::InvalidArgument(format!("{device} has events but its figures could not be read")));
            };
            let now = &anchor.stats;
            // The figures at the reading, in the terms the events carry.
            let mut level = match device {
                Device::Cpu => Level {
                    allocated: now.allocated_bytes.all.current,
                    active: now.active_bytes.all.current,
                    // The CPU allocator reserves nothing of its own.
                    reserved: 0,
                },
                Device::Cuda(_) => {
                    // Blocks freed but waiting for their streams: the events up to
                    // the reading say which, and the allocator how many.
                    let mut waiting: BTreeMap<u64, i64> = BTreeMap::new();
                    for e in events.iter().filter(|e| e.seq < anchor.before) {
                        match e.action {
                            Action::FreeRequested => drop(waiting.insert(e.address, e.size as i64)),
                            Action::FreeCompleted => drop(waiting.remove(&e.address)),
                            _ => {}
                        }
                    }
                    let blocks_waiting = now.active.all.current - now.allocation.all.current;
                    waiting_unseen |= blocks_waiting != waiting.len() as i64;
                    let requested = now.requested_bytes.all.current;
                    Level {
                        allocated: requested - waiting.values().sum::<i64>(),
                        active: requested,
                        reserved: now.reserved_bytes.all.current,
                    }
                }
            };
            // Then the events after the reading, to the end of the history.
            for e in events.iter().filter(|e| e.seq >= anchor.before) {
                level = level.plus(Level::change(e));
            }
            // Walk back from the end: each sample is the level right after its event.
            let mut samples: Vec<Sample> = Vec::with_capacity(events.len());
            for e in events.iter().rev() {
                samples.push(Sample { time_us: e.time_ns as f64 / 1000.0, level });
                level = level.minus(Level::change(e));
            }
            samples.reverse();
            counters.insert(device, samples);
        }
        let ooms = history
            .iter()
            .filter(|e| e.action == Action::Oom)
            .map(|e| Oom {
                time_us: e.time_ns as f64 / 1000.0,
                device: e.device,
                requested: e.size,
                device_free: (matches!(e.device, Device::Cuda(_)) || e.address > 0).then_some(e.address),
            })
            .collect();
        let partial = stats.dropped > 0 || timeline_dropped > 0 || waiting_unseen;
        Ok(Trace { counters, ooms, spans, readings, partial, run: None })
    }
}

fn span_category(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Call => "profiled call",
        SpanKind::Step => "step",
        SpanKind::Iteration => "iteration",
    }
}

/// A trace-event file as data: what [`Trace`] writes, and what `memlab
/// merge` reads back and writes merged. Only what memlab writes is modelled
/// (four phases, the arguments of [`TraceArgs`]); a file of other events is
/// refused, naming the event.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TraceFile {
    /// How the viewer shows times (`ms`).
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: String,
    /// Who wrote it, and of which process.
    #[serde(rename = "otherData")]
    pub info: TraceInfo,
    /// The events, in the order written.
    #[serde(rename = "traceEvents", deserialize_with = "read_events")]
    pub events: Vec<TraceEvent<'static>>,
}

/// The `otherData` of a trace file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TraceInfo {
    /// `memlab`, or `memlab merge`.
    pub producer: String,
    /// Whether the counters are incomplete (see [`Trace::partial`]); a merge
    /// is partial when one of its traces is.
    #[serde(default)]
    pub partial: bool,
    /// The process that wrote it (rank, host, the wall-clock time of time zero).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<crate::run::RunInfo>,
    /// A merge: the wall-clock time of its time zero, in microseconds since
    /// the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin_unix_us: Option<i64>,
}

/// What a trace event is (its `ph`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// A name for a process or thread (`M`).
    #[serde(rename = "M")]
    Metadata,
    /// Counter values at a time (`C`).
    #[serde(rename = "C")]
    Counter,
    /// A slice with its duration (`X`).
    #[serde(rename = "X")]
    Complete,
    /// A moment (`i`).
    #[serde(rename = "i")]
    Instant,
}

/// How far an instant event's line reaches (its `s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstantScope {
    /// Across every process (`g`).
    #[serde(rename = "g")]
    Global,
    /// Across its process (`p`).
    #[serde(rename = "p")]
    Process,
    /// Its thread only (`t`).
    #[serde(rename = "t")]
    Thread,
}

/// One trace event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent<'a> {
    /// Its name: `process_name`, `cuda:0 memory`, a function's, …
    pub name: Cow<'a, str>,
    /// A slice's category (`profiled call`, `step`, `iteration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cat: Option<Cow<'a, str>>,
    /// What it is.
    pub ph: Phase,
    /// An instant's reach.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<InstantScope>,
    /// When, in microseconds after the file's time zero (none for metadata).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
    /// A slice's duration, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// The process (one per file; a merge numbers them).
    pub pid: u64,
    /// The thread (memlab's number; 0 for the memory tracks).
    pub tid: u64,
    /// Its values.
    #[serde(default, skip_serializing_if = "TraceArgs::is_empty")]
    pub args: TraceArgs<'a>,
}

impl<'a> TraceEvent<'a> {
    /// An event of phase `ph` named `name`, of process 1's thread 0, with no
    /// time or values yet.
    pub fn new(ph: Phase, name: impl Into<Cow<'a, str>>) -> TraceEvent<'a> {
        TraceEvent {
            name: name.into(),
            cat: None,
            ph,
            s: None,
            ts: None,
            dur: None,
            pid: 1,
            tid: 0,
            args: TraceArgs::default(),
        }
    }

    /// The same event at `ts` microseconds.
    pub fn at(mut self, ts: f64) -> TraceEvent<'a> {
        self.ts = Some(ts);
        self
    }

    /// The same event with `args`.
    pub fn with(mut self, args: TraceArgs<'a>) -> TraceEvent<'a> {
        self.args = args;
        self
    }
}

/// The values of the events memlab writes; each event has only its own.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceArgs<'a> {
    /// A metadata event's name for its process or thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Cow<'a, str>>,
    /// A process's place among a merge's processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sort_index: Option<u64>,
    /// A device's allocated bytes (see [`Level`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<i64>,
    /// A device's active bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<i64>,
    /// A CUDA device's reserved bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<i64>,
    /// The process's resident set, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss: Option<u64>,
    /// A GPU's memory in use by every process, as its driver says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
    /// A failed request's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<u64>,
    /// What the device still had free when a request failed, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
    /// The profiled statement a failed request came from (a merge's, from
    /// the out-of-memory report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statement: Option<String>,
    /// Why the request failed (a merge's, from the out-of-memory report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<crate::verdict::Verdict>,
}

impl TraceArgs<'_> {
    fn is_empty(&self) -> bool {
        *self == TraceArgs::default()
    }
}

/// Reads `traceEvents`, naming the event that is not one memlab writes.
fn read_events<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<TraceEvent<'static>>, D::Error> {
    use serde::de::Error as _;
    let values = Vec::<serde_json::Value>::deserialize(deserializer)?;
    values
        .into_iter()
        .enumerate()
        .map(|(i, value)| {
            if !value.is_object() {
                return Err(D::Error::custom(format!(
                    "event {i} of its `traceEvents` is {}, not an object",
                    json_kind(&value)
                )));
            }
            TraceEvent::deserialize(value).map_err(|e| {
                D::Error::custom(format!("event {i} of its `traceEvents` is not an event memlab writes ({e})"))
            })
        })
        .collect()
}

/// What a JSON value is, for messages: `a number`, `a list`.
fn json_kind(value: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl TraceFile {
    /// The trace file in `json`; the error says what is wrong, and where.
    pub fn from_json(json: &str) -> Result<TraceFile> {
        serde_json::from_str(json).map_err(|e| {
            // serde_json's position is of the event's end; the message names it.
            let e = e.to_string();
            let e = match e.find(" at line ") {
                Some(at) if e.starts_with("event ") => e[..at].to_string(),
                _ => e,
            };
            Error::InvalidArgument(format!("{e}; give the trace JSON memlab wrote, unchanged"))
        })
    }
}

/// Writes a trace file's events one by one, one per line, as
/// [`TraceFile`]'s `Serialize` would write the whole (a recording's trace
/// may have millions of events; none is kept).
pub struct TraceWriter<W: std::io::Write> {
    out: W,
    first: bool,
}

impl<W: std::io::Write> TraceWriter<W> {
    /// Starts a trace file of `info` in `out`.
    pub fn start(mut out: W, info: &TraceInfo) -> std::io::Result<TraceWriter<W>> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        serde_json::to_writer(&mut out, info)?;
        out.write_all(b",\"traceEvents\":[\n")?;
        Ok(TraceWriter { out, first: true })
    }

    /// Writes `event`.
    pub fn event(&mut self, event: &TraceEvent<'_>) -> std::io::Result<()> {
        if !self.first {
            self.out.write_all(b",")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, event)?;
        self.out.write_all(b"\n")
    }

    /// Ends the file, and hands back its writer, flushed.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.write_all(b"]}\n")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

impl Trace {
    /// Writes the trace-event JSON document to `out`, one event per line.
    pub fn write_to(&self, out: &mut (impl std::io::Write + ?Sized)) -> std::io::Result<()> {
        let used: Vec<String> = self.counters.keys().map(Device::to_string).collect();
        let used: Vec<&str> = used.iter().map(String::as_str).collect();
        let mut name = match self.run.as_ref().filter(|r| r.rank.is_some()) {
            Some(run) => format!("memlab {}", run.label_with(&used)),
            None => "memlab".to_string(),
        };
        if self.partial {
            name += " (partial: the history dropped events)";
        }
        let info =
            TraceInfo { producer: "memlab".into(), partial: self.partial, run: self.run.clone(), origin_unix_us: None };
        let mut w = TraceWriter::start(out, &info)?;
        let named = |what: &'static str, tid: u64, name: String| {
            let mut e = TraceEvent::new(Phase::Metadata, what)
                .with(TraceArgs { name: Some(name.into()), ..TraceArgs::default() });
            e.tid = tid;
            e
        };
        w.event(&named("process_name", 0, name))?;
        w.event(&named("thread_name", 0, "memory".into()))?;
        let mut threads: Vec<u64> = self.spans.iter().map(|s| s.thread).collect();
        threads.sort_unstable();
        threads.dedup();
        for t in threads {
            w.event(&named("thread_name", t, format!("thread {t}")))?;
        }
        for (device, samples) in &self.counters {
            let name = format!("{device} memory");
            let cuda = matches!(device, Device::Cuda(_));
            for s in samples {
                let Level { allocated, active, reserved } = s.level;
                let args = TraceArgs {
                    allocated: Some(allocated),
                    active: Some(active),
                    reserved: cuda.then_some(reserved),
                    ..TraceArgs::default()
                };
                w.event(&TraceEvent::new(Phase::Counter, name.as_str()).at(s.time_us).with(args))?;
            }
        }
        for r in &self.readings {
            let ts = r.time_ns as f64 / 1000.0;
            let rss = TraceArgs { rss: Some(r.rss), ..TraceArgs::default() };
            w.event(&TraceEvent::new(Phase::Counter, "process resident set").at(ts).with(rss))?;
            for events::DriverUsed { device: gpu, bytes } in &r.driver_used {
                let used = TraceArgs { used: Some(*bytes), ..TraceArgs::default() };
                let name = format!("cuda:{gpu} driver used (all processes)");
                w.event(&TraceEvent::new(Phase::Counter, name).at(ts).with(used))?;
            }
        }
        for s in &self.spans {
            let mut e = TraceEvent::new(Phase::Complete, &*s.name).at(s.start_ns as f64 / 1000.0);
            e.cat = Some(span_category(s.kind).into());
            e.dur = Some(s.end_ns.saturating_sub(s.start_ns) as f64 / 1000.0);
            e.tid = s.thread;
            w.event(&e)?;
        }
        for o in &self.ooms {
            let free = o.device_free.map(|f| format!(", {} free", Cell::bytes(f))).unwrap_or_default();
            let name = format!("out of memory on {}: {} asked{free}", o.device, Cell::bytes(o.requested));
            let args = TraceArgs { requested: Some(o.requested), device_free: o.device_free, ..TraceArgs::default() };
            let mut e = TraceEvent::new(Phase::Instant, name).at(o.time_us).with(args);
            e.s = Some(InstantScope::Global);
            w.event(&e)?;
        }
        w.finish().map(drop)
    }

    /// The trace-event JSON document.
    pub fn to_json(&self) -> String {
        let mut out = Vec::new();
        self.write_to(&mut out).expect("writing to memory cannot fail");
        String::from_utf8(out).expect("the writer writes UTF-8")
    }

    /// Writes the JSON to `path`: open it in ui.perfetto.dev or chrome://tracing.
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |e| Error::io(format!("write {}", path.display()), e);
        let file = std::fs::File::create(path).map_err(io)?;
        let mut out = std::io::BufWriter::new(file);
        self.write_to(&mut out).map_err(io)?;
        std::io::Write::flush(&mut out).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!("{}/../fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    }

    #[test]
    fn a_trace_file_reads_back_as_it_was_written() {
        // Rank 1's trace from a CPU run: counters, names, and a failure.
        let text = fixture("memlab_trace_rank1.json");
        let file = TraceFile::from_json(&text).unwrap();
        assert_eq!(file.info.run.as_ref().and_then(|r| r.rank), Some(1));
        let oom = file.events.iter().find(|e| e.ph == Phase::Instant).unwrap();
        assert_eq!(
            (oom.s, oom.args.requested, oom.args.device_free),
            (Some(InstantScope::Global), Some(1 << 48), Some(24337768448))
        );
        let counters = file.events.iter().filter(|e| e.ph == Phase::Counter && e.name == "cpu memory").count();
        assert_eq!(counters, 465);
        // Written again, one event at a time, it is the same document.
        let mut w = TraceWriter::start(Vec::new(), &file.info).unwrap();
        for e in &file.events {
            w.event(e).unwrap();
        }
        let again = String::from_utf8(w.finish().unwrap()).unwrap();
        let value = |t: &str| serde_json::from_str::<serde_json::Value>(t).unwrap();
        assert_eq!(value(&again), value(&text), "nothing lost or added");
        assert_eq!(value(&serde_json::to_string(&file).unwrap()), value(&text), "the streamed and whole forms agree");
        assert_eq!(again.lines().count(), file.events.len() + 2, "one event per line");
    }

    #[test]
    fn an_event_memlab_does_not_write_is_refused_naming_it() {
        let head = r#"{"displayTimeUnit":"ms","otherData":{"producer":"memlab"},"traceEvents":["#;
        let e = TraceFile::from_json(&format!(r#"{head}{{"name":"a","ph":"M","pid":1,"tid":0}},7]}}"#)).unwrap_err();
        assert!(e.to_string().contains("event 1 of its `traceEvents` is a number, not an object"), "{e}");
        let e = TraceFile::from_json(&format!(r#"{head}{{"name":"a","ph":"B","pid":1,"tid":0}}]}}"#)).unwrap_err();
        assert!(e.to_string().contains("event 0 of its `traceEvents` is not an event memlab writes"), "{e}");
        assert!(e.to_string().ends_with("give the trace JSON memlab wrote, unchanged"), "{e}");
    }
}
