//! Benchmark program (not a test): tidepool against the direct path, in one run, on the
//! local clusters. Prints tables; asserts nothing about speed.
//!
//! ```text
//! bash tests/controlplane/cluster.sh up /tmp/cp && TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench bridge
//! ```
//! Scenarios (sizes from the environment, defaults in brackets):
//! 1. burst: `BENCH_BURST` [1000] tiny pods created at once — through tidepool (training
//!    pods bound to the virtual node) and directly in the member — throughput until all run,
//!    create→Running p50/p99, status up-sync lag (member Running → training Running).
//! 2. paced: `BENCH_PACED` [100] pods at 5 pods/s, the same measures.
//!    For both, the API requests per pod that each apiserver counted while the run lasted
//!    (`apiserver_request_total` by verb and resource, read before and after).
//! 3. gangs of `BENCH_GANGS` [8,64,256] pods submitted with `schedulerName: tidepool`: submit
//!    → all offload pods created in the member, and submit → all Running, against the same
//!    pods created directly (and, split, submit → all placed, → all bound); every 100 ms the
//!    gang is sampled for a split (pods on two pools). `BENCH_GANG_ROUNDS` [BENCH_ROUNDS]
//!    rounds per size after a warm-up round. Then the CPU seconds per pod, submit → all
//!    Running, of every process of the clusters (their `pids` file) and tidepool, both paths.
//!    Each scenario: a warm-up round (not counted), then `BENCH_ROUNDS` [3] rounds, the two
//!    paths alternating which goes first; tables give the median (min–max) over the rounds.
//! 4. tidepool's resident memory idle, after each scenario, and with `BENCH_MEMORY_PODS`
//!    [1000,10000] mirrored pods all Running, then again `BENCH_MEMORY_SETTLE` [100] s later
//!    (0: not); with its anonymous and file-backed parts, and the growth per mirrored pod.
//!
//! The member gets `BENCH_NODES` [11] extra kwok nodes of 1,000 pods each for the run, and
//! tidepool a member rate limit of `BENCH_MEMBER_QPS` [200] calls/s (0: the default, 50).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "cluster.rs"]
mod cluster;
#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "stats.rs"]
mod stats;
use cluster::*;
use stats::*;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness::*;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::keys;

const TEST: &str = "bench";
const NS: &str = "bench";
/// The direct path\'s pods in the member: a namespace of the member\'s own, apart from the
/// one tidepool makes for NS (same-named, the default), which it would never share.
const DIRECT_NS: &str = "bench-direct";

/// First time each pod was seen (created) and seen Running, by name.
#[derive(Default)]
struct Seen {
    created: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
    node: HashMap<String, String>,
    /// First time the pod was seen with the dispatcher's placement annotation.
    placed: HashMap<String, Instant>,
    /// First time the pod was seen bound to a node.
    bound: HashMap<String, Instant>,
}

fn observe(client: Client, ns: &str) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    let api = Api::<Pod>::namespaced(client, ns);
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
        while let Some(Ok(p)) = events.next().await {
            let now = Instant::now();
            let mut s = s.lock().unwrap();
            let name = p.name_any();
            s.created.entry(name.clone()).or_insert(now);
            if p.annotations().contains_key(keys::ANNOTATION_PLACEMENT) {
                s.placed.entry(name.clone()).or_insert(now);
            }
            if let Some(n) = p.spec.as_ref().and_then(|sp| sp.node_name.clone()) {
                s.bound.entry(name.clone()).or_insert(now);
                s.node.insert(name.clone(), n);
            }
            if p.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Running") {
                s.running.entry(name).or_insert(now);
            }
        }
    });
    seen
}

fn pod(name: &str, spec_extra: serde_json::Value, meta: serde_json::Value) -> Pod {
    let mut v = json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}]}
    });
    for (k, val) in spec_extra.as_object().unwrap() {
        v["spec"][k] = val.clone();
    }
    for (k, val) in meta.as_object().unwrap() {
        v["metadata"][k] = val.clone();
    }
    serde_json::from_value(v).unwrap()
}

