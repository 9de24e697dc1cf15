//! The pod controller: training pods bound to a virtual node ⇄ offload pods in its member.
//!
//! Reconciles are triggered by training pod changes, by offload pod changes (each member's
//! offload watch maps a member pod back to its training pod by the origin annotations), and
//! by changes of the ConfigMaps and Secrets a pod references (see [`crate::copies`]). They
//! read the member's state from those watches' caches: steady state costs the member no reads.
//!
//! Before an offload pod is created, the pod must pass the offload policy
//! ([`crate::policy`]) and everything it references must be copied into the member
//! ([`crate::reflect`]). Each member session also runs a collector ([`crate::collect`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodStatus};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tidepool_config::metrics::metrics;
use tidepool_config::pod::{PodLite, SyncedStatus};
use tidepool_config::{BridgeConfig, MemberName, keys};
use tidepool_federation::training::listed;
use tidepool_federation::writes::CopyWrites;
use tidepool_federation::{MemberHandle, Members, PodEvent, PoolHandle, TrainingPods};
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, WatchStream};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, instrument, warn};

use crate::copies::{self, Change, MemberCopies, MetaStores, Outcome};
use crate::handover::{self, Handovers};
use crate::offload::OffloadPod;
use crate::reflect::{self, References, Source};
use crate::translate::{self, Target};
use crate::{Error, collect, policy};

/// When a pod whose member does not answer is looked at again (the member answering again
/// triggers every pod sooner).
const RESYNC: Duration = Duration::from_secs(300);
/// Retry of a pod waiting for a ConfigMap or Secret it needs; their creation triggers it
/// sooner.
const MISSING_RETRY: Duration = Duration::from_secs(30);
/// How long other new conditions of a still-Pending offload pod wait before they are
/// copied up: usually the pod runs within it, and one status write says both. See
/// [`translate::status_settles_in`].
const PENDING_SETTLE: Duration = Duration::from_secs(1);
/// Pod writes in flight at once, per member and towards the training cluster. The API
/// clients speak HTTP/1.1, one connection per request in flight: unbounded, a burst of a
/// thousand pods opened a thousand TLS connections (each handshake costing the API server
/// CPU, each connection's buffers costing tidepool memory). Per member, so a member that
/// hangs holds up only its own pods.
const WRITES_IN_FLIGHT: usize = 32;
/// Pods reconciled at once. Each reconcile in flight is a future of a few KB: unbounded, a
/// burst of thousands of pods held thousands of them (and, before a reconcile decoded the
/// whole pod only once it could write, 18 KB more each) while they waited for the 32 write
/// slots of their member. The rest wait in the controller's queue, as a reference each.
/// Generous, because a reconcile waiting for its member's write slot holds its place: with
/// 256, the status syncs of copies already running queued behind a burst's creations and
/// the burst benchmark's throughput fell from 0.90 to 0.59 of the direct path.
const RECONCILES_IN_FLIGHT: u16 = 1024;
/// `reportingController` of the pod sync's Events.
const EVENT_REPORTER: &str = "tidepool";
/// Events published at once: they are notes for people, behind the pods' own writes.
const EVENTS_IN_FLIGHT: usize = 8;

pub(crate) struct Context {
    pub(crate) training: Client,
    pub(crate) config: Arc<BridgeConfig>,
    members: watch::Receiver<Members>,
    offload: Mutex<HashMap<MemberName, OffloadWatch>>,
    namespaces: Mutex<HashSet<(MemberName, String)>>,
    /// `reportingInstance` of the Events published (see [`publish`]).
    event_instance: String,
    /// The training pods (the cache shared with the dispatcher).
    pub(crate) pods: Store<PodLite>,
    /// The same, for whole pods when one is to be offloaded.
    training_pods: TrainingPods,
    /// Pods whose copy was freed for a reclaim, their status on the way.
    handovers: Handovers,
    /// What the pods on their way to a member reference (training namespace, sources),
    /// until their offload copy shows it: a source's change triggers them, and the
    /// collector keeps the copies made for them.
    pub(crate) waiting: Mutex<HashMap<ObjectRef<PodLite>, Waiting>>,
    /// Metadata of every training ConfigMap and Secret: when a copy is stale.
    sources: MetaStores,
    /// Bounds the training pod writes in flight (see [`WRITES_IN_FLIGHT`]).
    training_writes: Semaphore,
    /// Bounds the Events being published, apart: a burst's Events never delay its status.
    event_writes: Semaphore,
}

/// What a pod on its way to a member references: its training namespace and the sources.
pub(crate) type Waiting = (String, Vec<Source>);

/// One member session, as the pod controller sees it.
#[derive(Clone)]
pub(crate) struct OffloadWatch {
    pub(crate) member: Arc<MemberHandle>,
    /// This instance's offload pods in the member.
    pub(crate) store: Store<OffloadPod>,
    /// Metadata of this instance's reflected copies in the member.
    pub(crate) copies: MemberCopies,
    /// Asks the collector for work now.
    collect: mpsc::Sender<collect::Request>,
    /// Bounds the writes to this member in flight (see [`WRITES_IN_FLIGHT`]).
    pub(crate) writes: Arc<Semaphore>,
}

