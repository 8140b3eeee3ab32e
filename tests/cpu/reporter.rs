//! MemReporter on CPU tensors: exact storage bytes, gradients, shared
//! storages, sparse tensors, weak registration, and rows that add up to the
//! allocator's figure. One test at a time: the allocator is process-wide.

use crate::common::serial;

use memlab::Render;
use memlab::{
    reporter::{MemReport, RowKind},
    Device, MemReporter, Recording,
};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

fn cpu(report: &MemReport) -> &memlab::reporter::DeviceReport {
    report.device(Device::Cpu).expect("a CPU section")
}

fn row<'a>(report: &'a MemReport, name: &str) -> &'a memlab::reporter::Row {
    cpu(report).rows.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("row {name}: {report}"))
}

/// Every byte the allocator holds is in a row.
fn assert_rows_add_up(report: &MemReport) {
    for d in &report.devices {
        let total: i64 = d.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
        assert_eq!(total, d.allocated_bytes, "rows of {} add up to the allocator's figure:\n{report}", d.device);
    }
}

#[test]
fn parameters_and_gradients_by_name() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let linear = nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
    let report = MemReporter::new(&vs).report().unwrap();
    let w = row(&report, "fc.weight");
    assert_eq!(
        (w.kind, w.shape.as_slice(), w.dtype, w.bytes),
        (RowKind::Named(memlab::TensorKind::Parameter), &[1024, 1024][..], Some(memlab::DType::Float), 4 << 20)
    );
    assert_eq!(row(&report, "fc.bias").bytes, 4096);
    assert_eq!(cpu(&report).named_bytes, (4 << 20) + 4096);
    assert!(report.to_text().contains("fc.weight") && report.to_text().contains("4.00M"));
    assert_rows_add_up(&report);

    let x = Tensor::ones([8, 1024], (Kind::Float, tch::Device::Cpu));
    linear.forward(&x).sum(Kind::Float).backward();
    let report = MemReporter::new(&vs).report().unwrap();
    let g = row(&report, "fc.weight.grad");
    assert_eq!((g.kind, g.bytes), (RowKind::Named(memlab::TensorKind::Gradient), 4 << 20));
    assert_eq!(row(&report, "fc.bias.grad").bytes, 4096);
    assert_rows_add_up(&report);
}

