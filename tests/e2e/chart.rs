//! tidepool installed as an admin installs it: the chart with helm, in both clusters, from
//! tidepool's own image (`tidepool.invalid/tidepool:<version>`, built by tests/images/build.sh
//! and imported into the training cluster's real node). Two replicas, sharded (the chart's
//! default), elect a leader and share the member, their probes pass, the kubelet API gets its serving certificate from a CSR that an admin
//! approves, and a pod crosses the bridge driven by the tidepool in the pod, under the chart's
//! identities on both sides.
//!
//! Pods here reach the apiservers at the training bridge address (relays made by cluster.sh;
//! no kube-proxy), which the chart's `apiServer.host`/`apiServer.port` values are for.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::harness::*;

const TEST: &str = "chart";
const NS: &str = "e2e-chart";
const MEMBER_NS: &str = "e2e-chart-member";
const RELEASE: &str = "chart-e2e";
const MEMBER: &str = "e2e-chart-a";
const NODE: &str = "tidepool-e2e-chart-a";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/tidepool");

/// `helm ARGS` against `cluster`; panics with its output when it fails.
async fn helm(env: &Env, cluster: &str, args: &[&str]) -> String {
    let helm = std::env::var("TIDEPOOL_HELM")
        .unwrap_or_else(|_| panic!("TIDEPOOL_HELM is not set: run the README's test command (bash tests/run.sh)"));
    let out = tokio::process::Command::new(helm)
        .arg("--kubeconfig")
        .arg(env.kubeconfig_path(cluster))
        .args(args)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out).await.expect("helm hung").unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "helm {args:?} failed:\n{text}");
    text
}

