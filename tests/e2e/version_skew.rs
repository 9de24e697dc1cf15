//! Version skew: the training cluster and a member one Kubernetes minor apart. With
//! `CP_SKEW_BIN` (tests/controlplane/build-skew.sh), member-b runs the previous minor's
//! apiserver, controller-manager, scheduler and real-node kubelet; tidepool bridges it as it
//! bridges a member of its own version: its real node's capacity on a virtual node, a pod
//! offloaded there with its status coming back, and `kubectl logs` and `exec` through it.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::{MemberCluster, MemberClusterStatus};

use crate::harness::*;

const TEST: &str = "version-skew";
const NS: &str = "e2e-version-skew";
const MEMBER: &str = "e2e-skew-b";
const NODE: &str = "tidepool-e2e-skew-b-real";

/// `(major, minor)` of a cluster's apiserver.
async fn minor(client: &Client) -> (u32, u32) {
    let info = client.apiserver_version().await.unwrap();
    let number = |s: &str| s.trim_end_matches('+').parse::<u32>().unwrap_or_else(|_| panic!("version {s:?}"));
    (number(&info.major), number(&info.minor))
}

/// The member's pool `real` status once it counts the real node.
async fn real_pool_status(training: &Client) -> MemberClusterStatus {
    let api = Api::<MemberCluster>::all(training.clone());
    wait_for(Duration::from_secs(60), "pool `real` of the skew member counts its real node", || {
        let api = api.clone();
        async move {
            let status = api.get(MEMBER).await.ok()?.status?;
            status.pools.iter().any(|p| p.name == "real" && p.nodes == 1).then_some(status)
        }
    })
    .await
}

#[tokio::test]
async fn a_member_one_minor_older_is_bridged_capacity_pods_status_logs_and_exec() {
    let env = Env::load();
    let training = env.client("training").await;
    let skew = env.var_opt("CP_SKEW_MEMBER").unwrap_or_else(|| {
        panic!(
            "the clusters run one Kubernetes version: start them with \
             CP_SKEW_BIN=$(bash tests/controlplane/build-skew.sh | tail -n 1) (tests/run.sh does unless TIDEPOOL_SKEW=0)"
        )
    });
    assert_eq!(skew, "member-b", "this test bridges member-b's real node");
    let member = env.client("member-b").await;
    let (t, m) = (minor(&training).await, minor(&member).await);
    assert_eq!((m.0, m.1 + 1), t, "member-b runs {m:?}, training {t:?}: not one minor apart");
    let real_node = env.var("MEMBER_B_REAL_NODE").to_owned();
    let node_info = Api::<Node>::all(member.clone()).get(&real_node).await.unwrap().status.unwrap().node_info.unwrap();
    assert!(
        node_info.kubelet_version.starts_with(&format!("v{}.{}.", m.0, m.1)),
        "member-b's real node runs kubelet {}, not the member's minor",
        node_info.kubelet_version
    );

    let mut mc = member_cluster(MEMBER, TEST, NS, "member-b");
    mc.spec.pools = vec![real_pool(&env)];
    let tidepool = start_on_real_node(&env, &training, (TEST, NS), "", &mc, NODE).await;

    // Capacity: the pool counts the old kubelet's node, and the virtual node offers what the
    // pool status says it can lend, at most the real node's allocatable CPU.
    let status = real_pool_status(&training).await;
    let pool = status.pools.iter().find(|p| p.name == "real").unwrap();
    let virtual_node = Api::<Node>::all(training.clone()).get(NODE).await.unwrap();
    let offered = virtual_node.status.unwrap().allocatable.unwrap();
    assert_eq!(offered.get("cpu"), pool.capacity.get("cpu"), "virtual node vs pool status");
    let lent = tidepool_api::resources::parse_milli(&offered["cpu"].0).unwrap();
    let real_cpu = Api::<Node>::all(member.clone()).get(&real_node).await.unwrap().status.unwrap().allocatable.unwrap();
    let real_millis = tidepool_api::resources::parse_milli(&real_cpu["cpu"].0).unwrap();
    assert!(lent > 0 && lent <= real_millis, "lends {lent}m of the real node's {real_millis}m");

    // A pod offloaded to the old kubelet: running, its logs and exec come back, then its exit.
    let id = run_id();
    let name = format!("skew-{id}");
    let script =
        format!("echo \"hello from {id}\"; while [ ! -f /tmp/go ]; do sleep 0.2; done; echo \"bye {id}\"; exit 3");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "main",
                "image": env.var("WORKLOAD_IMAGE"),
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}
            }]
        }
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let running = wait_for(Duration::from_secs(90), "the training pod Running with a pod IP", || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let status = pods.get(&name).await.ok()?.status?;
            (status.phase.as_deref() == Some("Running") && status.pod_ip.is_some()).then_some(status)
        }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let copy = copies.get(&name).await.unwrap();
    assert_eq!(copy.spec.unwrap().node_name.as_deref(), Some(real_node.as_str()), "the copy is on the old kubelet");
    assert_eq!(running.pod_ip, copy.status.unwrap().pod_ip, "the training pod shows the copy's IP");

    let (code, out, err) = kubectl(&env, "training", &["-n", NS, "logs", &name], None).await;
    assert_eq!(
        (code, out.as_str()),
        (0, format!("hello from {id}\n").as_str()),
        "logs: {err}\n{}",
        tidepool.log_tail()
    );
    let (code, out, err) = kubectl(
        &env,
        "training",
        &["-n", NS, "exec", &name, "--", "sh", "-c", "touch /tmp/go; hostname; exit 7"],
        None,
    )
    .await;
    assert_eq!((code, out.as_str()), (7, format!("{name}\n").as_str()), "exec: {err}\n{}", tidepool.log_tail());

    // The exit reaches the training pod: Failed, exit code 3.
    wait_for(Duration::from_secs(60), "the training pod Failed with exit code 3", || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let status = pods.get(&name).await.ok()?.status?;
            let exit = status.container_statuses?.first()?.state.as_ref()?.terminated.as_ref()?.exit_code;
            (status.phase.as_deref() == Some("Failed") && exit == 3).then_some(())
        }
    })
    .await;
    drain_pods(&training, NS).await;
}
