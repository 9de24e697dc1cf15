//! The dispatcher end to end: gangs admitted whole on one pool, from every gang source,
//! elastic growth by band, unplaceable gangs explained, and no split after a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1beta1::PodGroup as NativePodGroup;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;

/// One tidepool bridging both members under this test's label and scheduler name.
async fn setup(env: &Env, test: &str, ns: &str, members: &[&str]) -> (Client, Tidepool) {
    let training = env.client("training").await;
    prepare(env, &training, test, ns).await;
    for m in members {
        let kubeconfig = std::fs::read(env.kubeconfig_path(m)).unwrap();
        put_kubeconfig_secret(&training, ns, m, &kubeconfig).await;
        apply_member(&training, &format!("{test}-{m}"), test, ns, m).await;
    }
    let tidepool = Tidepool::start(env, test, ns);
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
    for m in members {
        let node = format!("tidepool-{test}-{m}");
        wait_for(Duration::from_secs(60), &format!("virtual node {node}"), || {
            let nodes = nodes.clone();
            let node = node.clone();
            async move { nodes.get_opt(&node).await.ok().flatten().map(|_| ()) }
        })
        .await;
    }
    (training, tidepool)
}

fn gang_pod(name: &str, scheduler: &str, gpus: u32, meta: serde_json::Value) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler,
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "cpu": "1", "memory": "1Gi"}}}]
        }
    }))
    .unwrap();
    let extra: kube::api::ObjectMeta = serde_json::from_value(meta).unwrap();
    p.metadata.labels = extra.labels;
    p.metadata.annotations = extra.annotations;
    p
}

/// Pods of `names` once all are bound, by name → node.
async fn wait_bound(pods: &Api<Pod>, names: &[String], timeout: Duration) -> BTreeMap<String, String> {
    wait_for(timeout, &format!("pods bound: {names:?}"), || async move {
        let mut out = BTreeMap::new();
        for n in names {
            let p = pods.get(n).await.ok()?;
            out.insert(n.clone(), p.spec?.node_name?);
        }
        Some(out)
    })
    .await
}

async fn wait_running(pods: &Api<Pod>, names: &[String]) {
    wait_for(Duration::from_secs(90), &format!("pods Running: {names:?}"), || async move {
        for n in names {
            if pods.get(n).await.ok()?.status?.phase.as_deref() != Some("Running") {
                return None;
            }
        }
        Some(())
    })
    .await;
}

fn unschedulable_message(p: &Pod) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .and_then(|c| c.message.clone())
}

