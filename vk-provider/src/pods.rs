//! The pod controller: training pods bound to a virtual node ⇄ offload pods in its member.
//!
//! Reconciles are triggered by training pod changes and by offload pod changes (each member's
//! offload watch maps a member pod back to its training pod by the origin annotations), and
//! read the member's state from that watch's cache: steady state costs the member no reads.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tidepool_config::{BridgeConfig, MemberName, keys};
use tidepool_federation::{MemberHandle, Members, PoolHandle};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, WatchStream};
use tracing::{Instrument, info, info_span, instrument, warn};

use crate::Error;
use crate::translate::{self, Target};

/// Safety-net resync of every pod on a virtual node.
const RESYNC: Duration = Duration::from_secs(300);

pub(crate) struct Context {
    training: Client,
    config: Arc<BridgeConfig>,
    members: watch::Receiver<Members>,
    offload: Mutex<HashMap<MemberName, OffloadWatch>>,
    namespaces: Mutex<HashSet<(MemberName, String)>>,
    recorder: Recorder,
}

/// The offload pods of one member session, cached.
#[derive(Clone)]
struct OffloadWatch {
    member: Arc<MemberHandle>,
    store: Store<Pod>,
}

pub async fn run(training: Client, config: Arc<BridgeConfig>, members: watch::Receiver<Members>) {
    let (trigger_tx, trigger_rx) = mpsc::channel::<ObjectRef<Pod>>(1024);
    let recorder = Recorder::new(training.clone(), Reporter { controller: "tidepool".into(), instance: None });
    let ctx = Arc::new(Context {
        training: training.clone(),
        config,
        members: members.clone(),
        offload: Mutex::new(HashMap::new()),
        namespaces: Mutex::new(HashSet::new()),
        recorder,
    });
    tokio::spawn(supervise_offload_watches(ctx.clone(), trigger_tx));
    // A member (re)connecting re-checks every pod: its pods may have waited for it.
    let member_changes = WatchStream::new(members).map(|_| ());
    Controller::new(Api::<Pod>::all(training), watcher::Config::default())
        .reconcile_on(ReceiverStream::new(trigger_rx))
        .reconcile_all_on(member_changes)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

fn error_policy(pod: Arc<Pod>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(pod = %pod.name_any(), namespace = pod.namespace().unwrap_or_default(), %error, "pod sync failed; retrying");
    Action::requeue(if error.is_transient() { Duration::from_secs(2) } else { Duration::from_secs(30) })
}

/// Starts an offload watch for every member session and drops those of ended sessions.
async fn supervise_offload_watches(ctx: Arc<Context>, trigger: mpsc::Sender<ObjectRef<Pod>>) {
    let mut members = ctx.members.clone();
    loop {
        let current = members.borrow_and_update().clone();
        if let Ok(mut watches) = ctx.offload.lock() {
            watches.retain(|name, w| current.get(name).is_some_and(|m| Arc::ptr_eq(m, &w.member)));
            for (name, member) in &current {
                if !watches.contains_key(name) {
                    watches.insert(name.clone(), start_offload_watch(&ctx.config, member.clone(), trigger.clone()));
                }
            }
        }
        if members.changed().await.is_err() {
            return;
        }
    }
}

fn start_offload_watch(
    config: &BridgeConfig,
    member: Arc<MemberHandle>,
    trigger: mpsc::Sender<ObjectRef<Pod>>,
) -> OffloadWatch {
    let (store, writer) = reflector::store();
    let selector =
        format!("{}={},{}={}", keys::LABEL_ORIGIN_CLUSTER, config.cluster_name, keys::LABEL_ORIGIN_MEMBER, member.name);
    let events = watcher(Api::<Pod>::all(member.client.clone()), watcher::Config::default().labels(&selector))
        .default_backoff()
        .reflect(writer)
        .touched_objects()
        .take_until(member.cancelled.clone().cancelled_owned());
    tokio::spawn(
        async move {
            let mut events = std::pin::pin!(events);
            while let Some(ev) = events.next().await {
                match ev {
                    Ok(pod) => {
                        if let Some(origin) = origin_of(&pod) {
                            let _ = trigger.send(origin).await;
                        }
                    }
                    Err(e) => warn!(error = %e, "offload pod watch failed; retrying with backoff"),
                }
            }
        }
        .instrument(info_span!("offload_watch", member = %member.name)),
    );
    OffloadWatch { member, store }
}

/// The training pod an offload pod copies, from its origin annotations.
fn origin_of(offload: &Pod) -> Option<ObjectRef<Pod>> {
    let a = offload.metadata.annotations.as_ref()?;
    let ns = a.get(keys::ANNOTATION_ORIGIN_NAMESPACE)?;
    let name = a.get(keys::ANNOTATION_ORIGIN_NAME)?;
    Some(ObjectRef::new(name).within(ns))
}

impl Context {
    /// The member session and pool behind a virtual node, with that session's offload cache.
    fn route(&self, node: &str) -> Option<(OffloadWatch, PoolHandle)> {
        let watches = self.offload.lock().ok()?;
        watches.values().find_map(|w| w.member.pool_for_node(node).map(|p| (w.clone(), p.clone())))
    }
}

#[instrument(skip_all, fields(pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default()))]
async fn reconcile(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
        return Ok(Action::await_change());
    };
    let Some((watch, pool)) = ctx.route(node) else {
        // Not a virtual node of ours, or its member is not connected right now: a member
        // (re)connecting triggers every pod again.
        return Ok(Action::await_change());
    };
    let member = &watch.member;
    if tokio::time::timeout(Duration::from_secs(10), watch.store.wait_until_ready()).await.is_err() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let namespace = pod.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
    let name = pod.name_any();
    let member_ns = translate::member_namespace(&member.namespace_prefix, &namespace);
    let existing = watch.store.get(&ObjectRef::new(&name).within(&member_ns));
    let copy = existing.as_deref().filter(|o| translate::is_copy_of(o, &pod));

    // 1. Deleted in training: delete the offload copy first, then finish the training pod.
    if pod.metadata.deletion_timestamp.is_some() {
        if let Some(copy) = copy {
            if copy.metadata.deletion_timestamp.is_none() {
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
        match Api::<Pod>::namespaced(ctx.training.clone(), &namespace).delete(&name, &dp).await {
            Ok(_) => {}
            Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => {}
            Err(e) => return Err(Error::training("finish pod deletion", e)),
        }
        info!(member = %member.name, "offload pod gone; training pod deletion finished");
        return Ok(Action::await_change());
    }

    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let terminal = matches!(phase, Some("Succeeded" | "Failed"));

    let Some(copy) = copy else {
        if existing.is_some() {
            // 2. A pod of the same name that is not ours: never overwrite it.
            let msg = format!("member {} already has pod {member_ns}/{name} with another origin", member.name);
            publish(&ctx, &pod, EventType::Warning, "OffloadConflict", &msg).await;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        if terminal {
            return Ok(Action::await_change());
        }
        if pod.status.as_ref().is_some_and(|s| s.host_ip.is_some()) {
            // 3. It ran in the member and is gone without our deleting it: the member evicted
            //    or preempted it (its last status, copied up, says which), or someone deleted it.
            let (reason, why) = translate::member_disruption(pod.status.as_ref());
            let msg = format!("offload pod {member_ns}/{name} {why} in member {}", member.name);
            fail_pod(&ctx, &pod, reason, &msg).await?;
            return Ok(Action::await_change());
        }
        // 4. Create the offload copy.
        ensure_namespace(&ctx, member, &member_ns).await?;
        let target = Target {
            cluster: &ctx.config.cluster_name,
            member: member.name.as_str(),
            namespace_prefix: &member.namespace_prefix,
            node_selector: &pool.node_selector,
            band: translate::band_of(&pod),
        };
        let offload = translate::offload_pod(&pod, &target)?;
        match Api::<Pod>::namespaced(member.client.clone(), &member_ns).create(&PostParams::default(), &offload).await {
            Ok(_) => {
                info!(member = %member.name, "offload pod created");
                let msg = format!("created {member_ns}/{name} in member {}", member.name);
                publish(&ctx, &pod, EventType::Normal, "OffloadCreated", &msg).await;
            }
            // Already there: the watch brings it and the next reconcile checks its origin.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {
                // The namespace went away under us; create it again next time.
                if let Ok(mut known) = ctx.namespaces.lock() {
                    known.remove(&(member.name.clone(), member_ns.clone()));
                }
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
            Err(e) => return Err(Error::member(&member.name, "create offload pod", e)),
        }
        return Ok(Action::requeue(RESYNC));
    };

    // 5. The training pod ended here (reclaimed, or failed by tidepool): stop its copy.
    if terminal {
        if copy.metadata.deletion_timestamp.is_none() {
            delete_offload(member, copy, Some(0)).await?;
        }
        return Ok(Action::await_change());
    }

    // 6a. The member is deleting the copy on its own (eviction, preemption by an online
    //     pod): the training pod fails now, with the member's reason.
    if copy.metadata.deletion_timestamp.is_some() {
        let (reason, why) = translate::member_disruption(copy.status.as_ref());
        let msg = format!("offload pod {member_ns}/{name} {why} in member {}", member.name);
        fail_pod(&ctx, &pod, reason, &msg).await?;
        return Ok(Action::await_change());
    }

    // 6. Notices written on the training pod travel down, so the trainer sees them in
    //    /etc/tidepool/annotations.
    sync_notice(member, &pod, copy).await?;

    // 7. Copy status up.
    let Some(member_status) = copy.status.as_ref() else {
        return Ok(Action::requeue(RESYNC));
    };
    let mut desired = translate::training_status(member_status, &ctx.config.kubelet.node_address.to_string());
    translate::keep_tidepool_conditions(&mut desired, pod.status.as_ref());
    if !translate::status_in_sync(pod.status.as_ref(), &desired) {
        patch_status(&ctx, &pod, &desired).await?;
    }
    Ok(Action::requeue(RESYNC))
}

/// Copies the reclaim deadline from the training pod to its offload copy.
async fn sync_notice(member: &MemberHandle, pod: &Pod, copy: &Pod) -> Result<(), Error> {
    let key = keys::ANNOTATION_RECLAIM_DEADLINE;
    let want = pod.annotations().get(key);
    if want.is_none() || want == copy.annotations().get(key) {
        return Ok(());
    }
    let api = Api::<Pod>::namespaced(member.client.clone(), &copy.namespace().unwrap_or_default());
    let patch = json!({ "metadata": { "annotations": { key: want } } });
    api.patch(&copy.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(|e| Error::member(&member.name, "copy reclaim notice to offload pod", e))?;
    info!(member = %member.name, "reclaim notice copied to the offload pod");
    Ok(())
}

async fn delete_offload(member: &MemberHandle, copy: &Pod, grace: Option<u32>) -> Result<(), Error> {
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

async fn ensure_namespace(ctx: &Context, member: &MemberHandle, ns: &str) -> Result<(), Error> {
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
    match Api::<Namespace>::all(member.client.clone()).create(&PostParams::default(), &namespace).await {
        Ok(_) => info!(member = %member.name, namespace = ns, "offload namespace created"),
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(Error::member(&member.name, "create offload namespace", e)),
    }
    if let Ok(mut known) = ctx.namespaces.lock() {
        known.insert(key);
    }
    Ok(())
}

async fn patch_status(ctx: &Context, pod: &Pod, status: &PodStatus) -> Result<(), Error> {
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .map_err(|e| Error::training("update pod status", e))?;
    Ok(())
}

async fn fail_pod(ctx: &Context, pod: &Pod, reason: &str, message: &str) -> Result<(), Error> {
    warn!(reason, message, "training pod failed");
    let status = PodStatus {
        phase: Some("Failed".to_owned()),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        ..Default::default()
    };
    patch_status(ctx, pod, &status).await?;
    publish(ctx, pod, EventType::Warning, reason, message).await;
    Ok(())
}

async fn publish(ctx: &Context, pod: &Pod, type_: EventType, reason: &str, note: &str) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.to_owned()),
        action: "Offload".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
        warn!(error = %e, reason, "cannot publish event");
    }
}
