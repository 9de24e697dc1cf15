//! Planner benchmark: placement decisions per second of tidepool's per-node planner
//! ([`plan::place`]), next to the direct path: the aggregate-only check a scheduler makes when
//! it sees a virtual node as one big node (the gang's requests plus `used` within the
//! virtual node's allocatable). Same pools, same gangs, same run.
//!
//! ```text
//! cargo run --release -p tidepool-dispatcher --example planner_bench [-- <gangs> <seed>]
//! ```
//!
//! A program, not a test: it prints a table and asserts nothing about time (timed assertions
//! in tests only measure the machine they run on). Two runs per path:
//! - `snapshot`: every gang decided against the same pools, nothing committed: the raw
//!   decision rate.
//! - `sequential`: gangs decided in order, each admission committed, as one planning round
//!   of the controller; after each admission a simulated member scheduler binds the pods
//!   (largest first, best fit), and a gang it cannot bind whole is counted as `stranded`: a
//!   partial gang, the thing tidepool exists to prevent.
//!
//! Then topology: two pools of 500 nodes in 4 zones × 8 racks (`spec.pools[].topology`),
//! the same gangs decided by the topology-aware planner and by the same planner with the
//! topology left out (blind), counting the gangs each plan spreads over more than one rack.
//!
//! Then the native floor: 500 of the training cluster's own nodes and 4 members of 500 nodes
//! (racks as above); each gang keeps its core (4 pods) on the native nodes and places its
//! elastic part (4 pods) on one member pool (the pool chosen for its first elastic pod, the
//! others fitted there), against the same gangs placed whole on lent capacity.
//!
//! Inputs come from a seeded xorshift generator, so two runs with the same seed decide the
//! same gangs on the same pools.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tidepool_api::Resources;
use tidepool_dispatcher::gang::GangKey;
use tidepool_dispatcher::native_pool::NativePool;
use tidepool_dispatcher::plan::{self, GangDemand, PoolView};
use tidepool_federation::capacity::{GPU, NodeFree, NodeView};

const POOLS: usize = 10;
const PODS_PER_GANG: usize = 8;
const GPUS_PER_NODE: i64 = 8;
/// Each measurement is repeated and the median kept, so one scheduling hiccup of a shared
/// machine does not decide the number.
const REPEAT: usize = 5;
const GI: i64 = 1 << 30;

/// Marsaglia's xorshift64: enough randomness for test data, no dependency, fully seeded.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `0..n` (n > 0); the modulo bias is irrelevant at these sizes.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn res(gpus: i64, cpus: i64, memory_gi: i64) -> Resources {
    let mut r = Resources::new();
    r.set(GPU, gpus * 1000);
    r.set("cpu", cpus * 1000);
    r.set("memory", memory_gi * GI * 1000);
    r.set("pods", 1000);
    r
}

/// Ten pools of 16–64 member nodes with 8 GPUs, 128 cpu and 1Ti each, partly used by online
/// pods: a third of the nodes idle, a fifth full, the rest with 1–7 GPUs taken. Capacity is
/// the free sum minus a reserve of one node; two pools mix GPU models.
fn pools(rng: &mut XorShift) -> Vec<PoolView> {
    (0..POOLS)
        .map(|i| {
            let nodes = 16 + rng.below(49) as usize;
            let free_per_node: Vec<NodeFree> = (0..nodes)
                .map(|n| {
                    let used = match rng.below(10) {
                        0..=2 => 0,
                        3..=4 => GPUS_PER_NODE,
                        _ => 1 + rng.below(7) as i64,
                    };
                    let gpus = GPUS_PER_NODE - used;
                    let cpus = (128 - used * 14 - rng.below(8) as i64).max(0);
                    let memory = (1024 - used * 110 - rng.below(64) as i64).max(0);
                    let mut free = res(gpus, cpus, memory);
                    free.set("pods", 110_000);
                    NodeFree::new(format!("m{i}-node-{n}"), free)
                })
                .collect();
            let mut capacity = Resources::new();
            for f in &free_per_node {
                capacity.add(&f.free);
            }
            capacity.sub(&res(GPUS_PER_NODE, 128, 1024));
            capacity.clamp_non_negative();
            let (member, pool) = (i / 2, if i % 2 == 0 { "h100" } else { "h100b" });
            PoolView {
                node: format!("tidepool-m{member}-{pool}"),
                member: format!("m{member}"),
                pool: pool.to_owned(),
                capacity,
                used: Resources::new(),
                free_per_node,
                gpu_product: (i < 8).then(|| "NVIDIA-H100-80GB-HBM3".to_owned()),
                topology: Vec::new(),
                schedulable: true,
            }
        })
        .collect()
}