/// A var store's variables that tch does not train (running statistics)
/// are buffers in every tool; a frozen parameter stays a parameter.
#[test]
fn buffers_are_told_from_parameters_in_every_tool() {
    use memlab::TensorKind::{Buffer, Parameter};
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _fc = nn::linear(vs.root() / "fc", 16, 16, Default::default());
    let _mean = (vs.root() / "bn").zeros_no_train("running_mean", &[16]);
    let report = MemReporter::new(&vs).report().unwrap();
    assert_eq!(row(&report, "bn.running_mean").kind, RowKind::Named(Buffer), "{report}");
    assert_eq!(row(&report, "fc.weight").kind, RowKind::Named(Parameter), "{report}");
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let kinds: Vec<&str> =
        json["devices"][0]["rows"].as_array().unwrap().iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"buffer") && kinds.contains(&"parameter"), "{kinds:?}");

    // The training monitor's weights say the same, in its records and files.
    let dir = std::env::temp_dir().join(format!("memlab_buffers_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut monitor = memlab::TrainingMonitor::new(&vs).device(Device::Cpu).print_period(0).csv_dir(&dir);
    let record = monitor.record_stats().unwrap();
    let kind_of = |name: &str| record.weight_rows.iter().find(|r| r.name == name).map(|r| r.kind);
    assert_eq!((kind_of("bn.running_mean"), kind_of("fc.bias")), (Some(Buffer), Some(Parameter)));
    drop(monitor);
    let variables = std::fs::read_to_string(dir.join("memlab_variables.csv")).unwrap();
    assert!(variables.contains(",bn.running_mean,buffer,64\n"), "{variables}");
    assert!(variables.contains(",fc.weight,parameter,1024\n"), "{variables}");
    std::fs::remove_dir_all(&dir).ok();

    // Freezing trains nothing, but the variables stay parameters.
    let mut vs = vs;
    vs.freeze();
    let report = MemReporter::new(&vs).report().unwrap();
    assert_eq!(row(&report, "fc.weight").kind, RowKind::Named(Parameter), "{report}");
    assert_eq!(row(&report, "bn.running_mean").kind, RowKind::Named(Buffer), "{report}");
}

#[test]
fn shared_storages_count_once() {
    let _s = serial();
    let base = Tensor::zeros([256, 256], (Kind::Float, tch::Device::Cpu));
    let view = base.narrow(0, 0, 16);
    let report = MemReporter::default().tensor("base", &base).tensor("view", &view).report().unwrap();
    // One row for the storage, with its bytes; each view under it with its own size.
    let storage = row(&report, "storage #1: 2 views");
    assert_eq!(
        (storage.kind, storage.bytes, storage.count, storage.counted),
        (RowKind::Storage, 256 * 256 * 4, 256 * 256, true)
    );
    assert_eq!(storage.shape, [256 * 256], "a storage is a flat buffer");
    let whole = row(&report, "base(->storage #1)");
    assert_eq!((whole.bytes, whole.counted, whole.shape.as_slice()), (256 * 256 * 4, false, &[256, 256][..]));
    let part = row(&report, "view(->storage #1)");
    assert_eq!((part.bytes, part.counted, part.shape.as_slice()), (16 * 256 * 4, false, &[16, 256][..]));
    assert_eq!(cpu(&report).named_bytes, 256 * 256 * 4);
    assert_rows_add_up(&report);
    let text = report.to_text();
    assert!(text.contains("  view(->storage #1)") && text.contains("(16.00K)"), "{text}");
}

#[test]
fn sparse_tensors_are_indices_plus_values() {
    let _s = serial();
    let sparse = Tensor::eye(8, (Kind::Float, tch::Device::Cpu)).to_sparse_sparse_dim(2);
    let report = MemReporter::default().tensor("adjacency", &sparse).report().unwrap();
    // 8 non-zeros: 2x8 int64 indices and 8 float values.
    assert_eq!(row(&report, "adjacency.indices").bytes, 2 * 8 * 8);
    assert_eq!(row(&report, "adjacency.values").bytes, 8 * 4);
}

#[test]
fn registration_is_weak() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _layer = nn::linear(vs.root() / "layer", 16, 16, Default::default());
    memlab::register_var_store("model", &vs);
    let extra = Tensor::zeros([100], (Kind::Float, tch::Device::Cpu));
    memlab::register_tensor("extra", &extra).unwrap();
    let report = MemReporter::registered().report().unwrap();
    assert_eq!(row(&report, "model.layer.weight").bytes, 16 * 16 * 4);
    assert_eq!(row(&report, "extra").bytes, 400);
    drop((vs, _layer, extra));
    let report = MemReporter::registered().report().unwrap();
    // With nothing left on the CPU the section may be gone altogether.
    let rows = report.device(Device::Cpu).map(|d| d.rows.as_slice()).unwrap_or_default();
    assert!(rows.iter().all(|r| !r.name.starts_with("model.") && r.name != "extra"), "{report}");
}

#[memlab::profile(device = "cpu")]
fn activation(x: &Tensor) -> Tensor {
    let hidden = x.relu();
    hidden
}

#[test]
fn unnamed_allocations_are_listed_by_site() {
    let _s = serial();
    let _recording = Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _layer = nn::linear(vs.root() / "layer", 64, 64, Default::default());
    let x = Tensor::randn([32, 64], (Kind::Float, tch::Device::Cpu));
    let hidden = activation(&x);
    let report = MemReporter::new(&vs).tensor("x", &x).report().unwrap();
    let unnamed = cpu(&report)
        .rows
        .iter()
        .find(|r| r.kind == RowKind::Unnamed && r.name.contains("let hidden = x.relu();"))
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!((unnamed.bytes, unnamed.count), (32 * 64 * 4, 1));
    assert_rows_add_up(&report);
    drop(hidden);
}

