#!/usr/bin/env bash
# Runs examples/ranks.rs as N ranks (2 by default) writing into DIR, then
# merges their files with `memlab merge` into DIR/merged. On a machine with
# N GPUs each rank has its own GPU (the last asks for more than its GPU
# has); without them the ranks run on the CPU. Prints what merge prints.
#
#     bash scripts/ranks.sh [DIR] [N]
#
# RANKS_BIN and MEMLAB_BIN name prebuilt binaries (for a GPU host without
# cargo, with libtorch's libraries on LD_LIBRARY_PATH); otherwise they are
# built here first, with scripts/env.sh's set-up.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-memlab_ranks}"
world="${2:-2}"
if [ -z "${RANKS_BIN:-}" ] || [ -z "${MEMLAB_BIN:-}" ]; then
  source "$root/scripts/env.sh"
  (cd "$root" && cargo build --release --example ranks && cargo build --release -p memlab-cli) >&2
  RANKS_BIN="${RANKS_BIN:-$root/target/release/examples/ranks}"
  MEMLAB_BIN="${MEMLAB_BIN:-$root/target/release/memlab}"
fi
rm -rf "$dir"
mkdir -p "$dir"
pids=()
for rank in $(seq 0 $((world - 1))); do
  MEMLAB_RANK=$rank WORLD_SIZE=$world "$RANKS_BIN" --out "$dir" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
shopt -s nullglob
"$MEMLAB_BIN" merge "$dir"/memlab_snapshot_rank*.pickle "$dir"/memlab_trace_rank*.json "$dir"/memlab_oom_*.json \
  -o "$dir/merged"
