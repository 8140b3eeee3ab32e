//! Fast stack capture for allocation backtraces (Linux, x86-64).
//!
//! The system unwinder looks up every frame's unwind rule from scratch, which
//! costs microseconds per allocation through libtorch's deep C++ frames. This
//! one reads the unwind tables (`.eh_frame`, indexed by `.eh_frame_hdr`) of
//! the loaded modules straight from memory, once, and keeps the rules it has
//! used in per-thread caches (framehop's), so a repeated call path unwinds in
//! a few hundred nanoseconds. It only collects return addresses; symbols are
//! resolved when someone looks at the backtrace.
//!
//! A framehop cache is direct-mapped (509 slots by `address % 509`): two hot
//! return addresses that share a slot evict each other on every capture, and
//! whether any pair does depends on where the loader put each library. A
//! training step's allocations come from dozens of call paths of thirty to
//! forty frames, hundreds of distinct return addresses: in one cache, many
//! pairs collide, and every collision costs a rule lookup (a microsecond or
//! more) on every capture, so capture costs came out bimodal between runs and
//! builds. Each thread has [`CACHES`] caches, and an address goes to the one
//! that the top bits of a multiplicative hash of it pick, a choice
//! independent of its slot: two addresses then collide only if they share
//! both, as in one cache [`CACHES`] times larger. (An earlier version chose
//! the cache by stack depth, which separates the frames of one path but not
//! the different paths' frames at one depth: 1 to 4% of lookups still missed
//! on a GPU host, and captures cost 2 to 3 µs there.) Caches are made on first
//! use, so a thread that records few stacks pays for few.
//!
//! Even with every rule cached, a walk looks up and runs a rule for each of
//! thirty to fifty frames, a microsecond or two on a GPU host. A recording
//! walks from the same few dozen call paths over and over, so each thread
//! also remembers its walks by the stack pointer they started from, with the
//! stack words each depended on (return addresses, and saved frame pointers
//! where a rule used them): a walk that starts where a remembered one did,
//! over the same words, would find the same frames, and checking those words
//! costs a tenth of walking ([`capture_memoized`]). The check is exact: a
//! remembered walk is reused only where the walk would find the same.
//!
//! Stack reads are bounded by the calling thread's stack, so a broken rule
//! ends the walk instead of reading stray memory.
//!
//! Modules loaded after the tables were read (a notebook's later cells, a
//! plugin, a library torch loads on first use) are found when a walk first
//! fails at an address outside every known module (framehop unwinds such a
//! frame by its frame pointer, which code built without them does not keep):
//! if the loader's list has changed since it was read, it is read again and
//! the walk repeated. A complete walk ends at the outermost frame's rule and
//! pays nothing for this. A module unloaded after being read stays in the
//! tables until the next change is noticed; memlab's own copies, which
//! register thread-local destructors, are never unloaded.

use std::cell::RefCell;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};

use super::Backtrace;

/// The most frames one capture keeps.
pub(crate) const MAX_FRAMES: usize = 64;

/// Rule caches per thread (about 16 KB each, made on first use), chosen by
/// the top `CACHE_BITS` bits of a hash of the address.
const CACHE_BITS: u32 = 6;
const CACHES: usize = 1 << CACHE_BITS;

/// Which of a thread's caches holds the rule of `address`: the top bits of
/// a Fibonacci hash, unrelated to the slot (`address % 509`) inside it.
#[inline]
fn cache_of(address: u64) -> usize {
    (address.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - CACHE_BITS)) as usize
}

type Sections = &'static [u8];

/// Reads the unwind tables of the loaded modules now, so that no allocation
/// does it: the first capture may run inside libtorch's allocator lock, and
/// listing modules takes the dynamic loader's lock.
pub(crate) fn prepare() {
    known();
}

/// What the unwinder knows of the loaded modules.
struct Known {
    /// The unwind rules of the modules that have tables.
    unwinder: UnwinderX86_64<Sections>,
    /// Every module's address range, tables or not, sorted by start.
    ranges: Vec<Range<u64>>,
    /// The loader's count of loads and unloads when they were read.
    changes: Option<u64>,
}

