#[memlab::profile_every(-1)]
fn negative() {}

#[memlab::profile_every(ten)]
fn not_a_number() {}

#[memlab::profile_every(99999999999)]
fn too_large() {}

#[memlab::profile(every = 3)]
fn period_as_option() {}

fn main() {}
