#!/usr/bin/env bash
# The compile-fail (UI) tests once more with the toolchain's rust-src
# component switched the other way: rustc quotes the standard library's
# sources in its notes when rust-src is installed (rust-analyzer users have
# it) and not otherwise, and the expected messages must hold either way.
# The component is put back as it was afterwards. Run by CI after the
# README's test command, which ran them the first way.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"
if rustup component list --installed 2>/dev/null | grep -qx 'rust-src'; then
  had=1
  switch=(remove restore=add)
else
  had=0
  switch=(add restore=remove)
fi
echo "memlab: the UI tests again, with rust-src $([ "$had" = 1 ] && echo removed || echo added)" >&2
if ! rustup component "${switch[0]}" rust-src >&2; then
  echo "memlab: rustup could not ${switch[0]} rust-src here; the UI tests ran one way only" >&2
  exit 0
fi
status=0
# --workspace: features resolved as the suite's own run resolved them, so
# nothing but the test's cases is built again (alone, `--test ui` resolves
# others and rebuilds memlab and its crates, 45 s).
cargo test --release --workspace --test ui || status=$?
rustup component "${switch[1]#restore=}" rust-src >&2 || true
exit "$status"
