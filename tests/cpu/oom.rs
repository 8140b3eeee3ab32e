//! The out-of-memory recorder on the CPU: a request of 2^48 bytes fails
//! under any overcommit setting, the counting allocator sees the failure,
//! and the recorder writes its report before libtorch's error reaches the
//! caller. Limits and the environment variable are per process: those tests
//! run this binary again as a child (see `crate::common::run_child`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::pytorch::{python, VALIDATE};
use crate::common::{check_child, child, floats, serial, within};
use memlab::oom::Verdict;
use memlab::Render;
use memlab::{Device, OomRecorder};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

/// 2^46 floats: 2^48 bytes (256 TiB).
const TOO_BIG: i64 = 1 << 46;

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memlab-oom-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn reports(dir: &Path, extension: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> =
        std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    out.retain(|p| p.extension().is_some_and(|e| e == extension));
    out.sort();
    out
}

/// The line of this file where `code` is.
fn line_of(code: &str) -> u32 {
    let source = include_str!("oom.rs");
    source.lines().position(|l| l.contains(code)).expect("the code is in this file") as u32 + 1
}

#[memlab::profile(device = "cpu")]
fn train_step(net: &nn::Sequential, opt: &mut nn::Optimizer, blow_up: bool) -> Result<f64, tch::TchError> {
    let x = Tensor::ones([16, 64], (Kind::Float, tch::Device::Cpu));
    if blow_up {
        let _huge = Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu))?;
    }
    let loss = net.forward(&x).square().mean(Kind::Float);
    opt.backward_step(&loss);
    Ok(loss.double_value(&[]))
}

