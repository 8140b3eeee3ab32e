//! Allocation events: every allocation and free the backends observe, with when,
//! where (device, address, size), on which thread, and inside which memlab
//! scope and profiled statement it happened; optionally with a Rust backtrace.
//!
//! The recorder keeps a bounded history (old events are dropped and counted)
//! and the complete live set: what is allocated now, with where it was
//! allocated. Dispose scopes are built on the live set. Nothing is recorded,
//! and the backends' hooks cost one atomic load, until someone turns it on.

mod clock;
pub(crate) mod context;
mod loader;
mod recorder;
mod sites;
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
mod symbols;
mod timeline;
#[cfg(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64"))]
mod unwind;

use crate::sync::LockExt;
use std::path::Path;
use std::sync::Arc;

pub use clock::{clock_us, is_active, zero_unix_us};
pub use context::{current_statement, StatementRef};
pub use recorder::{
    attribute, current_settings, history, history_with, live, live_seqs, live_with, record, record_counted, recorded,
    release, retain, scope_close, scope_keep, scope_open, stats, LiveAllocation, ScopeCounts, ScopeOutcome, Settings,
    Stats, User,
};
pub use sites::{by_site, by_site_with, SiteGroup};
pub use timeline::{
    reading, span, span_start, timeline, DriverUsed, Reading, Span, SpanKind, Timeline, TIMELINE_CAPACITY,
};

use crate::device::Device;

/// What happened to a block of memory: the one vocabulary of allocator
/// events, from the C++ shim's `enum memlab_action` (each variant stands
/// for its [`code`](Action::code) there; memlab-tch's build checks the
/// header against this enum) to the traces of PyTorch's snapshot, which name
/// each as [`as_str`](Action::as_str) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A tensor's memory was allocated.
    Alloc,
    /// A tensor's memory was given back (for CUDA: the caching allocator got it back).
    FreeRequested,
    /// CUDA only: the block can be reused (the streams that used it are done).
    FreeCompleted,
    /// CUDA only: the caching allocator obtained a segment from the device.
    SegmentAlloc,
    /// CUDA only: the caching allocator returned a segment to the device.
    SegmentFree,
    /// CUDA only, with expandable segments: the caching allocator mapped
    /// more of a segment's pages (`address` and `size`: the range mapped).
    SegmentMap,
    /// CUDA only, with expandable segments: it unmapped a range of a
    /// segment's pages, giving them back to the device.
    SegmentUnmap,
    /// An allocation failed for lack of memory; `size` is what was asked for,
    /// `address` what the device still had free: the driver's figure (CUDA);
    /// on the CPU the kernel's `MemAvailable`, or what the address-space or
    /// cgroup limit left where that is less (0 where unknown). The caller
    /// still gets libtorch's error.
    Oom,
}

impl Action {
    /// Every action, in the order of their codes.
    pub const ALL: &'static [Action] = &[
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::Oom,
        Action::SegmentMap,
        Action::SegmentUnmap,
    ];

    /// The shim's code for the action (`enum memlab_action`).
    pub const fn code(self) -> i32 {
        match self {
            Action::Alloc => 0,
            Action::FreeRequested => 1,
            Action::FreeCompleted => 2,
            Action::SegmentAlloc => 3,
            Action::SegmentFree => 4,
            Action::Oom => 5,
            Action::SegmentMap => 6,
            Action::SegmentUnmap => 7,
        }
    }

    /// The action the shim's `code` stands for (`enum memlab_action`).
    #[inline]
    pub fn from_code(code: i32) -> Option<Action> {
        Some(match code {
            0 => Action::Alloc,
            1 => Action::FreeRequested,
            2 => Action::FreeCompleted,
            3 => Action::SegmentAlloc,
            4 => Action::SegmentFree,
            5 => Action::Oom,
            6 => Action::SegmentMap,
            7 => Action::SegmentUnmap,
            _ => return None,
        })
    }

    /// The name PyTorch's snapshot gives it (`free_requested`).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }

    /// The action PyTorch's snapshot names `name`, if any.
    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.iter().copied().find(|a| a.as_str() == name)
    }
}

