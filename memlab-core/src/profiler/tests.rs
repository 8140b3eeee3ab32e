//! The engine (frames, the peak ledger, user resets) driven through the
//! scripted backend, without libtorch.

use crate::backend::{Backend, ScriptedBackend};
use crate::device::Device;
use crate::profiler::{reset_peaks, reset_totals, Frame, LineStats, ProfiledFn, ProfiledFnMeta};
use crate::stats::DeviceSelector;
use crate::stats::RawStats;
use crate::stats::{field_index, ALLOCATED_BYTES_CURRENT};

// Each test scripts a device of its own: the peak ledger is per device
// and process-wide, and tests run in parallel.
static SCRIPT: ScriptedBackend = ScriptedBackend::new(8);

const SOURCE: &[&str] = &["fn f() {", "  a", "  b", "  c", "  d", "}"];

fn meta(device: usize, name: fn() -> &'static str) -> ProfiledFnMeta {
    ProfiledFnMeta {
        name,
        file: "scripted.rs",
        first_line: 10,
        signature_line: 10,
        source: SOURCE,
        device: Some(DeviceSelector::Fixed(Device::Cuda(device))),
        every: 0,
    }
}

fn line(function: &'static ProfiledFn, line: u32) -> LineStats {
    let state = function.state();
    state.as_ref().unwrap().total.lines[(line - 10) as usize].clone().expect("the line ran")
}

fn stat(stats: &LineStats, name: &str) -> i64 {
    stats.values[field_index(name).unwrap()]
}

#[test]
fn a_callers_line_keeps_the_peak_its_callee_reset() {
    static OUTER: std::sync::OnceLock<ProfiledFn> = std::sync::OnceLock::new();
    static INNER: std::sync::OnceLock<ProfiledFn> = std::sync::OnceLock::new();
    let outer = OUTER.get_or_init(|| ProfiledFn::new(meta(1, || "t::outer::__memlab_here")));
    let inner = INNER.get_or_init(|| ProfiledFn::new(meta(1, || "t::inner::__memlab_here")));
    let gpu = Device::Cuda(1);
    {
        let frame: Frame = Frame::enter(outer, &SCRIPT);
        frame.line(11);
        SCRIPT.alloc(gpu, 100);
        frame.line(12);
        {
            // The callee's probes reset the allocator's peak at each line.
            let callee: Frame = Frame::enter(inner, &SCRIPT);
            callee.line(11);
            SCRIPT.alloc(gpu, 1000);
            callee.line(12);
            SCRIPT.free(gpu, 1000);
        }
        frame.line(13);
        SCRIPT.free(gpu, 100);
    }
    let call = line(outer, 12);
    assert_eq!(stat(&call, "allocated_bytes.all.peak"), 1100, "the callee's spike on top of the caller's 100");
    assert_eq!(call.increment, 0);
    assert_eq!(line(outer, 11).increment, 100);
    assert_eq!(line(outer, 13).increment, -100);
    let spike = line(inner, 11);
    assert_eq!((spike.increment, stat(&spike, "allocated_bytes.all.peak")), (1000, 1100));
    assert_eq!(stat(&spike, "allocated_bytes.all.allocated"), 1000);
    assert_eq!(stat(&line(inner, 12), "allocation.all.freed"), 1);
}

#[test]
fn user_resets_inside_a_line_keep_its_figures() {
    static FUNCTION: std::sync::OnceLock<ProfiledFn> = std::sync::OnceLock::new();
    let function = FUNCTION.get_or_init(|| ProfiledFn::new(meta(2, || "t::resets::__memlab_here")));
    let gpu = Device::Cuda(2);
    {
        let frame: Frame = Frame::enter(function, &SCRIPT);
        frame.line(11);
        SCRIPT.alloc(gpu, 500);
        SCRIPT.free(gpu, 500);
        reset_peaks(&SCRIPT, gpu).unwrap();
        SCRIPT.alloc(gpu, 64);
        reset_totals(&SCRIPT, gpu).unwrap();
        SCRIPT.alloc(gpu, 32);
    }
    let l = line(function, 11);
    assert_eq!(stat(&l, "allocated_bytes.all.peak"), 500, "the peak before the reset is kept");
    assert_eq!(stat(&l, "allocated_bytes.all.allocated"), 500 + 64 + 32, "totals before the reset are kept");
    assert_eq!(stat(&l, "allocated_bytes.all.freed"), 500);
    assert_eq!(l.increment, 96);
    let mut now = RawStats::default();
    SCRIPT.sample(gpu, &mut now, false).unwrap();
    assert_eq!(now.0[ALLOCATED_BYTES_CURRENT], 96, "the script's own level");
}

#[test]
fn the_programs_reads_keep_the_peaks_a_watch_reset() {
    use crate::profiler::{read, PeakWatch};
    let gpu = Device::Cuda(3);
    let peak_field = field_index("allocated_bytes.all.peak").unwrap();
    let read_peak = || {
        let mut raw = RawStats::default();
        read(&SCRIPT, gpu, &mut raw).unwrap();
        raw.0[peak_field]
    };
    // An 8 MiB temporary, then a watch over a span (what the cell logger,
    // a monitor or a profiled line does): it resets the allocator's peak.
    SCRIPT.alloc(gpu, 8 << 20);
    SCRIPT.free(gpu, 8 << 20);
    assert_eq!(read_peak(), 8 << 20);
    let watch = PeakWatch::start(&SCRIPT, gpu).unwrap();
    SCRIPT.alloc(gpu, 1024);
    SCRIPT.free(gpu, 1024);
    let (_, end) = watch.finish().unwrap();
    assert_eq!(end.0[peak_field], 1024, "the watch's own peak");
    let mut raw = RawStats::default();
    SCRIPT.sample(gpu, &mut raw, false).unwrap();
    assert_eq!(raw.0[peak_field], 0, "the allocator's own counter was reset");
    assert_eq!(read_peak(), 8 << 20, "the program reads the peak since its own last reset");
    // The program's own reset is the one its reads follow.
    reset_peaks(&SCRIPT, gpu).unwrap();
    assert_eq!(read_peak(), 0);
    SCRIPT.alloc(gpu, 512);
    SCRIPT.free(gpu, 512);
    drop(PeakWatch::start(&SCRIPT, gpu).unwrap());
    assert_eq!(read_peak(), 512);
}
