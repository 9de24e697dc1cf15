//! Colocation modes end to end: a pool that lends what Koordinator publishes as batch
//! capacity (`kubernetes.io/batch-cpu`, `batch-memory`) rather than the surplus of requests.
//!
//! The member's nodes are kwok nodes that advertise the batch resources the way
//! koord-manager publishes them on `status.allocatable` (CPU in milli-cores as a whole
//! number); [`Agent`] changes them as koord-manager would when online usage moves. The
//! member has Koordinator's real PriorityClass `koord-batch`, and its own kube-scheduler
//! places the translated copies (it fits extended resources natively).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::MemberCluster;
use tidepool_api::crd::{PoolMode, PoolSpec, PoolToleration};
use tidepool_api::keys;
use tidepool_api::resources::parse_milli;

use crate::harness::*;

const NS: &str = "e2e-colocation";
/// Label and taint of the test's member nodes: only its pools (which tolerate the taint)
/// count them, so no other test's pool or online pod ever sees them.
const NODE_KEY: &str = "tidepool.io/e2e-colocation";
const BATCH_CPU: &str = "kubernetes.io/batch-cpu";
const BATCH_MEMORY: &str = "kubernetes.io/batch-memory";
/// Each member node: 8 cores, 7 of them requested by online pods that use little of them.
const NODE_CPU: u32 = 8;
const ONLINE_CPU: u32 = 7;
const NODES: usize = 2;

fn node_name(test: &str, i: usize) -> String {
    format!("colo-{test}-{i}")
}

/// What stands in for koord-manager: it publishes the batch allocatable of the test's nodes
/// on their status, as the real one does after each NodeMetric report.
struct Agent {
    nodes: Api<Node>,
    names: Vec<String>,
}

impl Agent {
    /// Publishes `milli_cpu` of batch CPU and `memory` of batch memory on every node, or
    /// removes both (`None`: the agent is gone and its resources were reset), and waits until
    /// every node shows it.
    async fn publish(&self, batch: Option<(u32, &str)>) {
        let allocatable = match batch {
            Some((milli, memory)) => json!({BATCH_CPU: milli.to_string(), BATCH_MEMORY: memory}),
            None => json!({BATCH_CPU: null, BATCH_MEMORY: null}),
        };
        let patch = json!({"status": {"allocatable": allocatable, "capacity": allocatable}});
        for name in &self.names {
            self.nodes.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
        }
        // The API server writes quantities its own way (`6000` becomes `6k`).
        let want = batch.map(|(milli, _)| i64::from(milli) * 1000);
        for name in &self.names {
            wait_for(Duration::from_secs(20), &format!("{name} publishes batch-cpu {want:?}"), || async {
                let node = self.nodes.get(name).await.ok()?;
                let shown = node.status?.allocatable?.get(BATCH_CPU).map(|q| parse_milli(&q.0).unwrap_or(-1));
                (shown == want).then_some(())
            })
            .await;
        }
    }
}

/// The test's member nodes (kwok, tainted and labelled for it) with `ONLINE_CPU` cores of
/// online requests on each, and Koordinator's PriorityClass. Nodes left by an earlier run go
/// first.
async fn member_side(member: &Client, test: &str) -> Agent {
    ensure_priority_class(member, "koord-batch", 5000).await;
    let nodes = Api::<Node>::all(member.clone());
    let names: Vec<String> = (0..NODES).map(|i| node_name(test, i)).collect();
    let online_ns = format!("online-{test}");
    ensure_namespace(member, &online_ns).await;
    clear_pods(member, &online_ns).await;
    for name in &names {
        let _ = nodes.delete(name, &DeleteParams::default()).await;
    }
    for name in &names {
        wait_for(Duration::from_secs(30), &format!("old {name} gone"), || async {
            nodes.get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await;
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": name, NODE_KEY: test}},
            "spec": {"providerID": format!("kwok://{name}"),
                     "taints": [{"key": NODE_KEY, "value": "true", "effect": "NoSchedule"}]},
            "status": {"capacity": {"cpu": NODE_CPU.to_string(), "memory": "32Gi", "pods": "110"},
                       "allocatable": {"cpu": NODE_CPU.to_string(), "memory": "32Gi", "pods": "110"}}
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &node).await.unwrap();
    }
    // Online pods that requested most of each node (their actual use is the agent's business).
    let online = Api::<Pod>::namespaced(member.clone(), &online_ns);
    for name in &names {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("web-{name}")},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": name},
                     "tolerations": [{"key": NODE_KEY, "operator": "Exists"}],
                     "containers": [{"name": "web", "image": "example.invalid/web:1",
                                     "resources": {"requests": {"cpu": ONLINE_CPU.to_string(), "memory": "8Gi"}}}]}
        }))
        .unwrap();
        online.create(&PostParams::default(), &pod).await.unwrap();
    }
    wait_for(Duration::from_secs(60), "online pods Running", || async {
        let pods = online.list(&ListParams::default()).await.ok()?.items;
        (pods.len() == NODES
            && pods.iter().all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")))
        .then_some(())
    })
    .await;
    Agent { nodes, names }
}

