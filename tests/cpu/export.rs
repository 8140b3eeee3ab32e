//! PyTorch memory snapshots of CPU recordings, checked by PyTorch's own
//! reader (`python -m torch.cuda._memory_viz`, from the project's venv) and
//! key by key against the `Snapshot`, `Segment`, `Block`, `TraceEntry` and
//! `Frame` types `torch/cuda/memory.py` documents.

use std::path::PathBuf;
use std::process::Command;

use crate::common::chromium::{self, Browser};
use crate::common::pytorch::{bytes_as_pytorch_prints, python, VALIDATE};
use crate::common::{floats, serial};
use memlab::export::Exporter;
use memlab::render::Cell;
use memlab::Device;
use memlab::Render;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

#[memlab::profile(device = "cpu")]
fn leaky_step(net: &nn::Sequential, opt: &mut nn::Optimizer, kept: &mut Vec<Tensor>) {
    let x = Tensor::ones([16, 32], (Kind::Float, tch::Device::Cpu));
    let logits = net.forward(&x);
    let loss = logits.square().mean(Kind::Float);
    opt.backward_step(&loss);
    kept.push(logits);
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memlab-export-{}-{name}", std::process::id()))
}

#[test]
fn a_cpu_recording_opens_in_pytorchs_reader() {
    let _s = serial();
    memlab::clear_registry();
    let settings = memlab::events::Settings::default().backtraces(true);
    let recording = memlab::Recording::start(settings).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 32, 32, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let mut kept = Vec::new();
    for _ in 0..3 {
        opt.with_mut(|opt| leaky_step(&net, opt, &mut kept));
    }
    let extra = floats(1000);

    let snapshot = Exporter::registered().snapshot().unwrap();
    let path = temp("snapshot.pickle");
    snapshot.write_pickle(&path).unwrap();
    let file = path.to_str().unwrap();

    // PyTorch's own reader: both text views succeed.
    let stats = python(&["-m", "torch.cuda._memory_viz", "stats", file]);
    let trace = python(&["-m", "torch.cuda._memory_viz", "trace", file]);
    assert!(trace.contains("entries") && trace.contains("TOTAL MEM"), "{trace}");
    println!("{stats}\n{}", trace.lines().take(12).collect::<Vec<_>>().join("\n"));

    // Every key and type PyTorch documents, and the figures.
    let summary: serde_json::Value = serde_json::from_str(&python(&["-c", VALIDATE, file])).unwrap();
    let live_cpu: u64 = memlab::events::live().iter().filter(|a| a.device == Device::Cpu).map(|a| a.size).sum();
    assert_eq!(summary["allocated"], live_cpu, "the CPU's segments hold what is live");
    // `stats` prints the same total, in its own units.
    let total = stats.lines().find(|l| l.starts_with("total_allocated:")).unwrap_or_default().to_string();
    assert!(total.contains(&bytes_as_pytorch_prints(live_cpu)), "{total} vs {live_cpu}\n{stats}");
    let files = summary["files"].as_array().unwrap();
    assert!(files.iter().any(|f| f == "export.rs"), "the user's .rs file in the frames: {files:?}");
    let categories = summary["categories"].as_array().unwrap();
    for c in ["parameter", "gradient", "optimizer_state", "unnamed"] {
        assert!(categories.iter().any(|x| x == c), "category {c}: {categories:?}");
    }
    assert_eq!(summary["partial"], false);

    // The profiled statement names its line in the innermost user frame.
    let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
    let line = line_of("let logits = net.forward(&x);");
    let logits = snapshot.device_traces[cpu]
        .iter()
        .find(|e| e.action == "alloc" && e.frames.first().is_some_and(|f| f.line == line))
        .unwrap_or_else(|| panic!("an allocation at line {line}"));
    assert!(logits.frames[0].name.contains("leaky_step"), "{:?}", logits.frames[0]);

    // What the page needs beyond PyTorch's keys reads back as written: the
    // names of what was alive at export, the line profile as data, libtorch.
    let read = memlab::export::Snapshot::read_pickle(&path).unwrap();
    assert_eq!(format!("{:?}", read.snapshot), format!("{snapshot:?}"));
    assert!(read.ignored.is_empty(), "{:?}", read.ignored);
    let info = read.snapshot.memlab.as_ref().unwrap();
    let run = info.run.as_ref().unwrap();
    assert_eq!(run.libtorch.as_deref(), Some(memlab::optimizer::libtorch_version()));
    assert_eq!((run.pid, run.devices.len()), (std::process::id(), 0));
    // The clock's zero on the wall clock: before now, and since the process began.
    let now_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    let started_us = run.process_start.expect("/proc tells") * 1_000_000;
    assert!(started_us <= run.clock_zero_unix_us + 1_000_000 && run.clock_zero_unix_us <= now_us, "{run:?}");
    let profile = info.profile.as_ref().expect("a profiled function ran");
    assert_eq!(profile.function("leaky_step").unwrap().calls, 3);
    assert_eq!(profile.clone().filter("leaky_step").to_text(), memlab::report().filter("leaky_step").to_text());
    let weight = &vs.variables()["fc.weight"];
    let named: Vec<_> = read.snapshot.device_traces[cpu]
        .iter()
        .filter(|e| e.tensor.as_deref().is_some_and(|t| t.ends_with("fc.weight")))
        .collect();
    assert_eq!(named.len(), 1, "one allocation named, the weight's own");
    assert_eq!((named[0].addr, named[0].size), (Some(weight.data_ptr() as u64), 32 * 32 * 4));
    drop((extra, kept, recording));
    std::fs::remove_file(&path).ok();
    memlab::clear_registry();
}