/// Gangs of 8 pods of 1, 2, 4 or 8 GPUs (12 cpu and 100Gi per GPU); one gang in five has a
/// GPU-less launcher pod in place of its first worker (the PyTorchJob master shape), so
/// unequal gangs exercise the exact search.
fn gangs(rng: &mut XorShift, n: usize) -> Vec<GangDemand> {
    (0..n)
        .map(|g| {
            let gpus = [1, 1, 2, 2, 4, 4, 8][rng.below(7) as usize];
            let mut pods = vec![res(gpus, gpus * 12, gpus * 100); PODS_PER_GANG];
            if rng.below(5) == 0 {
                pods[0] = res(0, 16, 64);
            }
            GangDemand {
                key: GangKey::annotation("bench", &format!("gang-{g:04}")),
                pods,
                pinned: None,
                constraints: vec![],
            }
        })
        .collect()
}

/// The direct path: the virtual node as one big node. Best fit on GPUs left, then name.
fn aggregate_place(gang: &GangDemand, pools: &[PoolView]) -> Option<usize> {
    let mut need = Resources::new();
    for p in &gang.pods {
        need.add(p);
    }
    let mut best: Option<(i64, usize)> = None;
    for (i, pool) in pools.iter().enumerate() {
        let fits = pool.schedulable
            && need.iter().all(|(name, amount)| pool.used.get(name).saturating_add(amount) <= pool.capacity.get(name));
        if !fits {
            continue;
        }
        let left = pool.capacity.get(GPU) - pool.used.get(GPU) - need.get(GPU);
        if best.is_none_or(|(l, b)| (left, &pool.node) < (l, &pools[b].node)) {
            best = Some((left, i));
        }
    }
    best.map(|(_, i)| i)
}

/// The member's scheduler binding the pods one by one (largest first, best fit). Pods that
/// find a node keep it even when others of the gang do not: returns whether all were bound.
fn member_binds(pool: &mut PoolView, pods: &[Resources]) -> bool {
    let mut order: Vec<&Resources> = pods.iter().collect();
    order.sort_by_key(|p| std::cmp::Reverse((p.get(GPU), p.get("cpu"), p.get("memory"))));
    let mut all = true;
    for pod in order {
        let node =
            (0..pool.free_per_node.len()).filter(|&n| pod.fits_in(&pool.free_per_node[n].free)).min_by_key(|&n| {
                let f = &pool.free_per_node[n].free;
                (f.get(GPU), f.get("cpu"), f.get("memory"), n)
            });
        match node {
            Some(n) => pool.free_per_node[n].free.sub(pod),
            None => all = false,
        }
        pool.used.add(pod);
    }
    all
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Tidepool,
    Aggregate,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Tidepool => "tidepool per-node planner",
            Path::Aggregate => "aggregate-only (direct path)",
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    placed: usize,
    refused: usize,
    stranded: usize,
    /// Time spent in the decision function only, per decision.
    decide: Vec<Duration>,
    /// The whole run, member simulation included.
    wall: Duration,
}

/// One run of one path; `commit` makes it sequential.
fn run(path: Path, gangs: &[GangDemand], initial: &[PoolView], commit: bool) -> Outcome {
    let start = Instant::now();
    let mut pools = initial.to_vec();
    let mut out = Outcome { decide: Vec::with_capacity(gangs.len()), ..Outcome::default() };
    for gang in gangs {
        let t = Instant::now();
        let chosen = match path {
            Path::Tidepool => plan::place(gang, &pools).ok().and_then(|p| pools.iter().position(|v| v.node == p.node)),
            Path::Aggregate => aggregate_place(gang, &pools),
        };
        out.decide.push(t.elapsed());
        let Some(i) = chosen else {
            out.refused += 1;
            continue;
        };
        out.placed += 1;
        if commit {
            if !member_binds(&mut pools[i], &gang.pods) {
                out.stranded += 1;
            }
        } else {
            let mut scratch = initial[i].clone();
            if !member_binds(&mut scratch, &gang.pods) {
                out.stranded += 1;
            }
        }
    }
    out.wall = start.elapsed();
    out
}

