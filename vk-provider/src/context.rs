//! What the pod sync's parts share: the [`Context`] (clients, caches, write slots) and one
//! [`OffloadWatch`] per member session. In a module of its own so the pod sync and its
//! helpers (the collector, the Service mirror, the member Event relay) each depend on it
//! rather than on one another.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tidepool_api::pod::PodLite;
use tidepool_api::sync::{Locked, Poisoned};
use tidepool_api::{BridgeConfig, MemberName};
use tidepool_federation::{MemberHandle, Members, PoolHandle, TrainingPods};
use tokio::sync::{Semaphore, mpsc, watch};
use tracing::{debug, info};

use crate::Error;
use crate::copies::{self, MemberCopies, MetaStores};
use crate::handover::Handovers;
use crate::member_pods::{self, SentDeletions};
use crate::offload::OffloadPod;
use crate::offload_cache::OffloadCache;
use crate::referenced::{References, Source};

/// Work for a member's collector ([`crate::collect`]) besides its periodic pass.
#[derive(Debug)]
pub(crate) enum CollectRequest {
    /// Collect the copies of one member namespace: an offload pod there went away.
    Copies(String),
    /// The training pod with `uid` was deleted outright: delete the offload pod `name` in the
    /// member namespace `namespace` (its copy's place) if it holds that pod's copy.
    Gone { namespace: String, name: String, uid: String },
}

/// Pod writes in flight at once, per member and towards the training cluster. The API
/// clients speak HTTP/1.1, one connection per request in flight: unbounded, a burst of a
/// thousand pods opened a thousand TLS connections (each handshake costing the API server
/// CPU, each connection's buffers costing tidepool memory). Per member, so a member that
/// hangs holds up only its own pods. In a burst a member's creates answer in 0.2-0.3 s, so
/// the slots set how soon the copies exist: 32 left a 500-pod burst's copies waiting 1.6-2.0 s
/// (p50) for one, 64 halves that (BENCHMARKS.md, "Side by side with the peer", session 20).
pub(crate) const WRITES_IN_FLIGHT: usize = 64;
/// Events published at once: they are notes for people, behind the pods' own writes.
const EVENTS_IN_FLIGHT: usize = 8;
/// `reportingController` of the pod sync's Events.
pub(crate) const EVENT_REPORTER: &str = "tidepool";
/// The waiting pods' lock, in errors.
const WAITING: &str = "pods waiting for references";

pub(crate) struct Context {
    pub(crate) training: Client,
    pub(crate) config: Arc<BridgeConfig>,
    pub(crate) members: watch::Receiver<Members>,
    pub(crate) offload: Mutex<HashMap<MemberName, OffloadWatch>>,
    pub(crate) namespaces: Mutex<HashSet<(MemberName, String)>>,
    /// `reportingInstance` of the Events published (see [`crate::pods`]' Events).
    pub(crate) event_instance: String,
    /// The training pods (the cache shared with the dispatcher).
    pub(crate) pods: Store<PodLite>,
    /// The same, for whole pods when one is to be offloaded.
    pub(crate) training_pods: TrainingPods,
    /// Pods whose copy was freed for a reclaim, their status on the way.
    pub(crate) handovers: Handovers,
    /// What the pods on their way to a member reference (training namespace, sources),
    /// until their offload copy shows it: a source's change triggers them, and the
    /// collector keeps the copies made for them.
    pub(crate) waiting: Mutex<HashMap<ObjectRef<PodLite>, Waiting>>,
    /// Metadata of every training ConfigMap and Secret: when a copy is stale.
    pub(crate) sources: MetaStores,
    /// Bounds the training pod writes in flight (see [`WRITES_IN_FLIGHT`]).
    pub(crate) training_writes: Semaphore,
    /// Bounds the Events being published, apart: a burst's Events never delay its status.
    pub(crate) event_writes: Semaphore,
    /// The status sync's queue: copies' changes are sent there as well as to the down-sync.
    pub(crate) status_triggers: mpsc::Sender<ObjectRef<PodLite>>,
}

/// What a pod on its way to a member references: its training namespace and the sources.
pub(crate) type Waiting = (String, Vec<Source>);

/// One member session, as the pod controller sees it.
#[derive(Clone)]
pub(crate) struct OffloadWatch {
    pub(crate) member: Arc<MemberHandle>,
    /// This instance's offload pods in the member.
    pub(crate) store: OffloadCache,
    /// Metadata of this instance's reflected copies in the member.
    pub(crate) copies: MemberCopies,
    /// Asks the collector for work now.
    pub(crate) collect: mpsc::Sender<CollectRequest>,
    /// Bounds the writes to this member in flight (see [`WRITES_IN_FLIGHT`]).
    pub(crate) writes: Arc<Semaphore>,
    /// Deletions of offload pods sent and perhaps not yet seen by `store`.
    pub(crate) deletions: Arc<SentDeletions>,
}

impl Context {
    pub(crate) fn new(
        training: Client,
        config: Arc<BridgeConfig>,
        members: watch::Receiver<Members>,
        training_pods: TrainingPods,
        sources: MetaStores,
        status_triggers: mpsc::Sender<ObjectRef<PodLite>>,
    ) -> Context {
        Context {
            training,
            config,
            members,
            offload: Mutex::new(HashMap::new()),
            namespaces: Mutex::new(HashSet::new()),
            event_instance: std::env::var("POD_NAME").unwrap_or_else(|_| EVENT_REPORTER.to_owned()),
            pods: training_pods.store(),
            training_pods,
            handovers: Handovers::default(),
            waiting: Mutex::new(HashMap::new()),
            sources,
            training_writes: Semaphore::new(WRITES_IN_FLIGHT),
            event_writes: Semaphore::new(EVENTS_IN_FLIGHT),
            status_triggers,
        }
    }

