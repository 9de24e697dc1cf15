//! Tests of the capacity model: the views, the policy, publication and the reference model.

use super::*;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;
use std::collections::BTreeSet;
use tidepool_api::crd::{PoolMode, PoolToleration};
use tidepool_api::{Resources, keys};

fn node(name: &str, alloc: &[(&str, &str)]) -> NodeView {
    NodeView {
        name: name.into(),
        ready: true,
        allocatable: Resources::from_pairs(alloc.iter().copied()).unwrap(),
        ..Default::default()
    }
}

#[test]
fn online_demand_counts_for_a_dedicated_pool_only_if_it_tolerates_the_taint() {
    let mut dedicated = node("dedicated", &[("cpu", "8")]);
    dedicated.taints = vec![HardTaint { key: "lend".into(), value: None, effect: "NoSchedule".into() }];
    let lend = PoolToleration { key: Some("lend".into()), operator: Some("Exists".into()), ..Default::default() };
    let pending = |tolerations: Vec<PoolToleration>| PodView {
        requests: Resources::from_pairs([("cpu", "3")]).unwrap(),
        online: OnlineParts::boxed(BTreeMap::new(), tolerations, None),
        ..Default::default()
    };
    let pool: Vec<&NodeView> =
        [&dedicated].into_iter().filter(|n| n.tolerated_by(std::slice::from_ref(&lend))).collect();
    let hpa = |tolerations: Vec<PoolToleration>| HpaView {
        max_replicas: 2,
        current_replicas: 1,
        per_replica: Resources::from_pairs([("cpu", "2")]).unwrap(),
        tolerations,
        ..Default::default()
    };
    let capacity = |pods: &[PodView], hpas: &[HpaView]| {
        let policy = CapacityPolicy { hpa_percent: 100, ..Default::default() };
        let demand = OnlineDemand { policy: &policy, hpas, to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
        pool_capacity_under(pool.iter().copied(), pods, &BTreeMap::new(), &demand).capacity
    };
    let cpu = |n: &str| Resources::from_pairs([("cpu", n)]).unwrap();
    // Neither the pending pod nor the HPA's replicas could go there: all 8 CPUs lend.
    assert_eq!(capacity(&[pending(vec![])], &[hpa(vec![])]), cpu("8"));
    // Tolerating the taint, they could: 3 pending and 2 of headroom are held back.
    assert_eq!(capacity(&[pending(vec![lend.clone()])], &[hpa(vec![lend.clone()])]), cpu("3"));
}

#[test]
fn a_tainted_node_lends_only_to_a_pool_whose_copies_tolerate_its_taints() {
    let mut dedicated = node("dedicated", &[("cpu", "8")]);
    dedicated.taints = vec![HardTaint { key: "lend".into(), value: Some("yes".into()), effect: "NoSchedule".into() }];
    let nodes = [node("plain", &[("cpu", "4")]), dedicated];
    let untolerated: Vec<&NodeView> = nodes.iter().filter(|n| n.tolerated_by(&[])).collect();
    assert_eq!(
        pool_capacity(untolerated, [], &BTreeMap::new()).capacity,
        Resources::from_pairs([("cpu", "4")]).unwrap()
    );
    let lend = PoolToleration {
        key: Some("lend".into()),
        value: Some("yes".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    };
    let tolerated: Vec<&NodeView> = nodes.iter().filter(|n| n.tolerated_by(std::slice::from_ref(&lend))).collect();
    assert_eq!(
        pool_capacity(tolerated, [], &BTreeMap::new()).capacity,
        Resources::from_pairs([("cpu", "12")]).unwrap()
    );
}

fn pod(node: &str, req: &[(&str, &str)]) -> PodView {
    PodView {
        node: Some(node.into()),
        requests: Resources::from_pairs(req.iter().copied()).unwrap(),
        ..Default::default()
    }
}

fn r(pairs: &[(&str, &str)]) -> Resources {
    Resources::from_pairs(pairs.iter().copied()).unwrap()
}

#[test]
fn a_koordinator_pool_lends_the_batch_allocatable_minus_what_batch_pods_request_there() {
    // Two nodes of 16 cores. a: the agent lends 10 cores and 30 Gi, 14 cores of online
    // requests (already out of the batch amount), 2 of another batch pod, 3 of an
    // offload copy, 1 GPU online of 4. b: no agent publishes there, so it lends nothing.
    let mut a = node("a", &[("cpu", "16"), ("memory", "64Gi"), ("nvidia.com/gpu", "4")]);
    a.allocatable.add(&r(&[("kubernetes.io/batch-cpu", "10000"), ("kubernetes.io/batch-memory", "30Gi")]));
    let b = node("b", &[("cpu", "16"), ("memory", "64Gi")]);
    let mut copy = pod("a", &[("kubernetes.io/batch-cpu", "3000"), ("kubernetes.io/batch-memory", "4Gi")]);
    copy.offload = true;
    copy.origin_uid = Some("u".into());
    let pods = [
        pod("a", &[("cpu", "14"), ("memory", "40Gi"), ("nvidia.com/gpu", "1")]),
        pod("a", &[("kubernetes.io/batch-cpu", "2000"), ("kubernetes.io/batch-memory", "6Gi")]),
        copy,
        pod("b", &[("kubernetes.io/batch-cpu", "1000")]),
    ];
    let policy = CapacityPolicy { reserve: r(&[("cpu", "1")]), ..Default::default() };
    let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
    let c = pool_capacity_in(&[a, b], &pods, &BTreeMap::new(), &demand, PoolMode::KoordinatorBatch);
    // 10 − 2 (other batch) − 1 (reserve) = 7 cores; 30 − 6 = 24 Gi; 4 − 1 GPUs.
    assert_eq!(c.capacity, r(&[("cpu", "7"), ("memory", "24Gi"), ("nvidia.com/gpu", "3")]));
    assert_eq!(c.used, r(&[("cpu", "3"), ("memory", "4Gi")]));
    assert_eq!(c.nodes, 1);
    // Free on a: 10 − 2 − 3 cores, 30 − 6 − 4 Gi, 3 GPUs.
    assert_eq!(
        c.free_per_node.iter().map(|n| n.free.clone()).collect::<Vec<_>>(),
        vec![r(&[("cpu", "5"), ("memory", "20Gi"), ("nvidia.com/gpu", "3")])]
    );
    // The same nodes in requests mode: 16 − 14 + 16 cores, the batch names untouched.
    let plain =
        pool_capacity_in(&[node("a", &[("cpu", "16")])], &pods[..1], &BTreeMap::new(), &demand, PoolMode::Requests);
    assert_eq!(plain.capacity.get("cpu"), 1000);
}

#[test]
fn a_katalyst_pool_shrinks_with_the_reclaimed_allocatable_into_a_deficit() {
    let with = |reclaimed: &str| {
        let mut n = node("n", &[("cpu", "32")]);
        n.allocatable.add(&r(&[("resource.katalyst.kubewharf.io/reclaimed_millicpu", reclaimed)]));
        n
    };
    let mut copy = pod("n", &[("resource.katalyst.kubewharf.io/reclaimed_millicpu", "6k")]);
    copy.offload = true;
    let capacity = |n: NodeView| {
        let policy = CapacityPolicy::default();
        let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
        pool_capacity_in(&[n], std::slice::from_ref(&copy), &BTreeMap::new(), &demand, PoolMode::KatalystReclaimed)
    };
    assert_eq!(capacity(with("8k")).deficit(), r(&[("cpu", "0")]));
    // Online usage rose: the agent reclaims only 4 cores now, 2 of the copy's 6 are owed.
    assert_eq!(capacity(with("4k")).deficit(), r(&[("cpu", "2")]));
}

#[test]
fn surplus_is_allocatable_minus_online_requests() {
    let nodes = [node("a", &[("cpu", "8"), ("nvidia.com/gpu", "8")]), node("b", &[("cpu", "8")])];
    let pods = [pod("a", &[("cpu", "3"), ("nvidia.com/gpu", "2")]), pod("b", &[("cpu", "500m")])];
    let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
    assert_eq!(c.capacity, r(&[("cpu", "12500m"), ("nvidia.com/gpu", "6")]));
    assert_eq!(c.nodes, 2);
}

#[test]
fn nodes_that_are_not_ready_or_cordoned_lend_nothing() {
    let mut sick = node("sick", &[("cpu", "8")]);
    sick.ready = false;
    let mut cordoned = node("cordoned", &[("cpu", "8")]);
    cordoned.unschedulable = true;
    let nodes = [sick, cordoned, node("ok", &[("cpu", "2")])];
    let pods = [pod("sick", &[("cpu", "1")])];
    let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
    assert_eq!(c.capacity, r(&[("cpu", "2")]));
    assert_eq!(c.nodes, 1);
}

#[test]
fn offload_pods_count_as_used_not_as_online() {
    let nodes = [node("a", &[("cpu", "8")])];
    let mut offload = pod("a", &[("cpu", "2")]);
    offload.offload = true;
    let c = pool_capacity(&nodes, &[offload], &BTreeMap::new());
    assert_eq!(c.capacity, r(&[("cpu", "8")]));
    assert_eq!(c.used, r(&[("cpu", "2")]));
}

#[test]
fn finished_and_pending_pods_hold_nothing_on_a_node() {
    let nodes = [node("a", &[("cpu", "8")])];
    let mut done = pod("a", &[("cpu", "4")]);
    done.terminated = true;
    // A pending offload pod is not online demand (pending online pods are, see below).
    let pending = PodView { node: None, requests: r(&[("cpu", "4")]), offload: true, ..Default::default() };
    let c = pool_capacity(&nodes, &[done, pending], &BTreeMap::new());
    assert_eq!(c.capacity, r(&[("cpu", "8")]));
}

#[test]
fn the_selector_picks_the_pool_and_a_homogeneous_gpu_model_is_reported() {
    let mut g1 = node("g1", &[("nvidia.com/gpu", "8")]);
    g1.labels.insert("pool".into(), "gpu".into());
    g1.labels.insert(GPU_PRODUCT_LABEL.into(), "H100".into());
    let mut g2 = g1.clone();
    g2.name = "g2".into();
    let c1 = node("c1", &[("cpu", "32")]);
    let selector = BTreeMap::from([("pool".to_string(), "gpu".to_string())]);
    let c = pool_capacity(&[g1, g2, c1], &[], &selector);
    assert_eq!(c.capacity, r(&[("nvidia.com/gpu", "16")]));
    assert_eq!(c.gpu_product.as_deref(), Some("H100"));
}

#[test]
fn each_node_record_has_its_name_and_only_the_topology_and_gpu_model_labels() {
    let labelled = |name: &str, rack: &str, gpus: &str| {
        let mut n = node(name, &[("nvidia.com/gpu", gpus)]);
        n.labels.insert("example.com/rack".into(), rack.into());
        n.labels.insert("topology.kubernetes.io/zone".into(), "z1".into());
        n.labels.insert("kubernetes.io/hostname".into(), name.into());
        n.labels.insert(GPU_PRODUCT_LABEL.into(), "H100".into());
        n
    };
    let nodes = [labelled("a", "r1", "4"), labelled("b", "r2", "8"), node("c", &[("amd.com/gpu", "2")])];
    let mut c = pool_capacity(&nodes, &[], &BTreeMap::new());
    let keys = vec!["topology.kubernetes.io/zone".to_owned(), "example.com/rack".to_owned()];
    c.label_topology(&keys, |name| nodes.iter().find(|n| n.name == name));
    assert_eq!(c.topology, keys);
    // Most devices first, whatever their vendor: b (8), a (4), c (2 AMD GPUs).
    let names: Vec<&str> = c.free_per_node.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["b", "a", "c"]);
    let want = BTreeMap::from([
        ("example.com/rack".to_owned(), "r2".to_owned()),
        ("topology.kubernetes.io/zone".to_owned(), "z1".to_owned()),
        (GPU_PRODUCT_LABEL.to_owned(), "H100".to_owned()),
    ]);
    assert_eq!(c.free_per_node[0].labels, want, "no hostname: only what the planner reads");
    assert!(c.free_per_node[2].labels.is_empty());
}

#[test]
fn free_capacity_is_kept_per_node_with_offload_pods_subtracted() {
    let nodes = [node("a", &[("nvidia.com/gpu", "8")]), node("b", &[("nvidia.com/gpu", "8")])];
    let mut offload = pod("a", &[("nvidia.com/gpu", "6")]);
    offload.offload = true;
    let online = pod("b", &[("nvidia.com/gpu", "1")]);
    let c = pool_capacity(&nodes, &[offload, online], &BTreeMap::new());
    let gpus: Vec<i64> = c.free_per_node.iter().map(|f| f.free.get(GPU)).collect();
    assert_eq!(gpus, [7000, 2000]);
    assert_eq!(c.capacity.get(GPU), 15_000);
}

#[test]
fn the_deficit_is_what_offload_pods_use_beyond_the_capacity() {
    let nodes = [node("a", &[("cpu", "8"), ("nvidia.com/gpu", "8")])];
    let mut offload = pod("a", &[("cpu", "2"), ("nvidia.com/gpu", "6")]);
    offload.offload = true;
    offload.origin_uid = Some("u1".into());
    let online = pod("a", &[("cpu", "1"), ("nvidia.com/gpu", "4")]);
    let c = pool_capacity(&nodes, &[offload, online], &BTreeMap::new());
    // capacity: 8−4 = 4 GPUs, 7 cpu; used: 6 GPUs, 2 cpu → deficit 2 GPUs, no cpu.
    assert_eq!(c.deficit(), r(&[("cpu", "0"), ("nvidia.com/gpu", "2")]));
    assert_eq!(c.placed.get("u1").map(|p| &*p.node), Some("a"));
}

fn policy(reserve: &[(&str, &str)], watermark: u32) -> CapacityPolicy {
    CapacityPolicy { reserve: r(reserve), watermark_percent: watermark, ..Default::default() }
}

fn under(nodes: &[NodeView], pods: &[PodView], policy: &CapacityPolicy, hpas: &[HpaView], now: &str) -> PoolCapacity {
    let demand = OnlineDemand { policy, hpas, to_come: &[], now: now.parse().unwrap() };
    pool_capacity_under(nodes, pods, &BTreeMap::new(), &demand)
}

#[test]
fn the_reserve_is_held_back_and_the_watermark_applies_to_the_rest() {
    let nodes = [node("a", &[("cpu", "100"), ("nvidia.com/gpu", "8")])];
    let c = under(&nodes, &[], &policy(&[("cpu", "20"), ("nvidia.com/gpu", "2")], 50), &[], "2026-11-30T12:00:00Z");
    assert_eq!(c.capacity, r(&[("cpu", "40"), ("nvidia.com/gpu", "3")]));
    assert_eq!(c.held_back, r(&[("cpu", "20"), ("nvidia.com/gpu", "2")]));
}

#[test]
fn a_window_reserves_from_its_start_to_its_end_only() {
    let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
    let mut p = policy(&[], 100);
    p.windows.push(Window {
        name: "evening".into(),
        schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
        duration: jiff::SignedDuration::from_hours(2),
        lead: jiff::SignedDuration::ZERO,
        reserve: r(&[("nvidia.com/gpu", "6")]),
    });
    let gpus = |now: &str| under(&nodes, &[], &p, &[], now).capacity.get(GPU);
    assert_eq!(gpus("2026-11-30T17:59:59Z"), 8000);
    assert_eq!(gpus("2026-11-30T18:00:00Z"), 2000);
    assert_eq!(gpus("2026-11-30T19:59:59Z"), 2000);
    assert_eq!(gpus("2026-11-30T20:00:00Z"), 8000);
}

/// The lead brings the reservation forward to the second, not to a minute boundary (cron
/// has minute granularity; the lead does not), and not a second earlier.
#[test]
fn a_window_reserves_from_exactly_its_lead_time_before_the_start() {
    let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
    let mut p = policy(&[], 100);
    p.windows.push(Window {
        name: "evening".into(),
        schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
        duration: jiff::SignedDuration::from_mins(30),
        lead: jiff::SignedDuration::from_secs(75),
        reserve: r(&[("nvidia.com/gpu", "6")]),
    });
    let gpus = |now: &str| under(&nodes, &[], &p, &[], now).capacity.get(GPU);
    assert_eq!(gpus("2026-11-30T17:58:44Z"), 8000, "one second before the lead");
    assert_eq!(gpus("2026-11-30T17:58:44.999Z"), 8000, "a moment before the lead");
    assert_eq!(gpus("2026-11-30T17:58:45Z"), 2000, "at the lead");
    assert_eq!(gpus("2026-11-30T17:59:30Z"), 2000, "between the lead and the start");
    assert_eq!(gpus("2026-11-30T18:29:59Z"), 2000, "just before the end");
    assert_eq!(gpus("2026-11-30T18:30:00Z"), 8000, "at the end");
}

#[test]
fn hpa_headroom_is_growth_times_replica_requests_times_factor() {
    let nodes = [node("a", &[("cpu", "64")])];
    let hpa = HpaView { max_replicas: 10, current_replicas: 4, per_replica: r(&[("cpu", "2")]), ..Default::default() };
    let mut p = policy(&[], 100);
    p.hpa_percent = 50;
    // (10 − 4) × 2 cpu × 50% = 6 cpu.
    assert_eq!(under(&nodes, &[], &p, std::slice::from_ref(&hpa), "2026-11-30T12:00:00Z").capacity.get("cpu"), 58_000);
    // An HPA whose pods cannot land in the pool holds nothing back there.
    let elsewhere = HpaView { node_selector: BTreeMap::from([("pool".into(), "cpu".into())]), ..hpa };
    assert_eq!(under(&nodes, &[], &p, &[elsewhere], "2026-11-30T12:00:00Z").capacity.get("cpu"), 64_000);
}

#[test]
fn replicas_yet_to_come_are_held_back_in_full_where_they_could_land() {
    let nodes = [node("a", &[("nvidia.com/gpu", "16")])];
    let policy = CapacityPolicy { hpa_percent: 50, ..Default::default() };
    let to_come = [
        ReplicasToCome { replicas: 4, per_replica: r(&[("nvidia.com/gpu", "2")]), ..Default::default() },
        ReplicasToCome {
            replicas: 3,
            per_replica: r(&[("nvidia.com/gpu", "1")]),
            node_selector: BTreeMap::from([("pool".into(), "cpu".into())]),
            ..Default::default()
        },
    ];
    let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &to_come, now: jiff::Timestamp::UNIX_EPOCH };
    let c = pool_capacity_under(&nodes, &[], &BTreeMap::new(), &demand);
    // 16 − 4 × 2: in full, not scaled by the HPA factor (they are asked for); the
    // replicas that could not land here hold nothing back.
    assert_eq!(c.capacity.get(GPU), 8000);
    assert_eq!(c.held_back.get(GPU), 8000);
}

