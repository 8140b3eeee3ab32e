//! Measures what cuDNN's RNNs allocate on this GPU: the figures behind
//! memlab's model of `_cudnn_rnn` and `_cudnn_rnn_backward`
//! (`memlab::replay::cudnn_rnn`). Each LSTM or GRU runs forward and backward
//! under a recording that watches its ops; every allocation each op made is
//! printed with whether the op freed it before it ended (a workspace) or not
//! (an output, the reserve space kept for the backward pass, a weight
//! buffer). One JSON object a configuration.
//!
//!     cargo run --release --example cudnn_rnn_sizes [-- --quick]
//!
//! Needs a CUDA device.

use std::error::Error;

use memlab::events::{Action, Settings};
use memlab::export::TraceEntry;
use memlab::replay::OpRecord;
use tch::nn::{self, RNN};
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug)]
struct Config {
    gru: bool,
    layers: i64,
    bidirectional: bool,
    input: i64,
    hidden: i64,
    seq: i64,
    batch: i64,
    kind: Kind,
    /// The VarStore made on CUDA (tch flattens the weights), or on the CPU
    /// and moved.
    flattened: bool,
    batch_first: bool,
}

const BASE: Config = Config {
    gru: false,
    layers: 1,
    bidirectional: false,
    input: 256,
    hidden: 512,
    seq: 64,
    batch: 32,
    kind: Kind::Float,
    flattened: true,
    batch_first: true,
};

fn configs(quick: bool) -> Vec<Config> {
    let mut out = Vec::new();
    for gru in [false, true] {
        for layers in [1, 2, 3] {
            for bidirectional in [false, true] {
                let base = Config { gru, layers, bidirectional, ..BASE };
                out.push(base);
                if quick {
                    continue;
                }
                out.extend([32, 300, 1024].map(|input| Config { input, ..base }));
                out.extend([64, 128, 250, 384, 1024].map(|hidden| Config { hidden, ..base }));
                out.extend([1, 8, 200].map(|seq| Config { seq, ..base }));
                out.extend([1, 2, 8, 33, 128].map(|batch| Config { batch, ..base }));
                out.extend([Kind::Half, Kind::BFloat16].map(|kind| Config { kind, ..base }));
                out.push(Config { flattened: false, ..base });
                out.push(Config { batch_first: false, ..base });
                // Batches between, at two widths: what a workspace is
                // interpolated along.
                for hidden in [384, 512] {
                    out.extend([4, 16, 24, 48, 64, 96, 256].map(|batch| Config { hidden, batch, ..base }));
                }
            }
        }
    }
    // Configurations no rule is fitted on: a deterministic spread, to check
    // the rules against.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut pick = |options: &[i64]| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        options[(state % options.len() as u64) as usize]
    };
    for _ in 0..if quick { 4 } else { 120 } {
        out.push(Config {
            gru: pick(&[0, 1]) == 1,
            layers: pick(&[1, 2, 3, 4]),
            bidirectional: pick(&[0, 1]) == 1,
            input: pick(&[16, 100, 128, 256, 512, 777]),
            hidden: pick(&[32, 96, 200, 256, 512, 768]),
            seq: pick(&[2, 16, 50, 128, 256]),
            batch: pick(&[2, 4, 16, 48, 64, 100]),
            kind: [Kind::Float, Kind::Half, Kind::BFloat16][pick(&[0, 0, 1, 2]) as usize],
            flattened: pick(&[0, 1, 1]) == 1,
            batch_first: pick(&[0, 1]) == 1,
        });
    }
    out
}

/// Per allocation the op made: its bytes, and whether the op freed it.
fn allocations(trace: &[TraceEntry], r: &OpRecord) -> Vec<(u64, bool)> {
    let from = trace.partition_point(|e| e.time_us < r.start_us);
    let to = trace.partition_point(|e| e.time_us <= r.end_us);
    let window = &trace[from..to];
    window
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .map(|a| {
            let freed = window.iter().any(|f| f.action == Action::FreeRequested && f.addr == a.addr);
            (a.size, freed)
        })
        .collect()
}

