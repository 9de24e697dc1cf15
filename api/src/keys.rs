//! Label, annotation, taint and condition keys. One definition each: the other crates
//! refer to these constants, never to string literals.

/// API group of tidepool's own resources.
pub const GROUP: &str = "tidepool.io";

/// Label on a virtual node: the member cluster it stands for.
pub const LABEL_MEMBER: &str = "tidepool.io/member";
/// Label on a virtual node: the pool inside the member.
pub const LABEL_POOL: &str = "tidepool.io/pool";
/// Annotation on a virtual node (metrics-server's): the kubelet API path its resource
/// metrics are scraped from. Every virtual node shares one kubelet API, so the path names
/// the node.
pub const ANNOTATION_RESOURCE_METRICS_PATH: &str = "metrics.k8s.io/resource-metrics-path";
/// Label every virtual-kubelet implementation puts on its nodes.
pub const LABEL_NODE_TYPE: &str = "type";
pub const NODE_TYPE_VIRTUAL: &str = "virtual-kubelet";
/// Taint on every virtual node: only pods that opt in land there.
pub const TAINT_VIRTUAL: &str = "tidepool.io/virtual";
/// NoSchedule taint on the virtual nodes of a member whose API server does not answer
/// (tidepool's own, so the node lifecycle controller's `node.kubernetes.io/*` taints stay
/// its own business).
pub const TAINT_UNREACHABLE: &str = "tidepool.io/unreachable";
/// NoSchedule taint on the virtual nodes of a member that answers but cannot be used: its
/// credentials are refused or its Secret or spec no longer yields a working connection.
pub const TAINT_NOT_READY: &str = "tidepool.io/not-ready";
/// NoSchedule taint on the virtual nodes of a member whose `spec.paused` is set: no new
/// placements by anyone (a pod bound by hand included); running offload pods stay.
pub const TAINT_PAUSED: &str = "tidepool.io/paused";
/// Reason of a training pod failed because its member stayed unreachable past
/// `memberLossTimeoutSeconds` (and of its Event), and of the virtual node's Ready condition
/// while the member is unreachable.
pub const REASON_MEMBER_LOST: &str = "MemberLost";
pub const REASON_MEMBER_UNREACHABLE: &str = "MemberUnreachable";
/// Reason of a virtual node's `Ready=False` (and of the `MemberCluster`'s) while a task of its
/// member's session has stopped, until a new session replaces it.
pub const REASON_MEMBER_TASK_STOPPED: &str = "MemberTaskStopped";

/// Label on an offload pod: UID of the training pod it copies. The identity of the copy:
/// creation is idempotent on it.
pub const LABEL_ORIGIN_UID: &str = "tidepool.io/origin-uid";
/// Label on an offload pod: the training cluster it came from (bridge config `clusterName`).
pub const LABEL_ORIGIN_CLUSTER: &str = "tidepool.io/origin-cluster";
/// Label on an offload pod and its namespace: the MemberCluster object that created it.
pub const LABEL_ORIGIN_MEMBER: &str = "tidepool.io/member-cluster";
/// Label on an offload pod: the gang of its training pod.
pub const LABEL_GANG: &str = "tidepool.io/gang";
/// Label on training pods written at bind time: `high`, `medium` or `low`.
pub const LABEL_BAND: &str = "tidepool.io/band";
/// Annotations on an offload pod naming its origin.
pub const ANNOTATION_ORIGIN_NAMESPACE: &str = "tidepool.io/origin-namespace";
/// On an offload namespace in a member: the training namespace whose pods it holds (with
/// [`LABEL_ORIGIN_MEMBER`], which of the training cluster's `MemberCluster`s made it).
pub const LABEL_ORIGIN_NAMESPACE: &str = "tidepool.io/origin-namespace";
pub const ANNOTATION_ORIGIN_NAME: &str = "tidepool.io/origin-name";
/// Label (value `true`) on the ConfigMaps and Secrets tidepool copied into an offload
/// namespace. With the origin cluster and member labels it is what the collector selects:
/// it never deletes an object without all three.
pub const LABEL_REFLECTED: &str = "tidepool.io/reflected";
/// Annotation on a reflected copy: the `resourceVersion` of the training object it was made
/// from. The copy is current while the source still has it, so syncing reads no contents.
pub const ANNOTATION_ORIGIN_RESOURCE_VERSION: &str = "tidepool.io/origin-resource-version";
/// Reason of a training pod the offload policy refused (and of its Event).
pub const REASON_OFFLOAD_POLICY: &str = "OffloadPolicy";
/// Event on a pod whose training namespace's name the member had taken for itself: its pods
/// run in the prefixed offload namespace there.
pub const REASON_OFFLOAD_NAMESPACE_FALLBACK: &str = "OffloadNamespaceFallback";
/// Event on a pod whose offload namespace's NetworkPolicy the member does not take (yet): the
/// copy waits, since none goes into an open namespace.
pub const REASON_OFFLOAD_ISOLATION: &str = "OffloadIsolationPending";
/// Label on member namespaces tidepool created, so it never touches others.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "tidepool";