#[test]
fn a_member_pod_view_is_small_and_an_offload_pod_boxes_no_online_parts() {
    // One view per member pod, in a table of thousands: the online-only parts are boxed.
    assert!(std::mem::size_of::<PodView>() <= 96, "PodView is {} bytes", std::mem::size_of::<PodView>());
    let copy: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "c", "uid": "copy", "labels": {keys::LABEL_ORIGIN_UID: "origin"}},
        "spec": {"nodeName": "n1", "nodeSelector": {"pool": "gpu"}, "containers": []},
    }))
    .unwrap();
    let view = PodView::from_pod(&copy);
    assert!(view.online.is_none() && view.node_selector().is_empty());
    let pending: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "lend", "operator": "Exists"}], "containers": []},
    }))
    .unwrap();
    let view = PodView::from_pod(&pending);
    assert_eq!(view.node_selector(), &BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]));
    assert_eq!(view.tolerations().len(), 1);
}

#[test]
fn a_pod_names_its_deployment_through_its_replica_set_or_its_stateful_set() {
    let pod = |kind: &str, owner: &str, hash: Option<&str>| -> Pod {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind,
                         "name": owner, "uid": "u", "controller": true}]},
        }))
        .unwrap();
        if let Some(h) = hash {
            p.metadata.labels = Some(BTreeMap::from([("pod-template-hash".to_owned(), h.to_owned())]));
        }
        p
    };
    let of = |p: &Pod| PodView::from_pod(p).workload().map(|(k, n)| (k, n.to_string()));
    assert_eq!(of(&pod("ReplicaSet", "web-6b9f7c", Some("6b9f7c"))), Some(("Deployment", "web".into())));
    assert_eq!(of(&pod("StatefulSet", "db", None)), Some(("StatefulSet", "db".into())));
    // A ReplicaSet of its own (no template hash of its name), or another controller.
    assert_eq!(of(&pod("ReplicaSet", "web", Some("6b9f7c"))), None);
    assert_eq!(of(&pod("ReplicaSet", "web-6b9f7c", None)), None);
    assert_eq!(of(&pod("Job", "batch", None)), None);
    // An offload copy is nobody's replica.
    let mut copy = pod("StatefulSet", "db", None);
    copy.metadata.labels = Some(BTreeMap::from([(keys::LABEL_ORIGIN_UID.to_owned(), "u1".to_owned())]));
    assert_eq!(of(&copy), None);
}

