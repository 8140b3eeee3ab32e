//! `will_it_fit` on the CPU: steps until the peak is steady, the weights made
//! before the step counted, the predicted peak allocated equal to the CPU
//! step's peak plus the modelled workspaces and CUDA's rounding, and the
//! answer for cards that fit and do not.

use crate::common::serial;
use memlab::replay::{CudaAdditions, Fit};
use memlab::{Device, WillItFit};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

const MIB: u64 = 1 << 20;

fn model(vs: &nn::VarStore) -> nn::Sequential {
    nn::seq().add(nn::linear(vs.root() / "fc1", 512, 1024, Default::default())).add_fn(|x| x.relu()).add(nn::linear(
        vs.root() / "fc2",
        1024,
        10,
        Default::default(),
    ))
}

#[test]
fn a_step_is_predicted_from_its_cpu_runs_with_the_weights_made_before_it() {
    let _s = serial();
    memlab::clear_registry();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    memlab::register_var_store("model", &vs);
    let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let data = Tensor::randn([256, 512], (Kind::Float, tch::Device::Cpu));
    let labels = Tensor::randint(10, [256], (Kind::Int64, tch::Device::Cpu));
    let cpu_peak = std::cell::Cell::new(0i64);
    let mut step = || {
        memlab::stats::reset_peak_stats(Device::Cpu)?;
        let loss = net.forward(&data).cross_entropy_for_logits(&labels);
        adam.backward_step(&loss);
        cpu_peak.set(memlab::stats::device_stats(Device::Cpu)?.allocated_bytes.all.peak);
        Ok(())
    };
    let saved = std::env::temp_dir().join(format!("memlab_fit_steps_{}.pickle", std::process::id()));
    let prediction = WillItFit::new(80 << 30).setting("expandable_segments:True").save(&saved).run(&mut step).unwrap();
    // The steps saved predict again, from the file alone, what the program did.
    let file = memlab::export::Snapshot::read_pickle(&saved).unwrap().snapshot;
    let _ = std::fs::remove_file(&saved);
    let options = memlab::replay::PredictOptions {
        capacity: Some(80 << 30),
        settings: vec![String::new(), "expandable_segments:True".into()],
        ..Default::default()
    };
    let again = memlab::replay::predict_cuda("saved", &file, &options).unwrap();
    assert_eq!(again.settings, prediction.settings);
    assert_eq!(again.cpu_step_peaks, prediction.cpu_step_peaks);

    // Adam's state appears in the first step: the second is larger, and the
    // steps stop once two agree.
    let peaks = &prediction.cpu_step_peaks;
    assert!(peaks.len() >= 3 && peaks[0] < peaks[1], "{peaks:?}");
    assert_eq!(peaks[peaks.len() - 2], peaks[peaks.len() - 1], "{peaks:?}");
    let cpu_peak = cpu_peak.get();
    assert_eq!(peaks[peaks.len() - 1] as i64, cpu_peak);

    // The predicted peak allocated is the CPU step's peak (weights, gradients,
    // Adam's state and the step's tensors, the data aside: it is not
    // registered) plus the modelled workspaces, each block rounded up to
    // CUDA's 512 bytes.
    let additions = CudaAdditions::default();
    let workspaces = u64::from(additions.cublas_handles) * additions.cublas_workspace + additions.cublaslt_workspace;
    let data_bytes = (256 * 512 * 4 + 256 * 8) as u64;
    let expected = cpu_peak as u64 - data_bytes + workspaces;
    assert_eq!(prediction.settings.len(), 2);
    for p in &prediction.settings {
        assert!(
            p.peak_allocated >= expected && p.peak_allocated < expected + 512 * 64,
            "{}: predicted {} for {expected}",
            p.settings,
            p.peak_allocated
        );
        assert!(p.peak_reserved >= p.peak_allocated);
        assert_eq!(p.peak_device, p.peak_reserved + additions.outside_allocator);
        assert_eq!(p.fit, Some(Fit::Fits { spare: (80 << 30) - p.peak_device }));
    }
    let text = prediction.to_string();
    assert!(text.contains("Every figure is an estimate") && text.contains("The CPU run's peak was steady"), "{text}");
    // Every op of the step is in memlab's table, modelled or the same on
    // both devices: the prediction is a point.
    assert!(prediction.unmodelled.is_empty(), "{text}");
    assert!(prediction.settings.iter().all(|p| p.range.is_none()), "{text}");

    // Without the registry what was made before the step is not known: the
    // prediction is smaller by what of it lives through the step, the
    // weights and Adam's two moments (the gradients are set to none and made
    // again in each step, so the history has them either way).
    memlab::clear_registry();
    let held = memlab::stats::device_stats(Device::Cpu).unwrap().allocated_bytes.all.current as u64 - data_bytes;
    let weights = ((512 * 1024 + 1024 + 1024 * 10 + 10) * 4) as u64;
    assert_eq!(held, 4 * weights, "weights, gradients and Adam's two moments");
    let unnamed = WillItFit::peaks().run(&mut step).unwrap();
    let diff = prediction.settings[0].peak_allocated - unnamed.settings[0].peak_allocated;
    assert!(diff.abs_diff(3 * weights) < 16 * 512, "{diff} for {} bytes of weights and moments", 3 * weights);

    // A card smaller than what lies outside the allocator and the step does not fit.
    let small = WillItFit::new(additions.outside_allocator + 16 * MIB).of(&vs).run(&mut step).unwrap();
    let Some(Fit::DoesNotFit { needing, .. }) = small.settings[0].fit else {
        panic!("a card with 16 MiB for the allocator fits: {:?}", small.settings[0].fit)
    };
    // A card as much larger as it says fits.
    let larger = WillItFit::new(additions.outside_allocator + 16 * MIB + needing).of(&vs).run(&mut step).unwrap();
    assert!(matches!(larger.settings[0].fit, Some(Fit::Fits { .. } | Fit::FitsGivingCacheBack { .. })), "{larger}");
    assert!(small.to_string().contains("does not fit: runs out at +"));
}

