//! PyTorch's memory snapshot, from memlab's recording: the format
//! `torch.cuda.memory._snapshot()` returns and `_dump_snapshot` pickles
//! (`segments` with their `blocks`, and `device_traces`), documented in
//! `torch/cuda/memory.py`. CUDA segments come from the caching allocator's
//! own snapshot; the traces are memlab's events, with the user's Rust frames.
//!
//! Devices are numbered as PyTorch's own converters number them: the CUDA
//! devices by index, then the CPU (so with one GPU, `device_traces[1]` is the
//! CPU). The CPU has no segments of its own: each live allocation is listed
//! as a segment holding one block, so the segments add up to what is live.

use memlab_core::hash::{FastHasher, FastMap};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use memlab_core::events::{self, Action, Backtrace, Event, Frame, StatementRef};
use memlab_core::{Device, Error, Result};
use serde::Serialize;

use super::pickle::Pickler;
use crate::named::{Kind, Model};

/// A call stack, innermost frame first, shared by every event that has it.
pub type Stack = Arc<[SnapshotFrame]>;

/// A frame of a stack, as PyTorch writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SnapshotFrame {
    /// The source file.
    pub filename: String,
    /// The line.
    pub line: u32,
    /// The function.
    pub name: String,
}

/// A block of a segment.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Block {
    /// Its address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// What the tensor asked for (0 when free).
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: &'static str,
    /// Where it was allocated, innermost first (empty when unknown).
    pub frames: Stack,
}

/// A segment: memory the allocator obtained at once.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Segment {
    /// The index of its device in `device_traces`.
    pub device: usize,
    /// Its address.
    pub address: u64,
    /// Its size.
    pub total_size: u64,
    /// The stream it serves (0 on the CPU).
    pub stream: u64,
    /// `small` or `large` (blocks over 1 MiB).
    pub segment_type: &'static str,
    /// Bytes of its allocated blocks.
    pub allocated_size: u64,
    /// Bytes of its allocated blocks and those waiting for a stream.
    pub active_size: u64,
    /// Bytes its tensors asked for.
    pub requested_size: u64,
    /// Whether it is an expandable segment.
    pub is_expandable: bool,
    /// Its blocks, by address.
    pub blocks: Vec<Block>,
}

/// One event of a device's trace.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `segment_map`, `segment_unmap` or `oom`.
    pub action: &'static str,
    /// The block's address (absent for `oom`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    /// Its size; for `oom`, what was asked for.
    pub size: u64,
    /// The stream (0 on the CPU).
    pub stream: u64,
    /// Microseconds since the recording began.
    pub time_us: u64,
    /// Where the allocation was made, innermost first; frees repeat their
    /// allocation's frames, as PyTorch's converters do.
    pub frames: Stack,
    /// For `alloc`: `parameter`, `gradient`, `optimizer_state` (named by the
    /// walk at export time for allocations still alive then, else by the
    /// walks at each `StepLogger` step or `TrainingMonitor` record that saw
    /// it alive) or `other`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub category: Option<&'static str>,
    /// For `oom`: what the device still had free (the CPU: the host's
    /// available memory, 0 where unknown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// What memlab adds to the snapshot (PyTorch's readers ignore it).
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct SnapshotInfo {
    /// The device of each index of `device_traces`: `cuda:0`, …, `cpu`.
    pub devices: Vec<String>,
    /// Whether the recording's bounded history dropped events (the traces
    /// then start later than the recording), or memory ran out while the
    /// live set grew (some live blocks are missing): the data is partial.
    pub partial: bool,
    /// How many events were dropped.
    pub dropped: u64,
    /// How many events the recording saw.
    pub recorded: u64,
}

/// A PyTorch memory snapshot of memlab's recording.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// The allocators' segments now.
    pub segments: Vec<Segment>,
    /// Per device (see [`SnapshotInfo::devices`]): its events, oldest first.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// memlab's notes on the data.
    pub memlab: SnapshotInfo,
}

