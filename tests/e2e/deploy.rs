//! What `deploy/` ships: the Helm chart renders to the committed plain manifests, the API
//! servers accept them (server-side dry run), and tidepool works under exactly the RBAC they
//! grant, on both sides, while everything else it might try is forbidden.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::{BridgeConfig, keys};

use crate::harness::*;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/tidepool");
const MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/manifests");

fn helm() -> PathBuf {
    let path = std::env::var("TIDEPOOL_HELM").unwrap_or_else(|_| {
        panic!(
            "TIDEPOOL_HELM is not set: the deploy tests render the chart with helm. Run the README's test \
             command (bash tests/run.sh), or build it with `bash tests/tools/build-helm.sh` and export \
             TIDEPOOL_HELM=<its last line>"
        )
    });
    PathBuf::from(path)
}

/// `helm template` of the chart for one side, as the plain manifests hold it (release `tidepool`).
fn render(target: &str, namespace: &str, extra: &[&str]) -> String {
    render_release("tidepool", target, namespace, extra)
}

/// `helm template` of the chart for one side as release `release`.
fn render_release(release: &str, target: &str, namespace: &str, extra: &[&str]) -> String {
    let out = std::process::Command::new(helm())
        .args(["template", release, CHART, "--namespace", namespace, "--set", &format!("target={target}")])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "helm template failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `kubectl` with `stdin`: its output, or its output as the error when it fails.
async fn kubectl_with(env: &Env, cluster: &str, args: &[&str], stdin: &str) -> Result<String, String> {
    let (code, out, err) = kubectl(env, cluster, args, Some(stdin)).await;
    if code == 0 { Ok(out + &err) } else { Err(out + &err) }
}

/// Every non-empty document of a rendered YAML stream (a stream that does not parse fails the test).
fn documents(text: &str) -> Vec<serde_json::Value> {
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("not a YAML stream: {e}\n{text}"));
    docs.into_iter().filter(|v| !v.is_null()).collect()
}

#[tokio::test]
async fn the_chart_renders_to_the_committed_manifests_and_the_api_servers_accept_them() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    env.install_crds(&training).await;

    let rendered = [
        ("training.yaml", render("training", "tidepool-system", &["--include-crds"])),
        ("member.yaml", render("member", "tidepool-member", &[])),
    ];
    for (file, text) in &rendered {
        let committed = std::fs::read_to_string(Path::new(MANIFESTS).join(file)).unwrap_or_default();
        assert!(
            &committed == text,
            "deploy/manifests/{file} differs from the chart: regenerate it with `bash deploy/render.sh`"
        );
    }

    // The bridge config inside the ConfigMap is one tidepool accepts.
    let docs = documents(&rendered[0].1);
    let config = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["tidepool.yaml"].as_str())
        .expect("the training side renders a ConfigMap with tidepool.yaml");
    let parsed = BridgeConfig::parse(config).unwrap_or_else(|e| panic!("chart config refused: {e:?}\n{config}"));
    assert!(parsed.leader_election.enabled, "two replicas need leader election");
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(deployment["spec"]["replicas"].as_u64(), Some(2));
    for kind in [
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "Service",
        "PodDisruptionBudget",
        "CustomResourceDefinition",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(docs.iter().any(|d| d["kind"] == kind), "the training side lacks a {kind}");
    }

    // Server-side dry run: every object valid and admissible as rendered.
    ensure_namespace(&training, "tidepool-system").await;
    ensure_namespace(&member, "tidepool-member").await;
    for (cluster, (file, text)) in ["training", "member-a"].iter().zip(&rendered) {
        let expect = documents(text).len();
        let out = kubectl_with(&env, cluster, &["apply", "--dry-run=server", "-f", "-"], text)
            .await
            .unwrap_or_else(|e| panic!("{cluster} refused {file}:\n{e}"));
        let accepted = out.lines().filter(|l| l.contains("(server dry run)")).count();
        assert_eq!(accepted, expect, "{cluster}: not every object of {file} accepted:\n{out}");
    }
}

// Render-only checks of the chart's values (helm, no cluster).

/// `(kind, namespace, name)` of every object of a rendered stream.
fn object_names(text: &str) -> std::collections::BTreeSet<(String, String, String)> {
    documents(text)
        .iter()
        .map(|d| {
            let field = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            (field(&d["kind"]), field(&d["metadata"]["namespace"]), field(&d["metadata"]["name"]))
        })
        .collect()
}

fn find<'a>(docs: &'a [serde_json::Value], kind: &str) -> Option<&'a serde_json::Value> {
    docs.iter().find(|d| d["kind"] == kind)
}

/// The bridge config inside the rendered ConfigMap, parsed as tidepool does.
fn bridge_config(docs: &[serde_json::Value]) -> BridgeConfig {
    let text = find(docs, "ConfigMap").and_then(|d| d["data"]["tidepool.yaml"].as_str()).expect("no ConfigMap");
    BridgeConfig::parse(text).unwrap_or_else(|e| panic!("chart config refused: {e:?}\n{text}"))
}

fn checksum(text: &str) -> String {
    let docs = documents(text);
    let deployment = find(&docs, "Deployment").expect("no Deployment");
    deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        .as_str()
        .expect("no checksum/config annotation")
        .to_owned()
}

/// The env of the tidepool container: name → the whole entry.
fn container_env(text: &str) -> std::collections::BTreeMap<String, serde_json::Value> {
    let docs = documents(text);
    let deployment = find(&docs, "Deployment").expect("no Deployment");
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"].as_array().expect("no env");
    env.iter().map(|e| (e["name"].as_str().unwrap().to_owned(), e.clone())).collect()
}

