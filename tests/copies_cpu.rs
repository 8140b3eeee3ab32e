//! One memlab per process, however many copies are linked. Two plugins that
//! link memlab statically (`tests/copies`: one source, built as two crates)
//! are loaded with `dlopen` into a process that links no memlab of its own,
//! as a notebook loads its cells' libraries: 2 copies, then 10. Through every
//! copy: one counting allocator, exact figures whichever copy made or freed a
//! tensor, a profiled function called through some copies and reported by
//! another as one table, a recording started in one copy seeing what another
//! allocates (with the statement of the other's profiled function), and one
//! OOM report per failure.
//!
//! This test binary uses no memlab itself, so that the plugins' copies are the
//! only ones. It builds the plugins with cargo, then runs each scenario in a
//! child (a fresh process: the first copy loaded makes the anchor).

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

const HOST: &str = "MEMLAB_COPIES_HOST";

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the two plugins (release, like the suite) and returns their paths.
/// Built with the whole workspace and its tests selected, as `cargo test
/// --workspace` resolves features: memlab and its crates are then the ones
/// the suite just built, and only the plugins are compiled (selecting the
/// two alone resolves other features and rebuilds memlab, a minute).
fn build_plugins() -> [PathBuf; 2] {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace())
        .args(["build", "--release", "--workspace", "--lib", "--tests", "--message-format=short"])
        .output()
        .expect("cargo runs");
    assert!(out.status.success(), "building the plugins failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from);
    ["a", "b"].map(|x| {
        let path = target.join("release").join(format!("libmemlab_plugin_{x}.so"));
        assert!(path.exists(), "{} was built", path.display());
        path
    })
}

