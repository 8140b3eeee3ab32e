//! The out-of-memory recorder when memory really runs out: a child process
//! under an address-space limit (`RLIMIT_AS`, as `ulimit -v` and batch
//! schedulers set it) asks for more than the limit leaves, armed or not,
//! with and without a large recording, and must get its `Err` and go on,
//! with the report written as far as the reserve allows. And the estimates
//! the recorder goes by: each must stay above what the part it estimates
//! really takes, measured by a counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::{check_child, child};
use memlab::OomRecorder;
use memlab::Render;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

/// The Rust heap of this test binary: bytes in use and their peak.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator; the counters only watch.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = IN_USE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            if new_size >= layout.size() {
                let now = IN_USE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                IN_USE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The most the Rust heap grew while `f` ran, above where it started.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = IN_USE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(start))
}

/// Two functions that call each other by the bits of a counter: 2^(DEPTH+1)
/// distinct call stacks, each DEPTH frames of this file deep.
const DEPTH: usize = 10;

#[inline(never)]
fn left(i: usize, depth: usize) -> Tensor {
    if depth == 0 {
        return Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu));
    }
    let t = if (i >> depth) & 1 == 0 { left(i, depth - 1) } else { right(i, depth - 1) };
    std::hint::black_box(t)
}

#[inline(never)]
fn right(i: usize, depth: usize) -> Tensor {
    if depth == 0 {
        return Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu));
    }
    let t = if (i >> depth) & 1 == 0 { left(i, depth - 1) } else { right(i, depth - 1) };
    std::hint::black_box(t)
}

/// Records `pairs` allocations and frees (each kept alive one in `keep_every`)
/// from one call site, or from thousands of deep stacks.
#[memlab::profile(device = "cpu")]
fn churn(pairs: usize, deep: bool, keep_every: usize, kept: &mut Vec<Tensor>) {
    for i in 0..pairs {
        let t = if deep {
            if i & 1 == 0 {
                left(i, DEPTH)
            } else {
                right(i, DEPTH)
            }
        } else {
            Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu))
        };
        if i % keep_every == 0 {
            kept.push(t);
        }
    }
}

#[test]
fn the_estimates_stay_above_what_each_part_takes() {
    // Alone in a process of its own: the Rust heap's peak is this test's.
    const NAME: &str = "the_estimates_stay_above_what_each_part_takes";
    if !child(NAME) {
        let (stdout, _) = check_child(NAME, &[]);
        println!("{}", stdout.lines().filter(|l| l.contains(" pairs, deep ")).collect::<Vec<_>>().join("\n"));
        return;
    }
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 64, 64, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let x = Tensor::ones([8, 64], (Kind::Float, tch::Device::Cpu));
    // (pairs, distinct deep stacks, one allocation in `keep` kept alive)
    let shapes = [(50_000, false, 1000), (50_000, true, 1000), (20_000, false, 1), (20_000, true, 2)];
    let mut table = Vec::new();
    for (pairs, deep, keep) in shapes {
        let settings = memlab::events::Settings::default().capacity(4 * pairs).backtraces(true);
        let recording = memlab::Recording::start(settings).unwrap();
        opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
        let mut kept = Vec::new();
        churn(pairs, deep, keep, &mut kept);
        let stats = memlab::events::stats();
        let exporter = memlab::export::Exporter::registered();
        use memlab::format::FileFormat;
        let html = memlab::format::HtmlPage.estimate();
        let snapshot = memlab::format::SnapshotPickle.estimate();
        let by_site = memlab::format::Cost::BY_SITE.of(0, stats.live as u64);
        let (_, html_took) = peak_of(|| exporter.html_report().unwrap().to_page().len());
        let (_, snapshot_took) = peak_of(|| exporter.snapshot().unwrap().to_pickle().unwrap().len());
        let (_, by_site_took) = peak_of(|| {
            let report = memlab::MemReporter::registered().device(memlab::Device::Cpu).report().unwrap();
            report.to_text().len()
        });
        table.push(format!(
            "{pairs} pairs, deep {deep}, {} events, {} live: html {html_took} <= {html}, snapshot {snapshot_took} <= \
             {snapshot}, by site {by_site_took} <= {by_site}",
            stats.kept, stats.live
        ));
        assert!(html_took as u64 <= html, "{}", table.join("\n"));
        assert!(snapshot_took as u64 <= snapshot, "{}", table.join("\n"));
        assert!(by_site_took as u64 <= by_site, "{}", table.join("\n"));
        drop((kept, recording));
    }
    println!("{}", table.join("\n"));
    drop(opt);
    memlab::clear_registry();
}

