//! The three training steps memlab's "will it fit" prediction is measured
//! on: an MLP, a conv net and a small transformer, each trained with Adam,
//! each with a CUDA peak above 1 GiB at the batch sizes of the measurement.
//!
//! Runs `--steps` steps of one model at one batch size on one device under a
//! recording, and writes the recording as a memlab snapshot: a CPU run's is
//! what a prediction replays, a CUDA run's what it is checked against. It
//! prints one `FIT` line with the allocator's own peaks over the steps after
//! the second (the steady state: Adam's state appears in the first step).
//!
//!     cargo run --release --example fit_models -- --model mlp --batch 1024 \
//!         --device cpu --out mlp_1024_cpu.pickle
//!
//! `--model` is `mlp`, `conv` or `transformer`; `--device` `cpu` or `cuda`;
//! `--backtraces` records each allocation's call stack. `--search MAX CARD`
//! searches the largest batch up to MAX that fits instead: on CUDA by running
//! two steps a try (set the memory fraction with `PYTORCH_CUDA_ALLOC_CONF`),
//! on the CPU by predicting them for a card of CARD bytes (`Budget::CudaCard`).
//! On CUDA, `--out` then writes the whole search's recording: every try's
//! allocations, the allocator's segment events and its failures, to compare
//! with the prediction at the batch where the search stopped.

use std::error::Error;

use memlab::events::Settings;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// One of the models, ready to take a batch and give its loss.
trait Model {
    /// A batch of `batch` samples: inputs and class labels.
    fn batch(&self, batch: i64, device: Device) -> (Tensor, Tensor);
    /// The loss of a batch.
    fn loss(&self, inputs: &Tensor, labels: &Tensor) -> Tensor;
}

/// Four 4096-wide layers: 64 M parameters.
struct Mlp {
    layers: Vec<nn::Linear>,
    head: nn::Linear,
}

const MLP_WIDTH: i64 = 4096;

impl Mlp {
    fn new(vs: &nn::Path) -> Mlp {
        let layers =
            (0..4).map(|i| nn::linear(vs / format!("fc{i}"), MLP_WIDTH, MLP_WIDTH, Default::default())).collect();
        Mlp { layers, head: nn::linear(vs / "head", MLP_WIDTH, 10, Default::default()) }
    }
}

impl Model for Mlp {
    fn batch(&self, batch: i64, device: Device) -> (Tensor, Tensor) {
        (Tensor::randn([batch, MLP_WIDTH], (Kind::Float, device)), Tensor::randint(10, [batch], (Kind::Int64, device)))
    }

    fn loss(&self, inputs: &Tensor, labels: &Tensor) -> Tensor {
        let hidden = self.layers.iter().fold(inputs.shallow_clone(), |x, layer| layer.forward(&x).relu());
        self.head.forward(&hidden).cross_entropy_for_logits(labels)
    }
}

/// Three 3×3 convolutions (64, 128, 256 channels) with max pooling, on
/// 3×64×64 images, then a linear head.
struct Conv {
    convs: Vec<nn::Conv2D>,
    head: nn::Linear,
}

impl Conv {
    fn new(vs: &nn::Path) -> Conv {
        let padded = nn::ConvConfig { padding: 1, ..Default::default() };
        let channels = [3, 64, 128, 256];
        let convs = channels
            .windows(2)
            .enumerate()
            .map(|(i, c)| nn::conv2d(vs / format!("conv{i}"), c[0], c[1], 3, padded))
            .collect();
        Conv { convs, head: nn::linear(vs / "head", 256 * 8 * 8, 10, Default::default()) }
    }
}

impl Model for Conv {
    fn batch(&self, batch: i64, device: Device) -> (Tensor, Tensor) {
        (Tensor::randn([batch, 3, 64, 64], (Kind::Float, device)), Tensor::randint(10, [batch], (Kind::Int64, device)))
    }

    fn loss(&self, inputs: &Tensor, labels: &Tensor) -> Tensor {
        let features =
            self.convs.iter().fold(inputs.shallow_clone(), |x, conv| conv.forward(&x).relu().max_pool2d_default(2));
        self.head.forward(&features.flatten(1, -1)).cross_entropy_for_logits(labels)
    }
}

