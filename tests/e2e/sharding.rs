//! Sharded replicas (issue 21): three `tidepool run` processes share six members — three
//! MemberClusters on each member API server, each with its own offload namespace prefix and
//! a pool of its own kwok node, so no capacity is lent twice. One replica is killed (SIGKILL);
//! its members are served by the others within the lease duration (the takeover) plus a
//! connection; the members' audit logs show that no member ever had two writers; every
//! training pod has exactly one copy. Prints the failover time.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::crd::{PoolSpec, PoolToleration};
use tidepool_api::keys;
use tidepool_federation::published;

use crate::harness::*;

const TEST: &str = "sharding";
const NS: &str = "e2e-sharding";
const MEMBERS: usize = 6;
const REPLICAS: usize = 3;
/// The sharding Leases' duration: a dead replica's members are free after it.
const LEASE_SECONDS: u64 = 15;
const RETRY_SECONDS: u64 = 2;
/// Pods per member before the kill; one more per member of the killed replica after it.
const PODS: usize = 2;
const NODE_KEY: &str = "tidepool.io/e2e-shard";
/// Short notices and hysteresis, for the reclaim on a member the leader does not own.
const DISPATCHER: &str = "reclaimGraceSeconds: {high: 5, medium: 5, low: 5}, deficitHysteresisSeconds: 1";
/// Where the online pod that takes the capacity back runs.
const ONLINE_NS: &str = "e2e-shard-online";

fn member(i: usize) -> String {
    format!("shard-{i}")
}

/// Members 0, 2, 4 live in member-a; 1, 3, 5 in member-b.
fn cluster(i: usize) -> &'static str {
    if i.is_multiple_of(2) { "member-a" } else { "member-b" }
}

/// Offload namespace prefix of member `i`: none is a prefix of another's.
fn prefix(i: usize) -> String {
    format!("shd{i}-")
}

fn identity(r: usize) -> String {
    format!("e2e-shard-{r}")
}

fn config() -> String {
    format!(
        "sharding: {{enabled: true, leaseDurationSeconds: {LEASE_SECONDS}, renewDeadlineSeconds: 10, \
         retryPeriodSeconds: {RETRY_SECONDS}}}\nleaderElection: {{leaseName: tidepool-e2e-sharding}}"
    )
}

/// Member `i`'s own kwok node (tainted, so nothing of other tests lands there).
async fn member_node(client: &Client, i: usize) {
    let name = format!("e2e-shard-{i}");
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": name, NODE_KEY: member(i)}},
        "spec": {"providerID": format!("kwok://{name}"),
                 "taints": [{"key": NODE_KEY, "value": "true", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "16", "memory": "32Gi", "pods": "110"},
                   "allocatable": {"cpu": "16", "memory": "32Gi", "pods": "110"}}
    }))
    .unwrap();
    match Api::<Node>::all(client.clone()).create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create node {name}: {e}"),
    }
}

/// MemberCluster `i`: its prefix, one pool on its node; `paused` or not.
async fn apply_shard_member(training: &Client, i: usize, paused: bool) {
    let mut mc = member_cluster(&member(i), TEST, NS, cluster(i));
    mc.spec.namespace_prefix = Some(prefix(i));
    // Three MemberClusters per API server, each in namespaces of its own prefix (same-named
    // ones would go to the first of them, the others falling back to their prefixes).
    mc.spec.namespace_mode = Some(tidepool_api::crd::NamespaceMode::Prefixed);
    mc.spec.paused = paused;
    mc.spec.pools = vec![PoolSpec {
        name: "p".into(),
        node_selector: BTreeMap::from([(NODE_KEY.to_owned(), member(i))]),
        tolerations: vec![PoolToleration {
            key: Some(NODE_KEY.into()),
            operator: Some("Equal".into()),
            value: Some("true".into()),
            effect: Some("NoSchedule".into()),
        }],
        ..Default::default()
    }];
    apply_member_cluster(training, &mc).await;
}

fn virtual_node(i: usize) -> String {
    format!("tidepool-{}-p", member(i))
}

