//! `Courtesy` on CUDA: the cache given back, training resumed bit-identically
//! (Adam's state moved too), a restore that survives a full GPU.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_gives_reserved_memory_back() {
    let _s = serial();
    memlab::gpu::empty_cache().unwrap();
    // What earlier tests left (cuBLAS workspaces stay once a matmul ran).
    let base = allocated();
    let reserved_base = memlab::stats::device_stats(Device::Cuda(0)).unwrap().reserved_bytes.all.current;
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    let weights: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::of(&vs);
    let report = courtesy.yield_memory().unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!(c.moved_bytes, (2 * 2048 * 2048 + 2 * 2048 + 2048 * 10 + 10) * 4);
    assert_eq!(c.parameters, c.moved_bytes);
    assert_eq!(c.still_allocated, base, "only what was there before the model stays");
    assert!(c.reserved_after <= reserved_base + 2 * MIB, "reserved after yield: {}", c.reserved_after);
    assert!(vs.trainable_variables().iter().all(|t| t.device() == tch::Device::Cpu));
    assert_eq!(courtesy.restore().unwrap(), 6);
    for (t, w) in vs.trainable_variables().iter().zip(&weights) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(w));
    }
}

fn train(steps: usize, yield_at: Option<usize>) -> Vec<f64> {
    use tch::nn::{Module, OptimizerConfig};
    tch::manual_seed(7);
    let vs = tch::nn::VarStore::new(GPU);
    let model = cuda_model(&vs, 512);
    let mut opt = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([256, 512], (Kind::Float, GPU));
    let y = Tensor::randint(10, [256], (Kind::Int64, GPU));
    let mut courtesy = memlab::Courtesy::of(&vs);
    let mut losses = Vec::new();
    for step in 0..steps {
        if Some(step) == yield_at {
            let report = courtesy.yield_memory().unwrap();
            println!("{report}");
            assert!(report.moved > 0);
            courtesy.restore().unwrap();
        }
        let loss = model.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
        losses.push(loss.double_value(&[]));
    }
    losses
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_mid_training_gives_bit_identical_losses() {
    let _s = serial();
    let plain = train(12, None);
    let yielded = train(12, Some(6));
    println!("losses without yield: {plain:?}\nlosses with yield at step 6: {yielded:?}");
    assert_eq!(
        plain.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        yielded.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_restore_survives_a_full_gpu() {
    let _s = serial();
    let vs = tch::nn::VarStore::new(GPU);
    let _model = cuda_model(&vs, 2048);
    let weights: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::of(&vs);
    courtesy.yield_memory().unwrap();
    // Someone else takes (nearly) the whole GPU.
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let hog = Tensor::empty([free as i64 - 8 * MIB], (Kind::Uint8, GPU));
    let err = courtesy.restore().unwrap_err();
    println!("restore on a full GPU: {err}");
    assert!(err.to_string().contains("valid on the CPU; call restore() again"));
    assert!(courtesy.is_yielded());
    for t in vs.trainable_variables() {
        let _ = t.sum(Kind::Float).double_value(&[]); // every tensor is usable wherever it is
    }
    drop(hog);
    assert!(courtesy.restore().unwrap() > 0);
    for (t, w) in vs.trainable_variables().iter().zip(&weights) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(w));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_moves_adam_state_and_training_goes_on_bit_identically() {
    use tch::nn::OptimizerConfig;
    const GIB: u64 = 1 << 30;
    let _s = serial();
    memlab::gpu::empty_cache().unwrap();
    let build = || {
        tch::manual_seed(11);
        let vs = tch::nn::VarStore::new(GPU);
        let layers = gib_model(&vs);
        let opt = tch::nn::Adam::default().build(&vs, 1e-4).unwrap();
        (vs, layers, opt)
    };
    let (vs_a, layers_a, mut opt_a) = build();
    let (vs_b, layers_b, mut opt_b) = build();
    tch::manual_seed(12);
    let x = Tensor::randn([64, 4096], (Kind::Float, GPU));
    gib_step(&layers_a, &mut opt_a, &x);
    gib_step(&layers_b, &mut opt_b, &x);

    // The state is named and exact on the GPU too.
    let report = memlab::MemReporter::new(&vs_a).optimizer(&opt_a).device(Device::Cuda(0)).report().unwrap();
    let rows = &report.device(Device::Cuda(0)).unwrap().rows;
    let state: Vec<_> = rows
        .iter()
        .filter(|r| r.kind == memlab::reporter::RowKind::Named(memlab::TensorKind::OptimizerState))
        .collect();
    assert_eq!(state.len(), 32);
    assert!(state.iter().all(|r| r.bytes == 4096 * 4096 * 4), "{report}");
    assert!(rows.iter().any(|r| r.name == "l0.weight.exp_avg_sq"), "{report}");

    let mut courtesy = memlab::Courtesy::of(&vs_a);
    let report = courtesy.yield_memory_with(&mut opt_a).unwrap();
    println!("{report}");
    let c = report.devices[&Device::Cuda(0)];
    assert_eq!((c.parameters, c.gradients, c.optimizer_state), (GIB, GIB, 2 * GIB), "{report}");
    assert!(c.returned() >= 4 * GIB as i64, "{report}");
    assert!(vs_a.trainable_variables().iter().all(|t| t.device() == tch::Device::Cpu));
    assert_eq!(courtesy.restore().unwrap(), 64);

    let (mut losses_a, mut losses_b) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        losses_a.push(gib_step(&layers_a, &mut opt_a, &x).to_bits());
        losses_b.push(gib_step(&layers_b, &mut opt_b, &x).to_bits());
    }
    assert_eq!(losses_a, losses_b, "20 steps after the yield match a run without it");
    for (a, b) in vs_a.trainable_variables().iter().zip(vs_b.trainable_variables()) {
        assert!(a.equal(&b), "weights bit-identical after 20 steps");
    }
    let after = memlab::MemReporter::new(&vs_a).optimizer(&opt_a).device(Device::Cuda(0)).report().unwrap();
    let state_a: i64 = after.devices[0]
        .rows
        .iter()
        .filter(|r| r.kind == memlab::reporter::RowKind::Named(memlab::TensorKind::OptimizerState))
        .map(|r| r.bytes)
        .sum();
    assert_eq!(state_a, 2 * GIB as i64, "the state came back to the GPU");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn courtesy_restore_with_optimizer_state_survives_a_full_gpu() {
    use tch::nn::{Module, OptimizerConfig};
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    tch::manual_seed(5);
    let vs = tch::nn::VarStore::new(GPU);
    let model = cuda_model(&vs, 2048);
    let mut adam = tch::nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([32, 2048], (Kind::Float, GPU));
    adam.backward_step(&model.forward(&x).square().mean(Kind::Float));
    // What the next step gives without any yield, from copies of everything.
    let state_before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.to_device(tch::Device::Cpu)).collect();
    let mut courtesy = memlab::Courtesy::of(&vs);
    let report = courtesy.yield_memory_with(&mut adam).unwrap();
    assert!(report.to_text().contains("optimizer state"), "{report}");
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let hog = Tensor::empty([free as i64 - 8 * MIB], (Kind::Uint8, GPU));
    let err = courtesy.restore().unwrap_err();
    println!("restore with Adam's state on a full GPU: {err}");
    assert!(err.to_string().contains("valid on the CPU; call restore() again"), "{err}");
    drop(hog);
    let restored = courtesy.restore().unwrap();
    assert!(restored > 0);
    for (t, before) in vs.trainable_variables().iter().zip(&state_before) {
        assert_eq!(t.device(), GPU);
        assert!(t.to_device(tch::Device::Cpu).equal(before), "weights came back bit for bit");
    }
    // Adam's moments came back too: its next step runs on the GPU and moves the weights.
    let loss = model.forward(&x).square().mean(Kind::Float);
    adam.backward_step(&loss);
    assert!(loss.double_value(&[]).is_finite());
    let moved =
        vs.trainable_variables().iter().zip(&state_before).any(|(t, b)| !t.to_device(tch::Device::Cpu).equal(b));
    assert!(moved, "the optimizer stepped");
    // The hog's memory stays in libtorch's cache: give it back to the device.
    drop((model, adam, vs, x));
    memlab::gpu::empty_cache().unwrap();
}
