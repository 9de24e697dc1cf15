//! Service mirroring, the I/O: one task per member session keeps the member's mirrors of
//! training Services equal to what [`services::wanted`] says. What is mirrored and how a
//! mirror looks is decided in [`crate::services`].
//!
//! A pass reads the training Services from a watch, the copies from the session's offload
//! cache and the training pods' labels from the shared training cache, so deciding costs no
//! API call; it then lists this instance's mirrors in the offload namespaces that have or
//! had some (one list each) and writes only what differs. Passes run when a training Service
//! or a copy changes (at most one every [`SETTLE`]), and every [`PERIOD`] as a safety net
//! (which also removes the mirrors of Services deleted while tidepool was down).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Resource};
use tidepool_api::keys;
use tidepool_api::pod::placed_natively;
use tidepool_federation::PodEvent;
use tidepool_federation::training::listed;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::context::{Context, OffloadWatch};
use crate::services::{self, MirrorTarget, NativePod, Step, key_of};

/// Safety-net pass interval.
const PERIOD: Duration = Duration::from_secs(30);
/// Changes arriving together are answered by one pass.
const SETTLE: Duration = Duration::from_millis(300);

/// Keeps `watch`'s member's mirrors in line until its session ends. `trigger` says a copy
/// changed; training Service changes are watched here.
pub(crate) async fn run(ctx: Arc<Context>, watch: OffloadWatch, mut trigger: mpsc::Receiver<()>) {
    let member = watch.member.clone();
    let (services, writer) = reflector::store::<Service>();
    let (changed_tx, mut changed) = mpsc::channel::<()>(1);
    let events = watcher(Api::<Service>::all(ctx.training.clone()), watcher::Config::default())
        .default_backoff()
        .modify(|s| s.metadata.managed_fields = None)
        .reflect(writer)
        .touched_objects()
        .take_until(member.cancelled.clone().cancelled_owned());
    member.tasks.spawn("Service watch", async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            if let Err(e) = event {
                warn!(error = %e, "training Service watch failed; retrying with backoff");
            }
            let _ = changed_tx.try_send(());
        }
    });
    // Native pods coming, going or changing address change the native slices.
    let mut native_changes =
        std::pin::pin!(ctx.training_pods.subscribe().filter(|e| std::future::ready(touches_native(e))));
    let mut state = State::default();
    loop {
        tokio::select! {
            () = member.cancelled.cancelled() => return,
            Some(()) = trigger.recv() => {}
            Some(()) = changed.recv() => {}
            Some(_) = native_changes.next() => {}
            () = tokio::time::sleep(PERIOD) => {}
        }
        tokio::time::sleep(SETTLE).await;
        while trigger.try_recv().is_ok() || changed.try_recv().is_ok() {}
        if !listed(&services, Duration::from_secs(10)).await || !watch.store.listed(Duration::from_secs(10)).await {
            continue;
        }
        if let Err(e) = pass(&ctx, &watch, &services, &mut state).await {
            warn!(error = %e, "Service mirror pass failed; tried again later");
        }
    }
}

/// Whether a training pod event may change a native slice: a pod the dispatcher placed on a
/// native node changed or went, or changes may have been missed.
fn touches_native(event: &PodEvent) -> bool {
    match event {
        PodEvent::Applied(p) | PodEvent::Deleted(p) => placed_natively(&p.metadata, p.node_name()),
        PodEvent::Relisted | PodEvent::Lagged => true,
    }
}

/// What a session's mirror remembers between passes.
#[derive(Default)]
struct State {
    /// Offload namespaces holding mirrors after the last pass; `None` before the first,
    /// which looks in all of this instance's offload namespaces.
    namespaces: Option<BTreeSet<String>>,
    /// Training Services (UID) whose conflict was told already, so it is told once.
    told: HashSet<String>,
    /// Offload namespaces holding native slices after the last pass (see `namespaces`).
    slices: Option<BTreeSet<String>>,
}

