//! Recovery: tidepool SIGKILLed in the middle of a burst of pods never makes two offload pods
//! for one origin, makes exactly one for each after its restart, and a restart over a
//! consistent state writes nothing for the pods.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use kube::runtime::watcher;
use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "restart";
const NS: &str = "e2e-restart";
const MEMBER: &str = "e2e-restart-a";
const NODE: &str = "tidepool-e2e-restart-a";
const PODS: usize = 40;
/// The pause between the burst's chunks of 8 pods: the burst lasts over a second, and the
/// SIGKILL, sent when the first copy shows in a watch, lands well inside it.
const BURST_PACE: Duration = Duration::from_millis(250);

/// Offload pods per origin UID in the member's offload namespace, of this run's pods (named
/// `burst-<run>-…`; copies an earlier run left may still be there): the pods carrying
/// tidepool's origin label, whatever else of the training pod travels.
async fn offload_copies(member: &Api<Pod>, run: &str) -> kube::Result<BTreeMap<String, usize>> {
    let mut per_origin = BTreeMap::new();
    let prefix = format!("burst-{run}-");
    let listed = member.list(&ListParams::default().labels(keys::LABEL_ORIGIN_UID)).await?.items;
    for p in listed.iter().filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix))) {
        if let Some(uid) = p.metadata.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_UID)) {
            *per_origin.entry(uid.clone()).or_insert(0) += 1;
        }
    }
    Ok(per_origin)
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

    let run = run_id();
    // A watch of the member: never two offload pods for one origin, at any moment. A watch
    // sees every pod that ever existed, however briefly (a poll could miss one that lived
    // between two LISTs), and a watch error fails the test instead of being skipped.
    let offload = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
    // How many offload pods of this run the watch has seen so far.
    let (seen_tx, mut seen_rx) = tokio::sync::watch::channel(0usize);
    // The most offload pods one origin had at once, so far.
    let (worst_tx, worst_rx) = tokio::sync::watch::channel(0usize);
    let prefix = format!("burst-{run}-");
    let watch = tokio::spawn({
        let offload = offload.clone();
        async move {
            // Pod name → origin UID, of the pods that exist now.
            let mut live: BTreeMap<String, String> = BTreeMap::new();
            let mut listing: Option<BTreeMap<String, String>> = None;
            let (mut worst, mut events) = (0usize, 0usize);
            let mut ready = Some(ready_tx);
            let stream = watcher(offload, watcher::Config::default().labels(keys::LABEL_ORIGIN_UID));
            futures::pin_mut!(stream);
            loop {
                let event = tokio::select! {
                    _ = &mut stop_rx => return (worst, events),
                    event = stream.next() => event,
                };
                let event = match event {
                    Some(Ok(event)) => event,
                    Some(Err(e)) => panic!("watch of the member's offload pods failed: {e}"),
                    None => panic!("watch of the member's offload pods ended"),
                };
                // This run's pods only: copies an earlier run left may still be there.
                let origin = |p: &Pod| -> Option<(String, String)> {
                    let uid = p.metadata.labels.as_ref()?.get(keys::LABEL_ORIGIN_UID)?.clone();
                    Some((p.metadata.name.clone().filter(|n| n.starts_with(&prefix))?, uid))
                };
                match event {
                    watcher::Event::Init => listing = Some(BTreeMap::new()),
                    watcher::Event::InitApply(p) => {
                        if let (Some(l), Some((name, uid))) = (listing.as_mut(), origin(&p)) {
                            l.insert(name, uid);
                        }
                    }
                    watcher::Event::InitDone => {
                        live = listing.take().unwrap_or_default();
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(());
                        }
                    }
                    watcher::Event::Apply(p) => {
                        if let Some((name, uid)) = origin(&p) {
                            events += 1;
                            seen_tx.send_modify(|n| *n += 1);
                            live.insert(name, uid);
                        }
                    }
                    watcher::Event::Delete(p) => {
                        if let Some((name, _)) = origin(&p) {
                            events += 1;
                            live.remove(&name);
                        }
                    }
                }
                let mut per_origin: BTreeMap<&str, usize> = BTreeMap::new();
                for uid in live.values() {
                    *per_origin.entry(uid.as_str()).or_insert(0) += 1;
                }
                worst = worst.max(per_origin.into_values().max().unwrap_or(0));
                worst_tx.send_replace(worst);
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(30), ready_rx).await.unwrap().unwrap();

    // A first pod, before the burst, so that the member's offload namespace and its access are
    // set up: otherwise the burst's pods queue behind that setup and their copies all appear in
    // one instant, before the SIGKILL can land between them (seen in CI: 40 of 40 at the kill).
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let warm = format!("warm-{run}");
    pods.create(&PostParams::default(), &small_bound_pod(&warm, NODE, "warm")).await.unwrap();
    wait_for(Duration::from_secs(60), "the first pod's offload copy", || {
        let (offload, warm) = (offload.clone(), warm.clone());
        async move {
            let listed = offload.list(&ListParams::default().labels(keys::LABEL_ORIGIN_UID)).await.ok()?;
            listed.items.iter().any(|p| p.metadata.name.as_deref() == Some(warm.as_str())).then_some(())
        }
    })
    .await;

    // The burst, paced in chunks, with a SIGKILL once some (not all) offload pods exist: a copy
    // cannot precede its pod, so the pods of the later chunks have none yet at the kill.
    let creating = tokio::spawn({
        let pods = pods.clone();
        let run = run.clone();
        async move {
            for chunk in (0..PODS).collect::<Vec<_>>().chunks(8) {
                let created =
                    chunk.iter().map(|i| {
                        let pods = pods.clone();
                        let name = format!("burst-{run}-{i}");
                        async move {
                            pods.create(&PostParams::default(), &small_bound_pod(&name, NODE, "burst")).await.unwrap()
                        }
                    });
                futures::future::join_all(created).await;
                tokio::time::sleep(BURST_PACE).await;
            }
        }
    });
    // Killed the moment the watch sees the first offload pod: a poll would come too late
    // (tidepool copies a chunk of 8 in well under the pace).
    tokio::time::timeout(Duration::from_secs(60), seen_rx.wait_for(|n| *n >= 1))
        .await
        .expect("no offload pod within 60 s")
        .unwrap();
    first.kill();
    creating.await.unwrap();
    // The kill landed in the middle of the burst: some offload pods made, not all.
    let copies_at_kill = offload_copies(&offload, &run).await.unwrap().len();
    assert!((1..PODS).contains(&copies_at_kill), "SIGKILL with {copies_at_kill} of {PODS} offload pods made");

    // 2. After the restart: exactly one offload pod per origin, every training pod Running.
    let second = Tidepool::start(&env, TEST, NS);
    wait_for(Duration::from_secs(120), "one offload pod per origin and every pod Running", || {
        let (offload, pods, run) = (offload.clone(), pods.clone(), run.clone());
        let worst = *worst_rx.borrow();
        async move {
            // A duplicate fails the test at once, not only after convergence (or its timeout).
            assert!(worst <= 1, "{worst} offload pods existed at once for one origin");
            let copies = offload_copies(&offload, &run).await.ok()?;
            let listed = pods.list(&ListParams::default().labels("app=burst")).await.ok()?;
            let running =
                listed.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
            (copies.len() == PODS && copies.values().all(|n| *n == 1) && running.count() == PODS).then_some(())
        }
    })
    .await;
    let _ = stop_tx.send(());
    let (worst, events) = watch.await.unwrap();
    // The watch saw the burst (at least one event per offload pod), and never two at once.
    assert!(events >= PODS, "the watch saw only {events} events for {PODS} offload pods");
    assert_eq!(worst, 1, "two offload pods existed at once for one origin");
    eprintln!("SIGKILL with {copies_at_kill} of {PODS} offload pods created; all {PODS} converged after restart");
    drop(second);

    // 3. A restart over this consistent state: the new process lists and watches, looks at
    //    every pod, and writes no pod anywhere. The evidence is the API servers': the training
    //    pods' resourceVersions (any write of a pod or its status changes it) and member-a's
    //    audit log of tidepool's writes. Tidepool's own counters only say when it has looked
    //    at every pod.
    let resource_versions = || {
        let pods = pods.clone();
        async move {
            let listed = pods.list(&ListParams::default()).await.unwrap().items;
            listed.into_iter().map(|p| (p.metadata.name.unwrap_or_default(), p.metadata.resource_version)).collect()
        }
    };
    let before: BTreeMap<String, Option<String>> = resource_versions().await;
    let since = jiff::Timestamp::now();
    let third = Tidepool::start(&env, TEST, NS);
    wait_for(Duration::from_secs(60), "restarted tidepool synced every pod", || {
        let text = third.scrape();
        async move {
            let ready = metric_value(&text, "tidepool_member_ready", &format!("member=\"{MEMBER}\"")) == Some(1.0);
            let synced = metric_value(&text, "tidepool_sync_duration_seconds_count", "controller=\"pod\"")?;
            let queued = metric_value(&text, "tidepool_queue_depth", "queue=\"pod_triggers\"").unwrap_or(0.0);
            (ready && synced >= PODS as f64 && queued == 0.0).then_some(())
        }
    })
    .await;
    // A write the last sync sent is in the audit log within a moment of its answer.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after: BTreeMap<String, Option<String>> = resource_versions().await;
    let changed: Vec<&String> = before.keys().filter(|name| before.get(*name) != after.get(*name)).collect();
    assert!(changed.is_empty(), "a restart over a consistent state wrote training pods {changed:?}");
    let member_ns = offload_ns(NS);
    let written: Vec<String> = audited_writes(&env, "member-a", since)
        .into_iter()
        .filter(|w| w.namespace == member_ns && w.resource == "pods")
        .map(|w| w.what())
        .collect();
    assert!(written.is_empty(), "a restart over a consistent state wrote member pods: {written:?}");
    drain_pods(&training, NS).await;
    drop(third);
}
