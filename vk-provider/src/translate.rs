//! Pod translation between the training cluster and a member. Pure: tested on plain data.
//!
//! Down: a training pod bound to a virtual node becomes an offload pod in the member
//! namespace `<prefix><namespace>`, with origin labels, the pool's node selector, no trace
//! of the virtual node, no training-cluster credentials, and `preemptionPolicy: Never`.
//! Up: the offload pod's status becomes the training pod's, with the virtual node's address
//! as host IP.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvVar, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodAffinityTerm, PodCondition,
    PodSpec, PodStatus, PreferredSchedulingTerm, Toleration, Volume, WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use tidepool_api::colocation::Colocation;
use tidepool_api::keys;
use tidepool_api::pod::{StatusLite, SyncedStatus};

/// What translation needs to know besides the pod.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// Bridge `clusterName`.
    pub cluster: &'a str,
    /// `MemberCluster` name.
    pub member: &'a str,
    /// The copy's member namespace ([`tidepool_api::names::OffloadNamespaces`]).
    pub namespace: &'a str,
    /// The pool's node selector.
    pub node_selector: &'a BTreeMap<String, String>,
    /// The pool's tolerations: every copy carries them.
    pub tolerations: &'a [tidepool_api::crd::PoolToleration],
    /// The pool's topology label keys: the only keys (with the GPU model's) a planned domain
    /// may pin a copy to.
    pub topology: &'a [String],
    /// Reclaim band: picks the member PriorityClass.
    pub band: keys::Band,
    /// Training pod labels the member lets travel besides tidepool's own
    /// (`spec.copyLabels`: keys, or `<prefix>/*`).
    pub copy_labels: &'a [String],
    /// The same for annotations (`spec.copyAnnotations`).
    pub copy_annotations: &'a [String],
    /// `spec.maxTerminationGraceSeconds` of the member.
    pub max_termination_grace: tidepool_api::crd::TerminationGraceLimits,
    /// `spec.podSecurity` and `spec.userNamespaces` of the member: what the copy is
    /// hardened to.
    pub confinement: &'a tidepool_api::crd::Confinement,
    /// The pool's mode: in a colocation mode the copy asks for the member's batch resources
    /// and carries what marks it as batch work there ([`colocate`]).
    pub mode: tidepool_api::crd::PoolMode,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    #[error("pod has no {0}")]
    MissingField(&'static str),
    /// The copy's namespace cannot exist in the member: the pod fails with this reason.
    #[error(transparent)]
    NamespaceTooLong(#[from] tidepool_api::names::NamespaceTooLong),
}

impl TranslateError {
    /// Reason of the training pod's failure and Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MissingField(_) => "OffloadInvalid",
            Self::NamespaceTooLong(_) => "OffloadNamespaceTooLong",
        }
    }
}

/// Member namespace of a training namespace.
pub use tidepool_api::names::member_namespace;

/// Node labels under a Kubernetes domain that a tenant's node selector keeps: they describe
/// hardware and topology, not what a node is for.
const SELECTABLE_NODE_LABELS: [&str; 5] = [
    "kubernetes.io/arch",
    "kubernetes.io/os",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "node.kubernetes.io/instance-type",
];

/// Node selector keys the copy drops: those of the virtual node (`type`, `tidepool.io/…`),
/// and every other key under a Kubernetes domain (`kubernetes.io`, `k8s.io` and their
/// subdomains) but [`SELECTABLE_NODE_LABELS`]. Those name a node's role or the node itself
/// (`node-role.kubernetes.io/control-plane`, `kubernetes.io/hostname`): a tenant could pick
/// out nodes of the pool the member never meant to run guests on. A selector only narrows
/// the pool's, so other keys (`disktype`, `nvidia.com/gpu.product`) are harmless.
fn steers_onto_reserved_nodes(key: &str) -> bool {
    let domain = key.split_once('/').map(|(d, _)| d);
    let kubernetes = domain.is_some_and(|d| {
        ["kubernetes.io", "k8s.io"].iter().any(|k| d == *k || d.strip_suffix(k).is_some_and(|sub| sub.ends_with('.')))
    });
    key == keys::LABEL_NODE_TYPE
        || domain.is_some_and(|d| d == keys::GROUP || d.ends_with(".tidepool.io"))
        || (kubernetes && !SELECTABLE_NODE_LABELS.contains(&key))
}

/// Taints of a node's lifecycle a copy keeps tolerating, as every pod does by default (the
/// DefaultTolerationSeconds admission gives each 300 s of both): NoExecute only, for at
/// most [`MAX_LIFECYCLE_TOLERATION_SECONDS`]. Every other toleration of the tenant is
/// dropped: `node-role.kubernetes.io/control-plane`, `node.kubernetes.io/unschedulable`
/// (cordoned), `dedicated=…` would carry the copy onto nodes the member keeps from guests.
/// What a pool's nodes need, the pool grants (`spec.pools[].tolerations`, added below).
const LIFECYCLE_TAINTS: [&str; 2] = ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"];
pub const MAX_LIFECYCLE_TOLERATION_SECONDS: i64 = 300;

/// The tenant's toleration `t` as the copy keeps it, if at all (see [`LIFECYCLE_TAINTS`]).
fn lifecycle_toleration(t: &Toleration) -> Option<Toleration> {
    let lifecycle = t.key.as_deref().is_some_and(|k| LIFECYCLE_TAINTS.contains(&k));
    if !lifecycle || t.effect.as_deref() != Some("NoExecute") {
        return None;
    }
    let seconds =
        t.toleration_seconds.map_or(MAX_LIFECYCLE_TOLERATION_SECONDS, |s| s.min(MAX_LIFECYCLE_TOLERATION_SECONDS));
    Some(Toleration { toleration_seconds: Some(seconds), ..t.clone() })
}

/// Keeps a pod (anti-)affinity term of the copy only when it speaks of the pod's own
/// namespace (no `namespaces`, or only its own name, which becomes "its own" again in the
/// member). A term naming other namespaces, or with a namespace selector (even `{}`: every
/// namespace), goes: in the member it would reach namespaces that are not this tenant's —
/// another tenant's offload namespace, or, with same-named namespaces, the member's own — so a
/// copy could seek out other pods or, with required anti-affinity, which the scheduler also
/// checks for pods placed after it, keep them off nodes.
fn confine_term(term: &mut PodAffinityTerm, own: &str) -> bool {
    if term.namespace_selector.is_some() {
        return false;
    }
    match term.namespaces.as_deref() {
        None | Some([]) => true,
        Some(names) if names.iter().all(|ns| ns == own) => {
            term.namespaces = None;
            true
        }
        Some(_) => false,
    }
}

fn confine_terms(
    required: &mut Option<Vec<PodAffinityTerm>>,
    preferred: &mut Option<Vec<WeightedPodAffinityTerm>>,
    own: &str,
) {
    if let Some(terms) = required.as_mut() {
        terms.retain_mut(|t| confine_term(t, own));
    }
    if let Some(terms) = preferred.as_mut() {
        terms.retain_mut(|t| confine_term(&mut t.pod_affinity_term, own));
    }
}

/// Labels of the training pod every copy carries: tidepool's own. (The origin labels are
/// set by translation itself, over anything the tenant wrote.)
const COPIED_LABELS: [&str; 2] = [keys::LABEL_GANG, keys::LABEL_BAND];
/// Annotations of the training pod every copy carries at creation: none of tidepool's. The
/// reclaim notice (`tidepool.io/reclaim-deadline`) is written on the copy by the pod sync once
/// tidepool's own condition says it is real ([`notice_for_copy`]): a tenant who writes the
/// annotation on a training pod must not make its trainer (or a gang mate) see a notice.
const COPIED_ANNOTATIONS: [&str; 0] = [];

