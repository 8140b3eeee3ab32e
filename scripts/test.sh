#!/usr/bin/env bash
# Sets everything up (see env.sh) and runs memlab's whole test suite: unit,
# integration, UI (trybuild) and documentation tests. Tests that need a CUDA
# GPU are ignored here; on a GPU machine pass `-- --include-ignored`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"
cargo test --release --workspace "$@"
