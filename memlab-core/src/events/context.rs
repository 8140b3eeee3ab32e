//! What the calling thread is doing, as memlab knows it: the profiled
//! statement running now and the dispose scopes open. Events read it to say
//! where they happened without unwinding the stack.

use std::cell::{Cell, RefCell};
use std::fmt;

use crate::profiled::ProfiledFn;

/// A statement of a profiled function: the function and the source line.
#[derive(Clone, Copy)]
pub struct StatementRef {
    function: &'static ProfiledFn,
    /// The source line.
    pub line: u32,
}

impl StatementRef {
    pub(crate) fn new(function: &'static ProfiledFn, line: u32) -> Self {
        StatementRef { function, line }
    }

    /// The function's path.
    pub fn function(&self) -> &'static str {
        self.function.name()
    }

    /// The source file.
    pub fn file(&self) -> &'static str {
        self.function.meta().file
    }

    /// The statement's source text (trimmed), as compiled.
    pub fn code(&self) -> &'static str {
        let meta = self.function.meta();
        meta.source.get(self.line.saturating_sub(meta.first_line) as usize).map_or("", |l| l.trim())
    }
}

impl PartialEq for StatementRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.function, other.function) && self.line == other.line
    }
}

impl Eq for StatementRef {}

impl std::hash::Hash for StatementRef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.function as *const ProfiledFn).hash(state);
        self.line.hash(state);
    }
}

impl fmt::Display for StatementRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}:{}): {}", self.function(), self.file(), self.line, self.code())
    }
}

impl fmt::Debug for StatementRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.function(), self.line)
    }
}

/// What an event reads of its thread, in one thread-local that needs no
/// initialization and no destructor: reading it is a plain load on every
/// thread, at every moment of its life (a free in a thread-exit destructor
/// included), so the allocator's hook reads it once and never fails.
struct Here {
    /// memlab's number for the thread (0 until first asked).
    number: Cell<u64>,
    /// The profiled statement running.
    statement: Cell<Option<StatementRef>>,
    /// The innermost dispose scope open (the top of the thread's scopes).
    scope: Cell<Option<u64>>,
}

thread_local! {
    static OWN_HERE: Here = const {
        Here { number: Cell::new(0), statement: Cell::new(None), scope: Cell::new(None) }
    };
    static OWN_SCOPES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The thread-locals of the copy of memlab that first needed them, for every
/// copy: a statement or scope set by one copy's code is what another copy's
/// allocator hook reads (in a notebook, the hook may be an earlier cell's).
struct Locals {
    here: unsafe extern "C" fn() -> *const Here,
    scopes: unsafe extern "C" fn() -> *const RefCell<Vec<u64>>,
}

unsafe extern "C" fn own_here() -> *const Here {
    OWN_HERE.try_with(|here| here as *const Here).unwrap_or(std::ptr::null())
}

unsafe extern "C" fn own_scopes() -> *const RefCell<Vec<u64>> {
    OWN_SCOPES.try_with(|scopes| scopes as *const RefCell<Vec<u64>>).unwrap_or(std::ptr::null())
}

crate::process::process_wide! {
    static LOCALS: Locals = Locals { here: own_here, scopes: own_scopes };
}

/// Runs `f` on the calling thread's `Here`; `None` when the thread-local is
/// gone (the thread is exiting).
#[inline]
fn with_here<R>(f: impl FnOnce(&Here) -> R) -> Option<R> {
    let here = LOCALS.here;
    // In the copy whose thread-local it is (every program that links memlab
    // once), the access stays inline, as fast as a plain thread-local.
    if here as *const () == own_here as *const () {
        return OWN_HERE.try_with(f).ok();
    }
    // SAFETY: the accessor returns null or the calling thread's value, which
    // lives until the thread exits and is only used here, on this thread.
    unsafe { here().as_ref() }.map(f)
}

fn with_scopes<R>(f: impl FnOnce(&RefCell<Vec<u64>>) -> R) -> Option<R> {
    // SAFETY: as in `with_here`.
    unsafe { (LOCALS.scopes)().as_ref() }.map(f)
}

/// Where the calling thread is, as an event records it.
#[derive(Clone, Copy)]
pub(crate) struct Whereabouts {
    pub thread: u64,
    pub scope: Option<u64>,
    pub statement: Option<StatementRef>,
}

/// The calling thread's number, innermost dispose scope and statement, read
/// in one access.
#[inline]
pub(crate) fn whereabouts() -> Whereabouts {
    with_here(|here| Whereabouts { thread: number_of(here), scope: here.scope.get(), statement: here.statement.get() })
        .unwrap_or(Whereabouts { thread: 0, scope: None, statement: None })
}

/// memlab's number for the calling thread (see [`super::thread_number`]).
pub(crate) fn thread_number() -> u64 {
    with_here(number_of).unwrap_or(0)
}

#[inline]
fn number_of(here: &Here) -> u64 {
    match here.number.get() {
        0 => {
            let number = next_thread_number();
            here.number.set(number);
            number
        }
        number => number,
    }
}

#[cold]
fn next_thread_number() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    crate::process::process_wide! {
        static NEXT: AtomicU64 = AtomicU64::new(1);
    }
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The profiled statement running on this thread, if any.
pub fn current_statement() -> Option<StatementRef> {
    with_here(|here| here.statement.get()).flatten()
}

/// Sets the running statement; returns the one it replaces.
pub(crate) fn set_statement(statement: Option<StatementRef>) -> Option<StatementRef> {
    with_here(|here| here.statement.replace(statement)).flatten()
}

/// The innermost dispose scope open on this thread.
pub(crate) fn innermost_scope() -> Option<u64> {
    with_here(|here| here.scope.get()).flatten()
}

pub(crate) fn push_scope(id: u64) {
    let _ = with_scopes(|s| {
        s.borrow_mut().push(id);
        set_innermost(s.borrow().last().copied());
    });
}

/// Removes `id` wherever it is (scopes should close innermost first, but a
/// guard moved elsewhere may not).
pub(crate) fn remove_scope(id: u64) {
    let _ = with_scopes(|s| {
        let mut s = s.borrow_mut();
        if let Some(pos) = s.iter().rposition(|x| *x == id) {
            s.remove(pos);
        }
        set_innermost(s.last().copied());
    });
}

fn set_innermost(scope: Option<u64>) {
    let _ = with_here(|here| here.scope.set(scope));
}
