//! Benchmark program (not a test): the cost and freshness of tidepool's member watches, against
//! the direct path in the same run. Prints tables; asserts nothing about speed.
//!
//! ```text
//! bash tests/controlplane/cluster.sh up /tmp/cp && TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench capacity
//! ```
//! 1. BENCH_NODES (default 1000) kwok nodes and BENCH_PODS (default 10000) online pods bound to
//!    them (`nodeName`, no scheduler) are created straight in member-b, BENCH_CONCURRENCY
//!    (default 32) calls at a time. kwok marks the pods Running; the benchmark then waits
//!    (at most 300 s) until the controller-manager has lifted every new node's not-ready
//!    taint, so the 30 s steady window that follows sees no node join the pool.
//! 2. CPU seconds and resident memory (from `/proc`) of tidepool watching member-b, next to a
//!    direct-path process: this program re-run as a plain kube-rs reflector of the same Nodes
//!    and Pods (full objects, as a controller without trimmed views holds them).
//! 3. Capacity freshness: BENCH_SAMPLES (default 20) times a 1-CPU pod is created on a bench
//!    node and deleted again; the time until the virtual node's allocatable changes, against
//!    the time until a direct watch of member-b sees the pod, each timed on its own (every
//!    sample waits for both).
//!
//! Everything it created (nodes, namespace, pods, MemberCluster) is deleted at the end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "stats.rs"]
mod stats;
use stats::*;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use harness::*;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::MemberCluster;

const TEST: &str = "bench-capacity";
const NS: &str = "bench-capacity";
const MEMBER: &str = "bcap-b";
const ONLINE_NS: &str = "bench-online";
const BENCH_LABEL: &str = "tidepool.io/bench";
const REFLECT_FLAG: &str = "--reflect-member";

/// The direct path: reflectors of every Node and Pod of member-b, full objects, until stdin
/// closes. Run as a child of the benchmark so its CPU and memory are its own.
async fn reflect_member() {
    let env = Env::load();
    let client = env.client("member-b").await;
    let (nodes, node_writer) = reflector::store::<Node>();
    let (pods, pod_writer) = reflector::store::<Pod>();
    let node_stream = reflector(node_writer, watcher(Api::<Node>::all(client.clone()), watcher::Config::default()))
        .default_backoff()
        .applied_objects()
        .for_each(|_| async {});
    let pod_stream = reflector(pod_writer, watcher(Api::<Pod>::all(client), watcher::Config::default()))
        .default_backoff()
        .applied_objects()
        .for_each(|_| async {});
    let stdin_closed = async {
        let mut buf = [0u8; 64];
        use tokio::io::AsyncReadExt;
        let mut stdin = tokio::io::stdin();
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        () = node_stream => {}
        () = pod_stream => {}
        () = stdin_closed => {}
    }
    eprintln!("reflector held {} nodes, {} pods", nodes.state().len(), pods.state().len());
}

fn bench_node(name: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", BENCH_LABEL: "capacity"}
        },
        "spec": {"providerID": format!("kwok://{name}")},
        "status": {
            "capacity": {"cpu": "32", "memory": "128Gi", "pods": "110"},
            "allocatable": {"cpu": "32", "memory": "128Gi", "pods": "110"}
        }
    }))
    .unwrap()
}

/// Polls `count` every 5 s until it reaches `target` or 300 s have passed; the last count and
/// the seconds waited.
async fn count_up_to<F, Fut>(target: usize, mut count: F) -> (usize, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    let start = Instant::now();
    let mut now = count().await;
    while now < target && start.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        now = count().await;
    }
    (now, start.elapsed().as_secs_f64())
}

/// How many of the benchmark's nodes are Ready and carry no taint, so take pods (0 when the
/// list fails).
async fn ready_nodes(api: &Api<Node>) -> usize {
    let lp = ListParams::default().labels(&format!("{BENCH_LABEL}=capacity"));
    let Ok(nodes) = api.list(&lp).await else { return 0 };
    let ready = |n: &Node| {
        let conditions = n.status.as_ref().and_then(|s| s.conditions.as_ref());
        let untainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_none_or(Vec::is_empty);
        untainted && conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    nodes.items.iter().filter(|n| ready(n)).count()
}

fn online_pod(name: &str, node: &str, cpu: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {BENCH_LABEL: "capacity"}},
        "spec": {
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/online:1",
                            "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}}]
        }
    }))
    .unwrap()
}

