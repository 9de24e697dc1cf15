//! The pod controller: training pods bound to a virtual node ⇄ offload pods in its member.
//!
//! Reconciles are triggered by training pod changes, by offload pod changes (each member's
//! offload watch maps a member pod back to its training pod by the origin annotations), and
//! by changes of the ConfigMaps and Secrets a pod references (see [`crate::copies`]). They
//! read the member's state from those watches' caches: steady state costs the member no reads.
//!
//! Before an offload pod is created, the pod must pass the offload policy
//! ([`crate::policy`]) and everything it references must be copied into the member
//! ([`crate::referenced`]). Each member session also runs a collector ([`crate::collect`]).

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodStatus};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tidepool_api::metrics::metrics;
use tidepool_api::pod::{PodLite, SyncedStatus};
use tidepool_api::sync::Locked;
use tidepool_api::terminal::{Ending, terminal_status};
use tidepool_api::{BridgeConfig, keys};
use tidepool_federation::tasks::Tasks;
use tidepool_federation::writes::CopyWrites;
use tidepool_federation::{MemberHandle, Members, PodEvent, PoolHandle, TrainingPods};
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, WatchStream};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, instrument, warn};

use crate::context::{Context, EVENT_REPORTER, OffloadWatch, WRITES_IN_FLIGHT, delete_offload};
use crate::copies::{Change, MemberCopies, MetaStores, Outcome};
use crate::handover;
use crate::isolation::Isolation;
use crate::member_pods::{self, Created};
use crate::offload::OffloadPod;
use crate::offload_cache::OffloadCache;
use crate::referenced::{self, Source};
use crate::step::{self, Cause, Facts, Step, Then};
use crate::translate::{self, Target};
use crate::{Error, collect, gang_group, policy};

/// Retry of a pod waiting for a ConfigMap or Secret it needs; their creation triggers it
/// sooner.
const MISSING_RETRY: Duration = Duration::from_secs(30);
/// How soon a copy whose member does not serve its gang scheduler's PodGroups looks again.
const GANG_API_RETRY: Duration = Duration::from_secs(30);
/// How long other new conditions of a still-Pending offload pod wait before they are
/// copied up: usually the pod runs within it, and one status write says both. See
/// [`translate::status_settles_in`].
const PENDING_SETTLE: Duration = Duration::from_secs(1);
/// How long a copy's terminal status may wait for its containers' ends before it is copied
/// up as it is. See [`translate::terminal_settles_in`].
const TERMINAL_SETTLE: Duration = Duration::from_secs(5);
/// Pods reconciled at once, per queue. Each reconcile in flight is a future of a few KB; the
/// rest wait in the controller's queue, as a reference each. Generous, because a reconcile
/// waiting for its member's write slot holds its place (BENCHMARKS.md, "Pod sync", has the
/// burst runs that set it).
const RECONCILES_IN_FLIGHT: u16 = 1024;
/// The offload namespaces' lock, in errors.
const NAMESPACES: &str = "offload namespaces";

pub async fn run(
    training: Client,
    config: Arc<BridgeConfig>,
    members: watch::Receiver<Members>,
    training_pods: TrainingPods,
    copy_writes: CopyWrites,
    stop: CancellationToken,
) {
    let (trigger_tx, trigger_rx) = mpsc::channel::<ObjectRef<PodLite>>(1024);
    let (source_tx, source_rx) = mpsc::channel::<Change>(1024);
    // The status sync's own queue (see [`status_up`]): copies' changes and training pods'.
    let (status_tx, status_rx) = mpsc::channel::<ObjectRef<PodLite>>(1024);
    let (inlets, split) = split_events(&training_pods, status_tx.clone());
    let (sources, source_watches) =
        MetaStores::sources(&training, &config.secret_namespaces, CancellationToken::new(), source_tx);
    let ctx = Arc::new(Context::new(training, config, members.clone(), training_pods, sources, status_tx));
    // Its helpers run beside the controller; one ending stops the pod sync (and the
    // process), none dies unseen.
    let mut helpers = Tasks::default();
    helpers.spawn("split-events", split);
    for watch in source_watches {
        helpers.spawn("training-source-watch", watch);
    }
    helpers.spawn("reclaim-deletes", handover::run(copy_writes, ctx.handovers.clone()));
    helpers.spawn("offload-watches", supervise_offload_watches(ctx.clone(), trigger_tx.clone()));
    helpers.spawn("forward-deletions", forward_deletions(ctx.clone(), inlets.gone));
    helpers.spawn("queue-depth", report_queue_depth(trigger_tx.clone()));
    helpers.spawn(
        "training-sources",
        follow_source_changes(ctx.clone(), source_rx, None, trigger_tx).instrument(info_span!("training_sources")),
    );
    let down = down_sync(ctx.clone(), inlets.applied, trigger_rx, inlets.resync, members.clone(), stop.clone());
    let up = status_sync(ctx, status_rx, inlets.resync_up, members, stop);
    tokio::select! {
        ((), ()) = futures::future::join(down, up) => info!("pod sync stopped"),
        ended = helpers.first_end() => error!(%ended, "pod sync helper stopped; stopping the pod sync"),
    }
}

/// What the shared training pod watch brings the pod sync.
struct Inlets {
    /// Changed pods, for the down-sync's queue (the status sync's gets their references).
    applied: mpsc::Receiver<Arc<PodLite>>,
    /// Pods gone from training, for their members' collectors.
    gone: mpsc::Receiver<Arc<PodLite>>,
    /// Relists and missed changes: every pod, on each queue.
    resync: mpsc::Receiver<()>,
    resync_up: mpsc::Receiver<()>,
}

