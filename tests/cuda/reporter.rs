//! `MemReporter` on CUDA: rows that add up, a flattened LSTM's storage, a
//! registered optimizer's state.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn reporter_rows_add_up_on_cuda() {
    let _s = serial();
    let _recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = tch::nn::VarStore::new(GPU);
    let _layer = tch::nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
    let odd = floats(1000); // 4000 bytes, a 4096-byte block
    let report = memlab::MemReporter::new(&vs).tensor("odd", &odd).device(Device::Cuda(0)).report().unwrap();
    println!("{report}");
    let cuda = report.device(Device::Cuda(0)).unwrap();
    assert_eq!(cuda.rows.iter().find(|r| r.name == "fc.weight").unwrap().bytes, 4 << 20);
    assert_eq!(cuda.rows.iter().find(|r| r.name == "odd").unwrap().bytes, 4000);
    let total: i64 = cuda.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cuda.allocated_bytes);
    let rounding = cuda.rows.iter().find(|r| r.kind == memlab::reporter::RowKind::Rounding).expect("a rounding row");
    assert!(rounding.bytes >= 96, "{report}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_flattened_lstm_storage_has_a_row_of_its_own() {
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let lstm = tch::nn::lstm(vs.root() / "lstm", 1024, 1024, Default::default());
    let input = Tensor::zeros([2, 4, 1024], (Kind::Float, GPU));
    let _ = tch::nn::RNN::seq(&lstm, &input);
    let report = memlab::MemReporter::new(&vs).device(Device::Cuda(0)).report().unwrap();
    println!("{report}");
    let cuda = report.device(Device::Cuda(0)).unwrap();
    let storage = cuda.rows.iter().find(|r| r.kind == memlab::reporter::RowKind::Storage).expect("a storage row");
    let views: Vec<_> = cuda.rows.iter().filter(|r| r.name.contains("(->storage #1)")).collect();
    assert_eq!(views.len(), 4, "weights and biases of one layer:\n{report}");
    for view in &views {
        let elements: i64 = view.shape.iter().product();
        assert_eq!(view.bytes, elements * 4, "a view's bytes are its own size: {view:?}");
        assert!(!view.counted);
    }
    let packed: i64 = views.iter().map(|v| v.bytes).sum();
    assert!(storage.bytes >= packed, "the storage holds its views:\n{report}");
    let total: i64 = cuda.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cuda.allocated_bytes, "rows add up:\n{report}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_registered_optimizer_is_named_on_cuda() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    memlab::clear_registry();
    let vs = tch::nn::VarStore::new(GPU);
    let net = cuda_model(&vs, 1024);
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(tch::nn::Adam::default().build(&vs, 1e-4).unwrap()).unwrap();
    let x = Tensor::randn([64, 1024], (Kind::Float, GPU));
    opt.backward_step(&net.forward(&x).mean(Kind::Float));
    let params = (2 * (1024 * 1024 + 1024) + 1024 * 10 + 10) * 4;
    assert_eq!(opt.registered_states(), 12);
    // where_gpu_memory_went counts the state as named: weights, gradients, moments.
    let account = memlab::where_gpu_memory_went(0).unwrap();
    println!("{account}");
    assert_eq!(account.named, 4 * params, "{account}");
    // Given a model instead of the registry: the var store names weights and
    // gradients; its optimizer, added with the builder every tool has, the moments.
    let of_store = memlab::gpu::GpuAccount::of(&vs, 0).unwrap();
    assert_eq!(of_store.named, 2 * params, "{of_store}");
    let with_state = memlab::gpu::GpuAccount::of(memlab::Model::from(&vs).optimizer(&opt), 0).unwrap();
    assert_eq!(with_state.named, 4 * params, "{with_state}");
    // Courtesy::new moves the registered state with the model.
    let mut courtesy = memlab::Courtesy::new();
    let report = courtesy.yield_memory().unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!((c.parameters, c.gradients, c.optimizer_state), (params as u64, params as u64, 2 * params as u64));
    courtesy.restore().unwrap();
    opt.backward_step(&net.forward(&x).mean(Kind::Float));
    memlab::clear_registry();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_blas_workspaces_are_named_and_little_stays_unnamed() {
    use tch::nn::Module;
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let layer = tch::nn::linear(vs.root() / "fc", 1024, 1024, Default::default());
    let input = Tensor::randn([256, 1024], (Kind::Float, GPU));
    let output = layer.forward(&input); // 1 MiB no one names
    let report = memlab::MemReporter::new(&vs).tensor("input", &input).device(Device::Cuda(0)).report().unwrap();
    println!("{report}");
    let cuda = report.device(Device::Cuda(0)).unwrap();
    use memlab::reporter::RowKind;
    let workspaces: Vec<_> = cuda.rows.iter().filter(|r| r.kind == RowKind::Workspace).collect();
    assert!(!workspaces.is_empty(), "the matrix product's cuBLAS workspace is named:\n{report}");
    // Each is a live block of the allocator, as libtorch's table lists it.
    let tables = memlab_tch::segments::blas_workspaces().unwrap();
    let blocks: Vec<(u64, u64)> = memlab_tch::segments::cuda_segments()
        .unwrap()
        .iter()
        .filter(|s| s.device == 0)
        .flat_map(|s| s.blocks.iter().map(|b| (b.address, b.requested_size)))
        .collect();
    for w in &workspaces {
        assert!(w.name.starts_with("cuBLAS"), "{w:?}");
        // cuBLASLt's handle may have cuBLAS's address: the kind tells them apart.
        let name = |t: &memlab_tch::segments::BlasWorkspace| {
            format!("{} workspace (handle {:#x}, stream {:#x})", t.kind.name(), t.handle, t.stream)
        };
        let listed = tables.iter().find(|t| w.name == name(t));
        let listed = listed.unwrap_or_else(|| panic!("{} is in libtorch's table", w.name));
        let block = blocks.iter().find(|(address, _)| *address == listed.address).expect("an allocator block");
        assert_eq!(w.bytes, block.1 as i64, "its bytes are its block's");
        assert!(w.bytes >= MIB && w.bytes % MIB == 0, "a workspace of whole MiB: {w:?}");
    }
    let unnamed: i64 =
        cuda.rows.iter().filter(|r| matches!(r.kind, RowKind::Unnamed | RowKind::Unattributed)).map(|r| r.bytes).sum();
    assert!(unnamed <= MIB, "at most the unnamed output's 1 MiB is left unnamed ({unnamed} B):\n{report}");
    let total: i64 = cuda.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cuda.allocated_bytes, "rows add up:\n{report}");
    // The GPU's account names them too.
    let account = memlab::where_gpu_memory_went(0).unwrap().to_string();
    assert!(account.contains("allocated, cuBLAS workspace (handle"), "{account}");
    drop(output);
}