async fn delete_all(pods: &Api<Pod>, names: &[String]) {
    for n in names {
        let _ = pods.delete(n, &DeleteParams::default()).await;
    }
    wait_for(Duration::from_secs(90), "pods deleted", || async move {
        for n in names {
            if pods.get_opt(n).await.ok()?.is_some() {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// Online pods of a member itself, each taking some GPUs of one of its nodes: the member's
/// pool lends that much less, and has room for part of a gang only.
pub(crate) struct Occupied {
    api: Api<Pod>,
    names: Vec<String>,
    /// `kubectl --kubeconfig <member> -n <ns>`, for the clean-up of a test that panics.
    kubectl: Vec<String>,
    released: bool,
}

impl Occupied {
    pub(crate) async fn release(mut self) {
        let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        for n in &self.names {
            let _ = self.api.delete(n, &dp).await;
        }
        self.released = true;
    }
}

/// A test that fails part-way must not leave its online pods holding the member's GPUs for
/// the tests after it: they go (without waiting) when the guard is dropped unreleased.
impl Drop for Occupied {
    fn drop(&mut self) {
        if self.released || self.names.is_empty() {
            return;
        }
        let _ = std::process::Command::new(&self.kubectl[0])
            .args(&self.kubectl[1..])
            .args(["delete", "pod", "--grace-period=0", "--force", "--wait=false"])
            .args(&self.names)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Puts `(member node, GPUs)` online pods in `cluster` (namespace `<test>-online`), Running.
pub(crate) async fn occupy(env: &Env, cluster: &str, test: &str, taken: &[(&str, u32)]) -> Occupied {
    let member = env.client(cluster).await;
    let ns = format!("{test}-online");
    ensure_namespace(&member, &ns).await;
    // What an earlier, failed run of the test left there goes first.
    clear_pods(&member, &ns).await;
    let api = Api::<Pod>::namespaced(member, &ns);
    let id = run_id();
    let mut names = Vec::new();
    for (i, (node, gpus)) in taken.iter().enumerate() {
        let name = format!("online-{id}-{i}");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": node,
                     "containers": [{"name": "web", "image": "example.invalid/web:1",
                                     "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}
        }))
        .unwrap();
        api.create(&PostParams::default(), &pod).await.unwrap();
        names.push(name);
    }
    let kubectl = vec![
        env.var("KUBECTL").to_owned(),
        "--kubeconfig".to_owned(),
        env.kubeconfig_path(cluster).display().to_string(),
        "-n".to_owned(),
        ns.clone(),
    ];
    let occupied = Occupied { api: api.clone(), names: names.clone(), kubectl, released: false };
    wait_running(&api, &names).await;
    occupied
}

/// Waits until virtual node `node` lends `gpus` GPUs or more.
pub(crate) async fn wait_lends_at_least(training: &Client, node: &str, gpus: i64) {
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
    wait_for(Duration::from_secs(30), &format!("{node} lends at least {gpus} GPUs"), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get(node).await.ok()?;
            let q = n.status?.allocatable?.get("nvidia.com/gpu")?.0.clone();
            (q.parse::<i64>().ok()? >= gpus).then_some(())
        }
    })
    .await;
}

/// Waits until virtual node `node` lends `gpus` GPUs or fewer: what the test's own arithmetic
/// says is left once `occupy` has taken its share.
async fn wait_lends_at_most(training: &Client, node: &str, gpus: i64) {
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
    wait_for(Duration::from_secs(30), &format!("{node} lends at most {gpus} GPUs"), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get(node).await.ok()?;
            let q = n.status?.allocatable?.get("nvidia.com/gpu")?.0.clone();
            (q.parse::<i64>().ok()? <= gpus).then_some(())
        }
    })
    .await;
}

/// The start of a whole-job test: the Jobs and pods an earlier, failed run left gone (they
/// would make pods of their own), and member-b's first two GPU nodes half taken by online
/// pods, so it lends 8 GPUs, spread: room for two 4-GPU pods, where member-a has room for four.
async fn squeeze_member_b(env: &Env, training: &Client, (test, ns): (&str, &str)) -> Occupied {
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..Default::default() };
    Api::<Job>::namespaced(training.clone(), ns).delete_collection(&dp, &ListParams::default()).await.unwrap();
    clear_pods(training, ns).await;
    let online = occupy(env, "member-b", test, &[("member-b-gpu-0", 4), ("member-b-gpu-1", 4)]).await;
    wait_lends_at_most(training, &format!("tidepool-{test}-member-b"), 8).await;
    online
}

#[tokio::test]
async fn a_batch_job_runs_whole_on_the_one_member_with_room_for_all_of_it() {
    let env = Env::load();
    let test = "dispatch-job";
    let ns = "e2e-dispatch-job";
    let (training, _tp) = setup(&env, test, ns, &["member-a", "member-b"]).await;
    // member-b (4 nodes × 4 GPUs) keeps 8 GPUs for the 3 × 4-GPU job: room for 2 of its pods,
    // on the tightest nodes. member-a (2 × 8) has room for all 3. Pod by pod, the job would
    // split; as a gang it goes whole to member-a.
    let online = squeeze_member_b(&env, &training, (test, ns)).await;
    let id = run_id();
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": format!("train-{id}")},
        "spec": {
            "parallelism": 3, "completions": 3, "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {keys::ANNOTATION_GANG: format!("train-{id}"), keys::ANNOTATION_MIN_MEMBER: "3"}},
                "spec": {
                    "schedulerName": scheduler_name(test),
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                    "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "4", "memory": "8Gi"}}}]
                }
            }
        }
    }))
    .unwrap();
    let jobs = Api::<Job>::namespaced(training.clone(), ns);
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let lp = ListParams::default().labels(&format!("job-name=train-{id}"));
    let names: Vec<String> = wait_for(Duration::from_secs(60), "3 job pods", || {
        let (pods, lp) = (pods.clone(), lp.clone());
        async move {
            let l = pods.list(&lp).await.ok()?;
            (l.items.len() == 3).then(|| l.items.iter().map(|p| p.metadata.name.clone().unwrap()).collect())
        }
    })
    .await;
    let bound = wait_bound(&pods, &names, Duration::from_secs(60)).await;
    let whole = format!("tidepool-{test}-member-a");
    assert!(bound.values().all(|n| *n == whole), "the job is not whole on {whole}: {bound:?}");
    wait_running(&pods, &names).await;
    for n in &names {
        let p = pods.get(n).await.unwrap();
        assert_eq!(p.labels()[keys::LABEL_BAND], "medium", "core pods are band medium");
        assert_eq!(p.annotations()[keys::ANNOTATION_PLACEMENT], *bound[n]);
    }
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Foreground), ..Default::default() };
    jobs.delete(&format!("train-{id}"), &dp).await.unwrap();
    delete_all(&pods, &names).await;
    online.release().await;
}