/// An LSTM's step on the CPU runs `aten::lstm`, whose CUDA kernel (cuDNN's
/// RNN) memlab does not model: the prediction is a range that contains its
/// point estimate, the op is named with its runs, and a card inside the
/// range gets "may not fit".
#[test]
fn an_op_memlab_does_not_model_makes_the_prediction_a_range_that_names_it() {
    let _s = serial();
    memlab::clear_registry();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let config = nn::ConvTransposeConfig { stride: 2, ..Default::default() };
    let up = nn::conv_transpose2d(vs.root() / "up", 32, 16, 3, config);
    let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let data = Tensor::randn([16, 32, 64, 64], (Kind::Float, tch::Device::Cpu));
    let mut step = || {
        adam.backward_step(&up.forward(&data).mean(None));
        Ok(())
    };
    // Under expandable segments reserved grows by 2 MiB pages: the range
    // shows in it (under the defaults a 20 MiB segment can hold it all).
    let expandable = "expandable_segments:True";
    let p = WillItFit::peaks().setting(expandable).of(&vs).run(&mut step).unwrap();
    let names: Vec<&str> = p.unmodelled.iter().map(|u| u.name.as_str()).collect();
    let name = "convolution (transposed)";
    assert!(names.contains(&name), "{p}");
    let runs = p.unmodelled.iter().find(|u| u.name == name).unwrap();
    assert_eq!(runs.runs as usize, p.cpu_step_peaks.len(), "one run a step: {p}");
    assert!(runs.may_add > 0, "{p}");
    let s = &p.settings[1];
    let range = s.range.expect("a range");
    assert!(range.low.reserved <= s.peak_reserved && s.peak_reserved < range.high.reserved, "{p}");
    assert!(range.low.allocated <= s.peak_allocated && s.peak_allocated < range.high.allocated, "{p}");
    let text = p.to_string();
    assert!(text.contains(name) && text.contains("reserved, high"), "{text}");

    let inside = s.peak_device + (range.high.device - s.peak_device) / 2;
    let card = WillItFit::new(inside).setting(expandable).of(&vs).run(&mut step).unwrap();
    assert!(matches!(&card.settings[1].fit, Some(Fit::MayNotFit { ops }) if ops.iter().any(|o| o == name)), "{card}");
}

/// An LSTM's step: cuDNN's RNN is modelled in place of the CPU's oneDNN
/// kernels (forward and backward). At a shape whose workspace was measured
/// the prediction is a point; elsewhere the workspace is an estimate and the
/// prediction a range around it.
#[test]
fn an_lstm_is_modelled_as_cudnn_runs_it() {
    let _s = serial();
    let predict_with = |hidden: i64, weights: Option<memlab::replay::rnn::RnnWeights>| {
        memlab::clear_registry();
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let config = nn::RNNConfig { batch_first: true, ..Default::default() };
        let lstm = nn::lstm(vs.root() / "lstm", 256, hidden, config);
        let head = nn::linear(vs.root() / "head", hidden, 10, Default::default());
        let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
        let data = Tensor::randn([4, 64, 256], (Kind::Float, tch::Device::Cpu));
        let mut step = || {
            use tch::nn::RNN;
            let (out, _) = lstm.seq(&data);
            adam.backward_step(&head.forward(&out).mean(None));
            Ok(())
        };
        let fit = WillItFit::peaks().of(&vs);
        let fit = match weights {
            Some(w) => fit.rnn_weights(w),
            None => fit,
        };
        fit.run(&mut step).unwrap()
    };
    let predict = |hidden: i64| predict_with(hidden, None);
    // Measured on an H200 at 256 in, 512 hidden, 64 steps, batch 4.
    let p = predict(512);
    assert!(p.unmodelled.is_empty(), "{p}");
    assert!(p.settings[0].range.is_none(), "{p}");
    let kernels = p.kernels.clone().unwrap();
    assert_eq!(kernels.rnns, p.cpu_step_peaks.len(), "one call a step: {p}");
    assert_eq!(kernels.rnn_workspaces_estimated, 0, "{p}");
    // cuDNN's reserve: five gates' and states' worth of floats a step and
    // 256 bytes (as measured).
    assert_eq!(kernels.largest_rnn_reserve, 5 * 64 * 4 * 512 * 4 + 256, "{p}");
    // A model made on the CPU and moved copies its weights into a buffer
    // of their size at every forward pass, kept for the backward pass: the
    // peak grows, by that buffer at most.
    let copied = predict_with(512, Some(memlab::replay::rnn::RnnWeights::CopiedEachStep));
    let weights = (4 * 512 * (256 + 512) + 2 * 4 * 512) * 4;
    let (with, without) = (copied.settings[0].peak_allocated, p.settings[0].peak_allocated);
    assert!(without < with && with <= without + weights, "{copied}");
    // Not measured at 200 hidden: a range, around the estimate.
    let p = predict(200);
    assert!(p.unmodelled.is_empty(), "{p}");
    let kernels = p.kernels.clone().unwrap();
    assert_eq!(kernels.rnn_workspaces_estimated, kernels.rnns, "{p}");
    let (s, range) = (&p.settings[0], p.settings[0].range.expect("a range"));
    assert!(range.low.allocated < s.peak_allocated && s.peak_allocated < range.high.allocated, "{p}");
}

