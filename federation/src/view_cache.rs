//! A member's objects as trimmed views kept in step with one watch ([`ViewCache`]), with what
//! is derived from them kept up to date change by change ([`Derived`]), the task that feeds
//! one ([`spawn_cache`]) and how it wakes its reader ([`Wakeups`]). Used by the capacity
//! model's watches and by the eviction requests' watch.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tidepool_api::sync::Locked;
use tokio::sync::Notify;
use tracing::{error, warn};

use crate::member_tasks::MemberTasks;

/// Set by the watches, taken by the capacity publisher.
#[derive(Clone, Default)]
pub(crate) struct Wakeups {
    /// Any event of any watch.
    pub(crate) changed: Arc<Notify>,
    /// Set with `changed` by a change of online demand (see [`crate::capacity::publisher::coalesce_after`]).
    pub(crate) demand: Arc<AtomicBool>,
    /// A gang waits for capacity (see [`crate::member::MemberHandle::want_capacity`]).
    pub(crate) wanted: Arc<AtomicBool>,
}

/// Every object of kind `K` in the member, watched with backoff.
pub(crate) fn watch_all<K>(
    client: &Client,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(Api::<K>::all(client.clone()), watcher::Config::default()).default_backoff()
}

/// A map of trimmed views kept in step with a watch, re-listed atomically: the views from a
/// re-list replace the old ones only once the re-list is complete. `D` is kept derived from
/// the views, told of every change ([`Derived`]).
#[derive(Debug)]
pub(crate) struct ViewCache<K, V, D = ()> {
    live: HashMap<K, V>,
    relist: Option<HashMap<K, V>>,
    /// True after the first complete list.
    pub synced: bool,
    pub derived: D,
}

/// What a [`ViewCache`] keeps derived from its views, updated with them.
pub(crate) trait Derived<K, V> {
    /// The view of `key` changed from `old` to `new` (`None`: absent).
    fn changed(&mut self, key: &K, old: Option<&V>, new: Option<&V>);
    /// A re-list replaced every view with `live`.
    fn relisted(&mut self, live: &HashMap<K, V>);
}

impl<K, V> Derived<K, V> for () {
    fn changed(&mut self, _: &K, _: Option<&V>, _: Option<&V>) {}
    fn relisted(&mut self, _: &HashMap<K, V>) {}
}

impl<K, V, D: Default> Default for ViewCache<K, V, D> {
    fn default() -> Self {
        Self::with(D::default())
    }
}

impl<K, V, D> ViewCache<K, V, D> {
    /// An empty cache keeping `derived`.
    pub fn with(derived: D) -> Self {
        Self { live: HashMap::new(), relist: None, synced: false, derived }
    }
}

impl<K: Eq + Hash, V: PartialEq, D: Derived<K, V>> ViewCache<K, V, D> {
    /// Applies one event; true when the views changed. Most events of a steady member change
    /// nothing a view keeps (a node's heartbeat, a pod's status probe): those wake no one.
    pub fn apply(&mut self, event: watcher::Event<(K, V)>) -> bool {
        match event {
            watcher::Event::Apply((k, v)) => {
                if self.live.get(&k) == Some(&v) {
                    return false;
                }
                self.derived.changed(&k, self.live.get(&k), Some(&v));
                self.live.insert(k, v);
                true
            }
            watcher::Event::Delete((k, _)) => {
                let Some(old) = self.live.remove(&k) else { return false };
                self.derived.changed(&k, Some(&old), None);
                true
            }
            watcher::Event::Init => {
                self.relist = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply((k, v)) => {
                self.relist.get_or_insert_with(HashMap::new).insert(k, v);
                false
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = self.relist.take() {
                    self.live = fresh;
                    self.derived.relisted(&self.live);
                }
                self.synced = true;
                true
            }
        }
    }
}

impl<K: Eq + Hash, V, D> ViewCache<K, V, D> {
    pub fn views(&self) -> &HashMap<K, V> {
        &self.live
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.live.values()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.live.iter()
    }

