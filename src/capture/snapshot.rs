//! PyTorch's memory snapshot captured from this process: CUDA's segments
//! from the caching allocator's own snapshot, the CPU's live allocations as
//! one-block segments, memlab's events as the device traces, each
//! allocation's category named by the walk over the model.

use memlab_core::export::{
    AllocatorSettings, Block, BlockState, Category, DeviceBytes, DeviceMemory, Frames, Segment, SegmentType, Snapshot,
    SnapshotFrame, SnapshotInfo, Stack, TraceEntry,
};
use memlab_core::hash::FastMap;

use memlab_core::events::{self, Action, Event};
use memlab_core::{Device, Result};

use crate::named::Model;
use memlab_core::{Report, TensorKind};

/// The site of an allocation whose backtrace has no frame of the user's code.
const OUTSIDE: &str = "outside the user's code (libtorch's own threads and workspaces, such as backward's)";

pub(crate) fn capture(sources: &Model) -> Result<Snapshot> {
    let (history, stats) = events::history();
    // The CPU allocator's figures read with the live set, under the
    // recorder's lock: what it counts beyond the live set was allocated
    // before the recording began (memlab's CPU segments are the live set).
    let (live, cpu_now) = events::live_with(|| {
        let mut raw = memlab_core::stats::RawStats::default();
        memlab_core::Backend::sample(&memlab_tch::BACKEND, Device::Cpu, &mut raw, false).map(|()| raw.to_device_stats())
    });
    let seen_cpu: u64 = live.iter().filter(|a| a.device == Device::Cpu).map(|a| a.size).sum();
    let unseen_cpu =
        cpu_now.map_or(0, |s| u64::try_from(s.allocated_bytes.all.current).unwrap_or(0).saturating_sub(seen_cpu));
    let cuda_devices = memlab_tch::cuda_device_count();
    let cpu_index = cuda_devices;
    let index_of = |device: Device| match device {
        Device::Cpu => Some(cpu_index),
        Device::Cuda(i) if i < cuda_devices => Some(i),
        Device::Cuda(_) => None,
    };
    // Names of what is alive now, by where its storage starts.
    let named = sources.collect()?;
    let mut names: FastMap<(Device, u64), (TensorKind, &str)> = FastMap::default();
    for device in std::iter::once(Device::Cpu).chain((0..cuda_devices).map(Device::Cuda)) {
        for storage in named.storages(device) {
            if let Some(view) = storage.views.first() {
                names.insert((device, storage.data_ptr), (view.kind, view.name.as_str()));
            }
        }
    }
    // The caching allocator's segments, read once: the snapshot's, and what
    // sizes libtorch's BLAS workspaces, named by what they are for.
    let cuda_segments = if cuda_devices > 0 { memlab_tch::segments::cuda_segments()? } else { Vec::new() };
    let tables = memlab_tch::segments::blas_workspaces().unwrap_or_default();
    let workspaces: FastMap<(Device, u64), String> = crate::attribution::sized_workspaces(&tables, &cuda_segments)
        .into_iter()
        .map(|(device, w)| ((Device::Cuda(device), w.address), w.label))
        .collect();
    let live_seq: FastMap<(Device, u64), u64> = live.iter().map(|a| ((a.device, a.address), a.seq)).collect();
    // What the walks at logged steps and monitor records saw, for what has died since.
    let seen = crate::named::seen::by_event();

    let mut frames = Frames::default();
    // An allocation whose backtrace holds no frame of the user's code.
    let outside: Stack =
        std::sync::Arc::from(vec![SnapshotFrame { filename: String::new(), line: 0, name: OUTSIDE.to_string() }]);
    let mut traces: Vec<Vec<TraceEntry>> = vec![Vec::new(); cuda_devices + 1];
    // The frames of each allocation, for its frees.
    let mut allocated: FastMap<(Device, u64), Stack> = FastMap::default();
    for e in &history {
        let Some(index) = index_of(e.device) else { continue };
        let key = (e.device, e.address);
        match e.action {
            Action::Alloc => {
                let mut f = frames.of(e.backtrace.as_deref(), e.statement.as_ref());
                if f.is_empty() && e.backtrace.is_some() {
                    f = outside.clone();
                }
                allocated.insert(key, f.clone());
                let alive = live_seq.get(&key) == Some(&e.seq);
                let named = names.get(&key).filter(|_| alive);
                let kind = named.map(|(kind, _)| kind).or_else(|| seen.get(&e.seq)).copied();
                let workspace = workspaces.get(&key).filter(|_| alive && named.is_none());
                let (category, tensor) = match (named, workspace) {
                    (Some((_, name)), _) => (kind.map_or(Category::Unnamed, Category::from), Some((*name).into())),
                    (None, Some(label)) => (Category::Workspace, Some(label.as_str().into())),
                    (None, None) => (kind.map_or(Category::Unnamed, Category::from), None),
                };
                traces[index].push(TraceEntry { category: Some(category), tensor, ..entry(e, f) });
            }
            Action::FreeRequested => {
                let f = allocated.get(&key).cloned().unwrap_or_default();
                traces[index].push(entry(e, f.clone()));
                if e.device == Device::Cpu {
                    // The CPU frees at once: its free completes with the request.
                    allocated.remove(&key);
                    traces[index].push(TraceEntry { action: Action::FreeCompleted, ..entry(e, f) });
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
    for s in &cuda_segments {
        let device = Device::Cuda(s.device);
        segments.push(segment(s, |address| {
            live_frames
                .get(&(device, address))
                .map(|a| frames.of(a.backtrace.as_deref(), a.statement.as_ref()))
                .unwrap_or_default()
        }));
    }
    for a in live.iter().filter(|a| a.device == Device::Cpu) {
        let block = Block {
            address: a.address,
            size: a.size,
            requested_size: a.size,
            state: BlockState::ActiveAllocated,
            frames: frames.of(a.backtrace.as_deref(), a.statement.as_ref()),
        };
        segments.push(Segment {
            device: cpu_index,
            address: a.address,
            total_size: a.size,
            stream: 0,
            segment_type: if a.size > 1 << 20 { SegmentType::Large } else { SegmentType::Small },
            allocated_size: a.size,
            active_size: a.size,
            requested_size: a.size,
            is_expandable: false,
            blocks: vec![block],
        });
    }
    let mut devices: Vec<String> = (0..cuda_devices).map(|i| Device::Cuda(i).to_string()).collect();
    devices.push(Device::Cpu.to_string());
    let (allocator_settings, device_memory) = cuda_allocators(cuda_devices);
    let ops = memlab_tch::ops::watched().map(|ops| memlab_core::export::ops::that_allocate(ops, &traces));
    Ok(Snapshot {
        segments,
        device_traces: traces,
        allocator_settings,
        memlab: Some(SnapshotInfo {
            devices,
            partial: stats.dropped > 0 || stats.untracked > 0,
            dropped: stats.dropped,
            recorded: stats.recorded,
            run: Some(crate::run::this_process()),
            device_memory,
            profile: Some(Report::collect()).filter(|p| p.functions.iter().any(|f| f.calls > 0)),
            ops,
            unseen_before: (unseen_cpu > 0 && events::is_active())
                .then(|| DeviceBytes { device: Device::Cpu.to_string(), bytes: unseen_cpu })
                .into_iter()
                .collect(),
            prediction_inputs: None,
        }),
    })
}

/// The CUDA caching allocator's settings, in the shape PyTorch's snapshots
/// give them (`allocator_settings`), and each device's memory and fraction:
/// what a replay needs to run the allocator as it ran. Nothing while the
/// allocator does not exist (no CUDA memory was ever allocated); a device
/// whose figures cannot be read is left out, with a warning, and its
/// replay says what it assumed.
pub(crate) fn cuda_allocators(cuda_devices: usize) -> (Option<AllocatorSettings>, Vec<DeviceMemory>) {
    let mut settings = None;
    let mut memory = Vec::new();
    for i in 0..cuda_devices {
        match memlab_tch::cuda_allocator_settings(i) {
            Ok(Some(s)) => {
                settings.get_or_insert_with(|| AllocatorSettings {
                    conf: Some(s.conf.clone()),
                    max_split_size: Some(i128::from(s.max_split_size)),
                    garbage_collection_threshold: Some(s.garbage_collection_threshold),
                    expandable_segments: Some(s.expandable_segments),
                    // Keyed by each bucket's start in MiB, as PyTorch writes them.
                    roundup_power2_divisions: Some(
                        s.roundup_power2_divisions
                            .iter()
                            .enumerate()
                            .map(|(bucket, &d)| ((1u64 << bucket).to_string(), d))
                            .collect(),
                    ),
                    ..AllocatorSettings::default()
                });
                memory.push(DeviceMemory {
                    device: Device::Cuda(i).to_string(),
                    total: s.total_memory,
                    memory_fraction: s.memory_fraction,
                });
            }
            Ok(None) => {}
            Err(e) => memlab_core::output::warn(&format!(
                "memlab: the snapshot goes without cuda:{i}'s allocator settings and memory, which a replay of it \
                 then assumes: {e}\n"
            )),
        }
    }
    (settings, memory)
}

/// Event `e` as an entry of a device's trace, with `frames`.
pub(crate) fn entry(e: &Event, frames: Stack) -> TraceEntry {
    TraceEntry {
        action: e.action,
        addr: Some(e.address),
        size: e.size,
        stream: e.stream,
        time_us: e.time_ns / 1000,
        frames,
        category: None,
        tensor: None,
        device_free: None,
    }
}

/// The caching allocator's segment `s` as the snapshot lists it, each
/// block with the frames `frames_of` gives for its address.
pub(crate) fn segment(s: &memlab_tch::segments::CudaSegment, mut frames_of: impl FnMut(u64) -> Stack) -> Segment {
    Segment {
        device: s.device,
        address: s.address,
        total_size: s.total_size,
        stream: s.stream,
        segment_type: if s.is_large { SegmentType::Large } else { SegmentType::Small },
        allocated_size: s.allocated_size,
        active_size: s.active_size,
        requested_size: s.requested_size,
        is_expandable: s.is_expandable,
        blocks: s
            .blocks
            .iter()
            .map(|b| Block {
                address: b.address,
                size: b.size,
                requested_size: b.requested_size,
                state: b.state,
                frames: frames_of(b.address),
            })
            .collect(),
    }
}