/// Median of `REPEAT` runs by decision time (the counts are the same in every run).
fn measure(path: Path, gangs: &[GangDemand], pools: &[PoolView], commit: bool) -> Outcome {
    let mut runs: Vec<Outcome> = (0..REPEAT).map(|_| run(path, gangs, pools, commit)).collect();
    runs.sort_by_key(|o| o.decide.iter().sum::<Duration>());
    runs.swap_remove(REPEAT / 2)
}

const TOPO_POOLS: usize = 2;
const TOPO_NODES: usize = 500;
const ZONES: usize = 4;
const RACKS_PER_ZONE: usize = 8;
const ZONE_KEY: &str = "topology.kubernetes.io/zone";
const RACK_KEY: &str = "example.com/rack";

/// The free capacity of one node of 8 GPUs, 128 cpu and 1Ti, used as in [`pools`]: a third
/// idle, a fifth full, the rest with 1–7 GPUs taken (with their share of cpu and memory).
fn node_free(rng: &mut XorShift) -> Resources {
    let used = match rng.below(10) {
        0..=2 => 0,
        3..=4 => GPUS_PER_NODE,
        _ => 1 + rng.below(7) as i64,
    };
    let mut free = res(GPUS_PER_NODE - used, 128 - used * 14, 1024 - used * 110);
    free.set("pods", 110_000);
    free
}

/// `count` pools of 500 member nodes (8 GPUs, 128 cpu, 1Ti each, used as in [`pools`]), the
/// nodes dealt in order over 4 zones × 8 racks of about 16 nodes.
fn topology_pools(rng: &mut XorShift, count: usize) -> Vec<PoolView> {
    (0..count)
        .map(|i| {
            let racks = ZONES * RACKS_PER_ZONE;
            let free_per_node: Vec<NodeFree> = (0..TOPO_NODES)
                .map(|n| {
                    let free = node_free(rng);
                    let rack = n * racks / TOPO_NODES;
                    let mut node = NodeFree::new(format!("t{i}-node-{n}"), free);
                    node.labels.insert(ZONE_KEY.to_owned(), format!("z{}", rack / RACKS_PER_ZONE));
                    node.labels.insert(RACK_KEY.to_owned(), format!("r{rack}"));
                    node
                })
                .collect();
            let mut capacity = Resources::new();
            for f in &free_per_node {
                capacity.add(&f.free);
            }
            PoolView {
                node: format!("tidepool-t{i}-racks"),
                member: format!("t{i}"),
                pool: "racks".to_owned(),
                capacity,
                used: Resources::new(),
                free_per_node,
                gpu_product: Some("NVIDIA-H100-80GB-HBM3".to_owned()),
                topology: vec![ZONE_KEY.to_owned(), RACK_KEY.to_owned()],
                schedulable: true,
            }
        })
        .collect()
}

#[derive(Debug, Default)]
struct TopologyOutcome {
    placed: usize,
    /// Gangs whose planned nodes lie in more than one rack.
    spread: usize,
    decide: Vec<Duration>,
}

/// Decides every gang on `initial` (the blind run: with the pools' topology left out, the
/// racks still counted); `commit` books each placement on the pools, as a round does.
fn run_topology(gangs: &[GangDemand], initial: &[PoolView], blind: bool, commit: bool) -> TopologyOutcome {
    let labelled = initial.to_vec();
    let mut pools = initial.to_vec();
    if blind {
        pools.iter_mut().for_each(|p| p.topology.clear());
    }
    let mut out = TopologyOutcome { decide: Vec::with_capacity(gangs.len()), ..TopologyOutcome::default() };
    for gang in gangs {
        let t = Instant::now();
        let placed = plan::place(gang, &pools);
        out.decide.push(t.elapsed());
        let Ok(p) = placed else { continue };
        out.placed += 1;
        let Some(i) = pools.iter().position(|v| v.node == p.node) else { continue };
        let racks: std::collections::BTreeSet<&String> =
            p.per_pod_member_node.iter().filter_map(|&n| labelled[i].free_per_node[n].labels.get(RACK_KEY)).collect();
        if racks.len() > 1 {
            out.spread += 1;
        }
        if commit {
            pools[i].reserve(&gang.pods, &p.per_pod_member_node);
        }
    }
    out
}