/// The member-side ClusterRole (pods, ConfigMaps, Secrets) tidepool binds its own identity to
/// in each offload namespace it creates; `deploy/helm/tidepool` (target=member) defines it.
pub const OFFLOAD_CLUSTER_ROLE: &str = "tidepool-offload";

/// Field manager for server-side apply and patches, per component.
pub const MANAGER_FEDERATION: &str = "tidepool-federation";
pub const MANAGER_VK: &str = "tidepool-vk";
pub const MANAGER_DISPATCHER: &str = "tidepool-dispatcher";

/// Finalizer tidepool puts on every `MemberCluster` it bridges: a deleted member is drained
/// (training pods failed, everything tidepool created there removed) before it goes.
pub const FINALIZER_DRAIN: &str = "tidepool.io/drain";
/// Reason of a training pod failed because its `MemberCluster` was deleted (and of its Event).
pub const REASON_MEMBER_REMOVED: &str = "MemberRemoved";
/// Event reason on a `MemberCluster` whose drain did not finish in time and was given up.
pub const REASON_DRAIN_ABANDONED: &str = "DrainAbandoned";

/// Condition types on `MemberCluster.status`.
pub const CONDITION_READY: &str = "Ready";
pub const CONDITION_CREDENTIALS_VALID: &str = "CredentialsValid";
pub const CONDITION_REACHABLE: &str = "Reachable";
/// True while online pods in the member run at or below the offload PriorityClasses.
pub const CONDITION_ONLINE_PRIORITY_CONFLICT: &str = "OnlinePriorityConflict";
/// `MemberCluster` condition: the member's pod CIDRs overlap the training cluster's or another
/// member's (reasons [`REASON_POD_NETWORK_OVERLAPS`], [`REASON_POD_NETWORKS_DISJOINT`]).
pub const CONDITION_POD_NETWORK_OVERLAP: &str = "PodNetworkOverlap";
pub const REASON_POD_NETWORK_OVERLAPS: &str = "PodCIDRsOverlap";
pub const REASON_POD_NETWORKS_DISJOINT: &str = "PodCIDRsDisjoint";
/// True while a deleted `MemberCluster` is drained; the reason names the step.
pub const CONDITION_DRAINING: &str = "Draining";

/// Default key of the kubeconfig inside the referenced Secret.
pub const DEFAULT_KUBECONFIG_KEY: &str = "kubeconfig";
/// Default prefix of offload namespaces in members: `tp-<namespace>`.
pub const DEFAULT_NAMESPACE_PREFIX: &str = "tp-";

/// Reclaim band of a training pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Band {
    Low,
    Medium,
    High,
}

impl Band {
    pub const ALL: [Band; 3] = [Band::High, Band::Medium, Band::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Band::High => "high",
            Band::Medium => "medium",
            Band::Low => "low",
        }
    }

    pub fn parse(s: &str) -> Option<Band> {
        Band::ALL.into_iter().find(|b| b.as_str() == s)
    }

    /// Member PriorityClass of offload pods in this band.
    pub fn priority_class(self) -> String {
        format!("tidepool-offload-{}", self.as_str())
    }

    /// Value of that PriorityClass: negative, so below every online pod (default 0), and
    /// ordered by band so the member's own preemption takes low before high.
    pub fn priority_value(self) -> i32 {
        match self {
            Band::High => -1000,
            Band::Medium => -2000,
            Band::Low => -3000,
        }
    }
}