/// Splits the shared watch: changes drive both queues; deletions go to the collector at once
/// (a pod deleted outright, with grace period 0, forced, or by the pod garbage collector,
/// never shows a deletion timestamp, and its offload copy must go now rather than at the
/// collector's next pass); missed changes resync every pod.
fn split_events(
    training_pods: &TrainingPods,
    status: mpsc::Sender<ObjectRef<PodLite>>,
) -> (Inlets, impl Future<Output = ()> + Send + 'static) {
    let (applied_tx, applied) = mpsc::channel::<Arc<PodLite>>(1024);
    let (gone_tx, gone) = mpsc::channel::<Arc<PodLite>>(1024);
    let (resync_tx, resync) = mpsc::channel::<()>(1);
    let (resync_up_tx, resync_up) = mpsc::channel::<()>(1);
    let events = training_pods.subscribe();
    let kept =
        |sent: Result<(), mpsc::error::TrySendError<()>>| !matches!(sent, Err(mpsc::error::TrySendError::Closed(_)));
    let split = async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let sent = match event {
                PodEvent::Applied(pod) => {
                    let key = ObjectRef::from_obj(&*pod);
                    applied_tx.send(pod).await.is_ok() && status.send(key).await.is_ok()
                }
                PodEvent::Deleted(pod) => gone_tx.try_send(pod).is_ok() || !gone_tx.is_closed(),
                PodEvent::Relisted | PodEvent::Lagged => kept(resync_tx.try_send(())) & kept(resync_up_tx.try_send(())),
            };
            if !sent {
                return;
            }
        }
    };
    (Inlets { applied, gone, resync, resync_up }, split)
}

/// One of the pod sync's queues over the shared training pod cache: changed `objects` and
/// `triggers` enqueue a pod, a member (re)connecting or `resync` every pod (their pods may
/// have waited for it); at shutdown it takes no new work and finishes what is in flight.
fn queue(
    ctx: &Context,
    objects: impl futures::Stream<Item = Arc<PodLite>> + Send + 'static,
    triggers: mpsc::Receiver<ObjectRef<PodLite>>,
    resync: mpsc::Receiver<()>,
    members: watch::Receiver<Members>,
    stop: CancellationToken,
) -> Controller<PodLite> {
    let member_changes = WatchStream::new(members).map(|_| ());
    Controller::for_shared_stream(objects, ctx.pods.clone())
        .with_config(controller::Config::default().concurrency(RECONCILES_IN_FLIGHT))
        .reconcile_on(ReceiverStream::new(triggers))
        .reconcile_all_on(futures::stream::select(member_changes, ReceiverStream::new(resync)))
        .graceful_shutdown_on(stop.cancelled_owned())
}

/// The down-sync's controller: every step but the status's way up ([`reconcile`]).
fn down_sync(
    ctx: Arc<Context>,
    applied: mpsc::Receiver<Arc<PodLite>>,
    triggers: mpsc::Receiver<ObjectRef<PodLite>>,
    resync: mpsc::Receiver<()>,
    members: watch::Receiver<Members>,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> {
    queue(&ctx, ReceiverStream::new(applied), triggers, resync, members, stop)
        .run(timed_reconcile, error_policy, ctx)
        .for_each(|_| async {})
}

/// Status up on a queue of its own, as virtual-kubelet keeps it: a running copy's status
/// never waits behind a burst's creations for a place in the down-sync's queue. Training
/// pods' changes reach it as triggers.
fn status_sync(
    ctx: Arc<Context>,
    triggers: mpsc::Receiver<ObjectRef<PodLite>>,
    resync: mpsc::Receiver<()>,
    members: watch::Receiver<Members>,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> {
    queue(&ctx, futures::stream::pending(), triggers, resync, members, stop)
        .run(timed_status_up, error_policy, ctx)
        .for_each(|_| async {})
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

async fn timed_status_up(pod: Arc<PodLite>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let result = status_up(pod, ctx).await;
    metrics().observe_sync("pod_status", started.elapsed());
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
        let mut started = Vec::new();
        // Without the watches no pod syncs: stop (the pod sync stops with this task).
        {
            let Some(mut watches) = ctx.offload.locked_or_log("offload watches") else { return };
            watches.retain(|name, w| current.get(name).is_some_and(|m| Arc::ptr_eq(m, &w.member)));
            for (name, member) in &current {
                if !watches.contains_key(name) {
                    watches.insert(name.clone(), start_offload_watch(&ctx, member.clone(), trigger.clone()));
                    started.push(member.clone());
                }
            }
        }
        // The member change that started these watches also woke every pod, maybe before the
        // watches were here: a pod that found no route then waits for a change. Go again.
        for pod in pods_on(&ctx, &started) {
            if trigger.send(pod).await.is_err() {
                return;
            }
        }
        if members.changed().await.is_err() {
            return;
        }
    }
}

/// The training pods bound to a virtual node of one of `members`.
fn pods_on(ctx: &Context, members: &[Arc<MemberHandle>]) -> Vec<ObjectRef<PodLite>> {
    if members.is_empty() {
        return Vec::new();
    }
    let on_theirs =
        |pod: &PodLite| pod.node_name().is_some_and(|n| members.iter().any(|m| m.pool_for_node(n).is_some()));
    ctx.pods.state().iter().filter(|p| on_theirs(p)).map(|p| ObjectRef::from_obj(&**p)).collect()
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
    let (store, writer) = crate::offload_cache::cache();
    let events = copy_events(ctx, &member, writer);
    let (collect_tx, collect_rx) = mpsc::channel::<collect::Request>(256);
    let (copy_tx, copy_rx) = mpsc::channel::<Change>(256);
    let copies = member_copies(ctx, &member, copy_tx);
    let watch = OffloadWatch {
        member: member.clone(),
        store: store.clone(),
        copies,
        collect: collect_tx.clone(),
        writes: Arc::new(Semaphore::new(WRITES_IN_FLIGHT)),
        deletions: Arc::default(),
    };
    // Copies coming and going change which Services are mirrored, and which Events relayed.
    let (mirror_tx, mirror_rx) = mpsc::channel::<()>(1);
    let (relay_tx, relay_rx) = mpsc::channel::<String>(64);
    // Every task below runs as long as the member's session, as one of its tasks: one that
    // stops early marks the member (see `tidepool_federation::member_tasks`).
    let tasks = &member.tasks;
    tasks.spawn("Service mirror", crate::mirror::run(ctx.clone(), watch.clone(), mirror_rx).in_current_span());
    tasks.spawn("Event relay", crate::member_events::run(ctx.clone(), watch.clone(), relay_rx).in_current_span());
    let tell = CopyEventTargets {
        pods: trigger.clone(),
        status: ctx.status_triggers.clone(),
        collect: collect_tx,
        mirror: mirror_tx,
        relay: relay_tx,
    };
    tasks.spawn("copy watch", forward_copy_events(events, store, tell).in_current_span());
    tasks.spawn("health follower", follow_health(ctx.clone(), member.clone(), trigger.clone()).in_current_span());
    let sources = follow_source_changes(ctx.clone(), copy_rx, Some(member.clone()), trigger);
    tasks.spawn("source follower", sources.in_current_span());
    tasks.spawn("collector", collect::run(ctx.clone(), watch.clone(), collect_rx).in_current_span());
    watch
}

/// The watch of `member`'s copies of this cluster's pods, applied to tidepool's own cache
/// through `writer` (what `reflect` and `touched_objects` do, see `crate::offload_cache`) and
/// passed on one copy at a time; it ends with the session.
fn copy_events(
    ctx: &Context,
    member: &MemberHandle,
    mut writer: crate::offload_cache::OffloadCacheWriter,
) -> impl futures::Stream<Item = Result<Arc<OffloadPod>, watcher::Error>> + Send + 'static {
    let selector = format!(
        "{}={},{}={}",
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name,
        keys::LABEL_ORIGIN_MEMBER,
        member.name
    );
    watcher(Api::<Pod>::all(member.client.clone()), watcher::Config::default().labels(&selector))
        .default_backoff()
        .map(|event| event.map(|e| translate::map_event(e, |pod| Arc::new(OffloadPod::from(pod)))))
        .map(move |event| {
            if let Ok(e) = &event {
                writer.apply(e);
            }
            event
        })
        .filter_map(|event| async move {
            match event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o)) => Some(Ok(o)),
                Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                Err(e) => Some(Err(e)),
            }
        })
        .take_until(member.cancelled.clone().cancelled_owned())
}

