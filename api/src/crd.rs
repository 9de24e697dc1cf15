//! The `MemberCluster` custom resource: how a platform admin lends an online cluster's
//! surplus to the training cluster.
//!
//! `deploy/crds/` holds the YAML generated from these types (`tidepool crds`); a test fails
//! when the two drift apart.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::names::{DEFAULT_POOL, MemberName, PoolName, VirtualNodeName};
use crate::{FieldError, is_dns_label, is_dns_subdomain, is_label_key, keys};

/// A member (online) cluster whose surplus capacity tidepool offers as virtual nodes.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "tidepool.io",
    version = "v1alpha1",
    kind = "MemberCluster",
    plural = "memberclusters",
    shortname = "mc",
    status = "MemberClusterStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"CPU","type":"string","jsonPath":".status.cpuSurplus"}"#,
    printcolumn = r#"{"name":"GPU","type":"string","jsonPath":".status.gpuSurplus"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterSpec {
    /// The Secret holding the member's kubeconfig. Kubeconfigs that run exec or
    /// auth-provider plugins are refused: credentials must be data, not programs.
    pub kubeconfig_secret_ref: SecretKeyRef,

    /// Pools of member nodes; each becomes one virtual node `tidepool-<member>-<pool>`.
    /// Empty: one pool named `default` with every schedulable node, virtual node
    /// `tidepool-<member>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolSpec>,

    /// Prefix of the member namespaces that hold offload pods (`<prefix><namespace>`).
    /// Defaults to the bridge's setting (`tp-`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_prefix: Option<String>,

    /// `SameName` (the default): offload pods of training namespace `team-a` run in member
    /// namespace `team-a`, so the FQDNs a job was given by its operator
    /// (`<job>-ps-0.team-a.svc:2222` in a TFJob's `TF_CONFIG`, an MPI hostfile's
    /// `<pod>.<job>.team-a.svc`) resolve in the member as they do in the training cluster.
    /// Where the member already has a namespace of that name that is not this member's
    /// offload namespace (its own `team-a`, `default`, another bridge's), it is never shared:
    /// that training namespace falls back to `<namespacePrefix><namespace>` for good (Event
    /// `OffloadNamespaceFallback` on the pod; FQDNs naming `team-a` then do not resolve there).
    /// `Prefixed`: always `<namespacePrefix><namespace>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_mode: Option<NamespaceMode>,

    /// How much of the surplus is lent: reserves, time windows, HPA headroom, watermark.
    #[serde(default)]
    pub capacity: CapacitySpec,

    /// No new placements on this member; offload pods already there keep running.
    #[serde(default)]
    pub paused: bool,

    /// Labels of a training pod its offload copy carries, besides tidepool's own (origin,
    /// gang, band): exact keys, or `<prefix>/*` for every key under a prefix. Default none:
    /// the member's NetworkPolicies and meshes select pods by label, so which labels may
    /// come from tenants is the member admin's decision (see `translate::copied_metadata`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_labels: Vec<String>,

    /// The same for annotations, besides tidepool's own (origin, reclaim deadline).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_annotations: Vec<String>,

    /// How fast tidepool may call this member's API server. Defaults: 50 calls/s, bursts
    /// of 100. Probes, reads and deletes go ahead of pod and object creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limits: Option<RateLimitSpec>,

    /// Longest `terminationGracePeriodSeconds` an offload copy of each band gets. A copy keeps
    /// its training pod's grace (so a trainer the member's scheduler preempts, SIGTERM being
    /// its only notice then, has the time its tenant asked for to checkpoint), up to this
    /// bound: how long the member lets an offload pod hold capacity after its own preemption
    /// or a drain. Unset bands get the defaults (high 600 s, medium 300 s, low 120 s) unless
    /// `unbounded` says otherwise.
    #[serde(default, skip_serializing_if = "TerminationGraceLimits::is_empty")]
    pub max_termination_grace_seconds: TerminationGraceLimits,

    /// The member's own gang scheduler, if it runs one. Set, tidepool creates a member-side
    /// PodGroup for each gang's copies (before the first copy, `minMember` the gang's core)
    /// and hands the copies to that scheduler, so the member places a gang all or nothing.
    /// The PodGroup API must be served in the member (its CRD installed; for `kubernetes`,
    /// Kubernetes 1.37 with `GenericWorkload` on): without it the member is not Ready.
    /// Default none: the member's default scheduler places each copy alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_scheduler: Option<GangScheduler>,

    /// The Pod Security level of the offload namespaces and the copies: `baseline` (default)
    /// or `restricted`. Restricted, the namespaces tidepool makes enforce it and every copy
    /// runs with what the level asks where its pod says nothing (`runAsNonRoot`, no privilege
    /// escalation, every capability dropped): a pod whose image runs as root then fails to
    /// start in the member, said on its training pod. Namespaces made before keep their label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security: Option<PodSecurityLevel>,

    /// The member's pod network, as its admin declares it (the CNI's address pools). Set, a
    /// copy's pod IPs outside it never reach its training pod's `status.podIP`: a member
    /// saying otherwise (a hostile or broken one) cannot give training pods the addresses of
    /// other pods or Services of the training cluster, which its EndpointSlices and IP-based
    /// policies would then point at. Copies with `hostNetwork` report their node's address.
    /// Unset: any address the member reports comes up. Set, it is also the network
    /// `PodNetworkOverlap` compares, in place of the member nodes' `podCIDRs`.
    #[serde(default, rename = "podCIDRs", skip_serializing_if = "Vec::is_empty")]
    pub pod_cidrs: Vec<String>,

    /// Copies run in user namespaces (`hostUsers: false`): root in a container is an
    /// unprivileged user on the member's node, so a container escape lands as nobody. The
    /// member's kubelets and runtime must support it (Kubernetes 1.33+, containerd 2 or
    /// CRI-O 1.25+, a kernel with idmapped mounts for the pod's volumes); a copy that cannot
    /// start says the kubelet's reason on its training pod. Pods using a host namespace
    /// (which the policy refuses unless `policy.privileged`) keep the host's users.
    /// Default `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub user_namespaces: bool,

    /// The NetworkPolicy tidepool writes in each offload namespace before its first copy.
    /// By default copies take traffic only from their own namespace (their job's other pods)
    /// and send it only there and to the member's cluster DNS: not to online pods and
    /// Services, node ports, or metadata endpoints. Destinations a job needs besides (its
    /// checkpoint store, a package mirror) are the member admin's to add here. The member's
    /// CNI must enforce NetworkPolicies for this to hold.
    #[serde(default, skip_serializing_if = "NetworkIsolation::is_default")]
    pub network_policy: NetworkIsolation,

    /// `schedulerName` of the copies in a gang, when `gangScheduler` is set. Default: the
    /// name a second scheduler of scheduler-plugins runs as (`scheduler-plugins-scheduler`)
    /// for `coscheduling`, `volcano` for `volcano`, `default-scheduler` for `kubernetes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_scheduler_name: Option<String>,
}

