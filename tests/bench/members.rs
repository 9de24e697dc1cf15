//! Benchmark program (not a test): how tidepool's cost grows with the number of members it
//! bridges. Prints tables; asserts nothing about speed.
//!
//! ```text
//! bash tests/controlplane/cluster.sh up /tmp/cp && TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench members
//! ```
//! 1. `tests/controlplane/members.sh` starts `BENCH_MEMBERS` [8] light member control planes
//!    (real kube-apiserver, KCM, scheduler on one etcd; kwok nodes, `BENCH_MEMBER_NODES` [4]
//!    each) at port offset `BENCH_MEMBERS_OFFSET` [the cluster set's + 3], and stops them by
//!    their recorded PIDs at the end. `BENCH_MEMBERS_ENV` names the members.env of members
//!    already up instead (they are then left running).
//! 2. For each size of `BENCH_SIZES` [1,2,4,all]: one release `tidepool run` bridging the first
//!    k members (a MemberCluster and kubeconfig Secret each), and, once every virtual node is
//!    Ready:
//!    - over `BENCH_IDLE_SECS` [20] s idle: tidepool CPU (utime+stime from /proc), RSS, API
//!      requests per member per second (its own `tidepool_api_requests_total`), open watches
//!      on each member and the training cluster (`apiserver_longrunning_requests`, WATCH,
//!      minus the count before tidepool ran), the dispatcher pass time
//!      (`tidepool_sync_duration_seconds{controller="dispatch"}`);
//!    - capacity freshness: `BENCH_FRESH` [16] member node allocatable changes, spread over
//!      the members, each timed until the virtual node's allocatable changes;
//!    - a burst of `BENCH_BURST` [400] tiny pods spread over the k members: created directly
//!      in the members (the direct path), then through tidepool (training pods bound to the
//!      virtual nodes), each until all are Running; tidepool's CPU and dispatcher passes
//!      during its burst.
//! 3. Tables per size and per member, and the least-squares slope (cost per added member) of
//!    idle CPU, RSS and dispatcher pass time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "stats.rs"]
mod stats;
use stats::*;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness::*;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::crd::RateLimitSpec;
use tidepool_api::{MemberCluster, keys};

const TEST: &str = "bench-members";
const NS: &str = "bench-members";

/// Least-squares slope of `y` over `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + (x - mx) * (y - my), b + (x - mx).powi(2)));
    if den.abs() < f64::EPSILON { f64::NAN } else { num / den }
}

/// The members started by members.sh, stopped (by its recorded PIDs) when dropped.
struct Members {
    dir: Option<PathBuf>,
    vars: BTreeMap<String, String>,
}

impl Members {
    fn start(env: &Env) -> Members {
        if let Ok(path) = std::env::var("BENCH_MEMBERS_ENV") {
            return Members { dir: None, vars: read_env(&PathBuf::from(path)) };
        }
        let n = env_usize("BENCH_MEMBERS", 8);
        let offset = env_usize("BENCH_MEMBERS_OFFSET", env.var("CP_PORT_OFFSET").parse::<usize>().unwrap_or(0) + 3);
        let dir = PathBuf::from(format!("{}-members", env.var("CP_STATE_DIR")));
        let status = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/controlplane/members.sh"))
            .args(["up"])
            .arg(&dir)
            .env("CP_BIN", env.var("CP_BIN"))
            .env("CP_PKI", env.var("CP_PKI"))
            .env("CP_MEMBERS", n.to_string())
            .env("CP_MEMBER_NODES", env_usize("BENCH_MEMBER_NODES", 4).to_string())
            .env("CP_PORT_OFFSET", offset.to_string())
            .status()
            .unwrap();
        // Made before the check, so that a failed start is stopped too (Drop).
        let mut members = Members { dir: Some(dir.clone()), vars: BTreeMap::new() };
        assert!(status.success(), "members.sh up failed");
        members.vars = read_env(&dir.join("members.env"));
        members
    }

