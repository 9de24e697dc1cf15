//! The walking skeleton: a member's surplus appears as a Ready virtual node, and a pod
//! bound to it runs in the member, reports status back, and is deleted both ways.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use tidepool_api::{MemberCluster, Resources, keys};

use crate::harness::*;

const TEST: &str = "skeleton";
const NS: &str = "e2e-skeleton";
const MEMBER: &str = "e2e-skel-a";
const NODE: &str = "tidepool-e2e-skel-a";

/// What member-a can lend, worked out here from its nodes and pods with none of the
/// capacity model under test: the allocatable of its Ready, schedulable nodes without a
/// `NoSchedule`/`NoExecute` taint (the skeleton's member tolerates none), minus the requests
/// of the online pods on them and of the online pods still pending (no node selector
/// here picks a node outside that set). Offload copies do not count: they use the surplus.
async fn member_surplus(member: &Client) -> Resources {
    pool_surplus(member, &std::collections::BTreeMap::new()).await
}

/// Like [`member_surplus`], for a pool: only nodes carrying every label of `selector`.
pub(crate) async fn pool_surplus(member: &Client, selector: &std::collections::BTreeMap<String, String>) -> Resources {
    let nodes = Api::<Node>::all(member.clone()).list(&ListParams::default()).await.unwrap().items;
    let pods = Api::<Pod>::all(member.clone()).list(&ListParams::default()).await.unwrap().items;
    let lends = |n: &Node| {
        let spec = n.spec.clone().unwrap_or_default();
        let hard_taint =
            spec.taints.unwrap_or_default().iter().any(|t| t.effect == "NoSchedule" || t.effect == "NoExecute");
        let labels = n.metadata.labels.clone().unwrap_or_default();
        let in_pool = selector.iter().all(|(k, v)| labels.get(k) == Some(v));
        is_ready(n) && !spec.unschedulable.unwrap_or(false) && !hard_taint && in_pool
    };
    let lending: Vec<&Node> = nodes.iter().filter(|n| lends(n)).collect();
    let mut surplus = Resources::new();
    for n in &lending {
        surplus.add(&allocatable(n).unwrap_or_default());
    }
    for p in &pods {
        let offload = p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(keys::LABEL_ORIGIN_UID));
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if offload || matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let spec = p.spec.clone().unwrap_or_default();
        let counts = match &spec.node_name {
            Some(node) => lending.iter().any(|n| n.metadata.name.as_ref() == Some(node)),
            None => {
                let selector = spec.node_selector.clone().unwrap_or_default();
                lending.iter().any(|n| {
                    let labels = n.metadata.labels.clone().unwrap_or_default();
                    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
                })
            }
        };
        if counts {
            surplus.sub(&requests(&spec));
        }
    }
    surplus.clamp_non_negative();
    surplus
}

/// A pod's requests as the member's scheduler counts them, written out for the test: its
/// containers and restartable init containers (sidecars) together, or its largest other
/// init container with the sidecars started before it if larger, plus overhead and one pod.
fn requests(spec: &k8s_openapi::api::core::v1::PodSpec) -> Resources {
    let of = |c: &k8s_openapi::api::core::v1::Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|q| Resources::from_quantities(q).ok())
            .unwrap_or_default()
    };
    let mut sidecars = Resources::new();
    let mut init_peak = Resources::new();
    for c in spec.init_containers.iter().flatten() {
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars.add(&of(c));
        } else {
            let mut during = of(c);
            during.add(&sidecars);
            init_peak.max_with(&during);
        }
    }
    let mut total = sidecars;
    for c in &spec.containers {
        total.add(&of(c));
    }
    total.max_with(&init_peak);
    if let Some(overhead) = spec.overhead.as_ref().and_then(|q| Resources::from_quantities(q).ok()) {
        total.add(&overhead);
    }
    total.add_one("pods", 1000);
    total
}

