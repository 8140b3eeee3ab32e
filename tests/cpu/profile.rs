//! The line profiler on CPU tensors, with exact byte counts. Every function
//! measures the CPU explicitly, so the figures are the same on a GPU machine.
//! The allocator's counters are process-wide: the tests of this file run one
//! at a time (see `serial`).

use crate::common::{floats, serial};
use std::panic;
use std::sync::{Arc, Mutex};

use memlab::Render;
use memlab::{
    profiler::{FunctionReport, LineStats},
    Device,
};
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;

fn allocated() -> i64 {
    memlab::stats::device_stats(Device::Cpu).unwrap().allocated_bytes.all.current
}

fn function(name: &str) -> FunctionReport {
    memlab::report().function(name).unwrap_or_else(|e| panic!("{e}")).clone()
}

fn line<'a>(f: &'a FunctionReport, code: &str) -> &'a LineStats {
    let l = f.find(code).unwrap_or_else(|| panic!("a line containing {code:?} in {}", f.name));
    l.stats.as_ref().unwrap_or_else(|| panic!("line {} ({code:?}) ran", l.line))
}

/// The figures of the `n`th closing brace (1 = the first) after the line
/// containing `code`: where a block's locals are freed when it ends.
fn brace_after<'a>(f: &'a FunctionReport, code: &str, n: usize) -> &'a LineStats {
    let start = f.lines.iter().position(|l| l.code.contains(code)).expect("the line exists");
    let brace = f.lines[start..].iter().filter(|l| l.code.trim() == "}").nth(n - 1).expect("a closing brace");
    brace.stats.as_ref().unwrap_or_else(|| panic!("the closing brace on line {} ran", brace.line))
}

fn never_ran(f: &FunctionReport, code: &str) -> bool {
    f.find(code).expect("line exists").stats.is_none()
}

fn stat(s: &LineStats, name: &str) -> i64 {
    s.values[index_of(name)]
}

fn index_of(name: &str) -> usize {
    match name.parse::<memlab::profiler::ProfileColumn>().unwrap() {
        memlab::profiler::ProfileColumn::Stat(i) => i,
        other => panic!("{other:?} is not a statistic"),
    }
}

#[memlab::profile(device = "cpu")]
fn known_allocations() -> Tensor {
    let weight = Tensor::zeros([1024, 1024], (Kind::Float, tch::Device::Cpu));
    let bias = floats(256);
    let transient = floats(2 * 1024 * 1024).numel();
    drop(bias);
    assert_eq!(transient, 2 * 1024 * 1024);
    weight
}

#[test]
fn exact_figures_for_known_allocations() {
    let _s = serial();
    memlab::reset();
    let base = allocated();
    let weight = known_allocations();
    let f = function("known_allocations");
    assert_eq!(f.calls, 1);
    assert_eq!(f.device, Some(Device::Cpu));

    let entry = line(&f, "fn known_allocations");
    assert_eq!((entry.hits, stat(entry, "allocated_bytes.all.current"), entry.increment), (1, base, 0));

    // A 1024x1024 f32 tensor: 4 MiB, by the allocator and by an independent count.
    let w = line(&f, "let weight");
    let expected = 1024 * 1024 * 4;
    assert_eq!(w.increment, expected);
    assert_eq!(memlab::stats::storage_info(&weight).unwrap().nbytes as i64, expected);
    assert_eq!(stat(w, "allocated_bytes.all.current"), base + 4 * MIB);
    assert_eq!(stat(w, "active_bytes.all.peak"), base + 4 * MIB);
    assert_eq!(stat(w, "allocation.all.allocated"), 1);

    assert_eq!(line(&f, "let bias").increment, 1024);

    // The 8 MiB temporary lives and dies inside its statement: a peak, no increment.
    let t = line(&f, "let transient");
    assert_eq!(t.increment, 0);
    assert_eq!(stat(t, "active_bytes.all.peak"), base + 4 * MIB + 1024 + 8 * MIB);
    assert_eq!(stat(t, "allocated_bytes.all.current"), base + 4 * MIB + 1024);
    assert_eq!(stat(t, "allocated_bytes.all.freed"), 8 * MIB);

    let d = line(&f, "drop(bias)");
    assert_eq!((d.increment, stat(d, "allocated_bytes.all.freed")), (-1024, 1024));
    assert_eq!(line(&f, "assert_eq!(transient").increment, 0);
    assert_eq!(stat(line(&f, "    weight"), "allocated_bytes.all.current"), base + 4 * MIB);
    assert_eq!(allocated(), base + 4 * MIB);
}

