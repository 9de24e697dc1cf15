//! A member that disrupts an offload pod itself is reflected on the training pod with its
//! own reason: preempted by the member's scheduler for a higher-priority online pod on a
//! full node → `Failed`/`PreemptedByMember`; evicted through the member's Eviction API →
//! `Failed`/`EvictedByMember`. Both real: the member's scheduler and API server do it.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

const TEST: &str = "member-disruption";
const NS: &str = "e2e-member-disruption";
const MEMBER: &str = "e2e-disrupt-b";
const ONLINE_NS: &str = "e2e-disrupt-online";

/// A training pod bound to the virtual node asking for a whole member node's GPUs (4 on
/// member-b), Running; returns the member node its copy landed on.
async fn run_whole_node(pods: &Api<Pod>, copies: &Api<Pod>, name: &str, node: &str) -> String {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), &format!("{name} Running"), || async move {
        (pods.get(name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
    copies.get(name).await.unwrap().spec.unwrap().node_name.unwrap()
}

/// Holds copy `name` in the member once its deletion starts (a finalizer of the test), so the
/// member's reason on it (`DisruptionTarget`) is there to be seen with its deletion: the member
/// deletes a kwok pod at once, and the copy's last status could otherwise be lost between
/// the condition's write and the deletion (tidepool then says `OffloadPodLost`, see the
/// report of issue 20).
async fn hold(copies: &Api<Pod>, name: &str, on: bool) {
    let finalizers = if on { serde_json::json!(["tidepool.io/e2e-hold"]) } else { serde_json::Value::Null };
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers}});
    copies.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
}

async fn failed_with(pods: &Api<Pod>, name: &str, reason: &str) -> String {
    wait_for(Duration::from_secs(60), &format!("{name} Failed with reason {reason}"), || async move {
        let st = pods.get(name).await.ok()?.status?;
        (st.phase.as_deref() == Some("Failed") && st.reason.as_deref() == Some(reason))
            .then(|| st.message.unwrap_or_default())
    })
    .await
}

async fn node_ready(training: &Client, node: &str) {
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node Ready", || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(node).await.ok()??;
            n.status?.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn a_member_preemption_and_a_member_eviction_are_reflected_with_their_reasons() {
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member_b, ONLINE_NS).await;
    clear_pods(&member_b, ONLINE_NS).await;
    ensure_priority_class(&member_b, "e2e-online-above-offload", 1000).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-b").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let node = format!("tidepool-{MEMBER}");
    node_ready(&training, &node).await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    let id = run_id();

    // 1. Preemption: an online pod above the offload priorities, for the node the copy
    //    fills: the member's scheduler preempts the copy to place it.
    let preempted = format!("preempted-{id}");
    let full = run_whole_node(&pods, &copies, &preempted, &node).await;
    hold(&copies, &preempted, true).await;
    let online: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("online-{id}")},
        "spec": {
            "priorityClassName": "e2e-online-above-offload",
            "nodeSelector": {"kubernetes.io/hostname": full},
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/online:1", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]
        }
    }))
    .unwrap();
    let online_pods = Api::<Pod>::namespaced(member_b.clone(), ONLINE_NS);
    online_pods.create(&PostParams::default(), &online).await.unwrap();
    let msg = failed_with(&pods, &preempted, "PreemptedByMember").await;
    assert!(msg.contains(MEMBER), "{msg}");
    hold(&copies, &preempted, false).await;
    wait_for(Duration::from_secs(60), "the online pod placed where the copy was", || {
        let (online_pods, name, full) = (online_pods.clone(), format!("online-{id}"), full.clone());
        async move { (online_pods.get(&name).await.ok()?.spec?.node_name.as_deref() == Some(full.as_str())).then_some(()) }
    })
    .await;

    // 2. Eviction: the member's Eviction API on another copy.
    let evicted = format!("evicted-{id}");
    run_whole_node(&pods, &copies, &evicted, &node).await;
    hold(&copies, &evicted, true).await;
    copies.evict(&evicted, &EvictParams::default()).await.unwrap();
    let msg = failed_with(&pods, &evicted, "EvictedByMember").await;
    assert!(msg.contains(MEMBER), "{msg} {}", tidepool.log_tail());
    hold(&copies, &evicted, false).await;

    online_pods
        .delete(&format!("online-{id}"), &DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
        .await
        .unwrap();
    drain_pods(&training, NS).await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}
