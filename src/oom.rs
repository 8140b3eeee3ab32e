//! The out-of-memory flight recorder: when a request of libtorch's CPU or
//! CUDA allocator fails, memlab writes what was asked, what held the memory
//! and why the request failed, before the error reaches the caller.
//!
//! Arm it once, with [`OomRecorder::arm`](crate::OomRecorder::arm) or `MEMLAB_OOM_DIR=dir` (read as
//! the program loads). Until a request fails it costs nothing: the allocators
//! call in only on failure. Then, on the failing thread:
//!
//! - the reserve (see below) is given back, so that what follows cannot fail
//!   for want of memory;
//! - the facts are taken first: the request (as the allocator saw it), the
//!   device, the profiled statement running and the failing call's Rust
//!   frames, the allocator's figures and its cache's free blocks, the
//!   driver's (or, for the CPU, the kernel's and the process's limits')
//!   figures;
//! - what holds the memory is named by a walk over the registered var
//!   stores, optimizer state and tensors that waits for no lock (tch holds a
//!   var store's lock while `set_device`, `load` and `copy` allocate: a store
//!   held then is listed as busy) and never asks libtorch for a gradient
//!   (gradients are named from the walks before, see below); the rest is
//!   listed by the site that allocated it while a [`Recording`](crate::Recording)
//!   runs;
//! - a [`Verdict`] with its figures: the request alone exceeds the device,
//!   fragmentation, other processes, or not enough free memory;
//! - `DIR/memlab_oom_<host>_<start>_<pid>_<n>.txt` is written (the host's
//!   name, the process's start as `YYYYMMDDTHHMMSS` UTC, its id and the
//!   report's number; a process that finds the name taken, by another
//!   container's PID 1 started in the same second, writes under
//!   `<pid>-<tag>` with a random tag: no report is lost, and no file is ever
//!   overwritten), with a `.json` sibling
//!   (the [`OomReport`] as data) and, while a `Recording` runs, `.html` and
//!   `.pickle` (the recording's report and PyTorch memory snapshot); the
//!   report is kept for [`last_oom`](crate::last_oom);
//! - a one-paragraph summary goes to memlab's warnings (standard error by
//!   default). A sink set with `set_warnings` runs later, on a thread of
//!   memlab's, never inside the allocator.
//!
//! The failing call still returns libtorch's error (`f_` calls an `Err`,
//! others a panic), and the process goes on. At most
//! [`max_reports`](crate::OomRecorder::max_reports) reports are written per process
//! (3 by default), so a retry loop cannot fill a disk; later failures are
//! counted ([`ooms_seen`]). [`find_batch_size`](crate::find_batch_size)'s
//! deliberate failures neither count nor print: it keeps their verdicts.
//! (While one of its tries runs, failures on its device are taken as the
//! try's on every thread: the autograd engine runs a CUDA backward pass on
//! threads of its own.)
//!
//! # When the host's memory runs out
//!
//! A CPU request can fail because the host has no memory left, or because
//! the process reached its address-space limit (`ulimit -v`, `RLIMIT_AS`,
//! common on shared clusters and under batch schedulers). Writing a report
//! takes memory too, exactly when there is none. So arming does beforehand
//! what the failure path needs: it keeps a reserve of address space aside
//! ([`OomRecorder::reserve`](crate::OomRecorder::reserve), 64 MiB by default: a mapping no page backs,
//! which costs no memory, only room under an address-space limit) and gives
//! it back when a request fails; it starts the threads it needs and reads
//! the program's unwind tables and debug information. The failure path is
//! bounded: before each part that grows with the recording (the unnamed
//! holders by site, the HTML report, the snapshot) it compares an estimate
//! of what the part takes with the memory left, and leaves the part out
//! when it would not fit: the report then says so ([`OomReport::left_out`],
//! and the text report is marked partial when one of its own sections is
//! missing). The text report itself is written first. After the report the
//! reserve is taken again.
//!
//! Under a cgroup's memory limit (containers, Kubernetes, Slurm), nothing
//! fails that could be reported: at the limit the kernel's out-of-memory
//! killer ends the process (SIGKILL) without asking anyone. What memlab
//! offers there is a warning before it happens: while the recorder is armed
//! by [`arm`](crate::OomRecorder::arm) (`MEMLAB_OOM_DIR` alone does not start it)
//! and a cgroup memory limit (or an address-space limit) applies, a thread
//! of memlab's reads the use ten times a second and warns once when it
//! crosses [`watermark`](crate::OomRecorder::watermark) (90% of the limit by
//! default), with the figures, and again after the use fell back and rose
//! again.
//!
//! # Which failures can be seen
//!
//! Every failed request of the counting CPU allocator; on CUDA, every failed
//! request of libtorch's caching allocator once memlab's observer is attached
//! to it, which libtorch allows only after the first CUDA allocation. Arming
//! attaches it then, or at once when CUDA memory was allocated already (or
//! with [`init_cuda`](crate::OomRecorder::init_cuda)); a failure in the first
//! milliseconds of CUDA use can be missed, and the reports count those
//! ([`OomReport::missed_before`]). Memory that CUDA libraries take outside
//! libtorch's allocator (cuBLAS and cuDNN workspaces, the CUDA context)
//! fails without any observer being told: those failures are not recorded.
//!
//! # Threads
//!
//! The handler runs on whatever thread failed, possibly an autograd thread
//! while a backward pass writes gradients. It never asks libtorch for a
//! parameter's gradient (that races with the backward pass, in plain tch as
//! well): it names the gradients that the last walk outside a handler saw
//! (a report, an export, a monitor's record, or a step of a
//! [`RegisteredOptimizer`](crate::RegisteredOptimizer)), held weakly; a
//! gradient made since is counted among the unnamed bytes.

pub use crate::diagnosis::{Diagnosis, Holders, NamedHolder, NamedRest, SiteHolder};
pub use crate::tools::oom::{
    ooms_seen, FailingThread, LeftOut, OomReport, DEFAULT_MAX_REPORTS, DEFAULT_RESERVE, DEFAULT_WATERMARK,
};
pub use memlab_core::oom::{CacheFree, DeviceMemory, HostLimit, MemoryFigures, Verdict};
