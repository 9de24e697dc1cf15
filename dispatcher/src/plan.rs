//! The placement planner: puts a whole gang on ONE pool, or says why it cannot.
//!
//! Pure and deterministic: plain data in, plain data out, no clock and no I/O, and the same
//! pools in any order give the same answer. The controller builds a [`PoolView`] per offered
//! pool (federation's [`PoolCapacity`] plus what it bound this round), calls [`place`] for a
//! new gang and [`fits_one`] for each elastic pod after it, and records the chosen virtual node
//! on the gang before binding anything, so a restart re-plans onto that pool only
//! ([`GangDemand::pinned`]) and never splits a gang.
//!
//! A pool takes a gang only when both hold:
//! - **per node**: every pod of the gang gets a member node with room for it, all at once,
//!   simulated on the pool's per-node free capacity. Never on the aggregate: sixteen nodes with
//!   one free GPU each add up to 16 GPUs and still cannot run one 8-GPU pod.
//! - **budget**: the gang's requests plus what offload pods already use stay within the pool's
//!   capacity (the virtual node's allocatable), so a placement never creates the deficit that
//!   reclaim would then have to undo.
//!
//! Inside the pool the gang is kept together ([`Placement::domain`]): on one GPU model when
//! it requests devices and one model can take it, and inside one domain of the finest level
//! of the pool's topology (`spec.pools[].topology`, coarse to fine) that fits it. When no
//! domain of any level fits, the gang is placed pool-wide rather than kept waiting: the
//! member's scheduler still puts it wherever it fits, and the Placed event says why it is
//! spread. The chosen domain travels with the copies as a required node affinity, each
//! pod's simulated node as a preferred one.
//!
//! The per-node simulation is best-fit decreasing (most devices first, then cpu, then
//! memory; each pod onto the node it leaves the least room on), against a fill-the-roomiest
//! packing that uses the fewest nodes (a PS beside its workers on one machine); the one on
//! fewer nodes wins. Greedy packing is exact for a gang of identical pods (the common case);
//! for a gang of unequal pods that greedy packing misses, a bounded exhaustive search
//! ([`SEARCH_BUDGET`]) looks for an assignment before the pool is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use tidepool_api::Resources;
use tidepool_api::node_match::{NodeConstraints, virtual_node_labels};
use tidepool_api::resources::{format_milli, is_device};
use tidepool_federation::PoolCapacity;
use tidepool_federation::capacity::{GPU_PRODUCT_LABEL, NodeFree};

use crate::gang::GangKey;

/// Node assignments the exhaustive search may try per pool before it gives up and the pool is
/// refused. Bounds the planner's worst case (a few milliseconds per pool) while staying exact
/// for small gangs on small pools, which is where greedy packing can miss.
pub const SEARCH_BUDGET: u32 = 10_000;

/// Resources compared right after the devices, in this order, wherever the planner ranks
/// pods, nodes or pools: devices (GPUs, MIG slices, any vendor's accelerator) are the scarce,
/// indivisible resources a training gang is placed for, and lead (see [`is_device`]).
const LEADING: [&str; 2] = ["cpu", "memory"];

/// What the planner needs to know of one offered pool (one virtual node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolView {
    /// Virtual node name; unique among the views passed to [`place`].
    pub node: String,
    pub member: String,
    pub pool: String,
    /// What the pool may lend in total.
    pub capacity: Resources,
    /// Requests of offload pods already running (or bound this round) in the pool.
    pub used: Resources,
    /// Free capacity per member node, with its name and topology labels, for the simulation.
    pub free_per_node: Vec<NodeFree>,
    /// The GPU model when every node of the pool has the same one.
    pub gpu_product: Option<String>,
    /// Topology label keys, coarse to fine.
    pub topology: Vec<String>,
    /// False while the member is paused or not ready: such a pool is never chosen.
    pub schedulable: bool,
}

impl PoolView {
    /// The view of a pool as federation reports it.
    pub fn from_capacity(
        node: impl Into<String>,
        member: impl Into<String>,
        pool: impl Into<String>,
        capacity: &PoolCapacity,
        schedulable: bool,
    ) -> Self {
        Self {
            node: node.into(),
            member: member.into(),
            pool: pool.into(),
            capacity: capacity.capacity.clone(),
            used: capacity.used.clone(),
            free_per_node: capacity.free_per_node.clone(),
            gpu_product: capacity.gpu_product.clone(),
            topology: capacity.topology.clone(),
            schedulable,
        }
    }

    /// Books pods onto this view as the planner placed them (`member_nodes[i]` is the index
    /// in `free_per_node` of pod `i`, as in [`Placement::per_pod_member_node`]), so later
    /// decisions of the same round see them before federation does. A pod whose index is out
    /// of range still counts against the budget.
    pub fn reserve(&mut self, pods: &[Resources], member_nodes: &[usize]) {
        for (i, pod) in pods.iter().enumerate() {
            if let Some(node) = member_nodes.get(i).and_then(|&n| self.free_per_node.get_mut(n)) {
                node.free.sub(pod);
            }
            self.used.add(pod);
        }
    }

    /// The labels of the pool's virtual node, which a pod's node selection is matched against.
    pub fn labels(&self) -> BTreeMap<String, String> {
        virtual_node_labels(&self.member, &self.pool, &self.node, self.gpu_product.as_deref())
    }

    /// The GPU model of a member node: its own label, else the pool's single model.
    fn product_of<'a>(&'a self, node: &'a NodeFree) -> Option<&'a str> {
        node.labels.get(GPU_PRODUCT_LABEL).or(self.gpu_product.as_ref()).map(String::as_str)
    }
}

/// A gang asking to be placed: the requests of its `minMember` core pods.
#[derive(Debug, Clone, PartialEq)]
pub struct GangDemand {
    pub key: GangKey,
    pub pods: Vec<Resources>,
    /// Virtual node already recorded for this gang: only that pool may be used, so a restart
    /// in the middle of binding never splits the gang across pools.
    pub pinned: Option<String>,
    /// The core pods' own node selection (selector, required affinity), each different one
    /// once: a pool is a candidate only when its virtual node satisfies all of them.
    pub constraints: Vec<NodeConstraints>,
}

/// The part of a pool a gang was planned into: node label pairs every node of it carries
/// (the pool's topology keys, coarse to fine, down to the level used; then the GPU model when
/// one was chosen in a pool mixing models). Empty: the whole pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Domain {
    pub pairs: Vec<(String, String)>,
}

impl Domain {
    /// Whether member node `node` lies inside the domain.
    pub fn contains(&self, node: &NodeFree) -> bool {
        self.pairs.iter().all(|(k, v)| node.labels.get(k) == Some(v))
    }

    /// `key=value,key=value`: the form of the `tidepool.io/planned-domain` annotation.
    pub fn to_annotation(&self) -> String {
        self.pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }

    /// Reads the annotation form back (see [`tidepool_api::keys::parse_planned_domain`]).
    pub fn parse(s: &str) -> Self {
        Self { pairs: tidepool_api::keys::parse_planned_domain(s) }
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// Where a gang goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Virtual node to bind every pod of the gang to.
    pub node: String,
    pub member: String,
    pub pool: String,
    /// For each pod of [`GangDemand::pods`], the index into the pool's `free_per_node` the
    /// simulation put it on: its planned node, which its copy prefers.
    pub per_pod_member_node: Vec<usize>,
    /// For each pod, the name of that member node.
    pub planned_nodes: Vec<String>,
    /// The domain the gang was kept in; its copies require it.
    pub domain: Domain,
    /// How the gang was kept together, for the Placed event: the level used, or why no
    /// domain fits and the gang is spread over the pool.
    pub note: Option<String>,
}

/// Why a gang cannot be placed now, in words a tenant can act on; the controller puts it on
/// the pods' `PodScheduled` condition and in an Event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Unplaceable {
    pub message: String,
}

impl Unplaceable {
    fn new(message: impl Into<String>) -> Self {
        Self { message: message.into() }
    }
}

/// Places the whole gang on one pool, or explains why no pool can take it.
///
/// Among the pools that fit, the choice is, in order: a pool where the gang gets one GPU
/// model when it requests devices (mixed models slow collective operations down to the
/// slowest card); a pool where it stays inside one topology domain; the tightest fit, i.e.
/// the least free capacity left on the member nodes the gang lands on (devices, then cpu,
/// then memory), so big holes stay whole for big pods; the least budget left in the pool;
/// and finally the virtual node name, so the answer never depends on input order.
pub fn place(gang: &GangDemand, pools: &[PoolView]) -> Result<Placement, Unplaceable> {
    place_within(gang, pools, None)
}

/// [`place`] pool-wide: no GPU model or topology domain is chosen inside a pool (the pools are
/// ranked as [`place`] ranks them). For the first lent pod of a gang whose core is on native
/// nodes: one pod needs no domain, and its gang's later lent pods join it anywhere in the pool.
pub fn place_pool_wide(gang: &GangDemand, pools: &[PoolView]) -> Result<Placement, Unplaceable> {
    place_within(gang, pools, Some(&Domain::default()))
}

