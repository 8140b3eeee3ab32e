//! Every static of the workspace that holds state is process-wide state in
//! `memlab_core::process`'s table (declared with `process_wide!`), or listed
//! here with the reason it stays with each copy of memlab. A new `static`
//! with a lock, an atomic or a once-cell outside `process_wide!` fails this
//! test until it is moved or listed.

use std::path::{Path, PathBuf};

/// Statics that each copy of memlab keeps for itself, on purpose:
/// (file, name, why).
const PER_COPY: &[(&str, &str, &str)] = &[
    ("memlab-core/src/process.rs", "TABLE", "the table of process-wide values itself"),
    ("memlab-core/src/events/unwind.rs", "KNOWN", "this copy's unwind tables, as it last read the modules"),
    ("memlab-core/src/events/unwind.rs", "ONE_AT_A_TIME", "one reading of this copy's unwind tables at a time"),
    ("memlab-core/src/events/mod.rs", "RESOLVED", "a cache of resolved frames, the same in every copy"),
    ("memlab-core/src/events/mod.rs", "LISTED_AT", "when this copy's backtrace crate listed the modules"),
    ("memlab-core/src/events/symbols.rs", "NAMED", "a cache of native functions' names, the same in every copy"),
    ("memlab-core/src/events/symbols.rs", "TABLES", "this copy's readers of the modules' symbol tables"),
    ("memlab-core/src/events/loader.rs", "OPENED", "this copy's readers of modules its backtrace crate does not know"),
    ("memlab-core/src/process.rs", "CHOSEN", "the table this copy found (the process's) or keeps"),
    ("memlab-core/src/process.rs", "PROVIDED", "this copy's anchor, given as it loads"),
    ("memlab-core/src/process.rs", "DEFERRED", "the warnings about this copy's choice of table, said once"),
    ("memlab-core/src/process.rs", "ANY_DEFERRED", "whether this copy has such warnings left to say"),
    (
        "memlab-core/src/profiler/frame.rs",
        "THIS_COPY",
        "whether this copy's first frame registered its profiled functions",
    ),
    ("memlab-core/src/profiled.rs", "REGISTERED", "whether this copy's profiled functions are in the process's list"),
    ("memlab-tch/src/driver.rs", "READY", "this copy's handle on the CUDA driver library"),
    ("memlab-tch/src/driver.rs", "CONTEXTS", "this copy's retained CUDA contexts"),
    ("memlab-tch/src/driver.rs", "NVML", "this copy's handle on NVML"),
    ("memlab-tch/src/driver.rs", "PAGE", "the page size, the same in every copy"),
    ("memlab-tch/src/driver.rs", "STATM", "this copy's open /proc/self/statm"),
    ("memlab-tch/src/lib.rs", "COUNT", "the device count, the same in every copy"),
    ("memlab-tch/src/optimizer.rs", "LAYOUT", "how libtorch lays out a tensor handle, the same in every copy"),
    ("src/oom/capture.rs", "IDENTITY", "the host's name and the process's start, the same in every copy"),
    ("src/step_figures.rs", "TOTAL", "the host's memory, the same in every copy"),
    ("src/batch_size.rs", "SEARCHES", "the panic hook it wraps is this copy's standard library's"),
    ("src/notebook.rs", "KERNEL_OUT", "the kernel's output, for the exit hook of the copy whose threads took it over"),
    ("src/notebook.rs", "OUTPUT_DONE", "whether that copy's output thread has passed everything on"),
];

/// Types whose statics hold state that can change.
const STATEFUL: &[&str] = &["Mutex", "RwLock", "Atomic", "OnceLock", "Once", "Condvar", "Cell", "LazyLock"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") && path.file_name().is_some_and(|n| n != "tests.rs") {
            out.push(path);
        }
    }
}

/// The stateful statics of `text` declared outside `process_wide!` and
/// `thread_local!` (unit tests at the end of a file excluded): (name, line).
fn loose_statics(text: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    // Depth of braces inside a process_wide! or thread_local! block (0: outside).
    let mut inside = 0i32;
    for (n, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        if inside > 0 {
            inside += code.matches('{').count() as i32 - code.matches('}').count() as i32;
            continue;
        }
        if code.contains("process_wide! {") || code.starts_with("thread_local! {") {
            inside = code.matches('{').count() as i32 - code.matches('}').count() as i32;
            continue;
        }
        let declared = code.strip_prefix("pub ").or_else(|| code.strip_prefix("pub(crate) ")).unwrap_or(code);
        let Some(rest) = declared.strip_prefix("static ") else { continue };
        let Some((name, ty)) = rest.split_once(':') else { continue };
        if STATEFUL.iter().any(|s| ty.contains(s)) {
            found.push((name.trim().to_string(), n + 1));
        }
    }
    found
}

#[test]
fn every_stateful_static_is_process_wide_or_listed_with_its_reason() {
    let root = workspace();
    let mut files = Vec::new();
    for dir in ["src", "memlab-core/src", "memlab-tch/src", "memlab-macros/src"] {
        sources(&root.join(dir), &mut files);
    }
    assert!(files.len() > 40, "the workspace's sources were found: {}", files.len());
    let mut loose = Vec::new();
    let mut listed_seen = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
        let text = std::fs::read_to_string(file).unwrap();
        for (name, line) in loose_statics(&text) {
            if PER_COPY.iter().any(|(f, n, _)| *f == relative && *n == name) {
                listed_seen.push((relative.clone(), name));
            } else {
                loose.push(format!("{relative}:{line} {name}"));
            }
        }
    }
    assert!(
        loose.is_empty(),
        "stateful statics outside process_wide! (declare them with memlab_core::process::process_wide!, or list them in \
         PER_COPY with the reason each copy keeps its own):\n{}",
        loose.join("\n")
    );
    for (file, name, _) in PER_COPY {
        assert!(
            listed_seen.iter().any(|(f, n)| f == file && n == name),
            "{file} {name} is listed but no longer declared there: take it off the list"
        );
    }
}

#[test]
fn the_scan_sees_what_it_must() {
    let text = "static A: Mutex<u8> = Mutex::new(0);\n\
                memlab_core::process::process_wide! {\n    static B: AtomicU64 = AtomicU64::new(0);\n}\n\
                thread_local! {\n    static C: Cell<u8> = const { Cell::new(0) };\n}\n\
                pub(crate) static D: OnceLock<u8> = OnceLock::new();\n\
                static E: [u8; 2] = [0, 1];\n\
                fn f() {\n    static F: AtomicBool = AtomicBool::new(false);\n}\n\
                #[cfg(test)]\nmod tests {\n    static G: Mutex<u8> = Mutex::new(0);\n}\n";
    let names: Vec<String> = loose_statics(text).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["A", "D", "F"]);
}