/// Annotation on training pods: the virtual node their gang was placed on. Written on every
/// core pod before the first bind, so a restarted dispatcher never splits a gang.
pub const ANNOTATION_PLACEMENT: &str = "tidepool.io/placement";
/// The [`ANNOTATION_PLACEMENT`] of a pod the dispatcher bound to one of the training
/// cluster's own nodes (the native floor): never a virtual node's name, which all start
/// with the virtual node prefix.
pub const PLACEMENT_NATIVE: &str = "native";
/// Annotation a tenant sets on a pod (in its template: per role, or on every role of a job)
/// for the training cluster's own nodes the admin offers (`dispatcher.nativeNodes`):
/// `core` keeps the pod there when it is one of its gang's core pods and borrows lent
/// capacity when it is elastic (the native floor); `all` keeps it there always; `none`, the
/// default, places it on lent capacity only. See [`Native`].
pub const ANNOTATION_NATIVE: &str = "tidepool.io/native";

/// Where a pod asks to run, by its [`ANNOTATION_NATIVE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Native {
    /// Lent capacity only (no annotation, or `none`).
    #[default]
    None,
    /// The training cluster's own nodes as a core pod, lent capacity as an elastic one.
    Core,
    /// The training cluster's own nodes only.
    All,
}

impl Native {
    /// The mode `value` names; an unknown word is an error naming the ones there are.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("none") => Ok(Native::None),
            Some("core") => Ok(Native::Core),
            Some("all") => Ok(Native::All),
            Some(other) => Err(format!("annotation {ANNOTATION_NATIVE}: {other:?} is not one of core, all, none")),
        }
    }

    /// Whether a pod in this mode goes to a native node, as a core pod (`core`) or not.
    pub fn on_native(self, core: bool) -> bool {
        match self {
            Native::None => false,
            Native::Core => core,
            Native::All => true,
        }
    }
}

/// When the placement was recorded (RFC 3339): the gang timeout counts from here.
pub const ANNOTATION_PLACED_AT: &str = "tidepool.io/placed-at";
/// Annotation on a training pod of a placed gang: the member node the planner simulated it
/// on. Its copy gets a preferred node affinity for that node; the member's scheduler still
/// decides. Written with the placement, before the first bind.
pub const ANNOTATION_PLANNED_NODE: &str = "tidepool.io/planned-node";
/// Annotation on a training pod of a placed gang: the topology domain its gang was planned
/// into, `<key>=<value>[,<key>=<value>...]` (every level of the pool's `topology` down to the
/// one used, and the GPU model when one was chosen). Its copy gets a required node affinity
/// for each pair whose key the pool allows (see `vk-provider`'s translation). Absent when
/// nothing constrains the gang.
pub const ANNOTATION_PLANNED_DOMAIN: &str = "tidepool.io/planned-domain";

/// The pairs of a [`ANNOTATION_PLANNED_DOMAIN`] value, in order; pieces without `=` or with
/// an empty key are skipped.
pub fn parse_planned_domain(value: &str) -> Vec<(String, String)> {
    value
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}
/// Label on a placed training pod: `core` (one of its gang's `minMember`, admitted with it) or
/// `elastic` (grown beyond it). Written with the band, before the binding; trusted only on a
/// pod whose placement names its node, as the band is. A core pod that fails restarts its
/// gang whole; an elastic one only shrinks it.
pub const LABEL_ROLE: &str = "tidepool.io/role";
pub const ROLE_CORE: &str = "core";
pub const ROLE_ELASTIC: &str = "elastic";
/// On each core pod of a placed gang, written with its placement: how many core pods the
/// gang was placed with (its `minMember`). A member with a gang scheduler gets a PodGroup of
/// that size; trusted, like the role, only on a pod whose placement names its node.
pub const ANNOTATION_GANG_CORE: &str = "tidepool.io/gang-core";
/// On a failed core pod once its gang's restart is under way (RFC 3339): the pods that
/// replace it form a new gang, which this failure must not restart again.
pub const ANNOTATION_GANG_RESTARTED: &str = "tidepool.io/gang-restarted";
/// Reason of the reclaim notice that stops a gang whose core pod failed, and of its Event.
pub const REASON_GANG_RESTART: &str = "GangRestart";
/// Annotations naming the gang of a bare pod or a Job's pods, and its minimum size.
pub const ANNOTATION_GANG: &str = "tidepool.io/gang";
pub const ANNOTATION_MIN_MEMBER: &str = "tidepool.io/min-member";
/// sig-scheduling PodGroup membership (pod label).
pub const LABEL_POD_GROUP: &str = "scheduling.x-k8s.io/pod-group";
/// Volcano PodGroup membership (pod annotation).
pub const ANNOTATION_VOLCANO_GROUP: &str = "scheduling.k8s.io/group-name";