/// What of a training pod's labels (or annotations) its copy carries: `fixed` (tidepool's
/// own) and what the member lists (`spec.copyLabels`/`copyAnnotations`: a key, or
/// `<prefix>/*`), never another `tidepool.io/` key.
///
/// An allowlist, not "everything but reserved prefixes": in a member, plain labels are
/// credentials. Its NetworkPolicies let in pods by label from any namespace
/// (`namespaceSelector: {}` with `podSelector: {app: api}`), its mesh and monitoring pick
/// pods by label, and annotations steer its controllers (`sidecar.istio.io/inject`,
/// `cluster-autoscaler.kubernetes.io/safe-to-evict`). Which of them a tenant may set is
/// known only to the member's admin, hence the per-member lists. Services mirrored to the
/// member will select copies by tidepool's labels or by labels the member lists.
fn copied_metadata(
    from: Option<&BTreeMap<String, String>>,
    fixed: &[&str],
    member: &[String],
) -> BTreeMap<String, String> {
    let listed = |key: &str| {
        !key.starts_with("tidepool.io/")
            && member.iter().any(|entry| match entry.strip_suffix("/*") {
                Some(prefix) => key.split_once('/').is_some_and(|(p, _)| p == prefix),
                None => entry == key,
            })
    };
    from.into_iter()
        .flatten()
        .filter(|(k, _)| fixed.contains(&k.as_str()) || listed(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The offload copy of `pod` for `target`.
pub fn offload_pod(pod: &Pod, target: &Target<'_>) -> Result<Pod, TranslateError> {
    let meta = &pod.metadata;
    let name = meta.name.clone().ok_or(TranslateError::MissingField("metadata.name"))?;
    let namespace = meta.namespace.clone().ok_or(TranslateError::MissingField("metadata.namespace"))?;
    let uid = meta.uid.clone().ok_or(TranslateError::MissingField("metadata.uid"))?;
    let spec = pod.spec.as_ref().ok_or(TranslateError::MissingField("spec"))?;

    let mut labels = copied_metadata(meta.labels.as_ref(), &COPIED_LABELS, target.copy_labels);
    // What mirrored Services select by (see crate::services): tenant labels only under
    // tidepool's prefix.
    labels.extend(crate::services::selector_labels(meta.labels.as_ref()));
    labels.insert(keys::LABEL_ORIGIN_UID.to_owned(), uid);
    labels.insert(keys::LABEL_ORIGIN_CLUSTER.to_owned(), target.cluster.to_owned());
    labels.insert(keys::LABEL_ORIGIN_MEMBER.to_owned(), target.member.to_owned());
    let mut annotations = copied_metadata(meta.annotations.as_ref(), &COPIED_ANNOTATIONS, target.copy_annotations);
    annotations.insert(keys::ANNOTATION_ORIGIN_NAMESPACE.to_owned(), namespace.clone());
    annotations.insert(keys::ANNOTATION_ORIGIN_NAME.to_owned(), name.clone());
    // A copy's PodGroup is tidepool's to name (see crate::gang_group), never the tenant's.
    crate::gang_group::drop_tenant_membership(&mut labels, &mut annotations);
    let mut spec = offload_spec(spec, target, (&namespace, meta.annotations.as_ref()));
    crate::downward::resolve_env(&mut spec, pod);
    if let Some(colocation) = target.mode.colocation() {
        colocate(colocation, &mut labels, &mut annotations, &mut spec);
    }

    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(target.namespace.to_owned()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// Makes a copy batch work of `colocation`: requests and limits under its resource names,
/// its PriorityClass, labels and annotations. A class of the colocation system decides the
/// preemption policy itself (the API refuses a pod that names another), and the copy asks
/// for none of the member's ordinary `cpu` and `memory`, so it cannot preempt online pods.
fn colocate(
    colocation: &Colocation,
    labels: &mut BTreeMap<String, String>,
    annotations: &mut BTreeMap<String, String>,
    spec: &mut PodSpec,
) {
    colocation.convert_spec(spec);
    if let Some(class) = colocation.priority_class {
        spec.priority_class_name = Some(class.to_owned());
        spec.preemption_policy = None;
    }
    labels.extend(colocation.labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    annotations.extend(colocation.annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
}

/// The node affinity a copy gets from its gang's plan: a required `key In [value]` for each
/// pair of `tidepool.io/planned-domain` whose key is one of the pool's `topology` keys or the
/// GPU model label (and whose value is a valid label value), and a preferred term (weight
/// 100) for `tidepool.io/planned-node`. Any other pair is dropped: a tenant can write any
/// annotation, and a forged key must not steer the copy anywhere the pool does not allow.
/// The member's scheduler still checks fit. `None` when the plan constrains nothing.
pub fn planned_affinity(annotations: Option<&BTreeMap<String, String>>, topology: &[String]) -> Option<NodeAffinity> {
    let annotations = annotations?;
    let allowed = |k: &str| topology.iter().any(|t| t == k) || k == tidepool_federation::capacity::GPU_PRODUCT_LABEL;
    let required: Vec<NodeSelectorRequirement> = annotations
        .get(keys::ANNOTATION_PLANNED_DOMAIN)
        .map(|d| keys::parse_planned_domain(d))
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, v)| allowed(k) && is_label_value(v))
        .map(|(key, value)| NodeSelectorRequirement { key, operator: "In".into(), values: Some(vec![value]) })
        .collect();
    let node = annotations.get(keys::ANNOTATION_PLANNED_NODE).filter(|n| tidepool_api::is_dns_subdomain(n));
    let preferred = node.map(|n| {
        vec![PreferredSchedulingTerm {
            weight: 100,
            preference: NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".into(),
                    operator: "In".into(),
                    values: Some(vec![n.clone()]),
                }]),
                ..Default::default()
            },
        }]
    });
    if required.is_empty() && preferred.is_none() {
        return None;
    }
    Some(NodeAffinity {
        required_during_scheduling_ignored_during_execution: (!required.is_empty()).then(|| NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm { match_expressions: Some(required), ..Default::default() }],
        }),
        preferred_during_scheduling_ignored_during_execution: preferred,
    })
}

/// A label value the API server accepts: empty, or at most 63 alphanumerics, `-`, `_`, `.`,
/// beginning and ending alphanumeric.
fn is_label_value(v: &str) -> bool {
    v.is_empty()
        || (v.len() <= 63
            && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && v.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && v.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric()))
}

fn offload_spec(
    spec: &PodSpec,
    target: &Target<'_>,
    (namespace, annotations): (&str, Option<&BTreeMap<String, String>>),
) -> PodSpec {
    let mut s = spec.clone();
    keep_in_pool(&mut s, target, (namespace, annotations));
    // Offload pods are guests: they never preempt online pods. Priority is the member's
    // business (its admission derives it from the class), so the training values go.
    s.priority = None;
    s.priority_class_name = Some(target.band.priority_class());
    s.preemption_policy = Some("Never".to_owned());
    s.termination_grace_period_seconds =
        Some(copy_grace(spec.termination_grace_period_seconds, target.max_termination_grace.get(target.band)));
    drop_training_credentials(&mut s);
    crate::harden::harden(&mut s, target.confinement);
    // Debug containers someone added to the training pod belong to it: the API refuses a new
    // pod that has any, and they were not meant to run in a member.
    s.ephemeral_containers = None;
    add_annotations_volume(&mut s);
    add_ack_exit_code(&mut s);
    s
}

/// The environment variable that tells a trainer which code to exit with after its ack.
pub const ACK_EXIT_CODE_ENV: &str = "TIDEPOOL_ACK_EXIT_CODE";

/// The exit code after an ack that the pod's controller takes for what it is, an interruption
/// to restart from the checkpoint: 143, as a process SIGTERM ended, when the pod never
/// restarts a container (`restartPolicy: Never`, which Kubeflow's `ExitCode` policy sets: it
/// retries codes of 128 and more and fails the job on others, 0 included); 0 otherwise (under
/// `OnFailure` a non-zero code would restart the container in the member).
pub fn ack_exit_code(restart_policy: Option<&str>) -> &'static str {
    if restart_policy == Some("Never") { "143" } else { "0" }
}

/// Sets [`ACK_EXIT_CODE_ENV`] in every container that does not set it itself (see
/// `deploy/docs/tenants.md`, "The ack").
fn add_ack_exit_code(s: &mut PodSpec) {
    let code = ack_exit_code(s.restart_policy.as_deref());
    for c in &mut s.containers {
        let env = c.env.get_or_insert_with(Vec::new);
        if !env.iter().any(|e| e.name == ACK_EXIT_CODE_ENV) {
            env.push(EnvVar { name: ACK_EXIT_CODE_ENV.to_owned(), value: Some(code.to_owned()), value_from: None });
        }
    }
}

/// Scheduling belongs to the member: its own scheduler, inside the pool (its selector and
/// tolerations), within the domain its gang was planned into.
fn keep_in_pool(
    s: &mut PodSpec,
    target: &Target<'_>,
    (namespace, annotations): (&str, Option<&BTreeMap<String, String>>),
) {
    s.node_name = None;
    s.scheduler_name = None;
    // The training pod's native PodGroup lives in the training cluster: a member would hold
    // the copy for a group it does not have. Only the member's own group is joined
    // (`gang_group::join`).
    s.scheduling_group = None;
    let mut selector: BTreeMap<String, String> = s
        .node_selector
        .take()
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !steers_onto_reserved_nodes(k))
        .collect();
    selector.extend(target.node_selector.iter().map(|(k, v)| (k.clone(), v.clone())));
    s.node_selector = (!selector.is_empty()).then_some(selector);
    if let Some(affinity) = s.affinity.as_mut() {
        // Node affinity names training-cluster nodes (the virtual one); the pool selector
        // above replaces it.
        affinity.node_affinity = None;
        if let Some(a) = affinity.pod_affinity.as_mut() {
            confine_terms(
                &mut a.required_during_scheduling_ignored_during_execution,
                &mut a.preferred_during_scheduling_ignored_during_execution,
                namespace,
            );
        }
        if let Some(a) = affinity.pod_anti_affinity.as_mut() {
            confine_terms(
                &mut a.required_during_scheduling_ignored_during_execution,
                &mut a.preferred_during_scheduling_ignored_during_execution,
                namespace,
            );
        }
    }
    if let Some(planned) = planned_affinity(annotations, target.topology) {
        s.affinity.get_or_insert_with(Default::default).node_affinity = Some(planned);
    }
    if let Some(tolerations) = s.tolerations.take() {
        let kept: Vec<Toleration> = tolerations.iter().filter_map(lifecycle_toleration).collect();
        s.tolerations = (!kept.is_empty()).then_some(kept);
    }
    if !target.tolerations.is_empty() {
        s.tolerations.get_or_insert_with(Vec::new).extend(target.tolerations.iter().map(|t| t.to_toleration()));
    }
}