impl Known {
    fn covers(&self, address: u64) -> bool {
        let after = self.ranges.partition_point(|r| r.start <= address);
        after > 0 && self.ranges[after - 1].end > address
    }
}

/// The newest [`Known`]. One that is replaced is leaked, not freed: another
/// thread may be walking with it. There is one per change of the loader's
/// list that a walk ran into, each a few kilobytes.
static KNOWN: AtomicPtr<Known> = AtomicPtr::new(std::ptr::null_mut());

fn known() -> &'static Known {
    let current = KNOWN.load(Ordering::Acquire);
    // SAFETY: a non-null KNOWN points at a leaked, never freed Known.
    unsafe { current.as_ref() }.unwrap_or_else(|| refresh(current))
}

/// Reads the loaded modules again, unless another thread has since `stale`
/// was the newest, or the loader's list is as it was when `stale` was read.
#[cold]
#[inline(never)]
fn refresh(stale: *mut Known) -> &'static Known {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = crate::sync::LockExt::locked(&ONE_AT_A_TIME);
    let current = KNOWN.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: as in `known`.
        let current_known = unsafe { &*current };
        if current != stale || (current_known.changes.is_some() && super::loader::changes() == current_known.changes) {
            return current_known;
        }
    }
    let (modules, ranges, changes) = loaded_modules();
    let mut unwinder = UnwinderX86_64::new();
    for module in modules {
        unwinder.add_module(module);
    }
    let fresh: &'static Known = Box::leak(Box::new(Known { unwinder, ranges, changes }));
    KNOWN.store(fresh as *const Known as *mut Known, Ordering::Release);
    fresh
}

/// The instruction, stack and frame pointers where it is written: a walk
/// from there starts in the function that holds it (a macro, so that no
/// call of its own comes between).
macro_rules! registers {
    () => {{
        let (pc, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers into locals; touches no memory.
        unsafe {
            std::arch::asm!(
                "lea {pc}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                pc = out(reg) pc,
                sp = out(reg) sp,
                bp = out(reg) bp,
                options(nomem, nostack, preserves_flags),
            );
        }
        (pc, sp, bp)
    }};
}

thread_local! {
    // Inline in the vector (no box of their own): one pointer less to follow per frame.
    static CACHE: RefCell<Vec<Option<CacheX86_64>>> = RefCell::new((0..CACHES).map(|_| None).collect());
    static STACK: Option<Range<u64>> = thread_stack();
    static MEMO: RefCell<Memo> = RefCell::default();
}

/// Where a walk starts: the instruction, stack and frame pointers, and the
/// calling thread's stack, the only memory it reads.
#[derive(Clone, Copy)]
struct Start<'a> {
    pc: u64,
    sp: u64,
    bp: u64,
    stack: &'a Range<u64>,
}

/// The most stack reads one walk logs for the memo; a longer walk is not kept.
const MAX_READS: usize = 4 * MAX_FRAMES;

/// The most walks a thread keeps in its memo, forgotten together when full.
const MEMO_WALKS: usize = 1024;

/// A thread's earlier walks, by the stack pointer they started from.
///
/// A walk is a function of where it starts (the instruction, stack and
/// frame pointers), the unwind rules of the code it passes (fixed while the
/// tables are), and the words it reads from the stack: the return addresses
/// and the saved frame pointers. A walk that starts where an earlier one did,
/// and finds every word the earlier one read unchanged, would read and
/// compute the same again, and find the same frames. Checking those words
/// (one or two a frame, hot in the cache) costs a fraction of looking up
/// and running a rule for each frame, and a training step allocates from the
/// same few dozen call paths, at the same depths, over and over.
///
/// Only walks whose every rule is in the thread's rule cache are kept, so a
/// remembered walk is the walk those cached rules give. (Where the
/// tables cannot say how to leave a function, framehop steps by its frame
/// pointer and caches that instead, as of the first walk that met it; a rule
/// evicted and worked out again may come out otherwise, for a plain walk as
/// for a remembered one.)
#[derive(Default)]
struct Memo {
    by_sp: crate::hash::FastMap<u64, Vec<Walk>>,
    walks: usize,
}