fn place_within(gang: &GangDemand, pools: &[PoolView], within: Option<&Domain>) -> Result<Placement, Unplaceable> {
    if gang.pods.is_empty() {
        return Err(Unplaceable::new("the gang has no pods to place"));
    }
    let subject = match &gang.pinned {
        Some(node) => Subject::Pinned(node),
        None => Subject::Any,
    };
    let offered: Vec<&PoolView> =
        pools.iter().filter(|p| gang.pinned.as_ref().is_none_or(|node| &p.node == node)).collect();
    if let Subject::Pinned(node) = subject
        && offered.is_empty()
    {
        return Err(Unplaceable::new(format!("the gang's recorded pool {node} is not offered any more")));
    }
    let offered = selected_by(&gang.constraints, offered);
    if offered.is_empty() && !gang.constraints.is_empty() {
        let wanted: Vec<String> = gang.constraints.iter().map(NodeConstraints::describe).collect();
        return Err(Unplaceable::new(format!("no pool matches the pods' node selection ({})", wanted.join("; "))));
    }
    let candidates: Vec<&PoolView> = offered.into_iter().filter(|p| p.schedulable).collect();
    if candidates.is_empty() {
        return Err(Unplaceable::new(match subject {
            Subject::Pinned(node) => {
                format!("the gang's recorded pool {node} is not schedulable (member paused or not ready)")
            }
            Subject::Any => "no schedulable pool".to_owned(),
        }));
    }

    let demand = Demand::new(&gang.pods);
    let mut best: Option<(Fit, &PoolView)> = None;
    let mut refusals = Vec::new();
    for pool in candidates.iter().copied() {
        match demand.try_pool(pool, within) {
            Ok(fit) => {
                let better = best.as_ref().is_none_or(|(b, bp)| {
                    (&fit.score, &pool.node, &pool.member, &pool.pool) < (&b.score, &bp.node, &bp.member, &bp.pool)
                });
                if better {
                    best = Some((fit, pool));
                }
            }
            Err(refusal) => refusals.push((pool, refusal)),
        }
    }
    match best {
        Some((fit, pool)) => Ok(Placement {
            node: pool.node.clone(),
            member: pool.member.clone(),
            pool: pool.pool.clone(),
            planned_nodes: fit.assignment.iter().map(|&n| pool.free_per_node[n].name.clone()).collect(),
            per_pod_member_node: fit.assignment,
            domain: fit.domain,
            note: fit.note,
        }),
        None => Err(Unplaceable::new(demand.explain(subject, &candidates, &refusals))),
    }
}

/// The pools whose virtual node satisfies every one of `constraints`.
fn selected_by<'a>(constraints: &[NodeConstraints], pools: Vec<&'a PoolView>) -> Vec<&'a PoolView> {
    if constraints.is_empty() {
        return pools;
    }
    pools.into_iter().filter(|p| constraints.iter().all(|c| c.matches(&p.node, &p.labels()))).collect()
}

/// Whether one more (elastic) pod fits on `pool`, next to `already`: the pods planned onto
/// this pool in this round that `pool` does not show yet (gang cores included). All of them
/// are simulated together, per node and against the budget, exactly as [`place`] does, on
/// the nodes of `domain` only: an elastic pod joins its gang where the gang is.
pub fn fits_one(pod: &Resources, pool: &PoolView, already: &[Resources], domain: &Domain) -> bool {
    if !pool.schedulable {
        return false;
    }
    let mut pods = already.to_vec();
    pods.push(pod.clone());
    Demand::new(&pods).try_pool(pool, Some(domain)).is_ok()
}

/// Which pools a message speaks about.
#[derive(Debug, Clone, Copy)]
enum Subject<'a> {
    Any,
    Pinned(&'a str),
}

/// The gang in dense form: each pod as a vector over the resource names that matter to it,
/// so the inner loops of the simulation compare small arrays instead of maps.
struct Demand<'a> {
    /// The devices some pod requests (alphabetically), then `LEADING`, then every other name
    /// some pod requests, alphabetically.
    dims: Vec<&'a str>,
    /// How many of `dims` are devices.
    devices: usize,
    pods: Vec<Vec<i64>>,
    /// Pod indices, largest first: the decreasing order of best-fit decreasing.
    order: Vec<usize>,
    /// Per dimension, the gang's total request.
    total: Vec<i64>,
    /// Every pod requests the same: greedy packing is then exact.
    uniform: bool,
}

/// A successful simulation on one pool.
struct Fit {
    assignment: Vec<usize>,
    domain: Domain,
    note: Option<String>,
    score: Score,
}

/// Rank of a fitting pool; smaller is better (field order is the preference order).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Score {
    /// The gang requests devices and lands on more than one GPU model (or unknown ones).
    mixed_gpu: bool,
    /// The pool has a topology, and no domain of it fits the gang.
    spread: bool,
    /// Free capacity left, per dimension, on the member nodes the gang lands on (with the
    /// devices it does not request, in sum, right after the ones it does).
    left_on_touched_nodes: Vec<i64>,
    /// Capacity − used − gang, per dimension.
    budget_left: Vec<i64>,
}

/// Why one pool cannot take the gang.
#[derive(Debug)]
enum Refusal {
    /// The gang's total in dimension `dim` exceeds what the pool may still lend.
    Budget { dim: usize, left: i64 },
    /// The simulation found no assignment; greedy packing placed `placed` pods.
    Nodes { placed: usize },
}

/// Where in a pool the gang goes, before it is scored against other pools.
struct Chosen {
    packed: Packed,
    domain: Domain,
    note: Option<String>,
    spread: bool,
}

impl Chosen {
    /// Order among the GPU models of one pool: kept in a domain, the finer the better; then
    /// fewest nodes, tightest, and the domain's labels so the answer is deterministic.
    fn rank(&self) -> (bool, std::cmp::Reverse<usize>, usize, &[i64], &Domain) {
        let levels = self.domain.pairs.iter().filter(|(k, _)| k != GPU_PRODUCT_LABEL).count();
        (self.spread, std::cmp::Reverse(levels), self.packed.nodes_used, &self.packed.left, &self.domain)
    }
}

/// The name of a topology level for messages: the label key without its prefix
/// (`topology.kubernetes.io/zone` → `zone`).
fn level_name(key: &str) -> &str {
    key.rsplit_once('/').map_or(key, |(_, name)| name)
}

/// How many pods of size `pod` fit into `free` (a huge number when the pod requests nothing).
fn holds(pod: &[i64], free: &[i64]) -> i64 {
    pod.iter().zip(free).filter(|(r, _)| **r > 0).map(|(r, f)| f.max(&0) / r).min().unwrap_or(i64::MAX)
}

/// One way to pack the gang into a set of nodes: which node each pod goes on, and how many
/// nodes that touches.
struct Packed {
    assignment: Vec<usize>,
    nodes_used: usize,
    left: Vec<i64>,
}

impl<'a> Demand<'a> {
    fn new(pods: &'a [Resources]) -> Self {
        let mut devices = BTreeSet::new();
        let mut rest = BTreeSet::new();
        for pod in pods {
            for (name, amount) in pod.iter() {
                if amount > 0 && is_device(name) {
                    devices.insert(name);
                } else if amount > 0 && !LEADING.contains(&name) {
                    rest.insert(name);
                }
            }
        }
        let device_count = devices.len();
        let dims: Vec<&str> = devices.into_iter().chain(LEADING.iter().copied()).chain(rest).collect();
        let dense: Vec<Vec<i64>> = pods.iter().map(|p| dims.iter().map(|d| p.get(d).max(0)).collect()).collect();
        let mut order: Vec<usize> = (0..dense.len()).collect();
        order.sort_by(|&a, &b| dense[b].cmp(&dense[a]).then(a.cmp(&b)));
        let mut total = vec![0i64; dims.len()];
        for pod in &dense {
            add(&mut total, pod);
        }
        let uniform = dense.windows(2).all(|w| w[0] == w[1]);
        Self { dims, devices: device_count, pods: dense, order, total, uniform }
    }

