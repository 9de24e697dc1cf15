//! The capacity model kept up to date pod by pod: per member node, the sums of what its pods
//! request ([`PodIndex`]), changed on each pod view change, so a pool's capacity is computed
//! from its nodes' records ([`super::pool::PoolModel`]) and no computation walks every
//! pod of the member. [`super::reference::pool_capacity_in`] is the reference both equal (see
//! the property test below).

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::view_cache::Derived;
use std::sync::Arc;

use tidepool_api::Resources;
use tidepool_api::crd::PoolMode;

use super::{PodCapacityKey, PodView, counted};
use crate::capacity::priority::{EXAMPLES, PriorityConflict};

/// Names of the member nodes whose view or pods changed since the pool models last looked,
/// or `all` after a re-list.
#[derive(Debug, Clone, Default)]
pub struct Touched {
    names: HashSet<String>,
    all: bool,
}

impl Touched {
    pub fn note(&mut self, node: &str) {
        if !self.all && !self.names.contains(node) {
            self.names.insert(node.to_owned());
        }
    }

    /// Everything may have changed (a re-list): the models start over.
    pub fn note_all(&mut self) {
        self.all = true;
        self.names.clear();
    }

    /// Whether everything was noted (a re-list).
    pub fn is_all(&self) -> bool {
        self.all
    }

    /// The names noted (none when [`Touched::is_all`]).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Whether nothing was noted.
    pub fn is_empty(&self) -> bool {
        !self.all && self.names.is_empty()
    }

    /// What was noted, leaving nothing noted.
    pub fn take(&mut self) -> Touched {
        std::mem::take(self)
    }

    /// What either noted.
    pub fn joined(mut self, other: Touched) -> Touched {
        if other.all {
            self.note_all();
        }
        for name in &other.names {
            self.note(name);
        }
        self
    }
}

/// A sum of requests over some pods, and per resource how many of them name it: a resource
/// stays in the sum (at zero, too) exactly while a pod naming it is counted, as a sum made
/// afresh over the same pods would have it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Tally {
    pub sum: Resources,
    naming: Resources,
}

impl Tally {
    pub fn add(&mut self, requests: &Resources) {
        self.sum.add(requests);
        for name in requests.names() {
            self.naming.add_one(name, 1);
        }
    }

    pub fn sub(&mut self, requests: &Resources) {
        self.sum.sub(requests);
        for name in requests.names() {
            self.naming.add_one(name, -1);
            if self.naming.get(name) <= 0 {
                self.naming.remove(name);
                self.sum.remove(name);
            }
        }
    }
}

/// The pods on one member node that hold resources (placed, not finished).
#[derive(Debug, Clone)]
struct NodePods {
    /// The node's name, shared by every [`crate::capacity::Placed`] of its pods.
    name: Arc<str>,
    /// Per indexed mode ([`PodIndex::modes`]), online pods' requests as that mode counts them.
    online: Vec<Tally>,
    /// The same for offload pods.
    offload: Vec<Tally>,
    /// Offload pods' origin UID and copy UID (shared with their views).
    placed: Vec<(Arc<str>, Option<Arc<str>>)>,
    /// Pods counted here; the record goes when it drops to zero.
    pods: usize,
}

