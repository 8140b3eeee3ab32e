#[memlab::profile(colour = 3)]
fn step() {}

fn main() {
    step();
}