/// The watches of `member`'s reflected ConfigMap and Secret copies and of its offload
/// namespaces (their isolation kept), changes sent to `copy_tx`.
fn member_copies(ctx: &Context, member: &MemberHandle, copy_tx: mpsc::Sender<Change>) -> MemberCopies {
    let copy_selector = referenced::copy_selector(&ctx.config.cluster_name, member.name.as_str());
    let namespace_selector = format!(
        "{}={},{}={}",
        keys::LABEL_MANAGED_BY,
        keys::MANAGED_BY,
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name
    );
    let isolation = Isolation::new(
        member.client.clone(),
        (&ctx.config.cluster_name, member.name.as_str()),
        member.confinement.network_policy.clone(),
    );
    MemberCopies::start(
        &member.client,
        member.name.as_str(),
        &namespace_selector,
        &copy_selector,
        &member.tasks,
        copy_tx,
        isolation,
    )
}

/// Who hears of a change of one of a member's offload pods.
struct CopyEventTargets {
    /// Both queues of the pod sync, by training pod.
    pods: mpsc::Sender<ObjectRef<PodLite>>,
    status: mpsc::Sender<ObjectRef<PodLite>>,
    collect: mpsc::Sender<collect::Request>,
    mirror: mpsc::Sender<()>,
    relay: mpsc::Sender<String>,
}

