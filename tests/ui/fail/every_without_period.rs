#[memlab::profile_every]
fn step() {}

#[memlab::profile_every(0)]
fn never() {}

fn main() {
    step();
    never();
}