/// A workload's namespace, kind and name (see [`PodView::workload`]).
type WorkloadOf = (String, &'static str, Box<str>);

/// What the capacity model needs of a member's pods, summed per node and kept up to date by
/// [`PodIndex::change`] on every view change.
#[derive(Debug, Clone)]
pub struct PodIndex {
    /// The pool modes counted (each pool's, once).
    modes: Vec<PoolMode>,
    nodes: HashMap<String, NodePods>,
    /// Online pods not placed yet: demand where they could land.
    pending: HashMap<PodCapacityKey, PodView>,
    /// Per workload, its pods that have not ended (see [`crate::capacity::ReplicasToCome`]).
    workloads: HashMap<WorkloadOf, i32>,
    /// Online pods at or below `ceiling`: priority and `namespace/name`.
    low_priority: BTreeSet<(i32, String)>,
    ceiling: i32,
    /// Nodes whose sums changed since the pool models last looked ([`PodIndex::take_touched`]).
    touched: Touched,
}

/// What the pods on one member node add up to under one pool mode ([`PodIndex::node_sums`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeSums<'a> {
    /// The node's name, shared with every [`crate::capacity::Placed`] of its pods.
    pub node: &'a Arc<str>,
    pub online: &'a Resources,
    pub offload: &'a Resources,
    /// Offload pods' origin UID and copy UID.
    pub placed: &'a [(Arc<str>, Option<Arc<str>>)],
}

impl PodIndex {
    /// An empty index counting pods for pools of `modes`, and online pods at or below the
    /// priority `ceiling`.
    pub fn new(modes: impl IntoIterator<Item = PoolMode>, ceiling: i32) -> Self {
        let mut counted = Vec::new();
        for m in modes {
            if !counted.contains(&m) {
                counted.push(m);
            }
        }
        Self {
            modes: counted,
            nodes: HashMap::new(),
            pending: HashMap::new(),
            workloads: HashMap::new(),
            low_priority: BTreeSet::new(),
            ceiling,
            touched: Touched::default(),
        }
    }

    /// The pod `key` changed from `old` to `new` (`None`: absent).
    pub fn change(&mut self, key: &PodCapacityKey, old: Option<&PodView>, new: Option<&PodView>) {
        if let Some(p) = old {
            self.count(key, p, false);
        }
        if let Some(p) = new {
            self.count(key, p, true);
        }
    }

    /// Forgets every pod, keeping the modes and the ceiling.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.pending.clear();
        self.workloads.clear();
        self.low_priority.clear();
        self.touched.note_all();
    }

    /// The nodes whose sums changed since the last call.
    pub fn take_touched(&mut self) -> Touched {
        self.touched.take()
    }

    /// The sums of the pods on `node` as a pool of `mode` counts them; `None` when no pod
    /// holds anything there, or the index does not count the mode.
    pub(crate) fn node_sums(&self, node: &str, mode: PoolMode) -> Option<NodeSums<'_>> {
        let slot = self.modes.iter().position(|m| *m == mode)?;
        let record = self.nodes.get(node)?;
        let (online, offload) = (record.online.get(slot)?, record.offload.get(slot)?);
        Some(NodeSums { node: &record.name, online: &online.sum, offload: &offload.sum, placed: &record.placed })
    }

    /// Online pods not placed yet.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &PodView> {
        self.pending.values()
    }

    /// Counts `p` in (`add`) or out.
    fn count(&mut self, key: &PodCapacityKey, p: &PodView, add: bool) {
        if p.pending_online() {
            if add {
                self.pending.insert(key.clone(), p.clone());
            } else {
                self.pending.remove(key);
            }
        }
        if let Some((kind, name)) = p.workload()
            && !p.terminated
        {
            let k = (key.0.clone(), kind, name.into());
            let n = self.workloads.entry(k.clone()).or_default();
            *n += if add { 1 } else { -1 };
            if *n == 0 {
                self.workloads.remove(&k);
            }
        }
        if let Some(prio) = p.priority.filter(|v| !p.offload && !p.terminated && *v <= self.ceiling) {
            let named = (prio, format!("{}/{}", key.0, key.1));
            if add {
                self.low_priority.insert(named);
            } else {
                self.low_priority.remove(&named);
            }
        }
        if let Some(node) = p.node.as_deref()
            && !p.terminated
        {
            self.count_on_node(node, p, add);
        }
    }

    fn count_on_node(&mut self, node: &str, p: &PodView, add: bool) {
        self.touched.note(node);
        let modes = self.modes.len();
        let record = self.nodes.entry(node.to_owned()).or_insert_with(|| NodePods {
            name: node.into(),
            online: vec![Tally::default(); modes],
            offload: vec![Tally::default(); modes],
            placed: Vec::new(),
            pods: 0,
        });
        let tallies = if p.offload { &mut record.offload } else { &mut record.online };
        for (mode, tally) in self.modes.iter().zip(tallies) {
            let requests = counted(mode.colocation(), &p.requests);
            if add { tally.add(&requests) } else { tally.sub(&requests) }
        }
        if let Some(origin) = p.origin_uid.as_ref().filter(|_| p.offload) {
            if add {
                record.placed.push((origin.clone(), p.uid.clone()));
            } else if let Some(i) = record.placed.iter().position(|(o, c)| o == origin && *c == p.uid) {
                record.placed.swap_remove(i);
            }
        }
        if add {
            record.pods += 1;
        } else {
            record.pods = record.pods.saturating_sub(1);
            if record.pods == 0 {
                self.nodes.remove(node);
            }
        }
    }

    /// Pods of the workload `kind`/`name` in namespace `ns` that have not ended.
    pub fn existing(&self, ns: &str, kind: &'static str, name: &str) -> i32 {
        self.workloads.get(&(ns.to_owned(), kind, name.into())).copied().unwrap_or(0)
    }

    /// The online pods at or below the ceiling, as
    /// [`crate::capacity::priority::priority_conflict`] reports them.
    pub fn priority_conflict(&self) -> Option<PriorityConflict> {
        if self.low_priority.is_empty() {
            return None;
        }
        let examples = self.low_priority.iter().take(EXAMPLES).map(|(p, name)| (name.clone(), *p)).collect();
        Some(PriorityConflict { count: self.low_priority.len(), examples, ceiling: self.ceiling })
    }
}