/// As PyTorch's snapshot names it.
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Action {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// One observed allocator event.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Event {
    /// Position in the sequence of all events since recording began.
    pub seq: u64,
    /// Nanoseconds since the recorder was first turned on.
    pub time_ns: u64,
    /// Where the memory is.
    pub device: Device,
    /// What happened.
    pub action: Action,
    /// Address of the block (for tensors: their storage's data pointer).
    pub address: u64,
    /// Bytes: asked for on the CPU, the rounded block on CUDA.
    pub size: u64,
    /// CUDA: the stream's handle (0 for the default stream); 0 on the CPU.
    pub stream: u64,
    /// memlab's number for the thread that caused it (see [`thread_number`]).
    pub thread: u64,
    /// The innermost dispose scope open on that thread, if any.
    pub scope: Option<u64>,
    /// The profiled statement running on that thread, if any.
    pub statement: Option<StatementRef>,
    /// Where in the program it happened, when backtraces are on.
    pub backtrace: Option<Arc<Backtrace>>,
}

/// A captured call stack: return addresses, resolved to functions and source
/// lines only when someone looks (and then once).
pub struct Backtrace {
    addresses: Vec<u64>,
    resolved: std::sync::OnceLock<Vec<Frame>>,
}

/// A frame of the user's code: function, source file and line.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    /// The function, as the debug information names it (`train::step`).
    pub function: String,
    /// The source file, as the debug information names it.
    pub file: String,
    /// The line.
    pub line: u32,
}

impl Frame {
    /// The frame of a profiled statement.
    pub fn of_statement(statement: &StatementRef) -> Frame {
        Frame { function: statement.function().to_string(), file: statement.file().to_string(), line: statement.line }
    }

    /// The user's frames of one return address, innermost first (inlined
    /// functions give several): frames without source information, and
    /// frames of memlab, dependencies and the standard library, are left out.
    pub fn resolve(address: u64) -> Vec<Frame> {
        let mut out = Vec::new();
        if in_foreign_library(address) {
            // Its frames would be left out below; reading its debug
            // information (hundreds of megabytes for libtorch) is skipped.
            return out;
        }
        // A return address points after the call; look up the call.
        let lookup = address.saturating_sub(1) as *mut std::ffi::c_void;
        // The loader's count before the backtrace crate first lists the
        // libraries (it does so once, on first use).
        static LISTED_AT: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let listed_at = *LISTED_AT.get_or_init(loader::changes);
        let mut found = false;
        let mut keep = |function: Option<String>, file: Option<&Path>, line: Option<u32>| {
            let (Some(file), Some(line)) = (file, line) else { return };
            if is_user_file(file) {
                let function = function.unwrap_or_else(|| "?".to_string());
                out.push(Frame { function, file: file.display().to_string(), line });
            }
        };
        backtrace::resolve(lookup, |symbol| {
            found = true;
            keep(symbol.name().map(|n| format!("{n:#}")), symbol.filename(), symbol.lineno());
        });
        if !found && loader::changes() != listed_at {
            // Perhaps a module loaded after the backtrace crate listed them.
            for frame in loader::frames_at(lookup as u64).unwrap_or_default() {
                keep(frame.function, frame.file.as_deref().map(Path::new), frame.line);
            }
        }
        out
    }
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {}:{}", self.function, self.file, self.line)
    }
}

/// The most distinct stacks a thread shares between its captures
/// ([`Backtrace::capture_shared`]).
pub const SHARED_STACKS: usize = 4096;

impl Backtrace {
    /// The calling thread's stack now (return addresses; resolved when looked at).
    pub fn capture() -> Backtrace {
        let mut frames = [0u64; 64];
        let n = Self::walk(&mut frames);
        Backtrace { addresses: frames[..n].to_vec(), resolved: std::sync::OnceLock::new() }
    }

