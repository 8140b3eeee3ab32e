//! The models of a recording as files other tools open, and their writers,
//! with no libtorch: PyTorch's memory snapshot (a pickle that
//! pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read),
//! trace events (JSON for ui.perfetto.dev and chrome://tracing), and one
//! self-contained HTML page. Capturing them from a live process is the
//! `memlab` crate's; the models, their vocabulary (the enums of
//! [`BlockState`], [`SegmentType`], [`Category`], and the events'
//! [`Action`](crate::events::Action), written as PyTorch writes them) and the walk of a history into counters are here, so
//! that a program without libtorch can build, write and later read them.
//!
//! The models are plain data whose fields mirror the files (PyTorch's
//! snapshot fixes most of them): build them with struct expressions.

pub mod analysis;
pub mod frames;
mod html;
pub mod ops;
mod pickle;
mod read;
mod snapshot;
pub mod summary;
mod trace;
mod unpickle;

pub use html::{DeviceTimeline, FlameNode, HtmlReport, PeakRow, Point};
pub use pickle::PROTOCOL as PICKLE_PROTOCOL;
pub use read::{check_figures, SnapshotFile};
pub use snapshot::{
    site_of, AllocatorSettings, Block, BlockState, Category, Construction, DeviceBytes, DeviceMemory, Frames, Made,
    PredictionInputs, Segment, SegmentType, Snapshot, SnapshotFrame, SnapshotInfo, Stack, TraceEntry,
};
pub use trace::{
    Anchor, InstantScope, Level, Oom, Phase, Sample, Trace, TraceArgs, TraceEvent, TraceFile, TraceInfo, TraceWriter,
};

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::events::{Action, Event, Stats};
    use crate::{Device, DeviceStats};

    #[test]
    fn the_vocabulary_is_written_as_pytorch_writes_it() {
        for action in Action::ALL {
            let json = serde_json::to_string(action).unwrap();
            assert_eq!(json, format!("\"{action}\""));
            assert_eq!(Action::from_name(action.as_str()), Some(*action));
            assert_eq!(Action::from_code(action.code()), Some(*action));
        }
        assert_eq!(Action::ALL.len(), 8);
        assert_eq!((Action::from_code(8), Action::from_code(-1)), (None, None));
        assert_eq!(BlockState::ActivePendingFree, "active_pending_free");
        assert_eq!(SegmentType::Large.to_string(), "large");
        assert_eq!(serde_json::to_string(&Category::OptimizerState).unwrap(), "\"optimizer_state\"");
        assert_eq!(Category::from_name("weights"), None);
        // A named tensor's category has its kind's name; unnamed memory has one name too.
        for kind in crate::TensorKind::ALL {
            assert_eq!(Category::from(kind).as_str(), kind.as_str());
        }
        assert_eq!(Category::Unnamed.as_str(), crate::kind::UNNAMED);
    }

    #[test]
    fn a_snapshot_built_without_libtorch_pickles() {
        let frames: Stack =
            Arc::from(vec![SnapshotFrame { filename: "src/train.rs".into(), line: 7, name: "step".into() }]);
        let entry = |action, size| TraceEntry {
            action,
            addr: Some(4096),
            size,
            stream: 0,
            time_us: 1,
            frames: frames.clone(),
            category: (action == Action::Alloc).then_some(Category::Parameter),
            tensor: None,
            device_free: None,
        };
        let snapshot = Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 4096,
                total_size: 2 << 20,
                stream: 0,
                segment_type: SegmentType::Large,
                allocated_size: 1024,
                active_size: 1024,
                requested_size: 1000,
                is_expandable: false,
                blocks: vec![Block {
                    address: 4096,
                    size: 1024,
                    requested_size: 1000,
                    state: BlockState::ActiveAllocated,
                    frames: frames.clone(),
                }],
            }],
            device_traces: vec![vec![entry(Action::Alloc, 1024), entry(Action::FreeRequested, 1024)]],
            allocator_settings: None,
            memlab: Some(SnapshotInfo {
                devices: vec!["cuda:0".into()],
                partial: false,
                dropped: 0,
                recorded: 2,
                run: None,
                device_memory: Vec::new(),
                profile: None,
                ops: None,
                unseen_before: Vec::new(),
                prediction_inputs: None,
            }),
        };
        let pickle = snapshot.to_pickle().unwrap();
        let text = String::from_utf8_lossy(&pickle);
        for word in ["segment_type", "large", "active_allocated", "free_requested", "parameter", "src/train.rs"] {
            assert!(text.contains(word), "{word} in the pickle");
        }
        // Protocol 4, as PyTorch dumps it: PROTO 4 first, STOP last.
        assert_eq!((&pickle[..2], pickle.last()), (&[0x80, 4][..], Some(&b'.')));
    }

    #[test]
    fn counters_walk_back_from_the_allocators_figures() {
        let event = |seq, action, size| Event {
            seq,
            time_ns: seq * 1000,
            device: Device::Cpu,
            action,
            address: 64,
            size,
            stream: 0,
            thread: 1,
            scope: None,
            statement: None,
            backtrace: None,
        };
        let history = [event(0, Action::Alloc, 100), event(1, Action::FreeRequested, 100), event(2, Action::Alloc, 40)];
        // 500 bytes were allocated before the history; 540 after its last event.
        let mut now = DeviceStats::default();
        now.allocated_bytes.all.current = 540;
        now.active_bytes.all.current = 540;
        let anchors = BTreeMap::from([(Device::Cpu, Anchor::new(now, u64::MAX))]);
        let trace = Trace::from_history(&history, &Stats::default(), &anchors).unwrap();
        let allocated: Vec<i64> = trace.counters[&Device::Cpu].iter().map(|s| s.level.allocated).collect();
        assert_eq!(allocated, [600, 500, 540]);
        assert!(!trace.partial);
        // A device with events and no figures is an error, not a guess.
        assert!(Trace::from_history(&history, &Stats::default(), &BTreeMap::new()).is_err());
    }
}