/// Runs the host in a child with `a` copies of plugin a and `b` of plugin b,
/// each a file of its own (the loader loads one file once); `env` is added
/// to the child's. Returns what the child wrote on standard error.
fn run(a: usize, b: usize, env: &[(&str, &str)]) -> String {
    // One scenario at a time: each copies its plugins into a folder of its
    // own, and ten copies of a plugin are the largest files the suite writes.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let [plugin_a, plugin_b] = build_plugins();
    let scratch = Scratch(std::env::temp_dir().join(format!("memlab-copies-{}-{a}-{b}", std::process::id())));
    let dir = &scratch.0;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("oom")).unwrap();
    let mut files = Vec::new();
    for (plugin, count, name) in [(&plugin_a, a, "a"), (&plugin_b, b, "b")] {
        for i in 0..count {
            let file = dir.join(format!("plugin_{name}{i}.so"));
            std::fs::copy(plugin, &file).unwrap();
            files.push(file);
        }
    }
    // Interleaved: a0 b0 a1 b1 ..., so that neither crate's copies are all first.
    let (mut a_files, mut b_files): (Vec<_>, Vec<_>) =
        files.into_iter().partition(|f| f.file_name().unwrap().to_string_lossy().starts_with("plugin_a"));
    let mut order = Vec::new();
    while !a_files.is_empty() || !b_files.is_empty() {
        if !a_files.is_empty() {
            order.push(a_files.remove(0));
        }
        if !b_files.is_empty() {
            order.push(b_files.remove(0));
        }
    }
    let list = std::env::join_paths(&order).unwrap();
    let oom = dir.join("oom");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "host", "--nocapture", "--test-threads=1"])
        .env(HOST, &list)
        .env("MEMLAB_COPIES_OOM_DIR", &oom)
        // "{oom}" in a value: the scenario's folder for reports.
        .envs(env.iter().map(|&(k, v)| (k, v.replace("{oom}", &oom.to_string_lossy()))))
        // Files, not pipes: a full pipe would stall the child while it is waited for.
        .stdout(std::fs::File::create(dir.join("stdout")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap();
    // A copy that hangs as it loads must fail the test, not stall the suite.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the host hung for 2 minutes:\n{}", std::fs::read_to_string(dir.join("stdout")).unwrap_or_default());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    let stdout = String::from_utf8_lossy(&std::fs::read(dir.join("stdout")).unwrap()).into_owned();
    let stderr = String::from_utf8_lossy(&std::fs::read(dir.join("stderr")).unwrap()).into_owned();
    assert!(status.success(), "the host failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("host: every check passed"), "the host ran its checks:\n{stdout}\n{stderr}");
    stderr
}

/// A scenario's folder, removed when the scenario ends, passed or failed.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn two_copies_are_one_memlab() {
    run(1, 1, &[]);
}

#[test]
fn ten_copies_are_one_memlab() {
    run(6, 4, &[]);
}

/// `MEMLAB_OOM_DIR` arms the OOM recorder as each copy loads, which reaches
/// the process-wide state before the loader has run every registration of
/// the copy: the copies are one memlab all the same.
#[test]
fn copies_armed_as_they_load_are_one_memlab() {
    run(2, 1, &[("MEMLAB_OOM_DIR", "{oom}")]);
}

/// A copy loaded after backtraces were captured and resolved (a notebook's
/// later cell): the stack is walked through its frames, and they are named.
#[test]
fn backtraces_go_through_a_copy_loaded_late() {
    run(1, 1, &[("MEMLAB_COPIES_MODE", "late")]);
}

/// The first copy, which made the process's state and installed the
/// counting allocator, ran only on a thread that has exited; then it is
/// closed with `dlclose`. The other copy's tensors still go through that
/// allocator, so the first copy must stay loaded.
#[test]
fn the_first_copy_stays_loaded_when_closed() {
    run(1, 1, &[("MEMLAB_COPIES_MODE", "close-first")]);
}

/// A copy that set an output sink is closed with `dlclose`; the other
/// copy's `profile_every` then prints to that sink, whose code must still
/// be there.
#[test]
fn a_copy_whose_sink_is_set_stays_loaded_when_closed() {
    run(1, 1, &[("MEMLAB_COPIES_MODE", "close-sink")]);
}

/// A memlab of another anchor ABI (played by the first copy, whose anchor
/// claims version 99): the second keeps its own state, installs no second
/// counting allocator, and says so once, naming both versions.
#[test]
fn a_copy_of_another_abi_keeps_its_own_state_and_says_so_once() {
    let stderr = run(1, 1, &[("MEMLAB_TEST_ANCHOR_ABI", "99"), ("MEMLAB_COPIES_MODE", "foreign")]);
    let warning = "another memlab in this process (memlab-tch 0.1.0, anchor ABI 99) shares its state through an \
                   anchor this copy (memlab-tch 0.1.0, anchor ABI 1) cannot read";
    assert_eq!(stderr.matches(warning).count(), 1, "warned once:\n{stderr}");
}

/// One loaded copy: its C functions.
struct Copy {
    name: String,
    handle: usize,
    copies: extern "C" fn() -> u32,
    installed_at_load: extern "C" fn() -> i32,
    cpu_allocated: extern "C" fn() -> i64,
    tensor_new: extern "C" fn(i64) -> *mut c_void,
    tensor_free: unsafe extern "C" fn(*mut c_void),
    work: extern "C" fn(i64) -> i64,
    report: extern "C" fn() -> *mut c_char,
    record_start: extern "C" fn(i32) -> *mut c_void,
    record_stop: unsafe extern "C" fn(*mut c_void),
    allocations_of: extern "C" fn(u64) -> *mut c_char,
    frames_of: extern "C" fn(u64) -> *mut c_char,
    oom_arm: unsafe extern "C" fn(*const c_char) -> i32,
    oom_fail: extern "C" fn() -> i32,
    string_free: unsafe extern "C" fn(*mut c_char),
    sink_set: extern "C" fn() -> i32,
    sink_unset: extern "C" fn() -> i32,
    printed: extern "C" fn(i64) -> i64,
    from_allocator: unsafe extern "C" fn(*const c_void) -> i32,
    reported: extern "C" fn(i64) -> *mut c_char,
}

impl Copy {
    fn load(path: &Path) -> Copy {
        let c_path = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a path to a library of ours; RTLD_LOCAL, as notebooks load
        // their cells, so no copy sees another's symbols.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns the loader's last message.
            let why = unsafe { CStr::from_ptr(libc::dlerror()) }.to_string_lossy();
            panic!("dlopen {}: {why}", path.display());
        }
        let symbol = |name: &str| {
            let c_name = CString::new(name).unwrap();
            // SAFETY: a handle dlopen returned, and a C string.
            let found = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
            assert!(!found.is_null(), "{} exports {name}", path.display());
            found
        };
        macro_rules! symbol {
            ($name:literal) => {{
                let found = symbol($name);
                // SAFETY: the plugin exports the symbol as a function of the
                // type the field has (a pointer's size).
                unsafe { std::mem::transmute_copy(&found) }
            }};
        }
        Copy {
            name: path.file_stem().unwrap().to_string_lossy().into_owned(),
            handle: handle as usize,
            copies: symbol!("plugin_copies"),
            installed_at_load: symbol!("plugin_installed_at_load"),
            cpu_allocated: symbol!("plugin_cpu_allocated"),
            tensor_new: symbol!("plugin_tensor_new"),
            tensor_free: symbol!("plugin_tensor_free"),
            work: symbol!("plugin_work"),
            report: symbol!("plugin_report"),
            record_start: symbol!("plugin_record_start"),
            record_stop: symbol!("plugin_record_stop"),
            allocations_of: symbol!("plugin_allocations_of"),
            frames_of: symbol!("plugin_frames_of"),
            oom_arm: symbol!("plugin_oom_arm"),
            oom_fail: symbol!("plugin_oom_fail"),
            string_free: symbol!("plugin_string_free"),
            sink_set: symbol!("plugin_sink_set"),
            sink_unset: symbol!("plugin_sink_unset"),
            printed: symbol!("plugin_printed"),
            from_allocator: symbol!("plugin_from_allocator"),
            reported: symbol!("plugin_reported"),
        }
    }

    /// `dlclose` of the copy: the loader unloads it unless it is pinned.
    /// Its functions are not called after this.
    fn close(self) {
        // SAFETY: the handle dlopen returned, closed once.
        assert_eq!(unsafe { libc::dlclose(self.handle as *mut c_void) }, 0, "dlclose {}", self.name);
    }

    fn text(&self, text: *mut c_char) -> String {
        assert!(!text.is_null(), "{} returned a string", self.name);
        // SAFETY: a NUL-terminated string of the plugin's, freed once here.
        let out = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
        unsafe { (self.string_free)(text) };
        out
    }

    fn json(&self, text: *mut c_char) -> serde_json::Value {
        serde_json::from_str(&self.text(text)).unwrap()
    }
}