impl Snapshot {
    /// The snapshot as a pickle, as `torch.cuda.memory._dump_snapshot`
    /// writes it.
    pub fn to_pickle(&self) -> Result<Vec<u8>> {
        let mut p = Pickler::new();
        p.dict(|p| {
            p.str("segments");
            p.list(|p| self.segments.iter().for_each(|s| segment(p, s)));
            p.str("device_traces");
            p.list(|p| {
                for trace in &self.device_traces {
                    p.list(|p| trace.iter().for_each(|e| entry(p, e)));
                }
            });
            p.str("memlab");
            p.dict(|p| {
                p.str("devices");
                p.list(|p| self.memlab.devices.iter().for_each(|d| p.str(d)));
                p.str("partial");
                p.bool(self.memlab.partial);
                p.str("dropped");
                p.int(self.memlab.dropped.into());
                p.str("recorded");
                p.int(self.memlab.recorded.into());
            });
        });
        Ok(p.finish())
    }

    /// Writes the pickle to `path`: open it at pytorch.org/memory_viz, or
    /// read it with `python -m torch.cuda._memory_viz stats|trace FILE`.
    pub fn write_pickle(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_pickle()?).map_err(|e| Error::io(format!("write {}", path.display()), e))
    }
}

fn stack(p: &mut Pickler, frames: &Stack) {
    p.shared(frames.as_ptr() as usize, |p| {
        p.list(|p| {
            for f in frames.iter() {
                p.dict(|p| {
                    p.key("filename");
                    p.str(&f.filename);
                    p.key("line");
                    p.int(f.line.into());
                    p.key("name");
                    p.str(&f.name);
                });
            }
        })
    });
}

fn segment(p: &mut Pickler, s: &Segment) {
    p.dict(|p| {
        for (key, value) in [
            ("device", s.device as u64),
            ("address", s.address),
            ("total_size", s.total_size),
            ("stream", s.stream),
            ("allocated_size", s.allocated_size),
            ("active_size", s.active_size),
            ("requested_size", s.requested_size),
        ] {
            p.key(key);
            p.int(value.into());
        }
        p.key("segment_type");
        p.key(s.segment_type);
        p.key("is_expandable");
        p.bool(s.is_expandable);
        p.key("blocks");
        p.list(|p| {
            for b in &s.blocks {
                p.dict(|p| {
                    for (key, value) in [("address", b.address), ("size", b.size), ("requested_size", b.requested_size)]
                    {
                        p.key(key);
                        p.int(value.into());
                    }
                    p.key("state");
                    p.key(b.state);
                    p.key("frames");
                    stack(p, &b.frames);
                });
            }
        });
    });
}

fn entry(p: &mut Pickler, e: &TraceEntry) {
    p.dict(|p| {
        p.key("action");
        p.key(e.action);
        if let Some(addr) = e.addr {
            p.key("addr");
            p.int(addr.into());
        }
        for (key, value) in [("size", e.size), ("stream", e.stream), ("time_us", e.time_us)] {
            p.key(key);
            p.int(value.into());
        }
        p.key("frames");
        stack(p, &e.frames);
        if let Some(category) = e.category {
            p.key("category");
            p.key(category);
        }
        if let Some(free) = e.device_free {
            p.key("device_free");
            p.int(free.into());
        }
    });
}

/// A stack built: its return addresses, its statement and its frames.
type KnownStack = (Box<[u64]>, Option<StatementRef>, Stack);

/// Resolves return addresses to the user's frames once per address, and
/// builds each distinct stack once.
#[derive(Default)]
pub(super) struct Frames {
    resolved: FastMap<u64, Vec<Frame>>,
    /// By the hash of (addresses, statement): the stacks with that hash.
    stacks: FastMap<u64, Vec<KnownStack>>,
}

impl Frames {
    /// The frames of an allocation: its backtrace's user frames, with the
    /// profiled statement's line in the innermost frame of its function; or
    /// the statement alone without a backtrace.
    pub(super) fn of(&mut self, backtrace: Option<&Backtrace>, statement: Option<&StatementRef>) -> Stack {
        let addresses = backtrace.map_or(&[][..], |b| b.addresses());
        let mut hasher = FastHasher::default();
        addresses.hash(&mut hasher);
        statement.hash(&mut hasher);
        let hash = hasher.finish();
        let found = self.stacks.get(&hash).and_then(|same| {
            same.iter()
                .find(|(a, st, _)| **a == *addresses && st.as_ref() == statement)
                .map(|(_, _, stack)| stack.clone())
        });
        if let Some(stack) = found {
            return stack;
        }
        let stack: Stack = self.build(backtrace, statement).into();
        self.stacks.entry(hash).or_default().push((addresses.into(), statement.copied(), stack.clone()));
        stack
    }

