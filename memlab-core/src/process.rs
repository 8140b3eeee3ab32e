//! Process-wide state, in one place. Everything memlab keeps for the whole
//! process (the recorder and its clock, the hooks' and the sampler's
//! switches, the registry, the OOM recorder's configuration and reserve, the
//! profiler's settings, sites and peak ledgers, the sinks) lives in one table.
//! Code reaches a value through a [`Shared`] handle, declared with
//! [`process_wide!`](crate::process::process_wide) beside the code that uses
//! it, which finds the value in the table the first time and remembers where
//! it is (one atomic load on every later use).
//!
//! The table is keyed by the value's name (its module path and static's
//! name) and its type, so two handles of one name and type reach one value,
//! and a handle of another type never reads a value it does not describe.
//!
//! **One table per process, however many copies of memlab are linked.** A
//! notebook compiles every cell into a library of its own with memlab inside
//! it, and two plugins may each carry one: each copy has its own statics. The
//! table is reached through a C ABI ([`TableAbi`]): the first copy that needs
//! it offers its own at the process's anchor (a place every copy can reach,
//! which the backend provides through [`Anchor`]; the libtorch backend's is
//! held by libtorch's dispatcher), and every later copy uses the one it finds
//! there. Values made by one copy are used by the others, so a value is
//! shared only between copies that agree on its type: same name, same
//! `TypeId` (which differs between builds of different sources or
//! compilers), same size and alignment. Thread-locals that must be the same
//! for every copy go through [`Shared`] too: a value holding the first
//! copy's accessor of its thread-local (the thread's statement and scopes).
//!
//! What stays per copy is what may: caches of facts that are the same for
//! every copy (the driver's handles, resolved frames, page size), thread-locals
//! of the copy's own code and constant tables.

use std::any::TypeId;
use std::ffi::c_void;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Mutex;

use crate::sync::LockExt;

/// A handle to one process-wide value of type `T`, made by `init` the first
/// time any handle of its name and type is used. Dereferences to the value.
pub struct Shared<T: 'static> {
    name: &'static str,
    init: fn() -> T,
    /// The value in the table once found (null before): one load on every
    /// use, the value's address itself.
    found: AtomicPtr<T>,
}

impl<T: Send + Sync + 'static> Shared<T> {
    /// A handle to the value called `name`, made by `init` when no handle of
    /// that name and type made it before. Prefer
    /// [`process_wide!`](crate::process::process_wide), which names it.
    pub const fn new(name: &'static str, init: fn() -> T) -> Shared<T> {
        Shared { name, init, found: AtomicPtr::new(std::ptr::null_mut()) }
    }

    /// The value. An associated function (`Shared::value(&X)`), like
    /// `Arc`'s, so that it never hides a method of the value's own.
    #[inline]
    pub fn value(this: &Self) -> &'static T {
        let found = this.found.load(Ordering::Acquire);
        if found.is_null() {
            return this.find();
        }
        // SAFETY: a non-null pointer was stored by `find`, from a value the
        // table holds for the rest of the process and never hands out
        // mutably; Acquire pairs with its Release, so the value is complete.
        unsafe { &*found }
    }

    /// The name the table knows the value by (`Shared::name(&X)`).
    pub fn name(this: &Self) -> &'static str {
        this.name
    }

    /// Finds (or makes) the value in the table and remembers where it is.
    /// Threads that race here all get the table's one value.
    #[cold]
    #[inline(never)]
    fn find(&self) -> &'static T {
        let value = find_or_make(self.name, self.init);
        self.found.store(value as *const T as *mut T, Ordering::Release);
        value
    }
}

impl<T: Send + Sync + 'static> Deref for Shared<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        Shared::value(self)
    }
}

impl<T: 'static> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Declares process-wide statics: `static NAME: T = init;` becomes a
/// [`Shared<T>`](crate::process::Shared) named after its module path and
/// `NAME`, whose value is made from `init` on first use and kept in the
/// process's table (see [`process`](crate::process)).
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// memlab_core::process::process_wide! {
///     /// Calls counted for the whole process.
///     static CALLS: AtomicU64 = AtomicU64::new(0);
/// }
/// CALLS.fetch_add(1, Ordering::Relaxed);
/// assert_eq!(CALLS.load(Ordering::Relaxed), 1);
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __process_wide {
    ($($(#[$meta:meta])* $vis:vis static $name:ident: $ty:ty = $init:expr;)+) => {$(
        $(#[$meta])*
        $vis static $name: $crate::process::Shared<$ty> =
            $crate::process::Shared::new(::core::concat!(::core::module_path!(), "::", ::core::stringify!($name)), || $init);
    )+};
}
#[doc(inline)]
pub use crate::__process_wide as process_wide;

/// The version of [`TableAbi`]: a copy that finds a table of another version
/// at the anchor keeps its own, and says so.
pub const TABLE_ABI: u32 = 1;

/// A value's type as copies compare it: a hash of its `TypeId`, its size and
/// its alignment.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeKey {
    hash: u64,
    size: usize,
    align: usize,
}

impl TypeKey {
    fn of<T: 'static>() -> TypeKey {
        use std::hash::{Hash, Hasher};
        let mut hasher = crate::hash::FastHasher::default();
        TypeId::of::<T>().hash(&mut hasher);
        TypeKey { hash: hasher.finish(), size: std::mem::size_of::<T>(), align: std::mem::align_of::<T>() }
    }
}

