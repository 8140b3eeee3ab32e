//! Optimizer state by name on CPU tensors: exact bytes per state tensor for
//! every optimizer tch builds, rows that still add up to the allocator's
//! figure, parameter groups, variables without state, and a clear error when
//! the optimizer's var store was not given. One test at a time: the
//! allocator is process-wide.

use crate::common::serial;

use memlab::reporter::{MemReport, Row, RowKind};
use memlab::Render;
use memlab::{Device, Error, MemReporter};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

const IN: i64 = 96;
const HIDDEN: i64 = 64;
const OUT: i64 = 10;

/// A two-layer model, its head in parameter group 1.
fn model(vs: &nn::VarStore) -> impl Module + use<> {
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
    report
        .device(Device::Cpu)
        .unwrap()
        .rows
        .iter()
        .filter(|r| r.kind == RowKind::Named(memlab::TensorKind::OptimizerState))
        .collect()
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
    assert!(rows.iter().all(|r| r.counted && r.dtype == Some(memlab::DType::Float)), "{report}");
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
fn the_tch_built_against_is_one_whose_layout_memlab_knows() {
    // memlab reads tch's Optimizer by its layout: the tch range it accepts
    // covers the releases it checked, and the one built against is one of
    // them (this suite runs on each: scripts/test-versions.sh). Every class
    // tch builds is recognised.
    let manifest = include_str!("../../Cargo.toml");
    assert!(manifest.contains("tch = \">=0.24, <0.27\""), "{manifest}");
    assert_eq!(memlab::optimizer::TCH_RELEASES, ["0.24", "0.26"]);
    let release = memlab::optimizer::tch_release();
    assert!(memlab::optimizer::TCH_RELEASES.contains(&release), "built against tch {release}");
    let libtorch = memlab::optimizer::libtorch_version();
    assert!(libtorch.starts_with(if release == "0.24" { "2.11." } else { "2.13." }), "{libtorch} for tch {release}");
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
        return; // the CUDA round trip is tests/cuda/courtesy.rs's
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    step(&net, &mut opt);
    let mut courtesy = memlab::Courtesy::of(&vs);
    let report = courtesy.yield_memory_with(&mut opt).unwrap();
    assert_eq!(report.to_string(), "Courtesy: no CUDA device, nothing to yield\n");
    assert!(!courtesy.is_yielded());
    // An optimizer of a var store the Courtesy does not know: an error, nothing moves.
    let other = nn::VarStore::new(tch::Device::Cpu);
    let mut lonely = memlab::Courtesy::of(&other);
    let err = lonely.yield_memory_with(&mut opt).unwrap_err();
    assert!(err.to_string().contains("pass that var store too"), "{err}");
    assert!(!lonely.is_yielded());
    // The error is not kept: the same Courtesy works without the optimizer.
    assert!(lonely.yield_memory().is_ok());
    step(&net, &mut opt);
}

#[test]
fn the_monitor_measures_the_state_exactly_and_writes_it_to_csv() {
    let _s = serial();
    memlab::clear_registry();
    let dir = std::env::temp_dir().join(format!("memlab-optimizer-csv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let mut monitor = memlab::TrainingMonitor::new(&vs)
        .device(Device::Cpu)
        .print_period(0)
        .optimizer_kind(memlab::StepOptimizer::Adam)
        .csv_dir(&dir);
    for _ in 0..3 {
        step(&net, &mut opt);
        monitor.record_stats_with(&opt);
    }
    let r = monitor.last().unwrap().clone();
    let params: i64 = parameters().iter().map(|(_, n)| n * 4).sum();
    assert_eq!(r.optimizer_state, Some(2 * params), "{r}");
    assert_eq!(r.optimizer_state_estimate, None, "the estimate only stands in for a missing optimizer");
    assert_eq!(r.optimizer_state_rows.len(), 8);
    let state = memlab::monitor::TensorBytes {
        name: "body.weight.exp_avg_sq".into(),
        kind: memlab::TensorKind::OptimizerState,
        bytes: HIDDEN * IN * 4,
    };
    assert!(r.optimizer_state_rows.contains(&state), "{r}");
    assert!(r.to_string().contains("Optimizer state............"), "{r}");
    assert!(r.to_string().contains("Other kept tensors"), "{r}");
    // Without the optimizer, the estimate is back, labelled as one.
    step(&net, &mut opt);
    let r = monitor.record_stats().unwrap().clone();
    assert_eq!((r.optimizer_state, r.optimizer_state_estimate), (None, Some(2 * params)));
    assert!(r.to_string().contains("optimizer state (estimate)"), "{r}");
    assert!(monitor.last_error().is_none(), "{:?}", monitor.last_error());
    monitor.flush();

    let text = std::fs::read_to_string(dir.join("memlab_iterations.csv")).unwrap();
    let mut rows = csv::Reader::from_reader(text.as_bytes());
    let header: Vec<String> = rows.headers().unwrap().iter().map(str::to_string).collect();
    let column = header.iter().position(|h| h == "optimizer_state").expect("an optimizer_state column");
    let records: Vec<csv::StringRecord> = rows.records().map(Result::unwrap).collect();
    assert_eq!(&records[2][column], (2 * params).to_string());
    assert_eq!(&records[3][column], "", "empty when no optimizer was given");
    let variables = std::fs::read_to_string(dir.join("memlab_variables.csv")).unwrap();
    assert!(variables.contains(&format!(",body.weight.exp_avg,optimizer_state,{}\n", HIDDEN * IN * 4)), "{variables}");
    // The last record had no optimizer: its state rows went away (0 bytes).
    assert!(variables.contains(",body.weight.exp_avg,optimizer_state,0\n"), "{variables}");
    drop(monitor);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_step_counts_a_first_step_state_as_model_state() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    let params: u64 = parameters().iter().map(|(_, n)| (n * 4) as u64).sum();
    // Without the optimizer, Adam's new moments look like a leak.
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let check =
        memlab::check_step_with(&vs, || opt.backward_step(&net.forward(&x).square().mean(Kind::Float))).unwrap();
    assert_eq!(check.scope.escaped_bytes(Device::Cpu), 2 * params, "{}", check.scope);
    // With it, they are model state, and nothing escapes.
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let check = memlab::check_step_with_optimizer(&vs, &mut opt, |opt| {
        opt.backward_step(&net.forward(&x).square().mean(Kind::Float))
    })
    .unwrap();
    check.assert_no_escapes();
    let state: u64 = check.scope.model_state.iter().map(|a| a.size).sum();
    assert_eq!(state, 2 * params + params, "new gradients and both moments: {}", check.scope);
    assert!(check.scope.to_string().contains("new gradients and optimizer state"), "{}", check.scope);
    // A dispose scope closed with the optimizer says the same.
    let mut sgd = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 1e-3).unwrap();
    let scope = memlab::DisposeScope::new("sgd").unwrap().var_store("", &vs).on_escape(memlab::OnEscape::Silent);
    sgd.backward_step(&net.forward(&x).square().mean(Kind::Float));
    let report = scope.finish_with(&sgd);
    assert!(report.escaped.is_empty(), "{report}");
    assert_eq!(report.model_state.iter().map(|a| a.size).sum::<u64>(), 2 * params, "gradients and buffers: {report}");
}

#[test]
fn check_step_refuses_an_optimizer_it_cannot_read_before_the_step() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let other = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&other);
    let mut opt = nn::Adam::default().build(&other, 1e-3).unwrap();
    let mut ran = false;
    let result = memlab::check_step_with_optimizer(&vs, &mut opt, |opt| {
        ran = true;
        step(&net, opt)
    });
    match result {
        Err(Error::Optimizer(why)) => assert!(why.contains("var store memlab was not given"), "{why}"),
        Err(e) => panic!("expected an optimizer error, got {e}"),
        Ok(check) => panic!("an unreadable optimizer was accepted: {}", check.scope),
    }
    assert!(!ran, "the step must not run when its check cannot be made");
}

