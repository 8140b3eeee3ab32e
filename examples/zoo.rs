//! A zoo of the models people train with tch, to measure "will it fit"
//! against: each model's training step at a size (a batch, or for the
//! sequence models a batch of fixed-length sequences), run on CUDA for the
//! allocator's real peaks, or on the CPU for memlab's prediction of them.
//!
//!     cargo run --release --example zoo -- --grid
//!     cargo run --release --example zoo -- --model lstm --size 64 --device cuda
//!     cargo run --release --example zoo -- --model lstm --size 64 --device cpu \
//!         --setting expandable_segments:True
//!
//! `--grid` lists every entry of the measurement, one `MODEL SIZE SETTING`
//! a line; `scripts/zoo.sh` runs them, each in a fresh process, and keeps
//! going from where a file of results stopped. On CUDA the allocator's
//! settings are `PYTORCH_CUDA_ALLOC_CONF`'s, set before the process starts
//! (the script does); `--setting` names them in the output. A run prints one
//! `ZOO {…}` line of JSON: on CUDA the peaks over `--steps` steps (5) from a
//! fresh process, on the CPU the prediction for the setting
//! (`WillItFit::peaks().setting(…)`), with the CPU's thread count.
//! `--out FILE.pickle` also writes the steps' recording as a memlab
//! snapshot (their ops watched): on CUDA, the GPU's own history beside its
//! peaks, which `memlab replay` replays; on the CPU, the steps the
//! prediction ran, with what lived before them (`WillItFit::save`), which
//! `memlab replay --as-cuda` predicts from again without running them.
//! `--threads N` runs the CPU's kernels on N threads (libtorch's default:
//! one a core). `--fraction F` runs the CUDA steps under a memory fraction
//! (given in `PYTORCH_CUDA_ALLOC_CONF` too, as `per_process_memory_fraction`)
//! and says whether they ran out (`scripts/zoo_verdicts.py` checks the
//! predictions' verdicts so).
//!
//! `--search MAX --limit BYTES` searches the largest batch up to MAX whose
//! steps fit under an allocator limit of BYTES instead (`find_batch_size`):
//! on CUDA by running them, two steps a try in one process, under the
//! memory fraction `--fraction` gives; on the CPU by predicting each try
//! for a card of BYTES plus what the prediction puts outside the allocator
//! (`Budget::CudaCard`), under `--setting`, or with `--fraction F --total
//! CARD` for a card of CARD bytes under that memory fraction, as the GPU
//! runs. It prints one `SEARCH {…}` line (`scripts/zoo_searches.py` runs
//! the zoo's); on CUDA `--out` writes the search's history, every try.
//!
//! The models, each with its optimizer: an MLP (Adam); a CNN (SGD with
//! momentum); a ResNet with batch norm (AdamW); a U-Net (transposed
//! convolutions up, skip concatenations, MSE, AdamW); LSTM and GRU language
//! models (one and two layers, the GRU bidirectional; Adam); a transformer
//! encoder and a GPT decoder with `scaled_dot_product_attention` (AdamW), the
//! decoder also with bf16 weights and under `tch::autocast`; a ViT (AdamW);
//! a recommender of large embeddings (BCE, Adam); a VAE (Adam).

use std::error::Error;

use tch::nn::{self, Module, ModuleT, OptimizerConfig, RNN};
use tch::{Device, Kind, Reduction, Tensor};

/// One model's training step.
trait Step {
    /// The loss of a batch of `size` made on `device`.
    fn loss(&self, size: i64, device: Device) -> Tensor;
}

fn linear(vs: &nn::Path, name: &str, i: i64, o: i64) -> nn::Linear {
    nn::linear(vs / name, i, o, Default::default())
}

fn classes(n: i64, size: i64, device: Device) -> Tensor {
    Tensor::randint(n, [size], (Kind::Int64, device))
}

/// Four 2048-wide layers, a head of 10 classes.
struct Mlp(Vec<nn::Linear>);

impl Mlp {
    fn new(vs: &nn::Path) -> Mlp {
        let mut layers: Vec<nn::Linear> = (0..4).map(|i| linear(vs, &format!("fc{i}"), 2048, 2048)).collect();
        layers.push(linear(vs, "head", 2048, 10));
        Mlp(layers)
    }
}