/// Makes a value for the table: its address, or null when making it
/// panicked. `init` is the copy's `fn() -> T`.
type Make = unsafe extern "C" fn(init: *const ()) -> *const ();
/// Drops a value `Make` made that lost a race to another thread's.
type Unmake = unsafe extern "C" fn(value: *const ());
/// Receives each name of [`TableAbi::names`] (UTF-8, not NUL-terminated).
type EachName = unsafe extern "C" fn(context: *mut c_void, name: *const u8, len: usize);
/// Finds the value of a name (`len` UTF-8 bytes) and type, or makes it with
/// `make(init)` (see [`own_find_or_make`]).
type FindOrMake = unsafe extern "C" fn(
    name: *const u8,
    len: usize,
    key: TypeKey,
    make: Make,
    unmake: Unmake,
    init: *const (),
) -> *const ();

/// The table of process-wide values as every copy of memlab reaches it: a C
/// ABI, so that copies built apart (by other compilers, other versions)
/// never depend on each other's Rust layouts except for values whose
/// [`TypeKey`] agrees.
#[repr(C)]
pub struct TableAbi {
    /// [`TABLE_ABI`] of the copy that made it.
    pub abi: u32,
    find_or_make: FindOrMake,
    names: unsafe extern "C" fn(each: EachName, context: *mut c_void),
}

/// Where the copies of memlab in a process meet: the backend submits one
/// (`inventory::submit!`); its `slot` returns the process's slot for the
/// table.
pub struct Anchor {
    /// The slot, the same for every copy that shares the process's state.
    pub slot: fn() -> &'static AtomicPtr<TableAbi>,
    /// Why this copy cannot share the process's state, if it cannot: said
    /// once, as a warning, when the copy first reaches its table.
    pub problem: fn() -> Option<String>,
}
inventory::collect!(Anchor);

/// The anchor the backend gave with [`provide_anchor`], if it did.
static PROVIDED: AtomicPtr<Anchor> = AtomicPtr::new(std::ptr::null_mut());

/// Gives this copy's anchor directly, for code that reaches process-wide
/// state as the copy loads (an initializer: `MEMLAB_OOM_DIR` arms the
/// recorder so). The loader runs a library's initializers in link order, and
/// `inventory`'s registration of the anchor may come after the code that
/// needs it: the copy would then keep a table of its own, apart from the
/// process's.
pub fn provide_anchor(anchor: &'static Anchor) {
    PROVIDED.store(anchor as *const Anchor as *mut Anchor, Ordering::Release);
}

/// This copy's anchor: given directly, or registered.
fn anchor() -> Option<&'static Anchor> {
    let provided = PROVIDED.load(Ordering::Acquire);
    // SAFETY: only `&'static Anchor`s are stored.
    unsafe { provided.as_ref() }.or_else(|| inventory::iter::<Anchor>.into_iter().next())
}

struct Entry {
    name: Box<str>,
    key: TypeKey,
    value: *const (),
}

// SAFETY: values are `Send + Sync` (the handles require it); the table only
// hands out their addresses.
unsafe impl Send for Entry {}

/// This copy's table, used when it is the first copy, or the only one, or
/// when the table at the anchor is of another version. A value is never
/// removed: it lives as long as the process, like the statics it stands for.
static TABLE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

static OWN: TableAbi = TableAbi { abi: TABLE_ABI, find_or_make: own_find_or_make, names: own_names };

fn lookup(table: &[Entry], name: &str, key: TypeKey) -> Option<*const ()> {
    table.iter().find(|e| e.key == key && &*e.name == name).map(|e| e.value)
}