/// A Pod Security Standards level ([`MemberClusterSpec::pod_security`]).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PodSecurityLevel {
    #[default]
    Baseline,
    Restricted,
}

impl PodSecurityLevel {
    /// As the `pod-security.kubernetes.io/enforce` label spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Restricted => "restricted",
        }
    }
}

/// A gang scheduler a member may run, by the PodGroup API it reads.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GangScheduler {
    /// sig-scheduling's Coscheduling plugin (scheduler-plugins): `scheduling.x-k8s.io/v1alpha1`
    /// PodGroups, members by label `scheduling.x-k8s.io/pod-group`.
    Coscheduling,
    /// Volcano: `scheduling.volcano.sh/v1beta1` PodGroups, members by annotation
    /// `scheduling.k8s.io/group-name`.
    Volcano,
    /// Kubernetes' own (1.37, feature gate `GenericWorkload`): `scheduling.k8s.io/v1beta1`
    /// PodGroups with a gang policy, members by `spec.schedulingGroup.podGroupName`; the
    /// member's default scheduler holds the gang all or nothing.
    Kubernetes,
}

impl GangScheduler {
    /// As `spec.gangScheduler` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Coscheduling => "coscheduling",
            Self::Volcano => "volcano",
            Self::Kubernetes => "kubernetes",
        }
    }

    /// The `schedulerName` its copies get unless `spec.gangSchedulerName` says otherwise.
    pub fn default_scheduler_name(self) -> &'static str {
        match self {
            Self::Coscheduling => "scheduler-plugins-scheduler",
            Self::Volcano => "volcano",
            Self::Kubernetes => "default-scheduler",
        }
    }

    /// API group, version and plural of its PodGroups.
    pub fn pod_group_api(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Self::Coscheduling => ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
            Self::Volcano => ("scheduling.volcano.sh", "v1beta1", "podgroups"),
            Self::Kubernetes => ("scheduling.k8s.io", "v1beta1", "podgroups"),
        }
    }

    /// The API resource of its PodGroups, for dynamic clients.
    pub fn pod_group_resource(self) -> kube::api::ApiResource {
        let (group, version, plural) = self.pod_group_api();
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(group, version, "PodGroup"),
            plural,
        )
    }
}

impl MemberClusterSpec {
    /// The member's gang scheduler and the `schedulerName` its gangs' copies get, if any.
    pub fn gang_scheduling(&self) -> Option<(GangScheduler, String)> {
        let kind = self.gang_scheduler?;
        let name = self.gang_scheduler_name.clone().unwrap_or_else(|| kind.default_scheduler_name().to_owned());
        Some((kind, name))
    }
}

/// What a member asks of its copies and their namespaces, from its spec
/// ([`MemberClusterSpec::confinement`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Confinement {
    /// The Pod Security level of the offload namespaces, and what copies are hardened to.
    pub pod_security: PodSecurityLevel,
    /// Copies in user namespaces (`hostUsers: false`).
    pub user_namespaces: bool,
    /// The offload namespaces' NetworkPolicy.
    pub network_policy: std::sync::Arc<NetworkIsolation>,
}