/// Holder of each member's Lease.
async fn holders(leases: &Api<Lease>) -> BTreeMap<usize, String> {
    let lp =
        ListParams::default().labels("tidepool.io/shard-lease=member,tidepool.io/shard-group=tidepool-e2e-sharding");
    let listed = leases.list(&lp).await.map(|l| l.items).unwrap_or_default();
    (0..MEMBERS)
        .filter_map(|i| {
            let lease = listed.iter().find(|l| l.name_any() == format!("tidepool-member-{}", member(i)))?;
            Some((i, lease.spec.as_ref()?.holder_identity.clone()?))
        })
        .collect()
}

async fn node_ready(nodes: &Api<Node>, name: &str) -> bool {
    let Ok(Some(node)) = nodes.get_opt(name).await else { return false };
    let conditions = node.status.and_then(|s| s.conditions).unwrap_or_default();
    conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Creates `count` pods bound to member `i`'s virtual node, named `<tag>-<i>-<n>`.
async fn pods_on(pods: &Api<Pod>, i: usize, tag: &str, count: usize) -> Vec<String> {
    let mut names = Vec::new();
    for n in 0..count {
        let name = format!("{tag}-{i}-{n}");
        let mut pod = small_bound_pod(&name, &virtual_node(i), TEST);
        pod.metadata.labels.get_or_insert_default().insert("shard".into(), member(i));
        pods.create(&PostParams::default(), &pod).await.unwrap();
        names.push(name);
    }
    names
}

/// Copies of training pod `pod` (by origin UID) in member `i`'s offload namespace.
async fn copies(clients: &BTreeMap<&str, Client>, i: usize, pod: &Pod) -> usize {
    let ns = format!("{}{NS}", prefix(i));
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let lp = ListParams::default().labels(&format!("{}={uid}", keys::LABEL_ORIGIN_UID));
    let api = Api::<Pod>::namespaced(clients[cluster(i)].clone(), &ns);
    api.list(&lp).await.map(|l| l.items.len()).unwrap_or(usize::MAX)
}

/// Whether every named pod of member `i` runs in training with one copy in the member.
async fn served(training_pods: &Api<Pod>, clients: &BTreeMap<&str, Client>, i: usize, names: &[String]) -> bool {
    for name in names {
        let Ok(Some(pod)) = training_pods.get_opt(name).await else { return false };
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if !running || copies(clients, i, &pod).await != 1 {
            return false;
        }
    }
    true
}

/// One replica's unbroken run of writes to a member: from its first request received to its
/// last completed.
#[derive(Debug)]
struct Run {
    agent: String,
    from: jiff::Timestamp,
    until: jiff::Timestamp,
    /// Each write's time received and what it was.
    writes: Vec<String>,
}

/// The writes to one member in order of arrival, as runs of one writer each.
fn runs(mut writes: Vec<AuditedWrite>) -> Vec<Run> {
    writes.sort_by_key(|w| w.received);
    let mut runs: Vec<Run> = Vec::new();
    for w in writes {
        match runs.last_mut() {
            Some(run) if run.agent == w.agent => {
                run.until = run.until.max(w.completed);
                run.writes.push(format!("{} {}", w.received, w.what()));
            }
            _ => runs.push(Run {
                writes: vec![format!("{} {}", w.received, w.what())],
                agent: w.agent,
                from: w.received,
                until: w.completed,
            }),
        }
    }
    runs
}

/// Per member: the writers in turn. Panics when one writer's run is not over (its last
/// request answered) before the next writer's first request arrives, or when the writers
/// alternate more often than ownership can change here (three replicas joining one by one,
/// then one failover: at most four runs).
fn assert_one_writer_at_a_time(
    env: &Env,
    since: jiff::Timestamp,
    logs: &[std::path::PathBuf],
) -> BTreeMap<usize, Vec<String>> {
    let mut writers = BTreeMap::new();
    for i in 0..MEMBERS {
        let ns = format!("{}{NS}", prefix(i));
        let writes: Vec<AuditedWrite> =
            audited_writes(env, cluster(i), since).into_iter().filter(|w| w.namespace == ns).collect();
        let runs = runs(writes);
        eprintln!("{}: writers in turn {runs:?}", member(i));
        for pair in runs.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.until >= b.from {
                ownership_history(logs);
            }
            assert!(
                a.until < b.from,
                "{}: {} wrote until {}, {} from {}: two writers at once",
                member(i),
                a.agent,
                a.until,
                b.agent,
                b.from
            );
        }
        assert!(runs.len() <= 4, "{}: writers alternate: {runs:?}", member(i));
        writers.insert(i, runs.into_iter().map(|r| r.agent).collect());
    }
    writers
}

