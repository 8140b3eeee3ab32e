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
use std::sync::Mutex;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};

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

thread_local! {
    // Inline in the vector (no box of their own): one pointer less to follow per frame.
    static CACHE: RefCell<Vec<Option<CacheX86_64>>> = RefCell::new((0..CACHES).map(|_| None).collect());
    static STACK: Option<Range<u64>> = thread_stack();
}

/// The return addresses of the calling thread's stack, innermost first
/// (starting with this function's caller), written to `frames`; returns how
/// many. Allocates nothing once the thread's caches are made.
#[inline(never)]
pub(crate) fn capture_into(frames: &mut [u64; MAX_FRAMES]) -> usize {
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
    let Some(stack) = STACK.try_with(Clone::clone).ok().flatten() else { return 0 };
    let mut read_stack = |address: u64| {
        if address.is_multiple_of(8) && stack.contains(&address) && stack.contains(&(address + 7)) {
            // SAFETY: the address is aligned and inside this thread's mapped stack.
            Ok(unsafe { std::ptr::read(address as *const u64) })
        } else {
            Err(())
        }
    };
    let mut count = 0;
    let _ = CACHE.try_with(|caches| {
        let Ok(mut caches) = caches.try_borrow_mut() else { return };
        let mut known = known();
        // At most twice: again after reading modules loaded since the last read.
        loop {
            count = 0;
            let mut outside = false;
            let mut regs = UnwindRegsX86_64::new(pc, sp, bp);
            let mut address = FrameAddress::InstructionPointer(pc);
            for _ in 0..MAX_FRAMES {
                let lookup = address.address_for_lookup();
                let cache = caches[cache_of(lookup)].get_or_insert_with(CacheX86_64::new);
                let ret = match known.unwinder.unwind_frame(address, &mut regs, cache, &mut read_stack) {
                    Ok(Some(ret)) => ret,
                    // The outermost frame: the walk is complete.
                    Ok(None) => break,
                    // A walk that fails at an address outside every module
                    // it knows has met code loaded since they were read.
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
            if !outside {
                break;
            }
            let newer = refresh(known as *const Known as *mut Known);
            if std::ptr::eq(newer, known) {
                break;
            }
            known = newer;
        }
    });
    count
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