/// A model's construction, recorded on the CPU, is what the prediction
/// makes before the steps: the GRU's weights in the order tch makes them,
/// grouped as one RNN's, then its flat buffer of their bytes right after
/// the last one and each freed, as tch's `nn::gru` does on a CUDA
/// `VarStore`; a tensor made beside the model and not named is left out.
#[test]
fn a_recorded_construction_is_made_as_cuda_makes_it() {
    let _s = serial();
    memlab::clear_registry();
    let ((vs, gru, head, data), construction) = memlab::record_construction(|| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let config = nn::RNNConfig { num_layers: 2, bidirectional: true, batch_first: true, ..Default::default() };
        let gru = nn::gru(vs.root() / "gru", 32, 48, config);
        let head = nn::linear(vs.root() / "head", 96, 10, Default::default());
        let data = Tensor::randn([4, 16, 32], (Kind::Float, tch::Device::Cpu));
        Ok((vs, gru, head, data))
    })
    .unwrap();
    let variables = vs.variables();
    let address = |name: &str| variables[name].data_ptr() as u64;
    let mut weights = Vec::new();
    for layer in 0..2 {
        for suffix in ["", "_reverse"] {
            for name in ["weight_ih", "weight_hh", "bias_ih", "bias_hh"] {
                weights.push(address(&format!("gru.{name}_l{layer}{suffix}")));
            }
        }
    }
    let made: Vec<u64> = construction.events.iter().filter(|e| !e.freed).map(|e| e.address).collect();
    for a in weights.iter().chain([&address("head.weight"), &(data.data_ptr() as u64)]) {
        assert!(made.contains(a), "{a:#x} made in the construction: {construction:?}");
    }
    let path = std::env::temp_dir().join(format!("memlab_construction_{}.pickle", std::process::id()));
    let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let mut step = || {
        use tch::nn::RNN;
        let (out, _) = gru.seq(&data);
        adam.backward_step(&head.forward(&out).mean(None));
        Ok(())
    };
    WillItFit::peaks().of(&vs).construction(construction).save(&path).run(&mut step).unwrap();
    let file = memlab::export::Snapshot::read_pickle(&path).unwrap().snapshot;
    std::fs::remove_file(&path).unwrap();
    let inputs = file.memlab.as_ref().unwrap().prediction_inputs.clone().unwrap();
    let saved = inputs.construction.unwrap();
    assert_eq!(saved.rnns, vec![weights.clone()], "one RNN, its weights in the order made");
    assert!(!saved.events.iter().any(|e| e.address == data.data_ptr() as u64), "the data is not the model's");
    // In the predicted history: the flat buffer of the weights' bytes right
    // after the last weight, then each weight freed.
    let history = memlab::replay::predicted_history("gru", &file, &Default::default()).unwrap();
    let trace = &history.device_traces[0];
    let last = trace.iter().position(|e| e.addr == weights.last().copied()).unwrap();
    let bytes: u64 = weights.iter().map(|&a| trace.iter().find(|e| e.addr == Some(a)).unwrap().size).sum();
    assert_eq!(bytes, 4 * (2 * 3 * 48 * (32 + 48 + 2) + 2 * 3 * 48 * (96 + 48 + 2)), "the GRU's weights");
    assert_eq!((trace[last + 1].action, trace[last + 1].size), (memlab::events::Action::Alloc, bytes));
    let freed: Vec<u64> = trace[last + 2..]
        .iter()
        .take(2 * weights.len())
        .filter(|e| e.action == memlab::events::Action::FreeRequested)
        .filter_map(|e| e.addr)
        .collect();
    assert_eq!(freed, weights);
}

