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
    let dir = std::env::temp_dir().join(format!("memlab-cli-{}", std::process::id()));
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
        "PyTorch's snapshot, pickle protocol 4; 1006 keys read past",
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
        device_free: None,
    };
    // The history lost the allocation of block 64: it frees it unseen.
    let snapshot = Snapshot {
        segments: vec![],
        device_traces: vec![vec![entry(Action::FreeRequested, 64, 100), entry(Action::Alloc, 128, 40)]],
        memlab: Some(SnapshotInfo { devices: vec!["cpu".into()], partial: true, dropped: 5, recorded: 7 }),
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
    for (path, why) in inputs {
        for args in [vec!["summary", path.as_str()], vec!["summary", path.as_str(), "--json"]] {
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
