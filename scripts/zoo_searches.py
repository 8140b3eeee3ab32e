#!/usr/bin/env python3
"""The batch-search checks of the zoo: for each model and setting of
fixtures/zoo/h200_cuda.jsonl, an allocator limit halfway between the GPU's
peak reserved at the model's two largest sizes, and the largest batch (up to
twice the largest size) whose steps fit under it, searched on the GPU by
running them and on the CPU by memlab's prediction (`examples/zoo.rs
--search`, `find_batch_size` with `Budget::CudaCard`).

    python3 scripts/zoo_searches.py plan > PLAN.jsonl
    python3 scripts/zoo_searches.py run PLAN.jsonl ZOO cuda|cpu RESULTS.jsonl [JOBS]
    python3 scripts/zoo_searches.py table PLAN.jsonl RESULTS.jsonl...

ZOO is examples/zoo.rs built. The limit is a memory fraction of the H200's
memory (TOTAL; libtorch 2.11 truncates
fraction x total to bytes), with the setting, in a fresh process per search:
on the GPU run so, on the CPU predicted for that card under that fraction. It appends each search's line to RESULTS as it ends and skips
those already there, JOBS at a time (default 1; on the CPU they share its
cores). A search's tries are the same on both: doubling from 1, then halving
the gap.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SETTINGS = ("default", "expandable_segments:True")
# The H200's memory, as torch gave it (total_memory) on the host the zoo ran on.
TOTAL = 150109880320


def plan():
    peaks = {}
    with open(os.path.join(ROOT, "fixtures/zoo/h200_cuda.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["setting"] in SETTINGS:
                peaks.setdefault((r["model"], r["setting"]), []).append((r["size"], r["peak_reserved"]))
    for (model, setting), sizes in peaks.items():
        sizes.sort()
        (_, middle), (largest, top) = sizes[-2], sizes[-1]
        limit = (middle + top) // 2
        fraction = f"{limit / TOTAL:.12f}"
        # libtorch truncates fraction x total: at least the limit.
        while int(float(fraction) * TOTAL) < limit:
            fraction = f"{float(fraction) + 1e-12:.12f}"
        print(json.dumps({"model": model, "setting": setting, "limit": limit, "max": 2 * largest,
                          "fraction": fraction, "total": TOTAL}))


def run(plan_file, zoo, device, results, jobs):
    """Runs the plan's searches not yet in RESULTS, JOBS at a time, each
    line appended to RESULTS as it ends (run again, it goes on)."""
    import concurrent.futures
    import threading
    if device == "cuda":
        out = subprocess.run(
            ["python3", "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
            check=True, capture_output=True, text=True).stdout
        if int(out) != TOTAL:
            sys.exit(f"the plan is for a device of {TOTAL} bytes; this one has {int(out)}")
    done = set()
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                r = json.loads(line)
                if "error" not in r:
                    done.add((r["model"], r["setting"], r["device"]))
    with open(plan_file) as f:
        entries = [json.loads(line) for line in f]
    entries = [e for e in entries if (e["model"], e["setting"], device) not in done]
    lock = threading.Lock()
    # The CPU's searches share its cores.
    threads = max(1, (os.cpu_count() or 1) // jobs)

    def one(e):
        env = dict(os.environ)
        args = [zoo, "--model", e["model"], "--search", str(e["max"]), "--limit", str(e["limit"]),
                "--device", device, "--setting", e["setting"]]
        conf = [] if e["setting"] == "default" else [e["setting"]]
        args += ["--fraction", e["fraction"]]
        if device == "cuda":
            conf.append(f"per_process_memory_fraction:{e['fraction']}")
        else:
            args += ["--total", str(e["total"]), "--threads", str(threads)]
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)
        ran = subprocess.run(args, env=env, capture_output=True, text=True)
        line = next((l for l in ran.stdout.splitlines() if l.startswith("SEARCH ")), None)
        if line is None:
            r = dict(e, device=device, error=(ran.stderr or ran.stdout)[-400:])
        else:
            r = json.loads(line[len("SEARCH "):])
        with lock, open(results, "a") as f:
            f.write(json.dumps(r) + "\n")

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, entries))


def table(plan_file, results):
    found = {}
    for path in results:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                # A search run again after an error: its last line counts.
                found[(r["model"], r["setting"], r["device"])] = r
    print("| model | setting | limit (MiB) | GPU's largest batch | fits outright, predicted | "
          "may fit, up to | the GPU's | CPU search took |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    counts = {}
    with open(plan_file) as f:
        for line in f:
            e = json.loads(line)
            gpu = found.get((e["model"], e["setting"], "cuda"), {})
            cpu = found.get((e["model"], e["setting"], "cpu"), {})
            g, c = gpu.get("largest"), cpu.get("largest")
            up_to = cpu.get("largest_giving_cache_back") or c
            if g is None or c is None:
                said = "?"
            elif c > g:
                said = "below the outright one ✗"
            elif c == g:
                said = "the outright one"
            elif g <= up_to:
                said = "between the two"
            else:
                said = "above both"
            counts[said] = counts.get(said, 0) + 1
            took = f"{cpu['seconds']:.0f} s" if "seconds" in cpu else ""
            extra = "" if up_to == c else f"{up_to}"
            print(f"| {e['model']} | `{e['setting']}` | {e['limit'] / 2**20:,.1f} | {g} | {c} | {extra} | {said} | {took} |")
    print()
    print(", ".join(f"{n} {said}" for said, n in sorted(counts.items())))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "plan":
        plan()
    elif len(sys.argv) in (6, 7) and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]) if len(sys.argv) == 7 else 1)
    elif len(sys.argv) >= 4 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