#[test]
fn two_releases_render_disjoint_object_names_and_leases() {
    let ns = "tidepool-system";
    let a = render_release("shard-a", "training", ns, &["--set", "config.memberSelector=tidepool.io/shard=a"]);
    let b = render_release("shard-b", "training", ns, &["--set", "config.memberSelector=tidepool.io/shard=b"]);
    let (names_a, names_b) = (object_names(&a), object_names(&b));
    assert!(names_a.len() >= 12, "too few objects: {names_a:?}");
    let shared: Vec<_> = names_a.intersection(&names_b).collect();
    assert!(shared.is_empty(), "two training releases in one namespace collide on {shared:?}");
    for (release, text) in [("shard-a", &a), ("shard-b", &b)] {
        let docs = documents(text);
        let config = bridge_config(&docs);
        assert_eq!(config.leader_election.lease_name, format!("{release}-tidepool"), "lease of {release}");
        let sa = format!("{release}-tidepool");
        // Every binding grants to the release's own ServiceAccount; the pods run as it and mount
        // the release's ConfigMap.
        for binding in docs.iter().filter(|d| d["kind"] == "RoleBinding" || d["kind"] == "ClusterRoleBinding") {
            assert_eq!(binding["subjects"][0]["name"].as_str(), Some(sa.as_str()), "{binding:?}");
        }
        let pod = &find(&docs, "Deployment").unwrap()["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"].as_str(), Some(sa.as_str()));
        assert_eq!(
            pod["volumes"][0]["configMap"]["name"].as_str(),
            Some(format!("{release}-tidepool-config").as_str())
        );
        assert!(text.contains(&format!("app.kubernetes.io/instance: {release}")));
    }
    // Member side: two identities in one member cluster; the offload ClusterRole (whose name
    // tidepool binds) is made by the first only.
    let a = render_release("train-1", "member", "tidepool-member", &[]);
    let b = render_release("train-2", "member", "tidepool-member", &["--set", "member.createOffloadRole=false"]);
    let shared: Vec<_> = object_names(&a).intersection(&object_names(&b)).cloned().collect();
    assert!(shared.is_empty(), "two member releases collide on {shared:?}");
    assert!(object_names(&a).contains(&("ClusterRole".into(), String::new(), keys::OFFLOAD_CLUSTER_ROLE.into())));
    assert!(object_names(&b).contains(&("Secret".into(), "tidepool-member".into(), "train-2-tidepool-token".into())));
    // The names stay within 63 characters, whatever the release is called.
    // The names stay within 63 characters, whatever the release (helm allows 53) or override.
    let long = "r".repeat(53);
    let override_ = format!("fullnameOverride={}", "f".repeat(70));
    for target in ["training", "member"] {
        for extra in [&[][..], &["--set", override_.as_str()][..]] {
            for (kind, _, name) in object_names(&render_release(&long, target, "tidepool-system", extra)) {
                assert!(name.len() <= 63 && !name.ends_with('-'), "{kind} {name}");
            }
        }
    }
    let named = render_release(
        "x",
        "training",
        "ns",
        &["--set", "fullnameOverride=bridge", "--set", "serviceAccount.name=custom"],
    );
    let names = object_names(&named);
    assert!(names.contains(&("Deployment".into(), "ns".into(), "bridge".into())), "{names:?}");
    assert!(names.contains(&("ServiceAccount".into(), "ns".into(), "custom".into())), "{names:?}");
    assert_eq!(bridge_config(&documents(&named)).leader_election.lease_name, "bridge");
}

#[test]
fn any_change_to_the_rendered_configmap_rolls_the_pods() {
    let base = checksum(&render("training", "tidepool-system", &[]));
    assert_eq!(base, checksum(&render("training", "tidepool-system", &[])), "the checksum is not stable");
    for set in [
        "leaderElection.leaseDurationSeconds=20",
        "leaderElection.leaseName=other",
        "metrics.port=9000",
        "kubelet.port=10251",
        "kubelet.tlsSecret=kubelet-tls",
        "config.memberLossTimeoutSeconds=60",
    ] {
        assert_ne!(
            base,
            checksum(&render("training", "tidepool-system", &["--set", set])),
            "{set} does not roll the pods"
        );
    }
    // Values outside the ConfigMap do not.
    assert_eq!(base, checksum(&render("training", "tidepool-system", &["--set", "replicas=3"])));
}

#[test]
fn the_pod_disruption_budget_is_there_unless_disabled_or_single_replica() {
    let docs = documents(&render("training", "tidepool-system", &[]));
    let pdb = find(&docs, "PodDisruptionBudget").expect("no PodDisruptionBudget by default");
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(1));
    assert_eq!(pdb["metadata"]["name"].as_str(), Some("tidepool"));
    let deployment = find(&docs, "Deployment").unwrap();
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"]);
    for set in ["podDisruptionBudget.enabled=false", "replicas=1"] {
        let docs = documents(&render("training", "tidepool-system", &["--set", set]));
        assert!(find(&docs, "PodDisruptionBudget").is_none(), "a PodDisruptionBudget with {set}");
    }
    assert!(find(&documents(&render("member", "tidepool-member", &[])), "PodDisruptionBudget").is_none());
}

