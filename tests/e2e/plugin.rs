//! `kubectl tidepool` through kubectl's own plugin lookup: a tenant with only the RBAC of
//! their namespace sees their gangs and why a pod waits, and is refused the admin views with
//! kubectl's exit code; an admin sees members and pools, in text and JSON.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "plugin";
const NS: &str = "e2e-plugin";
const NODE: &str = "tidepool-plugin-member-b";

/// A kubeconfig with the training cluster as context `training` and member-b as the
/// current context.
fn two_contexts(env: &Env, dir: &Path) -> std::path::PathBuf {
    let read = |cluster: &str| -> serde_json::Value {
        serde_saphyr::from_str(&std::fs::read_to_string(env.kubeconfig_path(cluster)).unwrap()).unwrap()
    };
    let (training, member) = (read("training"), read("member-b"));
    let entry = |config: &serde_json::Value, list: &str| config[list][0].clone();
    let named = |mut v: serde_json::Value, name: &str| {
        v["name"] = json!(name);
        v
    };
    let config = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "member",
        "clusters": [named(entry(&training, "clusters"), "training"), named(entry(&member, "clusters"), "member")],
        "users": [named(entry(&training, "users"), "training"), named(entry(&member, "users"), "member")],
        "contexts": [
            {"name": "training", "context": {"cluster": "training", "user": "training"}},
            {"name": "member", "context": {"cluster": "member", "user": "member"}},
        ],
    });
    let path = dir.join("two-contexts.kubeconfig");
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    path
}

/// Runs `kubectl tidepool ARGS` with the plugin (a link named `kubectl-tidepool` to the
/// binary under test) first on PATH. Returns exit code, stdout, stderr.
pub(crate) async fn plugin(env: &Env, bin_dir: &Path, kubeconfig: &Path, args: &[&str]) -> (i32, String, String) {
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    // kubectl finds a plugin from the arguments before the first flag: flags come after.
    let child = tokio::process::Command::new(env.var("KUBECTL"))
        .arg("tidepool")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await.unwrap().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// A ServiceAccount of `NS` that may read pods and events there, and nothing else.
async fn tenant_kubeconfig(env: &Env, training: &Client, dir: &Path) -> std::path::PathBuf {
    let ssa = PatchParams::apply("tidepool-e2e").force();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "tenant"}})).unwrap();
    Api::<ServiceAccount>::namespaced(training.clone(), NS).patch("tenant", &ssa, &Patch::Apply(&sa)).await.unwrap();
    let role: Role = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "tenant"},
        "rules": [{"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["get", "list", "watch"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(training.clone(), NS).patch("tenant", &ssa, &Patch::Apply(&role)).await.unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": NS}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(training.clone(), NS).patch("tenant", &ssa, &Patch::Apply(&binding)).await.unwrap();
    let token = token(training, NS, "tenant").await;
    let path = dir.join("tenant.kubeconfig");
    std::fs::write(&path, token_kubeconfig(env, env.var("TRAINING_SERVER"), &token)).unwrap();
    path
}

fn gang_pod(name: &str, gang: &str, gpus: u32) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: "2"}},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "cpu": "1", "memory": "1Gi"}}}]
        }
    }))
    .unwrap()
}