    fn count(&self) -> usize {
        self.vars.get("CP_MEMBERS").and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    fn kubeconfig(&self, k: usize) -> PathBuf {
        PathBuf::from(&self.vars[&format!("BENCH_{k}_KUBECONFIG")])
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else { return };
        let _ = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/controlplane/members.sh"))
            .arg("down")
            .arg(&dir)
            .status();
    }
}

fn read_env(path: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches(['"', '\'']).to_owned()))
        .collect()
}

async fn client_of(path: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
    Client::try_from(config).unwrap()
}

/// Open WATCH requests an apiserver serves (`apiserver_longrunning_requests`).
async fn open_watches(client: &Client) -> f64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap_or_default();
    metric_sum(&text, "apiserver_longrunning_requests", &["verb=\"WATCH\""])
}

/// Every allocatable cpu (milli) each training node had, with when it was seen.
type History = Arc<Mutex<HashMap<String, Vec<(Instant, i64)>>>>;

fn follow_allocatable(training: Client) -> History {
    let history: History = Arc::default();
    let h = history.clone();
    tokio::spawn(async move {
        let api = Api::<Node>::all(training);
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
        while let Some(Ok(n)) = events.next().await {
            let Some(cpu) = cpu_milli(&n) else { continue };
            let mut h = h.lock().unwrap();
            let seen = h.entry(n.name_any()).or_default();
            if seen.last().is_none_or(|(_, c)| *c != cpu) {
                seen.push((Instant::now(), cpu));
            }
        }
    });
    history
}

fn cpu_milli(node: &Node) -> Option<i64> {
    let q = node.status.as_ref()?.allocatable.as_ref()?.get("cpu")?;
    tidepool_api::resources::parse_milli(&q.0).ok()
}

/// First time each pod was seen Running, by name.
type Running = Arc<Mutex<HashMap<String, Instant>>>;

fn observe_running(client: Client, ns: &str, running: Running) {
    let api = Api::<Pod>::namespaced(client, ns);
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
        while let Some(Ok(p)) = events.next().await {
            if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
                running.lock().unwrap().entry(p.name_any()).or_insert_with(Instant::now);
            }
        }
    });
}

fn tiny_pod(name: &str, node: Option<&str>) -> Pod {
    let mut spec = json!({"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                          "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}]});
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
        spec["tolerations"] = json!([{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}]);
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

