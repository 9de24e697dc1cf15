//! The member's offload pods of one member session, by namespace and name.
//!
//! What kube's reflector `Store` does for these pods, for less: its table keys every entry
//! with an `ObjectRef` (a slot of 104 bytes, and four strings copied out of the object: name,
//! namespace, resource version, UID). Here a slot is the entry's pointer alone (8 bytes) and
//! the key is read from the entry itself, so at 10,000 offload pods the table is 0.2 MB
//! instead of 1.7, and no key is allocated.
//!
//! Watch events are applied as the reflector applies them: a re-list is gathered aside and
//! swapped in whole when it is done, so readers never see half a list; the cache is ready
//! once the first list is in.

use std::hash::BuildHasher;
use std::sync::{Arc, RwLock};

use std::time::Duration;
use tidepool_api::sync::ReadWrite;

use hashbrown::HashTable;
use kube::runtime::watcher;
use tokio::sync::watch;

use crate::offload::OffloadPod;

type Table = HashTable<Arc<OffloadPod>>;

/// Readers' handle: cheap to clone, shared by every task of the member session.
#[derive(Clone)]
pub struct OffloadCache {
    shared: Arc<Shared>,
    ready: watch::Receiver<bool>,
}

struct Shared {
    table: RwLock<Table>,
    hasher: std::hash::RandomState,
}

/// The watch's handle: the only writer.
pub struct OffloadCacheWriter {
    shared: Arc<Shared>,
    ready: watch::Sender<bool>,
    /// A re-list in progress, swapped in at its end.
    relist: Option<Table>,
}

/// A new, empty cache (not ready) and its writer.
pub fn cache() -> (OffloadCache, OffloadCacheWriter) {
    let shared = Arc::new(Shared { table: RwLock::new(Table::new()), hasher: std::hash::RandomState::new() });
    let (tx, rx) = watch::channel(false);
    (OffloadCache { shared: shared.clone(), ready: rx }, OffloadCacheWriter { shared, ready: tx, relist: None })
}

impl Shared {
    fn hash(&self, namespace: &str, name: &str) -> u64 {
        self.hasher.hash_one((namespace, name))
    }

    fn hash_of(&self, pod: &OffloadPod) -> u64 {
        self.hash(pod.namespace(), pod.name())
    }

    // A writer that panicked left a whole table (every change is one insert, remove or swap).
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table.read_recovered("offload table")
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table.write_recovered("offload table")
    }
}

fn same(namespace: &str, name: &str) -> impl Fn(&Arc<OffloadPod>) -> bool {
    move |p| p.namespace() == namespace && p.name() == name
}

/// Puts `pod` in `table`, replacing the entry of the same namespace and name.
fn upsert(table: &mut Table, shared: &Shared, pod: Arc<OffloadPod>) {
    let hash = shared.hash_of(&pod);
    match table.find_mut(hash, same(pod.namespace(), pod.name())) {
        Some(slot) => *slot = pod,
        None => {
            table.insert_unique(hash, pod, |p| shared.hash_of(p));
        }
    }
}

impl OffloadCache {
    /// The offload pod `name` in the member namespace `namespace`.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<OffloadPod>> {
        let hash = self.shared.hash(namespace, name);
        self.shared.read().find(hash, same(namespace, name)).cloned()
    }

    /// Every offload pod, in no particular order.
    pub fn state(&self) -> Vec<Arc<OffloadPod>> {
        self.shared.read().iter().cloned().collect()
    }

    /// How many offload pods the cache holds.
    pub fn len(&self) -> usize {
        self.shared.read().len()
    }

    /// The cache holds no pod.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits up to `limit` for the first list to be in; whether it is.
    pub async fn listed(&self, limit: Duration) -> bool {
        let mut ready = self.ready.clone();
        matches!(tokio::time::timeout(limit, ready.wait_for(|r| *r)).await, Ok(Ok(_)))
    }
}

impl std::fmt::Debug for OffloadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadCache").field("pods", &self.len()).field("ready", &*self.ready.borrow()).finish()
    }
}

impl std::fmt::Debug for OffloadCacheWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadCacheWriter").field("relisting", &self.relist.is_some()).finish_non_exhaustive()
    }
}

