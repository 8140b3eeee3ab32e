//! What a crate on tch 0.26 sees of memlab: a line profile, a report of its
//! model by name (optimizer state included) and an allocation recording,
//! each checked against the allocator's exact figures.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[memlab::profile(device = "cpu")]
fn make_weights() -> Tensor {
    let w = Tensor::zeros([1024, 1024], (Kind::Float, Device::Cpu));
    w
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    println!("memlab on tch {} (libtorch {})", memlab::optimizer::tch_release(), memlab::optimizer::libtorch_version());

    let _w = make_weights();
    let report = memlab::report();
    let line = report.function("make_weights")?.find("let w =").and_then(|l| l.stats.clone()).ok_or("the line ran")?;
    assert_eq!(line.increment, 4 << 20, "a 1024 x 1024 f32 tensor");
    println!("line profile: `let w = ...` keeps {} bytes", line.increment);

    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "fc", 64, 32, Default::default()));
    memlab::register_var_store("model", &vs);
    let mut opt = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
    let recording = memlab::Recording::start(memlab::events::Settings::default())?;
    let x = Tensor::ones([8, 64], (Kind::Float, Device::Cpu));
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    assert_eq!(opt.registered_states(), 4, "Adam's two moments of the weight and the bias");

    let report = memlab::MemReporter::registered().report()?;
    let cpu = report.device(memlab::Device::Cpu).ok_or("a CPU section")?;
    let named: i64 = cpu.rows.iter().filter(|r| r.counted && r.name.starts_with("model.")).map(|r| r.bytes).sum();
    // Weight and bias, their gradients and Adam's two moments: four times the parameters.
    assert_eq!(named, 4 * (64 * 32 + 32) * 4, "{report}");
    let total: i64 = cpu.rows.iter().filter(|r| r.counted).map(|r| r.bytes).sum();
    assert_eq!(total, cpu.allocated_bytes, "the rows add up to the allocator's figure");
    println!("{report}");

    let events = memlab::events::stats();
    assert!(events.recorded > 0);
    drop(recording);
    println!("recorded {} allocation events; every figure checked", events.recorded);
    Ok(())
}