#[test]
fn pending_online_pods_are_subtracted_at_once() {
    let nodes = [node("a", &[("nvidia.com/gpu", "8")])];
    let pending = PodView { requests: r(&[("nvidia.com/gpu", "3")]), ..Default::default() };
    let mut pending_offload = pending.clone();
    pending_offload.offload = true;
    let c = under(&nodes, &[pending, pending_offload], &policy(&[], 100), &[], "2026-11-30T12:00:00Z");
    assert_eq!(c.capacity.get(GPU), 5000);
}

#[test]
fn overcommitted_nodes_clamp_at_zero() {
    let nodes = [node("a", &[("cpu", "1")])];
    let pods = [pod("a", &[("cpu", "3")])];
    assert_eq!(pool_capacity(&nodes, &pods, &BTreeMap::new()).capacity.get("cpu"), 0);
}

#[test]
fn requests_follow_the_scheduler_rules() {
    let spec: k8s_openapi::api::core::v1::PodSpec = serde_json::from_value(serde_json::json!({
        "containers": [
            {"name": "a", "resources": {"requests": {"cpu": "1"}}},
            {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "2"}, "requests": {"cpu": "500m"}}}
        ],
        "initContainers": [
            {"name": "big-init", "resources": {"requests": {"cpu": "4"}}},
            {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"memory": "1Gi"}}}
        ],
        "overhead": {"cpu": "100m"}
    }))
    .unwrap();
    // containers: cpu 1.5, gpu 2; init max cpu 4; sidecar memory; overhead 100m; one pod.
    assert_eq!(pod_requests(&spec), r(&[("cpu", "4100m"), ("nvidia.com/gpu", "2"), ("memory", "1Gi"), ("pods", "1")]));
}