/// Runs `make(i)` for `0..n`, `concurrency` at a time; returns how many succeeded.
async fn bounded<F, Fut>(n: usize, concurrency: usize, make: F) -> usize
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let ok = AtomicUsize::new(0);
    futures::stream::iter(0..n)
        .for_each_concurrent(concurrency, |i| {
            let fut = make(i);
            let ok = &ok;
            async move {
                if fut.await {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .await;
    ok.into_inner()
}

fn cpu_milli(node: &Node) -> Option<i64> {
    let q = node.status.as_ref()?.allocatable.as_ref()?.get("cpu")?;
    tidepool_api::resources::parse_milli(&q.0).ok()
}

async fn cleanup(member_b: &Client, training: &Client) {
    let _ = Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await;
    let pods = Api::<Pod>::namespaced(member_b.clone(), ONLINE_NS);
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let _ = pods.delete_collection(&now, &ListParams::default()).await;
    let _ = Api::<Namespace>::all(member_b.clone()).delete(ONLINE_NS, &DeleteParams::default()).await;
    let nodes = Api::<Node>::all(member_b.clone());
    let _ = nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels(BENCH_LABEL)).await;
    // Deleting 10,000 pods takes the member minutes on a loaded machine.
    let started = Instant::now();
    for _ in 0..1800 {
        let left_pods = pods.list_metadata(&ListParams::default().limit(1)).await.map(|l| l.items.len()).unwrap_or(0);
        let left_nodes =
            nodes.list_metadata(&ListParams::default().labels(BENCH_LABEL).limit(1)).await.map(|l| l.items.len());
        // The namespace too: one still terminating refuses the pods made next, and goes
        // under them (another benchmark, reclaim, uses the same namespace).
        let ns_gone = matches!(Api::<Namespace>::all(member_b.clone()).get_opt(ONLINE_NS).await, Ok(None));
        if left_pods == 0 && left_nodes.is_ok_and(|n| n == 0) && ns_gone {
            eprintln!("cleanup took {:.0} s", started.elapsed().as_secs_f64());
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("cleanup: bench objects still present after 15 min; the namespace controller finishes it");
}

/// Every allocatable cpu value of the virtual node, with when it was seen.
type History = Arc<std::sync::Mutex<Vec<(Instant, i64)>>>;

fn follow_allocatable(nodes: Api<Node>, node: &str) -> History {
    let history: History = Arc::default();
    let h = history.clone();
    let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(nodes, cfg).default_backoff().applied_objects());
        while let Ok(Some(n)) = events.try_next().await {
            if let Some(cpu) = cpu_milli(&n) {
                h.lock().unwrap().push((Instant::now(), cpu));
            }
        }
    });
    history
}

/// The last allocatable cpu seen.
fn current(history: &History) -> Option<i64> {
    history.lock().unwrap().last().map(|(_, c)| *c)
}

/// Time from `since` until the virtual node's allocatable cpu was first seen to differ from
/// `before`.
async fn allocatable_change(history: &History, since: Instant, before: i64, timeout: Duration) -> Option<Duration> {
    let deadline = since + timeout;
    while Instant::now() < deadline {
        let found = history.lock().unwrap().iter().find(|(t, c)| *t >= since && *c != before).map(|(t, _)| *t);
        if let Some(t) = found {
            return Some(t.duration_since(since));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == REFLECT_FLAG) {
        reflect_member().await;
        return;
    }
    let n_nodes = env_usize("BENCH_NODES", 1000);
    let n_pods = env_usize("BENCH_PODS", 10_000);
    let concurrency = env_usize("BENCH_CONCURRENCY", 32);
    let samples = env_usize("BENCH_SAMPLES", 20);
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    cleanup(&member_b, &training).await;
    prepare(&env, &training, TEST, NS).await;

    // 1. tidepool on member-b, one pool of the bench nodes; the direct-path reflector beside it.
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-b", &kubeconfig).await;
    apply_member(&training, MEMBER, TEST, NS, "member-b").await;
    let pools = json!({"spec": {"pools": [{"name": "bench", "nodeSelector": {BENCH_LABEL: "capacity"}}]}});
    Api::<MemberCluster>::all(training.clone())
        .patch(MEMBER, &PatchParams::default(), &Patch::Merge(&pools))
        .await
        .unwrap();
    let tidepool = Tidepool::start(&env, TEST, NS);
    let mut reflector = std::process::Command::new(std::env::current_exe().unwrap())
        .arg(REFLECT_FLAG)
        .env("TIDEPOOL_CLUSTER_ENV", std::env::var("TIDEPOOL_CLUSTER_ENV").unwrap_or_default())
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tp, rf) = (tidepool.pid(), reflector.id());
    let vnode = format!("tidepool-{MEMBER}-bench");
    let vnodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node registered", || {
        let (vnodes, vnode) = (vnodes.clone(), vnode.clone());
        async move { vnodes.get_opt(&vnode).await.ok()?.map(|_| ()) }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut usage: Vec<(String, f64, f64, f64, f64)> = Vec::new();
    // Each moment also goes to stderr as it happens, with the time: a profiler attached to
    // tidepool (`perf record -p`) can be lined up with the window it is about.
    let mark = |what: &str, usage: &mut Vec<_>| {
        eprintln!("[capacity {}] {what}", jiff::Timestamp::now());
        usage.push((what.to_owned(), cpu_seconds(tp), rss_mib(tp), cpu_seconds(rf), rss_mib(rf)));
    };
    mark("idle (member-b as started)", &mut usage);

    // 2. The load, straight in member-b.
    let started = Instant::now();
    let node_api = Api::<Node>::all(member_b.clone());
    let names: Vec<String> = (0..n_nodes).map(|i| format!("bench-node-{i:04}")).collect();
    let made_nodes = bounded(n_nodes, concurrency, |i| {
        let (api, node) = (node_api.clone(), bench_node(&names[i]));
        async move { api.create(&PostParams::default(), &node).await.is_ok() }
    })
    .await;
    let node_secs = started.elapsed().as_secs_f64();
    mark(&format!("after creating {made_nodes} nodes"), &mut usage);
    ensure_namespace(&member_b, ONLINE_NS).await;
    wait_for(Duration::from_secs(60), "default ServiceAccount in the online namespace", || {
        let api = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(member_b.clone(), ONLINE_NS);
        async move { api.get_opt("default").await.ok()?.map(|_| ()) }
    })
    .await;
    let started = Instant::now();
    let pod_api = Api::<Pod>::namespaced(member_b.clone(), ONLINE_NS);
    let made_pods = bounded(n_pods, concurrency, |i| {
        let api = pod_api.clone();
        let pod = online_pod(&format!("online-{i:05}"), &names[i % names.len().max(1)], "100m");
        async move {
            for _ in 0..3 {
                match api.create(&PostParams::default(), &pod).await {
                    Ok(_) => return true,
                    Err(kube::Error::Api(s)) if s.code == 409 => return true,
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
            false
        }
    })
    .await;
    let pod_secs = started.elapsed().as_secs_f64();
    mark(&format!("after creating {made_pods} pods"), &mut usage);

    // kwok marks the pods Running; wait (bounded) and report how far it got.
    let running = |api: Api<Pod>| async move {
        let lp = ListParams::default().fields("status.phase=Running");
        let mut count = 0;
        let mut token: Option<String> = None;
        loop {
            let mut page = lp.clone().limit(2000);
            if let Some(t) = &token {
                page = page.continue_token(t);
            }
            let Ok(list) = api.list_metadata(&page).await else { return count };
            count += list.items.len();
            token = list.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                return count;
            }
        }
    };
    let (running_now, run_secs) = count_up_to(made_pods, || running(pod_api.clone())).await;
    mark(&format!("after {running_now} pods Running"), &mut usage);
    // kwok makes new nodes Ready at once, but the controller-manager lifts their
    // `node.kubernetes.io/not-ready` taint only a few nodes a second (~4.4 here). Until it
    // is done, every node it frees joins the pool (a computation and a virtual node write
    // for tidepool, a stored object for the reflector): the window below is steady only
    // after that.
    let (ready_now, ready_secs) = count_up_to(made_nodes, || ready_nodes(&node_api)).await;
    mark(&format!("after {ready_now} nodes Ready and untainted"), &mut usage);
    tokio::time::sleep(Duration::from_secs(30)).await;
    mark("30 s later (steady watching)", &mut usage);

    // 3. Freshness: a 1-CPU pod on a bench node, created then deleted.
    let direct_seen: Arc<std::sync::Mutex<BTreeMap<String, Instant>>> = Arc::default();
    {
        let seen = direct_seen.clone();
        let cfg = watcher::Config::default().labels("tidepool.io/bench-probe=1");
        let api = Api::<Pod>::namespaced(member_b.clone(), ONLINE_NS);
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(api, cfg).default_backoff().touched_objects());
            while let Ok(Some(p)) = events.try_next().await {
                let key = format!("{}:{}", p.name_any(), p.metadata.deletion_timestamp.is_some());
                seen.lock().unwrap().entry(key).or_insert_with(Instant::now);
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let history = follow_allocatable(vnodes.clone(), &vnode);
    wait_for(Duration::from_secs(10), "virtual node allocatable seen", || {
        let h = history.clone();
        async move { current(&h).map(|_| ()) }
    })
    .await;
    let (mut fresh, mut direct) = (Vec::new(), Vec::new());
    let (mut missed, mut missed_direct) = (0, 0);
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for i in 0..samples {
        let name = format!("probe-{i:03}");
        let mut pod = online_pod(&name, &names[i % names.len().max(1)], "1");
        pod.metadata.labels.get_or_insert_default().insert("tidepool.io/bench-probe".into(), "1".into());
        // Created, then deleted: each takes a CPU from or gives it back to the virtual node.
        for deleting in [false, true] {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let before = current(&history).unwrap_or_default();
            let sent = Instant::now();
            if deleting {
                pod_api.delete(&name, &now).await.unwrap();
            } else {
                pod_api.create(&PostParams::default(), &pod).await.unwrap();
            }
            match allocatable_change(&history, sent, before, Duration::from_secs(15)).await {
                Some(d) => fresh.push(d.as_secs_f64()),
                None => missed += 1,
            }
            // The direct path timed on its own: waited for as long as it takes (bounded), not
            // only when it came before tidepool's.
            let key = format!("{name}:{deleting}");
            let wait = Instant::now();
            loop {
                if let Some(t) = direct_seen.lock().unwrap().get(&key) {
                    direct.push(t.saturating_duration_since(sent).as_secs_f64());
                    break;
                }
                if wait.elapsed() > Duration::from_secs(15) {
                    missed_direct += 1;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    fresh.sort_by(f64::total_cmp);
    direct.sort_by(f64::total_cmp);

    let load = format!("{made_nodes} nodes, {made_pods} pods ({running_now} Running)");
    println!("\n## capacity: member-b with {load}\n");
    println!(
        "created {made_nodes} nodes in {node_secs:.1} s, {made_pods} pods in {pod_secs:.1} s \
         (concurrency {concurrency}); kwok had {running_now} Running after {run_secs:.0} s more, \
         and {ready_now} nodes Ready and untainted {ready_secs:.0} s after that\n"
    );
    println!("| moment | tidepool CPU s | tidepool RSS MiB | direct reflector CPU s | direct reflector RSS MiB |");
    println!("|---|---|---|---|---|");
    for (what, tc, tr, rc, rr) in &usage {
        println!("| {what} | {tc:.2} | {tr:.1} | {rc:.2} | {rr:.1} |");
    }
    println!("\n| freshness (member change → seen) | samples | p50 s | p99 s | max s |");
    println!("|---|---|---|---|---|");
    let row = |what: &str, v: &[f64]| {
        println!("| {what} | {} | {:.3} | {:.3} | {:.3} |", v.len(), pct(v, 0.5), pct(v, 0.99), pct(v, 1.0));
    };
    row("tidepool: virtual node allocatable changed", &fresh);
    row("direct: member-b pod watch event", &direct);
    if missed > 0 {
        println!("\n{missed} change(s) not reflected on the virtual node within 15 s");
    }
    if missed_direct > 0 {
        println!("\n{missed_direct} change(s) not seen by the direct watch within 15 s");
    }

    // 4. Clean up everything the benchmark made.
    drop(reflector.stdin.take());
    let _ = reflector.wait();
    drop(tidepool);
    cleanup(&member_b, &training).await;
}
