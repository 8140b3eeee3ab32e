//! What the calling thread is doing, as memlab knows it: the profiled
//! statement running now and the dispose scopes open. Events read it to say
//! where they happened without unwinding the stack.

use std::cell::{Cell, RefCell};
use std::fmt;

use crate::sites::Site;

/// A statement of a profiled function: the function and the source line.
#[derive(Clone, Copy)]
pub struct StatementRef {
    site: &'static Site,
    /// The source line.
    pub line: u32,
}

impl StatementRef {
    pub(crate) fn new(site: &'static Site, line: u32) -> Self {
        StatementRef { site, line }
    }

    /// The function's path.
    pub fn function(&self) -> &'static str {
        self.site.name()
    }

    /// The source file.
    pub fn file(&self) -> &'static str {
        self.site.meta().file
    }

    /// The statement's source text (trimmed), as compiled.
    pub fn code(&self) -> &'static str {
        let meta = self.site.meta();
        meta.source.get(self.line.saturating_sub(meta.first_line) as usize).map_or("", |l| l.trim())
    }
}

impl PartialEq for StatementRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.site, other.site) && self.line == other.line
    }
}

impl Eq for StatementRef {}

impl std::hash::Hash for StatementRef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.site as *const Site).hash(state);
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

thread_local! {
    static STATEMENT: Cell<Option<StatementRef>> = const { Cell::new(None) };
    static SCOPES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The profiled statement running on this thread, if any.
pub fn current_statement() -> Option<StatementRef> {
    STATEMENT.try_with(Cell::get).ok().flatten()
}

/// Sets the running statement; returns the one it replaces.
pub(crate) fn set_statement(statement: Option<StatementRef>) -> Option<StatementRef> {
    STATEMENT.try_with(|s| s.replace(statement)).ok().flatten()
}

/// The innermost dispose scope open on this thread.
pub(crate) fn innermost_scope() -> Option<u64> {
    SCOPES.try_with(|s| s.borrow().last().copied()).ok().flatten()
}

pub(crate) fn push_scope(id: u64) {
    let _ = SCOPES.try_with(|s| s.borrow_mut().push(id));
}

/// Removes `id` wherever it is (scopes should close innermost first, but a
/// guard moved elsewhere may not).
pub(crate) fn remove_scope(id: u64) {
    let _ = SCOPES.try_with(|s| {
        let mut s = s.borrow_mut();
        if let Some(pos) = s.iter().rposition(|x| *x == id) {
            s.remove(pos);
        }
    });
}
