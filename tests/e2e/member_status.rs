//! What a member's own state does to its `MemberCluster` and virtual node: online pods at or
//! below the offload priorities raise `OnlinePriorityConflict` (and clear it when gone), and
//! a capacity window shrinks the virtual node exactly from its lead time on, and pausing the
//! member taints its virtual node and places nothing new there (its running pods stay) until
//! it is unpaused. What a hostile member writes into a copy's status comes up bounded, never
//! as tidepool's own conditions.

use std::time::Duration;

use futures::StreamExt;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

/// Status, reason and message of condition `type_` of MemberCluster `name`.
async fn member_condition(client: &Client, name: &str, type_: &str) -> Option<(String, String, String)> {
    let mc = Api::<MemberCluster>::all(client.clone()).get(name).await.ok()?;
    mc.status?.conditions.into_iter().find(|c| c.type_ == type_).map(|c| (c.status, c.reason, c.message))
}

/// Waits until member `name`'s condition `type_` has `status`; its `(status, reason, message)`.
async fn condition_becomes(
    client: &Client,
    (name, type_, status): (&str, &str, &str),
    timeout: Duration,
    what: &str,
) -> (String, String, String) {
    wait_for(timeout, what, || async move {
        let c = member_condition(client, name, type_).await?;
        (c.0 == status).then_some(c)
    })
    .await
}

/// Starts a tidepool serving member-b as MemberCluster `member` and waits for its node.
async fn start(env: &Env, training: &Client, test: &str, ns: &str, member: &str) -> (Tidepool, String) {
    prepare(env, training, test, ns).await;
    let node = format!("tidepool-{member}");
    let nodes = Api::<Node>::all(training.clone());
    // A node an earlier run's tidepool left is not this run's: gone before this one starts.
    let _ = nodes.delete(&node, &DeleteParams::default()).await;
    wait_for(Duration::from_secs(30), "an earlier run's virtual node gone", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move { nodes.get_opt(&node).await.ok()?.is_none().then_some(()) }
    })
    .await;
    bridge_member(env, training, test, ns, member, "member-b").await;
    let tidepool = Tidepool::start(env, test, ns);
    wait_for(Duration::from_secs(90), "virtual node Ready", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move {
            let n = nodes.get_opt(&node).await.ok()??;
            let ready = n.status?.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
            (ready.status == "True").then_some(())
        }
    })
    .await;
    (tidepool, node)
}

async fn member_events(training: &Client, member: &str, reason: &str) -> usize {
    let lp = ListParams::default().fields(&format!("involvedObject.name={member}"));
    let list = Api::<Event>::all(training.clone()).list(&lp).await.unwrap();
    list.items.iter().filter(|e| e.reason.as_deref() == Some(reason)).count()
}

#[tokio::test]
async fn an_online_pod_at_offload_priority_raises_a_condition_until_it_goes() {
    const TEST: &str = "prio-conflict";
    const NS: &str = "e2e-prio-conflict";
    const MEMBER: &str = "prio-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    let (tidepool, _node) = start(&env, &training, TEST, NS, MEMBER).await;

    // 1. No online pod of member-b runs that low: the condition says so.
    let (status, _, _) = wait_for(Duration::from_secs(30), "OnlinePriorityConflict condition", || {
        let training = training.clone();
        async move { member_condition(&training, MEMBER, keys::CONDITION_ONLINE_PRIORITY_CONFLICT).await }
    })
    .await;
    assert_eq!(status, "False", "{}", tidepool.log_tail());

    // 2. An online pod below the lowest offload band appears in member-b.
    let online_ns = "e2e-prio-online";
    ensure_namespace(&member_b, online_ns).await;
    ensure_priority_class(&member_b, "e2e-below-offload", keys::Band::Low.priority_value() - 100).await;
    let pods = Api::<Pod>::namespaced(member_b.clone(), online_ns);
    let name = format!("batch-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "priorityClassName": "e2e-below-offload",
            "nodeSelector": {"kubernetes.io/hostname": "member-b-gpu-0"},
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/batch:1"}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let (_, reason, message) = condition_becomes(
        &training,
        (MEMBER, keys::CONDITION_ONLINE_PRIORITY_CONFLICT, "True"),
        Duration::from_secs(30),
        "OnlinePriorityConflict=True",
    )
    .await;
    assert_eq!(reason, "OnlinePodsAtOffloadPriority");
    let expected = format!("{online_ns}/{name} ({})", keys::Band::Low.priority_value() - 100);
    assert!(message.contains(&expected), "message {message:?} does not name {expected}");
    wait_for(Duration::from_secs(20), "OnlinePriorityConflict Event", || {
        let training = training.clone();
        async move { (member_events(&training, MEMBER, keys::CONDITION_ONLINE_PRIORITY_CONFLICT).await > 0).then_some(()) }
    })
    .await;
    // Ready is untouched: the member still works, its admin is only warned.
    let (ready, _, _) = member_condition(&training, MEMBER, keys::CONDITION_READY).await.unwrap();
    assert_eq!(ready, "True");

    // 3. The pod goes: the condition clears, with an Event.
    pods.delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.unwrap();
    condition_becomes(
        &training,
        (MEMBER, keys::CONDITION_ONLINE_PRIORITY_CONFLICT, "False"),
        Duration::from_secs(30),
        "OnlinePriorityConflict=False again",
    )
    .await;
    wait_for(Duration::from_secs(20), "OnlinePriorityConflictResolved Event", || {
        let training = training.clone();
        async move { (member_events(&training, MEMBER, "OnlinePriorityConflictResolved").await > 0).then_some(()) }
    })
    .await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
}

