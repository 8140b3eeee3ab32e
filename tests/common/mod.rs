//! Helpers shared by the integration tests that run on CPU tensors.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

pub mod cells;
pub mod chromium;
pub mod pytorch;

use std::sync::{Mutex, MutexGuard};

use tch::{Kind, Tensor};

/// Runs the calling test alone among the tests of its binary: allocator
/// counters and the event recorder are process-wide. Also keeps the exit
/// table quiet, so it does not follow the test harness's summary.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    memlab::profiler::set_print_at_exit(false);
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A CPU tensor of `n` f32 zeros: exactly `4 * n` bytes. (Not through
/// [`floats_on`]: tests name this helper as the site that allocated.)
pub fn floats(n: i64) -> Tensor {
    Tensor::zeros([n], (Kind::Float, tch::Device::Cpu))
}

/// A tensor of `n` f32 zeros on `device`: exactly `4 * n` bytes.
pub fn floats_on(device: tch::Device, n: i64) -> Tensor {
    Tensor::zeros([n], (Kind::Float, device))
}

/// Two threads run `check_step` around a step that keeps one tensor from
/// `make` (a deliberate leak of `bytes` on `device`) for `seconds`, while a
/// third starts and stops recordings all the time; every check must see the
/// leak. Returns how many checks ran.
pub fn concurrent_checks_catch_every_leak(
    seconds: u64,
    device: memlab::Device,
    bytes: u64,
    make: fn() -> Tensor,
) -> usize {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                drop(memlab::Recording::start(memlab::events::Settings::default()).unwrap());
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let checkers: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                let (mut kept, mut checks) = (Vec::new(), 0usize);
                while Instant::now() < deadline {
                    let check = memlab::check_step(|| kept.push(make())).unwrap();
                    assert_eq!(check.scope.escaped_bytes(device), bytes, "check {checks} missed the leak");
                    checks += 1;
                    if kept.len() > 64 {
                        kept.clear();
                    }
                }
                checks
            })
        })
        .collect();
    let checks = checkers.into_iter().map(|c| c.join().unwrap()).sum();
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    checks
}

// Child processes: tests that need a fresh process (environment variables
// read at load, process-wide limits) run their binary again with
// `MEMLAB_CHILD` naming the one test to run.

/// Runs `f` on a thread and fails the test if it has not returned within
/// `limit`: a hang must fail, not stall the suite.
pub fn within<R: Send + 'static>(limit: std::time::Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = send.send(f());
    });
    receive.recv_timeout(limit).unwrap_or_else(|_| panic!("did not return within {limit:?}: a hang or deadlock"))
}

/// The name libtest gives test `name` of the calling file: `module::name` in
/// a test binary made of modules (`tests/cpu/`, `tests/cuda/`: one module
/// per file beside `main.rs`), `name` in a binary of one file; a name with
/// its module already (`oom::name`) as it is.
#[track_caller]
pub fn test_path(name: &str) -> String {
    // A name that already says its module is the full name.
    if name.contains("::") {
        return name.to_string();
    }
    let file = std::path::Path::new(std::panic::Location::caller().file());
    let in_modules = file.parent().and_then(|d| d.file_name()).is_some_and(|d| d != "tests");
    match file.file_stem().and_then(|s| s.to_str()) {
        Some(module) if in_modules && module != "main" && module != "mod" => format!("{module}::{name}"),
        _ => name.to_string(),
    }
}

/// Runs test `name` of the calling file in a child process with `env` set,
/// and returns its output. The child runs only that test (see [`child`]).
#[track_caller]
pub fn run_child(name: &str, env: &[(&str, &str)]) -> std::process::Output {
    let name = &test_path(name);
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    // `--include-ignored`: the child runs the named test even when it is one for a GPU machine.
    command.args(["--exact", name, "--nocapture", "--test-threads=1", "--include-ignored"]).env("MEMLAB_CHILD", name);
    for var in ["MEMLAB_DISABLE", "MEMLAB_PRINT_AT_EXIT", "MEMLAB_CPU_ALLOCATOR", "MEMLAB_OOM_DIR"] {
        command.env_remove(var);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().unwrap()
}

/// Whether this process is the child that runs test `name` of the calling
/// file; the test body runs only then.
#[track_caller]
pub fn child(name: &str) -> bool {
    let name = test_path(name);
    std::env::var("MEMLAB_CHILD").is_ok_and(|c| c == name)
}

/// Whether this process is a child that runs some other test (see
/// [`run_child`]): a test that starts children does nothing there.
pub fn in_a_child() -> bool {
    std::env::var_os("MEMLAB_CHILD").is_some()
}

/// Bytes a child printed, as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs test `name` in a child (see [`run_child`]), checks that it ran and
/// passed, and returns what it printed on standard output and error.
#[track_caller]
pub fn check_child(name: &str, env: &[(&str, &str)]) -> (String, String) {
    let out = run_child(name, env);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "child {name} failed ({:?}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("1 passed"), "the child ran {name}:\n{stdout}");
    (stdout, stderr)
}