/// The topology table: decisions per second and gangs spread over racks, aware and blind.
fn topology_table(gangs: &[GangDemand], seed: u64) -> f64 {
    let mut rng = XorShift::new(seed ^ 0x7090);
    let pools = topology_pools(&mut rng, TOPO_POOLS);
    println!();
    println!(
        "topology: {} gangs, {TOPO_POOLS} pools x {TOPO_NODES} nodes in {ZONES} zones x {RACKS_PER_ZONE} racks \
         (topology [zone, rack]), median of {REPEAT} runs, single-threaded",
        gangs.len()
    );
    println!(
        "{:<11} {:<16} {:>9} {:>7} {:>18} {:>10} {:>12} {:>8} {:>8}",
        "run", "planner", "decisions", "placed", "spread over racks", "decide ms", "decisions/s", "p50 us", "p99 us"
    );
    let mut slowest = f64::INFINITY;
    for (name, commit) in [("snapshot", false), ("sequential", true)] {
        for (label, blind) in [("topology-aware", false), ("topology-blind", true)] {
            let runs = (0..REPEAT).map(|_| run_topology(gangs, &pools, blind, commit)).collect();
            let (o, sorted, decide, rate) = median_of(runs, |o| &o.decide);
            if !blind {
                slowest = slowest.min(rate);
            }
            println!(
                "{:<11} {:<16} {:>9} {:>7} {:>18} {:>10.1} {:>12.0} {:>8.1} {:>8.1}",
                name,
                label,
                sorted.len(),
                o.placed,
                o.spread,
                decide.as_secs_f64() * 1e3,
                rate,
                percentile(&sorted, 50).as_secs_f64() * 1e6,
                percentile(&sorted, 99).as_secs_f64() * 1e6,
            );
        }
    }
    println!("spread over racks: placed gangs whose planned nodes lie in more than one rack");
    slowest
}

/// Member pools and native nodes of the native-floor table.
const FLOOR_MEMBERS: usize = 4;
const FLOOR_NATIVE_NODES: usize = 500;
/// Core pods of each gang kept on the native nodes; the rest of its pods are elastic.
const FLOOR_CORE: usize = 4;

/// 500 training nodes, used as the member nodes of [`pools`] are.
fn native_nodes(rng: &mut XorShift) -> NativePool {
    let nodes = (0..FLOOR_NATIVE_NODES).map(|n| NodeView {
        name: format!("native-{n}"),
        ready: true,
        allocatable: node_free(rng),
        ..NodeView::default()
    });
    NativePool::new(nodes, &Default::default(), &[])
}

#[derive(Debug, Default)]
struct FloorOutcome {
    placed: usize,
    decide: Vec<Duration>,
}

/// One gang with a native floor: its core on the native nodes, whole or not at all, then its
/// elastic pods on the member pool chosen for the first of them. Books what it places when
/// `commit`. Whether the core was placed.
fn floor_decision(gang: &GangDemand, native: &mut NativePool, lent: &mut [PoolView], commit: bool) -> bool {
    let (core, elastic) = gang.pods.split_at(FLOOR_CORE.min(gang.pods.len()));
    let view = native.view_for(&vec![None; core.len()]);
    let demand = GangDemand { pods: core.to_vec(), ..gang.clone() };
    let Ok(placed) = plan::place(&demand, std::slice::from_ref(&view)) else { return false };
    if commit {
        for (pod, node) in core.iter().zip(&placed.planned_nodes) {
            native.reserve(node, pod);
        }
    }
    let Some((first, rest)) = elastic.split_first() else { return true };
    let one = GangDemand { pods: vec![first.clone()], ..gang.clone() };
    let Ok(pool) = plan::place_pool_wide(&one, lent) else { return true };
    let Some(i) = lent.iter().position(|v| v.node == pool.node) else { return true };
    let domain = plan::Domain::default();
    let mut admitted = vec![first.clone()];
    for pod in rest {
        if plan::fits_one(pod, &lent[i], &admitted, &domain) {
            admitted.push(pod.clone());
        }
    }
    if commit {
        lent[i].reserve(&admitted, &[]);
    }
    true
}