/// No credentials of the training cluster travel (its projected service-account tokens
/// and their mounts), and none of the member are mounted.
fn drop_training_credentials(s: &mut PodSpec) {
    s.service_account_name = None;
    #[allow(deprecated)]
    {
        s.service_account = None;
    }
    s.automount_service_account_token = Some(false);
    let token_volumes: Vec<String> =
        s.volumes.iter().flatten().filter(|v| carries_training_token(v)).map(|v| v.name.clone()).collect();
    if let Some(volumes) = s.volumes.as_mut() {
        volumes.retain(|v| !token_volumes.contains(&v.name));
    }
    for c in s.containers.iter_mut().chain(s.init_containers.iter_mut().flatten()) {
        if let Some(mounts) = c.volume_mounts.as_mut() {
            mounts.retain(|m| !token_volumes.contains(&m.name));
        }
    }
}

/// The copy's `terminationGracePeriodSeconds`: the training pod's (the API default, 30 s, when
/// it has none), never shortened except by the member admin's bound for the band. When the
/// member's scheduler preempts a copy itself there is no notice: SIGTERM is the trainer's
/// only warning, and this is its time to checkpoint.
pub fn copy_grace(tenant: Option<i64>, bound: Option<u32>) -> i64 {
    let asked = tenant.unwrap_or(DEFAULT_TERMINATION_GRACE).max(0);
    bound.map_or(asked, |b| asked.min(i64::from(b)))
}

/// The API server's default `terminationGracePeriodSeconds`.
const DEFAULT_TERMINATION_GRACE: i64 = 30;

/// Who else owns member namespace `meta`, if it is not one this training cluster's tidepool
/// created (labels managed-by tidepool and origin-cluster `cluster`): then nothing of ours
/// goes in. Two training clusters sharing one offload namespace would see and mount each
/// other's copies; a namespace tidepool did not create is somebody's.
pub fn foreign_namespace(meta: &ObjectMeta, cluster: &str, (member, origin): (&str, &str)) -> Option<String> {
    let label = |key: &str| meta.labels.as_ref().and_then(|l| l.get(key)).map(String::as_str);
    if label(keys::LABEL_MANAGED_BY) != Some(keys::MANAGED_BY) {
        return Some("a namespace not created by tidepool".to_owned());
    }
    match (label(keys::LABEL_ORIGIN_CLUSTER), label(keys::LABEL_ORIGIN_MEMBER)) {
        (Some(origin), _) if origin != cluster => Some(format!("the offload namespace of training cluster {origin}")),
        (None, _) => Some("a tidepool namespace of no known training cluster".to_owned()),
        // The same member bridged twice: each MemberCluster has namespaces of its own.
        (Some(_), Some(other)) if other != member => Some(format!("the offload namespace of MemberCluster {other}")),
        // Two training namespaces meeting in one name (`tp-team-a` and `team-a` fallen back).
        (Some(_), _) if label(keys::LABEL_ORIGIN_NAMESPACE).is_some_and(|o| o != origin) => Some(format!(
            "the offload namespace of training namespace {}",
            label(keys::LABEL_ORIGIN_NAMESPACE).unwrap_or_default()
        )),
        // Ours; or made before namespaces named their MemberCluster (each had its prefix).
        (Some(_), _) => None,
    }
}

/// True for a volume holding a service-account token of the training cluster (the projected
/// `kube-api-access-*` volume): translation drops it, so nothing it references travels.
pub fn carries_training_token(volume: &Volume) -> bool {
    volume.projected.as_ref().is_some_and(|p| p.sources.iter().flatten().any(|src| src.service_account_token.is_some()))
}

/// Band of the offload copy of `pod`: the band the dispatcher gave it
/// ([`tidepool_api::pod::band_of`]), else `medium` (a pod placed by hand is treated as gang
/// core).
pub fn copy_band(pod: &Pod) -> keys::Band {
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    tidepool_api::pod::band_of(&pod.metadata, node).unwrap_or(keys::Band::Medium)
}

/// Name of the downward-API volume that shows a pod its own annotations (and so the
/// reclaim notice) at `/etc/tidepool/annotations`, without any credentials.
pub const ANNOTATIONS_VOLUME: &str = "tidepool-annotations";
pub const ANNOTATIONS_DIR: &str = "/etc/tidepool";