#[memlab::profile(device = "cpu")]
fn inner_spike() -> usize {
    let spike = floats(4 * 1024 * 1024);
    spike.numel()
}

#[memlab::profile(device = "cpu")]
fn outer_calls_inner() -> usize {
    let kept = floats(1024 * 1024);
    let n = inner_spike();
    n + kept.numel()
}

#[test]
fn nested_calls_keep_the_callers_peak() {
    let _s = serial();
    memlab::reset();
    let base = allocated();
    assert_eq!(outer_calls_inner(), 5 * 1024 * 1024);
    let outer = function("outer_calls_inner");
    let call = line(&outer, "let n = inner_spike()");
    // inner_spike's probes reset the allocator's peak; the caller's line still
    // sees the 16 MiB spike on top of its own 4 MiB.
    assert_eq!(stat(call, "active_bytes.all.peak"), base + 4 * MIB + 16 * MIB);
    assert_eq!(call.increment, 0);
    let inner = function("inner_spike");
    assert_eq!(stat(line(&inner, "let spike"), "active_bytes.all.peak"), base + 20 * MIB);
    assert_eq!(line(&inner, "let spike").increment, 16 * MIB);
    // The callee's locals are freed at its closing brace, not by its last statement.
    assert_eq!(line(&inner, "spike.numel()").increment, 0);
    assert_eq!(brace_after(&inner, "spike.numel()", 1).increment, -16 * MIB);
}

#[memlab::profile(device = "cpu")]
fn early_return(stop: bool) -> usize {
    let a = floats(1024 * 1024);
    if stop {
        return a.numel();
    }
    let b = floats(1024);
    a.numel() + b.numel()
}

#[test]
fn early_return_records_the_returning_statement() {
    let _s = serial();
    memlab::reset();
    early_return(true);
    let f = function("early_return");
    let r = line(&f, "return a.numel()");
    assert_eq!(r.hits, 1);
    // Returning drops `a`: that belongs to the statement that returned.
    assert_eq!(r.increment, -4 * MIB);
    assert!(never_ran(&f, "let b"));
    assert!(never_ran(&f, "a.numel() + b.numel()"));

    early_return(false);
    let f = function("early_return");
    assert_eq!(f.calls, 2);
    assert_eq!(line(&f, "let b").hits, 1);
    assert_eq!(line(&f, "if stop").hits, 2);
}

#[memlab::profile(device = "cpu")]
fn search(stop_at: usize) -> usize {
    let mut seen = 0;
    for i in 0..3 {
        for j in 0..3 {
            let local = floats(100);
            seen += local.numel();
            if i * 3 + j == stop_at {
                return seen;
            }
        }
    }
    seen
}

#[test]
fn a_return_inside_nested_loops_frees_on_its_own_line() {
    let _s = serial();
    memlab::reset();
    // Found at once: the 400-byte local is freed by the `return`, and the
    // inner loop's closing brace never ran.
    assert_eq!(search(0), 100);
    let f = function("profile::search");
    let r = line(&f, "return seen");
    assert_eq!((r.hits, r.increment), (1, -400));
    let brace = f.lines.iter().filter(|l| l.code.trim() == "}").nth(1).expect("the inner loop's brace");
    assert!(brace.stats.is_none(), "the inner closing brace ran: {:?}", brace.stats);

    // Found at the fifth visit: four bodies end at the brace, one returns.
    memlab::reset();
    assert_eq!(search(4), 500);
    let f = function("profile::search");
    let r = line(&f, "return seen");
    assert_eq!((r.hits, r.increment, r.increment_total), (1, -400, -400));
    let brace = brace_after(&f, "return seen", 2);
    assert_eq!((brace.hits, brace.increment, brace.increment_total), (4, -400, -1600));
}

#[memlab::profile(device = "cpu")]
fn with_question_mark(text: &str) -> Result<usize, std::num::ParseIntError> {
    let t = floats(1024 * 1024);
    let n: usize = text.parse()?;
    Ok(n + t.numel())
}