#[tokio::test]
async fn of_two_gangs_competing_for_one_pool_one_runs_whole_and_the_other_waits_whole() {
    let env = Env::load();
    let test = "dispatch-compete";
    let ns = "e2e-dispatch-compete";
    // member-b: 4 nodes × 4 GPUs. The first gang (2 × 4 GPUs) leaves two whole nodes free;
    // the second (3 × 4 GPUs) then has room for two of its pods, not three: pod by pod, two
    // would bind. As a gang, none does.
    let (training, _tp) = setup(&env, test, ns, &["member-b"]).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let mut gangs: Vec<Vec<String>> = Vec::new();
    for (g, size) in [("first", 2), ("second", 3)] {
        let mut names = Vec::new();
        for i in 0..size {
            let name = format!("{g}-{id}-{i}");
            let meta = json!({"annotations": {keys::ANNOTATION_GANG: format!("{g}-{id}"),
                                              keys::ANNOTATION_MIN_MEMBER: size.to_string()}});
            pods.create(&PostParams::default(), &gang_pod(&name, &scheduler_name(test), 4, meta)).await.unwrap();
            names.push(name);
        }
        gangs.push(names);
        if g == "first" {
            // The first gang goes first: it is bound before the second exists.
            wait_bound(&pods, &gangs[0], Duration::from_secs(60)).await;
        }
    }
    wait_running(&pods, &gangs[0]).await;
    // The second gang waits whole, with the reason on every pod and none of them bound.
    let msg = wait_for(Duration::from_secs(30), "second gang explained", || {
        let (pods, names) = (pods.clone(), gangs[1].clone());
        async move {
            let mut msgs = Vec::new();
            for n in &names {
                let p = pods.get(n).await.ok()?;
                assert!(p.spec.as_ref().unwrap().node_name.is_none(), "pod {n} of the waiting gang was bound");
                msgs.push(unschedulable_message(&p)?);
            }
            msgs.into_iter().next()
        }
    })
    .await;
    assert!(msg.contains("nvidia.com/gpu"), "reason should name the missing resource: {msg}");
    for n in &gangs[1] {
        assert!(pods.get(n).await.unwrap().spec.unwrap().node_name.is_none(), "pod {n} of the waiting gang was bound");
    }
    // Freeing the pool lets the second gang in, whole.
    delete_all(&pods, &gangs[0]).await;
    let bound = wait_bound(&pods, &gangs[1], Duration::from_secs(60)).await;
    assert_eq!(bound.len(), 3, "{bound:?}");
    wait_running(&pods, &gangs[1]).await;
    delete_all(&pods, &gangs[1]).await;
}