/// The value of `name` and type `key`, made with `make(init)` when the table
/// has none. `make` runs outside the table's lock (it may use other handles);
/// of two threads that made it at once, the first to take the lock wins and
/// the other's value is dropped outside it. Under the lock only Rust's
/// allocator is asked for memory (the table's growth), never libtorch's, so
/// an allocator hook that finds a value cannot wait on code that allocates
/// through libtorch.
unsafe extern "C" fn own_find_or_make(
    name: *const u8,
    len: usize,
    key: TypeKey,
    make: Make,
    unmake: Unmake,
    init: *const (),
) -> *const () {
    // SAFETY: the caller passes a UTF-8 name of `len` bytes.
    let name = unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(name, len)) };
    if let Some(value) = lookup(&TABLE.locked(), name, key) {
        return value;
    }
    // SAFETY: `make` and `init` come together from the caller's copy.
    let made = unsafe { make(init) };
    if made.is_null() {
        return made;
    }
    let mut table = TABLE.locked();
    if let Some(value) = lookup(&table, name, key) {
        drop(table);
        // SAFETY: `made` came from `make`, and nobody else saw it.
        unsafe { unmake(made) };
        return value;
    }
    table.push(Entry { name: name.into(), key, value: made });
    made
}

unsafe extern "C" fn own_names(each: EachName, context: *mut c_void) {
    let names: Vec<Box<str>> = TABLE.locked().iter().map(|e| e.name.clone()).collect();
    for name in names {
        // SAFETY: the caller's `each` takes a name and its context.
        unsafe { each(context, name.as_ptr(), name.len()) };
    }
}

/// The table this copy uses: the process's, found at the anchor the first
/// time, or its own.
fn table() -> &'static TableAbi {
    static CHOSEN: AtomicPtr<TableAbi> = AtomicPtr::new(std::ptr::null_mut());
    let chosen = CHOSEN.load(Ordering::Acquire);
    if !chosen.is_null() {
        // SAFETY: only `&'static TableAbi`s are stored.
        return unsafe { &*chosen };
    }
    let (found, foreign) = choose();
    CHOSEN.store(found as *const TableAbi as *mut TableAbi, Ordering::Release);
    if let Some(problem) = anchor().and_then(|anchor| (anchor.problem)()) {
        defer_warning(problem);
    }
    if let Some(abi) = foreign {
        defer_warning(format!(
            "memlab: another copy of memlab in this process keeps its state in a table of version {abi}; this \
             copy (version {TABLE_ABI}) keeps its own, so the two report apart: build every part of the program \
             with one memlab version"
        ));
    }
    found
}

/// Warnings about this copy's table, said once: the output layer, which
/// needs the table to reach its sinks, writes them before anything else it
/// writes (see [`take_warnings`]); whatever it never took goes to standard
/// error when the process exits. Kept per copy, beside the choice of table.
static DEFERRED: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Whether [`DEFERRED`] may hold anything: one load on the output path.
static ANY_DEFERRED: AtomicBool = AtomicBool::new(false);

fn defer_warning(text: String) {
    let mut deferred = DEFERRED.locked();
    if deferred.is_empty() {
        extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        // SAFETY: registers a function that writes what is left and never unwinds.
        unsafe { atexit(warn_at_exit) };
    }
    deferred.push(text);
    ANY_DEFERRED.store(true, Ordering::Release);
}

extern "C" fn warn_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        use std::io::Write;
        for text in take_warnings() {
            let _ = writeln!(std::io::stderr().lock(), "{text}");
        }
    });
}

/// The warnings about this copy's table not said yet (another copy's state
/// it could not share, the anchor's problem), each once: the output layer
/// takes them before it writes anything.
#[inline]
pub fn take_warnings() -> Vec<String> {
    if !ANY_DEFERRED.load(Ordering::Acquire) {
        return Vec::new();
    }
    ANY_DEFERRED.store(false, Ordering::Release);
    std::mem::take(&mut *DEFERRED.locked())
}

/// The table this copy is to use, and the version of a table at the anchor
/// it could not share.
#[cold]
fn choose() -> (&'static TableAbi, Option<u32>) {
    let own = &OWN as *const TableAbi as *mut TableAbi;
    let Some(anchor) = anchor() else {
        return (&OWN, None);
    };
    match (anchor.slot)().compare_exchange(std::ptr::null_mut(), own, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => (&OWN, None),
        Err(theirs) => {
            // SAFETY: a slot holds only `&'static TableAbi`s of copies that
            // stay loaded (every copy pins itself as it meets the others:
            // the shim's `pin_this_copy`).
            let theirs: &'static TableAbi = unsafe { &*theirs };
            if theirs.abi == TABLE_ABI {
                (theirs, None)
            } else {
                (&OWN, Some(theirs.abi))
            }
        }
    }
}

