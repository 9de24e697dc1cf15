//! Garbage collection in members: offload pods whose training pod is gone (orphans, left by
//! a force deletion, a node deletion, or anything that happened while tidepool was down),
//! reflected copies no pod uses any more, and, for a member with a gang scheduler, PodGroups no
//! copy needs any more ([`crate::gang_group`]).
//!
//! One collector per member session. It runs a full pass as soon as its caches are filled
//! (so a restart cleans up at once), then every [`COLLECT_INTERVAL`]. Between passes it acts
//! on events: a training pod deleted outright (grace period 0, forced, or by the pod garbage
//! collector, so the pod controller never saw it terminating) loses its offload copy at
//! once, and an offload pod going away gets its namespace's unused copies collected. It reads only caches
//! (the training pods of the pod controller, the member's offload pods and copies) and it
//! only ever touches objects that carry this instance's origin-cluster and member labels.
//! A pod looks orphaned when its origin UID is not in the training cache; before deleting
//! it, the collector asks the training API, so a cache that lags cannot cost a running pod.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tracing::{debug, info, warn};

use crate::offload::OffloadPod;
use crate::{copies, gang_group};
use tidepool_api::sync::Locked;
use tidepool_federation::training::listed;

use crate::context::{Context, OffloadWatch, delete_offload};
use crate::referenced::Source;

/// Time between two full passes. Orphans are rare (the pod controller deletes offload pods
/// itself); this is the safety net, so a minute of delay costs little.
pub const COLLECT_INTERVAL: Duration = Duration::from_secs(60);
/// How long one wait for a cache lasts before the session is checked again.
const CACHE_WAIT: Duration = Duration::from_secs(5);

/// The offload pods whose training pod (by origin UID) is not among `live`. Pods without an
/// origin UID are not tidepool's copies and pods already being deleted are done: neither is
/// returned. Pure.
pub fn orphans<'a>(offload: impl IntoIterator<Item = &'a OffloadPod>, live: &HashSet<&str>) -> Vec<&'a OffloadPod> {
    offload
        .into_iter()
        .filter(|p| !p.deleting())
        .filter(|p| p.origin_uid().is_some_and(|uid| !live.contains(uid)))
        .collect()
}

pub(crate) use crate::context::CollectRequest as Request;

/// Runs one member session's collector until the session ends.
pub(crate) async fn run(ctx: Arc<Context>, watch: OffloadWatch, mut requests: mpsc::Receiver<Request>) {
    let stop = watch.member.cancelled.clone();
    // Everything looks orphaned to a collector with an empty cache: wait for full lists.
    loop {
        if stop.is_cancelled() {
            return;
        }
        if listed(&ctx.pods, CACHE_WAIT).await && watch.store.listed(CACHE_WAIT).await {
            break;
        }
    }
    let mut tick = tokio::time::interval(COLLECT_INTERVAL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                collect_orphans(&ctx, &watch).await;
                collect_copies(&ctx, &watch, None).await;
                collect_groups(&ctx, &watch, None).await;
            }
            Some(request) = requests.recv() => match request {
                Request::Copies(namespace) => {
                    collect_copies(&ctx, &watch, Some(&namespace)).await;
                    collect_groups(&ctx, &watch, Some(&namespace)).await;
                }
                Request::Gone { namespace, name, uid } => {
                    let copy = watch.store.get(&namespace, &name).filter(|p| p.origin_uid() == Some(uid.as_str()));
                    if let Some(copy) = copy.filter(|p| !p.deleting()) {
                        collect_orphan(&ctx, &watch, &copy).await;
                    }
                }
            },
        }
    }
}

async fn collect_orphans(ctx: &Context, watch: &OffloadWatch) {
    let training = ctx.pods.state();
    let live: HashSet<&str> = training.iter().filter_map(|p| p.metadata.uid.as_deref()).collect();
    let offload = watch.store.state();
    for pod in orphans(offload.iter().map(AsRef::as_ref), &live) {
        collect_orphan(ctx, watch, pod).await;
    }
}

/// Deletes `pod` unless the training API says its origin still exists.
async fn collect_orphan(ctx: &Context, watch: &OffloadWatch, pod: &OffloadPod) {
    let (name, namespace) = (pod.name(), pod.namespace());
    match still_there(ctx, pod).await {
        Ok(true) => {
            debug!(member = %watch.member.name, pod = %name, namespace, "origin found in training; not an orphan");
            return;
        }
        Ok(false) => {}
        Err(e) => {
            warn!(member = %watch.member.name, pod = %name, namespace, error = %e, "cannot confirm orphan; next pass");
            return;
        }
    }
    // No deletion with a grace period reached this pod from training: it gets its own, as
    // a kubelet gives a pod deleted under it.
    match delete_offload(watch, pod, None).await {
        Ok(()) => {
            info!(member = %watch.member.name, pod = %name, namespace, "orphan offload pod deleted: its training pod is gone")
        }
        Err(e) => {
            warn!(member = %watch.member.name, pod = %name, namespace, error = %e, "cannot delete orphan offload pod")
        }
    }
}

/// Whether the training API still has the origin of `offload` (same UID). Without origin
/// annotations there is nothing to ask, and the training cache has already answered.
async fn still_there(ctx: &Context, offload: &OffloadPod) -> Result<bool, kube::Error> {
    let Some((ns, name)) = offload.origin_name() else { return Ok(false) };
    let found = Api::<Pod>::namespaced(ctx.training.clone(), ns).get_opt(name).await?;
    Ok(found.is_some_and(|p| p.metadata.uid.as_deref() == offload.origin_uid()))
}