#[inline(never)]
fn make_buffer() -> Tensor {
    Tensor::zeros([777], (Kind::Float, tch::Device::Cpu))
}

#[memlab::profile(device = "cpu")]
fn calls_a_helper() -> Tensor {
    let buffer = make_buffer();
    buffer
}

#[test]
fn a_helper_called_from_a_profiled_statement_keeps_its_own_line() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let buffer = calls_a_helper();
    let snapshot = Exporter::registered().snapshot().unwrap();
    let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
    let alloc = snapshot.device_traces[cpu]
        .iter()
        .find(|e| e.action == "alloc" && e.size == 777 * 4)
        .expect("the helper's allocation");
    let helper = line_of("Tensor::zeros([777], (Kind::Float, tch::Device::Cpu))");
    let statement = line_of("let buffer = make_buffer();");
    let lines: Vec<(&str, u32)> = alloc.frames.iter().map(|f| (f.name.as_str(), f.line)).collect();
    assert!(
        lines[0].0.ends_with("make_buffer") && lines[0].1 == helper,
        "innermost: the helper at its line: {lines:?}"
    );
    let caller = lines.iter().find(|(name, _)| name.ends_with("calls_a_helper")).expect("the profiled caller");
    assert_eq!(caller.1, statement, "the profiled function at its statement: {lines:?}");
    drop((buffer, recording));
}

#[test]
fn a_bounded_history_says_the_data_is_partial() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().capacity(4)).unwrap();
    let tensors: Vec<Tensor> = (0..10).map(|_| floats(64)).collect();
    let snapshot = Exporter::registered().snapshot().unwrap();
    let info = snapshot.memlab.as_ref().expect("memlab's notes");
    assert!(info.partial && info.dropped >= 6, "{info:?}");
    let path = temp("partial.pickle");
    snapshot.write_pickle(&path).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&python(&["-c", VALIDATE, path.to_str().unwrap()])).unwrap();
    assert_eq!(summary["partial"], true);
    // Every picture says so: the trace, and each drawing of the HTML report.
    let trace: serde_json::Value = serde_json::from_str(&Exporter::registered().trace().unwrap().to_json()).unwrap();
    assert_eq!(trace["otherData"]["partial"], true);
    let process = trace["traceEvents"].as_array().unwrap().iter().find(|e| e["name"] == "process_name").unwrap();
    assert!(process["args"]["name"].as_str().unwrap().contains("partial"), "{process}");
    let report = Exporter::registered().html_report().unwrap();
    assert!(report.partial);
    let html = report.to_page();
    // Each drawing marks it: the timeline by event and by time (its text
    // is HTML over the plot), and the icicle graph.
    let charts: Vec<&str> =
        html.split("<div class=\"chart ").skip(1).map(|s| s.split("</svg>").nth(1).unwrap()).collect();
    assert_eq!(charts.len(), 2, "a timeline by event and by time for the CPU");
    assert!(charts.iter().all(|c| c.contains("<span class=\"partial\">partial: older events were dropped")));
    let flames: Vec<&str> =
        html.split("<svg class=\"flame\"").skip(1).map(|s| s.split("</svg>").next().unwrap()).collect();
    assert_eq!(flames.len(), 1);
    assert!(flames[0].contains("class=\"partial\""));
    assert!(html.matches("<p class=\"partial\">").count() >= 2, "the page and the peak table say it");
    drop((tensors, recording));
    std::fs::remove_file(&path).ok();
}

/// The line of this file where `code` is.
fn line_of(code: &str) -> u32 {
    let source = include_str!("export.rs");
    source.lines().position(|l| l.contains(code)).expect("the code is in this file") as u32 + 1
}

