//! Measures what `scaled_dot_product_attention` allocates on this GPU, per
//! backend libtorch picks (flash, memory-efficient, cuDNN attention, the
//! math fallback): the figures behind memlab's model of CUDA's attention
//! (`memlab::replay::attention`). Each shape runs forward and backward under
//! a recording that watches its ops; every op that allocated is printed with
//! its allocations, each with whether the op freed it before it ended. One
//! JSON object a shape.
//!
//!     cargo run --release --example attention_sizes [-- --quick]
//!
//! Needs a CUDA device.

use std::error::Error;

use memlab::events::{Action, Settings};
use memlab::export::TraceEntry;
use memlab::replay::OpRecord;
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: i64,
    heads: i64,
    len: i64,
    head_dim: i64,
    kind: Kind,
    causal: bool,
}

const BASE: Shape = Shape { batch: 4, heads: 8, len: 512, head_dim: 64, kind: Kind::Float, causal: true };

fn shapes(quick: bool) -> Vec<Shape> {
    let mut out = Vec::new();
    for kind in [Kind::Float, Kind::Half, Kind::BFloat16] {
        for causal in [false, true] {
            let base = Shape { kind, causal, ..BASE };
            out.push(base);
            if quick {
                continue;
            }
            out.extend([1, 2, 16, 33].map(|batch| Shape { batch, ..base }));
            out.extend([1, 12, 16].map(|heads| Shape { heads, ..base }));
            out.extend([16, 100, 128, 257, 1024, 2048].map(|len| Shape { len, ..base }));
            out.extend([32, 80, 128, 256].map(|head_dim| Shape { head_dim, ..base }));
        }
    }
    out
}

/// Every op of the recording that allocated, innermost first where they
/// nest: its name and, per allocation, its bytes and whether it freed it.
fn per_op(trace: &[TraceEntry], ops: &[OpRecord]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for r in ops {
        let from = trace.partition_point(|e| e.time_us < r.start_us);
        let to = trace.partition_point(|e| e.time_us <= r.end_us);
        let window = &trace[from..to];
        let allocations: Vec<(u64, bool)> = window
            .iter()
            .filter(|e| e.action == Action::Alloc)
            .map(|a| (a.size, window.iter().any(|f| f.action == Action::FreeRequested && f.addr == a.addr)))
            .collect();
        if !allocations.is_empty() {
            out.push(serde_json::json!({ "op": r.name, "allocations": allocations }));
        }
    }
    out
}

fn run(s: Shape) -> Result<serde_json::Value, Box<dyn Error>> {
    let cuda = Device::Cuda(0);
    let dims = [s.batch, s.heads, s.len, s.head_dim];
    let step = || {
        let q = Tensor::randn(dims, (s.kind, cuda)).set_requires_grad(true);
        let k = Tensor::randn(dims, (s.kind, cuda)).set_requires_grad(true);
        let v = Tensor::randn(dims, (s.kind, cuda)).set_requires_grad(true);
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, s.causal, None, false);
        out.to_kind(Kind::Float).sum(Kind::Float).backward();
    };
    step();
    let recording = memlab::Recording::start(Settings::default().ops(true))?;
    step();
    tch::Cuda::synchronize(0);
    let snapshot = memlab::export::Exporter::registered().snapshot()?;
    drop(recording);
    let device = snapshot.devices().iter().position(|d| d == "cuda:0").ok_or("no cuda:0 history")?;
    let ops = snapshot.memlab.as_ref().and_then(|m| m.ops.clone()).unwrap_or_default();
    let kind = match s.kind {
        Kind::Half => "f16",
        Kind::BFloat16 => "bf16",
        _ => "f32",
    };
    Ok(serde_json::json!({
        "batch": s.batch, "heads": s.heads, "len": s.len, "head_dim": s.head_dim, "dtype": kind,
        "causal": s.causal, "ops": per_op(&snapshot.device_traces[device], &ops),
    }))
}

fn main() -> Result<(), Box<dyn Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    if !tch::Cuda::is_available() {
        return Err("attention_sizes measures CUDA's attention: it needs a CUDA device".into());
    }
    for s in shapes(quick) {
        match run(s) {
            Ok(row) => println!("{row}"),
            Err(e) => eprintln!("{s:?}: {e}"),
        }
    }
    Ok(())
}
