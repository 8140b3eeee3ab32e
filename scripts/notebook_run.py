"""Runs examples/notebook/memlab.ipynb in evcxr's Jupyter kernel through
nbclient, as JupyterLab would, and checks every cell's outputs: the mime
types that arrive and every figure, against what the cells allocated.
Called by scripts/test-notebook.sh, which installs the kernel and sets the
environment; arguments: the notebook, the directory to run it in (which
gets the executed notebook, its HTML rendering and the cells' CSV)."""

import csv
import json
import re
import sys
from pathlib import Path

import nbclient
import nbformat
from nbconvert import HTMLExporter

MIB = 1 << 20
# The model: Linear(1024, 1024) and Linear(1024, 10), f32 weights and biases.
MODEL = (1024 * 1024 + 1024 + 10 * 1024 + 10) * 4


def main():
    source, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    run_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(source, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=3600,  # the first cell builds tch and memlab for the kernel
        kernel_name="rust",
        resources={"metadata": {"path": str(run_dir)}},
        allow_errors=True,  # every cell runs; the checks say which failed
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, run_dir / "memlab.ipynb")
    html, _ = HTMLExporter().from_notebook_node(nb)
    (run_dir / "memlab.html").write_text(html)

    code = [c for c in nb.cells if c.cell_type == "code"]
    failures = []

    def check(ok, what, cell=None):
        print(("ok: " if ok else "FAILED: ") + what)
        if not ok:
            failures.append(what)
            if cell is not None:
                print(json.dumps(cell.outputs, indent=1)[:4000])

    def streams(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    def displays(cell):
        return [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")]

    def first(cell, pattern):
        m = re.search(pattern, streams(cell), re.M)
        return m.group(1) if m else None

    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    check(not errors, f"no cell failed ({[e.get('evalue') for e in errors]})")
    deps, early, start, model, keep, profile, profile_report, reporter, step, html_report, table, late_free = code

    # A line after every cell from log_cells() on, none before.
    check("RAM:" not in streams(early) and "RAM:" not in streams(deps), "no line before log_cells()")
    check("(cell 1, from log_cells(), compile not timed)" in streams(start), "the calling cell's line", start)
    for n, cell in enumerate(code[3:], start=2):
        check(f"(cell {n}, compile not timed)" in streams(cell), f"cell {n} has its line", cell)

    # The per-cell figures, exact: the CSV the notebook wrote.
    rows = {r["cell"]: r for r in csv.DictReader(open(run_dir / "cells.csv"))}
    figure = lambda cell, column: int(rows[cell][column])
    check(figure("cell 2", "CPU tensors.consumed") == MODEL, f"the model's cell consumed {MODEL} B of CPU tensors")
    check(figure("cell 3", "CPU tensors.consumed") == 4 * MIB, "keep 4 MiB: consumed exactly 4 MiB")
    check(figure("cell 3", "CPU tensors.peaked") == 8 * MIB, "a temporary 8 MiB: peaked exactly 8 MiB")
    check("CPU:     4.00M          8.00M" in streams(keep), "the line shows it", keep)
    check(len(rows) == 8, f"the table holds the 8 cells that ended before it ({len(rows)})")

    # Displays: HTML and text in one bundle.
    for name, cell in [("profile", profile_report), ("reporter", reporter), ("HTML report", html_report), ("cells", table)]:
        bundles = displays(cell)
        check(
            len(bundles) == 1 and {"text/html", "text/plain"} <= set(bundles[0].data),
            f"the {name} display sends text/html and text/plain together",
            cell,
        )

    # The profile, reported in the cell after. The logits line keeps the
    # logits (64 × 10 f32) and the ReLU's output (64 × 1024 f32), which
    # autograd saves for fc2's backward; the softmax line adds its output
    # and the end frees the logits.
    text = displays(profile_report)[0].data["text/plain"]
    lines = {k: next((l for l in text.splitlines() if k in l), "") for k in ("let logits", "softmax", "}")}
    check("+258.50K" in lines["let logits"], f"the logits line kept 264,704 B: {lines['let logits'].strip()}")
    check("+2.50K" in lines["softmax"], f"the softmax line 2,560 B: {lines['softmax'].strip()}")
    check(figure("cell 4", "CPU tensors.consumed") == 2 * 64 * 1024 * 4 + 64 * 10 * 4, "x, the saved ReLU output and y")
    check(re.search(r"## \S*forward\s+\(cpu, 1 call\)", text) is not None, "one call of forward profiled")

    # The reporter in a later cell: the weights are the allocator's, and the
    # rows add up to its figure, which an independent sum gives.
    m = re.search(r"named (\d+) B; the rows add up to (\d+) B, the allocator's figure is (\d+) B", streams(reporter))
    named, summed, allocated = map(int, m.groups()) if m else (None, None, None)
    expected = MODEL + 4 * MIB + 2 * 64 * 1024 * 4 + 64 * 10 * 4  # model, kept, x, the saved ReLU output, y
    check(named == MODEL, f"the reporter names the model's {MODEL} B ({named})")
    check(summed == allocated == expected, f"rows {summed} = allocator {allocated} = {expected} B")
    text = displays(reporter)[0].data["text/plain"]
    check("fc1.weight" in text and "not from the allocator" not in text, "weights counted as the allocator's")

    # The HTML report of the recorded step.
    html_text = displays(html_report)[0].data["text/html"]
    check("<svg" in html_text and "forward" in html_text, "the HTML report draws the step and names forward")

    # The tensor made before memlab: freeing it leaves memlab's figures as they were.
    result = displays(late_free)
    pair = result[0].data.get("text/plain", "") if result else ""
    m = re.fullmatch(r"\((\d+), (\d+)\)", pair.strip())
    check(m is not None and m.group(1) == m.group(2), f"freeing the early tensor changes nothing: {pair}")

    print(f"{len(code)} cells of the notebook checked\n")
    session(check)
    print(f"\n{len(failures)} failed checks")
    sys.exit(1 if failures else 0)


# Cells typed one after another into a fresh kernel, each printing what it
# checks as `CHECK name value`: the figures of tools that outlive a cell.
SESSION = [
    ':dep tch = "0.24"\n:dep memlab = { path = "%(root)s" }',
    # A cell that calls memlab loads it (a cell's library holds only the
    # crates its code uses): its counting allocator is in place before the
    # first tensor.
    'println!("CHECK first {}", memlab::run::copies());',
    'let vs = tch::nn::VarStore::new(tch::Device::Cpu);\nlet w = vs.root().zeros("w", &[1024, 1024]);',
    'println!("CHECK var_store {}", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);',
    "let t = tch::Tensor::zeros([1024, 1024], (tch::Kind::Float, tch::Device::Cpu));",
    'println!("CHECK tensor {}", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);',
    '#[memlab::profile(device = "cpu")]\nfn work() -> i64 {\n    let kept = tch::Tensor::zeros([1 << 20], (tch::Kind::Float, tch::Device::Cpu));\n    kept.numel() as i64\n}',
    'println!("CHECK work {}", work());',
    '{\n    let report = memlab::profiler::Report::collect();\n    let f = report.function("work").unwrap();\n'
    '    println!("CHECK calls {}", f.calls);\n'
    '    println!("CHECK kept {}", f.lines.iter().filter_map(|l| l.stats.as_ref()).map(|s| s.increment).max().unwrap());\n}',
    "let mut logger = memlab::StepLogger::new().exact_ram_peak(true);",
    'let total = logger.log("step", || tch::Tensor::ones([8 << 20], (tch::Kind::Float, tch::Device::Cpu)).sum(tch::Kind::Float).double_value(&[]));\n'
    'println!("CHECK step_sum {total}");\nprintln!("CHECK step_peaked {}", logger.data().unwrap().ram.peaked);',
    # Backtraces through a later cell's code: the recording's unwinder read
    # the modules when it started, before the cells below were loaded.
    "let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();",
    "fn later_cell_work() -> tch::Tensor {\n    tch::Tensor::zeros([777_777], (tch::Kind::Uint8, tch::Device::Cpu))\n}",
    "let late = later_cell_work();",
    '{\n    let (events, _) = memlab::events::history();\n'
    '    let frames: Vec<String> = events.iter().filter(|e| e.size == 777_777 && e.action == memlab::events::Action::Alloc)'
    '.filter_map(|e| e.backtrace.as_ref()).flat_map(|b| b.frames().iter().map(|f| f.function.clone()).collect::<Vec<_>>()).collect();\n'
    '    println!("CHECK late_frame {}", frames.iter().any(|f| f.contains("later_cell_work")));\n}',
    "drop(late);\ndrop(recording);",
    'println!("CHECK copies {}", memlab::run::copies());',
    'println!("CHECK after {}", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);',
]


def session(check):
    from jupyter_client.manager import start_new_kernel

    root = Path(__file__).resolve().parent.parent
    manager, client = start_new_kernel(kernel_name="rust")
    printed = []
    try:
        for cell in SESSION:
            code = cell % {"root": root} if "%(root)s" in cell else cell

            def hook(msg):
                content = msg["content"]
                if msg["msg_type"] == "stream":
                    printed.append(content["text"])
                elif msg["msg_type"] == "error":
                    printed.append("ERROR " + content.get("evalue", ""))

            client.execute_interactive(code, output_hook=hook, timeout=3600)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(printed)

    def value(name):
        found = re.findall(rf"CHECK {name} (\S+)", text)
        return found[-1] if found else None

    def equal(name, want):
        check(value(name) == str(want), f"{name} = {value(name)} (expected {want})")

    def at_least(name, least):
        got = value(name)
        check(got is not None and int(got) >= least, f"{name} = {got} (at least {least})")

    check("ERROR" not in text, "no cell of the session failed" + (": " + text if "ERROR" in text else ""))
    # A cell's 4 MiB var store, then another cell's 4 MiB tensor: the counting
    # allocator of the process, read by a later cell's copy of memlab.
    equal("var_store", 4 * MIB)
    equal("tensor", 8 * MIB)
    # Defined in one cell, called in the next, reported by a third: one table.
    equal("work", MIB)
    equal("calls", 1)
    equal("kept", 4 * MIB)
    # The step held 32 MiB of ones at its peak: the resident set's high-water
    # mark (reset at the step's start) rose by most of it (pages the
    # allocator reused were resident already).
    equal("step_sum", 8 * MIB)
    at_least("step_peaked", 24 * MIB)
    # The walk went through the later cell's frames and named them.
    equal("late_frame", "true")
    # Every cell since memlab's first is a copy, and all share one state.
    equal("first", 1)
    at_least("copies", 5)
    equal("after", 8 * MIB)


if __name__ == "__main__":
    main()
