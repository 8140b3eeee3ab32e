#!/usr/bin/env bash
# Compares memlab's hot paths between two builds of its hot-path benchmark
# (benches/hotpaths.rs) on this machine: runs OLD and NEW alternately for
# ROUNDS rounds, each pair in the other order than the last (so drift hits
# both), then prints, per hot path, the median of each side and the median of
# the per-round ratios new/old.
#
#     bash scripts/compare_hotpaths.sh OLD_BINARY NEW_BINARY [ROUNDS]
#
# Run it where scripts/env.sh was sourced: the binaries load libtorch from
# there. To build the binaries, run this in the root of each checkout to
# measure (the script itself may come from another checkout):
#
#     bash scripts/compare_hotpaths.sh --build [COPY_TO]
#
# It builds the benchmark with `cargo bench --bench hotpaths --no-run` (the
# binary is target/release/deps/hotpaths-<hash>) and prints the binary's path,
# or copies the binary to COPY_TO and prints that. Copy the first build aside
# before building another commit in the same checkout, since cargo gives both
# the same path. Commits from before the benchmarks moved to benches/ have the
# same program as an example, which prints the same HOTPATHS line; there
# --build runs `cargo build --release --example bench_hotpaths` instead
# (target/release/examples/bench_hotpaths).
set -euo pipefail

if [ "${1:-}" = --build ]; then
  copy_to="${2:-}"
  source "$(dirname "${BASH_SOURCE[0]}")/env.sh" >&2
  if [ -f benches/hotpaths.rs ]; then
    build=(cargo bench --bench hotpaths --no-run)
  else
    build=(cargo build --release --example bench_hotpaths)
  fi
  binary="$("${build[@]}" --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["name"] in ("hotpaths", "bench_hotpaths") and message.get("executable"):
        print(message["executable"])
')"
  if [ -z "$binary" ]; then
    echo "compare_hotpaths.sh: the build produced no hot-path benchmark" >&2
    exit 1
  fi
  if [ -n "$copy_to" ]; then
    cp "$binary" "$copy_to"
    binary="$copy_to"
  fi
  echo "$binary"
  exit 0
fi

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
    # `--bench` makes the benchmark measure (without it, it only checks that
    # each path runs); builds of the example ignore it.
    "$binary" --bench | sed -n "s/^HOTPATHS /$round $side /p" >>"$log"
    grep -q "^$round $side " "$log" || {
      echo "compare_hotpaths.sh: $binary printed no HOTPATHS line" >&2
      exit 1
    }
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