/// A walk as the memo keeps it.
struct Walk {
    /// The instruction it started from (the one place that walks).
    pc: u64,
    /// The frame pointer it started with, where its frames may depend on it
    /// (a rule used it before any frame restored it from the stack).
    bp: Option<u64>,
    /// The unwind tables it used.
    known: *const Known,
    /// The stack words its frames depended on: (address, value), in order.
    reads: Box<[(u64, u64)]>,
    /// What it found.
    backtrace: Arc<Backtrace>,
}

impl Memo {
    /// An earlier walk from `sp` that the stack shows would find the same now.
    fn find(&self, start: Start, known: *const Known) -> Option<&Walk> {
        self.by_sp.get(&start.sp)?.iter().find(|w| {
            w.pc == start.pc
                && std::ptr::eq(w.known, known)
                && w.bp.is_none_or(|b| b == start.bp)
                && w.reads.iter().all(|&(address, value)| {
                    // Logged reads lie inside this thread's stack, aligned.
                    debug_assert!(start.stack.contains(&address) && start.stack.contains(&(address + 7)));
                    // SAFETY: the address was read from this thread's mapped
                    // stack before, and the stack stays mapped while the thread runs.
                    unsafe { std::ptr::read_volatile(address as *const u64) == value }
                })
        })
    }

    fn keep(&mut self, sp: u64, walk: Walk) {
        if self.walks >= MEMO_WALKS {
            self.by_sp.clear();
            self.walks = 0;
        }
        // Where memory has run out, the walk is not kept.
        if self.by_sp.len() == self.by_sp.capacity() && self.by_sp.try_reserve(1).is_err() {
            return;
        }
        let same_sp = self.by_sp.entry(sp).or_default();
        // A few starts per stack pointer: the newest replaces the oldest.
        if same_sp.len() >= 4 {
            same_sp.remove(0);
            self.walks -= 1;
        }
        if same_sp.try_reserve(1).is_ok() {
            same_sp.push(walk);
            self.walks += 1;
        }
    }
}

/// The calling thread's backtrace (return addresses innermost first,
/// starting with this function's caller): an earlier walk's result where the
/// stack shows it would be found again ([`Memo`]), else a walk's, made into a
/// backtrace by `make`. Returns it, its frames, and whether the walk was
/// skipped.
#[inline(never)]
pub(crate) fn capture_memoized(make: &mut dyn FnMut(&[u64]) -> Arc<Backtrace>) -> (Arc<Backtrace>, usize, bool) {
    let (pc, sp, bp) = registers!();
    let Some(stack) = STACK.try_with(Clone::clone).ok().flatten() else { return (make(&[]), 0, false) };
    let start = Start { pc, sp, bp, stack: &stack };
    let known_now: *const Known = known();
    #[cfg(test)]
    let found = (!tests::BYPASS.get()).then(|| memoized(start, known_now)).flatten();
    #[cfg(not(test))]
    let found = memoized(start, known_now);
    if let Some((backtrace, frames)) = found {
        return (backtrace, frames, true);
    }
    let mut frames = [0u64; MAX_FRAMES];
    let mut reads = [(0u64, 0u64); MAX_READS];
    let walked = walk(start, &mut frames, &mut reads);
    let backtrace = make(&frames[..walked.frames]);
    if let Some(logged) = walked.reads {
        let _ = MEMO.try_with(|memo| {
            let Ok(mut memo) = memo.try_borrow_mut() else { return };
            // Where memory has run out, the walk is not kept.
            let mut words = Vec::new();
            if words.try_reserve_exact(logged).is_err() {
                return;
            }
            words.extend_from_slice(&reads[..logged]);
            let bp = walked.bp_matters.then_some(bp);
            let walk =
                Walk { pc, bp, known: walked.known, reads: words.into_boxed_slice(), backtrace: backtrace.clone() };
            memo.keep(sp, walk);
        });
    }
    (backtrace, walked.frames, false)
}

/// The calling thread's earlier walk from `start` that the stack shows would
/// find the same now, and its frames.
fn memoized(start: Start, known: *const Known) -> Option<(Arc<Backtrace>, usize)> {
    MEMO.try_with(|memo| {
        let memo = memo.try_borrow().ok()?;
        memo.find(start, known).map(|w| (w.backtrace.clone(), w.backtrace.addresses.len()))
    })
    .ok()
    .flatten()
}

