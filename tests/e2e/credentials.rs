//! What each documented `Ready=False` reason of a member's credentials looks like, one
//! member each, next to a member that works: `InvalidSpec` (naming the field),
//! `KubeconfigMissing`, file references refused (`KubeconfigRejected`, naming the field),
//! `BootstrapFailed` (an identity the member knows but lets do nothing); and credentials
//! revoked while the member runs a pod: `Unauthorized`, the virtual node kept `Ready=False`
//! and tainted `tidepool.io/not-ready`, the pod left running; rotating to a new working
//! kubeconfig brings the member back with the same offload pod (same UID, not recreated).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

const TEST: &str = "credentials";
const NS: &str = "e2e-credentials";
/// Where the test's ServiceAccounts live in member-b.
const MEMBER_NS: &str = "e2e-credentials-ids";

/// A ServiceAccount in member-b (recreated, so its tokens are new) and a kubeconfig with a
/// token for it; bound to cluster-admin if `admin`.
async fn member_identity(env: &Env, member_b: &Client, name: &str, admin: bool) -> String {
    let sas = Api::<ServiceAccount>::namespaced(member_b.clone(), MEMBER_NS);
    let sa: ServiceAccount = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    match sas.create(&PostParams::default(), &sa).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create ServiceAccount {name}: {e}"),
    }
    if admin {
        let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("e2e-credentials-{name}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": MEMBER_NS}],
        }))
        .unwrap();
        Api::<ClusterRoleBinding>::all(member_b.clone())
            .patch(
                &format!("e2e-credentials-{name}"),
                &PatchParams::apply("tidepool-e2e").force(),
                &Patch::Apply(&binding),
            )
            .await
            .unwrap();
    }
    token_kubeconfig(env, env.var("MEMBER_B_SERVER"), &token(member_b, MEMBER_NS, name).await)
}

fn node_state(node: &Node) -> (Option<(String, String)>, bool) {
    let ready = node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| {
        cs.iter().find(|c| c.type_ == "Ready").map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    });
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == keys::TAINT_NOT_READY && t.effect == "NoSchedule"));
    (ready, tainted)
}