/// How copies are fenced on the member's network ([`MemberClusterSpec::network_policy`]).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkIsolation {
    /// `true`: no NetworkPolicy is written; the member's admin fences offload namespaces
    /// their own way (or accepts that copies reach everything online pods reach).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disabled: bool,
    /// Further destinations copies may reach, as NetworkPolicy egress rules (an `ipBlock` of
    /// the checkpoint store, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<k8s_openapi::api::networking::v1::NetworkPolicyEgressRule>,
    /// Further sources copies take traffic from (the member's monitoring, say), as
    /// NetworkPolicy ingress rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<k8s_openapi::api::networking::v1::NetworkPolicyIngressRule>,
}

impl NetworkIsolation {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Per-band upper bounds (seconds) on offload copies' `terminationGracePeriodSeconds`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TerminationGraceLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub medium: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low: Option<u32>,
    /// The member's explicit opt-out: bands not set here have no bound (a copy may then hold
    /// the member's capacity against its preemption or drain for as long as its tenant asks).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unbounded: bool,
}

/// The bound of a band the member admin did not set (seconds): long enough for a trainer
/// to write a checkpoint, short enough that a copy cannot hold a member's capacity against
/// its own preemption or drain for long. Elastic work is reclaimed first and waits least.
pub const DEFAULT_GRACE_BOUNDS: [(crate::keys::Band, u32); 3] =
    [(crate::keys::Band::High, 600), (crate::keys::Band::Medium, 300), (crate::keys::Band::Low, 120)];

impl TerminationGraceLimits {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The bound for `band`: the member admin's, else the default for the band
    /// ([`DEFAULT_GRACE_BOUNDS`]), none only where the admin opted out (`unbounded`).
    pub fn get(&self, band: crate::keys::Band) -> Option<u32> {
        let set = match band {
            crate::keys::Band::High => self.high,
            crate::keys::Band::Medium => self.medium,
            crate::keys::Band::Low => self.low,
        };
        let default = || DEFAULT_GRACE_BOUNDS.iter().find(|(b, _)| *b == band).map(|(_, s)| *s);
        set.or_else(|| if self.unbounded { None } else { default() })
    }
}

/// How a training namespace maps to its member namespace.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum NamespaceMode {
    /// The training namespace's own name, or `<namespacePrefix><namespace>` where the member
    /// has that name already.
    #[default]
    SameName,
    /// `<namespacePrefix><namespace>` (default `tp-<namespace>`).
    Prefixed,
}

impl MemberClusterSpec {
    /// The prefix of this member's prefixed offload namespaces (every one in `Prefixed` mode,
    /// the fallbacks in `SameName` mode): `spec.namespacePrefix` or the bridge's `default`.
    pub fn effective_namespace_prefix(&self, default: &str) -> String {
        self.namespace_prefix.clone().unwrap_or_else(|| default.to_owned())
    }

    /// How the member confines its copies: `podSecurity`, `userNamespaces`, `networkPolicy`.
    pub fn confinement(&self) -> Confinement {
        Confinement {
            pod_security: self.pod_security.unwrap_or_default(),
            user_namespaces: self.user_namespaces,
            network_policy: std::sync::Arc::new(self.network_policy.clone()),
        }
    }

    /// Whether offload namespaces take the training namespaces' own names where they can.
    pub fn same_name_namespaces(&self) -> bool {
        self.namespace_mode.unwrap_or_default() == NamespaceMode::SameName
    }
}

/// Default sustained rate of calls to a member (per second).
pub const DEFAULT_MEMBER_QPS: u32 = 50;
/// Default burst of calls to a member above the sustained rate.
pub const DEFAULT_MEMBER_BURST: u32 = 100;

/// Client-side limits on the calls tidepool makes to one member.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitSpec {
    /// Sustained calls per second (1–10000, default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub qps: Option<u32>,
    /// Calls that may go at once after a quiet spell (1–100000, default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub burst: Option<u32>,
}

impl RateLimitSpec {
    pub fn qps(&self) -> u32 {
        self.qps.unwrap_or(DEFAULT_MEMBER_QPS)
    }

    pub fn burst(&self) -> u32 {
        self.burst.unwrap_or(DEFAULT_MEMBER_BURST)
    }
}

/// What is held back from the surplus before it is lent. Each amount applies per pool.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacitySpec {
    /// Static safety margin kept free for online pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reserve: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// Percentage of what is left that is lent (1–100, default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark_percent: Option<u32>,
    /// Time-sliced reservations: capacity handed back before a predictable peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<WindowSpec>,
    /// Online HPA quota feeding: `(maxReplicas − currentReplicas) × per-replica requests ×
    /// factorPercent/100` is held back for every HPA of the member. Default 100; 0 disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hpa_headroom_percent: Option<u32>,
}

/// A reservation active for `durationMinutes` from each firing of `schedule` (cron),
/// starting `leadSeconds` early so victims get their checkpoint notice before the peak.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WindowSpec {
    pub name: String,
    /// `minute hour day-of-month month day-of-week` (names, `?` and `@daily`-style macros
    /// as in a CronJob), read in `timeZone`.
    pub schedule: String,
    /// IANA time zone the schedule is read in (as a CronJob's `timeZone`); default UTC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    pub duration_minutes: u32,
    #[serde(default)]
    pub lead_seconds: u32,
    pub reserve: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

