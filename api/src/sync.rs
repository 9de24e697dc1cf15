//! The one place locks are taken, and what their poisoning means.
//!
//! A `Mutex` is poisoned when a task panics while holding it: what it guards may be half
//! written. For state a decision rests on, poisoning is an error, never ignored:
//! `if let Ok(guard) = m.lock()` would skip the work silently from then on; [`Locked::locked`]
//! says which lock instead, for the caller to return as its error (the panic itself is logged
//! and counted by the binary). For a cache or a counter, whose worst half-written state is an
//! entry looked up again or a sample lost, [`Locked::recovered`] (and [`ReadWrite`] for an
//! `RwLock`) takes the lock anyway and says so in the log, rather than failing every caller
//! for good.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Lock `0` was poisoned by a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lock {0} poisoned: a task panicked while holding it")]
pub struct Poisoned(pub &'static str);

/// [`Mutex::lock`], with poisoning as a [`Poisoned`] error naming the lock.
pub trait Locked<T> {
    fn locked(&self, what: &'static str) -> Result<MutexGuard<'_, T>, Poisoned>;

    /// For code that has no error to return (a lookup, a background loop): the poisoning is
    /// logged at error level and the caller gets `None`, its "not known" case.
    fn locked_or_log(&self, what: &'static str) -> Option<MutexGuard<'_, T>> {
        self.locked(what).map_err(|e| tracing::error!(error = %e, "cannot use a lock")).ok()
    }

    /// For a cache or a counter: the guard even when the lock is poisoned (logged).
    fn recovered(&self, what: &'static str) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self, what: &'static str) -> Result<MutexGuard<'_, T>, Poisoned> {
        self.lock().map_err(|_| Poisoned(what))
    }

    fn recovered(&self, what: &'static str) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| recover(what, e))
    }
}

/// [`Locked::recovered`] for an `RwLock` guarding a cache.
pub trait ReadWrite<T> {
    fn read_recovered(&self, what: &'static str) -> RwLockReadGuard<'_, T>;
    fn write_recovered(&self, what: &'static str) -> RwLockWriteGuard<'_, T>;
}

impl<T> ReadWrite<T> for RwLock<T> {
    fn read_recovered(&self, what: &'static str) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|e| recover(what, e))
    }

    fn write_recovered(&self, what: &'static str) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|e| recover(what, e))
    }
}

fn recover<G>(what: &'static str, e: PoisonError<G>) -> G {
    tracing::warn!(lock = what, "lock poisoned by a panic; a cache, used as it is");
    e.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_held_through_a_panic_is_an_error_naming_it() {
        let m = std::sync::Arc::new(Mutex::new(1));
        assert_eq!(*m.locked("count").unwrap(), 1);
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("half written");
        })
        .join();
        assert_eq!(m.locked("count").unwrap_err(), Poisoned("count"));
        assert!(m.locked_or_log("count").is_none());
        assert_eq!(Poisoned("count").to_string(), "lock count poisoned: a task panicked while holding it");
        assert_eq!(*m.recovered("count"), 1, "a cache is used as it is");
    }

    #[test]
    fn a_cache_behind_a_poisoned_rwlock_is_still_read_and_written() {
        let l = std::sync::Arc::new(RwLock::new(vec![1]));
        let held = l.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.write().unwrap();
            panic!("half written");
        })
        .join();
        assert!(l.read().is_err(), "poisoned");
        l.write_recovered("cache").push(2);
        assert_eq!(*l.read_recovered("cache"), [1, 2]);
    }
}