#[tokio::test]
async fn an_8_gpu_pod_is_refused_where_the_free_gpus_are_spread_over_nodes() {
    let env = Env::load();
    let test = "dispatch-spread";
    let ns = "e2e-dispatch-spread";
    let (training, _tp) = setup(&env, test, ns, &["member-b"]).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let name = format!("big-{}", run_id());
    pods.create(&PostParams::default(), &gang_pod(&name, &scheduler_name(test), 8, json!({}))).await.unwrap();
    let msg = wait_for(Duration::from_secs(30), "8-GPU pod explained by the per-node fit", || {
        let (pods, name) = (pods.clone(), name.clone());
        async move { unschedulable_message(&pods.get(&name).await.ok()?).filter(|m| m.contains("one node")) }
    })
    .await;
    assert!(msg.contains('8') && msg.contains('4'), "message should say 8 needed, 4 largest free per node: {msg}");
    assert!(pods.get(&name).await.unwrap().spec.unwrap().node_name.is_none());
    delete_all(&pods, &[name]).await;
}

#[tokio::test]
async fn elastic_pods_beyond_min_member_join_the_same_pool_as_band_low_or_wait() {
    let env = Env::load();
    let test = "dispatch-elastic";
    let ns = "e2e-dispatch-elastic";
    let (training, _tp) = setup(&env, test, ns, &["member-a", "member-b"]).await;
    // member-a keeps 12 GPUs (8 + 4), member-b 16 (4 × 4). A job of 5 × 4 GPUs, minMember 2:
    // whichever pool takes its core has room for only part of the elastic pods (member-b:
    // 2 more, member-a: 1 more), while the other pool has room for more of them.
    let online = occupy(&env, "member-a", test, &[("member-a-gpu-1", 4)]).await;
    wait_lends_at_most(&training, &format!("tidepool-{test}-member-a"), 12).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let names: Vec<String> = (0..5).map(|i| format!("el-{id}-{i}")).collect();
    for n in &names {
        let meta =
            json!({"annotations": {keys::ANNOTATION_GANG: format!("el-{id}"), keys::ANNOTATION_MIN_MEMBER: "2"}});
        pods.create(&PostParams::default(), &gang_pod(n, &scheduler_name(test), 4, meta)).await.unwrap();
    }
    // Settled: the core bound, every other pod either bound or told why it waits as an elastic
    //    pod of the placed gang (an earlier round's reason may say something else).
    let (bound, waiting) = wait_for(Duration::from_secs(60), "every pod bound or explained", || {
        let (pods, names) = (pods.clone(), names.clone());
        async move {
            let (mut bound, mut waiting) = (BTreeMap::new(), Vec::new());
            for n in &names {
                let p = pods.get(n).await.ok()?;
                match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                    Some(node) => {
                        bound.insert(n.clone(), node);
                    }
                    None => waiting.push((n.clone(), unschedulable_message(&p).filter(|m| m.contains("elastic pod"))?)),
                }
            }
            (bound.len() >= 2).then_some((bound, waiting))
        }
    })
    .await;
    let pools: BTreeSet<&String> = bound.values().collect();
    assert_eq!(pools.len(), 1, "elastic pods left the gang's pool: {bound:?}");
    let pool = pools.into_iter().next().unwrap().clone();
    assert!(!waiting.is_empty(), "every elastic pod found room on {pool}: {bound:?}");
    assert!(
        waiting.iter().all(|(_, m)| m.contains(&format!("no room for another elastic pod on {pool}"))),
        "{waiting:?}"
    );
    // The other pool had room for a waiting pod: a pod-by-pod placer would have put it there.
    let other = if pool.ends_with("member-a") {
        format!("tidepool-{test}-member-b")
    } else {
        format!("tidepool-{test}-member-a")
    };
    let lends = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone()).get(&other).await.unwrap();
    let gpus = lends.status.unwrap().allocatable.unwrap()["nvidia.com/gpu"].0.parse::<i64>().unwrap();
    assert!(gpus >= 4, "{other} lends only {gpus} GPUs: no split was possible");
    let bound_names: Vec<String> = bound.keys().cloned().collect();
    wait_running(&pods, &bound_names).await;
    let mut bands = BTreeMap::new();
    for n in &bound_names {
        let band = pods.get(n).await.unwrap().labels()[keys::LABEL_BAND].clone();
        *bands.entry(band).or_insert(0) += 1;
    }
    assert_eq!(bands.get("medium"), Some(&2), "{bands:?}");
    assert_eq!(bands.get("low").copied().unwrap_or(0), bound.len() - 2, "{bands:?}");
    delete_all(&pods, &names).await;
    online.release().await;
}

