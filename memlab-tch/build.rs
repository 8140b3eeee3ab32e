//! Builds memlab's C++ shim against the libtorch that torch-sys found, with the
//! same C++ ABI, and keeps libtorch_cuda linked when that libtorch has CUDA.
//! A libtorch memlab does not support is refused before any C++ is compiled
//! (torch-sys refuses one other than its tch's own, unless
//! LIBTORCH_BYPASS_VERSION_CHECK is set).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "src/libtorch_version.rs"]
mod libtorch_version;

use libtorch_version::LibtorchVersion;

fn main() {
    println!("cargo:rerun-if-changed=cpp/memlab_shim.cpp");
    println!("cargo:rerun-if-changed=cpp/memlab_shim.h");
    println!("cargo:rerun-if-changed=cpp/memlab_state.h");
    println!("cargo:rerun-if-changed=src/libtorch_version.rs");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    write_action_checks();

    // Documentation builds (docs.rs, or `--features doc-only`) have no
    // libtorch: there is nothing to compile or link, only Rust to document.
    if env::var_os("DOCS_RS").is_some() || env::var_os("CARGO_FEATURE_DOC_ONLY").is_some() {
        return;
    }

    let Some(lib_dir) = env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
        panic!(
            "memlab-tch: torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB is unset). \
             Build with LIBTORCH_USE_PYTORCH=1 and a python3 that has torch==2.11.0 (tch 0.24) or 2.13.0 \
             (tch 0.26) first on PATH \
             (`source scripts/env.sh` in the memlab repository does both), or set LIBTORCH."
        );
    };
    let root = lib_dir.parent().expect("libtorch's lib directory has a parent").to_path_buf();
    let include = root.join("include");
    let version = match libtorch_version(&include) {
        Ok(version) => version,
        Err(why) => panic!("memlab-tch: {why}"),
    };
    if let Err(why) = version.check() {
        panic!("memlab-tch: {why}");
    }
    println!("cargo:rustc-env=MEMLAB_LIBTORCH_VERSION={version}");
    if !include.join("c10/core/CachingDeviceAllocator.h").exists() {
        panic!(
            "memlab-tch: {} has no c10/core/CachingDeviceAllocator.h; memlab needs libtorch's full headers \
             (PyPI's torch wheel, or LIBTORCH pointing at a full libtorch)",
            include.display()
        );
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        // libtorch 2.13's headers initialise bit-fields in their declaration
        // (c10/core/AutogradState.h), which C++20 allows; 2.11's are C++17.
        .std(if (version.major, version.minor) >= (2, 13) { "c++20" } else { "c++17" })
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi().as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // As libtorch itself is built. Its headers' debug-only checks read
        // state that only a debug libtorch keeps: RecordFunction::inputs()
        // asserts a flag a release libtorch never sets, and so throws.
        .define("NDEBUG", None)
        // Who made an anchor, for the warning a copy of another ABI gives.
        .define("MEMLAB_MADE_BY", format!("\"memlab-tch {}\"", env!("CARGO_PKG_VERSION")).as_str())
        .flag_if_supported("-Wno-unused-parameter")
        // The shim's symbols stay inside the binary that links it: calls
        // between its functions (the allocator's path through state()) are
        // direct and inlined rather than interposable through the PLT, and
        // two copies of memlab loaded into one process never bind to each
        // other's functions.
        .flag("-fvisibility=hidden")
        .file("cpp/memlab_shim.cpp");
    // Line tables, not cc's full -g: the shim's frames only ever need a file
    // and line, and full debug information of libtorch's headers is most of
    // a binary's size.
    if std::env::var("DEBUG").is_ok_and(|debug| debug != "false" && debug != "0") {
        build.debug(false).flag("-g1");
    }
    let with_cuda = lib_dir.join("libtorch_cuda.so").exists();
    if with_cuda {
        build.define("MEMLAB_WITH_CUDA", None);
    }
    // CUDA allocation events need the CUDA runtime headers, which PyPI's
    // torch wheel does not carry: nvidia-cuda-runtime ships most of them, and
    // nvidia-cuda-crt the crt/ ones. Without them memlab builds, and says so
    // when CUDA events are asked for.
    let cuda_include = root.parent().map(|site| site.join("nvidia/cu13/include"));
    let cuda_events = with_cuda
        && cuda_include
            .as_ref()
            .is_some_and(|dir| dir.join("cuda_runtime_api.h").exists() && dir.join("crt/host_defines.h").exists());
    if cuda_events {
        let dir = cuda_include.expect("checked above");
        println!("cargo:rerun-if-changed={}", dir.join("crt/host_defines.h").display());
        build.include(dir).define("MEMLAB_CUDA_EVENTS", None).file("cpp/memlab_cuda_events.cpp");
        if blas_workspace_tables(&include) {
            build.define("MEMLAB_BLAS_WORKSPACES", None);
        }
    } else if with_cuda {
        println!(
            "cargo:warning=memlab-tch: CUDA headers not found next to libtorch (nvidia/cu13/include with crt/); \
             CUDA allocation events are off. `pip install nvidia-cuda-crt==13.0.88` in torch's environment \
             (scripts/env.sh does) and rebuild."
        );
    }
    println!("cargo:rerun-if-changed=cpp/memlab_cuda_events.cpp");
    build.compile("memlab_shim");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    // After the shim, so that its reference to libtorch_cuda is already known
    // when the linker decides under --as-needed whether the library is needed.
    if with_cuda {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
    if cuda_events {
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
}

/// Whether libtorch declares its BLAS workspace tables as the shim
/// declares them again (`ATen/cuda/CUDAContextLight.h` itself cannot be
/// included: it pulls in cuSPARSE's headers, which need CUDA's C++ library
/// headers that torch's wheels do not carry). Any other declaration, and the
/// shim lists no workspace rather than read a table of another layout.
fn blas_workspace_tables(include: &Path) -> bool {
    let header = include.join("ATen/cuda/CUDAContextLight.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let Ok(text) = std::fs::read_to_string(&header) else { return false };
    let squeezed: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    [
        "struct WorkspaceMapWithMutex { std::map<std::tuple<void*, void*>, at::DataPtr> map; std::shared_mutex mutex; };",
        "TORCH_CUDA_CPP_API WorkspaceMapWithMutex& cublas_handle_stream_to_workspace();",
        "TORCH_CUDA_CPP_API WorkspaceMapWithMutex& cublaslt_handle_stream_to_workspace();",
    ]
    .iter()
    .all(|declaration| squeezed.contains(declaration))
}

/// The version of the libtorch whose headers are in `include`: its
/// `torch/headeronly/version.h` (2.11 and later), else `torch/version.h`.
/// Writes `action_checks.rs` for src/ffi.rs: a compile-time check that each
/// action of the header's `enum memlab_action` is the variant of
/// `memlab_core::events::Action` of the same name and code, and that the
/// two have as many, so that the one enum holds from the header up.
fn write_action_checks() {
    let header = std::fs::read_to_string("cpp/memlab_shim.h").expect("memlab-tch: read cpp/memlab_shim.h");
    let body = header
        .split_once("enum memlab_action {")
        .and_then(|(_, rest)| rest.split_once("};"))
        .map(|(body, _)| body)
        .expect("memlab-tch: cpp/memlab_shim.h declares enum memlab_action");
    let mut checks = String::new();
    let mut count = 0;
    for line in body.lines().map(str::trim).filter(|l| l.starts_with("MEMLAB_ACTION_")) {
        let (name, code) = line
            .trim_end_matches(',')
            .split_once('=')
            .unwrap_or_else(|| panic!("memlab-tch: `{line}` in enum memlab_action has no explicit code"));
        let (name, code) = (name.trim().trim_start_matches("MEMLAB_ACTION_"), code.trim());
        let variant: String = name.split('_').map(|w| w[..1].to_string() + &w[1..].to_ascii_lowercase()).collect();
        checks.push_str(&format!(
            "const _: () = assert!(\n    memlab_core::events::Action::{variant}.code() == {code},\n    \
             \"memlab_shim.h's MEMLAB_ACTION_{name} is {code}: memlab_core::events::Action::{variant} must be too\"\n);\n"
        ));
        count += 1;
    }
    checks.push_str(&format!(
        "const _: () = assert!(\n    memlab_core::events::Action::ALL.len() == {count},\n    \
         \"memlab_shim.h's enum memlab_action has {count} actions: memlab_core::events::Action must have as many\"\n);\n"
    ));
    // The anchor's version, which the Rust side reports in its warnings.
    let abi = header
        .lines()
        .find_map(|l| l.strip_prefix("#define MEMLAB_ANCHOR_ABI "))
        .map(str::trim)
        .expect("memlab-tch: cpp/memlab_shim.h defines MEMLAB_ANCHOR_ABI");
    checks.push_str(&format!(
        "const _: () = assert!(\n    MEMLAB_ANCHOR_ABI == {abi},\n    \
         \"memlab_shim.h's MEMLAB_ANCHOR_ABI is {abi}: ffi::MEMLAB_ANCHOR_ABI must be too\"\n);\n"
    ));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("action_checks.rs");
    std::fs::write(&out, checks).unwrap_or_else(|e| panic!("memlab-tch: write {}: {e}", out.display()));
}

fn libtorch_version(include: &Path) -> Result<LibtorchVersion, String> {
    let candidates =
        [include.join("torch/headeronly/version.h"), include.join("torch/csrc/api/include/torch/version.h")];
    let header = candidates.iter().find(|path| path.exists()).ok_or_else(|| {
        format!(
            "{} has no torch/version.h: memlab needs libtorch's headers to know its version (PyPI's torch \
             wheel has them)",
            include.display()
        )
    })?;
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(header).map_err(|e| format!("{} cannot be read ({e})", header.display()))?;
    LibtorchVersion::parse(&text).map_err(|why| format!("{} is not a libtorch version header: {why}", header.display()))
}

/// The C++ ABI libtorch was built with, which the shim must match: an explicit
/// LIBTORCH_CXX11_ABI, else what the PyTorch install says, else 1 (every
/// PyPI build of torch 2.11 and 2.13).
fn cxx11_abi() -> String {
    if let Ok(abi) = env::var("LIBTORCH_CXX11_ABI") {
        return abi;
    }
    if env::var("LIBTORCH_USE_PYTORCH").is_ok_and(|v| v == "1") {
        let python = env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
        println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
        if let Ok(out) =
            Command::new(python).args(["-c", "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"]).output()
        {
            let abi = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if abi == "0" || abi == "1" {
                return abi;
            }
        }
    }
    "1".into()
}
