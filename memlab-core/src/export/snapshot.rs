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

use crate::hash::{FastHasher, FastMap};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use super::pickle::Pickler;
use crate::events::{Action, Backtrace, Frame, LiveAllocation, StatementRef};
use crate::{Error, Result};

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

/// Declares an enum whose variants are written as PyTorch's snapshot writes
/// them (`snake_case`), with `as_str`, `Display`, and comparison with the
/// written name (`entry.action == "alloc"`).
macro_rules! snapshot_names {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)*
        }

        impl $name {
            /// Every value, in the order declared.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The name PyTorch's snapshot gives it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }

            /// The value PyTorch's snapshot names `name`, if any.
            pub fn from_name(name: &str) -> Option<$name> {
                $name::ALL.iter().copied().find(|v| v.as_str() == name)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }
    };
}

snapshot_names! {
    /// The state of a block of a segment.
    BlockState {
        /// Allocated to a tensor.
        ActiveAllocated => "active_allocated",
        /// Freed, waiting for the streams that used it.
        ActivePendingFree => "active_pending_free",
        /// Free.
        Inactive => "inactive",
    }
}

snapshot_names! {
    /// The pool a segment belongs to.
    SegmentType {
        /// Blocks of at most 1 MiB (2 MiB segments).
        Small => "small",
        /// Larger blocks.
        Large => "large",
    }
}

snapshot_names! {
    /// What an allocation is, as memory_viz colours it: memlab's kinds of
    /// named tensor ([`TensorKind`](crate::TensorKind), by the same names)
    /// and `unnamed`, then the categories of PyTorch's memory profiler, which
    /// its own snapshots carry.
    Category {
        /// A trainable variable of a var store.
        Parameter => "parameter",
        /// A variable of a var store that is not trained.
        Buffer => "buffer",
        /// A gradient.
        Gradient => "gradient",
        /// Optimizer state.
        OptimizerState => "optimizer_state",
        /// A tensor added or registered by name.
        Tensor => "tensor",
        /// Memory no named tensor holds (memlab).
        Unnamed => "unnamed",
        /// A buffer libtorch keeps for a library, named by it (memlab: a
        /// cuBLAS or cuBLASLt workspace).
        Workspace => "workspace",
        /// A model's input (PyTorch's profiler).
        Input => "input",
        /// A short-lived tensor (PyTorch's profiler).
        Temporary => "temporary",
        /// A forward activation kept for backward (PyTorch's profiler).
        Activation => "activation",
        /// Autograd's own bookkeeping (PyTorch's profiler).
        AutogradDetail => "autograd_detail",
        /// Not categorised (PyTorch's profiler).
        Unknown => "unknown",
    }
}

/// A named tensor's category: its kind, by the same name.
impl From<crate::TensorKind> for Category {
    fn from(kind: crate::TensorKind) -> Category {
        use crate::TensorKind;
        match kind {
            TensorKind::Parameter => Category::Parameter,
            TensorKind::Buffer => Category::Buffer,
            TensorKind::Gradient => Category::Gradient,
            TensorKind::OptimizerState => Category::OptimizerState,
            TensorKind::Tensor => Category::Tensor,
        }
    }
}

/// A block of a segment.
#[derive(Clone, Debug, Serialize)]
pub struct Block {
    /// Its address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// What the tensor asked for (0 when free).
    pub requested_size: u64,
    /// Allocated, freed but waiting for a stream, or free.
    pub state: BlockState,
    /// Where it was allocated, innermost first (empty when unknown).
    pub frames: Stack,
}