    /// Syncs copies from training namespace `origin` into `member_ns` of `watch`'s member.
    pub(crate) fn reflection<'a>(
        &'a self,
        watch: &'a OffloadWatch,
        origin: &'a str,
        member_ns: &'a str,
    ) -> copies::Reflection<'a> {
        copies::Reflection {
            training: &self.training,
            sources: &self.sources,
            member: &watch.member,
            copies: &watch.copies,
            cluster: &self.config.cluster_name,
            origin_namespace: origin,
            member_namespace: member_ns,
            reads_secrets: self.config.reads_secrets_in(origin),
        }
    }

    /// The member session and pool behind a virtual node, with that session's offload cache.
    pub(crate) fn route(&self, node: &str) -> Result<Option<(OffloadWatch, PoolHandle)>, Poisoned> {
        let watches = self.offload.locked("offload watches")?;
        Ok(watches.values().find_map(|w| w.member.pool_for_node(node).map(|p| (w.clone(), p.clone()))))
    }

    /// Training pods in `namespace` (or any) whose offload copy in `member` (or any member)
    /// references `source` (without one: anything at all), and pods held back waiting for
    /// one of those.
    pub(crate) fn referencing(
        &self,
        namespace: Option<&str>,
        source: Option<&Source>,
        member: Option<&MemberHandle>,
    ) -> Vec<ObjectRef<PodLite>> {
        let watches: Vec<OffloadWatch> = self
            .offload
            .locked_or_log("offload watches")
            .map(|w| w.values().filter(|w| member.is_none_or(|m| w.member.name == m.name)).cloned().collect())
            .unwrap_or_default();
        let mut found: HashSet<ObjectRef<PodLite>> = HashSet::new();
        for watch in watches {
            let member_ns = namespace.map(|ns| watch.member.namespaces.member_ns(ns));
            for copy in watch.store.state() {
                if member_ns.as_deref().is_some_and(|ns| copy.namespace() != ns) {
                    continue;
                }
                let uses = match source {
                    Some(s) => copy.references.contains_key(s),
                    None => !copy.references.is_empty(),
                };
                if let Some(origin) = copy.origin().filter(|_| uses) {
                    found.insert(origin);
                }
            }
        }
        if member.is_none()
            && let Some(waiting) = self.waiting.locked_or_log("pods waiting for references")
        {
            let held = waiting.iter().filter(|(pod, (ns, sources))| {
                namespace.is_none_or(|n| n == ns)
                    && source.is_none_or(|s| sources.contains(s))
                    && pod.namespace.is_some()
            });
            found.extend(held.map(|(pod, _)| pod.clone()));
        }
        found.into_iter().collect()
    }

    /// Every pod whose copy references anything, and every pod held back: after a relist,
    /// when single changes may have been missed.
    pub(crate) fn referencing_any(&self) -> Vec<ObjectRef<PodLite>> {
        self.referencing(None, None, None)
    }

    /// Remembers what `pod`, on its way to a member, references.
    pub(crate) fn wait_for(&self, pod: &PodLite, references: &References) -> Result<(), Poisoned> {
        if let Some(ns) = pod.metadata.namespace.clone() {
            let mut waiting = self.waiting.locked(WAITING)?;
            waiting.insert(ObjectRef::from_obj(pod), (ns, references.keys().cloned().collect()));
        }
        Ok(())
    }

    pub(crate) fn stop_waiting(&self, pod: &ObjectRef<PodLite>) -> Result<(), Poisoned> {
        self.waiting.locked(WAITING)?.remove(pod);
        Ok(())
    }

    /// The whole training pod `pod` is the cache's view of: kept by the shared watch until
    /// the pod runs, else read from the API. `None` if it is gone (or is another pod of
    /// the same name now).
    /// How much longer the dispatcher owns the ending of `pod`, whose copy it deleted
    /// itself (see [`handover`]).
    pub(crate) fn handed_over(&self, pod: &PodLite) -> Result<Option<Duration>, Poisoned> {
        self.handovers.held(pod)
    }

    pub(crate) async fn whole(&self, pod: &PodLite) -> Result<Option<Arc<Pod>>, Error> {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if let Some(whole) = self.training_pods.whole(uid) {
            return Ok(Some(Arc::new(whole)));
        }
        let api = Api::<Pod>::namespaced(self.training.clone(), &pod.namespace().unwrap_or_default());
        let found = api.get_opt(&pod.name_any()).await.map_err(|e| Error::training("read pod", e))?;
        Ok(found.filter(|p| p.metadata.uid.as_deref() == Some(uid)).map(Arc::new))
    }
}

/// Deletes the offload pod `copy` (of this UID only) with `grace` seconds, unless its
/// deletion was sent already (see [`SentDeletions`], [`member_pods::delete_copy`]).
pub(crate) async fn delete_offload(watch: &OffloadWatch, copy: &OffloadPod, grace: Option<u32>) -> Result<(), Error> {
    let member = &watch.member;
    match member_pods::delete_copy(&member.client, &watch.deletions, copy, grace, Instant::now()).await {
        Ok(true) => {
            info!(member = %member.name, ?grace, "offload pod deletion requested");
            Ok(())
        }
        Ok(false) => {
            debug!(member = %member.name, "offload pod deletion already sent; waiting for the member's watch");
            Ok(())
        }
        Err(member_pods::DeleteFailed::Member(e)) => Err(Error::member(&member.name, "delete offload pod", e)),
        Err(member_pods::DeleteFailed::Poisoned(p)) => Err(p.into()),
    }
}