/// Attention without a mask: CUDA's memory-efficient kernel (float32) and
/// cuDNN's (bfloat16) are modelled in place of the CPU's flash kernel
/// (forward and backward), so the prediction is a point.
#[test]
fn attention_is_modelled_as_cudas_kernels() {
    let _s = serial();
    let predict = |kind: Kind| {
        memlab::clear_registry();
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let proj = nn::linear(vs.root() / "proj", 64, 64, Default::default());
        let mut adam = nn::Adam::default().build(&vs, 1e-3).unwrap();
        let x = Tensor::randn([2, 4, 100, 64], (Kind::Float, tch::Device::Cpu));
        let mut step = || {
            let h = proj.forward(&x).to_kind(kind);
            let out = Tensor::scaled_dot_product_attention(&h, &h, &h, None::<&Tensor>, 0.0, true, None, false);
            adam.backward_step(&out.to_kind(Kind::Float).mean(None));
            Ok(())
        };
        WillItFit::peaks().of(&vs).run(&mut step).unwrap()
    };
    let p = predict(Kind::Float);
    assert!(p.unmodelled.is_empty(), "{p}");
    assert!(p.settings[0].range.is_none(), "{p}");
    let kernels = p.kernels.clone().unwrap();
    assert_eq!(kernels.attentions, 2 * p.cpu_step_peaks.len(), "forward and backward, a step: {p}");
    // 100 steps: the workspace's rows rounded up to 128, of 64 floats, and
    // a quarter byte a row.
    assert_eq!(kernels.largest_attention_workspace, 2 * 4 * 128 * 64 * 4 + 2 * 4 * 128 / 4, "{p}");
    let p = predict(Kind::BFloat16);
    assert!(p.unmodelled.is_empty() && p.settings[0].range.is_none(), "{p}");
    let kernels = p.kernels.clone().unwrap();
    assert_eq!((kernels.attentions, kernels.cudnn_attentions), (0, 2 * p.cpu_step_peaks.len()), "{p}");
    assert!(p.to_string().contains("cuDNN's attention"), "{p}");
}

/// A step whose forward pass runs under CUDA's autocast (`tch::autocast`,
/// which on the CPU does nothing) is recorded under CPU autocast: its
/// products in halves, its weights cast once a step, its backward pass and
/// everything after the prediction as without it. A type autocast does not
/// cast to is refused before the first step.
#[test]
fn a_step_under_autocast_runs_its_products_in_halves() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = model(&vs);
    let mut sgd = nn::Sgd::default().build(&vs, 1e-3).unwrap();
    let data = Tensor::randn([256, 512], (Kind::Float, tch::Device::Cpu));
    let mut step = || {
        let loss = tch::autocast(true, || net.forward(&data).mean(None));
        sgd.backward_step(&loss);
        Ok(())
    };
    let mut recorded = |autocast: Option<Kind>| {
        let path = std::env::temp_dir().join(format!("memlab_autocast_{}.pickle", std::process::id()));
        let fit = WillItFit::peaks().of(&vs).save(&path);
        let fit = match autocast {
            Some(kind) => fit.autocast(kind),
            None => fit,
        };
        fit.run(&mut step).unwrap();
        let file = memlab::export::Snapshot::read_pickle(&path).unwrap().snapshot;
        std::fs::remove_file(&path).unwrap();
        let sizes: Vec<u64> = file.device_traces[0].iter().map(|e| e.size).collect();
        (sizes, file.memlab.unwrap().ops.unwrap())
    };
    // The products' inputs as their kernels got them.
    let products = |ops: &[memlab::replay::OpRecord]| -> Vec<Option<memlab::DType>> {
        let addmm = ops.iter().filter(|r| r.name == "addmm");
        addmm.map(|r| r.tensors.as_ref().and_then(|t| t.first.first()?.dtype)).collect()
    };
    let (plain, ops) = recorded(None);
    assert!(products(&ops).iter().all(|&d| d == Some(memlab::DType::Float)), "{:?}", products(&ops));
    let (halves, ops) = recorded(Some(Kind::Half));
    assert!(products(&ops).contains(&Some(memlab::DType::Half)), "{:?}", products(&ops));
    // The input cast to halves (256 x 512), which a step without autocast
    // does not make, and fc1's weight cast (1,024 x 512).
    let (input, weight) = (256 * 512 * 2, 1024 * 512 * 2);
    assert!(halves.contains(&input) && !plain.contains(&input), "{halves:?}\n{plain:?}");
    assert!(halves.contains(&weight), "{halves:?}");
    // After the prediction, the CPU runs as before.
    let x = Tensor::ones([4, 4], (Kind::Float, tch::Device::Cpu));
    assert_eq!(x.mm(&x).kind(), Kind::Float);
    // Doubles are refused before any step.
    let ran = std::cell::Cell::new(false);
    let e = WillItFit::peaks()
        .autocast(Kind::Double)
        .run(|| {
            ran.set(true);
            Ok(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("autocast to Double") && !ran.get(), "{e}");
}

#[test]
fn a_failing_step_is_returned_as_it_failed() {
    let _s = serial();
    let e = memlab::will_it_fit(80 << 30, || Err(memlab::Error::InvalidArgument("no data".into()))).unwrap_err();
    assert!(e.to_string().contains("no data"), "{e}");
}

#[test]
fn find_batch_size_searches_a_cuda_card_on_the_cpu() {
    let _s = serial();
    memlab::clear_registry();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 4096, 512, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 512, 10, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3).unwrap()).unwrap();
    let mut step = |batch: usize| -> Result<(), Box<dyn std::error::Error>> {
        let data = Tensor::randn([batch as i64, 4096], (Kind::Float, tch::Device::Cpu));
        let labels = Tensor::randint(10, [batch as i64], (Kind::Int64, tch::Device::Cpu));
        adam.backward_step(&net.forward(&data).cross_entropy_for_logits(&labels));
        Ok(())
    };
    // The least card a batch fits, predicted on its own, with the model's
    // error to spare: its device peak and 1 % of its reserved peak.
    fn need(step: &mut impl FnMut(usize) -> Result<(), Box<dyn std::error::Error>>, batch: usize) -> u64 {
        let as_memlab = |e: Box<dyn std::error::Error>| memlab::Error::InvalidArgument(e.to_string());
        let p = WillItFit::peaks().max_steps(3).run(|| step(batch).map_err(as_memlab)).unwrap();
        let error = (p.settings[0].peak_reserved * memlab::batch_size::MODEL_ERROR_PERCENT).div_ceil(100);
        p.settings[0].peak_device + error
    }
    let card = need(&mut step, 64);
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::CudaCard(card), 512, &mut step).unwrap();
    let largest = search.largest.expect("batch 64 fits the card made for it");
    assert!((64..512).contains(&largest), "{search:?}");
    let (at, above) = (need(&mut step, largest), need(&mut step, largest + 1));
    assert!(at <= card && above > card, "{largest} ({at}) is the largest that fits {card} ({above} above it)");
    // A batch that fits with less than the model's error to spare only may fit.
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::CudaCard(card - 1), 512, &mut step).unwrap();
    assert!(search.largest.is_some_and(|n| n < largest), "{search:?}");
    assert!(search.largest_giving_cache_back.is_some_and(|n| n >= largest), "{search:?}");
    assert!(search.tried.iter().any(|t| t.within_error), "{search:?}");
    assert!(search.tried.iter().all(|t| t.outcome.is_ok()), "{search:?}");
    // A try that panics fails, as on a GPU, and the search goes on below it.
    let panicking = |batch: usize| -> Result<(), Box<dyn std::error::Error>> {
        assert!(batch <= 8, "failed to allocate {batch} rows on the host");
        step(batch)
    };
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::CudaCard(card), 512, panicking).unwrap();
    assert_eq!(search.largest, Some(8), "{search:?}");
    let failed = search.tried.iter().find(|t| t.batch_size == 16).unwrap();
    assert!(failed.outcome.as_ref().is_err_and(|e| e.contains("panicked: failed to allocate 16 rows")), "{failed:?}");
    // On a CUDA device the budget is refused: the search runs on the CPU.
    let e = memlab::find_batch_size(Device::Cuda(0), memlab::Budget::CudaCard(card), 8, &mut step).unwrap_err();
    assert!(e.to_string().contains("give Device::Cpu"), "{e}");
}

