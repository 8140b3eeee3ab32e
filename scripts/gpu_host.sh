#!/usr/bin/env bash
# On a GPU host without cargo, from the repository root, with the binaries
# built here copied into .gpu/ (see CONTRIBUTING.md):
#
#     mkdir -p .gpu
#     cargo test --release --no-run --test cuda --message-format=json \
#       | jq -r 'select(.profile.test == true) | .executable' | xargs -I{} cp {} .gpu/cuda
#     cargo bench --no-run --bench profiler --message-format=json \
#       | jq -r 'select(.profile.test == true) | .executable' | xargs -I{} cp {} .gpu/profiler
#     strip --strip-debug --compress-debug-sections .gpu/*   # keeps what backtraces need
#
# Then, on the GPU host (its python3 has torch 2.11.0+cu130):
#
#     bash scripts/gpu_host.sh OUT fixtures tests bench
#
# `fixtures` (`frag93` alone: its part): PyTorch's recordings that the CPU tests replay
# (scripts/replay_fixtures.py: a program that catches its out-of-memory
# errors, and a fragmentation failure at the device's scale: replay/ and
# frag93_results.jsonl). `tests` (`tests=NAME`: those whose names hold
# NAME): every CUDA test, one at a time, with the
# out-of-memory reports' fixtures copied (oom/). `bench`: the line
# profiler's benchmark. OUT gets two files: log.txt, everything printed, and
# fixtures.tgz, the fixtures made.
set -u
OUT=${1:?usage: gpu_host.sh OUT [fixtures] [tests] [bench]}
shift
mkdir -p "$OUT"
made=$(mktemp -d)
TL=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))') || {
  echo "no torch for python3: this runs on a GPU host whose python3 has torch 2.11.0+cu130" >&2
  exit 2
}
trap 'rm -rf "$made"' EXIT
export LD_LIBRARY_PATH="$TL/lib:$TL/../nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log="$OUT/log.txt"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.git_version)'
} >>"$log" 2>&1
for part in "$@"; do
  echo "== $part ($(date -u +%T))" >>"$log"
  case "$part" in
    fixtures)
      python3 scripts/replay_fixtures.py "$made/replay" caught >>"$log" 2>&1
      ;&
    frag93)
      frag=$(mktemp -d)
      python3 scripts/replay_fixtures.py "$frag" frag93 >>"$log" 2>&1
      cp "$frag/results.jsonl" "$made/frag93_results.jsonl"
      rm -rf "$frag"
      ;;
    tests | tests=*)
      # tests=NAME runs the tests whose names hold NAME.
      filter=${part#tests}
      MEMLAB_FIXTURE_OUT="$made/oom" .gpu/cuda --include-ignored --test-threads 1 ${filter#=} >>"$log" 2>&1
      echo "cuda tests exit $?" >>"$log"
      ;;
    bench)
      .gpu/profiler --bench >>"$log" 2>&1
      echo "profiler bench exit $?" >>"$log"
      ;;
    *) echo "unknown part $part" >>"$log" ;;
  esac
done
parts=$(cd "$made" && ls -d replay oom frag93_results.jsonl 2>/dev/null)
[ -n "$parts" ] && tar czf "$OUT/fixtures.tgz" -C "$made" $parts
echo "== done ($(date -u +%T))" >>"$log"
