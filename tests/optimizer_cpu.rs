//! Optimizer state by name on CPU tensors: exact bytes per state tensor for
//! every optimizer tch builds, rows that still add up to the allocator's
//! figure, parameter groups, variables without state, and a clear error when
//! the optimizer's var store was not given. One test at a time: the
//! allocator is process-wide.

mod common;

use common::serial;

use memlab::reporter::{MemReport, Row, RowKind};
use memlab::{Device, Error, MemReporter};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

const IN: i64 = 96;
const HIDDEN: i64 = 64;
const OUT: i64 = 10;

/// A two-layer model, its head in parameter group 1.
fn model(vs: &nn::VarStore) -> impl Module {
    nn::seq().add(nn::linear(vs.root() / "body", IN, HIDDEN, Default::default())).add_fn(|x| x.relu()).add(nn::linear(
        vs.root().set_group(1) / "head",
        HIDDEN,
        OUT,
        Default::default(),
    ))
}

/// The variables' names and element counts, computed from the shapes above.
fn parameters() -> Vec<(&'static str, i64)> {
    vec![("body.bias", HIDDEN), ("body.weight", HIDDEN * IN), ("head.bias", OUT), ("head.weight", OUT * HIDDEN)]
}

fn step(net: &impl Module, opt: &mut nn::Optimizer) {
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
}

fn state_rows(report: &MemReport) -> Vec<&Row> {
    report.device(Device::Cpu).unwrap().rows.iter().filter(|r| r.kind == RowKind::OptimizerState).collect()
}

fn assert_rows_add_up(report: &MemReport) {
    for d in &report.devices {
        let total: i64 = d.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
        assert_eq!(total, d.allocated_bytes, "rows of {} add up to the allocator's figure:\n{report}", d.device);
    }
}

/// Builds the model and `config`'s optimizer, steps twice, and checks that
/// every parameter has exactly `slots` as state rows, each of the
/// parameter's bytes, and that the rows add up.
fn check(config: impl OptimizerConfig, slots: &[&str]) {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = config.build(&vs, 1e-3).unwrap();
    step(&net, &mut opt);
    step(&net, &mut opt);
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    let rows = state_rows(&report);
    let mut expected: Vec<(String, i64)> = parameters()
        .into_iter()
        .flat_map(|(name, numel)| slots.iter().map(move |slot| (format!("{name}.{slot}"), numel * 4)))
        .collect();
    expected.sort();
    let mut found: Vec<(String, i64)> = rows.iter().map(|r| (r.name.clone(), r.bytes)).collect();
    found.sort();
    assert_eq!(found, expected, "{report}");
    assert!(rows.iter().all(|r| r.counted && r.dtype == "Float"), "{report}");
    // The state's total is the stated multiple of the parameters' bytes.
    let params: i64 = parameters().iter().map(|(_, n)| n * 4).sum();
    let state: i64 = rows.iter().map(|r| r.bytes).sum();
    assert_eq!(state, params * slots.len() as i64, "{report}");
    assert_rows_add_up(&report);
    let o = &report.optimizers[0];
    assert_eq!(o.state_tensors, rows.len());
    assert!(o.stateless.is_empty() && o.absent.is_empty(), "{report}");
    assert!(report.to_text().contains("body.weight.") && report.to_text().contains("state tensor(s)"), "{report}");
}

#[test]
fn adam_keeps_two_moments() {
    check(nn::Adam::default(), &["exp_avg", "exp_avg_sq"]);
}

#[test]
fn adam_with_amsgrad_keeps_a_third() {
    check(nn::Adam::default().amsgrad(true), &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]);
}

#[test]
fn adamw_with_and_without_amsgrad() {
    check(nn::AdamW::default(), &["exp_avg", "exp_avg_sq"]);
    check(nn::AdamW::default().amsgrad(true), &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]);
}

#[test]
fn sgd_with_momentum_keeps_a_buffer() {
    check(nn::Sgd { momentum: 0.9, ..Default::default() }, &["momentum_buffer"]);
}

#[test]
fn centred_rmsprop_with_momentum_keeps_three() {
    check(
        nn::RmsProp { momentum: 0.9, centered: true, ..Default::default() },
        &["square_avg", "momentum_buffer", "grad_avg"],
    );
}