    /// The calling thread's stack now, shared with this thread's earlier
    /// capture of the very same return addresses, if it still keeps it: a
    /// training step allocates from a few dozen call paths, over and over,
    /// and each is then stored once and resolved once, and a repeated capture
    /// allocates nothing. Where the thread walked from the same place before
    /// over the same stack words, the walk is skipped (see the unwinder's
    /// memo). The thread keeps up to [`SHARED_STACKS`] stacks, and forgets
    /// them all when it has that many.
    pub fn capture_shared() -> std::sync::Arc<Backtrace> {
        use std::cell::RefCell;
        use std::hash::{Hash, Hasher};
        use std::sync::Arc;
        thread_local! {
            static SHARED: RefCell<crate::hash::FastMap<u64, Arc<Backtrace>>> = RefCell::default();
        }
        let started = own_work::on().then(std::time::Instant::now);
        let share = |addresses: &[u64]| {
            let mut hasher = crate::hash::FastHasher::default();
            addresses.hash(&mut hasher);
            let key = hasher.finish();
            let fresh = || Arc::new(Backtrace { addresses: addresses.to_vec(), resolved: std::sync::OnceLock::new() });
            SHARED
                .try_with(|shared| {
                    let Ok(mut shared) = shared.try_borrow_mut() else { return fresh() };
                    if let Some(known) = shared.get(&key).filter(|b| b.addresses == addresses) {
                        return known.clone();
                    }
                    let made = fresh();
                    if shared.len() >= SHARED_STACKS {
                        shared.clear();
                    }
                    // Where memory has run out, the stack is not kept for later.
                    if shared.len() < shared.capacity() || shared.try_reserve(1).is_ok() {
                        shared.insert(key, made.clone());
                    }
                    made
                })
                .unwrap_or_else(|_| fresh())
        };
        #[cfg(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64"))]
        let (backtrace, n, skipped) = unwind::capture_memoized(&mut { share });
        #[cfg(not(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64")))]
        let (backtrace, n, skipped) = {
            let mut frames = [0u64; 64];
            let n = Self::walk(&mut frames);
            (share(&frames[..n]), n, false)
        };
        if let Some(started) = started {
            own_work::add(2, &[1, started.elapsed().as_nanos() as u64, n as u64, skipped as u64]);
        }
        backtrace
    }

    /// Writes the calling thread's return addresses to `frames`, innermost
    /// first; returns how many.
    #[inline(always)]
    fn walk(frames: &mut [u64; 64]) -> usize {
        #[cfg(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64"))]
        return unwind::capture_into(frames);
        #[cfg(not(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64")))]
        {
            let mut n = 0;
            backtrace::trace(|frame| {
                frames[n] = frame.ip() as u64;
                n += 1;
                n < frames.len()
            });
            n
        }
    }

    /// The raw return addresses, innermost first.
    pub fn addresses(&self) -> &[u64] {
        &self.addresses
    }

    /// The functions of every frame, innermost first, as the loaded modules'
    /// symbol tables name them (`torch::autograd::generated::MmBackward0::
    /// apply(…)`), `None` where none does: libtorch's frames as well as the
    /// program's, without files or lines. What libtorch allocated for itself
    /// is told from these (see [`export::frames`](crate::export::frames)).
    /// Each return address is looked up once per process.
    pub fn functions(&self) -> Vec<Option<std::sync::Arc<str>>> {
        #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
        return self.addresses.iter().map(|&a| symbols::function_at(a)).collect();
        #[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
        return self.addresses.iter().map(|_| None).collect();
    }

    /// The frames of the user's code, innermost first, as `function at
    /// file:line`: frames without source information (libtorch, libc) and
    /// frames of memlab, of dependencies and of the standard library are left out.
    pub fn user_frames(&self) -> Vec<String> {
        self.frames().iter().map(Frame::to_string).collect()
    }

    /// The frames of the user's code, innermost first (see
    /// [`user_frames`](Self::user_frames)), resolved once.
    pub fn frames(&self) -> &[Frame] {
        self.resolved.get_or_init(|| {
            self.addresses.iter().flat_map(|&a| resolved(a).iter().cloned().collect::<Vec<_>>()).collect()
        })
    }

    /// The innermost frame of the user's code, if any: only the return
    /// addresses up to it are resolved, and nothing is kept with the
    /// backtrace (a site of thousands of allocations costs one resolution).
    pub fn first_frame(&self) -> Option<Frame> {
        self.addresses.iter().find_map(|&a| resolved(a).first().cloned())
    }
}

/// The user's frames of one return address ([`Frame::resolve`]), resolved
/// once per process: a program has a bounded number of call sites, and the
/// same ones recur in every backtrace.
fn resolved(address: u64) -> std::sync::Arc<[Frame]> {
    use std::sync::{Arc, Mutex};
    static RESOLVED: Mutex<Option<crate::hash::FastMap<u64, Arc<[Frame]>>>> = Mutex::new(None);
    let known = RESOLVED.locked().as_ref().and_then(|m| m.get(&address).cloned());
    if let Some(frames) = known {
        return frames;
    }
    // Resolved outside the lock: reading debug information takes a while.
    let frames: Arc<[Frame]> = Frame::resolve(address).into();
    let mut all = RESOLVED.locked();
    all.get_or_insert_with(Default::default).entry(address).or_insert(frames).clone()
}

/// Reads now what capturing and resolving backtraces needs later: the loaded
/// modules' unwind tables, and the debug information of the modules on the
/// calling thread's stack that can hold the user's code (the program, most
/// often). Code that must resolve a backtrace when memory has run out (the
/// out-of-memory recorder) calls it beforehand.
pub fn prepare_backtraces() {
    let _ = Backtrace::capture().frames();
}