/// Prints what each replica's log says about member ownership and sessions, for a failure.
fn ownership_history(logs: &[std::path::PathBuf]) {
    const ABOUT: [&str; 6] = ["sharding", "handed over", "session", "member reachable", "offload pod created", "Lease"];
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_else(|e| format!("cannot read {}: {e}", log.display()));
        eprintln!("--- ownership in {} ---", log.display());
        for line in text.lines().filter(|l| ABOUT.iter().any(|a| l.contains(a))) {
            eprintln!("{line}");
        }
    }
}

/// Starts the shared set-up: nodes, members, the three replicas; returns them once every
/// member has one live owner and its virtual node is Ready.
async fn start(env: &Env, training: &Client, clients: &BTreeMap<&str, Client>) -> Vec<Option<Tidepool>> {
    prepare(env, training, TEST, NS).await;
    let leases = Api::<Lease>::namespaced(training.clone(), NS);
    // Leases and published records of an earlier run: their holders are gone.
    let _ = leases.delete_collection(&DeleteParams::default(), &ListParams::default()).await;
    let managed = ListParams::default().labels(&format!("{}={}", keys::LABEL_MANAGED_BY, keys::MANAGED_BY));
    let _ =
        Api::<ConfigMap>::namespaced(training.clone(), NS).delete_collection(&DeleteParams::default(), &managed).await;
    for (cluster, client) in clients {
        let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
        put_kubeconfig_secret(training, NS, cluster, &kubeconfig).await;
        for i in (0..MEMBERS).filter(|i| self::cluster(*i) == *cluster) {
            member_node(client, i).await;
            clear_pods(client, &format!("{}{NS}", prefix(i))).await;
        }
    }
    for i in 0..MEMBERS {
        apply_shard_member(training, i, false).await;
    }
    let replicas: Vec<Option<Tidepool>> = (0..REPLICAS)
        .map(|r| Some(Tidepool::start_replica(env, (TEST, NS), (DISPATCHER, &config()), &identity(r))))
        .collect();
    let nodes = Api::<Node>::all(training.clone());
    let live: BTreeSet<String> = (0..REPLICAS).map(identity).collect();
    wait_for(Duration::from_secs(120), "every member owned by a replica, its node Ready", || async {
        let holders = holders(&leases).await;
        let spread: BTreeSet<&String> = holders.values().collect();
        let owned = holders.len() == MEMBERS && holders.values().all(|h| live.contains(h)) && spread.len() > 1;
        for i in 0..MEMBERS {
            if !owned || !node_ready(&nodes, &virtual_node(i)).await {
                return None;
            }
        }
        Some(())
    })
    .await;
    replicas
}

