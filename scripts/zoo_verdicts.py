#!/usr/bin/env python3
"""The verdict checks of the zoo: for each entry of fixtures/zoo/h200_cuda.jsonl,
the least allocator limit under which memlab predicts its steps fit
(`memlab replay STEPS --as-cuda --capacity C --json`, from the steps of
fixtures/zoo/steps/), and the two limits to run the GPU under, 1 % below and
1 % above it: the step should run out under the first and fit under the second.

    python3 scripts/zoo_verdicts.py plan MEMLAB > PLAN.jsonl      # here, no GPU
    python3 scripts/zoo_verdicts.py run PLAN.jsonl ZOO > RESULTS.jsonl   # on the GPU host
    python3 scripts/zoo_verdicts.py table PLAN.jsonl RESULTS.jsonl   # the table

MEMLAB is the `memlab` command; ZOO is examples/zoo.rs built. On the GPU the
limit is a memory fraction of the device's memory (libtorch 2.11 truncates
fraction × total to bytes), with the entry's setting, in a fresh process.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


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


def plan(memlab):
    for model, size, setting in entries():
        steps = os.path.join(ROOT, "fixtures/zoo/steps", f"{model}_{size}.pickle.gz")
        p = predict(memlab, steps, setting)
        s = p["settings"][0]
        outside = p["additions"]["outside_allocator"]
        # The least card: under a card one byte short of the device peak the
        # prediction says by how much more, or the least it fits giving
        # cache back.
        short = predict(memlab, steps, setting, s["peak_device"] - 1)["settings"][0]["fit"]
        rng = s.get("range")
        if rng:
            # A range: it runs out below its low end and fits above its high end.
            low, high = rng["low"]["reserved"], rng["high"]["reserved"]
        elif "DoesNotFit" in short:
            low = high = s["peak_device"] - 1 + short["DoesNotFit"]["needing"] - outside
        elif "FitsGivingCacheBack" in short:
            low = high = short["FitsGivingCacheBack"]["least"] - outside
        else:
            low = high = s["peak_reserved"]
        print(json.dumps({
            "model": model, "size": size, "setting": setting,
            "predicted_reserved": s["peak_reserved"], "least_limit": low, "least_limit_high": high,
            "below": int(low * 0.99), "above": int(high * 1.01), "range": rng is not None,
        }))


def run(plan_file, zoo):
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    for line in open(plan_file):
        e = json.loads(line)
        for side in ("below", "above"):
            limit = e[side]
            fraction = f"{(limit + 0.5) / total:.12f}"
            conf = ",".join(x for x in [e["setting"] if e["setting"] != "default" else "",
                                        f"per_process_memory_fraction:{fraction}"] if x)
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            args = [zoo, "--model", e["model"], "--size", str(e["size"]), "--device", "cuda",
                    "--setting", e["setting"], "--fraction", fraction]
            out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
            line = [l for l in out.stdout.splitlines() if l.startswith("ZOO ")]
            r = json.loads(line[-1][4:]) if line else {"error": out.stderr[-500:]}
            r.update({"side": side, "limit": limit, "total": total})
            print(json.dumps(r), flush=True)


def table(plan_file, results_file):
    plans = {(p["model"], p["size"], p["setting"]): p for p in map(json.loads, open(plan_file))}
    results = {}
    for r in map(json.loads, open(results_file)):
        results[(r["model"], r["size"], r["setting"], r["side"])] = r
    right = wrong = 0
    print("| model | size | setting | least limit predicted (MiB) | 1 % below | 1 % above |")
    print("|---|---:|---|---:|---|---|")
    for k, p in plans.items():
        below, above = results.get(k + ("below",)), results.get(k + ("above",))
        said = lambda r, want: "?" if r is None else ("runs out" if r.get("oom") else "fits") + \
            ("" if (r.get("oom") is want) else " ✗")
        ok = below is not None and above is not None and below.get("oom") is True and above.get("oom") is False
        right += ok
        wrong += not ok
        print(f"| {k[0]} | {k[1]:,} | `{k[2]}` | {p['least_limit'] / 2**20:,.1f} | {said(below, True)} | {said(above, False)} |")
    print(f"\n{right} of {right + wrong} as predicted")


if __name__ == "__main__":
    {"plan": lambda: plan(sys.argv[2]), "run": lambda: run(sys.argv[2], sys.argv[3]),
     "table": lambda: table(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
