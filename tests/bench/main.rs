//! Benchmark program (not a test): tidepool against the direct path, in one run, on the
//! local clusters. Prints tables; asserts nothing about speed.
//!
//! ```text
//! bash tests/controlplane/cluster.sh up /tmp/cp && TIDEPOOL_CLUSTER_ENV=/tmp/cp/cluster.env cargo bench --bench bridge
//! ```
//! Scenarios:
//! 1. burst: N pods (BENCH_BURST, default 300) created at once — through tidepool (training
//!    pods bound to the virtual node) and directly in the member — throughput until all run,
//!    create→Running p50/p99, status up-sync lag (member Running → training Running).
//! 2. gangs of 8, 64 and 256 pods submitted with `schedulerName: tidepool`: submit → all
//!    offload pods created in the member, and submit → all Running, against the same pods
//!    created directly; every 100 ms the gang is sampled for a split (pods on two pools).
//! 3. tidepool's resident memory after each scenario.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_config::keys;

const TEST: &str = "bench";
const NS: &str = "bench";

/// First time each pod was seen (created) and seen Running, by name.
#[derive(Default)]
struct Seen {
    created: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
    node: HashMap<String, String>,
}

fn observe(client: Client, ns: &str) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    let api = Api::<Pod>::namespaced(client, ns);
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
        while let Some(Ok(p)) = events.next().await {
            let now = Instant::now();
            let mut s = s.lock().unwrap();
            let name = p.name_any();
            s.created.entry(name.clone()).or_insert(now);
            if let Some(n) = p.spec.as_ref().and_then(|sp| sp.node_name.clone()) {
                s.node.insert(name.clone(), n);
            }
            if p.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Running") {
                s.running.entry(name).or_insert(now);
            }
        }
    });
    seen
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn pod(name: &str, spec_extra: serde_json::Value, meta: serde_json::Value) -> Pod {
    let mut v = json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]}
    });
    for (k, val) in spec_extra.as_object().unwrap() {
        v["spec"][k] = val.clone();
    }
    for (k, val) in meta.as_object().unwrap() {
        v["metadata"][k] = val.clone();
    }
    serde_json::from_value(v).unwrap()
}

