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
# The command-line tool needs no libtorch to build or run: its tests again,
# with the torch venv off PATH and LD_LIBRARY_PATH.
(
  PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$MEMLAB_VENV/bin" | paste -sd:)"
  unset LD_LIBRARY_PATH LIBTORCH_USE_PYTORCH
  cargo test --release -p memlab-cli
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