async fn wait_all(seen: &Arc<Mutex<Seen>>, names: &[String], running: bool, timeout: Duration) -> Option<Instant> {
    wait_all_in(seen, names, if running { Seen::running } else { Seen::created }, timeout).await
}

impl Seen {
    fn created(&self) -> &HashMap<String, Instant> {
        &self.created
    }

    fn running(&self) -> &HashMap<String, Instant> {
        &self.running
    }

    fn placed(&self) -> &HashMap<String, Instant> {
        &self.placed
    }

    fn bound(&self) -> &HashMap<String, Instant> {
        &self.bound
    }
}

/// When every pod of `names` is in the map `of` picks (the latest of their times), or `None`
/// after `timeout`.
async fn wait_all_in(
    seen: &Arc<Mutex<Seen>>,
    names: &[String],
    of: fn(&Seen) -> &HashMap<String, Instant>,
    timeout: Duration,
) -> Option<Instant> {
    let start = Instant::now();
    loop {
        {
            let s = seen.lock().unwrap();
            let map = of(&s);
            if names.iter().all(|n| map.contains_key(n)) {
                return names.iter().filter_map(|n| map.get(n).copied()).max();
            }
        }
        if start.elapsed() > timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn delete_pods(api: &Api<Pod>) {
    let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for i in 0..3000 {
        // Again every 10 s: a collection of thousands of pods can outlast the request's
        // timeout, which leaves the rest in place.
        if i % 100 == 0 {
            let _ = api.delete_collection(&dp, &ListParams::default()).await;
        }
        if api.list(&ListParams::default().limit(1)).await.map(|l| l.items.is_empty()).unwrap_or(false) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `api` lists no pods (tidepool deleting offload copies).
async fn wait_empty(api: &Api<Pod>) {
    for _ in 0..3000 {
        if api.list(&ListParams::default().limit(1)).await.map(|l| l.items.is_empty()).unwrap_or(false) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member, DIRECT_NS).await;
    let direct_api = Api::<Pod>::namespaced(member.clone(), DIRECT_NS);
    delete_pods(&direct_api).await;
    // The offload namespace is tidepool's to create (it puts nothing in one it did not make):
    // one left by an earlier run is emptied, one made by anyone else goes.
    let offload_ns = offload_ns(NS);
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(member.clone());
    if let Some(ns) = namespaces.get_opt(&offload_ns).await.unwrap() {
        if ns.metadata.labels.unwrap_or_default().contains_key(keys::LABEL_MANAGED_BY) {
            delete_pods(&Api::<Pod>::namespaced(member.clone(), &offload_ns)).await;
        } else {
            let _ = namespaces.delete(&offload_ns, &DeleteParams::default()).await;
            wait_for(Duration::from_secs(120), "a foreign offload namespace gone", || {
                let (namespaces, offload_ns) = (namespaces.clone(), offload_ns.clone());
                async move { namespaces.get_opt(&offload_ns).await.ok()?.is_none().then_some(()) }
            })
            .await;
        }
    }
    let bench_nodes = add_bench_nodes(&member, env_usize("BENCH_NODES", 11)).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    apply_member(&training, "bench-a", TEST, NS, "member-a").await;
    set_member_qps(&training, "bench-a").await;
    // `BENCH_SHARDED=1`: the member owned by a replica that does not run the dispatcher; the
    // memory readings are the owner's.
    // `BENCH_DISPATCHER`: dispatcher settings for tidepool (e.g. `gangAdmission: Complete`).
    let dispatcher = std::env::var("BENCH_DISPATCHER").unwrap_or_default();
    if !dispatcher.is_empty() {
        println!("dispatcher settings: {dispatcher}");
    }
    let (replicas, owner) = if bench_sharded() {
        let sharded = Sharded::start(&env, &training, (TEST, NS), &dispatcher, "bench-a").await;
        (sharded.replicas, sharded.owner)
    } else {
        (vec![Tidepool::start_with(&env, TEST, NS, &dispatcher)], 0)
    };
    let tp = &replicas[owner];
    let node = "tidepool-bench-a";
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(node).await.ok().flatten().map(|_| ()) }
    })
    .await;
    // Let every watch list before the idle reading.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pid = tp.pid();
    let mut memory = vec![("idle, 0 pods".to_string(), Rss::of(pid))];
    let training_pods = Api::<Pod>::namespaced(training.clone(), NS);
    let bench = Bench { env: &env, training: training.clone(), member: member.clone(), node, offload_ns: &offload_ns };

    // 1. Burst, then 2. a steady 5 pods/s: each through tidepool and directly, in a warm-up
    //    round (not counted) and then BENCH_ROUNDS rounds whose order alternates (A/B, B/A,
    //    …), so neither path always runs on a machine the other has just warmed or loaded.
    let burst = env_usize("BENCH_BURST", 1000);
    let paced = env_usize("BENCH_PACED", 100);
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let mut runs: Vec<(&str, usize, Path, Vec<Run>)> = Vec::new();
    let offload_api = Api::<Pod>::namespaced(member.clone(), &offload_ns);
    for (scenario, n, every) in [("burst", burst, None), ("paced", paced, Some(Duration::from_millis(200)))] {
        if n == 0 {
            continue;
        }
        let mut measured: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
        for round in 0..=rounds {
            let order = if round % 2 == 1 { [Path::Tidepool, Path::Direct] } else { [Path::Direct, Path::Tidepool] };
            for path in order {
                let run = bench.run(path, scenario, n, every).await;
                eprintln!(
                    "{scenario} round {round}{} {}: {:.2} s",
                    if round == 0 { " (warm-up)" } else { "" },
                    path.label(),
                    run.total
                );
                if path == Path::Tidepool && scenario == "burst" && round == 1 {
                    memory.push((format!("after a burst of {n} mirrored pods"), Rss::of(pid)));
                }
                match path {
                    Path::Tidepool => {
                        delete_pods(&training_pods).await;
                        // The next run's request counts must not include this run's clean-up.
                        wait_empty(&offload_api).await;
                    }
                    Path::Direct => delete_pods(&direct_api).await,
                }
                if round > 0 {
                    measured.entry(path.label()).or_default().push(run);
                }
            }
        }
        for path in [Path::Tidepool, Path::Direct] {
            runs.push((scenario, n, path, measured.remove(path.label()).unwrap_or_default()));
        }
    }
    print_runs(&runs, rounds);

    // 3. Gangs through the dispatcher.
    let gangs: Vec<usize> = std::env::var("BENCH_GANGS")
        .unwrap_or_else(|_| "8,64,256".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    if !gangs.is_empty() {
        let mut procs = cluster_processes(&env);
        procs.push(("tidepool".to_string(), pid));
        gang_runs(&training, &member, &gangs, &offload_ns, &procs).await;
        memory.push(("after the gang runs (all deleted)".to_string(), Rss::of(pid)));
    }

    // 4. Memory with many mirrored pods: tiny pods bound to the virtual node, all Running.
    let steps: Vec<usize> = std::env::var("BENCH_MEMORY_PODS")
        .unwrap_or_else(|_| "1000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    // (pods, index into `memory`) of each step reached: the growth per pod is printed below.
    let mut per_pod: Vec<(usize, usize)> = Vec::new();
    if !steps.is_empty() {
        let seen = observe(training.clone(), NS);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut made = 0usize;
        for target in steps.iter().copied() {
            let names: Vec<String> = (made..target).map(|i| format!("mem-{i}")).collect();
            let start = Instant::now();
            create_all(&training_pods, &names, Some(node), None).await;
            let all: Vec<String> = (0..target).map(|i| format!("mem-{i}")).collect();
            let Some(done) = wait_all(&seen, &all, true, Duration::from_secs(1800)).await else {
                let running = seen.lock().unwrap().running.len();
                memory.push((
                    format!("{running} of {target} mirrored pods Running after 1800 s (gave up)"),
                    Rss::of(pid),
                ));
                break;
            };
            made = target;
            tokio::time::sleep(Duration::from_secs(3)).await;
            memory.push((
                format!(
                    "{target} mirrored pods, all Running ({} new in {:.0} s)",
                    names.len(),
                    (done - start).as_secs_f64()
                ),
                Rss::of(pid),
            ));
            per_pod.push((target, memory.len() - 1));
        }
        // The same pods once the burst's leftovers are gone: idle pooled connections close
        // after 90 s, and the allocator has had time to return what it purges.
        let settle = env_usize("BENCH_MEMORY_SETTLE", 100);
        if let Some(&(pods, _)) = per_pod.last().filter(|_| settle > 0) {
            tokio::time::sleep(Duration::from_secs(settle as u64)).await;
            memory.push((format!("{pods} mirrored pods, {settle} s later"), Rss::of(pid)));
            per_pod.push((pods, memory.len() - 1));
        }
        delete_pods(&training_pods).await;
    }

    print_memory(&memory, &per_pod);
    Api::<tidepool_api::MemberCluster>::all(training.clone())
        .delete("bench-a", &DeleteParams::default())
        .await
        .unwrap();
    drop(replicas);
    remove_bench_nodes(&member, &bench_nodes).await;
}

/// The RSS table, then the growth per mirrored pod from the idle reading to each step: in
/// all, and in anonymous memory alone (the file-backed part is mostly code paged in the first
/// time a path runs, which does not grow with the number of pods).
fn print_memory(memory: &[(String, Rss)], per_pod: &[(usize, usize)]) {
    println!("\n## tidepool resident memory (VmRSS)\n");
    println!("| moment | RSS (MiB) | anonymous (MiB) | file-backed (MiB) |");
    println!("|---|---|---|---|");
    for (when, rss) in memory {
        println!("| {when} | {:.1} | {:.1} | {:.1} |", rss.total, rss.anon, rss.file);
    }
    let Some((_, idle)) = memory.first() else { return };
    for &(pods, at) in per_pod {
        let rss = memory[at].1;
        let kib = |from: f64, to: f64| (to - from) * 1024.0 / pods as f64;
        println!(
            "\ngrowth from idle to \"{}\": {:.1} KiB RSS per pod ({:.1} KiB anonymous, {:+.1} MiB file-backed in all)",
            memory[at].0,
            kib(idle.total, rss.total),
            kib(idle.anon, rss.anon),
            rss.file - idle.file
        );
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Tidepool,
    Direct,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Tidepool => "tidepool",
            Path::Direct => "direct",
        }
    }
}

struct Bench<'a> {
    env: &'a Env,
    training: Client,
    member: Client,
    node: &'a str,
    offload_ns: &'a str,
}

/// What one run of one path measured.
struct Run {
    /// Submit of the first pod → the last pod Running.
    total: f64,
    /// Per pod: its create call → it is seen Running (where it was submitted).
    latency: Vec<f64>,
    /// Tidepool only: member copy Running → training pod Running.
    lag: Vec<f64>,
    /// API requests per pod, by (cluster, verb, resource), while the run lasted.
    calls: BTreeMap<(String, String, String), f64>,
}

impl Bench<'_> {
    async fn run(&self, path: Path, scenario: &str, n: usize, every: Option<Duration>) -> Run {
        let (api, seen) = match path {
            Path::Tidepool => (Api::<Pod>::namespaced(self.training.clone(), NS), observe(self.training.clone(), NS)),
            Path::Direct => {
                (Api::<Pod>::namespaced(self.member.clone(), DIRECT_NS), observe(self.member.clone(), DIRECT_NS))
            }
        };
        let offload_seen = observe(self.member.clone(), self.offload_ns);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let names: Vec<String> = (0..n).map(|i| format!("{scenario}-{}-{i}", path.label())).collect();
        // (Each run's pods are deleted before the next: the names repeat across rounds.)
        let before = (request_counts(self.env, "training"), request_counts(self.env, "member-a"));
        let start = Instant::now();
        let node = (path == Path::Tidepool).then_some(self.node);
        let submitted = create_all(&api, &names, node, every).await;
        let done = wait_all(&seen, &names, true, Duration::from_secs(900)).await.expect("pods did not all run");
        let after = (request_counts(self.env, "training"), request_counts(self.env, "member-a"));
        let mut calls = BTreeMap::new();
        for (cluster, b, a) in [("training", &before.0, &after.0), ("member", &before.1, &after.1)] {
            for (key, v) in a {
                let d = v - b.get(key).copied().unwrap_or(0.0);
                if d > 0.0 {
                    calls.insert((cluster.to_string(), key.0.clone(), key.1.clone()), d / n as f64);
                }
            }
        }
        let (s, o) = (seen.lock().unwrap(), offload_seen.lock().unwrap());
        let mut latency: Vec<f64> =
            names.iter().map(|nm| s.running[nm].duration_since(submitted[nm]).as_secs_f64()).collect();
        latency.sort_by(f64::total_cmp);
        let mut lag: Vec<f64> = names
            .iter()
            .filter_map(|nm| Some(s.running.get(nm)?.saturating_duration_since(*o.running.get(nm)?).as_secs_f64()))
            .collect();
        lag.sort_by(f64::total_cmp);
        Run { total: done.duration_since(start).as_secs_f64(), latency, lag, calls }
    }
}

