//! A training pod as tidepool's caches hold it.
//!
//! A `k8s_openapi` `Pod` costs about 18 KB of memory even when its JSON is 5 KB: every
//! optional part of a container or a volume is laid out inline, present or not (a `Volume`
//! is 3.2 KB before it holds anything). Tidepool keeps every pod of the training cluster
//! in memory, so the cache holds a [`PodLite`] instead: the metadata, what the dispatcher
//! and the pod sync read from the spec (node, scheduler, priority, effective requests), and
//! the status reduced to what they decide on plus a digest of the part the pod sync
//! writes. The whole pod is read where it is needed once (translating it into an offload
//! pod), from the watch event that brought it or from the API.

use std::hash::{Hash, Hasher};

use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::keys::Band;
use crate::node_match::NodeConstraints;
use crate::resources::{Resources, parse_milli};

/// `kubectl apply`'s copy of the whole object: never read here, and often most of a pod.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what no cache reads from a pod's metadata: managed fields and the last-applied copy.
pub fn trim_meta(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove(LAST_APPLIED);
    }
}

/// A training pod, reduced to what tidepool decides on (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodLite {
    pub metadata: ObjectMeta,
    pub spec: SpecLite,
    pub status: StatusLite,
}

/// The parts of a pod's spec the dispatcher and the pod sync read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecLite {
    pub node_name: Option<String>,
    pub scheduler_name: Option<String>,
    /// `spec.priority`, resolved by the API server at admission.
    pub priority: Option<i32>,
    /// Effective requests, as the scheduler counts them ([`pod_requests`]).
    pub requests: Resources,
    /// The node selector and required node affinity, for the few pods that have them.
    pub node_constraints: Option<Box<NodeConstraints>>,
    /// `spec.hostNetwork`: the pod's IP is its node's.
    pub host_network: bool,
    /// `spec.schedulingGroup.podGroupName`: the native PodGroup (`scheduling.k8s.io`) the pod
    /// belongs to, its gang. Boxed: few pods have one.
    pub pod_group: Option<Box<str>>,
}

/// The parts of a pod's status tidepool decides on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusLite {
    pub phase: Option<String>,
    /// Set once the pod ran somewhere (for an offloaded pod: the virtual node's address).
    pub host_ip: Option<String>,
    /// The pod has container statuses and every one has terminated.
    pub containers_exited: bool,
    /// What few pods have (see [`StatusMarks`]); `None` when it would be empty.
    pub marks: Option<Box<StatusMarks>>,
    /// [`SyncedStatus`] of the status as it is: compared with the status the pod sync
    /// would write, so an unchanged status costs no write.
    pub synced: SyncedStatus,
    /// Where the members' pods reach a pod the dispatcher placed on a native node; `None`
    /// for every other pod (see [`PodAddress`]).
    pub address: Option<Box<PodAddress>>,
}

/// How a native pod (one the dispatcher bound to a training node: [`placed_natively`]) is
/// reached from a member: its IPs and the names its Services give it. Its elastic peers run
/// as copies in a member, whose DNS answers for the job's names only with what tidepool
/// lists there. Kept for native pods alone (a few among the training pods), boxed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodAddress {
    /// `status.podIPs` (or `podIP`), as the training cluster's kubelet reported them.
    pub ips: Vec<String>,
    /// `spec.hostname`, the pod's name under its subdomain.
    pub hostname: Option<String>,
    /// `spec.subdomain`: the headless Service that gives it `<hostname>.<subdomain>`.
    pub subdomain: Option<String>,
    /// Its `Ready` condition is true.
    pub ready: bool,
    /// It is being deleted.
    pub terminating: bool,
}

