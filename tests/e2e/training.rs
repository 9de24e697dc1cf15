//! A real training job across the bridge (issue 22): `tp-train` (tests/workload), parameter
//! servers and a trainer doing SGD on synthetic data, runs on member-a's real node; on the
//! reclaim notice it checkpoints to the shared S3 store (moto's server, `CHECKPOINT_STORE`),
//! acknowledges from inside the pod with its termination message and exits, and tidepool
//! reclaims it at once, not at the deadline; started again it resumes from its checkpoint.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;

use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "training";
const NS: &str = "e2e-training";
const MEMBER: &str = "e2e-train-a";
const NODE: &str = "tidepool-e2e-train-a-real";

struct Setup {
    env: Env,
    training: Client,
    member: Client,
    tidepool: Tidepool,
}

impl Setup {
    async fn start(dispatcher: &str) -> Setup {
        let (env, training, member, tidepool) = real_node_setup((TEST, NS), MEMBER, NODE, dispatcher).await;
        Setup { env, training, member, tidepool }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), NS)
    }

    /// A one-pod training job for the dispatcher: two parameter servers and one trainer as
    /// three containers (they dial each other on localhost), checkpointing under `prefix` in
    /// the shared store. `restartPolicy: Never`, as a Job with a podFailurePolicy wants.
    fn job(&self, name: &str, prefix: &str) -> Pod {
        let store = format!("{}/ckpt/{prefix}", self.env.var("CHECKPOINT_STORE"));
        let container = |name: &str, role: &str, env: serde_json::Value, cpu: &str| {
            let mut vars =
                vec![json!({"name": "TP_STORE", "value": store}), json!({"name": "TP_STEP_DELAY_MS", "value": "50"})];
            vars.extend(env.as_array().unwrap().iter().cloned());
            json!({
                "name": name, "image": self.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                "command": ["tp-train", role], "env": vars,
                "resources": {"requests": {"cpu": cpu, "memory": "16Mi"}}
            })
        };
        let index = |i: u32| json!({"name": "TP_INDEX", "value": i.to_string()});
        let port = |p: u32| json!({"name": "TP_PORT", "value": p.to_string()});
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "schedulerName": scheduler_name(TEST),
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 10,
                "containers": [
                    container("ps-0", "ps", json!([index(0), port(2222)]), "100m"),
                    container("ps-1", "ps", json!([index(1), port(2223)]), "100m"),
                    container("trainer", "trainer", json!([index(0),
                        {"name": "TP_PS", "value": "127.0.0.1:2222,127.0.0.1:2223"}]), "300m"),
                ]
            }
        }))
        .unwrap()
    }

    /// The trainer's log lines through the training cluster.
    async fn trainer_log(&self, pod: &str) -> String {
        kubectl(&self.env, "training", &["-n", NS, "logs", pod, "-c", "trainer"], None).await.1
    }

    /// Waits until the trainer has logged at least `n` step lines, and returns them as
    /// (step, loss).
    async fn await_steps(&self, pod: &str, n: usize) -> Vec<(u64, f64)> {
        wait_for(Duration::from_secs(120), &format!("{n} step lines in {pod}'s trainer log"), || async move {
            let steps = steps(&self.trainer_log(pod).await);
            (steps.len() >= n).then_some(steps)
        })
        .await
    }

    /// Holds back all but 300m of the real node's CPU (a peak in member-a): the 500m job no
    /// longer fits and tidepool reclaims it with a notice. `None` lets it all go again.
    async fn hold_back_cpu(&self, hold: bool) {
        lend_real_cpu(&self.env, (&self.training, &self.member), (MEMBER, "member-a"), hold.then_some(300)).await;
    }
}

