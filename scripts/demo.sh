#!/usr/bin/env bash
# Sets everything up (see env.sh) and runs memlab's main demo: a small MLP
# trained for a few steps, with its line-by-line memory tables.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"
cargo run --release --example train_mlp -- "$@"
