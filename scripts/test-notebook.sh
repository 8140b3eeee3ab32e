#!/usr/bin/env bash
# memlab in a notebook, tried as a user tries it: evcxr's Jupyter kernel
# (evcxr_jupyter 0.22, default settings) runs examples/notebook/memlab.ipynb
# through nbclient, as JupyterLab would, and then a session of cells typed
# one after another; every cell's outputs are checked (the mime types that
# arrive, every figure against what the cells allocated). See
# scripts/notebook_run.py. The executed notebook, its HTML rendering and the
# cells' CSV are left in target/notebook.
#
#   bash scripts/test-notebook.sh            # run and check
#   bash scripts/test-notebook.sh --picture  # also screenshot the rendering
#                                            # into docs/notebook.png (chromium)
#   bash scripts/test-notebook.sh --fresh-kernel
#       # the kernel scripts/notebook-kernel.sh registers, started from a
#       # bare environment (nothing of env.sh's), runs memlab's first cells
#
# Too slow for CI: the first run installs evcxr_jupyter (cargo install
# --locked, 20 minutes to an hour on 2 cores; cached in target/evcxr) and
# builds memlab and tch for the notebook (cached in target/evcxr-cells).
# Run it before changing how memlab keeps its state or what a display sends.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"

picture=0
fresh=0
case "${1:-}" in
  --picture) picture=1 ;;
  --fresh-kernel) fresh=1 ;;
  "") ;;
  *) echo "usage: bash scripts/test-notebook.sh [--picture | --fresh-kernel]" >&2; exit 2 ;;
esac

EVCXR_VERSION="0.22.0"
tools="$MEMLAB_ROOT/target/evcxr"
if ! cargo install --list --root "$tools" 2>/dev/null | grep -qx "evcxr_jupyter v$EVCXR_VERSION:"; then
  echo "memlab: installing evcxr_jupyter $EVCXR_VERSION into target/evcxr (once; 20 minutes to an hour)" >&2
  cargo install --locked evcxr_jupyter --version "=$EVCXR_VERSION" --root "$tools"
fi
# The Jupyter side, in the project's venv, at the versions this was tried with.
"$MEMLAB_VENV/bin/python" -m pip install -q nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 nbconvert==7.17.2
# The kernel's spec where only this run looks (not the user's Jupyter), and
# Jupyter's connection files beside it.
export JUPYTER_PATH="$tools/jupyter" JUPYTER_RUNTIME_DIR="$tools/jupyter/runtime"
mkdir -p "$JUPYTER_PATH/kernels/rust" "$JUPYTER_RUNTIME_DIR"
cat > "$JUPYTER_PATH/kernels/rust/kernel.json" <<JSON
{"argv": ["$tools/bin/evcxr_jupyter", "--control_file", "{connection_file}"],
 "display_name": "Rust", "language": "rust", "interrupt_mode": "message"}
JSON
# The kernel builds the cells' dependencies with the environment env.sh set
# (LIBTORCH_USE_PYTORCH, the venv's python on PATH) and runs them with its
# LD_LIBRARY_PATH; its work directory is kept, so that a second run reuses
# what the first one built.
export EVCXR_TMPDIR="$MEMLAB_ROOT/target/evcxr-cells"
mkdir -p "$EVCXR_TMPDIR"
# No report of memlab's at exit: the checks below read what the cells print.
export MEMLAB_PRINT_AT_EXIT=0
# evcxr builds cells without debug information (and strips it), so their
# frames in backtraces would have no file or line; these put line tables back.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_DEV_STRIP=none

run_dir="$MEMLAB_ROOT/target/notebook"
rm -rf "$run_dir"
# evcxr's code analysis adds the toolchain's rust-src component when it is
# missing: a component this run added goes again, so the toolchain is left
# as it was found.
had_rust_src=0
if rustup component list --installed 2>/dev/null | grep -qx 'rust-src'; then had_rust_src=1; fi
status=0
if [ "$fresh" = 1 ]; then
  bash scripts/notebook-kernel.sh --name memlab-rust --evcxr "$tools/bin/evcxr_jupyter"
  tch_version=$([ "$MEMLAB_TORCH_VERSION" = 2.13.0 ] && echo 0.26 || echo 0.24)
  "$MEMLAB_VENV/bin/python" scripts/notebook_fresh_kernel.py memlab-rust "$MEMLAB_ROOT" "$tch_version" || status=$?
else
  "$MEMLAB_VENV/bin/python" scripts/notebook_run.py examples/notebook/memlab.ipynb "$run_dir" || status=$?
fi
if [ "$had_rust_src" = 0 ] && rustup component list --installed 2>/dev/null | grep -qx 'rust-src'; then
  echo "memlab: removing the rust-src component evcxr added, as the toolchain was" >&2
  rustup component remove rust-src >&2 || true
fi
if [ "$status" != 0 ] && [ "$fresh" = 1 ]; then
  echo "memlab in evcxr: the registered kernel failed from a bare environment (its cells' output is above)" >&2
  exit 1
elif [ "$status" != 0 ]; then
  echo "memlab in evcxr: some checks failed (the executed notebook is $run_dir/memlab.ipynb)" >&2
  exit 1
fi
[ "$fresh" = 1 ] && exit 0
echo "memlab in evcxr_jupyter $EVCXR_VERSION: every check passed; rendered to target/notebook/memlab.html"
if [ "$picture" = 1 ]; then
  # The page's height first (a copy that writes it into its title), then a
  # window that tall, so that the picture holds the whole notebook.
  measure="$run_dir/measure.html"
  sed 's|</body>|<script>addEventListener("load",()=>{document.title="height "+document.documentElement.scrollHeight})</script></body>|' \
    "$run_dir/memlab.html" > "$measure"
  height="$(chromium --headless --no-sandbox --disable-gpu --window-size=1000,1000 --dump-dom "file://$measure" 2>/dev/null |
    sed -n 's|.*<title>height \([0-9]*\)</title>.*|\1|p')"
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="1000,${height:-4000}" \
    --screenshot="$MEMLAB_ROOT/docs/notebook.png" "file://$run_dir/memlab.html" 2>/dev/null
  echo "memlab: docs/notebook.png taken from the rendering (1000 × ${height:-4000} px)"
fi