/// Passes the member's offload pod changes on until its watch ends.
async fn forward_copy_events(
    events: impl futures::Stream<Item = Result<Arc<OffloadPod>, watcher::Error>>,
    store: OffloadCache,
    tell: CopyEventTargets,
) {
    let mut events = std::pin::pin!(events);
    while let Some(ev) = events.next().await {
        match ev {
            Ok(pod) => {
                let _ = tell.mirror.try_send(());
                let _ = tell.relay.try_send(pod.namespace().to_owned());
                if store.get(pod.namespace(), pod.name()).is_none() {
                    // Gone from the member: its copies may be unused now.
                    let _ = tell.collect.try_send(collect::Request::Copies(pod.namespace().to_owned()));
                }
                if let Some(origin) = pod.origin() {
                    let _ = tell.status.send(origin.clone()).await;
                    let _ = tell.pods.send(origin).await;
                }
            }
            Err(e) => warn!(error = %e, "offload pod watch failed; retrying with backoff"),
        }
    }
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
        let forgot = ctx.stop_waiting(&ObjectRef::from_obj(&*pod)).and_then(|()| ctx.handovers.end(&pod));
        if let Err(e) = forgot {
            error!(error = %e, "cannot forget a deleted pod");
            return;
        }
        let Some(node) = pod.node_name() else { continue };
        let Ok(Some((watch, _))) = ctx.route(node) else { continue };
        let (Some(namespace), Some(uid)) = (pod.metadata.namespace.as_deref(), pod.metadata.uid.clone()) else {
            continue;
        };
        let request = collect::Request::Gone {
            namespace: watch.member.namespaces.member_ns(namespace),
            name: pod.name_any(),
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

/// What both queues know of a pod bound to a virtual node of ours, and its next step.
struct Known {
    watch: OffloadWatch,
    pool: PoolHandle,
    namespace: String,
    member_ns: String,
    /// Boxed: a reconcile waiting for a write slot holds it (see `future_sizes`).
    health: Box<tidepool_federation::Health>,
    existing: Option<Arc<OffloadPod>>,
    step: Step,
}

impl Known {
    /// Gathers the facts of [`step::next_step`]; `None` for a pod not on a node of a
    /// connected member (a member (re)connecting triggers every pod again).
    async fn of(pod: &PodLite, ctx: &Context) -> Result<Option<Known>, Error> {
        let Some(node) = pod.node_name() else { return Ok(None) };
        let Some((watch, pool)) = ctx.route(node)? else { return Ok(None) };
        let namespace = pod.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
        let member_ns = watch.member.namespaces.member_ns(&namespace);
        // The member's health (see tidepool_federation::health) first: a member that does
        // not answer is not waited for.
        let health = Box::new(watch.member.health.borrow().clone());
        let listed = health.is_answering() && watch.store.listed(Duration::from_secs(10)).await;
        let existing = watch.store.get(&member_ns, &pod.name_any());
        let handed_over = ctx.handed_over(pod)?;
        let facts = Facts { pod, health: &health, listed, existing: existing.as_deref(), handed_over };
        let step = step::next_step(&facts);
        Ok(Some(Known { watch, pool, namespace, member_ns, health, existing, step }))
    }

    /// The member pod, if it is this pod's copy.
    fn copy(&self, pod: &PodLite) -> Option<&OffloadPod> {
        self.existing.as_deref().filter(|o| o.is_copy_of(pod))
    }
}

/// The down-sync: every step but the status's way up.
#[instrument(skip_all, fields(pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default()))]
async fn reconcile(pod: Arc<PodLite>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(known) = Known::of(&pod, &ctx).await? else {
        return Ok(Action::await_change());
    };
    let copy = known.copy(&pod);
    if copy.is_some() {
        ctx.stop_waiting(&ObjectRef::from_obj(&*pod))?;
    }
    let Known { watch, pool, namespace, member_ns, health, step, .. } = &known;
    let (watch, pool, health) = (watch, pool, health);
    let sync = PodSync { ctx: &ctx, watch, pod: &pod, namespace: namespace.clone(), member_ns: member_ns.clone() };
    match (step.clone(), copy) {
        (Step::Wait, _) => Ok(Action::await_change()),
        (Step::Requeue(after), _) => Ok(Action::requeue(after)),
        (Step::Fail { reason, cause }, _) => {
            Box::pin(sync.fail(reason, &cause, health)).await?;
            Ok(Action::await_change())
        }
        (Step::DeleteCopy { grace, then }, Some(copy)) => {
            let _slot = slot(&watch.writes).await;
            Box::pin(delete_offload(watch, copy, grace)).await?;
            Ok(match then {
                Then::LookAgain => Action::requeue(step::DELETING),
                Then::Wait => Action::await_change(),
            })
        }
        (Step::FinishDeletion, _) => Box::pin(sync.finish_deletion()).await,
        (Step::DeleteStale, _) => {
            if let Some(stale) = known.existing.as_deref() {
                let _slot = slot(&watch.writes).await;
                info!(member = %watch.member.name, "an earlier pod's copy holds the name: deleting it");
                Box::pin(delete_offload(watch, stale, None)).await?;
            }
            Ok(Action::requeue(step::STALE))
        }
        (Step::Conflict, _) => {
            let msg = format!(
                "member {} already has pod {}/{} with another origin",
                watch.member.name,
                sync.member_ns,
                pod.name_any()
            );
            Box::pin(publish(&ctx, &pod, EventType::Warning, "OffloadConflict", &msg)).await;
            Ok(Action::requeue(step::CONFLICT))
        }
        (Step::Forget, _) => {
            ctx.stop_waiting(&ObjectRef::from_obj(&*pod))?;
            Ok(Action::await_change())
        }
        (Step::Offload, _) => sync.offload(pool).await,
        (Step::Follow, Some(copy)) => Box::pin(sync.follow(copy)).await,
        // Steps on a copy always come with one (see step::with_copy).
        (Step::DeleteCopy { .. } | Step::Follow, None) => Ok(Action::await_change()),
    }
}

/// The status sync: a running copy's status up to its training pod, on a queue of its own.
#[instrument(skip_all, fields(pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default()))]
async fn status_up(pod: Arc<PodLite>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(known) = Known::of(&pod, &ctx).await? else {
        return Ok(Action::await_change());
    };
    let (Step::Follow, Some(copy)) = (&known.step, known.copy(&pod)) else {
        return Ok(Action::await_change());
    };
    let sync = PodSync {
        ctx: &ctx,
        watch: &known.watch,
        pod: &pod,
        namespace: known.namespace.clone(),
        member_ns: known.member_ns.clone(),
    };
    Box::pin(sync.status(copy)).await
}

/// One pod's sync in progress: the pod, its member and where its copy lives.
struct PodSync<'a> {
    ctx: &'a Arc<Context>,
    watch: &'a OffloadWatch,
    pod: &'a Arc<PodLite>,
    namespace: String,
    member_ns: String,
}

impl PodSync<'_> {
    fn member(&self) -> &MemberHandle {
        &self.watch.member
    }

    /// Step::Fail: the message says why, with the member's name.
    async fn fail(&self, reason: &str, cause: &Cause, health: &tidepool_federation::Health) -> Result<(), Error> {
        let member = &self.member().name;
        let msg = match cause {
            Cause::MemberLost => format!(
                "member {member} unreachable for more than {}s ({}); the pod is given up so it can run elsewhere",
                self.ctx.config.member_loss_timeout_seconds,
                health.unreachable.as_deref().unwrap_or("no answer"),
            ),
            Cause::Disrupted { how, .. } => {
                format!("offload pod {}/{} {how} in member {member}", self.member_ns, self.pod.name_any())
            }
        };
        // A disruption: the member's own DisruptionTarget reason where it gave one
        // (preemption, eviction, taint, kubelet), else tidepool's for what happened.
        let member_said = match cause {
            Cause::Disrupted { target, .. } => target.as_deref(),
            Cause::MemberLost => None,
        };
        let end = Ending { reason, message: &msg, disruption: Some(member_said.unwrap_or(reason)) };
        fail_pod(self.ctx, self.pod, &end).await
    }

    /// Step::FinishDeletion: the copy is gone; the training pod ends as a kubelet ends a
    /// deleted pod (a terminal status first, [`tidepool_api::terminal::deleted_status`]), and
    /// its deletion completes.
    async fn finish_deletion(&self) -> Result<Action, Error> {
        if !matches!(self.pod.status.phase.as_deref(), Some("Succeeded" | "Failed")) {
            self.write_deleted_status().await?;
        }
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: self.pod.uid(), resource_version: None }),
            ..Default::default()
        };
        let _slot = slot(&self.ctx.training_writes).await;
        let api = Api::<Pod>::namespaced(self.ctx.training.clone(), &self.namespace);
        match api.delete(&self.pod.name_any(), &dp).await {
            Ok(_) => {}
            Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => {}
            Err(e) => return Err(Error::training("finish pod deletion", e)),
        }
        info!(member = %self.member().name, "offload pod gone; training pod deletion finished");
        // Copies made for a pod that never ran are not freed by an offload pod going away.
        let _ = self.watch.collect.try_send(collect::Request::Copies(self.member_ns.clone()));
        Ok(Action::await_change())
    }

    /// The terminal status of a training pod whose deletion completes while it shows itself
    /// running: without it, a Job with `podFailurePolicy` never removes its tracking
    /// finalizer and the pod stays `Terminating`.
    async fn write_deleted_status(&self) -> Result<(), Error> {
        let Some(whole) = self.ctx.whole(self.pod).await? else { return Ok(()) };
        let status = tidepool_api::terminal::deleted_status(whole.status.as_ref(), &Time(jiff::Timestamp::now()));
        let api = Api::<Pod>::namespaced(self.ctx.training.clone(), &self.namespace);
        let patch = json!({ "status": status });
        let _slot = slot(&self.ctx.training_writes).await;
        match api.patch_status(&self.pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => Ok(()),
            Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(()),
            Err(e) => Err(Error::training("write a deleted pod's terminal status", e)),
        }
    }

    /// Step::Offload: policy, translation, references, then the copy.
    async fn offload(&self, pool: &PoolHandle) -> Result<Action, Error> {
        // A turn to write to the member first, then the whole pod (decoded, several times
        // its cache entry) only while this sync can use it.
        let _slot = slot(&self.watch.writes).await;
        Box::pin(self.offload_holding_slot(pool)).await
    }

    async fn offload_holding_slot(&self, pool: &PoolHandle) -> Result<Action, Error> {
        let Some(whole) = self.ctx.whole(self.pod).await? else {
            return Ok(Action::await_change());
        };
        let member = self.member();
        // The offload policy: a refused pod fails here, before anything reaches the member.
        let allowed = policy::check(&whole, &self.ctx.config.policy)
            .and_then(|()| policy::check_pool(&whole, &pool.runtime_class_names))
            .and_then(|()| policy::check_mode(&whole, pool.mode));
        if let Err(violation) = allowed {
            let msg = format!("not offloaded to member {}: {violation}", member.name);
            fail_pod(self.ctx, self.pod, &refusal(keys::REASON_OFFLOAD_POLICY, &msg)).await?;
            return Ok(Action::await_change());
        }
        // A copy that cannot exist in the member fails the pod.
        let member_ns = match member.namespaces.offload_ns(&self.namespace) {
            Ok(ns) => ns,
            Err(e) => {
                let e = translate::TranslateError::NamespaceTooLong(e);
                let msg = format!("not offloaded to member {}: {e}", member.name);
                fail_pod(self.ctx, self.pod, &refusal(e.reason(), &msg)).await?;
                return Ok(Action::await_change());
            }
        };
        let mut offload = translate::offload_pod(&whole, &self.target(&whole, pool, &member_ns))?;
        if let Some(wait) = self.ensure_namespace(&member_ns).await? {
            return Ok(wait);
        }
        if let Some(wait) = self.reflect(&mut offload).await? {
            return Ok(wait);
        }
        if let Some(wait) = self.join_gang(&whole, &mut offload, pool).await? {
            return Ok(wait);
        }
        self.create(&offload).await
    }

    /// In a member with a gang scheduler: the gang's PodGroup first, then the copy joins it
    /// (see [`gang_group`]); `Some` when the copy must wait. A member that does not serve the
    /// PodGroup API gets no copy at all: a gang half in a group it cannot have would be placed
    /// pod by pod.
    async fn join_gang(&self, whole: &Pod, offload: &mut Pod, pool: &PoolHandle) -> Result<Option<Action>, Error> {
        let member = self.member();
        let Some((scheduler, scheduler_name)) = member.gang_scheduling.as_ref() else { return Ok(None) };
        let cluster = &self.ctx.config.cluster_name;
        let Some(group) = gang_group::member_group(
            &whole.metadata,
            whole.spec.as_ref().and_then(tidepool_api::pod::scheduling_group),
            cluster,
            pool.node.as_str(),
        )
        .filter(|_| gang_group::joins(*scheduler, &whole.metadata)) else {
            return Ok(None);
        };
        let group = group.with_priority_class(offload.spec.as_ref().and_then(|s| s.priority_class_name.as_deref()));
        match gang_group::ensure(member, *scheduler, &group, &self.member_ns, cluster).await? {
            gang_group::Ensured::Ready => {
                gang_group::join(offload, *scheduler, scheduler_name, &group.name);
                Ok(None)
            }
            gang_group::Ensured::ApiMissing => {
                let (group_api, version, _) = scheduler.pod_group_api();
                let msg = format!(
                    "not offloaded to member {}: it has gangScheduler {} but does not serve PodGroups of {group_api}/{version}",
                    member.name,
                    scheduler.as_str()
                );
                publish(self.ctx, self.pod, EventType::Warning, keys::REASON_GANG_SCHEDULER_MISSING, &msg).await;
                Ok(Some(Action::requeue(GANG_API_RETRY)))
            }
        }
    }

    fn target<'t>(&'t self, whole: &Pod, pool: &'t PoolHandle, member_ns: &'t str) -> Target<'t> {
        let member = self.member();
        Target {
            cluster: &self.ctx.config.cluster_name,
            member: member.name.as_str(),
            namespace: member_ns,
            node_selector: &pool.node_selector,
            tolerations: &pool.tolerations,
            topology: &pool.topology,
            band: translate::copy_band(whole),
            copy_labels: &member.copy_labels,
            copy_annotations: &member.copy_annotations,
            max_termination_grace: member.max_termination_grace,
            mode: pool.mode,
            confinement: &member.confinement,
        }
    }

    /// The copy's namespace, made if need be; `Some` when the copy must wait: the member had
    /// the training namespace's name for itself, so the pod's namespace now maps to the
    /// prefixed one (said on the pod once) and the next reconcile makes the copy there.
    async fn ensure_namespace(&self, member_ns: &str) -> Result<Option<Action>, Error> {
        if ensure_namespace(self.ctx, self.watch, (&self.namespace, member_ns)).await? {
            return self.isolate(member_ns).await;
        }
        let member = self.member();
        let msg = format!(
            "member {} has a namespace {} of its own: this namespace's pods run in its namespace {} \
             there, where names that say {} (such as <service>.{}.svc) do not resolve",
            member.name,
            self.namespace,
            member.namespaces.member_ns(&self.namespace),
            self.namespace,
            self.namespace
        );
        publish(self.ctx, self.pod, EventType::Warning, keys::REASON_OFFLOAD_NAMESPACE_FALLBACK, &msg).await;
        Ok(Some(Action::requeue(Duration::from_millis(100))))
    }

    /// The member namespace's NetworkPolicy, before any copy goes there; `Some` (the pod
    /// waits, said on it) while it cannot be written.
    async fn isolate(&self, member_ns: &str) -> Result<Option<Action>, Error> {
        let Err(e) = self.watch.copies.isolate(member_ns).await else { return Ok(None) };
        let member = &self.member().name;
        warn!(member = %member, namespace = member_ns, error = %e, "cannot isolate the offload namespace");
        let msg = format!(
            "waiting for member {member} to take the NetworkPolicy {} of namespace {member_ns} \
             (no copy goes into an open namespace): {}",
            crate::isolation::POLICY_NAME,
            tidepool_api::text::shown(&e.to_string(), 512)
        );
        publish(self.ctx, self.pod, EventType::Warning, keys::REASON_OFFLOAD_ISOLATION, &msg).await;
        Ok(Some(Action::requeue(Duration::from_secs(5))))
    }

    /// Copies what `offload` references into the member namespace; `Some` when the copy
    /// must wait (or the pod has failed).
    async fn reflect(&self, offload: &mut Pod) -> Result<Option<Action>, Error> {
        let (ctx, member) = (self.ctx, &self.member().name);
        let references = referenced::references(offload.spec.as_ref().ok_or(Error::MissingField("spec"))?);
        if !references.is_empty() {
            // Until its copy shows what it references, the pod itself says so.
            ctx.wait_for(self.pod, &references)?;
        }
        let outcome = ctx.reflection(self.watch, &self.namespace, &self.member_ns).run(&references).await?;
        let (event, msg, after) = match outcome {
            Outcome::Ready(absent) => {
                // Optional sources that do not exist in training are not referenced in the
                // member either: its kubelet would take any object of that name there.
                if let Some(spec) = offload.spec.as_mut() {
                    referenced::drop_references(spec, &absent);
                }
                return Ok(None);
            }
            Outcome::Missing(missing) => {
                let msg = format!("waiting for {} before offloading to member {member}", missing.join(", "));
                ("ReferenceMissing", msg, MISSING_RETRY)
            }
            Outcome::Refused(why) => {
                let msg = format!("not offloaded to member {member}: {why}");
                fail_pod(ctx, self.pod, &refusal(keys::REASON_OFFLOAD_POLICY, &msg)).await?;
                return Ok(Some(Action::await_change()));
            }
            Outcome::Conflict(msg) => ("ReflectionConflict", msg, step::CONFLICT),
            Outcome::Retry => return Ok(Some(Action::requeue(Duration::from_secs(2)))),
        };
        publish(ctx, self.pod, EventType::Warning, event, &msg).await;
        Ok(Some(Action::requeue(after)))
    }

    /// Creates the copy ([`member_pods::create_copy`]); the member's watch brings it back,
    /// and with it the next sync.
    async fn create(&self, offload: &Pod) -> Result<Action, Error> {
        let (ctx, pod, member) = (self.ctx, self.pod, self.member());
        let (member_ns, name) = (&self.member_ns, pod.name_any());
        let created = member_pods::create_copy(&member.client, (member_ns, offload), (&ctx.config.cluster_name, pod))
            .await
            .map_err(|e| Error::member(&member.name, "create offload pod", e))?;
        match created {
            Created::Made => {
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
            Created::There => {}
            // Another origin's pod: reported, never overwritten.
            Created::Foreign(msg) => {
                let msg = format!("member {}: {msg}", member.name);
                publish(ctx, pod, EventType::Warning, "OffloadConflict", &msg).await;
                return Ok(Action::requeue(step::CONFLICT));
            }
            Created::PriorityClassesMissing(why) => {
                warn!(member = %member.name, error = %why, "offload PriorityClasses missing in the member: creating them again");
                tidepool_federation::member::bootstrap(&member.client)
                    .await
                    .map_err(|e| Error::member(&member.name, "create offload PriorityClasses", e))?;
                return Ok(Action::requeue(Duration::from_millis(200)));
            }
            Created::NamespaceGone => {
                // Create (and bind, and watch) it again next time.
                ctx.namespaces.locked(NAMESPACES)?.remove(&(member.name.clone(), member_ns.clone()));
                self.watch.copies.leave(member_ns);
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
        }
        Ok(Action::await_change())
    }

    /// Step::Follow, down: the notice to the copy, its references current. Its status
    /// comes up on the other queue ([`status_up`]).
    ///
    /// Nothing waits on a timer in the steady state: the watches of both clusters (and of
    /// the sources) trigger every change, and their relists trigger every pod. A timer per
    /// pod would cost memory in proportion to the pods mirrored.
    async fn follow(&self, copy: &OffloadPod) -> Result<Action, Error> {
        // Notices written on the training pod travel down, so the trainer sees them in
        // /etc/tidepool/annotations.
        sync_notice(self.watch, self.pod, copy).await?;
        let retry = self.refresh_references(copy).await?;
        Ok(retry.map_or_else(Action::await_change, Action::requeue))
    }

    /// Step::Follow, up: the copy's status onto the training pod, unless it changed since
    /// the cache's view of it (then its newer version, on its way, triggers this again).
    async fn status(&self, copy: &OffloadPod) -> Result<Action, Error> {
        let Some(mut member_status) = copy.status() else {
            return Ok(Action::await_change());
        };
        let host_network = self.pod.spec.host_network;
        crate::bounded::within_pod_network(&mut member_status, &self.member().declared_pod_network, host_network);
        let ctx = self.ctx;
        let mut desired = translate::training_status(&member_status, &ctx.config.kubelet.node_address.to_string());
        let pool = self.pod.node_name().and_then(|node| self.member().pool_for_node(node));
        if let Some(colocation) = pool.and_then(|p| p.mode.colocation()) {
            colocation.status_to_training(&mut desired);
        }
        translate::keep_tidepool_conditions(&mut desired, self.pod.status.tidepool_conditions());
        translate::hold_for_reclaim(&mut desired, self.pod.status.tidepool_conditions());
        let synced = SyncedStatus::of(Some(&desired));
        if synced.all == self.pod.status.synced.all {
            return Ok(Action::await_change());
        }
        // A Pending pod's new conditions wait a moment for the pod to run (coalescing two
        // writes into one); the offload pod turning Running triggers this sooner.
        let now = jiff::Timestamp::now();
        if let Some(wait) = translate::status_settles_in(&self.pod.status, &desired, &synced, now, PENDING_SETTLE) {
            return Ok(match wait >= translate::UNTIL_NEXT_CHANGE {
                true => Action::await_change(),
                false => Action::requeue(wait),
            });
        }
        if let Some(wait) = translate::terminal_settles_in(&desired, now, TERMINAL_SETTLE) {
            return Ok(Action::requeue(wait));
        }
        patch_status(ctx, self.pod, &desired).await?;
        Ok(Action::await_change())
    }

    /// Keeps the copy's ConfigMap and Secret copies current while it runs; when to look
    /// again, if a source could not be copied now.
    async fn refresh_references(&self, copy: &OffloadPod) -> Result<Option<Duration>, Error> {
        if copy.references.is_empty() {
            return Ok(None);
        }
        let _slot = slot(&self.watch.writes).await;
        match self.ctx.reflection(self.watch, &self.namespace, &self.member_ns).run(&copy.references).await? {
            // A source deleted in training is deleted in the member too; the pod runs on,
            // as it would with a kubelet of its own.
            Outcome::Ready(_) | Outcome::Missing(_) => Ok(None),
            Outcome::Refused(msg) | Outcome::Conflict(msg) => {
                publish(self.ctx, self.pod, EventType::Warning, "ReflectionFailed", &msg).await;
                Ok(None)
            }
            Outcome::Retry => Ok(Some(Duration::from_secs(2))),
        }
    }
}

/// Copies the reclaim deadline from the training pod to its offload copy, once tidepool's
/// notice condition is there ([`translate::notice_for_copy`]), and takes it off the copy once
/// the notice is withdrawn (a member's eviction request withdrawn before the deadline).
async fn sync_notice(watch: &OffloadWatch, pod: &PodLite, copy: &OffloadPod) -> Result<(), Error> {
    let want = translate::notice_for_copy(pod.annotations(), pod.status.tidepool_conditions());
    if copy.reclaim_deadline() == want {
        return Ok(());
    }
    let member = &watch.member;
    let _slot = slot(&watch.writes).await;
    let wrote = member_pods::sync_notice(&member.client, copy, want)
        .await
        .map_err(|e| Error::member(&member.name, "copy reclaim notice to offload pod", e))?;
    match (wrote, want) {
        (false, _) => {}
        (true, Some(_)) => info!(member = %member.name, "reclaim notice copied to the offload pod"),
        (true, None) => info!(member = %member.name, "withdrawn reclaim notice taken off the offload pod"),
    }
    Ok(())
}

/// The offload namespace `ns` for training namespace `origin`, made (and entered) once per
/// session: labelled as this training cluster's and this member's, with the training
/// namespace it holds. A namespace of that name that is not ours is never used: a same-named
/// one falls back to the prefixed name (`Ok(false)`: map again and retry), a prefixed one is
/// an error.
async fn ensure_namespace(ctx: &Context, watch: &OffloadWatch, (origin, ns): (&str, &str)) -> Result<bool, Error> {
    let member = &watch.member;
    let key = (member.name.clone(), ns.to_owned());
    if ctx.namespaces.locked(NAMESPACES)?.contains(&key) {
        return Ok(true);
    }
    let labels = [
        (keys::LABEL_MANAGED_BY, keys::MANAGED_BY),
        (keys::LABEL_ORIGIN_CLUSTER, ctx.config.cluster_name.as_str()),
        (keys::LABEL_ORIGIN_MEMBER, member.name.as_str()),
        (keys::LABEL_ORIGIN_NAMESPACE, origin),
        ("pod-security.kubernetes.io/enforce", member.confinement.pod_security.as_str()),
        ("pod-security.kubernetes.io/warn", member.confinement.pod_security.as_str()),
    ];
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.to_owned()),
            labels: Some(labels.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect()),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<Namespace>::all(member.client.clone());
    match api.create(&PostParams::default(), &namespace).await {
        Ok(_) => info!(member = %member.name, namespace = ns, "offload namespace created"),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // There already: ours, or somebody's — another training cluster's tidepool
            // (whose copies our pods would mount), another MemberCluster's, or the member's
            // own. Nothing goes into, and no role is bound in, a namespace that is not ours.
            let existing =
                api.get_opt(ns).await.map_err(|e| Error::member(&member.name, "read offload namespace", e))?;
            let foreign = existing.and_then(|n| {
                translate::foreign_namespace(&n.metadata, &ctx.config.cluster_name, (member.name.as_str(), origin))
            });
            if let Some(owner) = foreign {
                if ns == origin && member.namespaces.fall_back(origin) {
                    warn!(member = %member.name, namespace = ns, owner, "same-named offload namespace taken; falling back to the prefix");
                    return Ok(false);
                }
                return Err(Error::ForeignNamespace { member: member.name.clone(), namespace: ns.to_owned(), owner });
            }
        }
        Err(e) => return Err(Error::member(&member.name, "create offload namespace", e)),
    }
    watch.copies.enter(ns).await;
    ctx.namespaces.locked(NAMESPACES)?.insert(key);
    Ok(true)
}