/// Four pre-norm transformer blocks, width 512, 8 heads, sequences of 256
/// tokens from a vocabulary of 8,192; attention written out (two matrix
/// products and a softmax), so the CPU and CUDA runs compute the same tensors.
struct Transformer {
    embed: nn::Embedding,
    blocks: Vec<Block>,
    norm: nn::LayerNorm,
    head: nn::Linear,
}

struct Block {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    out: nn::Linear,
    norm2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

const WIDTH: i64 = 512;
const HEADS: i64 = 8;
const SEQUENCE: i64 = 256;
const VOCABULARY: i64 = 8192;

impl Transformer {
    fn new(vs: &nn::Path) -> Transformer {
        let blocks = (0..4)
            .map(|i| {
                let b = vs / format!("block{i}");
                Block {
                    norm1: nn::layer_norm(&b / "norm1", vec![WIDTH], Default::default()),
                    qkv: nn::linear(&b / "qkv", WIDTH, 3 * WIDTH, Default::default()),
                    out: nn::linear(&b / "out", WIDTH, WIDTH, Default::default()),
                    norm2: nn::layer_norm(&b / "norm2", vec![WIDTH], Default::default()),
                    up: nn::linear(&b / "up", WIDTH, 4 * WIDTH, Default::default()),
                    down: nn::linear(&b / "down", 4 * WIDTH, WIDTH, Default::default()),
                }
            })
            .collect();
        Transformer {
            embed: nn::embedding(vs / "embed", VOCABULARY, WIDTH, Default::default()),
            blocks,
            norm: nn::layer_norm(vs / "norm", vec![WIDTH], Default::default()),
            head: nn::linear(vs / "head", WIDTH, VOCABULARY, Default::default()),
        }
    }
}

impl Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (batch, sequence) = (x.size()[0], x.size()[1]);
        let heads = |t: &Tensor| t.view([batch, sequence, HEADS, WIDTH / HEADS]).transpose(1, 2);
        let qkv = self.qkv.forward(&self.norm1.forward(x)).chunk(3, -1);
        let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        let scores = q.matmul(&k.transpose(-2, -1)) / ((WIDTH / HEADS) as f64).sqrt();
        let attended = scores.softmax(-1, Kind::Float).matmul(&v).transpose(1, 2).reshape([batch, sequence, WIDTH]);
        let x = x + self.out.forward(&attended);
        let mlp = self.down.forward(&self.up.forward(&self.norm2.forward(&x)).gelu("none"));
        x + mlp
    }
}

impl Model for Transformer {
    fn batch(&self, batch: i64, device: Device) -> (Tensor, Tensor) {
        let tokens = Tensor::randint(VOCABULARY, [batch, SEQUENCE + 1], (Kind::Int64, device));
        (tokens.narrow(1, 0, SEQUENCE), tokens.narrow(1, 1, SEQUENCE))
    }

    fn loss(&self, inputs: &Tensor, labels: &Tensor) -> Tensor {
        let x = self.blocks.iter().fold(self.embed.forward(inputs), |x, block| block.forward(&x));
        let logits = self.head.forward(&self.norm.forward(&x));
        logits.view([-1, VOCABULARY]).cross_entropy_for_logits(&labels.reshape([-1]))
    }
}

struct Args {
    model: String,
    batch: i64,
    device: Device,
    steps: usize,
    out: Option<String>,
    backtraces: bool,
    search: Option<(usize, u64)>,
}

