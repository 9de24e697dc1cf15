//! Every member-side disruption reaches the training pod as Kubernetes would report it
//! (issue "Real operators"): a Job with `backoffLimit: 0` whose `podFailurePolicy` ignores
//! `DisruptionTarget` runs a real process on member-a's real node; the member takes the copy
//! away — its Eviction API (`kubectl drain`), its scheduler preempting it for an online pod, a
//! `NoExecute` taint on its node, its kubelet evicting it for node pressure (disk) — and the training pod turns `Failed` with `DisruptionTarget`
//! **in the same status
//! write** (a watch of the training pod sees no version that is `Failed` without it, none that
//! is terminal with `Ready=True` or a running container), so the Job does not count it and
//! makes a new pod. Without the condition the Job would fail at once (`backoffLimit: 0`).
//!
//! And what is not a disruption stays one of the pod's own: a copy its kubelet evicts for
//! writing past its own `emptyDir` limit is `Failed`/`Evicted` with the kubelet's message and
//! no `DisruptionTarget` (the kubelet adds it only for node pressure), and the Job counts it,
//! as on a native node.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use crate::harness::*;

const TEST: &str = "disruptions";
const NS: &str = "e2e-disruptions";
const MEMBER: &str = "e2e-disruptions-a";
const NODE: &str = "tidepool-e2e-disruptions-a-real";
const ONLINE_NS: &str = "e2e-disruptions-online";

struct Setup(RealNodeJobs);

impl std::ops::Deref for Setup {
    type Target = RealNodeJobs;
    fn deref(&self) -> &RealNodeJobs {
        &self.0
    }
}

impl Setup {
    async fn start() -> Setup {
        Setup(RealNodeJobs::start((TEST, NS), MEMBER, NODE, "").await)
    }

    /// A Job of one pod running `script` on the real pool, `backoffLimit: 0`, ignoring
    /// disruptions; its first pod, once Running, and the name of its copy's member node.
    async fn job(&self, name: &str, script: &str, extra: serde_json::Value) -> (Pod, String) {
        let pod = self.job_pod(name, script, extra).await;
        let copy = Api::<Pod>::namespaced(self.member.clone(), &offload_ns(NS)).get(&pod.name_any()).await.unwrap();
        (pod, copy.spec.unwrap().node_name.unwrap())
    }