/// The return addresses of the calling thread's stack, innermost first
/// (starting with this function's caller), written to `frames`; returns how
/// many. Allocates nothing once the thread's caches are made.
#[inline(never)]
pub(crate) fn capture_into(frames: &mut [u64; MAX_FRAMES]) -> usize {
    let (pc, sp, bp) = registers!();
    let Some(stack) = STACK.try_with(Clone::clone).ok().flatten() else { return 0 };
    walk(Start { pc, sp, bp, stack: &stack }, frames, &mut [(0, 0); MAX_READS]).frames
}

/// Reads the word at `address` of this thread's `stack`, and logs it in
/// `reads` at `logged` (counted past the log's end too).
#[inline(always)]
fn read_logged(address: u64, stack: &Range<u64>, reads: &mut [(u64, u64)], logged: &mut usize) -> Result<u64, ()> {
    if address.is_multiple_of(8) && stack.contains(&address) && stack.contains(&(address + 7)) {
        // SAFETY: the address is aligned and inside this thread's mapped stack.
        let value = unsafe { std::ptr::read(address as *const u64) };
        if let Some(slot) = reads.get_mut(*logged) {
            *slot = (address, value);
        }
        *logged += 1;
        Ok(value)
    } else {
        Err(())
    }
}

/// What [`walk`] did.
struct Walked {
    /// Frames found.
    frames: usize,
    /// The words to check, packed at the log's start; `None` when the walk
    /// is not to be kept (more words than the log holds, a frame whose rule
    /// was not in the cache, or an end at code outside the tables).
    reads: Option<usize>,
    /// Whether the frames may depend on the frame pointer the walk started with.
    bp_matters: bool,
    /// Whether it ended at an address outside every module the tables know.
    outside: bool,
    /// The unwind tables it used.
    known: *const Known,
}

/// Walks the calling thread's stack from `start`, writing return addresses
/// to `frames` and the words the walk depends on to `reads`; again with the
/// modules read anew if it ran into code loaded since they were.
fn walk(start: Start, frames: &mut [u64; MAX_FRAMES], reads: &mut [(u64, u64); MAX_READS]) -> Walked {
    let mut out = Walked { frames: 0, reads: None, bp_matters: true, outside: false, known: std::ptr::null() };
    let _ = CACHE.try_with(|caches| {
        let Ok(mut caches) = caches.try_borrow_mut() else { return };
        let mut known = known();
        // At most twice: again after reading modules loaded since the last read.
        loop {
            out = walk_with(known, &mut caches, start, frames, reads);
            if !out.outside {
                break;
            }
            let newer = refresh(known as *const Known as *mut Known);
            if std::ptr::eq(newer, known) {
                break;
            }
            known = newer;
        }
    });
    out
}