/// A segment: memory the allocator obtained at once.
#[derive(Clone, Debug, Serialize)]
pub struct Segment {
    /// The index of its device in `device_traces`.
    pub device: usize,
    /// Its address.
    pub address: u64,
    /// Its size.
    pub total_size: u64,
    /// The stream it serves (0 on the CPU).
    pub stream: u64,
    /// Which pool it belongs to: small or large (blocks over 1 MiB).
    pub segment_type: SegmentType,
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
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
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
    /// For `alloc`: what the memory is (named by the walk over the model at
    /// export time for allocations still alive then, else by the walks at
    /// each `StepLogger` step or `TrainingMonitor` record that saw it alive).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub category: Option<Category>,
    /// For `alloc`: the tensor's name (`fc1.weight`, the first of its views)
    /// when the walk over named tensors at export found this allocation
    /// still alive then. memlab's key `tensor`; PyTorch's snapshots have none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<Box<str>>,
    /// For `oom`: what the device still had free (the CPU: the host's
    /// available memory, 0 where unknown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

impl TraceEntry {
    /// An event of `size` bytes at `addr` at `time_us`, on stream 0, with
    /// no frames, category, tensor name or free memory.
    pub fn new(action: Action, addr: Option<u64>, size: u64, time_us: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us,
            frames: Stack::default(),
            category: None,
            tensor: None,
            device_free: None,
        }
    }
}

/// What memlab adds to the snapshot (PyTorch's readers ignore it).
#[derive(Clone, Debug, Default, Serialize)]
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
    /// The process that wrote the file: rank, host, pid, the wall-clock
    /// time of its clock zero (the traces' `time_us` count from it),
    /// libtorch's version, its CUDA devices' UUIDs.
    pub run: Option<crate::run::RunInfo>,
    /// Each CUDA device's memory and memory fraction when the snapshot was
    /// taken: what a replay of the allocator needs beside its settings.
    pub device_memory: Vec<DeviceMemory>,
    /// The line profile at export, when a profiled function ran: the data
    /// (not a rendering), so a reader renders it as the program would have.
    pub profile: Option<crate::report::Report>,
    /// The ops whose CUDA kernels allocate otherwise than their CPU kernels,
    /// where the recording watched them
    /// ([`Settings::ops`](crate::events::Settings::ops)); `None` where it
    /// did not.
    pub ops: Option<Vec<crate::ops::OpRecord>>,
    /// Per device, bytes allocated before the recording began and still
    /// allocated at export, which neither the history nor the segments
    /// show: memlab's CPU segments are the allocations it saw made. Their
    /// allocator counts them (a trace's figures, walked back from it, do).
    pub unseen_before: Vec<DeviceBytes>,
    /// What a prediction from the recorded steps takes beside their
    /// history, where `memlab::WillItFit::save` wrote the file: `memlab
    /// replay --as-cuda` then predicts from it what the program did.
    pub prediction_inputs: Option<PredictionInputs>,
}

/// What lived before a CPU recording's steps and how they ran, as a
/// prediction from them takes it ([`crate::replay::PredictOptions`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PredictionInputs {
    /// Blocks live before the history (address, bytes), in the order a CUDA
    /// run made them: the weights, the gradients, the optimizer's state.
    pub live_before: Vec<(u64, u64)>,
    /// Where a step ran before the history: after how many of
    /// `live_before`'s blocks its cuBLAS workspaces came.
    pub workspaces_after: Option<usize>,
    /// Where the allocator's cache was given back between parts of the
    /// history (microseconds, the history's clock; files written before
    /// there could be several give one number).
    #[serde(deserialize_with = "one_or_many")]
    pub empty_cache_at_us: Vec<u64>,
    /// The CPU's peak allocated in each step.
    pub step_peaks: Vec<u64>,
    /// What CUDA adds, where the program said otherwise than the defaults
    /// (how its RNN weights reach cuDNN, another card's libraries): a
    /// `replay::CudaAdditions` as it serializes, which the replay reads
    /// back (the export layer knows nothing of the replay's types).
    pub additions: Option<serde_json::Value>,
    /// The model's construction, where the program recorded it
    /// (`memlab::record_construction`): the weights are then made as a CUDA
    /// run makes them, temporaries and all, before `live_before`'s others.
    pub construction: Option<Construction>,
}