/// One of `writes`' slots, held until dropped. `None` only if the semaphore were closed,
/// which none is.
async fn slot(writes: &Semaphore) -> Option<SemaphorePermit<'_>> {
    writes.acquire().await.ok()
}

/// Writes `status` onto the training pod as the cache saw it: if it changed since (the down
/// sync failed it, the dispatcher noted a reclaim), nothing is written, and the newer version
/// on its way through the watch triggers the status sync again.
async fn patch_status(ctx: &Context, pod: &PodLite, status: &PodStatus) -> Result<(), Error> {
    let _slot = slot(&ctx.training_writes).await;
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let patch = json!({ "metadata": { "resourceVersion": pod.metadata.resource_version }, "status": status });
    match api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
        Ok(_) => {
            debug!(status = %status_line(status), "training pod status written");
            Ok(())
        }
        Err(e) if tidepool_federation::api_code(&e, &[409]) => Ok(()),
        Err(e) => Err(Error::training("update pod status", e)),
    }
}

/// A status in one line for the debug log: phase and reason, the conditions that hold, each
/// container's state (a test that fails on one version of a pod reads its writes here).
fn status_line(status: &PodStatus) -> String {
    let conditions = status.conditions.iter().flatten().filter(|c| c.status == "True").map(|c| c.type_.as_str());
    let containers = status.container_statuses.iter().flatten().map(|c| {
        let state = c.state.as_ref();
        match (state.and_then(|s| s.running.as_ref()), state.and_then(|s| s.terminated.as_ref())) {
            (Some(_), _) => format!("{}:running", c.name),
            (None, Some(t)) => format!("{}:terminated({})", c.name, t.exit_code),
            (None, None) => format!("{}:waiting", c.name),
        }
    });
    format!(
        "{} {} [{}] [{}]",
        status.phase.as_deref().unwrap_or("-"),
        status.reason.as_deref().unwrap_or("-"),
        conditions.collect::<Vec<_>>().join(","),
        containers.collect::<Vec<_>>().join(",")
    )
}

