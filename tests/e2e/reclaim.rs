//! Reclaim end to end: an online HPA in a member grows, and tidepool hands the capacity back
//! by band — low first, a whole gang for a medium pod, high last — each victim warned with a
//! checkpoint notice first; the online pods then run.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "reclaim";
const NS: &str = "e2e-reclaim";
const ONLINE_NS: &str = "online";

fn pod(name: &str, gpus: u32, meta: serde_json::Value, priority_class: Option<&str>) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]
        }
    }))
    .unwrap();
    let extra: kube::api::ObjectMeta = serde_json::from_value(meta).unwrap();
    p.metadata.annotations = extra.annotations;
    p.metadata.labels = extra.labels;
    p.spec.as_mut().unwrap().priority_class_name = priority_class.map(str::to_owned);
    p
}

async fn phase(pods: &Api<Pod>, name: &str) -> Option<(String, Option<String>, Option<String>)> {
    let s = pods.get(name).await.ok()?.status?;
    Some((s.phase?, s.reason, s.message))
}

/// Waits until `name` failed with reason Reclaimed; returns its message.
async fn wait_reclaimed(pods: &Api<Pod>, name: &str, timeout: Duration) -> String {
    wait_for(timeout, &format!("{name} reclaimed"), || async move {
        let (phase, reason, message) = phase(pods, name).await?;
        (phase == "Failed" && reason.as_deref() == Some(keys::REASON_RECLAIMED)).then(|| message.unwrap_or_default())
    })
    .await
}

/// Whether tidepool sent `name` its reclaim notice: the `ReclaimRequested` condition, which
/// only tidepool writes (a deadline annotation alone may be the tenant's).
async fn noticed(pods: &Api<Pod>, name: &str) -> Option<bool> {
    let conditions = pods.get(name).await.ok()?.status?.conditions.unwrap_or_default();
    Some(conditions.iter().any(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED && c.status == "True"))
}

async fn assert_running(pods: &Api<Pod>, names: &[&String]) {
    for n in names {
        let (phase, _, _) = phase(pods, n).await.unwrap();
        assert_eq!(phase, "Running", "{n} should still run");
        assert_eq!(noticed(pods, n).await, Some(false), "{n} was noticed");
    }
}

async fn set_hpa_max(member: &Client, max: i32) {
    let hpa = Api::<HorizontalPodAutoscaler>::namespaced(member.clone(), ONLINE_NS);
    hpa.patch("online", &PatchParams::default(), &Patch::Merge(json!({"spec": {"maxReplicas": max}}))).await.unwrap();
}

