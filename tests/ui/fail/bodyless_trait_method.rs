trait Forward {
    #[memlab::profile]
    fn forward(&self) -> u32;
}

fn main() {}