    /// [`Setup::job`]'s pod once Running, for a job whose copy may be gone by then.
    async fn job_pod(&self, name: &str, script: &str, extra: serde_json::Value) -> Pod {
        let mut spec = json!({
            "schedulerName": scheduler_name(TEST),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main", "image": self.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}}
            }]
        });
        if let Some(obj) = extra.as_object() {
            for (k, v) in obj {
                spec[k] = v.clone();
            }
        }
        // Each volume mounted at /<its name>.
        let mounts: Vec<serde_json::Value> = spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| json!({"name": v["name"], "mountPath": format!("/{}", v["name"].as_str().unwrap_or_default())}))
            .collect();
        spec["containers"][0]["volumeMounts"] = json!(mounts);
        let job: Job = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                "template": {"metadata": {"labels": {"job": name}}, "spec": spec}
            }
        }))
        .unwrap();
        Api::<Job>::namespaced(self.training.clone(), NS).create(&PostParams::default(), &job).await.unwrap();
        let pods = Api::<Pod>::namespaced(self.training.clone(), NS);
        wait_for(Duration::from_secs(120), &format!("{name}'s pod Running"), || {
            let pods = pods.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(&format!("job={name}"))).await.ok()?.items;
                list.into_iter().find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            }
        })
        .await
    }

    fn copies(&self) -> Api<Pod> {
        Api::namespaced(self.member.clone(), &offload_ns(NS))
    }

    /// Waits until member-a's real node says it is not under disk pressure: the kubelet tests
    /// fill its nodefs, and one that failed half-way may have left it full.
    async fn without_disk_pressure(&self) {
        let (nodes, node) = (Api::<Node>::all(self.member.clone()), self.env.var("MEMBER_A_REAL_NODE").to_owned());
        wait_for(Duration::from_secs(120), &format!("{node} without DiskPressure"), || {
            let (nodes, node) = (nodes.clone(), node.clone());
            async move {
                let conditions = nodes.get(&node).await.ok()?.status?.conditions?;
                conditions.iter().any(|c| c.type_ == "DiskPressure" && c.status == "False").then_some(())
            }
        })
        .await;
    }

    /// What a reader of a failed kubelet test needs: member-a's real node's conditions, the
    /// copies and training pods with their status, and the member kubelet's eviction manager's lines.
    async fn diagnosis(&self) -> String {
        let node = self.env.var("MEMBER_A_REAL_NODE");
        let mut out = String::new();
        if let Ok(n) = Api::<Node>::all(self.member.clone()).get(node).await {
            for c in n.status.and_then(|st| st.conditions).unwrap_or_default() {
                out += &format!("node {node}: {}={} {:?} {:?}\n", c.type_, c.status, c.reason, c.message);
            }
        }
        for (side, api) in [("copy", self.copies()), ("training pod", Api::namespaced(self.training.clone(), NS))] {
            for p in api.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default() {
                let st = p.status.clone().unwrap_or_default();
                let node = p.spec.as_ref().and_then(|sp| sp.node_name.clone());
                let conditions: Vec<String> =
                    st.conditions.unwrap_or_default().iter().map(|c| format!("{}={}", c.type_, c.status)).collect();
                out += &format!(
                    "{side} {} on {node:?}: {:?} {:?} {:?} {conditions:?}\n",
                    p.name_any(),
                    st.phase,
                    st.reason,
                    st.message
                );
            }
        }
        let log = std::path::Path::new(self.env.var("CP_STATE_DIR")).join("logs/member-a-kubelet.log");
        let log = std::fs::read_to_string(&log).unwrap_or_else(|e| format!("{}: {e}", log.display()));
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("eviction_manager.go")).collect();
        for line in &lines[lines.len().saturating_sub(30)..] {
            out += &format!("kubelet: {line}\n");
        }
        out
    }
}

/// Runs `test`; if it fails, prints [`Setup::diagnosis`] before failing the same way, and
/// keeps it with the failure's message in a file beside tidepool's logs (a CI run's output
/// may be cut short; its machine's temporary directory is not).
async fn with_diagnosis(s: &Setup, test: impl std::future::Future<Output = ()>) {
    if let Err(panic) = std::panic::AssertUnwindSafe(test).catch_unwind().await {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|m| (*m).to_owned()))
            .unwrap_or_default();
        let diagnosis = format!("{message}\n---- what member-a showed when the test failed\n{}", s.diagnosis().await);
        eprintln!("{diagnosis}");
        let file = std::env::temp_dir().join(format!("tidepool-e2e-{TEST}-failure-{}.txt", run_id()));
        let _ = std::fs::write(&file, &diagnosis);
        eprintln!("(kept in {})", file.display());
        std::panic::resume_unwind(panic);
    }
}

/// Every version of training pod `name` a watch sees, from now on.
fn watch_versions(training: &Client, name: &str) -> (Arc<Mutex<Vec<Pod>>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let api = Api::<Pod>::namespaced(training.clone(), NS);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let sink = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, config));
        while let Some(event) = stream.next().await {
            if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = event {
                sink.lock().unwrap().push(p);
            }
        }
    });
    (seen, task)
}

fn has_true(p: &Pod, type_: &str) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

fn running_container(p: &Pod) -> bool {
    let statuses = p.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some() || s.waiting.is_some()))
}

/// Waits for the training pod `pod` to fail with `reason`, then checks every version the
/// watch saw, and that the Job made a new pod without failing. Returns the DisruptionTarget
/// reason. Panics (a failed expectation) are handed back, so a test puts the member back
/// before it fails.
async fn reflected(
    s: &Setup,
    job: &str,
    pod: &Pod,
    seen: &Arc<Mutex<Vec<Pod>>>,
    reason: &str,
) -> std::thread::Result<String> {
    let (training, job, pod, seen, reason) =
        (s.training.clone(), job.to_owned(), pod.clone(), seen.clone(), reason.to_owned());
    tokio::spawn(async move { check_reflected(training, &job, &pod, &seen, &reason).await })
        .await
        .map_err(|e| e.into_panic())
}

