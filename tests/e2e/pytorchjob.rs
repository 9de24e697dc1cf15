//! PyTorchJobs as the Kubeflow training-operator runs them, with real PyTorch processes
//! (Debian's torch, DDP over gloo: tests/frameworks/torch_ddp.py) on the members' real nodes.
//!
//! - master + 3 workers: the operator's pods, Services (`MASTER_ADDR=<job>-master-0`, a short
//!   name through the mirrored headless Service) and init containers (the workers wait for
//!   the master's name to resolve); the job trains to `Succeeded`; `kubectl exec` and
//!   `kubectl logs` reach an operator-made pod.
//! - the training-operator with `--gang-scheduler-name=tidepool`: its `scheduling.x-k8s.io`
//!   PodGroup is the gang tidepool reads.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "pytorchjob";
const NS: &str = "e2e-pytorchjob";

/// Runs a PyTorchJob of a master and 3 workers to `Succeeded` on member-a, the operator
/// started with `flags`; returns the job's pods as they ran.
async fn run_to_success(b: &Bridge, flags: &[&str], what: &str) -> Vec<k8s_openapi::api::core::v1::Pod> {
    let mut all = vec![format!("--namespace={NS}")];
    all.extend(flags.iter().map(|f| (*f).to_owned()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let _operator = Operator::start(&b.env, "training-operator", &all).await;
    let name = format!("pt-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");
    b.submit(&jobs, pytorchjob(&name, &scheduler_name(TEST), &store, 3, 300)).await;
    let selector = format!("training.kubeflow.org/job-name={name}");
    let pods = b.await_running(&selector, 4, &real_node(TEST, 0)).await;
    println!("{what}: {:?}", pods.iter().map(|p| (p.name_any(), labels_of(p))).collect::<Vec<_>>());
    let master = format!("{name}-master-0");
    let seen = b.await_steps(&master, None, 3).await;
    println!("{what}: master {seen:?}");
    assert!(seen.last().unwrap().1 < seen.first().unwrap().1, "the loss falls: {seen:?}");
    b.await_condition(&jobs, &name, "Succeeded", Duration::from_secs(600)).await;
    b.lend(1, None).await;
    pods
}

#[tokio::test]
async fn a_pytorchjob_of_a_master_and_three_workers_trains_over_gloo_to_success() {
    let b = Bridge::start(TEST, NS).await;
    let pods = run_to_success(&b, &[], "no gang flag").await;
    // One gang by the operator's labels, its core the whole job: nothing of tidepool's was written.
    assert!(pods.iter().all(|p| p.labels().get(keys::LABEL_ROLE).map(String::as_str) == Some(keys::ROLE_CORE)));
    assert!(pods.iter().all(|p| !p.labels().contains_key(keys::LABEL_POD_GROUP)));
    // The workers' init container (the operator's, on the local image) waited for the
    // master's name: it resolved in the member through the mirrored Service.
    let worker = pods.iter().find(|p| p.name_any().contains("-worker-")).unwrap();
    let init = worker.spec.as_ref().unwrap().init_containers.clone().unwrap_or_default();
    assert!(!init.is_empty(), "the operator's init container is there");
}

#[tokio::test]
async fn with_the_operators_gang_flag_its_podgroup_is_the_gang() {
    let b = Bridge::start(TEST, NS).await;
    let pods = run_to_success(&b, &["--gang-scheduler-name=tidepool"], "gang flag").await;
    let group = pods[0].labels().get(keys::LABEL_POD_GROUP).cloned().expect("the operator labels its pods");
    assert!(pods.iter().all(|p| p.labels().get(keys::LABEL_POD_GROUP) == Some(&group)));
    // The gang tidepool placed is the operator's PodGroup, sized by its minMember (all 4).
    let events = kube::Api::<k8s_openapi::api::core::v1::Event>::namespaced(b.training.clone(), NS);
    let placed = events.list(&kube::api::ListParams::default().fields("reason=Placed")).await.unwrap().items;
    let said: Vec<String> = placed.into_iter().filter_map(|e| e.message).collect();
    let want = format!("gang {NS}/podgroup/{group} (4 pods)");
    assert!(said.iter().any(|m| m.contains(&want)), "no Placed event for {want}: {said:?}");
}

#[tokio::test]
async fn kubectl_exec_and_logs_reach_an_operator_made_pod() {
    let b = Bridge::start("pytorchjob-exec", "e2e-pytorchjob-exec").await;
    let _operator = Operator::start(&b.env, "training-operator", &["--namespace=e2e-pytorchjob-exec"]).await;
    let name = format!("pt-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");
    b.submit(&jobs, pytorchjob(&name, &scheduler_name("pytorchjob-exec"), &store, 1, 0)).await;
    let selector = format!("training.kubeflow.org/job-name={name}");
    b.await_running(&selector, 2, &real_node("pytorchjob-exec", 0)).await;
    let master = format!("{name}-master-0");
    let (code, out, err) = kubectl(
        &b.env,
        "training",
        &["-n", &b.ns, "exec", &master, "--", "sh", "-c", "echo $MASTER_ADDR $WORLD_SIZE $RANK; exit 7"],
        None,
    )
    .await;
    println!("exec: {code} {out:?} {err:?}");
    assert_eq!(code, 7, "the exit status comes back");
    assert!(out.trim_end().ends_with("2 0"), "WORLD_SIZE and RANK of the master: {out:?}");
    b.await_steps(&master, None, 1).await;
    b.remove_job(&jobs, &name).await;
}

/// The worlds (`(world) ` of `... (world W)` lines) a torch_ddp log reports, in order.
fn worlds(log: &str) -> Vec<u32> {
    log.lines().filter_map(|l| l.split_once("(world ")?.1.split(')').next()?.trim().parse().ok()).collect()
}

/// An elastic PyTorchJob of 4 workers (`elasticPolicy` 2 to 4, torchrun's c10d rendezvous on
/// worker 0) as a test runs it: its gang is its floor (2), so workers 2 and 3 are elastic
/// (band `low`).
struct Elastic<'a> {
    b: &'a Bridge,
    jobs: kube::Api<kube::api::DynamicObject>,
    name: String,
    selector: String,
}

impl<'a> Elastic<'a> {
    /// Submits the job with the training-operator running; `native` annotates its workers
    /// `tidepool.io/native: core` (the core on the training cluster's own nodes).
    async fn submit(b: &'a Bridge, native: bool) -> Elastic<'a> {
        // An earlier run's jobs (a rerun on the same clusters) would take the floor's room (the
        // CRD is there once the operator started).
        let jobs = b.jobs("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");
        jobs.delete_collection(&kube::api::DeleteParams::background(), &Default::default()).await.unwrap();
        let name = format!("pte-{}", run_id());
        let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
        b.lend(1, Some(0)).await;
        let env = json!([
            {"name": "TP_STEP_DELAY_MS", "value": "100"}, {"name": "TP_LOG_EVERY", "value": "10"},
            {"name": "TP_CHECKPOINT_EVERY", "value": "50"}
        ]);
        let mut container = framework_container("pytorch", "torch_ddp.py", &store, env);
        container["command"] =
            json!(["python3", "/opt/tidepool/tidepool_notice.py", "torchrun", "/opt/tidepool/torch_ddp.py"]);
        let mut template = json!({"spec": {"schedulerName": scheduler_name(&b.test), "containers": [container]}});
        if native {
            template["metadata"] = json!({"annotations": {keys::ANNOTATION_NATIVE: "core"}});
            // The training cluster's real node keeps other pods off with its taint.
            let taint = b.env.var("REAL_NODE_TAINT");
            template["spec"]["tolerations"] = json!([{"key": taint, "operator": "Exists", "effect": "NoSchedule"}]);
        }
        let job = json!({
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name},
            "spec": {
                "runPolicy": {"cleanPodPolicy": "Running"},
                // One process per pod: the operator's default ("auto") is a process per CPU.
                "nprocPerNode": "1",
                "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 20},
                "pytorchReplicaSpecs": {"Worker": {"replicas": 4, "restartPolicy": "OnFailure", "template": template}}
            }
        });
        b.submit(&jobs, job).await;
        let selector = format!("training.kubeflow.org/job-name={name}");
        Elastic { b, jobs, name, selector }
    }

    fn worker(&self, i: u32) -> String {
        format!("{}-worker-{i}", self.name)
    }

    /// Waits until its 4 workers run, workers 0 and 1 on `core_node` and 2 and 3 on member-a's
    /// real node, and the job trains at 4; returns the pods and worker 0's steps so far.
    async fn at_four(&self, core_node: &str) -> (Vec<Pod>, Vec<(u64, f64)>) {
        let on_a = real_node(&self.b.test, 0);
        let what = format!("workers 0, 1 running on {core_node}, 2, 3 on {on_a}");
        let on_a = on_a.as_str();
        let pods = wait_for(WAIT, &what, || async move {
            let pods = self.b.live(&self.selector).await;
            let on = |p: &Pod, i: u32, node: &str| {
                p.name_any() == self.worker(i) && phase(p) == "Running" && node_of(p) == node
            };
            let placed =
                pods.iter().filter(|p| on(p, 0, core_node) || on(p, 1, core_node) || on(p, 2, on_a) || on(p, 3, on_a));
            (pods.len() == 4 && placed.count() == 4).then_some(pods)
        })
        .await;
        let w0 = self.worker(0);
        wait_for(WAIT, "the job at 4", || async { worlds(&self.b.log(&w0, None).await).contains(&4).then_some(()) })
            .await;
        let steps = self.b.await_steps(&w0, None, 2).await;
        (pods, steps)
    }

    /// Member-a lends `milli` CPU: its elastic workers are reclaimed, each acking from inside,
    /// and torchrun re-forms the job on workers 0 and 1, which train on.
    async fn reclaim_elastic(&self, pods: &[Pod], milli: u32) {
        let uids: Vec<String> =
            pods.iter().filter(|p| role(p) == keys::ROLE_ELASTIC).filter_map(|p| p.metadata.uid.clone()).collect();
        assert_eq!(uids.len(), 2, "two elastic workers");
        let seen = self.b.watch(&self.selector);
        self.b.lend(0, Some(milli)).await;
        let reclaimed = seen.await_ended(&uids, keys::REASON_RECLAIMED, "the elastic workers reclaimed").await;
        for p in &reclaimed {
            println!("{}: reclaimed, ack at step {:?}", p.name_any(), acked_step(p));
            assert!(acked_step(p).is_some(), "{} acked from inside", p.name_any());
        }
        let w0 = self.worker(0);
        let reformed = tokio::time::timeout(WAIT, async {
            loop {
                let log = self.b.log(&w0, None).await;
                if log.rfind("(world 2)").is_some_and(|at_two| steps(&log[at_two..]).len() >= 2) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        if reformed.await.is_err() {
            explain(self.b, &self.b.ns, &self.selector, &[&w0, &self.worker(1)]).await;
            panic!("timed out after {WAIT:?} waiting for the job to re-form at 2 and train");
        }
        let running: Vec<_> = self
            .b
            .live(&self.selector)
            .await
            .into_iter()
            .filter(|p| phase(p) == "Running")
            .map(|p| p.name_any())
            .collect();
        println!("running on the floor: {running:?}");
        assert!(running.contains(&w0) && running.contains(&self.worker(1)), "the core kept running");
    }

    /// Member-a lends everything again: the operator's new workers join there and the job
    /// grows back to 4 and trains on from where it was.
    async fn grow_back(&self, core_node: &str, before: &[(u64, f64)]) {
        self.b.lend(0, None).await;
        self.at_four(core_node).await;
        let w0 = self.worker(0);
        wait_for(WAIT, "the job back at 4", || async {
            let log = self.b.log(&w0, None).await;
            let back = log.rfind("(world 4)")?;
            (back > log.rfind("(world 2)")? && !steps(&log[back..]).is_empty()).then_some(())
        })
        .await;
        let after = self.b.await_steps(&w0, None, 1).await;
        println!("worker 0: {before:?} ... {:?}", after.last());
        assert!(after.last().unwrap().0 > before.last().unwrap().0, "the steps went on");
    }

    /// Its pods gone before the test (and its bridge) ends: a copy left running would be
    /// online demand for the next test's bridge.
    async fn finish(self) {
        self.jobs.delete(&self.name, &kube::api::DeleteParams::background()).await.unwrap();
        let listed = kube::api::ListParams::default().labels(&self.selector);
        wait_for(WAIT, "the job's pods gone", || async {
            self.b.pods().list(&listed).await.ok()?.items.is_empty().then_some(())
        })
        .await;
        self.b.lend(1, None).await;
    }
}

fn role(p: &Pod) -> String {
    p.labels().get(keys::LABEL_ROLE).cloned().unwrap_or_default()
}

/// Online demand on member-a takes the elastic workers with the notice; torchrun re-forms the
/// job on the 2 left, which resume from rank 0's save and go on training; when the demand
/// falls the operator's new workers join the same member and the job grows back to 4.
#[tokio::test]
async fn an_elastic_pytorchjob_loses_its_elastic_workers_to_online_demand_trains_on_and_grows_back() {
    let test = "pytorchjob-elastic";
    let ns = "e2e-pytorchjob-elastic";
    let b = Bridge::start(test, ns).await;
    let _operator = Operator::start(&b.env, "training-operator", &[&format!("--namespace={ns}")]).await;
    let job = Elastic::submit(&b, false).await;
    let on_a = real_node(test, 0);
    let (pods, before) = job.at_four(&on_a).await;
    println!("{:?}", pods.iter().map(|p| (p.name_any(), role(p))).collect::<Vec<_>>());
    let elastic: Vec<String> = pods.iter().filter(|p| role(p) == keys::ROLE_ELASTIC).map(|p| p.name_any()).collect();
    assert_eq!(elastic, [job.worker(2), job.worker(3)], "the floor (2) is the core, by index");
    // Online demand: member-a lends room for two workers only — room the floor has only once
    // no earlier test's pod is left on the node (they would count as online demand too).
    quiet_node(&b, &job.name).await;
    job.reclaim_elastic(&pods, 2 * 50 + 20).await;
    job.grow_back(&on_a, &before).await;
    job.finish().await;
}

/// The native floor with a real operator (issue 42): the same elastic PyTorchJob with its
/// workers marked `tidepool.io/native: core` keeps workers 0 and 1 on the training cluster's
/// real node and borrows 2 and 3 from member-a. The borrowed workers reach worker 0 by the
/// operator's name (`<job>-worker-0:29400`, torchrun's rendezvous), which the member's DNS
/// answers from tidepool's native slice beside the mirror; the native workers reach them by
/// their training pods' IPs. Member-a taking everything back ends only the borrowed workers
/// (a watch of the training API server sees nothing happen to the native ones), the job trains
/// on natively at 2, and grows back to 4 when member-a lends again.
#[tokio::test]
async fn an_elastic_pytorchjob_keeps_its_core_native_and_borrows_its_elastic_workers() {
    let test = "pytorchjob-native";
    let ns = "e2e-pytorchjob-native";
    let native = ", nativeNodes: {nodeSelector: {tidepool.io/test-pool: real}}";
    let b = Bridge::start_with(test, ns, native).await;
    let _operator = Operator::start(&b.env, "training-operator", &[&format!("--namespace={ns}")]).await;
    let job = Elastic::submit(&b, true).await;
    let core_node = b.env.var("TRAINING_REAL_NODE").to_owned();
    let (pods, before) = job.at_four(&core_node).await;
    println!("{:?}", pods.iter().map(|p| (p.name_any(), node_of(p), role(p))).collect::<Vec<_>>());
    // The name the borrowed workers rendezvous at: in member-a, tidepool's slice beside the
    // mirror lists worker 0's IP on the training cluster.
    let w0_ip = pods.iter().find(|p| p.name_any() == job.worker(0)).and_then(|p| p.status.clone()?.pod_ip).unwrap();
    let slices = kube::Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::all(b.members[0].clone());
    let by_service = kube::api::ListParams::default().labels(&format!("kubernetes.io/service-name={}", job.worker(0)));
    let listed = wait_for(Duration::from_secs(30), "member-a's slice listing worker 0's native IP", || {
        let (slices, by_service, w0_ip) = (slices.clone(), by_service.clone(), w0_ip.clone());
        async move {
            let listed: Vec<Vec<String>> = slices
                .list(&by_service)
                .await
                .ok()?
                .items
                .into_iter()
                .flat_map(|s| s.endpoints.into_iter().flatten().map(|e| e.addresses))
                .collect();
            listed.iter().any(|a| a.contains(&w0_ip)).then_some(listed)
        }
    })
    .await;
    println!("member-a's endpoints of {}: {listed:?} (worker 0 at {w0_ip})", job.worker(0));
    let (touched, watch) = watch_untouched(&b.training, ns, vec![job.worker(0), job.worker(1)]);
    job.reclaim_elastic(&pods, 0).await;
    job.grow_back(&core_node, &before).await;
    watch.abort();
    let touched = touched.lock().unwrap().clone();
    assert!(touched.is_empty(), "the native workers were disrupted: {touched:?}");
    job.finish().await;
}

/// Waits (up to 2 min) until member-a's real node runs no pod but this job's copies and the
/// cluster's own (kube-system).
async fn quiet_node(b: &Bridge, job: &str) {
    let node = b.env.var("MEMBER_A_REAL_NODE").to_owned();
    let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(b.members[0].clone());
    let on_node = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    let mut others = Vec::new();
    for _ in 0..240 {
        let list = pods.list(&on_node).await.map(|l| l.items).unwrap_or_default();
        others = list
            .iter()
            .filter(|p| p.namespace().as_deref() != Some("kube-system") && !p.name_any().starts_with(job))
            .filter(|p| !matches!(phase(p), "Succeeded" | "Failed"))
            .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
            .collect();
        if others.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("after 2 min, pods of other tests still run on member-a's real node: {others:?}");
}

/// What a test that timed out on torchrun needs to be understood: the pods as the training
/// cluster shows them, and the logs (the current and the previous container) of `pods`.
async fn explain(b: &Bridge, ns: &str, selector: &str, pods: &[&str]) {
    let (_, listed, _) =
        kubectl(&b.env, "training", &["-n", ns, "get", "pods", "-l", selector, "-o", "wide"], None).await;
    println!("--- pods\n{listed}");
    for pod in pods {
        for previous in [true, false] {
            let mut args = vec!["-n", ns, "logs", pod, "--tail=60"];
            if previous {
                args.push("--previous");
            }
            let (_, log, err) = kubectl(&b.env, "training", &args, None).await;
            println!("--- {pod} (previous: {previous})\n{log}{err}");
        }
    }
}
