//! PyTorch's own readers of memory snapshots, run with the `python3` on
//! PATH (the project's venv, with PyPI's torch==2.11.0; on a GPU machine, its
//! own torch 2.11).

use std::process::Command;

/// Runs `python3 ARGS` and returns what it printed; fails the test when it fails.
pub fn python(args: &[&str]) -> String {
    let out = Command::new("python3")
        .args(args)
        .output()
        .expect("python3 with torch on PATH (source scripts/env.sh: the project's venv has PyPI's torch==2.11.0)");
    assert!(
        out.status.success(),
        "python3 {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every key and type of the documented snapshot, checked in Python on what
/// `pickle.load` returns; prints a summary as JSON.
pub const VALIDATE: &str = r#"
import json, pickle, sys
data = pickle.load(open(sys.argv[1], "rb"))
def check(obj, fields, what):
    assert isinstance(obj, dict), f"{what} is a {type(obj)}"
    for key, types in fields.items():
        assert key in obj, f"{what} lacks {key!r}: {sorted(obj)}"
        assert isinstance(obj[key], types), f"{what}[{key!r}] is {type(obj[key])}, not {types}"
frame = {"filename": str, "line": int, "name": str}
block = {"size": int, "requested_size": int, "address": int, "state": str, "frames": list}
segment = {"address": int, "total_size": int, "stream": int, "segment_type": str,
           "allocated_size": int, "active_size": int, "blocks": list, "device": int}
entry = {"action": str, "frames": list, "size": int, "stream": int, "time_us": int}
check(data, {"segments": list, "device_traces": list}, "snapshot")
for s in data["segments"]:
    check(s, segment, "segment")
    assert s["segment_type"] in ("small", "large")
    assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
    for b in s["blocks"]:
        check(b, block, "block")
        assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        for f in b["frames"]:
            check(f, frame, "block frame")
files = set()
for trace in data["device_traces"]:
    assert isinstance(trace, list)
    for e in trace:
        check(e, entry, "trace entry")
        assert e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                               "segment_map", "segment_unmap", "oom")
        if e["action"] == "oom":
            check(e, {"device_free": int}, "oom entry")
        else:
            check(e, {"addr": int}, "trace entry")
        for f in e["frames"]:
            check(f, frame, "trace frame")
            files.add(f["filename"].rsplit("/", 1)[-1])
cpu = data["memlab"]["devices"].index("cpu")
print(json.dumps({
    "cpu": cpu,
    "files": sorted(files),
    "categories": sorted({e.get("category") for e in data["device_traces"][cpu] if e["action"] == "alloc"}),
    "allocated": sum(b["requested_size"] for s in data["segments"] if s["device"] == cpu
                     for b in s["blocks"] if b["state"] == "active_allocated"),
    "partial": data["memlab"]["partial"],
}))
"#;

/// Bytes as `_memory_viz.py`'s `_format_size` prints them (`3.5KiB`).
pub fn bytes_as_pytorch_prints(n: u64) -> String {
    let mut value = n as f64;
    for unit in ["", "Ki", "Mi", "Gi", "Ti", "Pi"] {
        if value.abs() < 1024.0 {
            return format!("{value:.1}{unit}B");
        }
        value /= 1024.0;
    }
    format!("{value:.1}EiB")
}
