#!/usr/bin/env bash
# Compares memlab's hot paths between two builds of examples/bench_hotpaths
# on this machine: runs OLD and NEW alternately for ROUNDS rounds, each pair
# in the other order than the last (so drift hits both), then prints, per
# hot path, the median of each side and the median of the per-round ratios
# new/old.
#
#     bash scripts/compare_hotpaths.sh OLD_BINARY NEW_BINARY [ROUNDS]
set -euo pipefail
old="$1"
new="$2"
rounds="${3:-7}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for round in $(seq 1 "$rounds"); do
  # Odd rounds run OLD first, even rounds NEW first, so that whatever the
  # machine does to the second run of a pair hits both sides alike.
  order="old new"
  [ $((round % 2)) = 0 ] && order="new old"
  for side in $order; do
    binary="$old"
    [ "$side" = new ] && binary="$new"
    "$binary" | sed -n "s/^HOTPATHS /$round $side /p" >>"$log"
  done
done
python3 - "$log" <<'PY'
import statistics, sys
rounds = {}
for line in open(sys.argv[1]):
    round_, side, *pairs = line.split()
    rounds.setdefault(round_, {})[side] = {k: float(v) for k, v in (p.split("=") for p in pairs)}
names = list(next(iter(rounds.values()))["old"])
print(f"| hot path | old, median ns | new, median ns | median ratio new/old ({len(rounds)} rounds) |")
print("|---|---:|---:|---:|")
for name in names:
    old = [r["old"][name] for r in rounds.values()]
    new = [r["new"][name] for r in rounds.values()]
    ratios = [n / o for n, o in zip(new, old) if o > 0]
    print(f"| {name} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | {statistics.median(ratios):.3f} |")
PY