async fn check_reflected(training: Client, job: &str, pod: &Pod, seen: &Mutex<Vec<Pod>>, reason: &str) -> String {
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let name = pod.name_any();
    // The kubelet measures volumes about once a minute: up to three for its eviction.
    let failed = wait_for(Duration::from_secs(200), &format!("{name} Failed/{reason}"), || {
        let (pods, name) = (pods.clone(), name.clone());
        async move {
            let p = pods.get(&name).await.ok()?;
            let st = p.status.as_ref()?;
            (st.phase.as_deref() == Some("Failed") && st.reason.as_deref() == Some(reason)).then_some(p)
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for v in seen.lock().unwrap().iter() {
        let phase = v.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("");
        if phase == "Failed" || phase == "Succeeded" {
            let rv = v.metadata.resource_version.clone().unwrap_or_default();
            assert_eq!(phase, "Failed", "version {rv} of {name}: a disrupted pod never succeeds");
            assert!(
                has_true(v, "DisruptionTarget"),
                "version {rv} of {name} is Failed without DisruptionTarget: {:?}",
                v.status
            );
            assert!(!has_true(v, "Ready"), "version {rv} of {name} is terminal and Ready");
            assert!(!running_container(v), "version {rv} of {name} is terminal with a live container");
        }
    }
    let target =
        failed.status.as_ref().unwrap().conditions.as_ref().unwrap().iter().find(|c| c.type_ == "DisruptionTarget");
    let target = target.and_then(|c| c.reason.clone()).unwrap_or_default();
    // The Job ignores it: not failed, and a new pod.
    wait_job_replaced(&training, NS, job, &name).await;
    println!("{name}: Failed/{reason}, DisruptionTarget {target}; the Job made a new pod");
    target
}

async fn finish(s: &Setup, job: &str) {
    let dp = DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Background), ..Default::default() };
    let _ = Api::<Job>::namespaced(s.training.clone(), NS).delete(job, &dp).await;
    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn an_eviction_through_the_members_api_is_a_disruption_the_job_does_not_count() {
    let s = Setup::start().await;
    let job = format!("evict-{}", run_id());
    let (pod, _) = s.job(&job, "exec sleep 3600", json!({})).await;
    let (seen, watch) = watch_versions(&s.training, &pod.name_any());
    s.copies().evict(&pod.name_any(), &EvictParams::default()).await.unwrap();
    let target =
        reflected(&s, &job, &pod, &seen, "EvictedByMember").await.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(target, "EvictionByEvictionAPI");
    watch.abort();
    finish(&s, &job).await;
}

#[tokio::test]
async fn a_noexecute_taint_on_the_members_node_is_a_disruption_the_job_does_not_count() {
    let s = Setup::start().await;
    let job = format!("taint-{}", run_id());
    let (pod, node) = s.job(&job, "exec sleep 3600", json!({})).await;
    let (seen, watch) = watch_versions(&s.training, &pod.name_any());
    let nodes = Api::<Node>::all(s.member.clone());
    let taint = json!({"key": "e2e.tidepool.io/drain", "value": "true", "effect": "NoExecute"});
    let current = nodes.get(&node).await.unwrap().spec.unwrap().taints.unwrap_or_default();
    let mut with = serde_json::to_value(&current).unwrap();
    with.as_array_mut().unwrap().push(taint);
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(json!({"spec": {"taints": with}}))).await.unwrap();
    let target = reflected(&s, &job, &pod, &seen, "EvictedByMember").await;
    // Untainted before anything else is checked: the node is shared by the other tests.
    let back = serde_json::to_value(&current).unwrap();
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(json!({"spec": {"taints": back}}))).await.unwrap();
    let target = target.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(target, "DeletionByTaintManager");
    watch.abort();
    finish(&s, &job).await;
}

#[tokio::test]
async fn a_copy_the_members_kubelet_evicts_over_its_own_limit_fails_as_on_a_native_node() {
    let s = Setup::start().await;
    with_diagnosis(&s, own_limit(&s)).await;
}

