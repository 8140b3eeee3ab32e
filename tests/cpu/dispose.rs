//! Allocation events, the live set and dispose scopes on CPU tensors, with
//! exact byte counts. One test at a time: the recorder is process-wide.

use crate::common::{floats, serial};

use memlab::{
    events::{Action, Settings},
    Device, DisposeScope, OnEscape, Recording,
};
use tch::{Kind, Tensor};

fn data_ptr(t: &Tensor) -> u64 {
    memlab::stats::storage_info(t).unwrap().data_ptr
}

#[test]
fn events_and_live_set_are_exact() {
    let _s = serial();
    let recording = Recording::start(Settings::default()).unwrap();
    let (_, before) = memlab::events::history();
    let t = floats(1000);
    let address = data_ptr(&t);
    let live = memlab::events::live();
    let mine = live.iter().find(|a| a.address == address).expect("the tensor is live");
    assert_eq!((mine.device, mine.size), (Device::Cpu, 4000));
    drop(t);
    assert!(memlab::events::live().iter().all(|a| a.address != address));
    let (events, after) = memlab::events::history();
    assert_eq!(after.recorded - before.recorded, 2);
    let tail: Vec<_> = events.iter().rev().take(2).rev().map(|e| (e.action, e.address, e.size)).collect();
    assert_eq!(tail, [(Action::Alloc, address, 4000), (Action::FreeRequested, address, 4000)]);
    assert_eq!(events.last().unwrap().thread, memlab::events::thread_number());
    drop(recording);
    assert!(memlab::events::live().is_empty(), "the live set is cleared when recording stops");
}

#[test]
fn dropped_events_are_counted() {
    let _s = serial();
    let _recording = Recording::start(Settings::default().capacity(4)).unwrap();
    let (_, before) = memlab::events::history();
    for _ in 0..5 {
        drop(floats(8));
    }
    let (events, after) = memlab::events::history();
    assert_eq!(events.len(), 4);
    assert_eq!(after.recorded - before.recorded, 10);
    assert!(after.dropped >= before.dropped + 6);
    memlab_restore_capacity();
}

#[test]
fn a_new_recording_starts_with_an_empty_history() {
    let _s = serial();
    let first = Recording::start(Settings::default().capacity(4)).unwrap();
    for _ in 0..5 {
        drop(floats(8));
    }
    drop(first);
    let (old, stats) = memlab::events::history();
    assert_eq!(old.len(), 4, "the history stays readable after the recording ends");
    assert!(stats.dropped >= 6);
    let last_old = old.last().unwrap().seq;
    let second = Recording::start(Settings::default()).unwrap();
    let t = floats(8);
    let (events, stats) = memlab::events::history();
    assert_eq!(stats.dropped, 0, "drops of an earlier recording are not this one's");
    assert!(events.iter().all(|e| e.seq > last_old), "no event of the earlier recording");
    assert!(events.iter().any(|e| e.size == 32), "this recording's own events");
    assert_eq!(stats.recorded, events.len() as u64);
    drop((t, second));
}

fn memlab_restore_capacity() {
    let _r = Recording::start(Settings::default()).unwrap();
}

#[memlab::profile(device = "cpu")]
fn allocates_on_a_known_line() -> Tensor {
    let made_here = floats(64);
    made_here
}

#[test]
fn events_know_the_profiled_statement() {
    let _s = serial();
    let _recording = Recording::start(Settings::default()).unwrap();
    let t = allocates_on_a_known_line();
    let live = memlab::events::live();
    let a = live.iter().find(|a| a.address == data_ptr(&t)).unwrap();
    let statement = a.statement.expect("allocated inside a profiled statement");
    assert!(statement.function().ends_with("allocates_on_a_known_line"));
    assert_eq!(statement.code(), "let made_here = floats(64);");
    assert!(a.site().unwrap().contains("let made_here = floats(64);"));
}