/// `step=N loss=L` of each trainer log line that has them.
pub(crate) fn steps(log: &str) -> Vec<(u64, f64)> {
    log.lines()
        .filter_map(|l| {
            let field = |key: &str| l.split_whitespace().find_map(|w| w.strip_prefix(key));
            Some((field("step=")?.parse().ok()?, field("loss=")?.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn the_job_acks_the_notice_from_inside_is_reclaimed_at_once_and_resumes_from_its_checkpoint() {
    // Ten minutes of grace in every band: a reclaim before that is the ack's doing.
    let s = Setup::start("deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 600, medium: 600, low: 600}").await;
    s.hold_back_cpu(false).await;
    let id = run_id();
    let first = format!("train-{id}");
    s.pods().create(&PostParams::default(), &s.job(&first, &id)).await.unwrap();

    // 1. It trains: the loss falls.
    let before = s.await_steps(&first, 6).await;
    let (start_loss, end_loss) = (before[0].1, before.last().unwrap().1);
    assert!(end_loss < start_loss / 10.0, "the loss did not fall: {before:?}");
    println!("loss {start_loss} at step {} -> {end_loss} at step {}", before[0].0, before.last().unwrap().0);

    // 2. Online demand: the notice. The processes checkpoint, write the ack as their
    //    termination message and exit; the pod is reclaimed then, not at the deadline.
    s.hold_back_cpu(true).await;
    let pods = s.pods();
    let pod = wait_for(Duration::from_secs(120), "the job reclaimed", || {
        let (pods, first) = (pods.clone(), first.clone());
        async move {
            let pod = pods.get(&first).await.ok()?;
            let status = pod.status.as_ref()?;
            (status.phase.as_deref() != Some("Running") && status.phase.as_deref() != Some("Pending")).then_some(pod)
        }
    })
    .await;
    let status = pod.status.unwrap();
    let log = s.tidepool.log_tail();
    assert_eq!(status.phase.as_deref(), Some("Failed"), "a reclaimed job is never Succeeded\n{log}");
    assert_eq!(status.reason.as_deref(), Some(keys::REASON_RECLAIMED));
    let message = status.message.unwrap_or_default();
    assert!(message.contains("checkpoint acknowledged by the pod as it exited"), "{message}");
    let conditions = status.conditions.unwrap_or_default();
    assert!(
        conditions.iter().any(|c| c.type_ == keys::CONDITION_DISRUPTION_TARGET && c.status == "True"),
        "no DisruptionTarget: {conditions:?}"
    );
    // The trainer's own ack, as the member's kubelet reported it.
    let trainer = status.container_statuses.unwrap_or_default().into_iter().find(|c| c.name == "trainer").unwrap();
    let ack = trainer.state.and_then(|st| st.terminated).and_then(|t| t.message).unwrap_or_default();
    let acked_step: u64 = ack
        .strip_prefix(keys::TERMINATION_ACK_PREFIX)
        .and_then(|rest| rest.split_whitespace().find_map(|w| w.strip_prefix("step=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no ack in the trainer's termination message: {ack:?}"));
    println!("acked at step {acked_step}: {message}");

    // 3. Room again: the job, started anew, resumes from its checkpoint: its step count goes
    //    on from the acked step and the loss stays where training had brought it.
    s.hold_back_cpu(false).await;
    let second = format!("train-{id}-again");
    s.pods().create(&PostParams::default(), &s.job(&second, &id)).await.unwrap();
    let after = s.await_steps(&second, 2).await;
    let log = s.trainer_log(&second).await;
    assert!(log.starts_with(&format!("trainer 0: resumed at step {acked_step} ")), "{log}");
    assert!(after[0].0 > acked_step, "the step count went back: {after:?} after {acked_step}");
    assert!(after[0].1 < start_loss / 10.0, "the loss jumped back: {} after {end_loss}", after[0].1);
    println!("resumed: step {} loss {}", after[0].0, after[0].1);
    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn when_the_member_preempts_the_copy_itself_sigterm_is_the_notice_and_the_job_resumes() {
    let s = Setup::start("").await;
    s.hold_back_cpu(false).await;
    let id = run_id();
    let first = format!("pre-{id}");
    s.pods().create(&PostParams::default(), &s.job(&first, &id)).await.unwrap();
    let before = s.await_steps(&first, 3).await;
    let last_seen = before.last().unwrap().0;

    // The member takes the copy back without any notice, as its scheduler does when online
    // pods arrive faster than tidepool's reclaim: a delete with the copy's own grace period.
    let copies = Api::<Pod>::namespaced(s.member.clone(), &offload_ns(NS));
    let copy = copies.get(&first).await.unwrap();
    assert_eq!(
        copy.spec.as_ref().unwrap().termination_grace_period_seconds,
        Some(10),
        "the copy keeps the training pod's grace"
    );
    copies.delete(&first, &Default::default()).await.unwrap();
    let pods = s.pods();
    wait_for(Duration::from_secs(60), "the training pod failed", || {
        let (pods, first) = (pods.clone(), first.clone());
        async move { (pods.get(&first).await.ok()?.status?.phase? == "Failed").then_some(()) }
    })
    .await;
    // The copy is gone once its processes have saved and exited (within its grace).
    wait_for(Duration::from_secs(30), "the copy gone", || {
        let (copies, first) = (copies.clone(), first.clone());
        async move { copies.get_opt(&first).await.ok()?.is_none().then_some(()) }
    })
    .await;

    // Started again, the job resumes from what it saved on SIGTERM.
    let second = format!("pre-{id}-again");
    s.pods().create(&PostParams::default(), &s.job(&second, &id)).await.unwrap();
    let after = s.await_steps(&second, 1).await;
    let log = s.trainer_log(&second).await;
    let resumed: u64 = log
        .strip_prefix("trainer 0: resumed at step ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the trainer did not resume from a checkpoint: {log}"));
    assert!(resumed >= last_seen, "resumed at {resumed}, before step {last_seen} was logged");
    assert!(after[0].0 > resumed, "{after:?}");
    println!("SIGTERM checkpoint: logged step {last_seen}, resumed at {resumed}, next step {}", after[0].0);
    drain_pods(&s.training, NS).await;
}

/// A PS/worker job as a launcher makes it: 2 parameter-server pods (`hostname`/`subdomain`
/// under headless Service `svc`) and `trainers` trainer pods that dial `<ps>.<svc>:2222`, one
/// gang of `min` pods (`tidepool.io/gang`), for the dispatcher.
fn ps_worker_job(s: &Setup, id: &str, svc: &str, trainers: u32, min: u32) -> Vec<Pod> {
    let store = format!("{}/ckpt/{id}", s.env.var("CHECKPOINT_STORE"));
    let ps_addrs = format!("{svc}-ps-0.{svc}:2222,{svc}-ps-1.{svc}:2222");
    let pod = |name: String, role: &str, index: u32, extra: serde_json::Value| -> Pod {
        let mut spec = json!({
            "schedulerName": scheduler_name(TEST),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "containers": [{
                "name": role, "image": s.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                "command": ["tp-train", role],
                "env": [{"name": "TP_INDEX", "value": index.to_string()}, {"name": "TP_STORE", "value": store},
                        {"name": "TP_PS", "value": ps_addrs}, {"name": "TP_STEP_DELAY_MS", "value": "50"}],
                "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}
            }]
        });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"job": id, "role": role},
                         "annotations": {keys::ANNOTATION_GANG: id, keys::ANNOTATION_MIN_MEMBER: min.to_string()}},
            "spec": spec,
        }))
        .unwrap()
    };
    let mut pods: Vec<Pod> = (0..2)
        .map(|i| pod(format!("{svc}-ps-{i}"), "ps", i, json!({"hostname": format!("{svc}-ps-{i}"), "subdomain": svc})))
        .collect();
    pods.extend((0..trainers).map(|i| pod(format!("{svc}-trainer-{i}"), "trainer", i, json!({}))));
    pods
}

#[tokio::test]
async fn a_ps_worker_job_finds_its_parameter_servers_by_service_name_on_one_member_and_its_loss_falls() {
    let s = Setup::start("").await;
    s.hold_back_cpu(false).await;
    let id = run_id();
    let svc = format!("ctr-{id}");
    let service: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
        "metadata": {"name": svc},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": true,
                 "selector": {"job": id, "role": "ps"}, "ports": [{"name": "ps", "port": 2222}]}
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(s.training.clone(), NS)
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    // 2 PS + 2 trainers, minMember 3 (the PS and one trainer).
    for p in ps_worker_job(&s, &id, &svc, 2, 3) {
        s.pods().create(&PostParams::default(), &p).await.unwrap();
    }
    for i in 0..2 {
        let trainer = format!("{svc}-trainer-{i}");
        let steps = s.await_steps(&trainer, 4).await;
        let (first, last) = (steps[0], *steps.last().unwrap());
        assert!(last.1 < first.1, "trainer {i}: the loss did not fall: {steps:?}");
        println!("trainer {i}: loss {} at step {} -> {} at step {}", first.1, first.0, last.1, last.0);
    }
    // Every pod of the job runs on the one pool it was placed on.
    let pods = s.pods().list(&Default::default()).await.unwrap();
    let nodes: std::collections::BTreeSet<_> = pods
        .items
        .iter()
        .filter(|p| p.metadata.labels.as_ref().and_then(|l| l.get("job")) == Some(&id))
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    assert_eq!(nodes.into_iter().collect::<Vec<_>>(), [NODE]);
    drain_pods(&s.training, NS).await;
}
