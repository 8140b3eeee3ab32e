//! Compile tests of `#[memlab::profile]`: what it must reject, with a message
//! that says what to do. (What it must keep building and running is
//! `tests/cpu/macro_forms`, part of the CPU test binary: trybuild builds and
//! links every case of a project that has one to pass, where cases that
//! only fail are checked, which takes a fraction of the time.)

#[test]
fn ui() {
    // trybuild checks memlab's dependencies twice: once with its own rustc
    // flags, then the cases with `--diagnostic-width=140` added, and a
    // changed flag makes cargo check every dependency again (70 s on 2
    // cores). CARGO_ENCODED_RUSTFLAGS outranks the flags trybuild gives
    // cargo, so both passes get the same ones: trybuild's own, width
    // included, and the dependencies are checked once.
    //
    // DOCS_RS: memlab-tch's build script then skips compiling its C++ shim,
    // which a check, linking nothing, never uses (torch-sys still compiles
    // its own; it has no such switch).
    //
    // SAFETY: set before trybuild starts any thread, in the one test of this
    // binary.
    unsafe {
        std::env::set_var(
            "CARGO_ENCODED_RUSTFLAGS",
            ["--cfg", "trybuild", "--verbose", "-A", "dead_code", "--diagnostic-width=140"].join("\x1f"),
        );
        std::env::set_var("DOCS_RS", "1");
    }
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}