#[test]
fn trace_counters_equal_the_allocators_figures() {
    let _s = serial();
    let before = floats(5000); // allocated before the recording: in the counters' levels
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let mut marks = Vec::new();
    let mut kept = Vec::new();
    for i in 0..6 {
        kept.push(floats(1000 * (i + 1)));
        if i % 2 == 1 {
            drop(kept.remove(0));
        }
        let cpu_events = memlab::events::history().0.iter().filter(|e| e.device == Device::Cpu).count();
        let stats = memlab::stats::device_stats(Device::Cpu).unwrap();
        marks.push((cpu_events, stats.allocated_bytes.all.current, stats.active_bytes.all.current));
    }
    let trace = Exporter::registered().trace().unwrap();
    let samples = &trace.counters[&Device::Cpu];
    for (n, allocated, active) in &marks {
        let level = samples[n - 1].level;
        assert_eq!((level.allocated, level.active), (*allocated, *active), "after CPU event {n}");
    }
    assert!(samples.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    // The page's peak counts what the recording saw; the trace's, walked
    // back from the allocator, also what lived before it (they differed by
    // what was allocated before). The page gives both, each labelled.
    let page = Exporter::registered().html_report().unwrap();
    let cpu = page.summary.devices.iter().find(|d| d.device == "cpu").unwrap();
    assert!(cpu.unseen_before >= 5000 * 4, "the floats made before the recording: {}", cpu.unseen_before);
    let trace_peak = samples.iter().map(|s| s.level.allocated).max().unwrap();
    assert_eq!((cpu.peak.allocated + cpu.unseen_before) as i64, trace_peak);
    let text = page.summary.to_text();
    let row = |label: &str| {
        let line = text.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("{label}:\n{text}"));
        line[label.len()..].split_whitespace().next().unwrap().to_string()
    };
    assert_eq!(row("peak allocated, since the recording began"), Cell::bytes(cpu.peak.allocated).to_string());
    assert_eq!(row("peak allocated, with what lived before"), Cell::bytes(trace_peak).to_string());

    // The JSON: a counter track per device, one sample per event.
    let path = temp("trace.json");
    trace.write_json(&path).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let cpu: Vec<&serde_json::Value> = events.iter().filter(|e| e["name"] == "cpu memory").collect();
    assert_eq!(cpu.len(), samples.len());
    assert!(cpu.iter().all(|e| e["ph"] == "C" && e["args"]["allocated"].is_i64() && e["ts"].is_number()));
    let last = marks.last().unwrap();
    assert_eq!(cpu[last.0 - 1]["args"]["allocated"], last.1);
    assert_eq!(doc["otherData"]["partial"], false);
    drop((kept, before, recording));
    std::fs::remove_file(&path).ok();
}

