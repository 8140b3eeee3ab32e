#[memlab::profile]
const fn answer() -> u32 {
    42
}

fn main() {
    let _ = answer();
}
