//! The capacity model: what a pool of member nodes can lend. Pure functions over plain data;
//! the watches in [`crate::member`] feed them.
//!
//! ```text
//! capacity(P) = clamp≥0( Σ_n∈P (allocatable(n) − online(n)) )
//! ```
//! over the pool's Ready, schedulable nodes, where `online(n)` is the requests of pods on `n`
//! that tidepool did not create. Offload pods do not reduce the capacity: it is what tidepool
//! may use in total, and `used(P)` is measured against it.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use tidepool_api::colocation::Colocation;
pub use tidepool_api::crd::PoolMode;
use tidepool_api::crd::PoolToleration;
use tidepool_api::{Resources, keys};

/// What the capacity model needs of a member node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub ready: bool,
    pub unschedulable: bool,
    pub allocatable: Resources,
    /// `NoSchedule` and `NoExecute` taints: a pool counts the node only if its copies
    /// tolerate them all ([`NodeView::tolerated_by`]).
    pub taints: Vec<HardTaint>,
    /// The node's pod CIDRs ([`crate::pod_network`]).
    pub pod_cidrs: Vec<crate::pod_network::Cidr>,
}

/// A taint that keeps every pod off a node unless the pod tolerates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardTaint {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
}

/// Key of a member pod: namespace and name.
pub type PodCapacityKey = (String, String);

/// What the capacity model needs of a member pod. A member holds one per pod (online and
/// offload, thousands of each), so what only some online pods carry is boxed apart
/// ([`OnlineParts`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodView {
    /// `spec.nodeName`; `None` while pending.
    pub node: Option<Box<str>>,
    pub requests: Resources,
    /// Succeeded or Failed: holds no resources any more.
    pub terminated: bool,
    /// Created by tidepool (carries `tidepool.io/origin-uid`).
    pub offload: bool,
    /// `spec.priority`, resolved by the API server at admission.
    pub priority: Option<i32>,
    /// The training pod an offload pod copies.
    pub origin_uid: Option<Arc<str>>,
    /// An offload pod's own UID (`None` for online pods: not needed).
    pub uid: Option<Arc<str>>,
    /// Where a pending pod could land and the workload it belongs to; `None` when it has
    /// neither (every offload pod, most placed online pods).
    pub online: Option<Box<OnlineParts>>,
}

/// The parts of a member pod's view that only online pods have ([`PodView::online`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OnlineParts {
    /// `spec.nodeSelector`: which pools a pending pod could land in.
    pub node_selector: BTreeMap<String, String>,
    /// `spec.tolerations` of a pending online pod: a pool of tainted (dedicated) nodes is
    /// where it could land only if it tolerates them.
    pub tolerations: Vec<PoolToleration>,
    /// The online workload whose controller created the pod: kind (`Deployment`, through
    /// its ReplicaSet, or `StatefulSet`) and name. Counts the replicas that exist.
    pub workload: Option<(&'static str, Box<str>)>,
}

impl OnlineParts {
    /// The parts boxed, or `None` when there are none to keep.
    pub fn boxed(
        node_selector: BTreeMap<String, String>,
        tolerations: Vec<PoolToleration>,
        workload: Option<(&'static str, Box<str>)>,
    ) -> Option<Box<Self>> {
        let empty = node_selector.is_empty() && tolerations.is_empty() && workload.is_none();
        (!empty).then(|| Box::new(Self { node_selector, tolerations, workload }))
    }
}

/// The selector of a view without one.
static NO_SELECTOR: BTreeMap<String, String> = BTreeMap::new();

impl PodView {
    /// `spec.nodeSelector` (kept for a pending online pod only).
    pub fn node_selector(&self) -> &BTreeMap<String, String> {
        self.online.as_ref().map_or(&NO_SELECTOR, |o| &o.node_selector)
    }

    /// `spec.tolerations` (kept for a pending online pod only).
    pub fn tolerations(&self) -> &[PoolToleration] {
        self.online.as_ref().map_or(&[], |o| &o.tolerations)
    }

    /// The online workload the pod belongs to: kind and name.
    pub fn workload(&self) -> Option<(&'static str, &str)> {
        self.online.as_ref()?.workload.as_ref().map(|(kind, name)| (*kind, &**name))
    }
}

impl PodView {
    /// An online pod the member's scheduler has not placed (yet): demand to answer at once.
    pub fn pending_online(&self) -> bool {
        !self.offload && !self.terminated && self.node.is_none()
    }
}

/// A pool's lendable capacity at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolCapacity {
    /// What the pool can lend: the virtual node's allocatable.
    pub capacity: Resources,
    /// Requests of offload pods running in the pool.
    pub used: Resources,
    /// Ready, schedulable nodes in the pool.
    pub nodes: u32,
    /// `nvidia.com/gpu.product` when every node of the pool has the same one.
    pub gpu_product: Option<String>,
    /// Per node of the pool, what is still free for new pods, most devices first (see
    /// [`NodeFree`]). Placement checks fit against these, not against the aggregate.
    pub free_per_node: Vec<NodeFree>,
    /// The pool's topology label keys, coarse to fine (`spec.pools[].topology`): the levels
    /// whose values [`NodeFree::labels`] carries.
    pub topology: Vec<String>,
    /// Origin UID → member node and copy of the offload pods already on a node of the pool, so
    /// the dispatcher can tell which pods it bound are still in flight (not yet in
    /// `used`/`free`), which victims would empty a whole member node, and which copy exactly
    /// to delete. Shared: every reader of a published capacity clones it, and it has an entry
    /// per offload pod.
    pub placed: std::sync::Arc<BTreeMap<Arc<str>, Placed>>,
    /// What the policy held back from the surplus (reserve, windows, HPA headroom, pending
    /// online pods), before the watermark.
    pub held_back: Resources,
}

/// One member node of a pool, as the planner simulates gangs on it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeFree {
    /// The member node's name: the planned node a copy prefers.
    pub name: String,
    /// `allocatable − online − offload`, clamped at zero.
    pub free: Resources,
    /// The node's values of the pool's topology keys and of [`GPU_PRODUCT_LABEL`], and no
    /// other label: a pool of thousands of nodes is copied on every publication.
    pub labels: BTreeMap<String, String>,
}

impl NodeFree {
    /// A node with no labels, named `name`.
    pub fn new(name: impl Into<String>, free: Resources) -> Self {
        Self { name: name.into(), free, labels: BTreeMap::new() }
    }
}

/// Where an offload pod runs in the member. Its strings are shared with the member pod's
/// view ([`PodView`]): a pool holds one entry per offload pod in every published capacity.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placed {
    /// The member node.
    pub node: Arc<str>,
    /// The copy's UID in the member: a delete made with it as precondition takes this copy and
    /// nothing else of the same name.
    pub copy_uid: Option<Arc<str>>,
}

/// An admin's capacity settings for a member, parsed (see `CapacitySpec`).
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityPolicy {
    pub reserve: Resources,
    pub watermark_percent: u32,
    pub windows: Vec<Window>,
    pub hpa_percent: u32,
}

impl Default for CapacityPolicy {
    fn default() -> Self {
        Self { reserve: Resources::new(), watermark_percent: 100, windows: Vec::new(), hpa_percent: 100 }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub name: String,
    pub schedule: tidepool_api::cron::Schedule,
    pub duration: jiff::SignedDuration,
    pub lead: jiff::SignedDuration,
    pub reserve: Resources,
}

impl CapacityPolicy {
    /// From a validated spec; entries that do not parse are skipped (validation reports them).
    pub fn from_spec(spec: &tidepool_api::crd::CapacitySpec) -> Self {
        let quantities = |m: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>| {
            let mut r = Resources::new();
            for (k, v) in m {
                if let Ok(x) = tidepool_api::resources::parse_milli(&v.0) {
                    r.add_one(k, x);
                }
            }
            r
        };
        Self {
            reserve: quantities(&spec.reserve),
            watermark_percent: spec.watermark_percent.unwrap_or(100).clamp(1, 100),
            hpa_percent: spec.hpa_headroom_percent.unwrap_or(100),
            windows: spec
                .windows
                .iter()
                .filter_map(|w| {
                    Some(Window {
                        name: w.name.clone(),
                        schedule: tidepool_api::cron::Schedule::parse_in(&w.schedule, w.time_zone.as_deref()).ok()?,
                        duration: jiff::SignedDuration::from_mins(i64::from(w.duration_minutes)),
                        lead: jiff::SignedDuration::from_secs(i64::from(w.lead_seconds)),
                        reserve: quantities(&w.reserve),
                    })
                })
                .collect(),
        }
    }
}

/// What an online HPA may still grow by.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HpaView {
    pub max_replicas: i32,
    pub current_replicas: i32,
    /// Requests of one replica (the target's pod template).
    pub per_replica: Resources,
    pub node_selector: BTreeMap<String, String>,
    /// The template's tolerations (see [`PodView::tolerations`]).
    pub tolerations: Vec<PoolToleration>,
}

