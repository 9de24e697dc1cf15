//! What benchmark programs do to the local clusters the same way: kwok nodes with room for
//! the runs, an API server's request counters, and the clusters' processes.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::harness::{Env, wait_for};
use crate::stats::env_usize;

/// Every process tests/controlplane/cluster.sh started (its state directory's `pids` file),
/// as (name, pid), in the file's order.
#[allow(dead_code)] // not every benchmark times the clusters' processes
pub fn cluster_processes(env: &Env) -> Vec<(String, u32)> {
    let pids = std::fs::read_to_string(format!("{}/pids", env.var("CP_STATE_DIR"))).unwrap();
    pids.lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(name, pid)| Some((name.to_owned(), pid.trim().parse().ok()?)))
        .collect()
}

/// An apiserver's request counters by (verb, resource[/subresource]), read from its
/// `/metrics` with kubectl.
pub fn request_counts(env: &Env, cluster: &str) -> BTreeMap<(String, String), f64> {
    let out = std::process::Command::new(format!("{}/kubectl", env.var("CP_BIN")))
        .arg("--kubeconfig")
        .arg(env.kubeconfig_path(cluster))
        .args(["get", "--raw", "/metrics"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut counts = BTreeMap::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("apiserver_request_total{")) {
        let Some((labels, value)) = line.rsplit_once("} ") else { continue };
        let label = |k: &str| {
            labels.split("\",").find_map(|kv| kv.strip_prefix(&format!("{k}=\""))).map(|v| v.trim_end_matches('"'))
        };
        let (Some(verb), Some(resource)) = (label("verb"), label("resource")) else { continue };
        if resource.is_empty() {
            continue;
        }
        let resource = match label("subresource") {
            Some(sub) if !sub.is_empty() => format!("{resource}/{sub}"),
            _ => resource.to_string(),
        };
        *counts.entry((verb.to_string(), resource)).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    counts
}

/// Adds kwok nodes with room for 1,000 tiny pods each, so the bursts and the memory run fit.
pub async fn add_bench_nodes(member: &Client, count: usize) -> Vec<String> {
    let api = Api::<Node>::all(member.clone());
    let names: Vec<String> = (0..count).map(|i| format!("bench-node-{i}")).collect();
    for name in &names {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "tidepool.io/test-pool": "bench"}},
            "spec": {"providerID": format!("kwok://{name}")},
            "status": {"capacity": {"cpu": "1000", "memory": "4000Gi", "pods": "1000"},
                       "allocatable": {"cpu": "1000", "memory": "4000Gi", "pods": "1000"}}
        }))
        .unwrap();
        match api.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("cannot create node {name}: {e}"),
        }
    }
    wait_for(Duration::from_secs(120), "bench nodes Ready and untainted", || {
        let (api, names) = (api.clone(), names.clone());
        async move {
            for name in &names {
                let n = api.get(name).await.ok()?;
                let ready =
                    n.status.as_ref()?.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
                let tainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| !t.is_empty());
                if !ready || tainted {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    names
}

pub async fn remove_bench_nodes(member: &Client, names: &[String]) {
    let api = Api::<Node>::all(member.clone());
    for name in names {
        let _ = api.delete(name, &DeleteParams::default()).await;
    }
}

/// Sets MemberCluster `name`'s rate limit for tidepool (`spec.rateLimits`, default 50 calls/s of
/// which creates get at most 4/5) to `BENCH_MEMBER_QPS` [200] calls/s, burst twice that (0 keeps
/// the default), and says so. A policy, not the bridge: the benchmarks set it above what the
/// local member takes.
pub async fn set_member_qps(training: &Client, name: &str) {
    let qps = env_usize("BENCH_MEMBER_QPS", 200);
    if qps > 0 {
        let limits = json!({"spec": {"rateLimits": {"qps": qps, "burst": 2 * qps}}});
        Api::<tidepool_api::MemberCluster>::all(training.clone())
            .patch(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(limits))
            .await
            .unwrap();
    }
    let limit = if qps > 0 { format!("{qps} calls/s, burst {}", 2 * qps) } else { "the default".to_owned() };
    println!("{name}: member rate limit for tidepool {limit}");
}