fn run(c: Config) -> Result<serde_json::Value, Box<dyn Error>> {
    let cuda = Device::Cuda(0);
    let mut vs = nn::VarStore::new(if c.flattened { cuda } else { Device::Cpu });
    let config = nn::RNNConfig {
        num_layers: c.layers,
        bidirectional: c.bidirectional,
        batch_first: c.batch_first,
        ..Default::default()
    };
    let dims = if c.batch_first { [c.batch, c.seq, c.input] } else { [c.seq, c.batch, c.input] };
    let (lstm, gru) = if c.gru {
        (None, Some(nn::gru(vs.root() / "rnn", c.input, c.hidden, config)))
    } else {
        (Some(nn::lstm(vs.root() / "rnn", c.input, c.hidden, config)), None)
    };
    if c.kind != Kind::Float {
        vs.set_kind(c.kind);
    }
    if c.flattened && c.kind != Kind::Float {
        // The cast copied each weight apart: flatten them again, as a
        // VarStore made on CUDA in this kind would have them.
        let directions = if c.bidirectional { 2 } else { 1 };
        let variables = vs.variables();
        let mut weights = Vec::new();
        for layer in 0..c.layers {
            for suffix in ["", "_reverse"].iter().take(directions) {
                for name in ["weight_ih", "weight_hh", "bias_ih", "bias_hh"] {
                    weights.push(variables[&format!("rnn.{name}_l{layer}{suffix}")].shallow_clone());
                }
            }
        }
        let _ = Tensor::internal_cudnn_rnn_flatten_weight(
            &weights,
            4,
            c.input,
            if c.gru { 3 } else { 2 },
            c.hidden,
            0,
            c.layers,
            c.batch_first,
            c.bidirectional,
        );
    }
    if !c.flattened {
        vs.set_device(cuda);
    }
    // The zero state on CUDA: a module made on the CPU keeps that device
    // for its own zero state.
    let directions = if c.bidirectional { 2 } else { 1 };
    let zeros = || Tensor::zeros([c.layers * directions, c.batch, c.hidden], (c.kind, cuda));
    let forward = |x: &Tensor| match (&lstm, &gru) {
        (Some(rnn), _) => rnn.seq_init(x, &nn::LSTMState((zeros(), zeros()))).0,
        (_, Some(rnn)) => rnn.seq_init(x, &nn::GRUState(zeros())).0,
        _ => unreachable!("one of the two is made"),
    };
    let step = || {
        let input = Tensor::randn(dims, (c.kind, cuda)).set_requires_grad(true);
        forward(&input).to_kind(Kind::Float).sum(Kind::Float).backward();
    };
    // Once unrecorded, so that cuDNN's first-call state is not measured.
    step();
    let recording = memlab::Recording::start(Settings::default().ops(true))?;
    step();
    tch::Cuda::synchronize(0);
    let snapshot = memlab::export::Exporter::of(&vs).snapshot()?;
    drop(recording);
    let device = snapshot.devices().iter().position(|d| d == "cuda:0").ok_or("no cuda:0 history")?;
    let trace = &snapshot.device_traces[device];
    let ops = snapshot.memlab.as_ref().and_then(|m| m.ops.clone()).unwrap_or_default();
    let of = |name: &str| -> Vec<Vec<(u64, bool)>> {
        ops.iter().filter(|r| r.name == name).map(|r| allocations(trace, r)).collect()
    };
    let kind = match c.kind {
        Kind::Half => "f16",
        Kind::BFloat16 => "bf16",
        _ => "f32",
    };
    Ok(serde_json::json!({
        "mode": if c.gru { "gru" } else { "lstm" },
        "layers": c.layers, "bidirectional": c.bidirectional, "input": c.input, "hidden": c.hidden,
        "seq": c.seq, "batch": c.batch, "dtype": kind, "flattened": c.flattened, "batch_first": c.batch_first,
        "rnn": of(if c.gru { "gru" } else { "lstm" }),
        "forward": of("_cudnn_rnn"),
        "backward": of("_cudnn_rnn_backward"),
    }))
}

fn main() -> Result<(), Box<dyn Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    if !tch::Cuda::is_available() {
        return Err("cudnn_rnn_sizes measures cuDNN: it needs a CUDA device".into());
    }
    for c in configs(quick) {
        // tch's modules panic on libtorch's errors: one configuration's
        // failure is said, and the others still run.
        match std::panic::catch_unwind(|| run(c).map_err(|e| e.to_string())) {
            Ok(Ok(row)) => println!("{row}"),
            Ok(Err(e)) => eprintln!("{c:?}: {e}"),
            Err(_) => eprintln!("{c:?}: panicked (above)"),
        }
    }
    Ok(())
}