#[tokio::test]
async fn online_growth_reclaims_low_then_whole_gangs_then_high_with_notice_first() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;

    // The online side of member-b (4 nodes × 4 GPUs): a Deployment of 2-GPU replicas with an
    // HPA. Created first, so its headroom is known before any training pod lands.
    ensure_namespace(&member, ONLINE_NS).await;
    let deployments = Api::<Deployment>::namespaced(member.clone(), ONLINE_NS);
    let _ = deployments.delete("online", &DeleteParams::default()).await;
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(member.clone(), ONLINE_NS);
    let _ = hpas.delete("online", &DeleteParams::default()).await;
    let online_pods = Api::<Pod>::namespaced(member.clone(), ONLINE_NS);
    wait_for(Duration::from_secs(60), "old online pods gone", || {
        let p = online_pods.clone();
        async move { p.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "online"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "online"}},
                 "template": {"metadata": {"labels": {"app": "online"}},
                              "spec": {"containers": [{"name": "web", "image": "example.invalid/web:1",
                                        "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}
    }))
    .unwrap();
    deployments.create(&PostParams::default(), &deployment).await.unwrap();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": "online"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "online"},
                 "minReplicas": 1, "maxReplicas": 1,
                 "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}
    }))
    .unwrap();
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    // The member's HPA controller reports the current replicas (the headroom is counted from it).
    wait_for(Duration::from_secs(40), "HPA status with current replicas", || {
        let hpas = hpas.clone();
        async move { (hpas.get("online").await.ok()?.status?.current_replicas? == 1).then_some(()) }
    })
    .await;

    // A high-priority class in training: pods in 2001–3000 are band high.
    ensure_priority_class(&training, "e2e-training-high", 2500).await;

    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-b", &kubeconfig).await;
    apply_member(&training, "reclaim-b", TEST, NS, "member-b").await;
    let settings = "deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 4, medium: 30, low: 3}";
    let _tp = Tidepool::start_with(&env, TEST, NS, settings);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let id = run_id();

    // 1. A high pod (4 GPUs, a whole node), then an elastic job: 2 core + 2 elastic × 2 GPUs.
    let high = format!("ps-{id}");
    pods.create(&PostParams::default(), &pod(&high, 4, json!({}), Some("e2e-training-high"))).await.unwrap();
    wait_for(Duration::from_secs(60), "high pod Running", || {
        let (pods, high) = (pods.clone(), high.clone());
        async move { (phase(&pods, &high).await?.0 == "Running").then_some(()) }
    })
    .await;
    // The job is a sig-scheduling PodGroup gang, so its checkpoint can be acked once, on
    // the PodGroup, for every pod (step 3).
    crate::dispatcher::install_pod_group_crd(&training, "scheduling.x-k8s.io", "v1alpha1").await;
    let group = format!("job-{id}");
    crate::dispatcher::create_pod_group(&training, NS, "scheduling.x-k8s.io", "v1alpha1", &group, 2).await;
    let job: Vec<String> = (0..4).map(|i| format!("job-{id}-{i}")).collect();
    for n in &job {
        let meta = json!({"labels": {keys::LABEL_POD_GROUP: group}});
        pods.create(&PostParams::default(), &pod(n, 2, meta, None)).await.unwrap();
    }
    wait_for(Duration::from_secs(60), "job Running", || {
        let (pods, job) = (pods.clone(), job.clone());
        async move {
            for n in &job {
                if phase(&pods, n).await?.0 != "Running" {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    let mut by_band: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in job.iter().chain([&high]) {
        by_band.entry(pods.get(n).await.unwrap().labels()[keys::LABEL_BAND].clone()).or_default().push(n.clone());
    }
    assert_eq!(by_band["high"], std::slice::from_ref(&high));
    assert_eq!(by_band["medium"].len(), 2);
    assert_eq!(by_band["low"].len(), 2);
    let (low, medium) = (by_band["low"].clone(), by_band["medium"].clone());
    // A tenant writes a deadline on one of its low pods, as if it were already giving its
    // GPUs back: no notice from tidepool, so it stays a candidate like any other low pod.
    let forged = json!({"metadata": {"annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2099-01-01T00:00:00Z"}}});
    pods.patch(&low[0], &PatchParams::default(), &Patch::Merge(forged)).await.unwrap();

    // 2. The HPA may grow by two replicas: 16 − 2 online − 4 headroom = 10 lendable, 12 used:
    //    2 GPUs of deficit → exactly one low pod is noticed and, without an ack, removed at its
    //    deadline.
    set_hpa_max(&member, 3).await;
    let victim = wait_for(Duration::from_secs(30), "one low pod noticed", || {
        let (pods, low) = (pods.clone(), low.clone());
        async move {
            for n in &low {
                if noticed(&pods, n).await? {
                    return Some(n.clone());
                }
            }
            None
        }
    })
    .await;
    // The notice is on the offload copy too, where /etc/tidepool/annotations shows it.
    let offload = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let copy = wait_for(Duration::from_secs(10), "notice on the offload pod", || {
        let (offload, victim) = (offload.clone(), victim.clone());
        async move {
            offload.get(&victim).await.ok().filter(|p| p.annotations().contains_key(keys::ANNOTATION_RECLAIM_DEADLINE))
        }
    })
    .await;
    let spec = copy.spec.unwrap();
    let mount =
        spec.containers[0].volume_mounts.as_ref().unwrap().iter().find(|m| m.mount_path == "/etc/tidepool").cloned();
    assert!(mount.is_some(), "annotations are not mounted at /etc/tidepool");
    let condition = pods.get(&victim).await.unwrap().status.unwrap().conditions.unwrap();
    assert!(condition.iter().any(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED && c.status == "True"));
    let msg = wait_reclaimed(&pods, &victim, Duration::from_secs(30)).await;
    assert!(msg.contains("not acknowledged"), "{msg}");
    wait_for(Duration::from_secs(30), "victim's offload pod deleted", || {
        let (offload, victim) = (offload.clone(), victim.clone());
        async move { offload.get_opt(&victim).await.ok()?.is_none().then_some(()) }
    })
    .await;
    let other_low: Vec<&String> = low.iter().filter(|n| **n != victim).collect();
    assert_running(&pods, &other_low.iter().copied().chain(medium.iter()).chain([&high]).collect::<Vec<_>>()).await;

    // 3. Deeper: 4 more GPUs. The last low pod goes first, then a medium pod — and with it
    //    the whole gang core. The job acks its checkpoint once, on its PodGroup, and its
    //    pods are removed at once.
    set_hpa_max(&member, 5).await;
    for m in &medium {
        wait_for(Duration::from_secs(30), &format!("{m} noticed"), || {
            let (pods, m) = (pods.clone(), m.clone());
            async move {
                pods.get(&m).await.ok()?.annotations().contains_key(keys::ANNOTATION_RECLAIM_DEADLINE).then_some(())
            }
        })
        .await;
    }
    // `kubectl tidepool reclaims` (operations.md) lists both under notice, in band medium,
    // on member-b's virtual node, not acknowledged yet, their deadline ahead.
    let plugin_dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tidepool"), plugin_dir.path().join("kubectl-tidepool")).unwrap();
    let args = ["reclaims", "-n", NS, "-o", "json"];
    let (code, out, err) =
        crate::plugin::plugin(&env, plugin_dir.path(), &env.kubeconfig_path("training"), &args).await;
    assert_eq!(code, 0, "kubectl tidepool reclaims: {err}");
    let rows = crate::plugin::items(&out);
    for m in &medium {
        let row = rows.iter().find(|r| r["pod"] == m.as_str()).unwrap_or_else(|| panic!("{m} not listed: {out}"));
        assert_eq!((row["namespace"].as_str(), row["band"].as_str()), (Some(NS), Some("medium")), "{row}");
        assert_eq!(
            (row["node"].as_str(), row["acknowledged"].as_bool()),
            (Some("tidepool-reclaim-b"), Some(false)),
            "{row}"
        );
        assert!(row["secondsLeft"].as_i64().is_some_and(|s| s > 0), "{row}");
    }
    assert!(rows.iter().all(|r| r["pod"] != high.as_str()), "the high pod is under no notice: {out}");
    let gvk = kube::api::GroupVersionKind::gvk("scheduling.x-k8s.io", "v1alpha1", "PodGroup");
    let pod_groups = Api::<kube::api::DynamicObject>::namespaced_with(
        training.clone(),
        NS,
        &kube::api::ApiResource::from_gvk_with_plural(&gvk, "podgroups"),
    );
    let ack = json!({"metadata": {"annotations": {keys::ANNOTATION_CHECKPOINT_DONE: "true"}}});
    pod_groups.patch(&group, &PatchParams::default(), &Patch::Merge(ack)).await.unwrap();
    for m in &medium {
        // Medium grace is 30 s: reclaimed well before means the ack did it.
        let msg = wait_reclaimed(&pods, m, Duration::from_secs(15)).await;
        assert!(msg.contains("checkpoint acknowledged on its PodGroup"), "{msg}");
    }
    wait_reclaimed(&pods, other_low[0], Duration::from_secs(30)).await;
    assert_running(&pods, &[&high]).await;

    // 4. The HPA may now take every GPU: the high pod goes last.
    set_hpa_max(&member, 8).await;
    wait_reclaimed(&pods, &high, Duration::from_secs(30)).await;

    // 5. The online side scales out and runs on the freed GPUs.
    deployments
        .patch("online", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 8}})))
        .await
        .unwrap();
    wait_for(Duration::from_secs(60), "8 online replicas Running", || {
        let p = online_pods.clone();
        async move {
            let l = p.list(&ListParams::default().labels("app=online")).await.ok()?;
            (l.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).count()
                == 8)
                .then_some(())
        }
    })
    .await;

    deployments.delete("online", &DeleteParams::default()).await.unwrap();
    hpas.delete("online", &DeleteParams::default()).await.unwrap();
    let _ = pod_groups.delete(&group, &DeleteParams::default()).await;
    drain_pods(&training, NS).await;
    Api::<tidepool_api::MemberCluster>::all(training.clone())
        .delete("reclaim-b", &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_pending_higher_band_gang_preempts_lower_band_pods_through_the_notice() {
    let env = Env::load();
    let test = "preempt";
    let ns = "e2e-preempt";
    let training = env.client("training").await;
    prepare(&env, &training, test, ns).await;
    ensure_priority_class(&training, "e2e-training-high", 2500).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-b", &kubeconfig).await;
    apply_member(&training, "preempt-b", test, ns, "member-b").await;
    let _tp = Tidepool::start_with(&env, test, ns, "reclaimGraceSeconds: {high: 60, medium: 60, low: 60}");
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let scheduler = scheduler_name(test);
    let mk = |name: &str, gang: &str, min: &str, class: Option<&str>| {
        let mut p = pod(
            name,
            2,
            json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: min}}),
            class,
        );
        p.spec.as_mut().unwrap().scheduler_name = Some(scheduler.clone());
        p
    };
    // An elastic job fills member-b's 16 GPUs: 1 core pod (medium) + 7 elastic (low).
    let filler: Vec<String> = (0..8).map(|i| format!("fill-{id}-{i}")).collect();
    for n in &filler {
        pods.create(&PostParams::default(), &mk(n, &format!("fill-{id}"), "1", None)).await.unwrap();
    }
    wait_for(Duration::from_secs(90), "filler running", || {
        let (pods, filler) = (pods.clone(), filler.clone());
        async move {
            for n in &filler {
                if phase(&pods, n).await?.0 != "Running" {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    // member-a joins now (so the filler never went there), with 2 of its GPUs left over by its
    // own online pods: room for one pod of the high gang, not both. Pod by pod, one high pod
    // would go there; as a gang, it preempts on member-b.
    let online =
        crate::dispatcher::occupy(&env, "member-a", test, &[("member-a-gpu-0", 8), ("member-a-gpu-1", 6)]).await;
    let kubeconfig_a = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-a", &kubeconfig_a).await;
    apply_member(&training, "preempt-a", test, ns, "member-a").await;
    crate::dispatcher::wait_lends_at_least(&training, "tidepool-preempt-a", 2).await;
    // A high-band gang of 2 × 2 GPUs arrives: no room, so two low pods get a notice.
    let high: Vec<String> = (0..2).map(|i| format!("high-{id}-{i}")).collect();
    for n in &high {
        pods.create(&PostParams::default(), &mk(n, &format!("high-{id}"), "2", Some("e2e-training-high")))
            .await
            .unwrap();
    }
    // The two victims ack their checkpoints on the pods themselves; with a 60 s grace, only
    // the acks free the room in time.
    let noticed = wait_for(Duration::from_secs(30), "two filler pods noticed", || {
        let (pods, filler, high) = (pods.clone(), filler.clone(), high.clone());
        async move {
            for n in &high {
                let node = pods.get(n).await.ok()?.spec?.node_name;
                assert!(node.as_deref() != Some("tidepool-preempt-a"), "{n} of the high gang went to member-a alone");
            }
            let mut noticed = Vec::new();
            for n in &filler {
                if pods.get(n).await.ok()?.annotations().contains_key(keys::ANNOTATION_RECLAIM_DEADLINE) {
                    noticed.push(n.clone());
                }
            }
            (noticed.len() == 2).then_some(noticed)
        }
    })
    .await;
    for n in &noticed {
        let ack = json!({"metadata": {"annotations": {keys::ANNOTATION_CHECKPOINT_DONE: "true"}}});
        pods.patch(n, &PatchParams::default(), &Patch::Merge(ack)).await.unwrap();
    }
    let bound = wait_for(Duration::from_secs(40), "high gang bound after preemption", || {
        let (pods, high) = (pods.clone(), high.clone());
        async move {
            let mut nodes = Vec::new();
            for n in &high {
                nodes.push(pods.get(n).await.ok()?.spec?.node_name?);
            }
            Some(nodes)
        }
    })
    .await;
    assert!(bound.iter().all(|n| n == "tidepool-preempt-b"), "{bound:?}");
    let mut reclaimed = Vec::new();
    for n in &filler {
        let p = pods.get(n).await.unwrap();
        if p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(keys::REASON_RECLAIMED) {
            assert_eq!(p.labels()[keys::LABEL_BAND], "low", "{n}: only lower-band pods are taken");
            let msg = p.status.unwrap().message.unwrap();
            assert!(msg.contains("checkpoint acknowledged") && !msg.contains("not acknowledged"), "{msg}");
            reclaimed.push(n.clone());
        }
    }
    assert_eq!(reclaimed.len(), 2, "exactly the room the gang needs is taken: {reclaimed:?}");
    drain_pods(&training, ns).await;
    for member in ["preempt-a", "preempt-b"] {
        Api::<tidepool_api::MemberCluster>::all(training.clone())
            .delete(member, &DeleteParams::default())
            .await
            .unwrap();
    }
    online.release().await;
}
