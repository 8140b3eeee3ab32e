//! The CUDA paths, on a GPU machine: `cargo test --release --test cuda --
//! --include-ignored`. Each test asserts that CUDA is there, so it cannot pass
//! without one. One module per tool; the helpers they share are here and in
//! `tests/common`. Runs one test at a time: the allocator is process-wide.

#[path = "../common/mod.rs"]
mod common;

mod courtesy;
mod notebook;
mod oom;
mod profile;
mod recording;
mod replay;
mod reporter;
mod sizing;
mod training;

use common::pytorch::{bytes_as_pytorch_prints, python, VALIDATE};

use std::sync::MutexGuard;

use memlab::{
    profiler::{FunctionReport, LineStats},
    Device, Render,
};
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;
const GPU: tch::Device = tch::Device::Cuda(0);

/// The tests' one lock (see `common::serial`), taken only where CUDA is.
fn serial() -> MutexGuard<'static, ()> {
    let guard = common::serial();
    assert!(memlab::gpu::cuda_is_available(), "these tests need a CUDA GPU");
    guard
}

/// A CUDA tensor of `n` f32 zeros: exactly `4 * n` bytes.
fn floats(n: i64) -> Tensor {
    common::floats_on(GPU, n)
}

fn allocated() -> i64 {
    memlab::stats::device_stats(Device::Cuda(0)).unwrap().allocated_bytes.all.current
}

fn line<'a>(f: &'a FunctionReport, code: &str) -> &'a LineStats {
    f.find(code).and_then(|l| l.stats.as_ref()).unwrap_or_else(|| panic!("{code:?} ran"))
}

fn stat(s: &LineStats, name: &str) -> i64 {
    match name.parse::<memlab::profiler::ProfileColumn>().unwrap() {
        memlab::profiler::ProfileColumn::Stat(i) => s.values[i],
        other => panic!("{other:?}"),
    }
}

fn cuda_model(vs: &tch::nn::VarStore, width: i64) -> tch::nn::Sequential {
    use tch::nn;
    nn::seq()
        .add(nn::linear(vs.root() / "a", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "c", width, 10, Default::default()))
}

/// A model of 16 bias-free 4096×4096 layers: 1 GiB of parameters.
fn gib_model(vs: &tch::nn::VarStore) -> Vec<tch::nn::Linear> {
    let config = tch::nn::LinearConfig { bias: false, ..Default::default() };
    (0..16).map(|i| tch::nn::linear(vs.root() / format!("l{i}"), 4096, 4096, config)).collect()
}

fn gib_step(layers: &[tch::nn::Linear], opt: &mut tch::nn::Optimizer, x: &Tensor) -> f64 {
    use tch::nn::Module;
    let out = layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).tanh());
    let loss = out.square().mean(Kind::Float);
    opt.backward_step(&loss);
    loss.double_value(&[])
}

#[memlab::profile(device = "cuda:0")]
fn asks_the_gpu_too_much() -> Result<Tensor, tch::TchError> {
    let t = Tensor::f_empty([1i64 << 40], (Kind::Float, GPU))?; // 4 TiB
    Ok(t)
}

fn oom_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("memlab-cuda-oom-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