#[test]
fn a_failed_request_is_reported_before_the_error_arrives_and_training_goes_on() {
    let _s = serial();
    memlab::clear_registry();
    let out = dir("report");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 64, 64, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let kept = floats(3000); // unnamed, allocated here: listed by its site
    opt.with_mut(|opt| train_step(&net, opt, false)).unwrap();

    let seen = memlab::oom::ooms_seen();
    let reads = memlab::testing::gradient_reads();
    let err = opt.with_mut(|opt| train_step(&net, opt, true)).expect_err("2^48 bytes cannot be allocated");
    // The handler named the last step's gradients without asking libtorch
    // for one: the two reads are the registered optimizer's, after the call.
    let report = memlab::last_oom().expect("the failure was recorded");
    assert_eq!(report.number, seen + 1, "the report of this failure, not an earlier one");
    assert!(report.holders.named.iter().any(|n| n.name == "model.fc.weight.grad"), "{:?}", report.holders.named);
    assert_eq!(memlab::testing::gradient_reads(), reads + 2, "weight and bias, once, after the call");
    assert_eq!(memlab::oom::ooms_seen(), seen + 1, "this failure, and only it, was seen");
    assert!(err.to_string().contains("allocate memory"), "libtorch's own error reaches the caller: {err}");
    // Training goes on.
    assert!(opt.with_mut(|opt| train_step(&net, opt, false)).unwrap().is_finite());
    // A failure between steps, outside any step method: the report names the
    // step's gradients, and libtorch is asked for none while it is written.
    let reads = memlab::testing::gradient_reads();
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    assert_eq!(memlab::testing::gradient_reads(), reads, "no gradient read during a report");
    let between = memlab::last_oom().unwrap();
    assert!(between.holders.named.iter().any(|n| n.name == "model.fc.bias.grad"), "{:?}", between.holders.named);

    let d = &report.diagnosis;
    assert_eq!((d.device, d.requested, d.rounded), (Device::Cpu, 1 << 48, false));
    assert_eq!(d.verdict, Verdict::RequestExceedsDevice);
    let host = d.figures.device.expect("the host's memory");
    assert!(host.total > 0 && host.free <= host.total && host.this_process.is_some());
    assert!(d.advice.contains("256.00T") && d.advice.contains("shape"), "{}", d.advice);
    // The statement and the frames of the failing call.
    let line = line_of("let _huge = Tensor::f_empty([TOO_BIG]");
    let statement = report.statement.as_deref().expect("a profiled statement ran");
    assert!(statement.contains(&format!("cpu/oom.rs:{line}")) && statement.contains("f_empty"), "{statement}");
    assert!(report.frames.iter().any(|f| f.function.contains("train_step")), "{:?}", report.frames);
    // What held the memory: the model by name, exactly; the rest by site.
    let h = &report.holders;
    let weight = h.named.iter().find(|n| n.name == "model.fc.weight").expect("the weight by name");
    assert_eq!((weight.kind, weight.bytes), (memlab::TensorKind::Parameter, 64 * 64 * 4));
    assert!(h
        .named
        .iter()
        .any(|n| n.name == "model.fc.weight.exp_avg" && n.kind == memlab::TensorKind::OptimizerState));
    // One JSON name per kind, as the reporter's and the snapshot's; text says it in words.
    let json = report.to_json();
    assert!(
        json.contains("\"kind\": \"optimizer_state\"") && !json.contains("\"kind\": \"optimizer state\""),
        "{json}"
    );
    assert!(report.to_text().contains("optimizer state"));
    assert!(h.named.iter().any(|n| n.name == "model.fc.weight.grad" && n.kind == memlab::TensorKind::Gradient));
    // Weight and bias, their gradients and Adam's two moments: four times the parameters.
    assert_eq!(h.named_bytes, 4 * (64 * 64 + 64) * 4);
    assert_eq!(h.named.iter().map(|n| n.bytes).sum::<u64>() + h.named_rest.bytes, h.named_bytes);
    let sites = h.by_site.as_ref().expect("a recording runs: sites");
    let mine = sites.iter().find(|s| s.bytes == 12_000).expect("the 12,000-byte tensor by its site");
    // Its site is the helper that made it; its frames lead back to this test.
    assert!(
        mine.site.starts_with("floats at ") && mine.frames.iter().any(|f| f.file.ends_with("cpu/oom.rs")),
        "{mine:?}"
    );
    assert!(h.busy.is_empty(), "{:?}", h.busy);

    // The files: the text report and its JSON, and with a recording the HTML
    // and the snapshot, named after the host, the process's start, its id
    // and the report's number.
    let start = report.process_start.as_deref().expect("the kernel tells when the process started");
    let compact: String = start.chars().filter(char::is_ascii_digit).collect();
    let base = format!(
        "memlab_oom_{}_{}T{}_{}_{}",
        report.host,
        &compact[..8],
        &compact[8..],
        std::process::id(),
        report.number
    );
    // A file of every format registered for reports: the text, the JSON, the
    // snapshot and the page, and `formats.rs`'s own.
    let formats = memlab::format::written_in(|set| set.oom_reports);
    let expected: Vec<String> = formats.iter().map(|f| format!("{base}.{}", f.extension())).collect();
    assert!(expected.len() >= 4, "{expected:?}");
    let names: Vec<String> =
        report.files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, expected, "{:?}", report.file_errors);
    assert!(report.left_out.is_empty() && !report.partial, "{:?}", report.left_out);
    // The JSON sibling is the report as data, verdict included.
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report.files[1]).unwrap()).unwrap();
    assert_eq!(json["diagnosis"]["verdict"], "request_exceeds_device");
    assert_eq!(json["diagnosis"]["requested"], 1u64 << 48);
    assert_eq!(json["number"], report.number);
    assert_eq!(json["holders"]["named_bytes"], h.named_bytes);
    // The HTML sibling is a whole page that opens on its own, content
    // security policy included; it opens with the report (verdict, advice,
    // holders), then the recording (its summary, memory over time).
    let page = std::fs::read_to_string(report.files.last().unwrap()).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>") && page.contains("default-src 'none'"), "{}", &page[..200]);
    let at = |needle: &str| page.find(needle).unwrap_or_else(|| panic!("{needle:?} in the page"));
    let order = [
        at("Verdict: the request alone exceeds the device"),
        at("no amount of freeing makes it fit"),
        at("What holds the memory"),
        at("model.fc.weight.exp_avg"),
        at("<h1>memlab summary: this process&#39;s recording</h1>"),
        at("memory over time"),
    ];
    assert!(order.windows(2).all(|w| w[0] < w[1]), "the report, then the recording: {order:?}");
    // What lived before the recording (the model and Adam's state, made
    // before it started) is in the allocator's figures, not the history's:
    // the page gives the peak both ways.
    assert!(page.contains("peak allocated, since the recording began"), "the page's summary");
    assert!(page.contains("peak allocated, with what lived before"), "the page's summary");
    let text = std::fs::read_to_string(&report.files[0]).unwrap();
    for needle in [
        "Verdict: the request alone exceeds the device",
        "281474976710656 bytes, as asked",
        &format!("cpu/oom.rs:{line}"),
        "model.fc.weight",
        "not named",
    ] {
        assert!(text.contains(needle), "{needle:?} in the report:\n{text}");
    }
    assert_eq!(text, report.to_text(), "the file is the report's text");
    // PyTorch's reader takes the snapshot, whose trace has the failure.
    let pickle = report.files[2].to_str().unwrap();
    python(&["-c", VALIDATE, pickle]);
    let trace = python(&["-m", "torch.cuda._memory_viz", "trace", pickle]);
    assert!(trace.contains("raise OutOfMemoryError # 256.0TiB requested"), "{trace}");
    assert!(report.summary().contains("Verdict: the request alone exceeds the device. Report: "));
    drop((kept, recording));
    OomRecorder::disarm();
    memlab::clear_registry();
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn the_reports_name_memory_after_the_model_given_and_hold_it_weakly() {
    let _s = serial();
    memlab::clear_registry();
    let out = dir("model");
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 64, 64, Default::default()));
    let cache = floats(1 << 20); // 4 MiB
    let model = memlab::Model::new().var_store("model", &vs).tensor("cache", &cache);
    OomRecorder::new(&out).max_reports(100).of(model).arm().unwrap();
    net.forward(&Tensor::ones([8, 64], (Kind::Float, tch::Device::Cpu))).sum(Kind::Float).backward();
    // A walk under other names (no prefix) keeps the gradients for the
    // handler, which names them after the recorder's model.
    memlab::MemReporter::new(&vs).report().unwrap();

    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let report = memlab::last_oom().expect("the failure was recorded");
    let named = |report: &memlab::oom::OomReport| -> Vec<String> {
        report.holders.named.iter().map(|n| n.name.clone()).collect()
    };
    for name in ["cache", "model.fc.weight", "model.fc.weight.grad", "model.fc.bias.grad"] {
        assert!(named(&report).iter().any(|n| n == name), "{name}: {:?}", named(&report));
    }
    assert_eq!(report.holders.named_bytes, (4 << 20) + 2 * (64 * 64 + 64) * 4);

    // Held weakly: what the program drops is freed, and no longer named.
    let allocated = || memlab::stats::device_stats(Device::Cpu).unwrap().allocated_bytes.all.current;
    let before = allocated();
    drop(cache);
    assert_eq!(before - allocated(), 4 << 20, "the recorder kept the tensor alive");
    drop((net, vs));
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let after = memlab::last_oom().unwrap();
    assert!(after.number > report.number && after.holders.named.is_empty(), "{:?}", named(&after));

    // A model whose optimizer cannot be read arms nothing.
    let other = nn::VarStore::new(tch::Device::Cpu);
    let _w = other.root().zeros("w", &[4]);
    let lost = nn::Sgd::default().build(&other, 0.1).unwrap();
    let broken = memlab::Model::new().optimizer(&lost);
    OomRecorder::disarm();
    assert!(OomRecorder::new(&out).of(broken).arm().is_err());
    assert_eq!(OomRecorder::armed_dir(), None, "nothing armed");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_batch_search_names_the_holders_of_its_first_failure_after_its_model() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _fc = nn::linear(vs.root() / "fc", 64, 64, Default::default());
    let step = |batch: usize| -> Result<(), Box<dyn std::error::Error>> {
        let size = if batch <= 2 { 1024 * batch as i64 } else { TOO_BIG };
        let _t = Tensor::f_empty([size], (Kind::Float, tch::Device::Cpu))?;
        Ok(())
    };
    let budget = memlab::Budget::Bytes(1 << 30);
    let search = memlab::BatchSizeSearch::new(Device::Cpu, budget).of(memlab::Model::new().var_store("model", &vs));
    let search = search.run(16, step).unwrap();
    assert_eq!(search.largest, Some(2));
    let first = search.first_oom.as_ref().expect("batch 4 ran out");
    assert_eq!((first.batch_size, first.diagnosis.verdict), (4, Verdict::RequestExceedsDevice));
    let weight = first.holders.named.iter().find(|n| n.name == "model.fc.weight").expect("the model by name");
    assert_eq!((weight.kind, weight.bytes), (memlab::TensorKind::Parameter, 64 * 64 * 4));
    assert_eq!(first.holders.named_bytes, (64 * 64 + 64) * 4);
    // The one-liner names the registry's, here nothing.
    let plain = memlab::find_batch_size(Device::Cpu, budget, 16, step).unwrap();
    assert!(plain.first_oom.expect("batch 4 ran out").holders.named.is_empty());
}

