//! Benchmark program (not a test): reclaim through tidepool against native preemption in the
//! member, in one run, on the local clusters. Prints tables; asserts nothing about speed.
//!
//! ```text
//! TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench reclaim
//! ```
//! 1. Trials (BENCH_TRIALS, default 7): 8 elastic offload pods of 2 GPUs fill member-b; each
//!    trial lets an online HPA grow by one 2-GPU replica and measures, from that change,
//!    the checkpoint notice on a training pod (detect→notice, an upper bound: it includes the
//!    member watch) and the offload pod's deletion (notice→gone, grace 0), both seen through
//!    watches (nothing polls the member while it is timed). With 7 samples the highest is
//!    reported as the max, not as a p99.
//! 2. Time until 4 online replicas run after the Deployment scales, the same 7 offline pods
//!    running (a) through tidepool and (b) directly in the member as low-priority pods that
//!    the member's scheduler preempts natively; a warm-up round (not counted), then
//!    `BENCH_ROUNDS` (default 11) rounds, which path goes first alternating, p50 compared.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::time::{Duration, Instant};

use harness::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::keys;

const TEST: &str = "bench-reclaim";
const NS: &str = "bench-reclaim";
/// The direct path\'s pods in the member: a namespace of the member\'s own, apart from the
/// one tidepool makes for NS (same-named, the default), which it would never share.
const DIRECT_NS: &str = "bench-reclaim-direct";
const ONLINE: &str = "bench-online";

fn offline_pod(name: &str, scheduler: Option<&str>, priority_class: Option<&str>, gang: Option<&str>) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}
    }))
    .unwrap();
    let spec = p.spec.as_mut().unwrap();
    spec.scheduler_name = scheduler.map(str::to_owned);
    spec.priority_class_name = priority_class.map(str::to_owned);
    if let Some(g) = gang {
        p.metadata.annotations = Some(
            [
                (keys::ANNOTATION_GANG.to_owned(), g.to_owned()),
                (keys::ANNOTATION_MIN_MEMBER.to_owned(), "1".to_owned()),
            ]
            .into(),
        );
    }
    p
}

async fn until<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// A watch of the pods selected by `labels` that tells when `n` of them run. A watch rather
/// than a poll loop: a LIST every few milliseconds loads the member's API server, the very
/// thing whose reaction is measured. Ready once the watch has listed.
async fn watch_running(
    api: &Api<Pod>,
    labels: &str,
    n: usize,
) -> impl std::future::Future<Output = Option<Instant>> + use<> {
    use futures::StreamExt;
    use kube::runtime::watcher;
    let mut events = Box::pin(watcher(api.clone(), watcher::Config::default().labels(labels)));
    let mut running = std::collections::BTreeSet::new();
    fn apply(p: &Pod, running: &mut std::collections::BTreeSet<String>) {
        if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && p.metadata.deletion_timestamp.is_none()
        {
            running.insert(p.name_any());
        } else {
            running.remove(&p.name_any());
        }
    }
    // Listed first: no change made after this returns is missed.
    while let Some(e) = events.next().await {
        match e {
            Ok(watcher::Event::InitApply(p)) => apply(&p, &mut running),
            Ok(watcher::Event::InitDone) => break,
            _ => {}
        }
    }
    async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while let Ok(Some(e)) = tokio::time::timeout_at(deadline, events.next()).await {
            match e {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => apply(&p, &mut running),
                Ok(watcher::Event::Delete(p)) => {
                    running.remove(&p.name_any());
                }
                _ => {}
            }
            if running.len() >= n {
                return Some(Instant::now());
            }
        }
        None
    }
}

/// When each pod of `api` was first seen with a reclaim deadline, and when it was deleted,
/// by name, from a watch started now (ready once it has listed).
type Times = std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Instant>>>;
async fn record(api: &Api<Pod>, noticed: bool) -> Times {
    use futures::StreamExt;
    use kube::runtime::watcher;
    let times: Times = Default::default();
    let mut events = Box::pin(watcher(api.clone(), watcher::Config::default()));
    // Listed first: nothing after this returns is missed.
    while let Some(e) = events.next().await {
        if let Ok(watcher::Event::InitDone) = e {
            break;
        }
    }
    let t = times.clone();
    tokio::spawn(async move {
        while let Some(e) = events.next().await {
            let hit = match e {
                Ok(watcher::Event::Apply(p))
                    if noticed && p.annotations().contains_key(keys::ANNOTATION_RECLAIM_DEADLINE) =>
                {
                    Some(p.name_any())
                }
                Ok(watcher::Event::Delete(p)) if !noticed => Some(p.name_any()),
                _ => None,
            };
            if let Some(name) = hit {
                t.lock().unwrap().entry(name).or_insert_with(Instant::now);
            }
        }
    });
    times
}

async fn running(api: &Api<Pod>, lp: &ListParams) -> usize {
    api.list(lp)
        .await
        .map(|l| {
            l.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).count()
        })
        .unwrap_or(0)
}

async fn reset(api: &Api<Pod>) {
    let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let _ = api.delete_collection(&dp, &ListParams::default()).await;
    until(Duration::from_secs(120), || async {
        api.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(())
    })
    .await;
}