impl Step for Mlp {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let x = Tensor::randn([size, 2048], (Kind::Float, device));
        let last = self.0.len() - 1;
        let h = self.0[..last].iter().fold(x, |x, l| l.forward(&x).relu());
        self.0[last].forward(&h).cross_entropy_for_logits(&classes(10, size, device))
    }
}

/// Two convolutions (32, 64 channels) on 3 × 32 × 32 images, then a linear head.
struct Cnn {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    head: nn::Linear,
}

impl Step for Cnn {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let x = Tensor::randn([size, 3, 32, 32], (Kind::Float, device));
        let h = self.c1.forward(&x).relu().max_pool2d_default(2);
        let h = self.c2.forward(&h).relu().max_pool2d_default(2).flatten(1, -1);
        self.head.forward(&h).cross_entropy_for_logits(&classes(10, size, device))
    }
}

fn conv(vs: &nn::Path, name: &str, i: i64, o: i64, k: i64, stride: i64) -> nn::Conv2D {
    let config = nn::ConvConfig { stride, padding: k / 2, bias: false, ..Default::default() };
    nn::conv2d(vs / name, i, o, k, config)
}

/// A ResNet of 3 stages of two basic blocks (64, 128, 256 channels) with
/// batch norm, on 3 × 64 × 64 images.
struct ResNet {
    stem: (nn::Conv2D, nn::BatchNorm),
    blocks: Vec<Block>,
    head: nn::Linear,
}

struct Block {
    a: (nn::Conv2D, nn::BatchNorm),
    b: (nn::Conv2D, nn::BatchNorm),
    shortcut: Option<(nn::Conv2D, nn::BatchNorm)>,
}

fn conv_bn(vs: &nn::Path, name: &str, i: i64, o: i64, k: i64, stride: i64) -> (nn::Conv2D, nn::BatchNorm) {
    let vs = vs / name;
    (conv(&vs, "conv", i, o, k, stride), nn::batch_norm2d(&vs / "bn", o, Default::default()))
}

impl ResNet {
    fn new(vs: &nn::Path) -> ResNet {
        let mut blocks = Vec::new();
        let mut channels = 64;
        for (stage, out) in [64, 128, 256].into_iter().enumerate() {
            for i in 0..2 {
                let stride = if i == 0 && stage > 0 { 2 } else { 1 };
                let name = format!("s{stage}b{i}");
                let block = vs / name;
                let shortcut =
                    (stride != 1 || channels != out).then(|| conv_bn(&block, "short", channels, out, 1, stride));
                blocks.push(Block {
                    a: conv_bn(&block, "a", channels, out, 3, stride),
                    b: conv_bn(&block, "b", out, out, 3, 1),
                    shortcut,
                });
                channels = out;
            }
        }
        ResNet { stem: conv_bn(vs, "stem", 3, 64, 3, 1), blocks, head: linear(vs, "head", 256, 100) }
    }
}

fn apply(layer: &(nn::Conv2D, nn::BatchNorm), x: &Tensor) -> Tensor {
    layer.1.forward_t(&layer.0.forward(x), true)
}

impl Step for ResNet {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let x = Tensor::randn([size, 3, 64, 64], (Kind::Float, device));
        let mut h = apply(&self.stem, &x).relu();
        for block in &self.blocks {
            let y = apply(&block.b, &apply(&block.a, &h).relu());
            let skip = block.shortcut.as_ref().map_or_else(|| h.shallow_clone(), |s| apply(s, &h));
            h = (y + skip).relu();
        }
        let pooled = h.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
        self.head.forward(&pooled).cross_entropy_for_logits(&classes(100, size, device))
    }
}

/// A two-level U-Net on 3 × 128 × 128 images: 32 and 64 channels down, a
/// transposed convolution up, the skip concatenated, MSE to the input.
struct UNet {
    down1: (nn::Conv2D, nn::Conv2D),
    down2: (nn::Conv2D, nn::Conv2D),
    up: nn::ConvTranspose2D,
    merge: (nn::Conv2D, nn::Conv2D),
    out: nn::Conv2D,
}

