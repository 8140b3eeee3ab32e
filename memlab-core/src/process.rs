//! Process-wide state, in one place. Everything memlab keeps for the whole
//! process (the recorder and its clock, the hooks' and the sampler's
//! switches, the registry, the OOM recorder's configuration and reserve, the
//! profiler's settings and peak ledgers, the sinks) lives in one table owned
//! by this module. Code reaches a value through a [`Shared`] handle, declared
//! with [`process_wide!`](crate::process::process_wide) beside the code that uses it,
//! which finds the value in the table the first time and remembers where it
//! is (one atomic load on every later use).
//!
//! The table is keyed by the value's name (its module path and static's
//! name) and its type, so two handles of one name and type reach one value,
//! and a handle of another type never reads a value it does not describe.
//! The handles are how a later change makes several copies of memlab in one
//! process (a notebook's cells, plugins) share one state: it hands every
//! copy the same table. What stays per copy is what may: caches of facts
//! that are the same for every copy (the driver's handles, resolved frames,
//! page size), thread-locals and constant tables.

use std::any::{Any, TypeId};
use std::ops::Deref;
use std::sync::atomic::{AtomicPtr, Ordering};
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

struct Entry {
    name: &'static str,
    type_id: TypeId,
    value: &'static (dyn Any + Send + Sync),
}

/// Every process-wide value made so far. A value is never removed: it
/// lives as long as the process, like the statics it stands for.
static TABLE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

fn lookup<T: Send + Sync + 'static>(table: &[Entry], name: &str) -> Option<&'static T> {
    let type_id = TypeId::of::<T>();
    table.iter().find(|e| e.type_id == type_id && e.name == name).and_then(|e| e.value.downcast_ref::<T>())
}

/// The value of `name` and type `T`, made with `init` when the table has
/// none. `init` runs outside the table's lock (it may use other handles);
/// of two threads that made it at once, the first to take the lock wins and
/// the other's value is dropped outside it. Under the lock only Rust's
/// allocator is asked for memory (the table's growth), never libtorch's, so
/// an allocator hook that finds a value cannot wait on code that allocates
/// through libtorch.
fn find_or_make<T: Send + Sync + 'static>(name: &'static str, init: fn() -> T) -> &'static T {
    if let Some(value) = lookup::<T>(&TABLE.locked(), name) {
        return value;
    }
    let made = Box::new(init());
    let mut table = TABLE.locked();
    if let Some(value) = lookup::<T>(&table, name) {
        drop(table);
        drop(made);
        return value;
    }
    let value: &'static T = Box::leak(made);
    table.push(Entry { name, type_id: TypeId::of::<T>(), value });
    value
}

/// The names of the process-wide values made so far, in the order they
/// were made.
pub fn names() -> Vec<&'static str> {
    TABLE.locked().iter().map(|e| e.name).collect()
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
        assert_eq!(names().iter().filter(|n| **n == "process::tests::one").count(), 1);
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
        assert!(names().contains(&"memlab_core::process::tests::NAMED"));
    }
}
