//! memlab under threads, async, misuse and a bad environment, on CPU tensors:
//! one regression test per way it used to give a wrong answer, panic, hang or
//! deadlock. Tests that need a fresh process (environment variables read at
//! load, a stack overflow, libtorch's warnings on stderr) run this binary
//! again as a child with `MEMLAB_CHILD` naming the test to run.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::common::{check_child, child, floats, serial, within};
use memlab::Render;
use memlab::{
    events::Settings, profiler::DeviceSelector, reporter::RowKind, Device, DisposeScope, MemReporter, OnEscape,
    Recording,
};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;

// 1. Hooks and the recorder's user count change together.

static PAUSED: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

fn pause_in_last_release() {
    *PAUSED.0.lock().unwrap() = true;
    PAUSED.1.notify_all();
    // Long enough for another thread to try to start recording meanwhile.
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn a_last_release_cannot_clear_hooks_that_a_new_user_set() {
    let _s = serial();
    *PAUSED.0.lock().unwrap() = false;
    memlab::testing::pause_after_next_last_release(pause_in_last_release);
    // Thread A is the recorder's only user; it stops in its last release,
    // right before the hooks go off.
    let a = std::thread::spawn(|| drop(DisposeScope::new("a").unwrap().on_escape(OnEscape::Silent)));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut paused = PAUSED.0.lock().unwrap();
    while !*paused {
        assert!(Instant::now() < deadline, "thread A never reached its last release: another user is alive");
        paused = PAUSED.1.wait_timeout(paused, Duration::from_millis(100)).unwrap().0;
    }
    drop(paused);
    // Meanwhile this thread starts a scope: it must wait for A to finish,
    // then turn the hooks on again, rather than be switched off by A.
    let scope = DisposeScope::new("b").unwrap().on_escape(OnEscape::Silent);
    a.join().unwrap();
    let leak = floats(256);
    let report = scope.finish();
    assert_eq!(report.escaped_bytes(Device::Cpu), 1024, "the leak is seen:\n{report}");
    drop(leak);
}

#[test]
fn concurrent_checks_catch_every_leak() {
    let _s = serial();
    let checks = crate::common::concurrent_checks_catch_every_leak(2, Device::Cpu, 256, || floats(64));
    assert!(checks > 100, "the stress ran ({checks} checks)");
}

// 2. With memlab's CPU allocator off, tools that cannot see CPU memory say so.

#[test]
fn cpu_allocator_off_tools_say_so() {
    if child("cpu_allocator_off_tools_say_so") {
        assert!(!memlab::stats::cpu_allocator_installed());
        let scope = DisposeScope::new("step").err().expect("a scope cannot see CPU allocations");
        // The value given is quoted, whatever it was.
        assert!(scope.to_string().contains("turned off with MEMLAB_CPU_ALLOCATOR=\"off\""), "{scope}");
        let stats = memlab::stats::device_stats(Device::Cpu).expect_err("no CPU figures");
        assert!(stats.to_string().contains("MEMLAB_CPU_ALLOCATOR=\"off\""), "{stats}");
        assert!(memlab::check_step(|| ()).is_err());
        assert!(MemReporter::default().device(Device::Cpu).report().is_err());
        let mut tracker = memlab::Tracker::new().device(Device::Cpu).stdout(false);
        memlab::track!(tracker);
        assert!(tracker.last_error().is_some());
        return;
    }
    check_child("cpu_allocator_off_tools_say_so", &[("MEMLAB_CPU_ALLOCATOR", "off")]);
}

// 3. Interleaved profiled futures leave no statement behind.

/// Pending once, then ready.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

#[memlab::profile(device = "cpu")]
async fn async_work(n: i64) -> Tensor {
    let first = floats(n);
    YieldOnce(false).await;
    let second = floats(n);
    YieldOnce(false).await;
    first + second
}

#[test]
fn interleaved_futures_leave_no_stale_statement() {
    let _s = serial();
    let recording = Recording::start(Settings::default()).unwrap();
    let mut a = Box::pin(async_work(16));
    let mut b = Box::pin(async_work(32));
    let mut cx = Context::from_waker(Waker::noop());
    let (mut done_a, mut done_b) = (None, None);
    // A first, then B, then A finishes before B: frames close out of order.
    while done_a.is_none() || done_b.is_none() {
        if done_a.is_none()
            && let Poll::Ready(t) = a.as_mut().poll(&mut cx)
        {
            done_a = Some(t);
        }
        // Plain code between polls runs in no profiled statement.
        let between = floats(8);
        let live = memlab::events::live();
        let entry = live.iter().find(|l| l.address == memlab::stats::storage_info(&between).unwrap().data_ptr).unwrap();
        assert!(entry.statement.is_none(), "plain code attributed to {:?}", entry.statement);
        if done_b.is_none()
            && let Poll::Ready(t) = b.as_mut().poll(&mut cx)
        {
            done_b = Some(t);
        }
    }
    let plain = floats(4);
    let address = memlab::stats::storage_info(&plain).unwrap().data_ptr;
    let entry = memlab::events::live().into_iter().find(|l| l.address == address).unwrap();
    assert!(entry.statement.is_none(), "after both finished: {:?}", entry.statement);
    // Each future's own allocations name its own statements.
    let made = done_b.unwrap();
    let entry = memlab::events::live()
        .into_iter()
        .find(|l| l.address == memlab::stats::storage_info(&made).unwrap().data_ptr)
        .unwrap();
    assert!(entry.statement.unwrap().code().starts_with("first + second"), "{:?}", entry.statement);
    drop(recording);
}

// 4. Memory libtorch's allocator never allocated stays outside its sum.

#[test]
fn from_blob_storages_are_listed_outside_the_allocators_sum() {
    let _s = serial();
    let data = vec![0f32; 1024];
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _fc = nn::linear(vs.root() / "fc", 16, 16, Default::default());
    // SAFETY: `data` outlives the tensor, which is dropped with `vs` below.
    let blob = unsafe { Tensor::from_blob(data.as_ptr().cast(), &[1024], &[1], Kind::Float, tch::Device::Cpu) };
    vs.variables_.lock().unwrap().named_variables.insert("blob".into(), blob);
    let _recording = Recording::start(Settings::default()).unwrap();
    let report = MemReporter::new(&vs).report().unwrap();
    let cpu = report.device(Device::Cpu).unwrap();
    let blob = cpu.rows.iter().find(|r| r.name == "blob").expect("a row for the blob");
    assert_eq!((blob.kind, blob.bytes, blob.counted), (RowKind::External, 4096, false));
    assert_eq!(cpu.external_bytes, 4096);
    assert_eq!(cpu.named_bytes, (16 * 16 + 16) * 4, "only what the allocator allocated is named");
    let counted: i64 = cpu.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(counted, cpu.allocated_bytes, "the counted rows add up to the allocator:\n{report}");
    assert!(cpu.rows.iter().all(|r| r.bytes >= 0), "no negative correction row:\n{report}");
    drop(vs);
}

// 5. memlab's own resets keep the figures of the profiled lines running.

fn spike_then_reset_peaks() {
    drop(floats(MIB));
    memlab::stats::reset_peak_stats(Device::Cpu).unwrap();
}

fn allocate_then_reset_totals() -> Tensor {
    let kept = floats(MIB);
    memlab::stats::reset_accumulated_stats(Device::Cpu).unwrap();
    kept
}

#[memlab::profile(device = "cpu")]
fn resets_inside_a_line() -> Tensor {
    spike_then_reset_peaks();
    allocate_then_reset_totals()
}

#[test]
fn user_resets_keep_the_running_lines_figures() {
    let _s = serial();
    memlab::reset();
    let base = memlab::stats::device_stats(Device::Cpu).unwrap().allocated_bytes.all.current;
    let kept = resets_inside_a_line();
    let f = memlab::report().function("resets_inside_a_line").unwrap().clone();
    let stat = |code: &str, name: &str| {
        let column: memlab::profiler::ProfileColumn = name.parse().unwrap();
        column.value(f.find(code).unwrap().stats.as_ref().unwrap())
    };
    assert_eq!(stat("spike_then_reset_peaks()", "allocated_bytes.all.peak"), base + 4 * MIB);
    assert_eq!(stat("allocate_then_reset_totals()", "allocated_bytes.all.allocated"), 4 * MIB);
    assert_eq!(stat("allocate_then_reset_totals()", "allocation.all.allocated"), 1);
    drop(kept);
}

// 6. A correct training step keeps nothing; its new gradients are model state.

#[test]
fn a_training_step_replaces_gradients_without_escaping() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::linear(vs.root() / "fc", 32, 4, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-2).unwrap();
    let x = Tensor::ones([8, 32], (Kind::Float, tch::Device::Cpu));
    for step in 0..3 {
        let check = memlab::check_step_with(&vs, || opt.backward_step(&net.forward(&x).mean(Kind::Float))).unwrap();
        assert!(check.scope.escaped.is_empty(), "step {step}:\n{}", check.scope);
        assert_eq!(check.scope.model_state.len(), 2, "weight and bias gradients:\n{}", check.scope);
        assert_eq!(check.scope.counts(Device::Cpu).model_state_bytes, (32 * 4 + 4) * 4);
    }
    // A registered var store counts without being named.
    memlab::register_var_store("net", &vs);
    let check = memlab::check_step(|| opt.backward_step(&net.forward(&x).mean(Kind::Float))).unwrap();
    check.assert_no_escapes();
    memlab::clear_registry();
    // The validation-loop leak still fails: the total keeps every step's graph.
    let mut total = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    let check = memlab::check_step_with(&vs, || total = &total + net.forward(&x).mean(Kind::Float)).unwrap();
    assert!(!check.scope.escaped.is_empty(), "the accumulated loss escapes:\n{}", check.scope);
}