/// Reads `PredictionInputs::empty_cache_at_us` as written now (a list)
/// or before (one number, or none).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<u64>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Written {
        One(u64),
        Many(Vec<u64>),
    }
    let written: Option<Written> = serde::Deserialize::deserialize(d)?;
    Ok(match written {
        None => Vec::new(),
        Some(Written::One(us)) => vec![us],
        Some(Written::Many(all)) => all,
    })
}

/// A model's construction as the CPU recorded it: what it allocated and
/// freed, in order, which a prediction makes again as a CUDA run would.
///
/// Where each weight lands decides what the steps share with it: a
/// construction's temporaries, and the LSTM and GRU weights tch copies into
/// one buffer on CUDA, leave holes the steps fill.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Construction {
    /// Each allocation and free, in order.
    pub events: Vec<Made>,
    /// Each LSTM's and GRU's weights (addresses, in the order they were
    /// made): on a CUDA `VarStore`, tch's `nn::lstm` and `nn::gru` copy them
    /// into one buffer of their bytes right after the last is made and free
    /// them (`_cudnn_rnn_flatten_weight`), which the CPU does not.
    pub rnns: Vec<Vec<u64>>,
}

/// An allocation or a free of a [`Construction`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Made {
    /// The block's address.
    pub address: u64,
    /// Its bytes.
    pub bytes: u64,
    /// A free (else an allocation).
    pub freed: bool,
}

impl Construction {
    /// The blocks allocated and not freed, by address, with the index of
    /// the event that made each.
    pub fn live(&self) -> std::collections::BTreeMap<u64, (usize, u64)> {
        let mut live = std::collections::BTreeMap::new();
        for (i, e) in self.events.iter().enumerate() {
            if e.freed {
                live.remove(&e.address);
            } else {
                live.insert(e.address, (i, e.bytes));
            }
        }
        live
    }
}

/// Bytes of one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct DeviceBytes {
    /// `cpu`, `cuda:0`.
    pub device: String,
    /// The bytes.
    pub bytes: u64,
}

/// A CUDA device's memory as its caching allocator saw it.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct DeviceMemory {
    /// `cuda:0`.
    pub device: String,
    /// The device's memory (`totalGlobalMem`).
    pub total: u64,
    /// Its memory fraction (`set_per_process_memory_fraction`; 1: none).
    pub memory_fraction: f64,
}

/// The CUDA caching allocator's settings as a snapshot records them
/// (`allocator_settings`, PyTorch 2.5 and later): the environment's
/// `PYTORCH_CUDA_ALLOC_CONF` as written, then the values libtorch held,
/// which win where they differ (a setting changed at run time shows there),
/// every key libtorch 2.11 writes typed.
/// A key a newer PyTorch adds (2.13's `max_round_threshold` and
/// `max_cached_size`, for pinned host memory), and a value not of the type
/// libtorch writes, are kept as read in `other` and written back; the
/// replay refuses a known key whose value it cannot read, naming it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AllocatorSettings {
    /// The settings string, as `PYTORCH_CUDA_ALLOC_CONF` held it.
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF", skip_serializing_if = "Option::is_none")]
    pub conf: Option<String>,
    /// `max_split_size` in bytes, as libtorch writes its `size_t` in an
    /// `int64_t`: -1 for no limit (PyTorch's), or 2^64 − 1 (memlab's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_split_size: Option<i128>,
    /// `garbage_collection_threshold` (0: off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub garbage_collection_threshold: Option<f64>,
    /// `expandable_segments`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expandable_segments: Option<bool>,
    /// `roundup_power2_divisions`, keyed by each bucket's start in MiB as
    /// PyTorch writes them (`"1"`, `"2"`, … `"32768"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roundup_power2_divisions: Option<std::collections::BTreeMap<String, u64>>,
    /// `release_lock_on_cudamalloc`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release_lock_on_cudamalloc: Option<bool>,
    /// `pinned_use_cuda_host_register`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_use_cuda_host_register: Option<bool>,
    /// `pinned_num_register_threads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_num_register_threads: Option<u64>,
    /// `graph_capture_record_stream_reuse`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_capture_record_stream_reuse: Option<bool>,
    /// Every other key, as read.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