/// Replicas an online Deployment or StatefulSet asks for whose pods do not exist yet: its
/// controller is about to create them, and they count like pending online pods from the
/// moment the workload is scaled, not from their creation (a ReplicaSet creates a scale-up's
/// pods in batches, over a few hundred milliseconds).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplicasToCome {
    pub replicas: i32,
    /// Requests of one replica (the workload's pod template).
    pub per_replica: Resources,
    pub node_selector: BTreeMap<String, String>,
    /// The template's tolerations (see [`PodView::tolerations`]).
    pub tolerations: Vec<PoolToleration>,
}

/// Everything besides nodes and pods that decides a pool's capacity at `now`.
#[derive(Debug, Clone, Copy)]
pub struct OnlineDemand<'a> {
    pub policy: &'a CapacityPolicy,
    pub hpas: &'a [HpaView],
    pub to_come: &'a [ReplicasToCome],
    pub now: jiff::Timestamp,
}

impl PoolCapacity {
    /// What offload pods use beyond what the pool may lend, per resource (zero when none):
    /// the amount reclaim has to free.
    pub fn deficit(&self) -> Resources {
        let mut d = self.used.clone();
        d.sub(&self.capacity);
        d.clamp_non_negative();
        d
    }
}

/// A change of a pool's capacity smaller than this (per resource, in hundredths of a percent
/// of the published value) waits for [`PUBLISH_MAX_INTERVAL`] before it is published.
pub const PUBLISH_THRESHOLD_BASIS_POINTS: i64 = 100;
/// Longest a small change of capacity waits before it is published anyway.
pub const PUBLISH_MAX_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether `next` differs from the published `current` enough to publish it at once, rather
/// than within [`PUBLISH_MAX_INTERVAL`]. Pure.
///
/// At once: anything tidepool's own decisions rest on — offload usage and placements, node
/// count, GPU product, a new or changed deficit (reclaim), any change of a resource counted
/// in whole devices (GPUs and other extended resources), on the pool or on a node. Held back:
/// drifts of cpu, memory, storage and pod counts below the threshold, which online churn
/// causes all the time and which would otherwise rewrite the virtual node on every event.
pub fn worth_publishing(current: &PoolCapacity, next: &PoolCapacity) -> bool {
    fn fungible(name: &str) -> bool {
        matches!(name, "cpu" | "memory" | "ephemeral-storage" | "pods") || name.starts_with("hugepages-")
    }
    fn significant(a: &Resources, b: &Resources) -> bool {
        a.names().chain(b.names()).any(|name| {
            let (x, y) = (a.get(name), b.get(name));
            if x == y {
                return false;
            }
            if !fungible(name) || x == 0 || y == 0 {
                return true;
            }
            let delta = i128::from(x.abs_diff(y));
            delta * 10_000 > i128::from(x.abs()) * i128::from(PUBLISH_THRESHOLD_BASIS_POINTS)
        })
    }
    if current.used != next.used
        || current.placed != next.placed
        || current.nodes != next.nodes
        || current.gpu_product != next.gpu_product
        || current.deficit() != next.deficit()
        || current.free_per_node.len() != next.free_per_node.len()
        || current.topology != next.topology
    {
        return true;
    }
    let devices =
        |r: &Resources| r.iter().filter(|(n, _)| !fungible(n)).map(|(n, v)| (n.to_owned(), v)).collect::<Vec<_>>();
    let moved =
        |a: &NodeFree, b: &NodeFree| a.name != b.name || a.labels != b.labels || devices(&a.free) != devices(&b.free);
    if current.free_per_node.iter().zip(&next.free_per_node).any(|(a, b)| moved(a, b)) {
        return true;
    }
    significant(&current.capacity, &next.capacity)
}

pub use tidepool_api::node_match::GPU_PRODUCT_LABEL;
/// The extended resource name of NVIDIA GPUs. Only one device resource among others (see
/// [`tidepool_api::resources::is_device`]): everything ranks by all of them alike.
pub const GPU: &str = "nvidia.com/gpu";

/// The devices a node has free in all, for ordering nodes: most devices first.
pub fn devices_of(r: &Resources) -> i64 {
    r.iter().filter(|(n, _)| tidepool_api::resources::is_device(n)).map(|(_, v)| v.max(0)).fold(0, i64::saturating_add)
}

impl PoolCapacity {
    /// Records the pool's topology `keys` and each node's values of them, looked up with
    /// `node` by name (the nodes the capacity was computed from).
    pub fn label_topology<'a>(&mut self, keys: &[String], node: impl Fn(&str) -> Option<&'a NodeView>) {
        self.topology = keys.to_vec();
        if keys.is_empty() {
            return;
        }
        for n in &mut self.free_per_node {
            let Some(view) = node(&n.name) else { continue };
            for k in keys {
                if let Some(v) = view.labels.get(k) {
                    n.labels.insert(k.clone(), v.clone());
                }
            }
        }
    }
}

impl NodeView {
    pub fn from_node(node: &Node) -> Self {
        let status = node.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let allocatable = status
            .and_then(|s| s.allocatable.as_ref())
            .map(|a| {
                // One malformed quantity must not hide the whole node: skip just that entry.
                let mut r = Resources::new();
                for (k, v) in a {
                    if let Ok(m) = tidepool_api::resources::parse_milli(&v.0) {
                        r.add_one(k, m);
                    }
                }
                r
            })
            .unwrap_or_default();
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            ready,
            unschedulable: node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
            allocatable,
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
                .map(|t| HardTaint { key: t.key.clone(), value: t.value.clone(), effect: t.effect.clone() })
                .collect(),
            pod_cidrs: crate::pod_network::node_cidrs(node),
        }
    }

    /// Whether pods carrying `tolerations` may be placed here as far as taints go: the
    /// member's scheduler would keep a copy off a node with any hard taint it does not
    /// tolerate, so such a node lends nothing to the pool.
    pub fn tolerated_by(&self, tolerations: &[PoolToleration]) -> bool {
        self.taints.iter().all(|t| tolerations.iter().any(|tol| tol.tolerates(&t.key, t.value.as_deref(), &t.effect)))
    }

    pub fn matches(&self, selector: &BTreeMap<String, String>) -> bool {
        selector.iter().all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

impl PodView {
    pub fn from_pod(pod: &Pod) -> Self {
        let origin_uid =
            pod.metadata.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_UID)).map(|u| u.as_str().into());
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).map(Box::from);
        // Only a pending online pod's selector is ever read (which pools it could land in).
        let (node_selector, tolerations) = match (&node, &origin_uid) {
            (None, None) => (
                pod.spec.as_ref().and_then(|s| s.node_selector.clone()).unwrap_or_default(),
                pod.spec.as_ref().map(tolerations_of).unwrap_or_default(),
            ),
            _ => (BTreeMap::new(), Vec::new()),
        };
        let online = origin_uid.is_none();
        Self {
            node,
            requests: pod.spec.as_ref().map(pod_requests).unwrap_or_default(),
            terminated: matches!(phase, Some("Succeeded" | "Failed")),
            offload: origin_uid.is_some(),
            uid: if online { None } else { pod.metadata.uid.as_deref().map(Arc::from) },
            origin_uid,
            priority: pod.spec.as_ref().and_then(|s| s.priority),
            online: OnlineParts::boxed(node_selector, tolerations, if online { workload_of(pod) } else { None }),
        }
    }
}

/// The Deployment or StatefulSet whose controller owns `pod`. A Deployment's pods are owned
/// by one of its ReplicaSets, named after it and the template hash the pods carry as a label.
fn workload_of(pod: &Pod) -> Option<(&'static str, Box<str>)> {
    let owner = pod.metadata.owner_references.as_ref()?.iter().find(|o| o.controller == Some(true))?;
    match owner.kind.as_str() {
        "StatefulSet" => Some(("StatefulSet", owner.name.as_str().into())),
        "ReplicaSet" => {
            let hash = pod.metadata.labels.as_ref()?.get("pod-template-hash")?;
            let name = owner.name.strip_suffix(hash.as_str())?.strip_suffix('-')?;
            Some(("Deployment", name.into()))
        }
        _ => None,
    }
}