// Needs the binary's line tables (the release profile keeps them).
#[test]
fn backtraces_name_the_user_frames() {
    let _s = serial();
    let _recording = Recording::start(Settings::default().backtraces(true)).unwrap();
    let t = floats(16);
    let live = memlab::events::live();
    let a = live.iter().find(|a| a.address == data_ptr(&t)).unwrap();
    let backtrace = a.backtrace.as_ref().expect("captured");
    // The walk goes from the allocator through libtorch's C++ frames and tch
    // up to the test harness.
    assert!(backtrace.addresses().len() > 10, "{:?}", backtrace.addresses());
    let frames = backtrace.user_frames();
    assert!(frames[0].starts_with("floats") && frames[0].contains("common/mod.rs:"), "{frames:#?}");
    assert!(frames.iter().any(|f| f.starts_with("backtraces_name_the_user_frames")), "{frames:#?}");
    assert!(frames.iter().all(|f| !f.contains("memlab-core") && !f.contains(".cargo")), "{frames:#?}");
    drop(Recording::start(Settings::default()).unwrap());
}

// Written the way the classic leak is written: a new `total_loss` that keeps
// every step's graph alive.
#[allow(clippy::assign_op_pattern)]
#[memlab::profile(device = "cpu")]
fn accumulate_with_graph(steps: usize) -> Tensor {
    let w = Tensor::ones([256], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let mut total_loss = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    for _ in 0..steps {
        let loss = (&w * 3.0).exp().sum(Kind::Float);
        total_loss = total_loss + loss;
    }
    total_loss
}

#[memlab::profile(device = "cpu")]
fn accumulate_values(steps: usize) -> f64 {
    let w = Tensor::ones([256], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let mut total_loss = 0.0;
    for _ in 0..steps {
        let loss = (&w * 3.0).exp().sum(Kind::Float);
        total_loss += loss.double_value(&[]);
    }
    total_loss
}

#[test]
fn the_classic_leak_is_caught_with_its_line() {
    let _s = serial();
    let scope = DisposeScope::new("accumulate").unwrap().on_escape(OnEscape::Silent);
    let total = accumulate_with_graph(4);
    scope.keep(&total).unwrap();
    let report = scope.finish();
    // Every step's graph keeps `exp`'s 1 KiB output (saved for backward).
    assert!(report.escaped_bytes(Device::Cpu) >= 4 * 1024, "{report}");
    let text = report.to_string();
    assert!(text.contains("let loss = (&w * 3.0).exp().sum(Kind::Float);"), "{text}");
    drop(total);

    let scope = DisposeScope::new("fixed").unwrap();
    let value = accumulate_values(4);
    let report = scope.finish();
    assert!(report.escaped.is_empty(), "{report}");
    assert!(value > 0.0);
    assert!(report.counts(Device::Cpu).created_bytes > 0);
}

#[test]
fn keep_detach_and_nested_scopes() {
    let _s = serial();
    let outer = DisposeScope::new("outer").unwrap().on_escape(OnEscape::Silent);
    let (kept, detached, leaked);
    {
        let inner = DisposeScope::new("inner").unwrap().on_escape(OnEscape::Silent);
        kept = floats(100);
        detached = floats(200);
        leaked = floats(300);
        let temporary = floats(400);
        assert_eq!(inner.keep(&kept).unwrap(), 400);
        assert_eq!(inner.detach(&detached).unwrap(), 800);
        assert!(inner.keep(&kept).is_err(), "kept already");
        drop(temporary);
        let report = inner.finish();
        let c = report.counts(Device::Cpu);
        assert_eq!((c.created_bytes, c.created), (400 + 800 + 1200 + 1600, 4));
        assert_eq!((c.freed_bytes, c.freed), (1600, 1));
        assert_eq!((c.kept_bytes, c.kept), (400 + 800, 2));
        assert_eq!((c.escaped_bytes, c.escaped), (1200, 1));
        assert_eq!(report.escaped[0].address, data_ptr(&leaked));
        assert!(report.handed_to.is_some());
    }
    let report = outer.finish();
    // The outer scope answers for what the inner one kept and leaked, not for
    // what it detached.
    let c = report.counts(Device::Cpu);
    assert_eq!((c.escaped_bytes, c.escaped), (400 + 1200, 2));
    assert!(report.escaped.iter().all(|a| a.address != data_ptr(&detached)));
    drop((kept, detached, leaked));
}

#[test]
fn fail_mode_panics_with_the_report() {
    let _s = serial();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut stash = Vec::new();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _scope = DisposeScope::new("must not leak").unwrap().on_escape(OnEscape::Fail);
        stash.push(floats(10));
    }));
    std::panic::set_hook(hook);
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.starts_with("DisposeScope `must not leak`: 1 allocation(s) escaped, 40.00B"), "{message}");
    assert!(DisposeScope::new("clean").unwrap().check().is_ok());
}