#[test]
fn the_service_monitor_is_rendered_only_when_enabled() {
    assert!(!render("training", "tidepool-system", &[]).contains("ServiceMonitor"));
    let text = render(
        "training",
        "tidepool-system",
        &[
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.serviceMonitor.interval=15s",
            "--set",
            "metrics.serviceMonitor.labels.release=prometheus",
        ],
    );
    let docs = documents(&text);
    let monitor = find(&docs, "ServiceMonitor").expect("no ServiceMonitor when enabled");
    assert_eq!(monitor["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    assert_eq!(monitor["metadata"]["labels"]["release"].as_str(), Some("prometheus"));
    assert_eq!(monitor["spec"]["endpoints"][0]["interval"].as_str(), Some("15s"));
    assert_eq!(monitor["spec"]["endpoints"][0]["port"].as_str(), Some("metrics"));
    // It selects the metrics Service, and only it.
    let service = find(&docs, "Service").unwrap();
    let selector = monitor["spec"]["selector"]["matchLabels"].as_object().unwrap();
    for (key, value) in selector {
        assert_eq!(&service["metadata"]["labels"][key], value, "the Service lacks {key:?}");
    }
    let selected = docs
        .iter()
        .filter(|d| d["kind"] == "Service")
        .filter(|d| selector.iter().all(|(k, v)| &d["metadata"]["labels"][k] == v))
        .count();
    assert_eq!(selected, 1);
}

#[test]
fn api_server_host_sets_the_in_cluster_env_and_the_node_address_stays_the_pod_ip() {
    let default = container_env(&render("training", "tidepool-system", &[]));
    assert!(!default.contains_key("KUBERNETES_SERVICE_HOST") && !default.contains_key("KUBERNETES_SERVICE_PORT"));
    let env = container_env(&render(
        "training",
        "tidepool-system",
        &["--set", "apiServer.host=172.31.0.1", "--set", "apiServer.port=6443"],
    ));
    assert_eq!(env["KUBERNETES_SERVICE_HOST"]["value"].as_str(), Some("172.31.0.1"));
    assert_eq!(env["KUBERNETES_SERVICE_PORT"]["value"].as_str(), Some("6443"));
    let env = container_env(&render("training", "tidepool-system", &["--set", "apiServer.host=10.0.0.1"]));
    assert_eq!(env["KUBERNETES_SERVICE_PORT"]["value"].as_str(), Some("443"));
    for env in [&default, &env] {
        assert_eq!(
            env["TIDEPOOL_KUBELET_NODE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
            Some("status.podIP")
        );
        assert_eq!(env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"].as_str(), Some("metadata.name"));
    }
}

#[test]
fn the_pod_runs_the_image_with_probes_and_the_kubelet_api_needs_no_files() {
    let text = render("training", "tidepool-system", &[]);
    let docs = documents(&text);
    let pod = &find(&docs, "Deployment").unwrap()["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let chart: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(Path::new(CHART).join("Chart.yaml")).unwrap()).unwrap();
    let app_version = chart["appVersion"].as_str().unwrap();
    assert_eq!(
        app_version,
        env!("CARGO_PKG_VERSION"),
        "Chart.yaml appVersion (the default image tag) is not the workspace version tests/images/build.sh tags the image with"
    );
    assert_eq!(container["image"].as_str(), Some(format!("tidepool.invalid/tidepool:{app_version}").as_str()));
    assert_eq!(container["imagePullPolicy"].as_str(), Some("IfNotPresent"));
    assert_eq!(container["livenessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert_eq!(container["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(container["readinessProbe"]["httpGet"]["port"].as_str(), Some("metrics"));
    assert!(container["readinessProbe"]["failureThreshold"].as_u64().unwrap_or(0) > 1);
    let custom = render(
        "training",
        "tidepool-system",
        &["--set", "image.repository=registry.invalid/x", "--set", "image.tag=t"],
    );
    assert!(custom.contains("image: registry.invalid/x:t"));
    // No TLS files: RBAC to request the serving certificate and read the client CA; no mount.
    let role = docs.iter().find(|d| d["kind"] == "ClusterRole").unwrap();
    let csr = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["apiGroups"][0] == "certificates.k8s.io" && r["resources"][0] == "certificatesigningrequests")
        .expect("no CertificateSigningRequest rule");
    let verbs: Vec<&str> = csr["verbs"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(verbs, ["create", "get", "list", "watch"]);
    let reader = docs
        .iter()
        .find(|d| d["kind"] == "RoleBinding" && d["metadata"]["namespace"] == "kube-system")
        .expect("no RoleBinding in kube-system");
    assert_eq!(reader["roleRef"]["kind"].as_str(), Some("Role"));
    assert_eq!(reader["roleRef"]["name"].as_str(), Some("extension-apiserver-authentication-reader"));
    bridge_config(&docs);
    assert!(!text.contains("kubelet-tls") && !text.contains("tlsCertFile"));
    // With a Secret: mounted, and the config names its files.
    let text = render("training", "tidepool-system", &["--set", "kubelet.tlsSecret=kubelet-tls"]);
    assert!(text.contains("secretName: kubelet-tls") && text.contains("mountPath: /etc/tidepool/kubelet"));
    bridge_config(&documents(&text));
    assert!(text.contains("tlsCertFile: /etc/tidepool/kubelet/tls.crt"));
}

/// The examples in deploy/examples are valid: those whose API the local clusters serve pass a
/// server-side dry run (member-side ones against a member); the PyTorchJob and Volcano Job,
/// whose operators are not installed here, are well-formed and ask for tidepool.
#[tokio::test]
async fn the_examples_are_accepted_by_the_clusters_they_are_for() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    env.install_crds(&training).await;
    for ns in ["team-a", "team-b", "tidepool-system"] {
        ensure_namespace(&training, ns).await;
    }
    ensure_namespace(&member, "online").await;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 7, "examples missing: {files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let docs = documents(&text);
        let api = docs[0]["apiVersion"].as_str().unwrap_or_default().to_owned();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if api.starts_with("kubeflow.org/") || api.starts_with("batch.volcano.sh/") {
            assert!(text.contains("schedulerName: tidepool"), "{name} does not ask for tidepool");
            continue;
        }
        let cluster = if name.starts_with("online") { "member-a" } else { "training" };
        let out = kubectl_with(&env, cluster, &["apply", "--dry-run=server", "-f", "-"], &text)
            .await
            .unwrap_or_else(|e| panic!("{cluster} refused {name}:\n{e}"));
        assert_eq!(out.matches("(server dry run)").count(), docs.len(), "{name}: {out}");
    }
}

const TEST: &str = "least-privilege";
const NS: &str = "e2e-least-privilege";
const MEMBER: &str = "e2e-lp-a";
const NODE: &str = "tidepool-e2e-lp-a";
const MEMBER_NS: &str = "tidepool-member";
/// The chart's release on both sides: its objects are named after it (`<release>-tidepool`), so
/// they do not touch a `tidepool` release installed in the same clusters.
const RELEASE: &str = "e2e-lp";
const SA: &str = "e2e-lp-tidepool";

fn forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// A RoleBinding of the offload ClusterRole for `subject`.
fn offload_binding(name: &str, subject: &serde_json::Value) -> RoleBinding {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": keys::OFFLOAD_CLUSTER_ROLE},
        "subjects": [subject],
    }))
    .unwrap()
}

/// Refused by an admission policy (403 naming it), where RBAC alone would allow it.
fn refused_by_policy<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("ValidatingAdmissionPolicy") => {}
        other => panic!("{what}: expected 403 Forbidden from the admission policy, got {other:?}"),
    }
}

/// The member identity's pods, Services and PriorityClasses are held to what tidepool writes
/// (the member chart's policies; RBAC allows every write below). Tried as a holder of its
/// token, with server-side dry runs (admission runs, nothing is stored).
async fn member_writes_are_held_to_tidepools(lp_member: &Client, offload_ns: &str) {
    let dry = PostParams { dry_run: true, ..Default::default() };
    let pods = Api::<Pod>::namespaced(lp_member.clone(), offload_ns);
    let node =
        Api::<Node>::all(lp_member.clone()).list(&ListParams::default()).await.unwrap().items[0].metadata.name.clone();
    let pod = |name: &str, spec: serde_json::Value| -> Pod {
        let mut p = json!({"metadata": {"name": name}, "spec": {
            "priorityClassName": "tidepool-offload-low", "preemptionPolicy": "Never",
            "containers": [{"name": "main", "image": "example.invalid/trainer:1"}]}});
        p["spec"].as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        serde_json::from_value(p).unwrap()
    };
    wait_for(Duration::from_secs(30), "the member pod policy in effect", || {
        let (pods, dry, p) = (pods.clone(), dry.clone(), pod("e2e-on-node", json!({"nodeName": node})));
        async move { matches!(pods.create(&dry, &p).await, Err(kube::Error::Api(s)) if s.code == 403).then_some(()) }
    })
    .await;
    pods.create(&dry, &pod("e2e-copy-like", json!({}))).await.expect("member: a pod as tidepool writes its copies");
    for (what, spec) in [
        ("member: a pod naming a node (a control-plane one)", json!({"nodeName": node})),
        ("member: a pod tolerating every taint", json!({"tolerations": [{"operator": "Exists"}]})),
        (
            "member: a pod in a class above online pods",
            json!({"priorityClassName": "system-node-critical", "preemptionPolicy": null}),
        ),
    ] {
        refused_by_policy(pods.create(&dry, &pod("e2e-escape", spec)).await, what);
    }
    // A pod's preemption policy other than its class's: Kubernetes' own Priority admission
    // refuses it before any policy runs.
    let preempting = pod("e2e-escape", json!({"preemptionPolicy": "PreemptLowerPriority"}));
    forbidden(pods.create(&dry, &preempting).await, "member: a pod of an offload class that preempts");
    let services = Api::<Service>::namespaced(lp_member.clone(), offload_ns);
    let service = |spec: serde_json::Value| -> Service {
        let mut s = json!({"metadata": {"name": "e2e-svc"}, "spec": {"ports": [{"port": 80}], "selector": {"x": "y"}}});
        s["spec"].as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        serde_json::from_value(s).unwrap()
    };
    services.create(&dry, &service(json!({}))).await.expect("member: a ClusterIP Service as tidepool mirrors");
    for (what, spec) in [
        ("member: a NodePort Service", json!({"type": "NodePort"})),
        ("member: a LoadBalancer Service", json!({"type": "LoadBalancer"})),
        ("member: a Service with externalIPs", json!({"externalIPs": ["10.0.0.1"]})),
    ] {
        refused_by_policy(services.create(&dry, &service(spec)).await, what);
    }
    member_slices_are_held_to_tidepools(lp_member, offload_ns).await;
    let classes = Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(lp_member.clone());
    for (what, class) in [
        (
            "member: a PriorityClass of its own",
            json!({"metadata": {"name": "e2e-mine"}, "value": -5000, "preemptionPolicy": "Never"}),
        ),
        (
            "member: an offload PriorityClass above online pods",
            json!({"metadata": {"name": "tidepool-offload-high"}, "value": 1000000, "preemptionPolicy": "Never"}),
        ),
        (
            "member: an offload PriorityClass as the global default",
            json!({"metadata": {"name": "tidepool-offload-low"}, "value": -3000, "globalDefault": true, "preemptionPolicy": "Never"}),
        ),
    ] {
        refused_by_policy(classes.create(&dry, &serde_json::from_value(class).unwrap()).await, what);
    }
}