/// This process's mapped address space, from the kernel.
fn mapped() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Limits this process's address space to what it maps now plus `headroom`.
fn limit_address_space(headroom: u64) {
    let limit = libc::rlimit { rlim_cur: mapped() + headroom, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads the struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
}

const MIB: u64 = 1 << 20;

/// One child: `headroom` MiB left under the limit, armed or not, with a
/// recording of `events` events or without (0); asks for 256 MiB more than
/// is left. With `exports`, the HTML report and the snapshot must have been
/// written (the reserve and the headroom cover them).
fn over_the_limit(headroom: u64, armed: bool, events: usize, exports: bool) {
    let recording = events > 0;
    memlab::profiler::set_print_at_exit(false);
    let out = std::env::temp_dir().join(format!("memlab-oom-limits-{}", std::process::id()));
    if armed {
        OomRecorder::new(&out).arm().unwrap();
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 64, 64, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let x = Tensor::ones([8, 64], (Kind::Float, tch::Device::Cpu));
    let mut train = || opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    train();
    let mut kept = Vec::new();
    let _recording = recording.then(|| {
        let settings = memlab::events::Settings::default().capacity(events).backtraces(true);
        let r = memlab::Recording::start(settings).unwrap();
        churn(events / 2 + 10_000, false, 1000, &mut kept);
        assert_eq!(memlab::events::stats().kept, events, "a full recording");
        r
    });
    limit_address_space(headroom * MIB);
    let asked = ((headroom + 256) * MIB / 4) as i64;
    let failed = Tensor::f_empty([asked], (Kind::Float, tch::Device::Cpu));
    assert!(failed.is_err(), "the caller gets libtorch's error");
    drop(failed);
    // The process goes on: it trains.
    train();
    train();
    println!("went on");
    if !armed {
        return;
    }
    let report = memlab::last_oom().expect("the failure was reported");
    assert_eq!(report.diagnosis.requested, (headroom + 256) * MIB);
    let text = std::fs::read_to_string(&report.files[0]).expect("the text report exists");
    assert!(text.contains("Verdict: "), "{text}");
    assert_eq!(report.partial, text.contains("This report is partial"), "{text}");
    // Under the limit: the figures are the limit's.
    let device = report.diagnosis.figures.device.expect("the host's figures");
    assert_eq!(device.limit, Some(memlab::oom::HostLimit::AddressSpace), "{text}");
    assert!(device.free < (headroom + 1) * MIB, "{text}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report.files[1]).unwrap()).unwrap();
    assert_eq!(json["partial"], report.partial);
    // With a recording, the HTML report and the snapshot are written or listed as left out.
    for extension in ["html", "pickle"] {
        let written = report.files.iter().any(|f| f.extension().is_some_and(|e| e == extension));
        let left_out = report
            .left_out
            .iter()
            .any(|l| l.file.as_ref().is_some_and(|f| f.extension().is_some_and(|e| e == extension)));
        assert_eq!(written || left_out, recording, "{extension}: {text}");
        assert!(!(written && left_out), "{extension}: {text}");
        assert!(written || !exports, "{extension} written: {text}");
        if left_out {
            assert!(text.contains("(estimated)"), "{text}");
        }
    }
    println!("{}", report.summary());
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_request_over_an_address_space_limit_is_reported_and_the_process_goes_on() {
    const NAME: &str = "a_request_over_an_address_space_limit_is_reported_and_the_process_goes_on";
    if child(NAME) {
        let number = |name: &str| std::env::var(name).unwrap().parse::<u64>().unwrap();
        let (headroom, armed, events) = (number("HEADROOM_MIB"), number("ARMED") == 1, number("EVENTS"));
        over_the_limit(headroom, armed, events as usize, number("EXPORTS") == 1);
        return;
    }
    // 8, 32 and 256 MiB left: with each, libtorch alone (unarmed) gets its
    // error and goes on, so the recorder must too; with a million events
    // recorded, the exports do not fit and are left out.
    for headroom in ["8", "32", "256"] {
        for armed in ["0", "1"] {
            for events in ["0", "1000000"] {
                let env = [("HEADROOM_MIB", headroom), ("ARMED", armed), ("EVENTS", events), ("EXPORTS", "0")];
                let (stdout, stderr) = check_child(NAME, &env);
                assert!(stdout.contains("went on"), "{env:?}:\n{stdout}\n{stderr}");
                if armed == "1" {
                    assert!(stderr.contains("memlab: out of memory on cpu"), "{env:?}:\n{stderr}");
                }
            }
        }
    }
    // A hundred thousand events: the reserve and 256 MiB cover both exports.
    let env = [("HEADROOM_MIB", "256"), ("ARMED", "1"), ("EVENTS", "100000"), ("EXPORTS", "1")];
    let (stdout, stderr) = check_child(NAME, &env);
    // Every format registered for reports, `formats.rs`'s own included.
    let rest: Vec<String> = memlab::format::written_in(|set| set.oom_reports)
        .iter()
        .skip(1)
        .map(|f| format!(".{}", f.extension()))
        .collect();
    let files = format!("(and {})", rest.join(", "));
    assert!(stdout.contains("went on") && stdout.contains(&files), "{files}: {stdout}\n{stderr}");
}

#[test]
fn the_watermark_warns_before_the_address_space_limit() {
    if child("the_watermark_warns_before_the_address_space_limit") {
        // 85% of the limit in use once armed; then 95%.
        let now = mapped() + memlab::oom::DEFAULT_RESERVE;
        let limit = (now as f64 / 0.85) as u64;
        limit_address_space(limit - mapped());
        OomRecorder::new(std::env::temp_dir()).arm().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let more = (limit as f64 * 0.95) as u64 - mapped();
        let held = Tensor::zeros([(more / 4) as i64], (Kind::Float, tch::Device::Cpu));
        std::thread::sleep(std::time::Duration::from_millis(500));
        drop(held);
        OomRecorder::disarm();
        return;
    }
    let (_, stderr) = check_child("the_watermark_warns_before_the_address_space_limit", &[]);
    assert_eq!(stderr.matches("memlab: this process has mapped").count(), 1, "once: {stderr}");
    assert!(stderr.contains("of the address-space limit (ulimit -v)"), "{stderr}");
}

#[test]
fn a_recording_that_cannot_grow_drops_its_oldest_events() {
    if child("a_recording_that_cannot_grow_drops_its_oldest_events") {
        memlab::profiler::set_print_at_exit(false);
        let settings = memlab::events::Settings::default().capacity(4_000_000);
        let recording = memlab::Recording::start(settings).unwrap();
        let mut kept = Vec::new();
        churn(300_000, false, 1000, &mut kept);
        let before = memlab::events::stats();
        assert_eq!(before.dropped, 0);
        // 32 MiB left: the history (600,000 events now) cannot double again.
        limit_address_space(32 * MIB);
        churn(600_000, false, 100_000, &mut kept);
        let after = memlab::events::stats();
        assert!(after.dropped > 0, "the oldest events made room: {after:?}");
        assert_eq!(after.kept as u64 + after.dropped, after.recorded, "every event is kept or counted: {after:?}");
        println!("went on: {after:?}");
        drop((kept, recording));
        return;
    }
    let (stdout, stderr) = check_child("a_recording_that_cannot_grow_drops_its_oldest_events", &[]);
    assert!(stdout.contains("went on"), "{stdout}\n{stderr}");
}
