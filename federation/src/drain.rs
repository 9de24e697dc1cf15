//! Draining a deleted `MemberCluster`: tidepool's finalizer ([`keys::FINALIZER_DRAIN`]),
//! added once the member has answered and before the first write there (a member never
//! reached has nothing to undo), holds the object until what tidepool did with the member is undone, in this order:
//!
//! 1. training pods on its virtual nodes that have not finished fail, reason
//!    [`keys::REASON_MEMBER_REMOVED`], with an Event;
//! 2. the offload copies of this training cluster and member are deleted in the member;
//! 3. so are the reflected ConfigMaps and Secrets, and the mirrored Services;
//! 4. and the offload namespaces tidepool made for this training cluster (waited for), but
//!    not one where another `MemberCluster` of this training cluster still has copies;
//! 5. the offload PriorityClasses, only when no other training cluster's offload namespace
//!    remains there (they are shared);
//! 6. the virtual nodes are removed (the member's session is stopped first);
//! 7. the finalizer is removed.
//!
//! Each pass observes everything again and [`next_step`] (pure) picks the first step not
//! done, so a restarted tidepool continues where the last one stopped. A drain that has not
//! finished [`DRAIN_TIMEOUT`] after the deletion (member unreachable, a step refused) is
//! given up: the finalizer goes anyway, with a `DrainAbandoned` Event saying what was left.
//! A `MemberCluster` that is only deselected is not drained (another bridge may take it
//! over): [`release`] removes the finalizer.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Secret, Service};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tidepool_api::terminal::{Ending, terminal_status};
use tidepool_api::{MemberCluster, MemberName, PoolName, VirtualNodeName, keys};
use tracing::{info, warn};

use crate::Error;
use crate::context::{self, Cond, Context};

/// How long after the deletion a drain may take before it is given up.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(300);
/// Pause between two passes of a drain.
const PASS: Duration = Duration::from_secs(2);

/// What tidepool still has in the member, as far as the drain is concerned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemberLeft {
    /// Offload copies of this training cluster and member not yet being deleted.
    pub copies: usize,
    /// Reflected ConfigMaps and Secrets of this training cluster and member.
    pub reflected: usize,
    /// This training cluster's offload namespaces not yet being deleted, and those that are.
    pub namespaces: usize,
    pub terminating: usize,
    /// Offload namespaces of other training clusters, of another `MemberCluster` of this one
    /// (its prefix), or shared with one: they keep the PriorityClasses (and are not deleted).
    pub foreign_namespaces: usize,
    /// The offload PriorityClasses tidepool created.
    pub priority_classes: usize,
}

/// Everything the next step depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainView {
    /// Time since the `MemberCluster`'s deletion timestamp.
    pub elapsed: Duration,
    /// Training pods on its virtual nodes that have not finished.
    pub live_pods: usize,
    /// `None`: the member could not be read (unreachable, credentials refused).
    pub member: Option<MemberLeft>,
    /// Its virtual nodes still in the training cluster.
    pub nodes: usize,
}

/// The next step of a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    FailPods,
    /// The member cannot be read: try again (until the timeout).
    WaitForMember,
    DeleteCopies,
    DeleteReflected,
    DeleteNamespaces,
    WaitForNamespaces,
    DeletePriorityClasses,
    DeleteNodes,
    RemoveFinalizer,
    /// Past the timeout with work left: remove the finalizer anyway and say what was left.
    Abandon,
}

impl Step {
    /// The `Draining` condition's reason while this step runs.
    pub fn reason(self) -> &'static str {
        match self {
            Step::FailPods => keys::REASON_FAILING_PODS,
            Step::WaitForMember => keys::REASON_WAITING_FOR_MEMBER,
            Step::DeleteCopies => keys::REASON_DELETING_OFFLOAD_PODS,
            Step::DeleteReflected => keys::REASON_DELETING_REFLECTED_OBJECTS,
            Step::DeleteNamespaces | Step::WaitForNamespaces => keys::REASON_DELETING_NAMESPACES,
            Step::DeletePriorityClasses => keys::REASON_DELETING_PRIORITY_CLASSES,
            Step::DeleteNodes => keys::REASON_DELETING_VIRTUAL_NODES,
            Step::RemoveFinalizer => keys::REASON_DRAINED,
            Step::Abandon => keys::REASON_DRAIN_ABANDONED,
        }
    }
}

