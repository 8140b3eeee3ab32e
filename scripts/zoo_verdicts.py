#!/usr/bin/env python3
"""The verdict checks of the zoo: for each entry of fixtures/zoo/h200_cuda.jsonl,
two allocator limits, 1 % below and 1 % above the peak reserved memlab
predicts for its steps (from fixtures/zoo/steps/), each a memory fraction of
the H200's memory; memlab's verdict for the H200 under that fraction
(`memlab replay STEPS --as-cuda --capacity TOTAL --setting
SETTING,per_process_memory_fraction:F --json`), and the GPU's run under it.
A verdict "fits" must fit, "does not fit" must run out; "may not fit" (the
model fits only by giving cache back, or the fraction lies in a range)
claims neither.

    python3 scripts/zoo_verdicts.py plan MEMLAB [JOBS] > PLAN.jsonl     # here, no GPU
    python3 scripts/zoo_verdicts.py run PLAN.jsonl ZOO [JOBS] > RESULTS.jsonl   # on the GPU host
    python3 scripts/zoo_verdicts.py table PLAN.jsonl RESULTS.jsonl       # the table

MEMLAB is the `memlab` command; ZOO is examples/zoo.rs built. TOTAL is the
H200's memory as torch gave it; libtorch
2.11 truncates fraction × total to bytes. Each GPU run is a fresh process
with the entry's setting.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The H200's memory, as torch gave it (total_memory) on the host the zoo ran on.
TOTAL = 150109880320


def entries():
    with open(os.path.join(ROOT, "fixtures/zoo/h200_cuda.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            yield r["model"], r["size"], r["setting"]


def predict(memlab, steps, setting, capacity=None):
    args = [memlab, "replay", steps, "--as-cuda", "--json"]
    if setting != "default":
        args += ["--setting", setting]
    if capacity is not None:
        args += ["--capacity", str(capacity)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def claim(fit):
    """What a verdict claims: fits, runs out, or neither."""
    if fit is None or "Fits" in fit:
        return "fits"
    if "DoesNotFit" in fit or "NoCard" in fit:
        return "runs out"
    return "may not fit"


def plan(memlab, jobs=1):
    import concurrent.futures

    def one(entry):
        model, size, setting = entry
        steps = os.path.join(ROOT, "fixtures/zoo/steps", f"{model}_{size}.pickle.gz")
        s = predict(memlab, steps, setting)["settings"][0]
        rows = []
        for side, factor in (("below", 0.99), ("above", 1.01)):
            limit = int(s["peak_reserved"] * factor)
            fraction = f"{(limit + 0.5) / TOTAL:.12f}"
            conf = ",".join(x for x in [setting if setting != "default" else "",
                                        f"per_process_memory_fraction:{fraction}"] if x)
            fit = predict(memlab, steps, conf, TOTAL)["settings"][0]["fit"]
            rows.append({"model": model, "size": size, "setting": setting,
                         "predicted_reserved": s["peak_reserved"], "side": side, "limit": limit,
                         "fraction": fraction, "verdict": claim(fit), "fit": fit})
        return rows

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for rows in pool.map(one, list(entries())):
            for r in rows:
                print(json.dumps(r), flush=True)


def run(plan_file, zoo, jobs=1):
    import concurrent.futures
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    if total != TOTAL:
        sys.exit(f"the plan is for a device of {TOTAL} bytes; this one has {total}")

    def one(e):
        conf = ",".join(x for x in [e["setting"] if e["setting"] != "default" else "",
                                    f"per_process_memory_fraction:{e['fraction']}"] if x)
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        args = [zoo, "--model", e["model"], "--size", str(e["size"]), "--device", "cuda",
                "--setting", e["setting"], "--fraction", e["fraction"]]
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        line = [l for l in out.stdout.splitlines() if l.startswith("ZOO ")]
        r = json.loads(line[-1][4:]) if line else {"error": out.stderr[-500:]}
        r.update({"model": e["model"], "size": e["size"], "setting": e["setting"],
                  "side": e["side"], "limit": e["limit"], "total": total})
        return r

    # Each process has its own fraction: several share the device.
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(one, [json.loads(line) for line in open(plan_file)]):
            print(json.dumps(r), flush=True)


def table(plan_file, results_file):
    plans = [json.loads(l) for l in open(plan_file)]
    results = {(r["model"], r["size"], r["setting"], r["side"]): r for r in map(json.loads, open(results_file))}
    right = wrong = neither = 0
    rows = {}
    for p in plans:
        r = results.get((p["model"], p["size"], p["setting"], p["side"]))
        gpu = "?" if r is None or "oom" not in r else ("runs out" if r["oom"] else "fits")
        mark = ""
        if p["verdict"] == "may not fit":
            neither += 1
        elif gpu == p["verdict"]:
            right += 1
        else:
            wrong += 1
            mark = " ✗"
        key = (p["model"], p["size"], p["setting"])
        rows.setdefault(key, {"reserved": p["predicted_reserved"]})[p["side"]] = f"{p['verdict']} / {gpu}{mark}"
    print("| model | size | setting | predicted peak reserved (MiB) | 1 % below: memlab / the GPU | "
          "1 % above: memlab / the GPU |")
    print("|---|---:|---|---:|---|---|")
    for (model, size, setting), row in rows.items():
        print(f"| {model} | {size:,} | `{setting}` | {row['reserved'] / 2**20:,.1f} | {row.get('below', '?')} | "
              f"{row.get('above', '?')} |")
    print(f"\n{right} verdicts right, {wrong} wrong, {neither} \"may not fit\" (no claim), of {len(plans)}")


if __name__ == "__main__":
    {"plan": lambda: plan(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1),
     "run": lambda: run(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1),
     "table": lambda: table(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