/// Removes what an earlier run left: both releases, the MemberCluster, the namespaces' pods.
async fn clean(env: &Env, training: &Client) {
    for (cluster, ns) in [("training", NS), ("member-a", MEMBER_NS)] {
        let _ =
            kubectl(env, cluster, &["-n", ns, "delete", "pods", "--all", "--grace-period=0", "--force"], None).await;
        let (_, list, _) = kubectl(env, cluster, &["-n", ns, "get", "secret", "-o", "name"], None).await;
        if list.contains("sh.helm.release") {
            helm(env, cluster, &["uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "90s"]).await;
        }
    }
    reset_members(training, TEST).await;
}

/// The member kubeconfig an admin mints from the member release's token Secret, with the
/// member apiserver's address as pods of the training cluster reach it.
async fn member_kubeconfig(env: &Env, member: &Client) -> String {
    let secrets = Api::<Secret>::namespaced(member.clone(), MEMBER_NS);
    let token = wait_for(Duration::from_secs(60), "member token Secret filled", || {
        let secrets = secrets.clone();
        async move {
            let secret = secrets.get_opt(&format!("{RELEASE}-token")).await.ok().flatten()?;
            let token = secret.data?.get("token")?.0.clone();
            (!token.is_empty()).then(|| String::from_utf8(token).unwrap())
        }
    })
    .await;
    let port = env.var("MEMBER_A_SERVER").rsplit_once(':').unwrap().1.to_owned();
    let server = format!("https://{}:{port}", env.var("APISERVER_RELAY_HOST"));
    token_kubeconfig(env, &server, &token)
}

/// Approves the kubelet-serving CSRs the release's identity asked for, as an admin does.
async fn approve_serving_csrs(env: &Env) -> usize {
    let user = format!("system:serviceaccount:{NS}:{RELEASE}");
    let (_, names, _) = kubectl(
        env,
        "training",
        &[
            "get",
            "csr",
            "-l",
            "app.kubernetes.io/component=kubelet-serving",
            "-o",
            &format!("jsonpath={{range .items[?(@.spec.username==\"{user}\")]}}{{.metadata.name}}={{.status.conditions[*].type}}{{\"\\n\"}}{{end}}"),
        ],
        None,
    )
    .await;
    let mut approved = 0;
    for line in names.lines() {
        if let Some(name) = line.strip_suffix('=') {
            let (code, _, err) = kubectl(env, "training", &["certificate", "approve", name], None).await;
            assert_eq!(code, 0, "approve {name}: {err}");
            approved += 1;
        }
    }
    approved
}

#[tokio::test]
async fn the_chart_runs_tidepool_from_its_image_and_the_pod_bridges_a_member() {
    let env = Env::load();
    assert_eq!(env.var("CP_REAL_NODES"), "1", "tidepool runs as a pod on the training cluster's real node");
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    env.install_crds(&training).await;
    clean(&env, &training).await;
    ensure_namespace(&training, NS).await;
    ensure_namespace(&member, MEMBER_NS).await;
    let version = env!("CARGO_PKG_VERSION");
    let taint = env.var("REAL_NODE_TAINT");

    // 1. Member side: the identity tidepool uses there.
    helm(
        &env,
        "member-a",
        &[
            "install",
            RELEASE,
            CHART,
            "-n",
            MEMBER_NS,
            "--set",
            "target=member",
            "--set",
            &format!("fullnameOverride={RELEASE}"),
        ],
    )
    .await;
    let kubeconfig = member_kubeconfig(&env, &member).await;
    put_kubeconfig_secret(&training, NS, "member-a", kubeconfig.as_bytes()).await;
    apply_member(&training, MEMBER, TEST, NS, "member-a").await;

    // 2. Training side: two replicas from the image, on the real node.
    let training_port = env.var("TRAINING_SERVER").rsplit_once(':').unwrap().1.to_owned();
    let scheduler = scheduler_name(TEST);
    let sets = [
        format!("fullnameOverride={RELEASE}"),
        "image.repository=tidepool.invalid/tidepool".to_owned(),
        format!("image.tag={version}"),
        "image.pullPolicy=Never".to_owned(),
        format!("apiServer.host={}", env.var("APISERVER_RELAY_HOST")),
        format!("apiServer.port={training_port}"),
        format!("config.memberSelector=tidepool.io/test={TEST}"),
        format!("config.dispatcher.schedulerName={scheduler}"),
        format!("nodeSelector.kubernetes\\.io/hostname={}", env.var("TRAINING_REAL_NODE")),
        format!("tolerations[0].key={taint}"),
        "tolerations[0].operator=Exists".to_owned(),
        "resources.requests.cpu=50m".to_owned(),
    ];
    let mut args = vec!["install", RELEASE, CHART, "-n", NS];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    // The release's admission policy is cluster-wide and exempts only its own ServiceAccount:
    // here it holds in its namespace alone, so it never refuses another test's tidepool (nor
    // lingers for the next test while the apiserver unloads it after the uninstall).
    let only_ns =
        format!("admissionPolicy.namespaceSelector={{\"matchLabels\":{{\"kubernetes.io/metadata.name\":\"{NS}\"}}}}");
    args.extend(["--set-json", only_ns.as_str()]);
    let notes = helm(&env, "training", &args).await;
    assert!(notes.contains("kubectl get memberclusters"), "NOTES.txt not shown: {notes}");

    // 3. The kubelet API's serving certificate: each replica asks, the admin approves. Both
    //    replicas Running and Ready (each once the members it owns are synced).
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let selector = format!("app.kubernetes.io/instance={RELEASE}");
    let approved = std::sync::atomic::AtomicUsize::new(0);
    let ready: Vec<(String, String)> = wait_for(Duration::from_secs(180), "both tidepool pods Ready", || {
        let (env, pods, selector, approved) = (&env, pods.clone(), selector.clone(), &approved);
        async move {
            approved.fetch_add(approve_serving_csrs(env).await, std::sync::atomic::Ordering::Relaxed);
            let list = pods.list(&ListParams::default().labels(&selector)).await.ok()?;
            let ready: Vec<(String, String)> = list
                .items
                .iter()
                .filter(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .map(|p| (p.metadata.name.clone().unwrap(), p.status.clone().unwrap().pod_ip.unwrap_or_default()))
                .collect();
            (ready.len() == 2).then_some(ready)
        }
    })
    .await;
    let images: Vec<String> = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.spec.as_ref().unwrap().containers[0].image.clone().unwrap())
        .collect();
    assert_eq!(images, vec![format!("tidepool.invalid/tidepool:{version}"); 2]);

    // 4. Sharded (the chart's default): one leader, holding the release's Lease, runs the
    //    dispatcher; the member is owned through its own Lease by one of the two.
    let leases = Api::<Lease>::namespaced(training.clone(), NS);
    let held = |name: String| {
        let leases = leases.clone();
        async move { leases.get_opt(&name).await.ok().flatten()?.spec?.holder_identity }
    };
    let holder = wait_for(Duration::from_secs(60), "leader Lease held", || held(RELEASE.to_owned())).await;
    let leader = ready.iter().find(|(name, _)| holder.contains(name.as_str()));
    leader.unwrap_or_else(|| panic!("Lease holder {holder} is none of {ready:?}"));
    let member_lease = format!("tidepool-member-{MEMBER}");
    let owner = wait_for(Duration::from_secs(60), "member Lease held", || held(member_lease.clone())).await;
    let owner = ready.iter().find(|(name, _)| owner.contains(name.as_str()));
    let (owner_name, owner_ip) = owner.unwrap_or_else(|| panic!("member Lease holder is none of {ready:?}"));

    // 5. The virtual node points at its owner's pod IP, where its kubelet API listens.
    let nodes = Api::<Node>::all(training.clone());
    let address = wait_for(Duration::from_secs(60), "virtual node registered by the pod", || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get_opt(NODE).await.ok().flatten()?;
            let addresses = node.status?.addresses?;
            addresses.into_iter().find(|a| a.type_ == "InternalIP").map(|a| a.address)
        }
    })
    .await;
    assert_eq!(&address, owner_ip, "virtual node address is not its owner {owner_name}'s pod IP");

    // 6. A pod crosses the bridge, placed by the tidepool in the pod; its logs come back
    //    through that pod's kubelet API, with the certificate the CSR gave it.
    let name = format!("crossing-{}", run_id());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler,
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(90), "pod across the bridge Running", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move {
            let p = pods.get(&name).await.ok()?;
            let on_node = p.spec.as_ref()?.node_name.as_deref() == Some(NODE);
            (on_node && p.status?.phase.as_deref() == Some("Running")).then_some(())
        }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let copy = copies.get(&name).await.unwrap();
    let labels: BTreeMap<String, String> = copy.metadata.labels.unwrap();
    assert_eq!(labels.get("tidepool.io/origin-cluster").map(String::as_str), Some("training"));
    let (code, out, err) = kubectl(&env, "training", &["-n", NS, "logs", &name, "--tail=1"], None).await;
    assert_eq!(code, 0, "kubectl logs through the in-cluster tidepool failed: {err}");
    assert!(!out.is_empty(), "no log line came back");
    assert!(approved.into_inner() >= 1, "no serving CSR was asked for and approved");

    // 7. Clean up through tidepool (the copy goes first), then the releases.
    pods.delete(&name, &Default::default()).await.unwrap();
    wait_for(Duration::from_secs(60), "copy removed in the member", || {
        let (copies, name) = (copies.clone(), name.clone());
        async move { copies.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    clean(&env, &training).await;
}