#[test]
fn the_html_report_opens_offline_in_chromium() {
    let _s = serial();
    memlab::clear_registry();
    memlab::reset(); // the profile counts this test's calls only
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 32, 32, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let mut kept = Vec::new();
    for _ in 0..4 {
        leaky_step(&net, &mut opt, &mut kept);
    }
    let report = Exporter::registered().html_report().unwrap();
    let cpu = report.devices.iter().find(|d| d.device == Device::Cpu).expect("a CPU section");
    // The peak is the allocator's highest level over the recording.
    assert!(cpu.points.iter().all(|p| p.allocated <= cpu.peak_bytes));
    assert_eq!(cpu.points.iter().map(|p| p.allocated).max(), Some(cpu.peak_bytes));
    assert!(cpu.points.len() <= 400);
    let rows: u64 = cpu.live_at_peak.iter().map(|r| r.bytes).sum();
    assert_eq!(rows as i64, cpu.peak_bytes, "what was live at the peak adds up to it");
    assert!(cpu.live_at_peak.iter().any(|r| r.label == "model.fc.weight (named at export)"), "{:?}", cpu.live_at_peak);
    // The line profile is data in the report, rendered as the page's last part.
    let profile = report.profile.as_ref().expect("a profiled function ran");
    let step = profile.function("leaky_step").unwrap();
    assert_eq!(step.calls, 4);
    let html = report.to_page();
    assert!(html.contains("default-src 'none'") && !html.contains("<script"), "no script, nothing fetched");
    // The profile's blocks, as its own rendering has them inside its styled block.
    let block = profile.to_html();
    let blocks = block.split_once("</style>\n").and_then(|(_, b)| b.strip_suffix("</div>")).unwrap();
    assert!(html.contains(&format!("<h2>Line profile</h2>\n{blocks}")), "the profile is on the page");
    assert_eq!(html.matches("<style>").count(), 1, "one stylesheet on the page");
    let path = temp("report.html");
    report.write(&path).unwrap();
    drop((kept, recording));
    memlab::clear_registry();

    let Some(mut browser) = Browser::launch(1100, 1400) else { return };
    let url = format!("file://{}", path.display());
    let mut page = browser.open(&url);
    assert_eq!(page.console_errors(), Vec::<String>::new(), "the page loads without console errors or CSP violations");
    // The timeline has its layers and one hover target per point.
    assert!(page.eval("document.querySelectorAll('svg.by-time polygon.layer').length").as_u64().unwrap() >= 2);
    let targets = page.eval("document.querySelectorAll('svg.by-time rect.hover').length").as_u64().unwrap();
    assert_eq!(targets as usize, cpu.points.len());
    // One drawing shows at a time; the switch shows the other.
    let visible = |page: &mut crate::common::chromium::Page<'_>, class: &str| {
        page.eval(&format!("getComputedStyle(document.querySelector('div.chart.{class}')).display != 'none'")).as_bool()
    };
    assert_ne!(visible(&mut page, "by-time"), visible(&mut page, "by-event"), "one drawing at a time");
    page.click("div.axes label[for$='-by-time']");
    assert_eq!((visible(&mut page, "by-time"), visible(&mut page, "by-event")), (Some(true), Some(false)));
    page.click("div.axes label[for$='-by-event']");
    assert_eq!((visible(&mut page, "by-time"), visible(&mut page, "by-event")), (Some(false), Some(true)));
    page.click("div.axes label[for$='-by-time']");
    // Hovering a column shows its point's figures, as the data says. (The
    // widest column: narrow ones can be a pixel wide and overlap.)
    let widest = page
        .eval(
            "(() => { const r = [...document.querySelectorAll('svg.by-time rect.hover')]; \
             const w = r.map(e => e.getBoundingClientRect().width); return w.indexOf(Math.max(...w)); })()",
        )
        .as_u64()
        .unwrap() as usize;
    let tip = page
        .hover(&format!("svg.by-time rect.hover:nth-of-type({})", widest + 1), "svg.by-time rect.hover")
        .expect("the column is hovered");
    let point = &cpu.points[widest];
    let expected = format!("{:.3} s: {} allocated", point.time_us / 1e6, memlab::render::Cell::bytes(point.allocated));
    assert!(tip.starts_with(&expected), "{tip:?} starts with {expected:?}");
    // Zoom: the plot widens in a box that scrolls sideways, its drawing and
    // its finer ticks with it, its labels unstretched.
    let shown_ticks = "[...document.querySelectorAll('div.chart.by-time div.ticks span')]\
                       .filter(s => getComputedStyle(s).display != 'none').length";
    let width = |page: &mut crate::common::chromium::Page<'_>, what: &str| {
        page.eval(&format!("document.querySelector('div.chart.by-time {what}').getBoundingClientRect().width")).as_f64()
    };
    let (plot, box_width, ticks) = (width(&mut page, "svg"), width(&mut page, "div.scroll"), page.eval(shown_ticks));
    let label = width(&mut page, "span.mark.peak");
    page.click("div.axes label[for$='-z16']");
    let zoomed = width(&mut page, "svg").unwrap();
    assert!((zoomed / plot.unwrap() - 16.0).abs() < 0.01, "16 times as wide: {plot:?} → {zoomed}");
    assert!(box_width == width(&mut page, "div.scroll"), "in the same box");
    assert!(page.eval(shown_ticks).as_u64() > ticks.as_u64(), "finer ticks");
    assert_eq!(width(&mut page, "span.mark.peak"), label, "the peak's label keeps its width");
    let scrolls = page.eval(
        "(() => { const b = document.querySelector('div.chart.by-time div.scroll'); \
                             return b.scrollWidth > 15 * b.clientWidth; })()",
    );
    assert_eq!(scrolls.as_bool(), Some(true));
    page.click("div.axes label[for$='-z1']");
    assert_eq!(width(&mut page, "svg"), plot);

    // The icicle graph names the user's function; hovering it gives its bytes.
    let flame = page.eval("document.querySelector('svg.flame').textContent").as_str().unwrap().to_string();
    assert!(flame.contains("leaky_step (tests/cpu/export.rs:"), "{flame}");
    page.eval(
        "[...document.querySelectorAll('svg.flame g.frame')].find(g => \
         g.querySelector('text') && g.querySelector('text').textContent.includes('leaky_step')).id = 'probe'",
    );
    let tip = page.hover("#probe rect", "svg.flame g.frame").expect("the frame is hovered");
    let node = find_node(&cpu.flame, "leaky_step").expect("leaky_step in the data");
    assert!(
        tip.starts_with(&node.name) && tip.contains(&memlab::render::Cell::bytes(node.bytes).to_string()),
        "{tip:?} for {node:?}"
    );
    // The line profile is there with its bars.
    let profile = page.eval("document.body.innerHTML").as_str().unwrap().to_string();
    assert!(profile.contains("cpu::export::leaky_step") && profile.contains("linear-gradient"), "line profile");
    drop(page);

    // The console check catches a page that breaks the policy.
    let broken = temp("broken.html");
    std::fs::write(
        &broken,
        "<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'\">\
         </head><body><script>document.title = 'ran'</script></body></html>",
    )
    .unwrap();
    let mut page = browser.open(&format!("file://{}", broken.display()));
    let errors = page.console_errors();
    assert!(errors.iter().any(|e| e.contains("Content Security Policy")), "{errors:?}");
    assert_ne!(page.eval("document.title"), "ran", "the policy blocks the script");
    drop(page);
    drop(browser);

    let shot = temp("report.png");
    let status = Command::new(chromium::command().unwrap())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,1400"])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .unwrap();
    assert!(status.status.success() && std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000), "a screenshot");
    std::fs::remove_file(&path).ok();
    std::fs::remove_file(&broken).ok();
    std::fs::remove_file(&shot).ok();
}