/// The function `name` of a report's JSON.
fn function<'a>(report: &'a serde_json::Value, name: &str) -> Vec<&'a serde_json::Value> {
    report["functions"].as_array().unwrap().iter().filter(|f| f["name"] == name).collect()
}

#[test]
fn host() {
    let Some(list) = std::env::var_os(HOST) else { return };
    let paths: Vec<PathBuf> = std::env::split_paths(&list).collect();
    let mode = std::env::var("MEMLAB_COPIES_MODE").unwrap_or_default();
    match mode.as_str() {
        "late" => return late(&paths),
        "close-first" => return close_first(&paths),
        "close-sink" => return close_sink(&paths),
        _ => {}
    }
    let copies: Vec<Copy> = paths.iter().map(|p| Copy::load(p)).collect();
    let n = copies.len() as u32;
    if mode == "foreign" {
        return foreign(&copies);
    }

    // One state: every copy counts the same copies, and the counting
    // allocator went in once, when the first copy loaded.
    for c in &copies {
        assert_eq!((c.copies)(), n, "{} sees every copy", c.name);
        assert_eq!((c.installed_at_load)(), 1, "{} sees the allocator installed at load", c.name);
    }

    // Exact figures through every copy: each copy makes a tensor of its own
    // size, and every copy reads the sum; each is freed by another copy.
    let base = (copies[0].cpu_allocated)();
    assert!(base >= 0);
    let mut held = Vec::new();
    let mut expected = 0i64;
    for (k, c) in copies.iter().enumerate() {
        let bytes = (1 << 20) + 4096 * k as i64;
        held.push((c.tensor_new)(bytes));
        expected += bytes;
        for other in &copies {
            assert_eq!((other.cpu_allocated)() - base, expected, "{} reads what {} made, exactly", other.name, c.name);
        }
    }
    for (k, tensor) in held.into_iter().enumerate() {
        let freeing = &copies[(k + 1) % copies.len()];
        // SAFETY: made by a copy's tensor_new, freed once.
        unsafe { (freeing.tensor_free)(tensor) };
        expected -= (1 << 20) + 4096 * k as i64;
        assert_eq!((copies[k].cpu_allocated)() - base, expected, "{} frees exactly", freeing.name);
    }

    // Every copy takes every copy's tensors for the counting allocator's,
    // whichever copy installed it (in a notebook, the first cell's), and its
    // reporter counts its own var store's weights as the allocator's.
    for c in &copies {
        for maker in &copies {
            let tensor = (maker.tensor_new)(4096);
            // SAFETY: made above, alive, freed once below.
            assert_eq!(
                unsafe { (c.from_allocator)(tensor) },
                1,
                "{} takes {}'s tensor for the allocator's",
                c.name,
                maker.name
            );
            unsafe { (c.tensor_free)(tensor) };
        }
        let reported = c.json((c.reported)(4 << 20));
        assert_eq!(reported, serde_json::json!({"named": 4 << 20, "external": 0}), "{}'s reporter", c.name);
    }

    // A profiled function called through some copies, reported by another:
    // every copy of plugin a but the last calls `work` once; each copy of a
    // carries its own site of it, and they are one table. Plugin b's report
    // shows it, and its own `work`, which ran nowhere, as never called.
    let a_copies: Vec<&Copy> = copies.iter().filter(|c| c.name.starts_with("plugin_a")).collect();
    let b_copies: Vec<&Copy> = copies.iter().filter(|c| c.name.starts_with("plugin_b")).collect();
    let callers = a_copies.len().max(2) - 1;
    for c in &a_copies[..callers] {
        assert_eq!((c.work)(3 << 20), 3 << 20);
    }
    for reader in [b_copies[b_copies.len() - 1], a_copies[a_copies.len() - 1]] {
        let report = reader.json((reader.report)());
        let a_work = function(&report, "memlab_plugin_a::work");
        assert_eq!(a_work.len(), 1, "{}'s report has plugin a's work once: {report}", reader.name);
        assert_eq!(a_work[0]["calls"], callers as u64, "{} counts every copy's calls", reader.name);
        let kept = a_work[0]["lines"].as_array().unwrap().iter().filter_map(|l| l["increment"].as_i64()).max().unwrap();
        assert_eq!(kept, 3 << 20, "the line that holds the tensor kept 3 MiB in every call");
        let b_work = function(&report, "memlab_plugin_b::work");
        assert_eq!(b_work.len(), 1, "{}'s report lists plugin b's work: {report}", reader.name);
        assert_eq!(b_work[0]["calls"], 0);
    }

    // A recording started through one copy sees what another allocates, with
    // the statement of the other's profiled function (the thread's statement
    // is one for every copy), and is stopped through a third.
    let recording = (a_copies[0].record_start)(0);
    assert!(!recording.is_null(), "the recording started");
    let b = b_copies[b_copies.len() - 1];
    let plain = (b.tensor_new)(777_777);
    // SAFETY: made above, freed once.
    unsafe { (copies[copies.len() - 1].tensor_free)(plain) };
    assert_eq!((b.work)(555_555), 555_555);
    let seen = a_copies[a_copies.len() - 1].json((a_copies[a_copies.len() - 1].allocations_of)(777_777));
    assert_eq!(seen, serde_json::json!([null]), "the recording saw b's allocation once, outside any profiled function");
    let seen = a_copies[0].json((a_copies[0].allocations_of)(555_555));
    assert_eq!(
        seen,
        serde_json::json!(["memlab_plugin_b::work"]),
        "the recording saw b's profiled allocation with its statement"
    );
    // SAFETY: started above, stopped once.
    unsafe { (b_copies[0].record_stop)(recording) };

    // One OOM report per failure: armed through one copy, failing through
    // others.
    let dir = std::env::var("MEMLAB_COPIES_OOM_DIR").unwrap();
    let c_dir = CString::new(dir.clone()).unwrap();
    // SAFETY: a C string.
    assert_eq!(unsafe { (a_copies[0].oom_arm)(c_dir.as_ptr()) }, 0);
    let failing = [b_copies[0], a_copies[a_copies.len() - 1]];
    for (i, c) in failing.iter().enumerate() {
        assert_eq!((c.oom_fail)(), 1, "{}'s 2^48-byte request failed", c.name);
        let texts = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "txt"))
            .count();
        assert_eq!(texts, i + 1, "one report per failure, after {}'s", c.name);
    }
    println!("host: every check passed with {n} copies");
}