impl PodAddress {
    /// The address of `pod` if the dispatcher placed it natively and it has an IP of its own
    /// (a host-network pod shares its node's, which is no pod's to publish).
    pub fn of(pod: &Pod) -> Option<Self> {
        let spec = pod.spec.as_ref()?;
        if spec.host_network == Some(true) || !placed_natively(&pod.metadata, spec.node_name.as_deref()) {
            return None;
        }
        let status = pod.status.as_ref()?;
        let mut ips: Vec<String> = status.pod_ips.iter().flatten().map(|ip| ip.ip.clone()).collect();
        if ips.is_empty() {
            ips.extend(status.pod_ip.clone());
        }
        if ips.is_empty() {
            return None;
        }
        let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
        Some(PodAddress {
            ips,
            hostname: spec.hostname.clone(),
            subdomain: spec.subdomain.clone(),
            ready,
            terminating: pod.metadata.deletion_timestamp.is_some(),
        })
    }
}

/// What a pod's status says only once it ended, was noticed or is being disrupted. Kept
/// apart and boxed: every training pod is cached, and most of them have none of it (96 bytes
/// inline, 8 boxed).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusMarks {
    pub reason: Option<String>,
    /// The first line of a terminated container's message that is the ack from inside the
    /// pod ([`crate::keys::TERMINATION_ACK_PREFIX`]), if one wrote it.
    pub exit_ack: Option<String>,
    /// Conditions tidepool itself wrote (`tidepool.io/…`, such as a reclaim notice, and the
    /// `DisruptionTarget` of a reclaim: [`is_tidepools`]).
    pub tidepool_conditions: Vec<PodCondition>,
    /// The reason of a true `DisruptionTarget` condition: why the pod is going away.
    pub disruption: Option<String>,
}

impl StatusLite {
    /// `status.reason`.
    pub fn reason(&self) -> Option<&str> {
        self.marks.as_ref()?.reason.as_deref()
    }

    /// See [`StatusMarks::exit_ack`].
    pub fn exit_ack(&self) -> Option<&str> {
        self.marks.as_ref()?.exit_ack.as_deref()
    }

    /// See [`StatusMarks::tidepool_conditions`].
    pub fn tidepool_conditions(&self) -> &[PodCondition] {
        self.marks.as_ref().map_or(&[], |m| &m.tidepool_conditions)
    }

    /// See [`StatusMarks::disruption`].
    pub fn disruption(&self) -> Option<&str> {
        self.marks.as_ref()?.disruption.as_deref()
    }

    /// The marks, to change them (an empty set if there were none).
    pub fn marks_mut(&mut self) -> &mut StatusMarks {
        self.marks.get_or_insert_default()
    }
}

/// Digests of the parts of a pod status that the pod sync copies from the member, so two
/// statuses can be compared without keeping either.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncedStatus {
    /// Everything the pod sync writes (phase, conditions, container statuses, IPs, start
    /// time, reason, message), `None` without a status.
    pub all: Option<u64>,
    /// Container statuses, reason and message: what may not change while a Pending pod's
    /// new conditions wait to be written together with the next change.
    pub pending_detail: u64,
    /// One digest per condition.
    pub conditions: Vec<u64>,
}

impl SyncedStatus {
    pub fn of(status: Option<&PodStatus>) -> Self {
        let Some(s) = status else {
            return SyncedStatus::default();
        };
        let mut all = Digest::default();
        all.add(&s.phase)
            .add(&s.conditions)
            .add(&s.container_statuses)
            .add(&s.init_container_statuses)
            .add(&s.pod_ip)
            .add(&s.pod_ips)
            .add(&s.host_ip)
            .add(&s.start_time)
            .add(&s.reason)
            .add(&s.message);
        let mut detail = Digest::default();
        detail.add(&s.container_statuses).add(&s.init_container_statuses).add(&s.reason).add(&s.message);
        SyncedStatus {
            all: Some(all.finish()),
            pending_detail: detail.finish(),
            conditions: s.conditions.iter().flatten().map(|c| Digest::default().add(c).finish()).collect(),
        }
    }

    /// The digest of one condition, as [`SyncedStatus::conditions`] holds it.
    pub fn condition(c: &PodCondition) -> u64 {
        Digest::default().add(c).finish()
    }
}

/// A digest of serializable values (their JSON), for equality checks within this process.
#[derive(Default)]
struct Digest(std::collections::hash_map::DefaultHasher);