impl UNet {
    fn new(vs: &nn::Path) -> UNet {
        let c = |name: &str, i, o| conv(vs, name, i, o, 3, 1);
        let up_config = nn::ConvTransposeConfig { stride: 2, ..Default::default() };
        UNet {
            down1: (c("d1a", 3, 32), c("d1b", 32, 32)),
            down2: (c("d2a", 32, 64), c("d2b", 64, 64)),
            up: nn::conv_transpose2d(vs / "up", 64, 32, 2, up_config),
            merge: (c("m1", 64, 32), c("m2", 32, 32)),
            out: conv(vs, "out", 32, 3, 1, 1),
        }
    }
}

impl Step for UNet {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let x = Tensor::randn([size, 3, 128, 128], (Kind::Float, device));
        let two = |p: &(nn::Conv2D, nn::Conv2D), x: &Tensor| p.1.forward(&p.0.forward(x).relu()).relu();
        let skip = two(&self.down1, &x);
        let deep = two(&self.down2, &skip.max_pool2d_default(2));
        let merged = Tensor::cat(&[self.up.forward(&deep), skip], 1);
        self.out.forward(&two(&self.merge, &merged)).mse_loss(&x, Reduction::Mean)
    }
}

const VOCABULARY: i64 = 8192;

/// A recurrent language model: embedding 8,192 × 256, the recurrent layers,
/// a head to the vocabulary, 64 tokens a sequence.
struct Recurrent<R: RNN> {
    embed: nn::Embedding,
    rnn: R,
    head: nn::Linear,
}

impl<R: RNN> Step for Recurrent<R> {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let tokens = Tensor::randint(VOCABULARY, [size, 65], (Kind::Int64, device));
        let (output, _) = self.rnn.seq(&self.embed.forward(&tokens.narrow(1, 0, 64)));
        let logits = self.head.forward(&output);
        logits.view([-1, VOCABULARY]).cross_entropy_for_logits(&tokens.narrow(1, 1, 64).reshape([-1]))
    }
}

fn embedding(vs: &nn::Path, name: &str, rows: i64, width: i64) -> nn::Embedding {
    nn::embedding(vs / name, rows, width, Default::default())
}

fn rnn_config(layers: i64, bidirectional: bool) -> nn::RNNConfig {
    nn::RNNConfig { num_layers: layers, bidirectional, batch_first: true, ..Default::default() }
}

/// A pre-norm transformer block with `scaled_dot_product_attention`.
struct Attention {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    out: nn::Linear,
    norm2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    heads: i64,
    causal: bool,
}

impl Attention {
    fn new(vs: &nn::Path, width: i64, heads: i64, causal: bool) -> Attention {
        let norm = |name: &str| nn::layer_norm(vs / name, vec![width], Default::default());
        Attention {
            norm1: norm("norm1"),
            qkv: linear(vs, "qkv", width, 3 * width),
            out: linear(vs, "out", width, width),
            norm2: norm("norm2"),
            up: linear(vs, "up", width, 4 * width),
            down: linear(vs, "down", 4 * width, width),
            heads,
            causal,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (batch, tokens, width) = x.size3().expect("batch, tokens, width");
        let heads = |t: Tensor| t.view([batch, tokens, self.heads, width / self.heads]).transpose(1, 2);
        let qkv = self.qkv.forward(&self.norm1.forward(x)).chunk(3, -1);
        let (q, k, v) = (heads(qkv[0].shallow_clone()), heads(qkv[1].shallow_clone()), heads(qkv[2].shallow_clone()));
        let attended = Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, 0.0, self.causal, None, false);
        let x = x + self.out.forward(&attended.transpose(1, 2).reshape([batch, tokens, width]));
        let mlp = self.down.forward(&self.up.forward(&self.norm2.forward(&x)).gelu("none"));
        x + mlp
    }
}

/// A stack of attention blocks over embedded tokens or patches.
struct Transformer {
    embed: Box<dyn Fn(i64, Device) -> (Tensor, Tensor)>,
    blocks: Vec<Attention>,
    norm: nn::LayerNorm,
    head: nn::Linear,
    /// A classification of the first token (encoder, ViT) or the next
    /// token everywhere (decoder).
    per_token: bool,
    autocast: bool,
}