impl<V> Derived<String, V> for Touched {
    fn changed(&mut self, key: &String, _: Option<&V>, _: Option<&V>) {
        self.note(key);
    }

    fn relisted(&mut self, _: &HashMap<String, V>) {
        self.note_all();
    }
}

impl Derived<PodCapacityKey, PodView> for PodIndex {
    fn changed(&mut self, key: &PodCapacityKey, old: Option<&PodView>, new: Option<&PodView>) {
        self.change(key, old, new);
    }

    fn relisted(&mut self, live: &HashMap<PodCapacityKey, PodView>) {
        self.clear();
        for (k, v) in live {
            self.change(k, None, Some(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::pool::PoolModel;
    use crate::capacity::priority::priority_conflict;
    use crate::capacity::{
        CapacityPolicy, HardTaint, HpaView, NodeView, OnlineDemand, OnlineParts, ReplicasToCome, Window,
        pool_capacity_in,
    };
    use crate::view_cache::ViewCache;
    use kube::runtime::watcher::Event;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use tidepool_api::crd::PoolToleration;

    const MODES: [PoolMode; 3] = [PoolMode::Requests, PoolMode::KoordinatorBatch, PoolMode::KatalystReclaimed];
    /// Plain, device and both colocation systems' resources, so every mode counts something.
    const NAMES: [&str; 5] = [
        "cpu",
        "memory",
        "nvidia.com/gpu",
        "kubernetes.io/batch-cpu",
        "resource.katalyst.kubewharf.io/reclaimed_millicpu",
    ];
    const CEILING: i32 = -100;

    fn resources(amounts: &[Option<i64>]) -> Resources {
        let mut r = Resources::new();
        for (name, v) in NAMES.iter().zip(amounts) {
            if let Some(v) = v {
                // Odd milli amounts too: a colocation mode's `/ 1000` must round alike.
                r.set(name, *v);
            }
        }
        r
    }

    fn arb_resources() -> impl Strategy<Value = Resources> {
        proptest::collection::vec(proptest::option::of(0i64..40_000), NAMES.len()).prop_map(|v| resources(&v))
    }

    fn arb_node() -> impl Strategy<Value = NodeView> {
        (0usize..4, any::<bool>(), proptest::bool::weighted(0.1), any::<bool>(), proptest::bool::weighted(0.2))
            .prop_flat_map(|(i, ready, cordoned, gpu_label, tainted)| {
                arb_resources().prop_map(move |allocatable| {
                    let mut labels =
                        BTreeMap::from([("pool".to_owned(), if gpu_label { "gpu" } else { "cpu" }.into())]);
                    if gpu_label {
                        labels.insert(crate::capacity::GPU_PRODUCT_LABEL.to_owned(), format!("model-{}", i % 2));
                    }
                    let taints = if tainted {
                        vec![HardTaint { key: "lend".into(), value: None, effect: "NoSchedule".into() }]
                    } else {
                        Vec::new()
                    };
                    NodeView {
                        name: format!("n{i}"),
                        labels,
                        ready,
                        unschedulable: cordoned,
                        allocatable,
                        taints,
                        pod_cidrs: Vec::new(),
                    }
                })
            })
    }

    fn arb_pod() -> impl Strategy<Value = (PodCapacityKey, PodView)> {
        let shape = (
            (0usize..3, 0usize..6),
            proptest::option::weighted(0.8, 0usize..5),
            proptest::bool::weighted(0.2),
            proptest::bool::weighted(0.4),
            proptest::option::of(-110i32..-90),
            proptest::option::of(0usize..2),
            any::<bool>(),
        );
        (shape, arb_resources()).prop_map(
            |(((ns, name), node, terminated, offload, priority, workload, gpu), requests)| {
                let key = (format!("ns{ns}"), format!("p{name}"));
                let origin = format!("origin-{}-{}", key.0, key.1);
                let view = PodView {
                    node: node.map(|n| format!("n{n}").into()),
                    requests,
                    terminated,
                    offload,
                    origin_uid: offload.then(|| origin.into()),
                    uid: offload.then(|| format!("copy-{ns}-{name}-{gpu}").into()),
                    priority,
                    online: OnlineParts::boxed(
                        if gpu { BTreeMap::from([("pool".into(), "gpu".into())]) } else { BTreeMap::new() },
                        Vec::new(),
                        workload.map(|w| (if w == 0 { "Deployment" } else { "StatefulSet" }, format!("w{w}").into())),
                    ),
                };
                (key, view)
            },
        )
    }

    #[derive(Debug, Clone)]
    enum Op {
        Node(NodeView),
        DeleteNode(usize),
        Pod(PodCapacityKey, PodView),
        DeletePod(PodCapacityKey),
        /// A re-list of the pods, one of them (by position) gone meanwhile.
        Relist(usize),
        /// A re-list of the nodes, one of them (by position) gone meanwhile.
        RelistNodes(usize),
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => arb_node().prop_map(Op::Node),
            1 => (0usize..4).prop_map(Op::DeleteNode),
            6 => arb_pod().prop_map(|(k, v)| Op::Pod(k, v)),
            2 => arb_pod().prop_map(|(k, _)| Op::DeletePod(k)),
            1 => (0usize..20).prop_map(Op::Relist),
            1 => (0usize..5).prop_map(Op::RelistNodes),
        ]
    }

    /// Replays the views of `cache` as a re-list in which the `gone`-th of them is missing.
    fn relist<K: Clone + Eq + std::hash::Hash, V: Clone + PartialEq, D: crate::view_cache::Derived<K, V>>(
        cache: &mut ViewCache<K, V, D>,
        gone: usize,
    ) {
        let all: Vec<_> = cache.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        cache.apply(Event::Init);
        for (i, (k, v)) in all.into_iter().enumerate() {
            if i != gone {
                cache.apply(Event::InitApply((k, v)));
            }
        }
        cache.apply(Event::InitDone);
    }

    /// Every pool shape there is (each mode, a selector, tolerating the taint or not, with a
    /// topology level or not), one model each.
    fn shapes() -> Vec<PoolModel> {
        let lend = PoolToleration { key: Some("lend".into()), operator: Some("Exists".into()), ..Default::default() };
        let selectors = [BTreeMap::new(), BTreeMap::from([("pool".to_owned(), "gpu".to_owned())])];
        let mut models = Vec::new();
        for mode in MODES {
            for selector in &selectors {
                for tolerations in [Vec::new(), vec![lend.clone()]] {
                    let topology = if selector.is_empty() { vec!["pool".to_owned()] } else { Vec::new() };
                    models.push(PoolModel::new(selector.clone(), tolerations, mode, topology));
                }
            }
        }
        models
    }

    /// Online demand besides nodes and pods: HPAs that may grow, replicas to come and a
    /// window (open at `now` or not), each selecting the GPU nodes or every node.
    #[derive(Debug, Clone)]
    struct Demand {
        policy: CapacityPolicy,
        hpas: Vec<HpaView>,
        to_come: Vec<ReplicasToCome>,
        now: jiff::Timestamp,
    }

    fn selector(gpu: bool) -> BTreeMap<String, String> {
        if gpu { BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]) } else { BTreeMap::new() }
    }

    fn arb_demand() -> impl Strategy<Value = Demand> {
        let lend = PoolToleration { key: Some("lend".into()), operator: Some("Exists".into()), ..Default::default() };
        let tolerations = move |t: bool| if t { vec![lend.clone()] } else { Vec::new() };
        let hpa = (0i32..4, 0i32..6, arb_resources(), any::<bool>(), any::<bool>());
        let to_come = (0i32..4, arb_resources(), any::<bool>(), any::<bool>());
        (
            proptest::collection::vec(hpa, 0..3),
            proptest::collection::vec(to_come, 0..3),
            proptest::option::of((arb_resources(), any::<bool>())),
            (0u32..=100, 1u32..=100),
        )
            .prop_map(move |(hpas, to_come, window, (hpa_percent, watermark_percent))| {
                // Every day at 12:00 for an hour: open at 12:30, closed at 06:00.
                let windows = window.iter().map(|(reserve, _)| Window {
                    name: "noon".into(),
                    schedule: tidepool_api::cron::Schedule::parse("0 12 * * *").unwrap(),
                    duration: jiff::SignedDuration::from_mins(60),
                    lead: jiff::SignedDuration::ZERO,
                    reserve: reserve.clone(),
                });
                let open = window.as_ref().is_some_and(|(_, open)| *open);
                let now: jiff::Timestamp =
                    if open { "2026-12-05T12:30:00Z" } else { "2026-12-05T06:00:00Z" }.parse().unwrap();
                let policy = CapacityPolicy {
                    reserve: resources(&[Some(500), None, Some(1000)]),
                    watermark_percent,
                    windows: windows.collect(),
                    hpa_percent,
                };
                let hpas = hpas
                    .into_iter()
                    .map(|(current, more, per_replica, gpu, t)| HpaView {
                        current_replicas: current,
                        max_replicas: current + more,
                        per_replica,
                        node_selector: selector(gpu),
                        tolerations: tolerations(t),
                    })
                    .collect();
                let to_come = to_come
                    .into_iter()
                    .map(|(replicas, per_replica, gpu, t)| ReplicasToCome {
                        replicas,
                        per_replica,
                        node_selector: selector(gpu),
                        tolerations: tolerations(t),
                    })
                    .collect();
                Demand { policy, hpas, to_come, now }
            })
    }

    /// Each model, caught up with what changed, against the capacity recomputed over every
    /// pod under `demand`; and the index's other sums against theirs.
    fn assert_same(
        nodes: &mut ViewCache<String, NodeView, Touched>,
        pods: &mut ViewCache<PodCapacityKey, PodView, PodIndex>,
        models: &mut [PoolModel],
        demand: &Demand,
    ) {
        let demand =
            OnlineDemand { policy: &demand.policy, hpas: &demand.hpas, to_come: &demand.to_come, now: demand.now };
        let touched = nodes.derived.take().joined(pods.derived.take_touched());
        for model in models {
            model.catch_up(&touched, nodes.views(), &pods.derived);
            let (selector, tolerations, mode, topology) = model.shape();
            let in_pool = nodes.values().filter(|n| n.tolerated_by(tolerations));
            let mut full = pool_capacity_in(in_pool, pods.values(), selector, &demand, mode);
            full.label_topology(topology, |name| nodes.get(name));
            let kept = model.capacity(&demand, nodes.views(), &pods.derived);
            assert_eq!(kept, full, "mode {mode:?}, selector {selector:?}, tolerations {tolerations:?}");
        }
        assert_eq!(pods.derived.priority_conflict(), priority_conflict(pods.iter(), CEILING));
        for ns in ["ns0", "ns1", "ns2"] {
            for (kind, name) in [("Deployment", "w0"), ("StatefulSet", "w1"), ("Deployment", "w1")] {
                let live = pods
                    .iter()
                    .filter(|((n, _), p)| n == ns && !p.terminated && p.workload() == Some((kind, name)))
                    .count();
                assert_eq!(pods.derived.existing(ns, kind, name), live as i32, "{ns}/{kind}/{name}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// After any sequence of node and pod adds, updates, deletes and re-lists, under any
        /// reserve, watermark, HPA headroom, replicas to come and window (open or closed), the
        /// pool models caught up with the nodes that changed equal the capacity recomputed
        /// over every node and pod.
        #[test]
        fn the_incremental_model_equals_the_full_recomputation(
            ops in proptest::collection::vec(arb_op(), 1..60), demand in arb_demand(),
        ) {
            let mut nodes = ViewCache::with(Touched::default());
            let mut pods = ViewCache::with(PodIndex::new(MODES, CEILING));
            nodes.apply(Event::Init);
            nodes.apply(Event::InitDone);
            pods.apply(Event::Init);
            pods.apply(Event::InitDone);
            let mut models = shapes();
            for op in ops {
                match op {
                    Op::Node(n) => { nodes.apply(Event::Apply((n.name.clone(), n))); }
                    Op::DeleteNode(i) => { nodes.apply(Event::Delete((format!("n{i}"), NodeView::default()))); }
                    Op::Pod(k, v) => { pods.apply(Event::Apply((k, v))); }
                    Op::DeletePod(k) => { pods.apply(Event::Delete((k, PodView::default()))); }
                    Op::Relist(gone) => relist(&mut pods, gone),
                    Op::RelistNodes(gone) => relist(&mut nodes, gone),
                }
                assert_same(&mut nodes, &mut pods, &mut models, &demand);
            }
        }
    }

    #[test]
    fn a_node_record_goes_with_its_last_pod_and_takes_the_names_it_held() {
        let key = |n: &str| ("ns".to_owned(), n.to_owned());
        let on = |requests: &[Option<i64>]| PodView {
            node: Some("n0".into()),
            requests: resources(requests),
            ..Default::default()
        };
        let mut index = PodIndex::new([PoolMode::Requests], CEILING);
        index.change(&key("a"), None, Some(&on(&[Some(1000), None, Some(0)])));
        index.change(&key("b"), None, Some(&on(&[Some(500)])));
        let online = |index: &PodIndex| index.nodes.get("n0").map(|r| r.online[0].sum.clone());
        assert_eq!(online(&index), Some(resources(&[Some(1500), None, Some(0)])), "a zero request stays named");
        index.change(&key("a"), Some(&on(&[Some(1000), None, Some(0)])), None);
        assert_eq!(online(&index), Some(resources(&[Some(500)])), "no pod names the GPU any more");
        index.change(&key("b"), Some(&on(&[Some(500)])), None);
        assert_eq!(online(&index), None);
    }
}