// 7. A block's locals are freed at its closing brace, not in its last statement.

#[memlab::profile(device = "cpu")]
fn last_statement_keeps_its_increment() {
    let _a = floats(1024);
    let _b = floats(2048);
    for _ in 0..3 {
        let _x = floats(256);
        let _y = floats(512);
    }
}

#[test]
fn each_statement_shows_its_own_increment() {
    let _s = serial();
    memlab::reset();
    last_statement_keeps_its_increment();
    let f = memlab::report().function("last_statement_keeps_its_increment").unwrap().clone();
    let line = |code: &str| f.find(code).unwrap().stats.clone().unwrap();
    assert_eq!(line("let _b = floats(2048)").increment, 8192);
    assert_eq!(line("let _y = floats(512)").increment, 2048);
    let braces: Vec<_> = f.lines.iter().filter(|l| l.code.trim() == "}").collect();
    let body = braces[0].stats.as_ref().expect("the loop body's brace ran");
    assert_eq!((body.hits, body.increment), (3, -(1024 + 2048)));
    let function = braces[1].stats.as_ref().expect("the function's brace ran");
    assert_eq!(function.increment, -(4096 + 8192));
}

// 8. Deep recursion of a profiled function fits an ordinary stack.

#[memlab::profile(device = "cpu")]
fn deep(n: u32) -> u32 {
    if n == 0 {
        return 0;
    }
    let below = deep(n - 1);
    below + 1
}

