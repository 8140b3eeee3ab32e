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

ZOO is examples/zoo.rs built. On the GPU the limit is a memory fraction of
the device's memory (libtorch 2.11 truncates fraction x total to bytes), with
the setting, in a fresh process per search; `run` takes the device's memory
from torch. It appends each search's line to RESULTS as it ends and skips
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
        print(json.dumps({"model": model, "setting": setting, "limit": limit, "max": 2 * largest}))


def run(plan_file, zoo, device, results, jobs):
    """Runs the plan's searches not yet in RESULTS, JOBS at a time, each
    line appended to RESULTS as it ends (run again, it goes on)."""
    import concurrent.futures
    import threading
    total = None
    if device == "cuda":
        out = subprocess.run(
            ["python3", "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
            check=True, capture_output=True, text=True).stdout
        total = int(out)
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
        if device == "cuda":
            fraction = f"{e['limit'] / total:.12f}"
            # libtorch truncates fraction x total: at least the limit.
            while int(float(fraction) * total) < e["limit"]:
                fraction = f"{float(fraction) + 1e-12:.12f}"
            args += ["--fraction", fraction]
            conf.append(f"per_process_memory_fraction:{fraction}")
        else:
            args += ["--threads", str(threads)]
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
    print("| model | setting | limit (MiB) | GPU's largest batch | predicted | tries | CPU search took |")
    print("|---|---|---:|---:|---:|---|---:|")
    with open(plan_file) as f:
        for line in f:
            e = json.loads(line)
            gpu = found.get((e["model"], e["setting"], "cuda"), {})
            cpu = found.get((e["model"], e["setting"], "cpu"), {})
            g, c = gpu.get("largest", gpu.get("error", "?")), cpu.get("largest", cpu.get("error", "?"))
            same = gpu.get("tried") is not None and gpu.get("tried") == cpu.get("tried")
            mark = "" if g == c else " ✗"
            tries = "the same" if same else "differ"
            took = f"{cpu['seconds']:.0f} s" if "seconds" in cpu else ""
            print(f"| {e['model']} | `{e['setting']}` | {e['limit'] / 2**20:,.1f} | {g} | {c}{mark} | {tries} | {took} |")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "plan":
        plan()
    elif len(sys.argv) in (6, 7) and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]) if len(sys.argv) == 7 else 1)
    elif len(sys.argv) >= 4 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
