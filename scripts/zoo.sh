#!/usr/bin/env bash
# The zoo of examples/zoo.rs, measured: every entry of its grid, each in a
# fresh process, one JSON line each appended to RESULTS. Run again, it goes
# on from where RESULTS stops (an entry already there is skipped), so that a
# long measurement can be spread over several runs.
#
#     bash scripts/zoo.sh cuda RESULTS.jsonl [SECONDS]   # the GPU's peaks
#     bash scripts/zoo.sh cpu RESULTS.jsonl [SECONDS]    # memlab's predictions
#
# SECONDS (default: no limit) stops starting entries after that long. On a
# GPU host without cargo, the binary built here is taken from .gpu/zoo
#     cargo build --release --example zoo && cp target/release/examples/zoo .gpu/
# with torch's libraries from its python3's torch. On CUDA each entry runs
# under its setting as PYTORCH_CUDA_ALLOC_CONF. An entry that fails gets a
# line with its error; each has at most 10 minutes. With ZOO_SAVE=DIR, the
# CPU's steps of each model and size are also saved there once
# (DIR/MODEL_SIZE.pickle, `WillItFit::save`), for `memlab replay --as-cuda`
# and the test of the committed zoo to predict from.
set -u
device=${1:?usage: zoo.sh cuda|cpu RESULTS.jsonl [SECONDS]}
results=${2:?usage: zoo.sh cuda|cpu RESULTS.jsonl [SECONDS]}
limit=${3:-0}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .gpu/zoo ]; then
  zoo=.gpu/zoo
  torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  source scripts/env.sh
  cargo build --release --quiet --example zoo
  zoo=target/release/examples/zoo
fi
touch "$results"
started=$SECONDS
"$zoo" --grid | while read -r model size setting; do
  key="\"device\":\"$device\",\"model\":\"$model\""
  if grep -F "$key" "$results" | grep -F "\"setting\":\"$setting\"" | grep -qF "\"size\":$size,"; then
    continue
  fi
  if [ "$limit" -gt 0 ] && [ $((SECONDS - started)) -ge "$limit" ]; then
    echo "zoo: stopping after ${limit} s; run again to go on" >&2
    break
  fi
  conf=$([ "$setting" = default ] || echo "$setting")
  save=()
  if [ "$device" = cpu ] && [ -n "${ZOO_SAVE:-}" ] && [ ! -e "$ZOO_SAVE/${model}_$size.pickle" ]; then
    mkdir -p "$ZOO_SAVE"
    save=(--out "$ZOO_SAVE/${model}_$size.pickle")
  fi
  out=$(PYTORCH_CUDA_ALLOC_CONF="$conf" timeout 600 "$zoo" --model "$model" --size "$size" \
    --device "$device" --setting "$setting" "${save[@]}" 2>&1)
  line=$(printf '%s\n' "$out" | grep '^ZOO ' | tail -1)
  if [ -n "$line" ]; then
    echo "${line#ZOO }" >>"$results"
  else
    error=$(printf '%s\n' "$out" | grep -v '^  ' | tail -3 | tr '\n' ' ' | sed 's/\\/\\\\/g; s/"/\\"/g')
    echo "{$key,\"setting\":\"$setting\",\"size\":$size,\"error\":\"$error\"}" >>"$results"
  fi
  tail -1 "$results" >&2
done