impl AllocatorSettings {
    /// The settings from a snapshot's plain data (a dict): each key libtorch
    /// 2.11 writes taken as its type where it is of it, everything else kept
    /// in `other`. `None` where the data is not a dict.
    pub fn from_json(value: serde_json::Value) -> Option<AllocatorSettings> {
        let serde_json::Value::Object(map) = value else { return None };
        let mut settings = AllocatorSettings::default();
        for (key, value) in map {
            let taken = match key.as_str() {
                "PYTORCH_CUDA_ALLOC_CONF" => value.as_str().map(|c| settings.conf = Some(c.to_string())),
                "max_split_size" => value
                    .as_i64()
                    .map(i128::from)
                    .or_else(|| value.as_u64().map(i128::from))
                    .map(|n| settings.max_split_size = Some(n)),
                "garbage_collection_threshold" => {
                    value.as_f64().map(|t| settings.garbage_collection_threshold = Some(t))
                }
                "expandable_segments" => value.as_bool().map(|e| settings.expandable_segments = Some(e)),
                "release_lock_on_cudamalloc" => value.as_bool().map(|b| settings.release_lock_on_cudamalloc = Some(b)),
                "pinned_use_cuda_host_register" => {
                    value.as_bool().map(|b| settings.pinned_use_cuda_host_register = Some(b))
                }
                "pinned_num_register_threads" => value.as_u64().map(|n| settings.pinned_num_register_threads = Some(n)),
                "graph_capture_record_stream_reuse" => {
                    value.as_bool().map(|b| settings.graph_capture_record_stream_reuse = Some(b))
                }
                "roundup_power2_divisions" => {
                    serde_json::from_value(value.clone()).ok().map(|d| settings.roundup_power2_divisions = Some(d))
                }
                _ => None,
            };
            // null is "not set", as libtorch writes an unset value.
            if taken.is_none() && !value.is_null() {
                settings.other.insert(key, value);
            }
        }
        Some(settings)
    }

    /// The settings as plain data, as the snapshot holds them.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// A PyTorch memory snapshot of memlab's recording.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// The allocators' segments now.
    pub segments: Vec<Segment>,
    /// Per device (see [`SnapshotInfo::devices`]): its events, oldest first.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The CUDA caching allocator's settings as libtorch held them, as
    /// PyTorch's snapshots give them; `None` where the file has none
    /// (PyTorch before 2.5; memlab before it recorded them, or without
    /// CUDA).
    pub allocator_settings: Option<AllocatorSettings>,
    /// memlab's notes on the data: `None` in PyTorch's own snapshots.
    pub memlab: Option<SnapshotInfo>,
}

impl Snapshot {
    /// The device of each index of `device_traces` (and of a segment's
    /// `device`): memlab's names (`cuda:0`, …, `cpu`), or for PyTorch's own
    /// snapshots, which trace CUDA devices only, `cuda:N` for index N.
    pub fn devices(&self) -> Vec<String> {
        match &self.memlab {
            Some(info) => info.devices.clone(),
            None => {
                let segments = self.segments.iter().map(|s| s.device + 1).max().unwrap_or(0);
                (0..self.device_traces.len().max(segments)).map(|i| format!("cuda:{i}")).collect()
            }
        }
    }