proptest! {
    #[test]
    fn capacity_is_never_negative_and_never_above_allocatable(
        allocs in proptest::collection::vec(0i64..64, 1..6),
        reqs in proptest::collection::vec((0usize..6, 0i64..80, any::<bool>(), any::<bool>()), 0..20),
    ) {
        let nodes: Vec<NodeView> = allocs.iter().enumerate()
            .map(|(i, a)| { let mut n = node(&format!("n{i}"), &[]); n.allocatable.set("cpu", a * 1000); n })
            .collect();
        let pods: Vec<PodView> = reqs.iter().map(|(n, cpu, offload, terminated)| {
            let mut p = pod(&format!("n{n}"), &[]);
            p.requests.set("cpu", cpu * 1000);
            p.offload = *offload;
            p.terminated = *terminated;
            p
        }).collect();
        let c = pool_capacity(&nodes, &pods, &BTreeMap::new());
        let total: i64 = allocs.iter().sum::<i64>() * 1000;
        prop_assert!(c.capacity.get("cpu") >= 0);
        prop_assert!(c.capacity.get("cpu") <= total);
    }

    #[test]
    fn holding_back_more_never_lends_more(
        alloc in 0i64..256, reserve in 0i64..300, extra in 0i64..300, watermark in 1u32..=100,
    ) {
        let nodes = [{ let mut n = node("a", &[]); n.allocatable.set("cpu", alloc * 1000); n }];
        let lend = |res: i64| {
            let mut p = policy(&[], watermark);
            p.reserve.set("cpu", res * 1000);
            under(&nodes, &[], &p, &[], "2026-11-30T12:00:00Z").capacity.get("cpu")
        };
        let (a, b) = (lend(reserve), lend(reserve + extra));
        prop_assert!(b <= a);
        prop_assert!(b >= 0);
        prop_assert!(a <= alloc * 1000);
    }
}

