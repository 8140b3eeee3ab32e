#!/usr/bin/env bash
# Sets everything up (see env.sh) and runs memlab's whole test suite: unit,
# integration, UI (trybuild) and documentation tests; then clippy, which with
# the workspace's rust-version also rejects std APIs newer than that version,
# and the documentation built as docs.rs builds it, without libtorch. Tests
# that need a CUDA GPU are ignored here; on a GPU machine pass
# `-- --include-ignored`.
set -euo pipefail
started=$SECONDS
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"
# Each step's wall time, printed as it ends and again at the end, so that a
# slow step shows in every log (BENCHMARKS.md has the suite's figures).
times=("$(printf '%5d s  %s' $((SECONDS - started)) "setup (the venv)")")
step() {
  local name="$1" began=$SECONDS
  shift
  "$@"
  times+=("$(printf '%5d s  %s' $((SECONDS - began)) "$name")")
  echo "memlab: ${times[-1]}"
}
step "unit, integration, UI and doc tests" cargo test --release --workspace "$@"
# The command-line tool needs no libtorch to run: its test binaries, just
# built, again with the torch venv off PATH and LD_LIBRARY_PATH (its crate
# graph holds no libtorch, so nothing needs building without it; building
# `-p memlab-cli` alone would unify other features and rebuild for a minute).
cli_tests="$(cargo test --release --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and "/memlab-cli#" in m["package_id"]:
        print(m["executable"])')"
[ -n "$cli_tests" ] || { echo "memlab: found no test binary of memlab-cli" >&2; exit 1; }
without_libtorch() (
  PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$MEMLAB_VENV/bin" | paste -sd:)"
  unset LD_LIBRARY_PATH LIBTORCH_USE_PYTORCH
  cd memlab-cli
  for test in $cli_tests; do
    echo "memlab: $(basename "$test") without libtorch"
    "$test"
  done
)
step "memlab-cli's tests without libtorch" without_libtorch
# The engine once more in debug, where an overflow that wraps in release
# panics: the allocator model, its readers and the property tests of their
# hostile inputs (memlab-core needs no libtorch: it builds in seconds). The
# committed zoo's 102 predictions (14 s in debug) run in release only.
step "memlab-core in debug" cargo test -p memlab-core -- --skip the_committed_zoo_is_predicted
# The backend with its optional parts left out: their calls say which feature they need.
step "memlab-tch without its features" cargo test --release -p memlab-tch --no-default-features --lib
step "clippy" cargo clippy --release --workspace --all-targets -- -D warnings
# In the release profile beside clippy's build: the dependencies the
# `doc-only` feature leaves as they were are checked once for both (the step
# took 43-60 s in a directory of its own, 12 s here).
docs_without_libtorch() {
  RUSTDOCFLAGS="-D warnings" cargo doc --release --workspace --no-deps --features doc-only
}
step "the documentation without libtorch" docs_without_libtorch
echo "memlab: the suite's steps:"
printf '%s\n' "${times[@]}"
printf '%5d s  in all\n' $((SECONDS - started))