/// Removes the test's member nodes and online pods.
async fn member_cleanup(member: &Client, agent: &Agent, test: &str) {
    clear_pods(member, &format!("online-{test}")).await;
    for name in &agent.names {
        let _ = agent.nodes.delete(name, &DeleteParams::default()).await;
    }
}

/// MemberCluster `name` on member-a with one pool `batch` of the test's nodes in `mode`.
fn colocation_member(name: &str, test: &str, mode: PoolMode) -> MemberCluster {
    let mut mc = member_cluster(name, test, NS, "member-a");
    mc.spec.pools = vec![PoolSpec {
        name: "batch".into(),
        node_selector: BTreeMap::from([(NODE_KEY.to_owned(), test.to_owned())]),
        tolerations: vec![PoolToleration {
            key: Some(NODE_KEY.into()),
            operator: Some("Exists".into()),
            ..Default::default()
        }],
        mode,
        ..Default::default()
    }];
    mc
}

async fn wait_lendable(training: &Client, node: &str, milli: i64) {
    wait_for(Duration::from_secs(60), &format!("{node} lends {milli}m cpu"), || async {
        (lendable_cpu(training, node).await? == milli).then_some(())
    })
    .await;
}

fn phase_of(p: &Pod) -> Option<&str> {
    p.status.as_ref()?.phase.as_deref()
}

/// A Job of `n` pods of 1 CPU and 1 Gi each, for `test`'s tidepool.
fn job(test: &str, name: &str, n: i32) -> Job {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"parallelism": n, "completions": n, "backoffLimit": 0,
                 "template": {"spec": {"schedulerName": scheduler_name(test), "restartPolicy": "Never",
                     "containers": [{"name": "train", "image": "example.invalid/trainer:1",
                                     "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}}
    }))
    .unwrap()
}

/// The CPU (milli-cores) lent to job `name`'s pods once they settle: `running` of them
/// Running, the rest waiting unbound in training because the pool has no more to lend.
async fn lent_to_job(training: &Client, name: &str, running: usize) -> i64 {
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let lp = ListParams::default().labels(&format!("job-name={name}"));
    let items = wait_for(Duration::from_secs(90), &format!("{running} pods of {name} Running"), || async {
        let items = pods.list(&lp).await.ok()?.items;
        (items.iter().filter(|p| phase_of(p) == Some("Running")).count() == running).then_some(items)
    })
    .await;
    let bound = items.iter().filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some())).count();
    assert_eq!(bound, running, "pods bound beyond what runs: the pool lent more than it has");
    running as i64 * 1000
}

async fn delete_job(training: &Client, name: &str) {
    let dp = DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Foreground), ..Default::default() };
    Api::<Job>::namespaced(training.clone(), NS).delete(name, &dp).await.unwrap();
    drain_pods(training, NS).await;
}