#[test]
fn a_failure_on_another_thread_is_caught() {
    let _s = serial();
    let out = dir("thread");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    let before = memlab::oom::ooms_seen();
    let main = memlab::events::thread_number();
    let worker = std::thread::Builder::new()
        .name("loader".into())
        .spawn(|| Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err())
        .unwrap();
    assert!(worker.join().unwrap(), "the worker got libtorch's error");
    assert_eq!(memlab::oom::ooms_seen(), before + 1);
    let report = memlab::last_oom().unwrap();
    assert_ne!(report.thread.number, main);
    assert_eq!(report.thread.name.as_deref(), Some("loader"));
    assert!(report.files[0].exists());
    OomRecorder::disarm();
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_var_store_held_by_the_failing_thread_is_reported_busy_not_waited_for() {
    let _s = serial();
    memlab::clear_registry();
    let out = dir("busy");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    let report = within(Duration::from_secs(60), {
        let out = out.clone();
        move || {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let _fc = nn::linear(vs.root() / "fc", 8, 8, Default::default());
            memlab::register_var_store("held", &vs);
            // As tch's set_device does: the store's lock held while allocating.
            let _held = vs.variables_.lock().unwrap();
            assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
            let report = memlab::last_oom().unwrap();
            assert!(report.files[0].starts_with(&out));
            report
        }
    });
    assert!(report.holders.busy.iter().any(|b| b.starts_with("held (its lock was held")), "{:?}", report.holders.busy);
    assert!(report.to_text().contains("not walked: held"), "{}", report.to_text());
    OomRecorder::disarm();
    memlab::clear_registry();
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn disarmed_it_writes_nothing() {
    let _s = serial();
    let out = dir("disarmed");
    OomRecorder::new(&out).arm().unwrap();
    OomRecorder::disarm();
    assert_eq!(OomRecorder::armed_dir(), None);
    let before = memlab::oom::ooms_seen();
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    assert_eq!(memlab::oom::ooms_seen(), before);
    assert!(reports(&out, "txt").is_empty());
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_directory_that_cannot_be_written_is_an_error_at_arming() {
    let _s = serial();
    let file = dir("not-a-dir");
    std::fs::write(&file, b"").unwrap();
    let err = OomRecorder::new(file.join("reports")).arm().unwrap_err();
    assert!(matches!(err, memlab::Error::Io { .. }), "an I/O error, with its source: {err:?}");
    let source = std::error::Error::source(&err).expect("the system's error").to_string();
    assert!(err.to_string().contains("could not create the directory") && err.to_string().contains(&source), "{err}");
    assert_eq!(OomRecorder::armed_dir(), None, "nothing armed");
    std::fs::remove_file(&file).ok();
}

#[test]
fn find_batch_size_keeps_its_failures_quiet_and_says_why_the_first_one_failed() {
    let _s = serial();
    let out = dir("search");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    let before = memlab::oom::ooms_seen();
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::Bytes(1 << 30), 64, |batch| {
        if batch <= 4 {
            let _t = Tensor::f_empty([1024 * batch as i64], (Kind::Float, tch::Device::Cpu))?;
            return Ok(());
        }
        // The failure happens on a thread of the step's own, as a CUDA
        // backward pass's does on the autograd engine's: still the search's.
        let failed = std::thread::scope(|s| {
            s.spawn(|| Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err()).join().unwrap()
        });
        assert!(failed);
        Err("out of memory".into())
    })
    .unwrap();
    assert_eq!(search.largest, Some(4));
    let memlab::batch_size::FirstOom { batch_size: batch, diagnosis: why, .. } =
        search.first_oom.as_ref().expect("the first failing batch's verdict");
    assert_eq!((*batch, why.verdict, why.requested), (8, Verdict::RequestExceedsDevice, 1 << 48));
    assert!(search
        .to_text()
        .contains("Batch 8 ran out of memory on cpu. Verdict: the request alone exceeds the device."));
    assert_eq!(memlab::oom::ooms_seen(), before, "the search's failures are not counted");
    assert!(reports(&out, "txt").is_empty(), "nor written");
    OomRecorder::disarm();
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_warnings_sink_gets_the_summary_from_a_thread_of_memlabs() {
    let _s = serial();
    let out = dir("sink");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    let (send, receive) = std::sync::mpsc::channel::<(String, Option<String>)>();
    let send = std::sync::Mutex::new(send);
    /// Puts standard error back as the warnings' output, even if an assertion fails.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            memlab::profiler::set_warnings(memlab::profiler::Output::Stderr);
        }
    }
    let _restore = Restore;
    memlab::profiler::set_warnings(memlab::profiler::Output::Sink(Box::new(move |text| {
        let thread = std::thread::current().name().map(str::to_string);
        let _ = send.lock().unwrap().send((text.to_string(), thread));
    })));
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let (text, thread) = receive.recv_timeout(Duration::from_secs(10)).expect("the summary arrives");
    assert!(text.starts_with("memlab: out of memory on cpu: 256.00T requested"), "{text}");
    assert!(text.contains("Verdict: the request alone exceeds the device. Report: "), "{text}");
    assert_eq!(thread.as_deref(), Some("memlab-warnings"), "the sink never runs inside the allocator");
    OomRecorder::disarm();
    std::fs::remove_dir_all(&out).ok();
}

// Per process: the limit on reports, and MEMLAB_OOM_DIR.

#[test]
fn at_most_the_limit_of_reports_is_written() {
    if child("at_most_the_limit_of_reports_is_written") {
        let out = PathBuf::from(std::env::var("OOM_TEST_DIR").unwrap());
        OomRecorder::new(&out).max_reports(2).arm().unwrap();
        for _ in 0..5 {
            assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
        }
        assert_eq!(memlab::oom::ooms_seen(), 5, "every failure is counted");
        assert_eq!(reports(&out, "txt").len(), 2, "two are written");
        assert_eq!(memlab::last_oom().unwrap().number, 2);
        return;
    }
    let out = dir("limit");
    let (_, stderr) =
        check_child("at_most_the_limit_of_reports_is_written", &[("OOM_TEST_DIR", out.to_str().unwrap())]);
    assert_eq!(stderr.matches("memlab: out of memory on cpu").count(), 2, "{stderr}");
    assert_eq!(stderr.matches("the most for this process").count(), 1, "said once: {stderr}");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn memlab_oom_dir_arms_the_recorder_as_the_program_loads() {
    if child("memlab_oom_dir_arms_the_recorder_as_the_program_loads") {
        // No memlab call before the failure: the directory was made, and the
        // reserve kept aside, as the program loaded.
        let out = PathBuf::from(std::env::var("MEMLAB_OOM_DIR").unwrap());
        assert!(out.is_dir(), "made as the program loaded");
        assert_eq!(memlab_tch::oom::reserve::bytes(), memlab::oom::DEFAULT_RESERVE);
        assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
        assert_eq!(reports(&out, "txt").len(), 1);
        assert_eq!(OomRecorder::armed_dir(), Some(out));
        return;
    }
    let out = dir("environment").join("made-if-missing");
    let (_, stderr) = check_child(
        "memlab_oom_dir_arms_the_recorder_as_the_program_loads",
        &[("MEMLAB_OOM_DIR", out.to_str().unwrap())],
    );
    assert!(stderr.contains("Verdict: the request alone exceeds the device"), "{stderr}");
    std::fs::remove_dir_all(out.parent().unwrap()).ok();
}

#[test]
fn a_bad_memlab_oom_dir_is_warned_about_once_and_nothing_breaks() {
    if child("a_bad_memlab_oom_dir_is_warned_about_once_and_nothing_breaks") {
        for _ in 0..3 {
            assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
        }
        assert_eq!(OomRecorder::armed_dir(), None);
        assert!(memlab::last_oom().is_none());
        assert_eq!(floats(10).size(), [10], "the allocator still serves");
        return;
    }
    let file = dir("bad-environment");
    std::fs::write(&file, b"a file, not a directory").unwrap();
    let bad = file.join("reports");
    let (_, stderr) = check_child(
        "a_bad_memlab_oom_dir_is_warned_about_once_and_nothing_breaks",
        &[("MEMLAB_OOM_DIR", bad.to_str().unwrap())],
    );
    assert_eq!(stderr.matches("memlab: ignoring MEMLAB_OOM_DIR=").count(), 1, "{stderr}");
    assert!(!stderr.contains("out of memory on"), "{stderr}");
    std::fs::remove_file(&file).ok();
}

// File names, and what is refused at arming.

/// In a child: the tag a taken name gives stays with the process.
#[test]
fn a_report_never_replaces_a_file_of_its_name() {
    if !child("a_report_never_replaces_a_file_of_its_name") {
        check_child("a_report_never_replaces_a_file_of_its_name", &[]);
        return;
    }
    let out = dir("exclusive");
    OomRecorder::new(&out).max_reports(100).arm().unwrap();
    // The next report's name: the host, the process's start, the pid, the number.
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let first = memlab::last_oom().unwrap();
    let name = first.files[0].file_name().unwrap().to_string_lossy().into_owned();
    let prefix = name.strip_suffix(&format!("_{}.txt", first.number)).expect("named by its number").to_string();
    assert!(prefix.starts_with(&format!("memlab_oom_{}_", first.host)), "{name}");
    assert!(prefix.ends_with(&format!("_{}", std::process::id())), "{name}");
    // Another process (another container with the same pid, started in the
    // same second on a host of the same name) wrote the next name first.
    let taken = [
        out.join(format!("{prefix}_{}.txt", first.number + 1)),
        out.join(format!("{prefix}_{}.json", first.number + 1)),
    ];
    for file in &taken {
        std::fs::write(file, "another process's report").unwrap();
    }
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let second = memlab::last_oom().unwrap();
    assert_eq!(second.number, first.number + 1);
    for file in &taken {
        assert_eq!(std::fs::read_to_string(file).unwrap(), "another process's report", "left as it was");
    }
    // This report is written whole, under this process's name with a tag.
    assert_eq!(second.file_errors, Vec::<String>::new());
    let names: Vec<String> =
        second.files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let tagged = names[0].strip_suffix(&format!("_{}.txt", second.number)).expect("named by its number");
    let tag = tagged.strip_prefix(&format!("{prefix}-")).expect("the pid, then a tag");
    assert!(tag.len() == 8 && tag.chars().all(|c| c.is_ascii_hexdigit()), "{names:?}");
    assert_eq!(names[1], format!("{tagged}_{}.json", second.number));
    // Later reports of this process keep its tag.
    assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
    let third = memlab::last_oom().unwrap();
    let name = third.files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(name, format!("{tagged}_{}.txt", third.number));
    OomRecorder::disarm();
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn an_empty_directory_is_refused_at_arming() {
    let _s = serial();
    let err = OomRecorder::new("").arm().unwrap_err();
    assert!(err.to_string().contains("an empty path"), "{err}");
    assert_eq!(OomRecorder::armed_dir(), None, "nothing armed");
}

#[test]
fn a_relative_directory_is_resolved_when_armed() {
    if child("a_relative_directory_is_resolved_when_armed") {
        let start = std::env::current_dir().unwrap();
        OomRecorder::new("rel-reports").arm().unwrap();
        assert_eq!(OomRecorder::armed_dir(), Some(start.join("rel-reports")));
        // The program moves elsewhere before memory runs out.
        let elsewhere = start.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::env::set_current_dir(&elsewhere).unwrap();
        assert!(Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu)).is_err());
        assert_eq!(reports(&start.join("rel-reports"), "txt").len(), 1, "written where it was armed");
        assert!(reports(&elsewhere.join("rel-reports"), "txt").is_empty());
        return;
    }
    let work = dir("relative");
    std::fs::create_dir_all(&work).unwrap();
    let name = crate::common::test_path("a_relative_directory_is_resolved_when_armed");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &name, "--nocapture", "--test-threads=1"])
        .env("MEMLAB_CHILD", &name)
        .env_remove("MEMLAB_OOM_DIR")
        .current_dir(&work)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("1 passed"), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&work).ok();
}

