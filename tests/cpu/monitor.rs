//! TrainingMonitor on the CPU: exact weights and gradients, feature maps,
//! printing, CSV files that append with one header, and a bad directory that
//! does not stop training.

use std::sync::{Arc, Mutex};

use crate::common::serial;
use memlab::monitor::TensorBytes;
use memlab::{Device, TensorKind, TrainingMonitor};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

struct Setup {
    vs: nn::VarStore,
    model: nn::Linear,
    opt: nn::Optimizer,
    x: Tensor,
}

fn setup() -> Setup {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = nn::linear(vs.root() / "fc", 256, 128, Default::default());
    let opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([64, 256], (Kind::Float, tch::Device::Cpu));
    Setup { vs, model, opt, x }
}

fn step(s: &mut Setup) {
    let loss = s.model.forward(&s.x).relu().mean(Kind::Float);
    s.opt.backward_step(&loss);
}

const PARAMS: i64 = (256 * 128 + 128) * 4;

#[test]
fn records_weights_gradients_and_feature_maps() {
    let _s = serial();
    let mut s = setup();
    let mut monitor =
        TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).optimizer_kind(memlab::StepOptimizer::Adam);
    step(&mut s);
    let r = monitor.record_stats().expect("a record").clone();
    assert_eq!((r.epoch, r.iteration, r.device), (1, 1, Some(Device::Cpu)));
    assert_eq!(r.weights, PARAMS);
    let rows: Vec<(&str, TensorKind, i64)> = r.weight_rows.iter().map(|r| (r.name.as_str(), r.kind, r.bytes)).collect();
    assert_eq!(rows, [("fc.bias", TensorKind::Parameter, 512), ("fc.weight", TensorKind::Parameter, 256 * 128 * 4)]);
    assert_eq!(r.gradients, PARAMS);
    assert_eq!(r.optimizer_state_estimate, Some(2 * PARAMS));
    // Adam's two moment buffers stay allocated besides weights and gradients.
    assert!(r.optimizer_state_measured >= 2 * PARAMS, "{r}");
    // The forward pass kept a 64x128 activation (and its relu) for backward.
    assert!(r.feature_maps >= 64 * 128 * 4, "{r}");
    assert!(r.peak_allocated >= r.current_allocated);
    step(&mut s);
    assert_eq!(monitor.record_stats().unwrap().iteration, 2);
    monitor.epoch_end();
    step(&mut s);
    let r = monitor.record_stats().unwrap();
    assert_eq!((r.epoch, r.iteration), (2, 1));
    assert!(monitor.last_error().is_none());
}

#[test]
fn prints_every_period() {
    let _s = serial();
    let mut s = setup();
    let printed = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = printed.clone();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(move |t| {
        sink.lock().unwrap().push(t.to_string())
    })));
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(2);
    for _ in 0..5 {
        step(&mut s);
        monitor.record_stats();
    }
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    let printed = printed.lock().unwrap();
    assert_eq!(printed.len(), 2);
    assert!(printed[0].contains("Memory of iteration 2 of epoch 1 on cpu"), "{}", printed[0]);
    assert!(printed[1].contains("Memory of iteration 4 of epoch 1 on cpu"));
    assert!(printed[0].contains("  fc.weight grad"), "{}", printed[0]);
    assert!(printed[0].contains(&format!("{:.<48}{:>10}", "Weights", "128.50K")), "{}", printed[0]);
}

