//! Broken members get a clear `Ready=False` reason and never disturb a good member served
//! by the same tidepool; a broken member that gets fixed recovers without a restart.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

const TEST: &str = "bad-input";
const NS: &str = "e2e-bad-input";

#[tokio::test]
async fn broken_members_are_reported_and_the_good_one_keeps_working() {
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;

    let good = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    let good_text = String::from_utf8(good.clone()).unwrap();
    // A server nobody listens on (a port just bound and released).
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let secret_token = "e2e-s3cr3t-token-value";
    // The good member's CA: kubeconfigs that skip TLS verification are refused outright.
    let ca = good_text.lines().find_map(|l| l.trim().strip_prefix("certificate-authority-data:")).unwrap().trim();
    let unreachable = format!(
        "apiVersion: v1\nkind: Config\nclusters: [{{name: x, cluster: {{server: \"https://127.0.0.1:{closed_port}\", certificate-authority-data: {ca}}}}}]\n\
         users: [{{name: u, user: {{token: {secret_token}}}}}]\ncontexts: [{{name: x, context: {{cluster: x, user: u}}}}]\ncurrent-context: x\n"
    );
    let exec = good_text.replace("users:", "users:\n- name: plugin\n  user:\n    exec: {command: /bin/true, apiVersion: client.authentication.k8s.io/v1}\n");

    // Step 3 below creates this Secret; a previous run must not have left it.
    let _ = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(training.clone(), NS)
        .delete("not-there-yet", &DeleteParams::default())
        .await;
    put_kubeconfig_secret(&training, NS, "good", &good).await;
    put_kubeconfig_secret(&training, NS, "garbage", b"apiVersion: v1\nclusters: [oops").await;
    put_kubeconfig_secret(&training, NS, "unreachable", unreachable.as_bytes()).await;
    put_kubeconfig_secret(&training, NS, "exec", exec.as_bytes()).await;
    apply_member(&training, "e2e-bad-good", TEST, NS, "good").await;
    apply_member(&training, "e2e-bad-nosecret", TEST, NS, "not-there-yet").await;
    apply_member(&training, "e2e-bad-garbage", TEST, NS, "garbage").await;
    apply_member(&training, "e2e-bad-unreachable", TEST, NS, "unreachable").await;
    apply_member(&training, "e2e-bad-exec", TEST, NS, "exec").await;
    let tidepool = Tidepool::start(&env, TEST, NS);

    // 1. Every broken member says why, where the admin looks.
    let msg = wait_reason(&training, "e2e-bad-nosecret", "False", "SecretNotFound").await;
    assert!(msg.contains("not-there-yet"), "{msg}");
    wait_reason(&training, "e2e-bad-garbage", "False", "KubeconfigInvalid").await;
    let msg = wait_reason(&training, "e2e-bad-unreachable", "False", "Unreachable").await;
    assert!(msg.contains(&closed_port.to_string()), "{msg}");
    assert!(!msg.contains(secret_token), "credentials leaked into status: {msg}");
    let msg = wait_reason(&training, "e2e-bad-exec", "False", "KubeconfigRejected").await;
    assert!(msg.contains("exec"), "{msg}");

    // 2. The good member next to them is Ready and serves pods.
    wait_reason(&training, "e2e-bad-good", "True", "Connected").await;
    let nodes = Api::<Node>::all(training.clone());
    for broken in ["nosecret", "garbage", "unreachable", "exec"] {
        assert!(nodes.get_opt(&format!("tidepool-e2e-bad-{broken}")).await.unwrap().is_none(), "{broken} got a node");
        let mc = Api::<MemberCluster>::all(training.clone()).get(&format!("e2e-bad-{broken}")).await.unwrap();
        assert!(mc.metadata.finalizers.unwrap_or_default().is_empty(), "never reached, yet {broken} has a finalizer");
    }
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let worker = format!("worker-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": worker},
        "spec": {
            "nodeName": "tidepool-e2e-bad-good",
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), "pod on the good member Running", || {
        let (pods, worker) = (pods.clone(), worker.clone());
        async move { (pods.get(&worker).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let offload = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS)).get(&worker).await.unwrap();
    assert!(offload.spec.unwrap().node_name.unwrap().starts_with("member-b-gpu-"));

    // 3. Fixing a broken member brings it up without restarting tidepool.
    put_kubeconfig_secret(&training, NS, "not-there-yet", &good).await;
    wait_reason(&training, "e2e-bad-nosecret", "True", "Connected").await;
    wait_for(Duration::from_secs(30), "virtual node of the repaired member", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt("tidepool-e2e-bad-nosecret").await.ok().flatten().map(|_| ()) }
    })
    .await;

    // 4. Breaking a member that worked keeps its node, NotReady and tainted NoSchedule (no
    //    node churn, no crash loop), and leaves the others alone.
    put_kubeconfig_secret(&training, NS, "not-there-yet", b"not a kubeconfig").await;
    wait_reason(&training, "e2e-bad-nosecret", "False", "KubeconfigInvalid").await;
    wait_for(Duration::from_secs(30), "node of the broken member NotReady and tainted", || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get_opt("tidepool-e2e-bad-nosecret").await.ok()??;
            let tainted = node
                .spec
                .as_ref()?
                .taints
                .as_ref()?
                .iter()
                .any(|t| t.key == keys::TAINT_NOT_READY && t.effect == "NoSchedule");
            let conditions = node.status?.conditions?;
            let not_ready = conditions.iter().any(|c| c.type_ == "Ready" && c.status == "False");
            (tainted && not_ready).then_some(())
        }
    })
    .await;
    assert_eq!(pods.get(&worker).await.unwrap().status.unwrap().phase.as_deref(), Some("Running"));

    pods.delete(&worker, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(60), "worker deleted", || {
        let (pods, worker) = (pods.clone(), worker.clone());
        async move { pods.get_opt(&worker).await.ok()?.is_none().then_some(()) }
    })
    .await;
    for m in ["e2e-bad-good", "e2e-bad-nosecret", "e2e-bad-garbage", "e2e-bad-unreachable", "e2e-bad-exec"] {
        Api::<MemberCluster>::all(training.clone()).delete(m, &DeleteParams::default()).await.unwrap();
    }
    // 5. Only deleting the MemberCluster takes the kept node away (it was reached once, so
    //    it is drained); one never reached has nothing to drain and goes at once.
    wait_for(Duration::from_secs(30), "node of the deleted member removed", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt("tidepool-e2e-bad-nosecret").await.ok()?.is_none().then_some(()) }
    })
    .await;
    let members = Api::<MemberCluster>::all(training.clone());
    wait_for(Duration::from_secs(10), "never-reached members deleted without a drain", || {
        let members = members.clone();
        async move {
            for m in ["e2e-bad-garbage", "e2e-bad-unreachable", "e2e-bad-exec"] {
                if members.get_opt(m).await.ok()?.is_some() {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    drop(tidepool);
}