/// Reclaim notice on a training pod and its offload copy: RFC 3339 time after which the pod
/// is deleted. The offload copy shows it in `/etc/tidepool/annotations`.
pub const ANNOTATION_RECLAIM_DEADLINE: &str = "tidepool.io/reclaim-deadline";
/// Set by the trainer (on the training pod) once its checkpoint is safe: reclaim may go ahead.
/// The operators' ack: it needs training-cluster credentials.
pub const ANNOTATION_CHECKPOINT_DONE: &str = "tidepool.io/checkpoint-done";
/// The ack from inside the pod, which needs no credentials: a container that exits after the
/// notice with a termination message (`/dev/termination-log`) starting with this says that
/// its checkpoint is written (`tidepool.io/checkpointed step=1200`). The member's kubelet
/// reports the message; only the pod's own containers can write it.
pub const TERMINATION_ACK_PREFIX: &str = "tidepool.io/checkpointed";
/// Pod condition telling the tenant a reclaim notice is out.
pub const CONDITION_RECLAIM_REQUESTED: &str = "tidepool.io/ReclaimRequested";
/// The standard condition of a pod about to be taken away (scheduler preemption, eviction,
/// kubelet termination); tidepool sets it with [`REASON_DISRUPTION_RECLAIM`] on the pods it
/// reclaims or preempts.
pub const CONDITION_DISRUPTION_TARGET: &str = "DisruptionTarget";
pub const REASON_DISRUPTION_RECLAIM: &str = "ReclaimedByTidepool";
/// Pod deletion cost (honoured when picking reclaim victims).
pub const ANNOTATION_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// Reason of a training pod failed by reclaim.
pub const REASON_RECLAIMED: &str = "Reclaimed";
/// Reason of the `tidepool.io/ReclaimRequested` condition of a pod under reclaim notice.
pub const REASON_CAPACITY_RECLAIMED: &str = "CapacityReclaimed";
/// Reason of the `tidepool.io/ReclaimRequested` condition of a pod whose copy a member actor
/// asked to evict through an `EvictionRequest`.
pub const REASON_EVICTION_REQUESTED: &str = "EvictionRequested";
/// Reason (condition and Event) of a reclaim notice ended because every eviction request for
/// the copy was withdrawn.
pub const REASON_EVICTION_WITHDRAWN: &str = "EvictionWithdrawn";
/// Condition tidepool keeps on a member's `EvictionRequest` for an offload copy: the
/// checkpoint notice it relayed and how it ended.
pub const CONDITION_CHECKPOINT_NOTICE: &str = "tidepool.io/CheckpointNotice";
/// Event on a pod that a reclaim notice went out to.
pub const REASON_RECLAIM_REQUESTED: &str = "ReclaimRequested";
/// Event on the first core pod of a gang the dispatcher placed.
pub const REASON_PLACED: &str = "Placed";
/// Event on a pod the dispatcher cannot place yet, with the reason.
pub const REASON_UNPLACEABLE: &str = "Unplaceable";
/// Reason of a waiting pod's `PodScheduled=False` condition (the scheduler's own word).
pub const REASON_UNSCHEDULABLE: &str = "Unschedulable";
/// Reason (status and Event) of the pods of a placed gang rolled back whole because its core
/// did not run within the gang timeout.
pub const REASON_GANG_TIMEOUT: &str = "GangTimeout";
/// The online demand a reclaim notice answers (`nvidia.com/gpu=2`), for the final message.
pub const ANNOTATION_RECLAIM_DEMAND: &str = "tidepool.io/reclaim-demand";