/// The first node of the icicle graph whose name contains `name`.
fn find_node<'a>(node: &'a memlab::export::FlameNode, name: &str) -> Option<&'a memlab::export::FlameNode> {
    if node.name.contains(name) {
        return Some(node);
    }
    node.children.iter().find_map(|c| find_node(c, name))
}

#[test]
fn the_trace_has_calls_steps_iterations_and_readings() {
    let _s = serial();
    memlab::clear_registry();
    let settings = memlab::events::Settings::default().sampling(std::time::Duration::from_millis(1));
    let recording = memlab::Recording::start(settings).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 32, 32, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let mut logger = memlab::StepLogger::new();
    logger.stop();
    let mut monitor = memlab::TrainingMonitor::new(&vs).print_period(0);
    let mut kept = Vec::new();
    for i in 0..3 {
        logger.log(&format!("step {i}"), || leaky_step(&net, &mut opt, &mut kept));
        monitor.record_stats_with(&opt);
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    let trace = Exporter::registered().trace().unwrap();
    let snapshot = Exporter::registered().snapshot().unwrap();
    drop(recording);

    let spans = |kind| trace.spans.iter().filter(move |s| s.kind == kind);
    let calls: Vec<_> = spans(memlab::events::SpanKind::Call).collect();
    let steps: Vec<_> = spans(memlab::events::SpanKind::Step).collect();
    let iterations: Vec<_> = spans(memlab::events::SpanKind::Iteration).collect();
    assert_eq!((calls.len(), steps.len(), iterations.len()), (3, 3, 3), "{:?}", trace.spans);
    assert!(calls.iter().all(|c| c.name.ends_with("leaky_step")), "{calls:?}");
    assert_eq!(steps.iter().map(|s| s.name.as_ref()).collect::<Vec<_>>(), ["step 0", "step 1", "step 2"]);
    assert_eq!(iterations[2].name, "epoch 1 iteration 3");
    for (call, step) in calls.iter().zip(&steps) {
        assert!(step.start_ns <= call.start_ns && call.end_ns <= step.end_ns, "the call lies inside its step");
        assert_eq!(call.thread, memlab::events::thread_number());
    }
    // The steps' allocations fall inside the steps.
    let history = memlab::events::history().0;
    let in_steps = history.iter().filter(|e| steps.iter().any(|s| (s.start_ns..=s.end_ns).contains(&e.time_ns)));
    assert!(in_steps.count() >= 3 * 4);

    // The readings: the resident set as the kernel counts it, read by the recording's thread.
    assert!(trace.readings.len() >= 5, "{} readings", trace.readings.len());
    let rss = memlab::logger::rss();
    let last = trace.readings.last().unwrap();
    assert!(last.rss > 0 && last.rss.abs_diff(rss) < 64 << 20, "{} vs {rss}", last.rss);
    assert!(trace.readings.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));

    // The JSON: slices on the thread's track, a resident-set counter.
    let doc: serde_json::Value = serde_json::from_str(&trace.to_json()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let slices: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(slices.len(), 9);
    let step0 = slices.iter().find(|e| e["name"] == "step 0").unwrap();
    assert_eq!(step0["cat"], "step");
    assert_eq!(step0["tid"], memlab::events::thread_number());
    let ts = step0["ts"].as_f64().unwrap();
    assert!((ts - steps[0].start_ns as f64 / 1000.0).abs() < 0.01, "{ts}");
    assert!(step0["dur"].as_f64().unwrap() > 0.0);
    let rss_counters = events.iter().filter(|e| e["name"] == "process resident set" && e["ph"] == "C").count();
    assert_eq!(rss_counters, trace.readings.len());
    assert!(events.iter().any(|e| e["ph"] == "M" && e["name"] == "thread_name"));

    // Gradients of earlier steps died before the export (Adam's zero_grad
    // frees them): the walks at the logged steps named them.
    let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
    let entries = &snapshot.device_traces[cpu];
    let dead_gradient = entries.iter().enumerate().any(|(i, e)| {
        e.action == "alloc"
            && e.category == Some(memlab::export::Category::Gradient)
            && entries[i + 1..].iter().any(|f| f.action == "free_completed" && f.addr == e.addr)
    });
    assert!(dead_gradient, "a gradient freed before the export keeps its name");
    drop((kept, logger, monitor));
    memlab::clear_registry();
}

/// A request of 2^48 bytes (256 TiB) fails under any overcommit setting.
const TOO_BIG: i64 = 1 << 46; // floats: 2^48 bytes

#[memlab::profile(device = "cpu")]
fn asks_too_much() -> Result<Tensor, tch::TchError> {
    let t = Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu))?;
    Ok(t)
}

