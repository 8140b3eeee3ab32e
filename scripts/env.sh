# Sourced by memlab's scripts: makes sure a project-local Python venv holds
# the torch whose libtorch the chosen tch binds, then exports what cargo needs
# to build against it and what the binaries need to load it. Idempotent: when
# the venv already has the right torch, nothing is installed.
#
# MEMLAB_TORCH picks the torch: 2.11.0 (the default, for tch 0.24, in .venv)
# or 2.13.0 (for tch 0.26, in .venv-2.13.0). Each venv is a few GB. Sourced
# again in one shell with another MEMLAB_TORCH, it switches to that torch's
# venv, and takes the other's entries out of PATH and LD_LIBRARY_PATH.
#
# MEMLAB_VENV, set by you, names the venv to use (and to install torch
# into) whatever MEMLAB_TORCH says; one this script chose is chosen again.

MEMLAB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEMLAB_TORCH_VERSION="${MEMLAB_TORCH:-2.11.0}"
case "$MEMLAB_TORCH_VERSION" in
  2.11.0) MEMLAB_DEFAULT_VENV="$MEMLAB_ROOT/.venv" ;;
  2.13.0) MEMLAB_DEFAULT_VENV="$MEMLAB_ROOT/.venv-2.13.0" ;;
  *)
    echo "memlab: MEMLAB_TORCH=$MEMLAB_TORCH_VERSION is not a torch memlab supports; use 2.11.0 (tch 0.24) or 2.13.0 (tch 0.26)" >&2
    return 1 2>/dev/null || exit 1
    ;;
esac
# MEMLAB_VENV_CHOSEN: the venv this script chose last in this shell, so that
# a MEMLAB_VENV it exported is told from one the user set.
if [ -z "${MEMLAB_VENV:-}" ] || [ "$MEMLAB_VENV" = "${MEMLAB_VENV_CHOSEN:-}" ]; then
  MEMLAB_VENV="$MEMLAB_DEFAULT_VENV"
  export MEMLAB_VENV_CHOSEN="$MEMLAB_VENV"
fi
export MEMLAB_VENV
# The CUDA runtime's crt/ headers, which memlab's CUDA event hook compiles
# against: both torch versions are built on CUDA 13.0, whose crt is 13.0.88.
MEMLAB_CUDA_CRT_VERSION="13.0.88"

memlab_installed() {
  "$MEMLAB_VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m
print(m.version("torch").split("+")[0], m.version("nvidia-cuda-crt"))
PY
}

if [ "$(memlab_installed)" != "$MEMLAB_TORCH_VERSION $MEMLAB_CUDA_CRT_VERSION" ]; then
  echo "memlab: installing torch==$MEMLAB_TORCH_VERSION into $MEMLAB_VENV (once; a few GB)" >&2
  python3 -m venv "$MEMLAB_VENV" || {
    echo "memlab: could not create a venv; install Python 3.10+ with its venv module" >&2
    return 1 2>/dev/null || exit 1
  }
  # torch first without its dependencies, then those it names but triton:
  # triton is torch.compile's Python compiler, which libtorch never loads
  # (0.6 GB installed, and its wheel's download while pip works).
  memlab_failed() {
    echo "memlab: pip could not install torch==$MEMLAB_TORCH_VERSION" >&2
    # The commonest cause is a full disk: torch and its CUDA libraries take
    # about 4.3 GB once installed, and pip wants about 1 GB more while it works.
    for memlab_dir in "$(dirname "$MEMLAB_VENV")" "${TMPDIR:-/tmp}"; do
      echo "memlab: $(df -Ph "$memlab_dir" | awk 'NR == 2 { print $4 }') free on the disk of $memlab_dir" >&2
    done
    echo "memlab: it needs about 5.5 GB free; free some, or point MEMLAB_VENV (and TMPDIR) at a larger disk" >&2
  }
  memlab_pip() {
    "$MEMLAB_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "$@"
  }
  memlab_pip --no-deps "torch==$MEMLAB_TORCH_VERSION" || { memlab_failed; return 1 2>/dev/null || exit 1; }
  "$MEMLAB_VENV/bin/python" - "nvidia-cuda-crt==$MEMLAB_CUDA_CRT_VERSION" <<'PY' || {
import importlib.metadata as m, subprocess, sys
from pip._vendor.packaging.requirements import Requirement
wanted = []
for line in m.requires("torch") or []:
    r = Requirement(line)
    if r.name != "triton" and (r.marker is None or r.marker.evaluate({"extra": ""})):
        r.marker = None
        wanted.append(str(r))
if not wanted:
    sys.exit("memlab: torch's metadata names no dependencies; it is unreadable")
pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]
sys.exit(subprocess.call(pip + wanted + sys.argv[1:]))
PY
    memlab_failed
    return 1 2>/dev/null || exit 1
  }
fi

# `PATH`-like $1 without the entry $2.
memlab_without() {
  printf '%s' "$1" | tr ':' '\n' | { grep -vxF -- "$2" || true; } | paste -sd: -
}

# What an earlier sourcing added goes, so the venv chosen now comes first
# and alone.
if [ -n "${MEMLAB_ADDED_PATH:-}" ]; then
  PATH="$(memlab_without "$PATH" "$MEMLAB_ADDED_PATH")"
fi
if [ -n "${MEMLAB_ADDED_LIBRARY_PATH:-}" ]; then
  LD_LIBRARY_PATH="$(memlab_without "${LD_LIBRARY_PATH:-}" "$MEMLAB_ADDED_LIBRARY_PATH")"
fi
export MEMLAB_ADDED_PATH="$MEMLAB_VENV/bin"
export PATH="$MEMLAB_ADDED_PATH:$PATH"
export LIBTORCH_USE_PYTORCH=1
MEMLAB_TORCH_DIR="$("$MEMLAB_VENV/bin/python" - <<'PY'
import importlib.util, os
print(os.path.dirname(importlib.util.find_spec("torch").origin))
PY
)"
export MEMLAB_ADDED_LIBRARY_PATH="$MEMLAB_TORCH_DIR/lib"
export LD_LIBRARY_PATH="$MEMLAB_ADDED_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