/// The member identity's EndpointSlices (native pods listed beside a mirror) are tidepool's:
/// marked as managed by tidepool, owned by a Service, naming no pod or node of the member.
async fn member_slices_are_held_to_tidepools(lp_member: &Client, offload_ns: &str) {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let dry = PostParams { dry_run: true, ..Default::default() };
    let slices = Api::<EndpointSlice>::namespaced(lp_member.clone(), offload_ns);
    let slice = |managed_by: &str, owned: bool, endpoint: serde_json::Value| -> EndpointSlice {
        let owners = json!([{"apiVersion": "v1", "kind": "Service", "name": "e2e-svc",
                             "uid": "00000000-0000-0000-0000-000000000001"}]);
        serde_json::from_value(json!({
            "metadata": {"name": "e2e-svc-native",
                         "labels": {"kubernetes.io/service-name": "e2e-svc",
                                    "endpointslice.kubernetes.io/managed-by": managed_by},
                         "ownerReferences": if owned { owners } else { json!([]) }},
            "addressType": "IPv4", "endpoints": [endpoint], "ports": [{"name": "", "port": 80}]
        }))
        .unwrap()
    };
    let plain = json!({"addresses": ["10.250.0.7"], "hostname": "trainer-0"});
    slices
        .create(&dry, &slice("tidepool.io", true, plain.clone()))
        .await
        .expect("member: a native slice as tidepool writes it");
    let node = Api::<Node>::all(lp_member.clone()).list(&ListParams::default()).await.unwrap().items[0]
        .metadata
        .name
        .clone()
        .unwrap();
    for (what, s) in [
        (
            "member: a slice as the member's own controller's",
            slice("endpointslice-controller.k8s.io", true, plain.clone()),
        ),
        ("member: a slice owned by nothing", slice("tidepool.io", false, plain)),
        (
            "member: a slice naming a member pod",
            slice(
                "tidepool.io",
                true,
                json!({"addresses": ["10.250.0.7"], "targetRef": {"kind": "Pod", "name": "online-0", "namespace": "prod"}}),
            ),
        ),
        (
            "member: a slice naming a member node",
            slice("tidepool.io", true, json!({"addresses": ["10.250.0.7"], "nodeName": node})),
        ),
    ] {
        refused_by_policy(slices.create(&dry, &s).await, what);
    }
}

/// The training identity's writes to pods and nodes are held to tidepool's own (the training
/// chart's policy; RBAC allows each write below): tried as a holder of its token, with
/// server-side dry runs, on a bystander pod of another scheduler and a real node; the pod
/// `ours` on the virtual node and the virtual node itself stay writable.
async fn training_writes_are_held_to_tidepools(env: &Env, training: &Client, lp_training: &Client, ours: &str) {
    let pods = Api::<Pod>::namespaced(lp_training.clone(), NS);
    let bystander = format!("e2e-bystander-{}", run_id());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": bystander},
        "spec": {"nodeSelector": {"e2e.tidepool.io/nowhere": "true"},
                 "containers": [{"name": "main", "image": "example.invalid/online:1"}]}
    }))
    .unwrap();
    Api::<Pod>::namespaced(training.clone(), NS).create(&PostParams::default(), &pod).await.unwrap();
    let dry = PatchParams { dry_run: true, ..Default::default() };
    let label = Patch::Merge(json!({"metadata": {"labels": {"e2e-touched": "yes"}}}));
    wait_for(Duration::from_secs(30), "the training writes policy in effect", || {
        let (pods, bystander, dry, label) = (pods.clone(), bystander.clone(), dry.clone(), label.clone());
        async move {
            matches!(pods.patch(&bystander, &dry, &label).await, Err(kube::Error::Api(s)) if s.code == 403)
                .then_some(())
        }
    })
    .await;
    refused_by_policy(pods.patch(&bystander, &dry, &label).await, "training: relabel another scheduler's pod");
    let failed = Patch::Merge(json!({"status": {"phase": "Failed", "reason": "Forged"}}));
    refused_by_policy(pods.patch_status(&bystander, &dry, &failed).await, "training: fail another scheduler's pod");
    let delete = kube::api::DeleteParams { dry_run: true, ..Default::default() };
    refused_by_policy(pods.delete(&bystander, &delete).await, "training: delete another scheduler's pod");
    pods.patch(ours, &dry, &label).await.expect("training: a pod on its virtual node");
    let nodes = Api::<Node>::all(lp_training.clone());
    let cordon = Patch::Merge(json!({"spec": {"unschedulable": true}}));
    refused_by_policy(nodes.patch(env.var("TRAINING_REAL_NODE"), &dry, &cordon).await, "training: cordon a real node");
    refused_by_policy(nodes.delete(env.var("TRAINING_REAL_NODE"), &delete).await, "training: delete a real node");
    nodes.patch(NODE, &dry, &label).await.expect("training: its virtual node");
    Api::<Pod>::namespaced(training.clone(), NS).delete(&bystander, &Default::default()).await.unwrap();
    volcano_groups_only_in_status(env, training, lp_training).await;
    kueue_queues_only_their_lent_quota(env, training, lp_training).await;
}

/// Volcano's PodGroups have no status subresource, and the training identity patches them as
/// their gang scheduler: the policy lets it change their status alone. Tried as a holder of its
/// token (dry runs) on a group it may write: its minimum and its labels (the policy refuses),
/// a new group (RBAC refuses), its status (allowed).
async fn volcano_groups_only_in_status(env: &Env, training: &Client, lp_training: &Client) {
    let crd =
        std::fs::read_to_string(format!("{}/volcano.yaml", std::env::var("TIDEPOOL_GANG_CRDS").unwrap())).unwrap();
    let apply = ["apply", "--server-side", "--force-conflicts", "--field-manager=tidepool-operators", "-f", "-"];
    kubectl_with(env, "training", &apply, &crd).await.unwrap();
    kubectl_with(
        env,
        "training",
        &["wait", "--for", "condition=Established", "crd/podgroups.scheduling.volcano.sh"],
        "",
    )
    .await
    .unwrap();
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "PodGroup"),
        "podgroups",
    );
    let name = format!("e2e-group-{}", run_id());
    let group: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
        "metadata": {"name": name}, "spec": {"minMember": 4}
    }))
    .unwrap();
    Api::<DynamicObject>::namespaced_with(training.clone(), NS, &ar)
        .create(&PostParams::default(), &group)
        .await
        .unwrap();
    let groups = Api::<DynamicObject>::namespaced_with(lp_training.clone(), NS, &ar);
    let dry = PatchParams { dry_run: true, ..Default::default() };
    let patch = |v: serde_json::Value| Patch::Merge(v);
    refused_by_policy(
        groups.patch(&name, &dry, &patch(json!({"spec": {"minMember": 1}}))).await,
        "training: shrink a Volcano PodGroup's minMember",
    );
    refused_by_policy(
        groups.patch(&name, &dry, &patch(json!({"metadata": {"labels": {"e2e-touched": "yes"}}}))).await,
        "training: relabel a Volcano PodGroup",
    );
    let mut other = group.clone();
    other.metadata.name = Some(format!("{name}-forged"));
    forbidden(
        groups.create(&PostParams { dry_run: true, ..Default::default() }, &other).await,
        "training: create a Volcano PodGroup (RBAC grants no create)",
    );
    groups
        .patch(&name, &dry, &patch(json!({"status": {"phase": "Inqueue"}})))
        .await
        .expect("training: a Volcano PodGroup's status");
    Api::<DynamicObject>::namespaced_with(training.clone(), NS, &ar).delete(&name, &Default::default()).await.unwrap();
}