#[test]
fn a_failed_cpu_request_is_an_oom_event_and_the_error_still_arrives() {
    let _s = serial();
    let before = memlab::stats::device_stats(Device::Cpu).unwrap();
    let settings = memlab::events::Settings::default().backtraces(true);
    let recording = memlab::Recording::start(settings).unwrap();
    let err = asks_too_much().expect_err("2^48 bytes cannot be allocated");
    assert!(err.to_string().contains("allocate memory"), "libtorch's own error reaches the caller: {err}");
    // The program goes on: the allocator still serves and counts.
    let after_oom = floats(1000);
    let (history, _) = memlab::events::history();
    let oom = history.iter().find(|e| e.action == memlab::events::Action::Oom).expect("an oom event");
    assert_eq!((oom.device, oom.size), (Device::Cpu, 1u64 << 48));
    let (_, host_total) = memlab::logger::host_memory().unwrap();
    assert!(oom.address > 0 && oom.address <= host_total, "the host's available memory: {}", oom.address);
    let line = line_of("let t = Tensor::f_empty([TOO_BIG], (Kind::Float, tch::Device::Cpu))?;");
    assert_eq!(oom.statement.map(|s| s.line), Some(line), "the profiled statement that failed");
    let frames = oom.backtrace.as_ref().expect("the failing call's frames").frames();
    assert!(frames.iter().any(|f| f.function.contains("asks_too_much")), "{frames:?}");
    // Nothing was counted for the failed request.
    let now = memlab::stats::device_stats(Device::Cpu).unwrap();
    assert_eq!(now.allocated_bytes.all.current - before.allocated_bytes.all.current, 4000);

    // The exports show it: the trace's instant event, the snapshot's `oom` entry.
    let trace = Exporter::registered().trace().unwrap();
    assert_eq!(trace.ooms.len(), 1);
    assert_eq!((trace.ooms[0].requested, trace.ooms[0].device_free), (1 << 48, Some(oom.address)));
    let snapshot = Exporter::registered().snapshot().unwrap();
    let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
    let entry = snapshot.device_traces[cpu].iter().find(|e| e.action == "oom").expect("an oom entry");
    assert_eq!((entry.size, entry.device_free), (1 << 48, Some(oom.address)));
    assert_eq!(entry.frames.first().map(|f| f.line), Some(line));
    // The page marks it on the CPU's memory over time, where it happened.
    let report = Exporter::registered().html_report().unwrap();
    let device = report.devices.iter().find(|d| d.device == Device::Cpu).unwrap();
    let event = snapshot.device_traces[cpu].iter().position(|e| e.action == "oom").unwrap() as u64 + 1;
    assert_eq!(device.ooms.iter().map(|o| (o.requested, o.event)).collect::<Vec<_>>(), [(1 << 48, event)]);
    let page = report.to_page();
    assert_eq!(page.matches("<line class=\"oom\"").count(), 2, "on the drawings by event and by time");
    assert!(page.contains(">out of memory: 256.00T asked</span>"));
    // PyTorch's reader takes the snapshot with its `oom` entry.
    let path = temp("oom.pickle");
    snapshot.write_pickle(&path).unwrap();
    let file = path.to_str().unwrap();
    python(&["-c", VALIDATE, file]);
    let trace = python(&["-m", "torch.cuda._memory_viz", "trace", file]);
    assert!(trace.contains("raise OutOfMemoryError # 256.0TiB requested"), "{trace}");
    std::fs::remove_file(&path).ok();
    drop((after_oom, recording));

    // The line profile counts it on the failing line and shows the column.
    assert_eq!(memlab::stats::device_stats(Device::Cpu).unwrap().num_ooms - before.num_ooms, 1);
    let report = memlab::report();
    let f = report.function("asks_too_much").unwrap();
    let ooms: Vec<(u32, u64)> =
        f.lines.iter().filter_map(|l| l.stats.as_ref().filter(|s| s.ooms > 0).map(|s| (l.line, s.ooms))).collect();
    assert_eq!(ooms, [(line, 1)]);
    let text = report.to_text();
    let table = text.split("## ").find(|t| t.contains("asks_too_much")).unwrap();
    assert!(table.lines().any(|l| l.contains("ooms")), "the ooms column appears:\n{table}");
    // Columns: the figures, hits, ooms, then the line number and the code.
    let failing: Vec<&str> =
        table.lines().find(|l| l.contains("Tensor::f_empty")).unwrap().split_whitespace().collect();
    let at = failing.iter().position(|w| *w == line.to_string()).unwrap();
    assert_eq!((failing[at - 2], failing[at - 1]), ("1", "1"), "hits and ooms: {failing:?}");
    // Other tables (other tests' profiled functions, when they ran) keep their columns.
    for other in text.split("## ").filter(|t| t.contains("hits") && !t.starts_with("cpu::export::asks_too_much")) {
        assert!(!other.contains("ooms"), "a function without an OOM keeps its columns:\n{other}");
    }
}