impl MemberLeft {
    /// Nothing of ours left but PriorityClasses another training cluster still uses.
    fn clean(&self) -> bool {
        self.copies == 0
            && self.reflected == 0
            && self.namespaces == 0
            && self.terminating == 0
            && (self.priority_classes == 0 || self.foreign_namespaces > 0)
    }
}

/// The first step of the drain not done yet, given what is known. Pure.
pub fn next_step(view: &DrainView, timeout: Duration) -> Step {
    let done = view.live_pods == 0 && view.member.as_ref().is_some_and(MemberLeft::clean);
    if view.elapsed >= timeout && !(done && view.nodes == 0) {
        return Step::Abandon;
    }
    if view.live_pods > 0 {
        return Step::FailPods;
    }
    let Some(m) = &view.member else { return Step::WaitForMember };
    if m.copies > 0 {
        Step::DeleteCopies
    } else if m.reflected > 0 {
        Step::DeleteReflected
    } else if m.namespaces > 0 {
        Step::DeleteNamespaces
    } else if m.terminating > 0 {
        Step::WaitForNamespaces
    } else if m.priority_classes > 0 && m.foreign_namespaces == 0 {
        Step::DeletePriorityClasses
    } else if view.nodes > 0 {
        Step::DeleteNodes
    } else {
        Step::RemoveFinalizer
    }
}

/// The `Draining` condition's message, and the `DrainAbandoned` Event's: the counts.
pub fn describe(view: &DrainView) -> String {
    let member = match &view.member {
        Some(m) => format!(
            "{} offload pod(s), {} reflected object(s), {} offload namespace(s) ({} terminating), {} PriorityClass(es) \
             ({} namespace(s) of other members or training clusters kept)",
            m.copies,
            m.reflected,
            m.namespaces + m.terminating,
            m.terminating,
            m.priority_classes,
            m.foreign_namespaces
        ),
        None => "member objects unknown (member not readable)".to_owned(),
    };
    format!("{} unfinished training pod(s), {member}, {} virtual node(s) left", view.live_pods, view.nodes)
}

/// What one pass found, with the objects the executors act on.
struct Observed {
    view: DrainView,
    pods: Vec<Pod>,
    nodes: Vec<String>,
    member: Option<(Client, MemberObjects)>,
}