impl Transformer {
    fn stack(vs: &nn::Path, layers: i64, width: i64, heads: i64, causal: bool) -> Vec<Attention> {
        (0..layers).map(|i| Attention::new(&(vs / format!("block{i}")), width, heads, causal)).collect()
    }
}

impl Step for Transformer {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let step = || {
            let (x, labels) = (self.embed)(size, device);
            let x = self.blocks.iter().fold(x, |x, b| b.forward(&x));
            let x = self.norm.forward(&x);
            if self.per_token {
                let logits = self.head.forward(&x);
                let classes = logits.size()[2];
                logits.view([-1, classes]).to_kind(Kind::Float).cross_entropy_for_logits(&labels.reshape([-1]))
            } else {
                self.head.forward(&x.select(1, 0)).to_kind(Kind::Float).cross_entropy_for_logits(&labels)
            }
        };
        if self.autocast {
            tch::autocast(true, step)
        } else {
            step()
        }
    }
}

/// A GPT-style decoder: 4 pre-norm blocks of width 512, 8 heads, causal,
/// GELU MLP ×4, a head to 8,192 tokens, 512 tokens a sequence.
fn decoder(vs: &nn::Path, kind: Kind, autocast: bool) -> Transformer {
    let tokens = embedding(vs, "tokens", VOCABULARY, 512);
    let positions = embedding(vs, "positions", 512, 512);
    let embed = move |size: i64, device: Device| {
        let t = Tensor::randint(VOCABULARY, [size, 513], (Kind::Int64, device));
        let position = Tensor::arange(512, (Kind::Int64, device));
        let x = tokens.forward(&t.narrow(1, 0, 512)) + positions.forward(&position);
        (x.to_kind(kind), t.narrow(1, 1, 512))
    };
    Transformer {
        embed: Box::new(embed),
        blocks: Transformer::stack(vs, 4, 512, 8, true),
        norm: nn::layer_norm(vs / "norm", vec![512], Default::default()),
        head: linear(vs, "head", 512, VOCABULARY),
        per_token: true,
        autocast,
    }
}

/// A transformer encoder: 4 blocks of width 256, 4 heads, over 128 tokens
/// of a vocabulary of 8,192, classifying the first token into 10 classes.
fn encoder(vs: &nn::Path) -> Transformer {
    let tokens = embedding(vs, "tokens", VOCABULARY, 256);
    let embed = move |size: i64, device: Device| {
        let t = Tensor::randint(VOCABULARY, [size, 128], (Kind::Int64, device));
        (tokens.forward(&t), classes(10, size, device))
    };
    Transformer {
        embed: Box::new(embed),
        blocks: Transformer::stack(vs, 4, 256, 4, false),
        norm: nn::layer_norm(vs / "norm", vec![256], Default::default()),
        head: linear(vs, "head", 256, 10),
        per_token: false,
        autocast: false,
    }
}

/// A ViT on 3 × 64 × 64 images: 8 × 8 patches (64 tokens, and a class
/// token), 6 blocks of width 384, 6 heads, 100 classes.
fn vit(vs: &nn::Path) -> Transformer {
    let patches = nn::conv2d(vs / "patches", 3, 384, 8, nn::ConvConfig { stride: 8, ..Default::default() });
    let token = vs.zeros("class_token", &[1, 1, 384]);
    let embed = move |size: i64, device: Device| {
        let images = Tensor::randn([size, 3, 64, 64], (Kind::Float, device));
        let x = patches.forward(&images).flatten(2, -1).transpose(1, 2);
        (Tensor::cat(&[token.expand([size, 1, 384], false), x], 1), classes(100, size, device))
    };
    Transformer {
        embed: Box::new(embed),
        blocks: Transformer::stack(vs, 6, 384, 6, false),
        norm: nn::layer_norm(vs / "norm", vec![384], Default::default()),
        head: linear(vs, "head", 384, 100),
        per_token: false,
        autocast: false,
    }
}

/// Four embedding tables of 200,000 × 64, an MLP, a click's BCE.
struct Recommender {
    tables: Vec<nn::Embedding>,
    mlp: (nn::Linear, nn::Linear, nn::Linear),
}

