//! Benchmark program (not a test): what one pod create costs member-a's API server, for
//! tidepool's copy of a pod against a plain pod (issue "A copy as cheap as a pod"). Prints
//! tables; asserts nothing about speed.
//!
//! ```text
//! TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench copy_cost
//! ```
//!
//! First a real copy: tidepool bridges member-a and one training pod bound to its virtual
//! node is offloaded; the copy as member-a stored it is the template (status, UID, versions
//! and managed fields dropped), tidepool is stopped. Then the same client (the admin's)
//! creates pods of two shapes in two namespaces of member-a, `BENCH_PODS` [200] of each in
//! every cell, at concurrency 1 and `BENCH_CONCURRENCY` [32], the cells' order rotating over
//! `BENCH_ROUNDS` [3] rounds:
//! - **plain**: the peer benchmark's pod (one container, 1m CPU);
//! - **copy**: tidepool's copy of that pod;
//! - in a **plain** namespace, and in one labelled as tidepool labels its offload namespaces
//!   (Pod Security `enforce` and `warn` at the member's level).
//!
//! - as the **admin** (`system:masters`: no admission policy, no APF queue), and, for the
//!   copy in the offload-like namespace, as **tidepool**'s member identity: the
//!   ServiceAccount `tidepool-member/tidepool` of `deploy/manifests/member.yaml` (applied to
//!   member-a), its pods allowed by a RoleBinding to `tidepool-offload` as tidepool makes
//!   one, its writes checked by the release's ValidatingAdmissionPolicies.
//!
//! Every pod names a scheduler nobody runs, so nothing but its create touches it. Latency is
//! read twice: at the client, and at the server from member-a's audit log
//! (`requestReceivedTimestamp` → `stageTimestamp` of each create). The API server's CPU
//! seconds over each cell are read from `/proc`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "stats.rs"]
#[allow(dead_code)]
mod stats;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use stats::*;

const TEST: &str = "bench-cc";
const NS: &str = "bench-cc";
const MEMBER: &str = "bench-cc-a";
const NODE: &str = "tidepool-bench-cc-a";
const PLAIN_NS: &str = "bench-cc-plain";
const OFFLOAD_LIKE_NS: &str = "bench-cc-offload";