#[tokio::test]
async fn a_killed_replica_s_members_are_served_by_the_others_with_one_writer_each() {
    let env = Env::load();
    let since = jiff::Timestamp::now();
    let training = env.client("training").await;
    let clients: BTreeMap<&str, Client> =
        BTreeMap::from([("member-a", env.client("member-a").await), ("member-b", env.client("member-b").await)]);
    let mut replicas = start(&env, &training, &clients).await;
    let logs: Vec<std::path::PathBuf> = replicas.iter().flatten().map(|r| r.log_path().to_owned()).collect();
    let leases = Api::<Lease>::namespaced(training.clone(), NS);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);

    // 1. A few pods on every member, each with its one copy.
    let mut names: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for i in 0..MEMBERS {
        names.insert(i, pods_on(&pods, i, "before", PODS).await);
    }
    wait_for(Duration::from_secs(90), "every pod running with one copy", || async {
        for (i, n) in &names {
            if !served(&pods, &clients, *i, n).await {
                return None;
            }
        }
        Some(())
    })
    .await;

    // 2. Kill the replica owning the most members.
    let holders = holders(&leases).await;
    let victim = (0..REPLICAS).max_by_key(|r| holders.values().filter(|h| **h == identity(*r)).count()).unwrap();
    let lost: Vec<usize> = holders.iter().filter(|(_, h)| **h == identity(victim)).map(|(i, _)| *i).collect();
    assert!(!lost.is_empty(), "the victim owns members: {holders:?}");
    replicas[victim].as_mut().unwrap().kill();
    let killed = Instant::now();
    replicas[victim] = None;

    // 3. New pods on its members are offloaded by the others.
    let mut fresh: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for &i in &lost {
        fresh.insert(i, pods_on(&pods, i, "after", 1).await);
    }
    let nodes = Api::<Node>::all(training.clone());
    let bound = Duration::from_secs(LEASE_SECONDS + 2 * RETRY_SECONDS + 30);
    wait_for(bound, "the killed replica's members served by the others", || async {
        let now = holders_of(&leases, &lost).await;
        if now.iter().any(|h| h == &identity(victim)) {
            return None;
        }
        for &i in &lost {
            if !node_ready(&nodes, &virtual_node(i)).await || !served(&pods, &clients, i, &fresh[&i]).await {
                return None;
            }
        }
        Some(())
    })
    .await;
    let failover = killed.elapsed();
    eprintln!(
        "sharding failover: {} member(s) of {} served again {failover:?} after SIGKILL",
        lost.len(),
        identity(victim)
    );

    // 4. No pod lost or duplicated: every training pod runs with exactly one copy.
    for i in 0..MEMBERS {
        let mut all = names[&i].clone();
        all.extend(fresh.get(&i).cloned().unwrap_or_default());
        assert!(served(&pods, &clients, i, &all).await, "{}: a pod lost or duplicated", member(i));
    }

    // 5. One writer at a time for every member; the killed replica's members did change hands.
    let writers = assert_one_writer_at_a_time(&env, since, &logs);
    for &i in &lost {
        let agents = &writers[&i];
        assert!(agents.len() >= 2, "{}: written by the killed replica and its successor: {agents:?}", member(i));
        assert!(!agents[agents.len() - 1].contains(&format!("({})", identity(victim))), "{agents:?}");
    }

    // 6. A replica stopped cleanly (SIGTERM) releases its member Leases (operations.md): a
    //    watch of the Leases sees each of them with no holder, before the lease duration
    //    could have freed it, and another replica takes it.
    let owners = self::holders(&leases).await;
    let owns = |r: usize| owners.iter().filter(|(_, h)| **h == identity(r)).map(|(i, _)| *i).collect::<Vec<_>>();
    let stopping = (0..REPLICAS).filter(|r| replicas[*r].is_some()).max_by_key(|r| owns(*r).len()).unwrap();
    let given_up = owns(stopping);
    assert!(!given_up.is_empty(), "the replica to stop owns members: {owners:?}");
    let released = released_leases(&leases).await;
    let stopped = Instant::now();
    assert!(replicas[stopping].as_mut().unwrap().terminate(), "tidepool did not end after SIGTERM");
    replicas[stopping] = None;
    wait_for(Duration::from_secs(LEASE_SECONDS), "the stopped replica's Leases released", || async {
        let seen = released.borrow().clone();
        given_up.iter().all(|i| seen.contains(&format!("tidepool-member-{}", member(*i)))).then_some(())
    })
    .await;
    eprintln!("sharding: {} Lease(s) released {:?} after SIGTERM", given_up.len(), stopped.elapsed());
    wait_for(Duration::from_secs(60), "the stopped replica's members taken by the others", || async {
        let now = holders_of(&leases, &given_up).await;
        (now.len() == given_up.len() && now.iter().all(|h| h != &identity(stopping))).then_some(())
    })
    .await;

    // 7. Clean up through the survivors.
    drain_pods(&training, NS).await;
    reset_members(&training, TEST).await;
}