    fn build(&mut self, backtrace: Option<&Backtrace>, statement: Option<&StatementRef>) -> Vec<SnapshotFrame> {
        let mut frames: Vec<Frame> = Vec::new();
        if let Some(bt) = backtrace {
            for &address in bt.addresses() {
                frames.extend(self.resolved.entry(address).or_insert_with(|| Frame::resolve(address)).iter().cloned());
            }
        }
        if let Some(st) = statement {
            // The profiled function's own frame gets the statement's line;
            // a helper it called, in the same file or not, keeps its own.
            let same_file = |f: &Frame| f.file.ends_with(st.file()) || st.file().ends_with(&f.file);
            match frames.iter_mut().find(|f| same_file(f) && same_function(&f.function, st.function())) {
                Some(frame) => frame.line = st.line,
                None => frames.insert(0, Frame::of_statement(st)),
            }
        }
        frames.into_iter().map(|f| SnapshotFrame { filename: f.file, line: f.line, name: f.function }).collect()
    }
}

/// Whether a frame's function (as the debug information names it:
/// `crate::module::f`, or `…::f::{{closure}}` for a closure inside it) is the
/// profiled function `profiled` (the macro's path: `module::f`, or
/// `Type::method` without generic arguments).
fn same_function(frame: &str, profiled: &str) -> bool {
    let frame = frame.split("::{{closure}}").next().unwrap_or(frame);
    // Generic arguments in the frame's path (`Holder<T>::make`) are not in the profiled name.
    let mut plain = String::with_capacity(frame.len());
    let mut depth = 0usize;
    for c in frame.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth = depth.saturating_sub(1),
            c if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    // `<T as Trait>::m` leaves `::m`: the method of a trait impl.
    plain == profiled
        || plain.ends_with(&format!("::{profiled}"))
        || profiled.ends_with(&format!("::{plain}"))
        || (plain.starts_with("::") && profiled.ends_with(&plain))
}

fn action_name(action: Action) -> &'static str {
    match action {
        Action::Alloc => "alloc",
        Action::FreeRequested => "free_requested",
        Action::FreeCompleted => "free_completed",
        Action::SegmentAlloc => "segment_alloc",
        Action::SegmentFree => "segment_free",
        Action::SegmentMap => "segment_map",
        Action::SegmentUnmap => "segment_unmap",
        Action::Oom => "oom",
    }
}

fn category(kind: Kind) -> &'static str {
    match kind {
        Kind::Parameter => "parameter",
        Kind::Gradient => "gradient",
        Kind::OptimizerState => "optimizer_state",
        Kind::Tensor => "other",
    }
}

