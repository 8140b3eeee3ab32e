//! Measures what cuDNN's convolutions allocate as workspaces on this GPU,
//! beside memlab's estimate of them: the figures behind the estimate
//! `memlab replay --as-cuda` and `memlab::will_it_fit` use
//! (`memlab::replay::cudnn_workspaces`). Each convolution runs forward and
//! backward (input, weight and bias gradients) under a recording that
//! watches its ops; what each op allocated and freed before it ended is its
//! workspace. Prints one row per op, and `--json` one object per op.
//! `--transposed` runs each shape as a transposed convolution instead (the
//! shape's output channels in, its input channels out) and prints, as JSON,
//! what every op allocated: what memlab's table calls not modelled yet.
//! `--grid` measures the shapes of common convolutional networks (channels
//! 3 to 2,048, sizes 7 to 224, kernels 1, 3 and 7, strides 1 and 2, and
//! decoders' transposed convolutions, at batches 4 to 8,192) one pass at a
//! time, the forward pass, the input's gradient and
//! the weight's each alone, and prints a JSON line of each shape's
//! workspaces: the table memlab's estimate reads
//! (`fixtures/cudnn/convolution_h200.jsonl`). `--grid heads` measures only
//! the heads of networks that make images (a U-Net's, an autoencoder's): 1 × 1
//! convolutions from 16 to 128 channels down to 1 or 3, at sizes 32 to 256.
//! `--grid dense` measures the convolutions of the zoo's image models
//! (`examples/zoo.rs`: the ResNet, the U-Net, the ViT's patches) at every
//! batch from 1 to 256, where cuDNN's choice of algorithm changes between
//! the powers of 2 (`fixtures/cudnn/convolution_dense_h200.jsonl`).
//!
//!     cargo run --release --example cudnn_workspaces [-- --json | --transposed | --grid [heads | dense]]
//!
//! Needs a CUDA device.

use std::error::Error;

use memlab::events::{Action, Settings};
use memlab::export::TraceEntry;
use memlab::replay::{cudnn_workspaces, reduction_staging, scratch_of_ops, Libtorch, Op, OpRecord, ReductionDevice};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Batch, input channels, output channels, height (= width), kernel, stride.
const SHAPES: &[(i64, i64, i64, i64, i64, i64)] = &[
    // The conv net of examples/fit_models.rs, at batches 256 and 512.
    (256, 3, 64, 64, 3, 1),
    (256, 64, 128, 32, 3, 1),
    (256, 128, 256, 16, 3, 1),
    (512, 3, 64, 64, 3, 1),
    (512, 64, 128, 32, 3, 1),
    (512, 128, 256, 16, 3, 1),
    // Others: channels, sizes, kernels and strides around them.
    (64, 4, 64, 64, 3, 1),
    (64, 8, 64, 64, 3, 1),
    (64, 16, 64, 64, 3, 1),
    (64, 32, 32, 64, 3, 1),
    (64, 64, 64, 56, 3, 1),
    (64, 64, 64, 56, 1, 1),
    (64, 64, 256, 56, 1, 1),
    (64, 128, 128, 28, 3, 1),
    (64, 128, 256, 28, 3, 2),
    (64, 256, 256, 14, 3, 1),
    (64, 256, 512, 14, 1, 1),
    (64, 512, 512, 7, 3, 1),
    (128, 64, 128, 32, 3, 1),
    (128, 128, 64, 32, 3, 1),
    (128, 256, 128, 16, 3, 1),
    (32, 96, 96, 64, 3, 1),
    (32, 3, 32, 224, 7, 2),
    (16, 64, 64, 128, 5, 1),
];