impl std::fmt::Debug for Backtrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Backtrace(..)")
    }
}

/// A folder of memlab's own Rust sources. Frames in files under it belong to
/// memlab, not to the user, and backtraces leave them out. Each memlab crate
/// submits its own, so no crate names another's folders.
#[doc(hidden)]
pub struct SourceRoot(pub &'static str);

inventory::collect!(SourceRoot);
inventory::submit! { SourceRoot(concat!(env!("CARGO_MANIFEST_DIR"), "/src")) }

/// Shared libraries none of whose frames is the user's, by the start of
/// their file names (`libtorch`): backtraces do not read their debug
/// information. Each crate submits the libraries it brings; the C and C++
/// runtimes, and every library under the system's library folders, are
/// known here.
#[doc(hidden)]
pub struct ForeignLibraries(pub &'static [&'static str]);

inventory::collect!(ForeignLibraries);

/// The C and C++ runtimes, wherever they are installed (a conda or Nix
/// environment keeps its own).
const RUNTIMES: [&str; 10] = [
    "libc.so",
    "libm.so",
    "libdl.so",
    "librt.so",
    "libpthread",
    "ld-linux",
    "libstdc++",
    "libgcc_s",
    "libgomp",
    "linux-vdso",
];

/// Whether `address` lies in a library that holds none of the user's code:
/// one under a system library folder, a C or C++ runtime, or one a crate
/// named ([`ForeignLibraries`]). The program itself, and libraries elsewhere
/// (the user's own), are looked at.
fn in_foreign_library(address: u64) -> bool {
    #[cfg(unix)]
    {
        // SAFETY: dladdr fills `info` for a code address; the file name it
        // gives is owned by the loader and is only read here.
        let path = unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(address.saturating_sub(1) as *const libc::c_void, &mut info) == 0
                || info.dli_fname.is_null()
            {
                return false;
            }
            std::ffi::CStr::from_ptr(info.dli_fname).to_bytes()
        };
        is_foreign_path(path)
    }
    #[cfg(not(unix))]
    {
        let _ = address;
        false
    }
}

/// [`in_foreign_library`]'s rule, on the library's path.
fn is_foreign_path(path: &[u8]) -> bool {
    const SYSTEM: [&[u8]; 4] = [b"/lib/", b"/lib64/", b"/usr/lib/", b"/usr/lib64/"];
    if SYSTEM.iter().any(|dir| path.starts_with(dir)) {
        return true;
    }
    let name = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    RUNTIMES.iter().any(|prefix| name.starts_with(prefix.as_bytes()))
        || inventory::iter::<ForeignLibraries>
            .into_iter()
            .flat_map(|libs| libs.0)
            .any(|prefix| name.starts_with(prefix.as_bytes()))
}

/// Whether a source file belongs to the user's code rather than to the
/// standard library, a dependency (registry or git checkout) or memlab itself.
/// Only resolving a frame asks, never an allocation event: kept out of line,
/// so that a change here does not move the recorder's code (an extra
/// condition here, inlined, read the CPU event 1.11 times the build without it).
#[inline(never)]
fn is_user_file(file: &std::path::Path) -> bool {
    let text = file.to_string_lossy();
    // libtorch's inline headers and the C library's sources (which its debug
    // information names relative to its build directory) are not the user's;
    // nor is Rust's standard library, named `/rustc/<commit>/library/...`, or
    // by its path in the toolchain where rust-src is installed (code of it
    // inlined into memlab's, such as `bool::then`, carries that path).
    !(text.starts_with("/rustc/")
        || text.contains("/lib/rustlib/src/rust/")
        || text.starts_with("./")
        || text.contains("/torch/include/")
        || text.contains("/.cargo/registry/")
        || text.contains("/.cargo/git/")
        || inventory::iter::<SourceRoot>.into_iter().any(|root| file.starts_with(root.0)))
}

/// The calling thread's unwinder rule caches so far, for benchmarks:
/// lookups that hit, that missed because another return address held the
/// slot, and that missed on a slot's first use. Zeros where memlab's own
/// unwinder is not built (other platforms).
#[doc(hidden)]
pub fn unwind_cache_stats() -> (u64, u64, u64) {
    #[cfg(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64"))]
    return unwind::cache_stats();
    #[cfg(not(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64")))]
    (0, 0, 0)
}