unsafe extern "C" fn make_value<T>(init: *const ()) -> *const () {
    // SAFETY: `find_or_make` passes the `fn() -> T` it was given.
    let init: fn() -> T = unsafe { std::mem::transmute::<*const (), fn() -> T>(init) };
    // Nothing may unwind into the table's code, which may be another copy's.
    match std::panic::catch_unwind(init) {
        Ok(value) => Box::into_raw(Box::new(value)) as *const (),
        Err(_) => std::ptr::null(),
    }
}

unsafe extern "C" fn unmake_value<T>(value: *const ()) {
    // SAFETY: `value` came from `make_value::<T>`'s box.
    drop(unsafe { Box::from_raw(value as *mut T) });
}

/// The value of `name` and type `T`, made with `init` when the process's
/// table has none.
fn find_or_make<T: Send + Sync + 'static>(name: &'static str, init: fn() -> T) -> &'static T {
    let table = table();
    // SAFETY: the table's functions take these arguments as documented on
    // `TableAbi`; `make_value::<T>` and `init` agree on `T`.
    let value = unsafe {
        (table.find_or_make)(
            name.as_ptr(),
            name.len(),
            TypeKey::of::<T>(),
            make_value::<T>,
            unmake_value::<T>,
            init as *const (),
        )
    };
    if value.is_null() {
        panic!("memlab: making the process-wide value {name} panicked");
    }
    // SAFETY: values of this name and key are `T`s (the key holds `T`'s
    // TypeId), made by `make_value::<T>` in a copy that agrees on `T`, kept
    // for the rest of the process and never handed out mutably.
    unsafe { &*(value as *const T) }
}

/// The names of the process-wide values made so far, in the order they
/// were made.
pub fn names() -> Vec<String> {
    unsafe extern "C" fn push(context: *mut c_void, name: *const u8, len: usize) {
        // SAFETY: `names` below passes its Vec; the table passes a name of `len` bytes.
        let (out, bytes) = unsafe { (&mut *(context as *mut Vec<String>), std::slice::from_raw_parts(name, len)) };
        out.push(String::from_utf8_lossy(bytes).into_owned());
    }
    let mut out: Vec<String> = Vec::new();
    // SAFETY: `push` takes the Vec passed as its context.
    unsafe { (table().names)(push, &mut out as *mut Vec<String> as *mut c_void) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn two_handles_of_one_name_reach_one_value() {
        static A: Shared<AtomicU64> = Shared::new("process::tests::one", || AtomicU64::new(5));
        static B: Shared<AtomicU64> = Shared::new("process::tests::one", || AtomicU64::new(7));
        A.fetch_add(1, Ordering::Relaxed);
        assert_eq!(B.load(Ordering::Relaxed), 6, "B found A's value, not a new one");
        assert!(std::ptr::eq(Shared::value(&A), Shared::value(&B)));
        assert_eq!(names().iter().filter(|n| *n == "process::tests::one").count(), 1);
    }

    #[test]
    fn a_handle_of_another_type_never_reads_the_value() {
        static WORD: Shared<AtomicU64> = Shared::new("process::tests::typed", || AtomicU64::new(1));
        static TEXT: Shared<Mutex<String>> = Shared::new("process::tests::typed", || Mutex::new("text".into()));
        assert_eq!(WORD.load(Ordering::Relaxed), 1);
        assert_eq!(*TEXT.locked(), "text");
    }

    #[test]
    fn threads_that_race_to_make_a_value_all_get_one() {
        // Two handles of one name: each makes the value on its first use.
        static ONE: Shared<Mutex<Vec<u32>>> = Shared::new("process::tests::raced", || Mutex::new(Vec::new()));
        static TWO: Shared<Mutex<Vec<u32>>> = Shared::new("process::tests::raced", || Mutex::new(Vec::new()));
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    let handle = if i % 2 == 0 { &ONE } else { &TWO };
                    handle.locked().push(i);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut seen = ONE.locked().clone();
        seen.sort();
        assert_eq!(seen, (0..8).collect::<Vec<_>>(), "no push went to a value that lost the race");
    }

    crate::process::process_wide! {
        static NAMED: AtomicU64 = AtomicU64::new(0);
    }

    #[test]
    fn the_macro_names_a_value_after_its_module() {
        NAMED.fetch_add(1, Ordering::Relaxed);
        assert_eq!(Shared::name(&NAMED), "memlab_core::process::tests::NAMED");
        assert!(names().iter().any(|n| n == "memlab_core::process::tests::NAMED"));
    }
}
