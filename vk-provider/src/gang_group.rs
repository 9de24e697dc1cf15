//! The member's own gang scheduler (`spec.gangScheduler`): the PodGroup a gang's copies
//! join in the member, so the member places the gang all or nothing too.
//!
//! What a group and a copy's membership look like is pure ([`member_group`],
//! [`pod_group`], [`join`]). The pod sync creates a gang's group before its first copy
//! ([`ensure`]); the collector ([`crate::collect`]) deletes each group no copy and no
//! training pod headed for the member needs any more ([`unused`]), so a group outlives
//! neither its last copy nor a restart of tidepool or of the member.
//!
//! Groups are named by tidepool from the training namespace and the gang's source
//! ([`group_name`]) and live in the gang's offload namespace: a tenant's own group labels
//! and annotations never travel ([`drop_tenant_membership`]), so no tenant's copy can join
//! another gang's group.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Pod, PodSchedulingGroup};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;
use sha2::{Digest, Sha256};
use tidepool_api::crd::GangScheduler;
use tidepool_api::keys;
use tidepool_federation::MemberHandle;

use crate::Error;

/// The member-side group of one gang: its name and `minMember`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberGroup {
    pub name: String,
    pub min_member: u32,
    /// The copies' PriorityClass, which a native group must carry too: Kubernetes' scheduler
    /// refuses a group whose pods' priority is not the group's (set by the pod sync from the
    /// copy, [`with_priority_class`](MemberGroup::with_priority_class)).
    pub priority_class: Option<String>,
}

impl MemberGroup {
    /// The group for copies of PriorityClass `class`.
    pub fn with_priority_class(self, class: Option<&str>) -> Self {
        Self { priority_class: class.map(str::to_owned), ..self }
    }
}

/// Whether a copy of training pod `meta` joins its gang's group under `scheduler`. Under
/// Kubernetes' own gang scheduling only the core does: a group's pods must share one
/// priority, and elastic pods run in band `low`, placed one by one as elastic pods are.
pub fn joins(scheduler: GangScheduler, meta: &ObjectMeta) -> bool {
    let role = meta.labels.as_ref().and_then(|l| l.get(keys::LABEL_ROLE)).map(String::as_str);
    scheduler != GangScheduler::Kubernetes || role != Some(keys::ROLE_ELASTIC)
}

/// The gang a training pod names, as `(kind, name)`: the same sources in the same order as
/// the dispatcher reads them (`tidepool_dispatcher::gang::gang_of_meta`), from its metadata
/// and its native PodGroup (`spec.schedulingGroup.podGroupName`). `None` for a pod without a
/// gang, which needs no group.
pub fn gang_source<'a>(meta: &'a ObjectMeta, native: Option<&'a str>) -> Option<(&'static str, &'a str)> {
    let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).filter(|v| !v.is_empty());
    let annotation = |k: &str| meta.annotations.as_ref().and_then(|a| a.get(k)).filter(|v| !v.is_empty());
    if let Some(g) = native.filter(|g| !g.is_empty()) {
        Some(("native", g))
    } else if let Some(g) = label(keys::LABEL_POD_GROUP) {
        Some(("podgroup", g))
    } else if let Some(g) = annotation(keys::ANNOTATION_VOLCANO_GROUP) {
        Some(("volcano", g))
    } else {
        annotation(keys::ANNOTATION_GANG).map(|g| ("gang", g.as_str()))
    }
}

/// Longest group name: it is also a label value (`scheduling.x-k8s.io/pod-group`).
const MAX_NAME: usize = 63;
/// Hex digits of the digest that makes a name unique.
const DIGEST_HEX: usize = 10;

/// The member-side name of gang `kind/gang` of training namespace `namespace` of training
/// cluster `cluster`: `tp-<kind>-<gang, made a DNS label>-<digest>`, at most 63 characters.
/// The digest is of all four, so two gangs (of two namespaces, or whose names read alike
/// once shortened) never share a group, whatever a tenant names its gang.
pub fn group_name(cluster: &str, namespace: &str, kind: &str, gang: &str) -> String {
    let mut h = Sha256::new();
    for part in [cluster, namespace, kind, gang] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let digest: String = h.finalize().iter().take(DIGEST_HEX / 2).map(|b| format!("{b:02x}")).collect();
    let room = MAX_NAME.saturating_sub("tp-".len() + kind.len() + 2 + DIGEST_HEX);
    let readable: String =
        gang.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).take(room).collect();
    let readable = readable.trim_matches('-');
    if readable.is_empty() { format!("tp-{kind}-{digest}") } else { format!("tp-{kind}-{readable}-{digest}") }
}