#[test]
fn device_filter_and_exports() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _layer = nn::linear(vs.root() / "l", 4, 3, Default::default());
    let report = MemReporter::new(&vs).device(Device::Cpu).report().unwrap();
    assert_eq!(report.devices.len(), 1);
    let csv = report.to_csv().unwrap();
    assert!(csv.starts_with("device,kind,name,shape,dtype,count,bytes,counted\n"));
    assert!(csv.contains("cpu,parameter,l.weight,3x4,Float,12,48,true\n"), "{csv}");
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["devices"][0]["device"], "cpu");
    assert_eq!(json["devices"][0]["rows"][1]["bytes"], 48);
    let html = report.to_html();
    assert!(html.contains("<td class=\"text\">l.weight</td>") && html.contains("<style>div.memlab table"), "{html}");
}

#[test]
fn courtesy_without_cuda_tensors_moves_nothing() {
    let _s = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let layer = nn::linear(vs.root() / "fc", 8, 8, Default::default());
    let before = layer.ws.shallow_clone().copy();
    let mut courtesy = memlab::Courtesy::of(&vs);
    let report = courtesy.yield_memory().unwrap();
    assert_eq!(report.moved, 0);
    assert!(!courtesy.is_yielded());
    assert_eq!(courtesy.restore().unwrap(), 0);
    assert_eq!(layer.ws.device(), tch::Device::Cpu);
    assert!(layer.ws.equal(&before));
    if memlab::gpu::cuda_device_count() == 0 {
        assert_eq!(report.to_string(), "Courtesy: no CUDA device, nothing to yield\n");
    }
}

#[test]
fn one_model_names_memory_for_every_tool_as_their_own_builders_do() {
    use tch::nn::OptimizerConfig;
    let _s = serial();
    // Recorded from the start: the exports then see the model's allocations.
    let recording = Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 64, 64, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    opt.backward_step(&fc.forward(&Tensor::ones([8, 64], (Kind::Float, tch::Device::Cpu))).sum(Kind::Float));
    let cache = Tensor::zeros([1000], (Kind::Float, tch::Device::Cpu));
    let model = memlab::Model::new().var_store("model", &vs).tensor("cache", &cache).optimizer(&opt);
    assert!(format!("{model:?}").contains("\"cache\""), "{model:?}");

    // The reporter: the same rows as its one-liner, exact bytes for each.
    let given = MemReporter::of(model.clone()).device(Device::Cpu).report().unwrap();
    let built = MemReporter::default().var_store("model", &vs).tensor("cache", &cache).optimizer(&opt);
    let built = built.device(Device::Cpu).report().unwrap();
    let rows = |r: &MemReport| cpu(r).rows.iter().map(|r| (r.name.clone(), r.bytes)).collect::<Vec<_>>();
    assert_eq!(rows(&given), rows(&built));
    assert_eq!(row(&given, "model.fc.weight.exp_avg").bytes, 64 * 64 * 4);
    assert_eq!(row(&given, "cache").bytes, 4000);
    assert_rows_add_up(&given);

    // The exporter: the snapshot's categories are the model's, as its own builders give them.
    let categories = |exporter: memlab::export::Exporter| {
        let snapshot = exporter.snapshot().unwrap();
        let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
        let allocs = snapshot.device_traces[cpu].iter().filter(|e| e.action == "alloc");
        allocs.map(|e| (e.size, e.category.map_or("none", |c| c.as_str()))).collect::<Vec<_>>()
    };
    let given = categories(memlab::export::Exporter::of(model.clone()));
    let built = memlab::export::Exporter::default().var_store("model", &vs).tensor("cache", &cache).optimizer(&opt);
    assert_eq!(given, categories(built));
    for (bytes, category) in [(64 * 64 * 4, "parameter"), (64 * 64 * 4, "gradient"), (64 * 64 * 4, "optimizer_state")] {
        assert!(given.contains(&(bytes, category)), "a {bytes} B {category}: {given:?}");
    }
    drop(recording);

    // A model whose optimizer cannot be named gives every tool the error.
    let other = nn::VarStore::new(tch::Device::Cpu);
    let _w = other.root().zeros("w", &[4]);
    let lost = nn::Sgd::default().build(&other, 0.1).unwrap();
    let broken = memlab::Model::new().var_store("model", &vs).optimizer(&lost);
    assert!(MemReporter::of(broken.clone()).report().is_err());
    assert!(memlab::export::Exporter::of(broken).snapshot().is_err());
}