    /// The free capacity of `nodes` in the demand's dimensions, one row per node.
    fn rows_of<'r>(&self, nodes: impl ExactSizeIterator<Item = &'r Resources>) -> Rows {
        let (width, len) = (self.dims.len(), nodes.len());
        let mut cells = Vec::with_capacity(width * len);
        for node in nodes {
            cells.extend(self.dims.iter().map(|d| node.get(d)));
        }
        Rows { width, len, cells }
    }

    fn free_of(&self, node: &Resources) -> Vec<i64> {
        self.dims.iter().map(|d| node.get(d)).collect()
    }

    fn wants_devices(&self) -> bool {
        self.total[..self.devices].iter().any(|t| *t > 0)
    }

    /// Simulates the gang on one pool: budget first (cheap), then per node, inside `within`
    /// when given (an elastic pod's gang domain), else inside the best domain that fits.
    fn try_pool(&self, pool: &PoolView, within: Option<&Domain>) -> Result<Fit, Refusal> {
        let budget_left: Vec<i64> = self
            .dims
            .iter()
            .zip(&self.total)
            .map(|(d, need)| pool.capacity.get(d).saturating_sub(pool.used.get(d)).saturating_sub(*need))
            .collect();
        if let Some(dim) = (0..self.dims.len()).find(|&i| self.total[i] > 0 && budget_left[i] < 0) {
            return Err(Refusal::Budget { dim, left: budget_left[dim].saturating_add(self.total[dim]) });
        }
        let nodes = self.rows_of(pool.free_per_node.iter().map(|n| &n.free));
        let mut budget = SEARCH_BUDGET;
        let chosen = match within {
            Some(domain) => {
                let members: Vec<usize> =
                    (0..nodes.len()).filter(|&n| domain.contains(&pool.free_per_node[n])).collect();
                let packed = self.pack_in(&nodes, &members, &mut budget)?;
                Chosen { packed, domain: domain.clone(), note: None, spread: false }
            }
            None => self.choose(pool, &nodes, &mut budget)?,
        };
        let touched: BTreeSet<usize> = chosen.packed.assignment.iter().copied().collect();
        let products: BTreeSet<Option<&str>> =
            touched.iter().map(|&n| pool.product_of(&pool.free_per_node[n])).collect();
        let mixed_gpu = self.wants_devices() && (products.len() != 1 || products.contains(&None));
        // Devices the gang does not request but would sit beside count right after the ones
        // it does: a cpu gang keeps off GPU nodes when it can.
        let idle_devices = touched
            .iter()
            .flat_map(|&n| pool.free_per_node[n].free.iter())
            .filter(|(name, _)| is_device(name) && !self.dims.contains(name))
            .map(|(_, v)| v.max(0))
            .fold(0i64, i64::saturating_add);
        let mut left_on_touched_nodes = chosen.packed.left;
        left_on_touched_nodes.insert(self.devices, idle_devices);
        Ok(Fit {
            assignment: chosen.packed.assignment,
            domain: chosen.domain,
            note: chosen.note,
            score: Score { mixed_gpu, spread: chosen.spread, left_on_touched_nodes, budget_left },
        })
    }

    /// Where in the pool the gang goes: one GPU model when it wants devices and one model
    /// takes it, and within that, the finest topology domain that fits (pool-wide when none
    /// does).
    fn choose(&self, pool: &PoolView, nodes: &Rows, budget: &mut u32) -> Result<Chosen, Refusal> {
        let all: Vec<usize> = (0..nodes.len()).collect();
        let mut models: BTreeMap<Option<&str>, Vec<usize>> = BTreeMap::new();
        for &n in &all {
            models.entry(pool.product_of(&pool.free_per_node[n])).or_default().push(n);
        }
        if self.wants_devices() && models.len() > 1 {
            // Known models first (a node without the label may be any model), then by name.
            let mut best: Option<Chosen> = None;
            for (model, members) in models.iter().filter(|(m, _)| m.is_some()) {
                let Ok(mut c) = self.in_topology(pool, nodes, members, budget) else { continue };
                if let Some(model) = model {
                    c.domain.pairs.push((GPU_PRODUCT_LABEL.to_owned(), (*model).to_owned()));
                }
                if best.as_ref().is_none_or(|b| c.rank() < b.rank()) {
                    best = Some(c);
                }
            }
            if let Some(best) = best {
                return Ok(best);
            }
        }
        self.in_topology(pool, nodes, &all, budget)
    }

    /// The finest level of the pool's topology at which one domain (of the nodes `members`)
    /// takes the gang, and the best such domain: fewest nodes, then tightest, then label
    /// values. Pool-wide (over `members`) when no domain of any level fits, with the reason.
    fn in_topology(
        &self,
        pool: &PoolView,
        nodes: &Rows,
        members: &[usize],
        budget: &mut u32,
    ) -> Result<Chosen, Refusal> {
        let mut why_not = Vec::new();
        for level in (0..pool.topology.len()).rev() {
            let keys = &pool.topology[..=level];
            let mut domains: BTreeMap<Vec<&str>, Vec<usize>> = BTreeMap::new();
            for &n in members {
                let labels = &pool.free_per_node[n].labels;
                let values: Option<Vec<&str>> = keys.iter().map(|k| labels.get(k).map(String::as_str)).collect();
                if let Some(values) = values {
                    domains.entry(values).or_default().push(n);
                }
            }
            let mut best: Option<(Packed, &Vec<&str>)> = None;
            for (values, in_domain) in &domains {
                if !self.sum_fits(nodes, in_domain) {
                    continue;
                }
                let Ok(packed) = self.pack_in(nodes, in_domain, budget) else { continue };
                if best.as_ref().is_none_or(|(b, _)| (packed.nodes_used, &packed.left) < (b.nodes_used, &b.left)) {
                    best = Some((packed, values));
                }
            }
            let name = level_name(&pool.topology[level]);
            if let Some((packed, values)) = best {
                let pairs: Vec<(String, String)> =
                    keys.iter().zip(values.iter()).map(|(k, v)| (k.clone(), (*v).to_owned())).collect();
                let domain = Domain { pairs };
                let note = format!("kept in one {name} ({})", domain.to_annotation());
                return Ok(Chosen { packed, domain, note: Some(note), spread: false });
            }
            why_not.push(self.level_refusal(name, nodes, domains.values()));
        }
        let packed = self.pack_in(nodes, members, budget)?;
        let note = (!why_not.is_empty()).then(|| format!("{}; placed across the pool", why_not.join("; ")));
        Ok(Chosen { packed, domain: Domain::default(), note, spread: !pool.topology.is_empty() })
    }

    /// Why no domain of one level takes the gang: the first resource no domain has enough
    /// of in sum ("no rack has 16 nvidia.com/gpu free; largest: 12"), else that none packs.
    fn level_refusal<'d>(&self, name: &str, nodes: &Rows, domains: impl Iterator<Item = &'d Vec<usize>>) -> String {
        let sums: Vec<Vec<i64>> = domains
            .map(|members| {
                let mut sum = vec![0i64; self.dims.len()];
                members.iter().for_each(|&n| add(&mut sum, &nodes[n].iter().map(|v| (*v).max(0)).collect::<Vec<_>>()));
                sum
            })
            .collect();
        for (d, dim) in self.dims.iter().enumerate() {
            let largest = sums.iter().map(|s| s[d]).max().unwrap_or(0);
            if self.total[d] > largest {
                return format!(
                    "no {name} has {} {dim} free; largest: {}",
                    amount(dim, self.total[d]),
                    amount(dim, largest)
                );
            }
        }
        format!("no {name} fits all {} pods together", self.pods.len())
    }

    /// Whether the nodes `members` have, in sum, what the gang needs: a cheap test before
    /// packing a domain.
    fn sum_fits(&self, nodes: &Rows, members: &[usize]) -> bool {
        (0..self.dims.len())
            .all(|d| self.total[d] <= 0 || members.iter().map(|&n| nodes[n][d].max(0)).sum::<i64>() >= self.total[d])
    }

    /// Packs the gang onto the nodes `members` (indices into `nodes`); the assignment is in
    /// indices into `nodes` too.
    fn pack_in(&self, nodes: &Rows, members: &[usize], budget: &mut u32) -> Result<Packed, Refusal> {
        let subset = nodes.select(members);
        let local = self.pack(&subset, budget)?;
        let mut after = subset;
        for (pod, &n) in local.iter().enumerate() {
            sub(&mut after[n], &self.pods[pod]);
        }
        let touched: BTreeSet<usize> = local.iter().copied().collect();
        let mut left = vec![0i64; self.dims.len()];
        for &n in &touched {
            add(&mut left, &after[n]);
        }
        let assignment = local.iter().map(|&n| members[n]).collect();
        Ok(Packed { assignment, nodes_used: touched.len(), left })
    }

    /// Best-fit decreasing and the fewest-nodes packing, the one on fewer nodes (best fit on
    /// a tie); then (for unequal pods) the bounded exhaustive search.
    fn pack(&self, nodes: &Rows, budget: &mut u32) -> Result<Vec<usize>, Refusal> {
        let tight = self.best_fit(nodes);
        let few = self.fewest_nodes(nodes);
        let count = |a: &[usize]| a.iter().collect::<BTreeSet<_>>().len();
        match (tight, few) {
            (Ok(t), Ok(f)) => Ok(if count(&f) < count(&t) { f } else { t }),
            (Ok(a), Err(_)) | (Err(_), Ok(a)) => Ok(a),
            (Err(placed), Err(_)) => {
                if self.uniform || !self.worth_searching(nodes) {
                    return Err(Refusal::Nodes { placed });
                }
                let mut free = nodes.clone();
                let mut assignment = vec![0usize; self.pods.len()];
                if self.search(0, &mut free, &mut assignment, budget) {
                    Ok(assignment)
                } else {
                    Err(Refusal::Nodes { placed })
                }
            }
        }
    }

    /// Fewest nodes: each pod (largest first) onto a node already in use with the least room
    /// that still fits, else onto the unused node that holds the most pods of its size (the
    /// roomiest on a tie). Exact for identical pods.
    fn fewest_nodes(&self, nodes: &Rows) -> Result<Vec<usize>, usize> {
        let mut free = nodes.clone();
        let mut used = vec![false; free.len()];
        let mut assignment = vec![0usize; self.pods.len()];
        for (placed, &p) in self.order.iter().enumerate() {
            let pod = &self.pods[p];
            let reuse = (0..free.len())
                .filter(|&n| used[n] && fits(pod, &free[n]))
                .min_by(|&a, &b| free[a].cmp(&free[b]).then(a.cmp(&b)));
            let open = || {
                (0..free.len())
                    .filter(|&n| !used[n] && fits(pod, &free[n]))
                    .max_by(|&a, &b| (holds(pod, &free[a]), &free[a], b).cmp(&(holds(pod, &free[b]), &free[b], a)))
            };
            let Some(n) = reuse.or_else(open) else { return Err(placed) };
            used[n] = true;
            sub(&mut free[n], pod);
            assignment[p] = n;
        }
        Ok(assignment)
    }

    /// Best-fit decreasing: each pod (largest first) onto the node it leaves the least room on.
    fn best_fit(&self, nodes: &Rows) -> Result<Vec<usize>, usize> {
        let mut free = nodes.clone();
        let mut assignment = vec![0usize; self.pods.len()];
        for (placed, &p) in self.order.iter().enumerate() {
            // The node with the least room that still fits leaves the least behind: the
            // comparison of `free` vectors is lexicographic, devices first.
            let best = (0..free.len())
                .filter(|&n| fits(&self.pods[p], &free[n]))
                .min_by(|&a, &b| free[a].cmp(&free[b]).then(a.cmp(&b)));
            let Some(n) = best else { return Err(placed) };
            sub(&mut free[n], &self.pods[p]);
            assignment[p] = n;
        }
        Ok(assignment)
    }
    /// Cheap necessary conditions, so hopeless pools never cost a search: every pod fits
    /// some node on its own, and the nodes' free capacity adds up to the gang's total.
    fn worth_searching(&self, nodes: &Rows) -> bool {
        let each_pod_fits_somewhere = self.pods.iter().all(|p| nodes.iter().any(|n| fits(p, n)));
        let sum_fits = (0..self.dims.len()).all(|d| nodes.iter().map(|n| n[d].max(0)).sum::<i64>() >= self.total[d]);
        each_pod_fits_somewhere && sum_fits
    }

    /// Depth-first search over pods in decreasing order. Nodes whose free capacity is
    /// currently identical are interchangeable, so only the first of them is tried.
    fn search(&self, depth: usize, free: &mut Rows, assignment: &mut [usize], budget: &mut u32) -> bool {
        let Some(&p) = self.order.get(depth) else { return true };
        let mut tried: Vec<usize> = Vec::new();
        for n in 0..free.len() {
            if !fits(&self.pods[p], &free[n]) || tried.iter().any(|&m| free[m] == free[n]) {
                continue;
            }
            if *budget == 0 {
                return false;
            }
            *budget -= 1;
            tried.push(n);
            sub(&mut free[n], &self.pods[p]);
            assignment[p] = n;
            if self.search(depth + 1, free, assignment, budget) {
                return true;
            }
            add(&mut free[n], &self.pods[p]);
        }
        false
    }

    /// The tenant-readable reason no candidate pool took the gang, most telling first: a pod
    /// too big for any single node, then a budget too small, then nodes too full in sum, and
    /// only then "does not pack", with each pool's own reason.
    fn explain(&self, subject: Subject<'_>, candidates: &[&PoolView], refusals: &[(&PoolView, Refusal)]) -> String {
        let nodes: Vec<Vec<i64>> =
            candidates.iter().flat_map(|p| p.free_per_node.iter()).map(|n| self.free_of(&n.free)).collect();
        for (d, name) in self.dims.iter().enumerate() {
            let need = self.pods.iter().map(|p| p[d]).max().unwrap_or(0);
            let largest = nodes.iter().map(|n| n[d].max(0)).max().unwrap_or(0);
            if need > largest {
                let (need, largest) = (amount(name, need), amount(name, largest));
                return match subject {
                    Subject::Any => {
                        format!("no pool fits {need} {name} on one node; largest free on one node: {largest}")
                    }
                    Subject::Pinned(node) => format!(
                        "the gang's recorded pool {node} does not fit {need} {name} on one node; \
                         largest free on one node: {largest}"
                    ),
                };
            }
        }
        if let Some(pod) = self.pods.iter().find(|p| !nodes.iter().any(|n| fits(p, n))) {
            let pod = self.describe(pod);
            return match subject {
                Subject::Any => format!("no pool has a node with room for a whole pod ({pod})"),
                Subject::Pinned(node) => {
                    format!("the gang's recorded pool {node} has no node with room for a whole pod ({pod})")
                }
            };
        }
        for (d, name) in self.dims.iter().enumerate() {
            let need = self.total[d];
            let left = candidates.iter().map(|p| p.capacity.get(name).saturating_sub(p.used.get(name))).max();
            let left = left.unwrap_or(0).max(0);
            if need > left {
                let (need, left) = (amount(name, need), amount(name, left));
                return match subject {
                    Subject::Any => format!("no pool has {need} {name} left for the gang (largest: {left})"),
                    Subject::Pinned(node) => {
                        format!("the gang's recorded pool {node} has {left} {name} left; the gang needs {need}")
                    }
                };
            }
        }
        for (d, name) in self.dims.iter().enumerate() {
            let need = self.total[d];
            let free =
                candidates.iter().map(|p| p.free_per_node.iter().map(|n| n.free.get(name).max(0)).sum::<i64>()).max();
            let free = free.unwrap_or(0);
            if need > free {
                let (need, free) = (amount(name, need), amount(name, free));
                return match subject {
                    Subject::Any => {
                        format!("no pool has {need} {name} free across its nodes for the gang (largest: {free})")
                    }
                    Subject::Pinned(node) => format!(
                        "the gang's recorded pool {node} has {free} {name} free across its nodes; the gang needs {need}"
                    ),
                };
            }
        }
        self.packing_reason(subject, refusals)
    }

    /// Each candidate pool's own reason for not packing the gang (the pods fit in sum).
    fn packing_reason(&self, subject: Subject<'_>, refusals: &[(&PoolView, Refusal)]) -> String {
        let n = self.pods.len();
        let mut reasons: Vec<(&str, String)> = refusals
            .iter()
            .map(|(pool, refusal)| {
                let why = match refusal {
                    Refusal::Budget { dim, left } => {
                        let name = self.dims[*dim];
                        format!(
                            "{} {name} left of {} needed",
                            amount(name, (*left).max(0)),
                            amount(name, self.total[*dim])
                        )
                    }
                    Refusal::Nodes { placed } => format!("only {placed} of {n} pods fit on its nodes"),
                };
                (pool.node.as_str(), why)
            })
            .collect();
        reasons.sort();
        match subject {
            Subject::Pinned(node) => {
                let why = reasons.first().map(|(_, why)| why.as_str()).unwrap_or("the pods do not pack");
                format!("the gang's recorded pool {node} cannot take all {n} pods together: {why}")
            }
            Subject::Any => {
                const SHOWN: usize = 4;
                let mut msg = format!("no pool fits all {n} pods together (");
                for (i, (node, why)) in reasons.iter().take(SHOWN).enumerate() {
                    let sep = if i == 0 { "" } else { "; " };
                    let _ = write!(msg, "{sep}{node}: {why}");
                }
                if reasons.len() > SHOWN {
                    let _ = write!(msg, "; and {} more", reasons.len() - SHOWN);
                }
                msg.push(')');
                msg
            }
        }
    }

    /// `nvidia.com/gpu=8, cpu=32, memory=256Gi`: a pod's requests as a tenant wrote them.
    fn describe(&self, pod: &[i64]) -> String {
        let parts: Vec<String> = self
            .dims
            .iter()
            .zip(pod)
            .filter(|(_, v)| **v > 0)
            .map(|(name, v)| format!("{name}={}", amount(name, *v)))
            .collect();
        parts.join(", ")
    }
}