// ---- model-based property: the capacity formula re-done on plain numbers ----

/// The resources of the model. Cases are written in whole units; the model and the
/// comparison work in milli-units, as the product does.
const DIMS: [&str; 3] = [GPU, "cpu", "memory"];
const M: i64 = 1000;

/// A pool's nodes and pods as plain numbers: what the model computes from.
#[derive(Debug, Clone)]
struct Case {
    nodes: Vec<CaseNode>,
    pods: Vec<CasePod>,
    /// Whether the pool is the `pool=gpu` nodes (else every node).
    gpu_pool: bool,
    reserve: [i64; 3],
    watermark: u32,
    hpa_percent: u32,
    /// (max, current, selector, per replica)
    hpas: Vec<(i32, i32, Sel, [i64; 3])>,
    /// (replicas, selector, per replica)
    to_come: Vec<(i32, Sel, [i64; 3])>,
    /// A window firing daily at 18:00 UTC: (duration minutes, lead seconds, reserve).
    window: Option<(i64, i64, [i64; 3])>,
    /// Seconds after 2026-11-30T00:00:00Z.
    now: i64,
}

/// (ready, cordoned, label `pool=gpu` (else `pool=cpu`), GPU model 0/1/none, allocatable)
type CaseNode = (bool, bool, bool, Option<u8>, [i64; 3]);
/// (node index or pending, terminated, offload, selector, requests)
type CasePod = (Option<usize>, bool, bool, Sel, [i64; 3]);

