//! Compile tests of `#[memlab::profile]`: what it must reject, with a message
//! that says what to do. (What it must keep building and running is
//! `tests/cpu/macro_forms`, part of the CPU test binary: trybuild builds and
//! links every case of a project that has one to pass, where cases that
//! only fail are checked, which takes a fraction of the time.)

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}