/// The names of the member Leases a watch has seen with no holder (released), from now on
/// (once the watch has listed them).
async fn released_leases(leases: &Api<Lease>) -> tokio::sync::watch::Receiver<BTreeSet<String>> {
    let (tx, rx) = tokio::sync::watch::channel(BTreeSet::new());
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let mut listed_tx = Some(listed_tx);
    let config = kube::runtime::watcher::Config::default().labels("tidepool.io/shard-lease=member");
    let stream = kube::runtime::watcher(leases.clone(), config);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = futures::StreamExt::next(&mut stream).await {
            if let Ok(kube::runtime::watcher::Event::InitDone) = event
                && let Some(listed) = listed_tx.take()
            {
                let _ = listed.send(());
            }
            let Ok(kube::runtime::watcher::Event::Apply(lease)) = event else { continue };
            let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).filter(|h| !h.is_empty());
            if holder.is_none() {
                tx.send_modify(|seen| {
                    seen.insert(lease.name_any());
                });
            }
            if tx.is_closed() {
                return;
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(30), listed).await.expect("the Lease watch listed").unwrap();
    rx
}

async fn holders_of(leases: &Api<Lease>, members: &[usize]) -> Vec<String> {
    let all = holders(leases).await;
    members.iter().filter_map(|i| all.get(i).cloned()).collect()
}

/// Holder of the leader Lease: the replica running the scheduling loop.
async fn leader(leases: &Api<Lease>) -> Option<String> {
    let lease = leases.get_opt("tidepool-e2e-sharding").await.ok().flatten()?;
    lease.spec?.holder_identity
}

/// A pod of gang `gang` (2 core pods) for the dispatcher, asking 4 of a member node's 16 cpus.
fn gang_pod(name: &str, gang: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": TEST},
                     "annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: "2"}},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}}]
        }
    }))
    .unwrap()
}

/// An online pod in member `i`'s cluster that wants 12 of its node's 16 cpus and never
/// preempts (PriorityClass `ONLINE_NS`): only tidepool's reclaim can make room for it.
fn online_pod(name: &str, i: usize) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {NODE_KEY: member(i)},
            "tolerations": [{"key": NODE_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
            "priorityClassName": ONLINE_NS,
            "containers": [{"name": "main", "image": "example.invalid/online:1",
                            "resources": {"requests": {"cpu": "12", "memory": "1Gi"}}}]
        }
    }))
    .unwrap()
}

async fn pod_phase(pods: &Api<Pod>, name: &str) -> Option<(String, Option<String>)> {
    let status = pods.get(name).await.ok()?.status?;
    Some((status.phase?, status.reason))
}