pub use tidepool_api::pod::pod_requests;

/// A pod spec's tolerations as the capacity model matches them against node taints
/// (`tolerationSeconds` does not matter for where a pod may land).
pub fn tolerations_of(spec: &k8s_openapi::api::core::v1::PodSpec) -> Vec<PoolToleration> {
    spec.tolerations
        .iter()
        .flatten()
        .map(|t| PoolToleration {
            key: t.key.clone(),
            operator: t.operator.clone(),
            value: t.value.clone(),
            effect: t.effect.clone(),
        })
        .collect()
}

/// The plain surplus of a pool (no reserves, windows or HPAs): `Σ allocatable − Σ online`.
pub fn pool_capacity<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
) -> PoolCapacity {
    let policy = CapacityPolicy::default();
    let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
    pool_capacity_under(nodes, pods, selector, &demand)
}

/// `resources` as a pool of `colocation` counts them (see [`pool_capacity_in`]).
pub(crate) fn counted<'r>(colocation: Option<&Colocation>, resources: &'r Resources) -> Cow<'r, Resources> {
    match colocation {
        Some(c) => Cow::Owned(c.as_plain(resources)),
        None => Cow::Borrowed(resources),
    }
}

/// What the pool holds back before any pod is counted: the reserve, the open windows, the HPA
/// headroom and the replicas yet to come of the workloads whose pods `could_land` in the pool,
/// a replica's requests as the pool's `colocation` system counts them ([`counted`]).
pub(crate) fn announced(
    demand: &OnlineDemand<'_>,
    could_land: &impl Fn(&BTreeMap<String, String>, &[PoolToleration]) -> bool,
    colocation: Option<&Colocation>,
) -> Resources {
    let mut held_back = demand.policy.reserve.clone();
    for w in &demand.policy.windows {
        if w.schedule.window_active(demand.now, w.duration, w.lead) {
            held_back.add(&w.reserve);
        }
    }
    for h in demand.hpas.iter().filter(|h| could_land(&h.node_selector, &h.tolerations)) {
        let growth = i64::from((h.max_replicas - h.current_replicas).max(0));
        for (k, v) in counted(colocation, &h.per_replica).iter() {
            let amount = v.saturating_mul(growth).saturating_mul(i64::from(demand.policy.hpa_percent)) / 100;
            held_back.add_one(k, amount);
        }
    }
    for w in demand.to_come.iter().filter(|w| could_land(&w.node_selector, &w.tolerations)) {
        for (k, v) in counted(colocation, &w.per_replica).iter() {
            held_back.add_one(k, v.saturating_mul(i64::from(w.replicas.max(0))));
        }
    }
    held_back
}

/// Capacity of the pool selected by `selector` (an empty selector takes every node):
///
/// ```text
/// capacity(P) = clamp≥0( Σ_n (allocatable(n) − online(n))
///                        − reserve − windows(now) − hpaHeadroom(P) − pendingOnline(P) ) × watermark
/// ```
/// `pendingOnline` is the online pods not yet placed and the replicas whose pods are yet to
/// be created ([`ReplicasToCome`]). HPA headroom and pending online demand count for a pool
/// when their node selector matches one of its nodes: that is where the member's scheduler
/// could put them.
pub fn pool_capacity_under<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
    demand: &OnlineDemand<'_>,
) -> PoolCapacity {
    pool_capacity_in(nodes, pods, selector, demand, PoolMode::Requests)
}

/// The pool's nodes that take pods (ready, schedulable, matching its selector, publishing the
/// mode's resources), by name, with what each lends under the mode.
pub(crate) fn pool_nodes<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    selector: &BTreeMap<String, String>,
    colocation: Option<&Colocation>,
) -> InPool<'a> {
    let mut in_pool = BTreeMap::new();
    for n in nodes {
        let advertised = colocation.is_none_or(|c| c.advertised_on(&n.allocatable));
        if n.ready && !n.unschedulable && n.matches(selector) && advertised {
            in_pool.insert(n.name.as_str(), (n, counted(colocation, &n.allocatable)));
        }
    }
    in_pool
}

/// What a pool lends of `capacity` (`Σ allocatable − Σ online`): `held_back` taken out,
/// clamped at zero, `watermark_percent` of the rest.
pub(crate) fn lendable(mut capacity: Resources, held_back: &Resources, watermark_percent: u32) -> Resources {
    capacity.sub(held_back);
    capacity.clamp_non_negative();
    apply_watermark(&mut capacity, watermark_percent);
    capacity
}

/// Lends `percent` of each resource of `capacity` (the watermark); 100 lends all of it.
fn apply_watermark(capacity: &mut Resources, percent: u32) {
    if percent >= 100 {
        return;
    }
    let names: Vec<String> = capacity.names().map(str::to_owned).collect();
    for k in names {
        let v = capacity.get(&k);
        capacity.set(&k, v / 100 * i64::from(percent));
    }
}

/// Each node's free resources as the planner reads them, with its GPU model, the nodes
/// with the most devices (then cpu) free first.
fn node_records<'a>(free: BTreeMap<&str, Resources>, view: impl Fn(&str) -> Option<&'a NodeView>) -> Vec<NodeFree> {
    let mut records: Vec<NodeFree> = free
        .into_iter()
        .map(|(name, mut f)| {
            f.clamp_non_negative();
            let mut n = NodeFree::new(name, f);
            if let Some(product) = view(name).and_then(|v| v.labels.get(GPU_PRODUCT_LABEL)) {
                n.labels.insert(GPU_PRODUCT_LABEL.to_owned(), product.clone());
            }
            n
        })
        .collect();
    records.sort_by_cached_key(|r| planner_order(&r.name, &r.free));
    records
}

/// A planner record's place in [`PoolCapacity::free_per_node`] ([`planner_order`]).
pub(crate) type PlannerOrder = (std::cmp::Reverse<i64>, std::cmp::Reverse<i64>, String);

/// A planner record's place in [`PoolCapacity::free_per_node`]: most devices free first, then
/// most cpu, then by name.
pub(crate) fn planner_order(name: &str, free: &Resources) -> PlannerOrder {
    use std::cmp::Reverse;
    (Reverse(devices_of(free)), Reverse(free.get("cpu")), name.to_owned())
}

/// [`pool_capacity_under`] for a pool of resource `mode`. In a colocation mode a node's
/// allocatable is what the member's agent publishes for batch work, shown as `cpu` and
/// `memory` ([`Colocation::as_plain`]), and a pod uses of it what it requests of the batch
/// resources: the agent has already taken online pods' usage out, so their ordinary
/// requests do not count again. A node without the batch resources (no agent publishing
/// there) lends nothing. GPUs and every other resource stay request-based.
///
/// Walks every pod: the reference the member sessions' incremental model
/// ([`crate::pool_model::PoolModel`]) must equal.
pub fn pool_capacity_in<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
    demand: &OnlineDemand<'_>,
    mode: PoolMode,
) -> PoolCapacity {
    let colocation = mode.colocation();
    let in_pool = pool_nodes(nodes, selector, colocation);
    let could_land =
        |sel: &BTreeMap<String, String>, tolerations: &[PoolToleration]| could_land(&in_pool, sel, tolerations);
    let mut sums = PoolSums::of(&in_pool, announced(demand, &could_land, colocation));
    for p in pods {
        let requests = counted(colocation, &p.requests);
        if p.pending_online() && could_land(p.node_selector(), p.tolerations()) {
            sums.held_back.add(&requests);
        }
        let Some(node) = p.node.as_deref() else { continue };
        if p.terminated || !in_pool.contains_key(node) {
            continue;
        }
        if p.offload {
            sums.used.add(&requests);
            if let Some(uid) = &p.origin_uid {
                sums.placed.insert(uid.clone(), Placed { node: node.into(), copy_uid: p.uid.clone() });
            }
        } else {
            sums.capacity.sub(&requests);
        }
        if let Some(f) = sums.free.get_mut(node) {
            f.sub(&requests);
        }
    }
    sums.finish(&in_pool, demand.policy.watermark_percent)
}

/// The nodes of a pool by name, with what each lends under the pool's mode ([`pool_nodes`]).
pub(crate) type InPool<'a> = BTreeMap<&'a str, (&'a NodeView, Cow<'a, Resources>)>;

