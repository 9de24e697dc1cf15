//! What `kubectl describe node` shows of a virtual node reads like a kubelet's: conditions
//! with real transition and heartbeat times (a transition time stays while the status
//! stays), memory in binary units (Ki), and tidepool's version in `tidepool_build_info`.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use crate::harness::*;

const TEST: &str = "node-status";
const NS: &str = "e2e-node-status";
const NODE: &str = "tidepool-node-status-member-b";

fn ready_times(node: &Node) -> Option<(jiff::Timestamp, jiff::Timestamp)> {
    let conditions = node.status.as_ref()?.conditions.as_ref()?;
    let ready = conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((ready.last_transition_time.as_ref()?.0, ready.last_heartbeat_time.as_ref()?.0))
}

fn cpus(node: &Node) -> Option<String> {
    Some(node.status.as_ref()?.allocatable.as_ref()?.get("cpu")?.0.clone())
}

#[tokio::test]
async fn a_virtual_node_reports_transition_times_memory_in_ki_and_the_build() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, "node-status-member-b", "member-b").await;
    let started = jiff::Timestamp::from_second(jiff::Timestamp::now().as_second()).unwrap();
    let tidepool = Tidepool::start(&env, TEST, NS);
    let nodes = Api::<Node>::all(training.clone());
    // Ready as written by this tidepool (an earlier run's node may still be there).
    let node = wait_for(Duration::from_secs(60), "virtual node Ready", || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(NODE).await.ok()??;
            let c = n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?.clone();
            (c.status == "True" && c.last_heartbeat_time?.0 >= started).then_some(n)
        }
    })
    .await;

    let status = node.status.clone().unwrap();
    for c in status.conditions.as_ref().unwrap() {
        assert!(c.last_transition_time.is_some(), "{} has no lastTransitionTime", c.type_);
        assert!(c.last_heartbeat_time.is_some(), "{} has no lastHeartbeatTime", c.type_);
    }
    let memory = &status.allocatable.as_ref().unwrap()["memory"].0;
    // Binary units, as kubelets write them (`…Ki`; the API server shortens exact ones to Mi, Gi…).
    let binary =
        ["Ki", "Mi", "Gi", "Ti", "Pi"].iter().any(|u| memory.strip_suffix(u).is_some_and(|n| n.parse::<u64>().is_ok()));
    assert!(binary, "memory {memory} is not in binary units");
    let (since, _) = ready_times(&node).unwrap();
    // Times have whole seconds: let the clock pass the node's first write first.
    while jiff::Timestamp::now().as_second() <= since.as_second() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // An online pod takes a core: the status is written again; Ready has not changed, so its
    // transition time stays while its heartbeat moves on.
    let before = cpus(&node).unwrap();
    let online = format!("online-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": online},
        "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1",
                                 "resources": {"requests": {"cpu": "1"}}}]}
    }))
    .unwrap();
    let online_pods = Api::<Pod>::namespaced(member.clone(), "default");
    online_pods.create(&PostParams::default(), &pod).await.unwrap();
    let rewritten = wait_for(Duration::from_secs(30), "status written after the capacity change", || {
        let (nodes, before) = (nodes.clone(), before.clone());
        async move {
            let n = nodes.get(NODE).await.ok()?;
            (cpus(&n)? != before).then_some(n)
        }
    })
    .await;
    online_pods.delete(&online, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    let (still, heartbeat) = ready_times(&rewritten).unwrap();
    assert_eq!(still, since, "Ready's lastTransitionTime moved without a transition");
    assert!(heartbeat > since, "the heartbeat ({heartbeat}) did not move on from {since}");

    let metrics = tidepool.scrape_live();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        metric_value(&metrics, "tidepool_build_info", &format!("version=\"{version}\"")),
        Some(1.0),
        "{metrics}"
    );
}