/// `minMember` of a new group for a copy of the training pod `meta` bound to `node`: the
/// gang's core as the dispatcher recorded it at placement ([`keys::ANNOTATION_GANG_CORE`]),
/// trusted only on a core pod whose placement names `node`, as the band is; 1 otherwise (a
/// pod bound by hand, or one bound after its gang was placed, which finds the group there).
pub fn min_member(meta: &ObjectMeta, node: &str) -> u32 {
    let label = meta.labels.as_ref().and_then(|l| l.get(keys::LABEL_ROLE)).map(String::as_str);
    let annotation = |k: &str| meta.annotations.as_ref().and_then(|a| a.get(k)).map(String::as_str);
    if label != Some(keys::ROLE_CORE) || annotation(keys::ANNOTATION_PLACEMENT) != Some(node) {
        return 1;
    }
    annotation(keys::ANNOTATION_GANG_CORE).and_then(|v| v.trim().parse::<u32>().ok()).filter(|n| *n >= 1).unwrap_or(1)
}

/// The group a copy of training pod `meta` (bound to `node`, in native PodGroup `native` if
/// any) joins, if it is in a gang.
pub fn member_group(meta: &ObjectMeta, native: Option<&str>, cluster: &str, node: &str) -> Option<MemberGroup> {
    let (kind, gang) = gang_source(meta, native)?;
    let namespace = meta.namespace.as_deref()?;
    Some(MemberGroup {
        name: group_name(cluster, namespace, kind, gang),
        min_member: min_member(meta, node),
        priority_class: None,
    })
}

/// The PodGroup object of `group` in member namespace `namespace`, labelled like every
/// object tidepool makes in a member (managed-by, origin cluster, member), which is what the
/// collector selects by.
pub fn pod_group(
    scheduler: GangScheduler,
    group: &MemberGroup,
    namespace: &str,
    cluster: &str,
    member: &str,
) -> DynamicObject {
    let labels = BTreeMap::from([
        (keys::LABEL_MANAGED_BY.to_owned(), keys::MANAGED_BY.to_owned()),
        (keys::LABEL_ORIGIN_CLUSTER.to_owned(), cluster.to_owned()),
        (keys::LABEL_ORIGIN_MEMBER.to_owned(), member.to_owned()),
    ]);
    let mut object = DynamicObject::new(&group.name, &scheduler.pod_group_resource()).within(namespace);
    object.metadata.labels = Some(labels);
    object.data = match scheduler {
        // Its pods never preempt (they are guests): the group says the same, as it must.
        GangScheduler::Kubernetes => json!({ "spec": {
            "schedulingPolicy": { "gang": { "minCount": group.min_member } },
            "priorityClassName": group.priority_class,
            "preemptionPolicy": "Never",
        } }),
        GangScheduler::Coscheduling | GangScheduler::Volcano => json!({ "spec": { "minMember": group.min_member } }),
    };
    object
}

/// Hands copy `copy` to the member's gang scheduler `scheduler_name` as a member of group
/// `group`: the label (coscheduling) or annotation (Volcano) that names it.
pub fn join(copy: &mut Pod, scheduler: GangScheduler, scheduler_name: &str, group: &str) {
    let meta = &mut copy.metadata;
    match scheduler {
        GangScheduler::Coscheduling => {
            meta.labels.get_or_insert_with(BTreeMap::new).insert(keys::LABEL_POD_GROUP.to_owned(), group.to_owned());
        }
        GangScheduler::Volcano => {
            let annotations = meta.annotations.get_or_insert_with(BTreeMap::new);
            annotations.insert(keys::ANNOTATION_VOLCANO_GROUP.to_owned(), group.to_owned());
        }
        GangScheduler::Kubernetes => {
            if let Some(spec) = copy.spec.as_mut() {
                spec.scheduling_group = Some(PodSchedulingGroup { pod_group_name: Some(group.to_owned()) });
            }
        }
    }
    if let Some(spec) = copy.spec.as_mut() {
        spec.scheduler_name = Some(scheduler_name.to_owned());
    }
}

/// Removes group membership a tenant wrote (or a member's `copyLabels` let through) from a
/// copy's labels and annotations: only [`join`] names a copy's group.
pub fn drop_tenant_membership(labels: &mut BTreeMap<String, String>, annotations: &mut BTreeMap<String, String>) {
    for key in [keys::LABEL_POD_GROUP, keys::ANNOTATION_VOLCANO_GROUP] {
        labels.remove(key);
        annotations.remove(key);
    }
}

