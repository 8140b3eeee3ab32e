//! The classic leak of a validation loop, caught by a dispose scope: summing
//! losses as tensors (`total_loss = total_loss + loss`) with autograd on keeps
//! every batch's graph, and with it the activations saved for a backward pass
//! that never comes. The scope names the lines that allocated what escaped;
//! the fix (no graph, plain numbers) leaves nothing behind.
//!
//!     cargo run --release --example leak_hunt

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

// The leaky version is written the way the bug is usually written.
#[allow(clippy::assign_op_pattern)]
#[memlab::profile]
fn validate_leaky(model: &nn::Sequential, batches: &[(Tensor, Tensor)]) -> Tensor {
    let mut total_loss = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for (x, y) in batches {
        let logits = model.forward(x);
        let loss = logits.cross_entropy_for_logits(y);
        total_loss = total_loss + loss;
    }
    total_loss
}

#[memlab::profile]
fn validate_fixed(model: &nn::Sequential, batches: &[(Tensor, Tensor)]) -> f64 {
    let mut total_loss = 0.0;
    for (x, y) in batches {
        let logits = tch::no_grad(|| model.forward(x));
        let loss = logits.cross_entropy_for_logits(y);
        total_loss += loss.double_value(&[]);
    }
    total_loss
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 128, 256, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 256, 10, Default::default()));
    let batches: Vec<(Tensor, Tensor)> = (0..4)
        .map(|_| {
            let x = Tensor::randn([64, 128], (Kind::Float, Device::Cpu));
            (x, Tensor::randint(10, [64], (Kind::Int64, Device::Cpu)))
        })
        .collect();

    println!("== the leaky validation loop ==");
    let scope = memlab::DisposeScope::new("leaky validation")?;
    let total = validate_leaky(&model, &batches);
    scope.keep(&total)?; // the returned sum is meant to escape; the graphs behind it are not
    print!("{}", scope.finish());
    println!("mean loss {:.4}\n", total.double_value(&[]) / batches.len() as f64);
    drop(total);

    println!("== the fixed validation loop ==");
    let scope = memlab::DisposeScope::new("fixed validation")?;
    let total = validate_fixed(&model, &batches);
    print!("{}", scope.finish());
    println!("mean loss {:.4}", total / batches.len() as f64);
    Ok(())
}