/// Timing of memlab's own work per event, for benchmarks: off unless a
/// benchmark turns it on ([`time_own_work`]).
pub(crate) mod own_work {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    crate::process::process_wide! {
        pub(crate) static ON: AtomicBool = AtomicBool::new(false);
    }
    crate::process::process_wide! {
        /// Events recorded, their nanoseconds in the recorder, backtraces
        /// captured, their nanoseconds, their frames, and how many of them
        /// an earlier walk gave.
        pub(crate) static COUNTS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
    }

    /// Whether timing is on.
    #[inline]
    pub(crate) fn on() -> bool {
        ON.load(Ordering::Relaxed)
    }

    /// Adds `values` to the counts at `first` and on.
    pub(crate) fn add(first: usize, values: &[u64]) {
        for (i, v) in values.iter().enumerate() {
            COUNTS[first + i].fetch_add(*v, Ordering::Relaxed);
        }
    }
}

/// Turns the timing of memlab's own work per event on or off, and returns
/// the counts so far: events recorded and the nanoseconds the recorder spent
/// on them (the backtrace included), backtraces captured and the nanoseconds
/// and frames of their walks, and how many an earlier walk gave. For
/// benchmarks that tell what recording costs directly from what it costs
/// the step around it.
#[doc(hidden)]
pub fn time_own_work(on: bool) -> [u64; 6] {
    use std::sync::atomic::Ordering;
    own_work::ON.store(on, Ordering::Relaxed);
    own_work::COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed))
}

/// A small number for the calling thread, stable for its lifetime: 1 for the
/// first thread that asks, 2 for the next, and so on.
pub fn thread_number() -> u64 {
    context::thread_number()
}

#[cfg(test)]
mod tests {
    use super::is_user_file;
    use super::Path;

    #[inline(never)]
    fn captured_here() -> std::sync::Arc<super::Backtrace> {
        std::hint::black_box(super::Backtrace::capture_shared())
    }

    #[inline(never)]
    fn captured_there() -> std::sync::Arc<super::Backtrace> {
        std::hint::black_box(super::Backtrace::capture_shared())
    }

    /// A thread's captures of one call path share one backtrace; another
    /// path gets its own, and each holds what a plain capture holds.
    #[test]
    fn captures_of_one_call_path_share_one_backtrace() {
        let here: Vec<_> = (0..3).map(|_| captured_here()).collect();
        assert!(here.windows(2).all(|w| std::sync::Arc::ptr_eq(&w[0], &w[1])), "one path, one backtrace");
        let there = captured_there();
        assert!(!std::sync::Arc::ptr_eq(&here[0], &there), "another path, another backtrace");
        assert_ne!(here[0].addresses(), there.addresses());
        // Another thread keeps its own.
        let elsewhere = std::thread::spawn(captured_here).join().unwrap();
        assert!(!std::sync::Arc::ptr_eq(&here[0], &elsewhere));
    }

    #[test]
    fn libraries_of_the_system_and_the_runtimes_are_not_read() {
        use super::is_foreign_path;
        for path in [
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/ld-linux-x86-64.so.2",
            "/opt/conda/envs/t/lib/libstdc++.so.6",
            "/home/u/.venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1",
            "linux-vdso.so.1",
        ] {
            assert!(is_foreign_path(path.as_bytes()), "{path}");
        }
        for path in ["/home/u/train/target/release/train", "/home/u/plugin/target/release/libplugin.so", ""] {
            assert!(!is_foreign_path(path.as_bytes()), "{path}");
        }
    }

    #[test]
    fn memlab_registry_and_std_frames_are_not_the_users() {
        let own = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/events/recorder.rs");
        assert!(!is_user_file(&own), "memlab-core's own sources");
        assert!(!is_user_file(Path::new("/rustc/abc/library/core/src/ops/function.rs")));
        assert!(!is_user_file(Path::new(
            "/home/u/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/lib/rustlib/src/rust/library/core/src/bool.rs"
        )));
        assert!(!is_user_file(Path::new("/home/u/.cargo/registry/src/index/tch-0.24.0/src/tensor/mod.rs")));
        assert!(!is_user_file(Path::new("/v/lib/python3.12/site-packages/torch/include/c10/core/Allocator.h")));
        assert!(is_user_file(Path::new("/home/u/train/src/main.rs")));
        // A crate beside memlab-core in the same folder is not memlab's unless it says so.
        let sibling = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("tests/common/mod.rs");
        assert!(is_user_file(&sibling));
    }
}