#[test]
fn plain_sgd_keeps_nothing_and_says_so() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 1e-3).unwrap();
    step(&net, &mut opt);
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    assert!(state_rows(&report).is_empty(), "{report}");
    assert_eq!(report.optimizers[0].stateless.len(), 4, "{report}");
    assert_rows_add_up(&report);
}

#[test]
fn no_state_before_the_first_step_and_for_late_variables() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    assert!(state_rows(&report).is_empty());
    let mut stateless = report.optimizers[0].stateless.clone();
    stateless.sort();
    assert_eq!(stateless, vec!["body.bias", "body.weight", "head.bias", "head.weight"]);
    assert!(report.to_text().contains("no state for body.bias, body.weight"), "{report}");

    step(&net, &mut opt);
    // A variable made after the optimizer: tch takes it in at the next step.
    let late = vs.root().zeros("late", &[16]);
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    assert_eq!(report.optimizers[0].absent, vec!["late".to_string()], "{report}");
    assert!(report.to_text().contains("not in the optimizer yet: late"), "{report}");
    assert_eq!(state_rows(&report).len(), 8);
    // After a step it is in, with no state (it took no part in the loss).
    step(&net, &mut opt);
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    assert!(report.optimizers[0].absent.is_empty(), "{report}");
    assert_eq!(report.optimizers[0].stateless, vec!["late".to_string()], "{report}");
    drop(late);
}

#[test]
fn frozen_variables_get_no_state() {
    let _s = serial();
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    vs.freeze();
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    assert!(state_rows(&report).is_empty(), "{report}");
    assert_eq!(report.optimizers[0].stateless.len(), 4, "{report}");
}

#[test]
fn the_var_store_must_be_given() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    step(&net, &mut opt);
    let other = nn::VarStore::new(tch::Device::Cpu);
    let _layer = nn::linear(other.root() / "other", 4, 4, Default::default());
    let err = MemReporter::new(&other).optimizer(&opt).report().unwrap_err();
    assert!(matches!(err, Error::Optimizer(_)), "{err:?}");
    assert!(err.to_string().contains("pass that var store too"), "{err}");
    // With a prefix, the state is named like its variables.
    let report = MemReporter::default().var_store("model", &vs).optimizer(&opt).report().unwrap();
    assert!(state_rows(&report).iter().any(|r| r.name == "model.head.weight.exp_avg"), "{report}");
}

#[test]
fn the_supported_tch_is_pinned() {
    // memlab reads tch's Optimizer by its layout: a tch with another one must
    // come with a memlab that knows it. Every class tch builds is recognised.
    let manifest = include_str!("../Cargo.toml");
    assert!(manifest.contains("tch = \"=0.24.0\""), "memlab reads tch 0.24's optimizer layout");
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _net = model(&vs);
    let kinds = [
        nn::Adam::default().build(&vs, 1e-3),
        nn::AdamW::default().build(&vs, 1e-3),
        nn::Sgd::default().build(&vs, 1e-3),
        nn::RmsProp::default().build(&vs, 1e-3),
    ];
    let names: Vec<String> = kinds
        .iter()
        .map(|o| {
            let report = MemReporter::new(&vs).optimizer(o.as_ref().unwrap()).report().unwrap();
            format!("{:?}", report.optimizers[0].kind)
        })
        .collect();
    assert_eq!(names, ["Adam", "AdamW", "Sgd", "RmsProp"]);
}

#[test]
fn courtesy_with_an_optimizer_on_a_cpu_only_machine() {
    let _s = serial();
    if tch::Cuda::is_available() {
        return; // the CUDA round trip is tests/cuda.rs's
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    step(&net, &mut opt);
    let mut courtesy = memlab::Courtesy::only().var_store(&vs);
    let report = courtesy.yield_memory_with(&mut opt).unwrap();
    assert_eq!(report.to_string(), "Courtesy: no CUDA device, nothing to yield\n");
    assert!(!courtesy.is_yielded());
    // An optimizer of a var store the Courtesy does not know: an error, nothing moves.
    let other = nn::VarStore::new(tch::Device::Cpu);
    let mut lonely = memlab::Courtesy::only().var_store(&other);
    let err = lonely.yield_memory_with(&mut opt).unwrap_err();
    assert!(err.to_string().contains("pass that var store too"), "{err}");
    assert!(!lonely.is_yielded());
    // The error is not kept: the same Courtesy works without the optimizer.
    assert!(lonely.yield_memory().is_ok());
    step(&net, &mut opt);
}