/// Kueue's ClusterQueues: the training identity may patch them (to keep the quota over lent
/// capacity), and the policy holds it to the nominalQuota of the queues an admin marked
/// `tidepool.io/lent-quota`. Tried as a holder of its token (dry runs): an unmarked queue's
/// quota, a marked one's cohort, borrowing limit, flavor and mark (the policy refuses), a new
/// queue (RBAC refuses), the marked queue's quota (allowed).
async fn kueue_queues_only_their_lent_quota(env: &Env, training: &Client, lp_training: &Client) {
    let crd = format!("{}/crds/kueue/kueue.x-k8s.io_clusterqueues.yaml", std::env::var("TIDEPOOL_SCHEDULERS").unwrap());
    let crd = std::fs::read_to_string(crd).unwrap();
    let apply = ["apply", "--server-side", "--force-conflicts", "--field-manager=tidepool-operators", "-f", "-"];
    kubectl_with(env, "training", &apply, &crd).await.unwrap();
    let established = ["wait", "--for", "condition=Established", "crd/clusterqueues.kueue.x-k8s.io"];
    kubectl_with(env, "training", &established, "").await.unwrap();
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "ClusterQueue"),
        "clusterqueues",
    );
    let id = run_id();
    let queue = |name: &str, mark: bool| -> DynamicObject {
        let annotations = if mark { json!({"tidepool.io/lent-quota": "100%"}) } else { json!({}) };
        serde_json::from_value(json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"cohortName": "e2e-deploy", "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                {"name": "lent", "resources": [{"name": "cpu", "nominalQuota": "1", "borrowingLimit": "1"}]}]}]}
        }))
        .unwrap()
    };
    let (marked, unmarked) = (format!("e2e-marked-{id}"), format!("e2e-unmarked-{id}"));
    let admin = Api::<DynamicObject>::all_with(training.clone(), &ar);
    for (name, mark) in [(&marked, true), (&unmarked, false)] {
        admin.create(&PostParams::default(), &queue(name, mark)).await.unwrap();
    }
    let queues = Api::<DynamicObject>::all_with(lp_training.clone(), &ar);
    let dry = PatchParams { dry_run: true, ..Default::default() };
    let groups = |flavor: &str, quota: &str, borrow: &str| {
        json!({"spec": {"resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
            {"name": flavor, "resources": [{"name": "cpu", "nominalQuota": quota, "borrowingLimit": borrow}]}]}]}})
    };
    let attempts = [
        (&unmarked, groups("lent", "64", "1"), "training: raise an unmarked ClusterQueue's quota"),
        (
            &marked,
            json!({"spec": {"cohortName": "elsewhere"}}),
            "training: move a marked ClusterQueue to another cohort",
        ),
        (&marked, groups("lent", "1", "64"), "training: raise a marked ClusterQueue's borrowing limit"),
        (&marked, groups("native", "1", "1"), "training: rename a marked ClusterQueue's flavor"),
        (
            &marked,
            json!({"metadata": {"annotations": {"tidepool.io/lent-quota": null}}}),
            "training: unmark a ClusterQueue",
        ),
    ];
    for (name, patch, what) in attempts {
        refused_by_policy(queues.patch(name, &dry, &Patch::Merge(patch)).await, what);
    }
    forbidden(
        queues
            .create(&PostParams { dry_run: true, ..Default::default() }, &queue(&format!("{marked}-forged"), true))
            .await,
        "training: create a ClusterQueue (RBAC grants no create)",
    );
    queues
        .patch(&marked, &dry, &Patch::Merge(groups("lent", "250m", "1")))
        .await
        .expect("training: the quota of a marked ClusterQueue");
    for name in [&marked, &unmarked] {
        admin.delete(name, &Default::default()).await.unwrap();
    }
}