#[test]
fn csv_files_append_with_one_header() {
    let _s = serial();
    let dir = std::env::temp_dir().join(format!("memlab-monitor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = setup();
    for _ in 0..2 {
        // Two monitors one after the other: the second appends.
        let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).csv_dir(&dir);
        for _ in 0..3 {
            step(&mut s);
            monitor.record_stats();
        }
        assert!(monitor.last_error().is_none(), "{:?}", monitor.last_error());
    }
    let text = std::fs::read_to_string(dir.join("memlab_iterations.csv")).unwrap();
    let mut rows = csv::Reader::from_reader(text.as_bytes());
    assert_eq!(rows.headers().unwrap().iter().next(), Some("epoch"));
    let records: Vec<csv::StringRecord> = rows.records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 6, "one row per recorded iteration, header once");
    assert_eq!(&records[5][7], PARAMS.to_string(), "weights column");
    let variables = std::fs::read_to_string(dir.join("memlab_variables.csv")).unwrap();
    // A row per variable and kind when its bytes change: each monitor's
    // first record lists them all, the records after it nothing.
    assert_eq!(variables.lines().count(), 1 + 2 * 4, "{variables}");
    assert!(variables.contains("1,1,cpu,fc.weight,gradient,131072\n"), "{variables}");

    // A variable that leaves the store gets a 0-byte row, once.
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).csv_dir(&dir);
    step(&mut s);
    monitor.record_stats();
    s.vs.variables_.lock().unwrap().named_variables.remove("fc.bias");
    monitor.record_stats();
    monitor.record_stats();
    drop(monitor);
    let variables = std::fs::read_to_string(dir.join("memlab_variables.csv")).unwrap();
    let tail: Vec<&str> = variables.lines().skip(1 + 2 * 4 + 4).collect();
    assert_eq!(tail, ["1,2,cpu,fc.bias,parameter,0", "1,2,cpu,fc.bias,gradient,0"], "{variables}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn csv_rows_read_back_as_the_records_they_were() {
    use memlab::monitor::{read_rows, IterationRow, VariableRow};
    let _s = serial();
    let dir = std::env::temp_dir().join(format!("memlab-monitor-rows-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = setup();
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).csv_dir(&dir);
    let mut records = Vec::new();
    for _ in 0..3 {
        step(&mut s);
        records.push(monitor.record_stats().unwrap().clone());
    }
    drop(monitor);
    let rows: Vec<IterationRow> = read_rows(dir.join("memlab_iterations.csv")).unwrap();
    assert_eq!(rows.len(), 3);
    for (row, r) in rows.iter().zip(&records) {
        assert_eq!((row.epoch, row.iteration, row.device.as_str()), (r.epoch, r.iteration, "cpu"));
        assert_eq!((row.peak_allocated, row.weights, row.gradients), (r.peak_allocated, r.weights, r.gradients));
        assert_eq!((row.optimizer_state, row.feature_maps), (r.optimizer_state, r.feature_maps));
    }
    let variables: Vec<VariableRow> = read_rows(dir.join("memlab_variables.csv")).unwrap();
    let weight = variables.iter().find(|v| v.variable == "fc.weight" && v.kind == TensorKind::Parameter).unwrap();
    assert_eq!((weight.iteration, weight.bytes), (1, 256 * 128 * 4));
    // Another file is refused, saying which files it reads.
    let e = read_rows::<IterationRow>(dir.join("memlab_variables.csv")).unwrap_err().to_string();
    assert!(e.contains("memlab_iterations.csv or memlab_variables.csv"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn csv_rows_reach_the_disk_at_flush_epoch_end_and_panic() {
    let _s = serial();
    let dir = std::env::temp_dir().join(format!("memlab-monitor-flush-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rows = || {
        std::fs::read_to_string(dir.join("memlab_iterations.csv")).map_or(0, |t| t.lines().count().saturating_sub(1))
    };
    let mut s = setup();
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).csv_dir(&dir);
    step(&mut s);
    monitor.record_stats();
    monitor.flush();
    assert_eq!(rows(), 1);
    step(&mut s);
    monitor.record_stats();
    monitor.epoch_end();
    assert_eq!(rows(), 2, "the epoch's rows are written at its end");
    // A panic in the training loop (tch panics on out-of-memory) unwinds
    // through the monitor, which writes what it still holds.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        step(&mut s);
        monitor.record_stats();
        panic!("out of memory");
    }));
    assert!(panicked.is_err());
    assert_eq!(rows(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_directory_does_not_stop_training() {
    let _s = serial();
    let mut s = setup();
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0).csv_dir("/nonexistent/memlab");
    for _ in 0..3 {
        step(&mut s);
        assert!(monitor.record_stats().is_some(), "records go on");
    }
    let error = monitor.last_error().expect("the problem is kept");
    assert!(matches!(error, memlab::Error::Io { .. }), "an I/O error, with its source: {error:?}");
    let error = error.to_string();
    assert!(error.contains("could not write CSV files in /nonexistent/memlab"), "{error}");
    assert!(error.contains("does not exist"), "{error}");
    assert_eq!(monitor.last().unwrap().iteration, 3);
}

#[test]
fn marking_backward_separates_feature_maps_from_intermediate_gradients() {
    let _s = serial();
    let mut s = setup();
    let mut monitor = TrainingMonitor::new(&s.vs).device(Device::Cpu).print_period(0);
    for _ in 0..2 {
        let loss = s.model.forward(&s.x).relu().mean(Kind::Float);
        monitor.mark_backward();
        s.opt.backward_step(&loss);
        drop(loss);
        monitor.record_stats();
    }
    let r = monitor.last().unwrap();
    // Forward kept the 64x128 linear output and its relu for backward.
    assert!(r.feature_maps >= 64 * 128 * 4, "{r}");
    let ig = r.intermediate_gradients.expect("separated");
    // Backward's transient: at least the gradient flowing into the linear layer.
    assert!(ig >= 64 * 128 * 4, "{r}");
    assert!(r.to_string().contains("Intermediate gradients (backward's transient)"));
    monitor.record_stats();
    assert_eq!(monitor.last().unwrap().intermediate_gradients, None, "only marked iterations separate");
}

#[test]
fn report_snapshot() {
    let mut r = memlab::monitor::IterationRecord::default();
    (r.epoch, r.iteration, r.device) = (2, 7, Some(Device::Cuda(0)));
    (r.peak_reserved, r.current_reserved) = (96 << 20, 64 << 20);
    (r.peak_allocated, r.current_allocated) = (80 << 20, 40 << 20);
    let row = |name: &str, kind, bytes| TensorBytes { name: name.into(), kind, bytes };
    r.weight_rows = vec![row("fc.bias", TensorKind::Parameter, 512), row("fc.weight", TensorKind::Parameter, 131_072)];
    r.gradient_rows = vec![row("fc.bias", TensorKind::Gradient, 512), row("fc.weight", TensorKind::Gradient, 131_072)];
    (r.weights, r.gradients) = (131_584, 131_584);
    r.optimizer_state_measured = r.current_allocated - r.weights - r.gradients;
    r.optimizer_state_estimate = Some(2 * r.weights);
    (r.feature_maps, r.intermediate_gradients) = (3 << 20, Some(5 << 20));
    let expected = "\
******************************************
Memory of iteration 7 of epoch 2 on cuda:0
******************************************
Peak reserved (cached)..........................    96.00M
Current reserved (cached).......................    64.00M
Peak allocated..................................    80.00M
Current allocated...............................    40.00M
Feature maps (held when backward began).........     3.00M
Intermediate gradients (backward's transient)...     5.00M

Weights.........................................   128.50K
  fc.bias.......................................   512.00B
  fc.weight.....................................   128.00K

Weight gradients................................   128.50K
  fc.bias grad..................................   512.00B
  fc.weight grad................................   128.00K

Optimizer state and kept tensors................    39.75M
  optimizer state (estimate)....................   257.00K
";
    assert_eq!(r.to_string(), expected);
}