#[test]
fn find_batch_size_on_the_cpu_keeps_its_out_of_memory_panics_from_the_panic_hook() {
    let _s = serial();
    use std::sync::atomic::{AtomicUsize, Ordering};
    static HOOK_CALLS: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {
        HOOK_CALLS.fetch_add(1, Ordering::Relaxed);
    }));
    HOOK_CALLS.store(0, Ordering::Relaxed);
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::Bytes(1 << 30), 64, |batch| {
        // tch's calls without `f_` panic with libtorch's CPU message, which
        // says nothing of "out of memory": the allocator's report tells.
        let size = if batch <= 4 { 1024 * batch as i64 } else { TOO_BIG };
        let _t = Tensor::empty([size], (Kind::Float, tch::Device::Cpu));
        Ok(())
    })
    .unwrap();
    let quiet = HOOK_CALLS.load(Ordering::Relaxed);
    // Any other panic of a try still reaches the hook.
    let loud = memlab::find_batch_size(Device::Cpu, memlab::Budget::Bytes(1 << 30), 1, |_| panic!("a bug in the step"));
    let after = HOOK_CALLS.load(Ordering::Relaxed);
    std::panic::set_hook(previous);
    assert_eq!(search.largest, Some(4));
    assert_eq!(search.tried.iter().filter(|t| t.outcome.is_err()).count(), 3, "{search}");
    assert_eq!(quiet, 0, "the search's out-of-memory panics reached the panic hook");
    assert_eq!(loud.unwrap().largest, None);
    assert_eq!(after, 1, "a panic for another reason is reported");
}