#[tokio::test]
async fn tidepool_works_under_the_shipped_rbac_and_is_refused_everything_else() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    // What a run without the member policy (or a failed one) left behind.
    let _ = Api::<RoleBinding>::namespaced(member.clone(), "kube-system")
        .delete("e2e-escalation", &Default::default())
        .await;

    // 1. Member side: the chart's identity and roles, applied for real; its token in a Secret.
    ensure_namespace(&member, MEMBER_NS).await;
    kubectl_with(&env, "member-a", &["apply", "-f", "-"], &render_release(RELEASE, "member", MEMBER_NS, &[]))
        .await
        .unwrap();
    let member_token = token(&member, MEMBER_NS, SA).await;
    let member_kubeconfig = token_kubeconfig(&env, env.var("MEMBER_A_SERVER"), &member_token);
    put_kubeconfig_secret(&training, NS, "member-a-least", member_kubeconfig.as_bytes()).await;

    // 2. Training side: the chart's ServiceAccount and roles in NS (no replicas: the test runs
    //    the binary itself, as that ServiceAccount).
    //    Its admission policy applies in NS alone here: it is cluster-wide, and the releases of
    //    other tests (the chart test's) are not exempt from it.
    let only_ns =
        format!("admissionPolicy.namespaceSelector={{\"matchLabels\":{{\"kubernetes.io/metadata.name\":\"{NS}\"}}}}");
    let scheduler = format!("config.dispatcher.schedulerName={}", scheduler_name(TEST));
    // Secrets granted in NS alone (config.secretNamespaces), not cluster-wide.
    let secrets_here = format!("config.secretNamespaces=[\"{NS}\"]");
    let rendered = render_release(
        RELEASE,
        "training",
        NS,
        &["--set", "replicas=0", "--set", &scheduler, "--set-json", &only_ns, "--set-json", &secrets_here],
    );
    kubectl_with(&env, "training", &["apply", "-f", "-"], &rendered).await.unwrap();
    let training_token = token(&training, NS, SA).await;
    let dir = tempfile::tempdir().unwrap();
    let training_kubeconfig = dir.path().join("training.kubeconfig");
    std::fs::write(&training_kubeconfig, token_kubeconfig(&env, env.var("TRAINING_SERVER"), &training_token)).unwrap();

    apply_member(&training, MEMBER, TEST, NS, "member-a-least").await;
    // An earlier run's capacity record would read as this run's.
    let records = Api::<ConfigMap>::namespaced(training.clone(), NS);
    let record = tidepool_federation::published::record_name(MEMBER);
    let _ = records.delete(&record, &Default::default()).await;
    // Sharded, as the chart runs it: its member and presence Leases and its published capacity
    // record are written under the Role too.
    let top_level = format!("sharding: {{enabled: true}}\nsecretNamespaces: [{NS}]");
    let tidepool = Tidepool::start_as(&env, TEST, NS, &training_kubeconfig, "", &top_level);

    // 3. Everything works: virtual node, a pod with a ConfigMap and a Secret offloaded and
    //    running, its copies reflected into the offload namespace.
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node under least privilege", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten() }
    })
    .await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let config: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "lp-config"}, "data": {"lr": "0.1"}})).unwrap();
    let secret: Secret =
        serde_json::from_value(json!({"metadata": {"name": "lp-secret"}, "stringData": {"token": "s3cret"}})).unwrap();
    let pp = PatchParams::apply("tidepool-e2e").force();
    Api::<ConfigMap>::namespaced(training.clone(), NS).patch("lp-config", &pp, &Patch::Apply(&config)).await.unwrap();
    Api::<Secret>::namespaced(training.clone(), NS).patch("lp-secret", &pp, &Patch::Apply(&secret)).await.unwrap();
    let name = format!("lp-{}", run_id());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "envFrom": [{"configMapRef": {"name": "lp-config"}}],
                            "volumeMounts": [{"name": "s", "mountPath": "/etc/s"}],
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
            "volumes": [{"name": "s", "secret": {"secretName": "lp-secret"}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(90), "pod Running through the least-privilege identities", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    // The member's capacity record, published for the other replicas.
    wait_for(Duration::from_secs(30), "capacity record published under the chart's Role", || {
        let (records, record) = (records.clone(), record.clone());
        async move { records.get_opt(&record).await.ok().flatten() }
    })
    .await;
    let offload_ns = offload_ns(NS);
    let lp_member = client_from(&member_kubeconfig).await;
    // The offload namespace was fenced (its NetworkPolicy) before the copy went in.
    let policies = Api::<NetworkPolicy>::namespaced(member.clone(), &offload_ns);
    assert!(policies.get_opt("tidepool-isolation").await.unwrap().is_some(), "no NetworkPolicy in {offload_ns}");
    // Its own offload namespace is readable to it, and holds the copies.
    let copies = Api::<Secret>::namespaced(lp_member.clone(), &offload_ns).list(&ListParams::default()).await.unwrap();
    assert!(copies.items.iter().any(|s| s.metadata.name.as_deref() == Some("lp-secret")), "Secret not reflected");
    // The usage of its copies, for the kubelet API's /metrics/resource (`kubectl top`, HPAs).
    let pod_metrics = kube::api::ApiResource {
        group: "metrics.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "metrics.k8s.io/v1beta1".into(),
        kind: "PodMetrics".into(),
        plural: "pods".into(),
    };
    Api::<kube::api::DynamicObject>::namespaced_with(lp_member.clone(), &offload_ns, &pod_metrics)
        .list(&ListParams::default())
        .await
        .unwrap_or_else(|e| panic!("the member role cannot list PodMetrics in {offload_ns}: {e}"));
    let bindings =
        Api::<RoleBinding>::namespaced(member.clone(), &offload_ns).list(&ListParams::default()).await.unwrap();
    assert!(
        bindings.items.iter().any(|b| b.role_ref.name == keys::OFFLOAD_CLUSTER_ROLE
            && b.subjects.iter().flatten().any(|s| s.name == SA && s.namespace.as_deref() == Some(MEMBER_NS))),
        "no RoleBinding of the offload role for tidepool's member identity in {offload_ns}"
    );

    // Nothing tidepool did was refused (read from live counters: a dead tidepool's empty
    // scrape would read as zero refusals).
    let text = tidepool.scrape_live();
    for cluster in ["training", MEMBER] {
        let refused =
            metric_sum(&text, "tidepool_api_requests_total", &[&format!("cluster=\"{cluster}\""), "code=\"403\""]);
        assert_eq!(refused, 0.0, "tidepool was refused calls to {cluster} it needs:\n{text}\n{}", tidepool.log_tail());
    }

    // 4. What the identities must not do, they cannot.
    forbidden(
        Api::<Secret>::namespaced(lp_member.clone(), "kube-system").list(&ListParams::default()).await,
        "member: Secrets of kube-system",
    );
    forbidden(
        Api::<Secret>::namespaced(lp_member.clone(), "default").get("anything").await,
        "member: a Secret in default",
    );
    forbidden(
        Api::<ClusterRole>::all(lp_member.clone()).list(&ListParams::default()).await,
        "member: list ClusterRoles",
    );
    forbidden(
        Api::<RoleBinding>::namespaced(lp_member.clone(), "kube-system").list(&ListParams::default()).await,
        "member: RoleBindings of kube-system",
    );
    forbidden(
        Api::<Node>::all(lp_member.clone())
            .patch(
                "member-a-gpu-0",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
            )
            .await,
        "member: patch a node",
    );
    let stray: Pod = serde_json::from_value(
        json!({"metadata": {"name": "stray"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}),
    )
    .unwrap();
    forbidden(
        Api::<Pod>::namespaced(lp_member.clone(), "default").create(&PostParams::default(), &stray).await,
        "member: a pod outside the offload namespaces",
    );
    forbidden(
        Api::<ConfigMap>::namespaced(lp_member.clone(), "kube-system").list(&ListParams::default()).await,
        "member: ConfigMaps of kube-system",
    );
    // Services (the mirrors of training Services) only in its offload namespaces.
    let mirror: Service =
        serde_json::from_value(json!({"metadata": {"name": "e2e-mirror"}, "spec": {"ports": [{"port": 80}]}})).unwrap();
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    Api::<Service>::namespaced(lp_member.clone(), &offload_ns)
        .create(&dry_run, &mirror)
        .await
        .expect("member: a Service in its offload namespace");
    forbidden(
        Api::<Service>::namespaced(lp_member.clone(), "default").create(&dry_run, &mirror).await,
        "member: a Service outside the offload namespaces",
    );
    forbidden(
        Api::<Service>::namespaced(lp_member.clone(), "kube-system").delete("kube-dns", &Default::default()).await,
        "member: delete a Service of kube-system",
    );
    // Its create on RoleBindings and bind on the offload role hold only in the namespaces
    // tidepool labelled as its own, and only for itself (the member chart's admission policy;
    // RBAC alone allows every one of these).
    let me = json!({"kind": "ServiceAccount", "name": SA, "namespace": MEMBER_NS});
    let escalation = offload_binding("e2e-escalation", &me);
    // A policy applied moments ago is enforced once the apiserver has loaded it: wait for
    // that with server-side dry runs (they pass admission too), then try it for real.
    let dry = PostParams { dry_run: true, ..Default::default() };
    let in_kube_system = Api::<RoleBinding>::namespaced(lp_member.clone(), "kube-system");
    wait_for(Duration::from_secs(30), "the member admission policy in effect", || {
        let (api, escalation, dry) = (in_kube_system.clone(), escalation.clone(), dry.clone());
        async move {
            match api.create(&dry, &escalation).await {
                Err(kube::Error::Api(s)) if s.code == 403 => Some(()),
                _ => None,
            }
        }
    })
    .await;
    refused_by_policy(
        Api::<RoleBinding>::namespaced(lp_member.clone(), "kube-system")
            .create(&PostParams::default(), &escalation)
            .await,
        "member: bind the offload role to itself in kube-system",
    );
    let own = Api::<RoleBinding>::namespaced(lp_member.clone(), &offload_ns);
    let _ = Api::<RoleBinding>::namespaced(member.clone(), &offload_ns).delete("e2e-again", &Default::default()).await;
    own.create(&PostParams::default(), &offload_binding("e2e-again", &me))
        .await
        .expect("member: bind the offload role to itself in its own offload namespace");
    let someone = json!({"kind": "ServiceAccount", "name": "default", "namespace": "kube-system"});
    refused_by_policy(
        own.create(&PostParams::default(), &offload_binding("e2e-someone", &someone)).await,
        "member: bind the offload role to another subject in its own offload namespace",
    );
    member_writes_are_held_to_tidepools(&lp_member, &offload_ns).await;
    let namespaces = Api::<Namespace>::all(lp_member);
    let id = run_id();
    for (what, labels) in [
        ("member: a namespace without tidepool's labels", json!({})),
        (
            "member: a tidepool-labelled namespace that admits privileged pods",
            json!({keys::LABEL_MANAGED_BY: keys::MANAGED_BY, keys::LABEL_ORIGIN_CLUSTER: "training",
                   "pod-security.kubernetes.io/enforce": "privileged"}),
        ),
    ] {
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": format!("e2e-stray-{id}"), "labels": labels}})).unwrap();
        refused_by_policy(namespaces.create(&PostParams::default(), &ns).await, what);
    }
    let lp_training = client_from(&std::fs::read_to_string(&training_kubeconfig).unwrap()).await;
    training_writes_are_held_to_tidepools(&env, &training, &lp_training, &name).await;
    secrets_only_where_granted(&training, &lp_training).await;
    forbidden(
        Api::<ClusterRole>::all(lp_training.clone()).list(&ListParams::default()).await,
        "training: list ClusterRoles",
    );
    forbidden(
        Api::<Deployment>::namespaced(lp_training.clone(), NS).list(&ListParams::default()).await,
        "training: Deployments",
    );
    forbidden(
        Api::<RoleBinding>::namespaced(lp_training.clone(), "kube-system").list(&ListParams::default()).await,
        "training: RoleBindings",
    );
    // Services are read (to mirror them), never written.
    Api::<Service>::namespaced(lp_training.clone(), NS).list(&ListParams::default()).await.expect("training: Services");
    forbidden(
        Api::<Service>::namespaced(lp_training.clone(), NS)
            .create(&PostParams { dry_run: true, ..Default::default() }, &mirror)
            .await,
        "training: create a Service",
    );
    // The kubelet API without files: it may request a serving certificate and read the client
    // CA, but not approve its own request.
    let csrs = Api::<CertificateSigningRequest>::all(lp_training.clone());
    csrs.list(&ListParams::default()).await.expect("training: list CertificateSigningRequests");
    Api::<ConfigMap>::namespaced(lp_training, "kube-system")
        .get("extension-apiserver-authentication")
        .await
        .expect("training: the client CA ConfigMap");
    forbidden(
        csrs.patch_approval(
            "tidepool-e2e-none",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{"type": "Approved", "status": "True"}]}})),
        )
        .await,
        "training: approve a CertificateSigningRequest",
    );

    drain_pods(&training, NS).await;
    drop(tidepool);
}