/// Installs a minimal CRD so PodGroups of `group` can be stored (tidepool reads only
/// `spec.minMember`).
pub(crate) async fn install_pod_group_crd(training: &Client, group: &str, version: &str) {
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("podgroups.{group}")},
        "spec": {
            "group": group, "scope": "Namespaced",
            "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup"},
            "versions": [{"name": version, "served": true, "storage": true,
                          "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))
    .unwrap();
    let api = Api::<CustomResourceDefinition>::all(training.clone());
    api.patch(&format!("podgroups.{group}"), &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&crd))
        .await
        .unwrap();
    let name = format!("podgroups.{group}");
    wait_for(Duration::from_secs(30), "PodGroup CRD established", || {
        let (api, name) = (api.clone(), name.clone());
        async move {
            let crd = api.get(&name).await.ok()?;
            crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
        }
    })
    .await;
}

pub(crate) async fn create_pod_group(training: &Client, ns: &str, group: &str, version: &str, name: &str, min: u32) {
    let gvk = kube::api::GroupVersionKind::gvk(group, version, "PodGroup");
    let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, "podgroups");
    let pg: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{group}/{version}"), "kind": "PodGroup",
        "metadata": {"name": name, "namespace": ns}, "spec": {"minMember": min}
    }))
    .unwrap();
    Api::<kube::api::DynamicObject>::namespaced_with(training.clone(), ns, &ar)
        .create(&PostParams::default(), &pg)
        .await
        .unwrap();
}

