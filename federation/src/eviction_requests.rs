//! A member's `EvictionRequest`s (`lifecycle.k8s.io/v1alpha1`, Kubernetes 1.37 behind the
//! `EvictionRequestAPI` gate): the graceful evictions the member's own actors (a drain tool, a
//! descheduler, an autoscaler) ask for. Tidepool answers those that target its offload copies
//! (the dispatcher's reclaim, [`EvictionAsks`] is what it reads).
//!
//! Kept trimmed like the capacity watches: one [`EvictionAsk`] per request, its target's UID
//! the key the dispatcher looks copies up by. Watched only where the member serves the API.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::lifecycle::v1alpha1::EvictionRequest;
use kube::{Client, ResourceExt};
use tidepool_api::sync::Locked;

use crate::member_tasks::MemberTasks;
use crate::view_cache::{ViewCache, Wakeups, spawn_cache, watch_all};

/// API group/version and resource of eviction requests.
pub const API: (&str, &str) = ("lifecycle.k8s.io/v1alpha1", "evictionrequests");

/// One eviction request of a member, as tidepool answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionAsk {
    pub namespace: String,
    pub name: String,
    /// `spec.requester`: who asks (`acme.io/drain`).
    pub requester: String,
    /// `spec.target.pod`: the pod to evict, by name and UID.
    pub target_name: String,
    pub target_uid: String,
    /// `spec.intent` is `Eviction` (not `Withdrawn`).
    pub wanted: bool,
    /// The condition types already `True` in its status (`TargetEvicted`, tidepool's own).
    pub true_conditions: Vec<String>,
}

impl EvictionAsk {
    /// The view of `er`; `None` for a request without a pod target (another kind of target,
    /// which tidepool never answers).
    pub fn of(er: &EvictionRequest) -> Option<EvictionAsk> {
        let pod = er.spec.target.pod.as_ref()?;
        let true_conditions = er
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .map(|cs| cs.iter().filter(|c| c.status == "True").map(|c| c.type_.clone()).collect())
            .unwrap_or_default();
        Some(EvictionAsk {
            namespace: er.namespace().unwrap_or_default(),
            name: er.name_any(),
            requester: er.spec.requester.clone(),
            target_name: pod.name.clone(),
            target_uid: pod.uid.clone(),
            wanted: er.spec.intent == "Eviction",
            true_conditions,
        })
    }

    /// `namespace/name`, as messages name it.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether the status already has condition `type_` at `True`.
    pub fn shows(&self, type_: &str) -> bool {
        self.true_conditions.iter().any(|t| t == type_)
    }
}

type Cache = ViewCache<(String, String), EvictionAsk>;

/// The eviction requests of one member, kept current by a watch of the member session.
#[derive(Debug, Clone)]
pub struct EvictionAsks {
    cache: Arc<Mutex<Cache>>,
}

impl EvictionAsks {
    /// Starts the watch of every eviction request in the member until `cancelled`.
    pub(crate) fn watch(client: &Client, tasks: &MemberTasks) -> Self {
        let cache: Arc<Mutex<Cache>> = Arc::default();
        let view = |er: &EvictionRequest| EvictionAsk::of(er).map(|a| ((a.namespace.clone(), a.name.clone()), a));
        // Its own wake-ups: a request changes no capacity; the reclaim reads them each pass.
        let wake = Wakeups::default();
        let events = watch_all::<EvictionRequest>(client);
        spawn_cache(events, &cache, (view, |_| false), &wake, tasks, "eviction request watch");
        Self { cache }
    }

    /// The requests by their target's UID, or `None` until the first list is complete (an
    /// incomplete list would read as every request withdrawn).
    pub fn by_target(&self) -> Option<HashMap<String, Vec<EvictionAsk>>> {
        let cache = self.cache.locked("member eviction requests").ok()?;
        if !cache.synced {
            return None;
        }
        let mut by_target: HashMap<String, Vec<EvictionAsk>> = HashMap::new();
        for ask in cache.values() {
            by_target.entry(ask.target_uid.clone()).or_default().push(ask.clone());
        }
        Some(by_target)
    }

    /// The requests naming the pod of UID `uid`, or `None` until the first list is complete.
    pub fn for_target(&self, uid: &str) -> Option<Vec<EvictionAsk>> {
        let cache = self.cache.locked("member eviction requests").ok()?;
        cache.synced.then(|| cache.values().filter(|a| a.target_uid == uid).cloned().collect())
    }
}

/// Whether the server serves eviction requests (1.37 with the gate and the API group on).
pub async fn served(client: &Client) -> Result<bool, kube::Error> {
    crate::discovery::serves(client, API.0, API.1).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(intent: &str, conditions: serde_json::Value) -> EvictionRequest {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "lifecycle.k8s.io/v1alpha1", "kind": "EvictionRequest",
            "metadata": { "name": "drain-a", "namespace": "tp-team", "generation": 2 },
            "spec": { "target": { "pod": { "name": "copy", "uid": "c-1" } }, "requester": "acme.io/drain", "intent": intent },
            "status": { "conditions": conditions },
        }))
        .unwrap()
    }

    #[test]
    fn a_request_is_seen_by_its_target_intent_and_shown_conditions() {
        let cond = |t: &str, s: &str| serde_json::json!({ "type": t, "status": s, "reason": "R", "message": "", "lastTransitionTime": "2026-12-05T08:00:00Z" });
        let ask = EvictionAsk::of(&request(
            "Eviction",
            serde_json::json!([cond("TargetEvicted", "False"), cond("tidepool.io/CheckpointNotice", "True")]),
        ))
        .unwrap();
        assert_eq!((ask.target_uid.as_str(), ask.target_name.as_str(), ask.wanted), ("c-1", "copy", true));
        assert_eq!((ask.key(), ask.requester.as_str()), ("tp-team/drain-a".to_owned(), "acme.io/drain"));
        assert!(ask.shows("tidepool.io/CheckpointNotice"));
        assert!(!ask.shows("TargetEvicted"));
        assert!(!EvictionAsk::of(&request("Withdrawn", serde_json::json!([]))).unwrap().wanted);
    }
}