#[test]
fn question_mark_records_the_failing_statement() {
    let _s = serial();
    memlab::reset();
    assert!(with_question_mark("not a number").is_err());
    let f = function("profile::with_question_mark");
    let q = line(&f, "text.parse()?");
    assert_eq!((q.hits, q.increment), (1, -4 * MIB));
    assert!(never_ran(&f, "Ok(n + t.numel())"));
    assert_eq!(with_question_mark("2"), Ok(2 + 1024 * 1024));
    assert_eq!(line(&function("profile::with_question_mark"), "Ok(n + t.numel())").hits, 1);
}

#[memlab::profile(device = "cpu")]
fn panics_after_allocating() -> usize {
    let held = floats(1024 * 1024);
    assert!(held.numel() == 0, "deliberate panic");
    held.numel()
}

#[test]
fn panic_records_the_panicking_statement() {
    let _s = serial();
    memlab::reset();
    let hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let result = panic::catch_unwind(panics_after_allocating);
    panic::set_hook(hook);
    assert!(result.is_err());
    let f = function("panics_after_allocating");
    let p = line(&f, "deliberate panic");
    // Unwinding frees `held` before the frame closes the statement.
    assert_eq!((p.hits, p.increment), (1, -4 * MIB));
    assert!(never_ran(&f, "    held.numel()"));
    assert_eq!(f.calls, 1);
}

#[memlab::profile(device = "cpu")]
fn recurse(depth: u32) -> usize {
    let level = floats(256 * 1024);
    if depth == 0 {
        return level.numel();
    }
    recurse(depth - 1) + level.numel()
}

#[test]
fn recursion_merges_calls_and_keeps_outer_peaks() {
    let _s = serial();
    memlab::reset();
    let base = allocated();
    assert_eq!(recurse(3), 4 * 256 * 1024);
    let f = function("recurse");
    assert_eq!(f.calls, 4);
    assert_eq!(line(&f, "fn recurse").hits, 4);
    assert_eq!(line(&f, "let level").hits, 4);
    let tail = line(&f, "recurse(depth - 1)");
    assert_eq!(tail.hits, 3);
    // At the deepest point all four levels (1 MiB each) were alive.
    assert_eq!(stat(tail, "active_bytes.all.peak"), base + 4 * MIB);
    // Each callee frees its level at its own closing brace, inside the
    // caller's line: the line itself keeps nothing.
    assert_eq!((tail.increment, tail.increment_total), (0, 0));
    // The three calls that reach the end free their level at the closing
    // brace; the deepest returns early, and its `return` frees it.
    let brace = brace_after(&f, "recurse(depth - 1)", 1);
    assert_eq!((brace.hits, brace.increment, brace.increment_total), (3, -MIB, -3 * MIB));
    let early = line(&f, "return level.numel()");
    assert_eq!((early.hits, early.increment), (1, -MIB));
}

#[memlab::profile(device = "cpu")]
fn sized(n: i64) -> Tensor {
    let t = floats(n);
    t
}

#[test]
fn repeated_calls_merge_per_line() {
    let _s = serial();
    memlab::reset();
    let kept: Vec<Tensor> = [1024, 3 * 1024, 2 * 1024].into_iter().map(sized).collect();
    let f = function("sized");
    let l = line(&f, "let t = floats(n)");
    assert_eq!(l.hits, 3);
    assert_eq!(l.increment, 12 * 1024);
    assert_eq!(l.increment_total, 24 * 1024);
    assert_eq!(stat(l, "allocation.all.allocated"), 1);
    assert_eq!(kept.len(), 3);
}

#[memlab::profile(device = "cpu")]
fn loop_body(steps: usize) -> Vec<Tensor> {
    let mut kept = Vec::new();
    let mut total = 0usize;
    for i in 0..steps {
        let t = floats(1024);
        if i % 2 == 0 {
            kept.push(t);
        } else {
            let scratch = floats(2048);
            drop(scratch);
        }
        match i {
            0 => {
                let first = floats(256);
                drop(first);
            }
            _ => total += i,
        }
        unsafe {
            let p: *const usize = &i;
            total += *p;
        }
    }
    let mut n = 0;
    while n < 3 {
        n += 1;
    }
    loop {
        if n == 3 {
            break;
        }
    }
    assert!(total > 0);
    kept
}

