#!/usr/bin/env bash
# Sets everything up (see env.sh) and runs memlab's whole test suite: unit,
# integration, UI (trybuild) and documentation tests; then clippy, which with
# the workspace's rust-version also rejects std APIs newer than that version,
# and the documentation built as docs.rs builds it, without libtorch. Tests
# that need a CUDA GPU are ignored here; on a GPU machine pass
# `-- --include-ignored`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"
cargo test --release --workspace "$@"
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
(
  PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$MEMLAB_VENV/bin" | paste -sd:)"
  unset LD_LIBRARY_PATH LIBTORCH_USE_PYTORCH
  cd memlab-cli
  for test in $cli_tests; do
    echo "memlab: $(basename "$test") without libtorch"
    "$test"
  done
)
# The engine once more in debug, where an overflow that wraps in release
# panics: the allocator model, its readers and the property tests of their
# hostile inputs (memlab-core needs no libtorch: it builds in seconds).
cargo test -p memlab-core
# The backend with its optional parts left out: their calls say which feature they need.
cargo test --release -p memlab-tch --no-default-features --lib
cargo clippy --release --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" CARGO_TARGET_DIR=target/doc-only \
  cargo doc --workspace --no-deps --features doc-only
