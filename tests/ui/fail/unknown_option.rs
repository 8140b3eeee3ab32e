#[memlab::profile(every = 3)]
fn step() {}

fn main() {
    step();
}
