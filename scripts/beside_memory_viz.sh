#!/usr/bin/env bash
# Prints what PyTorch's own reader, `python -m torch.cuda._memory_viz`,
# prints offline for the committed snapshots, beside what `memlab` prints
# for the same files: the side-by-side of the CLI's guide. `compare` is run
# too and shows how it ends on `_dump_snapshot`'s files.
#
#     bash scripts/beside_memory_viz.sh [SNAPSHOT]      # fixtures/transformer_all.pickle by default
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
snapshot="${1:-$root/fixtures/transformer_all.pickle}"
(cd "$root" && cargo build --release -q -p memlab-cli)
memlab="$root/target/release/memlab"
viz() { python3 -W ignore -m torch.cuda._memory_viz "$@" 2>&1 | grep -v "Warning\|_conversion_method_template"; }
section() { printf '\n==== %s\n' "$*"; }
section "memory_viz stats $snapshot"; viz stats "$snapshot"
section "memlab summary $snapshot"; "$memlab" summary "$snapshot"
section "memory_viz trace $snapshot (first and last 15 of $(viz trace "$snapshot" | wc -l) lines)"
viz trace "$snapshot" | head -15; echo "…"; viz trace "$snapshot" | tail -15
section "memlab view $snapshot"; "$memlab" view "$snapshot" -o "${TMPDIR:-/tmp}/memlab_view.html"
section "memory_viz compare fixed.pickle leaky.pickle"; viz compare "$root/fixtures/fixed.pickle" "$root/fixtures/leaky.pickle" | tail -3
section "memlab diff fixed.pickle leaky.pickle"; "$memlab" diff "$root/fixtures/fixed.pickle" "$root/fixtures/leaky.pickle"
