//! Compile tests of `#[memlab::profile]`: what must build (and run), and what
//! must be rejected with a message that says what to do.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