/// One walk with `known`'s rules and the thread's rule `caches` (see [`walk`]).
fn walk_with(
    known: &Known,
    caches: &mut [Option<CacheX86_64>],
    start: Start,
    frames: &mut [u64; MAX_FRAMES],
    reads: &mut [(u64, u64); MAX_READS],
) -> Walked {
    let Start { pc, sp, bp, stack } = start;
    let mut count = 0;
    let mut logged = 0usize;
    // The words a later walk needs unchanged to find the same: each frame's
    // return address, every word the last frame read (a zero return address
    // ends a walk), and the frame pointer's value where a rule uses it. The
    // other words a frame reads are registers it saved (an allocation's size,
    // say), which differ from call to call and change nothing the walk finds.
    let mut needed = [false; MAX_READS];
    // Where the frame pointer's value now may have come from: the reads that
    // gave that value, or `INITIAL`, the register itself.
    const INITIAL: usize = usize::MAX;
    let mut sources = [INITIAL; 8];
    let mut source_count = 1;
    let mut bp_matters = false;
    let mut all_cached = true;
    let mut outside = false;
    let mut regs = UnwindRegsX86_64::new(pc, sp, bp);
    let mut address = FrameAddress::InstructionPointer(pc);
    for _ in 0..MAX_FRAMES {
        let lookup = address.address_for_lookup();
        let cache = caches[cache_of(lookup)].get_or_insert_with(CacheX86_64::new);
        let bp_before = regs.bp();
        let reads_before = logged;
        let hits_before = cache.stats().hit_count;
        let regs_before = regs;
        let mut read_stack = |address| read_logged(address, stack, reads, &mut logged);
        let result = known.unwinder.unwind_frame(address, &mut regs, cache, &mut read_stack);
        if cache.stats().hit_count == hits_before {
            // The rule was not in the cache (first use, or another address
            // held its slot): the frame is run again from where it started,
            // which takes the rule from the cache if framehop put it there.
            // One it did not cache may have been worked out from other
            // registers than these two: such a walk is not kept.
            let hits = cache.stats().hit_count;
            let mut again = regs_before;
            let _ = known
                .unwinder
                .unwind_frame(address, &mut again, cache, &mut |a| read_logged(a, stack, &mut [], &mut 0));
            all_cached &= cache.stats().hit_count > hits && again == regs;
        }
        let frame_reads = reads_before.min(MAX_READS)..logged.min(MAX_READS);
        // A rule that uses the frame pointer reads the word it points at, or
        // the next; one that stops at a zero frame pointer reads neither. A
        // failure may come of where the frame pointer pointed.
        let bp_used = reads[frame_reads.clone()].iter().any(|&(a, _)| a == bp_before || a == bp_before.wrapping_add(8))
            || result.is_err()
            || (matches!(result, Ok(None)) && bp_before == 0);
        if bp_used {
            for &source in &sources[..source_count] {
                match source {
                    INITIAL => bp_matters = true,
                    read => needed[read] = true,
                }
            }
        }
        match result {
            Ok(Some(_)) => {
                let return_slot = regs.sp().wrapping_sub(8);
                if let Some(i) = frame_reads.clone().rev().find(|&i| reads[i].0 == return_slot) {
                    needed[i] = true;
                }
            }
            // How the walk ended may hang on any word the last frame read.
            _ => frame_reads.clone().for_each(|i| needed[i] = true),
        }
        // The frame pointer's new value came from a word this frame read that
        // holds it; an unchanged one may also have.
        let new_bp = regs.bp();
        if new_bp != bp_before {
            source_count = 0;
        }
        for i in frame_reads.filter(|&i| reads[i].1 == new_bp) {
            if source_count == sources.len() {
                // Too many to follow: each is kept.
                needed[i] = true;
            } else {
                sources[source_count] = i;
                source_count += 1;
            }
        }
        let ret = match result {
            Ok(Some(ret)) => ret,
            // The outermost frame: the walk is complete.
            Ok(None) => break,
            // A walk that fails at an address outside every module it knows
            // has met code loaded since they were read.
            Err(_) => {
                outside = !known.covers(lookup);
                break;
            }
        };
        let Some(next) = FrameAddress::from_return_address(ret) else { break };
        frames[count] = ret;
        count += 1;
        address = next;
    }
    // The words to check, in order, packed at the log's start.
    let keep = logged <= MAX_READS && all_cached && !outside;
    let mut kept = 0;
    if keep {
        for i in 0..logged {
            if needed[i] {
                reads[kept] = reads[i];
                kept += 1;
            }
        }
    }
    Walked { frames: count, reads: keep.then_some(kept), bp_matters, outside, known }
}

/// The calling thread's rule caches so far: lookups that hit, that missed
/// because another address held the slot, and that missed otherwise (first
/// use of a slot).
pub(crate) fn cache_stats() -> (u64, u64, u64) {
    CACHE
        .try_with(|caches| {
            let caches = caches.try_borrow().ok()?;
            Some(caches.iter().flatten().map(|c| c.stats()).fold((0, 0, 0), |(h, c, o), s| {
                (
                    h + s.hit_count,
                    c + s.miss_wrong_address_count,
                    o + s.miss_empty_slot_count + s.miss_wrong_modules_count,
                )
            }))
        })
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// The calling thread's stack, from pthread.
fn thread_stack() -> Option<Range<u64>> {
    // SAFETY: pthread_getattr_np fills `attr` for the calling thread; it is
    // destroyed after use; pthread_attr_getstack only reads it.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let ok = libc::pthread_attr_getstack(&attr, &mut base, &mut size) == 0;
        libc::pthread_attr_destroy(&mut attr);
        ok.then(|| base as u64..base as u64 + size as u64)
    }
}