#[tokio::test]
async fn volcano_and_sig_scheduling_pod_groups_are_gangs() {
    let env = Env::load();
    let test = "dispatch-podgroups";
    let ns = "e2e-dispatch-podgroups";
    let (training, _tp) = setup(&env, test, ns, &["member-a", "member-b"]).await;
    install_pod_group_crd(&training, "scheduling.volcano.sh", "v1beta1").await;
    install_pod_group_crd(&training, "scheduling.x-k8s.io", "v1alpha1").await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();

    // A Volcano job: one parameter server and two workers, minMember 3.
    let vc = format!("vc-{id}");
    let ann = json!({"annotations": {keys::ANNOTATION_VOLCANO_GROUP: vc}});
    let volcano: Vec<String> = ["ps-0", "worker-0", "worker-1"].iter().map(|r| format!("{vc}-{r}")).collect();
    // Pods first: the gang must wait for its PodGroup, not guess its size.
    for n in &volcano {
        pods.create(&PostParams::default(), &gang_pod(n, &scheduler_name(test), 1, ann.clone())).await.unwrap();
    }
    let msg = wait_for(Duration::from_secs(30), "gang waits for its PodGroup", || {
        let (pods, n) = (pods.clone(), volcano[0].clone());
        async move { unschedulable_message(&pods.get(&n).await.ok()?) }
    })
    .await;
    assert!(msg.contains("not found"), "{msg}");
    create_pod_group(&training, ns, "scheduling.volcano.sh", "v1beta1", &vc, 3).await;
    let bound = wait_bound(&pods, &volcano, Duration::from_secs(60)).await;
    assert_eq!(bound.values().collect::<BTreeSet<_>>().len(), 1, "{bound:?}");

    // A PyTorchJob-shaped set: master + 3 workers in a sig-scheduling PodGroup of 4.
    let pt = format!("pt-{id}");
    create_pod_group(&training, ns, "scheduling.x-k8s.io", "v1alpha1", &pt, 4).await;
    let label = json!({"labels": {keys::LABEL_POD_GROUP: pt, "training.kubeflow.org/job-name": pt}});
    let torch: Vec<String> =
        ["master-0", "worker-0", "worker-1", "worker-2"].iter().map(|r| format!("{pt}-{r}")).collect();
    // Three of four: not enough, nothing binds. The dispatcher says so on each pod: once
    //    it has, it has looked at them and bound none.
    for n in &torch[..3] {
        pods.create(&PostParams::default(), &gang_pod(n, &scheduler_name(test), 1, label.clone())).await.unwrap();
    }
    wait_for(Duration::from_secs(30), "the incomplete gang explained on each of its pods", || {
        let (pods, names) = (pods.clone(), torch[..3].to_vec());
        async move {
            for n in &names {
                let p = pods.get(n).await.ok()?;
                assert!(p.spec.as_ref().unwrap().node_name.is_none(), "{n} bound before its gang was complete");
                unschedulable_message(&p).filter(|m| m.contains("3 of its 4 pods"))?;
            }
            Some(())
        }
    })
    .await;
    pods.create(&PostParams::default(), &gang_pod(&torch[3], &scheduler_name(test), 1, label)).await.unwrap();
    let bound = wait_bound(&pods, &torch, Duration::from_secs(60)).await;
    assert_eq!(bound.values().collect::<BTreeSet<_>>().len(), 1, "{bound:?}");
    // Each binding recorded the placement on its pod: the pool, the band and role, the core.
    for n in &torch {
        let p = pods.get(n).await.unwrap();
        let (labels, annotations) = (p.labels(), p.annotations());
        assert_eq!(annotations.get(keys::ANNOTATION_PLACEMENT), Some(&bound[n]), "{n}");
        assert_eq!(annotations.get(keys::ANNOTATION_GANG_CORE).map(String::as_str), Some("4"), "{n}");
        assert!(annotations.contains_key(keys::ANNOTATION_PLACED_AT), "{n}");
        assert_eq!(labels.get(keys::LABEL_BAND).map(String::as_str), Some("medium"), "{n}");
        assert_eq!(labels.get(keys::LABEL_ROLE).map(String::as_str), Some(keys::ROLE_CORE), "{n}");
    }
    wait_running(&pods, &torch).await;
    delete_all(&pods, &volcano).await;
    delete_all(&pods, &torch).await;
}

/// The `PodGroupInitiallyScheduled` condition of native PodGroup `name`, as
/// `(status, reason, message)`.
async fn initially_scheduled(groups: &Api<NativePodGroup>, name: &str) -> Option<(String, String, String)> {
    let group = groups.get(name).await.ok()?;
    let c = group.status?.conditions?.into_iter().find(|c| c.type_ == "PodGroupInitiallyScheduled")?;
    Some((c.status, c.reason, c.message))
}