/// A batch that fits the card only if the allocator gives its cache back
/// is not named: whether the cache given back leaves room depends on where
/// the driver put the segments, which the model does not know. Each try
/// frees a temporary of `n` MiB before it makes one of `1.5 n` MiB, which
/// the first's cached segment cannot serve: the step reserves both, though
/// no more than the second is ever in use.
#[test]
fn find_batch_size_never_counts_on_the_cache_given_back() {
    let _s = serial();
    memlab::clear_registry();
    let mut step = |batch: usize| -> Result<(), Box<dyn std::error::Error>> {
        let first = Tensor::ones([batch as i64, 1 << 18], (Kind::Float, tch::Device::Cpu));
        drop(first);
        let second = Tensor::ones([batch as i64, 3 << 17], (Kind::Float, tch::Device::Cpu));
        drop(second);
        Ok(())
    };
    let peaks = |step: &mut dyn FnMut(usize) -> Result<(), Box<dyn std::error::Error>>, batch: usize| {
        let as_memlab = |e: Box<dyn std::error::Error>| memlab::Error::InvalidArgument(e.to_string());
        WillItFit::peaks().max_steps(3).run(|| step(batch).map_err(as_memlab)).unwrap().settings[0].clone()
    };
    let at_16 = peaks(&mut step, 16);
    assert!(at_16.peak_reserved >= 40 * MIB && at_16.peak_allocated < 25 * MIB, "{at_16:?}");
    // With the model's error to spare.
    let error = |p: &memlab::replay::SettingPrediction| {
        (p.peak_reserved * memlab::batch_size::MODEL_ERROR_PERCENT).div_ceil(100)
    };
    let card = at_16.peak_device + error(&at_16);
    // Giving the cache back, 24 fits the card in the model (36 MiB in use
    // at most, in 24 + 36 MiB reserved without a limit).
    let at_24 = WillItFit::new(card)
        .max_steps(3)
        .run(|| step(24).map_err(|e| memlab::Error::InvalidArgument(e.to_string())))
        .unwrap();
    assert!(matches!(at_24.settings[0].fit, Some(Fit::FitsGivingCacheBack { .. })), "{at_24}");
    assert!(at_24.to_string().contains("may not fit"), "{at_24}");
    let search = memlab::find_batch_size(Device::Cpu, memlab::Budget::CudaCard(card), 64, &mut step).unwrap();
    let largest = search.largest.expect("16 fits the card made for it");
    let need = |p: memlab::replay::SettingPrediction| p.peak_device + error(&p);
    let (at, above) = (need(peaks(&mut step, largest)), need(peaks(&mut step, largest + 1)));
    assert!(
        at <= card && above > card,
        "{largest} ({at}) is the largest that fits {card} ({above} above it): {search:?}"
    );
    // Up to 26 the second temporary (39 MiB at 26, to 2 MiB) fits the
    // allocator's 40 MiB once the first's segment is given back; 27's
    // (40.5 MiB) does not. The search names that too, as what may fit.
    assert_eq!((search.largest, search.largest_giving_cache_back), (Some(16), Some(26)), "{search}");
    assert!(search.tried.iter().any(|t| t.fits_giving_cache_back), "{search:?}");
    assert!(search.to_string().contains("Up to 26 may fit"), "{search}");
    // Each size is tried once.
    let mut sizes: Vec<usize> = search.tried.iter().map(|t| t.batch_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    assert_eq!(sizes.len(), search.tried.len(), "{search:?}");
}

/// Under a recording the program already runs, a prediction covers its own
/// steps only: a smaller batch after a larger one is predicted smaller.
#[test]
fn a_prediction_under_a_running_recording_covers_its_own_steps() {
    let _s = serial();
    memlab::clear_registry();
    let _outer = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let predict = |batch: i64| {
        let p = WillItFit::peaks().run(|| {
            let x = Tensor::ones([batch, 1 << 20], (Kind::Float, tch::Device::Cpu));
            drop(x.sum(Kind::Float));
            Ok(())
        });
        p.unwrap().settings[0].peak_allocated
    };
    let (large, small) = (predict(64), predict(2));
    // 4 MiB a sample; no matrix product, so no cuBLAS workspace.
    assert!(large >= 64 << 22 && small < 3 << 22, "batch 64 needs {large}, 2 {small}");
}

/// The reductions of the CPU steps are watched: a bias gradient's sum over a
/// batch of 2048 rows stages through a buffer on CUDA, which the prediction
/// adds (and the allocator then keeps cached).
#[test]
fn the_cuda_staging_of_the_steps_reductions_is_added() {
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 256, 512, Default::default());
    memlab::register_var_store("model", &vs);
    let data = Tensor::randn([2048, 256], (Kind::Float, tch::Device::Cpu));
    let prediction = WillItFit::peaks()
        .run(|| {
            let loss = fc.forward(&data).sum(Kind::Float);
            loss.backward();
            Ok(())
        })
        .unwrap();
    let kernels = prediction.kernels.as_ref().expect("will_it_fit watches the ops");
    assert!(kernels.reductions >= prediction.cpu_step_peaks.len(), "{prediction:?}");
    assert!(kernels.staged >= 1, "{prediction:?}");
    let staging = memlab::replay::reduction_staging(
        &memlab::replay::Reduction { shape: vec![2048, 512], strides: vec![512, 1], element_size: 4, reduced: 1 },
        memlab::replay::ReductionDevice::H100,
    )
    .unwrap()
    .0;
    assert!(staging > 0);
    // What the steps hold at once is far less than the staging buffer, which
    // the reserved peak holds cached.
    let p = &prediction.settings[0];
    assert!(p.peak_reserved >= staging + (2048 * 512 * 4), "{p:?} with a staging buffer of {staging}");
    assert!(prediction.to_string().contains("stage through a buffer"), "{prediction}");
}