/// Label prefix of the selector labels an offload copy carries: each label `k: v` of the
/// training pod becomes `svc.tidepool.io/<hash of k>: v` on the copy, and a mirrored
/// Service selects by those. The member's own selectors never use this prefix, so a tenant's
/// labels cannot make a copy match them (see `tidepool_vk::services`).
pub const SELECTOR_LABEL_PREFIX: &str = "svc.tidepool.io";
/// Label (value `true`) on the Services tidepool mirrored into an offload namespace; with the
/// origin cluster and member labels it is what the mirror, the drain and the collection select.
pub const LABEL_MIRRORED: &str = "tidepool.io/mirrored";
/// Annotation on a mirrored Service: the training Service's selector (JSON), for people.
pub const ANNOTATION_ORIGIN_SELECTOR: &str = "tidepool.io/origin-selector";
/// Reason of the Event on a training Service whose mirror a member object of the same name
/// (not tidepool's) prevents.
pub const REASON_SERVICE_CONFLICT: &str = "ServiceMirrorConflict";

// MemberCluster condition reasons and Event reasons, written by the federation controller
// (the e2e tests and users' tooling read them: they never change).

/// `Ready` False: the spec does not validate.
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
/// `CredentialsValid` and `Ready` False: the referenced Secret does not exist.
pub const REASON_SECRET_NOT_FOUND: &str = "SecretNotFound";
/// `CredentialsValid` and `Ready` False: the Secret lacks the kubeconfig key.
pub const REASON_KUBECONFIG_MISSING: &str = "KubeconfigMissing";
/// `CredentialsValid` and `Ready` False: the kubeconfig does not parse, has no usable context,
/// or no client can be built from it.
pub const REASON_KUBECONFIG_INVALID: &str = "KubeconfigInvalid";
/// `CredentialsValid` and `Ready` False: the kubeconfig asks for something tidepool refuses
/// (plugins, files on tidepool's disk, unverified TLS, credentials in the server URL).
pub const REASON_KUBECONFIG_REJECTED: &str = "KubeconfigRejected";
/// `CredentialsValid` True.
pub const REASON_VALID: &str = "Valid";
/// `CredentialsValid` and `Ready` False: the member's API server refuses the credentials.
pub const REASON_UNAUTHORIZED: &str = "Unauthorized";
/// `Reachable` True.
pub const REASON_REACHABLE: &str = "Reachable";
/// `Reachable` and `Ready` False: the member's API server does not answer.
pub const REASON_UNREACHABLE: &str = "Unreachable";
/// `Ready` False: the offload PriorityClasses cannot be created in the member.
pub const REASON_BOOTSTRAP_FAILED: &str = "BootstrapFailed";
/// `Ready` False: `spec.gangScheduler` is set but the member does not serve its PodGroups.
pub const REASON_GANG_SCHEDULER_MISSING: &str = "GangSchedulerMissing";
/// `Ready` True: the session runs and its pools are offered.
pub const REASON_CONNECTED: &str = "Connected";
/// `Ready` False while a deleted `MemberCluster` is drained (the session is held unusable).
pub const REASON_DRAINING: &str = "Draining";
/// `OnlinePriorityConflict` True, and False.
pub const REASON_ONLINE_PODS_AT_OFFLOAD_PRIORITY: &str = "OnlinePodsAtOffloadPriority";
pub const REASON_NO_CONFLICT: &str = "NoConflict";
/// Event reasons on a `MemberCluster` when a priority conflict appears (or changes), and
/// when it clears.
pub const REASON_ONLINE_PRIORITY_CONFLICT: &str = "OnlinePriorityConflict";
pub const REASON_ONLINE_PRIORITY_CONFLICT_RESOLVED: &str = "OnlinePriorityConflictResolved";
/// `Draining` reasons, one per step of the drain (see `tidepool_federation::drain`).
pub const REASON_FAILING_PODS: &str = "FailingPods";
pub const REASON_WAITING_FOR_MEMBER: &str = "WaitingForMember";
pub const REASON_DELETING_OFFLOAD_PODS: &str = "DeletingOffloadPods";
pub const REASON_DELETING_REFLECTED_OBJECTS: &str = "DeletingReflectedObjects";
pub const REASON_DELETING_NAMESPACES: &str = "DeletingNamespaces";
pub const REASON_DELETING_PRIORITY_CLASSES: &str = "DeletingPriorityClasses";
pub const REASON_DELETING_VIRTUAL_NODES: &str = "DeletingVirtualNodes";
pub const REASON_DRAINED: &str = "Drained";