async fn online_setup(member: &Client, replicas: i32, max: i32) -> (Api<Deployment>, Api<HorizontalPodAutoscaler>) {
    let deployments = Api::<Deployment>::namespaced(member.clone(), ONLINE);
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(member.clone(), ONLINE);
    let _ = deployments.delete("online", &DeleteParams::default()).await;
    let _ = hpas.delete("online", &DeleteParams::default()).await;
    reset(&Api::<Pod>::namespaced(member.clone(), ONLINE)).await;
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "online"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "online"}},
                 "template": {"metadata": {"labels": {"app": "online"}},
                              "spec": {"terminationGracePeriodSeconds": 0,
                                       "containers": [{"name": "web", "image": "example.invalid/web:1",
                                                       "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}
    }))
    .unwrap();
    until(Duration::from_secs(30), || async { deployments.create(&PostParams::default(), &d).await.ok() })
        .await
        .unwrap();
    let h: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": "online"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "online"},
                 "minReplicas": 1, "maxReplicas": max,
                 "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}
    }))
    .unwrap();
    hpas.create(&PostParams::default(), &h).await.unwrap();
    // The headroom counts from the HPA's reported replicas: wait for its controller.
    until(Duration::from_secs(60), || async {
        (hpas.get("online").await.ok()?.status?.current_replicas? == replicas).then_some(())
    })
    .await
    .expect("HPA controller reports current replicas");
    (deployments, hpas)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[((v.len() as f64 - 1.0) * p).round() as usize] }
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-b").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member, ONLINE).await;
    ensure_namespace(&member, DIRECT_NS).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-b", &kubeconfig).await;
    apply_member(&training, "bench-reclaim-b", TEST, NS, "member-b").await;
    let settings = "deficitHysteresisSeconds: 0, reclaimGraceSeconds: {high: 0, medium: 0, low: 0}";
    // `BENCH_SHARDED=1`: the member owned by a replica that does not run the dispatcher.
    let _tp = if bench_sharded() {
        Sharded::start(&env, &training, (TEST, NS), settings, "bench-reclaim-b").await.replicas
    } else {
        vec![Tidepool::start_with(&env, TEST, NS, settings)]
    };
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let offload = Api::<Pod>::namespaced(member.clone(), &offload_ns(NS));
    let online_pods = Api::<Pod>::namespaced(member.clone(), ONLINE);
    let trials: usize = std::env::var("BENCH_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(7);

    // 1. Trials: one HPA step, one victim each.
    let (deployments, hpas) = online_setup(&member, 1, 1).await;
    let names: Vec<String> = (0..7).map(|i| format!("off-{i}")).collect();
    for n in &names {
        pods.create(&PostParams::default(), &offline_pod(n, Some(&scheduler_name(TEST)), None, Some(n))).await.unwrap();
    }
    until(Duration::from_secs(120), || async {
        let l = pods.list(&ListParams::default()).await.ok()?;
        (l.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).count()
            == names.len())
        .then_some(())
    })
    .await
    .expect("offline pods running");
    let (mut to_notice, mut to_gone) = (Vec::new(), Vec::new());
    let noticed = record(&pods, true).await;
    let gone = record(&offload, false).await;
    // Victims of earlier trials; with grace 0 a victim is Failed right after its notice, so
    // a new victim is told apart by name, not by phase.
    let mut earlier: Vec<String> = Vec::new();
    for trial in 0..trials.min(names.len()) {
        let t0 = Instant::now();
        let max = 2 + trial as i32;
        hpas.patch("online", &PatchParams::default(), &Patch::Merge(json!({"spec": {"maxReplicas": max}})))
            .await
            .unwrap();
        let (victim, t_notice) = until(Duration::from_secs(30), || async {
            let seen = noticed.lock().unwrap();
            seen.iter().find(|(n, t)| **t >= t0 && !earlier.contains(n)).map(|(n, t)| (n.clone(), *t))
        })
        .await
        .expect("a victim noticed");
        earlier.push(victim.clone());
        let t_gone = until(Duration::from_secs(30), || async { gone.lock().unwrap().get(&victim).copied() })
            .await
            .expect("victim's offload pod deleted");
        to_notice.push(t_notice.duration_since(t0).as_secs_f64() * 1000.0);
        to_gone.push(t_gone.saturating_duration_since(t_notice).as_secs_f64() * 1000.0);
    }
    println!("\n## Reclaim through tidepool, one HPA step per trial ({} trials, grace 0)\n", to_notice.len());
    println!("| measure | p50 (ms) | max (ms) | every trial (ms) |");
    println!("|---|---|---|---|");
    let each = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
    let (notice_each, gone_each) = (each(&to_notice), each(&to_gone));
    println!(
        "| HPA change → checkpoint notice on the training pod | {:.0} | {:.0} | {notice_each} |",
        pct(&mut to_notice, 0.5),
        pct(&mut to_notice, 1.0)
    );
    println!(
        "| notice → offload pod gone in the member | {:.0} | {:.0} | {gone_each} |",
        pct(&mut to_gone, 0.5),
        pct(&mut to_gone, 1.0)
    );
    clear_pods(&training, NS).await;
    reset(&offload).await;

    // 2. Time until online pods run: tidepool vs native preemption, alternating, 11 rounds
    //    by default: on a 2-core machine running both clusters, one path's time varies by
    //    a third from round to round, and the p50 of 5 rounds by a quarter from run to run.
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(11);
    let mut times: std::collections::BTreeMap<&str, Vec<f64>> = std::collections::BTreeMap::new();
    let mut how: std::collections::BTreeMap<&str, std::collections::BTreeMap<String, usize>> =
        std::collections::BTreeMap::new();
    for round in 0..=rounds {
        // Round 0 warms up (not counted); then which path goes first alternates.
        let order = if round % 2 == 1 { ["tidepool", "native"] } else { ["native", "tidepool"] };
        for path in order {
            let (deployments2, hpas2) = online_setup(&member, 1, 1).await;
            let direct = Api::<Pod>::namespaced(member.clone(), DIRECT_NS);
            let names: Vec<String> = (0..7).map(|i| format!("{path}-{round}-{i}")).collect();
            if path == "tidepool" {
                for n in &names {
                    pods.create(&PostParams::default(), &offline_pod(n, Some(&scheduler_name(TEST)), None, Some(n)))
                        .await
                        .unwrap();
                }
            } else {
                let pc: PriorityClass = serde_json::from_value(
                    json!({"metadata": {"name": "bench-offline-low"}, "value": -3000, "preemptionPolicy": "Never"}),
                )
                .unwrap();
                let _ = Api::<PriorityClass>::all(member.clone()).create(&PostParams::default(), &pc).await;
                for n in &names {
                    direct
                        .create(&PostParams::default(), &offline_pod(n, None, Some("bench-offline-low"), None))
                        .await
                        .unwrap();
                }
            }
            let offline_api = if path == "tidepool" { pods.clone() } else { direct.clone() };
            until(Duration::from_secs(120), || async {
                (running(&offline_api, &ListParams::default()).await == names.len()).then_some(())
            })
            .await
            .expect("offline pods running");
            // The online service grows by 4 replicas at once (its HPA allows it).
            let all_running = watch_running(&online_pods, "app=online", 5).await;
            let t0 = Instant::now();
            // On stderr, to line rounds up with cluster logs.
            eprintln!(
                "round {round} {path}: scaling at {:.3} (Unix seconds)",
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
            );
            hpas2
                .patch("online", &PatchParams::default(), &Patch::Merge(json!({"spec": {"maxReplicas": 5}})))
                .await
                .unwrap();
            deployments2
                .patch("online", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 5}})))
                .await
                .unwrap();
            let ran = all_running.await.expect("online pods running");
            eprintln!(
                "round {round} {path}: {:.2} s{}",
                ran.duration_since(t0).as_secs_f64(),
                if round == 0 { " (warm-up)" } else { "" }
            );
            if round > 0 {
                times.entry(path).or_default().push(ran.duration_since(t0).as_secs_f64());
            }
            let mut uncounted = std::collections::BTreeMap::new();
            let reasons = if round > 0 { how.entry(path).or_default() } else { &mut uncounted };
            if path == "tidepool" {
                tokio::time::sleep(Duration::from_secs(1)).await;
                for p in pods.list(&ListParams::default()).await.unwrap().items {
                    if let Some(r) = p.status.and_then(|s| s.reason) {
                        *reasons.entry(r).or_insert(0) += 1;
                    }
                }
            } else {
                *reasons.entry("PreemptedNatively".to_string()).or_insert(0) +=
                    names.len() - running(&direct, &ListParams::default()).await;
            }
            clear_pods(&training, NS).await;
            reset(&offload).await;
            reset(&direct).await;
            let _ = deployments2.delete("online", &DeleteParams::default()).await;
        }
    }
    println!(
        "\n## Time until 4 more online replicas run (7 offline 2-GPU pods on 16 GPUs, 1 online replica; {rounds} rounds after a warm-up, which path goes first alternating)\n"
    );
    println!("| path | p50 (s) | min (s) | max (s) | every round (s) | how the offline pods left (all rounds) |");
    println!("|---|---|---|---|---|---|");
    for (path, t) in &mut times {
        let each = t.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(", ");
        let (min, max) = (t.iter().copied().fold(f64::INFINITY, f64::min), t.iter().copied().fold(0.0, f64::max));
        println!("| {path} | {:.2} | {min:.2} | {max:.2} | {each} | {:?} |", pct(t, 0.5), how.get(path));
    }
    let mut p50 = |path: &str| times.get_mut(path).map(|t| pct(t, 0.5));
    if let (Some(tide), Some(native)) = (p50("tidepool"), p50("native")) {
        println!("\ntidepool / native (p50) = {:.2}×", tide / native);
    }
    let _ = deployments.delete("online", &DeleteParams::default()).await;
    drain_pods(&training, NS).await;
    Api::<tidepool_api::MemberCluster>::all(training.clone())
        .delete("bench-reclaim-b", &DeleteParams::default())
        .await
        .unwrap();
}