impl Digest {
    fn add<T: Serialize>(&mut self, value: &T) -> &mut Self {
        // Serializing these types cannot fail (no maps with non-string keys).
        serde_json::to_vec(value).unwrap_or_default().hash(&mut self.0);
        self
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// `spec.schedulingGroup.podGroupName` of a pod spec, if set and not empty: the native
/// PodGroup (`scheduling.k8s.io`) the pod belongs to.
pub fn scheduling_group(spec: &PodSpec) -> Option<&str> {
    spec.scheduling_group.as_ref()?.pod_group_name.as_deref().filter(|g| !g.is_empty())
}

impl From<Pod> for PodLite {
    fn from(pod: Pod) -> Self {
        let address = PodAddress::of(&pod).map(Box::new);
        let Pod { mut metadata, spec, status } = pod;
        trim_meta(&mut metadata);
        // Gangs are read from labels and annotations, never from owners.
        metadata.owner_references = None;
        metadata.generate_name = None;
        // Fields are read in the order written: the borrowing ones before `s` is taken apart.
        let spec = spec.map(|s| SpecLite {
            pod_group: scheduling_group(&s).map(Box::from),
            requests: pod_requests(&s),
            node_constraints: NodeConstraints::of(&s).map(Box::new),
            node_name: s.node_name,
            scheduler_name: s.scheduler_name,
            priority: s.priority,
            host_network: s.host_network == Some(true),
        });
        let lite = StatusLite {
            synced: SyncedStatus::of(status.as_ref()),
            containers_exited: status.as_ref().and_then(|s| s.container_statuses.as_ref()).is_some_and(|cs| {
                !cs.is_empty() && cs.iter().all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
            }),
            marks: status.as_ref().and_then(StatusMarks::of).map(Box::new),
            phase: status.as_ref().and_then(|s| s.phase.clone()),
            host_ip: status.and_then(|s| s.host_ip),
            address,
        };
        PodLite { metadata, spec: spec.unwrap_or_default(), status: lite }
    }
}

impl StatusMarks {
    /// The marks of `status`; `None` if it has none.
    fn of(status: &PodStatus) -> Option<Self> {
        let marks = StatusMarks {
            reason: status.reason.clone(),
            exit_ack: exit_ack(status),
            tidepool_conditions: status.conditions.iter().flatten().filter(|c| is_tidepools(c)).cloned().collect(),
            disruption: disruption_reason(status).map(str::to_owned),
        };
        (marks != StatusMarks::default()).then_some(marks)
    }
}

impl PodLite {
    pub fn node_name(&self) -> Option<&str> {
        self.spec.node_name.as_deref()
    }

    pub fn phase(&self) -> Option<&str> {
        self.status.phase.as_deref()
    }

    /// Succeeded or Failed.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase(), Some("Succeeded" | "Failed"))
    }

    /// Still runs or is still to run: not terminal, not being deleted.
    pub fn is_live(&self) -> bool {
        self.metadata.deletion_timestamp.is_none() && !self.is_terminal()
    }
}

/// Implements `kube::Resource` as a core/v1 Pod for a reduced form of a pod that keeps its
/// `metadata`, so kube's caches and `ObjectRef`s take it as a pod.
#[macro_export]
macro_rules! pod_resource {
    ($ty:ty) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = k8s_openapi::NamespaceResourceScope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("Pod")
            }

            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("")
            }

            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("v1")
            }

            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("pods")
            }

            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }

            fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

pod_resource!(PodLite);

/// Whether a pod condition type is one of tidepool's own (`tidepool.io/…`): only tidepool
/// writes those, on the training pod.
pub fn is_tidepool_type(type_: &str) -> bool {
    type_.starts_with("tidepool.io/")
}

/// Whether tidepool wrote condition `c` on a training pod: its own `tidepool.io/…` types, and
/// the `DisruptionTarget` of a pod it reclaims (the member's status, copied up, must not
/// erase either).
pub fn is_tidepools(c: &PodCondition) -> bool {
    is_tidepool_type(&c.type_)
        || (c.type_ == crate::keys::CONDITION_DISRUPTION_TARGET
            && c.reason.as_deref() == Some(crate::keys::REASON_DISRUPTION_RECLAIM))
}

