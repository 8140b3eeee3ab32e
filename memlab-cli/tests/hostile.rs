//! The `memlab` command on files made to break it: each either reads as
//! what it is or is refused with one line that names the file, never a
//! panic, and no file's times can move another's. First the cases found by
//! hand, then every input that once failed (`tests/hostile/`), then real
//! files mutated at random through every reader (`summary`, `view`, `diff`,
//! `replay`, and `merge`'s snapshot, trace and out-of-memory report readers).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use memlab_cli::{analysis, diff, merge, replay, view};
use memlab_core::export::Snapshot;
use memlab_core::render::Render;
use proptest::prelude::*;
use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

fn memlab(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memlab")).args(args).output().expect("memlab runs")
}

/// A folder of this test binary's own, under cargo's temporary folder for
/// integration tests (inside target/, so that what a run leaves goes with it).
fn temp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memlab-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn read_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

fn write_json(name: &str, value: &Value) -> String {
    let path = temp(name);
    std::fs::write(&path, serde_json::to_string(value).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

/// Runs `memlab merge` on `files` and checks that it refused them with
/// exit code 2 and one line holding every piece of `says`.
fn refused(files: &[&str], extra: &[&str], says: &[&str]) {
    let out = temp("refused");
    let mut args = vec!["merge", "-o", out.to_str().unwrap()];
    args.extend(files);
    args.extend(extra);
    let output = memlab(&args);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{args:?}: exit code 2, got {:?}:\n{err}", output.status);
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line:\n{err}");
    for part in says {
        assert!(err.contains(part), "{args:?}: says {part:?}:\n{err}");
    }
}

#[test]
fn a_trace_event_that_is_not_an_object_is_refused_naming_it() {
    for (i, bad) in [json!(7), json!("cpu memory"), json!([1, 2]), json!(null)].into_iter().enumerate() {
        let mut trace = read_json("memlab_trace_rank0.json");
        trace["traceEvents"].as_array_mut().unwrap().insert(3, bad);
        let path = write_json(&format!("not_an_object_{i}_rank0.json"), &trace);
        refused(&[&path], &[], &[&path, "event 3 of its `traceEvents`", "not an object"]);
    }
}

#[test]
fn a_time_no_run_can_have_is_refused_and_moves_no_other_rank() {
    let good = fixture("memlab_trace_rank0.json");
    let good = good.to_str().unwrap();
    let mut far = read_json("memlab_trace_rank1.json");
    far["traceEvents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "cpu memory", "ph": "C", "ts": 1e300, "pid": 1, "tid": 0, "args": {"allocated": 5}}));
    let far = write_json("far_rank1.json", &far);
    refused(&[good, &far], &[], &[&far, "`ts` 1e+300", "not a time a run can have"]);
    // An offset that would wrap the rank's clock.
    refused(&[good], &["--offset", "0=9223372036854775000"], &["--offset 0=9223372036854775000", "no clock"]);
    // Times at the edge of what is allowed still merge, on one axis.
    let out = temp("edge");
    let merged = memlab(&["merge", good, "-o", out.to_str().unwrap(), "--json", "--offset", "0=-86400000000"]);
    assert!(merged.status.success(), "{}", String::from_utf8_lossy(&merged.stderr));
    let merged: Value = serde_json::from_slice(&merged.stdout).unwrap();
    assert!(merged["ranks"][0]["devices"][0]["at_us"].as_i64().unwrap() >= 0, "{merged}");
}

#[test]
fn a_clock_zero_past_what_a_run_can_have_is_refused_naming_the_field() {
    for zero in [json!(u64::MAX), json!(i64::MAX as u64 + 1), json!(40_000_000_000_000_000u64)] {
        let mut trace = read_json("memlab_trace_rank1.json");
        trace["otherData"]["run"]["clock_zero_unix_us"] = zero.clone();
        let path = write_json("zero_rank1.json", &trace);
        let good = fixture("memlab_trace_rank0.json");
        refused(
            &[good.to_str().unwrap(), &path],
            &[],
            &[&path, "`otherData.run.clock_zero_unix_us`", &zero.to_string()],
        );
    }
    let mut report = read_json("memlab_oom_rank1.json");
    report["run"]["clock_zero_unix_us"] = json!(u64::MAX);
    let path = write_json("zero_oom.json", &report);
    refused(&[&path], &[], &[&path, "`run.clock_zero_unix_us`"]);
}

#[test]
fn two_processes_that_claim_one_rank_are_told_apart_by_pid() {
    // Two processes on one host, both rank 0; the second ran out of memory.
    let trace = read_json("memlab_trace_rank0.json");
    let process = |pid: u32| {
        let mut t = trace.clone();
        t["otherData"]["run"]["pid"] = json!(pid);
        t
    };
    let (a, b) = (write_json("claim_a.json", &process(10)), write_json("claim_b.json", &process(11)));
    let mut report = read_json("memlab_oom_rank1.json");
    report["run"] = process(11)["otherData"]["run"].clone();
    let oom = write_json("claim_oom.json", &report);
    let out = temp("claims");
    let output = memlab(&["merge", &a, &b, &oom, "-o", out.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let merged: Value = serde_json::from_slice(&output.stdout).unwrap();
    let labels: Vec<&str> = merged["ranks"].as_array().unwrap().iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["rank 0 (vm, pid 10)", "rank 0 (vm, pid 11)"]);
    assert_eq!(merged["ooms"].as_array().unwrap().len(), 1);
    assert_eq!(
        (merged["ooms"][0]["process"].as_u64(), merged["ooms"][0]["label"].as_str()),
        (Some(1), Some(labels[1]))
    );
    let warnings = merged["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].as_str().unwrap().starts_with("2 processes claim rank 0 (pid 10 on vm, pid 11 on vm)"));

    // The table marks only the process that failed, and says why the names differ.
    let text = String::from_utf8(memlab(&["merge", &a, &b, &oom, "-o", out.to_str().unwrap()]).stdout).unwrap();
    let marked: Vec<&str> = text.lines().filter(|l| l.contains("out of memory  ")).collect();
    assert_eq!(marked.len(), 1, "one row marked:\n{text}");
    assert!(marked[0].starts_with("rank 0 (vm, pid 11)"), "{text}");
    assert!(text.contains("Warning: 2 processes claim rank 0"), "{text}");
}

#[test]
fn control_characters_in_names_forge_no_line_of_the_text() {
    let mut trace = read_json("memlab_trace_rank0.json");
    trace["otherData"]["run"]["host"] = json!("vm\nrank 9 (forged)  cpu  1.00T\r\u{1b}[2J");
    let path = write_json("forged_rank0.json", &trace);
    let out = temp("forged");
    let output = memlab(&["merge", &path, "-o", out.to_str().unwrap()]);
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(!text.lines().any(|l| l.starts_with("rank 9")), "no forged row:\n{text}");
    assert!(!text.contains('\r') && !text.contains('\u{1b}'), "no control character reaches the terminal:\n{text}");
    assert!(text.contains(r"rank 0 (vm\nrank 9 (forged)  cpu  1.00T\r\u{1b}[2J)"), "the name, made visible:\n{text}");
}

// ---------------------------------------------------------------------------
// Every reader on any file.

/// Runs every reader the command has on one file, as the command would
/// (`summary`, `view`, `diff` against a real snapshot, and `merge` beside a
/// real trace of another rank). A panic fails the caller.
fn read_every_way(path: &Path, out: &Path) {
    let name = path.to_str().unwrap();
    if let Ok(file) = Snapshot::read_pickle(path) {
        let summary = analysis::Summary::of(name, &file);
        let _ = summary.to_text();
        let _ = serde_json::to_string(&summary);
        let _ = view::page(name, &file, &summary);
        let other = Snapshot::read_pickle(fixture("mlp.pickle")).unwrap();
        let other = analysis::Summary::of("mlp.pickle", &other);
        let d = diff::Diff::of(&other, &summary);
        let _ = d.to_text();
        let _ = d.document().to_page("memlab diff");
        let options = replay::Options { compare: true, fraction: Some(0.5), ..Default::default() };
        if let Ok(r) = replay::replay(name, &file, &options) {
            let _ = r.to_text();
        }
    }
    let companion = fixture("memlab_trace_rank0.json");
    for files in [vec![name.to_string()], vec![name.to_string(), companion.to_str().unwrap().to_string()]] {
        if let Ok(merged) =
            merge::merge(&files, &merge::Options { out: out.to_path_buf(), offsets: Default::default() })
        {
            let _ = merged.to_text();
        }
    }
}

/// The inputs that once broke a reader, each kept as a file: they must
/// now read or be refused.
#[test]
fn every_input_that_once_failed_reads_or_is_refused() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hostile");
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "{} holds the inputs", dir.display());
    let out = temp("kept");
    for input in inputs {
        let outcome = std::panic::catch_unwind(|| read_every_way(&input, &out));
        assert!(outcome.is_ok(), "{} broke a reader", input.display());
    }
}

/// One change to a file's bytes, or (JSON only) to one value of it.
#[derive(Clone, Debug)]
enum Mutation {
    Flip {
        at: u32,
        bit: u8,
    },
    Set {
        at: u32,
        byte: u8,
    },
    Truncate {
        at: u32,
    },
    Delete {
        at: u32,
        len: u16,
    },
    Insert {
        at: u32,
        bytes: Vec<u8>,
    },
    Repeat {
        at: u32,
        len: u16,
    },
    /// The `at`-th value of the JSON document (in document order) replaced
    /// by hostile value `with`.
    Value {
        at: u32,
        with: u8,
    },
}

/// Values a reader may not expect where it finds them.
fn hostile_value(with: u8) -> Value {
    match with % 16 {
        0 => json!(null),
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(i64::MIN),
        4 => json!(1e300),
        5 => json!(-1e300),
        6 => json!(0.5),
        7 => json!("host\nrank 9\u{1b}[2J"),
        8 => json!([]),
        9 => json!({}),
        10 => json!(true),
        11 => json!([1, "two", null]),
        12 => json!({"ph": "C", "ts": 1e300, "name": "cpu memory", "args": {"allocated": -5}}),
        13 => json!(i64::MAX),
        14 => json!(""),
        _ => json!(0),
    }
}

/// The `at`-th value of `v` (modulo how many it has), `v` itself first.
fn nth_value<'a>(v: &'a mut Value, at: &mut usize) -> Option<&'a mut Value> {
    if *at == 0 {
        return Some(v);
    }
    *at -= 1;
    match v {
        Value::Array(items) => items.iter_mut().find_map(|c| nth_value(c, at)),
        Value::Object(map) => map.values_mut().find_map(|c| nth_value(c, at)),
        _ => None,
    }
}

fn count_values(v: &Value) -> usize {
    1 + match v {
        Value::Array(items) => items.iter().map(count_values).sum(),
        Value::Object(map) => map.values().map(count_values).sum(),
        _ => 0,
    }
}

fn mutate(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    // Values first, on the document as JSON, where the seed is JSON.
    let mut bytes = seed.to_vec();
    if let Ok(mut doc) = serde_json::from_slice::<Value>(seed) {
        let total = count_values(&doc);
        for m in mutations {
            if let Mutation::Value { at, with } = m {
                let mut k = *at as usize % total;
                if let Some(slot) = nth_value(&mut doc, &mut k) {
                    *slot = hostile_value(*with);
                }
            }
        }
        bytes = serde_json::to_vec(&doc).unwrap();
    }
    for m in mutations {
        let len = bytes.len().max(1);
        match m {
            Mutation::Flip { at, bit } if !bytes.is_empty() => bytes[*at as usize % len] ^= 1 << (bit % 8),
            Mutation::Set { at, byte } if !bytes.is_empty() => bytes[*at as usize % len] = *byte,
            Mutation::Truncate { at } => bytes.truncate(*at as usize % len),
            Mutation::Delete { at, len: n } => {
                let from = *at as usize % len;
                let to = (from + *n as usize).min(bytes.len());
                bytes.drain(from.min(to)..to);
            }
            Mutation::Insert { at, bytes: more } => {
                let from = (*at as usize % len).min(bytes.len());
                bytes.splice(from..from, more.iter().copied());
            }
            Mutation::Repeat { at, len: n } => {
                let from = (*at as usize % len).min(bytes.len());
                let to = (from + *n as usize).min(bytes.len());
                let copy = bytes[from..to].to_vec();
                bytes.splice(to..to, copy);
            }
            _ => {}
        }
    }
    bytes
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<u32>(), any::<u8>()).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        3 => (any::<u32>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => any::<u32>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<u32>(), 1..256u16).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => (any::<u32>(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<u32>(), 1..256u16).prop_map(|(at, len)| Mutation::Repeat { at, len }),
        6 => (any::<u32>(), any::<u8>()).prop_map(|(at, with)| Mutation::Value { at, with }),
    ]
}