/// The group `copy` is a member of, as [`join`] wrote it.
pub fn group_of(copy: &Pod, scheduler: GangScheduler) -> Option<&str> {
    let meta = &copy.metadata;
    match scheduler {
        GangScheduler::Coscheduling => meta.labels.as_ref()?.get(keys::LABEL_POD_GROUP).map(String::as_str),
        GangScheduler::Volcano => meta.annotations.as_ref()?.get(keys::ANNOTATION_VOLCANO_GROUP).map(String::as_str),
        GangScheduler::Kubernetes => copy.spec.as_ref().and_then(tidepool_api::pod::scheduling_group),
    }
}

/// The groups among `existing` (`(namespace, name)`) that nothing in `needed` names. Pure.
pub fn unused<'a>(
    existing: &'a [(String, String)],
    needed: &BTreeSet<(String, String)>,
) -> impl Iterator<Item = &'a (String, String)> {
    existing.iter().filter(move |g| !needed.contains(*g))
}

/// What [`ensure`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ensured {
    /// The group is there (made now, or before): the copy may be created.
    Ready,
    /// The member does not serve the PodGroup API: no copy goes there.
    ApiMissing,
}

/// Creates `group` in `namespace` of `member` unless it exists. Idempotent: a group made by
/// an earlier copy of the gang is kept as it is (its `minMember` included).
pub(crate) async fn ensure(
    member: &MemberHandle,
    scheduler: GangScheduler,
    group: &MemberGroup,
    namespace: &str,
    cluster: &str,
) -> Result<Ensured, Error> {
    let api = Api::<DynamicObject>::namespaced_with(member.client.clone(), namespace, &scheduler.pod_group_resource());
    let object = pod_group(scheduler, group, namespace, cluster, member.name.as_str());
    let pp = PostParams { field_manager: Some(keys::MANAGER_VK.to_owned()), ..Default::default() };
    match api.create(&pp, &object).await {
        Ok(_) => {
            tracing::info!(member = %member.name, namespace, group = %group.name, min_member = group.min_member, "PodGroup created");
            Ok(Ensured::Ready)
        }
        Err(e) if tidepool_federation::api_code(&e, &[409]) => Ok(Ensured::Ready),
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(Ensured::ApiMissing),
        Err(e) => Err(Error::member(&member.name, "create PodGroup", e)),
    }
}

/// This instance's groups in member namespace `namespace`, as `(namespace, name)`.
pub(crate) async fn list(
    member: &MemberHandle,
    scheduler: GangScheduler,
    namespace: &str,
    cluster: &str,
) -> Result<Vec<(String, String)>, Error> {
    let api = Api::<DynamicObject>::namespaced_with(member.client.clone(), namespace, &scheduler.pod_group_resource());
    let selector = format!(
        "{}={},{}={},{}={}",
        keys::LABEL_MANAGED_BY,
        keys::MANAGED_BY,
        keys::LABEL_ORIGIN_CLUSTER,
        cluster,
        keys::LABEL_ORIGIN_MEMBER,
        member.name
    );
    let groups = api
        .list_metadata(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| Error::member(&member.name, "list PodGroups", e))?;
    Ok(groups.items.into_iter().filter_map(|g| Some((namespace.to_owned(), g.metadata.name?))).collect())
}