/// The ack a terminated container of `status` wrote as its termination message.
fn exit_ack(status: &PodStatus) -> Option<String> {
    status.container_statuses.iter().flatten().find_map(|c| {
        let message = c.state.as_ref()?.terminated.as_ref()?.message.as_deref()?;
        let line = message.lines().next()?.trim();
        line.starts_with(crate::keys::TERMINATION_ACK_PREFIX).then(|| line.to_owned())
    })
}

/// The band the dispatcher gave a pod it placed on `node`, the node the pod is on: its
/// `tidepool.io/band` label, which counts only when the pod's `tidepool.io/placement`
/// (written with the label, before the binding) names that node.
///
/// Tenants write their pods' labels, so a label alone proves nothing: `None` for a pod bound
/// by hand (or not bound), and each caller says what such a pod is: the dispatcher reclaims
/// it as elastic (`low`), vk-provider runs its copy as `medium` (deploy/docs/configuration.md,
/// "Bands").
pub fn band_of(meta: &ObjectMeta, node: Option<&str>) -> Option<Band> {
    if !placed_by_dispatcher(meta, node) {
        return None;
    }
    meta.labels.as_ref().and_then(|l| l.get(crate::keys::LABEL_BAND)).and_then(|b| Band::parse(b))
}

/// Whether a pod on `node` was put there by the dispatcher: bound, and its placement
/// ([`crate::keys::ANNOTATION_PLACEMENT`], which only the dispatcher writes) names that virtual
/// node or says it was placed on a native node ([`crate::keys::PLACEMENT_NATIVE`]). Only then
/// are its band and role labels its decision and not the tenant's.
pub fn placed_by_dispatcher(meta: &ObjectMeta, node: Option<&str>) -> bool {
    let placement = meta.annotations.as_ref().and_then(|a| a.get(crate::keys::ANNOTATION_PLACEMENT));
    node.is_some_and(|n| placement.is_some_and(|p| p == n || p == crate::keys::PLACEMENT_NATIVE))
}

/// Whether a pod on `node` was put there by the dispatcher as a native pod: on one of the
/// training cluster's own nodes (placement [`crate::keys::PLACEMENT_NATIVE`]), where its
/// kubelet, not tidepool, runs it and writes its status.
pub fn placed_natively(meta: &ObjectMeta, node: Option<&str>) -> bool {
    let placement = meta.annotations.as_ref().and_then(|a| a.get(crate::keys::ANNOTATION_PLACEMENT));
    node.is_some() && placement.is_some_and(|p| p == crate::keys::PLACEMENT_NATIVE)
}

/// Whether tidepool's reclaim notice is out for the pod: its `tidepool.io/ReclaimRequested`
/// condition is true. Pod status is written through `pods/status`, which tenants are not
/// granted, so unlike the deadline annotation a tenant cannot write or remove it.
pub fn under_notice(tidepool_conditions: &[PodCondition]) -> bool {
    tidepool_conditions.iter().any(|c| c.type_ == crate::keys::CONDITION_RECLAIM_REQUESTED && c.status == "True")
}

/// The reason of `status`'s true `DisruptionTarget` condition, which the member (or any
/// cluster) sets before it deletes a pod on its own: preemption, eviction, taints.
pub fn disruption_reason(status: &PodStatus) -> Option<&str> {
    let conditions = status.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == "DisruptionTarget" && c.status == "True")?.reason.as_deref()
}