#[tokio::test]
async fn each_credentials_reason_is_reported_and_revoked_then_rotated_credentials_keep_the_pod() {
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member_b, MEMBER_NS).await;
    let sas = Api::<ServiceAccount>::namespaced(member_b.clone(), MEMBER_NS);
    // The revoked identity of an earlier run is gone, so this run's token is its own.
    let _ = sas.delete("revocable", &DeleteParams::default()).await;
    wait_for(Duration::from_secs(30), "an earlier run's ServiceAccount gone", || {
        let sas = sas.clone();
        async move { sas.get_opt("revocable").await.ok()?.is_none().then_some(()) }
    })
    .await;

    // The broken ones.
    let good = std::fs::read_to_string(env.kubeconfig_path("member-b")).unwrap();
    let admin_token = "e2e-file-refs";
    let files = token_kubeconfig(&env, env.var("MEMBER_B_SERVER"), admin_token).replace(
        &format!("{{token: \"{admin_token}\"}}"),
        "{client-certificate: /etc/hostname, client-key: /etc/hostname}",
    );
    put_kubeconfig_secret(&training, NS, "files", files.as_bytes()).await;
    let wrong_key = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("wrong-key".into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("config".to_owned(), ByteString(good.clone().into_bytes()))])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(training.clone(), NS)
        .patch("wrong-key", &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&wrong_key))
        .await
        .unwrap();
    let powerless = member_identity(&env, &member_b, "powerless", false).await;
    put_kubeconfig_secret(&training, NS, "powerless", powerless.as_bytes()).await;
    put_kubeconfig_secret(&training, NS, "good", good.as_bytes()).await;
    apply_member(&training, "e2e-cred-files", TEST, NS, "files").await;
    apply_member(&training, "e2e-cred-nokey", TEST, NS, "wrong-key").await;
    apply_member(&training, "e2e-cred-powerless", TEST, NS, "powerless").await;
    apply_member(&training, "e2e-cred-spec", TEST, NS, "good").await;
    let bad_window = serde_json::json!({"spec": {"capacity": {"windows": [
        {"name": "w", "schedule": "61 * * * *", "durationMinutes": 5, "reserve": {}}
    ]}}});
    Api::<MemberCluster>::all(training.clone())
        .patch("e2e-cred-spec", &PatchParams::default(), &Patch::Merge(&bad_window))
        .await
        .unwrap();
    // The one whose credentials are revoked later.
    let revocable = member_identity(&env, &member_b, "revocable", true).await;
    put_kubeconfig_secret(&training, NS, "revocable", revocable.as_bytes()).await;
    apply_member(&training, "e2e-cred-revoked", TEST, NS, "revocable").await;
    let tidepool = Tidepool::start(&env, TEST, NS);

    // 1. Each broken member says why, naming what to fix.
    let msg = wait_reason(&training, "e2e-cred-files", "False", "KubeconfigRejected").await;
    assert!(msg.contains("(client-certificate)"), "{msg}");
    let msg = wait_reason(&training, "e2e-cred-nokey", "False", "KubeconfigMissing").await;
    assert!(msg.contains("\"kubeconfig\""), "{msg}");
    let msg = wait_reason(&training, "e2e-cred-spec", "False", "InvalidSpec").await;
    assert!(msg.contains("spec.capacity.windows[0].schedule"), "{msg}");
    let msg = wait_reason(&training, "e2e-cred-powerless", "False", "BootstrapFailed").await;
    assert!(msg.contains("PriorityClass"), "{msg}");
    assert!(!msg.contains(powerless.lines().find(|l| l.contains("token")).unwrap().trim()), "a token in status: {msg}");

    // 2. The revocable member works and runs a pod.
    wait_reason(&training, "e2e-cred-revoked", "True", "Connected").await;
    let node = "tidepool-e2e-cred-revoked";
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node Ready", || {
        let nodes = nodes.clone();
        async move { (node_state(&nodes.get_opt(node).await.ok()??).0?.0 == "True").then_some(()) }
    })
    .await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let worker = format!("worker-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": worker},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let running = || {
        let (pods, worker) = (pods.clone(), worker.clone());
        async move { (pods.get(&worker).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    };
    wait_for(Duration::from_secs(60), "pod Running on the revocable member", running).await;
    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    let copy_uid = copies.get(&worker).await.unwrap().metadata.uid.unwrap();

    // 3. Revoked (its ServiceAccount deleted, so the member's API server refuses the token):
    //    Unauthorized, the node kept NotReady and tainted, the pod and its copy untouched.
    sas.delete("revocable", &DeleteParams::default()).await.unwrap();
    let msg = wait_reason(&training, "e2e-cred-revoked", "False", "Unauthorized").await;
    assert!(!msg.contains(revocable.lines().find(|l| l.contains("token")).unwrap().trim()), "a token in status: {msg}");
    wait_for(Duration::from_secs(30), "node of the revoked member NotReady and tainted", || {
        let nodes = nodes.clone();
        async move {
            let (ready, tainted) = node_state(&nodes.get_opt(node).await.ok()??);
            (ready? == ("False".to_owned(), "MemberCredentialsRefused".to_owned()) && tainted).then_some(())
        }
    })
    .await;
    wait_for(Duration::from_secs(5), "pod still Running", running).await;
    assert_eq!(copies.get(&worker).await.unwrap().metadata.uid.as_deref(), Some(copy_uid.as_str()));

    // 4. Rotated to a new working kubeconfig: Ready again, taint gone, the same copy runs on.
    let rotated = member_identity(&env, &member_b, "rotated", true).await;
    put_kubeconfig_secret(&training, NS, "revocable", rotated.as_bytes()).await;
    wait_reason(&training, "e2e-cred-revoked", "True", "Connected").await;
    wait_for(Duration::from_secs(30), "node of the rotated member Ready, untainted", || {
        let nodes = nodes.clone();
        async move {
            let (ready, tainted) = node_state(&nodes.get_opt(node).await.ok()??);
            (ready?.0 == "True" && !tainted).then_some(())
        }
    })
    .await;
    // The new session has synced the pod (its status written back from the new watch) and
    // left the copy alone: one copy, the same UID.
    wait_for(Duration::from_secs(5), "pod still Running after the rotation", running).await;
    let lp = kube::api::ListParams::default()
        .labels(&format!("{}={}", keys::LABEL_ORIGIN_UID, { pods.get(&worker).await.unwrap().metadata.uid.unwrap() }));
    let all = Api::<Pod>::all(member_b.clone()).list(&lp).await.unwrap().items;
    assert_eq!(all.len(), 1, "copies after rotation: {all:?}");
    assert_eq!(all[0].metadata.uid.as_deref(), Some(copy_uid.as_str()), "the copy was recreated by the rotation");

    drain_pods(&training, NS).await;
    for m in ["e2e-cred-files", "e2e-cred-nokey", "e2e-cred-powerless", "e2e-cred-spec", "e2e-cred-revoked"] {
        Api::<MemberCluster>::all(training.clone()).delete(m, &DeleteParams::default()).await.unwrap();
    }
    // The powerless member was reached (so it holds the drain finalizer) but can read
    // nothing to drain: its drain would wait the documented 5 minutes. Nothing of it is in
    // the member, so the test lets it go.
    let unhold = serde_json::json!({"metadata": {"finalizers": null}});
    let _ = Api::<MemberCluster>::all(training.clone())
        .patch("e2e-cred-powerless", &PatchParams::default(), &Patch::Merge(&unhold))
        .await;
    wait_for(Duration::from_secs(60), "members gone", || {
        let members = Api::<MemberCluster>::all(training.clone());
        async move {
            let lp = kube::api::ListParams::default().labels(&format!("tidepool.io/test={TEST}"));
            members.list(&lp).await.ok()?.items.is_empty().then_some(())
        }
    })
    .await;
    for name in ["revocable", "rotated"] {
        let _ = Api::<ClusterRoleBinding>::all(member_b.clone())
            .delete(&format!("e2e-credentials-{name}"), &DeleteParams::default())
            .await;
    }
    drop(tidepool);
}

/// Waits until training pod `ns/name` runs.
async fn running(training: &Client, ns: &str, name: &str) {
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    wait_for(Duration::from_secs(90), &format!("pod {name} Running"), || {
        let pods = pods.clone();
        async move { (pods.get(name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
}

/// The ServiceAccounts bound by tidepool's RoleBindings in member namespace `ns`.
async fn bound_identities(member: &Client, ns: &str) -> BTreeSet<String> {
    let managed = ListParams::default().labels(&format!("{}={}", keys::LABEL_MANAGED_BY, keys::MANAGED_BY));
    let bindings = Api::<RoleBinding>::namespaced(member.clone(), ns).list(&managed).await.unwrap().items;
    bindings.into_iter().flat_map(|b| b.subjects.unwrap_or_default()).map(|s| s.name).collect()
}

/// Two MemberClusters on one member API server, each with an identity and an offload
/// namespace prefix of its own: neither session enters the other's namespaces (no binding of
/// its identity there, which would give it the other's Secrets), and draining one leaves the
/// other's namespaces standing, even while they hold no pod.
#[tokio::test]
async fn two_members_on_one_api_server_never_enter_or_drain_each_others_offload_namespaces() {
    const TEST: &str = "isolation";
    const NS: &str = "e2e-isolation";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member_b, MEMBER_NS).await;
    let mut namespaces = BTreeMap::new();
    // Prefixes are a word and one '-' (validated), so neither names the other's namespaces.
    let prefix = |id: &str| format!("{}-", id.replace('-', ""));
    for (member, id) in [("e2e-iso-x", "iso-x"), ("e2e-iso-y", "iso-y")] {
        let kubeconfig = member_identity(&env, &member_b, id, true).await;
        put_kubeconfig_secret(&training, NS, id, kubeconfig.as_bytes()).await;
        namespaces.insert(member, format!("{}{NS}", prefix(id)));
    }
    // An earlier run's offload namespaces (and whatever it bound in them) are gone first.
    let namespaces_api = Api::<Namespace>::all(member_b.clone());
    for ns in namespaces.values() {
        let _ = namespaces_api.delete(ns, &DeleteParams::default()).await;
    }
    wait_for(Duration::from_secs(90), "an earlier run's offload namespaces gone", || async {
        for ns in namespaces.values() {
            if namespaces_api.get_opt(ns).await.ok()?.is_some() {
                return None;
            }
        }
        Some(())
    })
    .await;
    let members = Api::<MemberCluster>::all(training.clone());
    let member = |name: &str, id: &str| {
        let mut mc = member_cluster(name, TEST, NS, id);
        mc.spec.namespace_prefix = Some(prefix(id));
        // Each in its own prefixed namespaces (with the default same-named ones, the second
        // would fall back to its prefix: the same separation, less plainly seen).
        mc.spec.namespace_mode = Some(tidepool_api::crd::NamespaceMode::Prefixed);
        mc
    };
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let tidepool = Tidepool::start(&env, TEST, NS);

    // 1. X alone: its pod runs, its namespace holds its identity's binding.
    apply_member_cluster(&training, &member("e2e-iso-x", "iso-x")).await;
    pods.create(&PostParams::default(), &small_bound_pod("iso-x-0", "tidepool-e2e-iso-x", TEST)).await.unwrap();
    running(&training, NS, "iso-x-0").await;

    // 2. Y joins after X's namespace exists, so its first look around the server sees it.
    //    Y's pod runs and a training Service selecting it is mirrored: Y's mirror has made its
    //    passes over the offload namespaces it found.
    apply_member_cluster(&training, &member("e2e-iso-y", "iso-y")).await;
    let mut pod = small_bound_pod("iso-y-0", "tidepool-e2e-iso-y", TEST);
    pod.metadata.labels.get_or_insert_default().insert("iso".into(), "y".into());
    pods.create(&PostParams::default(), &pod).await.unwrap();
    running(&training, NS, "iso-y-0").await;
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "iso-y"},
        "spec": {"clusterIP": "None", "selector": {"iso": "y"}, "ports": [{"port": 80}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(training.clone(), NS)
        .patch("iso-y", &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&service))
        .await
        .unwrap();
    let y_services = Api::<Service>::namespaced(member_b.clone(), &namespaces["e2e-iso-y"]);
    wait_for(Duration::from_secs(60), "Service iso-y mirrored into Y's namespace", || {
        let y_services = y_services.clone();
        async move { y_services.get_opt("iso-y").await.ok().flatten() }
    })
    .await;
    assert_eq!(bound_identities(&member_b, &namespaces["e2e-iso-x"]).await, BTreeSet::from(["iso-x".to_owned()]));
    assert_eq!(bound_identities(&member_b, &namespaces["e2e-iso-y"]).await, BTreeSet::from(["iso-y".to_owned()]));

    // 3. Y's namespace empty of pods, X deleted and drained: Y's namespace stays.
    pods.delete("iso-y-0", &DeleteParams::default()).await.unwrap();
    let y_pods = Api::<Pod>::namespaced(member_b.clone(), &namespaces["e2e-iso-y"]);
    wait_for(Duration::from_secs(60), "Y's copy gone", || {
        let y_pods = y_pods.clone();
        async move { y_pods.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    pods.delete("iso-x-0", &DeleteParams::default()).await.unwrap();
    members.delete("e2e-iso-x", &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(90), "X drained and gone", || {
        let members = members.clone();
        async move { members.get_opt("e2e-iso-x").await.ok()?.is_none().then_some(()) }
    })
    .await;
    let x_ns = namespaces_api.get_opt(&namespaces["e2e-iso-x"]).await.unwrap();
    assert!(x_ns.is_none_or(|n| n.metadata.deletion_timestamp.is_some()), "X's namespace left after its drain");
    let y_ns = namespaces_api.get_opt(&namespaces["e2e-iso-y"]).await.unwrap().expect("Y's namespace");
    assert!(y_ns.metadata.deletion_timestamp.is_none(), "X's drain deleted Y's namespace");
    assert_eq!(bound_identities(&member_b, &namespaces["e2e-iso-y"]).await, BTreeSet::from(["iso-y".to_owned()]));

    Api::<Service>::namespaced(training.clone(), NS).delete("iso-y", &DeleteParams::default()).await.unwrap();
    drain_pods(&training, NS).await;
    reset_members(&training, TEST).await;
    for id in ["iso-x", "iso-y"] {
        let _ = Api::<ClusterRoleBinding>::all(member_b.clone())
            .delete(&format!("e2e-credentials-{id}"), &DeleteParams::default())
            .await;
    }
    drop(tidepool);
}
