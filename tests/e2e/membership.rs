//! What a `MemberCluster` is to the training cluster: `spec.pools` makes one virtual node per
//! pool with that pool's own surplus (and no node for the whole member); a same-named pod of
//! another origin in the member namespace is never overwritten (`OffloadConflict`); a member
//! no longer selected by this tidepool loses its virtual node and its drain finalizer, and is
//! not drained (its offload pods stay); a training pod ended in the training cluster by anyone
//! has its copy deleted by the pod sync (the fallback to the dispatcher's own delete).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tidepool_api::crd::{MemberClusterSpec, PoolSpec, SecretKeyRef};
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;
use crate::skeleton::{allocatable, pool_surplus};

/// Waits for virtual node `node` to be Ready.
async fn node_ready(training: &Client, node: &str) -> Node {
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), &format!("virtual node {node} Ready"), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(node).await.ok()??;
            let ready =
                n.status.as_ref()?.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(n)
        }
    })
    .await
}

/// A pod bound by hand to virtual node `node`, asking for `gpus` GPUs.
fn bound_pod(name: &str, node: &str, gpus: u32) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn each_pool_is_one_virtual_node_with_its_own_surplus() {
    const TEST: &str = "pools";
    const NS: &str = "e2e-pools";
    const MEMBER: &str = "e2e-pools-a";
    let env = Env::load();
    let training = env.client("training").await;
    let member_a = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    // Nodes an aborted earlier run left are not this run's (a status patch would keep their
    // resources): gone before this tidepool starts.
    let nodes = Api::<Node>::all(training.clone());
    let lp = ListParams::default().labels(&format!("{}={MEMBER}", keys::LABEL_MEMBER));
    let _ = nodes.delete_collection(&DeleteParams::default(), &lp).await;
    wait_for(Duration::from_secs(30), "an earlier run's pool nodes gone", || {
        let (nodes, lp) = (nodes.clone(), lp.clone());
        async move { nodes.list(&lp).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    // member-a's kwok nodes are labelled tidepool.io/test-pool=gpu or =cpu (cluster.sh).
    let selector = |pool: &str| BTreeMap::from([("tidepool.io/test-pool".to_owned(), pool.to_owned())]);
    let pool = |name: &str| PoolSpec { name: name.into(), node_selector: selector(name), ..Default::default() };
    let mut mc = MemberCluster::new(
        MEMBER,
        MemberClusterSpec {
            kubeconfig_secret_ref: SecretKeyRef { name: "member-a".into(), namespace: Some(NS.into()), key: None },
            pools: vec![pool("gpu"), pool("cpu")],
            ..Default::default()
        },
    );
    mc.metadata.labels = Some(BTreeMap::from([("tidepool.io/test".to_owned(), TEST.to_owned())]));
    Api::<MemberCluster>::all(training.clone())
        .patch(MEMBER, &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&mc))
        .await
        .unwrap();
    let tidepool = Tidepool::start(&env, TEST, NS);

    // One node per pool, named tidepool-<member>-<pool>, each with what its own nodes lend
    // (worked out here from the member's nodes and pods); none for the member as a whole.
    for name in ["gpu", "cpu"] {
        let node = format!("tidepool-{MEMBER}-{name}");
        let n = node_ready(&training, &node).await;
        assert_eq!(n.metadata.labels.as_ref().unwrap()[keys::LABEL_MEMBER], MEMBER);
        let want = pool_surplus(&member_a, &selector(name)).await;
        assert!(want.get("cpu") > 0, "pool {name} lends no cpu, the test computes {want}");
        wait_for(Duration::from_secs(30), &format!("{node} advertises pool {name}'s surplus"), || {
            let (nodes, node, member_a, sel) = (nodes.clone(), node.clone(), member_a.clone(), selector(name));
            async move {
                let have = allocatable(&nodes.get(&node).await.ok()?)?;
                let want = pool_surplus(&member_a, &sel).await;
                let gpus = want.get("nvidia.com/gpu") - want.get("nvidia.com/gpu").rem_euclid(1000);
                (have.get("cpu") == want.get("cpu") && have.get("nvidia.com/gpu") == gpus).then_some(())
            }
        })
        .await;
    }
    let gpu = allocatable(&nodes.get(&format!("tidepool-{MEMBER}-gpu")).await.unwrap()).unwrap();
    let cpu = allocatable(&nodes.get(&format!("tidepool-{MEMBER}-cpu")).await.unwrap()).unwrap();
    assert!(gpu.get("nvidia.com/gpu") >= 8000, "the gpu pool lends GPUs: {gpu}");
    assert_eq!(cpu.get("nvidia.com/gpu"), 0, "the cpu pool has no GPU nodes: {cpu}");
    assert!(nodes.get_opt(&format!("tidepool-{MEMBER}")).await.unwrap().is_none(), "a node for the whole member");

    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(60), "pool nodes removed with their member", || {
        let nodes = nodes.clone();
        async move {
            let lp = ListParams::default().labels(&format!("{}={MEMBER}", keys::LABEL_MEMBER));
            nodes.list(&lp).await.ok()?.items.is_empty().then_some(())
        }
    })
    .await;
    drop(tidepool);
}

#[tokio::test]
async fn a_same_named_pod_of_another_origin_in_the_member_is_never_overwritten() {
    const TEST: &str = "conflict";
    const NS: &str = "e2e-conflict";
    const MEMBER: &str = "e2e-conflict-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    let member_ns = offload_ns(NS);
    // A namespace of that name that tidepool did not make (an aborted run's) goes first.
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(member_b.clone());
    if let Some(ns) = namespaces.get_opt(&member_ns).await.unwrap()
        && !ns.metadata.labels.unwrap_or_default().contains_key(keys::LABEL_MANAGED_BY)
    {
        let _ = namespaces.delete(&member_ns, &DeleteParams::default()).await;
        wait_for(Duration::from_secs(60), "foreign offload namespace gone", || {
            let (namespaces, member_ns) = (namespaces.clone(), member_ns.clone());
            async move { namespaces.get_opt(&member_ns).await.ok()?.is_none().then_some(()) }
        })
        .await;
    }
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-b").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let node = format!("tidepool-{MEMBER}");
    node_ready(&training, &node).await;
    // A first pod through the member, so the offload namespace is tidepool's (it puts
    // nothing in a namespace it did not create).
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let first = format!("first-{}", run_id());
    pods.create(&PostParams::default(), &bound_pod(&first, &node, 1)).await.unwrap();
    wait_for(Duration::from_secs(60), "first pod Running", || {
        let (pods, first) = (pods.clone(), first.clone());
        async move { (pods.get(&first).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;

    // 1. Someone else's pod, in the member namespace, under the name a training pod will have.
    let name = format!("worker-{}", run_id());
    let theirs: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": "not-tidepool"}},
        "spec": {"containers": [{"name": "main", "image": "example.invalid/theirs:1"}],
                 "tolerations": [{"operator": "Exists"}]}
    }))
    .unwrap();
    let member_pods = Api::<Pod>::namespaced(member_b.clone(), &member_ns);
    let theirs = member_pods.create(&PostParams::default(), &theirs).await.unwrap();
    let their_uid = theirs.metadata.uid.clone().unwrap();

    // 2. The training pod of that name: an OffloadConflict Event on it, naming the pod.
    let ours = pods.create(&PostParams::default(), &bound_pod(&name, &node, 1)).await.unwrap();
    let our_uid = ours.metadata.uid.unwrap();
    let events = Api::<Event>::namespaced(training.clone(), NS);
    let note = wait_for(Duration::from_secs(60), "OffloadConflict Event on the training pod", || {
        let (events, our_uid) = (events.clone(), our_uid.clone());
        async move {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items.into_iter().find_map(|e| {
                (e.reason.as_deref() == Some("OffloadConflict") && e.involved_object.uid.as_deref() == Some(&our_uid))
                    .then(|| e.message.unwrap_or_default())
            })
        }
    })
    .await;
    assert!(note.contains(&format!("{member_ns}/{name}")), "{note}");

    // 3. Their pod is as it was: the same object, no origin label, its own spec; ours never ran.
    let now = member_pods.get(&name).await.unwrap();
    assert_eq!(now.metadata.uid.as_deref(), Some(their_uid.as_str()), "their pod was replaced");
    let labels = now.metadata.labels.unwrap_or_default();
    assert!(!labels.contains_key(keys::LABEL_ORIGIN_UID), "their pod got our origin label: {labels:?}");
    assert_eq!(labels.get("app").map(String::as_str), Some("not-tidepool"));
    assert_eq!(now.spec.unwrap().containers[0].image.as_deref(), Some("example.invalid/theirs:1"));
    assert!(now.metadata.deletion_timestamp.is_none(), "their pod is being deleted");
    let phase = pods.get(&name).await.unwrap().status.and_then(|s| s.phase);
    assert_ne!(phase.as_deref(), Some("Running"), "{}", tidepool.log_tail());

    // Deleting ours leaves theirs alone too.
    pods.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    wait_for(Duration::from_secs(30), "training pod gone", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { pods.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    let still = member_pods.get(&name).await.unwrap();
    assert_eq!(still.metadata.uid.as_deref(), Some(their_uid.as_str()));
    assert!(still.metadata.deletion_timestamp.is_none(), "their pod deleted with ours");
    member_pods.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    drain_pods(&training, NS).await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}

#[tokio::test]
async fn a_deselected_member_loses_its_node_and_finalizer_and_is_not_drained() {
    const TEST: &str = "deselect";
    const NS: &str = "e2e-deselect";
    const MEMBER: &str = "e2e-deselect-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-b").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let node = format!("tidepool-{MEMBER}");
    node_ready(&training, &node).await;
    let members = Api::<MemberCluster>::all(training.clone());
    wait_for(Duration::from_secs(30), "drain finalizer on the reached member", || {
        let members = members.clone();
        async move {
            let mc = members.get(MEMBER).await.ok()?;
            mc.metadata.finalizers?.iter().any(|f| f == keys::FINALIZER_DRAIN).then_some(())
        }
    })
    .await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = format!("worker-{}", run_id());
    pods.create(&PostParams::default(), &bound_pod(&name, &node, 1)).await.unwrap();
    wait_for(Duration::from_secs(60), "pod Running through the member", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    let copy_uid = copies.get(&name).await.unwrap().metadata.uid.unwrap();

    // Deselected (its label no longer matches this tidepool's memberSelector): the virtual
    // node goes, the finalizer goes, the MemberCluster stays, and nothing is drained.
    let relabel = serde_json::json!({"metadata": {"labels": {"tidepool.io/test": "deselected"}}});
    members.patch(MEMBER, &PatchParams::default(), &Patch::Merge(&relabel)).await.unwrap();
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node of the deselected member removed", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(&format!("tidepool-{MEMBER}")).await.ok()?.is_none().then_some(()) }
    })
    .await;
    wait_for(Duration::from_secs(30), "drain finalizer released", || {
        let members = members.clone();
        async move {
            let mc = members.get(MEMBER).await.ok()?;
            (!mc.metadata.finalizers.unwrap_or_default().iter().any(|f| f == keys::FINALIZER_DRAIN)).then_some(())
        }
    })
    .await;
    let mc = members.get(MEMBER).await.unwrap();
    assert!(mc.metadata.deletion_timestamp.is_none());
    let copy = copies.get(&name).await.unwrap();
    assert_eq!(copy.metadata.uid.as_deref(), Some(copy_uid.as_str()), "the copy was replaced");
    assert!(copy.metadata.deletion_timestamp.is_none(), "the deselected member was drained");
    let training_pod = pods.get(&name).await.unwrap().status.unwrap();
    assert_ne!(training_pod.reason.as_deref(), Some(keys::REASON_MEMBER_REMOVED), "{}", tidepool.log_tail());

    // Nobody serves it now: the test cleans up by hand.
    copies.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    pods.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    members.delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}

/// The pod sync's own delete of a copy (the fallback when the dispatcher's delete did not
/// happen): a training pod that ended in the training cluster by anyone's hand has its
/// copy stopped in the member.
#[tokio::test]
async fn a_training_pod_failed_in_the_training_cluster_has_its_copy_deleted() {
    const TEST: &str = "ended";
    const NS: &str = "e2e-ended";
    const MEMBER: &str = "e2e-ended-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-b").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let node = format!("tidepool-{MEMBER}");
    node_ready(&training, &node).await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = format!("worker-{}", run_id());
    pods.create(&PostParams::default(), &bound_pod(&name, &node, 1)).await.unwrap();
    wait_for(Duration::from_secs(60), "pod Running through the member", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    assert!(copies.get_opt(&name).await.unwrap().is_some());

    // Failed by someone else (an admin, a controller): not the dispatcher, which deletes the
    // copies of the pods it reclaims itself.
    let failed = serde_json::json!({"status": {"phase": "Failed", "reason": "Ended", "message": "ended by the test"}});
    pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&failed)).await.unwrap();
    wait_for(Duration::from_secs(30), "the copy of the ended pod deleted in the member", || {
        let (copies, name) = (copies.clone(), name.clone());
        async move { copies.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    let st = pods.get(&name).await.unwrap().status.unwrap();
    assert_eq!((st.phase.as_deref(), st.reason.as_deref()), (Some("Failed"), Some("Ended")), "{}", tidepool.log_tail());
    drain_pods(&training, NS).await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}