#[test]
fn scopes_see_only_their_own_thread() {
    let _s = serial();
    let scope = DisposeScope::new("main thread").unwrap().on_escape(OnEscape::Silent);
    let other = std::thread::spawn(|| floats(1000)).join().unwrap();
    let report = scope.finish();
    assert_eq!(report.counts(Device::Cpu).created, 0);
    drop(other);
}

#[test]
fn check_step_measures_peak_and_escapes() {
    let _s = serial();
    let check = memlab::check_step(|| {
        let spike = floats(256 * 1024);
        drop(spike);
        floats(16)
    })
    .unwrap();
    assert_eq!(check.peak_above_start[&Device::Cpu], 1 << 20);
    check.assert_peak_below(Device::Cpu, 1 << 20);
    assert_eq!(check.scope.escaped_bytes(Device::Cpu), 64, "the returned tensor escaped");
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(|| {
        check.assert_peak_below(Device::Cpu, 1000);
    });
    std::panic::set_hook(hook);
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert_eq!(message, "the step's peak on cpu rose 1.00M above its start, more than the 1000.00B allowed");
}

#[test]
fn warnings_and_reports_go_where_they_are_sent() {
    use memlab::profiler::{set_output, set_warnings, Output};
    use std::sync::{Arc, Mutex};
    let _s = serial();
    let (reports, warnings) = (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
    let (r, w) = (reports.clone(), warnings.clone());
    set_output(Output::Sink(Box::new(move |t| r.lock().unwrap().push_str(t))));
    set_warnings(Output::Sink(Box::new(move |t| w.lock().unwrap().push_str(t))));
    let mut kept = Vec::new();
    {
        let _warned = DisposeScope::new("warned").unwrap();
        kept.push(floats(16));
    }
    {
        let _reported = DisposeScope::new("reported").unwrap().on_escape(OnEscape::Report);
        kept.push(floats(16));
    }
    set_output(Output::Stdout);
    set_warnings(Output::Stderr);
    let (reports, warnings) = (reports.lock().unwrap().clone(), warnings.lock().unwrap().clone());
    assert!(warnings.contains("DisposeScope `warned`") && !warnings.contains("`reported`"), "{warnings}");
    assert!(reports.contains("DisposeScope `reported`") && !reports.contains("`warned`"), "{reports}");
}

#[test]
fn scope_reports_are_data() {
    let _s = serial();
    let scope = DisposeScope::new("as json").unwrap().on_escape(OnEscape::Silent);
    let kept = floats(16);
    let report = scope.finish();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["name"], "as json");
    assert_eq!(json["devices"]["cpu"]["escaped_bytes"], 64, "{json}");
    let escaped = &json["escaped"][0];
    assert_eq!((escaped["device"].as_str(), escaped["size"].as_u64()), (Some("cpu"), Some(64)), "{json}");
    drop(kept);
}