/// The real files the mutations start from: PyTorch's snapshots and
/// memlab's (two of them recorded for replays: many segments, expandable
/// segments), memlab's traces and an out-of-memory report.
const SEEDS: [&str; 9] = [
    "mlp.pickle",
    "replay/fragmentation__mss128.pickle",
    "replay/pattern123548__both.pickle",
    "mlp_protocol2.pickle",
    "leaky.pickle",
    "memlab_cpu.pickle",
    "memlab_trace_rank0.json",
    "memlab_trace_rank1.json",
    "memlab_oom_rank1.json",
];

proptest! {
    #![proptest_config(ProptestConfig {
        // A fixed number of cases, a few seconds in all on two cores;
        // PROPTEST_CASES=N for a longer search.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(384),
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    /// Any mutation of a real file reads or is refused; none panics.
    #[test]
    fn mutated_real_files_read_or_are_refused(seed in 0..SEEDS.len(), mutations in proptest::collection::vec(mutation(), 1..6)) {
        let bytes = mutate(&std::fs::read(fixture(SEEDS[seed])).unwrap(), &mutations);
        let extension = if SEEDS[seed].ends_with(".json") { "json" } else { "pickle" };
        let path = temp(&format!("case_rank1.{extension}"));
        std::fs::write(&path, &bytes).unwrap();
        read_every_way(&path, &temp("cases"));
    }
}