#[derive(Default)]
struct MemberObjects {
    copies: Vec<Pod>,
    reflected: Vec<(&'static str, ObjectMeta)>,
    namespaces: Vec<String>,
    priority_classes: Vec<String>,
}

/// One pass of the drain of `mc` (being deleted).
pub(crate) async fn reconcile(mc: &MemberCluster, ctx: &Context) -> Result<Action, Error> {
    if !mc.finalizers().iter().any(|f| f == keys::FINALIZER_DRAIN) {
        return Ok(Action::await_change());
    }
    let name = MemberName::new(mc.name_any());
    let since = mc.metadata.deletion_timestamp.as_ref().map(|t| t.0).unwrap_or_else(jiff::Timestamp::now);
    let elapsed = jiff::Timestamp::now().duration_since(since).unsigned_abs();
    let observed = observe(mc, &name, ctx, elapsed).await?;
    let step = next_step(&observed.view, DRAIN_TIMEOUT);
    let message = describe(&observed.view);
    info!(step = ?step, %message, "draining member");
    let draining = Cond::new(false, keys::REASON_DRAINING, format!("MemberCluster deleted; draining: {message}"));
    context::hold(ctx, &name, &draining)?;
    if !matches!(step, Step::RemoveFinalizer | Step::Abandon) {
        write_draining(mc, ctx, step, &message).await?;
    }
    execute(mc, &name, ctx, step, observed, &message).await?;
    Ok(Action::requeue(PASS))
}

async fn execute(
    mc: &MemberCluster,
    name: &MemberName,
    ctx: &Context,
    step: Step,
    observed: Observed,
    message: &str,
) -> Result<(), Error> {
    let Observed { pods, nodes, member, .. } = observed;
    match (step, member) {
        (Step::FailPods, _) => fail_pods(ctx, name, &pods).await,
        (Step::DeleteCopies, Some((client, m))) => delete_copies(&client, &m.copies).await,
        (Step::DeleteReflected, Some((client, m))) => delete_reflected(&client, &m.reflected).await,
        (Step::DeleteNamespaces, Some((client, m))) => delete_all::<Namespace>(&client, &m.namespaces).await,
        (Step::DeletePriorityClasses, Some((client, m))) => {
            delete_all::<PriorityClass>(&client, &m.priority_classes).await
        }
        (Step::DeleteNodes, _) => delete_nodes(ctx, name, &nodes).await,
        (Step::RemoveFinalizer, _) => {
            context::stop(ctx, name)?;
            info!("member drained; finalizer removed");
            remove_finalizer(mc, ctx).await
        }
        (Step::Abandon, _) => {
            context::stop(ctx, name)?;
            let note = format!("drain not finished {}s after deletion; left: {message}", DRAIN_TIMEOUT.as_secs());
            warn!(%note, "drain abandoned");
            publish(ctx, mc, EventType::Warning, keys::REASON_DRAIN_ABANDONED, note).await;
            remove_finalizer(mc, ctx).await
        }
        _ => Ok(()),
    }
}

/// Reads the training side (pods, nodes) and, if it answers, the member.
async fn observe(mc: &MemberCluster, name: &MemberName, ctx: &Context, elapsed: Duration) -> Result<Observed, Error> {
    let training = &ctx.training;
    let selector = format!("{}={}", keys::LABEL_MEMBER, name);
    let nodes: Vec<String> = Api::<Node>::all(training.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| Error::Training { what: "list virtual nodes", source: Box::new(source) })?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let mut node_names: Vec<String> = mc
        .spec
        .effective_pools()
        .iter()
        .map(|p| VirtualNodeName::for_pool(name, &PoolName::new(p.name.clone())).to_string())
        .collect();
    node_names.extend(nodes.iter().cloned());
    node_names.sort();
    node_names.dedup();
    let mut pods = Vec::new();
    for node in &node_names {
        let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let list = Api::<Pod>::all(training.clone())
            .list(&lp)
            .await
            .map_err(|source| Error::Training { what: "list training pods", source: Box::new(source) })?;
        pods.extend(list.items.into_iter().filter(unfinished));
    }
    let prefix = mc.spec.effective_namespace_prefix(&ctx.config.namespace_prefix);
    let member = match member_client(mc, name, ctx).await? {
        Some(client) => match member_objects(&client, &ctx.config.cluster_name, (name, &prefix)).await {
            Ok((left, objects)) => Some((client, left, objects)),
            Err(e) => {
                warn!(error = %crate::kubeconfig::scrub_urls(&e.to_string()), "cannot read the member to drain it");
                None
            }
        },
        None => None,
    };
    let view = DrainView {
        elapsed,
        live_pods: pods.len(),
        member: member.as_ref().map(|(_, left, _)| left.clone()),
        nodes: nodes.len(),
    };
    Ok(Observed { view, pods, nodes, member: member.map(|(c, _, o)| (c, o)) })
}

fn unfinished(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    !matches!(phase, Some("Succeeded" | "Failed"))
}

/// The member's client: the running session's, else one dialed from the Secret (a
/// restarted tidepool, or a member whose session is already stopped).
async fn member_client(mc: &MemberCluster, name: &MemberName, ctx: &Context) -> Result<Option<Client>, Error> {
    if let Some(client) = ctx.sessions()?.get(name).map(|s| s.handle.client.clone()) {
        return Ok(Some(client));
    }
    Ok(dial(mc, name, ctx).await)
}

/// A client dialed from the member's Secret, if it yields one.
async fn dial(mc: &MemberCluster, name: &MemberName, ctx: &Context) -> Option<Client> {
    let r = &mc.spec.kubeconfig_secret_ref;
    let ns = r.namespace.as_deref().unwrap_or(&ctx.config.namespace);
    let secret = Api::<Secret>::namespaced(ctx.training.clone(), ns).get_opt(&r.name).await.ok()??;
    let bytes = secret.data.as_ref()?.get(mc.spec.secret_key())?;
    let config = crate::kubeconfig::client_config(&bytes.0).await.ok()?;
    let limits = mc.spec.rate_limits.clone().unwrap_or_default();
    let stats = std::sync::Arc::new(crate::MemberStats::default());
    crate::throttle::client_with(config, name.as_str(), &limits, stats, &ctx.ownership.guard(name)).ok()
}

/// The label selector of this bridge instance's objects of one kind (`kind=true` plus both
/// origin labels): another MemberCluster's reflected objects or mirrors in the same
/// namespace are never listed, so never deleted. (`ListParams::labels` replaces a selector,
/// so the three go in one.)
fn owned_selector(kind: &str, cluster: &str, member: &MemberName) -> String {
    format!("{kind}=true,{}={cluster},{}={member}", keys::LABEL_ORIGIN_CLUSTER, keys::LABEL_ORIGIN_MEMBER)
}

/// Lists what tidepool made in the member for this training cluster and member, in the
/// offload namespaces this MemberCluster made (labelled with its name; older ones: named with
/// its `prefix`). Another MemberCluster on the same API server has namespaces of its own,
/// never this one's to empty or delete.
async fn member_objects(
    client: &Client,
    cluster: &str,
    (member, prefix): (&MemberName, &str),
) -> Result<(MemberLeft, MemberObjects), kube::Error> {
    let ours = ListParams::default().labels(&format!(
        "{}={cluster},{}={member}",
        keys::LABEL_ORIGIN_CLUSTER,
        keys::LABEL_ORIGIN_MEMBER
    ));
    let managed = ListParams::default().labels(&format!("{}={}", keys::LABEL_MANAGED_BY, keys::MANAGED_BY));
    let mut objects = MemberObjects::default();
    let mut left = MemberLeft::default();
    for ns in Api::<Namespace>::all(client.clone()).list_metadata(&managed).await?.items {
        let origin = ns.labels().get(keys::LABEL_ORIGIN_CLUSTER).map(String::as_str);
        if origin != Some(cluster) {
            left.foreign_namespaces += 1;
            continue;
        }
        let ns_name = ns.name_any();
        // This MemberCluster's by its label; one made before namespaces carried it, by the
        // prefix every namespace had then.
        let mine = match ns.labels().get(keys::LABEL_ORIGIN_MEMBER) {
            Some(m) => m == member.as_str(),
            None => made_with_prefix(&ns_name, prefix),
        };
        if !mine {
            left.foreign_namespaces += 1;
            continue;
        }
        // Another MemberCluster of this training cluster (the same member bridged twice)
        // still has copies there: the namespace and the PriorityClasses are its too.
        let cluster_only = ListParams::default().labels(&format!("{}={cluster}", keys::LABEL_ORIGIN_CLUSTER));
        let theirs = Api::<Pod>::namespaced(client.clone(), &ns_name).list_metadata(&cluster_only).await?.items;
        if theirs.iter().any(|p| p.labels().get(keys::LABEL_ORIGIN_MEMBER).map(String::as_str) != Some(member.as_str()))
        {
            left.foreign_namespaces += 1;
        } else if ns.metadata.deletion_timestamp.is_some() {
            left.terminating += 1;
        } else {
            left.namespaces += 1;
            objects.namespaces.push(ns_name.clone());
        }
        let reflected = ListParams::default().labels(&owned_selector(keys::LABEL_REFLECTED, cluster, member));
        for cm in Api::<ConfigMap>::namespaced(client.clone(), &ns_name).list_metadata(&reflected).await?.items {
            objects.reflected.push(("ConfigMap", cm.metadata));
        }
        for s in Api::<Secret>::namespaced(client.clone(), &ns_name).list_metadata(&reflected).await?.items {
            objects.reflected.push(("Secret", s.metadata));
        }
        let mirrored = ListParams::default().labels(&owned_selector(keys::LABEL_MIRRORED, cluster, member));
        for s in Api::<Service>::namespaced(client.clone(), &ns_name).list_metadata(&mirrored).await?.items {
            objects.reflected.push(("Service", s.metadata));
        }
        let copies = Api::<Pod>::namespaced(client.clone(), &ns_name).list(&ours).await?.items;
        objects.copies.extend(copies.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none()));
    }
    objects.reflected.retain(|(_, m)| m.deletion_timestamp.is_none());
    for pc in Api::<PriorityClass>::all(client.clone()).list_metadata(&managed).await?.items {
        objects.priority_classes.push(pc.name_any());
    }
    left.copies = objects.copies.len();
    left.reflected = objects.reflected.len();
    left.priority_classes = objects.priority_classes.len();
    Ok((left, objects))
}