/// A tensor's element type is one typed value in every report, named as
/// tch names its `Kind`.
#[test]
fn element_types_are_typed_and_named_as_tch_names_them() {
    use memlab::DType;
    let _s = serial();
    for (kind, dtype) in [
        (Kind::Float, DType::Float),
        (Kind::BFloat16, DType::BFloat16),
        (Kind::Int64, DType::Int64),
        (Kind::Bool, DType::Bool),
        (Kind::Half, DType::Half),
        (Kind::Uint8, DType::Uint8),
    ] {
        assert_eq!(memlab::stats::dtype(kind), dtype);
        assert_eq!(dtype.to_string(), format!("{kind:?}"));
        let t = Tensor::zeros([4], (kind, tch::Device::Cpu));
        let report = MemReporter::default().tensor("t", &t).report().unwrap();
        assert_eq!(row(&report, "t").dtype, Some(dtype));
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        let rows = json["devices"][0]["rows"].as_array().unwrap();
        assert!(rows.iter().any(|r| r["name"] == "t" && r["dtype"] == dtype.as_str()), "{json}");
    }
}

/// Every tool that names memory takes a model the same way, `of(model)`
/// (a var store is one), and its builders add to it with one signature:
/// each names the same tensors the same way.
#[test]
fn every_tool_takes_the_model_the_same_way() {
    let _serial = serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 32, 16, Default::default());
    let cache = Tensor::zeros([1000], (Kind::Float, tch::Device::Cpu));
    let model = memlab::Model::new().var_store("net", &vs).tensor("kv_cache", &cache);
    let names = |report: &MemReport| -> Vec<String> { cpu(report).rows.iter().map(|r| r.name.clone()).collect() };

    let of_model = MemReporter::of(model.clone()).device(Device::Cpu).report().unwrap();
    let built = MemReporter::of(memlab::Model::new())
        .var_store("net", &vs)
        .tensor("kv_cache", &cache)
        .device(Device::Cpu)
        .report()
        .unwrap();
    assert_eq!(names(&of_model), names(&built), "the builders make the same model");
    assert!(names(&of_model).contains(&"net.fc.weight".to_string()), "{of_model}");
    assert_eq!(row(&of_model, "kv_cache").bytes, 4000);
    let of_store = MemReporter::of(&vs).device(Device::Cpu).report().unwrap();
    assert_eq!(row(&of_store, "fc.weight").bytes, 32 * 16 * 4, "a var store is a model of its own names");
    assert_eq!(
        names(&MemReporter::new(&vs).device(Device::Cpu).report().unwrap()),
        names(&of_store),
        "the one-liner is the same"
    );

    // The tracker names a tensor of its model that appeared between two calls.
    let here = memlab::tracker::CallSite { file: file!(), line: line!(), function: "every_tool" };
    let mut tracker = memlab::tracker::Tracker::of(model.clone()).device(Device::Cpu).stdout(false);
    tracker.track(here);
    let later = Tensor::ones([250], (Kind::Float, tch::Device::Cpu));
    let entry = tracker.tensor("later", &later).track(here);
    let appeared: Vec<_> = entry.changes.iter().filter(|c| c.appeared && c.kind.is_some()).collect();
    assert_eq!(appeared.len(), 1, "{entry}");
    assert_eq!((appeared[0].kind, appeared[0].bytes), (Some(memlab::TensorKind::Tensor), 1000), "{entry}");

    // A dispose scope of the model: the gradients a step makes for its
    // variables are model state, not escapes.
    let scope = memlab::DisposeScope::of("step", model.clone()).unwrap().on_escape(memlab::OnEscape::Silent);
    fc.forward(&Tensor::ones([4, 32], (Kind::Float, tch::Device::Cpu))).sum(Kind::Float).backward();
    let report = scope.finish();
    assert_eq!(report.model_state.len(), 2, "weight and bias gradients: {report}");
    assert!(report.escaped.is_empty(), "{report}");
    drop(report);

    // The training monitor measures the model's var stores.
    let mut monitor = memlab::TrainingMonitor::of(&vs).device(Device::Cpu).print_period(0);
    let record = monitor.record_stats().unwrap();
    assert_eq!(record.weights, (32 * 16 + 16) * 4);
    let mut monitor = memlab::TrainingMonitor::of(model).device(Device::Cpu).print_period(0);
    assert_eq!(monitor.record_stats().unwrap().weights, (32 * 16 + 16) * 4);
}