/// Deletes this member's copies (in `only` namespace, or all) that neither an offload pod
/// in the member nor a live training pod headed for this member references.
async fn collect_copies(ctx: &Context, watch: &OffloadWatch, only: Option<&str>) {
    let member = &watch.member;
    if !watch.copies.ready().await {
        // Without the list of copies there is nothing to compare; the next pass retries.
        debug!(member = %member.name, "reflected copies not listed yet; not collecting them");
        return;
    }
    let wanted = |ns: &str| only.is_none_or(|o| o == ns);
    let mut used: HashSet<(String, Source)> = HashSet::new();
    for pod in watch.store.state() {
        let ns = pod.namespace().to_owned();
        if wanted(&ns) {
            used.extend(pod.references.keys().map(|s| (ns.clone(), s.clone())));
        }
    }
    // Pods on their way whose offload copy is not created yet use their copies too.
    if let Some(waiting) = ctx.waiting.locked_or_log("pods waiting for references") {
        for (origin_ns, sources) in waiting.values() {
            let ns = member.namespaces.member_ns(origin_ns);
            if wanted(&ns) {
                used.extend(sources.iter().map(|s| (ns.clone(), s.clone())));
            }
        }
    }
    let copies = watch.copies.all();
    debug!(member = %member.name, namespace = only, used = used.len(), copies = copies.len(), "collecting reflected copies");
    for (kind, meta) in copies {
        let (Some(ns), Some(name)) = (meta.namespace.as_deref(), meta.name.as_deref()) else { continue };
        if !wanted(ns) || used.contains(&(ns.to_owned(), Source::new(kind, name))) {
            continue;
        }
        if let Err(e) = copies::delete_reflected(member, kind, &meta).await {
            warn!(member = %member.name, kind = %kind, name, namespace = ns, error = %e, "cannot delete unused reflected copy");
        }
    }
}

/// Deletes this member's PodGroups (in `only` namespace, or all) that no offload pod in the
/// member joined and no live training pod bound to one of its virtual nodes will join (its
/// copy may be on its way: the group is made before it). Terminating copies keep their
/// group; their going away triggers this again.
///
/// The groups are listed first and the caches read after: a group the pod sync made is then
/// always seen with the bound training pod it was made for, never against a cache read
/// before that pod was bound.
async fn collect_groups(ctx: &Context, watch: &OffloadWatch, only: Option<&str>) {
    let member = &watch.member;
    let Some((scheduler, _)) = member.gang_scheduling else { return };
    let cluster = &ctx.config.cluster_name;
    let namespaces = only.map_or_else(|| watch.copies.namespaces(), |ns| vec![ns.to_owned()]);
    let mut existing = Vec::new();
    for ns in namespaces {
        match gang_group::list(member, scheduler, &ns, cluster).await {
            Ok(groups) => existing.extend(groups),
            Err(e) => warn!(member = %member.name, namespace = ns, error = %e, "cannot list PodGroups; next pass"),
        }
    }
    if existing.is_empty() {
        return;
    }
    let needed = needed_groups(ctx, watch);
    for (ns, name) in gang_group::unused(&existing, &needed) {
        if let Err(e) = gang_group::delete(member, scheduler, ns, name).await {
            warn!(member = %member.name, namespace = ns, group = name, error = %e, "cannot delete unused PodGroup");
        }
    }
}

/// The PodGroups (`(member namespace, name)`) the member's copies joined, and those the live
/// training pods bound to its virtual nodes join, as the caches hold them now.
fn needed_groups(ctx: &Context, watch: &OffloadWatch) -> BTreeSet<(String, String)> {
    let member = &watch.member;
    let mut needed: BTreeSet<(String, String)> = BTreeSet::new();
    for pod in watch.store.state() {
        if let (ns, Some(group)) = (pod.namespace(), pod.pod_group()) {
            needed.insert((ns.to_owned(), group.to_owned()));
        }
    }
    for pod in ctx.pods.state().iter().filter(|p| p.is_live()) {
        let (Some(node), Some(origin_ns)) = (pod.node_name(), pod.metadata.namespace.as_deref()) else { continue };
        if member.pool_for_node(node).is_none() {
            continue;
        }
        if let Some(group) =
            gang_group::member_group(&pod.metadata, pod.spec.pod_group.as_deref(), &ctx.config.cluster_name, node)
        {
            needed.insert((member.namespaces.member_ns(origin_ns), group.name));
        }
    }
    needed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tidepool_api::keys;

    fn offload(name: &str, uid: Option<&str>, deleting: bool) -> OffloadPod {
        let mut labels = serde_json::Map::new();
        if let Some(uid) = uid {
            labels.insert(keys::LABEL_ORIGIN_UID.into(), json!(uid));
        }
        let mut meta = json!({"name": name, "namespace": "tp-team-a", "labels": labels});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-11-29T10:00:00Z");
        }
        OffloadPod::from(serde_json::from_value::<Pod>(json!({"metadata": meta})).unwrap())
    }

    #[test]
    fn only_copies_of_vanished_pods_are_orphans() {
        let pods = [
            offload("alive", Some("uid-1"), false),
            offload("gone", Some("uid-2"), false),
            offload("gone-and-going", Some("uid-3"), true),
            offload("not-a-copy", None, false),
        ];
        let live = HashSet::from(["uid-1", "uid-9"]);
        let names: Vec<_> = orphans(&pods, &live).into_iter().map(|p| p.name().to_owned()).collect();
        assert_eq!(names, ["gone"]);
    }

    #[test]
    fn with_every_origin_alive_nothing_is_an_orphan() {
        let pods = [offload("a", Some("uid-1"), false), offload("b", Some("uid-2"), false)];
        assert!(orphans(&pods, &HashSet::from(["uid-1", "uid-2"])).is_empty());
    }
}