/// The host's checks of backtraces through a copy loaded after the first
/// copy captured and resolved some: a notebook's later cells. Both copies'
/// frames are on the stack, and the host's own below them.
fn late(paths: &[PathBuf]) {
    let first = Copy::load(&paths[0]);
    let recording = (first.record_start)(1);
    assert!(!recording.is_null(), "the recording started");
    assert_eq!((first.work)(111_111), 111_111);
    // Inlined frames are named without their path; `guard`'s generic
    // arguments name the plugin's crate.
    let has = |frames: &serde_json::Value, function: &str| {
        frames[0].as_array().unwrap().iter().any(|f| f.as_str().unwrap().contains(function))
    };
    let frames = first.json((first.frames_of)(111_111));
    assert!(has(&frames, "memlab_plugin_a::plugin_work") && has(&frames, "late"), "before: {frames}");

    let second = Copy::load(&paths[1]);
    assert_eq!((second.work)(222_222), 222_222);
    let frames = first.json((first.frames_of)(222_222));
    assert!(
        has(&frames, "memlab_plugin_b::plugin_work"),
        "the first copy names the frames of a copy loaded after it resolved others: {frames}"
    );
    assert!(has(&frames, "late"), "the stack was walked through the later copy's frames: {frames}");
    // SAFETY: started above, stopped once.
    unsafe { (second.record_stop)(recording) };
    println!("host: every check passed with a copy loaded late");
}