/// Every loaded ELF module that has an `.eh_frame_hdr`, with its unwind
/// tables and code as they are mapped in memory; the address ranges of every
/// module, sorted; and the loader's count of loads and unloads.
fn loaded_modules() -> (Vec<Module<Sections>>, Vec<Range<u64>>, Option<u64>) {
    struct Found {
        modules: Vec<Module<Sections>>,
        ranges: Vec<Range<u64>>,
        changes: Option<u64>,
    }
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, size: libc::size_t, data: *mut c_void) -> libc::c_int {
        // SAFETY: the loader passes a valid info of `size` bytes for the
        // duration of the call, and `data` is the Found handed to
        // dl_iterate_phdr below.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Found)) };
        found.changes = super::loader::changes_of(info, size);
        // SAFETY: `info` comes from dl_iterate_phdr.
        if let Some(range) = unsafe { super::loader::image_of(info) } {
            found.ranges.push(range);
        }
        // SAFETY: as above.
        if let Some(module) = unsafe { module_of(info) } {
            found.modules.push(module);
        }
        0
    }
    let mut found = Found { modules: Vec::new(), ranges: Vec::new(), changes: None };
    // SAFETY: `visit` only reads the headers the loader passes it.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut Found as *mut c_void) };
    found.ranges.sort_by_key(|r| r.start);
    (found.modules, found.ranges, found.changes)
}