#[tokio::test]
async fn a_job_is_lent_at_least_three_times_the_cpu_in_koordinator_batch_mode_on_the_same_load() {
    const TEST: &str = "colo-lend";
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    let agent = member_side(&member, TEST).await;
    // koord-manager lends 6 of each node's 8 cores: its online pods requested 7 but use ~2.
    agent.publish(Some((6000, "20Gi"))).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    let name = format!("colo-{TEST}");
    let vnode = format!("tidepool-{name}-batch");
    apply_member_cluster(&training, &colocation_member(&name, TEST, PoolMode::Requests)).await;
    let _tp = Tidepool::start(&env, TEST, NS);
    let jobs = Api::<Job>::namespaced(training.clone(), NS);
    let id = run_id();

    // 1. Requests mode: 8 − 7 requested = 1 core per node.
    let requests_cpu = i64::from((NODE_CPU - ONLINE_CPU) * NODES as u32) * 1000;
    wait_lendable(&training, &vnode, requests_cpu).await;
    let first = format!("train-{id}-a");
    jobs.create(&PostParams::default(), &job(TEST, &first, 12)).await.unwrap();
    let lent_requests = lent_to_job(&training, &first, 2).await;
    delete_job(&training, &first).await;

    // 2. The same pool, the same online load, in koordinator-batch mode: 6 cores per node.
    apply_member_cluster(&training, &colocation_member(&name, TEST, PoolMode::KoordinatorBatch)).await;
    wait_lendable(&training, &vnode, 12_000).await;
    let second = format!("train-{id}-b");
    jobs.create(&PostParams::default(), &job(TEST, &second, 12)).await.unwrap();
    let lent_batch = lent_to_job(&training, &second, 12).await;
    println!("colocation: job lent {lent_requests}m cpu in requests mode, {lent_batch}m in koordinator-batch mode");
    assert!(lent_batch >= 3 * lent_requests, "{lent_batch}m is not 3 × {lent_requests}m");

    // 3. The copies are Koordinator batch work, placed by the member's scheduler on its nodes.
    let copies = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS)).list(&ListParams::default()).await.unwrap();
    // Only this job's: a failed earlier run may have left copies its tidepool has not collected.
    let copies: Vec<&Pod> = copies.items.iter().filter(|c| c.name_any().starts_with(&second)).collect();
    assert_eq!(copies.len(), 12);
    for copy in copies {
        let spec = copy.spec.as_ref().unwrap();
        assert_eq!(spec.priority_class_name.as_deref(), Some("koord-batch"), "{}", copy.name_any());
        assert_eq!(spec.priority, Some(5000));
        assert_eq!(copy.labels().get("koordinator.sh/qosClass").map(String::as_str), Some("BE"));
        let requests = spec.containers[0].resources.as_ref().unwrap().requests.clone().unwrap();
        // 1 core as 1000 milli-cores (the API server writes it `1k`).
        assert_eq!(requests.get(BATCH_CPU).map(|q| parse_milli(&q.0).unwrap()), Some(1000 * 1000));
        assert_eq!(requests.get(BATCH_MEMORY).map(|q| q.0.as_str()), Some("1Gi"));
        assert!(!requests.contains_key("cpu") && !requests.contains_key("memory"), "{requests:?}");
        assert!(agent.names.iter().any(|n| spec.node_name.as_deref() == Some(n.as_str())), "{:?}", spec.node_name);
    }

    delete_job(&training, &second).await;
    member_cleanup(&member, &agent, TEST).await;
}

fn training_pod(test: &str, name: &str, cpu: &str, labels: serde_json::Value, class: Option<&str>) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"schedulerName": scheduler_name(test),
                 "containers": [{"name": "train", "image": "example.invalid/trainer:1",
                                 "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]}
    }))
    .unwrap();
    p.spec.as_mut().unwrap().priority_class_name = class.map(str::to_owned);
    p
}

async fn pod_state(pods: &Api<Pod>, name: &str) -> Option<(String, Option<String>, bool)> {
    let status = pods.get(name).await.ok()?.status?;
    let noticed =
        status.conditions.iter().flatten().any(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED && c.status == "True");
    Some((status.phase?, status.reason, noticed))
}

