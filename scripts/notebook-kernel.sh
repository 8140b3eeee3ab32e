#!/usr/bin/env bash
# Registers evcxr's Jupyter kernel for memlab, with the environment
# scripts/env.sh sets written into its kernel spec: a notebook started from
# any shell, or from JupyterLab's launcher, then finds libtorch. Without it
# a kernel started from a shell without torch's lib/ on LD_LIBRARY_PATH fails
# at the first cell that uses memlab or tch, with "dlopen failed …
# exit status: 99": the cell's library links libtorch, which the kernel's
# child process cannot load.
#
#   bash scripts/notebook-kernel.sh [--name NAME] [--evcxr PATH]
#
# NAME (default memlab-rust) is the kernel's name in Jupyter ("Rust
# (memlab, torch 2.11.0)" in its launcher); PATH is evcxr_jupyter (default:
# the one on PATH, else the one scripts/test-notebook.sh installs in
# target/evcxr; `cargo install --locked evcxr_jupyter` installs it). The spec
# goes where Jupyter looks for a user's kernels (JUPYTER_DATA_DIR, else
# ~/.local/share/jupyter), or under JUPYTER_PATH's first entry when that is set.
# MEMLAB_TORCH=2.13.0 registers the kernel for tch 0.26 (see env.sh).
#
# The kernel keeps its build of the cells' crates in target/evcxr-cells
# (EVCXR_TMPDIR), so a restarted kernel does not build memlab and tch again.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

name="memlab-rust"
evcxr=""
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="${2:?--name needs a name}"; shift 2 ;;
    --evcxr) evcxr="${2:?--evcxr needs a path}"; shift 2 ;;
    *) echo "usage: bash scripts/notebook-kernel.sh [--name NAME] [--evcxr PATH]" >&2; exit 2 ;;
  esac
done
if [ -z "$evcxr" ]; then
  evcxr="$(command -v evcxr_jupyter || true)"
  [ -n "$evcxr" ] || evcxr="$MEMLAB_ROOT/target/evcxr/bin/evcxr_jupyter"
fi
if [ ! -x "$evcxr" ]; then
  echo "memlab: no evcxr_jupyter at $evcxr; install it (cargo install --locked evcxr_jupyter --version 0.22.0) or give --evcxr PATH" >&2
  exit 2
fi
# Jupyter starts the kernel from its own directory: the path, whole.
evcxr="$(cd "$(dirname "$evcxr")" && pwd)/$(basename "$evcxr")"
# The kernel compiles each cell with cargo.
if ! command -v cargo >/dev/null; then
  echo "memlab: no cargo on PATH; the kernel compiles every cell with it (install Rust with rustup)" >&2
  exit 2
fi
if [ -n "${JUPYTER_PATH:-}" ]; then
  kernels="${JUPYTER_PATH%%:*}/kernels"
else
  kernels="${JUPYTER_DATA_DIR:-$HOME/.local/share/jupyter}/kernels"
fi
mkdir -p "$kernels/$name" "$MEMLAB_ROOT/target/evcxr-cells"
"$MEMLAB_VENV/bin/python" - "$kernels/$name/kernel.json" "$evcxr" "$MEMLAB_ROOT" "$MEMLAB_TORCH_VERSION" <<'PY'
import json, os, sys
spec, evcxr, root, torch = sys.argv[1:]
env = {
    # What env.sh sets: tch builds against the venv's torch, the cells load its libraries.
    "LIBTORCH_USE_PYTORCH": "1",
    "LD_LIBRARY_PATH": os.environ["LD_LIBRARY_PATH"],
    # This shell's PATH as env.sh left it: the venv's python first, cargo on it.
    "PATH": os.environ["PATH"],
    # The cells' build, kept between kernel restarts.
    "EVCXR_TMPDIR": os.path.join(root, "target", "evcxr-cells"),
    # Line tables in the cells' libraries: their frames in backtraces get a file and line.
    "CARGO_PROFILE_DEV_DEBUG": "line-tables-only",
    "CARGO_PROFILE_DEV_STRIP": "none",
}
with open(spec, "w") as f:
    json.dump({
        "argv": [evcxr, "--control_file", "{connection_file}"],
        "display_name": f"Rust (memlab, torch {torch})",
        "language": "rust",
        "interrupt_mode": "message",
        "env": env,
    }, f, indent=1)
print(f"memlab: registered the kernel {os.path.basename(os.path.dirname(spec))} ({spec}), torch {torch}")
PY