/// One pass: decide the mirrors wanted, list the ones there, write the difference.
async fn pass(
    ctx: &Context,
    watch: &OffloadWatch,
    services: &Store<Service>,
    state: &mut State,
) -> Result<(), kube::Error> {
    // 1. The mirrors wanted, each with its training Service.
    let desired = desired(ctx, watch, &services.state());
    // 2. The mirrors there, in the namespaces that have or may have some.
    let mut namespaces: BTreeSet<String> = desired.iter().filter_map(|(m, _)| m.metadata.namespace.clone()).collect();
    match &state.namespaces {
        Some(known) => namespaces.extend(known.iter().cloned()),
        None => namespaces.extend(offload_namespaces(ctx, watch).await?),
    }
    let existing = mirrors_in(ctx, watch, &namespaces).await?;
    // 3. Write the difference.
    let wanted: Vec<Service> = desired.iter().map(|(m, _)| m.clone()).collect();
    let sources: BTreeMap<(String, String), &Service> =
        desired.iter().map(|(m, s)| (key_of(&m.metadata), &**s)).collect();
    let mut present: BTreeMap<(String, String), Service> =
        existing.iter().map(|m| (key_of(&m.metadata), m.clone())).collect();
    for step in services::plan(&wanted, &existing) {
        let source = match &step {
            Step::Create(m) | Step::Update(m) | Step::Recreate(m) => sources.get(&key_of(&m.metadata)).copied(),
            Step::Delete(..) => None,
        };
        let _slot = watch.writes.acquire().await;
        match execute(ctx, watch, &step, &existing, source, &mut state.told).await {
            Ok(Some(written)) => drop(present.insert(key_of(&written.metadata), written)),
            Ok(None) => {
                if let Step::Delete(ns, name) = &step {
                    present.remove(&(ns.clone(), name.clone()));
                }
            }
            Err(e) => warn!(error = %e, "Service mirror write failed; tried again on the next pass"),
        }
    }
    let mut holding: BTreeSet<String> = wanted.iter().filter_map(|m| m.metadata.namespace.clone()).collect();
    holding.extend(existing.iter().filter_map(|m| m.metadata.namespace.clone()));
    state.namespaces = Some(holding);
    // 4. The native slices of the mirrors there.
    crate::native_names::pass(ctx, watch, &desired, &present, &mut state.slices).await
}

/// The mirrors wanted in `watch`'s member, from the caches: the copies there (each with its
/// training pod's namespace and labels) and the native pods against the training Services
/// `all`.
fn desired(ctx: &Context, watch: &OffloadWatch, all: &[Arc<Service>]) -> Vec<(Service, Arc<Service>)> {
    let member = &watch.member;
    let copies: Vec<(String, Option<BTreeMap<String, String>>)> = watch
        .store
        .state()
        .iter()
        .filter_map(|copy| {
            let pod = ctx.pods.get(&copy.origin()?)?;
            let namespace = pod.metadata.namespace.clone().filter(|_| copy.is_copy_of(&pod))?;
            Some((namespace, pod.metadata.labels.clone()))
        })
        .collect();
    let native_pods = crate::native_names::native_pods(ctx);
    let native: Vec<NativePod<'_>> = native_pods.iter().filter_map(|p| crate::native_names::as_native(p)).collect();
    let by_key: BTreeMap<(String, String), &Arc<Service>> = all.iter().map(|s| (key_of(&s.metadata), s)).collect();
    services::wanted(all.iter().map(|s| &**s), &copies, &native)
        .into_iter()
        .filter_map(|key| {
            let source = by_key.get(&key)?;
            let namespace = member.namespaces.member_ns(&key.0);
            let target =
                MirrorTarget { cluster: &ctx.config.cluster_name, member: member.name.as_str(), namespace: &namespace };
            Some((services::mirrored_service(source, &target)?, Arc::clone(source)))
        })
        .collect()
}

/// This instance's mirrors in `namespaces` of the member (one list each).
async fn mirrors_in(
    ctx: &Context,
    watch: &OffloadWatch,
    namespaces: &BTreeSet<String>,
) -> Result<Vec<Service>, kube::Error> {
    let member = &watch.member;
    let selector =
        ListParams::default().labels(&services::mirror_selector(&ctx.config.cluster_name, member.name.as_str()));
    let mut existing = Vec::new();
    for ns in namespaces {
        // Bound there first (once per namespace; the namespace watch may not have got to it
        // yet): a list refused for want of the binding would be a needless 403.
        watch.copies.enter(ns).await;
        match Api::<Service>::namespaced(member.client.clone(), ns).list(&selector).await {
            Ok(list) => existing.extend(list.items),
            // Not bound there (the binding failed) or gone: nothing of ours.
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 404 => debug!(namespace = ns, "no mirrors readable"),
            Err(e) => return Err(e),
        }
    }
    Ok(existing)
}

