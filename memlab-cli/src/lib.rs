//! `memlab` (the `memlab-cli` package) reads memory snapshots on the command
//! line: memlab's own `memlab_snapshot.pickle` and the pickles PyTorch's
//! `torch.cuda.memory._dump_snapshot` writes, pickle protocols 2 to 5: a
//! summary, an HTML page, the difference between two runs and the merge of
//! several processes' files. It needs no libtorch to build or run, so a
//! PyTorch user installs it with cargo alone:
//!
//! ```sh
//! cargo install --path memlab-cli     # or, in this checkout: cargo run -p memlab-cli -- summary FILE
//! memlab summary fixtures/leaky.pickle
//! ```
//!
//! ```text
//! memlab summary SNAPSHOT [--json]
//! memlab view SNAPSHOT [-o FILE.html] [--json]
//! memlab diff A B [--html FILE.html] [--json]
//! memlab merge FILES… -o DIR [--offset RANK=µs]… [--json]
//! memlab replay SNAPSHOT [--setting CONF]… [--capacity BYTES | --fraction F] [--total BYTES] [--compare] [--libtorch VERSION] [--json]
//! memlab replay CPU_SNAPSHOT --as-cuda [--capacity BYTES] [--setting CONF]… [--json] [--history FILE.pickle]
//! ```
//!
//! This crate is the command's parts, as a library: reading snapshots into
//! summaries ([`analysis`], [`summary`]), the HTML page ([`view`]), the
//! comparison of two runs ([`diff`]) and the merge of several processes'
//! files ([`merge`]), and the replay of a recording through a model of
//! libtorch's CUDA caching allocator ([`replay`]). The binary is a thin layer of arguments over these;
//! tests drive them directly. No libtorch.
//!
//! # `memlab summary`
//!
//! `memlab summary SNAPSHOT` replays each device's history: the peaks of
//! allocated and reserved bytes and when they happened, how much of the
//! reserved memory was not allocated at the peak (fragmentation and the
//! caching allocator's rounding), what was live at the peak by category and by
//! site (the innermost frame of the program's own code: frames of PyTorch, the
//! Python and Rust standard libraries and C++ are skipped; an allocation whose
//! stack has none is named for what made it, read from its native frames, such
//! as `autograd's backward pass (PowBackward0)` for one made on the backward
//! pass's thread, which runs no Python; and libtorch's own buffers are named
//! for what they are, `libtorch's cuBLAS workspace`, whichever line's matrix
//! product made them, where the recording has the native frames), and whether the
//! history is partial (memlab's bounded history dropped events, or PyTorch's
//! kept only its last `max_entries`: the trace frees blocks it never saw
//! allocated). On `fixtures/leaky.pickle`, a PyTorch 2.11 snapshot of a
//! training loop that keeps every step's output alive, it prints:
//!
//! ```text
//! memlab summary: fixtures/leaky.pickle
//! =====================================
//! PyTorch's snapshot, pickle protocol 4; 1005 keys read past (5 kinds, listed by --json)
//! Allocated bytes are what the tensors asked for (trace events carry that size); reserved bytes include the caching allocator's rounding.
//!
//! cuda:0: 487 events over 0.036s
//! ------------------------------
//!                         bytes  when
//! peak allocated         98.17M  at +0.035s (event 481)
//! reserved then         108.00M  9.83M of it not allocated (9% of reserved)
//! peak reserved         108.00M  at +0.034s (event 430)
//! allocated at the end   97.17M  after the last event
//! reserved at the end   108.00M  after the last event
//! live before            71.05M  in 9 blocks allocated before the first event
//! The history is complete: the replay ends where the final segments are.
//! No allocation has a category (PyTorch's snapshots carry none; memlab's name what its walks saw).
//! live at the peak, by site
//!  bytes  blocks  share  site
//! 38.05M       7    39%  (allocated before the history began)
//! 33.00M       2    34%  train (fixtures/make_snapshots.py:68)
//! 16.08M      24    16%  leaky_or_fixed (fixtures/make_snapshots.py:79)
//!  7.05M       7     7%  (no stack recorded)
//!  4.00M       8     4%  leaky_or_fixed (fixtures/make_snapshots.py:78)
//!  4.00B       1     0%  leaky_or_fixed (fixtures/make_snapshots.py:80)
//!  4.00B       1     0%  leaky_or_fixed (fixtures/make_snapshots.py:82)
//! ```
//!
//! Allocated bytes are what the tensors asked for (the size a trace event
//! carries); reserved bytes include the allocator's rounding. The replay starts
//! from what was live before the first event (blocks the trace frees without
//! having seen them allocated, and blocks of the final segments it never
//! touches), and checks its end against the final segments: where they
//! disagree, the history is marked partial with the difference. "(no stack
//! recorded)" is an allocation whose stack in the file is empty: PyTorch
//! recorded none for it, or, in memlab's files, which keep only the program's
//! own frames, libtorch made it on its own (its threads and workspaces, such as
//! backward's) or the recording had no backtraces. `--json` prints
//! the same as data, with every site and the keys the reader read past, by
//! where they occur (`device_traces[][].compile_context`: PyTorch adds keys
//! between versions, and the reader ignores and counts what it does not know).
//!
//! # Reading untrusted pickles
//!
//! The reader is memlab-core's (`memlab_core::export::Snapshot::read_pickle`),
//! made for gigabyte files: it reads through a buffer, keeps only the pickle's
//! shared values in memory and turns each trace entry into the model's compact
//! form as soon as it is read. A pickle is a program, and reading one must not
//! run it: opcodes that build objects (`GLOBAL`, `REDUCE`, `BUILD`, …) are
//! refused, never executed. Bad input (a missing, empty, truncated or
//! non-snapshot file, a pickle that builds objects) gets one line on standard
//! error and exit code 2:
//!
//! ```text
//! $ memlab summary notes.txt
//! memlab: cannot read notes.txt: not a pickle: it does not start with a pickle header of protocol 2 to 5 (bytes 0x80 0x02 to 0x80 0x05)
//! $ memlab summary exploit.pickle
//! memlab: cannot read exploit.pickle: refused: the pickle builds objects (STACK_GLOBAL at byte 39); memlab reads plain data only and never runs a pickle's code
//! ```
//!
//! Every command recognises a file through memlab's registry of formats
//! (`memlab_core::format`), so a file of another format memlab writes is
//! named for what it is: `memlab summary memlab_trace.json` says it is the
//! trace JSON, not a snapshot, and `memlab merge` names a file it takes no
//! data from (the monitor's CSVs) and lists what it reads.
//!
//! # `memlab view`
//!
//! `memlab view SNAPSHOT [-o FILE.html] [--all-frames]` writes the
//! self-contained HTML report (one file, no script, nothing fetched; the
//! snapshot's name with `.html` by default): the summary, then per device
//! memory over time stacked by the sites that held the most at the peak, an
//! icicle graph of what was live at the peak by call stack, and the table of it, by the tensor's name where memlab's
//! exporter named it and by site otherwise, then the line profile. From memlab's
//! own pickle the page is the one the program's `Exporter::html_report` wrote
//! (the same rows, names and profile); PyTorch's pickles carry no names, line
//! profile or libtorch version, so those parts are left out with one line saying
//! so. A gigabyte snapshot makes a page of about 0.6 MB (see `BENCHMARKS.md`).
//!
//! Memory over time is drawn by event as well as by time, with a switch
//! above the drawing; by event first where most of the recording's time
//! passes with few of its events. A recording that starts before the model is
//! built spends most of its time there: on `fixtures/transformer_all.pickle`
//! the model's setup is 28 of its 1,408 events and 89% of its time, so the two
//! training steps fill the last ninth of the time axis and all but the first
//! 2% of the event axis. The peak is marked on both, and so is every
//! allocation that failed (out of memory), where it happened. Each drawing
//! zooms 4× or 16× (the buttons above it) in a box that scrolls sideways,
//! with finer ticks as it grows: the training steps of that fixture, 10
//! events a tick at 16×, fill the width. The page has 400 points per device
//! (each the highest of its stretch of events), so zoom shows the shape of
//! a range, not each event of it: for those, `memlab summary --json` or the
//! trace in Perfetto.
//!
//! The icicle graph shows the program's own frames. PyTorch's default
//! recording (`stacks="all"`) gives an allocation some 60 frames, most of them
//! CPython's interpreter, torch's Python modules, libtorch's dispatcher, the
//! runtime and the recorder; each run of them between two frames of the
//! program's own is one node, `… 23 frames: CPython, Python library`, and a
//! click on it lists them under the graph. A stack with no frame of the
//! program's own starts with what made it. On `fixtures/transformer_all.pickle`
//! (a small transformer's setup and two training steps on an H100) the
//! deepest path is 10 levels instead of 107. `--all-frames` shows every frame.
//! Memory libtorch allocates for itself is named for what it is wherever it
//! was made: cuBLAS's and cuBLASLt's workspaces, and cuDNN's
//! (`at::native::run_conv_plan`; on `fixtures/convnet_all.pickle`, under the
//! forward pass's line and on autograd's thread alike). The one classifier
//! of frames is `memlab_core::export::frames`. Writing a page:
//!
//! ```text
//! $ memlab view fixtures/memlab_cpu.pickle -o memlab_cpu.html
//! wrote memlab_cpu.html (196.40K): open it in a browser
//! ```
//!
//! # `memlab diff`
//!
//! `memlab diff A B [--html FILE.html]` compares two runs, device by device:
//! the peaks, then what was live at each run's peak by site (and by category,
//! where the files have them), new, gone, grown or shrunk, largest change
//! first. Sites are matched by function, file (its last two path components,
//! so that runs from different checkouts match) and line, never by address.
//! The leaky and the fixed training loop of `fixtures/` (the leaky one keeps
//! every step's output, and through `retain_graph` the activations behind it):
//!
//! ```text
//! $ memlab diff fixtures/fixed.pickle fixtures/leaky.pickle
//! memlab diff
//! ===========
//! A: fixtures/fixed.pickle
//! B: fixtures/leaky.pickle
//!
//! cuda:0
//! ------
//!                      A        B   change
//! peak allocated  80.60M   98.17M  +17.57M
//! peak reserved   92.00M  108.00M  +16.00M
//! live at the peak, by site (largest change first)
//!  change        A       B         what
//! +13.07M    3.01M  16.08M  grown  leaky_or_fixed (fixtures/make_snapshots.py:79)
//!  +3.50M  512.00K   4.00M  grown  leaky_or_fixed (fixtures/make_snapshots.py:78)
//!  +1.00M    6.05M   7.05M  grown  (no stack recorded)
//!  +4.00B    0.00B   4.00B  new    leaky_or_fixed (fixtures/make_snapshots.py:82)
//! ```
//!
//! The leak's line comes first: the model's forward pass, whose outputs and
//! activations the leaky loop keeps. Every command takes `--json` (`view`'s
//! prints where the page went and the summary; `diff`'s has every row).
//!
//! # `memlab merge`: several processes
//!
//! `memlab merge FILES… -o DIR` reads the snapshots, trace JSONs and
//! out-of-memory report JSONs of every rank (memlab's files say which process
//! wrote them: their `run`, see `memlab::run` in the memlab crate; PyTorch's
//! own snapshots too, their rank taken from a `rankN` in the file's name, as in
//! `snapshot_rank3.pickle`) and writes one Perfetto trace (`merged_trace.json`,
//! a process per rank named `rank N (host, cuda:K)`) and one page
//! (`merged.html`). Each process's clock starts when it first records, so raw
//! times of two ranks are seconds apart; the merge places every file by the
//! wall-clock time its clock started (`run.clock_zero_unix_us`; PyTorch's
//! snapshot times are wall-clock already), and `--offset RANK=µs` corrects a
//! rank on a host whose clock is off. `examples/ranks.rs` is one rank of such
//! a run: two ranks on the CPU, rank 1 asking for more memory than the host
//! has:
//!
//! ```sh
//! for r in 0 1; do MEMLAB_RANK=$r WORLD_SIZE=2 cargo run --release --example ranks -- --out run &
//! done; wait
//! cargo run --release -p memlab-cli -- merge run/memlab_snapshot_rank*.pickle \
//!     run/memlab_trace_rank*.json run/memlab_oom_*.json -o run/merged
//! ```
//!
//! ```text
//! memlab merge: 2 processes
//! =========================
//!
//! Peaks
//! -----
//! Per process and device: the allocated peak (as tensors asked for their bytes), the reserved peak, and when; the highest allocated peak of the CUDA devices and of the CPUs is marked.
//! process         device  peak allocated  peak reserved      when                 from
//! rank 0 (node1)  cpu             34.18M                 +0.236 s  highest        snapshot
//! rank 1 (node1)  cpu             20.18M                 +0.223 s  out of memory  snapshot
//!
//! Out of memory
//! -------------
//! rank 1 (node1) ran out of memory on cpu at +0.553 s: 256.00T asked; verdict: request exceeds device; at main (examples/ranks.rs:65).
//!
//! wrote run/merged/merged_trace.json (open it in ui.perfetto.dev) and run/merged/merged.html
//! ```
//!
//! `bash scripts/ranks.sh DIR [N]` does the same for N ranks, each on its own
//! GPU where the machine has N of them. On a host with two H100s (driver 580,
//! torch 2.11.0+cu130; binaries built elsewhere and stripped of their debug
//! information, so the failure names no source line):
//!
//! ```text
//! process              device  peak allocated  peak reserved      when                 from
//! rank 0 (vm, cuda:0)  cpu              8.00B                 +0.567 s  highest        snapshot
//! rank 0 (vm, cuda:0)  cuda:0         101.19M        122.00M  +0.691 s  highest        snapshot
//! rank 1 (vm, cuda:1)  cpu              8.00B                 +0.543 s  highest        snapshot
//! rank 1 (vm, cuda:1)  cuda:1          87.18M        106.00M  +0.693 s  out of memory  snapshot
//!
//! Out of memory
//! -------------
//! rank 1 (vm, cuda:1) ran out of memory on cuda:1 at +0.763 s: 316.71G asked; verdict: request exceeds device.
//! ```
//!
//! The page has the same table and failures, each rank's memory over time on
//! one time axis and one scale (every failure marked on its rank's drawing,
//! the axis long enough to hold it; a device whose peak is under a
//! thousandth of the scale, such as the 8 bytes above, is named, not drawn),
//! and what was live at each rank's peak by category and by site, the rows
//! that differ most between ranks first. Each rank's devices are compared by
//! kind and order, not by name: rank 0's `cuda:0` with rank 1's `cuda:1`,
//! under "each process's GPU: rank 0 on cuda:0, rank 1 on cuda:1"
//! (`fixtures/ranks/` holds such a run, PyTorch's snapshots and memlab's
//! files). `--json` prints the table and the failures as data; the README
//! shows a picture of the page.
//!
//! Files of one process are grouped by its host and pid, so several GPUs in
//! one process make one row per device, and several processes on one GPU are
//! told apart by pid (and the device by its UUID). Two processes that claim
//! one rank are both kept, each named with its pid, and the merge warns.
//! Files are read as untrusted: one that is not what it says, or gives a
//! time no run can have (a clock zero or a time past the year 3000, an
//! `--offset` as large), is refused with one line naming the file and the
//! field, and no file's times can move another's. A process that left several
//! snapshots (the out-of-memory recorder writes one beside the final export)
//! is read from the one with the longest history.
//!
//! # Beside PyTorch's `_memory_viz.py`
//!
//! PyTorch reads its own snapshots with `python -m torch.cuda._memory_viz`.
//! Offline, with torch 2.11, on `fixtures/transformer_all.pickle`
//! (`bash scripts/beside_memory_viz.sh` prints both tools' output for the
//! fixtures):
//!
//! - `stats` draws the segments of 20 MiB and more as page maps and adds
//!   up the snapshot's end: `total_reserved: 128.0MiB`,
//!   `total_allocated: 65.0MiB`. `memlab summary` gives the same end
//!   (65.00M allocated, 128.00M reserved) and what `stats` cannot, having
//!   no history: the peak, 105.07M allocated at event 766, 20.93M of the
//!   reserved memory not allocated then, and what was live then by site:
//!   61% libtorch's two cuBLAS workspaces (the forward thread's and the
//!   backward pass's), 18% `forward (make_snapshots.py:60)`.
//! - `trace` prints the history as a program, an event a line
//!   (`b = a[0:500.0KiB]`, `del g13 # 4.0B`, 1,411 lines here), with
//!   addresses and segment offsets and no sites; a failure reads
//!   `raise OutOfMemoryError # 79.2GiB requested, 78.3GiB free in CUDA`.
//!   memlab's page draws that history (by event or by time, zoomed,
//!   stacked by site, the peak and each failure marked) and the call
//!   stacks at the peak, every frame of the program's own and the rest
//!   folded.
//! - `compare A B` writes a flame graph of the segments only one snapshot
//!   has, with `flamegraph.pl` downloaded from GitHub; on the files
//!   `_dump_snapshot` writes it stops with `TypeError: string indices must
//!   be integers` (it expects the list of segments). `memlab diff` compares
//!   what was live at each run's peak, by site, largest change first.
//! - Its HTML views (`trace_plot`, `segment_plot`, and pytorch.org's
//!   memory_viz page) load the viewer from the network; memlab's pages are
//!   one file that fetches nothing.
//!
//! What memory_viz shows that memlab does not: the allocator's layout,
//! each segment's blocks at their addresses and its pages (`stats`, the
//! web viewer's allocator state over time), and every single event of a
//! long history (memlab's page draws 400 points per device, each the
//! highest of its stretch; `memlab summary --json` and the merged trace in
//! Perfetto keep each figure). What memlab shows that memory_viz does not:
//! peaks and when they were, sites and what made the allocations without
//! one (`autograd's backward pass (PowBackward0)`, `libtorch's cuBLAS
//! workspace`), two runs compared by
//! line, several ranks on one axis (`merge`), and which allocator setting
//! would have avoided a failure (`replay`). Pictures of memlab's pages are
//! in `docs/`: `memlab_view_transformer.png` (this fixture) and
//! `memlab_merge.png` (`fixtures/ranks/`).
//!
//! # Fixtures
//!
//! `fixtures/` holds the snapshots the tests read: PyTorch's own of an MLP, a
//! conv net, a small transformer, a leaky and a fixed training loop (made on
//! an H100 by `fixtures/make_snapshots.py`), the MLP's rewritten with protocols
//! 2 and 5, and memlab's CPU export of the `timeline` example.
//!
//! # `memlab replay`
//!
//! `memlab replay SNAPSHOT` replays each CUDA device's history through a
//! model of libtorch 2.11's caching allocator (`memlab_core::replay`):
//! under the settings it was recorded with (PyTorch 2.5 and later write them
//! into the snapshot), how many of the allocator's own segment events the
//! model made too, and the peaks; with `--setting CONF` (as
//! `PYTORCH_CUDA_ALLOC_CONF` writes it: `expandable_segments:True`) or
//! `--compare` (the settings people try), the peaks and errors under those.
//! `--capacity BYTES` (`1536M`, `80G`) is what the allocator could reserve,
//! `--fraction F` a memory fraction of the device's `--total`; with one, the
//! replay says whether and where memory runs out, and which settings avoid
//! the recorded error. On PyTorch's recording of a fragmentation error under
//! a 1.5 GiB fraction (`fixtures/replay/fragmentation__default.pickle`):
//!
//! ```text
//! memlab replay fixtures/replay/fragmentation__default.pickle --total 85017493504 --fraction 0.01894448624181354 --compare
//! ```
//!
//! prints that the default, `expandable_segments` and garbage collection
//! fail where the GPU failed, and `max_split_size_mb` (64, 128 and 512)
//! avoids the error, at a 1.50 GiB reserved peak. `--json` prints every
//! figure, one object per device (`segment_events`,
//! `segment_events_matched`, `peak_reserved`, `peak_allocated`, `ooms`, and
//! `replays` under the other settings).
//!
//! `memlab replay CPU_SNAPSHOT --as-cuda` predicts a CUDA run from a step
//! recorded on the CPU (the guide is `memlab::will_it_fit`'s); `--history
//! FILE.pickle` also writes the CUDA history the prediction replays, the
//! recording's ops beside it: `memlab view` draws it, `memlab replay`
//! replays it, and set beside the CUDA run's own recording it shows where
//! the two part.

pub mod diff;
pub mod merge;
pub mod replay;
pub mod view;

pub use memlab_core::export::{analysis, summary};