#[test]
fn statements_in_nested_blocks_get_their_own_rows() {
    let _s = serial();
    memlab::reset();
    let kept = loop_body(4);
    assert_eq!(kept.len(), 2);
    let f = function("loop_body");
    assert_eq!(line(&f, "for i in 0..steps").hits, 1);
    let t = line(&f, "let t = floats(1024)");
    assert_eq!((t.hits, t.increment), (4, 4096));
    assert_eq!(line(&f, "kept.push(t)").hits, 2);
    let scratch = line(&f, "let scratch");
    assert_eq!((scratch.hits, scratch.increment), (2, 8192));
    // `t` of odd iterations is dropped at the end of the body, after the last statement.
    assert_eq!(line(&f, "drop(scratch)").increment, -8192);
    // The `t` of odd iterations is freed when the loop body ends: its closing
    // brace (the second after `total += *p`; the first closes `unsafe`).
    assert_eq!(line(&f, "total += *p").increment_total, 0);
    assert_eq!(brace_after(&f, "total += *p", 1).increment_total, 0);
    assert_eq!(brace_after(&f, "total += *p", 2).increment_total, -2 * 4096);
    assert_eq!(line(&f, "let first").hits, 1);
    assert_eq!(line(&f, "let p: *const usize").hits, 4);
    assert_eq!(line(&f, "total += *p").hits, 4);
    assert_eq!(line(&f, "        n += 1").hits, 3);
    assert_eq!(line(&f, "break;").hits, 1);
}

#[memlab::profile(device = "cpu")]
fn threaded(n: i64) -> usize {
    let t = floats(n);
    t.numel()
}

#[test]
fn many_threads_at_once() {
    let _s = serial();
    memlab::reset();
    let handles: Vec<_> =
        (0..4).map(|_| std::thread::spawn(|| (0..25).map(|_| threaded(1024)).sum::<usize>())).collect();
    let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(total, 100 * 1024);
    let f = function("threaded");
    assert_eq!(f.calls, 100);
    assert!(f.error.is_none());
    let l = line(&f, "let t = floats(n)");
    assert_eq!(l.hits, 100);
    // Other threads' allocations count too, so the figure is at least our own.
    assert!(l.increment >= 4096, "{}", l.increment);
    assert!(f.find("t.numel()").unwrap().stats.as_ref().unwrap().hits == 100);
}

#[memlab::profile_every(2, device = "cpu")]
fn every_second_call() -> usize {
    let t = floats(1024);
    t.numel()
}

#[test]
fn profile_every_prints_the_last_n_calls() {
    let _s = serial();
    memlab::reset();
    let printed = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = printed.clone();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(move |text| {
        sink.lock().unwrap().push(text.to_string())
    })));
    for _ in 0..3 {
        every_second_call();
    }
    assert_eq!(printed.lock().unwrap().len(), 1);
    every_second_call();
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    let printed = printed.lock().unwrap();
    assert_eq!(printed.len(), 2);
    for table in printed.iter() {
        assert!(table.starts_with("## cpu::profile::every_second_call  (cpu, 2 calls)\n"), "{table}");
        assert!(table.contains("+4.00K     2"), "{table}");
    }
    // The report keeps every call.
    assert_eq!(function("every_second_call").calls, 4);
}

const SNAPSHOT_LINE: u32 = line!() + 2;
#[memlab::profile(device = "cpu")]
fn snapshot_subject() -> usize {
    let a = floats(1024 * 1024);
    let b = floats(512);
    let mut parts = vec![a, b];
    parts.pop();
    parts.len()
}

#[test]
fn text_table_snapshot() {
    let _s = serial();
    memlab::reset();
    snapshot_subject();
    snapshot_subject();
    let report =
        memlab::report().filter("snapshot_subject").with_columns(&["increment", "increment_total", "hits"]).unwrap();
    let rows = [
        "    0.00B            0.00B     2  {0}  fn snapshot_subject() -> usize {{",
        "   +4.00M           +8.00M     2  {1}      let a = floats(1024 * 1024);",
        "   +2.00K           +4.00K     2  {2}      let b = floats(512);",
        "    0.00B            0.00B     2  {3}      let mut parts = vec![a, b];",
        "   -2.00K           -4.00K     2  {4}      parts.pop();",
        "    0.00B            0.00B     2  {5}      parts.len()",
        "   -4.00M           -8.00M     2  {6}  }}",
    ];
    let mut expected = String::from(
        "## cpu::profile::snapshot_subject  (cpu, 2 calls)\n\nincrement  increment_total  hits  line  code\n",
    );
    for (i, row) in rows.iter().enumerate() {
        let line = format!("{:>4}", SNAPSHOT_LINE + i as u32);
        expected.push_str(&row.replace(&format!("{{{i}}}"), &line).replace("{{", "{").replace("}}", "}"));
        expected.push('\n');
    }
    expected.push('\n');
    assert_eq!(report.to_text(), expected);
}

