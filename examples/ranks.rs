//! One rank of a run of several processes, for `memlab merge`. Each process
//! reads its rank from `MEMLAB_RANK` (or `RANK`, or `LOCAL_RANK`, as torchrun
//! sets them) and trains a small MLP for a few steps on its own device
//! (`cuda:N` for rank N when the machine has that many GPUs, else the CPU),
//! rank 0 with the largest batch. The last rank (`WORLD_SIZE - 1`) then asks
//! for more memory than its device has. Each process writes, into DIR, its
//! snapshot, trace and page under the default names with `_rank{N}`
//! (`memlab_snapshot_rank0.pickle`, …) and, for the failure, the
//! out-of-memory recorder's report. Then merge them:
//!
//!     for r in 0 1; do
//!       MEMLAB_RANK=$r WORLD_SIZE=2 cargo run --release --example ranks -- --out DIR &
//!     done; wait
//!     cargo run --release -p memlab-cli -- merge DIR/*.pickle DIR/*.json -o DIR/merged

use std::error::Error;
use std::path::PathBuf;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mut out = PathBuf::from("memlab_ranks");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            other => return Err(format!("unknown argument {other:?}; use --out DIR").into()),
        }
    }
    std::fs::create_dir_all(&out)?;
    memlab::profiler::set_print_at_exit(false);
    let run = memlab::run::this_process();
    let (rank, world) = (run.rank.unwrap_or(0), run.world_size.unwrap_or(1));
    let device = match usize::try_from(rank) {
        Ok(r) if r < memlab::gpu::cuda_device_count() => Device::Cuda(r),
        _ => Device::Cpu,
    };
    memlab::OomRecorder::new(&out).arm()?;
    let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true))?;

    tch::manual_seed(i64::from(rank));
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 512, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 1024, 10, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
    // Rank 0 has the largest batch, and so the highest peak.
    let batch = 2048 >> rank.min(3);
    for _ in 0..4 {
        let x = Tensor::randn([batch, 512], (Kind::Float, device));
        let y = Tensor::randint(10, [batch], (Kind::Int64, device));
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        adam.with_mut(|adam| adam.backward_step(&loss));
    }
    if rank + 1 == world {
        // More than the device has: the recorder writes its report, and the
        // error comes back as a value.
        let too_many = match device {
            Device::Cuda(i) => memlab::gpu::driver_memory(i).map_or(1 << 40, |m| m.total as i64),
            _ => 1 << 46,
        };
        let failed = Tensor::f_empty([too_many], (Kind::Float, device));
        println!(
            "rank {rank}: asking for {too_many} floats on {device:?}: {}",
            if failed.is_err() { "failed" } else { "fit" }
        );
    }
    let written = memlab::export::Exporter::registered().write_files(&out)?;
    let names: Vec<String> =
        written.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
    println!("rank {rank} of {world} on {device:?} ({}): wrote {}", run.label(), names.join(", "));
    drop(recording);
    Ok(())
}
