//! A pool's capacity kept node by node: what each member node of the pool adds to the pool's
//! sums is remembered ([`PoolModel`]), so a computation redoes only the nodes that changed
//! since the last one ([`Touched`], from the node watch and from [`PodIndex`]) and not every
//! node of the pool. [`super::reference::pool_capacity_in`] is the reference it equals (see the
//! property test in [`super::index`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tidepool_api::Resources;
use tidepool_api::crd::{PoolMode, PoolToleration};

use super::index::{PodIndex, Tally, Touched};
use super::{
    GPU_PRODUCT_LABEL, NodeFree, NodeView, OnlineDemand, Placed, PlannerOrder, PoolCapacity, announced, counted,
    lendable, planner_order,
};

/// What one member node of the pool adds to its sums, kept to take it out again.
#[derive(Debug)]
struct Member {
    allocatable: Resources,
    online: Resources,
    offload: Resources,
    order: PlannerOrder,
    product: Option<String>,
}

/// One pool's sums over its member nodes, changed node by node ([`PoolModel::update`]).
#[derive(Debug)]
pub struct PoolModel {
    selector: BTreeMap<String, String>,
    tolerations: Vec<PoolToleration>,
    mode: PoolMode,
    topology: Vec<String>,
    members: HashMap<String, Member>,
    /// The members' planner records, in planner order.
    records: BTreeMap<PlannerOrder, NodeFree>,
    allocatable: Tally,
    online: Tally,
    used: Tally,
    /// Members per value of [`GPU_PRODUCT_LABEL`] (`None`: unlabelled).
    products: BTreeMap<Option<String>, usize>,
}

impl PoolModel {
    /// An empty model of the pool spanning the nodes that match `selector` and whose taints
    /// `tolerations` tolerate, lending their resources of `mode`, labelled with `topology`.
    pub fn new(
        selector: BTreeMap<String, String>,
        tolerations: Vec<PoolToleration>,
        mode: PoolMode,
        topology: Vec<String>,
    ) -> Self {
        Self {
            selector,
            tolerations,
            mode,
            topology,
            members: HashMap::new(),
            records: BTreeMap::new(),
            allocatable: Tally::default(),
            online: Tally::default(),
            used: Tally::default(),
            products: BTreeMap::new(),
        }
    }

    /// The pool's selector, tolerations, mode and topology keys.
    #[cfg(test)]
    pub fn shape(&self) -> (&BTreeMap<String, String>, &[PoolToleration], PoolMode, &[String]) {
        (&self.selector, &self.tolerations, self.mode, &self.topology)
    }

    /// Brings the model up to date with the `touched` nodes; `nodes` holds every node view.
    pub fn catch_up(&mut self, touched: &Touched, nodes: &HashMap<String, NodeView>, index: &PodIndex) {
        if touched.is_all() {
            self.members.clear();
            self.records.clear();
            (self.allocatable, self.online, self.used) = Default::default();
            self.products.clear();
            for (name, view) in nodes {
                self.update(name, Some(view), index);
            }
            return;
        }
        for name in touched.names() {
            self.update(name, nodes.get(name), index);
        }
    }

    /// Whether the node is one of the pool's: ready, schedulable, matching the selector,
    /// tolerated, and publishing the mode's resources.
    fn takes(&self, n: &NodeView) -> bool {
        let advertised = self.mode.colocation().is_none_or(|c| c.advertised_on(&n.allocatable));
        n.ready && !n.unschedulable && n.matches(&self.selector) && n.tolerated_by(&self.tolerations) && advertised
    }

    /// Redoes node `name` (`view`: its view, `None` if gone) from its pods' sums in `index`.
    fn update(&mut self, name: &str, view: Option<&NodeView>, index: &PodIndex) {
        if let Some(old) = self.members.remove(name) {
            self.forget(old);
        }
        let Some(view) = view.filter(|v| self.takes(v)) else { return };
        let allocatable = counted(self.mode.colocation(), &view.allocatable).into_owned();
        let sums = index.node_sums(name, self.mode);
        let (online, offload) = sums.map(|s| (s.online.clone(), s.offload.clone())).unwrap_or_default();
        let mut free = allocatable.clone();
        free.sub(&online);
        free.sub(&offload);
        free.clamp_non_negative();
        let mut record = NodeFree::new(name, free);
        let product = view.labels.get(GPU_PRODUCT_LABEL).cloned();
        for key in self.topology.iter().map(String::as_str).chain(product.is_some().then_some(GPU_PRODUCT_LABEL)) {
            if let Some(v) = view.labels.get(key) {
                record.labels.insert(key.to_owned(), v.clone());
            }
        }
        let order = planner_order(name, &record.free);
        self.allocatable.add(&allocatable);
        self.online.add(&online);
        self.used.add(&offload);
        *self.products.entry(product.clone()).or_default() += 1;
        self.records.insert(order.clone(), record);
        self.members.insert(name.to_owned(), Member { allocatable, online, offload, order, product });
    }

    /// Takes a member's part out of the sums.
    fn forget(&mut self, old: Member) {
        self.allocatable.sub(&old.allocatable);
        self.online.sub(&old.online);
        self.used.sub(&old.offload);
        if let Some(n) = self.products.get_mut(&old.product) {
            *n -= 1;
            if *n == 0 {
                self.products.remove(&old.product);
            }
        }
        self.records.remove(&old.order);
    }

    /// Where the offload pods on the pool's nodes run. Built afresh for each computation, as
    /// a copy the model kept would be a second map of every offload pod whenever the published
    /// capacity still holds the first.
    fn placed(&self, index: &PodIndex) -> BTreeMap<Arc<str>, Placed> {
        let mut placed = BTreeMap::new();
        for name in self.members.keys() {
            let Some(sums) = index.node_sums(name, self.mode) else { continue };
            for (origin, copy_uid) in sums.placed {
                placed.insert(origin.clone(), Placed { node: sums.node.clone(), copy_uid: copy_uid.clone() });
            }
        }
        placed
    }

    /// The pool's capacity under `demand`, the pending online pods of `index` counted where
    /// they could land; `nodes` holds every node view.
    pub fn capacity(
        &self,
        demand: &OnlineDemand<'_>,
        nodes: &HashMap<String, NodeView>,
        index: &PodIndex,
    ) -> PoolCapacity {
        let colocation = self.mode.colocation();
        let could_land = |sel: &BTreeMap<String, String>, tolerations: &[PoolToleration]| {
            self.members.keys().any(|n| nodes.get(n).is_some_and(|v| v.matches(sel) && v.tolerated_by(tolerations)))
        };
        let mut held_back = announced(demand, &could_land, colocation);
        for p in index.pending().filter(|p| could_land(p.node_selector(), p.tolerations())) {
            held_back.add(&counted(colocation, &p.requests));
        }
        let mut capacity = self.allocatable.sum.clone();
        capacity.sub(&self.online.sum);
        let gpu_product = match self.products.len() {
            1 => self.products.keys().next().cloned().flatten(),
            _ => None,
        };
        PoolCapacity {
            capacity: lendable(capacity, &held_back, demand.policy.watermark_percent),
            used: self.used.sum.clone(),
            nodes: self.members.len() as u32,
            gpu_product,
            free_per_node: self.records.values().cloned().collect(),
            topology: self.topology.clone(),
            placed: Arc::new(self.placed(index)),
            held_back,
        }
    }
}
