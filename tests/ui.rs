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
    // which a check, linking nothing, never uses; torch-sys's build script
    // has no such switch and is overridden instead (`skip_torch_sys_cpp`).
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
    skip_torch_sys_cpp();
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}

/// A check links nothing, so the C++ library torch-sys's build script
/// compiles (48 s of the check of memlab's dependencies) is never used:
/// cargo's override of a `links` build script (`[target.<triple>.tch]` in a
/// configuration file above trybuild's project, read by its builds alone)
/// stands in for it. Where the override cannot be written, the build script
/// runs as it would. It says libtorch is nowhere (`libtorch_lib` empty),
/// which memlab-tch's build script, under `DOCS_RS`, never reads; a case
/// that must build and link (`t.pass`) could not be run beside it.
fn skip_torch_sys_cpp() {
    let Some(host) = std::process::Command::new(std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
        .arg("-vV")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.lines().find_map(|l| l.strip_prefix("host: ").map(str::to_string)))
    else {
        return;
    };
    // trybuild builds in `tests/trybuild` of the target directory.
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("the target directory");
    let dir = target.join("tests/trybuild/.cargo");
    let config = format!(
        "# Written by memlab's tests/ui.rs: torch-sys's C++ is not compiled for trybuild's checks.\n\
         [target.\"{host}\".tch]\n\
         libtorch_lib = \"\"\n"
    );
    let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("config.toml"), config));
}
