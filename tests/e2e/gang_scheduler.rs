//! The member's own gang scheduler (`spec.gangScheduler`) end to end, against the real
//! PodGroup CRDs (from `tests/schedulers/build.sh`, installed in member-b): a gang's copies join
//! a PodGroup made before them with the gang's core as `minMember` and go to the gang
//! scheduler; the group goes with the last copy, a group a restart left is collected, a tenant
//! cannot join a group of another namespace, and a member without the CRD is not Ready.
//!
//! The object checks run without a gang scheduler (the copies stay Pending, which is all they
//! need); `member_gang_holds` runs the members' real gang schedulers (scheduler-plugins'
//! Coscheduling, Volcano's scheduler) and shows what they do with the copies.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tidepool_api::crd::GangScheduler;
use tidepool_api::keys;
use tidepool_vk::collect::COLLECT_INTERVAL;
use tidepool_vk::gang_group;

use crate::harness::*;

/// The PodGroup CRD of `scheduler`, from `tests/schedulers/build.sh`'s gang-crds
/// (`TIDEPOOL_GANG_CRDS`), applied to `client`'s cluster and Established.
async fn install_pod_group_crd(client: &Client, scheduler: GangScheduler) {
    let dir = std::env::var("TIDEPOOL_GANG_CRDS").unwrap_or_else(|_| {
        panic!("TIDEPOOL_GANG_CRDS is not set: run tests/run.sh, or export it to the gang-crds directory of the one bash tests/schedulers/build.sh prints")
    });
    let path = std::path::Path::new(&dir).join(format!("{}.yaml", scheduler.as_str()));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let name = crd.name_any();
    api.patch(&name, &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&crd)).await.unwrap();
    wait_for(Duration::from_secs(30), &format!("CRD {name} established"), || {
        let (api, name) = (api.clone(), name.clone());
        async move {
            let crd = api.get(&name).await.ok()?;
            crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
        }
    })
    .await;
}