#[test]
fn a_registered_optimizer_is_named_by_every_tool() {
    let _s = serial();
    memlab::clear_registry();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    memlab::register_var_store("model", &vs);
    // The natural order: registered where it is built, then trained.
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    assert_eq!(opt.registered_states(), 0, "no state before the first step");
    let mut tracker = memlab::Tracker::new().device(Device::Cpu);
    memlab::track!(tracker);
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    assert_eq!(opt.registered_states(), 8, "registered by the first step");
    let grown = memlab::track!(tracker).to_text();
    assert!(grown.contains(&format!("  + 2 × [{HIDDEN}, {IN}] Float optimizer state 48.00K")), "{grown}");
    // The registry's reporter names it once, even when the optimizer is also given.
    for reporter in [MemReporter::registered(), MemReporter::registered().optimizer(&opt)] {
        let report = reporter.report().unwrap();
        let rows = state_rows(&report);
        assert_eq!(rows.len(), 8, "{report}");
        assert!(rows.iter().any(|r| r.name == "model.head.weight.exp_avg"), "{report}");
        assert_rows_add_up(&report);
    }
    // Code written for tch's optimizer runs through `with_mut`; later steps
    // keep the same tensors, and the registration stays right.
    opt.with_mut(|o| step(&net, o));
    assert_eq!(state_rows(&MemReporter::registered().report().unwrap()).len(), 8);
    // The registry holds them weakly: a dropped optimizer drops out.
    drop(opt);
    assert!(state_rows(&MemReporter::registered().report().unwrap()).is_empty());
    memlab::clear_registry();
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
}