/// The host's checks of a first copy closed after its thread exited: the
/// second copy still counts CPU tensors exactly, through the allocator the
/// first installed.
fn close_first(paths: &[PathBuf]) {
    let paths = paths.to_vec();
    // The first copy loads, makes the state and allocates on a thread that
    // then exits (taking its thread-locals, which would otherwise hold the
    // copy in place).
    let first = std::thread::spawn(move || {
        let first = Copy::load(&paths[0]);
        assert_eq!((first.work)(1 << 20), 1 << 20);
        (first, paths)
    });
    let (first, paths) = first.join().unwrap();
    let second = Copy::load(&paths[1]);
    assert_eq!((second.copies)(), 2);
    first.close();
    let base = (second.cpu_allocated)();
    let tensor = (second.tensor_new)(3 << 20);
    assert_eq!((second.cpu_allocated)() - base, 3 << 20, "the second copy counts through the first's allocator");
    // SAFETY: made above, freed once.
    unsafe { (second.tensor_free)(tensor) };
    assert_eq!((second.work)(1 << 20), 1 << 20);
    println!("host: every check passed with the first copy closed");
}

/// The host's checks of a copy closed after it set the output sink: the
/// other copy's `profile_every` report goes to that sink; setting the
/// output again through the remaining copy still works.
fn close_sink(paths: &[PathBuf]) {
    let first = Copy::load(&paths[0]);
    let second = Copy::load(&paths[1]);
    assert_eq!((second.sink_set)(), 0);
    second.close();
    assert_eq!((first.printed)(4096), 4096, "the report went to the closed copy's sink");
    assert_eq!((first.sink_unset)(), 0);
    assert_eq!((first.printed)(4096), 4096);
    println!("host: every check passed with the sink's copy closed");
}

/// The host's checks beside a memlab of another ABI: `copies[0]` made the
/// anchor (of ABI 99), `copies[1]` could not read it.
fn foreign(copies: &[Copy]) {
    let (first, other) = (&copies[0], &copies[1]);
    assert_eq!((first.copies)(), 1);
    assert_eq!((other.copies)(), 1, "the other copy joined nothing");
    assert_eq!((first.installed_at_load)(), 1);
    assert_eq!((other.installed_at_load)(), 0, "the other copy installed no second allocator");
    // The first copy's allocator counts every CPU tensor, exactly, whoever made it.
    let base = (first.cpu_allocated)();
    let tensor = (other.tensor_new)(1 << 20);
    assert_eq!((first.cpu_allocated)() - base, 1 << 20);
    assert_eq!((other.cpu_allocated)(), -1, "the other copy has no CPU figures of its own");
    // SAFETY: made above, freed once.
    unsafe { (other.tensor_free)(tensor) };
    assert_eq!((first.cpu_allocated)(), base);
    assert_eq!((other.work)(1 << 10), 1 << 10, "the other copy still runs its code");
    println!("host: every check passed beside another ABI");
}