/// Whether pods with `selector` and `tolerations` could land on a node of the pool: where
/// pending online demand and HPA headroom count.
pub(crate) fn could_land(
    in_pool: &InPool<'_>,
    selector: &BTreeMap<String, String>,
    tolerations: &[PoolToleration],
) -> bool {
    in_pool.values().any(|(n, _)| n.matches(selector) && n.tolerated_by(tolerations))
}

/// A pool's sums while its pods are counted in, before the policy's last steps.
pub(crate) struct PoolSums<'a> {
    /// `Σ allocatable − Σ online`, so far.
    pub capacity: Resources,
    pub used: Resources,
    pub placed: BTreeMap<Arc<str>, Placed>,
    /// Per node: `allocatable − online − offload`, so far.
    pub free: BTreeMap<&'a str, Resources>,
    pub held_back: Resources,
}

impl<'a> PoolSums<'a> {
    /// Before any pod: the nodes' allocatable, and `held_back` from the policy.
    pub fn of(in_pool: &InPool<'a>, held_back: Resources) -> Self {
        let mut capacity = Resources::new();
        for (_, allocatable) in in_pool.values() {
            capacity.add(allocatable);
        }
        let free = in_pool.iter().map(|(k, (_, allocatable))| (*k, allocatable.clone().into_owned())).collect();
        Self { capacity, used: Resources::new(), placed: BTreeMap::new(), free, held_back }
    }

