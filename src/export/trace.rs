//! A Chrome trace-event file (the JSON that ui.perfetto.dev and
//! chrome://tracing open): per device, counter tracks of the allocator's
//! allocated, active and (CUDA) reserved bytes at every event, and an instant
//! event for every out-of-memory failure.
//!
//! The counters are the allocator's own figures: memlab reads each device's
//! figures at export time and walks the history back, so every sample is the
//! figure at that moment, allocations made before the recording included.

use std::collections::BTreeMap;
use std::path::Path;

use memlab_core::events::{self, Action, Event};
use memlab_core::{format_bytes, Device, Error, Result};
use serde::Serialize;
use serde_json::{json, Value};

/// The allocator's figures of one device at one moment, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Level {
    /// Bytes allocated to tensors (CUDA: rounded blocks).
    pub allocated: i64,
    /// Allocated, or freed but still in use by a stream (CUDA).
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
            Action::SegmentAlloc => Level { reserved: size, ..Level::default() },
            Action::SegmentFree => Level { reserved: -size, ..Level::default() },
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
}

/// One sample of a device's counters.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Sample {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// The figures right after the event.
    pub level: Level,
}

/// An out-of-memory failure.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Oom {
    /// Microseconds since the recording began.
    pub time_us: f64,
    /// Where.
    pub device: Device,
    /// What was asked for.
    pub requested: u64,
    /// CUDA: what the device still had free.
    pub device_free: Option<u64>,
}

/// A recording as trace events.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Trace {
    /// Per device: its figures after every event, oldest first.
    pub counters: BTreeMap<Device, Vec<Sample>>,
    /// The out-of-memory failures.
    pub ooms: Vec<Oom>,
    /// Whether the bounded history dropped events (the counters then start
    /// later than the recording).
    pub partial: bool,
}

pub(super) fn capture() -> Result<Trace> {
    let (history, stats) = events::history();
    let mut by_device: BTreeMap<Device, Vec<&Event>> = BTreeMap::new();
    for e in &history {
        by_device.entry(e.device).or_default().push(e);
    }
    let mut counters = BTreeMap::new();
    for (device, events) in by_device {
        let now = memlab_tch::device_stats(device)?;
        let mut level = Level {
            allocated: now.allocated_bytes.all.current,
            active: now.active_bytes.all.current,
            reserved: now.reserved_bytes.all.current,
        };
        if device == Device::Cpu {
            // The CPU allocator reserves nothing of its own.
            level.reserved = 0;
        }
        // Walk back from now: each sample is the level right after its event.
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
            device_free: matches!(e.device, Device::Cuda(_)).then_some(e.address),
        })
        .collect();
    Ok(Trace { counters, ooms, partial: stats.dropped > 0 })
}

impl Trace {
    /// The trace-event JSON document.
    pub fn to_json(&self) -> String {
        let mut events: Vec<Value> = vec![json!({
            "name": "process_name", "ph": "M", "pid": 1, "tid": 0,
            "args": {"name": if self.partial { "memlab (partial: the history dropped events)" } else { "memlab" }},
        })];
        for (device, samples) in &self.counters {
            let name = format!("{device} memory");
            for s in samples {
                let mut args = json!({"allocated": s.level.allocated, "active": s.level.active});
                if matches!(device, Device::Cuda(_)) {
                    args["reserved"] = json!(s.level.reserved);
                }
                events.push(json!({"name": name, "ph": "C", "ts": s.time_us, "pid": 1, "tid": 0, "args": args}));
            }
        }
        for o in &self.ooms {
            let free = o.device_free.map(|f| format!(", {} free", format_bytes(f as i64))).unwrap_or_default();
            events.push(json!({
                "name": format!("out of memory on {}: {} asked{free}", o.device, format_bytes(o.requested as i64)),
                "ph": "i", "s": "g", "ts": o.time_us, "pid": 1, "tid": 0,
                "args": {"requested": o.requested, "device_free": o.device_free},
            }));
        }
        let doc = json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"producer": "memlab", "partial": self.partial},
        });
        doc.to_string()
    }

    /// Writes the JSON to `path`: open it in ui.perfetto.dev or chrome://tracing.
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json()).map_err(|e| Error::io(format!("write {}", path.display()), e))
    }
}
