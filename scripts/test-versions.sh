#!/usr/bin/env bash
# memlab's CPU suite on its other supported tch: tch 0.26 over libtorch 2.13.
# Sets up that torch's venv (.venv-2.13.0, see env.sh), selects tch 0.26 in
# Cargo.lock (the project's own lock, on tch 0.24, the version CUDA is
# verified on, is saved first and put back on exit), builds beside the first
# pass's build, and runs the unit, integration and documentation tests (the UI
# tests, whose compiler messages are the default's, only run there). Then a
# user's crate pinned to tch 0.26, with memlab as a path dependency, builds
# and runs its demo (examples/tch-0.26-user).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MEMLAB_TORCH=2.13.0
source scripts/env.sh
cd "$MEMLAB_ROOT"
# The default target directory, shared with the first pass: cargo keeps both
# tch's builds side by side, and everything that does not depend on tch
# (memlab-core, memlab-cli, every other crate) is built once for both. The
# user's crate of tch 0.26 builds there too.
export CARGO_TARGET_DIR="$MEMLAB_ROOT/target"
saved="$(mktemp)" user_saved="$(mktemp)"
user_lock=examples/tch-0.26-user/Cargo.lock
cp Cargo.lock "$saved"
cp "$user_lock" "$user_saved"
trap 'cp "$saved" Cargo.lock; cp "$user_saved" "$user_lock"; rm -f "$saved" "$user_saved"' EXIT
cargo update --quiet -p tch --precise 0.26.0
grep -A1 '^name = "torch-sys"' Cargo.lock | grep -q 'version = "0.26.0"' || {
  echo "memlab: selecting tch 0.26 did not select torch-sys 0.26" >&2
  exit 1
}
# Every crate but memlab-cli (its crate graph holds no tch: the first pass
# tested it; left out, nothing else resolves other features), libraries,
# test binaries and doc tests. Examples are left out: they build in the
# first pass, and the user's crate below builds memlab under tch 0.26.
selected=(--workspace --exclude memlab-cli)
cargo test --release "${selected[@]}" --lib --bins --tests "$@" -- --exact --skip ui
cargo test --release "${selected[@]}" --doc "$@"
# The user's crate resolves against memlab's own lock, now on tch 0.26 (its
# committed lock is put back on exit): the same versions of every crate, so
# that it reuses this pass's build of them (torch-sys's C++ above all) and
# builds only what its features change, 55 s where its own lock took 150 s.
cp Cargo.lock "$user_lock"
(cd examples/tch-0.26-user && cargo run --release --quiet)