/// With `secretNamespaces`, the training identity reads no Secret outside them, and a pod
/// elsewhere that references one fails with the reason, nothing of it created in the member.
async fn secrets_only_where_granted(training: &Client, lp_training: &Client) {
    forbidden(
        Api::<Secret>::namespaced(lp_training.clone(), "kube-system").list(&ListParams::default()).await,
        "training: Secrets of kube-system",
    );
    forbidden(Api::<Secret>::all(lp_training.clone()).list(&ListParams::default()).await, "training: every Secret");
    Api::<Secret>::namespaced(lp_training.clone(), NS).list(&ListParams::default()).await.expect("training: NS's");
    const ELSEWHERE: &str = "e2e-deploy-elsewhere";
    ensure_namespace(training, ELSEWHERE).await;
    let secret: Secret =
        serde_json::from_value(json!({"metadata": {"name": "other-secret"}, "stringData": {"k": "v"}})).unwrap();
    let pp = PatchParams::apply("tidepool-e2e").force();
    Api::<Secret>::namespaced(training.clone(), ELSEWHERE)
        .patch("other-secret", &pp, &Patch::Apply(&secret))
        .await
        .unwrap();
    let name = format!("elsewhere-{}", run_id());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "volumeMounts": [{"name": "s", "mountPath": "/etc/s"}],
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
            "volumes": [{"name": "s", "secret": {"secretName": "other-secret"}}]
        }
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), ELSEWHERE);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let message = wait_for(Duration::from_secs(60), "the pod elsewhere refused", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move {
            let st = pods.get(&name).await.ok()?.status?;
            (st.phase.as_deref() == Some("Failed"))
                .then(|| (st.reason.unwrap_or_default(), st.message.unwrap_or_default()))
        }
    })
    .await;
    println!("a pod elsewhere: {message:?}");
    assert_eq!(message.0, keys::REASON_OFFLOAD_POLICY);
    assert!(message.1.contains("secretNamespaces"), "says why: {}", message.1);
    let _ = pods.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
}

/// The namespace of the hand-binding test; the training policy is rendered to apply there only,
/// so it never touches the other tests' pods.
const VAP_NS: &str = "e2e-vap";
/// The release whose training policy that test installs.
const VAP_RELEASE: &str = "e2e-vap";

/// A pod of `name` in the test's namespace, on `node` when given.
fn bare_pod(name: &str, node: Option<&str>) -> Pod {
    let mut spec = json!({"containers": [{"name": "c", "image": "example.invalid/trainer:1"}]});
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

/// A ServiceAccount of `VAP_NS` that may create, bind and delete pods there (a tenant, or a
/// stand-in for tidepool's own account), and a client that is it.
async fn pod_creator(env: &Env, admin: &Client, name: &str) -> Client {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    let pp = PatchParams::apply("tidepool-e2e").force();
    Api::<ServiceAccount>::namespaced(admin.clone(), VAP_NS).patch(name, &pp, &Patch::Apply(&sa)).await.unwrap();
    let role: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
        "metadata": {"name": "e2e-pod-creator"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "patch", "delete"]},
                  {"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]}]
    }))
    .unwrap();
    Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(admin.clone(), VAP_NS)
        .patch("e2e-pod-creator", &pp, &Patch::Apply(&role))
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("e2e-pod-creator-{name}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "e2e-pod-creator"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": VAP_NS}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), VAP_NS)
        .patch(&format!("e2e-pod-creator-{name}"), &pp, &Patch::Apply(&binding))
        .await
        .unwrap();
    let token = token(admin, VAP_NS, name).await;
    client_from(&token_kubeconfig(env, env.var("TRAINING_SERVER"), &token)).await
}