/// A node selector of a pod, an HPA or a workload.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sel {
    Any,
    Gpu,
    Cpu,
}

impl Sel {
    fn map(self) -> BTreeMap<String, String> {
        match self {
            Sel::Any => BTreeMap::new(),
            Sel::Gpu => BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]),
            Sel::Cpu => BTreeMap::from([("pool".to_owned(), "cpu".to_owned())]),
        }
    }

    /// Whether a node labelled `pool=gpu` (`gpu_label`) or `pool=cpu` matches.
    fn admits(self, gpu_label: bool) -> bool {
        match self {
            Sel::Any => true,
            Sel::Gpu => gpu_label,
            Sel::Cpu => !gpu_label,
        }
    }
}

const DAY0: i64 = 1_795_996_800; // 2026-11-30T00:00:00Z

fn units(v: [i64; 3]) -> Resources {
    let mut r = Resources::new();
    for (name, x) in DIMS.iter().zip(v) {
        r.set(name, x * M);
    }
    r
}

/// What the model expects, per resource in milli-units.
#[derive(Debug, PartialEq)]
struct Expected {
    capacity: [i64; 3],
    used: [i64; 3],
    held_back: [i64; 3],
    nodes: u32,
    gpu_product: Option<String>,
    /// Sorted, largest first.
    free_per_node: Vec<[i64; 3]>,
    placed: BTreeMap<String, String>,
}

/// The capacity formula of the module docs, written out without any of the code above.
fn model(c: &Case) -> Expected {
    let in_pool: Vec<usize> = (0..c.nodes.len())
        .filter(|&i| {
            let (ready, cordoned, gpu_label, _, _) = c.nodes[i];
            ready && !cordoned && (!c.gpu_pool || gpu_label)
        })
        .collect();
    let could_land = |s: Sel| in_pool.iter().any(|&i| s.admits(c.nodes[i].2));
    let mut surplus = [0i64; 3];
    let mut free: Vec<[i64; 3]> = Vec::new();
    let mut used = [0i64; 3];
    let mut placed = BTreeMap::new();
    for &i in &in_pool {
        let alloc = c.nodes[i].4.map(|x| x * M);
        let mut f = alloc;
        for (k, (node, terminated, offload, _, req)) in c.pods.iter().enumerate() {
            if *node != Some(i) || *terminated {
                continue;
            }
            for d in 0..3 {
                f[d] -= req[d] * M;
                if *offload {
                    used[d] += req[d] * M;
                } else {
                    surplus[d] -= req[d] * M;
                }
            }
            if *offload {
                placed.insert(format!("origin-{k}"), format!("n{i}"));
            }
        }
        for d in 0..3 {
            surplus[d] += alloc[d];
        }
        free.push(f.map(|x| x.max(0)));
    }
    let mut held = c.reserve.map(|x| x * M);
    if let Some((minutes, lead, reserve)) = c.window {
        // Firings at 18:00 of the day before, the day and the day after `now`'s day.
        let active = (-1..=2).any(|day| {
            let start = day * 86_400 + 18 * 3600;
            start - lead <= c.now && c.now < start + minutes * 60
        });
        if active {
            for d in 0..3 {
                held[d] += reserve[d] * M;
            }
        }
    }
    for &(max, current, sel, per) in &c.hpas {
        if could_land(sel) {
            let growth = i64::from((max - current).max(0));
            for d in 0..3 {
                held[d] += per[d] * M * growth * i64::from(c.hpa_percent) / 100;
            }
        }
    }
    for &(replicas, sel, per) in &c.to_come {
        if could_land(sel) {
            for d in 0..3 {
                held[d] += per[d] * M * i64::from(replicas.max(0));
            }
        }
    }
    for (node, terminated, offload, sel, req) in &c.pods {
        if node.is_none() && !terminated && !offload && could_land(*sel) {
            for d in 0..3 {
                held[d] += req[d] * M;
            }
        }
    }
    let capacity = std::array::from_fn(|d| (surplus[d] - held[d]).max(0) * i64::from(c.watermark) / 100);
    free.sort_by(|a, b| b.cmp(a));
    let models: BTreeSet<Option<u8>> = in_pool.iter().map(|&i| c.nodes[i].3).collect();
    let gpu_product = match models.iter().collect::<Vec<_>>()[..] {
        [Some(m)] => Some(format!("model-{m}")),
        _ => None,
    };
    Expected { capacity, used, held_back: held, nodes: in_pool.len() as u32, gpu_product, free_per_node: free, placed }
}

