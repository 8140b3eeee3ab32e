//! The `memlab` command as a user runs it: the binary, its output and its
//! exit code, on real snapshots (fixtures/) and on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

fn memlab(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memlab")).args(args).output().expect("memlab runs")
}

fn stdout(output: &Output) -> String {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&stdout(&memlab(args))).unwrap()
}

fn temp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memlab-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The peak of allocated bytes computed another way than the tool's replay:
/// the level before the first event walked back from the final segments
/// (their live blocks' requested sizes less every alloc and free), then the
/// running sum's maximum. Reads the pickle with memlab-core's reader.
fn peak_by_walking_back(name: &str) -> (u64, u64) {
    use memlab_core::events::Action;
    use memlab_core::export::{BlockState, Snapshot};
    let s = Snapshot::read_pickle(fixture(name)).unwrap().snapshot;
    let trace = &s.device_traces[0];
    let release = if trace.iter().any(|e| e.action == Action::FreeCompleted) {
        Action::FreeCompleted
    } else {
        Action::FreeRequested
    };
    let delta = |a: Action, size: u64| -> i64 {
        if a == Action::Alloc {
            size as i64
        } else if a == release {
            -(size as i64)
        } else {
            0
        }
    };
    let end: i64 = s
        .segments
        .iter()
        .filter(|seg| seg.device == 0)
        .flat_map(|seg| &seg.blocks)
        .filter(|b| b.state != BlockState::Inactive)
        .map(|b| b.requested_size as i64)
        .sum();
    let net: i64 = trace.iter().map(|e| delta(e.action, e.size)).sum();
    let mut level = end - net;
    let (mut peak, mut at) = (level, 0);
    for (i, e) in trace.iter().enumerate() {
        level += delta(e.action, e.size);
        if level > peak {
            (peak, at) = (level, i + 1);
        }
    }
    (peak as u64, at as u64)
}

#[test]
fn summary_of_pytorch_snapshots_agrees_with_an_independent_walk() {
    for name in ["mlp.pickle", "convnet.pickle", "transformer.pickle", "leaky.pickle", "fixed.pickle"] {
        let summary = json(&["summary", fixture(name).to_str().unwrap(), "--json"]);
        let device = &summary["devices"][0];
        assert_eq!(device["device"], "cuda:0", "{name}");
        let (peak, at) = peak_by_walking_back(name);
        assert_eq!(device["peak"]["allocated"], peak, "{name}");
        assert_eq!(device["peak"]["event"], at, "{name}");
        // What was live at the peak adds up to it, by category and by site.
        for key in ["by_category", "by_site"] {
            let sum: u64 = device[key].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
            assert_eq!(sum, peak, "{name} {key}");
        }
        assert_eq!(device["partial"].as_array().unwrap().len(), 0, "{name}: {}", device["partial"]);
        assert_eq!(summary["writer"], "pytorch");
        // PyTorch's keys the model has no place for are counted.
        assert!(summary["ignored"]["device_traces[][].user_metadata"].as_u64().unwrap() > 0, "{name}");
    }
}

#[test]
fn summary_text_names_the_peak_and_its_sites() {
    let text = stdout(&memlab(&["summary", fixture("leaky.pickle").to_str().unwrap()]));
    for line in [
        "memlab summary: ",
        "PyTorch's snapshot, pickle protocol 4; 1005 keys read past", // allocator_settings is read (replays)
        "cuda:0: 487 events over 0.036s",
        "peak allocated         98.17M  at +0.035s (event 481)",
        "reserved then         108.00M  9.83M of it not allocated (9% of reserved)",
        "The history is complete",
        "16.08M      24    16%  leaky_or_fixed (fixtures/make_snapshots.py:79)",
        "(allocated before the history began)",
    ] {
        assert!(text.contains(line), "{line:?} in\n{text}");
    }
}

#[test]
fn every_pickle_protocol_summarises_the_same() {
    let strip = |mut v: serde_json::Value| {
        v.as_object_mut().unwrap().remove("file");
        v.as_object_mut().unwrap().remove("protocol");
        v
    };
    let p4 = json(&["summary", fixture("mlp.pickle").to_str().unwrap(), "--json"]);
    for other in ["mlp_protocol2.pickle", "mlp_protocol5.pickle"] {
        let o = json(&["summary", fixture(other).to_str().unwrap(), "--json"]);
        assert_eq!(strip(o), strip(p4.clone()), "{other}");
    }
}

#[test]
fn summary_of_memlabs_own_snapshot_has_categories() {
    let summary = json(&["summary", fixture("memlab_cpu.pickle").to_str().unwrap(), "--json"]);
    assert_eq!(summary["writer"], "memlab");
    let cpu = summary["devices"].as_array().unwrap().iter().find(|d| d["device"] == "cpu").unwrap();
    assert!(cpu["reserved_peak"].is_null() && cpu["peak"]["reserved"].is_null());
    let categories: Vec<&str> =
        cpu["by_category"].as_array().unwrap().iter().map(|c| c["category"].as_str().unwrap()).collect();
    for c in ["parameter", "gradient", "optimizer_state"] {
        assert!(categories.contains(&c), "{categories:?}");
    }
    let sum: u64 = cpu["by_site"].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    assert_eq!(cpu["peak"]["allocated"], sum);
    assert_eq!(cpu["partial"].as_array().unwrap().len(), 0);
    assert!(summary["ignored"].as_object().unwrap().is_empty());
}

#[test]
fn summary_of_memlabs_cuda_snapshot_agrees_with_the_walk_and_the_program() {
    let summary = json(&["summary", fixture("memlab_cuda.pickle").to_str().unwrap(), "--json"]);
    assert_eq!((summary["writer"].as_str(), summary["run"]["libtorch"].as_str()), (Some("memlab"), Some("2.11.0")));
    let cuda = &summary["devices"][0];
    assert_eq!(cuda["device"], "cuda:0");
    let (peak, at) = peak_by_walking_back("memlab_cuda.pickle");
    assert_eq!((&cuda["peak"]["allocated"], &cuda["peak"]["event"]), (&peak.into(), &at.into()));
    // The program's own report, from the allocator's counters, printed
    // "cuda:0: peak 76.70M allocated" for this run.
    assert_eq!(peak, 80_425_120);
    // Reserved at the end: the final segments, every byte.
    let s = memlab_core::export::Snapshot::read_pickle(fixture("memlab_cuda.pickle")).unwrap().snapshot;
    let reserved: u64 = s.segments.iter().filter(|seg| seg.device == 0).map(|seg| seg.total_size).sum();
    assert_eq!(cuda["end"]["reserved"], reserved);
    assert_eq!(cuda["partial"].as_array().unwrap().len(), 0);
}

