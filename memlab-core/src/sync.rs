//! Locks that outlive a panic. Every structure memlab keeps behind a mutex
//! is consistent before anything that can panic runs under it, so a lock
//! poisoned by a panic elsewhere is taken as it is: memlab's state survives
//! the user's panics (and a panicking test) instead of failing every later
//! call.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] that takes a poisoned lock as it is.
pub trait LockExt<T: ?Sized> {
    /// The lock, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    #[inline]
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::LockExt;
    use std::sync::Mutex;

    #[test]
    fn a_poisoned_lock_is_taken_as_it_is() {
        let m = Mutex::new(1);
        let _ = std::panic::catch_unwind(|| {
            let _guard = m.lock().unwrap();
            panic!("poisons the lock");
        });
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