/// Median of `v` (the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `median (min–max)` of one measure over the rounds.
fn spread(v: &[f64], digits: usize) -> String {
    let (min, max) = v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(*x), b.max(*x)));
    if v.is_empty() {
        return "–".to_owned();
    }
    format!("{:.digits$} ({min:.digits$}–{max:.digits$})", median(v))
}

/// The API rows the bridge's claims are about: printed whatever they measure (a 0 is a
/// measurement, not a row to leave out).
const CLAIMED: [(&str, &str, &str); 6] = [
    ("member", "POST", "pods"),
    ("member", "GET", "pods"),
    ("member", "LIST", "pods"),
    ("member", "WATCH", "pods"),
    ("training", "PATCH", "pods/status"),
    ("training", "POST", "events"),
];

fn print_runs(runs: &[(&str, usize, Path, Vec<Run>)], rounds: usize) {
    println!(
        "\n## Pod sync: tidepool (training pods bound to the virtual node) vs direct (the same pods created in the member)\n"
    );
    println!(
        "Median (min–max) over {rounds} round(s) after a warm-up round; the order of the two paths alternates from round to round.\n"
    );
    println!(
        "| scenario | path | all Running after (s) | throughput (pods/s) | create→Running p50 (s) | p99 (s) | status up-sync p50 (s) | p99 (s) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let of = |rs: &[Run], f: &dyn Fn(&Run) -> f64| rs.iter().map(f).collect::<Vec<f64>>();
    for (scenario, n, path, rs) in runs {
        let lag = if rs.iter().all(|r| r.lag.is_empty()) {
            "– | –".to_string()
        } else {
            format!("{} | {}", spread(&of(rs, &|r| pct(&r.lag, 0.5)), 3), spread(&of(rs, &|r| pct(&r.lag, 0.99)), 3))
        };
        println!(
            "| {scenario} {n} | {} | {} | {} | {} | {} | {lag} |",
            path.label(),
            spread(&of(rs, &|r| r.total), 2),
            spread(&of(rs, &|r| *n as f64 / r.total), 1),
            spread(&of(rs, &|r| pct(&r.latency, 0.5)), 3),
            spread(&of(rs, &|r| pct(&r.latency, 0.99)), 3),
        );
    }
    for scenario in ["burst", "paced"] {
        let find = |p: Path| runs.iter().find(|r| r.0 == scenario && r.2 == p).map(|r| &r.3);
        if let (Some(t), Some(d)) = (find(Path::Tidepool), find(Path::Direct)) {
            let ratios: Vec<f64> = t.iter().zip(d).map(|(t, d)| d.total / t.total).collect();
            let added =
                |p: f64| t.iter().zip(d).map(|(t, d)| pct(&t.latency, p) - pct(&d.latency, p)).collect::<Vec<_>>();
            println!(
                "\n{scenario}: throughput ratio tidepool/direct {} (per round: the pair run in that round); added create→Running p50 {} s, p99 {} s",
                spread(&ratios, 2),
                spread(&added(0.5), 3),
                spread(&added(0.99), 3)
            );
        }
    }
    println!("\n## API requests per pod while a run lasted (apiserver_request_total, all clients)\n");
    println!(
        "Median over the rounds. In the direct path the member requests are the benchmark's create, the member scheduler's binding and kwok's status writes; what the tidepool path adds on top is tidepool's. Every row either path counted is printed, and the claimed rows even at 0.\n"
    );
    println!("| scenario | cluster | verb | resource | tidepool path | direct path | added by tidepool |");
    println!("|---|---|---|---|---|---|---|");
    for scenario in ["burst", "paced"] {
        let find = |p: Path| runs.iter().find(|r| r.0 == scenario && r.2 == p).map(|r| &r.3);
        let (Some(t), Some(d)) = (find(Path::Tidepool), find(Path::Direct)) else { continue };
        let claimed = CLAIMED.iter().map(|(c, v, r)| ((*c).to_owned(), (*v).to_owned(), (*r).to_owned()));
        let keys: BTreeSet<(String, String, String)> =
            t.iter().chain(d).flat_map(|r| r.calls.keys().cloned()).chain(claimed).collect();
        for k in keys {
            let per =
                |rs: &[Run]| median(&rs.iter().map(|r| r.calls.get(&k).copied().unwrap_or(0.0)).collect::<Vec<_>>());
            let (tv, dv) = (per(t), per(d));
            println!("| {scenario} | {} | {} | {} | {tv:.2} | {dv:.2} | {:+.2} |", k.0, k.1, k.2, tv - dv);
        }
    }
}

/// Creates the pods (bound to `node` when given), 32 at a time, or one every `every`; returns
/// when each create call was made.
async fn create_all(
    api: &Api<Pod>,
    names: &[String],
    node: Option<&str>,
    every: Option<Duration>,
) -> HashMap<String, Instant> {
    let spec = match node {
        Some(node) => json!({"nodeName": node, "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}]}),
        None => json!({}),
    };
    let make = |name: String| {
        let (api, spec) = (api.clone(), spec.clone());
        async move {
            let t = Instant::now();
            api.create(&PostParams::default(), &pod(&name, spec, json!({}))).await.unwrap();
            (name, t)
        }
    };
    match every {
        None => futures::stream::iter(names.iter().cloned()).map(make).buffer_unordered(32).collect().await,
        Some(every) => {
            let mut tasks = Vec::new();
            let mut tick = tokio::time::interval(every);
            for name in names {
                tick.tick().await;
                tasks.push(tokio::spawn(make(name.clone())));
            }
            futures::future::join_all(tasks).await.into_iter().map(Result::unwrap).collect()
        }
    }
}

/// What one gang through the dispatcher measured (seconds from the first submit).
struct GangRun {
    /// The tenant's last create answered; all placed (annotation seen), all bound, all copies
    /// created in the member, all Running.
    submitted: f64,
    placed: f64,
    bound: f64,
    created: f64,
    running: f64,
    samples: u32,
    split: u32,
    /// CPU seconds of every cluster process and tidepool, submit → all Running.
    cpu: CpuSpent,
}

async fn gang_runs(training: &Client, member: &Client, sizes: &[usize], offload_ns: &str, procs: &[(String, u32)]) {
    let training_pods = Api::<Pod>::namespaced(training.clone(), NS);
    let direct_api = Api::<Pod>::namespaced(member.clone(), DIRECT_NS);
    let rounds = env_usize("BENCH_GANG_ROUNDS", env_usize("BENCH_ROUNDS", 3)).max(1);
    println!("\n## Gangs through the dispatcher vs the same pods created directly\n");
    println!(
        "Median (min–max) over {rounds} round(s) per size after a warm-up round; the path that goes first alternates from round to round. The split columns: tidepool submit → the tenant's last create answered, → all pods placed (annotation), → all bound, → all copies created in the member.\n"
    );
    println!(
        "| gang | tidepool submit→all created in member (s) | direct submit→all created (s) | ratio | tidepool submit→all Running (s) | direct submit→all Running (s) | tidepool submit→all submitted / placed / bound (s) | split samples (every 100 ms) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut cpus = Vec::new();
    for &size in sizes {
        let names: Vec<String> = (0..size).map(|i| format!("g{size}-{i}")).collect();
        let (mut t, mut d) = (Vec::new(), Vec::new());
        for round in 0..=rounds {
            let (tidepool, direct) = if round % 2 == 0 {
                let first = gang_through_tidepool(training, member, &training_pods, &names, offload_ns, procs).await;
                (first, gang_direct(member, &direct_api, &names, procs).await)
            } else {
                let first = gang_direct(member, &direct_api, &names, procs).await;
                (gang_through_tidepool(training, member, &training_pods, &names, offload_ns, procs).await, first)
            };
            eprintln!(
                "gang {size} round {round}{}: tidepool created {:.2} s (submitted {:.2}, placed {:.2}, bound {:.2}), direct {:.2} s",
                if round == 0 { " (warm-up)" } else { "" },
                tidepool.created,
                tidepool.submitted,
                tidepool.placed,
                tidepool.bound,
                direct.0
            );
            if round > 0 {
                t.push(tidepool);
                d.push(direct);
            }
        }
        let of = |f: &dyn Fn(&GangRun) -> f64| t.iter().map(f).collect::<Vec<f64>>();
        let ratios: Vec<f64> = t.iter().zip(&d).map(|(t, d)| t.created / d.0).collect();
        let (samples, split) = t.iter().fold((0, 0), |(a, b), r| (a + r.samples, b + r.split));
        println!(
            "| {size} | {} | {} | {} | {} | {} | {} / {} / {} | {split} of {samples} |",
            spread(&of(&|r| r.created), 2),
            spread(&d.iter().map(|d| d.0).collect::<Vec<_>>(), 2),
            spread(&ratios, 2),
            spread(&of(&|r| r.running), 2),
            spread(&d.iter().map(|d| d.1).collect::<Vec<_>>(), 2),
            spread(&of(&|r| r.submitted), 2),
            spread(&of(&|r| r.placed), 2),
            spread(&of(&|r| r.bound), 2),
        );
        cpus.push((size, t.into_iter().map(|r| r.cpu).collect(), d.into_iter().map(|d| d.2).collect()));
    }
    print_gang_cpu(&cpus);
}

/// Per gang size, each process's CPU seconds per pod (median over the rounds, submit → all
/// Running) on both paths, and their sum; the processes under 0.05 ms a pod on both paths
/// are summed in one row.
fn print_gang_cpu(cpus: &[(usize, Vec<CpuSpent>, Vec<CpuSpent>)]) {
    println!("\n### CPU seconds per pod, submit → all Running (median over the rounds)\n");
    println!("| gang | process | tidepool path | direct path |");
    println!("|---|---|---:|---:|");
    for (size, t, d) in cpus {
        let names: BTreeSet<&String> = t.iter().chain(d).flat_map(|r| r.keys()).collect();
        let per_pod = |runs: &[CpuSpent], name: &str| {
            median(&runs.iter().map(|r| r.get(name).copied().unwrap_or(0.0)).collect::<Vec<_>>()) / *size as f64
        };
        let (mut t_sum, mut d_sum, mut rest) = (0.0, 0.0, (0, 0.0, 0.0));
        for name in names {
            let (tp, dp) = (per_pod(t, name), per_pod(d, name));
            (t_sum, d_sum) = (t_sum + tp, d_sum + dp);
            if tp.max(dp) < 0.00005 {
                rest = (rest.0 + 1, rest.1 + tp, rest.2 + dp);
                continue;
            }
            println!("| {size} | {name} | {tp:.4} | {dp:.4} |");
        }
        println!("| {size} | {} others | {:.4} | {:.4} |", rest.0, rest.1, rest.2);
        println!("| {size} | **all** | **{t_sum:.4}** | **{d_sum:.4}** |");
    }
}

/// One gang submitted to the dispatcher: seconds to all placed, bound, created in the
/// member and Running, and (samples, samples that saw the gang on two pools).
async fn gang_through_tidepool(
    training: &Client,
    member: &Client,
    training_pods: &Api<Pod>,
    names: &[String],
    offload_ns: &str,
    procs: &[(String, u32)],
) -> GangRun {
    let offload_seen = observe(member.clone(), offload_ns);
    let training_seen = observe(training.clone(), NS);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gang = names.first().and_then(|n| n.split_once('-')).map(|(g, _)| g.to_owned()).unwrap_or_default();
    let meta =
        json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: names.len().to_string()}});
    let spec = json!({"schedulerName": scheduler_name(TEST)});
    let splits = Arc::new(Mutex::new((0u32, 0u32)));
    let stop = tokio_util::sync::CancellationToken::new();
    {
        let (seen, splits, stop, names) = (training_seen.clone(), splits.clone(), stop.clone(), names.to_vec());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                {
                    let s = seen.lock().unwrap();
                    let pools: BTreeSet<&String> = names.iter().filter_map(|n| s.node.get(n)).collect();
                    let mut c = splits.lock().unwrap();
                    c.0 += 1;
                    if pools.len() > 1 {
                        c.1 += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    let cpu = CpuMeter::start(procs);
    let start = Instant::now();
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    eprintln!(
        "gang of {} submitted from {:.3} (Unix seconds; tidepool's log is in UTC)",
        names.len(),
        wall.as_secs_f64()
    );
    futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let (api, spec, meta) = (training_pods.clone(), spec.clone(), meta.clone());
            async move { api.create(&PostParams::default(), &pod(&name, spec, meta)).await.unwrap() }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let submitted = start.elapsed().as_secs_f64();
    let created = wait_all(&offload_seen, names, false, Duration::from_secs(600)).await.expect("gang not created");
    let running = wait_all(&training_seen, names, true, Duration::from_secs(600)).await.expect("gang not running");
    let cpu = cpu.spent();
    let placed = wait_all_in(&training_seen, names, Seen::placed, Duration::from_secs(10)).await;
    let bound = wait_all_in(&training_seen, names, Seen::bound, Duration::from_secs(10)).await;
    stop.cancel();
    let (samples, split) = *splits.lock().unwrap();
    delete_pods(training_pods).await;
    wait_empty(&Api::<Pod>::namespaced(member.clone(), offload_ns)).await;
    let secs = |t: Option<Instant>| t.map_or(f64::NAN, |t| t.duration_since(start).as_secs_f64());
    GangRun {
        submitted,
        placed: secs(placed),
        bound: secs(bound),
        created: secs(Some(created)),
        running: secs(Some(running)),
        samples,
        split,
        cpu,
    }
}

/// The same pods created directly in the member: seconds to all created and to all Running,
/// and every process's CPU seconds until then.
async fn gang_direct(
    member: &Client,
    direct_api: &Api<Pod>,
    names: &[String],
    procs: &[(String, u32)],
) -> (f64, f64, CpuSpent) {
    let direct_seen = observe(member.clone(), DIRECT_NS);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu = CpuMeter::start(procs);
    let start = Instant::now();
    futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let api = direct_api.clone();
            async move { api.create(&PostParams::default(), &pod(&name, json!({}), json!({}))).await.unwrap() }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let created = wait_all(&direct_seen, names, false, Duration::from_secs(600)).await.expect("direct not created");
    let running = wait_all(&direct_seen, names, true, Duration::from_secs(600)).await.expect("direct not running");
    let cpu = cpu.spent();
    delete_pods(direct_api).await;
    (created.duration_since(start).as_secs_f64(), running.duration_since(start).as_secs_f64(), cpu)
}
