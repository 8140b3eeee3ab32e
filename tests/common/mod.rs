//! Helpers shared by the integration tests that run on CPU tensors.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

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

/// A CPU tensor of `n` f32 zeros: exactly `4 * n` bytes.
pub fn floats(n: i64) -> Tensor {
    Tensor::zeros([n], (Kind::Float, tch::Device::Cpu))
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