/// Step 1: every unfinished training pod on the member's virtual nodes fails, with an Event.
async fn fail_pods(ctx: &Context, name: &MemberName, pods: &[Pod]) -> Result<(), Error> {
    let message = format!("MemberCluster {name} was deleted; the pod is given up so it can run elsewhere");
    for pod in pods {
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
        let end = Ending {
            reason: keys::REASON_MEMBER_REMOVED,
            message: &message,
            disruption: Some(keys::REASON_MEMBER_REMOVED),
        };
        let status = terminal_status(pod.status.as_ref(), &end, &[], &Time(jiff::Timestamp::now()));
        let patch = json!({ "metadata": { "resourceVersion": pod.metadata.resource_version }, "status": status });
        match api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => {}
            // Changed or gone since the list: the next pass sees it again.
            Err(e) if crate::api_code(&e, &[404, 409]) => continue,
            Err(source) => return Err(Error::Training { what: "fail training pod", source: Box::new(source) }),
        }
        warn!(pod = %pod.name_any(), namespace = pod.namespace(), "training pod failed: member removed");
        let event = Event {
            type_: EventType::Warning,
            reason: keys::REASON_MEMBER_REMOVED.to_owned(),
            note: Some(message.clone()),
            action: "Drain".to_owned(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
            warn!(error = %e, "cannot publish event");
        }
    }
    Ok(())
}