/// This member's offload namespaces (this instance's, with its prefix: other members may
/// share the API server).
async fn offload_namespaces(ctx: &Context, watch: &OffloadWatch) -> Result<Vec<String>, kube::Error> {
    let selector = format!(
        "{}={},{}={}",
        keys::LABEL_MANAGED_BY,
        keys::MANAGED_BY,
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name
    );
    let list = Api::<Namespace>::all(watch.member.client.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await?;
    Ok(list.items.into_iter().filter(|n| watch.copies.is_ours(&n.metadata)).filter_map(|n| n.metadata.name).collect())
}

async fn execute(
    ctx: &Context,
    watch: &OffloadWatch,
    step: &Step,
    existing: &[Service],
    source: Option<&Service>,
    told: &mut HashSet<String>,
) -> Result<Option<Service>, kube::Error> {
    let member = &watch.member;
    let api = |ns: &str| Api::<Service>::namespaced(member.client.clone(), ns);
    let ns_name = key_of;
    match step {
        Step::Create(mirror) => {
            let (ns, name) = ns_name(&mirror.metadata);
            match api(&ns).create(&PostParams::default(), mirror).await {
                Ok(made) => {
                    info!(member = %member.name, namespace = ns, service = name, "Service mirrored");
                    return Ok(Some(made));
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    // Somebody's Service of that name (ours would have been listed): never
                    // overwritten; the tenant is told on the training Service, once.
                    let theirs = api(&ns).get_opt(&name).await?;
                    let ours = theirs.as_ref().is_some_and(|s| {
                        services::is_ours(&s.metadata, &ctx.config.cluster_name, member.name.as_str())
                    });
                    if let (false, Some(source)) = (ours, source) {
                        conflict(ctx, watch, source, &ns, told).await;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Step::Update(mirror) => {
            let (ns, name) = ns_name(&mirror.metadata);
            let Some(old) = existing.iter().find(|s| ns_name(&s.metadata) == (ns.clone(), name.clone())) else {
                return Ok(None);
            };
            let written = api(&ns).replace(&name, &PostParams::default(), &services::updated(old, mirror)).await?;
            info!(member = %member.name, namespace = ns, service = name, "mirrored Service updated");
            return Ok(Some(written));
        }
        Step::Recreate(mirror) => {
            let (ns, name) = ns_name(&mirror.metadata);
            delete(&api(&ns), &name).await?;
            let made = api(&ns).create(&PostParams::default(), mirror).await?;
            info!(member = %member.name, namespace = ns, service = name, "mirrored Service made again");
            return Ok(Some(made));
        }
        Step::Delete(ns, name) => {
            delete(&api(ns), name).await?;
            info!(member = %member.name, namespace = ns, service = name, "mirrored Service removed: no copy selected");
        }
    }
    Ok(None)
}

async fn delete(api: &Api<Service>, name: &str) -> Result<(), kube::Error> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// A Warning Event on training Service `source`: its mirror is held back by a member
/// Service of the same name that is not tidepool's.
async fn conflict(ctx: &Context, watch: &OffloadWatch, source: &Service, member_ns: &str, told: &mut HashSet<String>) {
    let uid = source.metadata.uid.clone().unwrap_or_default();
    if !told.insert(uid) {
        return;
    }
    let name = source.metadata.name.clone().unwrap_or_default();
    let namespace = source.metadata.namespace.clone().unwrap_or_default();
    let note = format!(
        "member {} already has Service {member_ns}/{name}, not made by tidepool: it is left untouched, and pods \
         offloaded there do not reach this Service by name",
        watch.member.name
    );
    warn!(member = %watch.member.name, namespace, service = name, "mirror refused: member Service not ours");
    let now = jiff::Timestamp::now();
    let event = K8sEvent {
        metadata: ObjectMeta {
            name: Some(format!("{}.{:x}", &name[..name.len().min(230)], now.as_nanosecond())),
            namespace: Some(namespace.clone()),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        type_: Some("Warning".to_owned()),
        reason: Some(keys::REASON_SERVICE_CONFLICT.to_owned()),
        note: Some(note),
        action: Some("Mirror".to_owned()),
        regarding: Some(source.object_ref(&())),
        reporting_controller: Some("tidepool".to_owned()),
        reporting_instance: Some(std::env::var("POD_NAME").unwrap_or_else(|_| "tidepool".to_owned())),
        ..Default::default()
    };
    if let Err(e) =
        Api::<K8sEvent>::namespaced(ctx.training.clone(), &namespace).create(&PostParams::default(), &event).await
    {
        warn!(error = %e, "cannot publish event");
    }
}