pub(crate) fn allocatable(node: &Node) -> Option<Resources> {
    Resources::from_quantities(node.status.as_ref()?.allocatable.as_ref()?).ok()
}

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn a_member_becomes_a_ready_virtual_node_and_a_pod_goes_there_and_back() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let tidepool = Tidepool::start(&env, TEST, NS);

    // 1. The virtual node registers Ready, with the member's requests-based surplus.
    let nodes = Api::<Node>::all(training.clone());
    let node = wait_for(Duration::from_secs(90), "virtual node Ready", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten().filter(is_ready) }
    })
    .await;
    let labels = node.metadata.labels.clone().unwrap();
    assert_eq!(labels["type"], "virtual-kubelet");
    assert_eq!(labels[keys::LABEL_MEMBER], MEMBER);
    let spec = node.spec.clone().unwrap();
    assert!(
        spec.taints.unwrap().iter().any(|t| t.key == keys::TAINT_VIRTUAL && t.effect == "NoSchedule"),
        "virtual node lacks its taint"
    );
    let status = node.status.clone().unwrap();
    let addresses = status.addresses.unwrap();
    assert_eq!((addresses[0].type_.as_str(), addresses[0].address.as_str()), ("InternalIP", "127.0.0.2"));
    // An online pod of the member on a GPU node, so the surplus is more than allocatable.
    // In a namespace of its own: the member namespace named like the training one is
    // tidepool's to make (same-named offload namespaces are the default).
    let online_ns = format!("{NS}-online");
    ensure_namespace(&member, &online_ns).await;
    clear_pods(&member, &online_ns).await;
    let online_pods = Api::<Pod>::namespaced(member.clone(), &online_ns);
    let online = format!("online-{}", run_id());
    let online_pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": online},
        "spec": {
            "nodeName": "member-a-gpu-0",
            "containers": [{"name": "web", "image": "example.invalid/web:1",
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    online_pods.create(&PostParams::default(), &online_pod).await.unwrap();
    let expected = member_surplus(&member).await;
    // member-a has two 8-GPU nodes; the test's own arithmetic must see at least one of them.
    assert!(expected.get("nvidia.com/gpu") >= 8_000, "member-a should lend GPUs, the test computes {expected}");
    // Other tests may add pods to member-a meanwhile, so compare until both agree.
    wait_for(Duration::from_secs(30), "allocatable equal to the member's surplus", || {
        let (nodes, member) = (nodes.clone(), member.clone());
        async move {
            let node = nodes.get(NODE).await.ok()?;
            let want = member_surplus(&member).await;
            let have = allocatable(&node)?;
            ["cpu", "memory", "nvidia.com/gpu", "pods"].iter().all(|r| have.get(r) == want.get(r)).then_some(())
        }
    })
    .await;

    // The online pod is counted: allocatable is what the member's nodes have minus it (and
    // whatever else runs there), never their plain allocatable.
    let have = allocatable(&nodes.get(NODE).await.unwrap()).unwrap();
    let all_gpus: i64 = Api::<Node>::all(member.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(allocatable)
        .map(|a| a.get("nvidia.com/gpu"))
        .sum();
    assert!(have.get("nvidia.com/gpu") <= all_gpus - 1000, "the online GPU pod is not subtracted: {have}");
    online_pods.delete(&online, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();

    // 2. The Lease is renewed, so the node lifecycle controller keeps the node Ready.
    let leases = Api::<Lease>::namespaced(training.clone(), "kube-node-lease");
    let first = wait_for(Duration::from_secs(20), "node lease", || {
        let leases = leases.clone();
        async move { leases.get_opt(NODE).await.ok().flatten()?.spec?.renew_time }
    })
    .await;
    wait_for(Duration::from_secs(25), "lease renewal", || {
        let (leases, first) = (leases.clone(), first.clone());
        async move { leases.get(NODE).await.ok()?.spec?.renew_time.filter(|t| t.0 > first.0) }
    })
    .await;
    let node = nodes.get(NODE).await.unwrap();
    assert!(is_ready(&node));
    let not_ready_taint =
        node.spec.unwrap().taints.unwrap_or_default().into_iter().any(|t| t.key.starts_with("node.kubernetes.io/"));
    assert!(!not_ready_taint, "node lifecycle controller still taints the virtual node");

    // 3. A pod bound to the virtual node runs in the member.
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = format!("trainer-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": "trainer"}},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "2", "memory": "4Gi"}}}]
        }
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let member_pods = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let offload = wait_for(Duration::from_secs(60), "offload pod Running in the member", || {
        let (member_pods, name) = (member_pods.clone(), name.clone());
        async move {
            let p = member_pods.get_opt(&name).await.ok().flatten()?;
            (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
        }
    })
    .await;
    let labels = offload.metadata.labels.clone().unwrap();
    assert_eq!(labels[keys::LABEL_ORIGIN_UID], uid);
    assert_eq!(labels[keys::LABEL_ORIGIN_CLUSTER], "training");
    // Tenant labels travel only when the MemberCluster lists them (`spec.copyLabels`).
    assert!(!labels.contains_key("app"), "a tenant label travelled unlisted: {labels:?}");
    let member_node = offload.spec.as_ref().unwrap().node_name.clone().unwrap();
    assert!(member_node.starts_with("member-a-gpu-"), "member scheduler put the GPU pod on {member_node}");
    assert_eq!(offload.spec.as_ref().unwrap().preemption_policy.as_deref(), Some("Never"));

    // 4. Its status shows in the training cluster.
    let member_ip = offload.status.as_ref().unwrap().pod_ip.clone().unwrap();
    let running = wait_for(Duration::from_secs(30), "training pod Running with the member's status", || {
        let (pods, ip, name) = (pods.clone(), member_ip.clone(), name.clone());
        async move {
            let p = pods.get(&name).await.ok()?;
            let s = p.status.as_ref()?;
            (s.phase.as_deref() == Some("Running") && s.pod_ip.as_deref() == Some(ip.as_str())).then_some(p)
        }
    })
    .await;
    let s = running.status.unwrap();
    assert_eq!(s.host_ip.as_deref(), Some("127.0.0.2"));
    assert!(s.start_time.is_some());
    let cs = &s.container_statuses.unwrap()[0];
    assert!(cs.ready && cs.state.as_ref().unwrap().running.is_some(), "container status not copied: {cs:?}");
    assert!(s.conditions.unwrap().iter().any(|c| c.type_ == "Ready" && c.status == "True"));

    // 5. The MemberCluster reports Ready with its surplus.
    let mc = Api::<MemberCluster>::all(training.clone()).get(MEMBER).await.unwrap();
    let status = mc.status.unwrap();
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.status, "True", "{ready:?}");
    assert!(status.gpu_surplus.is_some());

    // 6. Deleting the training pod removes the member copy, then the training pod.
    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(60), "offload pod deleted in the member", || {
        let (member_pods, name) = (member_pods.clone(), name.clone());
        async move { member_pods.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    wait_for(Duration::from_secs(30), "training pod deletion finished", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { pods.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;

    // 7. Removing the MemberCluster removes its virtual node.
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(30), "virtual node removed with its member", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok()?.is_none().then_some(()) }
    })
    .await;
    drop(tidepool);
}