fn add_annotations_volume(s: &mut PodSpec) {
    use k8s_openapi::api::core::v1::{
        DownwardAPIVolumeFile, DownwardAPIVolumeSource, ObjectFieldSelector, Volume, VolumeMount,
    };
    let volumes = s.volumes.get_or_insert_with(Vec::new);
    if volumes.iter().any(|v| v.name == ANNOTATIONS_VOLUME) {
        return;
    }
    volumes.push(Volume {
        name: ANNOTATIONS_VOLUME.to_owned(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "annotations".to_owned(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.annotations".to_owned(),
                    api_version: None,
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    for c in s.containers.iter_mut().chain(s.init_containers.iter_mut().flatten()) {
        let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
        if mounts.iter().any(|m| m.mount_path == ANNOTATIONS_DIR) {
            continue;
        }
        mounts.push(VolumeMount {
            name: ANNOTATIONS_VOLUME.to_owned(),
            mount_path: ANNOTATIONS_DIR.to_owned(),
            read_only: Some(true),
            ..Default::default()
        });
    }
}

/// The reclaim deadline to show the copy of a training pod: the pod's deadline annotation,
/// only while tidepool's notice condition is on the pod ([`tidepool_api::pod::under_notice`]).
pub fn notice_for_copy<'a>(annotations: &'a BTreeMap<String, String>, ours: &[PodCondition]) -> Option<&'a str> {
    if !tidepool_api::pod::under_notice(ours) {
        return None;
    }
    annotations.get(keys::ANNOTATION_RECLAIM_DEADLINE).map(String::as_str)
}

/// A copy that ended while its training pod is under notice ended because of the notice (its
/// trainer checkpointed and exited): the training pod is not `Succeeded` (a Job would count
/// it done) nor `Failed` of its own making (a failure against `backoffLimit`). It stays
/// `Running`, with the containers' terminated states, so the dispatcher sees the exit (and
/// any ack in the termination message) and ends it as reclaimed: `Failed`, reason
/// `Reclaimed`, with `DisruptionTarget`.
pub fn hold_for_reclaim(desired: &mut PodStatus, ours: &[PodCondition]) {
    let ended = matches!(desired.phase.as_deref(), Some("Succeeded" | "Failed"));
    if ended && tidepool_api::pod::under_notice(ours) {
        desired.phase = Some("Running".to_owned());
        desired.reason = None;
        desired.message = None;
    }
}

/// Keeps the conditions tidepool itself wrote on the training pod (`tidepool.io/…`, such as
/// a reclaim notice) when the member's status is copied over it.
pub fn keep_tidepool_conditions(desired: &mut PodStatus, ours: &[PodCondition]) {
    if !ours.is_empty() {
        let conditions = desired.conditions.get_or_insert_with(Vec::new);
        for c in ours {
            // A member's own DisruptionTarget (it preempted the copy meanwhile) wins.
            if !conditions.iter().any(|have| have.type_ == c.type_) {
                conditions.push(c.clone());
            }
        }
    }
}

/// The reason of a true `DisruptionTarget` condition of `status`, if any.
pub fn disruption_reason(status: Option<&PodStatus>) -> Option<&str> {
    status.and_then(tidepool_api::pod::disruption_reason)
}

/// Why an offload pod that ran vanished from its member, from the reason of the
/// `DisruptionTarget` condition the member set before deleting it (copied up with its
/// status): a reason for the training pod and a phrase for the message.
pub fn member_disruption(target: Option<&str>) -> (&'static str, &'static str) {
    match target {
        Some("PreemptionByScheduler") => ("PreemptedByMember", "was preempted by an online pod"),
        Some("EvictionByEvictionAPI") => ("EvictedByMember", "was evicted"),
        Some("DeletionByTaintManager") => ("EvictedByMember", "was evicted by a node taint"),
        Some("TerminationByKubelet") => ("EvictedByMember", "was terminated by the member's kubelet"),
        Some("DeletionByPodGC") => ("OffloadPodLost", "was garbage-collected"),
        Some(keys::REASON_DISRUPTION_RECLAIM) => (keys::REASON_RECLAIMED, "was reclaimed by tidepool"),
        _ => ("OffloadPodLost", "disappeared"),
    }
}

/// The training pod's status for an offload pod's status. `host_ip` is the virtual node's
/// address: tenants see their pod on the virtual node, not on a member node. What the member
/// says is bounded first ([`crate::bounded::from_member`]).
pub fn training_status(offload: &PodStatus, host_ip: &str) -> PodStatus {
    let mut s = offload.clone();
    crate::bounded::from_member(&mut s);
    let placed = s.phase.as_deref().is_some_and(|p| p != "Pending") || s.start_time.is_some();
    if placed {
        s.host_ip = Some(host_ip.to_owned());
        s.host_ips = Some(vec![k8s_openapi::api::core::v1::HostIP { ip: host_ip.to_owned() }]);
    } else {
        s.host_ip = None;
        s.host_ips = None;
    }
    // The member's nominated node means nothing in the training cluster.
    s.nominated_node_name = None;
    s.resize = None;
    s.observed_generation = None;
    s
}

/// Maps the objects of a watch event (a cache keeps a reduced form of what it watches).
pub fn map_event<A, B>(event: watcher::Event<A>, f: impl Fn(A) -> B) -> watcher::Event<B> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(f(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(f(o)),
        watcher::Event::InitApply(o) => watcher::Event::InitApply(f(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// What [`status_settles_in`] answers when the write waits for the pod's next change rather
/// than for a time: its caller then waits for that change, not for a timer.
pub const UNTIL_NEXT_CHANGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Whether copying `desired` up should wait, and how long, while the pod is Pending on both
/// sides and only its conditions changed. `None`: write now.
///
/// - The member's scheduler placing the copy (`PodScheduled` turning true) alone waits for
///   the next change: the training pod is bound to its virtual node already, so that says
///   nothing new, and in a burst, where copies wait seconds for the member's scheduler and
///   nodes, it would cost the training API server a write per pod.
/// - Any other new condition (the member cannot place the copy, say) waits until the
///   newest is `settle` old — the pod usually runs by then, and one write carries both
///   changes. A condition stamped in the future (a member clock ahead of ours) never delays
///   a write.
/// - A copy's status that a merge patch would not change anything with (no conditions,
///   address or start time: `merges_to_nothing`) waits for the next change.
///
/// `current` is the training pod's status as the cache has it, `desired_digest` the
/// digest of `desired`.
pub fn status_settles_in(
    current: &StatusLite,
    desired: &PodStatus,
    desired_digest: &SyncedStatus,
    now: jiff::Timestamp,
    settle: std::time::Duration,
) -> Option<std::time::Duration> {
    current.synced.all?;
    let pending = |phase: Option<&str>| phase.is_none_or(|p| p == "Pending");
    if !pending(current.phase.as_deref()) || !pending(desired.phase.as_deref()) {
        return None;
    }
    if current.synced.pending_detail != desired_digest.pending_detail {
        return None;
    }
    if merges_to_nothing(desired) {
        return Some(UNTIL_NEXT_CHANGE);
    }
    let before = &current.synced.conditions;
    let new: Vec<&PodCondition> =
        desired.conditions.iter().flatten().filter(|c| !before.contains(&SyncedStatus::condition(c))).collect();
    if !new.is_empty() && new.iter().all(|c| c.type_ == "PodScheduled" && c.status == "True") {
        return Some(UNTIL_NEXT_CHANGE);
    }
    let newest = new.iter().filter_map(|c| c.last_transition_time.as_ref().map(|t| t.0)).max()?;
    settle_left(newest, now, settle)
}

/// What is left of `settle` after `newest` at `now`: `None` once it has passed, and when
/// `newest` is ahead of `now` (a member clock ahead of ours never delays a write).
fn settle_left(
    newest: jiff::Timestamp,
    now: jiff::Timestamp,
    settle: std::time::Duration,
) -> Option<std::time::Duration> {
    let age = now.duration_since(newest);
    let settle = jiff::SignedDuration::try_from(settle).ok()?;
    if age.is_negative() || age >= settle {
        return None;
    }
    std::time::Duration::try_from(settle - age).ok()
}

/// Whether a merge patch of `desired`, a Pending copy's status, leaves the Pending training pod
/// as it is (its container statuses, reason and message being the pod's already): no
/// conditions, no address, no start time. That is a copy just created, before the member's
/// scheduler has looked at it, of a pod the training scheduler or the dispatcher bound: the
/// Binding gave the training pod `PodScheduled`, which the copy lacks, so the digests differ,
/// yet writing would change nothing and cost the training API server a write per pod.
fn merges_to_nothing(desired: &PodStatus) -> bool {
    desired.conditions.is_none()
        && desired.pod_ip.is_none()
        && desired.pod_ips.as_ref().is_none_or(Vec::is_empty)
        && desired.host_ip.is_none()
        && desired.start_time.is_none()
}

/// Whether copying up `desired`, a copy's terminal status, should wait, and how long: while
/// a container still shows itself running or waiting in it. A member's kubelet can say
/// `Failed` a moment before it has the killed container's end (seen: an eviction written
/// with the container `waiting`, its `terminated` state 1 s later), and the training pod,
/// once terminal, takes no later status from its copy: it would keep a container that never
/// ends. So the write waits until the member has every container's end, or `settle` after
/// the newest condition change, whichever comes first, and then says what the member says.
pub fn terminal_settles_in(
    desired: &PodStatus,
    now: jiff::Timestamp,
    settle: std::time::Duration,
) -> Option<std::time::Duration> {
    let terminal = desired.phase.as_deref().is_some_and(|p| p == "Failed" || p == "Succeeded");
    let statuses =
        [&desired.init_container_statuses, &desired.container_statuses, &desired.ephemeral_container_statuses];
    let unended =
        statuses.into_iter().flatten().flatten().any(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_none()));
    if !terminal || !unended {
        return None;
    }
    let newest =
        desired.conditions.iter().flatten().filter_map(|c| c.last_transition_time.as_ref().map(|t| t.0)).max()?;
    settle_left(newest, now, settle)
}

#[cfg(test)]
mod tests {
    use super::*;

    static NO_CONFINEMENT: std::sync::LazyLock<tidepool_api::crd::Confinement> =
        std::sync::LazyLock::new(Default::default);
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;
    use tidepool_api::pod::PodLite;

    fn training_pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "trainer-0", "namespace": "team-a", "uid": "uid-1",
                         "labels": {"app": "trainer"}, "annotations": {"note": "x"}},
            "spec": {
                "nodeName": "tidepool-member-a",
                "schedulerName": "tidepool",
                "serviceAccountName": "default",
                "priority": 1500, "priorityClassName": "training-medium",
                "nodeSelector": {"type": "virtual-kubelet", "disktype": "ssd"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "tidepool.io/member", "operator": "In", "values": ["member-a"]}]}]}}},
                "tolerations": [
                    {"key": "tidepool.io/virtual", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
                ],
                "containers": [{"name": "main", "image": "trainer:1",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "volumeMounts": [{"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                                     {"name": "data", "mountPath": "/data"}]}],
                "volumes": [
                    {"name": "kube-api-access-abcde", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
                    {"name": "data", "emptyDir": {}}
                ]
            }
        }))
        .unwrap()
    }

    #[test]
    fn a_copy_runs_in_the_band_the_dispatcher_gave_and_a_hand_bound_pod_as_medium() {
        let with = |labels: serde_json::Value, annotations: serde_json::Value| {
            let mut pod = training_pod();
            pod.metadata.labels = serde_json::from_value(labels).unwrap();
            pod.metadata.annotations = serde_json::from_value(annotations).unwrap();
            pod
        };
        let placed = json!({keys::ANNOTATION_PLACEMENT: "tidepool-member-a"});
        for band in keys::Band::ALL {
            assert_eq!(copy_band(&with(json!({keys::LABEL_BAND: band.as_str()}), placed.clone())), band);
        }
        // Bound by hand: treated as gang core, whatever band label it carries.
        assert_eq!(copy_band(&with(json!({}), json!({}))), keys::Band::Medium);
        assert_eq!(copy_band(&with(json!({keys::LABEL_BAND: "high"}), json!({}))), keys::Band::Medium);
    }

    fn target(selector: &BTreeMap<String, String>) -> Target<'_> {
        Target {
            cluster: "training",
            member: "member-a",
            namespace: "tp-team-a",
            node_selector: selector,
            tolerations: &[],
            topology: &[],
            band: keys::Band::Medium,
            copy_labels: &[],
            copy_annotations: &[],
            max_termination_grace: Default::default(),
            confinement: &NO_CONFINEMENT,
            mode: Default::default(),
        }
    }

    #[test]
    fn a_copy_never_names_the_training_pods_native_pod_group() {
        let mut pod = training_pod();
        pod.spec.as_mut().unwrap().scheduling_group =
            Some(k8s_openapi::api::core::v1::PodSchedulingGroup { pod_group_name: Some("trainers".into()) });
        let no_selector = BTreeMap::new();
        let spec = offload_pod(&pod, &target(&no_selector)).unwrap().spec.unwrap();
        assert_eq!(spec.scheduling_group, None, "the member has no such group: it would hold the copy");
    }

    #[test]
    fn a_copy_requires_its_gangs_planned_domain_within_the_pools_keys_and_prefers_its_planned_node() {
        const ZONE: &str = "topology.kubernetes.io/zone";
        const RACK: &str = "example.com/rack";
        let mut pod = training_pod();
        let domain = format!("{ZONE}=z1,{RACK}=r2,nvidia.com/gpu.product=H100,evil.example/steer=x,{RACK}2=r9");
        pod.metadata.annotations = Some(
            [
                (keys::ANNOTATION_PLANNED_DOMAIN.to_owned(), domain),
                (keys::ANNOTATION_PLANNED_NODE.to_owned(), "node-7".to_owned()),
            ]
            .into(),
        );
        pod.spec.as_mut().unwrap().affinity.as_mut().unwrap().pod_anti_affinity = Some(
            serde_json::from_value(json!({
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm":
                    {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "trainer"}}}}]
            }))
            .unwrap(),
        );
        let topology = [ZONE.to_owned(), RACK.to_owned()];
        let no_selector = BTreeMap::new();
        let t = Target { topology: &topology, ..target(&no_selector) };
        let affinity = offload_pod(&pod, &t).unwrap().spec.unwrap().affinity.unwrap();
        let node = affinity.node_affinity.unwrap();
        let terms = node.required_during_scheduling_ignored_during_execution.unwrap().node_selector_terms;
        assert_eq!(terms.len(), 1, "one term: every pair is required together");
        let required: Vec<(String, String, Vec<String>)> = terms[0]
            .match_expressions
            .iter()
            .flatten()
            .map(|r| (r.key.clone(), r.operator.clone(), r.values.clone().unwrap_or_default()))
            .collect();
        let want = |k: &str, v: &str| (k.to_owned(), "In".to_owned(), vec![v.to_owned()]);
        assert_eq!(
            required,
            [want(ZONE, "z1"), want(RACK, "r2"), want("nvidia.com/gpu.product", "H100")],
            "the forged keys (not in the pool's topology) are dropped; the training pod's own node affinity too"
        );
        let preferred = node.preferred_during_scheduling_ignored_during_execution.unwrap();
        assert_eq!(preferred.len(), 1);
        assert_eq!(preferred[0].weight, 100);
        let fields = preferred[0].preference.match_fields.clone().unwrap();
        assert_eq!(
            (fields[0].key.as_str(), fields[0].values.clone().unwrap()),
            ("metadata.name", vec!["node-7".into()])
        );
        assert!(affinity.pod_anti_affinity.is_some(), "the copy keeps the rest of its affinity");

        // A pool without topology keys lets only the GPU model through; a forged domain alone
        // pins nothing.
        let plain = offload_pod(&pod, &target(&no_selector)).unwrap().spec.unwrap().affinity.unwrap();
        let required = plain.node_affinity.unwrap().required_during_scheduling_ignored_during_execution.unwrap();
        let keys: Vec<String> =
            required.node_selector_terms[0].match_expressions.iter().flatten().map(|r| r.key.clone()).collect();
        assert_eq!(keys, ["nvidia.com/gpu.product"]);
        let mut forged = training_pod();
        forged.metadata.annotations =
            Some([(keys::ANNOTATION_PLANNED_DOMAIN.to_owned(), "evil.example/steer=x".to_owned())].into());
        let spec = offload_pod(&forged, &t).unwrap().spec.unwrap();
        assert!(spec.affinity.unwrap().node_affinity.is_none());
    }

    #[test]
    fn the_pools_tolerations_are_added_and_the_tenants_tidepool_ones_dropped() {
        let mut pod = training_pod();
        pod.spec.as_mut().unwrap().tolerations.as_mut().unwrap().push(k8s_openapi::api::core::v1::Toleration {
            key: Some("tidepool.io/real-node".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        });
        let lend = tidepool_api::crd::PoolToleration {
            key: Some("tidepool.io/real-node".into()),
            operator: Some("Equal".into()),
            value: Some("true".into()),
            effect: Some("NoSchedule".into()),
        };
        let selector = BTreeMap::new();
        let pool = Target { tolerations: std::slice::from_ref(&lend), ..target(&selector) };
        let tolerations = offload_pod(&pod, &pool).unwrap().spec.unwrap().tolerations.unwrap();
        let seen: Vec<_> = tolerations.iter().map(|t| (t.key.as_deref(), t.value.as_deref())).collect();
        assert_eq!(seen, [(Some("node.kubernetes.io/not-ready"), None), (Some("tidepool.io/real-node"), Some("true"))]);
    }

    #[test]
    fn the_offload_pod_carries_its_origin_and_lands_in_the_mapped_namespace() {
        let selector = BTreeMap::from([("pool".to_string(), "gpu".to_string())]);
        let p = offload_pod(&training_pod(), &target(&selector)).unwrap();
        let labels = p.metadata.labels.unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("trainer-0"));
        assert_eq!(p.metadata.namespace.as_deref(), Some("tp-team-a"));
        assert_eq!(labels[keys::LABEL_ORIGIN_UID], "uid-1");
        assert_eq!(labels[keys::LABEL_ORIGIN_CLUSTER], "training");
        assert_eq!(labels[keys::LABEL_ORIGIN_MEMBER], "member-a");
        let ann = p.metadata.annotations.unwrap();
        assert_eq!(ann[keys::ANNOTATION_ORIGIN_NAMESPACE], "team-a");
        assert!(p.metadata.uid.is_none() && p.metadata.resource_version.is_none());
    }

    #[test]
    fn a_copy_for_a_koordinator_pool_is_batch_work_and_a_katalyst_one_reclaimed_cores() {
        use tidepool_api::crd::PoolMode;
        let mut pod = training_pod();
        let resources =
            json!({"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"cpu": "2", "nvidia.com/gpu": "1"}});
        pod.spec.as_mut().unwrap().containers[0].resources = Some(serde_json::from_value(resources).unwrap());
        let selector = BTreeMap::new();
        let koordinator = Target { mode: PoolMode::KoordinatorBatch, ..target(&selector) };
        let copy = offload_pod(&pod, &koordinator).unwrap();
        let spec = copy.spec.unwrap();
        // Koordinator's class decides preemption (the API refuses a pod that names another).
        assert_eq!(spec.priority_class_name.as_deref(), Some("koord-batch"));
        assert_eq!(spec.preemption_policy, None);
        assert_eq!(copy.metadata.labels.unwrap()["koordinator.sh/qosClass"], "BE");
        let r = spec.containers[0].resources.clone().unwrap();
        let q =
            |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned()))).collect();
        assert_eq!(r.requests, Some(q(&[("kubernetes.io/batch-cpu", "500"), ("kubernetes.io/batch-memory", "2Gi")])));
        assert_eq!(r.limits, Some(q(&[("kubernetes.io/batch-cpu", "2000"), ("nvidia.com/gpu", "1")])));
        // Katalyst keys on the annotation; the band's own class stays, never preempting.
        let katalyst = Target { mode: PoolMode::KatalystReclaimed, ..target(&selector) };
        let copy = offload_pod(&pod, &katalyst).unwrap();
        assert_eq!(copy.metadata.annotations.unwrap()["katalyst.kubewharf.io/qos_level"], "reclaimed_cores");
        let spec = copy.spec.unwrap();
        assert_eq!(spec.priority_class_name, Some(keys::Band::Medium.priority_class()));
        assert_eq!(spec.preemption_policy.as_deref(), Some("Never"));
        let r = spec.containers[0].resources.clone().unwrap();
        assert_eq!(r.requests.unwrap()["resource.katalyst.kubewharf.io/reclaimed_millicpu"], Quantity("500".into()));
        // Requests mode: nothing of either.
        let plain = offload_pod(&pod, &target(&selector)).unwrap();
        assert!(!plain.metadata.labels.unwrap().contains_key("koordinator.sh/qosClass"));
        assert_eq!(
            plain.spec.unwrap().containers[0].resources.clone().unwrap().requests.unwrap()["cpu"],
            Quantity("500m".into())
        );
    }

    #[test]
    fn the_virtual_node_leaves_no_trace_in_scheduling() {
        let selector = BTreeMap::from([("pool".to_string(), "gpu".to_string())]);
        let spec = offload_pod(&training_pod(), &target(&selector)).unwrap().spec.unwrap();
        assert_eq!(spec.node_name, None);
        assert_eq!(spec.scheduler_name, None);
        assert_eq!(
            spec.node_selector.unwrap(),
            BTreeMap::from([("disktype".to_string(), "ssd".to_string()), ("pool".to_string(), "gpu".to_string())])
        );
        assert!(spec.affinity.unwrap().node_affinity.is_none());
        let keys: Vec<_> = spec.tolerations.unwrap().into_iter().filter_map(|t| t.key).collect();
        assert_eq!(keys, ["node.kubernetes.io/not-ready"]);
        assert_eq!(spec.preemption_policy.as_deref(), Some("Never"));
        assert_eq!(spec.priority, None);
        assert_eq!(spec.priority_class_name.as_deref(), Some("tidepool-offload-medium"));
    }

    #[test]
    fn training_credentials_are_not_mounted() {
        let spec = offload_pod(&training_pod(), &target(&BTreeMap::new())).unwrap().spec.unwrap();
        assert_eq!(spec.service_account_name, None);
        assert_eq!(spec.automount_service_account_token, Some(false));
        let volumes: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(volumes, ["data", ANNOTATIONS_VOLUME]);
        let mounts: Vec<_> = spec.containers[0].volume_mounts.clone().unwrap().into_iter().map(|m| m.name).collect();
        assert_eq!(mounts, ["data", ANNOTATIONS_VOLUME]);
    }

    #[test]
    fn the_pod_sees_its_annotations_at_etc_tidepool() {
        let spec = offload_pod(&training_pod(), &target(&BTreeMap::new())).unwrap().spec.unwrap();
        let v = spec.volumes.unwrap().into_iter().find(|v| v.name == ANNOTATIONS_VOLUME).unwrap();
        let item = &v.downward_api.unwrap().items.unwrap()[0];
        assert_eq!(
            (item.path.as_str(), item.field_ref.as_ref().unwrap().field_path.as_str()),
            ("annotations", "metadata.annotations")
        );
        let m =
            spec.containers[0].volume_mounts.as_ref().unwrap().iter().find(|m| m.name == ANNOTATIONS_VOLUME).unwrap();
        assert_eq!(m.mount_path, "/etc/tidepool");
        assert_eq!(m.read_only, Some(true));
    }

    #[test]
    fn tidepool_conditions_survive_the_status_copy() {
        let current: PodStatus = serde_json::from_value(json!({"conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "tidepool.io/ReclaimRequested", "status": "True"}
        ]}))
        .unwrap();
        let mut desired: PodStatus =
            serde_json::from_value(json!({"conditions": [{"type": "Ready", "status": "True"}]})).unwrap();
        keep_tidepool_conditions(&mut desired, lite(Some(current)).tidepool_conditions());
        let types: Vec<_> = desired.conditions.unwrap().into_iter().map(|c| (c.type_, c.status)).collect();
        assert_eq!(types, [("Ready".into(), "True".into()), ("tidepool.io/ReclaimRequested".into(), "True".into())]);
    }

    #[test]
    fn a_reclaims_disruption_target_survives_the_status_copy_unless_the_member_set_its_own() {
        let current: PodStatus = serde_json::from_value(json!({"conditions": [
            {"type": "tidepool.io/ReclaimRequested", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": keys::REASON_DISRUPTION_RECLAIM}
        ]}))
        .unwrap();
        let ours = lite(Some(current)).tidepool_conditions().to_vec();
        let copy = |conditions: serde_json::Value| -> PodStatus {
            serde_json::from_value(json!({"conditions": conditions})).unwrap()
        };
        let mut desired = copy(json!([{"type": "Ready", "status": "True"}]));
        keep_tidepool_conditions(&mut desired, &ours);
        let reasons: Vec<_> = desired.conditions.unwrap().into_iter().map(|c| (c.type_, c.reason)).collect();
        assert_eq!(reasons[2], ("DisruptionTarget".into(), Some(keys::REASON_DISRUPTION_RECLAIM.into())));
        // The member preempted the copy meanwhile: its own condition stays, once.
        let mut desired =
            copy(json!([{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]));
        keep_tidepool_conditions(&mut desired, &ours);
        let targets: Vec<_> = desired
            .conditions
            .unwrap()
            .into_iter()
            .filter(|c| c.type_ == "DisruptionTarget")
            .map(|c| c.reason)
            .collect();
        assert_eq!(targets, [Some("PreemptionByScheduler".to_owned())]);
        // A pod whose copy vanished after tidepool's own reclaim is Reclaimed, not lost.
        assert_eq!(member_disruption(Some(keys::REASON_DISRUPTION_RECLAIM)).0, keys::REASON_RECLAIMED);
    }

    fn notice_conditions(status: &str) -> Vec<PodCondition> {
        let current: PodStatus = serde_json::from_value(json!({"conditions": [
            {"type": keys::CONDITION_RECLAIM_REQUESTED, "status": status},
        ]}))
        .unwrap();
        lite(Some(current)).tidepool_conditions().to_vec()
    }

    #[test]
    fn the_copy_keeps_the_tenants_grace_up_to_the_members_bound_for_its_band() {
        assert_eq!(copy_grace(Some(120), None), 120, "the tenant's grace, unbounded");
        assert_eq!(copy_grace(None, None), 30, "the API default when the pod names none");
        assert_eq!(copy_grace(Some(120), Some(45)), 45, "the member admin's bound");
        assert_eq!(copy_grace(Some(10), Some(45)), 10, "never longer than asked");
        assert_eq!(copy_grace(Some(-1), None), 0);
        let mut pod = training_pod();
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(90);
        let selector = BTreeMap::new();
        let limits = tidepool_api::crd::TerminationGraceLimits { low: Some(20), high: Some(60), ..Default::default() };
        let unbounded = tidepool_api::crd::TerminationGraceLimits { unbounded: true, ..limits };
        for (band, limits, want) in [
            (keys::Band::Low, limits, 20),
            (keys::Band::High, limits, 60),
            (keys::Band::Medium, limits, 90),
            (keys::Band::Medium, unbounded, 90),
        ] {
            let t = Target { band, max_termination_grace: limits, ..target(&selector) };
            let copy = offload_pod(&pod, &t).unwrap();
            assert_eq!(copy.spec.unwrap().termination_grace_period_seconds, Some(want), "{band:?}");
        }
        // A year asked for: the band's default bound, unless the member opted out.
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(365 * 24 * 3600);
        let opted_out = tidepool_api::crd::TerminationGraceLimits { unbounded: true, ..Default::default() };
        for (limits, want) in [(Default::default(), 120), (opted_out, 365 * 24 * 3600)] {
            let t = Target { band: keys::Band::Low, max_termination_grace: limits, ..target(&selector) };
            let copy = offload_pod(&pod, &t).unwrap();
            assert_eq!(copy.spec.unwrap().termination_grace_period_seconds, Some(want));
        }
    }

    #[test]
    fn a_copy_that_ended_under_notice_is_held_running_for_the_reclaim() {
        for ended in ["Succeeded", "Failed"] {
            let mut desired: PodStatus =
                serde_json::from_value(json!({"phase": ended, "reason": "Completed"})).unwrap();
            hold_for_reclaim(&mut desired, &notice_conditions("True"));
            assert_eq!((desired.phase.as_deref(), desired.reason), (Some("Running"), None), "{ended}");
            // Without tidepool's notice the copy's end is the pod's own.
            let mut desired: PodStatus = serde_json::from_value(json!({"phase": ended})).unwrap();
            hold_for_reclaim(&mut desired, &notice_conditions("False"));
            assert_eq!(desired.phase.as_deref(), Some(ended));
            hold_for_reclaim(&mut desired, &[]);
            assert_eq!(desired.phase.as_deref(), Some(ended));
        }
    }

    #[test]
    fn only_a_notice_tidepool_gave_reaches_the_copy() {
        let forged =
            BTreeMap::from([(keys::ANNOTATION_RECLAIM_DEADLINE.to_owned(), "2026-12-01T10:00:00Z".to_owned())]);
        assert_eq!(notice_for_copy(&forged, &[]), None, "a tenant's annotation alone");
        assert_eq!(notice_for_copy(&forged, &notice_conditions("False")), None);
        assert_eq!(notice_for_copy(&forged, &notice_conditions("True")), Some("2026-12-01T10:00:00Z"));
        // Nor does a forged deadline travel when the copy is made.
        let mut pod = training_pod();
        pod.metadata.annotations = Some(forged);
        let selector = BTreeMap::new();
        let copy = offload_pod(&pod, &target(&selector)).unwrap();
        assert!(!copy.metadata.annotations.unwrap().contains_key(keys::ANNOTATION_RECLAIM_DEADLINE));
    }

    #[test]
    fn member_disruptions_keep_their_own_reason() {
        let with = |reason: &str| -> PodStatus {
            serde_json::from_value(
                json!({"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": reason}]}),
            )
            .unwrap()
        };
        let reason_of = |s: PodStatus| member_disruption(disruption_reason(Some(&s))).0;
        assert_eq!(reason_of(with("PreemptionByScheduler")), "PreemptedByMember");
        assert_eq!(reason_of(with("EvictionByEvictionAPI")), "EvictedByMember");
        assert_eq!(reason_of(PodStatus::default()), "OffloadPodLost");
        assert_eq!(member_disruption(None).0, "OffloadPodLost");
        // The training pod's cache keeps the reason its status was copied up with.
        assert_eq!(lite(Some(with("EvictionByEvictionAPI"))).disruption(), Some("EvictionByEvictionAPI"));
    }

    #[test]
    fn debug_containers_stay_in_the_training_cluster() {
        let mut pod = training_pod();
        pod.spec.as_mut().unwrap().ephemeral_containers =
            Some(vec![serde_json::from_value(json!({"name": "debugger", "image": "busybox"})).unwrap()]);
        let spec = offload_pod(&pod, &target(&BTreeMap::new())).unwrap().spec.unwrap();
        assert_eq!(spec.ephemeral_containers, None);
    }

    #[test]
    fn only_tidepools_own_and_the_members_chosen_labels_and_annotations_travel() {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let mut pod = training_pod();
        pod.metadata.labels = Some(map(&[
            ("app", "api"),
            ("team", "ml"),
            ("example.com/tier", "a"),
            ("example.com.evil/tier", "b"),
            (keys::LABEL_GANG, "g"),
            (keys::LABEL_BAND, "low"),
            (keys::LABEL_ORIGIN_UID, "forged"),
        ]));
        pod.metadata.annotations = Some(map(&[
            ("sidecar.istio.io/inject", "true"),
            ("cluster-autoscaler.kubernetes.io/safe-to-evict", "false"),
            ("prometheus.io/scrape", "true"),
            (keys::ANNOTATION_RECLAIM_DEADLINE, "2026-12-01T10:00:00Z"),
            ("note", "x"),
        ]));
        let keys_of = |m: Option<BTreeMap<String, String>>| m.unwrap_or_default().into_keys().collect::<Vec<_>>();
        let selector = BTreeMap::new();
        let copy = offload_pod(&pod, &target(&selector)).unwrap();
        let origin = [keys::LABEL_ORIGIN_CLUSTER, keys::LABEL_ORIGIN_UID, keys::LABEL_ORIGIN_MEMBER];
        let mut want: Vec<&str> = [keys::LABEL_BAND, keys::LABEL_GANG].into_iter().chain(origin).collect();
        want.sort();
        // Besides: every training label under tidepool's selector prefix (crate::services).
        let (selectable, plain): (BTreeMap<_, _>, BTreeMap<_, _>) = copy
            .metadata
            .labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .partition(|(k, _)| k.starts_with("svc.tidepool.io/"));
        assert_eq!(selectable, crate::services::selector_labels(pod.metadata.labels.as_ref()));
        assert_eq!(keys_of(Some(plain)), want);
        assert_eq!(copy.metadata.labels.unwrap()[keys::LABEL_ORIGIN_UID], "uid-1", "the origin is tidepool's word");
        // Not even the reclaim deadline: the pod sync writes it once the notice is tidepool's.
        let want_ann = vec![keys::ANNOTATION_ORIGIN_NAME, keys::ANNOTATION_ORIGIN_NAMESPACE];
        assert_eq!(keys_of(copy.metadata.annotations), want_ann);

        let (labels, annotations) = (["team".to_owned(), "example.com/*".to_owned()], ["prometheus.io/*".to_owned()]);
        let chosen = Target { copy_labels: &labels, copy_annotations: &annotations, ..target(&selector) };
        let copy = offload_pod(&pod, &chosen).unwrap();
        let labels = keys_of(copy.metadata.labels);
        assert!(labels.contains(&"team".to_owned()) && labels.contains(&"example.com/tier".to_owned()), "{labels:?}");
        assert!(!labels.contains(&"app".to_owned()) && !labels.contains(&"example.com.evil/tier".to_owned()));
        let annotations = keys_of(copy.metadata.annotations);
        assert!(annotations.contains(&"prometheus.io/scrape".to_owned()), "{annotations:?}");
        assert!(!annotations.contains(&"sidecar.istio.io/inject".to_owned()));
    }

    #[test]
    fn tenants_cannot_steer_their_copy_onto_nodes_the_pool_does_not_lend() {
        let mut pod = training_pod();
        let spec = pod.spec.as_mut().unwrap();
        spec.node_selector = Some(
            [
                ("node-role.kubernetes.io/control-plane", ""),
                ("kubernetes.io/hostname", "cp-0"),
                ("node.kubernetes.io/exclude-from-external-load-balancers", ""),
                ("kubernetes.io/arch", "amd64"),
                ("topology.kubernetes.io/zone", "z1"),
                ("disktype", "ssd"),
                ("nvidia.com/gpu.product", "H100"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        );
        spec.tolerations = Some(
            serde_json::from_value(json!([
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "payments", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists"}
            ]))
            .unwrap(),
        );
        let pool = BTreeMap::from([("pool".to_string(), "gpu".to_string())]);
        let spec = offload_pod(&pod, &target(&pool)).unwrap().spec.unwrap();
        let selector: Vec<_> = spec.node_selector.unwrap().into_keys().collect();
        assert_eq!(
            selector,
            ["disktype", "kubernetes.io/arch", "nvidia.com/gpu.product", "pool", "topology.kubernetes.io/zone"]
        );
        // Only the node-lifecycle tolerations every pod has, for at most 300 s, and only for
        // NoExecute (tolerating not-ready for every effect would schedule onto such nodes).
        let tolerations: Vec<_> = spec
            .tolerations
            .unwrap()
            .into_iter()
            .map(|t| (t.key.unwrap_or_default(), t.effect.unwrap_or_default(), t.toleration_seconds))
            .collect();
        assert_eq!(
            tolerations,
            [
                ("node.kubernetes.io/not-ready".to_owned(), "NoExecute".to_owned(), Some(300)),
                ("node.kubernetes.io/unreachable".to_owned(), "NoExecute".to_owned(), Some(60)),
            ]
        );
    }

    #[test]
    fn pod_affinity_stays_within_the_pods_own_namespace() {
        let mut pod = training_pod();
        pod.spec.as_mut().unwrap().affinity = Some(
            serde_json::from_value(json!({
                "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname", "namespaceSelector": {}},
                    {"labelSelector": {"matchLabels": {"job": "j"}}, "topologyKey": "kubernetes.io/hostname"},
                    {"labelSelector": {"matchLabels": {"job": "k"}}, "topologyKey": "kubernetes.io/hostname", "namespaces": ["team-a", "team-b"]},
                    {"labelSelector": {"matchLabels": {"job": "l"}}, "topologyKey": "kubernetes.io/hostname", "namespaces": ["team-a"]},
                    {"labelSelector": {"matchLabels": {"job": "m"}}, "topologyKey": "kubernetes.io/hostname", "namespaces": ["online"]}
                ]},
                "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 10, "podAffinityTerm": {"labelSelector": {"matchLabels": {"app": "api"}}, "topologyKey": "kubernetes.io/hostname",
                                                       "namespaceSelector": {"matchLabels": {"team": "payments"}}}},
                    {"weight": 5, "podAffinityTerm": {"labelSelector": {"matchLabels": {"job": "j"}}, "topologyKey": "kubernetes.io/hostname"}}
                ]}
            }))
            .unwrap(),
        );
        let affinity = offload_pod(&pod, &target(&BTreeMap::new())).unwrap().spec.unwrap().affinity.unwrap();
        let required = affinity.pod_affinity.unwrap().required_during_scheduling_ignored_during_execution.unwrap();
        let scopes: Vec<_> = required.iter().map(|t| (t.namespaces.clone(), t.namespace_selector.is_some())).collect();
        // Only the terms about the pod's own namespace (team-a) stay, as "its own" in the member:
        // another tenant's namespace, the member's `online` or a selector would reach beyond it.
        assert_eq!(scopes, [(None, false), (None, false)]);
        let jobs: Vec<_> =
            required.iter().map(|t| t.label_selector.clone().unwrap().match_labels.unwrap()["job"].clone()).collect();
        assert_eq!(jobs, ["j", "l"]);
        let preferred =
            affinity.pod_anti_affinity.unwrap().preferred_during_scheduling_ignored_during_execution.unwrap();
        assert_eq!(preferred.iter().map(|t| t.weight).collect::<Vec<_>>(), [5]);
    }

    #[test]
    fn every_container_is_told_the_exit_code_for_its_ack_by_its_restart_policy() {
        let with_policy = |policy: Option<&str>, own: Option<&str>| {
            let mut pod = training_pod();
            let spec = pod.spec.as_mut().unwrap();
            spec.restart_policy = policy.map(str::to_owned);
            if let Some(v) = own {
                spec.containers[0].env =
                    Some(vec![EnvVar { name: ACK_EXIT_CODE_ENV.into(), value: Some(v.into()), value_from: None }]);
            }
            let copy = offload_pod(&pod, &target(&BTreeMap::new())).unwrap();
            let spec = copy.spec.unwrap();
            let code = |c: &k8s_openapi::api::core::v1::Container| {
                c.env
                    .iter()
                    .flatten()
                    .filter(|e| e.name == ACK_EXIT_CODE_ENV)
                    .map(|e| e.value.clone().unwrap())
                    .collect::<Vec<_>>()
            };
            spec.containers.iter().map(code).collect::<Vec<_>>()
        };
        assert!(
            with_policy(Some("Never"), None).iter().all(|c| c == &["143"]),
            "as SIGTERM would: Kubeflow's ExitCode retries it"
        );
        assert!(
            with_policy(Some("OnFailure"), None).iter().all(|c| c == &["0"]),
            "a non-zero code restarts the container"
        );
        assert!(with_policy(None, None).iter().all(|c| c == &["0"]));
        assert_eq!(with_policy(Some("Never"), Some("7"))[0], ["7"], "the tenant's own value stays");
    }

    #[test]
    fn an_offload_namespace_is_shared_with_no_other_training_cluster_or_member_cluster() {
        let ns = |labels: serde_json::Value| -> ObjectMeta {
            serde_json::from_value(json!({"name": "tp-team-a", "labels": labels})).unwrap()
        };
        let (managed, origin, member) = (keys::LABEL_MANAGED_BY, keys::LABEL_ORIGIN_CLUSTER, keys::LABEL_ORIGIN_MEMBER);
        let foreign = |labels| foreign_namespace(&ns(labels), "training", ("member-a", "team-a"));
        assert_eq!(foreign(json!({managed: "tidepool", origin: "training", member: "member-a"})), None);
        assert_eq!(foreign(json!({managed: "tidepool", origin: "training"})), None, "made before the member label");
        let other = foreign(json!({managed: "tidepool", origin: "other"}));
        assert!(other.as_deref().is_some_and(|o| o.contains("training cluster other")), "{other:?}");
        let twin = foreign(json!({managed: "tidepool", origin: "training", member: "member-a-twin"}));
        assert!(twin.as_deref().is_some_and(|o| o.contains("MemberCluster member-a-twin")), "{twin:?}");
        let unmanaged = foreign(json!({"team": "payments"}));
        assert!(unmanaged.as_deref().is_some_and(|o| o.contains("not created by tidepool")), "{unmanaged:?}");
        assert!(foreign_namespace(&ObjectMeta::default(), "training", ("member-a", "team-a")).is_some());
        let holds = keys::LABEL_ORIGIN_NAMESPACE;
        assert_eq!(
            foreign(json!({managed: "tidepool", origin: "training", member: "member-a", holds: "team-a"})),
            None
        );
        let met = foreign(json!({managed: "tidepool", origin: "training", member: "member-a", holds: "tp-team-a"}));
        assert!(met.as_deref().is_some_and(|o| o.contains("training namespace tp-team-a")), "{met:?}");
    }

    #[test]
    fn a_pod_without_uid_is_refused() {
        let mut p = training_pod();
        p.metadata.uid = None;
        assert_eq!(offload_pod(&p, &target(&BTreeMap::new())), Err(TranslateError::MissingField("metadata.uid")));
    }

    #[test]
    fn identity_is_the_origin_uid() {
        let pod = training_pod();
        let copy = crate::offload::OffloadPod::from(offload_pod(&pod, &target(&BTreeMap::new())).unwrap());
        assert!(copy.is_copy_of(&PodLite::from(pod.clone())));
        let mut other = pod.clone();
        other.metadata.uid = Some("uid-2".into());
        assert!(!copy.is_copy_of(&PodLite::from(other)));
    }

    #[test]
    fn status_goes_up_with_the_virtual_node_as_host() {
        let member: PodStatus = serde_json::from_value(json!({
            "phase": "Running", "hostIP": "10.0.0.5", "podIP": "10.244.0.7", "podIPs": [{"ip": "10.244.0.7"}],
            "startTime": "2026-11-29T10:00:00Z", "nominatedNodeName": "member-a-gpu-0",
            "conditions": [{"type": "Ready", "status": "True"},
                           {"type": "tidepool.io/ReclaimRequested", "status": "True", "reason": "ForgedByTheMember"}],
            "containerStatuses": [{"name": "main", "ready": true, "restartCount": 2, "image": "trainer:1", "imageID": "",
                                   "state": {"running": {"startedAt": "2026-11-29T10:00:01Z"}}}]
        }))
        .unwrap();
        let up = training_status(&member, "127.0.0.2");
        let types: Vec<_> = up.conditions.iter().flatten().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Ready"], "only tidepool writes its own conditions");
        assert_eq!(up.host_ip.as_deref(), Some("127.0.0.2"));
        assert_eq!(up.pod_ip.as_deref(), Some("10.244.0.7"));
        assert_eq!(up.container_statuses.as_ref().unwrap()[0].restart_count, 2);
        assert_eq!(up.nominated_node_name, None);
        // In sync: the cached training pod's digest is the one of what would be written.
        assert_eq!(lite(Some(up.clone())).synced.all, SyncedStatus::of(Some(&up)).all);
        assert_ne!(lite(None).synced.all, SyncedStatus::of(Some(&up)).all);
        let pending = training_status(&PodStatus { phase: Some("Pending".into()), ..Default::default() }, "127.0.0.2");
        assert_eq!(pending.host_ip, None);
    }

    fn status(v: serde_json::Value) -> PodStatus {
        serde_json::from_value(v).unwrap()
    }

    /// A training pod's status as the cache holds it.
    fn lite(status: Option<PodStatus>) -> StatusLite {
        PodLite::from(Pod { status, ..Default::default() }).status
    }

    #[test]
    fn a_pending_pods_new_conditions_wait_to_settle_and_everything_else_is_written_at_once() {
        let now: jiff::Timestamp = "2026-11-29T12:00:10Z".parse().unwrap();
        let settle = std::time::Duration::from_secs(1);
        let pending = status(json!({"phase": "Pending", "qosClass": "BestEffort"}));
        let scheduled_at = |t: &str| {
            status(json!({"phase": "Pending", "qosClass": "BestEffort", "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": t}]}))
        };
        let unschedulable_at = |t: &str| {
            status(json!({"phase": "Pending", "qosClass": "BestEffort", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": t}]}))
        };
        let running = status(json!({"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-29T12:00:09.8Z"}]}));
        let cases = [
            (
                "placed in the member: wait for the next change",
                Some(&pending),
                scheduled_at("2026-11-29T12:00:08Z"),
                Some(3_600_000),
            ),
            (
                "unschedulable 200 ms ago: wait the rest",
                Some(&pending),
                unschedulable_at("2026-11-29T12:00:09.8Z"),
                Some(800),
            ),
            ("unschedulable 2 s ago: write", Some(&pending), unschedulable_at("2026-11-29T12:00:08Z"), None),
            (
                "a member clock ahead of ours never delays",
                Some(&pending),
                unschedulable_at("2026-11-29T12:00:30Z"),
                None,
            ),
            ("running: write at once", Some(&pending), running.clone(), None),
            ("no status yet: write", None, scheduled_at("2026-11-29T12:00:09.8Z"), None),
            (
                "a copy just created, its pod bound by a Binding: a write would change nothing",
                Some(&scheduled_at("2026-11-29T12:00:08Z")),
                pending.clone(),
                Some(3_600_000),
            ),
            (
                "a copy with an address: write",
                Some(&scheduled_at("2026-11-29T12:00:08Z")),
                status(json!({"phase": "Pending", "qosClass": "BestEffort", "podIP": "10.0.0.7"})),
                None,
            ),
            (
                "nothing new among the conditions: write",
                Some(&scheduled_at("2026-11-29T12:00:09.8Z")),
                status(json!({"phase": "Pending", "qosClass": "Burstable", "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-29T12:00:09.8Z"}]})),
                None,
            ),
        ];
        for (name, current, desired, want_ms) in cases {
            let (current, digest) = (lite(current.cloned()), SyncedStatus::of(Some(&desired)));
            let got = status_settles_in(&current, &desired, &digest, now, settle).map(|d| d.as_millis());
            assert_eq!(got, want_ms, "{name}");
        }
    }

    fn ended(phase: &str, state: serde_json::Value, changed: &str) -> PodStatus {
        serde_json::from_value(json!({
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": changed}],
            "containerStatuses": [{"name": "main", "image": "i", "imageID": "", "ready": false,
                                   "restartCount": 0, "state": state}]
        }))
        .unwrap()
    }

    #[test]
    fn a_terminal_status_waits_for_its_containers_ends_a_few_seconds_at_most() {
        let now: jiff::Timestamp = "2026-12-06T06:54:08Z".parse().unwrap();
        let settle = std::time::Duration::from_secs(5);
        let waiting = ended("Failed", json!({"waiting": {"reason": "ContainerCreating"}}), "2026-12-06T06:54:07Z");
        assert_eq!(terminal_settles_in(&waiting, now, settle), Some(std::time::Duration::from_secs(4)));
        let running = ended("Succeeded", json!({"running": {}}), "2026-12-06T06:54:07Z");
        assert_eq!(terminal_settles_in(&running, now, settle), Some(std::time::Duration::from_secs(4)));
        let old = ended("Failed", json!({"waiting": {}}), "2026-12-06T06:54:02Z");
        assert_eq!(terminal_settles_in(&old, now, settle), None, "the member never said more: write what it says");
        let done = ended("Failed", json!({"terminated": {"exitCode": 137}}), "2026-12-06T06:54:07Z");
        assert_eq!(terminal_settles_in(&done, now, settle), None, "every container ended");
        let live = ended("Running", json!({"running": {}}), "2026-12-06T06:54:07Z");
        assert_eq!(terminal_settles_in(&live, now, settle), None, "not terminal");
        let ahead = ended("Failed", json!({"waiting": {}}), "2026-12-06T06:54:30Z");
        assert_eq!(terminal_settles_in(&ahead, now, settle), None, "a member clock ahead never delays a write");
    }
}
