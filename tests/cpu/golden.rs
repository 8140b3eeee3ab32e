//! The outputs of memlab's tools on a fixed CPU model against files kept in
//! `fixtures/golden/` (recorded with libtorch 2.11, whose CPU kernels make
//! the figures; on another libtorch the comparison is skipped, said): the
//! monitor's two CSV files, the storage report and a line profile as text,
//! CSV and JSON. A change to any of them shows as a diff there;
//! `MEMLAB_BLESS=1` writes them anew (review the diff before committing).
//! The command's outputs on the fixtures are checked the same way by
//! memlab-cli's `outputs_match_the_golden_files`.

use std::path::Path;

use crate::common::{check_child, child};
use memlab::{Device, MemReporter, Render, TrainingMonitor};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

#[memlab::profile(device = "cpu")]
fn golden_step(model: &nn::Linear, opt: &mut nn::Optimizer, x: &Tensor) {
    let hidden = model.forward(x).relu();
    let loss = hidden.mean(Kind::Float);
    opt.backward_step(&loss);
}

/// Compares (or, with `MEMLAB_BLESS`, writes) each output.
fn check(outputs: Vec<(&str, String)>) {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden");
    let mut changed = Vec::new();
    for (name, actual) in outputs {
        let path = golden.join(name);
        if std::env::var_os("MEMLAB_BLESS").is_some() {
            std::fs::write(&path, &actual).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if expected != actual {
            let line = expected.lines().zip(actual.lines()).position(|(a, b)| a != b);
            changed.push(format!("{name} (first differing line: {line:?})\n{actual}"));
        }
    }
    assert!(changed.is_empty(), "outputs changed (MEMLAB_BLESS=1 writes them anew): {changed:#?}");
}

#[test]
fn the_tools_outputs_match_the_golden_files() {
    let libtorch = memlab::run::this_process().libtorch.unwrap_or_default();
    if !libtorch.starts_with("2.11.") {
        eprintln!("golden outputs are libtorch 2.11's; this is {libtorch}: not compared");
        return;
    }
    // Absolute figures (what was allocated before a line) are the
    // process's: alone in a child, where nothing else ran before.
    if !child("the_tools_outputs_match_the_golden_files") {
        check_child("the_tools_outputs_match_the_golden_files", &[]);
        return;
    }
    memlab::reset();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = nn::linear(vs.root() / "fc", 64, 32, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([16, 64], (Kind::Float, tch::Device::Cpu));
    let dir = std::env::temp_dir().join(format!("memlab-golden-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut monitor = TrainingMonitor::new(&vs)
        .device(Device::Cpu)
        .print_period(0)
        .optimizer_kind(memlab::StepOptimizer::Adam)
        .csv_dir(&dir);
    for _ in 0..3 {
        golden_step(&model, &mut opt, &x);
        monitor.record_stats();
    }
    monitor.epoch_end();
    drop(monitor);
    let report = MemReporter::new(&vs).optimizer(&opt).device(Device::Cpu).report().unwrap();
    let profile = memlab::report().filter("golden_step");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    check(vec![
        ("monitor_iterations.csv", read("memlab_iterations.csv")),
        ("monitor_variables.csv", read("memlab_variables.csv")),
        ("reporter.txt", report.to_text()),
        ("reporter.csv", report.to_csv().unwrap()),
        ("reporter.json", report.to_json()),
        ("profile.txt", profile.to_text()),
        ("profile.csv", profile.to_csv().unwrap()),
    ]);
    std::fs::remove_dir_all(&dir).ok();
}
