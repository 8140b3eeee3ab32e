#[memlab::profile(device = "cpu", device = "cuda")]
fn step() {}

fn main() {
    step();
}