impl Step for Recommender {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let ids = |t: &nn::Embedding| t.forward(&Tensor::randint(200_000, [size], (Kind::Int64, device)));
        let x = Tensor::cat(&self.tables.iter().map(ids).collect::<Vec<_>>(), 1);
        let h = self.mlp.1.forward(&self.mlp.0.forward(&x).relu()).relu();
        let logit = self.mlp.2.forward(&h).squeeze_dim(1);
        let clicked = Tensor::randint(2, [size], (Kind::Float, device));
        logit.binary_cross_entropy_with_logits::<Tensor>(&clicked, None, None, Reduction::Mean)
    }
}

/// A VAE on 784-pixel images: 512 → latent 32 → 512 → 784, BCE and KL.
struct Vae {
    enc: nn::Linear,
    mu: nn::Linear,
    logvar: nn::Linear,
    dec: (nn::Linear, nn::Linear),
}

impl Step for Vae {
    fn loss(&self, size: i64, device: Device) -> Tensor {
        let x = Tensor::rand([size, 784], (Kind::Float, device));
        let h = self.enc.forward(&x).relu();
        let (mu, logvar) = (self.mu.forward(&h), self.logvar.forward(&h));
        let z = &mu + Tensor::randn_like(&mu) * (&logvar * 0.5).exp();
        let logits = self.dec.1.forward(&self.dec.0.forward(&z).relu());
        let bce = logits.binary_cross_entropy_with_logits::<Tensor>(&x, None, None, Reduction::Sum);
        let kl = (&logvar + 1.0 - mu.square() - logvar.exp()).sum(Kind::Float) * -0.5;
        (bce + kl) / size as f64
    }
}

/// The optimizer a model trains with, and its learning rate.
enum Optimizer {
    Adam(f64),
    AdamW(f64),
    SgdMomentum(f64),
}

/// Builds `model` on `vs` and its optimizer.
fn build(model: &str, vs: &mut nn::VarStore) -> Result<(Box<dyn Step>, nn::Optimizer), Box<dyn Error>> {
    let root = vs.root();
    let recurrent =
        |rnn_out: i64| (embedding(&root, "embed", VOCABULARY, 256), linear(&root, "head", rnn_out, VOCABULARY));
    let (step, optimizer): (Box<dyn Step>, Optimizer) = match model {
        "mlp" => (Box::new(Mlp::new(&root)), Optimizer::Adam(1e-4)),
        "cnn" => {
            let c = |name: &str, i, o| {
                nn::conv2d(&root / name, i, o, 3, nn::ConvConfig { padding: 1, ..Default::default() })
            };
            let cnn = Cnn { c1: c("c1", 3, 32), c2: c("c2", 32, 64), head: linear(&root, "head", 64 * 8 * 8, 10) };
            (Box::new(cnn), Optimizer::SgdMomentum(1e-2))
        }
        "resnet" => (Box::new(ResNet::new(&root)), Optimizer::AdamW(1e-3)),
        "unet" => (Box::new(UNet::new(&root)), Optimizer::AdamW(1e-3)),
        "lstm" | "lstm2" => {
            let layers = if model == "lstm" { 1 } else { 2 };
            let rnn = nn::lstm(&root / "lstm", 256, 512, rnn_config(layers, false));
            let (embed, head) = recurrent(512);
            (Box::new(Recurrent { embed, rnn, head }), Optimizer::Adam(1e-3))
        }
        "gru" => {
            let rnn = nn::gru(&root / "gru", 256, 384, rnn_config(2, true));
            let (embed, head) = recurrent(768);
            (Box::new(Recurrent { embed, rnn, head }), Optimizer::Adam(1e-3))
        }
        "encoder" => (Box::new(encoder(&root)), Optimizer::AdamW(1e-4)),
        "gpt" => (Box::new(decoder(&root, Kind::Float, false)), Optimizer::AdamW(1e-4)),
        "gpt-bf16" => (Box::new(decoder(&root, Kind::BFloat16, false)), Optimizer::AdamW(1e-4)),
        "gpt-autocast" => (Box::new(decoder(&root, Kind::Float, true)), Optimizer::AdamW(1e-4)),
        "vit" => (Box::new(vit(&root)), Optimizer::AdamW(1e-4)),
        "recommender" => {
            let tables = (0..4).map(|i| embedding(&root, &format!("table{i}"), 200_000, 64)).collect();
            let mlp = (linear(&root, "fc1", 256, 256), linear(&root, "fc2", 256, 64), linear(&root, "out", 64, 1));
            (Box::new(Recommender { tables, mlp }), Optimizer::Adam(1e-3))
        }
        "vae" => {
            let vae = Vae {
                enc: linear(&root, "enc", 784, 512),
                mu: linear(&root, "mu", 512, 32),
                logvar: linear(&root, "logvar", 512, 32),
                dec: (linear(&root, "dec1", 32, 512), linear(&root, "dec2", 512, 784)),
            };
            (Box::new(vae), Optimizer::Adam(1e-3))
        }
        other => return Err(format!("no model {other}: see --grid").into()),
    };
    if model == "gpt-bf16" {
        vs.bfloat16();
    }
    let optimizer = match optimizer {
        Optimizer::Adam(lr) => nn::Adam::default().build(vs, lr)?,
        Optimizer::AdamW(lr) => nn::AdamW::default().build(vs, lr)?,
        Optimizer::SgdMomentum(lr) => nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, lr)?,
    };
    Ok((step, optimizer))
}

