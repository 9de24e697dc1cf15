//! Recovery: tidepool SIGKILLed in the middle of a burst of pods never makes two offload pods
//! for one origin, makes exactly one for each after its restart, and a restart over a
//! consistent state writes nothing for the pods.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use tidepool_config::keys;

use crate::harness::*;

const TEST: &str = "restart";
const NS: &str = "e2e-restart";
const MEMBER: &str = "e2e-restart-a";
const NODE: &str = "tidepool-e2e-restart-a";
const PODS: usize = 40;

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "burst"}},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]
        }
    }))
    .unwrap()
}

/// Offload pods per origin UID in the member's offload namespace.
async fn offload_copies(member: &Api<Pod>) -> BTreeMap<String, usize> {
    let mut per_origin = BTreeMap::new();
    let Ok(list) = member.list(&ListParams::default().labels("app=burst")).await else { return per_origin };
    for p in list.items {
        if let Some(uid) = p.metadata.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_UID)) {
            *per_origin.entry(uid.clone()).or_insert(0) += 1;
        }
    }
    per_origin
}

#[tokio::test]
async fn a_sigkill_during_a_burst_never_duplicates_and_a_restart_over_a_consistent_state_writes_nothing() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let mut first = Tidepool::start(&env, TEST, NS);
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten() }
    })
    .await;

    // A watcher of the member: never two offload pods for one origin, at any moment.
    let offload = Api::<Pod>::namespaced(member.clone(), &format!("tp-{NS}"));
    let worst = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (offload, worst, stop) = (offload.clone(), worst.clone(), stop.clone());
        async move {
            // Bounded: at most 10 minutes of 50 ms polls.
            for _ in 0..12_000 {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let most = offload_copies(&offload).await.into_values().max().unwrap_or(0);
                worst.fetch_max(most, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });

    // The burst, with a SIGKILL once some (not all) offload pods exist.
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let run = run_id();
    let creating = tokio::spawn({
        let pods = pods.clone();
        let run = run.clone();
        async move {
            for chunk in (0..PODS).collect::<Vec<_>>().chunks(8) {
                let created = chunk.iter().map(|i| {
                    let pods = pods.clone();
                    let name = format!("burst-{run}-{i}");
                    async move { pods.create(&PostParams::default(), &pod(&name)).await.unwrap() }
                });
                futures::future::join_all(created).await;
            }
        }
    });
    wait_for(Duration::from_secs(60), "first offload pods in the member", || {
        let offload = offload.clone();
        async move { (offload_copies(&offload).await.len() >= 5).then_some(()) }
    })
    .await;
    first.kill();
    creating.await.unwrap();
    let copies_at_kill = offload_copies(&offload).await.len();

    // 2. After the restart: exactly one offload pod per origin, every training pod Running.
    let second = Tidepool::start(&env, TEST, NS);
    wait_for(Duration::from_secs(120), "one offload pod per origin and every pod Running", || {
        let (offload, pods) = (offload.clone(), pods.clone());
        async move {
            let copies = offload_copies(&offload).await;
            let listed = pods.list(&ListParams::default().labels("app=burst")).await.ok()?;
            let running =
                listed.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
            (copies.len() == PODS && copies.values().all(|n| *n == 1) && running.count() == PODS).then_some(())
        }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    assert_eq!(worst.load(Ordering::SeqCst), 1, "two offload pods existed at once for one origin");
    eprintln!("SIGKILL with {copies_at_kill} of {PODS} offload pods created; all {PODS} converged after restart");
    drop(second);

    // 3. A restart over this consistent state: the new process lists and watches, and writes
    //    no pod anywhere (its own counters, after it has had time to sync everything).
    let third = Tidepool::start(&env, TEST, NS);
    wait_for(Duration::from_secs(60), "restarted tidepool synced", || {
        let text = third.scrape();
        async move {
            let ready = metric_value(&text, "tidepool_member_ready", &format!("member=\"{MEMBER}\"")) == Some(1.0);
            let watching =
                metric_sum(&text, "tidepool_api_requests_total", &["verb=\"watch\"", "resource=\"pods\""]) > 0.0;
            (ready && watching).then_some(())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let text = third.scrape();
    for verb in ["create", "update", "patch", "delete"] {
        for resource in ["pods", "pods/status"] {
            let writes = metric_sum(
                &text,
                "tidepool_api_requests_total",
                &[&format!("verb=\"{verb}\""), &format!("resource=\"{resource}\"")],
            );
            assert_eq!(writes, 0.0, "a restart over a consistent state sent {verb} {resource}:\n{text}");
        }
    }
    drain_pods(&training, NS).await;
    drop(third);
}