    /// The snapshot as a pickle, as `torch.cuda.memory._dump_snapshot`
    /// writes it.
    pub fn to_pickle(&self) -> Result<Vec<u8>> {
        let as_data = |what: &str, e: serde_json::Error| Error::Backend(format!("{what} as data: {e}"));
        let profile = self.memlab.as_ref().and_then(|m| m.profile.as_ref()).map(serde_json::to_value);
        let profile = profile.transpose().map_err(|e| as_data("the line profile", e))?;
        let run = self.memlab.as_ref().and_then(|m| m.run.as_ref()).map(serde_json::to_value);
        let run = run.transpose().map_err(|e| as_data("the run", e))?;
        let device_memory = self.memlab.as_ref().map(|m| &m.device_memory).map(serde_json::to_value);
        let device_memory =
            device_memory.transpose().map_err(|e| as_data("the devices' memory", e))?.unwrap_or_default();
        let ops = self.memlab.as_ref().map(|m| serde_json::to_value(&m.ops)).transpose();
        let ops = ops.map_err(|e| as_data("the ops", e))?.unwrap_or_default();
        let unseen_before = self.memlab.as_ref().map(|m| serde_json::to_value(&m.unseen_before)).transpose();
        let unseen_before = unseen_before.map_err(|e| as_data("the bytes unseen before", e))?.unwrap_or_default();
        let inputs = self.memlab.as_ref().and_then(|m| m.prediction_inputs.as_ref()).map(serde_json::to_value);
        let inputs = inputs.transpose().map_err(|e| as_data("the prediction's inputs", e))?;
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
            if let Some(settings) = &self.allocator_settings {
                p.str("allocator_settings");
                p.json(&settings.to_json());
            }
            if let Some(memlab) = &self.memlab {
                p.str("memlab");
                p.dict(|p| {
                    p.str("devices");
                    p.list(|p| memlab.devices.iter().for_each(|d| p.str(d)));
                    p.str("partial");
                    p.bool(memlab.partial);
                    p.str("dropped");
                    p.int(memlab.dropped.into());
                    p.str("recorded");
                    p.int(memlab.recorded.into());
                    if let Some(run) = &run {
                        p.str("run");
                        p.json(run);
                    }
                    if !memlab.device_memory.is_empty() {
                        p.str("device_memory");
                        p.json(&device_memory);
                    }
                    if memlab.ops.is_some() {
                        p.str("ops");
                        p.json(&ops);
                    }
                    if !memlab.unseen_before.is_empty() {
                        p.str("unseen_before");
                        p.json(&unseen_before);
                    }
                    if let Some(inputs) = &inputs {
                        p.str("prediction_inputs");
                        p.json(inputs);
                    }
                    if let Some(profile) = &profile {
                        // As plain dicts and lists, which Python reads too.
                        p.str("profile");
                        p.json(profile);
                    }
                });
            }
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
        p.key(s.segment_type.as_str());
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
                    p.key(b.state.as_str());
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
        p.key(e.action.as_str());
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
            p.key(category.as_str());
        }
        if let Some(tensor) = &e.tensor {
            p.key("tensor");
            p.str(tensor);
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
pub struct Frames {
    resolved: FastMap<u64, Vec<Frame>>,
    /// By the hash of (addresses, statement): the stacks with that hash.
    stacks: FastMap<u64, Vec<KnownStack>>,
}

impl Frames {
    /// The frames of an allocation: its backtrace's user frames, with the
    /// profiled statement's line in the innermost frame of its function; or
    /// the statement alone without a backtrace.
    pub fn of(&mut self, backtrace: Option<&Backtrace>, statement: Option<&StatementRef>) -> Stack {
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
        let user: Vec<SnapshotFrame> =
            frames.into_iter().map(|f| SnapshotFrame { filename: f.file, line: f.line, name: f.function }).collect();
        match backtrace {
            Some(bt) => with_native(user, native_frames(bt)),
            None => user,
        }
    }
}

/// Where a live allocation was made, as a snapshot of it names it (see
/// [`frames::site`](super::frames::site)): what libtorch made it for, where
/// its native frames say so (a cuDNN or cuBLAS workspace); else its
/// innermost frame of the user's code or its profiled statement
/// ([`LiveAllocation::site`]); else, for a stack with no frame of the user's,
/// what made it (`autograd's backward pass (ConvolutionBackward0)`). `None`
/// without a backtrace or a statement.
pub fn site_of(allocation: &LiveAllocation) -> Option<String> {
    let Some(backtrace) = allocation.backtrace.as_deref() else { return allocation.site() };
    let native = native_frames(backtrace);
    if let Some((purpose, _)) = super::frames::Purpose::found(&native) {
        return Some(purpose.name().to_string());
    }
    allocation.site().or_else(|| (!native.is_empty()).then(|| super::frames::made_by(&native).to_string()))
}

/// A backtrace's frames that the symbol tables name, innermost first, as
/// PyTorch writes native frames (no file, line 0).
fn native_frames(backtrace: &Backtrace) -> Vec<SnapshotFrame> {
    backtrace
        .functions()
        .into_iter()
        .flatten()
        .map(|name| SnapshotFrame { filename: NATIVE_FILE.to_string(), line: 0, name: name.to_string() })
        .collect()
}

/// The file PyTorch's snapshots give a native frame.
const NATIVE_FILE: &str = "??";

/// An allocation's stack as a snapshot keeps it, from its frames of the
/// user's code and its native ones: the user's frames, led by the native
/// frame that says what libtorch made it for where one does
/// ([`Purpose`](super::frames::Purpose): a cuDNN or cuBLAS workspace made
/// under the user's line); with no frame of the user's, its native frames,
/// which say what made it (autograd's backward op on its engine's thread;
/// see [`frames::site`](super::frames::site)).
fn with_native(user: Vec<SnapshotFrame>, native: Vec<SnapshotFrame>) -> Vec<SnapshotFrame> {
    if let Some((_, said)) = super::frames::Purpose::found(&native) {
        return std::iter::once(said.clone()).chain(user).collect();
    }
    if user.is_empty() {
        return native;
    }
    user
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

#[cfg(test)]
mod tests {
    use super::{same_function, with_native, SnapshotFrame};
    use crate::export::frames::site;

    fn native(name: &str) -> SnapshotFrame {
        SnapshotFrame { filename: "??".into(), line: 0, name: name.into() }
    }

    /// What a stack keeps of its native frames: the one that says what
    /// libtorch made an allocation for, ahead of the user's line; all of
    /// them where the user has no frame; none otherwise.
    #[test]
    fn native_frames_name_what_the_users_frames_cannot() {
        let user = vec![SnapshotFrame { filename: "/p/src/main.rs".into(), line: 12, name: "net::forward".into() }];
        let conv = vec![
            native("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)"),
            native("at::native::run_conv_plan(cudnnContext*, at::Tensor const&, at::Tensor const&, at::Tensor const&)"),
            native("at::native::run_single_conv(cudnnBackendDescriptorType_t, at::Tensor const&)"),
            native("at::_ops::convolution::call(at::Tensor const&)"),
        ];
        let stack = with_native(user.clone(), conv.clone());
        assert_eq!((stack.len(), &stack[1..]), (2, &user[..]), "the purpose's frame, then the user's");
        assert_eq!(site(&stack).map(|s| s.0).as_deref(), Some("libtorch's cuDNN workspace"));
        let output = &conv[2..];
        assert_eq!(with_native(user.clone(), output.to_vec()), user, "an op's output keeps the user's line");
        let backward = vec![
            native("at::empty_strided(c10::ArrayRef<long>)"),
            native("torch::autograd::generated::ConvolutionBackward0::apply(std::vector<at::Tensor>&&)"),
            native("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"),
            native("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
            native("start_thread"),
        ];
        let stack = with_native(Vec::new(), backward.clone());
        assert_eq!(stack, backward);
        assert_eq!(site(&stack).map(|s| s.0).as_deref(), Some("autograd's backward pass (ConvolutionBackward0)"));
        assert!(with_native(Vec::new(), Vec::new()).is_empty());
    }

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