/// Free capacity per node in a demand's dimensions: one row per node, all in one allocation
/// (the simulation copies them for every packing it tries, thousands of nodes per decision).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rows {
    width: usize,
    len: usize,
    cells: Vec<i64>,
}

impl Rows {
    fn len(&self) -> usize {
        self.len
    }

    fn iter(&self) -> impl Iterator<Item = &[i64]> {
        (0..self.len).map(|n| &self[n])
    }

    /// The rows `members`, in that order.
    fn select(&self, members: &[usize]) -> Rows {
        let mut cells = Vec::with_capacity(self.width * members.len());
        for &n in members {
            cells.extend_from_slice(&self[n]);
        }
        Rows { width: self.width, len: members.len(), cells }
    }
}

impl std::ops::Index<usize> for Rows {
    type Output = [i64];

    fn index(&self, n: usize) -> &[i64] {
        &self.cells[n * self.width..(n + 1) * self.width]
    }
}

impl std::ops::IndexMut<usize> for Rows {
    fn index_mut(&mut self, n: usize) -> &mut [i64] {
        &mut self.cells[n * self.width..(n + 1) * self.width]
    }
}

/// A request of zero (or less) always fits: a CPU pod does not need a free GPU.
fn fits(pod: &[i64], free: &[i64]) -> bool {
    pod.iter().zip(free).all(|(r, f)| *r <= 0 || r <= f)
}

fn sub(free: &mut [i64], pod: &[i64]) {
    for (f, r) in free.iter_mut().zip(pod) {
        *f = f.saturating_sub(*r);
    }
}

fn add(acc: &mut [i64], pod: &[i64]) {
    for (a, r) in acc.iter_mut().zip(pod) {
        *a = a.saturating_add(*r);
    }
}