async fn own_limit(s: &Setup) {
    s.without_disk_pressure().await;
    let job = format!("kubelet-{}", run_id());
    // Writes past its emptyDir's sizeLimit: the member's kubelet (its eviction manager) evicts it.
    let extra = json!({"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Mi"}}]});
    let script = "sleep 1; dd if=/dev/zero of=/scratch/fill bs=1M count=8 2>/dev/null; exec sleep 3600";
    let (pod, _) = s.job(&job, script, extra).await;
    let (pods, name) = (Api::<Pod>::namespaced(s.training.clone(), NS), pod.name_any());
    let failed = wait_for(Duration::from_secs(120), &format!("{name} Failed"), || {
        let (pods, name) = (pods.clone(), name.clone());
        async move {
            let p = pods.get(&name).await.ok()?;
            (p.status.as_ref()?.phase.as_deref() == Some("Failed")).then_some(p)
        }
    })
    .await;
    let copy = s.copies().get(&name).await.unwrap();
    let (st, member) = (failed.status.clone().unwrap(), copy.status.clone().unwrap());
    println!("training pod: {:?}: {:?}; copy: {:?}: {:?}", st.reason, st.message, member.reason, member.message);
    assert_eq!(member.reason.as_deref(), Some("Evicted"), "the member's kubelet evicted the copy");
    assert_eq!(st.reason, member.reason, "the kubelet's reason");
    assert_eq!(st.message, member.message, "the kubelet's message");
    assert!(st.message.unwrap_or_default().contains("scratch"), "names the volume");
    assert!(!has_true(&failed, "DisruptionTarget"), "its own doing, as the member's kubelet says: {:?}", st.conditions);
    assert!(!has_true(&copy, "DisruptionTarget"), "the member's kubelet added none either");
    let jobs = Api::<Job>::namespaced(s.training.clone(), NS);
    wait_for(Duration::from_secs(60), &format!("Job {job} failed (backoffLimit 0)"), || {
        let (jobs, job) = (jobs.clone(), job.clone());
        async move {
            let j = jobs.get(&job).await.ok()?;
            j.status?.conditions?.iter().any(|c| c.type_ == "Failed" && c.status == "True").then_some(())
        }
    })
    .await;
    finish(s, &job).await;
}

#[tokio::test]
async fn a_copy_the_members_kubelet_evicts_for_node_pressure_is_a_disruption_the_job_does_not_count() {
    let s = Setup::start().await;
    with_diagnosis(&s, node_pressure(&s)).await;
}

