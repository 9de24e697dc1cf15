//! Removing a member leaves nothing behind: deleting a bridged `MemberCluster` fails its
//! training pods `MemberRemoved`, removes the offload copy, the reflected ConfigMap and the
//! offload namespace from the member, then the virtual node, and only then the object.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

const TEST: &str = "drain";
const NS: &str = "e2e-drain";
const MEMBER: &str = "e2e-drain-a";
const NODE: &str = "tidepool-e2e-drain-a";

#[tokio::test]
async fn deleting_a_member_fails_its_pods_and_removes_everything_tidepool_made_there() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node registered", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten().map(|_| ()) }
    })
    .await;
    let members = Api::<MemberCluster>::all(training.clone());

    // 1. A pod with a ConfigMap runs across: copy and reflected ConfigMap in member-a.
    let id = run_id();
    let (trainer, config) = (format!("trainer-{id}"), format!("cfg-{id}"));
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": config}, "data": {"lr": "0.1"}})).unwrap();
    Api::<ConfigMap>::namespaced(training.clone(), NS).create(&PostParams::default(), &cm).await.unwrap();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": trainer},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [{"name": "config", "configMap": {"name": config}}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                "volumeMounts": [{"name": "config", "mountPath": "/etc/trainer"}],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
        }
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let member_ns = offload_ns(NS);
    let member_pods = Api::<Pod>::namespaced(member.clone(), &member_ns);
    let member_cms = Api::<ConfigMap>::namespaced(member.clone(), &member_ns);
    let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());
    wait_for(Duration::from_secs(60), "training pod Running across the bridge", || {
        let pods = pods.clone();
        let trainer = trainer.clone();
        async move { (phase(&pods.get(&trainer).await.ok()?).as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    assert!(member_pods.get_opt(&trainer).await.unwrap().is_some(), "offload copy in member-a");
    assert!(member_cms.get_opt(&config).await.unwrap().is_some(), "reflected ConfigMap in member-a");

    // 2. The MemberCluster is deleted: it is drained, then goes.
    members.delete(MEMBER, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(90), "MemberCluster gone after its drain", || {
        let members = members.clone();
        async move { members.get_opt(MEMBER).await.ok()?.is_none().then_some(()) }
    })
    .await;

    // 3. What the drain left: the training pod failed with the reason, nothing in member-a.
    let failed = pods.get(&trainer).await.unwrap();
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        (status.phase.as_deref(), status.reason.as_deref()),
        (Some("Failed"), Some(keys::REASON_MEMBER_REMOVED)),
        "{}",
        tidepool.log_tail()
    );
    assert!(status.message.unwrap_or_default().contains(MEMBER));
    assert!(member_pods.get_opt(&trainer).await.unwrap().is_none(), "offload copy left in member-a");
    assert!(member_cms.get_opt(&config).await.unwrap().is_none(), "reflected ConfigMap left in member-a");
    assert!(
        Api::<Namespace>::all(member.clone()).get_opt(&member_ns).await.unwrap().is_none(),
        "offload namespace {member_ns} left in member-a"
    );
    assert!(nodes.get_opt(NODE).await.unwrap().is_none(), "virtual node left");
    pods.delete(&trainer, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    drop(tidepool);
}