/// An amount as a tenant reads it: `8`, `500m`, `64Gi`, `37.5Gi`.
fn amount(name: &str, milli: i64) -> String {
    let bytes_like = name == "memory" || name == "ephemeral-storage" || name.starts_with("hugepages-");
    if !bytes_like || milli % 1000 != 0 {
        return format_milli(milli);
    }
    let bytes = milli / 1000;
    const KI: i64 = 1 << 10;
    const MI: i64 = 1 << 20;
    const GI: i64 = 1 << 30;
    const TI: i64 = 1 << 40;
    // The largest unit that divides exactly, so the number is the one a tenant would write.
    for (unit, suffix) in [(TI, "Ti"), (GI, "Gi"), (MI, "Mi"), (KI, "Ki")] {
        if bytes != 0 && bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    if bytes >= GI {
        // One decimal, in integers: memory never goes through floats.
        let tenths = bytes / (GI / 10);
        return format!("{}.{}Gi", tenths / 10, tenths % 10);
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tidepool_federation::capacity::GPU;

    fn r(pairs: &[(&str, &str)]) -> Resources {
        Resources::from_pairs(pairs.iter().copied()).unwrap()
    }

    fn gpus(n: i64) -> Resources {
        let mut res = Resources::new();
        res.set(GPU, n * 1000);
        res
    }

    /// A schedulable pool with a homogeneous GPU model whose budget is exactly the sum of its
    /// nodes' free capacity.
    fn pool(node: &str, free: Vec<Resources>) -> PoolView {
        let mut capacity = Resources::new();
        for n in &free {
            capacity.add(n);
        }
        PoolView {
            node: node.into(),
            member: format!("m-{node}"),
            pool: "default".into(),
            capacity,
            used: Resources::new(),
            free_per_node: named(free),
            gpu_product: Some("H100".into()),
            topology: Vec::new(),
            schedulable: true,
        }
    }

    /// Member nodes `n0`, `n1`, … with these free resources and no labels.
    fn named(free: Vec<Resources>) -> Vec<NodeFree> {
        free.into_iter().enumerate().map(|(i, f)| NodeFree::new(format!("n{i}"), f)).collect()
    }

    /// What is free on each node of `pool`.
    fn frees(pool: &PoolView) -> Vec<Resources> {
        pool.free_per_node.iter().map(|n| n.free.clone()).collect()
    }

    fn gang(pods: Vec<Resources>) -> GangDemand {
        GangDemand { key: GangKey::annotation("ns", "job"), pods, pinned: None, constraints: vec![] }
    }

    #[test]
    fn an_8_gpu_pod_is_refused_on_a_pool_whose_free_gpus_are_spread_over_nodes() {
        let spread = pool("tidepool-a", (0..16).map(|_| gpus(1)).collect());
        let err = place(&gang(vec![gpus(8)]), &[spread]).unwrap_err();
        assert_eq!(err.message, "no pool fits 8 nvidia.com/gpu on one node; largest free on one node: 1");
    }

    #[test]
    fn the_largest_free_node_is_named_across_all_pools() {
        let a = pool("tidepool-a", vec![gpus(4), gpus(4), gpus(4)]);
        let b = pool("tidepool-b", vec![gpus(2); 8]);
        let err = place(&gang(vec![gpus(8)]), &[a, b]).unwrap_err();
        assert_eq!(err.message, "no pool fits 8 nvidia.com/gpu on one node; largest free on one node: 4");
    }

    #[test]
    fn a_gang_that_fits_only_across_two_pools_is_not_split() {
        let a = pool("tidepool-a", vec![gpus(8)]);
        let b = pool("tidepool-b", vec![gpus(8)]);
        let err = place(&gang(vec![gpus(8), gpus(8)]), &[a, b]).unwrap_err();
        assert_eq!(err.message, "no pool has 16 nvidia.com/gpu left for the gang (largest: 8)");
    }

    #[test]
    fn a_gang_that_fits_whole_is_placed_with_every_pod_on_a_node() {
        let a = pool("tidepool-a", vec![gpus(8), gpus(4), gpus(4)]);
        let p = place(&gang(vec![gpus(4), gpus(8), gpus(4)]), &[a]).unwrap();
        assert_eq!(p.node, "tidepool-a");
        assert_eq!(p.member, "m-tidepool-a");
        assert_eq!(p.per_pod_member_node, [1, 0, 2]);
    }

    #[test]
    fn largest_pods_are_placed_first() {
        // In submission order, first fit would put the 4-GPU pod on the 8-GPU node and
        // strand the 8-GPU pod; decreasing order places it first.
        let a = pool("tidepool-a", vec![gpus(8), gpus(4)]);
        let p = place(&gang(vec![gpus(4), gpus(8)]), &[a]).unwrap();
        assert_eq!(p.per_pod_member_node, [1, 0]);
    }

    #[test]
    fn a_gang_greedy_packing_misses_is_still_found_by_the_search() {
        // Best fit puts the GPU pod on node 0 (fewer free GPUs) and leaves no node with 4 cpu;
        // the only assignment is the GPU pod on node 1 and the cpu pod on node 0.
        let n0 = r(&[(GPU, "1"), ("cpu", "4")]);
        let n1 = r(&[(GPU, "2"), ("cpu", "1")]);
        let a = pool("tidepool-a", vec![n0, n1]);
        let pods = vec![r(&[(GPU, "1"), ("cpu", "1")]), r(&[("cpu", "4")])];
        let p = place(&gang(pods), &[a]).unwrap();
        assert_eq!(p.per_pod_member_node, [1, 0]);
    }

    #[test]
    fn the_pool_the_gang_fills_most_tightly_wins() {
        let roomy = pool("tidepool-a", vec![gpus(8), gpus(8)]);
        let tight = pool("tidepool-b", vec![gpus(4), gpus(8)]);
        let p = place(&gang(vec![gpus(2), gpus(2)]), &[roomy, tight]).unwrap();
        assert_eq!(p.node, "tidepool-b");
        assert_eq!(p.per_pod_member_node, [0, 0]);
    }

    #[test]
    fn a_gpu_gang_prefers_a_pool_with_one_gpu_model() {
        let mut mixed = pool("tidepool-a", vec![gpus(2)]);
        mixed.gpu_product = None;
        let homogeneous = pool("tidepool-b", vec![gpus(8)]);
        let p = place(&gang(vec![gpus(2)]), &[mixed, homogeneous]).unwrap();
        assert_eq!(p.node, "tidepool-b");
    }

    #[test]
    fn a_cpu_gang_ignores_gpu_models_and_avoids_gpu_nodes() {
        let mut cpu_only = pool("tidepool-b", vec![r(&[("cpu", "32")])]);
        cpu_only.gpu_product = None;
        let gpu_pool = pool("tidepool-a", vec![r(&[("cpu", "32"), (GPU, "8")])]);
        let p = place(&gang(vec![r(&[("cpu", "8")])]), &[gpu_pool, cpu_only]).unwrap();
        assert_eq!(p.node, "tidepool-b");
    }

    #[test]
    fn equal_pools_are_chosen_by_virtual_node_name() {
        let a = pool("tidepool-b", vec![gpus(8)]);
        let b = pool("tidepool-a", vec![gpus(8)]);
        assert_eq!(place(&gang(vec![gpus(1)]), &[a.clone(), b.clone()]).unwrap().node, "tidepool-a");
        assert_eq!(place(&gang(vec![gpus(1)]), &[b, a]).unwrap().node, "tidepool-a");
    }

    #[test]
    fn the_budget_refuses_a_gang_whose_nodes_have_room() {
        let mut a = pool("tidepool-a", vec![r(&[("cpu", "64")]), r(&[("cpu", "64")])]);
        a.capacity = r(&[("cpu", "48")]);
        a.used = r(&[("cpu", "16")]);
        let err = place(&gang(vec![r(&[("cpu", "32")]), r(&[("cpu", "32")])]), &[a]).unwrap_err();
        assert_eq!(err.message, "no pool has 64 cpu left for the gang (largest: 32)");
    }

    #[test]
    fn memory_is_explained_in_binary_units() {
        let a = pool("tidepool-a", vec![r(&[("memory", "48Gi")])]);
        let err = place(&gang(vec![r(&[("memory", "64Gi")])]), &[a]).unwrap_err();
        assert_eq!(err.message, "no pool fits 64Gi memory on one node; largest free on one node: 48Gi");
    }

    #[test]
    fn a_pod_too_big_in_combination_is_explained() {
        // 8 GPUs on one node and 64 cpu on another, but never both on one node.
        let a = pool("tidepool-a", vec![r(&[(GPU, "8"), ("cpu", "8")]), r(&[("cpu", "64")])]);
        let err = place(&gang(vec![r(&[(GPU, "8"), ("cpu", "32")])]), &[a]).unwrap_err();
        assert_eq!(err.message, "no pool has a node with room for a whole pod (nvidia.com/gpu=8, cpu=32)");
    }

    #[test]
    fn pods_that_do_not_pack_are_explained_per_pool() {
        // Each pool has 12 GPUs free and room for a 6-GPU pod, but not for two of them.
        let a = pool("tidepool-a", vec![gpus(6), gpus(3), gpus(3)]);
        let b = pool("tidepool-b", vec![gpus(6), gpus(5), gpus(1)]);
        let err = place(&gang(vec![gpus(6), gpus(6)]), &[b, a]).unwrap_err();
        assert_eq!(
            err.message,
            "no pool fits all 2 pods together (tidepool-a: only 1 of 2 pods fit on its nodes; \
             tidepool-b: only 1 of 2 pods fit on its nodes)"
        );
    }

    #[test]
    fn an_unschedulable_pool_is_never_chosen() {
        let mut paused = pool("tidepool-a", vec![gpus(8)]);
        paused.schedulable = false;
        let ready = pool("tidepool-b", vec![gpus(2)]);
        assert_eq!(place(&gang(vec![gpus(1)]), &[paused.clone(), ready]).unwrap().node, "tidepool-b");
        assert_eq!(place(&gang(vec![gpus(1)]), &[paused]).unwrap_err().message, "no schedulable pool");
        assert_eq!(place(&gang(vec![gpus(1)]), &[]).unwrap_err().message, "no schedulable pool");
    }

    #[test]
    fn a_pinned_gang_uses_only_its_recorded_pool() {
        let tight = pool("tidepool-a", vec![gpus(1)]);
        let recorded = pool("tidepool-b", vec![gpus(8)]);
        let mut g = gang(vec![gpus(1)]);
        g.pinned = Some("tidepool-b".into());
        assert_eq!(place(&g, &[tight, recorded.clone()]).unwrap().node, "tidepool-b");
        g.pods = vec![gpus(8), gpus(8)];
        assert_eq!(
            place(&g, &[recorded]).unwrap_err().message,
            "the gang's recorded pool tidepool-b has 8 nvidia.com/gpu left; the gang needs 16"
        );
    }

    #[test]
    fn a_pinned_pool_that_is_gone_or_paused_is_explained() {
        let mut g = gang(vec![gpus(1)]);
        g.pinned = Some("tidepool-gone".into());
        let other = pool("tidepool-a", vec![gpus(8)]);
        assert_eq!(
            place(&g, std::slice::from_ref(&other)).unwrap_err().message,
            "the gang's recorded pool tidepool-gone is not offered any more"
        );
        g.pinned = Some("tidepool-a".into());
        let mut paused = other;
        paused.schedulable = false;
        assert_eq!(
            place(&g, &[paused]).unwrap_err().message,
            "the gang's recorded pool tidepool-a is not schedulable (member paused or not ready)"
        );
    }

    #[test]
    fn an_empty_gang_is_refused() {
        let a = pool("tidepool-a", vec![gpus(8)]);
        assert_eq!(place(&gang(vec![]), &[a]).unwrap_err().message, "the gang has no pods to place");
    }

    #[test]
    fn an_elastic_pod_fits_only_beside_the_pods_already_admitted_this_round() {
        let a = pool("tidepool-a", vec![gpus(4), gpus(4)]);
        assert!(fits_one(&gpus(4), &a, &[gpus(4)], &Domain::default()));
        assert!(!fits_one(&gpus(4), &a, &[gpus(4), gpus(4)], &Domain::default()));
        assert!(!fits_one(&gpus(4), &a, &[gpus(2), gpus(2), gpus(2)], &Domain::default()));
        let mut paused = a;
        paused.schedulable = false;
        assert!(!fits_one(&gpus(1), &paused, &[], &Domain::default()));
    }

    #[test]
    fn an_elastic_pod_respects_the_budget() {
        let mut a = pool("tidepool-a", vec![gpus(8)]);
        a.capacity = gpus(4);
        a.used = gpus(3);
        assert!(fits_one(&gpus(1), &a, &[], &Domain::default()));
        assert!(!fits_one(&gpus(1), &a, &[gpus(1)], &Domain::default()));
    }

    #[test]
    fn reserving_a_placement_takes_its_room_away() {
        let mut a = pool("tidepool-a", vec![gpus(8), gpus(4)]);
        let g = gang(vec![gpus(4), gpus(4)]);
        let p = place(&g, std::slice::from_ref(&a)).unwrap();
        a.reserve(&g.pods, &p.per_pod_member_node);
        assert_eq!(a.used.get(GPU), 8000);
        assert_eq!(a.free_per_node.iter().map(|f| f.free.get(GPU)).sum::<i64>(), 4000);
        assert!(place(&g, &[a]).is_err());
    }

    #[test]
    fn amounts_read_like_quantities() {
        let cases = [
            ("whole cpus", "cpu", 64_000, "64"),
            ("millicores", "cpu", 500, "500m"),
            ("gibibytes", "memory", (64i64 << 30) * 1000, "64Gi"),
            ("a fraction of a gibibyte in mebibytes", "memory", (3i64 << 29) * 1000, "1536Mi"),
            ("an odd size in tenths of a gibibyte", "memory", ((3i64 << 29) + 1) * 1000, "1.5Gi"),
            ("mebibytes", "memory", (512i64 << 20) * 1000, "512Mi"),
            ("a few bytes", "memory", 1000 * 1000, "1000"),
            ("gpus", GPU, 8000, "8"),
        ];
        for (name, resource, milli, want) in cases {
            assert_eq!(amount(resource, milli), want, "{name}");
        }
    }

    /// A gang the search cannot settle within [`SEARCH_BUDGET`], on a pool that can take it.
    ///
    /// Thirteen cpu pods (8, 8, 7 × 6, 5, 5, 4, 4, 3) and a last pod of 1 cpu and 10Gi memory
    /// on five nodes whose cpu adds up to exactly the gang's 80: node 0 (8 cpu, the only
    /// one with memory) must hold one 7-cpu pod and the memory pod, and nothing else. Best fit
    /// fills node 0 with an 8-cpu pod, and the depth-first search, which tries node 0 first
    /// for every pod, needs about 59,000 steps to find an assignment.
    fn budget_buster() -> (GangDemand, PoolView, Vec<usize>) {
        let cpu = |n: i64| {
            let mut res = Resources::new();
            res.set("cpu", n * 1000);
            res
        };
        let mut pods: Vec<Resources> = [7, 8, 5, 5, 7, 7, 8, 7, 7, 7, 3, 4, 4].map(cpu).to_vec();
        pods.push(r(&[("cpu", "1"), ("memory", "10Gi")]));
        let nodes = vec![r(&[("cpu", "8"), ("memory", "10Gi")]), cpu(15), cpu(12), cpu(21), cpu(24)];
        // One assignment that fits, written by hand: pod i goes on node planted[i].
        let planted = vec![0, 2, 4, 1, 3, 4, 4, 3, 1, 3, 1, 4, 2, 0];
        let mut a = pool("tidepool-a", nodes);
        a.gpu_product = None;
        (gang(pods), a, planted)
    }

    #[test]
    fn a_pool_whose_search_runs_out_of_budget_is_refused_never_given_a_half_checked_placement() {
        let (g, a, planted) = budget_buster();
        // The gang does fit on the pool: the hand-written assignment, checked node by node.
        let mut load = vec![Resources::new(); a.free_per_node.len()];
        let free = frees(&a);
        for (pod, &n) in g.pods.iter().zip(&planted) {
            load[n].add(pod);
        }
        for (l, free) in load.iter().zip(&free) {
            assert!(l.fits_in(free), "{l} on {free}");
        }
        // The search gives up and the pool is refused with a reason: no placement is made
        // from an assignment that was not checked to the end.
        let err = place(&g, std::slice::from_ref(&a)).unwrap_err();
        assert!(err.message.starts_with("no pool fits all 14 pods together (tidepool-a: only "), "{}", err.message);
        // The same for an elastic pod joining the 13 cpu pods already planned there.
        let (last, already) = g.pods.split_last().unwrap();
        assert!(!fits_one(last, &a, already, &Domain::default()));
    }

    #[test]
    fn a_pool_whose_search_runs_out_of_budget_does_not_keep_the_gang_from_another_pool() {
        let (g, a, _) = budget_buster();
        // A roomier pool (one node of 96 cpu and 16Gi) ranks after the tight one when both
        // fit; with the tight one refused, the gang goes there, whole.
        let mut b = pool("tidepool-b", vec![r(&[("cpu", "96"), ("memory", "16Gi")])]);
        b.gpu_product = None;
        let p = place(&g, &[a.clone(), b.clone()]).unwrap();
        assert_eq!(p.node, "tidepool-b");
        assert_eq!(p.per_pod_member_node, vec![0; 14]);
        // A gang recorded on the tight pool stays there and waits: it never moves.
        let mut pinned = g;
        pinned.pinned = Some("tidepool-a".into());
        let err = place(&pinned, &[a, b]).unwrap_err();
        assert!(
            err.message.starts_with("the gang's recorded pool tidepool-a cannot take all 14 pods together: only "),
            "{}",
            err.message
        );
    }

    // ---- topology and GPU models ----

    const ZONE: &str = "topology.kubernetes.io/zone";
    const RACK: &str = "example.com/rack";

    /// A member node named `name` with `gpus` free in `zone`/`rack`.
    fn racked(name: &str, gpus_free: i64, zone: &str, rack: &str) -> NodeFree {
        let mut n = NodeFree::new(name, gpus(gpus_free));
        n.labels.insert(ZONE.into(), zone.into());
        n.labels.insert(RACK.into(), rack.into());
        n
    }

    /// A pool with `topology` over `nodes`, its budget the nodes' sum.
    fn topo_pool(nodes: Vec<NodeFree>, topology: &[&str]) -> PoolView {
        let mut a = pool("tidepool-a", nodes.iter().map(|n| n.free.clone()).collect());
        a.free_per_node = nodes;
        a.topology = topology.iter().map(|k| (*k).to_owned()).collect();
        a
    }

    /// Two racks of eight 1-GPU nodes in one zone: rack r1 fragmented (online pods hold
    /// the GPUs of five of its nodes), rack r2 free.
    fn two_racks() -> PoolView {
        let mut nodes = Vec::new();
        for i in 0..8 {
            nodes.push(racked(&format!("r1-{i}"), i64::from(i >= 5), "z1", "r1"));
            nodes.push(racked(&format!("r2-{i}"), 1, "z1", "r2"));
        }
        topo_pool(nodes, &[ZONE, RACK])
    }

    #[test]
    fn a_gang_lands_wholly_in_the_one_rack_that_fits_it() {
        let a = two_racks();
        let p = place(&gang(vec![gpus(1); 8]), std::slice::from_ref(&a)).unwrap();
        let domain = Domain { pairs: vec![(ZONE.into(), "z1".into()), (RACK.into(), "r2".into())] };
        assert_eq!(p.domain, domain);
        assert!(p.planned_nodes.iter().all(|n| n.starts_with("r2-")), "{:?}", p.planned_nodes);
        assert_eq!(p.planned_nodes.iter().collect::<BTreeSet<_>>().len(), 8, "one pod per 1-GPU node");
        assert_eq!(p.note.as_deref(), Some("kept in one rack (topology.kubernetes.io/zone=z1,example.com/rack=r2)"));
    }

    #[test]
    fn a_gang_no_rack_fits_is_kept_in_its_zone_and_one_no_zone_fits_is_spread_with_the_reason() {
        // 11 GPUs free in all, at most 8 in one rack: a 10-GPU gang fits the zone only.
        let a = two_racks();
        let p = place(&gang(vec![gpus(1); 10]), std::slice::from_ref(&a)).unwrap();
        assert_eq!(p.domain.pairs, vec![(ZONE.to_owned(), "z1".to_owned())]);
        assert_eq!(
            p.note.as_deref(),
            Some("kept in one zone (topology.kubernetes.io/zone=z1)"),
            "the rack level was tried first"
        );
        // The same racks in two zones: no zone has 10 either, so the gang goes pool-wide.
        let mut b = a.clone();
        for n in b.free_per_node.iter_mut().filter(|n| n.name.starts_with("r2-")) {
            n.labels.insert(ZONE.into(), "z2".into());
        }
        let p = place(&gang(vec![gpus(1); 10]), std::slice::from_ref(&b)).unwrap();
        assert!(p.domain.is_empty());
        assert_eq!(
            p.note.as_deref(),
            Some(
                "no rack has 10 nvidia.com/gpu free; largest: 8; no zone has 10 nvidia.com/gpu free; largest: 8; \
                 placed across the pool"
            )
        );
        // A pool whose gang fits a domain ranks before one that would spread it.
        let mut c = two_racks();
        c.node = "tidepool-c".into();
        c.free_per_node.iter_mut().for_each(|n| n.free = gpus(2));
        c.capacity = gpus(32);
        let p = place(&gang(vec![gpus(1); 10]), &[b, c]).unwrap();
        assert_eq!(p.node, "tidepool-c");
    }

    #[test]
    fn a_ps_goes_on_the_machine_of_its_workers_when_they_fit_there() {
        // Two 8-GPU machines and a cpu-only one: best fit alone would put the PS on the
        // cpu-only node (least room left); the fewest-nodes packing keeps the job on one.
        let gpu_node = r(&[(GPU, "8"), ("cpu", "64")]);
        let a = pool("tidepool-a", vec![gpu_node.clone(), gpu_node, r(&[("cpu", "16")])]);
        let worker = r(&[(GPU, "4"), ("cpu", "8")]);
        let p = place(&gang(vec![r(&[("cpu", "4")]), worker.clone(), worker]), &[a]).unwrap();
        assert_eq!(p.per_pod_member_node.iter().collect::<BTreeSet<_>>().len(), 1, "{:?}", p.per_pod_member_node);
    }

    #[test]
    fn a_gang_gets_one_gpu_model_of_a_mixed_pool_when_one_takes_it() {
        let model = |name: &str, n: i64, product: &str| {
            let mut node = NodeFree::new(name, gpus(n));
            node.labels.insert(GPU_PRODUCT_LABEL.into(), product.into());
            node
        };
        let nodes =
            vec![model("a0", 4, "A100"), model("a1", 4, "A100"), model("h0", 2, "H100"), model("h1", 2, "H100")];
        let mut a = topo_pool(nodes, &[]);
        a.gpu_product = None;
        let p = place(&gang(vec![gpus(2); 3]), std::slice::from_ref(&a)).unwrap();
        assert_eq!(p.domain.pairs, vec![(GPU_PRODUCT_LABEL.to_owned(), "A100".to_owned())]);
        assert!(p.planned_nodes.iter().all(|n| n.starts_with('a')), "{:?}", p.planned_nodes);
        // Ten GPUs: no model has them; the gang still runs, on both, and nothing is pinned.
        let p = place(&gang(vec![gpus(2); 5]), &[a]).unwrap();
        assert!(p.domain.is_empty());
    }

    #[test]
    fn an_elastic_pod_joins_its_gangs_domain() {
        let a = two_racks();
        let r2 = Domain { pairs: vec![(ZONE.into(), "z1".into()), (RACK.into(), "r2".into())] };
        let r1 = Domain { pairs: vec![(ZONE.into(), "z1".into()), (RACK.into(), "r1".into())] };
        assert!(fits_one(&gpus(1), &a, &vec![gpus(1); 7], &r2));
        assert!(!fits_one(&gpus(1), &a, &vec![gpus(1); 8], &r2), "rack r2 is full; r1's free GPUs do not count");
        assert!(!fits_one(&gpus(1), &a, &vec![gpus(1); 3], &r1));
        assert!(fits_one(&gpus(1), &a, &vec![gpus(1); 8], &Domain::default()));
    }

    #[test]
    fn other_devices_lead_the_packing_like_nvidia_gpus() {
        // AMD GPUs and MIG slices are devices: the tightest fit is judged on them before cpu
        // (pool a leaves no device idle, b leaves 4), and a node's free ones count per node,
        // never in sum.
        for device in ["amd.com/gpu", "nvidia.com/mig-1g.10gb"] {
            let dev = |n: &str, cpu: &str| r(&[(device, n), ("cpu", cpu)]);
            let a = pool("tidepool-a", vec![dev("4", "64")]);
            let b = pool("tidepool-b", vec![dev("8", "1")]);
            let p = place(&gang(vec![dev("4", "1")]), &[a.clone(), b]).unwrap();
            assert_eq!(p.node, "tidepool-a", "{device}");
            let a = pool("tidepool-a", vec![dev("4", "1"), dev("8", "1")]);
            let err = place(&gang(vec![dev("9", "1")]), &[a]).unwrap_err();
            assert_eq!(
                err.message,
                format!("no pool fits 9 {device} on one node; largest free on one node: 8"),
                "{device}"
            );
        }
    }

    #[test]
    fn a_planned_domain_reads_back_from_its_annotation() {
        let d = Domain { pairs: vec![(ZONE.into(), "z1".into()), (RACK.into(), "r2".into())] };
        assert_eq!(d.to_annotation(), "topology.kubernetes.io/zone=z1,example.com/rack=r2");
        assert_eq!(Domain::parse(&d.to_annotation()), d);
        assert_eq!(Domain::parse("junk,=x"), Domain::default());
    }

    // ---- properties ----

    const NAMES: [&str; 3] = [GPU, "cpu", "memory"];

    fn res(v: [i64; 3]) -> Resources {
        let mut r = Resources::new();
        for (name, amount) in NAMES.iter().zip(v) {
            if amount > 0 {
                r.set(name, amount * 1000);
            }
        }
        r
    }

    fn arb_res(max: i64) -> impl Strategy<Value = Resources> {
        (0..=max.min(8), 0..=max, 0..=max).prop_map(|(g, c, m)| res([g, c, m]))
    }

    fn arb_pool(i: usize) -> impl Strategy<Value = PoolView> {
        (
            proptest::collection::vec(arb_res(8), 0..5),
            proptest::collection::vec(0i64..40, 3),
            proptest::collection::vec(0i64..8, 3),
            any::<bool>(),
            prop::bool::weighted(0.9),
        )
            .prop_map(move |(free, cap, used, homogeneous, schedulable)| PoolView {
                node: format!("tidepool-m{i}"),
                member: format!("m{i}"),
                pool: "default".into(),
                capacity: res([cap[0], cap[1], cap[2]]),
                used: res([used[0], used[1], used[2]]),
                free_per_node: named(free),
                gpu_product: homogeneous.then(|| "H100".to_owned()),
                topology: Vec::new(),
                schedulable,
            })
    }

    fn arb_pools() -> impl Strategy<Value = Vec<PoolView>> {
        (0usize..5).prop_flat_map(|n| (0..n).map(arb_pool).collect::<Vec<_>>())
    }

    fn arb_gang() -> impl Strategy<Value = GangDemand> {
        (proptest::collection::vec(arb_res(6), 1..5), proptest::option::weighted(0.2, 0usize..5)).prop_map(
            |(pods, pinned)| GangDemand {
                key: GangKey::annotation("ns", "job"),
                pods,
                pinned: pinned.map(|i| format!("tidepool-m{i}")),
                constraints: vec![],
            },
        )
    }

    /// Brute force: some assignment of every pod to a node fits, and the budget holds.
    fn feasible(pods: &[Resources], pool: &PoolView) -> bool {
        let mut total = pool.used.clone();
        for p in pods {
            total.add(p);
        }
        let within_budget = pods.iter().flat_map(|p| p.names()).all(|n| total.get(n) <= pool.capacity.get(n));
        if !within_budget || !pool.schedulable {
            return false;
        }
        fn go(pods: &[Resources], free: &mut [Resources]) -> bool {
            let Some((first, rest)) = pods.split_first() else { return true };
            for i in 0..free.len() {
                if first.fits_in(&free[i]) {
                    free[i].sub(first);
                    let ok = go(rest, free);
                    free[i].add(first);
                    if ok {
                        return true;
                    }
                }
            }
            false
        }
        go(pods, &mut frees(pool))
    }

    fn check_placement(gang: &GangDemand, pools: &[PoolView], p: &Placement) -> Result<(), TestCaseError> {
        let chosen: Vec<&PoolView> = pools.iter().filter(|v| v.node == p.node).collect();
        prop_assert_eq!(chosen.len(), 1, "placement names exactly one offered pool");
        let pool = chosen[0];
        prop_assert!(pool.schedulable);
        prop_assert_eq!(&pool.member, &p.member);
        if let Some(pin) = &gang.pinned {
            prop_assert_eq!(pin, &p.node);
        }
        prop_assert_eq!(p.per_pod_member_node.len(), gang.pods.len());
        let mut on_node = vec![Resources::new(); pool.free_per_node.len()];
        let mut total = pool.used.clone();
        for (pod, &n) in gang.pods.iter().zip(&p.per_pod_member_node) {
            prop_assert!(n < pool.free_per_node.len());
            on_node[n].add(pod);
            total.add(pod);
        }
        for (load, free) in on_node.iter().zip(&frees(pool)) {
            prop_assert!(load.fits_in(free), "node overcommitted: {} on {}", load, free);
        }
        for pod in &gang.pods {
            for name in pod.names() {
                prop_assert!(total.get(name) <= pool.capacity.get(name), "budget exceeded in {}", name);
            }
        }
        Ok(())
    }

    /// Gangs made to measure for a pool, like [`budget_buster`]: 12–14 cpu pods of 4–9 cpu
    /// dealt onto 4–5 nodes whose cpu is exactly what they were dealt, plus a last pod of
    /// 1 cpu and 10 memory that only node 0 has room for. Every such gang fits its pool; about
    /// one in eight runs the search out of budget (see the test below).
    fn arb_planted() -> impl Strategy<Value = (GangDemand, PoolView)> {
        (4usize..=5, proptest::collection::vec((4i64..=9, 0usize..5), 12..=14)).prop_map(|(k, dealt)| {
            let mut free = vec![res([0, 0, 0]); k];
            free[0] = res([0, 1, 10]);
            let mut pods = Vec::new();
            for (cpu, node) in dealt {
                free[node % k].add(&res([0, cpu, 0]));
                pods.push(res([0, cpu, 0]));
            }
            pods.push(res([0, 1, 10]));
            let mut a = pool("tidepool-a", free);
            a.gpu_product = None;
            (gang(pods), a)
        })
    }

    /// A pool that takes any planted gang by best fit: one node with room for all of it.
    fn roomy() -> PoolView {
        let mut b = pool("tidepool-b", vec![res([0, 200, 20])]);
        b.gpu_product = None;
        b
    }

    #[test]
    fn the_planted_gangs_include_ones_that_run_the_search_out_of_budget() {
        // Each planted gang fits its pool by construction, and the search is exhaustive
        // below its budget (a_gang_is_placed_exactly_when_some_pool_can_take_all_of_it), so
        // a refusal here is a search that ran out.
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = arb_planted();
        let refused = (0..200)
            .filter(|_| {
                let (g, a) = proptest::strategy::ValueTree::current(&strategy.new_tree(&mut runner).unwrap());
                place(&g, &[a]).is_err()
            })
            .count();
        assert!(refused >= 5, "only {refused} of 200 planted gangs exhausted the search");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn a_gang_its_pool_can_take_is_placed_validly_or_refused_and_never_kept_from_a_roomy_pool(
            (g, a) in arb_planted(),
        ) {
            let alone = std::slice::from_ref(&a);
            if let Ok(p) = place(&g, alone) {
                check_placement(&g, alone, &p)?;
            }
            let both = [a.clone(), roomy()];
            let p = place(&g, &both);
            prop_assert!(p.is_ok(), "{:?}", p);
            if let Ok(p) = p {
                check_placement(&g, &both, &p)?;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_placement_puts_every_pod_on_one_pool_within_node_and_budget_limits(
            gang in arb_gang(), pools in arb_pools(),
        ) {
            if let Ok(p) = place(&gang, &pools) {
                check_placement(&gang, &pools, &p)?;
            }
        }

        #[test]
        fn a_gang_is_placed_exactly_when_some_pool_can_take_all_of_it(gang in arb_gang(), pools in arb_pools()) {
            let possible = pools
                .iter()
                .filter(|v| gang.pinned.as_ref().is_none_or(|pin| pin == &v.node))
                .any(|v| feasible(&gang.pods, v));
            prop_assert_eq!(place(&gang, &pools).is_ok(), possible);
        }

        #[test]
        fn the_answer_does_not_depend_on_pool_order(
            gang in arb_gang(), pools in arb_pools(), seed in any::<u64>(),
        ) {
            let first = place(&gang, &pools);
            prop_assert_eq!(&first, &place(&gang, &pools));
            let mut shuffled = pools.clone();
            crate::testutil::shuffle(&mut shuffled, seed);
            prop_assert_eq!(first, place(&gang, &shuffled));
        }

        #[test]
        fn an_elastic_pod_fits_exactly_when_the_pool_could_place_it_with_the_others(
            pod in arb_res(6), already in proptest::collection::vec(arb_res(6), 0..3), pool in arb_pool(0),
        ) {
            let mut pods = already.clone();
            pods.push(pod.clone());
            prop_assert_eq!(fits_one(&pod, &pool, &already, &Domain::default()), feasible(&pods, &pool));
        }

        #[test]
        fn gangs_placed_one_after_another_never_overcommit_a_node(
            gangs in proptest::collection::vec(arb_gang(), 1..6), pools in arb_pools(),
        ) {
            let original = pools.clone();
            let mut pools = pools;
            let mut booked: Vec<Vec<Resources>> = pools.iter().map(|p| vec![Resources::new(); p.free_per_node.len()]).collect();
            for g in gangs {
                let g = GangDemand { pinned: None, ..g };
                if let Ok(p) = place(&g, &pools) {
                    check_placement(&g, &pools, &p)?;
                    let i = pools.iter().position(|v| v.node == p.node).unwrap();
                    for (pod, &n) in g.pods.iter().zip(&p.per_pod_member_node) {
                        booked[i][n].add(pod);
                    }
                    pools[i].reserve(&g.pods, &p.per_pod_member_node);
                }
            }
            for (pool, load) in original.iter().zip(&booked) {
                for (l, free) in load.iter().zip(&frees(pool)) {
                    prop_assert!(l.fits_in(free));
                }
            }
        }
    }

    // ---- properties of topology and GPU models ----

    /// A pool of 1–6 nodes in up to two zones of two racks each (some nodes unlabelled),
    /// each node of one of two GPU models or of none, with topology `[zone, rack]`.
    fn arb_topo_pool() -> impl Strategy<Value = PoolView> {
        let node = (arb_res(6), 0usize..3, 0usize..3, 0usize..3);
        (proptest::collection::vec(node, 1..7), any::<bool>()).prop_map(|(nodes, with_topology)| {
            let free = nodes
                .into_iter()
                .enumerate()
                .map(|(i, (free, zone, rack, model))| {
                    let mut n = NodeFree::new(format!("n{i}"), free);
                    if zone < 2 {
                        n.labels.insert(ZONE.into(), format!("z{zone}"));
                        if rack < 2 {
                            n.labels.insert(RACK.into(), format!("z{zone}-r{rack}"));
                        }
                    }
                    if model < 2 {
                        n.labels.insert(GPU_PRODUCT_LABEL.into(), format!("model-{model}"));
                    }
                    n
                })
                .collect();
            let mut a = topo_pool(free, if with_topology { &[ZONE, RACK] } else { &[] });
            a.capacity = res([40, 40, 40]);
            a.gpu_product = None;
            a
        })
    }

    /// `pool` with only the nodes `keep` says yes to.
    fn only(pool: &PoolView, keep: impl Fn(&NodeFree) -> bool) -> PoolView {
        let mut sub = pool.clone();
        sub.free_per_node.retain(keep);
        sub
    }

    /// The domains of one level (`keys`): the values of the keys, and the nodes having them all.
    fn domains_of(pool: &PoolView, keys: &[String]) -> BTreeMap<Vec<String>, PoolView> {
        let mut out = BTreeMap::new();
        for n in &pool.free_per_node {
            let values: Option<Vec<String>> = keys.iter().map(|k| n.labels.get(k).cloned()).collect();
            if let Some(values) = values {
                out.entry(values.clone()).or_insert_with(|| {
                    only(pool, |m| keys.iter().zip(&values).all(|(k, v)| m.labels.get(k) == Some(v)))
                });
            }
        }
        out
    }

    /// The fewest distinct nodes any assignment of `pods` onto `pool` uses (`None`: none fits).
    fn fewest_nodes_brute(pods: &[Resources], pool: &PoolView) -> Option<usize> {
        fn go(pods: &[Resources], free: &mut [Resources], used: &mut Vec<usize>, best: &mut Option<usize>) {
            let distinct = used.iter().collect::<BTreeSet<_>>().len();
            if best.is_some_and(|b| distinct >= b) {
                return;
            }
            let Some((first, rest)) = pods.split_first() else {
                *best = Some(distinct);
                return;
            };
            for i in 0..free.len() {
                if first.fits_in(&free[i]) {
                    free[i].sub(first);
                    used.push(i);
                    go(rest, free, used, best);
                    used.pop();
                    free[i].add(first);
                }
            }
        }
        if !feasible(pods, pool) {
            return None;
        }
        let mut best = None;
        go(pods, &mut frees(pool), &mut Vec::new(), &mut best);
        best
    }

    fn arb_uniform_gang() -> impl Strategy<Value = GangDemand> {
        (arb_res(4), 1usize..5).prop_map(|(pod, n)| gang(vec![pod; n]))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_gang_never_crosses_a_domain_of_the_finest_level_where_one_fits(g in arb_gang(), pool in arb_topo_pool()) {
            // One GPU model per pool here, so models do not decide the domain.
            let mut pool = pool;
            pool.free_per_node.iter_mut().for_each(|n| { n.labels.remove(GPU_PRODUCT_LABEL); });
            pool.gpu_product = Some("H100".into());
            let g = GangDemand { pinned: None, ..g };
            let placed = place(&g, std::slice::from_ref(&pool));
            prop_assert_eq!(placed.is_ok(), feasible(&g.pods, &pool));
            let Ok(p) = placed else { return Ok(()) };
            check_placement(&g, std::slice::from_ref(&pool), &p)?;
            let finest = (0..pool.topology.len()).rev().find(|&l| {
                domains_of(&pool, &pool.topology[..=l]).values().any(|d| feasible(&g.pods, d))
            });
            match finest {
                Some(l) => {
                    let keys = &pool.topology[..=l];
                    prop_assert_eq!(p.domain.pairs.len(), l + 1, "{:?}", p.domain);
                    for &n in &p.per_pod_member_node {
                        prop_assert!(p.domain.contains(&pool.free_per_node[n]), "pod on {} outside {:?}", n, p.domain);
                    }
                    prop_assert!(p.domain.pairs.iter().map(|(k, _)| k).eq(keys.iter()));
                }
                None => prop_assert!(p.domain.is_empty(), "{:?}", p.domain),
            }
        }

        #[test]
        fn a_uniform_gang_uses_as_few_nodes_as_brute_force_in_the_domain_it_gets(
            g in arb_uniform_gang(), pool in arb_topo_pool(),
        ) {
            let mut pool = pool;
            pool.free_per_node.iter_mut().for_each(|n| { n.labels.remove(GPU_PRODUCT_LABEL); });
            pool.gpu_product = Some("H100".into());
            let Ok(p) = place(&g, std::slice::from_ref(&pool)) else { return Ok(()) };
            // The fewest nodes over every domain of the level the planner used.
            let level = p.domain.pairs.len();
            let fewest = if level == 0 {
                fewest_nodes_brute(&g.pods, &pool)
            } else {
                domains_of(&pool, &pool.topology[..level]).values().filter_map(|d| fewest_nodes_brute(&g.pods, d)).min()
            };
            let used = p.per_pod_member_node.iter().collect::<BTreeSet<_>>().len();
            prop_assert_eq!(Some(used), fewest);
        }

        #[test]
        fn a_gang_never_mixes_gpu_models_when_one_model_takes_it(g in arb_gang(), pool in arb_topo_pool()) {
            let mut pool = pool;
            pool.topology.clear();
            let g = GangDemand { pinned: None, ..g };
            let Ok(p) = place(&g, std::slice::from_ref(&pool)) else {
                prop_assert!(!feasible(&g.pods, &pool));
                return Ok(());
            };
            let wants_gpus = g.pods.iter().any(|pod| pod.get(GPU) > 0);
            let one_model_fits = ["model-0", "model-1"].iter().any(|m| {
                feasible(&g.pods, &only(&pool, |n| n.labels.get(GPU_PRODUCT_LABEL).map(String::as_str) == Some(*m)))
            });
            if wants_gpus && one_model_fits {
                let models: BTreeSet<Option<&String>> =
                    p.per_pod_member_node.iter().map(|&n| pool.free_per_node[n].labels.get(GPU_PRODUCT_LABEL)).collect();
                prop_assert_eq!(models.len(), 1, "{:?}", models);
                prop_assert!(!models.contains(&None));
            }
        }

        #[test]
        fn an_elastic_pod_fits_its_domain_exactly_when_the_domain_could_take_it_with_the_others(
            pod in arb_res(6), already in proptest::collection::vec(arb_res(6), 0..3), pool in arb_topo_pool(),
            zone in 0usize..2,
        ) {
            let domain = Domain { pairs: vec![(ZONE.into(), format!("z{zone}"))] };
            let mut pods = already.clone();
            pods.push(pod.clone());
            let inside = only(&pool, |n| domain.contains(n));
            prop_assert_eq!(fits_one(&pod, &pool, &already, &domain), feasible(&pods, &inside));
        }
    }
}