fn main() -> Result<(), Box<dyn Error>> {
    let json = std::env::args().any(|a| a == "--json");
    if !tch::Cuda::is_available() {
        return Err("cudnn_workspaces measures cuDNN: it needs a CUDA device".into());
    }
    let device = Device::Cuda(0);
    if !json {
        println!(
            "{:>4} {:>4} {:>4} {:>4} {:>2} {:>2}  {:<9} {:>12} {:>12} {:>12} {:>12}  measured / estimated workspaces",
            "N", "Cin", "Cout", "H", "k", "s", "op", "input", "weight", "output", "in+out+w"
        );
    }
    if std::env::args().any(|a| a == "--transposed") {
        return transposed(device);
    }
    if std::env::args().any(|a| a == "--grid") {
        let heads = std::env::args().any(|a| a == "heads");
        let dense = std::env::args().any(|a| a == "dense");
        return grid(device, heads, dense);
    }
    for &(n, c_in, c_out, h, k, s) in SHAPES {
        let vs = nn::VarStore::new(device);
        let config = nn::ConvConfig { stride: s, padding: k / 2, ..Default::default() };
        let conv = nn::conv2d(vs.root() / "conv", c_in, c_out, k, config);
        let input = Tensor::randn([n, c_in, h, h], (Kind::Float, device)).set_requires_grad(true);
        let (trace, ops) = recorded(&vs, || conv.forward(&input).sum(Kind::Float).backward())?;
        for (record, scratch) in scratch_of_ops(&trace, &ops) {
            if let Op::Reduction(r) = &record.op {
                // The bias gradient's sum: its staging buffer, measured and modelled.
                let modelled = reduction_staging(r, ReductionDevice::H100);
                if json {
                    let row = serde_json::json!({
                        "n": n, "c_in": c_in, "c_out": c_out, "h": h, "k": k, "stride": s, "op": "sum",
                        "shape": r.shape, "measured": scratch, "modelled": modelled,
                    });
                    println!("{row}");
                } else {
                    println!(
                        "{n:>4} {c_in:>4} {c_out:>4} {h:>4} {k:>2} {s:>2}  sum {:?}: {scratch:?} / {modelled:?}",
                        r.shape
                    );
                }
                continue;
            }
            let Op::Convolution(c) = &record.op else { continue };
            let (i, w, o) = c.bytes();
            let estimate: Vec<u64> = cudnn_workspaces(c, Libtorch::V2_11).into_iter().map(|w| w.bytes).collect();
            let op = if c.backward { "backward" } else { "forward" };
            if json {
                let row = serde_json::json!({
                    "n": n, "c_in": c_in, "c_out": c_out, "h": h, "k": k, "stride": s, "op": op,
                    "input": i, "weight": w, "output": o, "measured": scratch, "estimated": estimate,
                });
                println!("{row}");
            } else {
                println!(
                    "{n:>4} {c_in:>4} {c_out:>4} {h:>4} {k:>2} {s:>2}  {op:<9} {i:>12} {w:>12} {o:>12} {:>12}  {scratch:?} / {estimate:?}",
                    i + o + w
                );
            }
        }
    }
    Ok(())
}

/// Each shape as a transposed convolution (and the U-Net's of
/// `examples/zoo.rs`: 64 to 32 channels, kernel 2, stride 2, at batches 8 to
/// 32): every op's allocations, each with whether the op freed it.
fn transposed(device: Device) -> Result<(), Box<dyn Error>> {
    let unet = [8, 16, 32].map(|n| (n, 32, 64, 64, 2, 2));
    for &(n, c_out, c_in, h, k, s) in SHAPES.iter().chain(unet.iter()) {
        let vs = nn::VarStore::new(device);
        let padding = if k == 2 { 0 } else { k / 2 };
        let config = nn::ConvTransposeConfig { stride: s, padding, output_padding: s - 1, ..Default::default() };
        let conv = nn::conv_transpose2d(vs.root() / "conv", c_in, c_out, k, config);
        let input = Tensor::randn([n, c_in, h, h], (Kind::Float, device)).set_requires_grad(true);
        let (trace, ops) = recorded(&vs, || conv.forward(&input).sum(Kind::Float).backward())?;
        let mut per_op = Vec::new();
        for r in &ops {
            let allocations: Vec<(u64, bool)> = allocated_in(&trace, r);
            if !allocations.is_empty() {
                per_op.push(serde_json::json!({ "op": r.name, "allocations": allocations }));
            }
        }
        let row = serde_json::json!({
            "n": n, "c_in": c_in, "c_out": c_out, "h": h, "k": k, "stride": s, "ops": per_op,
        });
        println!("{row}");
    }
    Ok(())
}

/// The shapes of `--grid`: (input channels, output channels, size, kernel,
/// stride), each at the batches whose input and output fit 3 GiB.
fn grid_shapes() -> Vec<(i64, i64, i64, i64, i64)> {
    #[rustfmt::skip]
    let pairs = [
        (3, 16), (3, 32), (3, 64), (16, 16), (16, 32), (32, 32), (32, 64), (64, 64), (64, 128), (128, 128),
        (128, 256), (256, 256), (256, 512), (512, 512), (64, 32), (128, 64), (256, 128), (512, 256), (64, 256),
        (256, 64), (128, 512), (512, 128), (256, 1024), (1024, 256), (512, 2048), (2048, 512),
    ];
    let mut shapes = Vec::new();
    for h in [32, 16, 64, 8, 28, 14, 56, 7, 128, 112, 224] {
        for &(c_in, c_out) in &pairs {
            for (k, s) in [(3, 1), (1, 1), (3, 2), (1, 2), (7, 2)] {
                // The stems' 7 × 7 from 3 channels at 112 and up only, and
                // from 3 channels nothing else there; 1 × 1 where the input
                // has 64 channels or more, or as many as the output.
                let stem = k == 7;
                if stem != (c_in == 3 && h >= 112) && (stem || c_in == 3) {
                    continue;
                }
                if k == 1 && c_in < 64.min(c_out) {
                    continue;
                }
                shapes.push((c_in, c_out, h, k, s));
            }
        }
    }
    shapes
}