#[test]
fn recursion_2000_deep_fits_a_2_mib_stack() {
    if child("recursion_2000_deep_fits_a_2_mib_stack") {
        let depth = std::thread::Builder::new().stack_size(2 << 20).spawn(|| deep(2000)).unwrap().join().unwrap();
        assert_eq!(depth, 2000);
        assert_eq!(memlab::report().function("deep").unwrap().calls, 2001);
        return;
    }
    // A stack overflow aborts the process: it runs in a child of its own.
    check_child("recursion_2000_deep_fits_a_2_mib_stack", &[("MEMLAB_PRINT_AT_EXIT", "0")]);
}

// 9 and 10. The batch search leaves other panics alone and always ends.

static USER_HOOK_CALLS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn batch_search_keeps_the_users_panic_hook() {
    let _s = serial();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {
        USER_HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
    }));
    let before = USER_HOOK_CALLS.load(Ordering::SeqCst);
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::Bytes(i64::MAX), 64, |n| {
        if n == 2 {
            // A data-loader thread that panics during the search.
            let _ = std::thread::spawn(|| panic!("the data loader failed")).join();
        }
        if n > 8 {
            panic!("CUDA out of memory. Tried to allocate {n} GiB");
        }
        Ok(())
    })
    .unwrap();
    let calls = USER_HOOK_CALLS.load(Ordering::SeqCst) - before;
    std::panic::set_hook(previous);
    assert_eq!(search.largest, Some(8));
    assert_eq!(calls, 1, "the loader's panic reached the user's hook, the search's OOM panics did not");
}

