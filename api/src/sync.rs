//! Locks whose poisoning is an error, never ignored.
//!
//! A `Mutex` is poisoned when a task panics while holding it: what it guards may be half
//! written. `if let Ok(guard) = m.lock()` would skip the work silently from then on; `locked`
//! says which lock instead, for the caller to return as its error (the panic itself is logged
//! and counted by the binary).

use std::sync::{Mutex, MutexGuard};

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
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self, what: &'static str) -> Result<MutexGuard<'_, T>, Poisoned> {
        self.lock().map_err(|_| Poisoned(what))
    }
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
    }
}