#[tokio::test]
async fn a_tenant_cannot_put_a_pod_on_a_virtual_node_by_hand() {
    let env = Env::load();
    let training = env.client("training").await;
    ensure_namespace(&training, VAP_NS).await;
    // The training side's admission policy, as the chart renders it, for this namespace alone.
    let selector = format!(
        "admissionPolicy.namespaceSelector={{\"matchLabels\":{{\"kubernetes.io/metadata.name\":\"{VAP_NS}\"}}}}"
    );
    let rendered = render_release(VAP_RELEASE, "training", VAP_NS, &["--set", "replicas=0", "--set-json", &selector]);
    let policy: Vec<String> = documents(&rendered)
        .into_iter()
        .filter(|d| d["apiVersion"] == "admissionregistration.k8s.io/v1")
        .map(|d| serde_saphyr::to_string(&d).unwrap())
        .collect();
    if !policy.is_empty() {
        kubectl_with(&env, "training", &["apply", "-f", "-"], &policy.join("---\n")).await.unwrap();
    }
    let tenant = pod_creator(&env, &training, "tenant").await;
    let tenant_client = tenant.clone();
    // The release's own ServiceAccount (`<release>-tidepool`) is tidepool: exempt.
    let tidepool = pod_creator(&env, &training, &format!("{VAP_RELEASE}-tidepool")).await;
    let (as_tenant, as_admin, as_tidepool) = (
        Api::<Pod>::namespaced(tenant, VAP_NS),
        Api::<Pod>::namespaced(training.clone(), VAP_NS),
        Api::<Pod>::namespaced(tidepool, VAP_NS),
    );
    let id = run_id();
    let delete = |name: String| {
        let api = as_admin.clone();
        async move {
            let _ = api
                .delete(&name, &kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
                .await;
        }
    };

    // 1. The tenant names a virtual node: refused, the message says what to do instead. (A
    //    new policy takes a moment to reach the API server's admission chain.)
    let hand_bound = format!("hand-bound-{id}");
    let refusal = wait_for(Duration::from_secs(30), "the tenant's hand-bound pod refused", || {
        let (api, name, delete) = (as_tenant.clone(), hand_bound.clone(), delete);
        async move {
            match api.create(&PostParams::default(), &bare_pod(&name, Some("tidepool-x"))).await {
                // Refused: by the policy as rendered (a policy just changed may still answer
                // with its previous version for a moment).
                Err(kube::Error::Api(s)) if s.code == 403 => Some(s),
                Err(kube::Error::Api(_)) => None,
                Ok(_) => {
                    delete(name).await;
                    None
                }
                Err(e) => panic!("creating the pod: {e}"),
            }
        }
    })
    .await;
    assert_eq!(refusal.code, 403, "{refusal:?}");
    for words in ["tidepool-x", "schedulerName: tidepool", &hand_bound] {
        assert!(refusal.message.contains(words), "the refusal does not say {words:?}: {}", refusal.message);
    }

    // 2. Without nodeName the same pod is fine (the scheduler or the dispatcher places it).
    let plain = format!("plain-{id}");
    as_tenant.create(&PostParams::default(), &bare_pod(&plain, None)).await.expect("a pod without nodeName");

    // 2b. The dispatcher's record on a pod (band label, placement annotations) is not the
    //     tenant's to preset or change; other labels are.
    let mut preset = bare_pod(&format!("preset-{id}"), None);
    preset.metadata.labels = Some([(keys::LABEL_BAND.to_owned(), "high".to_owned())].into());
    let refusal = wait_for(Duration::from_secs(30), "the tenant's preset band label refused", || {
        let (api, pod, delete) = (as_tenant.clone(), preset.clone(), delete);
        async move {
            match api.create(&PostParams::default(), &pod).await {
                Err(kube::Error::Api(s)) if s.code == 403 => Some(s),
                Err(kube::Error::Api(_)) => None,
                Ok(p) => {
                    delete(p.metadata.name.unwrap_or_default()).await;
                    None
                }
                Err(e) => panic!("creating the pod: {e}"),
            }
        }
    })
    .await;
    assert!(refusal.message.contains(keys::LABEL_BAND), "{}", refusal.message);
    let mut pinned = bare_pod(&format!("pinned-{id}"), None);
    pinned.metadata.annotations = Some([(keys::ANNOTATION_PLACEMENT.to_owned(), "tidepool-x".to_owned())].into());
    refused_by_policy(as_tenant.create(&PostParams::default(), &pinned).await, "tenant: a pod preset to a placement");
    let label = |key: &str, value: &str| Patch::Merge(json!({"metadata": {"labels": {key: value}}}));
    refused_by_policy(
        as_tenant.patch(&plain, &PatchParams::default(), &label(keys::LABEL_BAND, "high")).await,
        "tenant: labelling its pod's band",
    );
    as_tenant.patch(&plain, &PatchParams::default(), &label("team", "a")).await.expect("tenant: another label");
    as_admin.patch(&plain, &PatchParams::default(), &label(keys::LABEL_BAND, "low")).await.expect("admin: the band");
    as_tenant
        .patch(&plain, &PatchParams::default(), &label("team", "b"))
        .await
        .expect("tenant: another label, the band left as it is");

    // 3. Binding the pending pod to a virtual node is refused as well.
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": plain},
                         "target": {"apiVersion": "v1", "kind": "Node", "name": "tidepool-x"}});
    match as_tenant
        .create_subresource::<_, serde_json::Value>("binding", &plain, &PostParams::default(), &binding)
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("tidepool-x") => {}
        other => panic!("tenant binding a pod to a virtual node: expected the policy's 403, got {other:?}"),
    }
    // The same through the legacy `bindings` resource (POST .../namespaces/<ns>/bindings).
    let legacy = kube::api::ApiResource {
        group: String::new(),
        version: "v1".into(),
        api_version: "v1".into(),
        kind: "Binding".into(),
        plural: "bindings".into(),
    };
    let bindings = Api::<kube::api::DynamicObject>::namespaced_with(tenant_client, VAP_NS, &legacy);
    let object: kube::api::DynamicObject = serde_json::from_value(binding.clone()).unwrap();
    match bindings.create(&PostParams::default(), &object).await {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("tidepool-x") => {}
        other => {
            panic!("tenant binding through the legacy bindings resource: expected the policy's 403, got {other:?}")
        }
    }
    let pod = as_admin.get(&plain).await.unwrap();
    assert_eq!(pod.spec.and_then(|s| s.node_name), None, "the pod was bound");

    // 4. An admin (system:masters) and tidepool's own ServiceAccount may.
    let by_admin = format!("by-admin-{id}");
    as_admin.create(&PostParams::default(), &bare_pod(&by_admin, Some("tidepool-x"))).await.expect("admin, by hand");
    let by_tidepool = format!("by-tidepool-{id}");
    as_tidepool
        .create(&PostParams::default(), &bare_pod(&by_tidepool, Some("tidepool-x")))
        .await
        .expect("tidepool's ServiceAccount, by hand");

    for name in [plain, by_admin, by_tidepool] {
        delete(name).await;
    }
}
