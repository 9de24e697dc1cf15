//! `kubectl top` and the HPA on offloaded pods: the training cluster's metrics-server scrapes
//! tidepool's kubelet API (`/metrics/resource/<node>`, the path the virtual node's annotation
//! names), which reads the usage of the copies from the member's own metrics.k8s.io API
//! (metrics-server there scraping the member's real kubelet). All of it real: the
//! metrics-servers are the ones `tests/controlplane/cluster.sh` runs for each cluster, the
//! HPA controller the training cluster's kube-controller-manager.
//!
//! And a member without a metrics API (member-b's APIService removed for the test, put back
//! after): its virtual node still answers, with `scrape_error 1`, and says so once.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "metrics";
const NS: &str = "e2e-metrics";

/// The virtual node of member `member`'s pool `real`.
fn node_of(member: &str) -> String {
    format!("tidepool-{member}-real")
}

/// tidepool with its kubelet API, bridging `cluster`'s real node as pool `real` of `member`.
async fn start(cluster: &str, member: &str) -> (Env, Client, Tidepool) {
    let env = Env::load();
    assert_eq!(env.var("CP_REAL_NODES"), "1", "these tests need the real nodes (and metrics-servers) of cluster.sh");
    let training = env.client("training").await;
    // An earlier run's Deployment would bring its pods back as they are cleared.
    kubectl(&env, "training", &["delete", "deployment,hpa", "--all", "-n", NS, "--ignore-not-found"], None).await;
    prepare(&env, &training, TEST, NS).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
    put_kubeconfig_secret(&training, NS, cluster, &kubeconfig).await;
    apply_real_pool(&env, &training, member, cluster).await;
    // A virtual node an earlier run left keeps what that run wrote: this run registers its own.
    let nodes = Api::<Node>::all(training.clone());
    let node = node_of(member);
    if nodes.get_opt(&node).await.unwrap().is_some() {
        let _ = nodes.delete(&node, &DeleteParams::default()).await;
    }
    let tidepool = Tidepool::start_config(&env, TEST, NS, "", &kubelet_config(&env));
    wait_for(Duration::from_secs(90), "virtual node of the real pool Ready", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move {
            let node = nodes.get_opt(&node).await.ok().flatten()?;
            let ready = node.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(())
        }
    })
    .await;
    (env, training, tidepool)
}

async fn apply_real_pool(env: &Env, training: &Client, member: &str, cluster: &str) {
    let mut mc = member_cluster(member, TEST, NS, cluster);
    mc.spec.pools = vec![real_pool(env)];
    apply_member_cluster(training, &mc).await;
}

/// A pod template for the dispatcher to place on the real pool: a shell busy loop, 100m
/// requested and 300m its limit (so the HPA sees it far above a 50 % target, and the
/// machine keeps most of its two cores).
fn burner(env: &Env, app: &str) -> serde_json::Value {
    json!({
        "metadata": {"labels": {"app": app}},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "burn",
                "image": env.var("WORKLOAD_IMAGE"),
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "while :; do :; done"],
                "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}, "limits": {"cpu": "300m"}}
            }]
        }
    })
}

/// The `(CPU millicores, memory MiB)` `kubectl top pod` prints for `pod`, once it prints them.
async fn top_pod(env: &Env, pod: &str) -> (u64, u64) {
    wait_for(Duration::from_secs(150), &format!("kubectl top pod {pod} shows its usage"), || async move {
        let (code, out, _) = kubectl(env, "training", &["top", "pod", pod, "-n", NS, "--no-headers"], None).await;
        let fields: Vec<&str> = out.split_whitespace().collect();
        match (code, fields.as_slice()) {
            (0, [name, cpu, memory]) if *name == pod => {
                Some((cpu.strip_suffix('m')?.parse().ok()?, memory.strip_suffix("Mi")?.parse().ok()?))
            }
            _ => None,
        }
    })
    .await
}

