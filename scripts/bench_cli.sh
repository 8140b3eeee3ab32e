#!/usr/bin/env bash
# The command-line tool at scale: generates two synthetic snapshots in
# PyTorch's schema (memlab-cli/examples/synthetic_snapshot.rs; SIZE each,
# 1G by default; with the native frames of PyTorch's default recording, so
# the page folds them), then times `memlab summary`, `memlab view` and
# `memlab replay --compare` (under a memory fraction, so the garbage
# collector's setting is among those compared) of the first and `memlab diff`
# of both with /usr/bin/time -v (wall clock, peak resident set), and headless
# Chromium's screenshot of the page (as written, and with its drawings
# switched to the event axis) against an empty page's. Prints a Markdown
# table.
#
#     bash scripts/bench_cli.sh [SIZE]
#
# Needs no libtorch; the files go to target/bench-cli/ (about 2 GB at 1G).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
size="${1:-1G}"
cargo build --release -p memlab-cli --bins --examples >&2
dir=target/bench-cli
mkdir -p "$dir"
memlab="$PWD/target/release/memlab"
synth="$PWD/target/release/examples/synthetic_snapshot"
cd "$dir"
"$synth" a.pickle --size "$size" --seed 1 --native >&2
"$synth" b.pickle --size "$size" --seed 2 --grow 7 --native >&2

timed() {
  /usr/bin/time -v "$@" > out.txt 2> time.txt
  local wall rss
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ { n = split($2, t, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + t[i]; print s }' time.txt)
  rss=$(awk -F': ' '/Maximum resident set size/ { printf "%.0f", $2 / 1024 }' time.txt)
  echo "$wall $rss"
}

shot() {
  local start end
  start=$(date +%s.%N)
  timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1100,3000 \
    --screenshot="$PWD/shot.png" "file://$PWD/$1" > /dev/null 2>&1
  end=$(date +%s.%N)
  printf '%.2f' "$(echo "$end - $start" | bc)"
}

read -r s_wall s_rss < <(timed "$memlab" summary a.pickle)
read -r v_wall v_rss < <(timed "$memlab" view a.pickle -o a.html)
read -r d_wall d_rss < <(timed "$memlab" diff a.pickle b.pickle)
read -r r_wall r_rss < <(timed "$memlab" replay a.pickle --compare --fraction 0.5)
replays=$("$memlab" replay a.pickle --compare --fraction 0.5 --json | python3 -c 'import json,sys; d=json.load(sys.stdin)["devices"][0]; print(1 + len(d["replays"]))')
echo '<!doctype html><title>empty</title>' > empty.html
# The same page with every timeline drawn by event (its other radio button checked).
sed 's/class="by-time" checked>/class="by-time">/g; s/class="by-event">/class="by-event" checked>/g' a.html > a_by_event.html
folded=$(grep -o 'href="#fold-' a.html | wc -l)
# Layout time: the median of three screenshots of each, alternating.
empty=(); page=(); by_event=()
for _ in 1 2 3; do
  empty+=("$(shot empty.html)"); page+=("$(shot a.html)"); by_event+=("$(shot a_by_event.html)")
done
median() { printf '%s\n' "$@" | sort -n | sed -n 2p; }

a_bytes=$(stat -c %s a.pickle)
b_bytes=$(stat -c %s b.pickle)
events=$("$memlab" summary a.pickle --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["devices"][0]["events"])')
echo
echo "Snapshots: a.pickle $a_bytes bytes ($events events), b.pickle $b_bytes bytes; $(nproc) cores."
echo
echo "| command | wall clock | peak RSS |"
echo "|---|---:|---:|"
echo "| memlab summary a.pickle | ${s_wall} s | ${s_rss} MiB |"
echo "| memlab view a.pickle | ${v_wall} s | ${v_rss} MiB |"
echo "| memlab diff a.pickle b.pickle | ${d_wall} s | ${d_rss} MiB |"
echo "| memlab replay a.pickle --compare --fraction 0.5 ($replays settings) | ${r_wall} s | ${r_rss} MiB |"
echo
echo "| page | bytes | Chromium screenshot, median of 3 |"
echo "|---|---:|---:|"
echo "| empty page | $(stat -c %s empty.html) | $(median "${empty[@]}") s |"
echo "| a.html ($folded folded runs of frames) | $(stat -c %s a.html) | $(median "${page[@]}") s |"
echo "| a.html drawn by event | $(stat -c %s a_by_event.html) | $(median "${by_event[@]}") s |"