pub async fn run(
    training: Client,
    config: Arc<BridgeConfig>,
    members: watch::Receiver<Members>,
    training_pods: TrainingPods,
    copy_writes: CopyWrites,
) {
    let (trigger_tx, trigger_rx) = mpsc::channel::<ObjectRef<PodLite>>(1024);
    let (source_tx, source_rx) = mpsc::channel::<Change>(1024);
    let (gone_tx, gone_rx) = mpsc::channel::<Arc<PodLite>>(1024);
    let (applied_tx, applied_rx) = mpsc::channel::<Arc<PodLite>>(1024);
    let (resync_tx, resync_rx) = mpsc::channel::<()>(1);
    // The shared watch, split: changes drive the controller; deletions go to the
    // collector at once (a pod deleted outright, with grace period 0, forced, or by the pod
    // garbage collector, never shows a deletion timestamp, and its offload copy must go
    // now rather than at the collector's next pass); missed changes resync every pod.
    let events = training_pods.subscribe();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let sent = match event {
                PodEvent::Applied(pod) => applied_tx.send(pod).await.is_ok(),
                PodEvent::Deleted(pod) => gone_tx.try_send(pod).is_ok() || !gone_tx.is_closed(),
                PodEvent::Relisted | PodEvent::Lagged => resync_tx.try_send(()).is_ok() || !resync_tx.is_closed(),
            };
            if !sent {
                return;
            }
        }
    });
    let store = training_pods.store();
    let controller = Controller::for_shared_stream(ReceiverStream::new(applied_rx), store.clone())
        .with_config(controller::Config::default().concurrency(RECONCILES_IN_FLIGHT));
    let ctx = Arc::new(Context {
        training: training.clone(),
        config,
        members: members.clone(),
        offload: Mutex::new(HashMap::new()),
        namespaces: Mutex::new(HashSet::new()),
        event_instance: std::env::var("POD_NAME").unwrap_or_else(|_| EVENT_REPORTER.to_owned()),
        pods: store,
        training_pods,
        handovers: Handovers::default(),
        waiting: Mutex::new(HashMap::new()),
        // The training side's watches live as long as the process.
        sources: MetaStores::sources(&training, CancellationToken::new(), source_tx),
        training_writes: Semaphore::new(WRITES_IN_FLIGHT),
        event_writes: Semaphore::new(EVENTS_IN_FLIGHT),
    });
    tokio::spawn(handover::run(copy_writes, ctx.handovers.clone()));
    tokio::spawn(supervise_offload_watches(ctx.clone(), trigger_tx.clone()));
    tokio::spawn(forward_deletions(ctx.clone(), gone_rx));
    tokio::spawn(report_queue_depth(trigger_tx.clone()));
    tokio::spawn(
        follow_source_changes(ctx.clone(), source_rx, None, trigger_tx).instrument(info_span!("training_sources")),
    );
    // A member (re)connecting re-checks every pod: its pods may have waited for it.
    let member_changes = WatchStream::new(members).map(|_| ());
    let resync = ReceiverStream::new(resync_rx);
    controller
        .reconcile_on(ReceiverStream::new(trigger_rx))
        .reconcile_all_on(futures::stream::select(member_changes, resync))
        .run(timed_reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

/// Pod sync work queued by watches of members and sources, as a gauge, once a second.
async fn report_queue_depth(trigger: mpsc::Sender<ObjectRef<PodLite>>) {
    while !trigger.is_closed() {
        metrics().set_queue_depth("pod_triggers", trigger.max_capacity() - trigger.capacity());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn timed_reconcile(pod: Arc<PodLite>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let result = reconcile(pod, ctx).await;
    metrics().observe_sync("pod", started.elapsed());
    result
}

/// When a pod whose sync was refused (a 403 from the member, say) is tried again: the
/// refusal lasts until someone changes RBAC or credentials, and the Event says so.
const REFUSED_RETRY: Duration = Duration::from_secs(300);

fn error_policy(pod: Arc<PodLite>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(pod = %pod.name_any(), namespace = pod.namespace().unwrap_or_default(), %error, "pod sync failed; retrying");
    if error.is_transient() {
        return Action::requeue(Duration::from_secs(2));
    }
    if let Some(reason) = error.event_reason() {
        // Told to people, off the controller's thread (this function cannot wait).
        let note = format!("{error}; tried again in {} s", REFUSED_RETRY.as_secs());
        tokio::spawn(async move { publish(&ctx, &pod, EventType::Warning, reason, &note).await }.in_current_span());
        return Action::requeue(REFUSED_RETRY);
    }
    Action::requeue(Duration::from_secs(30))
}

/// Starts an offload watch for every member session and drops those of ended sessions.
async fn supervise_offload_watches(ctx: Arc<Context>, trigger: mpsc::Sender<ObjectRef<PodLite>>) {
    let mut members = ctx.members.clone();
    loop {
        let current = members.borrow_and_update().clone();
        if let Ok(mut watches) = ctx.offload.lock() {
            watches.retain(|name, w| current.get(name).is_some_and(|m| Arc::ptr_eq(m, &w.member)));
            for (name, member) in &current {
                if !watches.contains_key(name) {
                    watches.insert(name.clone(), start_offload_watch(&ctx, member.clone(), trigger.clone()));
                }
            }
        }
        if members.changed().await.is_err() {
            return;
        }
    }
}

/// Starts the watches of one member session (offload pods, reflected copies) and its
/// collector; all end with the session.
fn start_offload_watch(
    ctx: &Arc<Context>,
    member: Arc<MemberHandle>,
    trigger: mpsc::Sender<ObjectRef<PodLite>>,
) -> OffloadWatch {
    let span = info_span!("offload_watch", member = %member.name);
    let _entered = span.enter();
    let (store, writer) = reflector::store();
    let selector = format!(
        "{}={},{}={}",
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name,
        keys::LABEL_ORIGIN_MEMBER,
        member.name
    );
    let events = watcher(Api::<Pod>::all(member.client.clone()), watcher::Config::default().labels(&selector))
        .default_backoff()
        .map(|event| event.map(|e| translate::map_event(e, OffloadPod::from)))
        .reflect(writer)
        .touched_objects()
        .take_until(member.cancelled.clone().cancelled_owned());
    let (collect_tx, collect_rx) = mpsc::channel::<collect::Request>(256);
    let copy_selector = reflect::copy_selector(&ctx.config.cluster_name, member.name.as_str());
    let (copy_tx, copy_rx) = mpsc::channel::<Change>(256);
    let namespace_selector = format!(
        "{}={},{}={}",
        keys::LABEL_MANAGED_BY,
        keys::MANAGED_BY,
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name
    );
    let copies = MemberCopies::start(
        &member.client,
        member.name.as_str(),
        &namespace_selector,
        &copy_selector,
        member.cancelled.clone(),
        copy_tx,
    );
    let watch = OffloadWatch {
        member: member.clone(),
        store: store.clone(),
        copies,
        collect: collect_tx.clone(),
        writes: Arc::new(Semaphore::new(WRITES_IN_FLIGHT)),
    };
    let pod_trigger = trigger.clone();
    // Copies coming and going change which Services are mirrored, and which Events relayed.
    let (mirror_tx, mirror_rx) = mpsc::channel::<()>(1);
    let (relay_tx, relay_rx) = mpsc::channel::<String>(64);
    tokio::spawn(crate::mirror::run(ctx.clone(), watch.clone(), mirror_rx).in_current_span());
    tokio::spawn(crate::member_events::run(ctx.clone(), watch.clone(), relay_rx).in_current_span());
    tokio::spawn(
        async move {
            let mut events = std::pin::pin!(events);
            while let Some(ev) = events.next().await {
                match ev {
                    Ok(pod) => {
                        let _ = mirror_tx.try_send(());
                        let _ = relay_tx.try_send(pod.namespace().unwrap_or_default());
                        if store.get(&ObjectRef::from_obj(&pod)).is_none() {
                            // Gone from the member: its copies may be unused now.
                            let _ = collect_tx.try_send(collect::Request::Copies(pod.namespace().unwrap_or_default()));
                        }
                        if let Some(origin) = pod.origin() {
                            let _ = pod_trigger.send(origin).await;
                        }
                    }
                    Err(e) => warn!(error = %e, "offload pod watch failed; retrying with backoff"),
                }
            }
        }
        .in_current_span(),
    );
    tokio::spawn(follow_health(ctx.clone(), member.clone(), trigger.clone()).in_current_span());
    tokio::spawn(follow_source_changes(ctx.clone(), copy_rx, Some(member.clone()), trigger).in_current_span());
    tokio::spawn(collect::run(ctx.clone(), watch.clone(), collect_rx).in_current_span());
    watch
}

/// Reconciles every pod on the member's virtual nodes when its health changes: an outage
/// turning into a loss fails them, a recovery resumes their sync.
async fn follow_health(ctx: Arc<Context>, member: Arc<MemberHandle>, trigger: mpsc::Sender<ObjectRef<PodLite>>) {
    let mut health = member.health.clone();
    loop {
        tokio::select! {
            () = member.cancelled.cancelled() => return,
            res = health.changed() => if res.is_err() { return },
        }
        let nodes: HashSet<&str> = member.pools.iter().map(|p| p.node.as_str()).collect();
        let pods: Vec<ObjectRef<PodLite>> = ctx
            .pods
            .state()
            .iter()
            .filter(|p| p.node_name().is_some_and(|n| nodes.contains(n)))
            .map(|p| ObjectRef::from_obj(&**p))
            .collect();
        for pod in pods {
            if trigger.send(pod).await.is_err() {
                return;
            }
        }
    }
}

/// Hands training pods that are gone to the collector of their member, which deletes their
/// offload copy if there is one (after a normal deletion there is none left).
async fn forward_deletions(ctx: Arc<Context>, mut gone: mpsc::Receiver<Arc<PodLite>>) {
    while let Some(pod) = gone.recv().await {
        ctx.stop_waiting(&ObjectRef::from_obj(&*pod));
        ctx.handovers.end(&pod);
        let Some(node) = pod.node_name() else { continue };
        let Some((watch, _)) = ctx.route(node) else { continue };
        let (Some(namespace), Some(uid)) = (pod.metadata.namespace.as_deref(), pod.metadata.uid.clone()) else {
            continue;
        };
        let request = collect::Request::Gone {
            offload: ObjectRef::new(&pod.name_any())
                .within(&translate::member_namespace(&watch.member.namespace_prefix, namespace)),
            uid,
        };
        // Never wait on one member's collector; its periodic pass catches what is dropped.
        let _ = watch.collect.try_send(request);
    }
}

/// Turns ConfigMap and Secret changes into reconciles of the pods that reference them.
/// Training side (`member` None): any change of a source. Member side: a copy deleted
/// behind tidepool's back, named by its origin annotations.
async fn follow_source_changes(
    ctx: Arc<Context>,
    mut changes: mpsc::Receiver<Change>,
    member: Option<Arc<MemberHandle>>,
    trigger: mpsc::Sender<ObjectRef<PodLite>>,
) {
    while let Some(change) = changes.recv().await {
        let pods = match (&change, &member) {
            (Change::Applied(kind, meta) | Change::Deleted(kind, meta), None) => {
                let (Some(ns), Some(name)) = (meta.namespace.as_deref(), meta.name.as_deref()) else { continue };
                ctx.referencing(Some(ns), Some(&Source::new(*kind, name)), None)
            }
            (Change::Relisted, None) => ctx.referencing_any(),
            (Change::Deleted(kind, meta), Some(member)) => {
                let annotations = meta.annotations.as_ref();
                let Some(ns) = annotations.and_then(|a| a.get(keys::ANNOTATION_ORIGIN_NAMESPACE)) else { continue };
                let Some(name) = meta.name.as_deref() else { continue };
                ctx.referencing(Some(ns), Some(&Source::new(*kind, name)), Some(member))
            }
            (Change::Applied(..) | Change::Relisted, Some(_)) => continue,
        };
        for pod in pods {
            if trigger.send(pod).await.is_err() {
                return;
            }
        }
    }
}

impl Context {
    /// Syncs copies from training namespace `origin` into `member_ns` of `watch`'s member.
    fn reflection<'a>(
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
        }
    }

    /// The member session and pool behind a virtual node, with that session's offload cache.
    fn route(&self, node: &str) -> Option<(OffloadWatch, PoolHandle)> {
        let watches = self.offload.lock().ok()?;
        watches.values().find_map(|w| w.member.pool_for_node(node).map(|p| (w.clone(), p.clone())))
    }

    /// Training pods in `namespace` (or any) whose offload copy in `member` (or any member)
    /// references `source` (without one: anything at all), and pods held back waiting for
    /// one of those.
    fn referencing(
        &self,
        namespace: Option<&str>,
        source: Option<&Source>,
        member: Option<&MemberHandle>,
    ) -> Vec<ObjectRef<PodLite>> {
        let watches: Vec<OffloadWatch> = self
            .offload
            .lock()
            .map(|w| w.values().filter(|w| member.is_none_or(|m| w.member.name == m.name)).cloned().collect())
            .unwrap_or_default();
        let mut found: HashSet<ObjectRef<PodLite>> = HashSet::new();
        for watch in watches {
            let member_ns = namespace.map(|ns| translate::member_namespace(&watch.member.namespace_prefix, ns));
            for copy in watch.store.state() {
                if member_ns.as_deref().is_some_and(|ns| copy.metadata.namespace.as_deref() != Some(ns)) {
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
            && let Ok(waiting) = self.waiting.lock()
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
    fn referencing_any(&self) -> Vec<ObjectRef<PodLite>> {
        self.referencing(None, None, None)
    }

    /// Remembers what `pod`, on its way to a member, references.
    fn wait_for(&self, pod: &PodLite, references: &References) {
        if let (Ok(mut waiting), Some(ns)) = (self.waiting.lock(), pod.metadata.namespace.clone()) {
            waiting.insert(ObjectRef::from_obj(pod), (ns, references.keys().cloned().collect()));
        }
    }

    fn stop_waiting(&self, pod: &ObjectRef<PodLite>) {
        if let Ok(mut waiting) = self.waiting.lock() {
            waiting.remove(pod);
        }
    }

    /// The whole training pod `pod` is the cache's view of: kept by the shared watch until
    /// the pod runs, else read from the API. `None` if it is gone (or is another pod of
    /// the same name now).
    /// How much longer the dispatcher owns the ending of `pod`, whose copy it deleted
    /// itself (see [`handover`]).
    fn handed_over(&self, pod: &PodLite) -> Option<Duration> {
        self.handovers.held(pod)
    }

    async fn whole(&self, pod: &PodLite) -> Result<Option<Arc<Pod>>, Error> {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if let Some(whole) = self.training_pods.whole(uid) {
            return Ok(Some(Arc::new(whole)));
        }
        let api = Api::<Pod>::namespaced(self.training.clone(), &pod.namespace().unwrap_or_default());
        let found = api.get_opt(&pod.name_any()).await.map_err(|e| Error::training("read pod", e))?;
        Ok(found.filter(|p| p.metadata.uid.as_deref() == Some(uid)).map(Arc::new))
    }
}

#[instrument(skip_all, fields(pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default()))]
async fn reconcile(pod: Arc<PodLite>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(node) = pod.node_name() else {
        return Ok(Action::await_change());
    };
    let Some((watch, pool)) = ctx.route(node) else {
        // Not a virtual node of ours, or its member is not connected right now: a member
        // (re)connecting triggers every pod again.
        return Ok(Action::await_change());
    };
    let member = &watch.member;
    // 0. The member's health (see tidepool_federation::health). Lost past the loss timeout:
    //    the pod fails so its controller places it elsewhere; its offload copy is deleted
    //    by step 7 once the member answers again. Merely unreachable: nothing is touched,
    //    here or in the member; the health changing back triggers every pod again.
    let health = member.health.borrow().clone();
    if health.lost && pod.is_live() {
        let msg = format!(
            "member {} unreachable for more than {}s ({}); the pod is given up so it can run elsewhere",
            member.name,
            ctx.config.member_loss_timeout_seconds,
            health.unreachable.as_deref().unwrap_or("no answer"),
        );
        fail_pod(&ctx, &pod, keys::REASON_MEMBER_LOST, &msg).await?;
        return Ok(Action::await_change());
    }
    if !health.is_answering() {
        return Ok(Action::requeue(RESYNC));
    }
    if !listed(&watch.store, Duration::from_secs(10)).await {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let namespace = pod.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
    let name = pod.name_any();
    let member_ns = translate::member_namespace(&member.namespace_prefix, &namespace);
    let existing = watch.store.get(&ObjectRef::new(&name).within(&member_ns));
    let copy = existing.as_deref().filter(|o| o.is_copy_of(&pod));

    // 1. Deleted in training: delete the offload copy first, then finish the training pod.
    if pod.metadata.deletion_timestamp.is_some() {
        if let Some(copy) = copy {
            if copy.metadata.deletion_timestamp.is_none() {
                let _slot = slot(&watch.writes).await;
                let grace = pod.metadata.deletion_grace_period_seconds.map(|g| g.max(0) as u32);
                delete_offload(member, copy, grace).await?;
            }
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: pod.uid(), resource_version: None }),
            ..Default::default()
        };
        let _slot = slot(&ctx.training_writes).await;
        match Api::<Pod>::namespaced(ctx.training.clone(), &namespace).delete(&name, &dp).await {
            Ok(_) => {}
            Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => {}
            Err(e) => return Err(Error::training("finish pod deletion", e)),
        }
        info!(member = %member.name, "offload pod gone; training pod deletion finished");
        // Copies made for a pod that never ran are not freed by an offload pod going away.
        let _ = watch.collect.try_send(collect::Request::Copies(member_ns));
        return Ok(Action::await_change());
    }

    let terminal = pod.is_terminal();

    let Some(copy) = copy else {
        if existing.is_some() {
            // 2. A pod of the same name that is not ours: never overwrite it.
            let msg = format!("member {} already has pod {member_ns}/{name} with another origin", member.name);
            publish(&ctx, &pod, EventType::Warning, "OffloadConflict", &msg).await;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        if terminal {
            ctx.stop_waiting(&ObjectRef::from_obj(&*pod));
            return Ok(Action::await_change());
        }
        if pod.status.host_ip.is_some() {
            if let Some(left) = ctx.handed_over(&pod) {
                // The dispatcher deleted it, reclaiming the pod; its status is on the way.
                return Ok(Action::requeue(left));
            }
            // 3. It ran in the member and is gone without our deleting it: the member evicted
            //    or preempted it (its last status, copied up, says which), or someone deleted it.
            let (reason, why) = translate::member_disruption(pod.status.disruption.as_deref());
            let msg = format!("offload pod {member_ns}/{name} {why} in member {}", member.name);
            fail_pod(&ctx, &pod, reason, &msg).await?;
            return Ok(Action::await_change());
        }
        // A turn to write to the member first, then the whole pod (decoded, several times
        // its cache entry) only while this reconcile can use it.
        let _slot = slot(&watch.writes).await;
        // The whole pod, to translate (the cache holds only what the sync decides on).
        let Some(whole) = ctx.whole(&pod).await? else {
            return Ok(Action::await_change());
        };
        // 4. The offload policy: a refused pod fails here, before anything reaches the member.
        let allowed = policy::check(&whole, &ctx.config.policy)
            .and_then(|()| policy::check_pool(&whole, &pool.runtime_class_names));
        if let Err(violation) = allowed {
            let msg = format!("not offloaded to member {}: {violation}", member.name);
            fail_pod(&ctx, &pod, keys::REASON_OFFLOAD_POLICY, &msg).await?;
            return Ok(Action::await_change());
        }
        // 5. Translate (a copy that cannot exist in the member fails the pod), then copy
        //    what it references into the member namespace.
        let target = Target {
            cluster: &ctx.config.cluster_name,
            member: member.name.as_str(),
            namespace_prefix: &member.namespace_prefix,
            node_selector: &pool.node_selector,
            tolerations: &pool.tolerations,
            band: translate::copy_band(&whole),
            copy_labels: &member.copy_labels,
            copy_annotations: &member.copy_annotations,
            max_termination_grace: member.max_termination_grace,
        };
        let mut offload = match translate::offload_pod(&whole, &target) {
            Ok(offload) => offload,
            Err(e @ translate::TranslateError::NamespaceTooLong(_)) => {
                let msg = format!("not offloaded to member {}: {e}", member.name);
                fail_pod(&ctx, &pod, e.reason(), &msg).await?;
                return Ok(Action::await_change());
            }
            Err(e) => return Err(e.into()),
        };
        ensure_namespace(&ctx, &watch, &member_ns).await?;
        let references = reflect::references(offload.spec.as_ref().ok_or(Error::MissingField("spec"))?);
        if !references.is_empty() {
            // Until its copy shows what it references, the pod itself says so.
            ctx.wait_for(&pod, &references);
        }
        let reflection = ctx.reflection(&watch, &namespace, &member_ns);
        match reflection.run(&references).await? {
            Outcome::Ready(absent) => {
                // Optional sources that do not exist in training are not referenced in the
                // member either: its kubelet would take any object of that name there.
                if let Some(spec) = offload.spec.as_mut() {
                    reflect::drop_references(spec, &absent);
                }
            }
            Outcome::Missing(missing) => {
                let msg = format!("waiting for {} before offloading to member {}", missing.join(", "), member.name);
                publish(&ctx, &pod, EventType::Warning, "ReferenceMissing", &msg).await;
                return Ok(Action::requeue(MISSING_RETRY));
            }
            Outcome::Refused(why) => {
                let msg = format!("not offloaded to member {}: {why}", member.name);
                fail_pod(&ctx, &pod, keys::REASON_OFFLOAD_POLICY, &msg).await?;
                return Ok(Action::await_change());
            }
            Outcome::Conflict(msg) => {
                publish(&ctx, &pod, EventType::Warning, "ReflectionConflict", &msg).await;
                return Ok(Action::requeue(Duration::from_secs(60)));
            }
            Outcome::Retry => return Ok(Action::requeue(Duration::from_secs(2))),
        }
        // 6. Create the offload copy.
        match Api::<Pod>::namespaced(member.client.clone(), &member_ns).create(&PostParams::default(), &offload).await {
            Ok(_) => {
                info!(member = %member.name, "offload pod created");
                let msg = format!("created {member_ns}/{name} in member {}", member.name);
                // Off the pod's sync path: its status changes, which follow at once, must
                // not wait for the training API to store an Event.
                let (ctx, pod) = (ctx.clone(), pod.clone());
                tokio::spawn(
                    async move { publish(&ctx, &pod, EventType::Normal, "OffloadCreated", &msg).await }
                        .in_current_span(),
                );
            }
            // Already there: ours (the watch brings it, and the next reconcile), or a pod
            // our watch never sees (another origin): reported, never overwritten.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                if let Some(msg) = foreign_pod(&member.client, &member_ns, &name, &pod).await {
                    publish(
                        &ctx,
                        &pod,
                        EventType::Warning,
                        "OffloadConflict",
                        &format!("member {}: {msg}", member.name),
                    )
                    .await;
                    return Ok(Action::requeue(Duration::from_secs(60)));
                }
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                // The namespace went away under us; create it again next time.
                if let Ok(mut known) = ctx.namespaces.lock() {
                    known.remove(&(member.name.clone(), member_ns.clone()));
                }
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
            Err(e) => return Err(Error::member(&member.name, "create offload pod", e)),
        }
        // The member's watch brings the copy back, and with it the next reconcile.
        return Ok(Action::await_change());
    };

    ctx.stop_waiting(&ObjectRef::from_obj(&*pod));

    // The dispatcher is deleting the copy, reclaiming the pod: neither a second delete nor
    // the notice is worth a member write. Back once the handover is over, if the copy is
    // still there.
    if copy.metadata.deletion_timestamp.is_none()
        && let Some(left) = ctx.handed_over(&pod)
    {
        return Ok(Action::requeue(left));
    }

    // 7. The training pod ended here (reclaimed, or failed by tidepool): stop its copy.
    if terminal {
        if copy.metadata.deletion_timestamp.is_none() {
            let _slot = slot(&watch.writes).await;
            delete_offload(member, copy, Some(0)).await?;
        }
        return Ok(Action::await_change());
    }

    // 8a. The member is deleting the copy on its own (eviction, preemption by an online
    //     pod): the training pod fails now, with the member's reason.
    let member_status = copy.status();
    if copy.metadata.deletion_timestamp.is_some() {
        if let Some(left) = ctx.handed_over(&pod) {
            return Ok(Action::requeue(left));
        }
        let (reason, why) = translate::member_disruption(translate::disruption_reason(member_status.as_ref()));
        let msg = format!("offload pod {member_ns}/{name} {why} in member {}", member.name);
        fail_pod(&ctx, &pod, reason, &msg).await?;
        return Ok(Action::await_change());
    }

    // 8. Notices written on the training pod travel down, so the trainer sees them in
    //    /etc/tidepool/annotations.
    sync_notice(&watch, &pod, copy).await?;

    // 9. Keep its ConfigMap and Secret copies current while it runs.
    // Nothing waits on a timer in the steady state: the watches of both clusters (and of
    // the sources) trigger every change, and their relists trigger every pod. A timer per
    // pod would cost memory in proportion to the pods mirrored.
    let mut retry = None;
    if !copy.references.is_empty() {
        let _slot = slot(&watch.writes).await;
        match ctx.reflection(&watch, &namespace, &member_ns).run(&copy.references).await? {
            // A source deleted in training is deleted in the member too; the pod runs on,
            // as it would with a kubelet of its own.
            Outcome::Ready(_) | Outcome::Missing(_) => {}
            Outcome::Refused(msg) | Outcome::Conflict(msg) => {
                publish(&ctx, &pod, EventType::Warning, "ReflectionFailed", &msg).await;
            }
            Outcome::Retry => retry = Some(Duration::from_secs(2)),
        }
    }
    let next = || retry.map_or_else(Action::await_change, Action::requeue);

    // 10. Copy status up.
    let Some(member_status) = member_status else {
        return Ok(next());
    };
    let mut desired = translate::training_status(&member_status, &ctx.config.kubelet.node_address.to_string());
    translate::keep_tidepool_conditions(&mut desired, &pod.status.tidepool_conditions);
    translate::hold_for_reclaim(&mut desired, &pod.status.tidepool_conditions);
    let synced = SyncedStatus::of(Some(&desired));
    if synced.all != pod.status.synced.all {
        // A Pending pod's new conditions wait a moment for the pod to run (coalescing two
        // writes into one); the offload pod turning Running triggers this sooner.
        if let Some(wait) =
            translate::status_settles_in(&pod.status, &desired, &synced, jiff::Timestamp::now(), PENDING_SETTLE)
        {
            return Ok(match retry {
                Some(r) => Action::requeue(wait.min(r)),
                None if wait >= translate::UNTIL_NEXT_CHANGE => Action::await_change(),
                None => Action::requeue(wait),
            });
        }
        patch_status(&ctx, &pod, &desired).await?;
    }
    Ok(next())
}

/// Copies the reclaim deadline from the training pod to its offload copy, once tidepool's
/// notice condition is there ([`translate::notice_for_copy`]).
async fn sync_notice(watch: &OffloadWatch, pod: &PodLite, copy: &OffloadPod) -> Result<(), Error> {
    let key = keys::ANNOTATION_RECLAIM_DEADLINE;
    let Some(want) = translate::notice_for_copy(pod.annotations(), &pod.status.tidepool_conditions) else {
        return Ok(());
    };
    if copy.reclaim_deadline() == Some(want) {
        return Ok(());
    }
    let member = &watch.member;
    let _slot = slot(&watch.writes).await;
    let api = Api::<Pod>::namespaced(member.client.clone(), &copy.namespace().unwrap_or_default());
    let patch = json!({ "metadata": { "annotations": { key: want } } });
    api.patch(&copy.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(|e| Error::member(&member.name, "copy reclaim notice to offload pod", e))?;
    info!(member = %member.name, "reclaim notice copied to the offload pod");
    Ok(())
}

pub(crate) async fn delete_offload(member: &MemberHandle, copy: &OffloadPod, grace: Option<u32>) -> Result<(), Error> {
    let ns = copy.namespace().unwrap_or_default();
    let dp = DeleteParams {
        grace_period_seconds: grace,
        preconditions: Some(Preconditions { uid: copy.uid(), resource_version: None }),
        ..Default::default()
    };
    match Api::<Pod>::namespaced(member.client.clone(), &ns).delete(&copy.name_any(), &dp).await {
        Ok(_) => {
            info!(member = %member.name, ?grace, "offload pod deletion requested");
            Ok(())
        }
        Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => {
            info!(member = %member.name, ?grace, "offload pod deletion requested");
            Ok(())
        }
        Err(e) => Err(Error::member(&member.name, "delete offload pod", e)),
    }
}

async fn ensure_namespace(ctx: &Context, watch: &OffloadWatch, ns: &str) -> Result<(), Error> {
    let member = &watch.member;
    let key = (member.name.clone(), ns.to_owned());
    if ctx.namespaces.lock().is_ok_and(|k| k.contains(&key)) {
        return Ok(());
    }
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.to_owned()),
            labels: Some(
                [
                    (keys::LABEL_MANAGED_BY, keys::MANAGED_BY),
                    (keys::LABEL_ORIGIN_CLUSTER, ctx.config.cluster_name.as_str()),
                    ("pod-security.kubernetes.io/enforce", "baseline"),
                    ("pod-security.kubernetes.io/warn", "baseline"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<Namespace>::all(member.client.clone());
    match api.create(&PostParams::default(), &namespace).await {
        Ok(_) => info!(member = %member.name, namespace = ns, "offload namespace created"),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // There already: ours, or somebody's — another training cluster's tidepool
            // (whose copies our pods would mount) or the member's own. Nothing goes into,
            // and no role is bound in, a namespace that is not ours.
            let existing =
                api.get_opt(ns).await.map_err(|e| Error::member(&member.name, "read offload namespace", e))?;
            if let Some(owner) =
                existing.and_then(|n| translate::foreign_namespace(&n.metadata, &ctx.config.cluster_name))
            {
                return Err(Error::ForeignNamespace { member: member.name.clone(), namespace: ns.to_owned(), owner });
            }
        }
        Err(e) => return Err(Error::member(&member.name, "create offload namespace", e)),
    }
    watch.copies.enter(ns).await;
    if let Ok(mut known) = ctx.namespaces.lock() {
        known.insert(key);
    }
    Ok(())
}

/// One of `writes`' slots, held until dropped. `None` only if the semaphore were closed,
/// which none is.
async fn slot(writes: &Semaphore) -> Option<SemaphorePermit<'_>> {
    writes.acquire().await.ok()
}

async fn patch_status(ctx: &Context, pod: &PodLite, status: &PodStatus) -> Result<(), Error> {
    let _slot = slot(&ctx.training_writes).await;
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .map_err(|e| Error::training("update pod status", e))?;
    Ok(())
}

/// Fails the training pod with `reason`, unless it changed since the cache's view of it
/// (then its next reconcile decides again): a pod another controller has just finished —
/// the dispatcher reclaiming it, say, and deleting its copy — keeps that controller's
/// reason, whichever watch reaches this controller first.
async fn fail_pod(ctx: &Context, pod: &PodLite, reason: &str, message: &str) -> Result<(), Error> {
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let patch = json!({
        "metadata": { "resourceVersion": pod.metadata.resource_version },
        "status": { "phase": "Failed", "reason": reason, "message": message },
    });
    let written = {
        let _slot = slot(&ctx.training_writes).await;
        api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await
    };
    match written {
        Ok(_) => {}
        Err(e) if tidepool_federation::api_code(&e, &[409]) => {
            info!(reason, "training pod changed since this decision; deciding again");
            return Ok(());
        }
        Err(e) => return Err(Error::training("update pod status", e)),
    }
    warn!(reason, message, "training pod failed");
    publish(ctx, pod, EventType::Warning, reason, message).await;
    Ok(())
}

/// Publishes an Event about `pod`. Written straight to the API rather than through kube's
/// `Recorder`, which keeps every Event it published for minutes (to count repeats) and
/// scans all of them on each publish: with an Event per offloaded pod, that is a cache the
/// size of the cluster and a scan of it per pod.
/// Why member pod `ns/name`, found where `pod`'s copy was to be created, is not its copy (it
/// lacks `pod`'s origin UID), or `None` if it is (or is gone, or cannot be read now: the next
/// reconcile looks again).
async fn foreign_pod(client: &kube::Client, ns: &str, name: &str, pod: &PodLite) -> Option<String> {
    let found = OffloadPod::from(Api::<Pod>::namespaced(client.clone(), ns).get_opt(name).await.ok()??);
    if found.is_copy_of(pod) {
        return None;
    }
    Some(format!("already has pod {ns}/{name} with another origin"))
}

async fn publish(ctx: &Context, pod: &PodLite, type_: EventType, reason: &str, note: &str) {
    let namespace = pod.namespace().unwrap_or_default();
    let now = jiff::Timestamp::now();
    // `<pod>.<time in hex>`, as other Events are named (the pod's name cut to fit).
    let pod_name = pod.name_any();
    let name = format!("{}.{:x}", &pod_name[..pod_name.len().min(230)], now.as_nanosecond());
    let event = K8sEvent {
        metadata: ObjectMeta { name: Some(name), namespace: Some(namespace.clone()), ..Default::default() },
        event_time: Some(MicroTime(now)),
        type_: Some(match type_ {
            EventType::Normal => "Normal".to_owned(),
            EventType::Warning => "Warning".to_owned(),
        }),
        reason: Some(reason.to_owned()),
        note: Some(note.to_owned()),
        action: Some("Offload".to_owned()),
        regarding: Some(pod.object_ref(&())),
        reporting_controller: Some(EVENT_REPORTER.to_owned()),
        reporting_instance: Some(ctx.event_instance.clone()),
        ..Default::default()
    };
    let _slot = slot(&ctx.event_writes).await;
    if let Err(e) =
        Api::<K8sEvent>::namespaced(ctx.training.clone(), &namespace).create(&PostParams::default(), &event).await
    {
        warn!(error = %e, reason, "cannot publish event");
    }
}