#[tokio::test]
async fn kubectl_top_shows_an_offloaded_pod_and_an_hpa_scales_its_deployment() {
    let member = "e2e-metrics-a";
    let (env, training, tidepool) = start("member-a", member).await;
    let node = node_of(member);
    let annotation =
        Api::<Node>::all(training.clone()).get(&node).await.unwrap().metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotation.get(keys::ANNOTATION_RESOURCE_METRICS_PATH).map(String::as_str),
        Some(format!("/metrics/resource/{node}").as_str()),
        "metrics-server must be sent to this node's own path"
    );

    let app = format!("burn-{}", run_id());
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": app},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": app}}, "template": burner(&env, &app)}
    }))
    .unwrap();
    let deployments = Api::<Deployment>::namespaced(training.clone(), NS);
    deployments.create(&PostParams::default(), &deployment).await.unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let selector = ListParams::default().labels(&format!("app={app}"));
    let first = wait_for(Duration::from_secs(90), "the Deployment's pod running on the virtual node", || {
        let (pods, selector, node) = (pods.clone(), selector.clone(), node.clone());
        async move {
            let pod = pods.list(&selector).await.ok()?.items.into_iter().next()?;
            let on_node = pod.spec.as_ref()?.node_name.as_deref() == Some(node.as_str());
            let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
            (on_node && running).then(|| pod.metadata.name.clone()).flatten()
        }
    })
    .await;

    // The training cluster's `kubectl top` shows the copy's usage, as the member measured it.
    let (cpu, memory) = top_pod(&env, &first).await;
    assert!(cpu >= 20, "a busy loop shows CPU: {cpu}m\n{}", tidepool.log_tail());
    assert!(memory > 0 || cpu > 0, "usage shown");
    let copy = offload_ns(NS);
    let (code, member_top, _) =
        kubectl(&env, "member-a", &["top", "pod", &first, "-n", &copy, "--no-headers"], None).await;
    assert_eq!(code, 0, "the member's own metrics-server sees the copy: {member_top}");

    // The stats summary names the pod too, for a caller allowed nodes/stats (the API server's
    // kubelet client); metrics-server's identity has nodes/metrics only, and is refused it.
    // (Directly: the API server's node proxy refuses the loopback address of this setup.)
    let pki = env.var("CP_PKI");
    let cert = |name: &str| (format!("{pki}/{name}.crt"), format!("{pki}/{name}.key"));
    let path = format!("/stats/summary/{node}");
    let (status, body) = kubelet_call(&env, &cert("metrics-client"), "GET", &path);
    assert_eq!(status, 403, "{body}");
    assert_eq!(body.trim(), "Forbidden (user=system:metrics-server, verb=get, resource=nodes, subresource=stats)");
    let (status, summary) = kubelet_call(&env, &cert("apiserver-kubelet-client"), "GET", &path);
    assert_eq!(status, 200, "{summary}");
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["node"]["nodeName"], node.as_str());
    let pod = summary["pods"].as_array().unwrap().iter().find(|p| p["podRef"]["name"] == first.as_str());
    let pod = pod.unwrap_or_else(|| panic!("{first} not in the summary: {summary}"));
    assert!(pod["cpu"]["usageNanoCores"].as_u64().unwrap() > 0, "{pod}");
    assert!(pod["memory"]["workingSetBytes"].as_u64().unwrap() > 0, "{pod}");

    // An HPA on the Deployment scales it on that CPU: 1 → 2 replicas, both offloaded.
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": app},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": app},
            "minReplicas": 1, "maxReplicas": 2,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]
        }
    }))
    .unwrap();
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(training.clone(), NS);
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    wait_for(Duration::from_secs(150), "the HPA scaled the Deployment to 2 on CPU", || {
        let (hpas, app) = (hpas.clone(), app.clone());
        async move {
            let status = hpas.get(&app).await.ok()?.status?;
            let utilization =
                status.current_metrics?.into_iter().find_map(|m| m.resource?.current.average_utilization)?;
            (status.desired_replicas >= 2 && utilization > 50).then_some(())
        }
    })
    .await;
    wait_for(Duration::from_secs(90), "two pods of the Deployment on the virtual node", || {
        let (pods, selector, node) = (pods.clone(), selector.clone(), node.clone());
        async move {
            let list = pods.list(&selector).await.ok()?;
            let on_node = list
                .items
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node))
                .count();
            (on_node >= 2).then_some(())
        }
    })
    .await;

    hpas.delete(&app, &DeleteParams::default()).await.unwrap();
    deployments.delete(&app, &DeleteParams::default()).await.unwrap();
    drain_pods(&training, NS).await;
}

