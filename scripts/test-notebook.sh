#!/usr/bin/env bash
# memlab in a notebook, tried as a user tries it: the evcxr REPL (evcxr_repl
# 0.22, the engine evcxr_jupyter runs) is fed cells with `:dep memlab` and
# `:dep tch`, default settings, and every figure memlab prints is checked
# against what the cells allocated. evcxr compiles each cell into a library of
# its own, with memlab linked into each: the figures hold only if every copy
# shares one memlab (see memlab::run::copies).
#
# Too slow for CI: the first run installs evcxr_repl (cargo install --locked,
# 20 minutes to an hour on 2 cores; cached in target/evcxr) and builds memlab and tch for
# the notebook (cached in target/evcxr-cells). Run it before changing how
# memlab keeps its state.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEMLAB_ROOT"

EVCXR_VERSION="0.22.0"
tools="$MEMLAB_ROOT/target/evcxr"
if ! "$tools/bin/evcxr" --version 2>/dev/null | grep -qF "$EVCXR_VERSION"; then
  echo "memlab: installing evcxr_repl $EVCXR_VERSION into target/evcxr (once; 20 minutes to an hour)" >&2
  cargo install --locked evcxr_repl --version "=$EVCXR_VERSION" --root "$tools"
fi
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

# One cell per line; U+2028 separates the lines of a cell (evcxr's
# --disable-readline reads it so).
nl=$'\u2028'
cells=(
  ":dep tch = \"0.24\"${nl}:dep memlab = { path = \"$MEMLAB_ROOT\" }"
  # A cell that calls memlab loads it (a cell's library holds only the
  # crates its code uses): its counting allocator is in place before the
  # first tensor.
  "println!(\"CHECK first {}\", memlab::run::copies());"
  "let vs = tch::nn::VarStore::new(tch::Device::Cpu);${nl}let w = vs.root().zeros(\"w\", &[1024, 1024]);"
  "println!(\"CHECK var_store {}\", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);"
  "let t = tch::Tensor::zeros([1024, 1024], (tch::Kind::Float, tch::Device::Cpu));"
  "println!(\"CHECK tensor {}\", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);"
  "#[memlab::profile(device = \"cpu\")]${nl}fn work() -> i64 {${nl}    let kept = tch::Tensor::zeros([1 << 20], (tch::Kind::Float, tch::Device::Cpu));${nl}    kept.numel() as i64${nl}}"
  "println!(\"CHECK work {}\", work());"
  "{${nl}    let report = memlab::profiler::Report::collect();${nl}    let f = report.function(\"work\").unwrap();${nl}    println!(\"CHECK calls {}\", f.calls);${nl}    println!(\"CHECK kept {}\", f.lines.iter().filter_map(|l| l.stats.as_ref()).map(|s| s.increment).max().unwrap());${nl}    println!(\"{report}\");${nl}}"
  "let mut logger = memlab::StepLogger::new().exact_ram_peak(true);"
  "let total = logger.log(\"step\", || tch::Tensor::ones([8 << 20], (tch::Kind::Float, tch::Device::Cpu)).sum(tch::Kind::Float).double_value(&[]));${nl}println!(\"CHECK step_sum {total}\");${nl}println!(\"CHECK step_peaked {}\", logger.data().unwrap().ram.peaked);"
  # Backtraces through a later cell's code: the recording's unwinder read
  # the modules when it started, before the cells below were loaded.
  "let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();"
  "fn later_cell_work() -> tch::Tensor {${nl}    tch::Tensor::zeros([777_777], (tch::Kind::Uint8, tch::Device::Cpu))${nl}}"
  "let late = later_cell_work();"
  "{${nl}    let (events, _) = memlab::events::history();${nl}    let frames: Vec<String> = events.iter().filter(|e| e.size == 777_777 && e.action == memlab::events::Action::Alloc).filter_map(|e| e.backtrace.as_ref()).flat_map(|b| b.frames().iter().map(|f| f.function.clone()).collect::<Vec<_>>()).collect();${nl}    println!(\"CHECK late_frame {}\", frames.iter().any(|f| f.contains(\"later_cell_work\")));${nl}    println!(\"{frames:?}\");${nl}}"
  "drop(late);${nl}drop(recording);"
  "println!(\"CHECK copies {}\", memlab::run::copies());"
  "println!(\"CHECK after {}\", memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current);"
)
log="$EVCXR_TMPDIR/session.log"
# evcxr's code analysis adds the toolchain's rust-src component when it is
# missing: a component this run added goes again, so the toolchain is left
# as it was found.
had_rust_src=0
if rustup component list --installed 2>/dev/null | grep -qx 'rust-src'; then had_rust_src=1; fi
printf '%s\n' "${cells[@]}" | "$tools/bin/evcxr" --disable-readline 2>&1 | tee "$log"
if [ "$had_rust_src" = 0 ] && rustup component list --installed 2>/dev/null | grep -qx 'rust-src'; then
  echo "memlab: removing the rust-src component evcxr added, as the toolchain was" >&2
  rustup component remove rust-src >&2 || true
fi

fail=0
check() {
  local name="$1" want="$2" got
  got="$(sed -n "s/.*CHECK $name //p" "$log" | tail -n 1)"
  if [ "$got" = "$want" ]; then
    echo "ok: $name = $got"
  else
    echo "FAILED: $name = '${got}', expected '$want'"
    fail=1
  fi
}
at_least() {
  local name="$1" least="$2" got
  got="$(sed -n "s/.*CHECK $name //p" "$log" | tail -n 1)"
  if [ -n "$got" ] && [ "$got" -ge "$least" ]; then
    echo "ok: $name = $got (at least $least)"
  else
    echo "FAILED: $name = '${got}', expected at least $least"
    fail=1
  fi
}
# A cell's 4 MiB var store, then another cell's 4 MiB tensor: the counting
# allocator of the process, read by a later cell's copy of memlab.
check var_store 4194304
check tensor 8388608
# Defined in one cell, called in the next, reported by a third: one table.
check work 1048576
check calls 1
check kept 4194304
# The step held 32 MiB of ones at its peak: the resident set's high-water
# mark (reset at the step's start) rose by most of it (pages the allocator
# reused were resident already).
check step_sum 8388608
at_least step_peaked 25165824
# The walk went through the later cell's frames and named them.
check late_frame true
# Every cell since memlab's first is a copy, and all of them share one state.
check first 1
at_least copies 5
check after 8388608
if [ "$fail" != 0 ]; then
  echo "memlab in evcxr: some figures were wrong (session in $log)" >&2
  exit 1
fi
echo "memlab in evcxr $EVCXR_VERSION: every figure exact"