impl OffloadCacheWriter {
    /// Applies one watch event, as the reflector's writer does; the cache shares the event's
    /// entry.
    pub fn apply(&mut self, event: &watcher::Event<Arc<OffloadPod>>) {
        let shared = &*self.shared;
        match event {
            watcher::Event::Apply(pod) => upsert(&mut shared.write(), shared, pod.clone()),
            watcher::Event::Delete(pod) => {
                if let Ok(entry) = shared.write().find_entry(shared.hash_of(pod), same(pod.namespace(), pod.name())) {
                    entry.remove();
                }
            }
            watcher::Event::Init => self.relist = Some(Table::new()),
            watcher::Event::InitApply(pod) => {
                let relist = self.relist.get_or_insert_with(Table::new);
                upsert(relist, shared, pod.clone());
            }
            watcher::Event::InitDone => {
                let relisted = self.relist.take().unwrap_or_default();
                // The old table is dropped once the lock is released.
                let old = std::mem::replace(&mut *shared.write(), relisted);
                drop(old);
                self.ready.send_replace(true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;
    use watcher::Event;

    /// An offload pod; `origin` tells one version of it from another.
    fn pod(namespace: &str, name: &str, origin: &str) -> Arc<OffloadPod> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "uid": format!("u-{name}"),
                         "labels": {tidepool_api::keys::LABEL_ORIGIN_UID: origin}}
        }))
        .unwrap();
        Arc::new(OffloadPod::from(pod))
    }

    fn names(cache: &OffloadCache) -> Vec<String> {
        let mut v: Vec<String> = cache.state().iter().map(|p| format!("{}/{}", p.namespace(), p.name())).collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn applies_watch_events_as_the_reflector_does() {
        let (cache, mut writer) = cache();
        assert!(!cache.listed(Duration::from_millis(10)).await, "not ready before the first list");
        writer.apply(&Event::Init);
        writer.apply(&Event::InitApply(pod("a", "p1", "1")));
        writer.apply(&Event::InitApply(pod("b", "p1", "1")));
        assert!(cache.is_empty(), "a list in progress is not seen");
        writer.apply(&Event::InitDone);
        assert!(cache.listed(Duration::from_millis(10)).await);
        assert_eq!(names(&cache), ["a/p1", "b/p1"]);

        writer.apply(&Event::Apply(pod("a", "p1", "2")));
        assert_eq!(cache.len(), 2, "an update replaces its entry");
        assert_eq!(cache.get("a", "p1").unwrap().origin_uid(), Some("2"));
        assert!(cache.get("a", "p2").is_none());
        writer.apply(&Event::Apply(pod("a", "p2", "3")));
        writer.apply(&Event::Delete(pod("b", "p1", "4")));
        assert_eq!(names(&cache), ["a/p1", "a/p2"]);
        writer.apply(&Event::Delete(pod("b", "nope", "5")));
        assert_eq!(cache.len(), 2, "deleting what is not there changes nothing");

        // A re-list replaces everything at its end: what it did not bring is gone.
        writer.apply(&Event::Init);
        writer.apply(&Event::InitApply(pod("c", "p9", "6")));
        assert_eq!(names(&cache), ["a/p1", "a/p2"], "the old state is read until the re-list is done");
        writer.apply(&Event::InitDone);
        assert_eq!(names(&cache), ["c/p9"]);
    }

    #[test]
    fn many_pods_each_found_by_namespace_and_name() {
        let (cache, mut writer) = cache();
        for i in 0..2_000 {
            writer.apply(&Event::Apply(pod(&format!("ns-{}", i % 7), &format!("p-{i}"), "1")));
        }
        assert_eq!(cache.len(), 2_000);
        for i in (0..2_000).step_by(13) {
            let p = cache.get(&format!("ns-{}", i % 7), &format!("p-{i}")).unwrap();
            assert_eq!(p.name(), format!("p-{i}"));
            assert!(cache.get(&format!("ns-{}", (i + 1) % 7), &format!("p-{i}")).is_none());
        }
        for i in 0..1_000 {
            writer.apply(&Event::Delete(pod(&format!("ns-{}", i % 7), &format!("p-{i}"), "2")));
        }
        assert_eq!(cache.len(), 1_000);
        assert!(cache.get("ns-0", "p-0").is_none());
        assert!(cache.get(&format!("ns-{}", 1_500 % 7), "p-1500").is_some());
    }
}