/// The API server's time of the newest write to the node's status (managed fields record
/// it, to the second, for each writer).
fn status_write_time(node: &Node) -> Option<jiff::Timestamp> {
    let fields = node.metadata.managed_fields.as_ref()?;
    fields.iter().filter(|f| f.subresource.as_deref() == Some("status")).filter_map(|f| Some(f.time.as_ref()?.0)).max()
}

fn gpus(node: &Node) -> Option<i64> {
    let q = node.status.as_ref()?.allocatable.as_ref()?.get("nvidia.com/gpu")?;
    q.0.parse().ok()
}

#[tokio::test]
async fn a_capacity_window_shrinks_the_virtual_node_from_its_lead_time_on() {
    const TEST: &str = "window";
    const NS: &str = "e2e-window";
    const MEMBER: &str = "window-b";
    const RESERVE: i64 = 4;
    let env = Env::load();
    let training = env.client("training").await;
    let (tidepool, node) = start(&env, &training, TEST, NS, MEMBER).await;
    let nodes = Api::<Node>::all(training.clone());
    let base = wait_for(Duration::from_secs(30), "GPUs on the virtual node", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move { gpus(&nodes.get(&node).await.ok()?).filter(|g| *g >= RESERVE) }
    })
    .await;

    // Every version of the node from here on, in order, with the API server's own time of
    // the write that made it: the order of events is read from the server, not timed here.
    let field = format!("metadata.name={node}");
    let mut versions = Box::pin(watcher(nodes.clone(), watcher::Config::default().fields(&field)));

    // 1. A window whose cron start is the next minute boundary at least 12 s away, with a lead
    //    that brings the reservation forward to exactly 12 s from now (cron has minute
    //    granularity; the lead does not).
    let now = jiff::Timestamp::now();
    let reserve_at = now.as_second() + 12;
    let boundary = reserve_at + (60 - reserve_at.rem_euclid(60)).rem_euclid(60);
    let lead = boundary - reserve_at;
    let fire = jiff::Timestamp::from_second(boundary).unwrap().to_zoned(jiff::tz::TimeZone::UTC);
    let schedule = format!("{} {} * * *", fire.minute(), fire.hour());
    let patch = serde_json::json!({"spec": {"capacity": {"windows": [{
        "name": "peak", "schedule": schedule, "durationMinutes": 5, "leadSeconds": lead,
        "reserve": {"nvidia.com/gpu": RESERVE.to_string()}
    }]}}});
    Api::<MemberCluster>::all(training.clone())
        .patch(MEMBER, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let start = jiff::Timestamp::from_second(reserve_at).unwrap();
    eprintln!("window {schedule:?} lead {lead}s: reservation from {start}");

    // 2. Every version before the reservation shows the whole surplus; the first one without
    //    the window's GPUs was written, by the API server's clock, no earlier than the lead
    //    time (server times are whole seconds, and the lead time is one: a write even a
    //    moment early carries the second before it).
    let shrunk = tokio::time::timeout(Duration::from_secs(40), async {
        let mut seen = 0usize;
        loop {
            match versions.next().await.expect("node watch ended").expect("node watch failed") {
                watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                    seen += 1;
                    match gpus(&n) {
                        Some(g) if g == base => {}
                        Some(g) if g == base - RESERVE => return (n, seen),
                        other => panic!("virtual node GPUs {other:?}, neither {base} nor {}", base - RESERVE),
                    }
                }
                watcher::Event::Delete(_) => panic!("virtual node deleted"),
                _ => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the window never shrank the virtual node {}", tidepool.log_tail()));
    let (n, seen) = shrunk;
    let written = status_write_time(&n).expect("the node's status write has a server time");
    eprintln!("reservation written at {written} (server), lead time {start}, after {seen} versions");
    assert!(seen > 1, "the watch saw no version before the reservation");
    assert!(written >= start, "reservation written at {written}, before the window's lead time {start}");
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
}

fn has_taint(node: &Node, key: &str) -> bool {
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_ref());
    taints.is_some_and(|t| t.iter().any(|t| t.key == key && t.effect == "NoSchedule"))
}

/// PodScheduled=False/Unschedulable message of a pod, once the dispatcher wrote one.
fn unschedulable_message(p: &Pod) -> Option<String> {
    let conditions = p.status.as_ref()?.conditions.as_ref()?;
    let c = conditions.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    (c.reason.as_deref() == Some("Unschedulable")).then(|| c.message.clone().unwrap_or_default())
}

#[tokio::test]
async fn pausing_a_member_places_nothing_new_there_and_keeps_its_running_pods() {
    const TEST: &str = "pause";
    const NS: &str = "e2e-pause";
    const MEMBER: &str = "pause-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    let (tidepool, node) = start(&env, &training, TEST, NS, MEMBER).await;
    let nodes = Api::<Node>::all(training.clone());
    assert!(!has_taint(&nodes.get(&node).await.unwrap(), keys::TAINT_PAUSED));
    let members = Api::<MemberCluster>::all(training.clone());
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let phase = |name: String| {
        let pods = pods.clone();
        async move { pods.get(&name).await.ok()?.status?.phase }
    };

    // 1. A pod runs on the member before the pause.
    let kept = format!("kept-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": kept},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), "kept pod Running", || {
        let phase = phase(kept.clone());
        async move { (phase.await.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    let copy_uid = copies.get(&kept).await.unwrap().metadata.uid.unwrap();

    // 2. Paused: the node is tainted, and a pod for tidepool's scheduler that fits the member
    //    is looked at (the dispatcher says why it waits) and not placed.
    let patch = serde_json::json!({"spec": {"paused": true}});
    members.patch(MEMBER, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    wait_for(Duration::from_secs(30), "paused taint on the virtual node", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move { has_taint(&nodes.get_opt(&node).await.ok()??, keys::TAINT_PAUSED).then_some(()) }
    })
    .await;
    let waiting = format!("waiting-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": waiting},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let message = wait_for(Duration::from_secs(30), "the dispatcher explains why the pod waits", || {
        let (pods, waiting) = (pods.clone(), waiting.clone());
        async move { unschedulable_message(&pods.get(&waiting).await.ok()?) }
    })
    .await;
    eprintln!("waiting while paused: {message}");
    let p = pods.get(&waiting).await.unwrap();
    assert_eq!(p.spec.unwrap().node_name, None, "placed on a paused member");
    // The pod that ran before the pause runs on, the same copy.
    assert_eq!(phase(kept.clone()).await.as_deref(), Some("Running"));
    let copy = copies.get(&kept).await.unwrap();
    assert_eq!(copy.metadata.uid.as_deref(), Some(copy_uid.as_str()), "the kept pod's copy was replaced");
    assert!(copy.metadata.deletion_timestamp.is_none(), "the kept pod's copy is being deleted");

    // 3. Unpaused: the taint goes, and the waiting pod is placed there and runs.
    let patch = serde_json::json!({"spec": {"paused": false}});
    members.patch(MEMBER, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    wait_for(Duration::from_secs(30), "paused taint gone", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move { (!has_taint(&nodes.get_opt(&node).await.ok()??, keys::TAINT_PAUSED)).then_some(()) }
    })
    .await;
    wait_for(Duration::from_secs(60), "the waiting pod placed on the unpaused member and Running", || {
        let (pods, waiting, node) = (pods.clone(), waiting.clone(), node.clone());
        async move {
            let p = pods.get(&waiting).await.ok()?;
            (p.spec?.node_name.as_deref() == Some(node.as_str()) && p.status?.phase.as_deref() == Some("Running"))
                .then_some(())
        }
    })
    .await;
    let n = nodes.get(&node).await.unwrap();
    assert!(has_taint(&n, keys::TAINT_VIRTUAL), "the virtual taint stays {}", tidepool.log_tail());
    drain_pods(&training, NS).await;
    members.delete(MEMBER, &DeleteParams::default()).await.unwrap();
}

/// A hostile member (its admin, or whoever holds its API server) writes into a copy's status
/// a reclaim notice tidepool never gave and a condition whose message would forge lines in
/// `kubectl describe`. The training pod shows the member's own condition, escaped and
/// bounded, never tidepool's: the pod is not under notice and keeps running. It then claims
/// the copy's IP is the training cluster's API server Service address: the member declared its pod
/// network (`spec.podCIDRs`, kwok's), so the training pod never shows that address. The pod's
/// tenant asked for a year of grace: its copy (hand-bound, so `medium`) gets the band's
/// default bound.
#[tokio::test]
async fn a_hostile_members_status_comes_up_bounded_and_a_tenants_year_of_grace_is_bounded() {
    const TEST: &str = "hostile-status";
    const NS: &str = "e2e-hostile-status";
    const MEMBER: &str = "hostile-b";
    const FORGED: &str = "example.com/Forged";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    let (tidepool, node) = start(&env, &training, TEST, NS, MEMBER).await;
    // kwok's pod network in member-b (tests/controlplane/cluster.sh), declared by its admin.
    let declared = json!({"spec": {"podCIDRs": ["10.244.0.0/16"]}});
    Api::<MemberCluster>::all(training.clone())
        .patch(MEMBER, &PatchParams::default(), &Patch::Merge(&declared))
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = format!("victim-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 365 * 24 * 3600,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), "the pod Running", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { (pods.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;

    let copies = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(NS));
    let grace = copies.get(&name).await.unwrap().spec.unwrap().termination_grace_period_seconds;
    assert_eq!(grace, Some(300), "a year asked for; medium's default bound given");
    let message = format!("ok\u{1b}[2J\n  Normal  Reclaimed  forged {}", "x".repeat(5000));
    let forged = serde_json::json!({"status": {"conditions": [
        {"type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": "Forged", "message": "forged"},
        {"type": FORGED, "status": "True", "reason": "Forged", "message": message},
    ]}});
    copies.patch_status(&name, &PatchParams::default(), &Patch::Strategic(&forged)).await.unwrap();
    let condition =
        |p: &Pod, type_: &str| p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_).cloned();
    let shown = wait_for(Duration::from_secs(30), "the member's condition on the training pod", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { condition(&pods.get(&name).await.ok()?, FORGED) }
    })
    .await;
    let text = shown.message.unwrap_or_default();
    assert!(!text.contains('\u{1b}') && !text.contains('\n'), "control characters obeyed: {text:?}");
    assert!(text.starts_with("ok\\u{1b}[2J\\n") && text.len() <= 1024, "{} bytes: {text:.80}", text.len());
    // The copy still says it is under notice; the training pod never did.
    let copy = copies.get(&name).await.unwrap();
    assert!(condition(&copy, keys::CONDITION_RECLAIM_REQUESTED).is_some(), "the forgery is in the member");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = pods.get(&name).await.unwrap();
    assert_eq!(condition(&p, keys::CONDITION_RECLAIM_REQUESTED), None, "{}", tidepool.log_tail());
    assert_eq!(p.status.clone().and_then(|s| s.phase).as_deref(), Some("Running"));
    let own_ip = p.status.and_then(|s| s.pod_ip).unwrap_or_default();
    assert!(own_ip.starts_with("10.244."), "the copy's address inside the declared network: {own_ip:?}");

    // The training cluster's API server Service address, claimed as the copy's.
    let services = Api::<k8s_openapi::api::core::v1::Service>::namespaced(training.clone(), "default");
    let dns_ip = services.get("kubernetes").await.unwrap().spec.unwrap().cluster_ip.unwrap();
    let claim = json!({"status": {"podIP": dns_ip, "podIPs": [{"ip": dns_ip}],
        "conditions": [{"type": FORGED, "status": "True", "reason": "Claimed", "message": "claimed"}]}});
    copies.patch_status(&name, &PatchParams::default(), &Patch::Merge(&claim)).await.unwrap();
    let copy = copies.get(&name).await.unwrap();
    assert_eq!(copy.status.as_ref().and_then(|s| s.pod_ip.as_deref()), Some(dns_ip.as_str()), "claimed in the member");
    // The claim's condition reached the training pod: so did whatever of its status came up.
    let seen = wait_for(Duration::from_secs(30), "the claim's status on the training pod", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move {
            let p = pods.get(&name).await.ok()?;
            (condition(&p, FORGED)?.reason.as_deref() == Some("Claimed")).then_some(p)
        }
    })
    .await;
    let shown = seen.status.unwrap();
    println!("the training pod's IPs after the claim: {:?} {:?}", shown.pod_ip, shown.pod_ips);
    assert_ne!(shown.pod_ip.as_deref(), Some(dns_ip.as_str()), "the API server's address came up as a pod's");
    assert!(shown.pod_ips.iter().flatten().all(|ip| ip.ip != dns_ip), "{:?}", shown.pod_ips);
    drain_pods(&training, NS).await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
}

/// A member whose pod CIDRs overlap the training cluster's is reported on its
/// `MemberCluster` (`PodNetworkOverlap`, naming both CIDRs), and the report clears when the
/// overlapping node goes; a pod network its admin declares (`spec.podCIDRs`) is compared then. The local clusters do not allocate node CIDRs, so an admin's node
/// object with a pod CIDR stands in on each side (unschedulable: nothing runs there).
#[tokio::test]
async fn a_member_whose_pod_cidrs_overlap_the_training_clusters_is_reported() {
    const TEST: &str = "pod-network";
    const NS: &str = "e2e-pod-network";
    const MEMBER: &str = "pod-network-b";
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    let id = run_id();
    let node = |name: &str, cidr: &str| -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"e2e.tidepool.io/stand-in": "true"}},
            "spec": {"podCIDR": cidr, "podCIDRs": [cidr], "unschedulable": true,
                     "taints": [{"key": "e2e.tidepool.io/stand-in", "effect": "NoSchedule"}]}
        }))
        .unwrap()
    };
    let (in_training, in_member) = (format!("e2e-cidr-t-{id}"), format!("e2e-cidr-m-{id}"));
    let training_nodes = Api::<Node>::all(training.clone());
    training_nodes.create(&PostParams::default(), &node(&in_training, "10.250.0.0/24")).await.unwrap();
    let (_tidepool, _) = start(&env, &training, TEST, NS, MEMBER).await;
    let member_nodes = Api::<Node>::all(member_b.clone());
    member_nodes.create(&PostParams::default(), &node(&in_member, "10.250.0.128/25")).await.unwrap();
    let (status, reason, message) = condition_becomes(
        &training,
        (MEMBER, keys::CONDITION_POD_NETWORK_OVERLAP, "True"),
        Duration::from_secs(60),
        "PodNetworkOverlap True on the member",
    )
    .await;
    eprintln!("{status} {reason}: {message}");
    assert_eq!(reason, keys::REASON_POD_NETWORK_OVERLAPS);
    assert!(message.contains("10.250.0.128/25") && message.contains("10.250.0.0/24"), "{message}");
    assert!(message.contains("the training cluster"), "{message}");

    member_nodes.delete(&in_member, &DeleteParams::default()).await.unwrap();
    condition_becomes(
        &training,
        (MEMBER, keys::CONDITION_POD_NETWORK_OVERLAP, "False"),
        Duration::from_secs(60),
        "PodNetworkOverlap False once the node is gone",
    )
    .await;
    // A pod network the member's admin declares (`spec.podCIDRs`) is the one compared.
    let declared = json!({"spec": {"podCIDRs": ["10.250.0.64/26"]}});
    let members = Api::<MemberCluster>::all(training.clone());
    members.patch(MEMBER, &PatchParams::default(), &Patch::Merge(&declared)).await.unwrap();
    let (_, _, message) = condition_becomes(
        &training,
        (MEMBER, keys::CONDITION_POD_NETWORK_OVERLAP, "True"),
        Duration::from_secs(60),
        "PodNetworkOverlap True for the declared network",
    )
    .await;
    assert!(message.contains("10.250.0.64/26"), "{message}");
    training_nodes.delete(&in_training, &DeleteParams::default()).await.unwrap();
    members.delete(MEMBER, &DeleteParams::default()).await.unwrap();
}