/// Every entry of the measurement: model, sizes, and whether it is also
/// measured under `max_split_size_mb:128`.
const GRID: &[(&str, [i64; 3], bool)] = &[
    ("mlp", [1024, 4096, 16384], false),
    ("cnn", [512, 2048, 8192], true),
    ("resnet", [32, 64, 128], true),
    ("unet", [8, 16, 32], true),
    ("lstm", [32, 64, 128], false),
    ("lstm2", [32, 64, 128], false),
    ("gru", [16, 32, 64], true),
    ("encoder", [32, 64, 128], false),
    ("gpt", [4, 8, 16], true),
    ("gpt-bf16", [4, 8, 16], false),
    ("gpt-autocast", [4, 8, 16], false),
    ("vit", [32, 64, 128], false),
    ("recommender", [2048, 8192, 32768], true),
    ("vae", [256, 1024, 4096], false),
];

const SETTINGS: [&str; 2] = ["default", "expandable_segments:True"];
const THIRD: &str = "max_split_size_mb:128";

struct Args {
    model: String,
    size: i64,
    device: Device,
    setting: String,
    steps: usize,
    out: Option<String>,
    threads: Option<i32>,
    fraction: Option<String>,
    search: Option<usize>,
    limit: Option<u64>,
    total: Option<u64>,
}

fn args() -> Result<Option<Args>, Box<dyn Error>> {
    let mut args = Args {
        model: String::new(),
        size: 0,
        device: Device::Cpu,
        setting: "default".into(),
        steps: 5,
        out: None,
        threads: None,
        fraction: None,
        search: None,
        limit: None,
        total: None,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--grid" => {
                for (model, sizes, third) in GRID {
                    for size in sizes {
                        for setting in SETTINGS.iter().chain(third.then_some(&THIRD)) {
                            println!("{model} {size} {setting}");
                        }
                    }
                }
                return Ok(None);
            }
            "--model" => args.model = value()?,
            "--size" => args.size = value()?.parse()?,
            "--setting" => args.setting = value()?,
            "--steps" => args.steps = value()?.parse()?,
            "--out" => args.out = Some(value()?),
            "--threads" => args.threads = Some(value()?.parse()?),
            "--fraction" => args.fraction = Some(value()?),
            "--search" => args.search = Some(value()?.parse()?),
            "--limit" => args.limit = Some(value()?.parse()?),
            "--total" => args.total = Some(value()?.parse()?),
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
    if args.model.is_empty() || (args.size <= 0 && args.search.is_none()) {
        return Err("give --model NAME --size N, --model NAME --search MAX --limit BYTES, or --grid".into());
    }
    if args.search.is_some() && args.limit.is_none() {
        return Err("--search MAX needs --limit BYTES, the allocator's limit".into());
    }
    if args.search.is_some() && args.device.is_cuda() && args.fraction.is_none() {
        return Err(
            "--search on CUDA runs under a memory fraction: give --fraction F (BYTES of the device's total)".into()
        );
    }
    Ok(Some(args))
}