/// The heads of `--grid`, which `--grid heads` measures alone: the 1 × 1
/// convolutions that end networks making images, down to 1 or 3 channels
/// (input channels, output channels, size, kernel, stride).
fn grid_heads() -> Vec<(i64, i64, i64, i64, i64)> {
    let mut shapes = Vec::new();
    for h in [32, 64, 128, 256] {
        for c_in in [16, 32, 64, 128] {
            for c_out in [1, 3] {
                shapes.push((c_in, c_out, h, 1, 1));
            }
        }
    }
    shapes
}

/// The transposed shapes of `--grid`, as decoders upsample: (input
/// channels, output channels, size, kernel, stride, padding, output
/// padding).
fn grid_transposed() -> Vec<(i64, i64, i64, i64, i64, i64, i64)> {
    let pairs = [(64, 32), (128, 64), (256, 128), (512, 256), (1024, 512), (32, 16), (32, 32), (64, 64), (128, 128)];
    let mut shapes = Vec::new();
    for h in [32, 16, 64, 8, 128, 4] {
        for &(c_in, c_out) in &pairs {
            for (k, s, p, op) in [(2, 2, 0, 0), (4, 2, 1, 0), (3, 2, 1, 1), (3, 1, 1, 0)] {
                shapes.push((c_in, c_out, h, k, s, p, op));
            }
        }
    }
    shapes
}

/// A convolution of `--grid`: input channels, output channels, size,
/// kernel, stride, padding, output padding, transposed.
type Shape = (i64, i64, i64, i64, i64, i64, i64, bool);

/// The convolutions of `examples/zoo.rs`'s image models whose searches
/// stay below batch 256 (the ResNet, the U-Net, the ViT's patches), as
/// `--grid dense` measures them.
#[rustfmt::skip]
const ZOO_SHAPES: &[Shape] = &[
    // The ResNet on 64 × 64.
    (3, 64, 64, 3, 1, 1, 0, false), (64, 64, 64, 3, 1, 1, 0, false), (64, 128, 64, 3, 2, 1, 0, false),
    (64, 128, 64, 1, 2, 0, 0, false), (128, 128, 32, 3, 1, 1, 0, false), (128, 256, 32, 3, 2, 1, 0, false),
    (128, 256, 32, 1, 2, 0, 0, false), (256, 256, 16, 3, 1, 1, 0, false),
    // The U-Net on 128 × 128, its transposed convolution up.
    (3, 32, 128, 3, 1, 1, 0, false), (32, 32, 128, 3, 1, 1, 0, false), (32, 64, 64, 3, 1, 1, 0, false),
    (64, 64, 64, 3, 1, 1, 0, false), (64, 32, 128, 3, 1, 1, 0, false), (32, 3, 128, 1, 1, 0, 0, false),
    (64, 32, 64, 2, 2, 0, 0, true),
    // The ViT's patches.
    (3, 384, 64, 8, 8, 0, 0, false),
];