/// Reference to one key of a Secret in the training cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    pub name: String,
    /// Defaults to tidepool's own namespace (bridge config `namespace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Defaults to `kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// A set of member nodes lent as one virtual node.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    /// DNS label; part of the virtual node's name.
    pub name: String,
    /// Member nodes whose labels match all of these belong to the pool. Offload pods get
    /// the same selector, so the member's scheduler keeps them inside the pool.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Taints of the pool's nodes that its offload pods tolerate (nodes dedicated to
    /// lending, say). Every copy gets these tolerations, and only nodes whose `NoSchedule`
    /// and `NoExecute` taints are all tolerated count towards the pool's capacity. Tenants'
    /// own tolerations never reach the member, but `node.kubernetes.io/not-ready` and
    /// `unreachable` NoExecute for at most 300 s (see `translate::LIFECYCLE_TAINTS`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<PoolToleration>,
    /// RuntimeClasses offload pods in this pool may name (`spec.runtimeClassName`); a pod
    /// naming another is refused (reason `OffloadPolicy`). Empty: only the member's default
    /// runtime.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runtime_class_names: Vec<String>,
    /// Node label keys naming the pool's topology domains, coarse to fine (for example
    /// `topology.kubernetes.io/zone`, then a rack label, then an NVLink-domain label). The
    /// planner keeps each gang inside one domain of the finest level that fits it, and every
    /// copy gets a required node affinity for that domain. Empty: no topology.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology: Vec<String>,
    /// Which node resources the pool lends (see [`PoolMode`]). Default `requests`.
    #[serde(default, skip_serializing_if = "PoolMode::is_requests")]
    pub mode: PoolMode,
}

/// What a pool lends: the surplus of requests, or the slack a member's colocation system
/// measures and publishes as batch resources on its nodes (see [`crate::colocation`]).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PoolMode {
    /// Node allocatable minus what online pods request.
    #[default]
    Requests,
    /// Koordinator's `kubernetes.io/batch-cpu` and `batch-memory`: copies run as
    /// `koord-batch` pods of QoS `BE`.
    KoordinatorBatch,
    /// Katalyst's `resource.katalyst.kubewharf.io/reclaimed_millicpu` and `reclaimed_memory`:
    /// copies run as `reclaimed_cores` pods.
    KatalystReclaimed,
}

impl PoolMode {
    pub fn is_requests(&self) -> bool {
        *self == PoolMode::Requests
    }

    /// As written in `spec.pools[].mode`.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Requests => "requests",
            PoolMode::KoordinatorBatch => "koordinator-batch",
            PoolMode::KatalystReclaimed => "katalyst-reclaimed",
        }
    }
}

/// A toleration every copy of a pool gets: a `core/v1` Toleration without
/// `tolerationSeconds` (a pool tolerates its own nodes for good).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolToleration {
    /// Taint key: required (a key-less `Exists` would tolerate every taint, the member's
    /// control plane's too, and the member chart's policy refuses such copies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `Equal` (default) or `Exists`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`; empty: every effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
}

/// The problems of `spec.capacity`.
fn capacity_errors(c: &CapacitySpec, errors: &mut Vec<FieldError>) {
    for (k, v) in &c.reserve {
        if crate::resources::parse_milli(&v.0).map_or(true, |m| m < 0) {
            errors.push(FieldError::new(
                format!("spec.capacity.reserve[{k}]"),
                format!("{:?} is not a non-negative quantity", v.0),
            ));
        }
    }
    if let Some(w) = c.watermark_percent
        && !(1..=100).contains(&w)
    {
        errors.push(FieldError::new("spec.capacity.watermarkPercent", "must be between 1 and 100"));
    }
    if c.hpa_headroom_percent.is_some_and(|f| f > 1000) {
        errors.push(FieldError::new("spec.capacity.hpaHeadroomPercent", "must be at most 1000"));
    }
    for (i, w) in c.windows.iter().enumerate() {
        let path = format!("spec.capacity.windows[{i}]");
        if let Some(tz) = &w.time_zone
            && let Err(why) = crate::cron::time_zone(tz)
        {
            errors.push(FieldError::new(format!("{path}.timeZone"), why));
        } else if let Err(e) = crate::cron::Schedule::parse_in(&w.schedule, w.time_zone.as_deref()) {
            errors.push(FieldError::new(format!("{path}.schedule"), e.reason));
        }
        if !(1..=1440).contains(&w.duration_minutes) {
            errors.push(FieldError::new(format!("{path}.durationMinutes"), "must be between 1 and 1440"));
        }
        if w.lead_seconds > 86_400 {
            errors.push(FieldError::new(format!("{path}.leadSeconds"), "must be at most 86400"));
        }
        for (k, v) in &w.reserve {
            if crate::resources::parse_milli(&v.0).map_or(true, |m| m < 0) {
                errors.push(FieldError::new(
                    format!("{path}.reserve[{k}]"),
                    format!("{:?} is not a non-negative quantity", v.0),
                ));
            }
        }
    }
}