/// Registers `config`'s optimizer before any step, the way training code
/// is written, steps it once through its own method, and returns the
/// registry's state rows as (name, bytes), sorted.
fn registered_rows_after_one_step(config: impl OptimizerConfig) -> Vec<(String, i64)> {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    memlab::register_var_store("m", &vs);
    let mut opt = memlab::register_optimizer(config.build(&vs, 1e-3).unwrap()).unwrap();
    let x = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    let report = MemReporter::registered().report().unwrap();
    assert_rows_add_up(&report);
    let mut rows: Vec<(String, i64)> = state_rows(&report).iter().map(|r| (r.name.clone(), r.bytes)).collect();
    rows.sort();
    drop(opt);
    memlab::clear_registry();
    rows
}

/// The rows `slots` give every parameter of [`model`], named in store `m`.
fn expected_rows(slots: &[&str]) -> Vec<(String, i64)> {
    let mut rows: Vec<(String, i64)> = parameters()
        .into_iter()
        .flat_map(|(name, numel)| slots.iter().map(move |slot| (format!("m.{name}.{slot}"), numel * 4)))
        .collect();
    rows.sort();
    rows
}

#[test]
fn registered_before_the_first_step_the_rows_are_exact_after_it() {
    assert_eq!(registered_rows_after_one_step(nn::Adam::default()), expected_rows(&["exp_avg", "exp_avg_sq"]));
    let momentum = nn::Sgd { momentum: 0.9, ..Default::default() };
    assert_eq!(registered_rows_after_one_step(momentum), expected_rows(&["momentum_buffer"]));
    // Plain SGD keeps no state: there is none to name.
    assert_eq!(registered_rows_after_one_step(nn::Sgd::default()), vec![]);
}

#[test]
fn tied_weights_are_one_state_named_once() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let root = vs.root();
    let shared = root.var("enc", &[16, 16], nn::Init::Const(0.5));
    // The same tensor under a second trainable name, as tied embeddings are.
    let tied = root.add("dec", shared.shallow_clone(), true);
    let bias = root.zeros("bias", &[16]);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::ones([2, 16], (Kind::Float, tch::Device::Cpu));
    opt.backward_step(&(x.matmul(&shared).matmul(&tied) + &bias).sum(Kind::Float));
    let report = MemReporter::new(&vs).optimizer(&opt).report().unwrap();
    // libtorch keeps two tensors (exp_avg, exp_avg_sq) per distinct
    // parameter: two parameters, four tensors.
    let o = &report.optimizers[0];
    assert_eq!(o.state_tensors, 4, "{report}");
    let rows = state_rows(&report);
    let mut names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["bias.exp_avg", "bias.exp_avg_sq", "dec.exp_avg", "dec.exp_avg_sq"], "{report}");
    let bytes: i64 = rows.iter().map(|r| r.bytes).sum();
    assert_eq!(bytes, 2 * (16 * 16 + 16) * 4, "{report}");
    assert!(o.stateless.is_empty() && o.absent.is_empty(), "{report}");
    assert_rows_add_up(&report);
}

#[test]
fn measure_model_reads_every_optimizer_it_steps() {
    use memlab::StepOptimizer as S;
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let input = Tensor::ones([4, IN], (Kind::Float, tch::Device::Cpu));
    let kinds = [
        S::Sgd,
        S::SgdMomentum,
        S::Adam,
        S::AdamAmsgrad,
        S::AdamW,
        S::AdamWAmsgrad,
        S::RmsProp,
        S::RmsPropCenteredMomentum,
    ];
    let size = memlab::measure_model(&vs, |x| net.forward(x), &input, &kinds).unwrap();
    let params: i64 = parameters().iter().map(|(_, n)| n * 4).sum();
    let multiples: Vec<(S, i64)> = size.optimizers.iter().map(|o| (o.optimizer, o.state / params)).collect();
    // What TrainingMonitor's estimate multiplies the weights by is what a real step keeps.
    for o in &size.optimizers {
        assert_eq!(o.state, o.optimizer.state_buffers() as i64 * params, "{o:?}");
    }
    assert_eq!(kinds, S::ALL);
    assert_eq!(
        multiples,
        vec![
            (S::Sgd, 0),
            (S::SgdMomentum, 1),
            (S::Adam, 2),
            (S::AdamAmsgrad, 3),
            (S::AdamW, 2),
            (S::AdamWAmsgrad, 3),
            (S::RmsProp, 1),
            (S::RmsPropCenteredMomentum, 3)
        ]
    );
    assert!(size.optimizers.iter().all(|o| o.state % params == 0), "{size}");
}