pub(crate) fn items(stdout: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    v["items"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn kubectl_tidepool_shows_a_tenant_their_gangs_and_an_admin_the_members() {
    let env = Env::load();
    let training = env.client("training").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, "plugin-member-b", "member-b").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten().map(|_| ()) }
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tidepool"), dir.path().join("kubectl-tidepool")).unwrap();
    let tenant = tenant_kubeconfig(&env, &training, dir.path()).await;
    let admin = env.kubeconfig_path("training");

    // A gang that fits, and one no pool can hold.
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    for (name, gang, gpus) in
        [("fits-0", "fits", 1), ("fits-1", "fits", 1), ("huge-0", "huge", 999), ("huge-1", "huge", 999)]
    {
        pods.create(&PostParams::default(), &gang_pod(name, gang, gpus)).await.unwrap();
    }
    wait_for(Duration::from_secs(60), "the fitting gang bound", || {
        let pods = pods.clone();
        async move {
            for n in ["fits-0", "fits-1"] {
                pods.get(n).await.ok()?.spec?.node_name?;
            }
            Some(())
        }
    })
    .await;
    let scheduler = scheduler_name(TEST);
    let common = ["-n", NS, "--scheduler-name", scheduler.as_str()];

    // The tenant's gangs, as JSON: one placed whole on the member's node, one waiting with
    // the dispatcher's reason.
    let rows = wait_for(Duration::from_secs(60), "the waiting gang explained", || {
        let (env, dir, tenant) = (&env, dir.path(), &tenant);
        async move {
            let mut args = vec!["jobs", "-o", "json"];
            args.extend(common);
            let (code, out, err) = plugin(env, dir, tenant, &args).await;
            assert_eq!(code, 0, "jobs as the tenant: {err}");
            let rows = items(&out);
            let huge = rows.iter().find(|r| r["gang"].as_str().is_some_and(|g| g.ends_with("/huge")))?;
            huge["waiting"].as_str().filter(|w| !w.is_empty())?;
            Some(rows)
        }
    })
    .await;
    let fits = rows.iter().find(|r| r["gang"].as_str().is_some_and(|g| g.ends_with("/fits"))).unwrap();
    assert_eq!(fits["state"], "Placed", "{fits}");
    assert_eq!((fits["pods"].as_u64(), fits["placed"].as_u64()), (Some(2), Some(2)), "{fits}");
    assert_eq!(fits["nodes"], json!([NODE]), "{fits}");
    let huge = rows.iter().find(|r| r["gang"].as_str().is_some_and(|g| g.ends_with("/huge"))).unwrap();
    assert_eq!((huge["state"].as_str(), huge["placed"].as_u64()), (Some("Waiting"), Some(0)), "{huge}");

    // The same list as YAML: the documented fields, the same values.
    let mut args = vec!["jobs", "-o", "yaml"];
    args.extend(common);
    let (code, out, err) = plugin(&env, dir.path(), &tenant, &args).await;
    assert_eq!(code, 0, "{err}");
    let list: serde_json::Value = serde_saphyr::from_str(&out).unwrap_or_else(|e| panic!("not YAML ({e}): {out}"));
    assert_eq!((list["apiVersion"].as_str(), list["kind"].as_str()), (Some("tidepool.io/v1alpha1"), Some("JobList")));
    let row = list["items"].as_array().unwrap().iter().find(|r| r["gang"] == fits["gang"]).expect("fits in YAML");
    assert_eq!(
        (&row["state"], &row["placed"], &row["nodes"]),
        (&fits["state"], &fits["placed"], &fits["nodes"]),
        "{out}"
    );
    // A usage error exits 1 with kubectl's `error: ` prefix, as every other error does.
    let (code, _, err) = plugin(&env, dir.path(), &tenant, &["jobs", "-o", "xml"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("error: "), "{err}");

    // In text, and `why` for one pod of each.
    let mut args = vec!["jobs"];
    args.extend(common);
    let (code, out, _) = plugin(&env, dir.path(), &tenant, &args).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.contains("/fits") && l.contains("2/2") && l.contains(NODE)), "{out}");
    let (code, out, err) = plugin(&env, dir.path(), &tenant, &["why", "fits-0", "-n", NS]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("placed on {NODE}")), "{out}");
    let (code, out, _) = plugin(&env, dir.path(), &tenant, &["why", "huge-0", "-n", NS, "-o", "json"]).await;
    assert_eq!(code, 0);
    let why = &items(&out)[0];
    assert!(why["summary"].as_str().unwrap().starts_with("waiting: "), "{why}");

    // The tenant is refused what its RBAC does not allow, as kubectl reports it.
    for args in [vec!["members"], vec!["jobs", "-A"]] {
        let (code, out, err) = plugin(&env, dir.path(), &tenant, &args).await;
        assert_eq!(code, 1, "{args:?} as the tenant: {out}{err}");
        assert!(err.starts_with("error: ") && err.contains("forbidden"), "{err}");
    }
    let (code, _, err) = plugin(&env, dir.path(), &tenant, &["why", "no-such-pod", "-n", NS]).await;
    assert_eq!(code, 1);
    assert!(err.contains("not found"), "{err}");

    // The admin sees the member's pool with its capacity and what the gang uses of it.
    let row = wait_for(Duration::from_secs(30), "the member's pool using the gang's 2 GPUs", || {
        let (env, dir, admin) = (&env, dir.path(), &admin);
        async move {
            let (code, out, err) = plugin(env, dir, admin, &["members", "-o", "json"]).await;
            assert_eq!(code, 0, "{err}");
            let row = items(&out).into_iter().find(|r| r["member"] == "plugin-member-b")?;
            (row["used"]["nvidia.com/gpu"] == "2").then_some(row)
        }
    })
    .await;
    assert_eq!((row["state"].as_str(), row["virtualNode"].as_str()), (Some("Ready"), Some(NODE)), "{row}");
    assert!(row["capacity"]["nvidia.com/gpu"].as_str().is_some(), "{row}");
    let (code, out, _) = plugin(&env, dir.path(), &admin, &["members"]).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.starts_with("plugin-member-b") && l.contains("Ready")), "{out}");
    // `--context`: with another cluster (member-b, which has no MemberClusters) as the
    // kubeconfig's current context, the named context is the one read.
    let two = two_contexts(&env, dir.path());
    let (code, _, err) = plugin(&env, dir.path(), &two, &["members"]).await;
    assert_eq!(code, 1, "the current context (member-b) has no MemberClusters: {err}");
    let (code, out, err) = plugin(&env, dir.path(), &two, &["members", "--context", "training"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l.starts_with("plugin-member-b") && l.contains("Ready")), "{out}");

    // `tidepool status` (operations.md) with the bridge's own config: the member Ready with
    // its pool, the fitting gang placed on its node, the other waiting with its reason.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_tidepool"))
        .arg("status")
        .arg("--config")
        .arg(tidepool.config_path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{out}{}", String::from_utf8_lossy(&status.stderr));
    let section = |name: &str| -> Vec<String> {
        out.split("\n\n").find(|s| s.starts_with(name)).unwrap_or_default().lines().skip(1).map(str::to_owned).collect()
    };
    let members = section("MEMBERS");
    assert!(members.iter().any(|l| l.trim() == "plugin-member-b  Ready"), "{out}");
    assert!(members.iter().any(|l| l.contains(NODE) && l.contains("gpu [")), "{out}");
    let placed = section("GANGS PLACED");
    assert!(placed.iter().any(|l| l.contains("/fits") && l.contains(&format!("2 pods on {NODE}"))), "{out}");
    let waiting = section("GANGS WAITING");
    assert!(
        waiting.iter().any(|l| l.contains("/huge") && l.contains("2 pods") && !l.contains("not yet considered")),
        "{out}"
    );

    // The placed gang's copies hold member-b's GPUs: gone before the next test needs them.
    drain_pods(&training, NS).await;
}