/// The test's training pods in `ns` bound to `node` by hand or placed by the dispatcher.
fn pod(name: &str, meta: serde_json::Value, spec: serde_json::Value) -> Pod {
    let mut spec = spec;
    spec["containers"] = json!([{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]);
    let mut meta = meta;
    meta["name"] = json!(name);
    serde_json::from_value(json!({"metadata": meta, "spec": spec})).unwrap()
}

/// Member-side PodGroups of `scheduler` in `ns`.
fn groups(member: &Client, scheduler: GangScheduler, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(member.clone(), ns, &scheduler.pod_group_resource())
}

/// The copies of `names` once all exist in member namespace `ns`.
async fn copies(member: &Client, ns: &str, names: &[String]) -> Vec<Pod> {
    let api = Api::<Pod>::namespaced(member.clone(), ns);
    wait_for(Duration::from_secs(60), &format!("copies of {names:?} in {ns}"), || {
        let api = api.clone();
        async move {
            let mut found = Vec::new();
            for n in names {
                found.push(api.get_opt(n).await.ok()??);
            }
            Some(found)
        }
    })
    .await
}

/// Waits until PodGroup `name` is gone, for less than the collector's periodic pass: what
/// deletes it is the event (the last copy going, tidepool starting), not the safety net.
async fn wait_gone(api: &Api<DynamicObject>, name: &str, what: &str) {
    wait_for(COLLECT_INTERVAL / 2, what, || async move { api.get_opt(name).await.ok()?.is_none().then_some(()) }).await;
}

/// A resourceVersion as etcd's revision: one etcd per local cluster, so a later write has a
/// larger one. Opaque to clients in general; here it orders two creations without a clock.
fn revision(meta: &kube::api::ObjectMeta) -> u64 {
    meta.resource_version.as_deref().unwrap().parse().unwrap()
}

/// The group `copy` names for `scheduler` (label or annotation).
fn group_of(copy: &Pod, scheduler: GangScheduler) -> Option<String> {
    let (labels, annotations) = (copy.labels(), copy.annotations());
    match scheduler {
        GangScheduler::Coscheduling => labels.get(keys::LABEL_POD_GROUP).cloned(),
        GangScheduler::Volcano => annotations.get(keys::ANNOTATION_VOLCANO_GROUP).cloned(),
        GangScheduler::Kubernetes => gang_group::group_of(copy, scheduler).map(str::to_owned),
    }
}

/// A gang of 3 placed on member-b with `scheduler`: its PodGroup (minMember 3) is made before
/// its copies, which join it and name the gang scheduler; a tenant of another namespace whose
/// pod names that group (the member letting the keys travel) gets a group of its own instead;
/// deleting the pods deletes the groups, and a stray group found after a restart goes too.
async fn gang_path(scheduler: GangScheduler, test: &str) {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-b").await;
    install_pod_group_crd(&member, scheduler).await;
    let ns = format!("e2e-{test}");
    let other_ns = format!("e2e-{test}-b");
    prepare(&env, &training, test, &ns).await;
    ensure_namespace(&training, &other_ns).await;
    clear_pods(&training, &other_ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, &ns, "member-b", &kubeconfig).await;
    let mc_name = format!("{test}-member-b");
    let mut mc = member_cluster(&mc_name, test, &ns, "member-b");
    mc.spec.gang_scheduler = Some(scheduler);
    // The member lets the group keys through: tidepool must still not let a tenant pick one.
    mc.spec.copy_labels = vec!["scheduling.x-k8s.io/*".into()];
    mc.spec.copy_annotations = vec!["scheduling.k8s.io/*".into()];
    apply_member_cluster(&training, &mc).await;
    let mut tidepool = Tidepool::start(&env, test, &ns);
    let node = format!("tidepool-{mc_name}");
    wait_node(&training, &node).await;

    // 1. A gang of three through the dispatcher.
    let id = run_id();
    let gang = format!("job-{id}");
    let names: Vec<String> = (0..3).map(|i| format!("{gang}-{i}")).collect();
    let pods = Api::<Pod>::namespaced(training.clone(), &ns);
    for n in &names {
        let meta = json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: "3"}});
        pods.create(&PostParams::default(), &pod(n, meta, json!({"schedulerName": scheduler_name(test)})))
            .await
            .unwrap();
    }
    let member_ns = offload_ns(&ns);
    let made = copies(&member, &member_ns, &names).await;
    let group = gang_group::group_name("training", &ns, "gang", &gang);
    // Waited for rather than read at once, so a group made after its copies fails on the
    // order below, not on its absence.
    let pg = wait_for(Duration::from_secs(30), "the gang's PodGroup", || {
        let api = groups(&member, scheduler, &member_ns);
        let group = group.clone();
        async move { api.get_opt(&group).await.ok()? }
    })
    .await;
    assert_eq!(pg.data["spec"]["minMember"], 3, "minMember is the gang's core: {pg:?}");
    let want_scheduler = scheduler.default_scheduler_name();
    for copy in &made {
        assert_eq!(
            group_of(copy, scheduler).as_deref(),
            Some(group.as_str()),
            "{} joins the gang's group",
            copy.name_any()
        );
        let spec = copy.spec.as_ref().unwrap();
        assert_eq!(
            spec.scheduler_name.as_deref(),
            Some(want_scheduler),
            "{} goes to the gang scheduler",
            copy.name_any()
        );
        assert!(revision(&pg.metadata) < revision(&copy.metadata), "the PodGroup was made before {}", copy.name_any());
    }

    // 2. A tenant of another namespace names that group on a pod bound by hand.
    let intruder = format!("intruder-{id}");
    let meta =
        json!({"labels": {keys::LABEL_POD_GROUP: group}, "annotations": {keys::ANNOTATION_VOLCANO_GROUP: group}});
    let spec = json!({"nodeName": node, "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}]});
    let other = Api::<Pod>::namespaced(training.clone(), &other_ns);
    other.create(&PostParams::default(), &pod(&intruder, meta, spec)).await.unwrap();
    let other_member_ns = offload_ns(&other_ns);
    let intruding = copies(&member, &other_member_ns, std::slice::from_ref(&intruder)).await.remove(0);
    let own = gang_group::group_name("training", &other_ns, "podgroup", &group);
    assert_ne!(own, group);
    assert_eq!(group_of(&intruding, scheduler).as_deref(), Some(own.as_str()), "the tenant's copy has its own group");
    let (labels, annotations) = (intruding.labels(), intruding.annotations());
    assert!(labels.get(keys::LABEL_POD_GROUP).is_none_or(|g| *g == own), "{labels:?}");
    assert!(annotations.get(keys::ANNOTATION_VOLCANO_GROUP).is_none_or(|g| *g == own), "{annotations:?}");
    let own_pg = groups(&member, scheduler, &other_member_ns).get(&own).await.unwrap();
    assert_eq!(own_pg.data["spec"]["minMember"], 1, "a pod bound by hand sizes no gang");
    assert!(groups(&member, scheduler, &other_member_ns).get_opt(&group).await.unwrap().is_none());
    let pg = groups(&member, scheduler, &member_ns).get(&group).await.unwrap();
    assert_eq!(pg.data["spec"]["minMember"], 3, "the gang's group is untouched");

    // 3. The group goes with the last copy.
    let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for n in &names[..2] {
        pods.delete(n, &dp).await.unwrap();
    }
    let member_pods = Api::<Pod>::namespaced(member.clone(), &member_ns);
    wait_for(Duration::from_secs(60), "two copies gone", || {
        let member_pods = member_pods.clone();
        let names = names.clone();
        async move {
            for n in &names[..2] {
                member_pods.get_opt(n).await.ok()?.is_none().then_some(())?;
            }
            Some(())
        }
    })
    .await;
    assert!(groups(&member, scheduler, &member_ns).get_opt(&group).await.unwrap().is_some(), "one copy left needs it");
    pods.delete(&names[2], &dp).await.unwrap();
    wait_gone(&groups(&member, scheduler, &member_ns), &group, "the gang's PodGroup gone with its last copy").await;
    other.delete(&intruder, &dp).await.unwrap();
    wait_gone(&groups(&member, scheduler, &other_member_ns), &own, "the tenant's PodGroup gone with its copy").await;

    // 4. A group left while tidepool was down (no copy needs it) is collected when it starts.
    tidepool.kill();
    let stray = format!("tp-gang-stray-{id}");
    let labels = BTreeMap::from([
        (keys::LABEL_MANAGED_BY.to_owned(), keys::MANAGED_BY.to_owned()),
        (keys::LABEL_ORIGIN_CLUSTER.to_owned(), "training".to_owned()),
        (keys::LABEL_ORIGIN_MEMBER.to_owned(), mc_name.clone()),
    ]);
    let mut left = DynamicObject::new(&stray, &scheduler.pod_group_resource()).within(&member_ns);
    left.metadata.labels = Some(labels);
    left.data = json!({"spec": {"minMember": 2}});
    groups(&member, scheduler, &member_ns).create(&PostParams::default(), &left).await.unwrap();
    let _tidepool = Tidepool::start(&env, test, &ns);
    wait_gone(&groups(&member, scheduler, &member_ns), &stray, "the stray PodGroup collected after the restart").await;
}

async fn wait_node(training: &Client, node: &str) {
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), &format!("virtual node {node} Ready"), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(node).await.ok()??;
            n.status?.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn a_gangs_copies_join_a_coscheduling_podgroup_made_before_them_and_it_goes_with_the_last() {
    gang_path(GangScheduler::Coscheduling, "gang-cosched").await;
}

#[tokio::test]
async fn a_gangs_copies_join_a_volcano_podgroup_made_before_them_and_it_goes_with_the_last() {
    gang_path(GangScheduler::Volcano, "gang-volcano").await;
}

/// member-a serves no PodGroups: a MemberCluster asking for a gang scheduler there is not Ready,
/// with the reason, so nothing is placed on it.
#[tokio::test]
async fn a_member_without_the_podgroup_crd_is_not_ready_with_the_reason() {
    let env = Env::load();
    let test = "gang-no-crd";
    let ns = "e2e-gang-no-crd";
    let training = env.client("training").await;
    let member_a = env.client("member-a").await;
    // The test needs member-a without the coscheduling CRD, which the test running
    // Coscheduling there installed.
    let crds = Api::<CustomResourceDefinition>::all(member_a);
    if crds.get_opt("podgroups.scheduling.x-k8s.io").await.unwrap().is_some() {
        crds.delete("podgroups.scheduling.x-k8s.io", &DeleteParams::default()).await.unwrap();
    }
    wait_for(Duration::from_secs(60), "member-a without the coscheduling CRD", || {
        let crds = crds.clone();
        async move { crds.get_opt("podgroups.scheduling.x-k8s.io").await.ok()?.is_none().then_some(()) }
    })
    .await;
    prepare(&env, &training, test, ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-a", &kubeconfig).await;
    let name = format!("{test}-member-a");
    let mut mc = member_cluster(&name, test, ns, "member-a");
    mc.spec.gang_scheduler = Some(GangScheduler::Coscheduling);
    apply_member_cluster(&training, &mc).await;
    // A virtual node an earlier, killed run left would hide what this one offers.
    let lp = ListParams::default().labels(&format!("{}={name}", keys::LABEL_MEMBER));
    let nodes = Api::<Node>::all(training.clone());
    nodes.delete_collection(&DeleteParams::default(), &lp).await.unwrap();
    let _tidepool = Tidepool::start(&env, test, ns);
    let message = wait_reason(&training, &name, "False", keys::REASON_GANG_SCHEDULER_MISSING).await;
    assert!(message.contains("podgroups.scheduling.x-k8s.io/v1alpha1"), "{message}");
    let nodes = nodes.list(&lp).await.unwrap();
    assert!(nodes.items.is_empty(), "a member that is not Ready offers no virtual node: {:?}", nodes.items.len());
}

/// member-a runs Kubernetes 1.37 with `GenericWorkload`: with `gangScheduler: kubernetes` a
/// gang's copies form a native PodGroup there (minCount the gang's core) and the member's own
/// kube-scheduler holds them all or nothing. One copy of a gang of two can never be placed
/// (it asks for a node label no member node has): the other stays Pending with it rather than
/// running alone, the member's reason shows on the training pods, and the gang timeout rolls
/// the gang back whole.
#[tokio::test]
async fn a_gang_under_the_members_own_kubernetes_gang_scheduling_runs_all_or_nothing() {
    let env = Env::load();
    let test = "gang-native";
    let ns = "e2e-gang-native";
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, test, ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-a", &kubeconfig).await;
    let mc_name = format!("{test}-member-a");
    let mut mc = member_cluster(&mc_name, test, ns, "member-a");
    mc.spec.gang_scheduler = Some(GangScheduler::Kubernetes);
    apply_member_cluster(&training, &mc).await;
    let _tidepool = Tidepool::start_with(&env, test, ns, "gangTimeoutSeconds: 30");
    wait_node(&training, &format!("tidepool-{mc_name}")).await;

    let id = run_id();
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let member_ns = offload_ns(ns);
    let native = groups(&member, GangScheduler::Kubernetes, &member_ns);
    // 1. A gang that fits runs: the member's scheduler takes the group (its priority and
    //    preemption policy are its copies') and places it whole.
    let fits = format!("fits-{id}");
    let fitting: Vec<String> = (0..2).map(|i| format!("{fits}-{i}")).collect();
    for n in &fitting {
        let meta = json!({"annotations": {keys::ANNOTATION_GANG: fits, keys::ANNOTATION_MIN_MEMBER: "2"}});
        pods.create(&PostParams::default(), &pod(n, meta, json!({"schedulerName": scheduler_name(test)})))
            .await
            .unwrap();
    }
    let fit_group = gang_group::group_name("training", ns, "gang", &fits);
    let placed = wait_for(Duration::from_secs(60), "the member's scheduler places the fitting gang", || {
        let (native, group) = (native.clone(), fit_group.clone());
        async move {
            let pg = native.get(&group).await.ok()?;
            let conditions = pg.data["status"]["conditions"].as_array()?.clone();
            conditions.into_iter().find(|c| c["type"] == "PodGroupInitiallyScheduled")
        }
    })
    .await;
    assert_eq!(placed["status"], "True", "the member's scheduler placed the gang: {placed}");
    for n in &fitting {
        wait_for(Duration::from_secs(60), &format!("{n} Running"), || {
            let (pods, n) = (pods.clone(), n.clone());
            async move { (pods.get(&n).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
        })
        .await;
    }
    // 2. A gang one of whose copies can never be placed.
    let gang = format!("job-{id}");
    let names: Vec<String> = (0..2).map(|i| format!("{gang}-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        let meta = json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: "2"}});
        let mut spec = json!({"schedulerName": scheduler_name(test)});
        if i == 1 {
            spec["nodeSelector"] = json!({"disktype": "ssd"});
        }
        pods.create(&PostParams::default(), &pod(n, meta, spec)).await.unwrap();
    }
    let made = copies(&member, &member_ns, &names).await;
    let group = gang_group::group_name("training", ns, "gang", &gang);
    let pg = native.get(&group).await.unwrap();
    assert_eq!(pg.data["spec"]["schedulingPolicy"]["gang"]["minCount"], 2, "a gang of the core: {pg:?}");
    // (Made before the copies, as gang_path shows for every scheduler: the member's scheduler
    // writes this group's status, so its resourceVersion no longer orders its creation.)
    for copy in &made {
        assert_eq!(group_of(copy, GangScheduler::Kubernetes).as_deref(), Some(group.as_str()), "{}", copy.name_any());
    }
    // The member's scheduler tried the gang and could not place it whole: it says so on its
    // group, and both copies wait; the reason reaches the training pods.
    let said = wait_for(Duration::from_secs(60), "the member's scheduler reports the gang unschedulable", || {
        let (native, group) = (native.clone(), group.clone());
        async move {
            let pg = native.get(&group).await.ok()?;
            let conditions = pg.data["status"]["conditions"].as_array()?.clone();
            conditions.into_iter().find(|c| c["type"] == "PodGroupInitiallyScheduled" && c["status"] == "False")
        }
    })
    .await;
    println!("member PodGroup {group}: {said}");
    assert_eq!(said["reason"], "Unschedulable", "the member's scheduler tried the gang and found no room: {said}");
    shows_members_reason(&pods, &names, Duration::from_secs(30)).await;
    let member_pods = Api::<Pod>::namespaced(member.clone(), &member_ns);
    for n in &names {
        let copy = member_pods.get(n).await.unwrap();
        let spec = copy.spec.unwrap();
        assert_eq!(spec.node_name, None, "{n} was placed without its gang");
        assert_eq!(copy.status.and_then(|s| s.phase).as_deref(), Some("Pending"), "{n}");
    }
    // At the gang timeout the gang is rolled back whole: none of its pods ever ran.
    for n in &names {
        let msg = wait_rolled_back(&pods, n).await;
        assert!(msg.contains("0 of its 2 pods running"), "{msg}");
    }
    clear_pods(&training, ns).await;
}

/// member-b runs the previous minor, without the native PodGroup API: a MemberCluster asking
/// for `kubernetes` gang scheduling there is not Ready, with the reason.
#[tokio::test]
async fn a_member_without_the_native_pod_group_api_is_not_ready_for_kubernetes_gang_scheduling() {
    let env = Env::load();
    let test = "gang-native-old";
    let ns = "e2e-gang-native-old";
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    assert!(
        !tidepool_federation::discovery::serves_pod_groups(&member_b, GangScheduler::Kubernetes).await.unwrap(),
        "this test needs member-b on a Kubernetes without scheduling.k8s.io/v1beta1 PodGroups (TIDEPOOL_SKEW=1)"
    );
    prepare(&env, &training, test, ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-b", &kubeconfig).await;
    let name = format!("{test}-member-b");
    let mut mc = member_cluster(&name, test, ns, "member-b");
    mc.spec.gang_scheduler = Some(GangScheduler::Kubernetes);
    apply_member_cluster(&training, &mc).await;
    let _tidepool = Tidepool::start(&env, test, ns);
    let message = wait_reason(&training, &name, "False", keys::REASON_GANG_SCHEDULER_MISSING).await;
    assert!(message.contains("podgroups.scheduling.k8s.io/v1beta1"), "{message}");
}

/// Waits until each training pod of `names` shows the member's reason for not placing its copy
/// (`PodScheduled` `False` with a message), and prints it.
async fn shows_members_reason(pods: &Api<Pod>, names: &[String], within: Duration) {
    for n in names {
        let reason = wait_for(within, &format!("{n} shows the member's reason"), || {
            let (pods, n) = (pods.clone(), n.clone());
            async move {
                let st = pods.get(&n).await.ok()?.status?;
                let c = st.conditions?.into_iter().find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
                c.message.filter(|m| !m.is_empty())
            }
        })
        .await;
        println!("{n}: {reason}");
    }
}

/// A pod of `cpu` CPU for a kwok node, with `meta` and `spec` as [`pod`] takes them.
fn sized(name: &str, meta: serde_json::Value, spec: serde_json::Value, cpu: &str) -> Pod {
    let mut p = pod(name, meta, spec);
    let c = &mut p.spec.as_mut().unwrap().containers[0];
    c.resources = Some(serde_json::from_value(json!({"requests": {"cpu": cpu, "memory": "64Mi"}})).unwrap());
    p
}

/// A gang of three pods of `cpu` CPU each, of `test`'s scheduler.
async fn gang_of_three(pods: &Api<Pod>, test: &str, gang: &str, cpu: &str) -> Vec<String> {
    let names: Vec<String> = (0..3).map(|i| format!("{gang}-{i}")).collect();
    for n in &names {
        let meta = json!({"annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: "3"}});
        pods.create(&PostParams::default(), &sized(n, meta, json!({"schedulerName": scheduler_name(test)}), cpu))
            .await
            .unwrap();
    }
    names
}

/// Issue "Volcano, Kueue and member gang schedulers", item 2: the member's gang scheduler
/// running, over a pool of one 32-CPU node of the member. A gang that fits is placed whole by
/// that scheduler. Then online pods take half the node between tidepool's plan and the
/// member's scheduling (the member's scheduler is down while the copies are made, so the window
/// is sure to be open): the member's scheduler holds the gang's copies all or none, none ever
/// bound (a watch on the member's API server), its reason on the training pods, the gang rolled
/// back whole at its timeout, and the online pods untouched (no preemption).
struct MemberGang {
    scheduler: GangScheduler,
    /// tests/operators/start.sh's name for the member's scheduler.
    operator: &'static str,
    cluster: &'static str,
    /// The pool's one node, and a quarter of its CPU: each of the gang's three pods and of the
    /// two online pods asks for that much.
    node: &'static str,
    quarter: &'static str,
    test: &'static str,
}

/// scheduler-plugins' Coscheduling in member-a (1.37; built by tests/schedulers/build.sh).
#[tokio::test]
async fn a_gang_the_members_coscheduling_cannot_hold_whole_waits_whole_and_is_rolled_back() {
    let g = MemberGang {
        scheduler: GangScheduler::Coscheduling,
        operator: "coscheduling",
        cluster: "member-a",
        node: "member-a-cpu-0",
        quarter: "8",
        test: "gang-cosched-run",
    };
    member_gang_holds(g).await;
}

/// Volcano's scheduler in member-b (1.36; built by tests/schedulers/build.sh).
#[tokio::test]
async fn a_gang_the_members_volcano_cannot_hold_whole_waits_whole_and_is_rolled_back() {
    let g = MemberGang {
        scheduler: GangScheduler::Volcano,
        operator: "volcano-scheduler",
        cluster: "member-b",
        node: "member-b-gpu-0",
        quarter: "16",
        test: "gang-volcano-run",
    };
    member_gang_holds(g).await;
}

async fn member_gang_holds(g: MemberGang) {
    let env = Env::load();
    let (test, ns, node) = (g.test, format!("e2e-{}", g.test), g.node.to_owned());
    let ns = ns.as_str();
    let training = env.client("training").await;
    let member = env.client(g.cluster).await;
    prepare(&env, &training, test, ns).await;
    // Online pods an earlier run left would hold the node.
    ensure_namespace(&member, "e2e-online").await;
    clear_pods(&member, "e2e-online").await;
    let kubeconfig = std::fs::read(env.kubeconfig_path(g.cluster)).unwrap();
    put_kubeconfig_secret(&training, ns, g.cluster, &kubeconfig).await;
    let mc_name = format!("{test}-member");
    let mut mc = member_cluster(&mc_name, test, ns, g.cluster);
    mc.spec.gang_scheduler = Some(g.scheduler);
    mc.spec.pools = vec![tidepool_api::crd::PoolSpec {
        name: "one".into(),
        node_selector: BTreeMap::from([("kubernetes.io/hostname".to_owned(), node.clone())]),
        ..Default::default()
    }];
    let scheduler = crate::operators::Operator::start_on(&env, g.operator, g.cluster, &[]).await;
    apply_member_cluster(&training, &mc).await;
    let _tidepool = Tidepool::start_with(&env, test, ns, "gangTimeoutSeconds: 45");
    wait_node(&training, &format!("tidepool-{mc_name}-one")).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let member_ns = offload_ns(ns);
    let member_pods = Api::<Pod>::namespaced(member.clone(), &member_ns);
    let id = run_id();

    // 1. A gang that fits: the member's Coscheduling binds its copies, all three.
    let fits = gang_of_three(&pods, test, &format!("fits-{id}"), g.quarter).await;
    for n in &fits {
        let copy =
            wait_for(Duration::from_secs(60), &format!("{n}'s copy bound by the member's scheduler"), || {
                let (member_pods, n) = (member_pods.clone(), n.clone());
                async move {
                    member_pods.get(&n).await.ok().filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                }
            })
            .await;
        assert_eq!(copy.spec.unwrap().scheduler_name.as_deref(), Some(g.scheduler.default_scheduler_name()));
    }
    clear_pods(&training, ns).await;
    wait_for(Duration::from_secs(60), "the fitting gang's copies gone", || {
        let member_pods = member_pods.clone();
        async move { member_pods.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;

    // 2. The member's scheduler is down; a gang is placed (three quarters of the node) and its
    //    copies made; online pods then take half of that node.
    drop(scheduler);
    let names = gang_of_three(&pods, test, &format!("job-{id}"), g.quarter).await;
    copies(&member, &member_ns, &names).await;
    let bound = member_watch_bound(&member_pods);
    let online = online_pods(&member, &node, &id, g.quarter).await;
    let _scheduler = crate::operators::Operator::start_on(&env, g.operator, g.cluster, &[]).await;
    shows_members_reason(&pods, &names, Duration::from_secs(60)).await;
    for n in &names {
        let msg = wait_rolled_back(&pods, n).await;
        assert!(msg.contains("0 of its 3 pods running"), "{msg}");
    }
    let ever_bound = bound.lock().unwrap().clone();
    assert!(ever_bound.is_empty(), "copies bound without their gang: {ever_bound:?}");
    let still = Api::<Pod>::namespaced(member.clone(), "e2e-online");
    for (name, uid) in &online {
        let p = still.get(name).await.unwrap();
        assert_eq!(p.metadata.uid.as_ref(), Some(uid), "online pod {name} was replaced");
        assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Running"), "online pod {name}");
    }
    clear_pods(&training, ns).await;
    clear_pods(&member, "e2e-online").await;
}

/// The names of the copies in `member_pods` a watch sees bound to a node, from now on.
fn member_watch_bound(member_pods: &Api<Pod>) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    use futures::StreamExt;
    let bound = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (api, sink) = (member_pods.clone(), bound.clone());
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(kube::runtime::watcher(api, kube::runtime::watcher::Config::default()));
        while let Some(Ok(kube::runtime::watcher::Event::Apply(p) | kube::runtime::watcher::Event::InitApply(p))) =
            stream.next().await
        {
            if p.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                sink.lock().unwrap().push(p.name_any());
            }
        }
    });
    bound
}

/// Two online pods of `cpu` CPU each bound to `node` in member namespace `e2e-online`, Running;
/// their names and UIDs.
async fn online_pods(member: &Client, node: &str, id: &str, cpu: &str) -> Vec<(String, String)> {
    let api = Api::<Pod>::namespaced(member.clone(), "e2e-online");
    let mut made = Vec::new();
    for i in 0..2 {
        let name = format!("online-{id}-{i}");
        let p =
            api.create(&PostParams::default(), &sized(&name, json!({}), json!({"nodeName": node}), cpu)).await.unwrap();
        made.push((name, p.metadata.uid.unwrap()));
    }
    for (name, _) in &made {
        wait_for(Duration::from_secs(60), &format!("online pod {name} Running"), || {
            let (api, name) = (api.clone(), name.clone());
            async move { (api.get(&name).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
        })
        .await;
    }
    made
}
