#[memlab::profile(device = 5)]
fn device_not_a_string() {}

#[memlab::profile(device "cpu")]
fn device_without_eq() {}

#[memlab::profile(crate = "memlab")]
fn crate_as_string() {}

#[memlab::profile(device = "cpu" crate = memlab)]
fn missing_comma() {}

#[memlab::profile(5)]
fn bare_number() {}

fn main() {}
