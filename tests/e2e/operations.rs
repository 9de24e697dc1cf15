//! Operations: leader election between two replicas and the metrics they export.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;

use crate::harness::*;

const TEST: &str = "operations";
const NS: &str = "e2e-operations";
const MEMBER: &str = "e2e-ops-a";
const NODE: &str = "tidepool-e2e-ops-a";
const LEASE: &str = "tidepool-e2e-ops";

/// The Lease holder identity of a local tidepool process (`<host>-<pid>`).
fn identity_of(tidepool: &Tidepool) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    format!("{}-{}", host.trim(), tidepool.pid())
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases.get_opt(LEASE).await.ok()??.spec?.holder_identity
}

/// Requests a replica sent to the training cluster that change something.
fn training_writes(text: &str) -> f64 {
    ["create", "update", "patch", "delete"]
        .iter()
        .map(|verb| {
            metric_sum(text, "tidepool_api_requests_total", &["cluster=\"training\"", &format!("verb=\"{verb}\"")])
        })
        .sum()
}

#[tokio::test]
async fn one_replica_leads_a_standby_writes_nothing_and_takes_over_after_sigkill() {
    let env = Env::load();
    let training = env.client("training").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let leases = Api::<Lease>::namespaced(training.clone(), NS);
    let _ = leases.delete(LEASE, &Default::default()).await;
    let election = format!(
        "leaderElection: {{enabled: true, leaseName: {LEASE}, leaseDurationSeconds: 10, retryPeriodSeconds: 2}}"
    );

    // 1. The first replica takes the Lease and serves the member.
    let mut first = Tidepool::start_config(&env, TEST, NS, "", &election);
    let first_id = identity_of(&first);
    wait_for(Duration::from_secs(60), "first replica holds the Lease", || {
        let leases = leases.clone();
        let want = first_id.clone();
        async move { (holder(&leases).await? == want).then_some(()) }
    })
    .await;
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node registered by the leader", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten() }
    })
    .await;

    // 2. A second replica stands by: it reads the Lease and writes nothing at all.
    let second = Tidepool::start_config(&env, TEST, NS, "", &election);
    let second_id = identity_of(&second);
    let standby = wait_for(Duration::from_secs(30), "standby replica reading the Lease", || {
        let text = second.scrape();
        async move {
            let reads = metric_sum(&text, "tidepool_api_requests_total", &["resource=\"leases\"", "verb=\"get\""]);
            (reads >= 3.0).then_some(text)
        }
    })
    .await;
    assert_eq!(metric_value(&standby, "tidepool_leader", ""), Some(0.0), "{standby}");
    assert_eq!(training_writes(&standby), 0.0, "a standby wrote to the training cluster:\n{standby}");
    for resource in ["nodes", "pods", "memberclusters"] {
        let calls = metric_sum(&standby, "tidepool_api_requests_total", &[&format!("resource=\"{resource}\"")]);
        assert_eq!(calls, 0.0, "a standby touched {resource}:\n{standby}");
    }
    assert_eq!(holder(&leases).await.as_deref(), Some(first_id.as_str()));
    let leader = first.scrape_live();
    assert_eq!(metric_value(&leader, "tidepool_leader", ""), Some(1.0), "{leader}");
    assert!(training_writes(&leader) > 0.0, "the leader wrote nothing?\n{leader}");

    // 3. SIGKILL the leader: the standby takes the Lease once it expires (how soon is a
    //    matter for a benchmark, not this test), and then does the leader's work.
    first.kill();
    let killed = Instant::now();
    wait_for(Duration::from_secs(60), "standby took the Lease after the SIGKILL", || {
        let leases = leases.clone();
        let want = second_id.clone();
        async move { (holder(&leases).await? == want).then_some(()) }
    })
    .await;
    let took_over = killed.elapsed();
    let active = wait_for(Duration::from_secs(60), "new leader writing", || {
        let text = second.scrape_live();
        async move {
            let nodes =
                metric_sum(&text, "tidepool_api_requests_total", &["cluster=\"training\"", "resource=\"nodes\""]);
            (metric_value(&text, "tidepool_leader", "") == Some(1.0) && nodes > 0.0).then_some(text)
        }
    })
    .await;
    eprintln!("takeover after SIGKILL: Lease in {took_over:?}, controllers running in {:?}", killed.elapsed());
    assert!(training_writes(&active) > 0.0);
    // The member's metrics series are exported by the new leader.
    wait_for(Duration::from_secs(30), "pool capacity exported", || {
        let text = second.scrape();
        async move {
            let gpus = metric_value(
                &text,
                "tidepool_pool_capacity",
                &format!("member=\"{MEMBER}\",pool=\"default\",resource=\"gpu\",unit=\"devices\""),
            )?;
            (gpus > 0.0).then_some(())
        }
    })
    .await;
    // 4. The new leader does the work, not just the Lease: a pod bound to the virtual node
    //    runs in the member through it.
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = format!("after-failover-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": tidepool_api::keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), "a pod Running through the new leader", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let text = second.scrape_live();
    let created = metric_sum(
        &text,
        "tidepool_api_requests_total",
        &[&format!("cluster=\"{MEMBER}\""), "verb=\"create\"", "resource=\"pods\""],
    );
    assert!(created >= 1.0, "the new leader created no offload pod in the member:\n{text}");
    drain_pods(&training, NS).await;
    drop(second);
}