async fn node_pressure(s: &Setup) {
    s.without_disk_pressure().await;
    let job = format!("pressure-{}", run_id());
    // The member's real node keeps its kubelet root (nodefs) on a 2 GiB filesystem of its own
    // and evicts below 25 % free (tests/controlplane/realnode.sh): 1.6 GiB in an emptyDir
    // without a limit puts the node under disk pressure, and the pod using the most goes.
    let extra = json!({"volumes": [{"name": "scratch", "emptyDir": {}}]});
    // The copy may be evicted (and gone) by the time the test sees its pod Running: the node
    // is known beforehand, and watched from before the job.
    let node = s.env.var("MEMBER_A_REAL_NODE").to_owned();
    let nodes = Api::<Node>::all(s.member.clone());
    let pressure = node_watch_sees(&nodes, &node, "DiskPressure");
    let script = "sleep 1; dd if=/dev/zero of=/scratch/fill bs=1M count=1600 2>/dev/null; exec sleep 3600";
    let pod = s.job_pod(&job, script, extra).await;
    let (seen, watch) = watch_versions(&s.training, &pod.name_any());
    let target = reflected(s, &job, &pod, &seen, "Evicted").await.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(target, "TerminationByKubelet", "the kubelet's own reason for a node-pressure eviction");
    let failed = Api::<Pod>::namespaced(s.training.clone(), NS).get(&pod.name_any()).await.unwrap();
    let message = failed.status.and_then(|st| st.message).unwrap_or_default();
    assert!(message.contains("low on resource: ephemeral-storage"), "the kubelet's message: {message}");
    // The member's API server saw its node under pressure: the eviction was the kubelet's.
    assert!(pressure.await.unwrap(), "member node {node} never reported DiskPressure");
    watch.abort();
    finish(s, &job).await;
    // The Job's replacement writes as much: no copy may be left to fill the node again.
    wait_for(Duration::from_secs(90), "the job's copies gone from the member", || {
        let copies = s.copies();
        async move { copies.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    // The node leaves pressure 10 s after the space is back: the next test finds it as it was.
    s.without_disk_pressure().await;
}

/// Whether a watch of member node `node` sees condition `type_` turn True within 200 s.
fn node_watch_sees(nodes: &Api<Node>, node: &str, type_: &str) -> tokio::task::JoinHandle<bool> {
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let (nodes, type_) = (nodes.clone(), type_.to_owned());
    tokio::spawn(async move {
        let seen = async {
            let mut stream = std::pin::pin!(watcher(nodes, config));
            while let Some(event) = stream.next().await {
                if let Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = event {
                    let conditions = n.status.and_then(|st| st.conditions).unwrap_or_default();
                    if conditions.iter().any(|c| c.type_ == type_ && c.status == "True") {
                        return true;
                    }
                }
            }
            false
        };
        tokio::time::timeout(Duration::from_secs(200), seen).await.unwrap_or(false)
    })
}

#[tokio::test]
async fn a_preemption_by_the_members_scheduler_is_a_disruption_the_job_does_not_count() {
    let s = Setup::start().await;
    ensure_namespace(&s.member, ONLINE_NS).await;
    clear_pods(&s.member, ONLINE_NS).await;
    ensure_priority_class(&s.member, "e2e-online-above-offload", 1000).await;
    let job = format!("preempt-{}", run_id());
    let (pod, node) = s.job(&job, "exec sleep 3600", json!({})).await;
    let (seen, watch) = watch_versions(&s.training, &pod.name_any());
    // An online pod that needs all but a sliver of the node's CPU, allowed on the real node.
    let allocatable = Api::<Node>::all(s.member.clone()).get(&node).await.unwrap().status.unwrap().allocatable.unwrap();
    let cores: u32 = allocatable["cpu"].0.parse().unwrap();
    let online: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("online-{}", run_id())},
        "spec": {
            "priorityClassName": "e2e-online-above-offload",
            "nodeName": null,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"key": s.env.var("REAL_NODE_TAINT"), "operator": "Exists"}],
            "containers": [{"name": "main", "image": s.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"],
                            "resources": {"requests": {"cpu": format!("{}m", cores * 1000 - 50)}}}]
        }
    }))
    .unwrap();
    let online_api = Api::<Pod>::namespaced(s.member.clone(), ONLINE_NS);
    online_api.create(&PostParams::default(), &online).await.unwrap();
    let target = reflected(&s, &job, &pod, &seen, "PreemptedByMember").await;
    // The online pod goes before anything else is checked: the node is shared.
    online_api
        .delete(&online.name_any(), &DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
        .await
        .unwrap();
    let target = target.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(target, "PreemptionByScheduler");
    watch.abort();
    finish(&s, &job).await;
}

/// README: "Deleting the training pod deletes the member copy first, then finishes the
/// training pod's deletion." The copy's process ignores SIGTERM (`sleep` as PID 1), so it
/// lingers its 2 s grace: the first read that finds the training pod gone is followed by one
/// that finds the copy gone from the member too.
#[tokio::test]
async fn deleting_a_training_pod_removes_its_copy_first_then_the_pod() {
    let s = Setup::start().await;
    let job = format!("delete-{}", run_id());
    let (pod, _) = s.job(&job, "exec sleep 3600", json!({})).await;
    let name = pod.name_any();
    let copy_uid = s.copies().get(&name).await.unwrap().uid();
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    // Read about every 0.3 s: the copy's 2 s of grace cannot fall between two reads.
    wait_for(Duration::from_secs(60), &format!("training pod {name} deleted"), || {
        let pods = pods.clone();
        let (name, uid) = (name.clone(), pod.uid());
        async move {
            match pods.get_opt(&name).await {
                Ok(None) => Some(()),
                Ok(Some(p)) if p.uid() != uid => Some(()),
                _ => None,
            }
        }
    })
    .await;
    let copy = s.copies().get_opt(&name).await.unwrap();
    assert!(copy.is_none_or(|c| c.uid() != copy_uid), "the training pod went while its copy was still in the member");
    finish(&s, &job).await;
}