/// The problems of `spec.pools[i]` of the member named `member`; `seen` holds the pool
/// names before it.
fn pool_errors<'a>(
    member: &str,
    i: usize,
    pool: &'a PoolSpec,
    seen: &mut std::collections::BTreeSet<&'a str>,
    errors: &mut Vec<FieldError>,
) {
    if !is_dns_label(&pool.name) {
        errors.push(FieldError::new(format!("spec.pools[{i}].name"), "must be a DNS-1123 label"));
    } else if !seen.insert(pool.name.as_str()) {
        errors.push(FieldError::new(format!("spec.pools[{i}].name"), format!("duplicate pool {:?}", pool.name)));
    } else if is_dns_label(member) {
        let node = VirtualNodeName::for_pool(&MemberName::from(member), &PoolName::from(pool.name.as_str()));
        if node.as_str().len() > 63 {
            errors.push(FieldError::new(
                format!("spec.pools[{i}].name"),
                format!("virtual node name {node} is longer than 63 characters"),
            ));
        }
    }
    for (j, class) in pool.runtime_class_names.iter().enumerate() {
        if !is_dns_subdomain(class) {
            errors.push(FieldError::new(
                format!("spec.pools[{i}].runtimeClassNames[{j}]"),
                "must be a RuntimeClass name",
            ));
        }
    }
    for (j, t) in pool.tolerations.iter().enumerate() {
        if let Some(problem) = t.problem() {
            errors.push(FieldError::new(format!("spec.pools[{i}].tolerations[{j}]"), problem));
        }
    }
    if pool.topology.len() > 8 {
        errors.push(FieldError::new(format!("spec.pools[{i}].topology"), "must have at most 8 keys"));
    }
    let mut levels = std::collections::BTreeSet::new();
    for (j, key) in pool.topology.iter().enumerate() {
        let path = format!("spec.pools[{i}].topology[{j}]");
        if !is_label_key(key) {
            errors.push(FieldError::new(path, format!("{key:?} is not a node label key")));
        } else if !levels.insert(key.as_str()) {
            errors.push(FieldError::new(path, format!("duplicate topology key {key:?}")));
        }
    }
}

impl PoolToleration {
    /// Whether this toleration lets a pod onto a node with taint `key=value:effect`
    /// (the scheduler's rule: same key, or empty key with `Exists`; same value unless
    /// `Exists`; same effect unless empty).
    pub fn tolerates(&self, key: &str, value: Option<&str>, effect: &str) -> bool {
        if self.effect.as_deref().is_some_and(|e| !e.is_empty() && e != effect) {
            return false;
        }
        let own_key = self.key.as_deref().unwrap_or("");
        match self.operator.as_deref() {
            Some("Exists") => own_key.is_empty() || own_key == key,
            _ => own_key == key && self.value.as_deref().unwrap_or("") == value.unwrap_or(""),
        }
    }

    /// As the toleration a copy carries.
    pub fn to_toleration(&self) -> k8s_openapi::api::core::v1::Toleration {
        k8s_openapi::api::core::v1::Toleration {
            key: self.key.clone(),
            operator: self.operator.clone(),
            value: self.value.clone(),
            effect: self.effect.clone(),
            toleration_seconds: None,
        }
    }
}

/// What tidepool last observed of the member.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterStatus {
    /// `Ready`, `CredentialsValid`, `Reachable`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// One entry per pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolStatus>,
    /// Sum of the pools' cpu capacity, for `kubectl get memberclusters`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_surplus: Option<String>,
    /// Sum of the pools' `nvidia.com/gpu` capacity, for `kubectl get memberclusters`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_surplus: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Capacity of one pool as last computed by federation.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    pub name: String,
    /// The virtual node standing for this pool.
    pub virtual_node: String,
    /// Ready, schedulable member nodes in the pool.
    pub nodes: i32,
    /// What the pool can lend (the virtual node's allocatable).
    #[serde(default)]
    pub capacity: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// What offload pods in the pool request.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub used: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// What offload pods use beyond the capacity: what reclaim has to free.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub deficit: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// What the pool keeps from lending now: the reserve, open capacity windows, HPA
    /// headroom and pending online pods (before the watermark).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub held_back: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

impl MemberClusterSpec {
    /// The pools with the default applied.
    pub fn effective_pools(&self) -> Vec<PoolSpec> {
        if self.pools.is_empty() {
            vec![PoolSpec { name: DEFAULT_POOL.to_owned(), ..Default::default() }]
        } else {
            self.pools.clone()
        }
    }

    pub fn secret_key(&self) -> &str {
        self.kubeconfig_secret_ref.key.as_deref().unwrap_or(keys::DEFAULT_KUBECONFIG_KEY)
    }