/// Effective requests of a pod as the scheduler counts them: the larger of the sum of its
/// containers and its largest init container, plus overhead, plus one `pods`. A container
/// that sets only a limit requests that limit (the API server defaults requests to limits).
pub fn pod_requests(spec: &PodSpec) -> Resources {
    let container = |c: &k8s_openapi::api::core::v1::Container| {
        let mut r = Resources::new();
        if let Some(res) = &c.resources {
            let limits = res.limits.clone().unwrap_or_default();
            let requests = res.requests.clone().unwrap_or_default();
            for (k, v) in limits.iter().filter(|(k, _)| !requests.contains_key(*k)).chain(requests.iter()) {
                if let Ok(m) = parse_milli(&v.0) {
                    r.set(k, m);
                }
            }
        }
        r
    };
    let mut total = Resources::new();
    for c in &spec.containers {
        total.add(&container(c));
    }
    for c in spec.init_containers.iter().flatten() {
        // Sidecars (restartPolicy: Always) keep running next to the app containers.
        if c.restart_policy.as_deref() == Some("Always") {
            total.add(&container(c));
        } else {
            total.max_with(&container(c));
        }
    }
    if let Some(overhead) = &spec.overhead
        && let Ok(o) = Resources::from_quantities(overhead)
    {
        total.add(&o);
    }
    total.add_one("pods", 1000);
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn running_pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "trainer-0", "namespace": "team-a", "uid": "u1",
                         "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
                         "annotations": {LAST_APPLIED: "{}", "tidepool.io/gang": "g"}},
            "spec": {"nodeName": "tidepool-member-a", "schedulerName": "tidepool", "priority": 10,
                     "containers": [{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
                     "volumes": [{"name": "data", "emptyDir": {}}]},
            "status": {"phase": "Running", "hostIP": "127.0.0.2",
                       "conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "tidepool.io/ReclaimRequested", "status": "True"}],
                       "containerStatuses": [{"name": "main", "image": "x", "imageID": "", "ready": true,
                                              "restartCount": 0, "state": {"running": {}}}]}
        }))
        .unwrap()
    }

    #[test]
    fn keeps_what_is_decided_on_and_drops_the_rest() {
        let lite = PodLite::from(running_pod());
        assert_eq!(lite.metadata.managed_fields, None);
        assert!(!lite.metadata.annotations.as_ref().unwrap().contains_key(LAST_APPLIED));
        assert_eq!(lite.metadata.annotations.as_ref().unwrap().get("tidepool.io/gang").map(String::as_str), Some("g"));
        assert_eq!(lite.node_name(), Some("tidepool-member-a"));
        assert_eq!(lite.spec.priority, Some(10));
        assert_eq!(lite.spec.requests.get("nvidia.com/gpu"), 2000);
        assert_eq!(lite.spec.requests.get("pods"), 1000);
        assert_eq!(lite.phase(), Some("Running"));
        assert!(lite.is_live());
        assert!(!lite.status.containers_exited);
        assert_eq!(lite.status.tidepool_conditions().len(), 1);
        assert_eq!(lite.status.synced.conditions.len(), 2);
    }

    #[test]
    fn a_pod_with_nothing_to_mark_keeps_no_marks() {
        let mut pod = running_pod();
        pod.status.as_mut().unwrap().conditions = None;
        let lite = PodLite::from(pod);
        assert_eq!(lite.status.marks, None);
        assert_eq!(lite.status.tidepool_conditions(), &[] as &[PodCondition]);
        // Every training pod is cached: its entry stays small (an `Arc` of it, two counters
        // more, fits jemalloc's 640-byte size class).
        let arc = std::mem::size_of::<PodLite>() + 2 * std::mem::size_of::<usize>();
        assert!(arc <= 640, "{arc} bytes");
    }

    #[test]
    fn only_a_pod_placed_natively_with_an_ip_of_its_own_has_an_address() {
        let native = || {
            let mut pod = running_pod();
            let meta = &mut pod.metadata;
            meta.annotations.as_mut().unwrap().insert(crate::keys::ANNOTATION_PLACEMENT.into(), "native".into());
            let spec = pod.spec.as_mut().unwrap();
            spec.node_name = Some("training-real".into());
            spec.hostname = Some("trainer-0".into());
            spec.subdomain = Some("job".into());
            pod.status.as_mut().unwrap().pod_ip = Some("10.1.0.7".into());
            pod
        };
        let address = PodLite::from(native()).status.address.expect("a native pod has an address");
        assert_eq!(address.ips, ["10.1.0.7"]);
        assert_eq!((address.hostname.as_deref(), address.subdomain.as_deref()), (Some("trainer-0"), Some("job")));
        assert!(address.ready && !address.terminating);
        // A copy's training pod (placed on a virtual node), a host-network pod and a pod with
        // no IP yet have none.
        assert_eq!(PodLite::from(running_pod()).status.address, None);
        let mut host = native();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(PodAddress::of(&host), None);
        let mut starting = native();
        starting.status.as_mut().unwrap().pod_ip = None;
        assert_eq!(PodAddress::of(&starting), None);
    }

    #[test]
    fn equal_statuses_have_equal_digests_and_any_change_shows() {
        let pod = running_pod();
        let a = SyncedStatus::of(pod.status.as_ref());
        assert_eq!(a, SyncedStatus::of(pod.status.as_ref()));
        let mut changed = pod.status.clone().unwrap();
        changed.pod_ip = Some("10.0.0.1".into());
        let b = SyncedStatus::of(Some(&changed));
        assert_ne!(a.all, b.all);
        assert_eq!(a.pending_detail, b.pending_detail);
        assert_eq!(SyncedStatus::of(None).all, None);
    }

    #[test]
    fn exited_needs_every_container_terminated() {
        let mut pod = running_pod();
        let cs = pod.status.as_mut().unwrap().container_statuses.as_mut().unwrap();
        cs[0].state = serde_json::from_value(json!({"terminated": {"exitCode": 0}})).unwrap();
        assert!(PodLite::from(pod).status.containers_exited);
    }

    #[test]
    fn the_ack_from_inside_is_a_terminated_containers_message_with_the_prefix() {
        let with_message = |message: &str| {
            let mut pod = running_pod();
            let cs = pod.status.as_mut().unwrap().container_statuses.as_mut().unwrap();
            cs[0].state = serde_json::from_value(json!({"terminated": {"exitCode": 0, "message": message}})).unwrap();
            PodLite::from(pod).status.exit_ack().map(str::to_owned)
        };
        assert_eq!(
            with_message("tidepool.io/checkpointed step=12 offset=384\n").as_deref(),
            Some("tidepool.io/checkpointed step=12 offset=384")
        );
        assert_eq!(with_message("segfault"), None);
        assert_eq!(with_message("done\ntidepool.io/checkpointed"), None, "only the first line counts");
        assert_eq!(PodLite::from(running_pod()).status.exit_ack(), None);
        assert_eq!(PodLite::from(running_pod()).status.reason(), None);
    }
    #[test]
    fn the_band_label_counts_only_on_a_pod_placed_on_its_node() {
        let meta = |labels: serde_json::Value, annotations: serde_json::Value| -> ObjectMeta {
            serde_json::from_value(json!({"name": "p", "labels": labels, "annotations": annotations})).unwrap()
        };
        let placed =
            |band: &str| meta(json!({"tidepool.io/band": band}), json!({"tidepool.io/placement": "tidepool-m"}));
        let cases = [
            ("the dispatcher's placement on this node keeps the label's band", placed("high"), Some(Band::High)),
            ("so does it for every band", placed("low"), Some(Band::Low)),
            ("a label on a pod bound by hand is no band", meta(json!({"tidepool.io/band": "high"}), json!({})), None),
            (
                "a placement on another node is no placement of this pod",
                meta(json!({"tidepool.io/band": "high"}), json!({"tidepool.io/placement": "tidepool-other"})),
                None,
            ),
            (
                "a placed pod without the label has no band",
                meta(json!({}), json!({"tidepool.io/placement": "tidepool-m"})),
                None,
            ),
            ("a label that names no band is none", placed("urgent"), None),
        ];
        for (name, m, want) in cases {
            assert_eq!(band_of(&m, Some("tidepool-m")), want, "{name}");
        }
        assert_eq!(band_of(&placed("high"), None), None, "a pod on no node was placed nowhere yet");
    }
}