/// Deletes every pod of `api` and waits (bounded) until none is left.
async fn empty(api: &Api<Pod>) {
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for i in 0..1200 {
        if i % 50 == 0 {
            let _ = api.delete_collection(&now, &ListParams::default()).await;
        }
        if api.list_metadata(&ListParams::default().limit(1)).await.is_ok_and(|l| l.items.is_empty()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("pods still present after 300 s");
}

/// Waits (bounded) until offload copies in the members' offload namespace are gone.
async fn copies_gone(members: &[Client]) {
    let offload_ns = offload_ns(NS);
    for m in members {
        let api = Api::<Pod>::namespaced(m.clone(), &offload_ns);
        for _ in 0..1200 {
            if api.list_metadata(&ListParams::default().limit(1)).await.is_ok_and(|l| l.items.is_empty()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// One burst: `n` pods in namespace NS, the i-th created through `targets[i % len]` with
/// node `node(i)` (tidepool's path: a virtual node) or none (the direct path: the member's
/// scheduler places it). Returns (pods/s until all are Running, p50 s, p99 s).
async fn burst(targets: &[Client], prefix: &str, n: usize, node: impl Fn(usize) -> Option<String>) -> (f64, f64, f64) {
    let running: Running = Arc::default();
    for c in targets {
        observe_running(c.clone(), NS, running.clone());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let created: HashMap<String, Instant> = futures::stream::iter(0..n)
        .map(|i| {
            let api = Api::<Pod>::namespaced(targets[i % targets.len()].clone(), NS);
            let pod = tiny_pod(&format!("{prefix}-{i}"), node(i).as_deref());
            async move {
                let t = Instant::now();
                api.create(&PostParams::default(), &pod).await.unwrap();
                (pod.name_any(), t)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let deadline = Instant::now() + Duration::from_secs(600);
    while running.lock().unwrap().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = running.lock().unwrap();
    assert!(r.len() >= n, "{prefix}: only {} of {n} pods Running after 600 s", r.len());
    let last = r.values().max().copied().unwrap_or(started);
    let mut lat: Vec<f64> =
        created.iter().filter_map(|(k, t)| Some(r.get(k)?.duration_since(*t).as_secs_f64())).collect();
    lat.sort_by(f64::total_cmp);
    (n as f64 / last.duration_since(started).as_secs_f64(), pct(&lat, 0.5), pct(&lat, 0.99))
}

/// What one size measured.
#[derive(Default)]
struct Size {
    k: usize,
    idle_cpu_pct: f64,
    rss: f64,
    member_watches: Vec<f64>,
    training_watches: f64,
    requests_per_s: Vec<f64>,
    dispatch_idle_ms: f64,
    dispatch_burst_ms: f64,
    dispatch_burst_passes: f64,
    fresh: Vec<(usize, f64)>,
    missed: usize,
    tidepool: (f64, f64, f64),
    direct: (f64, f64, f64),
    burst_cpu: f64,
}

/// Mean dispatcher pass (ms) and passes between two scrapes.
fn dispatch(before: &str, after: &str) -> (f64, f64) {
    let v = |t: &str, s: &str| metric_value(t, s, "controller=\"dispatch\"").unwrap_or(0.0);
    let sum = v(after, "tidepool_sync_duration_seconds_sum") - v(before, "tidepool_sync_duration_seconds_sum");
    let count = v(after, "tidepool_sync_duration_seconds_count") - v(before, "tidepool_sync_duration_seconds_count");
    (if count > 0.0 { sum / count * 1000.0 } else { f64::NAN }, count)
}

struct Bench<'a> {
    env: &'a Env,
    training: Client,
    members: Vec<Client>,
    baseline: Vec<f64>,
    baseline_training: f64,
    history: History,
}

fn mc_name(k: usize) -> String {
    format!("bm-{k}")
}

impl Bench<'_> {
    async fn size(&self, k: usize) -> Size {
        reset_members(&self.training, TEST).await;
        let qps = u32::try_from(env_usize("BENCH_MEMBER_QPS", 200)).unwrap_or(200);
        for i in 0..k {
            let mut mc = member_cluster(&mc_name(i), TEST, NS, &format!("bench-{i}"));
            mc.spec.rate_limits = Some(RateLimitSpec { qps: Some(qps), burst: Some(2 * qps) });
            apply_member_cluster(&self.training, &mc).await;
        }
        let tp = Tidepool::start(self.env, TEST, NS);
        let nodes = Api::<Node>::all(self.training.clone());
        wait_for(Duration::from_secs(300), "every virtual node Ready", || {
            let nodes = nodes.clone();
            async move {
                for i in 0..k {
                    let n = nodes.get_opt(&format!("tidepool-{}", mc_name(i))).await.ok()??;
                    let ready = n.status?.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
                    ready.then_some(())?;
                }
                Some(())
            }
        })
        .await;
        // Let every watch list before the idle window.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut s = Size { k, ..Default::default() };
        self.idle(&tp, k, &mut s).await;
        self.freshness(k, &mut s).await;
        self.bursts(&tp, k, &mut s).await;
        reset_members(&self.training, TEST).await;
        drop(tp);
        s
    }

    async fn idle(&self, tp: &Tidepool, k: usize, s: &mut Size) {
        let window = env_usize("BENCH_IDLE_SECS", 20) as f64;
        let (m0, c0, t0) = (tp.scrape(), cpu_seconds(tp.pid()), Instant::now());
        tokio::time::sleep(Duration::from_secs_f64(window)).await;
        let (m1, c1, secs) = (tp.scrape(), cpu_seconds(tp.pid()), t0.elapsed().as_secs_f64());
        s.idle_cpu_pct = (c1 - c0) / secs * 100.0;
        s.rss = rss_mib(tp.pid());
        s.dispatch_idle_ms = dispatch(&m0, &m1).0;
        for (i, (member, baseline)) in self.members[..k].iter().zip(&self.baseline).enumerate() {
            let label = format!("cluster=\"{}\"", mc_name(i));
            let req = |t: &str| metric_sum(t, "tidepool_api_requests_total", &[label.as_str()]);
            s.requests_per_s.push((req(&m1) - req(&m0)) / secs);
            s.member_watches.push(open_watches(member).await - baseline);
        }
        s.training_watches = open_watches(&self.training).await - self.baseline_training;
    }

    async fn freshness(&self, k: usize, s: &mut Size) {
        let samples = env_usize("BENCH_FRESH", 16);
        for j in 0..samples {
            let i = j % k;
            let vnode = format!("tidepool-{}", mc_name(i));
            let node = format!("bench-{i}-node-0");
            let api = Api::<Node>::all(self.members[i].clone());
            let before = self.history.lock().unwrap().get(&vnode).and_then(|h| h.last().map(|(_, c)| *c));
            let cpu = api.get(&node).await.ok().as_ref().and_then(cpu_milli).unwrap_or(32_000);
            let next = if cpu == 32_000 { "24" } else { "32" };
            let patch = json!({"status": {"allocatable": {"cpu": next}}});
            let sent = Instant::now();
            api.patch_status(&node, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
            let deadline = sent + Duration::from_secs(15);
            let seen = loop {
                let found = self.history.lock().unwrap().get(&vnode).and_then(|h| {
                    h.iter().find(|(t, c)| *t >= sent && Some(*c) != before).map(|(t, _)| t.duration_since(sent))
                });
                if found.is_some() || Instant::now() > deadline {
                    break found;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            match seen {
                Some(d) => s.fresh.push((i, d.as_secs_f64())),
                None => s.missed += 1,
            }
        }
    }

    async fn bursts(&self, tp: &Tidepool, k: usize, s: &mut Size) {
        let n = env_usize("BENCH_BURST", 400);
        let members = &self.members[..k];
        s.direct = burst(members, "direct", n, |_| None).await;
        for m in members {
            empty(&Api::namespaced(m.clone(), NS)).await;
        }
        let (m0, c0) = (tp.scrape(), cpu_seconds(tp.pid()));
        let training = std::slice::from_ref(&self.training);
        s.tidepool = burst(training, "tp", n, |i| Some(format!("tidepool-{}", mc_name(i % k)))).await;
        let (m1, c1) = (tp.scrape(), cpu_seconds(tp.pid()));
        s.burst_cpu = c1 - c0;
        (s.dispatch_burst_ms, s.dispatch_burst_passes) = dispatch(&m0, &m1);
        empty(&Api::namespaced(self.training.clone(), NS)).await;
        copies_gone(members).await;
    }
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let started = Instant::now();
    let members = Members::start(&env);
    let n = members.count();
    eprintln!("{n} members up in {:.0} s", started.elapsed().as_secs_f64());
    prepare(&env, &training, TEST, NS).await;
    let mut clients = Vec::new();
    for k in 0..n {
        let path = members.kubeconfig(k);
        put_kubeconfig_secret(&training, NS, &format!("bench-{k}"), &std::fs::read(&path).unwrap()).await;
        let client = client_of(&path).await;
        ensure_namespace(&client, NS).await;
        empty(&Api::<Pod>::namespaced(client.clone(), NS)).await;
        clients.push(client);
    }
    let mut baseline = Vec::new();
    for c in &clients {
        baseline.push(open_watches(c).await);
    }
    let bench = Bench {
        env: &env,
        baseline_training: open_watches(&training).await,
        history: follow_allocatable(training.clone()),
        training: training.clone(),
        members: clients,
        baseline,
    };
    let mut sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| format!("1,2,4,{n}"))
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|&k| k >= 1 && k <= n)
        .collect();
    sizes.dedup();
    let mut results = Vec::new();
    for k in sizes {
        let t = Instant::now();
        results.push(bench.size(k).await);
        eprintln!("size {k}: {:.0} s", t.elapsed().as_secs_f64());
    }
    report(&results, env_usize("BENCH_BURST", 400));
    let _ = Api::<MemberCluster>::all(training.clone())
        .delete_collection(&DeleteParams::default(), &ListParams::default().labels(&format!("tidepool.io/test={TEST}")))
        .await;
    drop(members);
}

fn report(results: &[Size], burst: usize) {
    println!("\n## many members: tidepool cost by member count\n");
    println!(
        "| members | idle CPU % | CPU % per member | RSS MiB | RSS per member MiB | watches on members (per member) | watches on training | requests/s per member | dispatch pass idle ms | dispatch pass in burst ms (passes) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for s in results {
        let k = s.k as f64;
        let w: f64 = s.member_watches.iter().sum();
        let r: f64 = s.requests_per_s.iter().sum();
        println!(
            "| {} | {:.2} | {:.2} | {:.1} | {:.1} | {w:.0} ({:.1}) | {:.0} | {:.2} | {:.2} | {:.2} ({:.0}) |",
            s.k,
            s.idle_cpu_pct,
            s.idle_cpu_pct / k,
            s.rss,
            s.rss / k,
            w / k,
            s.training_watches,
            r / k,
            s.dispatch_idle_ms,
            s.dispatch_burst_ms,
            s.dispatch_burst_passes
        );
    }
    println!("\n| members | freshness samples | p50 s | p99 s | max s | missed (15 s) |");
    println!("|---|---|---|---|---|---|");
    for s in results {
        let mut f: Vec<f64> = s.fresh.iter().map(|(_, d)| *d).collect();
        f.sort_by(f64::total_cmp);
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {} |",
            s.k,
            f.len(),
            pct(&f, 0.5),
            pct(&f, 0.99),
            pct(&f, 1.0),
            s.missed
        );
    }
    println!(
        "\n| members | burst of {burst} pods: tidepool pods/s | direct pods/s | ratio | tidepool p50 / p99 s | direct p50 / p99 s | tidepool CPU s in burst |"
    );
    println!("|---|---|---|---|---|---|---|");
    for s in results {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} |",
            s.k,
            s.tidepool.0,
            s.direct.0,
            s.tidepool.0 / s.direct.0,
            s.tidepool.1,
            s.tidepool.2,
            s.direct.1,
            s.direct.2,
            s.burst_cpu
        );
    }
    if let Some(last) = results.last() {
        println!("\n| member (of {}) | tidepool watches on it | requests/s idle | freshness p50 s |", last.k);
        println!("|---|---|---|---|");
        for (i, (watches, requests)) in last.member_watches.iter().zip(&last.requests_per_s).enumerate() {
            let mut f: Vec<f64> = last.fresh.iter().filter(|(m, _)| *m == i).map(|(_, d)| *d).collect();
            f.sort_by(f64::total_cmp);
            println!("| {} | {watches:.0} | {requests:.2} | {:.3} |", mc_name(i), pct(&f, 0.5));
        }
    }
    let pts = |f: fn(&Size) -> f64| results.iter().map(|s| (s.k as f64, f(s))).collect::<Vec<_>>();
    println!("\n| slope per added member | value |");
    println!("|---|---|");
    println!("| idle CPU (% of a core) | {:.3} |", slope(&pts(|s| s.idle_cpu_pct)));
    println!("| RSS (MiB) | {:.2} |", slope(&pts(|s| s.rss)));
    println!("| dispatch pass idle (ms) | {:.3} |", slope(&pts(|s| s.dispatch_idle_ms)));
    println!("| dispatch pass in burst (ms) | {:.3} |", slope(&pts(|s| s.dispatch_burst_ms)));
    println!("| tidepool CPU s per burst of {burst} | {:.3} |", slope(&pts(|s| s.burst_cpu)));
}