#[tokio::test]
async fn the_agent_shrinking_batch_cpu_reclaims_the_low_band_with_notice_and_keeps_the_rest() {
    const TEST: &str = "colo-reclaim";
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    let agent = member_side(&member, TEST).await;
    agent.publish(Some((6000, "20Gi"))).await;
    ensure_priority_class(&training, "e2e-training-high", 2500).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    let name = format!("colo-{TEST}");
    apply_member_cluster(&training, &colocation_member(&name, TEST, PoolMode::KoordinatorBatch)).await;
    let settings = "deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 4, medium: 30, low: 3}";
    let _tp = Tidepool::start_with(&env, TEST, NS, settings);
    wait_lendable(&training, &format!("tidepool-{name}-batch"), 12_000).await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let id = run_id();

    // 1. 10 of the 12 lent cores: a high pod of 2, and a gang of 2 core + 2 elastic pods of 2.
    let high = format!("ps-{id}");
    pods.create(&PostParams::default(), &training_pod(TEST, &high, "2", json!({}), Some("e2e-training-high")))
        .await
        .unwrap();
    crate::dispatcher::install_pod_group_crd(&training, "scheduling.x-k8s.io", "v1alpha1").await;
    let group = format!("job-{id}");
    crate::dispatcher::create_pod_group(&training, NS, "scheduling.x-k8s.io", "v1alpha1", &group, 2).await;
    let job: Vec<String> = (0..4).map(|i| format!("job-{id}-{i}")).collect();
    for n in &job {
        let labels = json!({keys::LABEL_POD_GROUP: group});
        pods.create(&PostParams::default(), &training_pod(TEST, n, "2", labels, None)).await.unwrap();
    }
    let all: Vec<String> = job.iter().chain([&high]).cloned().collect();
    wait_for(Duration::from_secs(90), "every pod Running", || async {
        for n in &all {
            if pod_state(&pods, n).await?.0 != "Running" {
                return None;
            }
        }
        Some(())
    })
    .await;
    let mut by_band: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in &all {
        by_band.entry(pods.get(n).await.unwrap().labels()[keys::LABEL_BAND].clone()).or_default().push(n.clone());
    }
    assert_eq!(by_band["low"].len(), 2);

    // 2. Online usage rises: the agent lends 3 cores per node. 6 lendable, 10 used: 4 cores
    //    of deficit, exactly the two low pods, each noticed before it goes.
    agent.publish(Some((3000, "20Gi"))).await;
    for low in &by_band["low"] {
        wait_for(Duration::from_secs(30), &format!("{low} noticed"), || async {
            pod_state(&pods, low).await?.2.then_some(())
        })
        .await;
    }
    for low in &by_band["low"] {
        wait_for(Duration::from_secs(60), &format!("{low} reclaimed"), || async {
            let (phase, reason, _) = pod_state(&pods, low).await?;
            (phase == "Failed" && reason.as_deref() == Some(keys::REASON_RECLAIMED)).then_some(())
        })
        .await;
    }
    for n in by_band["medium"].iter().chain(&by_band["high"]) {
        let (phase, _, noticed) = pod_state(&pods, n).await.unwrap();
        assert_eq!((phase.as_str(), noticed), ("Running", false), "{n} should keep running, unnoticed");
    }

    drain_pods(&training, NS).await;
    member_cleanup(&member, &agent, TEST).await;
}

#[tokio::test]
async fn without_the_agent_the_pool_is_not_ready_and_a_guaranteed_pod_is_refused_with_the_reason() {
    const TEST: &str = "colo-refuse";
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    // No agent publishes batch resources yet.
    let agent = member_side(&member, TEST).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    let name = format!("colo-{TEST}");
    let vnode = format!("tidepool-{name}-batch");
    apply_member_cluster(&training, &colocation_member(&name, TEST, PoolMode::KoordinatorBatch)).await;
    let _tp = Tidepool::start(&env, TEST, NS);

    // 1. The pool is NotReady, saying what is missing.
    let nodes = Api::<Node>::all(training.clone());
    let message = wait_for(Duration::from_secs(60), "virtual node NotReady, colocation resources missing", || async {
        let conditions = nodes.get_opt(&vnode).await.ok()??.status?.conditions?;
        let ready = conditions.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.status == "False" && ready.reason.as_deref() == Some("ColocationResourcesMissing"))
            .then(|| ready.message.unwrap_or_default())
    })
    .await;
    assert!(message.contains(BATCH_CPU), "{message}");

    // 2. The agent publishes: the pool is Ready and lends it.
    agent.publish(Some((6000, "20Gi"))).await;
    wait_lendable(&training, &vnode, 12_000).await;

    // 3. A pod asking for Guaranteed QoS cannot be Koordinator batch work: refused, with why.
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let id = run_id();
    let guaranteed = format!("exclusive-{id}");
    let mut pod = training_pod(TEST, &guaranteed, "1", json!({}), None);
    let resources = pod.spec.as_mut().unwrap().containers[0].resources.as_mut().unwrap();
    resources.limits = resources.requests.clone();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let message = wait_for(Duration::from_secs(60), "guaranteed pod refused", || async {
        let status = pods.get(&guaranteed).await.ok()?.status?;
        (status.phase.as_deref() == Some("Failed") && status.reason.as_deref() == Some(keys::REASON_OFFLOAD_POLICY))
            .then(|| status.message.unwrap_or_default())
    })
    .await;
    assert!(message.contains("Guaranteed") && message.contains("koordinator-batch"), "{message}");
    let copies = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    assert!(copies.get_opt(&guaranteed).await.unwrap().is_none(), "a refused pod reached the member");

    drain_pods(&training, NS).await;
    member_cleanup(&member, &agent, TEST).await;
}