#[tokio::test]
async fn a_job_in_a_native_pod_group_is_a_gang_of_its_min_count_and_the_group_tells_its_scheduling() {
    let env = Env::load();
    let test = "dispatch-native";
    let ns = "e2e-dispatch-native";
    let (training, _tp) = setup(&env, test, ns, &["member-a", "member-b"]).await;
    // member-b keeps room for 2 of the job's 4-GPU pods, member-a for all 4: pod by pod the
    // job would split.
    let online = squeeze_member_b(&env, &training, (test, ns)).await;
    let id = run_id();
    let name = format!("train-{id}");
    // Kubernetes' own gang API: a PodGroup of minCount 4 and a Job whose pods join it.
    let groups = Api::<NativePodGroup>::namespaced(training.clone(), ns);
    let group: NativePodGroup = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 4}}}
    }))
    .unwrap();
    groups.create(&PostParams::default(), &group).await.unwrap();
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "parallelism": 3, "completions": 4, "backoffLimit": 0,
            "template": {"spec": {
                "schedulerName": scheduler_name(test),
                "schedulingGroup": {"podGroupName": name},
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "4", "memory": "8Gi"}}}]
            }}
        }
    }))
    .unwrap();
    let jobs = Api::<Job>::namespaced(training.clone(), ns);
    jobs.create(&PostParams::default(), &job).await.unwrap();
    // Three pods of a gang of four: none binds, and the group says why, as the default
    // scheduler's would.
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let lp = ListParams::default().labels(&format!("job-name={name}"));
    let (status, reason, message) = wait_for(Duration::from_secs(60), "the group reported unschedulable", || async {
        initially_scheduled(&groups, &name).await.filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(reason, "Unschedulable", "{status} {message}");
    assert!(message.contains("3 of its 4 pods"), "{message}");
    for p in pods.list(&lp).await.unwrap() {
        assert!(p.spec.unwrap().node_name.is_none(), "a pod bound before its gang of 4 was complete");
    }
    // The fourth pod: the gang goes whole to the one member with room for it.
    jobs.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"parallelism": 4}}))).await.unwrap();
    let names: Vec<String> = wait_for(Duration::from_secs(60), "4 job pods", || {
        let (pods, lp) = (pods.clone(), lp.clone());
        async move {
            let l = pods.list(&lp).await.ok()?;
            (l.items.len() == 4).then(|| l.items.iter().map(|p| p.name_any()).collect())
        }
    })
    .await;
    let bound = wait_bound(&pods, &names, Duration::from_secs(60)).await;
    let whole = format!("tidepool-{test}-member-a");
    assert!(bound.values().all(|n| *n == whole), "the gang is not whole on {whole}: {bound:?}");
    for n in &names {
        let p = pods.get(n).await.unwrap();
        assert_eq!(p.annotations().get(keys::ANNOTATION_GANG_CORE).map(String::as_str), Some("4"), "{n}");
    }
    let (status, reason, message) = wait_for(Duration::from_secs(30), "the group reported scheduled", || async {
        initially_scheduled(&groups, &name).await.filter(|c| c.0 == "True")
    })
    .await;
    assert_eq!(reason, "Scheduled", "{status} {message}");
    assert!(message.contains(&whole), "{message}");
    wait_running(&pods, &names).await;
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Foreground), ..Default::default() };
    jobs.delete(&name, &dp).await.unwrap();
    delete_all(&pods, &names).await;
    let _ = groups.delete(&name, &DeleteParams::default()).await;
    online.release().await;
}

#[tokio::test]
async fn a_gang_whose_pods_arrive_together_is_placed_without_being_told_to_wait() {
    let env = Env::load();
    let test = "dispatch-forming";
    let ns = "e2e-dispatch-forming";
    let (training, tp) = setup(&env, test, ns, &["member-a"]).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let names: Vec<String> = (0..4).map(|i| format!("forming-{id}-{i}")).collect();
    let meta =
        json!({"annotations": {keys::ANNOTATION_GANG: format!("forming-{id}"), keys::ANNOTATION_MIN_MEMBER: "4"}});
    // Three of four, then a dispatcher round that saw them short of their minimum (its gauge
    // of waiting gangs counts them), then the fourth, as a job's controller creates pods.
    for n in &names[..3] {
        pods.create(&PostParams::default(), &gang_pod(n, &scheduler_name(test), 1, meta.clone())).await.unwrap();
    }
    wait_for(Duration::from_secs(30), "a dispatcher round that saw the forming gang", || {
        let text = tp.scrape();
        async move { (metric_value(&text, "tidepool_gangs_waiting", "")? >= 1.0).then_some(()) }
    })
    .await;
    pods.create(&PostParams::default(), &gang_pod(&names[3], &scheduler_name(test), 1, meta)).await.unwrap();
    wait_bound(&pods, &names, Duration::from_secs(60)).await;
    // Bound whole; while it formed, no pod was told it waits (neither condition nor Event).
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(training.clone(), ns);
    let told: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(keys::REASON_UNPLACEABLE))
        .filter_map(|e| e.regarding?.name)
        .filter(|n| names.contains(n))
        .collect();
    assert!(told.is_empty(), "pods of a gang still forming were told to wait: {told:?}");
    wait_running(&pods, &names).await;
    delete_all(&pods, &names).await;
}