#[test]
fn batch_search_ends_for_any_max() {
    let _s = serial();
    let search = within(Duration::from_secs(60), || {
        memlab::find_batch_size(Device::Cpu, memlab::Budget::Bytes(i64::MAX), usize::MAX, |_| Ok(())).unwrap()
    });
    assert_eq!(search.largest, Some(usize::MAX));
    assert!(search.tried.len() <= 66, "{} tries", search.tried.len());
}

// 11. An output sink may call memlab.

#[test]
fn an_output_sink_may_call_memlab() {
    if child("an_output_sink_may_call_memlab") {
        let seen = within(Duration::from_secs(20), || {
            let seen = Arc::new(AtomicUsize::new(0));
            let counter = seen.clone();
            memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
                // Re-entering memlab from a sink: replace the sink, log a call site.
                memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
                memlab::track!();
            })));
            memlab::track!();
            memlab::profiler::set_output(memlab::profiler::Output::Stdout);
            seen.load(Ordering::SeqCst)
        });
        assert_eq!(seen, 1);
        return;
    }
    // The global tracker keeps recording on for the rest of its process.
    check_child("an_output_sink_may_call_memlab", &[]);
}

// 12. measure_model explains a forward that autograd cannot go back through.

#[test]
fn measure_model_without_grad_is_an_error() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::linear(vs.root() / "fc", 8, 2, Default::default());
    let x = Tensor::ones([4, 8], (Kind::Float, tch::Device::Cpu));
    let err = memlab::measure_model(&vs, |x| net.forward(x).detach(), &x, &[]).unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
}

// 13 and 21. GPU figures on a machine without that GPU: an error naming the
// cause, and no panic on the way.

#[test]
fn driver_figures_without_the_device_are_clear_errors() {
    let _s = serial();
    let previous = std::panic::take_hook();
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    std::panic::set_hook(Box::new(|_| {
        CALLS.fetch_add(1, Ordering::SeqCst);
    }));
    let count = memlab::gpu::cuda_device_count();
    let missing = count + 7;
    let driver = memlab::gpu::driver_memory(missing).unwrap_err();
    let account = memlab::where_gpu_memory_went(missing).unwrap_err();
    let nvml = memlab::gpu::process_gpu_memory(missing).unwrap_err();
    std::panic::set_hook(previous);
    assert_eq!(CALLS.load(Ordering::SeqCst), 0, "no panic reached the hook");
    for err in [driver, account, nvml] {
        assert_eq!(err, memlab::Error::DeviceUnavailable { device: Device::Cuda(missing), count }, "{err}");
        assert!(err.to_string().contains(&format!("cuda:{missing} is not available")), "{err}");
    }
}

// 14. Scopes closed out of order hand escapes to a scope still open.

#[test]
fn scopes_closed_out_of_order_hand_nothing_to_a_closed_scope() {
    let _s = serial();
    let outer = DisposeScope::new("outer").unwrap().on_escape(OnEscape::Silent);
    let a = DisposeScope::new("a").unwrap().on_escape(OnEscape::Silent);
    let b = DisposeScope::new("b").unwrap().on_escape(OnEscape::Silent);
    let leak = floats(128);
    let a_report = a.finish();
    assert!(a_report.escaped.is_empty());
    let b_report = b.finish();
    assert_eq!(b_report.handed_to, Some(outer.id()), "handed to the nearest open scope, not the closed `a`");
    let live = memlab::events::live();
    let tag = live.iter().find(|l| l.address == memlab::stats::storage_info(&leak).unwrap().data_ptr).unwrap().scope;
    assert_eq!(tag, Some(outer.id()));
    let outer_report = outer.finish();
    assert_eq!(outer_report.escaped_bytes(Device::Cpu), 512);
    drop(leak);
}

