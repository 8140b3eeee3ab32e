//! `track!()` on the CPU: call sites, totals, and the +/- lines of storages
//! that appeared or disappeared, grouped by kind, shape and dtype.

use crate::common::{floats, serial};
use memlab::Render;
use memlab::{Device, Tracker};
use tch::nn;

#[memlab::profile(device = "cpu")]
fn grow(cache: &mut Vec<tch::Tensor>) {
    let entry = floats(2048);
    cache.push(entry);
}

#[test]
fn logs_what_appeared_and_disappeared() {
    let _s = serial();
    memlab::clear_registry();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _fc = nn::linear(vs.root() / "fc", 32, 16, Default::default());
    memlab::register_var_store("model", &vs);
    let mut tracker = Tracker::new().device(Device::Cpu);

    let first = memlab::track!(tracker).to_text();
    let header = first.lines().next().unwrap();
    assert!(header.contains("tests/cpu/tracker.rs:"), "{header}");
    assert!(header.contains("cpu::tracker::logs_what_appeared_and_disappeared — live tensors"), "{header}");
    assert!(first.contains("  + 1 × [16, 32] Float parameter 2.00K"), "{first}");
    assert!(first.contains("  + 1 × [16] Float parameter 64.00B"), "{first}");

    let mut cache = Vec::new();
    grow(&mut cache);
    grow(&mut cache);
    let second = memlab::track!(tracker).to_text();
    let growth = second.lines().filter(|l| l.starts_with("  +")).collect::<Vec<_>>();
    assert_eq!(growth.len(), 1, "{second}");
    assert!(growth[0].starts_with("  + 2 × unnamed 16.00K, allocated at cpu::tracker::grow"), "{second}");
    assert!(growth[0].contains("let entry = floats(2048);"), "{second}");
    assert!(!second.contains("  -"), "nothing went away: {second}");

    cache.clear();
    let third = memlab::track!(tracker).to_text();
    assert!(third.contains("  - 2 × unnamed 16.00K"), "{third}");
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    memlab::clear_registry();
}

#[test]
fn log_file_and_a_bad_path() {
    let _s = serial();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let path = std::env::temp_dir().join(format!("memlab-track-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut tracker = Tracker::new().device(Device::Cpu).log_file(&path).stdout(false);
    memlab::track!(tracker);
    let kept = floats(100);
    memlab::track!(tracker);
    let log = std::fs::read_to_string(&path).unwrap();
    assert_eq!(log.lines().filter(|l| l.starts_with('[')).count(), 2, "{log}");
    assert!(log.contains("  + 1 × unnamed 400.00B"), "{log}");
    std::fs::remove_file(&path).unwrap();

    let mut broken = Tracker::new().device(Device::Cpu).log_file("/nonexistent/dir/track.log");
    let text = memlab::track!(broken).to_text();
    assert!(text.contains("live tensors"), "tracking goes on");
    let error = broken.last_error().expect("the problem is kept");
    assert!(matches!(error, memlab::Error::Io { .. }), "an I/O error, with its source: {error:?}");
    assert!(error.to_string().contains("could not append to /nonexistent/dir/track.log"), "{error}");
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    drop(kept);
}

#[inline(never)]
fn allocate_unprofiled() -> tch::Tensor {
    floats(4096)
}

#[test]
fn with_backtraces_unnamed_storages_name_their_caller() {
    let _s = serial();
    memlab::clear_registry();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    // A recording started with backtraces on: the tracker joins it.
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let mut tracker = Tracker::new().device(Device::Cpu);
    memlab::track!(tracker);
    let kept = allocate_unprofiled();
    let text = memlab::track!(tracker).to_text();
    println!("{text}");
    let line = text.lines().find(|l| l.starts_with("  + 1 × unnamed 16.00K")).unwrap_or_else(|| panic!("{text}"));
    // The innermost of the user's frames: the helper that made the tensor.
    assert!(line.contains("allocated at floats at ") && line.contains("common/mod.rs:"), "{line}");
    drop((kept, tracker, recording));
    // Back to the default settings (no backtraces) for the other tests.
    drop(memlab::Recording::start(memlab::events::Settings::default()).unwrap());
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
}
