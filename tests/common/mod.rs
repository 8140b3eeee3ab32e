//! Helpers shared by the integration tests that run on CPU tensors.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

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
