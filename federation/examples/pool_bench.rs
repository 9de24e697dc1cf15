//! Pool computation benchmark: the cost of one capacity computation of a member's pool, as
//! tidepool's capacity publisher makes it ([`PoolModel`]: the nodes that changed since the
//! last computation are redone), next to the direct path: the same capacity recomputed from
//! every node and pod ([`pool_capacity_in`], the reference the model must equal). Same
//! nodes, same pods, same run.
//!
//! ```text
//! cargo run --release -p tidepool-federation --example pool_bench [-- <nodes> <pods per node>]
//! ```
//!
//! A program, not a test: it prints a table and asserts nothing about time. Each row is the
//! median of several repetitions of a batch of computations:
//! - `one node changed`: a node's allocatable moves between computations (a node joining or
//!   a kubelet re-reporting), the model redoes that node;
//! - `one pod changed`: an online pod on one node grows, the model redoes its node;
//! - `re-list`: every node counts as changed (after a watch re-lists);
//! - `direct`: every node and pod walked, whatever changed.
//!
//! Each computation's result is compared with the reference's once per batch, so a fast but
//! wrong model does not print a row.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tidepool_api::Resources;
use tidepool_api::crd::PoolMode;
use tidepool_federation::capacity::index::PodIndex;
use tidepool_federation::capacity::index::Touched;
use tidepool_federation::capacity::pool::PoolModel;
use tidepool_federation::capacity::{CapacityPolicy, NodeView, OnlineDemand, PodView, pool_capacity_in};

/// Computations per batch, and batches per row (the median is printed).
const BATCH: u32 = 200;
const REPEAT: usize = 5;

fn node(i: usize, cpu: i64) -> NodeView {
    let name = format!("bench-node-{i:05}");
    let mut labels = BTreeMap::new();
    // Labels a kwok or cloud node carries, which the pool selector reads past.
    for k in ["kubernetes.io/arch", "kubernetes.io/hostname", "kubernetes.io/os", "node.kubernetes.io/instance-type"] {
        labels.insert(k.to_owned(), format!("{name}-{k}"));
    }
    labels.insert("tidepool.io/bench".to_owned(), "capacity".to_owned());
    labels.insert("topology.kubernetes.io/zone".to_owned(), format!("zone-{}", i % 4));
    let mut allocatable = Resources::new();
    for (k, v) in [("cpu", cpu), ("memory", 256 << 30), ("pods", 110), ("ephemeral-storage", 100 << 30)] {
        allocatable.set(k, v * 1000);
    }
    NodeView { name, labels, ready: true, unschedulable: false, allocatable, taints: Vec::new(), pod_cidrs: Vec::new() }
}

fn pod(node: usize, cpu_milli: i64) -> PodView {
    let mut requests = Resources::new();
    requests.set("cpu", cpu_milli);
    requests.set("memory", 128 << 30);
    PodView { node: Some(format!("bench-node-{node:05}").into()), requests, ..Default::default() }
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[runs.len() / 2]
}

/// The median time of one computation over [`REPEAT`] batches of [`BATCH`]: `step` changes
/// something and computes.
fn time(mut step: impl FnMut(u32)) -> Duration {
    let runs = (0..REPEAT)
        .map(|_| {
            let started = Instant::now();
            for i in 0..BATCH {
                step(i);
            }
            started.elapsed() / BATCH
        })
        .collect();
    median(runs)
}

fn main() -> ExitCode {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (nodes_n, per_node) = (args.first().copied().unwrap_or(1000), args.get(1).copied().unwrap_or(10));
    let mut nodes: HashMap<String, NodeView> = (0..nodes_n).map(|i| node(i, 32)).map(|n| (n.name.clone(), n)).collect();
    let mut pods: HashMap<(String, String), PodView> = HashMap::new();
    let mut index = PodIndex::new([PoolMode::Requests], -100);
    for i in 0..nodes_n * per_node {
        let key = ("bench".to_owned(), format!("pod-{i}"));
        let view = pod(i % nodes_n, 100);
        index.change(&key, None, Some(&view));
        pods.insert(key, view);
    }
    let _ = index.take_touched();
    let policy = CapacityPolicy { watermark_percent: 90, ..Default::default() };
    let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::now() };
    let selector = BTreeMap::from([("tidepool.io/bench".to_owned(), "capacity".to_owned())]);
    let topology = vec!["topology.kubernetes.io/zone".to_owned()];
    let mut model = PoolModel::new(selector.clone(), Vec::new(), PoolMode::Requests, topology.clone());
    let mut all = Touched::default();
    all.note_all();
    model.catch_up(&all, &nodes, &index);

    let reference = |nodes: &HashMap<String, NodeView>, pods: &HashMap<(String, String), PodView>| {
        let mut c = pool_capacity_in(nodes.values(), pods.values(), &selector, &demand, PoolMode::Requests);
        c.label_topology(&topology, |name| nodes.get(name));
        c
    };
    if model.capacity(&demand, &nodes, &index) != reference(&nodes, &pods) {
        eprintln!("the model does not equal the reference after the first re-list");
        return ExitCode::FAILURE;
    }

    let mut rows: Vec<(&str, Duration)> = Vec::new();
    let one_node = time(|i| {
        let n = node(i as usize % nodes_n, 32 + i64::from(i % 2));
        let mut touched = Touched::default();
        touched.note(&n.name);
        nodes.insert(n.name.clone(), n);
        model.catch_up(&touched, &nodes, &index);
        black_box(model.capacity(&demand, &nodes, &index));
    });
    rows.push(("tidepool: one node changed", one_node));
    let one_pod = time(|i| {
        let key = ("bench".to_owned(), format!("pod-{}", i as usize % pods.len()));
        let new = pod(i as usize % nodes_n, 100 + i64::from(i % 2 + 1));
        index.change(&key, pods.get(&key), Some(&new));
        pods.insert(key, new);
        model.catch_up(&index.take_touched(), &nodes, &index);
        black_box(model.capacity(&demand, &nodes, &index));
    });
    rows.push(("tidepool: one pod changed", one_pod));
    let relist = time(|_| {
        model.catch_up(&all, &nodes, &index);
        black_box(model.capacity(&demand, &nodes, &index));
    });
    rows.push(("tidepool: re-list (every node redone)", relist));
    let direct = time(|_| {
        black_box(reference(&nodes, &pods));
    });
    rows.push(("direct: every node and pod walked", direct));
    if model.capacity(&demand, &nodes, &index) != reference(&nodes, &pods) {
        eprintln!("the model does not equal the reference after the timed changes");
        return ExitCode::FAILURE;
    }

    println!("## Pool computation: {nodes_n} nodes, {} pods (one pool, release build)\n", pods.len());
    println!("| computation | median time | vs direct |");
    println!("|---|---|---|");
    for (what, t) in rows {
        println!("| {what} | {:.1} µs | {:.3}× |", t.as_secs_f64() * 1e6, t.as_secs_f64() / direct.as_secs_f64());
    }
    ExitCode::SUCCESS
}