/// The module described by `info`, if it has unwind tables.
///
/// # Safety
/// `info` must come from `dl_iterate_phdr`. The slices made here point into
/// the module's mapped image and live as long as the module stays loaded,
/// which for the libraries on a training process's stack is until it exits.
unsafe fn module_of(info: &libc::dl_phdr_info) -> Option<Module<Sections>> {
    let base = info.dlpi_addr;
    // SAFETY: as the caller promises.
    let headers = unsafe { super::loader::headers_of(info) };
    let loads: Vec<Range<u64>> =
        headers.iter().filter(|h| h.p_type == libc::PT_LOAD).map(|h| h.p_vaddr..h.p_vaddr + h.p_memsz).collect();
    let text = headers
        .iter()
        .find(|h| h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_X != 0)
        .map(|h| h.p_vaddr..h.p_vaddr + h.p_memsz)?;
    let hdr = headers.iter().find(|h| h.p_type == libc::PT_GNU_EH_FRAME)?;
    let hdr_svma = hdr.p_vaddr..hdr.p_vaddr + hdr.p_memsz;
    // SAFETY: PT_GNU_EH_FRAME points at the mapped .eh_frame_hdr.
    let hdr_data: Sections =
        unsafe { std::slice::from_raw_parts((base + hdr_svma.start) as *const u8, hdr.p_memsz as usize) };
    // .eh_frame_hdr: version 1, then the encoding of the eh_frame pointer;
    // with 0x1b (pc-relative, signed 4 bytes) it follows at offset 4.
    if hdr_data.len() < 8 || hdr_data[0] != 1 || hdr_data[1] != 0x1b {
        return None;
    }
    let offset = i32::from_le_bytes(hdr_data[4..8].try_into().ok()?) as i64;
    let eh_frame_start = (hdr_svma.start as i64 + 4 + offset) as u64;
    // .eh_frame's length is not recorded; it runs at most to the end of the
    // segment that holds it, and the FDEs are found through the index.
    let segment = loads.iter().find(|r| r.contains(&eh_frame_start))?;
    let eh_frame_svma = eh_frame_start..segment.end;
    // SAFETY: the range lies inside a mapped PT_LOAD segment of the module.
    let eh_frame: Sections = unsafe {
        std::slice::from_raw_parts((base + eh_frame_start) as *const u8, (segment.end - eh_frame_start) as usize)
    };
    // SAFETY: the executable segment is mapped readable (x86-64 has no
    // execute-only mappings for ordinary ELF objects).
    let text_data: Sections =
        unsafe { std::slice::from_raw_parts((base + text.start) as *const u8, (text.end - text.start) as usize) };
    let name = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated path owned by the loader.
        unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }.to_string_lossy().into_owned()
    };
    let image_start = loads.iter().map(|r| r.start).min()?;
    let image_end = loads.iter().map(|r| r.end).max()?;
    let sections = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: Some(text.clone()),
        text: Some(text_data),
        eh_frame_svma: Some(eh_frame_svma),
        eh_frame: Some(eh_frame),
        eh_frame_hdr_svma: Some(hdr_svma),
        eh_frame_hdr: Some(hdr_data),
        ..Default::default()
    };
    Some(Module::new(name, base + image_start..base + image_end, base, sections))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::hint::black_box;
    use std::sync::Arc;

    use super::{capture_memoized, Backtrace};

    thread_local! {
        /// Makes [`capture_memoized`] walk, whatever its memo holds.
        pub(super) static BYPASS: Cell<bool> = const { Cell::new(false) };
    }

    /// From one call site, twice: through the memo, then walking. Returns
    /// both frames and whether the first came from the memo.
    #[inline(never)]
    fn leaf(payload: u64) -> (Vec<u64>, Vec<u64>, bool) {
        let mut make = |a: &[u64]| Arc::new(Backtrace { addresses: a.to_vec(), resolved: Default::default() });
        let mut out = Vec::new();
        // One call instruction for both: a trip count the compiler cannot see.
        for i in 0..black_box(2) {
            BYPASS.set(i == 1);
            // Callee-saved registers hold values that differ from call to call.
            let (backtrace, _, remembered) = capture_memoized(black_box(&mut make));
            out.push((backtrace.addresses.clone(), remembered));
            black_box(payload);
        }
        BYPASS.set(false);
        (out[0].0.clone(), out[1].0.clone(), out[0].1)
    }

    // Two callers with the same body: the same frame size, so the leaf runs
    // at the same stack pointer from either, under different return addresses.
    #[inline(never)]
    fn via_a(depth: u32, payload: u64) -> (Vec<u64>, Vec<u64>, bool) {
        let r = descend(depth, black_box(payload.wrapping_mul(3)));
        black_box(payload);
        r
    }

    #[inline(never)]
    fn via_b(depth: u32, payload: u64) -> (Vec<u64>, Vec<u64>, bool) {
        let r = descend(depth, black_box(payload.wrapping_mul(3)));
        black_box(payload);
        r
    }

    #[inline(never)]
    fn with_array(depth: u32, payload: u64) -> (Vec<u64>, Vec<u64>, bool) {
        let pad = black_box([payload; 9]);
        let r = descend(depth, pad[(payload % 9) as usize]);
        black_box(&pad);
        r
    }

    #[inline(never)]
    fn descend(depth: u32, payload: u64) -> (Vec<u64>, Vec<u64>, bool) {
        match depth {
            0 => leaf(payload),
            d if payload.is_multiple_of(3) => via_a(d - 1, payload / 3 + d as u64),
            d if payload % 3 == 1 => via_b(d - 1, payload / 3 + d as u64),
            d => with_array(d - 1, payload / 3 + d as u64),
        }
    }

    use super::{walk_with, Known, Memo, Start, Walk, CACHES, MAX_FRAMES, MAX_READS};
    use framehop::x86_64::{CacheX86_64, UnwinderX86_64};

    /// Walks the made-up stack `words` (a chain of frame pointers; with no
    /// modules, every rule is the frame-pointer step) twice, keeps the second
    /// walk (all its rules cached), then changes each word in turn to each
    /// of `values(word)`: wherever the memo still takes the kept walk, a
    /// fresh walk finds the same frames.
    fn mutate(words: &mut [u64], bp_index: usize, values: impl Fn(u64, u64) -> Vec<u64>) -> (usize, usize) {
        let known = Known { unwinder: UnwinderX86_64::new(), ranges: Vec::new(), changes: None };
        let mut caches: Vec<Option<CacheX86_64>> = (0..CACHES).map(|_| None).collect();
        let base = words.as_ptr() as u64;
        let stack = base..base + 8 * words.len() as u64;
        let (pc, sp, bp) = (0x1000, base, base + 8 * bp_index as u64);
        let start = Start { pc, sp, bp, stack: &stack };
        let mut frames = [0u64; MAX_FRAMES];
        let mut reads = [(0u64, 0u64); MAX_READS];
        let mut fresh = |frames: &mut [u64; MAX_FRAMES], reads: &mut [(u64, u64); MAX_READS]| {
            let w = walk_with(&known, &mut caches, start, frames, reads);
            (frames[..w.frames].to_vec(), w)
        };
        fresh(&mut frames, &mut reads);
        let (found, walked) = fresh(&mut frames, &mut reads);
        let logged = walked.reads.expect("a walk over cached rules is kept");
        let backtrace = Arc::new(Backtrace { addresses: found.clone(), resolved: Default::default() });
        let mut memo = Memo::default();
        let walk =
            Walk { pc, bp: walked.bp_matters.then_some(bp), known: &known, reads: reads[..logged].into(), backtrace };
        memo.keep(sp, walk);
        let remembered = |memo: &Memo| memo.find(start, &known).map(|w| w.backtrace.addresses.clone());
        assert_eq!(remembered(&memo).as_deref(), Some(&found[..]), "unchanged, the memo gives the walk");
        let (mut changes, mut taken) = (0, 0);
        // By index: the walks read the words through their addresses, so no
        // reference to one is held across them.
        #[allow(clippy::needless_range_loop)]
        for i in 0..words.len() {
            let kept = words[i];
            for value in values(kept, base) {
                words[i] = value;
                changes += 1;
                if let Some(given) = remembered(&memo) {
                    taken += 1;
                    let (walked, _) = fresh(&mut frames, &mut reads);
                    assert_eq!(given, walked, "word {i} from {kept:#x} to {value:#x}");
                }
            }
            words[i] = kept;
        }
        (changes, taken)
    }

    /// A chain of `frames` frame records (saved frame pointer, return
    /// address) two words apart after a gap, its end as `end` makes it.
    fn chain(frames: usize, end: impl Fn(&mut [u64], u64)) -> Vec<u64> {
        let mut words = vec![0u64; 4 + 3 * frames + 4];
        let base = words.as_ptr() as u64;
        for f in 0..frames {
            let at = 4 + 3 * f;
            words[at] = base + 8 * (at as u64 + 3);
            words[at + 1] = 0x7000 + 0x10 * f as u64;
            words[at + 2] = 0xdead_0000 + f as u64; // a saved word no rule reads
        }
        end(&mut words, base);
        words
    }

    /// The memo checks every word that could change what a walk finds: the
    /// return addresses, the frame pointers a rule follows, and how the walk
    /// ended (a zero return address, a zero frame pointer, the frame limit).
    #[test]
    fn a_remembered_walk_checks_every_word_that_could_change_it() {
        let values = |kept: u64, base: u64| vec![0, kept ^ 8, kept.wrapping_add(24), base + 40, 0x7777];
        // Ends at a zero return address.
        let mut words = chain(6, |w, _| w[4 + 3 * 5 + 1] = 0);
        let (changes, taken) = mutate(&mut words, 4, values);
        assert!(taken > 0 && taken < changes, "{taken} of {changes} changes left the walk to the memo");
        // Ends at a zero frame pointer.
        let mut words = chain(6, |w, _| w[4 + 3 * 5] = 0);
        mutate(&mut words, 4, values);
        // Cut at the frame limit.
        let mut words = chain(MAX_FRAMES + 4, |_, _| {});
        let (changes, taken) = mutate(&mut words, 4, values);
        assert!(taken > 0, "{taken} of {changes}");
    }

    /// Whatever call path, caller-saved values and depth, a backtrace the
    /// memo gives is the one a walk from the same place finds: the memo is
    /// an exact shortcut, never a guess. Paths recur (so the memo is used)
    /// and differ in their callers at equal stack pointers (so it is tested).
    #[test]
    fn a_remembered_walk_is_the_walk() {
        let mut remembered = 0;
        for round in 0..4u64 {
            for path in 0..60u64 {
                let (memo, walked, hit) = descend((path % 7) as u32, path * 7 + round % 2);
                assert_eq!(memo, walked, "path {path}, round {round}");
                assert!(walked.len() > 4, "{walked:x?}");
                remembered += hit as u32;
            }
        }
        assert!(remembered > 60, "the memo gave {remembered} of 240");
    }
}
