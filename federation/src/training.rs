//! The training cluster's pods, watched once for every controller.
//!
//! The dispatcher and the pod sync both decide on every training pod. One watch feeds one
//! cache of [`PodLite`]s (see `tidepool_api::pod` for why not whole pods) and tells each
//! controller what changed. The whole pod is kept only while the pod sync may still need
//! it to create an offload copy: from its binding to a node until it runs somewhere.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tidepool_api::pod::{PodLite, trim_meta};
use tidepool_api::sync::Locked;
use tokio::sync::broadcast;
use tracing::warn;

/// Events buffered per subscriber. A subscriber that falls further behind is told so
/// ([`PodEvent::Lagged`]) and resyncs from the cache.
const EVENT_BUFFER: usize = 8192;
/// Whole pods kept at most, waiting to be offloaded (a burst's worth: a member takes
/// tens of creates a second). Past this, the pod sync reads the pod from the API instead,
/// one GET when its turn comes, rather than holding thousands in memory meanwhile.
const AWAITING_MAX: usize = 1024;
/// The awaiting map's lock, in errors. It only remembers: poisoned, the pods are read from
/// the API instead.
const AWAITING: &str = "pods awaiting offload";

/// A change of one training pod, as the cache has it after the change.
#[derive(Clone, Debug)]
pub enum PodEvent {
    Applied(Arc<PodLite>),
    Deleted(Arc<PodLite>),
    /// The watch listed everything again: changes may have been missed.
    Relisted,
    /// This subscriber missed events: changes may have been missed.
    Lagged,
}

/// The shared cache of training pods. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TrainingPods {
    store: Store<PodLite>,
    events: broadcast::Sender<PodEvent>,
    /// Whole pods by UID, as JSON: a decoded `Pod` costs several times its JSON.
    awaiting: Arc<Mutex<HashMap<String, Box<str>>>>,
}

impl TrainingPods {
    /// Starts the watch, as task `training-pods` of `tasks`.
    pub fn start(tasks: &mut crate::tasks::Tasks, client: Client) -> TrainingPods {
        let (store, mut writer) = reflector::store::<PodLite>();
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let pods = TrainingPods { store, events, awaiting: Arc::default() };
        let shared = pods.clone();
        let stream = watcher(Api::<Pod>::all(client), watcher::Config::default()).default_backoff();
        tasks.spawn("training-pods", async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                let event = match event {
                    Ok(e) => e,
                    Err(e) => {
                        warn!(error = %e, "training pod watch failed; retrying with backoff");
                        continue;
                    }
                };
                let lite = shared.absorb(event);
                writer.apply_watcher_event(&lite);
                let note = match lite {
                    // The cache's own copy: the buffer of recent events holds no second one.
                    watcher::Event::Apply(p) => {
                        PodEvent::Applied(shared.store.get(&ObjectRef::from_obj(&p)).unwrap_or_else(|| Arc::new(p)))
                    }
                    watcher::Event::Delete(p) => PodEvent::Deleted(Arc::new(p)),
                    watcher::Event::InitDone => PodEvent::Relisted,
                    watcher::Event::Init | watcher::Event::InitApply(_) => continue,
                };
                // No subscriber yet is fine: they start from the cache.
                let _ = shared.events.send(note);
            }
        });
        pods
    }

    /// The cache.
    pub fn store(&self) -> Store<PodLite> {
        self.store.clone()
    }

    /// Waits for the watch's first full list, without a limit (see [`listed`] for why in
    /// short waits).
    pub async fn listed(&self) {
        while tokio::time::timeout(Duration::from_millis(100), self.store.wait_until_ready()).await.is_err() {}
    }

    /// Changes from now on. Dropping the stream unsubscribes.
    pub fn subscribe(&self) -> impl futures::Stream<Item = PodEvent> + Send + 'static {
        let rx = self.events.subscribe();
        futures::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(e) => Some((e, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => Some((PodEvent::Lagged, rx)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        })
    }

    /// The whole pod, if the watch still holds it (bound to a node, never ran anywhere).
    pub fn whole(&self, uid: &str) -> Option<Pod> {
        let json = self.awaiting.locked_or_log(AWAITING)?.get(uid)?.clone();
        serde_json::from_str(&json).ok()
    }

    /// Keeps or forgets the whole pod of `event` (see [`TrainingPods::whole`]) and reduces
    /// it to what the cache holds.
    fn absorb(&self, event: watcher::Event<Pod>) -> watcher::Event<PodLite> {
        match event {
            watcher::Event::Apply(p) => watcher::Event::Apply(self.keep(p)),
            watcher::Event::InitApply(p) => watcher::Event::InitApply(self.keep(p)),
            watcher::Event::Delete(p) => {
                if let (Some(uid), Some(mut awaiting)) =
                    (p.metadata.uid.as_ref(), self.awaiting.locked_or_log(AWAITING))
                {
                    awaiting.remove(uid);
                }
                watcher::Event::Delete(p.into())
            }
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitDone => watcher::Event::InitDone,
        }
    }

    fn keep(&self, mut pod: Pod) -> PodLite {
        let ended = pod.status.as_ref().is_some_and(|s| matches!(s.phase.as_deref(), Some("Succeeded" | "Failed")));
        let awaiting_offload = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some())
            && pod.status.as_ref().is_none_or(|s| s.host_ip.is_none())
            && pod.metadata.deletion_timestamp.is_none()
            && !ended;
        if let (Some(mut awaiting), Some(uid)) = (self.awaiting.locked_or_log(AWAITING), pod.metadata.uid.clone()) {
            if awaiting_offload && (awaiting.len() < AWAITING_MAX || awaiting.contains_key(&uid)) {
                trim_meta(&mut pod.metadata);
                if let Ok(json) = serde_json::to_string(&pod) {
                    awaiting.insert(uid, json.into_boxed_str());
                }
            } else {
                awaiting.remove(&uid);
            }
        }
        pod.into()
    }
}

/// Waits up to `limit` for `store`'s first full list; false if it does not come (or its
/// watch is gone). `Store::wait_until_ready` wakes only the last of several tasks waiting at
/// once (kube-runtime 5 keeps a single waker), so each wait is short and repeated rather
/// than trusted to be woken.
pub async fn listed<K>(store: &Store<K>, limit: Duration) -> bool
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout(Duration::from_millis(100), store.wait_until_ready()).await {
            Ok(ready) => return ready.is_ok(),
            Err(_) if tokio::time::Instant::now() >= deadline => return false,
            Err(_) => {}
        }
    }
}
