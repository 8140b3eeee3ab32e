//! A format of one's own is this one file (plus its `mod` line in
//! `main.rs`): the folded stacks that flame-graph tools read (inferno,
//! speedscope), one line per call stack of the memory alive at export,
//! `cpu;outer;…;inner BYTES`. Registered here, the exporter writes it beside
//! its other files, an out-of-memory report writes it beside the report, and
//! `memlab::format::read` (what `memlab merge` and the other commands
//! recognise files with) reads it back; merge names it for what it is.

use std::collections::BTreeMap;

use memlab::format::{About, Contents, FileFormat, Input, Registered, Source, WrittenIn};
use memlab::{Error, Result};
use tch::{Kind, Tensor};

use crate::common::serial;

/// `memlab_stacks.folded`.
struct FoldedStacks;

memlab::format::inventory::submit! { Registered(&FoldedStacks) }

/// What a folded-stacks file holds: bytes by stack (`device;outer;…;inner`).
#[derive(Debug, PartialEq, Eq)]
struct Folded(BTreeMap<String, u64>);

impl FileFormat for FoldedStacks {
    fn about(&self) -> &'static About {
        &About {
            name: "folded-stacks",
            description: "the folded stacks of the memory alive",
            recognised_by: Some("lines of `device;frame;… BYTES`"),
            extension: "folded",
            stem: "memlab_stacks",
            written_in: WrittenIn::BOTH,
            order: 30,
            made_from_recording: true,
        }
    }

    /// It builds the snapshot, then a line per stack: the snapshot's cost.
    fn estimate(&self) -> u64 {
        memlab::format::Cost::SNAPSHOT.now()
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        let snapshot = source.snapshot()?;
        let devices = snapshot.devices();
        let mut folded = BTreeMap::new();
        for segment in &snapshot.segments {
            for block in segment.blocks.iter().filter(|b| b.state == "active_allocated") {
                let mut stack = devices[segment.device].clone();
                for frame in block.frames.iter().rev() {
                    stack.push(';');
                    stack.push_str(&frame.name.replace([';', '\n'], " "));
                }
                *folded.entry(stack).or_insert(0) += block.size;
            }
        }
        for (stack, bytes) in folded {
            writeln!(out, "{stack} {bytes}").map_err(|e| Error::io("write the folded stacks", e))?;
        }
        Ok(())
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        let line = |l: &str| -> Option<(String, u64)> {
            let (stack, bytes) = l.rsplit_once(' ')?;
            let known = ["cpu", "cuda"].iter().any(|d| stack.starts_with(d));
            known.then(|| Some((stack.to_string(), bytes.parse().ok()?))).flatten()
        };
        line(input.first_line()?)?;
        Some(input.text().and_then(|text| {
            let lines: Option<BTreeMap<String, u64>> = text.lines().map(line).collect();
            let why = "a line is not `device;frame;… BYTES`";
            lines.map(|l| Contents::new(Folded(l))).ok_or_else(|| Error::InvalidArgument(why.into()))
        }))
    }
}

/// The bytes of active blocks of `device` in a snapshot read back from its
/// pickle: what the folded stacks must add up to, computed without them.
fn active_bytes(snapshot: &memlab::export::Snapshot, device: &str) -> u64 {
    let index = snapshot.devices().iter().position(|d| d == device).unwrap();
    let blocks = snapshot.segments.iter().filter(|s| s.device == index).flat_map(|s| &s.blocks);
    blocks.filter(|b| b.state == "active_allocated").map(|b| b.size).sum()
}

#[memlab::profile(device = "cpu")]
fn keep_some() -> Vec<Tensor> {
    vec![
        Tensor::ones([1 << 18], (Kind::Float, tch::Device::Cpu)),
        Tensor::ones([1 << 10], (Kind::Float, tch::Device::Cpu)),
    ]
}

#[test]
fn a_format_of_ones_own_is_written_with_the_exports_read_back_and_named_by_merge() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let kept = keep_some();
    let dir = std::env::temp_dir().join(format!("memlab-formats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let written = memlab::export::Exporter::registered().write_files(&dir).unwrap();
    let names: Vec<&str> = written.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
    assert_eq!(
        names,
        ["memlab_snapshot.pickle", "memlab_trace.json", "memlab_stacks.folded", "memlab_report.html"],
        "in the formats' order"
    );

    let (format, contents) = memlab::format::read(dir.join("memlab_stacks.folded")).unwrap();
    assert_eq!(format.name(), "folded-stacks");
    let Folded(stacks) = contents.downcast::<Folded>().unwrap();
    let (_, snapshot) = memlab::format::read(dir.join("memlab_snapshot.pickle")).unwrap();
    let snapshot = snapshot.downcast::<memlab::export::SnapshotFile>().unwrap().snapshot;
    let cpu: u64 = stacks.iter().filter(|(s, _)| s.starts_with("cpu")).map(|(_, b)| b).sum();
    assert_eq!(cpu, active_bytes(&snapshot, "cpu"), "every byte alive, once");
    let here: u64 = stacks.iter().filter(|(s, _)| s.contains("keep_some")).map(|(_, b)| b).sum();
    assert_eq!(here, 4 << 18 | 4 << 10, "the two tensors kept, under the function that made them");

    let merged = memlab_cli::merge::merge(
        &[dir.join("memlab_stacks.folded").to_str().unwrap().to_string()],
        &memlab_cli::merge::Options { out: dir.join("merged"), offsets: Default::default() },
    );
    let refused = merged.expect_err("merge takes no folded stacks");
    assert!(refused.contains("it is the folded stacks of the memory alive"), "{refused}");
    drop((kept, recording));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_out_of_memory_report_writes_it_beside_the_report() {
    let _s = serial();
    let dir = std::env::temp_dir().join(format!("memlab-formats-oom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    memlab::OomRecorder::new(&dir).max_reports(100).arm().unwrap();
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let kept = keep_some();
    assert!(Tensor::f_empty([1i64 << 46], (Kind::Float, tch::Device::Cpu)).is_err());
    memlab::OomRecorder::disarm();
    let report = memlab::last_oom().expect("reported");
    assert_eq!(report.file_errors, Vec::<String>::new());
    let extensions: Vec<&str> = report.files.iter().map(|p| p.extension().unwrap().to_str().unwrap()).collect();
    assert_eq!(extensions, ["txt", "json", "pickle", "folded", "html"], "{:?}", report.files);
    let (format, _) = memlab::format::read(&report.files[3]).unwrap();
    assert_eq!(format.name(), "folded-stacks");
    drop((kept, recording));
    std::fs::remove_dir_all(&dir).unwrap();
}