/// `--grid`: each shape's workspaces, one pass at a time, at every batch
/// from 4 to 8,192 (powers of 2) whose input and output fit 3 GiB; with
/// `heads`, the heads' shapes alone; with `dense`, the zoo's image models'
/// shapes at every batch from 1 to 256 (cuDNN's choice of algorithm, and
/// so its workspace, changes between the powers of 2).
fn grid(device: Device, heads_only: bool, dense: bool) -> Result<(), Box<dyn Error>> {
    let (plain, transposed) =
        if heads_only || dense { (Vec::new(), Vec::new()) } else { (grid_shapes(), grid_transposed()) };
    let heads = if dense { Vec::new() } else { grid_heads() };
    let plain = plain.into_iter().chain(heads).map(|(c_in, c_out, h, k, s)| (c_in, c_out, h, k, s, k / 2, 0, false));
    let transposed = transposed.into_iter().map(|(c_in, c_out, h, k, s, p, op)| (c_in, c_out, h, k, s, p, op, true));
    let zoo = if dense { ZOO_SHAPES.to_vec() } else { Vec::new() };
    let batches: Vec<i64> = if dense { (1..=256).collect() } else { (2..=13).map(|e| 1i64 << e).collect() };
    let mut seen = std::collections::HashSet::new();
    for (c_in, c_out, h, k, s, p, op, is_transposed) in plain.chain(transposed).chain(zoo) {
        // The U-Net's 64 to 64 at 64 is the ResNet's too.
        if !seen.insert((c_in, c_out, h, k, s, p, op, is_transposed)) {
            continue;
        }
        for &n in &batches {
            let out_h = if is_transposed { (h - 1) * s - 2 * p + k + op } else { (h + 2 * p - k) / s + 1 };
            let bytes = 4 * n * (c_in * h * h + c_out * out_h * out_h);
            if bytes > 3 << 30 {
                continue;
            }
            let vs = nn::VarStore::new(device);
            let conv: Box<dyn Module> = if is_transposed {
                let config = nn::ConvTransposeConfig {
                    stride: s,
                    padding: p,
                    output_padding: op,
                    bias: false,
                    ..Default::default()
                };
                Box::new(nn::conv_transpose2d(vs.root() / "conv", c_in, c_out, k, config))
            } else {
                let config = nn::ConvConfig { stride: s, padding: p, bias: false, ..Default::default() };
                Box::new(nn::conv2d(vs.root() / "conv", c_in, c_out, k, config))
            };
            let weight = vs.trainable_variables().into_iter().next().ok_or("a convolution without a weight")?;
            let input = Tensor::randn([n, c_in, h, h], (Kind::Float, device));
            // What one pass allocated and freed inside its convolution ops
            // of that direction.
            let measure = |backward: bool, pass: &dyn Fn()| -> Result<Vec<u64>, Box<dyn Error>> {
                let (trace, ops) = recorded(&vs, pass)?;
                let convolutions = ops.iter().filter(|r| matches!(&r.op, Op::Convolution(c) if c.backward == backward));
                Ok(convolutions
                    .flat_map(|r| allocated_in(&trace, r))
                    .filter(|&(_, freed)| freed)
                    .map(|(size, _)| size)
                    .collect())
            };
            let forward = measure(false, &|| drop(tch::no_grad(|| conv.forward(&input))))?;
            let grad_input = input.copy().set_requires_grad(true);
            // The input's gradient alone: the weight needs none.
            let _ = weight.set_requires_grad(false);
            let input_grad = measure(true, &|| conv.forward(&grad_input).sum(Kind::Float).backward())?;
            let _ = weight.set_requires_grad(true);
            let weight_grad = measure(true, &|| conv.forward(&input).sum(Kind::Float).backward())?;
            let mut row = serde_json::json!({
                "n": n, "c_in": c_in, "c_out": c_out, "h": h, "k": k, "stride": s,
                "forward": forward, "input_grad": input_grad, "weight_grad": weight_grad,
            });
            if is_transposed {
                row["transposed"] = true.into();
                row["output_padding"] = op.into();
            }
            if is_transposed || p != k / 2 {
                row["padding"] = p.into();
            }
            println!("{row}");
        }
    }
    Ok(())
}

/// What CUDA allocated while `pass` ran a second time (the first, untimed,
/// so that cuDNN's first-call state is not measured): the device's
/// history and the ops watched.
fn recorded(vs: &nn::VarStore, pass: impl Fn()) -> Result<(Vec<TraceEntry>, Vec<OpRecord>), Box<dyn Error>> {
    pass();
    tch::Cuda::synchronize(0);
    let recording = memlab::Recording::start(Settings::default().ops(true))?;
    pass();
    tch::Cuda::synchronize(0);
    let mut snapshot = memlab::export::Exporter::of(vs).snapshot()?;
    drop(recording);
    let cuda = snapshot.devices().iter().position(|d| d == "cuda:0").ok_or("no cuda:0 history")?;
    let ops = snapshot.memlab.as_ref().and_then(|m| m.ops.clone()).unwrap_or_default();
    Ok((snapshot.device_traces.swap_remove(cuda), ops))
}

/// Each allocation made while `op` ran, with whether it was freed before
/// the op ended.
fn allocated_in(trace: &[TraceEntry], op: &OpRecord) -> Vec<(u64, bool)> {
    let from = trace.partition_point(|e| e.time_us < op.start_us);
    let to = trace.partition_point(|e| e.time_us <= op.end_us);
    let window = &trace[from..to];
    let freed = |a: &TraceEntry| window.iter().any(|f| f.action == Action::FreeRequested && f.addr == a.addr);
    window.iter().filter(|e| e.action == Action::Alloc).map(|a| (a.size, freed(a))).collect()
}