#[tokio::test]
async fn the_leader_places_a_gang_on_a_member_another_replica_owns_and_its_owner_reclaims_it_after_notice() {
    let env = Env::load();
    let training = env.client("training").await;
    let clients: BTreeMap<&str, Client> =
        BTreeMap::from([("member-a", env.client("member-a").await), ("member-b", env.client("member-b").await)]);
    let replicas = start(&env, &training, &clients).await;
    let leases = Api::<Lease>::namespaced(training.clone(), NS);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);

    // 1. The target: a member some replica other than the leader owns. Every other member is
    //    paused, so the gang can only go there.
    let (leader, holders) = wait_for(Duration::from_secs(60), "a leader", || async {
        Some((leader(&leases).await?, holders(&leases).await))
    })
    .await;
    let t = (0..MEMBERS).find(|i| holders.get(i).is_some_and(|h| *h != leader));
    let t = t.unwrap_or_else(|| panic!("the leader {leader} owns every member: {holders:?}"));
    for i in (0..MEMBERS).filter(|i| *i != t) {
        apply_shard_member(&training, i, true).await;
    }
    // The pause reaches the leader through the owners' published records.
    let records = Api::<ConfigMap>::namespaced(training.clone(), NS);
    wait_for(Duration::from_secs(60), "every other member's record published paused", || async {
        for i in 0..MEMBERS {
            let cm = records.get_opt(&published::record_name(&member(i))).await.ok().flatten()?;
            let record = published::parse(&cm).ok()?;
            if record.paused != (i != t) {
                return None;
            }
        }
        Some(())
    })
    .await;

    // 2. A gang of two, placed whole on that member's virtual node and run there.
    let id = run_id();
    let gang: Vec<String> = (0..2).map(|n| format!("gang-{id}-{n}")).collect();
    for name in &gang {
        pods.create(&PostParams::default(), &gang_pod(name, &format!("g-{id}"))).await.unwrap();
    }
    wait_for(
        Duration::from_secs(90),
        "the gang placed on the member another replica owns, each pod with its copy",
        || async {
            for name in &gang {
                let pod = pods.get(name).await.ok()?;
                let on = pod.spec.as_ref()?.node_name.clone()?;
                assert_eq!(on, virtual_node(t), "{name} went to a paused member");
                let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
                if !running || copies(&clients, t, &pod).await != 1 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;

    // 2b. A second gang that fits nowhere waits: the leader says capacity is wanted, for the
    //     owners of the members it does not bridge (they publish growing room at once then).
    let big: Vec<String> = (0..2).map(|n| format!("big-{id}-{n}")).collect();
    for name in &big {
        let mut pod = gang_pod(name, &format!("big-{id}"));
        let requests = json!({"cpu": "12", "memory": "1Gi"});
        pod.spec.as_mut().unwrap().containers[0].resources =
            Some(serde_json::from_value(json!({"requests": requests})).unwrap());
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    wait_for(Duration::from_secs(60), "capacity wanted while the big gang waits", || async {
        let cm = records.get_opt(published::WANTED).await.ok().flatten()?;
        (cm.data?.get("waiting")? == "true").then_some(())
    })
    .await;
    for name in &big {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }

    // 3. Online demand in that member takes the capacity back: the owner notices the deficit,
    //    warns both gang pods, and at the deadline deletes their copies; the online pod runs.
    let member_client = clients[cluster(t)].clone();
    ensure_namespace(&member_client, ONLINE_NS).await;
    let never: PriorityClass = serde_json::from_value(
        json!({"metadata": {"name": ONLINE_NS}, "value": 0, "preemptionPolicy": "Never", "globalDefault": false}),
    )
    .unwrap();
    match Api::<PriorityClass>::all(member_client.clone()).create(&PostParams::default(), &never).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create PriorityClass {ONLINE_NS}: {e}"),
    }
    let online = Api::<Pod>::namespaced(member_client, ONLINE_NS);
    let online_name = format!("online-{id}");
    online.create(&PostParams::default(), &online_pod(&online_name, t)).await.unwrap();
    for name in &gang {
        let reason = wait_for(Duration::from_secs(60), &format!("{name} reclaimed"), || async {
            let (phase, reason) = pod_phase(&pods, name).await?;
            (phase == "Failed").then_some(reason)
        })
        .await;
        assert_eq!(reason.as_deref(), Some(keys::REASON_RECLAIMED), "{name} ended otherwise");
        let pod = pods.get(name).await.unwrap();
        let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
        assert!(
            conditions.iter().any(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED),
            "{name} was reclaimed without its notice: {conditions:?}"
        );
    }
    wait_for(Duration::from_secs(60), "the online pod running in the room given back", || async {
        (pod_phase(&online, &online_name).await?.0 == "Running").then_some(())
    })
    .await;

    // 4. Clean up.
    let _ = online.delete(&online_name, &DeleteParams::default()).await;
    drain_pods(&training, NS).await;
    reset_members(&training, TEST).await;
    drop(replicas);
}