    /// Every problem in the spec, each with the path of its field. `name` is the object's
    /// name, which ends up in virtual node names.
    pub fn validate(&self, name: &str) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if !is_dns_label(name) {
            errors.push(FieldError::new("metadata.name", "must be a DNS-1123 label (it names virtual nodes)"));
        }
        let r = &self.kubeconfig_secret_ref;
        if !is_dns_subdomain(&r.name) {
            errors.push(FieldError::new("spec.kubeconfigSecretRef.name", "must be a Secret name"));
        }
        if let Some(ns) = &r.namespace
            && !is_dns_label(ns)
        {
            errors.push(FieldError::new("spec.kubeconfigSecretRef.namespace", "must be a namespace name"));
        }
        if let Some(key) = &r.key
            && (key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)))
        {
            errors.push(FieldError::new("spec.kubeconfigSecretRef.key", "must be a Secret data key"));
        }
        if let Some(prefix) = &self.namespace_prefix
            && !valid_namespace_prefix(prefix)
        {
            errors.push(FieldError::new("spec.namespacePrefix", NAMESPACE_PREFIX_RULE));
        }
        if let Some(n) = &self.gang_scheduler_name {
            if self.gang_scheduler.is_none() {
                errors.push(FieldError::new("spec.gangSchedulerName", "must be unset without gangScheduler"));
            } else if !is_dns_subdomain(n) {
                errors.push(FieldError::new("spec.gangSchedulerName", "must be a scheduler name (DNS-1123 subdomain)"));
            }
        }
        for (i, cidr) in self.pod_cidrs.iter().enumerate() {
            if cidr.parse::<crate::net::Cidr>().is_err() {
                errors.push(FieldError::new(format!("spec.podCIDRs[{i}]"), "must be an IP network (10.244.0.0/16)"));
            }
        }
        capacity_errors(&self.capacity, &mut errors);
        for (field, list) in [("copyLabels", &self.copy_labels), ("copyAnnotations", &self.copy_annotations)] {
            for (i, entry) in list.iter().enumerate() {
                if let Err(why) = check_copy_entry(entry) {
                    errors.push(FieldError::new(format!("spec.{field}[{i}]"), why));
                }
            }
        }
        if let Some(r) = &self.rate_limits {
            if r.qps.is_some_and(|q| !(1..=10_000).contains(&q)) {
                errors.push(FieldError::new("spec.rateLimits.qps", "must be between 1 and 10000"));
            }
            if r.burst.is_some_and(|b| !(1..=100_000).contains(&b)) {
                errors.push(FieldError::new("spec.rateLimits.burst", "must be between 1 and 100000"));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            pool_errors(name, i, pool, &mut seen, &mut errors);
        }
        errors
    }
}

impl PoolToleration {
    /// What the API server would refuse in this toleration, if anything.
    fn problem(&self) -> Option<&'static str> {
        let key = self.key.as_deref().unwrap_or("");
        match self.operator.as_deref() {
            None | Some("Equal") if key.is_empty() => return Some("operator Equal needs a key"),
            // The member chart's policy refuses such copies: say so here, once.
            Some("Exists") if key.is_empty() => {
                return Some(
                    "a toleration without a key tolerates every taint (the member's control plane too): name the key",
                );
            }
            None | Some("Equal") | Some("Exists") => {}
            Some(_) => return Some("operator must be Equal or Exists"),
        }
        if self.operator.as_deref() == Some("Exists") && self.value.as_deref().is_some_and(|v| !v.is_empty()) {
            return Some("operator Exists takes no value");
        }
        match self.effect.as_deref() {
            None | Some("" | "NoSchedule" | "PreferNoSchedule" | "NoExecute") => None,
            Some(_) => Some("effect must be NoSchedule, PreferNoSchedule or NoExecute"),
        }
    }
}

/// An entry of `spec.copyLabels`/`copyAnnotations`: a label key (`[prefix/]name`) or
/// `<prefix>/*`, and none of tidepool's own (`tidepool.io/`): those mean something to
/// tidepool, so only tidepool writes them on a copy.
fn check_copy_entry(entry: &str) -> Result<(), &'static str> {
    let (prefix, name) = match entry.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, entry),
    };
    if prefix.is_some_and(|p| p == crate::keys::GROUP || p.ends_with(".tidepool.io")) {
        return Err("tidepool.io/ keys are tidepool's own and cannot be copied from a tenant's pod");
    }
    if prefix.is_some_and(|p| !is_dns_subdomain(p)) {
        return Err("the prefix must be a DNS subdomain");
    }
    let name_ok = name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if name == "*" && prefix.is_some() || name_ok {
        Ok(())
    } else {
        Err("must be a label key (example.com/tier) or a prefix with /* (example.com/*)")
    }
}

/// What [`valid_namespace_prefix`] accepts, for messages.
pub const NAMESPACE_PREFIX_RULE: &str = "must be a lower-case letter, then lower-case letters and digits, then one '-' \
     (like tp-), at most 20 characters, not kube-, openshift- or default-";

/// Namespace-name prefixes the cluster itself (or a distribution) keeps for its own
/// components, and the namespaces `default` and `kube`.
const RESERVED_NAMESPACE_STEMS: [&str; 3] = ["kube", "openshift", "default"];