/// Fails the training pod with `reason`, unless it changed since the cache's view of it
/// (then its next reconcile decides again): a pod another controller has just finished —
/// the dispatcher reclaiming it, say, and deleting its copy — keeps that controller's
/// reason, whichever watch reaches this controller first.
/// An end of the pod's own making (its spec refused): no disruption.
fn refusal<'a>(reason: &'a str, message: &'a str) -> Ending<'a> {
    Ending { reason, message, disruption: None }
}

/// Ends the training pod as `end` says, in one status write (see
/// [`tidepool_api::terminal`]): read whole first, since the lists it rewrites (conditions,
/// container states) are replaced whole by a merge patch; written only over the version read.
async fn fail_pod(ctx: &Context, pod: &PodLite, end: &Ending<'_>) -> Result<(), Error> {
    let Some(whole) = ctx.whole(pod).await? else { return Ok(()) };
    let now = Time(jiff::Timestamp::now());
    let status = terminal_status(whole.status.as_ref(), end, &[], &now);
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let patch = json!({ "metadata": { "resourceVersion": whole.metadata.resource_version }, "status": status });
    let written = {
        let _slot = slot(&ctx.training_writes).await;
        api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await
    };
    let reason = end.reason;
    match written {
        Ok(_) => {}
        Err(e) if tidepool_federation::api_code(&e, &[409]) => {
            info!(reason, "training pod changed since this decision; deciding again");
            return Ok(());
        }
        Err(e) => return Err(Error::training("update pod status", e)),
    }
    warn!(reason, message = end.message, "training pod failed");
    publish(ctx, pod, EventType::Warning, reason, end.message).await;
    Ok(())
}