#[test]
fn html_csv_and_json_carry_the_same_figures() {
    let _s = serial();
    memlab::reset();
    snapshot_subject();
    let report = memlab::report().filter("snapshot_subject");
    let html = report.to_html();
    assert!(html.contains("<table>") && html.contains("+4.00M") && html.contains("let mut parts = vec![a, b];"));
    assert!(html.contains("-&gt; usize"), "code is escaped");

    let csv = report.to_csv().unwrap();
    let mut rows = csv::Reader::from_reader(csv.as_bytes());
    let header = rows.headers().unwrap().clone();
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    let records: Vec<csv::StringRecord> = rows.records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 7, "one row per line that ran, the closing brace included");
    let a = records.iter().find(|r| r[col("code")].starts_with("let a")).unwrap();
    assert_eq!(&a[col("increment")], (4 * MIB).to_string());
    assert_eq!(a[col("line")].parse::<u32>().unwrap(), SNAPSHOT_LINE + 1);
    assert_eq!(&a[col("allocation.all.allocated")], "1");

    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let lines = &json["functions"][0]["lines"];
    let a = lines.as_array().unwrap().iter().find(|l| l["line"] == SNAPSHOT_LINE + 1).unwrap();
    assert_eq!(a["increment"], 4 * MIB);
    assert_eq!(a["stats"]["allocated_bytes.all.allocated"], 4 * MIB);
    // The closing brace ran: the locals were freed there.
    let brace = lines.as_array().unwrap().last().unwrap();
    assert_eq!(brace["increment"], -4 * MIB);
}

#[memlab::profile(device = "cuda:7")]
fn on_a_missing_gpu() -> usize {
    let t = floats(16);
    t.numel()
}

#[test]
fn an_unavailable_device_is_reported_not_fatal() {
    let _s = serial();
    memlab::reset();
    assert_eq!(on_a_missing_gpu(), 16);
    let f = function("on_a_missing_gpu");
    let error = f.error.as_deref().expect("an error is recorded");
    assert!(error.starts_with("cuda:7 is not available"), "{error}");
    assert!(memlab::report().filter("on_a_missing_gpu").to_text().contains("not measured: cuda:7 is not available"));
}

#[memlab::profile(device = "cpu")]
fn never_called() {}

#[test]
fn uncalled_functions_are_listed() {
    let _s = serial();
    memlab::reset();
    let report = memlab::report();
    let f = report.function("never_called").expect("registered at compile time");
    assert!(!f.ran());
    assert!(
        report.to_text().contains("Profiled, never called: ")
            && report.to_text().contains("cpu::profile::never_called")
    );
}

#[test]
fn disabled_profiling_records_nothing() {
    let _s = serial();
    memlab::reset();
    memlab::profiler::set_enabled(false);
    let kept = sized(8);
    memlab::profiler::set_enabled(true);
    assert_eq!(kept.numel(), 8);
    assert!(!function("sized").ran());
}

#[test]
fn unknown_columns_are_rejected_with_a_hint() {
    let err = memlab::report().with_columns(&["active_bytes.peak"]).unwrap_err();
    assert!(err.to_string().contains("`active_bytes.peak` is not a statistic"), "{err}");
    assert!(memlab::profiler::set_default_columns(&["nope"]).is_err());
}

#[memlab::profile(device = "cpu")]
async fn async_allocation() -> usize {
    let t = floats(1024);
    std::future::ready(()).await;
    t.numel()
}

#[test]
fn async_fn_is_profiled_across_await() {
    let _s = serial();
    memlab::reset();
    let fut = async_allocation();
    let n = block_on(fut);
    assert_eq!(n, 1024);
    let f = function("async_allocation");
    assert_eq!(line(&f, "let t = floats(1024)").increment, 4096);
    assert_eq!(line(&f, ".await").hits, 1);
}

fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
}