/// Takes member-b's APIService away for the test; put back when dropped (even on a panic).
struct MetricsApiRemoved {
    kubectl: String,
    kubeconfig: std::path::PathBuf,
    saved: String,
}

impl MetricsApiRemoved {
    async fn remove(env: &Env, cluster: &str) -> Self {
        let (code, saved, err) =
            kubectl(env, cluster, &["get", "apiservice", "v1beta1.metrics.k8s.io", "-o", "json"], None).await;
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = kubectl(env, cluster, &["delete", "apiservice", "v1beta1.metrics.k8s.io"], None).await;
        assert_eq!(code, 0, "{err}");
        let mut object: serde_json::Value = serde_json::from_str(&saved).unwrap();
        object["metadata"] = json!({"name": "v1beta1.metrics.k8s.io"});
        object.as_object_mut().unwrap().remove("status");
        MetricsApiRemoved {
            kubectl: env.var("KUBECTL").to_owned(),
            kubeconfig: env.kubeconfig_path(cluster),
            saved: object.to_string(),
        }
    }
}

impl Drop for MetricsApiRemoved {
    fn drop(&mut self) {
        use std::io::Write;
        let child = std::process::Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn();
        if let Ok(mut child) = child {
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(self.saved.as_bytes());
            }
            let _ = child.wait();
        }
    }
}

#[tokio::test]
async fn a_member_without_a_metrics_api_is_reported_once_and_its_node_still_answers() {
    let member = "e2e-metrics-b";
    let (env, training, tidepool) = start("member-b", member).await;
    let node = node_of(member);
    let _removed = MetricsApiRemoved::remove(&env, "member-b").await;

    let name = format!("burn-{}", run_id());
    let mut pod = burner(&env, &name);
    pod["metadata"]["name"] = json!(name);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let created = pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    let since = created.metadata.creation_timestamp.map(|t| t.0);
    wait_for(Duration::from_secs(90), "the pod running on the virtual node", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;

    // Every scrape is answered (200), the member's pods left out and the error flagged.
    let pki = env.var("CP_PKI");
    let scraper = (format!("{pki}/metrics-client.crt"), format!("{pki}/metrics-client.key"));
    let path = format!("/metrics/resource/{node}");
    for _ in 0..3 {
        let (status, text) = kubelet_call(&env, &scraper, "GET", &path);
        assert_eq!(status, 200, "a member without metrics is no error per scrape: {text}");
        assert_eq!(metric_value(&text, "scrape_error", ""), Some(1.0), "{text}");
        assert!(!text.contains(&name), "no usage can be known for {name}:\n{text}");
    }
    // Said once: one Warning Event on the node and one log line, however many scrapes.
    let events = Api::<Event>::namespaced(training.clone(), "default");
    let fields = ListParams::default().fields(&format!("involvedObject.name={node},reason=MetricsUnavailable"));
    // This run's (Events of an earlier run may still be there).
    let listed: Vec<Event> = events
        .list(&fields)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.event_time.as_ref().map(|t| t.0) >= since)
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let note = listed[0].message.clone().unwrap_or_default();
    assert!(note.contains("no metrics.k8s.io API"), "{note}");
    let said = tidepool.log().matches("no resource usage of this member's offloaded pods").count();
    assert_eq!(said, 1, "{}", tidepool.log_tail());

    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    drain_pods(&training, NS).await;
}
