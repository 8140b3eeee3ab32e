#[memlab::profile]
struct Model {
    layers: usize,
}

fn main() {
    let _ = Model { layers: 1 };
}