/// Deletes group `name` of member namespace `namespace`; one already gone is fine.
pub(crate) async fn delete(
    member: &MemberHandle,
    scheduler: GangScheduler,
    namespace: &str,
    name: &str,
) -> Result<(), Error> {
    let api = Api::<DynamicObject>::namespaced_with(member.client.clone(), namespace, &scheduler.pod_group_resource());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {
            tracing::info!(member = %member.name, namespace, group = name, "PodGroup deleted: no copy needs it");
            Ok(())
        }
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(()),
        Err(e) => Err(Error::member(&member.name, "delete PodGroup", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn training(namespace: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> ObjectMeta {
        let map = |kv: &[(&str, &str)]| Some(kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect());
        ObjectMeta {
            name: Some("worker-0".into()),
            namespace: Some(namespace.into()),
            labels: map(labels),
            annotations: map(annotations),
            ..Default::default()
        }
    }

    fn placed_core(namespace: &str, core: &str) -> ObjectMeta {
        training(
            namespace,
            &[(keys::LABEL_ROLE, keys::ROLE_CORE)],
            &[
                (keys::ANNOTATION_GANG, "job"),
                (keys::ANNOTATION_PLACEMENT, "tidepool-b"),
                (keys::ANNOTATION_GANG_CORE, core),
            ],
        )
    }

    #[test]
    fn a_gangs_group_has_its_core_as_min_member() {
        let group = member_group(&placed_core("team-a", "4"), None, "training", "tidepool-b").expect("a gang");
        assert_eq!(group.min_member, 4);
        assert_eq!(group.name, group_name("training", "team-a", "gang", "job"));
        let object = pod_group(GangScheduler::Coscheduling, &group, "tp-team-a", "training", "member-b");
        assert_eq!(object.data["spec"]["minMember"], 4);
        let types = object.types.as_ref().expect("typed");
        assert_eq!((types.api_version.as_str(), types.kind.as_str()), ("scheduling.x-k8s.io/v1alpha1", "PodGroup"));
        assert_eq!(object.metadata.namespace.as_deref(), Some("tp-team-a"));
        let labels = object.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels.get(keys::LABEL_ORIGIN_MEMBER).map(String::as_str), Some("member-b"));
        assert_eq!(labels.get(keys::LABEL_ORIGIN_CLUSTER).map(String::as_str), Some("training"));
        let volcano = pod_group(GangScheduler::Volcano, &group, "tp-team-a", "training", "member-b");
        let types = volcano.types.as_ref().expect("typed");
        assert_eq!(types.api_version, "scheduling.volcano.sh/v1beta1");
        let native = pod_group(GangScheduler::Kubernetes, &group, "tp-team-a", "training", "member-b");
        let types = native.types.as_ref().expect("typed");
        assert_eq!(types.api_version, "scheduling.k8s.io/v1beta1");
        assert_eq!(native.data["spec"]["schedulingPolicy"], json!({"gang": {"minCount": 4}}), "a gang of the core");
        let classed = group.clone().with_priority_class(Some("tidepool-offload-medium"));
        let native = pod_group(GangScheduler::Kubernetes, &classed, "tp-team-a", "training", "member-b");
        assert_eq!(native.data["spec"]["priorityClassName"], "tidepool-offload-medium", "the copies' class");
        assert_eq!(native.data["spec"]["preemptionPolicy"], "Never", "as the copies'");
    }

    #[test]
    fn under_kubernetes_gang_scheduling_only_the_core_joins() {
        let core = placed_core("team-a", "4");
        let mut elastic = core.clone();
        elastic.labels = Some(BTreeMap::from([(keys::LABEL_ROLE.to_owned(), keys::ROLE_ELASTIC.to_owned())]));
        assert!(joins(GangScheduler::Kubernetes, &core));
        assert!(!joins(GangScheduler::Kubernetes, &elastic), "another priority: the group would be refused");
        assert!(joins(GangScheduler::Volcano, &elastic) && joins(GangScheduler::Coscheduling, &elastic));
    }

    #[test]
    fn the_core_size_counts_only_on_a_core_pod_placed_on_this_node() {
        assert_eq!(min_member(&placed_core("team-a", "4"), "tidepool-b"), 4);
        assert_eq!(min_member(&placed_core("team-a", "4"), "tidepool-a"), 1, "placed elsewhere: not trusted");
        let mut elastic = placed_core("team-a", "4");
        elastic.labels = Some(BTreeMap::from([(keys::LABEL_ROLE.to_owned(), keys::ROLE_ELASTIC.to_owned())]));
        assert_eq!(min_member(&elastic, "tidepool-b"), 1, "an elastic pod does not size the group");
        assert_eq!(min_member(&placed_core("team-a", "zero"), "tidepool-b"), 1);
        assert_eq!(min_member(&placed_core("team-a", "0"), "tidepool-b"), 1);
    }

    #[test]
    fn a_pod_without_a_gang_has_no_group_and_sources_go_in_the_dispatchers_order() {
        assert_eq!(member_group(&training("team-a", &[], &[]), None, "training", "n"), None);
        let all = training(
            "team-a",
            &[(keys::LABEL_POD_GROUP, "pg")],
            &[(keys::ANNOTATION_VOLCANO_GROUP, "vg"), (keys::ANNOTATION_GANG, "g")],
        );
        assert_eq!(gang_source(&all, None), Some(("podgroup", "pg")));
        assert_eq!(gang_source(&all, Some("native")), Some(("native", "native")), "Kubernetes' own first");
        let group = member_group(&all, Some("trainers"), "training", "n").expect("a gang");
        assert_eq!(group.name, group_name("training", "team-a", "native", "trainers"));
        let volcano = training("team-a", &[], &[(keys::ANNOTATION_VOLCANO_GROUP, "vg"), (keys::ANNOTATION_GANG, "g")]);
        assert_eq!(gang_source(&volcano, None), Some(("volcano", "vg")));
    }

    #[test]
    fn names_fit_a_label_value_and_differ_across_namespaces_kinds_and_clusters() {
        let long = "Job_With.A-Name-That-Goes-On-And-On-Far-Beyond-What-A-Label-Value-Can-Hold";
        let name = group_name("training", "team-a", "podgroup", long);
        assert!(name.len() <= 63, "{name}");
        assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'), "{name}");
        assert!(name.starts_with("tp-podgroup-job-with-a-name"), "{name}");
        assert!(!name.ends_with('-'));
        let base = group_name("training", "team-a", "gang", "job");
        assert_ne!(base, group_name("training", "team-b", "gang", "job"), "another namespace");
        assert_ne!(base, group_name("training", "team-a", "podgroup", "job"), "another source");
        assert_ne!(base, group_name("other", "team-a", "gang", "job"), "another training cluster");
        assert_ne!(group_name("t", "n", "gang", "a.b"), group_name("t", "n", "gang", "a-b"), "alike once made a label");
        assert!(group_name("t", "n", "gang", "___").starts_with("tp-gang-"));
    }

    #[test]
    fn a_copy_joins_only_the_group_tidepool_names() {
        let mut copy = Pod { spec: Some(Default::default()), ..Default::default() };
        let (mut labels, mut annotations) = (BTreeMap::new(), BTreeMap::new());
        labels.insert(keys::LABEL_POD_GROUP.to_owned(), "someone-elses".to_owned());
        annotations.insert(keys::ANNOTATION_VOLCANO_GROUP.to_owned(), "someone-elses".to_owned());
        annotations.insert(keys::LABEL_POD_GROUP.to_owned(), "someone-elses".to_owned());
        drop_tenant_membership(&mut labels, &mut annotations);
        assert!(labels.is_empty() && annotations.is_empty(), "{labels:?} {annotations:?}");
        join(&mut copy, GangScheduler::Coscheduling, "scheduler-plugins-scheduler", "tp-gang-job-0123456789");
        assert_eq!(group_of(&copy, GangScheduler::Coscheduling), Some("tp-gang-job-0123456789"));
        let spec = copy.spec.as_ref().expect("spec");
        assert_eq!(spec.scheduler_name.as_deref(), Some("scheduler-plugins-scheduler"));
        let mut volcano = Pod { spec: Some(Default::default()), ..Default::default() };
        join(&mut volcano, GangScheduler::Volcano, "volcano", "tp-gang-job-0123456789");
        assert_eq!(group_of(&volcano, GangScheduler::Volcano), Some("tp-gang-job-0123456789"));
        assert_eq!(group_of(&volcano, GangScheduler::Coscheduling), None);
        assert_eq!(volcano.spec.and_then(|s| s.scheduler_name).as_deref(), Some("volcano"));
        let mut native = Pod { spec: Some(Default::default()), ..Default::default() };
        join(&mut native, GangScheduler::Kubernetes, "default-scheduler", "tp-gang-job-0123456789");
        assert_eq!(group_of(&native, GangScheduler::Kubernetes), Some("tp-gang-job-0123456789"));
        assert_eq!(group_of(&native, GangScheduler::Volcano), None);
        assert!(native.metadata.labels.is_none() && native.metadata.annotations.is_none(), "the spec names it");
        let spec = native.spec.expect("spec");
        assert_eq!(spec.scheduler_name.as_deref(), Some("default-scheduler"));
    }

    #[test]
    fn only_groups_nothing_needs_are_unused() {
        let existing = vec![("tp-a".to_owned(), "g1".to_owned()), ("tp-a".to_owned(), "g2".to_owned())];
        let needed = BTreeSet::from([("tp-a".to_owned(), "g1".to_owned()), ("tp-b".to_owned(), "g2".to_owned())]);
        let gone: Vec<_> = unused(&existing, &needed).collect();
        assert_eq!(gone, [&("tp-a".to_owned(), "g2".to_owned())], "a name needed in another namespace is not this one");
    }
}