/// A recording with `Settings::ops` keeps the ops whose CUDA kernels
/// allocate otherwise, with their shapes, in its snapshot and through a
/// pickle: a convolution forward and backward (its output mask), the sums,
/// and the matrix products inside backward functions told from the others.
/// Without `Settings::ops` a snapshot says it did not watch them.
#[test]
fn a_recording_watches_the_ops_whose_cuda_kernels_allocate_otherwise() {
    use memlab::replay::Op;
    let _s = serial();
    memlab::clear_registry();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let conv = nn::conv2d(vs.root() / "conv", 3, 8, 3, nn::ConvConfig { padding: 1, ..Default::default() });
    let fc = nn::linear(vs.root() / "fc", 8 * 16 * 16, 10, Default::default());
    let images = Tensor::randn([4, 3, 16, 16], (Kind::Float, tch::Device::Cpu));
    let recording = memlab::Recording::start(memlab::events::Settings::default().ops(true)).unwrap();
    let loss = fc.forward(&conv.forward(&images).relu().flatten(1, -1)).sum(Kind::Float);
    loss.backward();
    let snapshot = memlab::export::Exporter::of(&vs).snapshot().unwrap();
    drop(recording);
    let ops = snapshot.memlab.as_ref().unwrap().ops.clone().expect("the recording watched its ops");
    let convolutions: Vec<_> = ops
        .iter()
        .filter_map(|r| match &r.op {
            Op::Convolution(c) => Some(c.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(convolutions.len(), 2, "{ops:?}");
    let (forward, backward) = (&convolutions[0], &convolutions[1]);
    assert!(!forward.backward && backward.backward);
    assert_eq!((forward.input.clone(), forward.weight.clone()), (vec![4, 3, 16, 16], vec![8, 3, 3, 3]));
    assert_eq!(forward.output, [4, 8, 16, 16]);
    assert_eq!((forward.padding.clone(), forward.stride.clone()), (vec![1, 1], vec![1, 1]));
    // The images need no gradient: the weight's and the bias's only.
    assert_eq!((backward.output.clone(), backward.output_mask), (vec![4, 8, 16, 16], 0b110));
    // Every other op that allocated is kept too, by name, with its tensor
    // arguments; one that allocated nothing (a view) is not.
    assert!(ops.iter().all(|r| !r.name.is_empty()), "{ops:?}");
    let names: Vec<&str> = ops.iter().map(|r| r.name.as_str()).collect();
    // The CPU's relu is clamp_min's.
    let relu =
        ops.iter().find(|r| r.name == "clamp_min").unwrap_or_else(|| panic!("relu allocated its output: {names:?}"));
    assert!(matches!(relu.op, Op::Other));
    let arguments = relu.tensors.as_ref().unwrap();
    assert_eq!((arguments.count, arguments.bytes), (1, 4 * 8 * 16 * 16 * 4));
    assert_eq!(arguments.first[0].shape.as_deref(), Some(&[4, 8, 16, 16][..]));
    assert_eq!(arguments.first[0].dtype, Some(memlab::DType::Float));
    assert!(!ops.iter().any(|r| r.name == "flatten" || r.name == "view"), "views allocate nothing: {ops:?}");
    let matmuls: Vec<bool> = ops
        .iter()
        .filter_map(|r| match r.op {
            Op::Matmul { in_backward } => Some(in_backward),
            _ => None,
        })
        .collect();
    assert_eq!(matmuls.first(), Some(&false), "the forward addmm first: {matmuls:?}");
    assert!(matmuls.contains(&true), "backward's products inside backward functions: {matmuls:?}");
    // Each forward op carries autograd's sequence numbers, and the backward
    // nodes that ran carry theirs: the convolution's backward pass is found
    // by them (the relu's node is made by `relu`, before its kernel calls
    // `clamp_min`, which makes none).
    let conv_record = ops.iter().find(|r| matches!(&r.op, Op::Convolution(c) if !c.backward)).unwrap();
    assert!(conv_record.sequence.is_some() && conv_record.sequence_end > conv_record.sequence, "{conv_record:?}");
    let nodes: Vec<&str> = conv_record.backward_nodes(&ops).map(|n| n.name.as_str()).collect();
    assert_eq!(nodes, ["ConvolutionBackward0"], "{ops:?}");
    assert_eq!(relu.backward_nodes(&ops).count(), 0, "{relu:?}");
    // Bool, int and float arguments are kept in order (lists are not): the
    // convolution's transposed flag and groups.
    let flags: Vec<f64> = conv_record.scalars.iter().map(|s| s.0).collect();
    assert_eq!(flags, [0.0, 1.0], "convolution's transposed and groups: {conv_record:?}");
    assert!(ops.iter().any(|r| matches!(&r.op, Op::Reduction(s) if s.shape == [4, 10])), "the loss's sum: {ops:?}");
    // A softmax's backward pass, with its gradient's shape.
    let recording2 = memlab::Recording::start(memlab::events::Settings::default().ops(true)).unwrap();
    let scores = Tensor::randn([2, 3, 5], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    (scores.softmax(-1, Kind::Float) * Tensor::arange(5, (Kind::Float, tch::Device::Cpu))).sum(Kind::Float).backward();
    let watched = memlab::export::Exporter::of(&vs).snapshot().unwrap().memlab.unwrap().ops.unwrap();
    drop(recording2);
    let softmax = Op::SoftmaxBackward { shape: vec![2, 3, 5], element_size: 4 };
    assert!(watched.iter().any(|r| r.op == softmax), "{watched:?}");
    // An embedding's backward pass: its indices (a narrowed view, as a
    // language model's inputs are), its table, and the sum's gradient,
    // broadcast (not contiguous).
    let recording3 = memlab::Recording::start(memlab::events::Settings::default().ops(true)).unwrap();
    let table = Tensor::randn([10, 6], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let tokens = Tensor::randint(10, [2, 5], (Kind::Int64, tch::Device::Cpu));
    Tensor::embedding(&table, &tokens.narrow(1, 0, 4), -1, false, false).sum(Kind::Float).backward();
    let watched = memlab::export::Exporter::of(&vs).snapshot().unwrap().memlab.unwrap().ops.unwrap();
    drop(recording3);
    let embedding = Op::EmbeddingBackward(memlab::replay::EmbeddingBackward {
        indices: 8,
        index_size: 8,
        rows: 10,
        width: 6,
        element_size: 4,
        scale_grad_by_freq: false,
        indices_contiguous: false,
        grad_contiguous: false,
    });
    assert!(watched.iter().any(|r| r.op == embedding), "{watched:?}");
    assert!(ops.iter().all(|r| r.start_us <= r.end_us));
    // Through a pickle, as `memlab replay --as-cuda` reads it.
    let read = memlab::export::Snapshot::from_pickle(&snapshot.to_pickle().unwrap()).unwrap().snapshot;
    assert_eq!(read.memlab.unwrap().ops, Some(ops));
    // A recording without the setting did not watch them.
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let snapshot = memlab::export::Exporter::of(&vs).snapshot().unwrap();
    drop(recording);
    assert_eq!(snapshot.memlab.unwrap().ops, None);
}

/// Two predictions at once, on two threads, each of its own model: each
/// figure is its run's alone. They ran under one recording and one CPU
/// peak, and the small model's prediction took in the large one's steps.
#[test]
fn two_predictions_at_once_each_get_their_own_figures() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let _s = serial();
    memlab::clear_registry();
    /// Whether each of the two threads has begun a step.
    static STEPPING: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    /// A model of `width` and its step. Run as thread `overlap` of two, the
    /// two models are made before either prediction starts and freed after
    /// both end (a recording sees every thread's allocations and frees), and
    /// each step first waits (at most
    /// 300 ms) for the other thread to be in a step too: where predictions
    /// may overlap, they do.
    fn predict(width: i64, overlap: Option<(usize, &std::sync::Barrier)>) -> u64 {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = nn::seq().add(nn::linear(vs.root() / "fc", 256, width, Default::default()));
        let mut sgd = nn::Sgd::default().build(&vs, 1e-3).unwrap();
        let data = Tensor::randn([64, 256], (Kind::Float, tch::Device::Cpu));
        if let Some((_, made)) = overlap {
            made.wait();
        }
        let mut step = || {
            if let Some((me, _)) = overlap {
                STEPPING[me].store(true, Ordering::SeqCst);
                let waited = Instant::now();
                while !STEPPING[1 - me].load(Ordering::SeqCst) && waited.elapsed() < Duration::from_millis(300) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let loss = net.forward(&data).square().mean(Kind::Float);
            sgd.backward_step(&loss);
            Ok(())
        };
        let peak = WillItFit::peaks().of(&vs).max_steps(3).run(&mut step).unwrap().settings[0].peak_reserved;
        // The model is freed once both predictions are done: a free is an
        // event the other's recording would see.
        if let Some((_, both)) = overlap {
            both.wait();
        }
        peak
    }
    let (small, large) = (predict(64, None), predict(8192, None));
    assert!(large > small);
    let made = std::sync::Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = [64, 8192]
        .into_iter()
        .enumerate()
        .map(|(i, width)| {
            let made = made.clone();
            std::thread::spawn(move || predict(width, Some((i, &made))))
        })
        .collect();
    let at_once: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(at_once, [small, large]);
}

/// A setting libtorch refuses is refused before any step runs: the
/// model does not train for it.
#[test]
fn bad_settings_are_refused_before_the_first_step() {
    let _s = serial();
    for bad in [
        "expandable_segments:Maybe",
        "max_split_size_mb:10",
        "garbage_collection_threshold:2",
        "roundup_power2_divisions:3",
        "per_process_memory_fraction:0.5",
        "backend:cudaMallocAsync",
        "release_lock_on_cudamalloc:maybe",
        "no_such_key:1",
    ] {
        let steps = std::cell::Cell::new(0);
        let e = WillItFit::peaks()
            .setting(bad)
            .run(|| {
                steps.set(steps.get() + 1);
                Ok(())
            })
            .unwrap_err();
        assert_eq!(steps.get(), 0, "{bad}: {e}");
        assert!(e.to_string().contains(bad), "{bad}: {e}");
    }
}

/// A step that allocates nothing is predicted: what lives before it and
/// what CUDA adds, said so; no error a library caller cannot act on.
#[test]
fn a_step_that_allocates_nothing_is_predicted_and_said_so() {
    let _s = serial();
    memlab::clear_registry();
    let p = memlab::will_it_fit(80 << 30, || Ok(())).unwrap();
    assert!(matches!(p.settings[0].fit, Some(Fit::Fits { .. })), "{p}");
    assert!(p.to_string().contains("The CPU run made no allocation"), "{p}");
}

/// A prediction asked for inside a step being predicted, on its thread, is
/// refused rather than left waiting on its own turn.
#[test]
fn a_prediction_inside_a_predicted_step_is_refused() {
    let _s = serial();
    let mut inner = None;
    let outer = memlab::will_it_fit(80 << 30, || {
        inner = Some(memlab::will_it_fit(80 << 30, || Ok(())));
        Ok(())
    });
    assert!(outer.is_ok(), "{outer:?}");
    let e = inner.expect("the step ran").unwrap_err().to_string();
    assert!(e.contains("inside the step of another on the same thread"), "{e}");
}