// 16. Boolean environment variables: one way to write them, calls win.

#[test]
fn env_disable_reads_every_spelling() {
    if child("env_disable_reads_every_spelling") {
        let expected = std::env::var("EXPECT_ENABLED").unwrap() == "1";
        assert_eq!(memlab::profiler::is_enabled(), expected, "MEMLAB_DISABLE={:?}", std::env::var("MEMLAB_DISABLE"));
        return;
    }
    for (value, enabled) in
        [("false", "1"), ("no", "1"), ("OFF", "1"), ("0", "1"), ("1", "0"), ("true", "0"), ("Yes", "0"), ("on", "0")]
    {
        check_child("env_disable_reads_every_spelling", &[("MEMLAB_DISABLE", value), ("EXPECT_ENABLED", enabled)]);
    }
}

#[test]
fn env_garbage_is_warned_about_once_and_ignored() {
    if child("env_garbage_is_warned_about_once_and_ignored") {
        assert!(memlab::profiler::is_enabled());
        memlab::profiler::set_enabled(true);
        assert!(memlab::stats::cpu_allocator_installed());
        return;
    }
    let (_, stderr) = check_child(
        "env_garbage_is_warned_about_once_and_ignored",
        &[("MEMLAB_DISABLE", "maybe"), ("MEMLAB_CPU_ALLOCATOR", "sometimes")],
    );
    assert_eq!(stderr.matches("ignoring MEMLAB_DISABLE=\"maybe\"").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("ignoring MEMLAB_CPU_ALLOCATOR=\"sometimes\"").count(), 1, "{stderr}");
}

#[test]
fn an_explicit_call_wins_over_the_environment() {
    if child("an_explicit_call_wins_over_the_environment") {
        memlab::profiler::set_enabled(true);
        assert!(memlab::profiler::is_enabled(), "set_enabled(true) before the first read wins over MEMLAB_DISABLE=1");
        assert!(!memlab::stats::cpu_allocator_installed(), "MEMLAB_CPU_ALLOCATOR=Off is read before main");
        return;
    }
    check_child(
        "an_explicit_call_wins_over_the_environment",
        &[("MEMLAB_DISABLE", "1"), ("MEMLAB_CPU_ALLOCATOR", "Off")],
    );
}

// 17. Every target device stays itself.

#[test]
fn every_cuda_index_stays_itself_as_a_target() {
    let _s = serial();
    for index in [usize::MAX, usize::MAX - 1, usize::MAX - 2, usize::MAX - 3, 0, 5] {
        memlab::profiler::set_target_device(DeviceSelector::Fixed(Device::Cuda(index)));
        assert_eq!(memlab::profiler::target_device(), DeviceSelector::Fixed(Device::Cuda(index)));
    }
    memlab::profiler::set_target_device(DeviceSelector::Fixed(Device::Cpu));
    assert_eq!(memlab::profiler::target_device(), DeviceSelector::Fixed(Device::Cpu));
    memlab::profiler::set_target_device(DeviceSelector::Auto);
    assert_eq!(memlab::profiler::target_device(), DeviceSelector::Auto);
}

// 18. Methods of generic types and trait impls are found as people write them.

struct Holder<T>(T);

impl<T> Holder<T> {
    #[memlab::profile(device = "cpu")]
    fn make(&self) -> Tensor {
        let made = floats(16);
        made
    }
}

trait Step {
    fn step(&self) -> Tensor;
}

struct Net;

impl Step for Net {
    #[memlab::profile(device = "cpu")]
    fn step(&self) -> Tensor {
        let out = floats(32);
        out
    }
}

mod other {
    #[memlab::profile(device = "cpu")]
    pub fn make() -> usize {
        let n = 1;
        n
    }
}

