#[memlab::profile(device = "gpu0")]
fn step() {}

fn main() {
    step();
}