/// A namespace prefix leaves room for the training namespace after it, and maps namespaces
/// one to one: with a single `-`, at its end, `<prefix><ns>` splits at its first `-` into
/// prefix and training namespace, so `tp-` + `a-b` and `tp-a-` + `b` (both `tp-a-b`)
/// cannot both be configured. Reserved prefixes (`kube-`, …) are refused: tidepool must
/// never create a namespace the member's own components own or trust.
pub fn valid_namespace_prefix(prefix: &str) -> bool {
    let Some(stem) = prefix.strip_suffix('-') else { return false };
    prefix.len() <= 20
        && stem.starts_with(|c: char| c.is_ascii_lowercase())
        && stem.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && !RESERVED_NAMESPACE_STEMS.contains(&stem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> MemberClusterSpec {
        MemberClusterSpec {
            kubeconfig_secret_ref: SecretKeyRef { name: "member-a-kubeconfig".into(), ..Default::default() },
            ..Default::default()
        }
    }

    #[test]
    fn declared_pod_cidrs_must_be_networks() {
        let s = MemberClusterSpec {
            pod_cidrs: vec!["10.244.0.0/16".into(), "fd00::/64".into(), "10.0.0.0/33".into(), "10.0.0.0".into()],
            ..spec()
        };
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["spec.podCIDRs[2]", "spec.podCIDRs[3]"]);
    }

    #[test]
    fn grace_is_bounded_per_band_by_default_and_unbounded_only_when_the_member_says_so() {
        use crate::keys::Band;
        let none = TerminationGraceLimits::default();
        assert_eq!([Band::High, Band::Medium, Band::Low].map(|b| none.get(b)), [Some(600), Some(300), Some(120)]);
        let set = TerminationGraceLimits { medium: Some(45), ..none };
        assert_eq!((set.get(Band::Medium), set.get(Band::Low)), (Some(45), Some(120)));
        let opted_out = TerminationGraceLimits { unbounded: true, ..set };
        assert_eq!((opted_out.get(Band::Medium), opted_out.get(Band::Low)), (Some(45), None));
        let yaml: TerminationGraceLimits = serde_json::from_value(serde_json::json!({"unbounded": true})).unwrap();
        assert_eq!(yaml.get(Band::High), None);
    }

    #[test]
    fn a_minimal_spec_is_valid_and_has_one_default_pool() {
        let s = spec();
        assert!(s.validate("member-a").is_empty());
        let pools = s.effective_pools();
        assert_eq!(pools.len(), 1);
        assert_eq!(pools[0].name, DEFAULT_POOL);
        assert_eq!(s.secret_key(), "kubeconfig");
    }

    #[test]
    fn same_name_is_the_default_and_the_prefix_names_the_fallbacks() {
        let mut s = spec();
        assert!(s.same_name_namespaces(), "same-named namespaces unless the member says otherwise");
        assert_eq!(s.effective_namespace_prefix("tp-"), "tp-");
        s.namespace_prefix = Some("lend-".into());
        assert_eq!(s.effective_namespace_prefix("tp-"), "lend-");
        assert!(s.validate("member-a").is_empty(), "a prefix names the fallback namespaces");
        s.namespace_mode = Some(NamespaceMode::Prefixed);
        assert!(!s.same_name_namespaces());
    }

    #[test]
    fn a_gang_scheduler_picks_its_copies_scheduler_name_unless_the_admin_names_one() {
        let mut s = spec();
        assert_eq!(s.gang_scheduling(), None, "default: no gang scheduler");
        s.gang_scheduler = Some(GangScheduler::Coscheduling);
        assert_eq!(s.gang_scheduling(), Some((GangScheduler::Coscheduling, "scheduler-plugins-scheduler".into())));
        s.gang_scheduler = Some(GangScheduler::Volcano);
        assert_eq!(s.gang_scheduling(), Some((GangScheduler::Volcano, "volcano".into())));
        s.gang_scheduler_name = Some("gang-scheduler".into());
        assert_eq!(s.gang_scheduling(), Some((GangScheduler::Volcano, "gang-scheduler".into())));
        assert!(s.validate("member-a").is_empty());
        s.gang_scheduler_name = Some("Not A Name".into());
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["spec.gangSchedulerName"]);
        s.gang_scheduler = None;
        s.gang_scheduler_name = Some("gang-scheduler".into());
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["spec.gangSchedulerName"], "a name without a gang scheduler means nothing");
        let parsed: GangScheduler = serde_json::from_str("\"coscheduling\"").expect("parses");
        assert_eq!(parsed, GangScheduler::Coscheduling);
    }

    #[test]
    fn every_bad_field_is_named() {
        let mut s = spec();
        s.kubeconfig_secret_ref.name = "Bad_Name".into();
        s.namespace_prefix = Some("TP".into());
        s.pools = vec![
            PoolSpec { name: "gpu".into(), ..Default::default() },
            PoolSpec { name: "gpu".into(), ..Default::default() },
            PoolSpec { name: "Not OK".into(), ..Default::default() },
        ];
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            ["spec.kubeconfigSecretRef.name", "spec.namespacePrefix", "spec.pools[1].name", "spec.pools[2].name"]
        );
    }

    #[test]
    fn topology_keys_are_label_keys_each_listed_once() {
        let mut s = spec();
        let keys = ["topology.kubernetes.io/zone", "example.com/rack", "Not A Key", "example.com/rack"];
        s.pools = vec![PoolSpec {
            name: "gpu".into(),
            topology: keys.iter().map(|k| (*k).to_owned()).collect(),
            ..Default::default()
        }];
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["spec.pools[0].topology[2]", "spec.pools[0].topology[3]"]);
        s.pools[0].topology.truncate(2);
        assert!(s.validate("member-a").is_empty());
    }

    #[test]
    fn capacity_settings_are_checked_field_by_field() {
        let mut s = spec();
        s.capacity.watermark_percent = Some(0);
        s.capacity.reserve.insert("cpu".into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("lots".into()));
        s.capacity.windows.push(WindowSpec {
            name: "peak".into(),
            schedule: "0 25 * * *".into(),
            duration_minutes: 0,
            ..Default::default()
        });
        s.capacity.windows.push(WindowSpec {
            name: "local".into(),
            schedule: "0 18 * * *".into(),
            time_zone: Some("Europe/Atlantis".into()),
            duration_minutes: 60,
            ..Default::default()
        });
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            [
                "spec.capacity.reserve[cpu]",
                "spec.capacity.watermarkPercent",
                "spec.capacity.windows[0].schedule",
                "spec.capacity.windows[0].durationMinutes",
                "spec.capacity.windows[1].timeZone"
            ]
        );
    }

    #[test]
    fn rate_limits_default_and_are_bounded() {
        let mut s = spec();
        let r = s.rate_limits.clone().unwrap_or_default();
        assert_eq!((r.qps(), r.burst()), (DEFAULT_MEMBER_QPS, DEFAULT_MEMBER_BURST));
        s.rate_limits = Some(RateLimitSpec { qps: Some(0), burst: Some(100_001) });
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["spec.rateLimits.qps", "spec.rateLimits.burst"]);
        s.rate_limits = Some(RateLimitSpec { qps: Some(5), burst: None });
        assert!(s.validate("member-a").is_empty());
        assert_eq!(s.rate_limits.as_ref().map(RateLimitSpec::burst), Some(DEFAULT_MEMBER_BURST));
    }

    #[test]
    fn a_pool_toleration_follows_the_schedulers_matching_rule() {
        let t = |key: Option<&str>, op: Option<&str>, value: Option<&str>, effect: Option<&str>| PoolToleration {
            key: key.map(Into::into),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
        };
        let equal = t(Some("dedicated"), None, Some("lend"), Some("NoSchedule"));
        assert!(equal.tolerates("dedicated", Some("lend"), "NoSchedule"));
        assert!(!equal.tolerates("dedicated", Some("other"), "NoSchedule"), "another value");
        assert!(!equal.tolerates("dedicated", Some("lend"), "NoExecute"), "another effect");
        assert!(!equal.tolerates("gpu", Some("lend"), "NoSchedule"), "another key");
        let exists = t(Some("dedicated"), Some("Exists"), None, None);
        assert!(exists.tolerates("dedicated", Some("anything"), "NoExecute"));
        assert!(!exists.tolerates("gpu", None, "NoSchedule"));
        assert!(t(None, Some("Exists"), None, None).tolerates("any", Some("x"), "NoExecute"), "tolerate-all");
        // Validation, as the API server would judge the copy's toleration.
        assert_eq!(t(None, None, Some("x"), None).problem(), Some("operator Equal needs a key"));
        assert_eq!(t(Some("k"), Some("In"), None, None).problem(), Some("operator must be Equal or Exists"));
        assert_eq!(t(Some("k"), Some("Exists"), Some("v"), None).problem(), Some("operator Exists takes no value"));
        assert!(t(Some("k"), None, None, Some("NoRun")).problem().is_some());
        assert_eq!(equal.problem(), None);
        assert!(t(None, Some("Exists"), None, None).problem().is_some(), "tolerate-all is not lent");
    }

    #[test]
    fn copy_lists_name_keys_or_prefixes_and_never_tidepools_own() {
        let mut s = spec();
        s.copy_labels = ["app", "example.com/tier", "example.com/*", "tidepool.io/gang", "*", "a b", "x/*/y"]
            .map(String::from)
            .to_vec();
        s.copy_annotations = ["prometheus.io/*", "tidepool.io/*"].map(String::from).to_vec();
        s.pools = vec![PoolSpec {
            name: "gpu".into(),
            runtime_class_names: vec!["gvisor".into(), "Not_A_Name".into()],
            ..Default::default()
        }];
        let paths: Vec<String> = s.validate("member-a").into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            [
                "spec.copyLabels[3]",
                "spec.copyLabels[4]",
                "spec.copyLabels[5]",
                "spec.copyLabels[6]",
                "spec.copyAnnotations[1]",
                "spec.pools[0].runtimeClassNames[1]"
            ]
        );
    }

    #[test]
    fn namespace_prefixes_are_unambiguous_and_never_reserved() {
        // `tp-` + `a-b` and `tp-a-` + `b` would both be `tp-a-b`: one dash, at the end.
        for bad in ["kube-", "kube-tp-", "kube", "default", "default-", "openshift-", "tp", "tp-a-", "tp--", "-"] {
            assert!(!valid_namespace_prefix(bad), "{bad:?} accepted");
        }
        for good in ["tp-", "offload-", "t1-"] {
            assert!(valid_namespace_prefix(good), "{good:?} refused");
        }
    }

    #[test]
    fn the_object_name_must_fit_a_node_name() {
        assert_eq!(spec().validate("Member.A")[0].path, "metadata.name");
    }
}