    pub fn get<Q>(&self, k: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.live.get(k)
    }
}

/// The view of one watch event; `None` for an object the view leaves out.
pub(crate) fn view_event<T, K, V>(
    event: watcher::Event<T>,
    view: fn(&T) -> Option<(K, V)>,
) -> Option<watcher::Event<(K, V)>> {
    match event {
        watcher::Event::Apply(o) => view(&o).map(watcher::Event::Apply),
        watcher::Event::Delete(o) => view(&o).map(watcher::Event::Delete),
        watcher::Event::InitApply(o) => view(&o).map(watcher::Event::InitApply),
        watcher::Event::Init => Some(watcher::Event::Init),
        watcher::Event::InitDone => Some(watcher::Event::InitDone),
    }
}

/// How a watched object becomes a view (`None`: not kept), and whether a view is online
/// demand (its change wakes the capacity publisher sooner).
pub(crate) type ViewOf<T, K, V> = (fn(&T) -> Option<(K, V)>, fn(&V) -> bool);

/// Keeps `cache` in step with `events` as task `what` of `tasks` (until the session stops),
/// waking its reader on every event that changes a view (and flagging `online_demand`
/// changes). A poisoned cache ends the watch, with an error logged, which marks the member
/// (see [`crate::member_tasks`]).
pub(crate) fn spawn_cache<T, K, V, D, S>(
    events: S,
    cache: &Arc<Mutex<ViewCache<K, V, D>>>,
    (view, online_demand): ViewOf<T, K, V>,
    wakeups: &Wakeups,
    tasks: &MemberTasks,
    what: &'static str,
) where
    S: Stream<Item = Result<watcher::Event<T>, watcher::Error>> + Send + 'static,
    T: Send + 'static,
    K: Eq + Hash + Send + 'static,
    V: PartialEq + Send + 'static,
    D: Derived<K, V> + Send + 'static,
{
    let (cache, wakeups) = (cache.clone(), wakeups.clone());
    let mut events = Box::pin(events.take_until(tasks.cancelled().clone().cancelled_owned()));
    tasks.spawn(what, async move {
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    warn!(error = %e, "member watch failed; retrying with backoff");
                    continue;
                }
            };
            let Some(e) = view_event(event, view) else { continue };
            let demand =
                matches!(&e, watcher::Event::Apply((_, v)) | watcher::Event::Delete((_, v)) if online_demand(v));
            let changed = match cache.locked("member view") {
                Ok(mut c) => c.apply(e),
                Err(e) => {
                    error!(error = %e, "member watch stopped");
                    return;
                }
            };
            if changed {
                if demand {
                    wakeups.demand.store(true, Ordering::Relaxed);
                }
                wakeups.changed.notify_one();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_events_that_change_a_view_wake_the_publisher() {
        let mut c = ViewCache::<&str, u32>::default();
        assert!(!c.apply(watcher::Event::Init));
        assert!(!c.apply(watcher::Event::InitApply(("a", 1))));
        assert!(c.apply(watcher::Event::InitDone), "the first list is news");
        // A node's heartbeat or a pod's probe: the object changed, its view did not.
        assert!(!c.apply(watcher::Event::Apply(("a", 1))));
        assert!(c.apply(watcher::Event::Apply(("a", 2))));
        assert!(c.apply(watcher::Event::Apply(("b", 1))));
        assert!(c.apply(watcher::Event::Delete(("b", 1))));
        assert!(!c.apply(watcher::Event::Delete(("b", 1))), "already gone");
    }

    #[test]
    fn a_relist_replaces_the_cache_only_when_complete() {
        let mut c = ViewCache::<&str, u32>::default();
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(("a", 1)));
        c.apply(watcher::Event::InitDone);
        assert!(c.synced);
        c.apply(watcher::Event::Apply(("b", 2)));
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(("c", 3)));
        // The old view stays visible while the re-list runs.
        assert_eq!(c.values().count(), 2);
        c.apply(watcher::Event::InitDone);
        assert_eq!(c.values().copied().collect::<Vec<_>>(), vec![3]);
        c.apply(watcher::Event::Delete(("c", 0)));
        assert_eq!(c.values().count(), 0);
    }
}