pub(crate) fn capture(sources: &Model) -> Result<Snapshot> {
    let (history, stats) = events::history();
    let live = events::live();
    let cuda_devices = memlab_tch::cuda_device_count();
    let cpu_index = cuda_devices;
    let index_of = |device: Device| match device {
        Device::Cpu => Some(cpu_index),
        Device::Cuda(i) if i < cuda_devices => Some(i),
        Device::Cuda(_) => None,
    };
    // Names of what is alive now, by where its storage starts.
    let named = sources.collect()?;
    let mut names: FastMap<(Device, u64), Kind> = FastMap::default();
    for device in std::iter::once(Device::Cpu).chain((0..cuda_devices).map(Device::Cuda)) {
        for storage in named.storages(device) {
            if let Some(view) = storage.views.first() {
                names.insert((device, storage.data_ptr), view.kind);
            }
        }
    }
    let live_seq: FastMap<(Device, u64), u64> = live.iter().map(|a| ((a.device, a.address), a.seq)).collect();
    // What the walks at logged steps and monitor records saw, for what has died since.
    let seen = crate::named::seen::by_event();

    let mut frames = Frames::default();
    let mut traces: Vec<Vec<TraceEntry>> = vec![Vec::new(); cuda_devices + 1];
    // The frames of each allocation, for its frees.
    let mut allocated: FastMap<(Device, u64), Stack> = FastMap::default();
    for e in &history {
        let Some(index) = index_of(e.device) else { continue };
        let key = (e.device, e.address);
        let entry = |e: &Event, frames: Stack| TraceEntry {
            action: action_name(e.action),
            addr: Some(e.address),
            size: e.size,
            stream: e.stream,
            time_us: e.time_ns / 1000,
            frames,
            category: None,
            device_free: None,
        };
        match e.action {
            Action::Alloc => {
                let f = frames.of(e.backtrace.as_deref(), e.statement.as_ref());
                allocated.insert(key, f.clone());
                let alive = live_seq.get(&key) == Some(&e.seq);
                let kind = names.get(&key).filter(|_| alive).or_else(|| seen.get(&e.seq)).copied();
                traces[index].push(TraceEntry { category: Some(kind.map_or("other", category)), ..entry(e, f) });
            }
            Action::FreeRequested => {
                let f = allocated.get(&key).cloned().unwrap_or_default();
                traces[index].push(entry(e, f.clone()));
                if e.device == Device::Cpu {
                    // The CPU frees at once: its free completes with the request.
                    allocated.remove(&key);
                    traces[index].push(TraceEntry { action: "free_completed", ..entry(e, f) });
                }
            }
            Action::FreeCompleted => {
                let f = allocated.remove(&key).unwrap_or_default();
                traces[index].push(entry(e, f));
            }
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => {
                traces[index].push(entry(e, Stack::default()))
            }
            Action::Oom => traces[index].push(TraceEntry {
                addr: None,
                // PyTorch's reader needs the key: on the CPU, the host's
                // available memory when the request failed (0 where unknown).
                device_free: Some(e.address),
                ..entry(e, frames.of(e.backtrace.as_deref(), e.statement.as_ref()))
            }),
        }
    }

    // Segments: the caching allocator's own, blocks named by the live set.
    let live_frames: FastMap<(Device, u64), &events::LiveAllocation> =
        live.iter().map(|a| ((a.device, a.address), a)).collect();
    let mut segments = Vec::new();
    if cuda_devices > 0 {
        for s in memlab_tch::segments::cuda_segments()? {
            let device = Device::Cuda(s.device);
            let blocks = s
                .blocks
                .iter()
                .map(|b| Block {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: b.state.name(),
                    frames: live_frames
                        .get(&(device, b.address))
                        .map(|a| frames.of(a.backtrace.as_deref(), a.statement.as_ref()))
                        .unwrap_or_default(),
                })
                .collect();
            segments.push(Segment {
                device: s.device,
                address: s.address,
                total_size: s.total_size,
                stream: s.stream,
                segment_type: if s.is_large { "large" } else { "small" },
                allocated_size: s.allocated_size,
                active_size: s.active_size,
                requested_size: s.requested_size,
                is_expandable: s.is_expandable,
                blocks,
            });
        }
    }
    for a in live.iter().filter(|a| a.device == Device::Cpu) {
        let block = Block {
            address: a.address,
            size: a.size,
            requested_size: a.size,
            state: "active_allocated",
            frames: frames.of(a.backtrace.as_deref(), a.statement.as_ref()),
        };
        segments.push(Segment {
            device: cpu_index,
            address: a.address,
            total_size: a.size,
            stream: 0,
            segment_type: if a.size > 1 << 20 { "large" } else { "small" },
            allocated_size: a.size,
            active_size: a.size,
            requested_size: a.size,
            is_expandable: false,
            blocks: vec![block],
        });
    }
    let mut devices: Vec<String> = (0..cuda_devices).map(|i| Device::Cuda(i).to_string()).collect();
    devices.push(Device::Cpu.to_string());
    Ok(Snapshot {
        segments,
        device_traces: traces,
        memlab: SnapshotInfo {
            devices,
            partial: stats.dropped > 0 || stats.untracked > 0,
            dropped: stats.dropped,
            recorded: stats.recorded,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::same_function;

    #[test]
    fn a_frame_is_the_profiled_function_by_its_path() {
        assert!(same_function("train::step", "train::step"));
        assert!(same_function("mycrate::train::step", "train::step"));
        assert!(same_function("train::step::{{closure}}", "train::step"));
        assert!(same_function("demo::Holder<f32>::make", "demo::Holder::make"));
        assert!(same_function("<demo::Net as demo::Step>::step", "demo::Net::step"));
        assert!(!same_function("train::helper", "train::step"));
        assert!(!same_function("train::step_twice", "train::step"));
    }
}