#[tokio::test]
async fn a_gang_a_crash_left_partly_bound_is_finished_on_its_pool() {
    let env = Env::load();
    let test = "dispatch-crash";
    let ns = "e2e-dispatch-crash";
    let (training, mut tp) = setup(&env, test, ns, &["member-a", "member-b"]).await;
    let (node_a, node_b) = (format!("tidepool-{test}-member-a"), format!("tidepool-{test}-member-b"));
    wait_lends_at_least(&training, &node_b, 16).await;
    // Tidepool is down while the gang is created, and two of its six 2-GPU pods are bound to
    // member-a as a dispatcher that crashed between its bindings leaves them: each binding
    // recorded the placement on its pod, and the other four were never bound.
    tp.kill();
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let names: Vec<String> = (0..6).map(|i| format!("crash-{id}-{i}")).collect();
    let meta = json!({"annotations": {keys::ANNOTATION_GANG: format!("crash-{id}"), keys::ANNOTATION_MIN_MEMBER: "6"}});
    for n in &names {
        pods.create(&PostParams::default(), &gang_pod(n, &scheduler_name(test), 2, meta.clone())).await.unwrap();
    }
    for n in &names[..2] {
        let binding: k8s_openapi::api::core::v1::Binding = serde_json::from_value(json!({
            "metadata": {"name": n,
                         "labels": {keys::LABEL_BAND: "medium", keys::LABEL_ROLE: keys::ROLE_CORE},
                         "annotations": {keys::ANNOTATION_PLACEMENT: node_a, keys::ANNOTATION_GANG_CORE: "6",
                                         keys::ANNOTATION_PLACED_AT: jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_a}
        }))
        .unwrap();
        pods.create_subresource::<_, serde_json::Value>("binding", n, &PostParams::default(), &binding).await.unwrap();
    }
    // member-b lends 16 GPUs on four 4-GPU nodes: placed afresh, the gang would fit it more
    // tightly than member-a's two 8-GPU nodes. The recorded placement must win.
    let _tp = Tidepool::start(&env, test, ns);
    let bound = wait_bound(&pods, &names, Duration::from_secs(60)).await;
    assert!(bound.values().all(|n| *n == node_a), "gang split after a crash mid-placement: {bound:?}");
    wait_running(&pods, &names).await;
    delete_all(&pods, &names).await;
}

#[tokio::test]
async fn a_gang_the_member_leaves_pending_is_rolled_back_whole() {
    let env = Env::load();
    let test = "dispatch-timeout";
    let ns = "e2e-dispatch-timeout";
    let training = env.client("training").await;
    prepare(&env, &training, test, ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-b")).unwrap();
    put_kubeconfig_secret(&training, ns, "member-b", &kubeconfig).await;
    apply_member(&training, &format!("{test}-member-b"), test, ns, "member-b").await;
    let _tp = Tidepool::start_with(&env, test, ns, "gangTimeoutSeconds: 5");
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    // Two pods, one of which asks for a node label no member node has: the member's
    // scheduler leaves that copy Pending, so the gang never runs whole.
    let names: Vec<String> = (0..2).map(|i| format!("stuck-{id}-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        let meta =
            json!({"annotations": {keys::ANNOTATION_GANG: format!("stuck-{id}"), keys::ANNOTATION_MIN_MEMBER: "2"}});
        let mut p = gang_pod(n, &scheduler_name(test), 1, meta);
        if i == 1 {
            p.spec.as_mut().unwrap().node_selector =
                Some(BTreeMap::from([("disktype".to_string(), "ssd".to_string())]));
        }
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    wait_bound(&pods, &names, Duration::from_secs(60)).await;
    for n in &names {
        let msg = wait_rolled_back(&pods, n).await;
        assert!(msg.contains("1 of its 2 pods running"), "{msg}");
    }
    // Both offload copies are gone, the running one included.
    let member = env.client("member-b").await;
    let offload = Api::<Pod>::namespaced(member, &offload_ns(ns));
    wait_for(Duration::from_secs(60), "offload copies removed", || {
        let (offload, names) = (offload.clone(), names.clone());
        async move {
            for n in &names {
                if offload.get_opt(n).await.ok()?.is_some() {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    clear_pods(&training, ns).await;
}