/// The peer benchmark's pod.
fn plain_pod() -> Value {
    json!({
        "metadata": {"labels": {"app": "bench"}},
        "spec": {"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}]},
    })
}

/// Tidepool's copy of the peer benchmark's pod, as member-a stores it, and the labels of its
/// offload namespace.
async fn real_copy(env: &Env, training: &Client, member: &Client) -> (Value, BTreeMap<String, String>) {
    prepare(env, training, TEST, NS).await;
    bridge_member(env, training, TEST, NS, MEMBER, "member-a").await;
    let tidepool = Tidepool::start(env, TEST, NS);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let mut pod = plain_pod();
    pod["metadata"]["name"] = json!("template");
    pod["spec"]["nodeName"] = json!(NODE);
    pod["spec"]["tolerations"] =
        json!([{"key": tidepool_api::keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}]);
    let _ = pods.delete("template", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
    wait_for(Duration::from_secs(60), "an earlier template gone", || {
        let pods = pods.clone();
        async move { pods.get_opt("template").await.ok()?.is_none().then_some(()) }
    })
    .await;
    pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    let member_ns = offload_ns(NS);
    let copies = Api::<Pod>::namespaced(member.clone(), &member_ns);
    let copy = wait_for(Duration::from_secs(90), "the template's copy", || {
        let copies = copies.clone();
        async move { copies.get_opt("template").await.ok()? }
    })
    .await;
    let labels = Api::<Namespace>::all(member.clone()).get(&member_ns).await.unwrap().labels().clone();
    drain_pods(training, NS).await;
    drop(tidepool);
    let mut copy = serde_json::to_value(copy).unwrap();
    for field in ["uid", "resourceVersion", "creationTimestamp", "managedFields", "namespace", "name", "generation"] {
        copy["metadata"].as_object_mut().unwrap().remove(field);
    }
    copy.as_object_mut().unwrap().remove("status");
    copy["spec"].as_object_mut().unwrap().remove("nodeName");
    (copy, labels)
}

/// `template` named `name`, for a scheduler nobody runs.
fn named(template: &Value, name: &str) -> Pod {
    let mut pod = template.clone();
    pod["metadata"]["name"] = json!(name);
    pod["spec"]["schedulerName"] = json!("bench-nobody");
    serde_json::from_value(pod).unwrap()
}

async fn fresh_namespace(member: &Client, name: &str, labels: &BTreeMap<String, String>) {
    let namespaces = Api::<Namespace>::all(member.clone());
    let _ = namespaces.delete(name, &DeleteParams::default()).await;
    wait_for(Duration::from_secs(120), &format!("namespace {name} gone"), || {
        let namespaces = namespaces.clone();
        async move { namespaces.get_opt(name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    namespaces.create(&PostParams::default(), &ns).await.unwrap();
}

/// One cell's figures.
struct Cell {
    client: Vec<f64>,
    server: Vec<f64>,
    apiserver_cpu: f64,
}

/// Creates `n` pods from `template` in `ns` as `client`, `concurrency` at a time (the
/// admin `member` cleans up); client latencies, the
/// API server's CPU seconds meanwhile, and (read later from the audit log) server latencies.
async fn run_cell(
    env: &Env,
    (member, client): (&Client, &Client),
    (ns, template): (&str, &Value),
    n: usize,
    concurrency: usize,
) -> Cell {
    let (pods, creator) = (Api::<Pod>::namespaced(member.clone(), ns), Api::<Pod>::namespaced(client.clone(), ns));
    let apiserver = apiserver_pid(env);
    let tag = run_id();
    let since = jiff::Timestamp::now();
    let cpu = cpu_seconds(apiserver);
    let names: Vec<String> = (0..n).map(|i| format!("cc-{tag}-{i}")).collect();
    let mut client = Vec::with_capacity(n);
    for chunk in names.chunks(concurrency) {
        let creates = chunk.iter().map(|name| {
            let (pods, pod) = (creator.clone(), named(template, name));
            async move {
                let start = Instant::now();
                pods.create(&PostParams::default(), &pod).await.unwrap();
                start.elapsed().as_secs_f64()
            }
        });
        client.extend(futures::future::join_all(creates).await);
    }
    let apiserver_cpu = cpu_seconds(apiserver) - cpu;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server = audited_creates(env, ns, since, &tag);
    let _ = pods.delete_collection(&DeleteParams::default(), &ListParams::default()).await;
    wait_for(Duration::from_secs(120), "the cell's pods gone", || {
        let pods = pods.clone();
        async move { pods.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    Cell { client, server, apiserver_cpu }
}

/// member-a's API server, from tests/controlplane/cluster.sh's `pids` file.
fn apiserver_pid(env: &Env) -> u32 {
    let pids = std::fs::read_to_string(format!("{}/pids", env.var("CP_STATE_DIR"))).unwrap();
    pids.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(name, _)| *name == "member-a-apiserver")
        .and_then(|(_, pid)| pid.trim().parse().ok())
        .expect("member-a-apiserver in the pids file")
}

/// Server-side seconds of the creates of pods `cc-<tag>-…` in `ns` since `since`, from
/// member-a's audit log.
fn audited_creates(env: &Env, ns: &str, since: jiff::Timestamp, tag: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(env.var("MEMBER_A_AUDIT_LOG")).unwrap();
    let prefix = format!("cc-{tag}-");
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["verb"] == "create" && e["objectRef"]["resource"] == "pods" && e["objectRef"]["namespace"] == ns)
        .filter(|e| e["objectRef"]["name"].as_str().is_some_and(|n| n.starts_with(&prefix)))
        .filter_map(|e| {
            let received: jiff::Timestamp = e["requestReceivedTimestamp"].as_str()?.parse().ok()?;
            let done: jiff::Timestamp = e["stageTimestamp"].as_str()?.parse().ok()?;
            (received >= since).then(|| done.duration_since(received).as_secs_f64())
        })
        .collect()
}

fn ms(sorted: &[f64], p: f64) -> String {
    if sorted.is_empty() { "–".to_owned() } else { format!("{:.1}", pct(sorted, p / 100.0) * 1e3) }
}

/// A client of member-a as tidepool's member identity (`deploy/manifests/member.yaml`,
/// applied), allowed pods in `ns` as tidepool allows itself in an offload namespace.
async fn tidepool_identity(env: &Env, member: &Client, ns: &str) -> Client {
    ensure_namespace(member, "tidepool-member").await;
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/manifests/member.yaml");
    let (code, _, err) = kubectl(env, "member-a", &["apply", "-f", manifest], None).await;
    assert_eq!(code, 0, "kubectl apply {manifest}: {err}");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tidepool-offload", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tidepool-offload"},
        "subjects": [{"kind": "ServiceAccount", "name": "tidepool", "namespace": "tidepool-member"}],
    }))
    .unwrap();
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(member.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let token = token(member, "tidepool-member", "tidepool").await;
    client_from(&token_kubeconfig(env, env.var("MEMBER_A_SERVER"), &token)).await
}

/// A cell: who creates, which pod, in which namespace, how many at once.
type Key = (&'static str, &'static str, &'static str, usize);

/// Every cell once, in the order of the first round: the admin's four shapes and spaces,
/// tidepool's identity only where it may create (its copy, in an offload namespace).
fn cells_in_order(concurrency: usize) -> Vec<Key> {
    let mut order = Vec::new();
    for who in ["admin", "tidepool"] {
        for shape in ["plain", "copy"] {
            for space in ["plain", "offload-like"] {
                if who == "tidepool" && (shape, space) != ("copy", "offload-like") {
                    continue;
                }
                for c in [1, concurrency] {
                    order.push((who, shape, space, c));
                }
            }
        }
    }
    order
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    let (n, concurrency, rounds) =
        (env_usize("BENCH_PODS", 200), env_usize("BENCH_CONCURRENCY", 32), env_usize("BENCH_ROUNDS", 3));
    let (copy, offload_labels) = real_copy(&env, &training, &member).await;
    let plain = plain_pod();
    let bytes = |v: &Value| serde_json::to_vec(v).unwrap().len();
    println!("copy_cost: {n} pods per cell, concurrency 1 and {concurrency}, {rounds} rounds; member-a's API server");
    println!("plain pod {} bytes, copy {} bytes (JSON as sent)", bytes(&plain), bytes(&copy));
    println!("offload namespace labels: {offload_labels:?}\n");
    fresh_namespace(&member, PLAIN_NS, &BTreeMap::new()).await;
    fresh_namespace(&member, OFFLOAD_LIKE_NS, &offload_labels).await;
    let identity = tidepool_identity(&env, &member, OFFLOAD_LIKE_NS).await;
    let mut cells: BTreeMap<Key, Cell> = BTreeMap::new();
    let mut order = cells_in_order(concurrency);
    for round in 0..rounds {
        let len = order.len();
        order.rotate_left(round % len);
        for &(who, shape, space, c) in &order {
            let template = if shape == "plain" { &plain } else { &copy };
            let namespace = if space == "plain" { PLAIN_NS } else { OFFLOAD_LIKE_NS };
            let client = if who == "admin" { &member } else { &identity };
            let got = run_cell(&env, (&member, client), (namespace, template), n, c).await;
            let cell = cells.entry((who, shape, space, c)).or_insert(Cell {
                client: vec![],
                server: vec![],
                apiserver_cpu: 0.0,
            });
            cell.client.extend(got.client);
            cell.server.extend(got.server);
            cell.apiserver_cpu += got.apiserver_cpu;
        }
    }
    print_table(&mut cells, n * rounds);
}

fn print_table(cells: &mut BTreeMap<Key, Cell>, per_cell: usize) {
    println!(
        "| as | pod | namespace | concurrency | creates | client p50 ms | client p99 ms | server p50 ms | server p99 ms | API server CPU ms per create |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for ((who, shape, space, c), cell) in cells.iter_mut() {
        cell.client.sort_by(f64::total_cmp);
        cell.server.sort_by(f64::total_cmp);
        println!(
            "| {who} | {shape} | {space} | {c} | {} | {} | {} | {} | {} | {:.2} |",
            cell.server.len(),
            ms(&cell.client, 50.0),
            ms(&cell.client, 99.0),
            ms(&cell.server, 50.0),
            ms(&cell.server, 99.0),
            cell.apiserver_cpu * 1e3 / per_cell as f64,
        );
    }
}
