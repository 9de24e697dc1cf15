//! The walking skeleton: a member's surplus appears as a Ready virtual node, and a pod
//! bound to it runs in the member, reports status back, and is deleted both ways.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use tidepool_config::{MemberCluster, Resources, keys};
use tidepool_federation::capacity::{NodeView, PodView, pool_capacity};

use crate::harness::*;

const TEST: &str = "skeleton";
const NS: &str = "e2e-skeleton";
const MEMBER: &str = "e2e-skel-a";
const NODE: &str = "tidepool-e2e-skel-a";

/// What the capacity model says member-a can lend, computed from the member's own API.
async fn member_surplus(member: &Client) -> Resources {
    let nodes = Api::<Node>::all(member.clone()).list(&ListParams::default()).await.unwrap();
    let pods = Api::<Pod>::all(member.clone()).list(&ListParams::default()).await.unwrap();
    let nodes: Vec<NodeView> = nodes.items.iter().map(NodeView::from_node).collect();
    let pods: Vec<PodView> = pods.items.iter().map(PodView::from_pod).collect();
    pool_capacity(&nodes, &pods, &BTreeMap::new()).capacity
}

fn allocatable(node: &Node) -> Option<Resources> {
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
    let expected = member_surplus(&member).await;
    assert!(expected.get("nvidia.com/gpu") >= 8_000, "member-a should lend GPUs, model says {expected}");
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
    let member_pods = Api::<Pod>::namespaced(member.clone(), &format!("tp-{NS}"));
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
    assert_eq!(labels["app"], "trainer");
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