/// Every gang decided with its native floor (`floor`) or whole on lent capacity.
fn run_floor(gangs: &[GangDemand], native: &NativePool, lent: &[PoolView], floor: bool, commit: bool) -> FloorOutcome {
    let (mut native, mut lent) = (native.clone(), lent.to_vec());
    let mut out = FloorOutcome { decide: Vec::with_capacity(gangs.len()), ..FloorOutcome::default() };
    for gang in gangs {
        let t = Instant::now();
        let placed = if floor {
            floor_decision(gang, &mut native, &mut lent, commit)
        } else {
            match plan::place(gang, &lent) {
                Ok(p) => {
                    if commit && let Some(pool) = lent.iter_mut().find(|v| v.node == p.node) {
                        pool.reserve(&gang.pods, &p.per_pod_member_node);
                    }
                    true
                }
                Err(_) => false,
            }
        };
        out.decide.push(t.elapsed());
        out.placed += usize::from(placed);
    }
    out
}

/// The native-floor table: decisions per second with the core native and the elastic part
/// lent, against the same gangs all lent. The slowest native-floor rate.
fn floor_table(gangs: &[GangDemand], seed: u64) -> f64 {
    let mut rng = XorShift::new(seed ^ 0xf100);
    let native = native_nodes(&mut rng);
    let lent = topology_pools(&mut rng, FLOOR_MEMBERS);
    println!();
    println!(
        "native floor: {} gangs, {FLOOR_NATIVE_NODES} native nodes + {FLOOR_MEMBERS} members x {TOPO_NODES} nodes; \
         core {FLOOR_CORE} pods native, the rest lent on one pool; median of {REPEAT} runs, single-threaded",
        gangs.len()
    );
    println!(
        "{:<11} {:<22} {:>9} {:>7} {:>10} {:>12} {:>8} {:>8}",
        "run", "placement", "decisions", "placed", "decide ms", "decisions/s", "p50 us", "p99 us"
    );
    let mut slowest = f64::INFINITY;
    for (name, commit) in [("snapshot", false), ("sequential", true)] {
        for (label, floor) in [("native core + lent", true), ("all lent", false)] {
            let runs = (0..REPEAT).map(|_| run_floor(gangs, &native, &lent, floor, commit)).collect();
            let (o, sorted, decide, rate) = median_of(runs, |o| &o.decide);
            if floor {
                slowest = slowest.min(rate);
            }
            println!(
                "{:<11} {:<22} {:>9} {:>7} {:>10.1} {:>12.0} {:>8.1} {:>8.1}",
                name,
                label,
                sorted.len(),
                o.placed,
                decide.as_secs_f64() * 1e3,
                rate,
                percentile(&sorted, 50).as_secs_f64() * 1e6,
                percentile(&sorted, 99).as_secs_f64() * 1e6,
            );
        }
    }
    slowest
}

/// The run of `runs` with the median total decision time, with its decision times sorted,
/// their sum and the decisions per second.
fn median_of<T>(mut runs: Vec<T>, decide: impl Fn(&T) -> &Vec<Duration>) -> (T, Vec<Duration>, Duration, f64) {
    runs.sort_by_key(|o| decide(o).iter().sum::<Duration>());
    let o = runs.swap_remove(runs.len() / 2);
    let mut sorted = decide(&o).clone();
    sorted.sort();
    let total: Duration = sorted.iter().sum();
    let rate = sorted.len() as f64 / total.as_secs_f64().max(1e-9);
    (o, sorted, total, rate)
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) * p) / 100]
}

