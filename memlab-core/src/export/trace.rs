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

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

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

/// A time in microseconds, as trace events write it.
struct Micros(f64);

impl std::fmt::Display for Micros {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Nanosecond precision, no exponent.
        write!(f, "{:.3}", self.0)
    }
}

/// A string as a JSON literal.
struct JsonStr<'a>(&'a str);

impl std::fmt::Display for JsonStr<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self.0).map_err(|_| std::fmt::Error)?)
    }
}

fn span_category(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Call => "profiled call",
        SpanKind::Step => "step",
        SpanKind::Iteration => "iteration",
    }
}

impl Trace {
    /// Writes the trace-event JSON document to `out`, one event per line.
    pub fn write_to(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let used: Vec<String> = self.counters.keys().map(Device::to_string).collect();
        let used: Vec<&str> = used.iter().map(String::as_str).collect();
        let mut name = match self.run.as_ref().filter(|r| r.rank.is_some()) {
            Some(run) => format!("memlab {}", run.label_with(&used)),
            None => "memlab".to_string(),
        };
        if self.partial {
            name += " (partial: the history dropped events)";
        }
        let name = name.as_str();
        write!(out, "{{\"displayTimeUnit\":\"ms\",")?;
        write!(out, "\"otherData\":{{\"producer\":\"memlab\",\"partial\":{}", self.partial)?;
        if let Some(run) = &self.run {
            write!(out, ",\"run\":{}", serde_json::to_string(run).map_err(std::io::Error::other)?)?;
        }
        write!(out, "}},")?;
        writeln!(out, "\"traceEvents\":[")?;
        write!(
            out,
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{{\"name\":{}}}}}",
            JsonStr(name)
        )?;
        writeln!(
            out,
            ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{{\"name\":\"memory\"}}}}"
        )?;
        let mut threads: Vec<u64> = self.spans.iter().map(|s| s.thread).collect();
        threads.sort_unstable();
        threads.dedup();
        for t in threads {
            writeln!(
                out,
                ",{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":{t},\"args\":{{\"name\":\"thread {t}\"}}}}"
            )?;
        }
        for (device, samples) in &self.counters {
            let name = JsonStr(&format!("{device} memory")).to_string();
            let cuda = matches!(device, Device::Cuda(_));
            for s in samples {
                let Level { allocated, active, reserved } = s.level;
                write!(out, ",{{\"name\":{name},\"ph\":\"C\",\"ts\":{},\"pid\":1,\"tid\":0,", Micros(s.time_us))?;
                write!(out, "\"args\":{{\"allocated\":{allocated},\"active\":{active}")?;
                if cuda {
                    write!(out, ",\"reserved\":{reserved}")?;
                }
                writeln!(out, "}}}}")?;
            }
        }
        for r in &self.readings {
            let ts = Micros(r.time_ns as f64 / 1000.0);
            writeln!(
                out,
                ",{{\"name\":\"process resident set\",\"ph\":\"C\",\"ts\":{ts},\"pid\":1,\"tid\":0,\"args\":{{\"rss\":{}}}}}",
                r.rss
            )?;
            for events::DriverUsed { device: gpu, bytes: used } in &r.driver_used {
                writeln!(out, ",{{\"name\":\"cuda:{gpu} driver used (all processes)\",\"ph\":\"C\",\"ts\":{ts},\"pid\":1,\"tid\":0,\"args\":{{\"used\":{used}}}}}")?;
            }
        }
        for s in &self.spans {
            let dur = s.end_ns.saturating_sub(s.start_ns);
            writeln!(
                out,
                ",{{\"name\":{},\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":1,\"tid\":{}}}",
                JsonStr(&s.name),
                span_category(s.kind),
                Micros(s.start_ns as f64 / 1000.0),
                Micros(dur as f64 / 1000.0),
                s.thread
            )?;
        }
        for o in &self.ooms {
            let free = o.device_free.map(|f| format!(", {} free", Cell::bytes(f))).unwrap_or_default();
            let name = format!("out of memory on {}: {} asked{free}", o.device, Cell::bytes(o.requested));
            let device_free = o.device_free.map_or_else(|| "null".to_string(), |f| f.to_string());
            writeln!(
                out,
                ",{{\"name\":{},\"ph\":\"i\",\"s\":\"g\",\"ts\":{},\"pid\":1,\"tid\":0,\"args\":{{\"requested\":{},\"device_free\":{device_free}}}}}",
                JsonStr(&name),
                Micros(o.time_us),
                o.requested
            )?;
        }
        writeln!(out, "]}}")
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