async fn wait_all(seen: &Arc<Mutex<Seen>>, names: &[String], running: bool, timeout: Duration) -> Option<Instant> {
    let start = Instant::now();
    loop {
        {
            let s = seen.lock().unwrap();
            let map = if running { &s.running } else { &s.created };
            if names.iter().all(|n| map.contains_key(n)) {
                return names.iter().filter_map(|n| map.get(n).copied()).max();
            }
        }
        if start.elapsed() > timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn delete_pods(api: &Api<Pod>) {
    let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let _ = api.delete_collection(&dp, &ListParams::default()).await;
    for _ in 0..600 {
        if api.list(&ListParams::default()).await.map(|l| l.items.is_empty()).unwrap_or(false) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    ensure_namespace(&member, NS).await;
    let direct_api = Api::<Pod>::namespaced(member.clone(), NS);
    delete_pods(&direct_api).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
    apply_member(&training, "bench-a", TEST, NS, "member-a").await;
    let tp = Tidepool::start(&env, TEST, NS);
    let node = "tidepool-bench-a";
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(node).await.ok().flatten().map(|_| ()) }
    })
    .await;
    let pid = tp.pid();
    let mut memory = vec![("idle, 0 pods".to_string(), rss_mib(pid))];
    let training_pods = Api::<Pod>::namespaced(training.clone(), NS);
    let offload_ns = format!("tp-{NS}");
    ensure_namespace(&member, &offload_ns).await;

    // 1. Burst.
    let n: usize = std::env::var("BENCH_BURST").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    println!(
        "\n## Burst of {n} pods: tidepool (training pods bound to the virtual node) vs direct (created in the member)\n"
    );
    println!("| path | all Running after (s) | throughput (pods/s) | create→Running p50 (s) | p99 (s) |");
    println!("|---|---|---|---|---|");
    let mut burst_rows = Vec::new();
    for path in ["tidepool", "direct"] {
        let (api, seen) = if path == "tidepool" {
            (training_pods.clone(), observe(training.clone(), NS))
        } else {
            (direct_api.clone(), observe(member.clone(), NS))
        };
        let offload_seen = observe(member.clone(), &offload_ns);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let names: Vec<String> = (0..n).map(|i| format!("burst-{path}-{i}")).collect();
        let start = Instant::now();
        let mut submitted = HashMap::new();
        let creates = futures::stream::iter(names.iter().cloned())
            .map(|name| {
                let api = api.clone();
                let spec = if path == "tidepool" {
                    json!({"nodeName": node, "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}]})
                } else {
                    json!({})
                };
                async move {
                    let t = Instant::now();
                    api.create(&PostParams::default(), &pod(&name, spec, json!({}))).await.unwrap();
                    (name, t)
                }
            })
            .buffer_unordered(16);
        let created: Vec<(String, Instant)> = creates.collect().await;
        submitted.extend(created);
        let done = wait_all(&seen, &names, true, Duration::from_secs(600)).await.expect("burst did not finish");
        let total = done.duration_since(start).as_secs_f64();
        let mut lat: Vec<f64> = {
            let s = seen.lock().unwrap();
            names.iter().map(|nm| s.running[nm].duration_since(submitted[nm]).as_secs_f64()).collect()
        };
        lat.sort_by(f64::total_cmp);
        println!("| {path} | {total:.2} | {:.1} | {:.3} | {:.3} |", n as f64 / total, pct(&lat, 0.5), pct(&lat, 0.99));
        if path == "tidepool" {
            // Up-sync lag: the member copy turned Running → the training pod shows Running.
            let lags: Vec<f64> = {
                let (s, o) = (seen.lock().unwrap(), offload_seen.lock().unwrap());
                let mut v: Vec<f64> = names
                    .iter()
                    .filter_map(|nm| {
                        Some(s.running.get(nm)?.saturating_duration_since(*o.running.get(nm)?).as_secs_f64())
                    })
                    .collect();
                v.sort_by(f64::total_cmp);
                v
            };
            burst_rows.push(format!(
                "status up-sync lag (member Running → training Running): p50 {:.3} s, p99 {:.3} s",
                pct(&lags, 0.5),
                pct(&lags, 0.99)
            ));
            memory.push((format!("after a burst of {n} mirrored pods"), rss_mib(pid)));
            delete_pods(&training_pods).await;
        } else {
            delete_pods(&direct_api).await;
        }
    }
    for r in burst_rows {
        println!("\n{r}");
    }

    // 2. Gangs.
    println!("\n## Gangs through the dispatcher vs the same pods created directly\n");
    println!(
        "| gang | tidepool submit→all created in member (s) | direct submit→all created (s) | tidepool submit→all Running (s) | direct submit→all Running (s) | split samples (every 100 ms) |"
    );
    println!("|---|---|---|---|---|---|");
    for size in [8usize, 64, 256] {
        let offload_seen = observe(member.clone(), &offload_ns);
        let training_seen = observe(training.clone(), NS);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let gang = format!("g{size}");
        let names: Vec<String> = (0..size).map(|i| format!("{gang}-{i}")).collect();
        let meta = json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: size.to_string()}});
        let spec = json!({"schedulerName": scheduler_name(TEST)});
        let splits = Arc::new(Mutex::new((0u32, 0u32)));
        let stop = tokio_util::sync::CancellationToken::new();
        {
            let (seen, splits, stop, names) = (training_seen.clone(), splits.clone(), stop.clone(), names.clone());
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    {
                        let s = seen.lock().unwrap();
                        let pools: BTreeSet<&String> = names.iter().filter_map(|n| s.node.get(n)).collect();
                        let mut c = splits.lock().unwrap();
                        c.0 += 1;
                        if pools.len() > 1 {
                            c.1 += 1;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
        let start = Instant::now();
        futures::stream::iter(names.iter().cloned())
            .map(|name| {
                let (api, spec, meta) = (training_pods.clone(), spec.clone(), meta.clone());
                async move { api.create(&PostParams::default(), &pod(&name, spec, meta)).await.unwrap() }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        let created = wait_all(&offload_seen, &names, false, Duration::from_secs(600)).await.expect("gang not created");
        let running = wait_all(&training_seen, &names, true, Duration::from_secs(600)).await.expect("gang not running");
        stop.cancel();
        let (samples, split) = *splits.lock().unwrap();
        let (t_created, t_running) =
            (created.duration_since(start).as_secs_f64(), running.duration_since(start).as_secs_f64());
        delete_pods(&training_pods).await;

        let direct_seen = observe(member.clone(), NS);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let start = Instant::now();
        futures::stream::iter(names.iter().cloned())
            .map(|name| {
                let api = direct_api.clone();
                async move { api.create(&PostParams::default(), &pod(&name, json!({}), json!({}))).await.unwrap() }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        let d_created =
            wait_all(&direct_seen, &names, false, Duration::from_secs(600)).await.expect("direct not created");
        let d_running =
            wait_all(&direct_seen, &names, true, Duration::from_secs(600)).await.expect("direct not running");
        println!(
            "| {size} | {t_created:.2} | {:.2} | {t_running:.2} | {:.2} | {split} of {samples} |",
            d_created.duration_since(start).as_secs_f64(),
            d_running.duration_since(start).as_secs_f64()
        );
        delete_pods(&direct_api).await;
    }
    memory.push(("after the gang runs".to_string(), rss_mib(pid)));

    println!("\n## tidepool resident memory\n");
    println!("| moment | RSS (MiB) |");
    println!("|---|---|");
    for (when, mib) in memory {
        println!("| {when} | {mib:.1} |");
    }
    Api::<tidepool_config::MemberCluster>::all(training.clone())
        .delete("bench-a", &DeleteParams::default())
        .await
        .unwrap();
}
