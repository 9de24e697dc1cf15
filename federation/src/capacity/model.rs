//! A pool's capacity and the policy that shapes it: [`PoolCapacity`] (what a pool lends, what
//! tidepool uses of it, node by node), the online demand held back ([`announced`]: reserve,
//! windows, HPA headroom, replicas to come), and the last steps every computation shares
//! ([`PoolSums`]: the watermark, the per-node records in the planner's order).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use tidepool_api::Resources;
use tidepool_api::colocation::Colocation;
use tidepool_api::crd::PoolToleration;

use super::*;

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