/// The first table: the 10 pools, snapshot and sequential, tidepool's planner against the
/// aggregate-only path; tidepool's slowest rate.
fn pool_table(gangs: &[GangDemand], pools: &[PoolView]) -> f64 {
    let mut tidepool_rate = f64::INFINITY;
    // A warm-up of each path (caches, allocator), then the scenarios with the path that goes
    // first alternating, so neither path always runs on a warmer machine.
    for path in [Path::Tidepool, Path::Aggregate] {
        let _ = measure(path, gangs, pools, false);
    }
    for (i, (name, commit)) in [("snapshot", false), ("sequential", true)].into_iter().enumerate() {
        let order = if i % 2 == 0 { [Path::Tidepool, Path::Aggregate] } else { [Path::Aggregate, Path::Tidepool] };
        for path in order {
            let o = measure(path, gangs, pools, commit);
            let mut sorted = o.decide.clone();
            sorted.sort();
            let decide: Duration = sorted.iter().sum();
            let rate = sorted.len() as f64 / decide.as_secs_f64().max(1e-9);
            if path == Path::Tidepool {
                tidepool_rate = tidepool_rate.min(rate);
            }
            println!(
                "{:<11} {:<29} {:>9} {:>7} {:>8} {:>9} {:>10.1} {:>12.0} {:>8.1} {:>8.1} {:>9.1}",
                name,
                path.label(),
                sorted.len(),
                o.placed,
                o.refused,
                o.stranded,
                decide.as_secs_f64() * 1e3,
                rate,
                percentile(&sorted, 50).as_secs_f64() * 1e6,
                percentile(&sorted, 99).as_secs_f64() * 1e6,
                o.wall.as_secs_f64() * 1e3,
            );
        }
    }
    tidepool_rate
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |i: usize, default: u64| args.get(i).map_or(Ok(default), |a| a.parse::<u64>());
    let (Ok(n), Ok(seed)) = (parse(0, 1000), parse(1, 42)) else {
        eprintln!("usage: planner_bench [gangs (default 1000)] [seed (default 42)]");
        return ExitCode::from(2);
    };
    let total = Instant::now();
    let mut rng = XorShift::new(seed);
    let pools = pools(&mut rng);
    let gangs = gangs(&mut rng, n as usize);

    let nodes: usize = pools.iter().map(|p| p.free_per_node.len()).sum();
    let free_gpus: i64 = pools.iter().flat_map(|p| &p.free_per_node).map(|f| f.free.get(GPU) / 1000).sum();
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    println!(
        "planner_bench: {n} gangs x {PODS_PER_GANG} pods, {POOLS} pools, {nodes} member nodes \
         (16-64 per pool, {GPUS_PER_NODE} GPUs each, {free_gpus} GPUs free), seed {seed}, \
         {cores} cores, median of {REPEAT} runs, single-threaded"
    );
    println!();
    println!(
        "{:<11} {:<29} {:>9} {:>7} {:>8} {:>9} {:>10} {:>12} {:>8} {:>8} {:>9}",
        "run",
        "path",
        "decisions",
        "placed",
        "refused",
        "stranded",
        "decide ms",
        "decisions/s",
        "p50 us",
        "p99 us",
        "wall ms"
    );
    let tidepool_rate = pool_table(&gangs, &pools);
    println!();
    println!("stranded: admitted, but the member scheduler cannot bind all {PODS_PER_GANG} pods (a partial gang)");
    println!(
        "goal (issue 5): >= 200 decisions/s on 2 cores; tidepool's slowest run: {tidepool_rate:.0} decisions/s ({})",
        if tidepool_rate >= 200.0 { "met" } else { "NOT met" }
    );
    let topology_rate = topology_table(&gangs, seed);
    println!(
        "goal (issue 16): >= 2000 decisions/s on one core with topology; slowest topology-aware run: \
         {topology_rate:.0} decisions/s ({})",
        if topology_rate >= 2000.0 { "met" } else { "NOT met" }
    );
    let floor_rate = floor_table(&gangs, seed);
    println!(
        "goal (issue 42): >= 2000 decisions/s on one core with native pools; slowest native-floor run: \
         {floor_rate:.0} decisions/s ({})",
        if floor_rate >= 2000.0 { "met" } else { "NOT met" }
    );
    println!("total wall time: {:.2} s", total.elapsed().as_secs_f64());
    ExitCode::SUCCESS
}