/// The largest batch up to `max` whose steps fit under the allocator's
/// `limit`: on CUDA by running two steps a try in this process (under the
/// memory fraction and setting `PYTORCH_CUDA_ALLOC_CONF` sets), on the CPU
/// by predicting each try for a card of `limit` and what the prediction
/// puts outside the allocator (`Budget::CudaCard`), under `--setting`, or
/// for a card of `--total` under the memory fraction `--fraction`.
/// Prints one `SEARCH {…}` line of JSON.
fn search(
    args: &Args,
    vs: &nn::VarStore,
    model: &dyn Step,
    optimizer: nn::Optimizer,
    construction: Option<memlab::export::Construction>,
    max: usize,
    limit: u64,
) -> Result<(), Box<dyn Error>> {
    memlab::register_var_store("model", vs);
    let mut optimizer = memlab::register_optimizer(optimizer)?;
    let cuda = args.device.is_cuda();
    // On CUDA a try is two steps: the second finds the first's blocks
    // cached, as training does. The prediction runs its own steps.
    let steps = if cuda { 2 } else { 1 };
    let step = |batch: usize| -> Result<(), Box<dyn Error>> {
        for _ in 0..steps {
            optimizer.backward_step(&model.loss(batch as i64, args.device));
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    // The card, and the settings with the memory fraction where one is of it.
    let (card, setting) = match (&args.fraction, args.total) {
        (Some(fraction), Some(total)) if !cuda => {
            let fraction = format!("per_process_memory_fraction:{fraction}");
            let setting = match args.setting.as_str() {
                "default" => fraction,
                setting => format!("{setting},{fraction}"),
            };
            (total, setting)
        }
        _ => (limit + memlab::replay::CudaAdditions::default().outside_allocator, args.setting.clone()),
    };
    let found = if cuda {
        memlab::find_batch_size(memlab::Device::Cuda(0), memlab::Budget::Bytes(i64::MAX), max, step)?
    } else {
        let mut search = memlab::BatchSizeSearch::new(memlab::Device::Cpu, memlab::Budget::CudaCard(card));
        if let Some(construction) = construction {
            search = search.construction(construction);
        }
        if setting != "default" {
            search = search.setting(setting);
        }
        if args.model == "gpt-autocast" {
            search = search.autocast(Kind::Half);
        }
        search.run(max, step)?
    };
    let tried: Vec<serde_json::Value> = found
        .tried
        .iter()
        // A GPU try fits where it ran; a predicted one where it needs no
        // more than the card.
        .map(|t| serde_json::json!([t.batch_size, t.outcome.as_ref().is_ok_and(|&need| cuda || need <= card as i64)]))
        .collect();
    let line = serde_json::json!({
        "model": args.model, "setting": args.setting, "limit": limit, "max": max,
        "device": if cuda { "cuda" } else { "cpu" }, "threads": tch::get_num_threads(),
        "largest": found.largest, "largest_giving_cache_back": found.largest_giving_cache_back,
        "tried": tried, "seconds": started.elapsed().as_secs_f64(),
    });
    println!("SEARCH {line}");
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let Some(args) = args()? else { return Ok(()) };
    if let Some(threads) = args.threads {
        tch::set_num_threads(threads);
    }
    // With --out, the CUDA run is recorded from before the model is made
    // (ops watched, no stacks) and its snapshot written there: what CUDA
    // allocated, event by event, the model's construction included, to set
    // beside the CPU run's.
    let recording = match &args.out {
        Some(_) if args.device.is_cuda() => {
            Some(memlab::Recording::start(memlab::events::Settings::default().capacity(10_000_000).ops(true))?)
        }
        _ => None,
    };
    // On the CPU, the model's construction is recorded for the prediction,
    // which makes the weights as a CUDA run does.
    let made = |device| -> Result<_, memlab::Error> {
        let mut vs = nn::VarStore::new(device);
        let (model, optimizer) =
            build(&args.model, &mut vs).map_err(|e| memlab::Error::InvalidArgument(e.to_string()))?;
        Ok((vs, model, optimizer))
    };
    let ((vs, model, mut optimizer), construction) = if args.device.is_cuda() {
        (made(args.device)?, None)
    } else {
        let (built, construction) = memlab::record_construction(|| made(args.device))?;
        (built, Some(construction))
    };
    if args.device.is_cuda() {
        let conf = std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default();
        let setting = (args.setting != "default").then_some(args.setting.clone());
        let fraction = args.fraction.as_ref().map(|f| format!("per_process_memory_fraction:{f}"));
        let expected = setting.into_iter().chain(fraction).collect::<Vec<_>>().join(",");
        if conf != expected {
            return Err(format!(
                "--setting {} but PYTORCH_CUDA_ALLOC_CONF={conf:?}: set {expected:?} before the process starts",
                args.setting
            )
            .into());
        }
    }
    if let (Some(max), Some(limit)) = (args.search, args.limit) {
        search(&args, &vs, &*model, optimizer, construction, max, limit)?;
        // The search's own history on CUDA, every try in order.
        if let (Some(out), Some(recording)) = (&args.out, recording) {
            memlab::export::Exporter::of(&vs).snapshot()?.write_pickle(out)?;
            drop(recording);
        }
        return Ok(());
    }
    let mut line = serde_json::json!({
        "model": args.model, "size": args.size, "setting": args.setting,
        "device": if args.device.is_cuda() { "cuda" } else { "cpu" },
        "threads": tch::get_num_threads(),
    });
    if args.device.is_cuda() {
        // Under a memory fraction the steps may run out: tch panics with
        // libtorch's error, which says so.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for _ in 0..args.steps {
                optimizer.backward_step(&model.loss(args.size, args.device));
            }
        }));
        if let Some(fraction) = &args.fraction {
            line["fraction"] = fraction.clone().into();
            line["oom"] = ran.is_err().into();
        } else if let Err(panic) = ran {
            std::panic::resume_unwind(panic);
        }
        let stats = memlab::stats::device_stats(memlab::Device::Cuda(0))?;
        line["peak_reserved"] = stats.reserved_bytes.all.peak.into();
        line["peak_allocated"] = stats.allocated_bytes.all.peak.into();
        // What the process holds outside the allocator: the driver's count
        // of its memory less what the allocator reserves.
        let account = memlab::where_gpu_memory_went(0).ok();
        if let Some((used, reserved)) = account.and_then(|a| Some((a.process_used?, a.reserved))) {
            line["outside_allocator"] = (used as i64 - reserved).into();
        }
    } else {
        memlab::register_var_store("model", &vs);
        let mut optimizer = memlab::register_optimizer(optimizer)?;
        let mut fit = memlab::WillItFit::peaks();
        if let Some(construction) = construction {
            fit = fit.construction(construction);
        }
        // The decoder's forward pass runs under tch::autocast, which on CUDA
        // casts to halves.
        if args.model == "gpt-autocast" {
            fit = fit.autocast(Kind::Half);
        }
        if args.setting != "default" {
            fit = fit.setting(args.setting.clone());
        }
        if let Some(out) = &args.out {
            fit = fit.save(out);
        }
        let started = std::time::Instant::now();
        let predicted = fit.run(|| {
            optimizer.backward_step(&model.loss(args.size, args.device));
            Ok(())
        })?;
        // The defaults come first, then the setting asked for.
        let setting = if args.setting == "default" { predicted.settings.first() } else { predicted.settings.get(1) };
        let setting = setting.ok_or("the prediction has no such setting")?;
        line["predicted_settings"] = setting.settings.clone().into();
        line["predicted_reserved"] = setting.peak_reserved.into();
        line["predicted_allocated"] = setting.peak_allocated.into();
        if let Some(range) = setting.range {
            line["predicted_low"] = range.low.reserved.into();
            line["predicted_high"] = range.high.reserved.into();
            line["unmodelled"] = predicted.unmodelled.iter().map(|u| u.name.clone()).collect::<Vec<_>>().into();
        }
        line["seconds"] = started.elapsed().as_secs_f64().into();
    }
    if let (Some(out), Some(recording)) = (&args.out, recording) {
        memlab::export::Exporter::of(&vs).snapshot()?.write_pickle(out)?;
        drop(recording);
    }
    println!("ZOO {line}");
    Ok(())
}