fn args() -> Result<Args, Box<dyn Error>> {
    let mut args = Args {
        model: "mlp".into(),
        batch: 256,
        device: Device::Cpu,
        steps: 4,
        out: None,
        backtraces: false,
        search: None,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--batch" => args.batch = value()?.parse()?,
            "--steps" => args.steps = value()?.parse()?,
            "--out" => args.out = Some(value()?),
            "--backtraces" => args.backtraces = true,
            "--search" => {
                let max = value()?.parse()?;
                args.search = Some((max, value()?.parse()?));
            }
            "--device" => {
                args.device = match value()?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => return Err(format!("--device is cpu or cuda, not {other}").into()),
                }
            }
            other => return Err(format!("unknown argument {other}; see the example's docs").into()),
        }
    }
    if args.steps < 3 {
        return Err("--steps must be at least 3: the peak is read over the steps after the second".into());
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = args()?;
    let memlab_device = if args.device.is_cuda() { memlab::Device::Cuda(0) } else { memlab::Device::Cpu };
    let recording =
        memlab::Recording::start(Settings::default().capacity(10_000_000).backtraces(args.backtraces).ops(true))?;
    let vs = nn::VarStore::new(args.device);
    let model: Box<dyn Model> = match args.model.as_str() {
        "mlp" => Box::new(Mlp::new(&vs.root())),
        "conv" => Box::new(Conv::new(&vs.root())),
        "transformer" => Box::new(Transformer::new(&vs.root())),
        other => return Err(format!("--model is mlp, conv or transformer, not {other}").into()),
    };
    let mut adam = nn::Adam::default().build(&vs, 1e-4)?;
    if let Some((max, card)) = args.search {
        return search(&*model, &vs, adam, args.device, max, card, args.out.as_deref());
    }
    for step in 0..args.steps {
        if step == 2 {
            memlab::stats::reset_peak_stats(memlab_device)?;
        }
        let (inputs, labels) = model.batch(args.batch, args.device);
        let loss = model.loss(&inputs, &labels);
        adam.backward_step(&loss);
        drop(loss);
    }
    let stats = memlab::stats::device_stats(memlab_device)?;
    println!(
        "FIT model={} batch={} device={} peak_reserved={} peak_allocated={}",
        args.model, args.batch, memlab_device, stats.reserved_bytes.all.peak, stats.allocated_bytes.all.peak
    );
    if args.device.is_cuda() {
        // What the process holds beyond the allocator: the CUDA context and libraries.
        let account = memlab::gpu::where_gpu_memory_went(0)?;
        println!(
            "FIT_DEVICE total={} driver_used={} process_used={} reserved={}",
            account.total,
            account.driver_used,
            account.process_used.map_or(-1, |b| b as i64),
            account.reserved
        );
    }
    if let Some(out) = &args.out {
        memlab::export::Exporter::of(&vs).snapshot()?.write_pickle(out)?;
    }
    drop(recording);
    Ok(())
}

/// The largest batch up to `max` whose step fits: on CUDA by running it
/// (under the memory fraction `PYTORCH_CUDA_ALLOC_CONF` sets), on the CPU by
/// predicting it for a card of `card` bytes. Prints one `SEARCH` line.
fn search(
    model: &dyn Model,
    vs: &nn::VarStore,
    adam: nn::Optimizer,
    device: Device,
    max: usize,
    card: u64,
    out: Option<&str>,
) -> Result<(), Box<dyn Error>> {
    memlab::register_var_store("model", vs);
    let mut adam = memlab::register_optimizer(adam)?;
    // On CUDA a try is two steps: one step after an empty cache can fit
    // where training's next step, which finds the first one's blocks cached,
    // runs out (the transformer at batch 56 under a 4 GiB fraction). On the
    // CPU the prediction runs the steps until their peak is steady itself.
    let steps_per_try = if device.is_cuda() { 2 } else { 1 };
    let step = |batch: usize| -> Result<(), Box<dyn Error>> {
        for _ in 0..steps_per_try {
            let (inputs, labels) = model.batch(batch as i64, device);
            let loss = model.loss(&inputs, &labels);
            adam.backward_step(&loss);
        }
        Ok(())
    };
    let (memlab_device, budget) = match device {
        Device::Cpu => (memlab::Device::Cpu, memlab::Budget::CudaCard(card)),
        _ => (memlab::Device::Cuda(0), memlab::Budget::Bytes(i64::MAX)),
    };
    let found = memlab::find_batch_size(memlab_device, budget, max, step)?;
    let tried: Vec<String> = found
        .tried
        .iter()
        .map(|t| format!("{}:{}", t.batch_size, t.outcome.as_ref().map_or("fail".to_string(), |b| b.to_string())))
        .collect();
    println!("SEARCH device={memlab_device} largest={:?} tried={}", found.largest, tried.join(","));
    if let Some(out) = out.filter(|_| device.is_cuda()) {
        memlab::export::Exporter::of(vs).snapshot()?.write_pickle(out)?;
    }
    Ok(())
}