/// The same case as views, through the function under test.
fn product(c: &Case) -> Expected {
    let nodes: Vec<NodeView> = c
        .nodes
        .iter()
        .enumerate()
        .map(|(i, (ready, cordoned, gpu_label, gpu_model, alloc))| {
            let mut labels = BTreeMap::from([("pool".to_owned(), if *gpu_label { "gpu" } else { "cpu" }.to_owned())]);
            if let Some(m) = gpu_model {
                labels.insert(GPU_PRODUCT_LABEL.to_owned(), format!("model-{m}"));
            }
            NodeView {
                name: format!("n{i}"),
                labels,
                ready: *ready,
                unschedulable: *cordoned,
                allocatable: units(*alloc),
                ..Default::default()
            }
        })
        .collect();
    let pods: Vec<PodView> = c
        .pods
        .iter()
        .enumerate()
        .map(|(k, (node, terminated, offload, sel, req))| PodView {
            node: node.map(|i| format!("n{i}").into()),
            requests: units(*req),
            terminated: *terminated,
            offload: *offload,
            origin_uid: offload.then(|| format!("origin-{k}").into()),
            uid: offload.then(|| format!("copy-{k}").into()),
            online: OnlineParts::boxed(sel.map(), Vec::new(), None),
            ..Default::default()
        })
        .collect();
    let mut policy = CapacityPolicy {
        reserve: units(c.reserve),
        watermark_percent: c.watermark,
        hpa_percent: c.hpa_percent,
        windows: vec![],
    };
    if let Some((minutes, lead, reserve)) = c.window {
        policy.windows.push(Window {
            name: "evening".into(),
            schedule: tidepool_api::cron::Schedule::parse("0 18 * * *").unwrap(),
            duration: jiff::SignedDuration::from_mins(minutes),
            lead: jiff::SignedDuration::from_secs(lead),
            reserve: units(reserve),
        });
    }
    let hpas: Vec<HpaView> = c
        .hpas
        .iter()
        .map(|(max, current, sel, per)| HpaView {
            max_replicas: *max,
            current_replicas: *current,
            per_replica: units(*per),
            node_selector: sel.map(),
            ..Default::default()
        })
        .collect();
    let to_come: Vec<ReplicasToCome> = c
        .to_come
        .iter()
        .map(|(replicas, sel, per)| ReplicasToCome {
            replicas: *replicas,
            per_replica: units(*per),
            node_selector: sel.map(),
            ..Default::default()
        })
        .collect();
    let now = jiff::Timestamp::from_second(DAY0 + c.now).unwrap();
    let demand = OnlineDemand { policy: &policy, hpas: &hpas, to_come: &to_come, now };
    let selector = if c.gpu_pool { Sel::Gpu.map() } else { BTreeMap::new() };
    let got = pool_capacity_under(&nodes, &pods, &selector, &demand);
    let whole = |r: &Resources| DIMS.map(|d| r.get(d));
    let mut free_per_node: Vec<[i64; 3]> = got.free_per_node.iter().map(|n| whole(&n.free)).collect();
    free_per_node.sort_by(|a, b| b.cmp(a));
    Expected {
        capacity: whole(&got.capacity),
        used: whole(&got.used),
        held_back: whole(&got.held_back),
        nodes: got.nodes,
        gpu_product: got.gpu_product.clone(),
        free_per_node,
        placed: got.placed.iter().map(|(uid, p)| (uid.to_string(), p.node.to_string())).collect(),
    }
}

fn arb_amounts(max: i64) -> impl Strategy<Value = [i64; 3]> {
    (0..=max, 0..=max, 0..=max).prop_map(|(a, b, c)| [a, b, c])
}

fn arb_sel() -> impl Strategy<Value = Sel> {
    prop_oneof![Just(Sel::Any), Just(Sel::Gpu), Just(Sel::Cpu)]
}