#[test]
fn generic_and_trait_methods_are_found_by_their_names() {
    let _s = serial();
    memlab::reset();
    drop((Holder(1u8).make(), Net.step(), other::make()));
    let report = memlab::report();
    for name in ["Holder::make", "Holder<T>::make", "cpu::reliability::Holder::make"] {
        assert_eq!(report.function(name).unwrap().name, "cpu::reliability::Holder::make", "{name}");
    }
    for name in ["Net::step", "<Net as Step>::step", "step"] {
        let f = report.function(name).unwrap();
        assert_eq!((f.name.as_str(), f.trait_name.as_deref()), ("cpu::reliability::Net::step", Some("Step")), "{name}");
    }
    let err = report.function("make").unwrap_err().to_string();
    assert!(err.contains("cpu::reliability::Holder::make") && err.contains("cpu::reliability::other::make"), "{err}");
    let table = report.clone().filter("Net::step").to_text();
    assert!(table.contains("## cpu::reliability::Net::step (Step)"), "{table}");
    assert!(report.filter("Holder::make").to_text().contains("## cpu::reliability::Holder::make  (cpu"));
}

// 19. A tracker that cannot read its device says so.

#[test]
fn a_tracker_on_an_unreadable_device_keeps_the_error() {
    let _s = serial();
    let missing = memlab::gpu::cuda_device_count() + 3;
    let mut tracker = memlab::Tracker::new().device(Device::Cuda(missing)).stdout(false);
    let log = memlab::track!(tracker);
    let error = tracker.last_error().expect("the error is kept");
    assert!(matches!(error, memlab::Error::DeviceUnavailable { .. }), "by its cause: {error:?}");
    let error = error.to_string();
    assert!(error.contains(&format!("cuda:{missing}")), "{error}\n{log}");
    assert!(log.error.as_deref().is_some_and(|e| e.contains(&error)), "the entry says it too: {log}");
}

// 22. A var store holding a non-leaf tensor: no libtorch warning per read.

#[test]
fn non_leaf_variables_read_quietly() {
    if child("non_leaf_variables_read_quietly") {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _fc = nn::linear(vs.root() / "fc", 4, 4, Default::default());
        let leaf = Tensor::ones([4], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        vs.variables_.lock().unwrap().named_variables.insert("scaled".into(), &leaf * 2);
        memlab::register_var_store("model", &vs);
        let mut monitor = memlab::TrainingMonitor::new(&vs);
        let mut tracker = memlab::Tracker::new().device(Device::Cpu).stdout(false);
        for _ in 0..3 {
            MemReporter::new(&vs).report().unwrap();
            monitor.record_stats();
            memlab::track!(tracker);
        }
        return;
    }
    let (_, stderr) = check_child("non_leaf_variables_read_quietly", &[]);
    assert!(!stderr.contains("not a leaf Tensor"), "libtorch warned:\n{stderr}");
}

// 23. Every reporter row reads in full.

#[test]
fn reporter_rows_read_in_full() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _fc = nn::linear(vs.root() / "fc", 8, 8, Default::default());
    let name = "a_registered_tensor_with_a_name_far_longer_than_any_column_of_the_table_would_let_it_be";
    let named = floats(8);
    let hidden = floats(4096);
    let report = MemReporter::new(&vs).tensor(name, &named).report().unwrap();
    let text = report.to_text();
    for row in &report.device(Device::Cpu).unwrap().rows {
        for word in row.name.split(' ') {
            assert!(text.contains(word), "`{word}` of `{}` is in:\n{text}", row.name);
        }
    }
    assert!(!text.contains('…'), "nothing is cut:\n{text}");
    drop((named, hidden));
}

// 25. A second recording keeps the first one's settings.

#[test]
fn concurrent_recordings_keep_what_each_asked_for() {
    let _s = serial();
    let big = Recording::start(Settings::default().capacity(1_000_000).backtraces(true)).unwrap();
    let small = Recording::start(Settings::default()).unwrap();
    assert_eq!((small.settings().capacity, small.settings().backtraces), (1_000_000, true));
    for _ in 0..60_000 {
        drop(floats(1));
    }
    let (events, stats) = memlab::events::history();
    assert!(events.len() >= 120_000, "the first recording's capacity holds: {stats:?}");
    drop(small);
    assert_eq!(big.settings().capacity, 1_000_000);
    drop(big);
    let next = Recording::start(Settings::default()).unwrap();
    assert_eq!((next.settings().capacity, next.settings().backtraces), (100_000, false));
}