/// Step 2: the copies go at once (their training pods have failed).
async fn delete_copies(client: &Client, copies: &[Pod]) -> Result<(), Error> {
    for pod in copies {
        let api = Api::<Pod>::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
        let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        member_delete(api.delete(&pod.name_any(), &dp).await.map(|_| ()), "offload pod");
    }
    Ok(())
}

/// Step 3.
async fn delete_reflected(client: &Client, objects: &[(&'static str, ObjectMeta)]) -> Result<(), Error> {
    for (kind, meta) in objects {
        let (Some(ns), Some(name)) = (meta.namespace.as_deref(), meta.name.as_deref()) else { continue };
        let dp = DeleteParams::default();
        let result = if *kind == "Secret" {
            Api::<Secret>::namespaced(client.clone(), ns).delete(name, &dp).await.map(|_| ())
        } else if *kind == "Service" {
            Api::<Service>::namespaced(client.clone(), ns).delete(name, &dp).await.map(|_| ())
        } else {
            Api::<ConfigMap>::namespaced(client.clone(), ns).delete(name, &dp).await.map(|_| ())
        };
        member_delete(result, kind);
    }
    Ok(())
}

/// Steps 4 and 5: cluster-scoped objects by name.
async fn delete_all<K>(client: &Client, names: &[String]) -> Result<(), Error>
where
    K: Resource<Scope = k8s_openapi::ClusterResourceScope> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api = Api::<K>::all(client.clone());
    for name in names {
        member_delete(
            api.delete(name, &DeleteParams::default()).await.map(|_| ()),
            K::kind(&K::DynamicType::default()).as_ref(),
        );
    }
    Ok(())
}

/// A member deletion's outcome: gone already is fine; anything else shows in the next
/// pass's counts (and, past the timeout, in `DrainAbandoned`).
fn member_delete(result: Result<(), kube::Error>, what: &str) {
    match result {
        Ok(()) => {}
        Err(e) if crate::api_code(&e, &[404]) => {}
        Err(e) => warn!(what, error = %crate::kubeconfig::scrub_urls(&e.to_string()), "drain: cannot delete in member"),
    }
}

/// Step 6: the session stops first, so nothing registers the nodes again.
async fn delete_nodes(ctx: &Context, name: &MemberName, nodes: &[String]) -> Result<(), Error> {
    context::stop(ctx, name)?;
    let api = Api::<Node>::all(ctx.training.clone());
    for node in nodes {
        match api.delete(node, &DeleteParams::default()).await {
            Ok(_) => info!(node, "virtual node deleted: member removed"),
            Err(e) if crate::api_code(&e, &[404]) => {}
            Err(source) => return Err(Error::Training { what: "delete virtual node", source: Box::new(source) }),
        }
    }
    Ok(())
}

/// Adds the finalizer to a `MemberCluster` this bridge serves (a no-op when present).
pub(crate) async fn ensure_finalizer(mc: &MemberCluster, ctx: &Context) -> Result<(), Error> {
    if mc.finalizers().iter().any(|f| f == keys::FINALIZER_DRAIN) {
        return Ok(());
    }
    let mut finalizers = mc.finalizers().to_vec();
    finalizers.push(keys::FINALIZER_DRAIN.to_owned());
    patch_finalizers(mc, ctx, finalizers).await
}

/// Step 7, and [`release`].
async fn remove_finalizer(mc: &MemberCluster, ctx: &Context) -> Result<(), Error> {
    let finalizers: Vec<String> = mc.finalizers().iter().filter(|f| *f != keys::FINALIZER_DRAIN).cloned().collect();
    patch_finalizers(mc, ctx, finalizers).await
}

async fn patch_finalizers(mc: &MemberCluster, ctx: &Context, finalizers: Vec<String>) -> Result<(), Error> {
    // The resourceVersion makes this a compare-and-swap: another controller's finalizer
    // added meanwhile is never dropped (409, and the next pass tries again).
    let patch = json!({ "metadata": { "resourceVersion": mc.metadata.resource_version, "finalizers": finalizers } });
    match Api::<MemberCluster>::all(ctx.training.clone())
        .patch(&mc.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if crate::api_code(&e, &[404]) => Ok(()),
        Err(source) => Err(Error::Training { what: "update MemberCluster finalizers", source: Box::new(source) }),
    }
}

/// A `MemberCluster` this bridge no longer selects (not deleted) loses our finalizer, and
/// nothing is drained: another bridge may take it over.
pub(crate) async fn release(ctx: &Context, name: &MemberName) {
    let api = Api::<MemberCluster>::all(ctx.training.clone());
    let Ok(Some(mc)) = api.get_opt(name.as_str()).await else { return };
    if mc.metadata.deletion_timestamp.is_some() || !mc.finalizers().iter().any(|f| f == keys::FINALIZER_DRAIN) {
        return;
    }
    match remove_finalizer(&mc, ctx).await {
        Ok(()) => info!(member = %name, "MemberCluster no longer selected: finalizer removed, not drained"),
        Err(e) => warn!(member = %name, error = %e, "cannot remove the finalizer of a deselected MemberCluster"),
    }
}

/// The `Draining` condition, with the other conditions kept.
async fn write_draining(mc: &MemberCluster, ctx: &Context, step: Step, message: &str) -> Result<(), Error> {
    let old = mc.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
    let next = context::condition(&old, keys::CONDITION_DRAINING, Cond::new(true, step.reason(), message), None);
    if old.iter().any(|c| c.type_ == next.type_ && c.reason == next.reason && c.message == next.message) {
        return Ok(());
    }
    let mut conditions: Vec<_> = old.into_iter().filter(|c| c.type_ != keys::CONDITION_DRAINING).collect();
    conditions.push(next);
    let status = json!({ "status": { "conditions": conditions } });
    Api::<MemberCluster>::all(ctx.training.clone())
        .patch_status(&mc.name_any(), &PatchParams::default(), &Patch::Merge(status))
        .await
        .map_err(|source| Error::Training { what: "write MemberCluster status", source: Box::new(source) })?;
    Ok(())
}

async fn publish(ctx: &Context, mc: &MemberCluster, type_: EventType, reason: &str, note: String) {
    let event =
        Event { type_, reason: reason.to_owned(), note: Some(note), action: "Drain".to_owned(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&event, &mc.object_ref(&())).await {
        warn!(error = %e, "cannot publish event");
    }
}

/// Whether namespace `name`, made before namespaces carried their member's label, is one of
/// the member with namespace prefix `prefix`. An empty prefix (same-name namespaces) names no
/// namespace this way: it would match every one.
fn made_with_prefix(name: &str, prefix: &str) -> bool {
    !prefix.is_empty() && name.starts_with(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unlabelled_namespace_is_a_members_only_by_a_non_empty_prefix() {
        assert!(made_with_prefix("tp-team-a", "tp-"));
        assert!(!made_with_prefix("payments", "tp-"));
        assert!(!made_with_prefix("payments", ""), "an empty prefix would drain every namespace");
    }

    #[test]
    fn a_drain_lists_only_its_own_reflected_objects_and_mirrors() {
        let member = MemberName::new("member-a".to_owned());
        for kind in [keys::LABEL_REFLECTED, keys::LABEL_MIRRORED] {
            let selector = owned_selector(kind, "training", &member);
            let terms: Vec<&str> = selector.split(',').collect();
            assert!(terms.contains(&format!("{kind}=true").as_str()), "{selector}");
            assert!(terms.contains(&format!("{}=training", keys::LABEL_ORIGIN_CLUSTER).as_str()), "{selector}");
            assert!(terms.contains(&format!("{}=member-a", keys::LABEL_ORIGIN_MEMBER).as_str()), "{selector}");
        }
    }

    const T: Duration = DRAIN_TIMEOUT;

    fn left() -> MemberLeft {
        MemberLeft::default()
    }

    fn view(live_pods: usize, member: Option<MemberLeft>, nodes: usize) -> DrainView {
        DrainView { elapsed: Duration::from_secs(10), live_pods, member, nodes }
    }

    #[test]
    fn each_step_comes_only_after_the_ones_before_it_are_done() {
        let all = MemberLeft {
            copies: 2,
            reflected: 1,
            namespaces: 1,
            terminating: 0,
            foreign_namespaces: 0,
            priority_classes: 3,
        };
        let cases = [
            (
                "unfinished training pods fail first, whatever else is left",
                view(1, Some(all.clone()), 1),
                Step::FailPods,
            ),
            ("pods fail even when the member cannot be read", view(2, None, 1), Step::FailPods),
            ("an unreadable member is waited for", view(0, None, 1), Step::WaitForMember),
            ("then the copies", view(0, Some(all.clone()), 1), Step::DeleteCopies),
            (
                "then the reflected objects",
                view(0, Some(MemberLeft { copies: 0, ..all.clone() }), 1),
                Step::DeleteReflected,
            ),
            (
                "then the namespaces",
                view(0, Some(MemberLeft { copies: 0, reflected: 0, ..all.clone() }), 1),
                Step::DeleteNamespaces,
            ),
            (
                "namespaces still terminating are waited for",
                view(0, Some(MemberLeft { terminating: 1, priority_classes: 3, ..left() }), 1),
                Step::WaitForNamespaces,
            ),
            (
                "then the PriorityClasses, when no other training cluster uses them",
                view(0, Some(MemberLeft { priority_classes: 3, ..left() }), 1),
                Step::DeletePriorityClasses,
            ),
            (
                "shared PriorityClasses stay: on to the nodes",
                view(0, Some(MemberLeft { priority_classes: 3, foreign_namespaces: 1, ..left() }), 1),
                Step::DeleteNodes,
            ),
            ("then the virtual nodes", view(0, Some(left()), 2), Step::DeleteNodes),
            ("nothing left: the finalizer goes", view(0, Some(left()), 0), Step::RemoveFinalizer),
            (
                "shared PriorityClasses left do not hold the finalizer",
                view(0, Some(MemberLeft { priority_classes: 3, foreign_namespaces: 2, ..left() }), 0),
                Step::RemoveFinalizer,
            ),
        ];
        for (name, view, want) in cases {
            assert_eq!(next_step(&view, T), want, "{name}");
        }
    }

    #[test]
    fn past_the_timeout_a_drain_with_work_left_is_abandoned() {
        let late = |v: DrainView| DrainView { elapsed: T, ..v };
        let cases = [
            ("the member never answered", late(view(0, None, 1)), Step::Abandon),
            ("copies left", late(view(0, Some(MemberLeft { copies: 1, ..left() }), 0)), Step::Abandon),
            ("pods left", late(view(1, Some(left()), 0)), Step::Abandon),
            ("only the nodes left", late(view(0, Some(left()), 1)), Step::Abandon),
            ("everything done: drained, not abandoned", late(view(0, Some(left()), 0)), Step::RemoveFinalizer),
            (
                "a second before the timeout it still waits",
                DrainView { elapsed: T - Duration::from_secs(1), ..view(0, None, 1) },
                Step::WaitForMember,
            ),
        ];
        for (name, view, want) in cases {
            assert_eq!(next_step(&view, T), want, "{name}");
        }
    }

    #[test]
    fn the_message_counts_what_is_left() {
        let v = view(
            1,
            Some(MemberLeft {
                copies: 2,
                reflected: 3,
                namespaces: 1,
                terminating: 1,
                foreign_namespaces: 0,
                priority_classes: 3,
            }),
            1,
        );
        assert_eq!(
            describe(&v),
            "1 unfinished training pod(s), 2 offload pod(s), 3 reflected object(s), 2 offload namespace(s) \
             (1 terminating), 3 PriorityClass(es) (0 namespace(s) of other members or training clusters kept), \
             1 virtual node(s) left"
        );
        assert!(describe(&view(0, None, 0)).contains("member objects unknown"));
    }
}