fn arb_case() -> impl Strategy<Value = Case> {
    let nodes = proptest::collection::vec(
        (
            prop::bool::weighted(0.85),
            prop::bool::weighted(0.15),
            any::<bool>(),
            proptest::option::of(0u8..2),
            arb_amounts(16),
        ),
        0..5,
    );
    let pods = proptest::collection::vec(
        (
            proptest::option::weighted(0.8, 0usize..6),
            prop::bool::weighted(0.2),
            any::<bool>(),
            arb_sel(),
            arb_amounts(6),
        ),
        0..10,
    );
    let hpas = proptest::collection::vec((0i32..8, 0i32..8, arb_sel(), arb_amounts(3)), 0..3);
    let to_come = proptest::collection::vec((-1i32..4, arb_sel(), arb_amounts(3)), 0..3);
    let window = proptest::option::of((1i64..240, 0i64..3600, arb_amounts(8)));
    (
        nodes,
        pods,
        any::<bool>(),
        arb_amounts(8),
        prop_oneof![Just(100u32), 1u32..=100],
        // Tens of percent, so every amount stays a multiple of 100 milli-units and the
        // watermark's rounding cannot differ between the model and the product.
        (0u32..=20).prop_map(|p| p * 10),
        hpas,
        to_come,
        window,
        0i64..(2 * 86_400),
    )
        .prop_map(|(nodes, pods, gpu_pool, reserve, watermark, hpa_percent, hpas, to_come, window, now)| Case {
            nodes,
            pods,
            gpu_pool,
            reserve,
            watermark,
            hpa_percent,
            hpas,
            to_come,
            window,
            now,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn the_capacity_of_any_pool_is_what_the_formula_gives_on_its_nodes_and_pods(c in arb_case()) {
        prop_assert_eq!(product(&c), model(&c));
    }
}

#[test]
fn the_model_itself_is_not_trivially_zero() {
    // One node of 10 cpu with 3 cpu online, 2 cpu offload, 1 cpu reserved, 50 %:
    // capacity (10 − 3 − 1) × 50 % = 3, used 2, free on the node 10 − 3 − 2 = 5.
    let c = Case {
        nodes: vec![(true, false, true, Some(0), [0, 10, 0])],
        pods: vec![(Some(0), false, false, Sel::Any, [0, 3, 0]), (Some(0), false, true, Sel::Any, [0, 2, 0])],
        gpu_pool: false,
        reserve: [0, 1, 0],
        watermark: 50,
        hpa_percent: 100,
        hpas: vec![],
        to_come: vec![],
        window: None,
        now: 0,
    };
    let e = model(&c);
    assert_eq!(e.capacity, [0, 3000, 0]);
    assert_eq!(e.used, [0, 2000, 0]);
    assert_eq!(e.free_per_node, [[0, 5000, 0]]);
    assert_eq!(product(&c), e);
}

#[test]
fn small_drifts_of_fungible_resources_wait_and_everything_else_goes_at_once() {
    let base = PoolCapacity {
        capacity: r(&[("cpu", "1000"), ("memory", "4000Gi"), ("nvidia.com/gpu", "16")]),
        used: r(&[("cpu", "10")]),
        nodes: 4,
        free_per_node: vec![NodeFree::new("n1", r(&[("cpu", "250"), ("nvidia.com/gpu", "4")]))],
        ..Default::default()
    };
    let with = |f: &dyn Fn(&mut PoolCapacity)| {
        let mut c = base.clone();
        f(&mut c);
        c
    };
    assert!(!worth_publishing(&base, &base));
    // Under 1 %: held back.
    assert!(!worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 999_000))));
    assert!(!worth_publishing(&base, &with(&|c| c.capacity.set("memory", c.capacity.get("memory") - 1))));
    assert!(!worth_publishing(&base, &with(&|c| c.free_per_node[0].free.set("cpu", 249_000))));
    // Over 1 %, or whole devices, or anything tidepool itself decided: at once.
    assert!(worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 989_000))));
    assert!(worth_publishing(&base, &with(&|c| c.capacity.set("nvidia.com/gpu", 15_000))));
    assert!(worth_publishing(&base, &with(&|c| c.free_per_node[0].free.set("nvidia.com/gpu", 3_000))));
    assert!(worth_publishing(&base, &with(&|c| c.used.set("cpu", 11_000))));
    assert!(worth_publishing(&base, &with(&|c| c.nodes = 3)));
    assert!(worth_publishing(
        &base,
        &with(&|c| {
            let placed = Placed { node: "n1".into(), copy_uid: Some("c1".into()) };
            std::sync::Arc::make_mut(&mut c.placed).insert("uid".into(), placed);
        })
    ));
    assert!(worth_publishing(&base, &with(&|c| c.capacity.set("example.com/fpga", 1_000))));
    // The planner's view of topology: a node relabelled to another rack, or new keys.
    assert!(worth_publishing(
        &base,
        &with(&|c| {
            c.free_per_node[0].labels.insert("example.com/rack".into(), "r2".into());
        })
    ));
    assert!(worth_publishing(&base, &with(&|c| c.topology = vec!["example.com/rack".into()])));
    assert!(worth_publishing(&base, &with(&|c| c.capacity.set("cpu", 0))));
    // A small drift that opens a deficit goes at once: reclaim depends on it.
    let tight = with(&|c| {
        c.capacity.set("cpu", 1_000_000);
        c.used.set("cpu", 1_000_000);
    });
    let mut less = tight.clone();
    less.capacity.set("cpu", 999_000);
    assert!(worth_publishing(&tight, &less));
}