const TWIN: &str = "twin_child";

/// The body of each twin of [`two_containers_pid_1_keep_both_reports`]:
/// says its pid and start, waits for the parent's byte, then fails a
/// request; its report must be written whole.
#[test]
fn twin_child() {
    use std::io::{Read, Write};
    if !child(TWIN) {
        return;
    }
    let run = memlab::run::this_process();
    println!("memlab-test: ready {} {}", run.pid, run.process_start.unwrap_or(0));
    std::io::stdout().flush().unwrap();
    let mut go = [0u8];
    std::io::stdin().read_exact(&mut go).unwrap();
    // Each twin asks for its own size: the parent tells their reports apart.
    let extra: i64 = std::env::var("MEMLAB_TWIN_EXTRA").map_or(0, |v| v.parse().unwrap());
    assert!(Tensor::f_empty([TOO_BIG + extra], (Kind::Float, tch::Device::Cpu)).is_err());
    let report = memlab::last_oom().expect("reported");
    assert_eq!(report.file_errors, Vec::<String>::new(), "every file written");
    assert_eq!(report.files.len(), 2, "{:?}", report.files);
}

/// Two containers sharing an output directory: each program is pid 1 in
/// its own PID namespace, on hosts of one name, started in one second, so
/// their reports' usual names are the same. Both reports are written
/// whole. Needs `unshare --pid` (root); where it is missing,
/// `a_report_never_replaces_a_file_of_its_name` plays the same collision
/// in one process.
#[test]
fn two_containers_pid_1_keep_both_reports() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let works = Command::new("unshare").args(["--pid", "--fork", "true"]).stderr(Stdio::null()).status();
    if !works.is_ok_and(|s| s.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI runs this test as root, with unshare");
        eprintln!("unshare --pid is not available here: the collision is played in one process instead");
        return;
    }
    let out = dir("containers");
    std::fs::create_dir_all(&out).unwrap();
    let twin_test = crate::common::test_path(TWIN);
    let spawn = |extra: i64| {
        let mut twin = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", &twin_test, "--nocapture", "--test-threads=1"])
            .env("MEMLAB_CHILD", &twin_test)
            .env("MEMLAB_TWIN_EXTRA", extra.to_string())
            .env("MEMLAB_OOM_DIR", &out)
            .env_remove("MEMLAB_CPU_ALLOCATOR")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = BufReader::new(twin.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        (twin, rx)
    };
    let ready = |rx: std::sync::mpsc::Receiver<String>| {
        rx.iter()
            .find_map(|l| l.split_once("memlab-test: ready ").map(|(_, r)| r.to_string()))
            .expect("the twin got ready")
    };
    // Until both started in one second (the usual names are then the same).
    // Both start before either is waited for: on a loaded machine one
    // twin's start alone can take more than a second.
    let twins = (0..10)
        .find_map(|_| {
            let ((mut a, a_lines), (mut b, b_lines)) = (spawn(0), spawn(1));
            let (a_ready, b_ready) = (ready(a_lines), ready(b_lines));
            if a_ready == b_ready {
                return Some((a, b, a_ready));
            }
            for t in [&mut a, &mut b] {
                let _ = t.kill();
                let _ = t.wait();
            }
            None
        })
        .expect("two twins started within one second");
    let (mut a, mut b, ready) = twins;
    assert!(ready.starts_with("1 "), "each is pid 1 in its namespace: {ready}");
    for twin in [&mut a, &mut b] {
        twin.stdin.take().unwrap().write_all(b"g").unwrap();
        let status = twin.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(twin.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        assert!(status.success(), "{stderr}");
    }
    let texts = reports(&out, "txt");
    let jsons = reports(&out, "json");
    assert_eq!((texts.len(), jsons.len()), (2, 2), "both reports kept: {texts:?} {jsons:?}");
    // Two processes' reports, not one twice: each holds its own twin's
    // request. (Their clock zeros may be equal: a wall clock that ticks in
    // milliseconds gives two processes started together one reading.)
    let mut requested: Vec<u64> = jsons
        .iter()
        .map(|j| {
            let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(j).unwrap()).unwrap();
            assert_eq!(report["run"]["pid"], 1);
            report["diagnosis"]["requested"].as_u64().unwrap()
        })
        .collect();
    requested.sort_unstable();
    let float = 4u64;
    assert_eq!(requested, [TOO_BIG as u64 * float, (TOO_BIG as u64 + 1) * float], "one report of each twin");
    std::fs::remove_dir_all(&out).ok();
}