#[test]
fn exports_while_another_thread_allocates_give_the_allocators_figures() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().capacity(2000)).unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let churned = std::sync::Arc::new(AtomicU64::new(0));
    // Allocated before the other thread starts: every sample comes after it.
    let kept = floats(1000);
    let churn = {
        let (stop, churned) = (stop.clone(), churned.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // 64 MiB, never touched: allocated and freed at once.
                drop(Tensor::empty([16 << 20], (Kind::Float, tch::Device::Cpu)));
                churned.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut checked = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut export = 0;
    // At least 1,000 exports, while the other thread allocated at least 500 times.
    while export < 1000 || (churned.load(Ordering::Relaxed) < 500 && std::time::Instant::now() < deadline) {
        export += 1;
        let trace = Exporter::registered().trace().unwrap();
        let samples = &trace.counters[&Device::Cpu];
        for s in samples {
            assert!(s.level.allocated >= 4000, "export {export}: {:?} below what stays allocated", s.level);
            assert_eq!(s.level.active, s.level.allocated, "export {export}");
        }
        checked += samples.len();
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    let churned = churned.load(Ordering::Relaxed);
    println!("{checked} samples of {export} exports, while the other thread made {churned} allocations");
    assert!(churned >= 500, "the other thread allocated throughout ({churned})");
    assert!(checked > 1000, "samples were checked");
    drop((kept, recording));
}

/// One builder makes the HTML report: the page of a live recording and
/// `memlab view`'s page of the same recording's snapshot file are one page,
/// apart from the title and the file's name.
#[test]
fn the_live_report_and_memlab_view_of_its_snapshot_are_one_page() {
    let _s = serial();
    memlab::clear_registry();
    memlab::reset();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 32, 32, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let mut kept = Vec::new();
    for _ in 0..3 {
        leaky_step(&net, &mut opt, &mut kept);
    }
    let exporter = Exporter::registered();
    let path = temp("one_page.pickle");
    exporter.snapshot().unwrap().write_pickle(&path).unwrap();
    let live = exporter.html_report().unwrap().to_page();
    drop((kept, recording));
    memlab::clear_registry();

    let name = path.to_str().unwrap();
    let file = memlab_core::export::Snapshot::read_pickle(&path).unwrap();
    let summary = memlab_cli::analysis::Summary::of(name, &file);
    let viewed = memlab_cli::view::page(name, &file, &summary);
    let live = live.replacen("<title>memlab report</title>", "<title>TITLE</title>", 1);
    let viewed = viewed.replacen(&format!("<title>memlab: {name}</title>"), "<title>TITLE</title>", 1);
    let live = live.replace("this process&#39;s recording", "FILE");
    let viewed = viewed.replace(name, "FILE");
    assert!(live.contains("model.fc.weight (named at export)") && live.contains("leaky_step (tests/cpu/export.rs:"));
    if live != viewed {
        let at = live.bytes().zip(viewed.bytes()).position(|(a, b)| a != b).unwrap_or(live.len().min(viewed.len()));
        let around = |page: &str| page[at.saturating_sub(200)..(at + 200).min(page.len())].to_string();
        panic!("the pages differ at byte {at}:\nlive:   {}\nviewed: {}", around(&live), around(&viewed));
    }
    std::fs::remove_file(&path).ok();
}

#[test]
fn a_folded_run_of_frames_lists_them_when_clicked() {
    // PyTorch's default recording: each run of frames that are not the
    // program's own is one node of the icicle graph, which lists them when
    // clicked, with no script on the page.
    let name = "transformer_all.pickle";
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
    let file = memlab_core::export::Snapshot::read_pickle(&fixture).unwrap();
    let summary = memlab_cli::analysis::Summary::of(name, &file);
    let path = temp("folded.html");
    std::fs::write(&path, memlab_cli::view::page(name, &file, &summary)).unwrap();
    let Some(mut browser) = Browser::launch(1100, 1400) else { return };
    let mut page = browser.open(&format!("file://{}", path.display()));
    assert_eq!(page.console_errors(), Vec::<String>::new(), "no console errors or CSP violations");
    // Its setup takes most of the time: memory over time is drawn by event first.
    let checked = page.eval("document.querySelector('div.axes input:checked').className");
    assert_eq!(checked.as_str(), Some("by-event"));
    let shown = "[...document.querySelectorAll('div.fold')].filter(d => getComputedStyle(d).display != 'none').length";
    assert_eq!(page.eval(shown).as_u64(), Some(0), "no list shows before a click");
    let folded = "svg.flame a[href^='#fold-'] rect";
    let label =
        page.eval(&format!("document.querySelector(\"{folded}\").parentElement.querySelector('title').textContent"));
    page.click(folded);
    assert_eq!(page.eval(shown).as_u64(), Some(1), "the click shows one list");
    let list =
        page.eval("document.querySelector('div.fold:target').innerText").as_str().unwrap_or_default().to_string();
    let label = label.as_str().unwrap().lines().next().unwrap().to_string();
    assert!(list.starts_with(&label), "the list of the node clicked: {label:?}\n{list}");
    let count: usize = label.trim_start_matches("… ").split(' ').next().unwrap().parse().unwrap();
    assert_eq!(
        page.eval("document.querySelectorAll('div.fold:target li').length").as_u64(),
        Some(count as u64),
        "{list}"
    );
    std::fs::remove_file(&path).ok();
}

/// Autograd's backward functions are named from libtorch's symbol table:
/// on the CPU, its engine runs the backward pass on the calling thread, so
/// the allocation keeps the user's line; its native frames name the backward
/// function that made it, which is what names an allocation on CUDA, where
/// the engine's own thread runs it with no frame of the user's.
#[test]
fn a_backward_allocations_native_frames_name_its_op() {
    let _s = serial();
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
    let x = Tensor::randn([64, 128], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([128, 32], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let loss = x.matmul(&w).sum(Kind::Float);
    let (before, _) = memlab::events::history();
    let from = before.last().map_or(0, |e| e.seq + 1);
    loss.backward();
    let grad = w.grad();
    let (history, _) = memlab::events::history();
    let made = history
        .iter()
        .find(|e| e.seq >= from && e.action == memlab::events::Action::Alloc && e.address == grad.data_ptr() as u64)
        .expect("the gradient's allocation was recorded");
    let backtrace = made.backtrace.as_ref().expect("backtraces were on");
    let names: Vec<String> = backtrace.functions().into_iter().flatten().map(|n| n.to_string()).collect();
    assert!(names.iter().any(|n| n.starts_with("torch::autograd::generated::MmBackward0::apply(")), "{names:#?}");
    assert!(names.iter().any(|n| n.starts_with("torch::autograd::Engine::")), "{names:#?}");
    // The same frames without the user's: what the engine's thread has.
    let native: Vec<memlab::export::SnapshotFrame> = names
        .iter()
        .map(|n| memlab::export::SnapshotFrame { filename: "??".into(), line: 0, name: n.clone() })
        .collect();
    let site = memlab_core::export::frames::site(&native).map(|s| s.0);
    assert_eq!(site.as_deref(), Some("autograd's backward pass (MmBackward0)"));
    // The snapshot keeps the user's line: the backward() call.
    let snapshot = Exporter::registered().snapshot().unwrap();
    let entry = snapshot.device_traces.iter().flatten().find(|e| e.addr == Some(grad.data_ptr() as u64)).unwrap();
    assert!(entry.frames.iter().any(|f| f.filename.ends_with("cpu/export.rs")), "{:?}", entry.frames);
    drop((grad, loss, x, w, recording));
}