    /// The pool's capacity: what is held back taken out, clamped, the watermark applied, the
    /// per-node records and the GPU model added.
    pub fn finish(self, in_pool: &InPool<'a>, watermark_percent: u32) -> PoolCapacity {
        let Self { capacity, used, placed, free, held_back } = self;
        let capacity = lendable(capacity, &held_back, watermark_percent);
        let products: std::collections::BTreeSet<Option<&String>> =
            in_pool.values().map(|(n, _)| n.labels.get(GPU_PRODUCT_LABEL)).collect();
        let gpu_product = match products.len() {
            1 => products.into_iter().next().flatten().cloned(),
            _ => None,
        };
        PoolCapacity {
            capacity,
            used,
            nodes: in_pool.len() as u32,
            gpu_product,
            free_per_node: node_records(free, |name| in_pool.get(name).map(|(v, _)| *v)),
            topology: Vec::new(),
            placed: std::sync::Arc::new(placed),
            held_back,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn node(name: &str, alloc: &[(&str, &str)]) -> NodeView {
        NodeView {
            name: name.into(),
            ready: true,
            allocatable: Resources::from_pairs(alloc.iter().copied()).unwrap(),
            ..Default::default()
        }
    }

    #[test]
    fn online_demand_counts_for_a_dedicated_pool_only_if_it_tolerates_the_taint() {
        let mut dedicated = node("dedicated", &[("cpu", "8")]);
        dedicated.taints = vec![HardTaint { key: "lend".into(), value: None, effect: "NoSchedule".into() }];
        let lend = PoolToleration { key: Some("lend".into()), operator: Some("Exists".into()), ..Default::default() };
        let pending = |tolerations: Vec<PoolToleration>| PodView {
            requests: Resources::from_pairs([("cpu", "3")]).unwrap(),
            online: OnlineParts::boxed(BTreeMap::new(), tolerations, None),
            ..Default::default()
        };
        let pool: Vec<&NodeView> =
            [&dedicated].into_iter().filter(|n| n.tolerated_by(std::slice::from_ref(&lend))).collect();
        let hpa = |tolerations: Vec<PoolToleration>| HpaView {
            max_replicas: 2,
            current_replicas: 1,
            per_replica: Resources::from_pairs([("cpu", "2")]).unwrap(),
            tolerations,
            ..Default::default()
        };
        let capacity = |pods: &[PodView], hpas: &[HpaView]| {
            let policy = CapacityPolicy { hpa_percent: 100, ..Default::default() };
            let demand = OnlineDemand { policy: &policy, hpas, to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
            pool_capacity_under(pool.iter().copied(), pods, &BTreeMap::new(), &demand).capacity
        };
        let cpu = |n: &str| Resources::from_pairs([("cpu", n)]).unwrap();
        // Neither the pending pod nor the HPA's replicas could go there: all 8 CPUs lend.
        assert_eq!(capacity(&[pending(vec![])], &[hpa(vec![])]), cpu("8"));
        // Tolerating the taint, they could: 3 pending and 2 of headroom are held back.
        assert_eq!(capacity(&[pending(vec![lend.clone()])], &[hpa(vec![lend.clone()])]), cpu("3"));
    }

    #[test]
    fn a_tainted_node_lends_only_to_a_pool_whose_copies_tolerate_its_taints() {
        let mut dedicated = node("dedicated", &[("cpu", "8")]);
        dedicated.taints =
            vec![HardTaint { key: "lend".into(), value: Some("yes".into()), effect: "NoSchedule".into() }];
        let nodes = [node("plain", &[("cpu", "4")]), dedicated];
        let untolerated: Vec<&NodeView> = nodes.iter().filter(|n| n.tolerated_by(&[])).collect();
        assert_eq!(
            pool_capacity(untolerated, [], &BTreeMap::new()).capacity,
            Resources::from_pairs([("cpu", "4")]).unwrap()
        );
        let lend = PoolToleration {
            key: Some("lend".into()),
            value: Some("yes".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        };
        let tolerated: Vec<&NodeView> = nodes.iter().filter(|n| n.tolerated_by(std::slice::from_ref(&lend))).collect();
        assert_eq!(
            pool_capacity(tolerated, [], &BTreeMap::new()).capacity,
            Resources::from_pairs([("cpu", "12")]).unwrap()
        );
    }

    fn pod(node: &str, req: &[(&str, &str)]) -> PodView {
        PodView {
            node: Some(node.into()),
            requests: Resources::from_pairs(req.iter().copied()).unwrap(),
            ..Default::default()
        }
    }

    fn r(pairs: &[(&str, &str)]) -> Resources {
        Resources::from_pairs(pairs.iter().copied()).unwrap()
    }

    #[test]
    fn a_koordinator_pool_lends_the_batch_allocatable_minus_what_batch_pods_request_there() {
        // Two nodes of 16 cores. a: the agent lends 10 cores and 30 Gi, 14 cores of online
        // requests (already out of the batch amount), 2 of another batch pod, 3 of an
        // offload copy, 1 GPU online of 4. b: no agent publishes there, so it lends nothing.
        let mut a = node("a", &[("cpu", "16"), ("memory", "64Gi"), ("nvidia.com/gpu", "4")]);
        a.allocatable.add(&r(&[("kubernetes.io/batch-cpu", "10000"), ("kubernetes.io/batch-memory", "30Gi")]));
        let b = node("b", &[("cpu", "16"), ("memory", "64Gi")]);
        let mut copy = pod("a", &[("kubernetes.io/batch-cpu", "3000"), ("kubernetes.io/batch-memory", "4Gi")]);
        copy.offload = true;
        copy.origin_uid = Some("u".into());
        let pods = [
            pod("a", &[("cpu", "14"), ("memory", "40Gi"), ("nvidia.com/gpu", "1")]),
            pod("a", &[("kubernetes.io/batch-cpu", "2000"), ("kubernetes.io/batch-memory", "6Gi")]),
            copy,
            pod("b", &[("kubernetes.io/batch-cpu", "1000")]),
        ];
        let policy = CapacityPolicy { reserve: r(&[("cpu", "1")]), ..Default::default() };
        let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
        let c = pool_capacity_in(&[a, b], &pods, &BTreeMap::new(), &demand, PoolMode::KoordinatorBatch);
        // 10 − 2 (other batch) − 1 (reserve) = 7 cores; 30 − 6 = 24 Gi; 4 − 1 GPUs.
        assert_eq!(c.capacity, r(&[("cpu", "7"), ("memory", "24Gi"), ("nvidia.com/gpu", "3")]));
        assert_eq!(c.used, r(&[("cpu", "3"), ("memory", "4Gi")]));
        assert_eq!(c.nodes, 1);
        // Free on a: 10 − 2 − 3 cores, 30 − 6 − 4 Gi, 3 GPUs.
        assert_eq!(
            c.free_per_node.iter().map(|n| n.free.clone()).collect::<Vec<_>>(),
            vec![r(&[("cpu", "5"), ("memory", "20Gi"), ("nvidia.com/gpu", "3")])]
        );
        // The same nodes in requests mode: 16 − 14 + 16 cores, the batch names untouched.
        let plain =
            pool_capacity_in(&[node("a", &[("cpu", "16")])], &pods[..1], &BTreeMap::new(), &demand, PoolMode::Requests);
        assert_eq!(plain.capacity.get("cpu"), 1000);
    }

    #[test]
    fn a_katalyst_pool_shrinks_with_the_reclaimed_allocatable_into_a_deficit() {
        let with = |reclaimed: &str| {
            let mut n = node("n", &[("cpu", "32")]);
            n.allocatable.add(&r(&[("resource.katalyst.kubewharf.io/reclaimed_millicpu", reclaimed)]));
            n
        };
        let mut copy = pod("n", &[("resource.katalyst.kubewharf.io/reclaimed_millicpu", "6k")]);
        copy.offload = true;
        let capacity = |n: NodeView| {
            let policy = CapacityPolicy::default();
            let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
            pool_capacity_in(&[n], std::slice::from_ref(&copy), &BTreeMap::new(), &demand, PoolMode::KatalystReclaimed)
        };
        assert_eq!(capacity(with("8k")).deficit(), r(&[("cpu", "0")]));
        // Online usage rose: the agent reclaims only 4 cores now, 2 of the copy's 6 are owed.
        assert_eq!(capacity(with("4k")).deficit(), r(&[("cpu", "2")]));
    }

    #[test]
    fn surplus_is_allocatable_minus_online_requests() {
        let nodes = [node("a", &[("cpu", "8"), ("nvidia.com/gpu", "8")]), node("b", &[("cpu", "8")])];
        let pods = [pod("a", &[("cpu", "3"), ("nvidia.com/gpu", "2")]), pod("b", &[("cpu", "500m")])];
        let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
        assert_eq!(c.capacity, r(&[("cpu", "12500m"), ("nvidia.com/gpu", "6")]));
        assert_eq!(c.nodes, 2);
    }

    #[test]
    fn nodes_that_are_not_ready_or_cordoned_lend_nothing() {
        let mut sick = node("sick", &[("cpu", "8")]);
        sick.ready = false;
        let mut cordoned = node("cordoned", &[("cpu", "8")]);
        cordoned.unschedulable = true;
        let nodes = [sick, cordoned, node("ok", &[("cpu", "2")])];
        let pods = [pod("sick", &[("cpu", "1")])];
        let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
        assert_eq!(c.capacity, r(&[("cpu", "2")]));
        assert_eq!(c.nodes, 1);
    }

    #[test]
    fn offload_pods_count_as_used_not_as_online() {
        let nodes = [node("a", &[("cpu", "8")])];
        let mut offload = pod("a", &[("cpu", "2")]);
        offload.offload = true;
        let c = pool_capacity(&nodes, &[offload], &BTreeMap::new());
        assert_eq!(c.capacity, r(&[("cpu", "8")]));
        assert_eq!(c.used, r(&[("cpu", "2")]));
    }

    #[test]
    fn finished_and_pending_pods_hold_nothing_on_a_node() {
        let nodes = [node("a", &[("cpu", "8")])];
        let mut done = pod("a", &[("cpu", "4")]);
        done.terminated = true;
        // A pending offload pod is not online demand (pending online pods are, see below).
        let pending = PodView { node: None, requests: r(&[("cpu", "4")]), offload: true, ..Default::default() };
        let c = pool_capacity(&nodes, &[done, pending], &BTreeMap::new());
        assert_eq!(c.capacity, r(&[("cpu", "8")]));
    }

    #[test]
    fn the_selector_picks_the_pool_and_a_homogeneous_gpu_model_is_reported() {
        let mut g1 = node("g1", &[("nvidia.com/gpu", "8")]);
        g1.labels.insert("pool".into(), "gpu".into());
        g1.labels.insert(GPU_PRODUCT_LABEL.into(), "H100".into());
        let mut g2 = g1.clone();
        g2.name = "g2".into();
        let c1 = node("c1", &[("cpu", "32")]);
        let selector = BTreeMap::from([("pool".to_string(), "gpu".to_string())]);
        let c = pool_capacity(&[g1, g2, c1], &[], &selector);
        assert_eq!(c.capacity, r(&[("nvidia.com/gpu", "16")]));
        assert_eq!(c.gpu_product.as_deref(), Some("H100"));
    }

    #[test]
    fn each_node_record_has_its_name_and_only_the_topology_and_gpu_model_labels() {
        let labelled = |name: &str, rack: &str, gpus: &str| {
            let mut n = node(name, &[("nvidia.com/gpu", gpus)]);
            n.labels.insert("example.com/rack".into(), rack.into());
            n.labels.insert("topology.kubernetes.io/zone".into(), "z1".into());
            n.labels.insert("kubernetes.io/hostname".into(), name.into());
            n.labels.insert(GPU_PRODUCT_LABEL.into(), "H100".into());
            n
        };
        let nodes = [labelled("a", "r1", "4"), labelled("b", "r2", "8"), node("c", &[("amd.com/gpu", "2")])];
        let mut c = pool_capacity(&nodes, &[], &BTreeMap::new());
        let keys = vec!["topology.kubernetes.io/zone".to_owned(), "example.com/rack".to_owned()];
        c.label_topology(&keys, |name| nodes.iter().find(|n| n.name == name));
        assert_eq!(c.topology, keys);
        // Most devices first, whatever their vendor: b (8), a (4), c (2 AMD GPUs).
        let names: Vec<&str> = c.free_per_node.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["b", "a", "c"]);
        let want = BTreeMap::from([
            ("example.com/rack".to_owned(), "r2".to_owned()),
            ("topology.kubernetes.io/zone".to_owned(), "z1".to_owned()),
            (GPU_PRODUCT_LABEL.to_owned(), "H100".to_owned()),
        ]);
        assert_eq!(c.free_per_node[0].labels, want, "no hostname: only what the planner reads");
        assert!(c.free_per_node[2].labels.is_empty());
    }

    #[test]
    fn free_capacity_is_kept_per_node_with_offload_pods_subtracted() {
        let nodes = [node("a", &[("nvidia.com/gpu", "8")]), node("b", &[("nvidia.com/gpu", "8")])];
        let mut offload = pod("a", &[("nvidia.com/gpu", "6")]);
        offload.offload = true;
        let online = pod("b", &[("nvidia.com/gpu", "1")]);
        let c = pool_capacity(&nodes, &[offload, online], &BTreeMap::new());
        let gpus: Vec<i64> = c.free_per_node.iter().map(|f| f.free.get(GPU)).collect();
        assert_eq!(gpus, [7000, 2000]);
        assert_eq!(c.capacity.get(GPU), 15_000);
    }

    #[test]
    fn the_deficit_is_what_offload_pods_use_beyond_the_capacity() {
        let nodes = [node("a", &[("cpu", "8"), ("nvidia.com/gpu", "8")])];
        let mut offload = pod("a", &[("cpu", "2"), ("nvidia.com/gpu", "6")]);
        offload.offload = true;
        offload.origin_uid = Some("u1".into());
        let online = pod("a", &[("cpu", "1"), ("nvidia.com/gpu", "4")]);
        let c = pool_capacity(&nodes, &[offload, online], &BTreeMap::new());
        // capacity: 8−4 = 4 GPUs, 7 cpu; used: 6 GPUs, 2 cpu → deficit 2 GPUs, no cpu.
        assert_eq!(c.deficit(), r(&[("cpu", "0"), ("nvidia.com/gpu", "2")]));
        assert_eq!(c.placed.get("u1").map(|p| &*p.node), Some("a"));
    }

    fn policy(reserve: &[(&str, &str)], watermark: u32) -> CapacityPolicy {
        CapacityPolicy { reserve: r(reserve), watermark_percent: watermark, ..Default::default() }
    }

    fn under(
        nodes: &[NodeView],
        pods: &[PodView],
        policy: &CapacityPolicy,
        hpas: &[HpaView],
        now: &str,
    ) -> PoolCapacity {
        let demand = OnlineDemand { policy, hpas, to_come: &[], now: now.parse().unwrap() };
        pool_capacity_under(nodes, pods, &BTreeMap::new(), &demand)
    }

    #[test]
    fn the_reserve_is_held_back_and_the_watermark_applies_to_the_rest() {
        let nodes = [node("a", &[("cpu", "100"), ("nvidia.com/gpu", "8")])];
        let c = under(&nodes, &[], &policy(&[("cpu", "20"), ("nvidia.com/gpu", "2")], 50), &[], "2026-11-30T12:00:00Z");
        assert_eq!(c.capacity, r(&[("cpu", "40"), ("nvidia.com/gpu", "3")]));
        assert_eq!(c.held_back, r(&[("cpu", "20"), ("nvidia.com/gpu", "2")]));
    }

    #[test]
    fn a_window_reserves_from_its_start_to_its_end_only() {
        let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
        let mut p = policy(&[], 100);
        p.windows.push(Window {
            name: "evening".into(),
            schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
            duration: jiff::SignedDuration::from_hours(2),
            lead: jiff::SignedDuration::ZERO,
            reserve: r(&[("nvidia.com/gpu", "6")]),
        });
        let gpus = |now: &str| under(&nodes, &[], &p, &[], now).capacity.get(GPU);
        assert_eq!(gpus("2026-11-30T17:59:59Z"), 8000);
        assert_eq!(gpus("2026-11-30T18:00:00Z"), 2000);
        assert_eq!(gpus("2026-11-30T19:59:59Z"), 2000);
        assert_eq!(gpus("2026-11-30T20:00:00Z"), 8000);
    }

    /// The lead brings the reservation forward to the second, not to a minute boundary (cron
    /// has minute granularity; the lead does not), and not a second earlier.
    #[test]
    fn a_window_reserves_from_exactly_its_lead_time_before_the_start() {
        let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
        let mut p = policy(&[], 100);
        p.windows.push(Window {
            name: "evening".into(),
            schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
            duration: jiff::SignedDuration::from_mins(30),
            lead: jiff::SignedDuration::from_secs(75),
            reserve: r(&[("nvidia.com/gpu", "6")]),
        });
        let gpus = |now: &str| under(&nodes, &[], &p, &[], now).capacity.get(GPU);
        assert_eq!(gpus("2026-11-30T17:58:44Z"), 8000, "one second before the lead");
        assert_eq!(gpus("2026-11-30T17:58:44.999Z"), 8000, "a moment before the lead");
        assert_eq!(gpus("2026-11-30T17:58:45Z"), 2000, "at the lead");
        assert_eq!(gpus("2026-11-30T17:59:30Z"), 2000, "between the lead and the start");
        assert_eq!(gpus("2026-11-30T18:29:59Z"), 2000, "just before the end");
        assert_eq!(gpus("2026-11-30T18:30:00Z"), 8000, "at the end");
    }

    #[test]
    fn hpa_headroom_is_growth_times_replica_requests_times_factor() {
        let nodes = [node("a", &[("cpu", "64")])];
        let hpa =
            HpaView { max_replicas: 10, current_replicas: 4, per_replica: r(&[("cpu", "2")]), ..Default::default() };
        let mut p = policy(&[], 100);
        p.hpa_percent = 50;
        // (10 − 4) × 2 cpu × 50% = 6 cpu.
        assert_eq!(
            under(&nodes, &[], &p, std::slice::from_ref(&hpa), "2026-11-30T12:00:00Z").capacity.get("cpu"),
            58_000
        );
        // An HPA whose pods cannot land in the pool holds nothing back there.
        let elsewhere = HpaView { node_selector: BTreeMap::from([("pool".into(), "cpu".into())]), ..hpa };
        assert_eq!(under(&nodes, &[], &p, &[elsewhere], "2026-11-30T12:00:00Z").capacity.get("cpu"), 64_000);
    }

    #[test]
    fn replicas_yet_to_come_are_held_back_in_full_where_they_could_land() {
        let nodes = [node("a", &[("nvidia.com/gpu", "16")])];
        let policy = CapacityPolicy { hpa_percent: 50, ..Default::default() };
        let to_come = [
            ReplicasToCome { replicas: 4, per_replica: r(&[("nvidia.com/gpu", "2")]), ..Default::default() },
            ReplicasToCome {
                replicas: 3,
                per_replica: r(&[("nvidia.com/gpu", "1")]),
                node_selector: BTreeMap::from([("pool".into(), "cpu".into())]),
                ..Default::default()
            },
        ];
        let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &to_come, now: jiff::Timestamp::UNIX_EPOCH };
        let c = pool_capacity_under(&nodes, &[], &BTreeMap::new(), &demand);
        // 16 − 4 × 2: in full, not scaled by the HPA factor (they are asked for); the
        // replicas that could not land here hold nothing back.
        assert_eq!(c.capacity.get(GPU), 8000);
        assert_eq!(c.held_back.get(GPU), 8000);
    }

    #[test]
    fn a_member_pod_view_is_small_and_an_offload_pod_boxes_no_online_parts() {
        // One view per member pod, in a table of thousands: the online-only parts are boxed.
        assert!(std::mem::size_of::<PodView>() <= 96, "PodView is {} bytes", std::mem::size_of::<PodView>());
        let copy: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "uid": "copy", "labels": {keys::LABEL_ORIGIN_UID: "origin"}},
            "spec": {"nodeName": "n1", "nodeSelector": {"pool": "gpu"}, "containers": []},
        }))
        .unwrap();
        let view = PodView::from_pod(&copy);
        assert!(view.online.is_none() && view.node_selector().is_empty());
        let pending: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "lend", "operator": "Exists"}], "containers": []},
        }))
        .unwrap();
        let view = PodView::from_pod(&pending);
        assert_eq!(view.node_selector(), &BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]));
        assert_eq!(view.tolerations().len(), 1);
    }

    #[test]
    fn a_pod_names_its_deployment_through_its_replica_set_or_its_stateful_set() {
        let pod = |kind: &str, owner: &str, hash: Option<&str>| -> Pod {
            let mut p: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind,
                             "name": owner, "uid": "u", "controller": true}]},
            }))
            .unwrap();
            if let Some(h) = hash {
                p.metadata.labels = Some(BTreeMap::from([("pod-template-hash".to_owned(), h.to_owned())]));
            }
            p
        };
        let of = |p: &Pod| PodView::from_pod(p).workload().map(|(k, n)| (k, n.to_string()));
        assert_eq!(of(&pod("ReplicaSet", "web-6b9f7c", Some("6b9f7c"))), Some(("Deployment", "web".into())));
        assert_eq!(of(&pod("StatefulSet", "db", None)), Some(("StatefulSet", "db".into())));
        // A ReplicaSet of its own (no template hash of its name), or another controller.
        assert_eq!(of(&pod("ReplicaSet", "web", Some("6b9f7c"))), None);
        assert_eq!(of(&pod("ReplicaSet", "web-6b9f7c", None)), None);
        assert_eq!(of(&pod("Job", "batch", None)), None);
        // An offload copy is nobody's replica.
        let mut copy = pod("StatefulSet", "db", None);
        copy.metadata.labels = Some(BTreeMap::from([(keys::LABEL_ORIGIN_UID.to_owned(), "u1".to_owned())]));
        assert_eq!(of(&copy), None);
    }

    #[test]
    fn pending_online_pods_are_subtracted_at_once() {
        let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
        let pending = PodView { requests: r(&[("nvidia.com/gpu", "3")]), ..Default::default() };
        let mut pending_offload = pending.clone();
        pending_offload.offload = true;
        let c = under(&nodes, &[pending, pending_offload], &policy(&[], 100), &[], "2026-11-30T12:00:00Z");
        assert_eq!(c.capacity.get(GPU), 5000);
    }

    #[test]
    fn overcommitted_nodes_clamp_at_zero() {
        let nodes = [node("a", &[("cpu", "1")])];
        let pods = [pod("a", &[("cpu", "3")])];
        assert_eq!(pool_capacity(&nodes, &pods, &BTreeMap::new()).capacity.get("cpu"), 0);
    }

    #[test]
    fn requests_follow_the_scheduler_rules() {
        let spec: k8s_openapi::api::core::v1::PodSpec = serde_json::from_value(serde_json::json!({
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "1"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "2"}, "requests": {"cpu": "500m"}}}
            ],
            "initContainers": [
                {"name": "big-init", "resources": {"requests": {"cpu": "4"}}},
                {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"memory": "1Gi"}}}
            ],
            "overhead": {"cpu": "100m"}
        }))
        .unwrap();
        // containers: cpu 1.5, gpu 2; init max cpu 4; sidecar memory; overhead 100m; one pod.
        assert_eq!(
            pod_requests(&spec),
            r(&[("cpu", "4100m"), ("nvidia.com/gpu", "2"), ("memory", "1Gi"), ("pods", "1")])
        );
    }

    proptest! {
        #[test]
        fn capacity_is_never_negative_and_never_above_allocatable(
            allocs in proptest::collection::vec(0i64..64, 1..6),
            reqs in proptest::collection::vec((0usize..6, 0i64..80, any::<bool>(), any::<bool>()), 0..20),
        ) {
            let nodes: Vec<NodeView> = allocs.iter().enumerate()
                .map(|(i, a)| { let mut n = node(&format!("n{i}"), &[]); n.allocatable.set("cpu", a * 1000); n })
                .collect();
            let pods: Vec<PodView> = reqs.iter().map(|(n, cpu, offload, terminated)| {
                let mut p = pod(&format!("n{n}"), &[]);
                p.requests.set("cpu", cpu * 1000);
                p.offload = *offload;
                p.terminated = *terminated;
                p
            }).collect();
            let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
            let total: i64 = allocs.iter().sum::<i64>() * 1000;
            prop_assert!(c.capacity.get("cpu") >= 0);
            prop_assert!(c.capacity.get("cpu") <= total);
        }

        #[test]
        fn holding_back_more_never_lends_more(
            alloc in 0i64..256, reserve in 0i64..300, extra in 0i64..300, watermark in 1u32..=100,
        ) {
            let nodes = [{ let mut n = node("a", &[]); n.allocatable.set("cpu", alloc * 1000); n }];
            let lend = |res: i64| {
                let mut p = policy(&[], watermark);
                p.reserve.set("cpu", res * 1000);
                under(&nodes, &[], &p, &[], "2026-11-30T12:00:00Z").capacity.get("cpu")
            };
            let (a, b) = (lend(reserve), lend(reserve + extra));
            prop_assert!(b <= a);
            prop_assert!(b >= 0);
            prop_assert!(a <= alloc * 1000);
        }
    }

    // ---- model-based property: the capacity formula re-done on plain numbers ----

    /// The resources of the model. Cases are written in whole units; the model and the
    /// comparison work in milli-units, as the product does.
    const DIMS: [&str; 3] = [GPU, "cpu", "memory"];
    const M: i64 = 1000;

    /// A pool's nodes and pods as plain numbers: what the model computes from.
    #[derive(Debug, Clone)]
    struct Case {
        nodes: Vec<CaseNode>,
        pods: Vec<CasePod>,
        /// Whether the pool is the `pool=gpu` nodes (else every node).
        gpu_pool: bool,
        reserve: [i64; 3],
        watermark: u32,
        hpa_percent: u32,
        /// (max, current, selector, per replica)
        hpas: Vec<(i32, i32, Sel, [i64; 3])>,
        /// (replicas, selector, per replica)
        to_come: Vec<(i32, Sel, [i64; 3])>,
        /// A window firing daily at 18:00 UTC: (duration minutes, lead seconds, reserve).
        window: Option<(i64, i64, [i64; 3])>,
        /// Seconds after 2026-11-30T00:00:00Z.
        now: i64,
    }

    /// (ready, cordoned, label `pool=gpu` (else `pool=cpu`), GPU model 0/1/none, allocatable)
    type CaseNode = (bool, bool, bool, Option<u8>, [i64; 3]);
    /// (node index or pending, terminated, offload, selector, requests)
    type CasePod = (Option<usize>, bool, bool, Sel, [i64; 3]);

    /// A node selector of a pod, an HPA or a workload.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Sel {
        Any,
        Gpu,
        Cpu,
    }

    impl Sel {
        fn map(self) -> BTreeMap<String, String> {
            match self {
                Sel::Any => BTreeMap::new(),
                Sel::Gpu => BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]),
                Sel::Cpu => BTreeMap::from([("pool".to_owned(), "cpu".to_owned())]),
            }
        }

        /// Whether a node labelled `pool=gpu` (`gpu_label`) or `pool=cpu` matches.
        fn admits(self, gpu_label: bool) -> bool {
            match self {
                Sel::Any => true,
                Sel::Gpu => gpu_label,
                Sel::Cpu => !gpu_label,
            }
        }
    }

    const DAY0: i64 = 1_795_996_800; // 2026-11-30T00:00:00Z

    fn units(v: [i64; 3]) -> Resources {
        let mut r = Resources::new();
        for (name, x) in DIMS.iter().zip(v) {
            r.set(name, x * M);
        }
        r
    }

    /// What the model expects, per resource in milli-units.
    #[derive(Debug, PartialEq)]
    struct Expected {
        capacity: [i64; 3],
        used: [i64; 3],
        held_back: [i64; 3],
        nodes: u32,
        gpu_product: Option<String>,
        /// Sorted, largest first.
        free_per_node: Vec<[i64; 3]>,
        placed: BTreeMap<String, String>,
    }

    /// The capacity formula of the module docs, written out without any of the code above.
    fn model(c: &Case) -> Expected {
        let in_pool: Vec<usize> = (0..c.nodes.len())
            .filter(|&i| {
                let (ready, cordoned, gpu_label, _, _) = c.nodes[i];
                ready && !cordoned && (!c.gpu_pool || gpu_label)
            })
            .collect();
        let could_land = |s: Sel| in_pool.iter().any(|&i| s.admits(c.nodes[i].2));
        let mut surplus = [0i64; 3];
        let mut free: Vec<[i64; 3]> = Vec::new();
        let mut used = [0i64; 3];
        let mut placed = BTreeMap::new();
        for &i in &in_pool {
            let alloc = c.nodes[i].4.map(|x| x * M);
            let mut f = alloc;
            for (k, (node, terminated, offload, _, req)) in c.pods.iter().enumerate() {
                if *node != Some(i) || *terminated {
                    continue;
                }
                for d in 0..3 {
                    f[d] -= req[d] * M;
                    if *offload {
                        used[d] += req[d] * M;
                    } else {
                        surplus[d] -= req[d] * M;
                    }
                }
                if *offload {
                    placed.insert(format!("origin-{k}"), format!("n{i}"));
                }
            }
            for d in 0..3 {
                surplus[d] += alloc[d];
            }
            free.push(f.map(|x| x.max(0)));
        }
        let mut held = c.reserve.map(|x| x * M);
        if let Some((minutes, lead, reserve)) = c.window {
            // Firings at 18:00 of the day before, the day and the day after `now`'s day.
            let active = (-1..=2).any(|day| {
                let start = day * 86_400 + 18 * 3600;
                start - lead <= c.now && c.now < start + minutes * 60
            });
            if active {
                for d in 0..3 {
                    held[d] += reserve[d] * M;
                }
            }
        }
        for &(max, current, sel, per) in &c.hpas {
            if could_land(sel) {
                let growth = i64::from((max - current).max(0));
                for d in 0..3 {
                    held[d] += per[d] * M * growth * i64::from(c.hpa_percent) / 100;
                }
            }
        }
        for &(replicas, sel, per) in &c.to_come {
            if could_land(sel) {
                for d in 0..3 {
                    held[d] += per[d] * M * i64::from(replicas.max(0));
                }
            }
        }
        for (node, terminated, offload, sel, req) in &c.pods {
            if node.is_none() && !terminated && !offload && could_land(*sel) {
                for d in 0..3 {
                    held[d] += req[d] * M;
                }
            }
        }
        let capacity = std::array::from_fn(|d| (surplus[d] - held[d]).max(0) * i64::from(c.watermark) / 100);
        free.sort_by(|a, b| b.cmp(a));
        let models: BTreeSet<Option<u8>> = in_pool.iter().map(|&i| c.nodes[i].3).collect();
        let gpu_product = match models.iter().collect::<Vec<_>>()[..] {
            [Some(m)] => Some(format!("model-{m}")),
            _ => None,
        };
        Expected {
            capacity,
            used,
            held_back: held,
            nodes: in_pool.len() as u32,
            gpu_product,
            free_per_node: free,
            placed,
        }
    }

    /// The same case as views, through the function under test.
    fn product(c: &Case) -> Expected {
        let nodes: Vec<NodeView> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, (ready, cordoned, gpu_label, gpu_model, alloc))| {
                let mut labels =
                    BTreeMap::from([("pool".to_owned(), if *gpu_label { "gpu" } else { "cpu" }.to_owned())]);
                if let Some(m) = gpu_model {
                    labels.insert(GPU_PRODUCT_LABEL.to_owned(), format!("model-{m}"));
                }
                NodeView {
                    name: format!("n{i}"),
                    labels,
                    ready: *ready,
                    unschedulable: *cordoned,
                    allocatable: units(*alloc),
                    ..Default::default()
                }
            })
            .collect();
        let pods: Vec<PodView> = c
            .pods
            .iter()
            .enumerate()
            .map(|(k, (node, terminated, offload, sel, req))| PodView {
                node: node.map(|i| format!("n{i}").into()),
                requests: units(*req),
                terminated: *terminated,
                offload: *offload,
                origin_uid: offload.then(|| format!("origin-{k}").into()),
                uid: offload.then(|| format!("copy-{k}").into()),
                online: OnlineParts::boxed(sel.map(), Vec::new(), None),
                ..Default::default()
            })
            .collect();
        let mut policy = CapacityPolicy {
            reserve: units(c.reserve),
            watermark_percent: c.watermark,
            hpa_percent: c.hpa_percent,
            windows: vec![],
        };
        if let Some((minutes, lead, reserve)) = c.window {
            policy.windows.push(Window {
                name: "evening".into(),
                schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
                duration: jiff::SignedDuration::from_mins(minutes),
                lead: jiff::SignedDuration::from_secs(lead),
                reserve: units(reserve),
            });
        }
        let hpas: Vec<HpaView> = c
            .hpas
            .iter()
            .map(|(max, current, sel, per)| HpaView {
                max_replicas: *max,
                current_replicas: *current,
                per_replica: units(*per),
                node_selector: sel.map(),
                ..Default::default()
            })
            .collect();
        let to_come: Vec<ReplicasToCome> = c
            .to_come
            .iter()
            .map(|(replicas, sel, per)| ReplicasToCome {
                replicas: *replicas,
                per_replica: units(*per),
                node_selector: sel.map(),
                ..Default::default()
            })
            .collect();
        let now = jiff::Timestamp::from_second(DAY0 + c.now).unwrap();
        let demand = OnlineDemand { policy: &policy, hpas: &hpas, to_come: &to_come, now };
        let selector = if c.gpu_pool { Sel::Gpu.map() } else { BTreeMap::new() };
        let got = pool_capacity_under(&nodes, &pods, &selector, &demand);
        let whole = |r: &Resources| DIMS.map(|d| r.get(d));
        let mut free_per_node: Vec<[i64; 3]> = got.free_per_node.iter().map(|n| whole(&n.free)).collect();
        free_per_node.sort_by(|a, b| b.cmp(a));
        Expected {
            capacity: whole(&got.capacity),
            used: whole(&got.used),
            held_back: whole(&got.held_back),
            nodes: got.nodes,
            gpu_product: got.gpu_product.clone(),
            free_per_node,
            placed: got.placed.iter().map(|(uid, p)| (uid.to_string(), p.node.to_string())).collect(),
        }
    }

    fn arb_amounts(max: i64) -> impl Strategy<Value = [i64; 3]> {
        (0..=max, 0..=max, 0..=max).prop_map(|(a, b, c)| [a, b, c])
    }

    fn arb_sel() -> impl Strategy<Value = Sel> {
        prop_oneof![Just(Sel::Any), Just(Sel::Gpu), Just(Sel::Cpu)]
    }

    fn arb_case() -> impl Strategy<Value = Case> {
        let nodes = proptest::collection::vec(
            (
                prop::bool::weighted(0.85),
                prop::bool::weighted(0.15),
                any::<bool>(),
                proptest::option::of(0u8..2),
                arb_amounts(16),
            ),
            0..5,
        );
        let pods = proptest::collection::vec(
            (
                proptest::option::weighted(0.8, 0usize..6),
                prop::bool::weighted(0.2),
                any::<bool>(),
                arb_sel(),
                arb_amounts(6),
            ),
            0..10,
        );
        let hpas = proptest::collection::vec((0i32..8, 0i32..8, arb_sel(), arb_amounts(3)), 0..3);
        let to_come = proptest::collection::vec((-1i32..4, arb_sel(), arb_amounts(3)), 0..3);
        let window = proptest::option::of((1i64..240, 0i64..3600, arb_amounts(8)));
        (
            nodes,
            pods,
            any::<bool>(),
            arb_amounts(8),
            prop_oneof![Just(100u32), 1u32..=100],
            // Tens of percent, so every amount stays a multiple of 100 milli-units and the
            // watermark's rounding cannot differ between the model and the product.
            (0u32..=20).prop_map(|p| p * 10),
            hpas,
            to_come,
            window,
            0i64..(2 * 86_400),
        )
            .prop_map(
                |(nodes, pods, gpu_pool, reserve, watermark, hpa_percent, hpas, to_come, window, now)| Case {
                    nodes,
                    pods,
                    gpu_pool,
                    reserve,
                    watermark,
                    hpa_percent,
                    hpas,
                    to_come,
                    window,
                    now,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn the_capacity_of_any_pool_is_what_the_formula_gives_on_its_nodes_and_pods(c in arb_case()) {
            prop_assert_eq!(product(&c), model(&c));
        }
    }

    #[test]
    fn the_model_itself_is_not_trivially_zero() {
        // One node of 10 cpu with 3 cpu online, 2 cpu offload, 1 cpu reserved, 50 %:
        // capacity (10 − 3 − 1) × 50 % = 3, used 2, free on the node 10 − 3 − 2 = 5.
        let c = Case {
            nodes: vec![(true, false, true, Some(0), [0, 10, 0])],
            pods: vec![(Some(0), false, false, Sel::Any, [0, 3, 0]), (Some(0), false, true, Sel::Any, [0, 2, 0])],
            gpu_pool: false,
            reserve: [0, 1, 0],
            watermark: 50,
            hpa_percent: 100,
            hpas: vec![],
            to_come: vec![],
            window: None,
            now: 0,
        };
        let e = model(&c);
        assert_eq!(e.capacity, [0, 3000, 0]);
        assert_eq!(e.used, [0, 2000, 0]);
        assert_eq!(e.free_per_node, [[0, 5000, 0]]);
        assert_eq!(product(&c), e);
    }

    #[test]
    fn small_drifts_of_fungible_resources_wait_and_everything_else_goes_at_once() {
        let base = PoolCapacity {
            capacity: r(&[("cpu", "1000"), ("memory", "4000Gi"), ("nvidia.com/gpu", "16")]),
            used: r(&[("cpu", "10")]),
            nodes: 4,
            free_per_node: vec![NodeFree::new("n1", r(&[("cpu", "250"), ("nvidia.com/gpu", "4")]))],
            ..Default::default()
        };
        let with = |f: &dyn Fn(&mut PoolCapacity)| {
            let mut c = base.clone();
            f(&mut c);
            c
        };
        assert!(!worth_publishing(&base, &base));
        // Under 1 %: held back.
        assert!(!worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 999_000))));
        assert!(!worth_publishing(&base, &with(&|c| c.capacity.set("memory", c.capacity.get("memory") - 1))));
        assert!(!worth_publishing(&base, &with(&|c| c.free_per_node[0].free.set("cpu", 249_000))));
        // Over 1 %, or whole devices, or anything tidepool itself decided: at once.
        assert!(worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 989_000))));
        assert!(worth_publishing(&base, &with(&|c| c.capacity.set("nvidia.com/gpu", 15_000))));
        assert!(worth_publishing(&base, &with(&|c| c.free_per_node[0].free.set("nvidia.com/gpu", 3_000))));
        assert!(worth_publishing(&base, &with(&|c| c.used.set("cpu", 11_000))));
        assert!(worth_publishing(&base, &with(&|c| c.nodes = 3)));
        assert!(worth_publishing(
            &base,
            &with(&|c| {
                let placed = Placed { node: "n1".into(), copy_uid: Some("c1".into()) };
                std::sync::Arc::make_mut(&mut c.placed).insert("uid".into(), placed);
            })
        ));
        assert!(worth_publishing(&base, &with(&|c| c.capacity.set("example.com/fpga", 1_000))));
        // The planner's view of topology: a node relabelled to another rack, or new keys.
        assert!(worth_publishing(
            &base,
            &with(&|c| {
                c.free_per_node[0].labels.insert("example.com/rack".into(), "r2".into());
            })
        ));
        assert!(worth_publishing(&base, &with(&|c| c.topology = vec!["example.com/rack".into()])));
        assert!(worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 0))));
        // A small drift that opens a deficit goes at once: reclaim depends on it.
        let tight = with(&|c| {
            c.capacity.set("cpu", 1_000_000);
            c.used.set("cpu", 1_000_000);
        });
        let mut less = tight.clone();
        less.capacity.set("cpu", 999_000);
        assert!(worth_publishing(&tight, &less));
    }
}