/// Publishes an Event about `pod`. Written straight to the API rather than through kube's
/// `Recorder`, which keeps every Event it published for minutes (to count repeats) and
/// scans all of them on each publish: with an Event per offloaded pod, that is a cache the
/// size of the cluster and a scan of it per pod.
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

#[cfg(test)]
mod future_sizes {
    use super::*;

    fn size_of_future<F: std::future::Future>(_: impl Fn(Arc<PodLite>, Arc<Context>) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Up to [`RECONCILES_IN_FLIGHT`] of these wait at once in a burst, most of them for a
    /// write slot: the steps that call an API are boxed when they run, so a waiting one holds
    /// a few hundred bytes more than its facts (it was 11.8 KB, 12 MB for a burst's 1,024).
    #[test]
    fn a_reconcile_waiting_its_turn_holds_little() {
        let (down, up) = (size_of_future(timed_reconcile), size_of_future(timed_status_up));
        assert!(down <= 2048, "the down-sync's future is {down} bytes");
        assert!(up <= 1536, "the status sync's future is {up} bytes");
    }
}

#[cfg(test)]
mod status_line_tests {
    use super::*;

    #[test]
    fn a_status_line_names_the_phase_the_conditions_that_hold_and_each_containers_state() {
        let status: PodStatus = serde_json::from_value(json!({
            "phase": "Failed", "reason": "Evicted",
            "conditions": [{"type": "DisruptionTarget", "status": "True"}, {"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "main", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"terminated": {"exitCode": 137}}},
                {"name": "side", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                 "state": {"running": {}}}
            ]
        }))
        .unwrap();
        assert_eq!(status_line(&status), "Failed Evicted [DisruptionTarget] [main:terminated(137),side:running]");
        assert_eq!(status_line(&PodStatus::default()), "- - [] []");
    }
}