#[test]
fn a_partial_memlab_history_says_so() {
    use memlab_core::events::Action;
    use memlab_core::export::{Snapshot, SnapshotInfo, TraceEntry};
    let entry = |action, addr, size| TraceEntry {
        action,
        addr: Some(addr),
        size,
        stream: 0,
        time_us: addr,
        frames: std::sync::Arc::from(Vec::new()),
        category: None,
        tensor: None,
        device_free: None,
    };
    // The history lost the allocation of block 64: it frees it unseen.
    let snapshot = Snapshot {
        segments: vec![],
        device_traces: vec![vec![entry(Action::FreeRequested, 64, 100), entry(Action::Alloc, 128, 40)]],
        allocator_settings: None,
        memlab: Some(SnapshotInfo {
            devices: vec!["cpu".into()],
            partial: true,
            dropped: 5,
            recorded: 7,
            run: None,
            device_memory: Vec::new(),
            profile: None,
            ops: None,
            unseen_before: Vec::new(),
            prediction_inputs: None,
        }),
    };
    let path = temp("partial.pickle");
    snapshot.write_pickle(&path).unwrap();
    let summary = json(&["summary", path.to_str().unwrap(), "--json"]);
    let cpu = &summary["devices"][0];
    let partial: Vec<&str> = cpu["partial"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert!(partial[0].contains("dropped 5 of its 7 events"), "{partial:?}");
    assert!(partial[1].contains("frees 1 block(s) (100 bytes) it never saw allocated"), "{partial:?}");
    // The replay ends with 40 bytes; the file's segments hold none: said too.
    assert!(partial[2].contains("ends with 40 bytes allocated where the final segments hold 0"), "{partial:?}");
    assert_eq!((cpu["before"]["bytes"].as_u64(), cpu["peak"]["allocated"].as_u64()), (Some(100), Some(100)));
    let text = stdout(&memlab(&["summary", path.to_str().unwrap()]));
    assert!(text.contains("Partial history: memlab's recording dropped 5 of its 7 events"), "{text}");
}

#[test]
fn bad_input_gets_one_clear_line_and_exit_code_2() {
    let leaky = std::fs::read(fixture("leaky.pickle")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty.pickle", vec![], "the file is empty"),
        ("truncated.pickle", leaky[..leaky.len() / 2].to_vec(), "truncated: the pickle ends at byte"),
        ("text.pickle", b"segments,device_traces\n1,2\n".to_vec(), "not a pickle"),
        // pickle.dumps({"a": 1}, protocol=4)
        (
            "other.pickle",
            b"\x80\x04\x95\x0a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s.".to_vec(),
            "no `segments` or no `device_traces`",
        ),
        // pickle.dumps(collections.OrderedDict(), protocol=4): builds an object.
        (
            "object.pickle",
            b"\x80\x04\x95\x22\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94.".to_vec(),
            "refused: the pickle builds objects (STACK_GLOBAL at byte 39)",
        ),
        ("cut.pickle.gz", b"\x1f\x8b\x08\x00".to_vec(), "it is gzipped but does not decompress"),
    ];
    let mut inputs: Vec<(String, String)> = cases
        .into_iter()
        .map(|(name, bytes, why)| {
            let path = temp(name);
            std::fs::write(&path, bytes).unwrap();
            (path.to_str().unwrap().to_string(), why.to_string())
        })
        .collect();
    inputs.push((std::env::temp_dir().to_str().unwrap().to_string(), "is a directory".into()));
    inputs.push((temp("missing.pickle").to_str().unwrap().to_string(), "no such file".into()));
    // Files of memlab's other formats are named for what they are.
    for (name, what) in [
        ("memlab_trace_rank0.json", "it is the trace JSON, not a snapshot"),
        ("memlab_oom_rank1.json", "it is an out-of-memory report's JSON, not a snapshot"),
        ("golden/monitor_variables.csv", "it is the training monitor's variables CSV, not a snapshot"),
    ] {
        inputs.push((fixture(name).to_str().unwrap().to_string(), what.into()));
    }
    let page = temp("bad.html");
    let (page, good) = (page.to_str().unwrap(), fixture("leaky.pickle"));
    let good = good.to_str().unwrap();
    for (path, why) in inputs {
        let p = path.as_str();
        for args in [
            vec!["summary", p],
            vec!["summary", p, "--json"],
            vec!["view", p, "-o", page],
            vec!["diff", good, p],
            vec!["diff", p, good, "--json"],
        ] {
            let out = memlab(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(out.stdout.is_empty(), "{args:?}");
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(err.starts_with(&format!("memlab: cannot read {path}: ")) && err.contains(&why), "{args:?}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

#[path = "../../tests/common/chromium.rs"]
#[allow(dead_code)]
mod chromium;

/// Opens `path` in headless Chromium: no console errors, no content
/// security policy violations; returns the page's text.
fn look_at(path: &Path) -> Option<String> {
    let mut browser = chromium::Browser::launch(1100, 900)?;
    let mut page = browser.open(&format!("file://{}", path.display()));
    assert_eq!(page.console_errors(), Vec::<String>::new(), "no console errors or CSP violations");
    Some(page.eval("document.body.innerText").as_str().unwrap_or_default().to_string())
}

#[test]
fn diff_of_the_leaky_and_the_fixed_run_names_the_leaking_line_first() {
    let (fixed, leaky) = (fixture("fixed.pickle"), fixture("leaky.pickle"));
    let diff = json(&["diff", fixed.to_str().unwrap(), leaky.to_str().unwrap(), "--json"]);
    let device = &diff["devices"][0];
    let first = &device["sites"][0];
    assert_eq!(first["name"], "leaky_or_fixed (fixtures/make_snapshots.py:79)", "{first}");
    assert_eq!(first["kind"], "grown");
    // The change is B's bytes less A's, as each run's summary gives them.
    let at = |file: &Path, site: &str| -> u64 {
        let s = json(&["summary", file.to_str().unwrap(), "--json"]);
        s["devices"][0]["by_site"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["site"]["line"] == 79 && x["site"]["function"] == site)
            .map_or(0, |x| x["bytes"].as_u64().unwrap())
    };
    let (a, b) = (at(&fixed, "leaky_or_fixed"), at(&leaky, "leaky_or_fixed"));
    assert_eq!((first["a"]["bytes"].as_u64(), first["b"]["bytes"].as_u64()), (Some(a), Some(b)));
    assert_eq!(first["change"].as_i64(), Some(b as i64 - a as i64));
    let peak =
        |file: &Path| json(&["summary", file.to_str().unwrap(), "--json"])["devices"][0]["peak"]["allocated"].clone();
    assert_eq!((&device["peak"]["a"], &device["peak"]["b"]), (&peak(&fixed), &peak(&leaky)));
    // The other way round, the same line first, shrunk.
    let back = json(&["diff", leaky.to_str().unwrap(), fixed.to_str().unwrap(), "--json"]);
    assert_eq!(back["devices"][0]["sites"][0]["name"], first["name"]);
    assert_eq!(back["devices"][0]["sites"][0]["kind"], "shrunk");
    // Text, and a page that passes the browser's checks.
    let html = temp("diff.html");
    let text =
        stdout(&memlab(&["diff", fixed.to_str().unwrap(), leaky.to_str().unwrap(), "--html", html.to_str().unwrap()]));
    assert!(text.contains("+13.07M    3.01M  16.08M  grown  leaky_or_fixed (fixtures/make_snapshots.py:79)"), "{text}");
    if let Some(page) = look_at(&html) {
        assert!(page.contains("leaky_or_fixed (fixtures/make_snapshots.py:79)"), "{page}");
    }
}

#[test]
fn view_writes_one_page_that_passes_the_browsers_checks() {
    for name in ["leaky.pickle", "memlab_cpu.pickle"] {
        let html = temp(&format!("{name}.html"));
        let out = json(&["view", fixture(name).to_str().unwrap(), "-o", html.to_str().unwrap(), "--json"]);
        assert_eq!(out["page"], html.to_str().unwrap());
        let page = std::fs::read_to_string(&html).unwrap();
        assert_eq!(out["bytes"].as_u64(), Some(page.len() as u64));
        assert!(page.starts_with("<!DOCTYPE html>") && page.contains("Content-Security-Policy"), "a whole page");
        assert!(!page.contains("<script"), "no script");
        for part in ["memory over time", "live at the peak, by call stack"] {
            assert!(page.contains(part), "{name}: {part}");
        }
        if name == "leaky.pickle" {
            // PyTorch's files lack memlab's parts: one line says so.
            assert!(page.contains("Not in this file") && page.contains("PyTorch&#39;s snapshots do not carry them"));
            assert!(!page.contains("named at export") && !page.contains("Line profile"));
        } else {
            // memlab's carry the names, the line profile and libtorch's version.
            assert!(!page.contains("Not in this file"), "{name}");
            assert!(page.contains("model.fc1.weight (named at export)"), "the walk's names");
            assert!(page.contains("Line profile") && page.contains("history.push(logits);"), "the profile");
            assert!(page.contains("(libtorch 2.11.0"), "the version");
        }
        if let Some(text) = look_at(&html) {
            assert!(text.contains("peak allocated"), "{text}");
        }
    }
}

#[test]
fn synthetic_snapshots_read_as_pytorch_reads_them() {
    // The generator is this package's example; cargo builds it for the tests.
    let deps = std::env::current_exe().unwrap();
    let synth = deps.parent().unwrap().parent().unwrap().join("examples/synthetic_snapshot");
    assert!(synth.exists(), "{} is built by cargo test", synth.display());
    let path = temp("synthetic.pickle");
    let args = [path.to_str().unwrap(), "--size", "1M", "--seed", "3", "--native"];
    let out = Command::new(&synth).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = json(&["summary", path.to_str().unwrap(), "--json"]);
    let device = &summary["devices"][0];
    assert_eq!(device["partial"].as_array().unwrap().len(), 0, "{}", device["partial"]);
    // Its native frames (`--native`) fold away: every site is a frame of the model's own.
    let sites = device["by_site"].as_array().unwrap();
    assert!(sites.iter().filter_map(|s| s["site"]["file"].as_str()).all(|f| f.contains("project/model/")), "{sites:?}");
    assert_eq!(summary["writer"], "pytorch");
    // PyTorch's own reader, where the project's venv has torch.
    let Some(venv) = std::env::var_os("MEMLAB_VENV") else {
        assert!(std::env::var_os("CI").is_none(), "CI runs the tests with scripts/env.sh's MEMLAB_VENV");
        eprintln!("skipped: MEMLAB_VENV is not set (source scripts/env.sh) to run torch.cuda._memory_viz");
        return;
    };
    let python = Path::new(&venv).join("bin/python3");
    let out = Command::new(&python)
        .args(["-m", "torch.cuda._memory_viz", "stats", path.to_str().unwrap()])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let segments = summary_segments(&path);
    assert!(stdout.contains(&format!("segments: {segments}")), "{stdout}");
}

/// How many segments memlab's reader finds in `path`.
fn summary_segments(path: &Path) -> usize {
    memlab_core::export::Snapshot::read_pickle(path).unwrap().snapshot.segments.len()
}

#[test]
fn merge_of_two_ranks_marks_the_higher_peak_and_what_differed() {
    // PyTorch's files, ranks from their names: the leaky run as rank 0.
    let (r0, r1) = (temp("snapshot_rank0.pickle"), temp("snapshot_rank1.pickle"));
    std::fs::copy(fixture("leaky.pickle"), &r0).unwrap();
    std::fs::copy(fixture("fixed.pickle"), &r1).unwrap();
    let out = temp("merged");
    let (r0, r1, dir) = (r0.to_str().unwrap(), r1.to_str().unwrap(), out.to_str().unwrap());
    let merged = json(&["merge", r1, r0, "-o", dir, "--json"]);
    let ranks = merged["ranks"].as_array().unwrap();
    assert_eq!((ranks[0]["rank"].as_u64(), ranks[1]["rank"].as_u64()), (Some(0), Some(1)), "rank order");
    // Each peak is the one `summary` finds; the higher marked.
    let peak = |file: &str| json(&["summary", file, "--json"])["devices"][0]["peak"]["allocated"].clone();
    let device = |r: usize| ranks[r]["devices"][0].clone();
    assert_eq!((device(0)["allocated"].clone(), device(1)["allocated"].clone()), (peak(r0), peak(r1)));
    assert_eq!((device(0)["highest"].as_bool(), device(1)["highest"].as_bool()), (Some(true), Some(false)));
    assert_eq!(merged["ooms"].as_array().unwrap().len(), 0);
    // The leaking line differs most between the ranks at their peaks.
    let page = std::fs::read_to_string(out.join("merged.html")).unwrap();
    let sites = &page[page.find("cuda:0, by site").unwrap()..];
    let first_row = sites.split("</tr>").nth(1).unwrap();
    assert!(first_row.contains("13.07M") && first_row.contains("make_snapshots.py:79"), "{first_row}");
    if let Some(text) = look_at(&out.join("merged.html")) {
        assert!(text.contains("highest") && text.contains("rank 1"), "{text}");
    }
    // The trace: a process per rank, PyTorch's wall-clock times on one axis from zero.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("merged_trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let names: Vec<&str> =
        events.iter().filter(|e| e["name"] == "process_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["rank 0", "rank 1"]);
    let first = events.iter().filter_map(|e| e["ts"].as_f64()).fold(f64::MAX, f64::min);
    assert_eq!(first, 0.0, "the earliest event is the axis's zero");

    // --offset moves one rank by exactly that.
    let shifted = json(&["merge", r0, r1, "-o", dir, "--json", "--offset", "1=250000"]);
    let at = |m: &serde_json::Value| m["ranks"][1]["devices"][0]["at_us"].as_i64().unwrap();
    assert_eq!(at(&shifted) - at(&merged), 250_000);
    assert_eq!(shifted["ranks"][1]["offset_us"], 250_000);
}

/// The value of `attribute` in each element of `page` that starts with
/// `element` (`<line class="oom"`).
fn attributes<'a>(page: &'a str, element: &str, attribute: &str) -> Vec<&'a str> {
    page.split(element)
        .skip(1)
        .map(|rest| {
            let at = rest.find(&format!(" {attribute}=\"")).expect("the attribute is there") + attribute.len() + 3;
            &rest[at..at + rest[at..].find('"').unwrap()]
        })
        .collect()
}

#[test]
fn merge_pairs_each_ranks_own_gpu_and_marks_the_failure_where_it_happened() {
    // Two ranks on a host with two H100s, rank N on cuda:N, the last one out
    // of memory at the end: PyTorch's snapshots, then memlab's own files.
    let pytorch = ["snapshot_rank0.pickle", "snapshot_rank1.pickle"];
    let memlab = [
        "memlab_snapshot_rank0.pickle",
        "memlab_snapshot_rank1.pickle",
        "memlab_trace_rank0.json",
        "memlab_trace_rank1.json",
        "memlab_oom_rank1.json",
    ];
    for (name, files, row, bytes) in [
        ("pytorch", &pytorch[..], "make_snapshots.py:113)", ["37.00M", "33.00M"]),
        ("memlab", &memlab[..], "ranks.rs:53)", ["4.00M", "2.00M"]),
    ] {
        let out = temp(&format!("merged-gpus-{name}"));
        let paths: Vec<String> =
            files.iter().map(|f| fixture(&format!("ranks/{f}")).to_string_lossy().into_owned()).collect();
        let mut args: Vec<&str> = vec!["merge"];
        args.extend(paths.iter().map(String::as_str));
        args.extend(["-o", out.to_str().unwrap(), "--json"]);
        let merged = json(&args);
        let ooms = merged["ooms"].as_array().unwrap();
        assert_eq!(ooms.len(), 1, "{name}: {ooms:?}");
        assert_eq!((ooms[0]["rank"].as_u64(), ooms[0]["device"].as_str()), (Some(1), Some("cuda:1")));
        let page = std::fs::read_to_string(out.join("merged.html")).unwrap();
        // Rank 0's cuda:0 pairs with rank 1's cuda:1: one table, both
        // ranks' bytes on a row, no table of a device by its name alone.
        let heading = "GPU: rank 0 on cuda:0, rank 1 on cuda:1, by site</h3>";
        let sites = &page[page.find(heading).unwrap_or_else(|| panic!("{name}: no paired table"))..];
        let line = sites.split("</tr>").find(|r| r.contains(row)).unwrap();
        assert!(bytes.iter().all(|b| line.contains(b)), "{name}: {line}");
        assert!(!page.contains("<h3>cuda:0,") && !page.contains("<h3>cuda:1,"), "{name}");
        // The failure is marked on rank 1's drawing, inside the axis.
        let drawings = attributes(&page, "<svg class=\"timeline", "aria-label");
        assert_eq!(drawings.len(), 2, "{name}: the two GPUs, no CPU of 8 bytes: {drawings:?}");
        assert!(drawings[0].ends_with("cuda:0") && drawings[1].ends_with("cuda:1"), "{drawings:?}");
        let oom = attributes(&page, "<line class=\"oom\"", "x1");
        assert_eq!(oom.len(), 1, "{name}");
        let x: f64 = oom[0].parse().unwrap();
        assert!((0.0..=1000.0).contains(&x), "{name}: the failure at {x} of the plot's 1000");
        assert!(page[page.find("cuda:1\"").unwrap()..].contains("<line class=\"oom\""), "on rank 1's drawing");
        if let Some(text) = look_at(&out.join("merged.html")) {
            assert!(text.contains("out of memory:"), "{name}: the mark's label shows");
        }
    }
}

#[test]
fn merge_refuses_what_it_cannot_place_with_one_line() {
    let text = temp("notes.json");
    std::fs::write(&text, "{\"a\": 1}").unwrap();
    let garbage = temp("garbage.bin");
    std::fs::write(&garbage, "not json").unwrap();
    let leaky = fixture("leaky.pickle");
    let (leaky, dir) = (leaky.to_str().unwrap(), temp("merge-bad"));
    let dir = dir.to_str().unwrap();
    for (args, why) in [
        (vec![text.to_str().unwrap()], "a JSON object without their keys"),
        (vec![garbage.to_str().unwrap()], "none of the formats memlab reads; give "),
        (vec![leaky, "--offset", "1"], "write RANK=MICROSECONDS"),
        (vec![leaky, "--offset", "4=10"], "no file is of rank 4"),
        (vec![leaky, "/no/such/file.pickle"], "no such file"),
    ] {
        let mut all = vec!["merge", "-o", dir];
        all.extend(args.iter().copied());
        let out = memlab(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{all:?}: {err}");
        assert!(err.contains(why), "{all:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{all:?}: {err}");
    }
}

#[test]
fn merge_tells_processes_on_one_gpu_apart_and_keeps_a_process_on_two() {
    use memlab_core::events::Action;
    use memlab_core::export::{Snapshot, SnapshotInfo, TraceEntry};
    use memlab_core::run::{DeviceId, RunInfo};
    let entry = |action, addr, size, time_us| TraceEntry {
        action,
        addr: Some(addr),
        size,
        stream: 0,
        time_us,
        frames: std::sync::Arc::from(Vec::new()),
        category: None,
        tensor: None,
        device_free: None,
    };
    let gpu = |i: usize, uuid: &str| DeviceId { device: format!("cuda:{i}"), uuid: Some(uuid.into()) };
    let write = |name: &str, pid: u32, zero: u64, devices: Vec<DeviceId>, traces: Vec<Vec<TraceEntry>>| {
        let mut names: Vec<String> = devices.iter().map(|d| d.device.clone()).collect();
        names.push("cpu".into());
        let run = RunInfo { pid, host: Some("node".into()), clock_zero_unix_us: zero, devices, ..RunInfo::default() };
        let snapshot = Snapshot {
            segments: vec![],
            device_traces: traces,
            allocator_settings: None,
            memlab: Some(SnapshotInfo {
                devices: names,
                partial: false,
                dropped: 0,
                recorded: 0,
                run: Some(run),
                device_memory: Vec::new(),
                profile: None,
                ops: None,
                unseen_before: Vec::new(),
                prediction_inputs: None,
            }),
        };
        let path = temp(name);
        snapshot.write_pickle(&path).unwrap();
        path.to_str().unwrap().to_string()
    };
    // Process 100 drives two GPUs; process 200 shares the first (same UUID),
    // its clock started 100 µs later.
    let a = write(
        "a.pickle",
        100,
        1_000_000_000,
        vec![gpu(0, "GPU-x"), gpu(1, "GPU-y")],
        vec![
            vec![entry(Action::Alloc, 64, 1000, 10), entry(Action::FreeRequested, 64, 1000, 20)],
            vec![entry(Action::Alloc, 64, 3000, 15), entry(Action::FreeRequested, 64, 3000, 25)],
            vec![],
        ],
    );
    let b = write(
        "b.pickle",
        200,
        1_000_000_100,
        vec![gpu(0, "GPU-x")],
        vec![vec![entry(Action::Alloc, 64, 2000, 5), entry(Action::FreeRequested, 64, 2000, 30)], vec![]],
    );
    let dir = temp("merge-gpus");
    let merged = json(&["merge", &b, &a, "-o", dir.to_str().unwrap(), "--json"]);
    let ranks = merged["ranks"].as_array().unwrap();
    let labels: Vec<&str> = ranks.iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["pid 100 (node, cuda:0, cuda:1)", "pid 200 (node, cuda:0)"]);
    let peak = |r: usize, d: usize| {
        let d = &ranks[r]["devices"][d];
        (
            d["device"].as_str().unwrap(),
            d["uuid"].as_str().unwrap(),
            d["allocated"].as_u64().unwrap(),
            d["at_us"].as_i64().unwrap(),
            d["highest"].as_bool().unwrap(),
        )
    };
    // On one axis from process 100's first event: 200's clock zero is 100 µs later.
    assert_eq!(peak(0, 0), ("cuda:0", "GPU-x", 1000, 0, false));
    assert_eq!(peak(0, 1), ("cuda:1", "GPU-y", 3000, 5, true));
    assert_eq!(peak(1, 0), ("cuda:0", "GPU-x", 2000, 95, false));
    assert_eq!(merged["origin_unix_us"], 1_000_000_010);
}

// ---------------------------------------------------------------------------
// memlab replay

#[test]
fn replay_reproduces_the_recording_and_says_which_setting_avoids_its_error() {
    // PyTorch's recording, on an H100, of a fragmentation error under a
    // 1.5 GiB memory fraction (scripts/replay_fixtures.py); its run under
    // max_split_size_mb:128 did not fail (fixtures/replay/results.jsonl).
    let path = fixture("replay/fragmentation__default.pickle");
    let args = ["replay", path.to_str().unwrap(), "--total", "85017493504", "--fraction", "0.01894448624181354"];
    let mut with_compare = args.to_vec();
    with_compare.extend(["--compare", "--json"]);
    let out = json(&with_compare);
    let device = &out["devices"][0];
    assert_eq!(device["device"], "cuda:0");
    assert_eq!(device["segment_events"], device["segment_events_matched"], "{device}");
    assert_eq!(device["ooms"].as_array().unwrap().len(), 1, "the recorded error, replayed");
    assert_eq!(device["ooms"][0]["oom"]["requested"], 600u64 << 20);
    let replays = device["replays"].as_array().unwrap();
    let by_settings = |s: &str| replays.iter().find(|r| r["settings"].as_str().unwrap().starts_with(s)).unwrap();
    assert!(by_settings("max_split_size_mb:128")["ooms"].as_array().unwrap().is_empty());
    assert_eq!(by_settings("max_split_size_mb:128")["peak_reserved"], 1534u64 << 20, "the GPU's peak under it");
    assert!(!by_settings("expandable_segments:True,").is_null());
    assert_eq!(by_settings("expandable_segments:True,")["ooms"].as_array().unwrap().len(), 1);
    // The text says it as a table, labelled a replay.
    let mut text_args = args.to_vec();
    text_args.extend(["--setting", "max_split_size_mb:128"]);
    let text = stdout(&memlab(&text_args));
    assert!(text.contains("figures replayed, not measured"), "{text}");
    assert!(text.contains("the allocator may hold 1.50G"), "{text}");
    assert!(text.contains("max_split_size_mb:128") && text.contains("no: avoids the recorded error"), "{text}");
    assert!(text.contains("made 1 of the allocator's 1 segment events"), "{text}");
}

#[test]
fn a_snapshot_that_says_its_devices_memory_replays_without_flags() {
    use memlab_core::export::{DeviceMemory, Snapshot, SnapshotInfo};
    // The fragmentation recording, given the memory and fraction memlab's
    // own snapshots record: the replay needs no --total or --fraction, and
    // gives what the flags gave.
    let path = fixture("replay/fragmentation__default.pickle");
    let mut file = Snapshot::read_pickle(&path).unwrap();
    file.snapshot.memlab = Some(SnapshotInfo {
        devices: vec!["cuda:0".into()],
        partial: false,
        dropped: 0,
        recorded: 0,
        run: None,
        device_memory: vec![DeviceMemory {
            device: "cuda:0".into(),
            total: 85_017_493_504,
            memory_fraction: 0.01894448624181354,
        }],
        profile: None,
        ops: None,
        unseen_before: Vec::new(),
        prediction_inputs: None,
    });
    let written = temp("fragmentation_with_memory.pickle");
    file.snapshot.write_pickle(&written).unwrap();
    let with_flags = json(&[
        "replay",
        path.to_str().unwrap(),
        "--total",
        "85017493504",
        "--fraction",
        "0.01894448624181354",
        "--json",
    ]);
    let from_file = json(&["replay", written.to_str().unwrap(), "--json"]);
    assert_eq!(from_file["devices"], with_flags["devices"]);
    let assumed = from_file["assumptions"].to_string();
    assert!(!assumed.contains("memory") && !assumed.contains("reserve"), "{assumed}");
    // The flags still win over the file.
    let halved = json(&["replay", written.to_str().unwrap(), "--fraction", "0.5", "--json"]);
    assert_eq!(halved["devices"][0]["memory_fraction"], 0.5);
    assert!(halved["devices"][0]["ooms"].as_array().unwrap().is_empty(), "{halved}");
}

#[test]
fn a_cpu_recording_predicts_the_cuda_run_and_whether_it_fits() {
    // The MLP's CPU run (examples/fit_models.rs), which watched its ops; its
    // CUDA run on an H100 peaked at 1,430,257,664 bytes reserved and
    // 1,293,822,464 allocated (fixtures/fit/cuda_peaks.jsonl).
    let path = fixture("fit/mlp_1024_cpu.pickle");
    let path = path.to_str().unwrap();
    let out = json(&["replay", path, "--as-cuda", "--json"]);
    let predicted = &out["settings"][0];
    assert_eq!(predicted["settings"], "");
    assert_eq!(predicted["peak_reserved"], 1_430_257_664u64, "{predicted}");
    let allocated = predicted["peak_allocated"].as_f64().unwrap();
    assert!((allocated / 1_293_822_464.0 - 1.0).abs() < 0.005, "{predicted}");
    assert_eq!(out["kernels"]["staged"], 16, "the bias gradients' sums of its four steps: {out}");
    assert_eq!(
        predicted["peak_device"].as_u64().unwrap(),
        predicted["peak_reserved"].as_u64().unwrap() + out["additions"]["outside_allocator"].as_u64().unwrap()
    );
    // On an 80 GiB card it fits; on a 1 GiB card it does not, by how much.
    let text = stdout(&memlab(&["replay", path, "--as-cuda", "--capacity", "80G"]));
    assert!(text.contains("Every figure is an estimate") && text.contains("fits, 77."), "{text}");
    let text =
        stdout(&memlab(&["replay", path, "--as-cuda", "--capacity", "1G", "--setting", "expandable_segments:True"]));
    assert!(text.contains("expandable_segments:True") && text.contains("does not fit: runs out at +"), "{text}");
    assert!(text.contains("stage through a buffer (the largest 32.00M)"), "{text}");
    assert!(text.contains("Not modelled: ops whose CUDA kernels allocate otherwise"), "{text}");
    // A CUDA recording has no CPU run to predict from; a CPU one points here.
    let cuda = fixture("replay/mlp__default.pickle");
    let output = memlab(&["replay", cuda.to_str().unwrap(), "--as-cuda"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("record the step on the CPU"));
    let output = memlab(&["replay", fixture("memlab_cpu.pickle").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&output.stderr).contains("--as-cuda"));
}

#[test]
fn the_predicted_history_replays_to_the_prediction() {
    // `--history` writes the CUDA history the prediction replays: replayed
    // as a recording, it gives the prediction's own peaks.
    let path = fixture("fit/mlp_1024_cpu.pickle");
    let path = path.to_str().unwrap();
    let out = std::env::temp_dir().join(format!("memlab_history_{}.pickle", std::process::id()));
    let predicted = json(&["replay", path, "--as-cuda", "--json", "--history", out.to_str().unwrap()]);
    let replayed = json(&["replay", out.to_str().unwrap(), "--json"]);
    let _ = std::fs::remove_file(&out);
    let device = &replayed["devices"][0];
    assert_eq!(device["device"], "cuda:0", "{replayed}");
    assert_eq!(device["peak_reserved"], predicted["settings"][0]["peak_reserved"], "{replayed}");
    assert_eq!(device["peak_allocated"], predicted["settings"][0]["peak_allocated"], "{replayed}");
    // Without --as-cuda there is no prediction to write.
    let output = memlab(&["replay", path, "--history", "x.pickle"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn replay_refuses_what_it_cannot_replay_in_one_line() {
    let cuda = fixture("replay/mlp__default.pickle");
    let cuda = cuda.to_str().unwrap();
    let cpu = fixture("memlab_cpu.pickle");
    for (args, says) in [
        (vec!["replay", cpu.to_str().unwrap()], "no CUDA history"),
        (vec!["replay", cuda, "--setting", "backend:cudaMallocAsync"], "does not model"),
        (vec!["replay", cuda, "--setting", "max_split_size_mb:8"], "must be >= 20"),
        (vec!["replay", cuda, "--capacity", "lots"], "--capacity lots"),
        (vec!["replay", cuda, "--fraction", "1.5"], "between 0 and 1"),
    ] {
        let output = memlab(&args);
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains(says), "{args:?} says {says:?}: {err}");
    }
    // Without a capacity, the replay says what it assumed.
    let text = stdout(&memlab(&["replay", cuda]));
    assert!(text.contains("Assumed: the file does not say what the allocator could reserve"), "{text}");
    assert!(text.contains("replayed as libtorch 2.11's allocator (give --libtorch)"), "{text}");
    // memlab's own snapshot says its version: 2.11.0 needs no warning.
    let memlab_cuda = fixture("memlab_cuda.pickle");
    let text = stdout(&memlab(&["replay", memlab_cuda.to_str().unwrap()]));
    assert!(!text.contains("made by libtorch") && !text.contains("its libtorch version"), "{text}");
    // A history that began after the allocator held segments says so, and
    // how much: leaky.pickle's recorder started on a warm allocator. The
    // replay rebuilds those segments from the snapshot's, undoing the
    // history, and then makes every segment event the allocator made
    // (before the rebuild, it first differed at event 3).
    let text = stdout(&memlab(&["replay", fixture("leaky.pickle").to_str().unwrap()]));
    assert!(text.contains("The allocator held 86.00M of segments before the history began"), "{text}");
    assert!(text.contains("rebuilt them (4 segment(s), 9 block(s) in use)"), "{text}");
    assert!(text.contains("made 11 of the allocator's 11 segment events."), "{text}");
}

/// The allocations live after the first `events` events of device 0's
/// history, walked here apart from the tool: each with its stack.
fn live_after(name: &str, events: usize) -> Vec<(u64, Vec<memlab_core::export::SnapshotFrame>)> {
    use memlab_core::events::Action;
    let s = memlab_core::export::Snapshot::read_pickle(fixture(name)).unwrap().snapshot;
    let mut live = std::collections::BTreeMap::new();
    for e in &s.device_traces[0][..events] {
        match e.action {
            Action::Alloc => {
                live.insert(e.addr, (e.size, e.frames.to_vec()));
            }
            Action::FreeCompleted => {
                live.remove(&e.addr);
            }
            _ => {}
        }
    }
    live.into_values().collect()
}

#[test]
fn pytorchs_full_stacks_read_as_a_person_reads_them() {
    // PyTorch's default recording (stacks="all"): some 60 frames an
    // allocation, most of them CPython's, the dispatcher's, the runtime's.
    let name = "transformer_all.pickle";
    let summary = json(&["summary", fixture(name).to_str().unwrap(), "--json"]);
    let device = &summary["devices"][0];
    let peak_event = device["peak"]["event"].as_u64().unwrap() as usize;
    let live = live_after(name, peak_event);
    assert_eq!(live.iter().map(|(size, _)| size).sum::<u64>(), device["peak"]["allocated"].as_u64().unwrap());
    let ours = |f: &memlab_core::export::SnapshotFrame| f.filename.ends_with("make_snapshots.py");

    // Every site is a line of the script, or names what made it: libtorch's
    // own workspaces, autograd's backward pass, whose thread runs no Python.
    // None is a frame of the recorder or of CPython.
    let (mut backward, mut workspaces) = (0, 0);
    for row in device["by_site"].as_array().unwrap() {
        let (function, file) = (row["site"]["function"].as_str().unwrap(), row["site"]["file"].as_str().unwrap());
        let bytes = row["bytes"].as_u64().unwrap();
        if let Some(node) = function.strip_prefix("autograd's backward pass (") {
            assert!(file.is_empty() && node.ends_with("Backward0)"), "{row}");
            backward += bytes;
        } else if function.starts_with("libtorch's cuBLAS") {
            assert!(file.is_empty() && function.ends_with(" workspace"), "{row}");
            workspaces += bytes;
        } else {
            assert!(file.ends_with("make_snapshots.py"), "a site of the script's own: {row}");
        }
    }
    let called =
        |frames: &[memlab_core::export::SnapshotFrame], name: &str| frames.iter().any(|f| f.name.starts_with(name));
    // cuBLAS's workspace (per handle, on the forward thread and on
    // backward's) and cuBLASLt's, told by the function that made them.
    let workspace = |frames: &[memlab_core::export::SnapshotFrame]| {
        called(frames, "at::cuda::setWorkspaceForHandle(") || called(frames, "at::cuda::getCUDABlasLtWorkspace(")
    };
    let expected: u64 = live.iter().filter(|(_, frames)| workspace(frames)).map(|(size, _)| size).sum();
    assert_eq!(expected, (32 << 20) * 2 + (1 << 20), "two cuBLAS workspaces and cuBLASLt's at the peak");
    assert_eq!(workspaces, expected, "libtorch's workspaces are named as such");
    let on_engine = |frames: &[memlab_core::export::SnapshotFrame]| {
        called(frames, "torch::autograd::Engine::thread_main") && !workspace(frames)
    };
    let expected: u64 = live.iter().filter(|(_, frames)| on_engine(frames)).map(|(size, _)| size).sum();
    assert!(expected > 10 << 20, "the backward pass held {expected} B at the peak");
    assert_eq!(backward, expected, "the backward pass's allocations are named as such");

    // The call-stack view: at most 12 levels deep, every line of the script
    // that a live allocation's stack passes through shown as a level of its
    // own, none hidden in a folded run.
    let file = memlab_core::export::Snapshot::read_pickle(fixture(name)).unwrap();
    let summary = memlab_cli::analysis::Summary::of(name, &file);
    let report = memlab_core::export::HtmlReport::of_snapshot(&file, &summary);
    let flame = &report.devices[0].flame;
    fn walk(
        n: &memlab_core::export::FlameNode,
        depth: usize,
        shown: &mut Vec<String>,
        hidden: &mut Vec<String>,
    ) -> usize {
        if n.folded.is_empty() {
            shown.push(n.name.clone());
        } else {
            hidden.extend(n.folded.iter().cloned());
        }
        n.children.iter().map(|c| walk(c, depth + 1, shown, hidden)).max().unwrap_or(depth)
    }
    let (mut shown, mut hidden) = (Vec::new(), Vec::new());
    let deepest = walk(flame, 1, &mut shown, &mut hidden);
    assert!(deepest <= 12, "the deepest path has {deepest} levels");
    for (_, frames) in &live {
        for f in frames.iter().filter(|f| ours(f)) {
            let (head, tail) = (format!("{} (", f.name), format!("make_snapshots.py:{})", f.line));
            let level = shown.iter().any(|s| s.starts_with(&head) && s.ends_with(&tail));
            assert!(level, "{head}…{tail} is a level of its own");
        }
    }
    assert!(!hidden.iter().any(|f| f.contains("make_snapshots.py")), "no line of the script is folded away");
    assert!(hidden.iter().any(|f| f.starts_with("_PyEval_EvalFrameDefault")), "CPython's frames are folded");

    // --all-frames shows them all: as deep as the deepest stack.
    let all = memlab_core::export::HtmlReport::of_snapshot_with(&file, &summary, true);
    let (mut shown, mut hidden) = (Vec::new(), Vec::new());
    let deepest_all = walk(&all.devices[0].flame, 1, &mut shown, &mut hidden);
    let longest = live.iter().map(|(_, frames)| frames.len()).max().unwrap();
    assert_eq!((deepest_all, hidden.len()), (longest + 1, 0), "every frame, under the root");
}

#[test]
fn pytorchs_full_stacks_name_cudnns_workspaces() {
    // PyTorch's default recording of a conv net: cuDNN's workspaces are
    // allocated by `at::native::run_conv_plan` under the script's line (the
    // forward pass) or on autograd's thread (the backward pass).
    let name = "convnet_all.pickle";
    let called =
        |frames: &[memlab_core::export::SnapshotFrame], name: &str| frames.iter().any(|f| f.name.starts_with(name));
    let cudnn = |frames: &[memlab_core::export::SnapshotFrame]| called(frames, "at::native::run_conv_plan(");
    let s = memlab_core::export::Snapshot::read_pickle(fixture(name)).unwrap().snapshot;
    let allocs: Vec<_> = s.device_traces[0].iter().filter(|e| e.action == memlab_core::events::Action::Alloc).collect();
    // Every one, forward's and backward's, is named for what it is, and
    // nothing else is.
    let (mut named, mut walked, mut forward, mut backward) = (0u64, 0u64, 0, 0);
    for e in &allocs {
        let site = memlab_core::export::analysis::Site::of(&e.frames).unwrap();
        if site.function == "libtorch's cuDNN workspace" {
            assert!(site.file.is_empty(), "{site:?}");
            named += e.size;
        }
        if cudnn(&e.frames) {
            walked += e.size;
            match called(&e.frames, "torch::autograd::Engine::") {
                true => backward += 1,
                false => forward += 1,
            }
        }
    }
    assert!(walked > 1 << 20 && forward > 0 && backward > 0, "{walked} B: {forward} forward, {backward} backward");
    assert_eq!(named, walked, "cuDNN's workspaces, and only they, are named so");
    // At the peak, `memlab summary` lists them, and the backward pass's ops.
    let summary = json(&["summary", fixture(name).to_str().unwrap(), "--json"]);
    let device = &summary["devices"][0];
    let live = live_after(name, device["peak"]["event"].as_u64().unwrap() as usize);
    let row = |function: &str| -> u64 {
        let rows = device["by_site"].as_array().unwrap();
        rows.iter().filter(|r| r["site"]["function"] == function).map(|r| r["bytes"].as_u64().unwrap()).sum()
    };
    let expected: u64 = live.iter().filter(|(_, f)| cudnn(f)).map(|(size, _)| size).sum();
    assert_eq!(row("libtorch's cuDNN workspace"), expected);
    // libtorch's workspaces made on the engine's thread are named for what they are.
    let workspace = |f: &[memlab_core::export::SnapshotFrame]| {
        cudnn(f) || called(f, "at::cuda::setWorkspaceForHandle(") || called(f, "at::cuda::getCUDABlasLtWorkspace(")
    };
    let on_engine = |f: &[memlab_core::export::SnapshotFrame]| called(f, "torch::autograd::Engine::") && !workspace(f);
    let by_op = |op: &str| -> u64 {
        let apply = format!("torch::autograd::generated::{op}::apply(");
        live.iter().filter(|(_, f)| on_engine(f) && called(f, &apply)).map(|(size, _)| size).sum()
    };
    let ops = ["ConvolutionBackward0", "ReluBackward0", "MaxPool2DWithIndicesBackward0", "AddmmBackward0"];
    assert!(ops.iter().map(|op| by_op(op)).sum::<u64>() > 0, "the peak is in the backward pass");
    for op in ops {
        assert_eq!(row(&format!("autograd's backward pass ({op})")), by_op(op), "{op}");
    }
}

/// A snapshot of one device (`cuda:0`, or `cpu` for `--as-cuda`) whose
/// history is `entries` (action, address, bytes), written to a file.
fn history_file(name: &str, device: &str, entries: &[(memlab_core::events::Action, u64, u64)]) -> String {
    use memlab_core::export::{Snapshot, SnapshotInfo, TraceEntry};
    let trace = entries
        .iter()
        .enumerate()
        .map(|(i, &(action, addr, size))| {
            let addr = (action != memlab_core::events::Action::Oom).then_some(addr);
            TraceEntry::new(action, addr, size, i as u64)
        })
        .collect();
    let snapshot = Snapshot {
        segments: Vec::new(),
        device_traces: vec![trace],
        allocator_settings: Some(memlab_core::export::AllocatorSettings {
            conf: Some(String::new()),
            ..Default::default()
        }),
        memlab: Some(SnapshotInfo { devices: vec![device.into()], ..SnapshotInfo::default() }),
    };
    let path = temp(name);
    std::fs::write(&path, snapshot.to_pickle().unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

/// The replay on hostile settings and sizes (reliability round 5): what
/// libtorch refuses is refused in one line with its message, what it
/// clamps is clamped and said, no figure wraps, and no history that cannot
/// fit is said to fit.
#[test]
fn replay_takes_hostile_settings_and_sizes_as_libtorch_would_and_says_so() {
    use memlab_core::events::Action::{Alloc, Oom, SegmentAlloc};
    const MIB: u64 = 1 << 20;
    let cuda = fixture("replay/mlp__default.pickle");
    let cuda = cuda.to_str().unwrap();
    // Refused by libtorch, so refused here (these two exited 0).
    for (setting, says) in [
        (
            "release_lock_on_cudamalloc:maybe",
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'maybe'",
        ),
        ("pinned_num_register_threads:abc", "stoull"),
    ] {
        let output = memlab(&["replay", cuda, "--setting", setting]);
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!((output.status.code(), err.trim_end().lines().count()), (Some(2), 1), "{setting}: {err}");
        assert!(err.starts_with("memlab: ") && err.contains(says), "{setting}: {err}");
    }
    // A large segment size past SIZE_MAX / 1 MiB is clamped, as libtorch
    // clamps it, and said; its segments fit no card, and no figure wraps.
    for mb in ["17592186044436", "17592186044415"] {
        let setting = format!("large_segment_size_mb:{mb}");
        let args = ["replay", cuda, "--capacity", "80G", "--setting", &setting];
        let text = stdout(&memlab(&args));
        assert!(text.contains("17592186044415"), "{text}");
        let mut json_args = args.to_vec();
        json_args.push("--json");
        let replayed = json(&json_args);
        for replay in replayed["devices"][0]["replays"].as_array().unwrap() {
            let (reserved, allocated) =
                (replay["peak_reserved"].as_u64().unwrap(), replay["peak_allocated"].as_u64().unwrap());
            assert!(allocated <= reserved && reserved <= 80 << 30, "{setting}: {replay}");
            assert!(!replay["ooms"].as_array().unwrap().is_empty(), "its segments fit no card: {replay}");
        }
        assert!(!text.contains("8192.00P") && !text.contains("16.00E free"), "{text}");
    }
    // A memory fraction of the row's own names the row.
    let text = stdout(&memlab(&["replay", cuda, "--setting", "per_process_memory_fraction:0.0001"]));
    assert!(text.lines().any(|l| l.trim_start().starts_with("per_process_memory_fraction:0.0001")), "{text}");
    assert_eq!(text.lines().filter(|l| l.trim_start().starts_with("default")).count(), 1, "{text}");
    // A request of u64::MAX after 2 MiB allocated: libtorch refuses it at
    // once; the text's figure is the JSON's.
    let huge = history_file(
        "huge_request.pickle",
        "cuda:0",
        &[(SegmentAlloc, 1 << 32, 2 * MIB), (Alloc, 1 << 32, 2 * MIB), (Oom, 0, u64::MAX)],
    );
    let text = stdout(&memlab(&["replay", &huge]));
    assert!(text.contains("asking 16.00E: libtorch refuses a request of 1.00E or more at once"), "{text}");
    assert_eq!(
        json(&["replay", &huge, "--json"])["devices"][0]["ooms"][0]["oom"]["requested"],
        serde_json::json!(u64::MAX)
    );
    // A card no device has is refused, saying the largest the model takes.
    let output = memlab(&["replay", &huge, "--capacity", "9223372036854775808"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("at most 1 EiB"), "{err}");
    let output = memlab(&["replay", &huge, "--capacity", "99999999999999999999"]);
    assert!(String::from_utf8_lossy(&output.stderr).contains("more bytes than a 64-bit count holds"));
    // Two final segments whose bytes pass 2^63 - 1: refused, naming the second.
    let path = temp("two_huge_segments.pickle");
    let segment = |address: u64| memlab_core::export::Segment {
        device: 0,
        address,
        total_size: 1 << 62,
        stream: 0,
        segment_type: memlab_core::export::SegmentType::Large,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        is_expandable: false,
        blocks: Vec::new(),
    };
    let snapshot = memlab_core::export::Snapshot {
        segments: vec![segment(0), segment(1 << 62)],
        device_traces: vec![Vec::new()],
        allocator_settings: None,
        memlab: None,
    };
    std::fs::write(&path, snapshot.to_pickle().unwrap()).unwrap();
    for command in ["summary", "replay"] {
        let output = memlab(&[command, path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{command}: {err}");
        assert!(err.contains("segment 1 (cuda:0 at 0x4000000000000000)"), "{command}: {err}");
    }
    // A CPU history with an allocation of 1 EiB fits no card.
    let cpu = history_file("exabyte_step.pickle", "cpu", &[(Alloc, 1 << 40, 4 * MIB), (Alloc, 2 << 40, 1 << 60)]);
    let text = stdout(&memlab(&["replay", &cpu, "--as-cuda", "--capacity", "80G"]));
    assert!(text.contains("does not fit on any card") && !text.contains("to spare"), "{text}");
    // A CPU history recorded without its ops gets no verdict, and says why.
    let cpu = history_file("step_without_ops.pickle", "cpu", &[(Alloc, 1 << 40, 4 * MIB)]);
    let text = stdout(&memlab(&["replay", &cpu, "--as-cuda", "--capacity", "80G"]));
    assert!(text.contains("Not predictable: the recording did not watch its ops (Settings::ops)"), "{text}");
    assert!(!text.contains("to spare"), "{text}");
    let out = json(&["replay", &cpu, "--as-cuda", "--capacity", "80G", "--json"]);
    assert_eq!(out["settings"][0]["fit"], "NotPredictable", "{out}");
    assert!(out["not_predictable"].as_str().is_some_and(|why| why.contains("Settings::ops")), "{out}");
}

/// PyTorch's snapshots never say their libtorch: `--libtorch` does, and the
/// replay names the allocator it followed; a version memlab does not model
/// is refused with the list of those it does.
#[test]
fn replay_follows_the_libtorch_it_is_told() {
    let file = fixture("replay/fragmentation__default.pickle");
    let file = file.to_str().unwrap();
    let text = stdout(&memlab(&["replay", file, "--libtorch", "2.13"]));
    assert!(text.contains("model of libtorch 2.13's CUDA caching allocator"), "{text}");
    assert!(!text.contains("does not say its libtorch version"), "{text}");
    let replayed = json(&["replay", file, "--libtorch", "2.13.0", "--json"]);
    assert_eq!(replayed["libtorch"], "2.13");
    let text = stdout(&memlab(&["replay", file]));
    assert!(text.contains("libtorch 2.11's") && text.contains("give --libtorch"), "{text}");
    // 2.13 knows keys 2.11 refuses.
    let setting = ["replay", file, "--setting", "pinned_max_cached_size_mb:64"];
    assert!(stdout(&memlab(&[&setting[..], &["--libtorch", "2.13"]].concat())).contains("libtorch 2.13"));
    let refused = memlab(&setting);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("Unrecognized key"), "{refused:?}");
    let wrong = memlab(&["replay", file, "--libtorch", "2.9"]);
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success() && stderr.contains("2.11.0, 2.13.0"), "{stderr}");
}

/// Every text and JSON output of the command on the fixtures, and the
/// renderings of an out-of-memory report, against files kept in
/// `fixtures/golden/`: a change to any output shows as a diff there.
/// `MEMLAB_BLESS=1` writes them anew (review the diff before committing).
#[test]
fn outputs_match_the_golden_files() {
    use memlab_core::oom::OomReport;
    use memlab_core::render::Render;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let golden = root.join("fixtures/golden");
    let bless = std::env::var_os("MEMLAB_BLESS").is_some();
    let merged = temp("golden-merge");
    let merged = merged.to_str().unwrap();
    let page = temp("golden-view.html");
    let page = page.to_str().unwrap();
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("summary_leaky.txt", vec!["summary", "fixtures/leaky.pickle"]),
        ("summary_leaky.json", vec!["summary", "fixtures/leaky.pickle", "--json"]),
        ("summary_memlab_cpu.txt", vec!["summary", "fixtures/memlab_cpu.pickle"]),
        ("summary_memlab_cuda.json", vec!["summary", "fixtures/memlab_cuda.pickle", "--json"]),
        ("summary_transformer_all.txt", vec!["summary", "fixtures/transformer_all.pickle"]),
        ("view_memlab_cpu.json", vec!["view", "fixtures/memlab_cpu.pickle", "-o", page, "--json"]),
        ("diff_leaky_fixed.txt", vec!["diff", "fixtures/leaky.pickle", "fixtures/fixed.pickle"]),
        ("diff_leaky_fixed.json", vec!["diff", "fixtures/leaky.pickle", "fixtures/fixed.pickle", "--json"]),
        (
            "replay_fragmentation.txt",
            vec![
                "replay",
                "fixtures/replay/fragmentation__default.pickle",
                "--total",
                "85017493504",
                "--fraction",
                "0.01894448624181354",
                "--compare",
            ],
        ),
        (
            "replay_pattern123548.json",
            vec!["replay", "fixtures/replay/pattern123548__default.pickle", "--compare", "--json"],
        ),
        (
            "replay_mlp_as_cuda.txt",
            vec!["replay", "fixtures/fit/mlp_1024_cpu.pickle", "--as-cuda", "--capacity", "80G"],
        ),
        (
            "replay_mlp_as_cuda.json",
            vec!["replay", "fixtures/fit/mlp_1024_cpu.pickle", "--as-cuda", "--capacity", "80G", "--json"],
        ),
        (
            "merge_ranks.json",
            vec![
                "merge",
                "fixtures/ranks/memlab_trace_rank0.json",
                "fixtures/ranks/memlab_trace_rank1.json",
                "-o",
                merged,
                "--json",
            ],
        ),
    ];
    let mut outputs: Vec<(String, String)> = cases
        .into_iter()
        .map(|(name, args)| {
            let out = Command::new(env!("CARGO_BIN_EXE_memlab")).args(&args).current_dir(&root).output().unwrap();
            assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
            (name.to_string(), String::from_utf8(out.stdout).unwrap().replace(merged, "MERGED").replace(page, "PAGE"))
        })
        .collect();
    let report = std::fs::read_to_string(root.join("fixtures/oom/frag93_default.json")).unwrap();
    let report = OomReport::from_json(&report).unwrap();
    outputs.push(("oom_frag93_default.txt".into(), report.to_text()));
    outputs.push(("oom_frag93_default.json".into(), report.to_json()));
    outputs.push(("oom_frag93_default.csv".into(), report.to_csv().unwrap()));
    let mut changed = Vec::new();
    for (name, actual) in outputs {
        let path = golden.join(&name);
        if bless {
            std::fs::create_dir_all(&golden).unwrap();
            std::fs::write(&path, &actual).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if expected != actual {
            let line = expected.lines().zip(actual.lines()).position(|(a, b)| a != b);
            changed.push(format!("{name} (first differing line: {line:?})"));
        }
    }
    assert!(changed.is_empty(), "outputs changed (MEMLAB_BLESS=1 writes them anew): {changed:#?}");
}
