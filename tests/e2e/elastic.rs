//! The PS/worker training job (tests/workload's `tp-train`) as Jobs make it, on the real
//! nodes, through the elastic life of issue 22 item 7: online demand takes its elastic
//! trainers and gives them back; a deeper deficit takes the whole job, which resumes on the
//! other member from its checkpoints; a parameter server's death restarts the whole gang,
//! while an elastic trainer's only shrinks it.
//!
//! The job: two Indexed Jobs (`<svc>-ps`, `<svc>-trainer`) whose pods form one gang
//! (`tidepool.io/gang`, `minMember` 3: the PS and one trainer), the PS under headless Service
//! `<svc>`, a `podFailurePolicy` that ignores `DisruptionTarget` (reclaims and restarts are
//! no failure of the job). Each test prints the steps, losses and times it saw.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use tidepool_api::keys;

use crate::harness::*;
use crate::training::steps;

const TEST: &str = "elastic";
const NS: &str = "e2e-elastic";
/// The MemberClusters of member-a and member-b, and their real pools' virtual nodes.
const MEMBERS: [(&str, &str, &str); 2] = [
    ("e2e-elastic-a", "member-a", "tidepool-e2e-elastic-a-real"),
    ("e2e-elastic-b", "member-b", "tidepool-e2e-elastic-b-real"),
];
/// Each pod's CPU request: the job is 5 × 50m at most.
const POD_CPU_MILLI: u32 = 50;
/// Bounded waits for the steps of a scenario (a reclaim, a placement, a resume).
const WAIT: Duration = Duration::from_secs(120);

struct Setup {
    env: Env,
    training: Client,
    /// member-a's and member-b's clients.
    members: Vec<Client>,
    /// Runs while the test does (dropped, it stops).
    _tidepool: Tidepool,
    /// The run's id: the job's label, its gang and its checkpoint prefix.
    id: String,
    svc: String,
}

impl Setup {
    /// Bridges member-a (and member-b when `both`) with their real pools, every pool lending
    /// all its CPU, and waits for their virtual nodes.
    async fn start(both: bool) -> Setup {
        let env = Env::load();
        assert_eq!(env.var("CP_REAL_NODES"), "1", "these tests need the real nodes (CP_REAL_NODES=1)");
        let training = env.client("training").await;
        // An earlier run's Jobs first, or they would make new pods as fast as they are cleared.
        delete_jobs(&training).await;
        prepare(&env, &training, TEST, NS).await;
        let used = if both { &MEMBERS[..] } else { &MEMBERS[..1] };
        let mut members = Vec::new();
        for (name, cluster, _) in used {
            members.push(env.client(cluster).await);
            let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
            put_kubeconfig_secret(&training, NS, cluster, &kubeconfig).await;
            apply_real_member(&env, &training, name, cluster).await;
        }
        let dispatcher = "deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 120, medium: 120, low: 120}";
        let tidepool = Tidepool::start_config(&env, TEST, NS, dispatcher, &kubelet_config(&env));
        let id = run_id();
        let s = Setup { env, training, members, _tidepool: tidepool, svc: format!("ctr-{id}"), id };
        for (i, (_, _, node)) in used.iter().enumerate() {
            s.lend(i, None).await;
            let nodes = Api::<Node>::all(s.training.clone());
            wait_for(Duration::from_secs(90), &format!("virtual node {node} Ready"), || {
                let nodes = nodes.clone();
                async move {
                    let n = nodes.get_opt(node).await.ok().flatten()?;
                    n.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
                }
            })
            .await;
        }
        s
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), NS)
    }

    /// Lets member `i`'s pool lend `milli` CPU of its real node (the rest held back, as online
    /// demand would take it), or everything (`None`).
    async fn lend(&self, i: usize, milli: Option<u32>) {
        lend_real_cpu(&self.env, (&self.training, &self.members[i]), (MEMBERS[i].0, MEMBERS[i].1), milli).await;
    }

    /// The job: headless Service `svc` over the PS, the PS Job (whose pods exist before any
    /// trainer's, so the gang's core is the PS and the first trainer), then the trainer Job.
    /// `ps_env` goes to the parameter servers only.
    async fn submit(&self, trainers: u32, ps_env: serde_json::Value) {
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": self.svc},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": true,
                     "selector": {"job": self.id, "role": "ps"}, "ports": [{"name": "ps", "port": 2222}]}
        }))
        .unwrap();
        Api::<Service>::namespaced(self.training.clone(), NS).create(&PostParams::default(), &service).await.unwrap();
        let jobs = Api::<Job>::namespaced(self.training.clone(), NS);
        jobs.create(&PostParams::default(), &self.job("ps", 2, ps_env)).await.unwrap();
        wait_for(WAIT, "the PS Job's two pods", || async move { (self.live("ps").await.len() == 2).then_some(()) })
            .await;
        jobs.create(&PostParams::default(), &self.job("trainer", trainers, json!([]))).await.unwrap();
    }

    fn job(&self, role: &str, count: u32, extra_env: serde_json::Value) -> Job {
        let store = format!("{}/ckpt/{}", self.env.var("CHECKPOINT_STORE"), self.id);
        let svc = &self.svc;
        let mut env = vec![
            json!({"name": "TP_STORE", "value": store}),
            json!({"name": "TP_PS", "value": format!("{svc}-ps-0.{svc}:2222,{svc}-ps-1.{svc}:2222")}),
            json!({"name": "TP_STEP_DELAY_MS", "value": "50"}),
        ];
        env.extend(extra_env.as_array().unwrap().iter().cloned());
        let mut spec = json!({
            "schedulerName": scheduler_name(TEST),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "containers": [{
                "name": role, "image": self.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                "command": ["tp-train", role], "env": env,
                // A process that fails before its ack leaves its last lines as the message.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {"requests": {"cpu": format!("{POD_CPU_MILLI}m"), "memory": "16Mi"}}
            }]
        });
        if role == "ps" {
            spec["subdomain"] = json!(svc);
        }
        serde_json::from_value(json!({
            "metadata": {"name": format!("{svc}-{role}")},
            "spec": {
                "completionMode": "Indexed", "completions": count, "parallelism": count, "backoffLimit": 6,
                "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                "template": {
                    "metadata": {"labels": {"job": self.id, "role": role},
                                 "annotations": {keys::ANNOTATION_GANG: self.id, keys::ANNOTATION_MIN_MEMBER: "3"}},
                    "spec": spec,
                }
            }
        }))
        .unwrap()
    }

    /// The job's pods of `role` (`ps`, `trainer`, or "" for all) that are not over, by name.
    async fn live(&self, role: &str) -> Vec<Pod> {
        let mut selector = format!("job={}", self.id);
        if !role.is_empty() {
            selector.push_str(&format!(",role={role}"));
        }
        let list =
            self.pods().list(&ListParams::default().labels(&selector)).await.map(|l| l.items).unwrap_or_default();
        let mut live: Vec<Pod> = list
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| !matches!(phase(p), "Failed" | "Succeeded"))
            .collect();
        live.sort_by_key(|p| p.name_any());
        live
    }

    /// Waits until exactly `n` pods of the job run, all on virtual node `node`, and returns them.
    async fn await_running(&self, n: usize, node: &str, what: &str) -> Vec<Pod> {
        wait_for(WAIT, what, || async move {
            let pods = self.live("").await;
            let running = pods.iter().filter(|p| phase(p) == "Running" && node_of(p) == node).count();
            (pods.len() == n && running == n).then_some(pods)
        })
        .await
    }

    async fn log(&self, pod: &str) -> String {
        kubectl(&self.env, "training", &["-n", NS, "logs", pod], None).await.1
    }

    /// Waits until `pod` has logged at least `n` step lines; returns them as (step, loss).
    async fn await_steps(&self, pod: &str, n: usize) -> Vec<(u64, f64)> {
        wait_for(WAIT, &format!("{n} step lines in {pod}'s log"), || async move {
            let steps = steps(&self.log(pod).await);
            (steps.len() >= n).then_some(steps)
        })
        .await
    }

    /// Kills the process of `pod`'s container in member `i` with SIGKILL through the real
    /// node's containerd: the process dies, the pod object is left to the kubelet and tidepool.
    async fn kill_process(&self, i: usize, pod: &str) {
        let copies = Api::<Pod>::namespaced(self.members[i].clone(), &offload_ns(NS));
        let copy = copies.get(pod).await.unwrap();
        let id = copy.status.and_then(|s| s.container_statuses).and_then(|c| c.into_iter().next()?.container_id);
        let id = id.unwrap_or_else(|| panic!("the copy of {pod} has no container id"));
        let id = id.strip_prefix("containerd://").unwrap_or(&id).to_owned();
        let socket = self.env.var(&format!("{}_CONTAINERD", MEMBERS[i].1.to_uppercase().replace('-', "_")));
        let out = tokio::process::Command::new(self.env.var("CTR"))
            .args(["--address", socket, "--namespace", "k8s.io", "tasks", "kill", "--signal", "SIGKILL", &id])
            .output();
        let out = tokio::time::timeout(Duration::from_secs(30), out).await.unwrap().unwrap();
        assert!(out.status.success(), "ctr tasks kill {id}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Deletes the job's Jobs (and so its pods, through tidepool) and waits for them to go.
    async fn finish(&self) {
        delete_jobs(&self.training).await;
        drain_pods(&self.training, NS).await;
    }
}

fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

fn node_of(p: &Pod) -> &str {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("")
}

fn label<'a>(p: &'a Pod, key: &str) -> &'a str {
    p.labels().get(key).map_or("", String::as_str)
}

/// The Indexed Job's completion index of a pod.
fn index(p: &Pod) -> String {
    p.annotations().get("batch.kubernetes.io/job-completion-index").cloned().unwrap_or_default()
}

fn uids(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().filter_map(|p| p.metadata.uid.clone()).collect()
}

/// The time of `p`'s true condition `type_`, if it has one.
fn condition_time(p: &Pod, type_: &str) -> Option<jiff::Timestamp> {
    let c = p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_ && c.status == "True")?;
    Some(c.last_transition_time.as_ref()?.0)
}

fn condition_reason(p: &Pod, type_: &str) -> Option<String> {
    let c = p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_ && c.status == "True")?;
    c.reason.clone()
}

/// The step of the ack in `p`'s termination message, and when its container ended.
fn acked(p: &Pod) -> Option<(u64, jiff::Timestamp)> {
    let statuses = p.status.as_ref()?.container_statuses.as_ref()?;
    let t = statuses.iter().find_map(|c| c.state.as_ref()?.terminated.clone())?;
    let step = t
        .message?
        .strip_prefix(keys::TERMINATION_ACK_PREFIX)?
        .split_whitespace()
        .find_map(|w| w.strip_prefix("step="))?
        .parse()
        .ok()?;
    Some((step, t.finished_at?.0))
}

/// The step a process's log says it resumed at (`… resumed at step N …`), if it resumed.
fn resumed_at(log: &str) -> Option<u64> {
    log.lines().find_map(|l| l.split_once("resumed at step ")?.1.split_whitespace().next()?.parse().ok())
}

/// Waits until every pod of `uids` is `Failed` with reason `Reclaimed`, and returns them.
async fn await_reclaimed(s: &Setup, uids: &BTreeSet<String>, what: &str) -> Vec<Pod> {
    wait_for(WAIT, what, || async move {
        let list = s.pods().list(&ListParams::default().labels(&format!("job={}", s.id))).await.ok()?.items;
        let gone: Vec<Pod> = list
            .into_iter()
            .filter(|p| p.metadata.uid.as_ref().is_some_and(|u| uids.contains(u)))
            .filter(|p| {
                phase(p) == "Failed"
                    && p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(keys::REASON_RECLAIMED)
            })
            .collect();
        (gone.len() == uids.len()).then_some(gone)
    })
    .await
}

async fn delete_jobs(training: &Client) {
    let jobs = Api::<Job>::namespaced(training.clone(), NS);
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..Default::default() };
    // (No namespace yet on a first run: nothing to delete.)
    let _ = jobs.delete_collection(&dp, &ListParams::default()).await;
    wait_for(Duration::from_secs(60), "the Jobs gone", || {
        let jobs = jobs.clone();
        async move { jobs.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
}

/// MemberCluster `name` bridging `cluster` with one pool: its real node, whose taint the
/// copies tolerate.
async fn apply_real_member(env: &Env, training: &Client, name: &str, cluster: &str) {
    let mut mc = member_cluster(name, TEST, NS, cluster);
    mc.spec.pools = vec![real_pool(env)];
    apply_member_cluster(training, &mc).await;
}

fn secs(d: jiff::SignedDuration) -> f64 {
    d.as_secs_f64()
}

#[tokio::test]
async fn online_demand_takes_the_elastic_trainers_with_a_checkpoint_and_gives_them_back() {
    let s = Setup::start(false).await;
    let node = MEMBERS[0].2;
    s.submit(3, json!([])).await;
    let pods = s.await_running(5, node, "the job's 5 pods running on member-a").await;
    let (core, elastic): (Vec<Pod>, Vec<Pod>) =
        pods.into_iter().partition(|p| label(p, keys::LABEL_ROLE) == keys::ROLE_CORE);
    assert_eq!(
        core.len(),
        3,
        "the PS and one trainer are the core: {:?}",
        core.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );
    assert!(core.iter().filter(|p| label(p, "role") == "ps").count() == 2, "both PS are core");
    assert!(
        elastic.iter().all(|p| label(p, keys::LABEL_ROLE) == keys::ROLE_ELASTIC && label(p, keys::LABEL_BAND) == "low")
    );
    let trainer = core.iter().find(|p| label(p, "role") == "trainer").unwrap().name_any();
    let before = s.await_steps(&trainer, 3).await;
    let start_loss = before[0].1;

    // Online demand in member-a: its pool lends room for the core and a half only.
    let demand = Instant::now();
    s.lend(0, Some(3 * POD_CPU_MILLI + POD_CPU_MILLI / 2)).await;
    let demand_at = jiff::Timestamp::now();
    let gone = await_reclaimed(&s, &uids(&elastic), "the elastic trainers reclaimed").await;
    let gone_after = demand.elapsed();
    let mut acks = BTreeMap::new();
    for p in &gone {
        let message = p.status.as_ref().and_then(|s| s.message.clone()).unwrap_or_default();
        assert!(message.contains("checkpoint acknowledged by the pod as it exited"), "{}: {message}", p.name_any());
        let noticed = condition_time(p, keys::CONDITION_RECLAIM_REQUESTED).expect("no notice condition");
        assert!(condition_time(p, keys::CONDITION_DISRUPTION_TARGET).is_some(), "no DisruptionTarget");
        let (step, ack_at) = acked(p).unwrap_or_else(|| panic!("{}: no ack in its termination message", p.name_any()));
        println!(
            "elastic {} (index {}): demand -> notice {:.0}s -> ack {:.0}s (step {step}); gone {:.1}s after the demand",
            p.name_any(),
            index(p),
            secs(noticed.duration_since(demand_at)).max(0.0),
            secs(ack_at.duration_since(noticed)),
            gone_after.as_secs_f64()
        );
        acks.insert(index(p), step);
    }

    // The job keeps training with its minimum: the core is the same pods, untouched.
    let now = s.live("").await;
    let running_core: Vec<&Pod> = now.iter().filter(|p| node_of(p) == node).collect();
    assert_eq!(uids(&running_core.iter().map(|p| (*p).clone()).collect::<Vec<_>>()), uids(&core), "the core changed");
    assert!(running_core.iter().all(|p| condition_time(p, keys::CONDITION_RECLAIM_REQUESTED).is_none()));
    let at_reclaim = steps(&s.log(&trainer).await).len();
    let during = s.await_steps(&trainer, at_reclaim + 2).await;
    println!(
        "core trainer goes on: step {} loss {} with the elastic trainers gone",
        during.last().unwrap().0,
        during.last().unwrap().1
    );
    // The Job made new trainers for them; they wait for room on the gang's member.
    let setup = &s;
    wait_for(WAIT, "the replacement trainers waiting unplaced", || async move {
        let pods = setup.live("trainer").await;
        let waiting = pods.iter().filter(|p| node_of(p).is_empty()).count();
        (pods.len() == 3 && waiting == 2).then_some(())
    })
    .await;

    // The online demand falls: the job grows back to its maximum, on the same member.
    let fall = Instant::now();
    s.lend(0, None).await;
    let pods = s.await_running(5, node, "the job back at 5 pods on member-a").await;
    let regrown = fall.elapsed();
    for p in pods.iter().filter(|p| !uids(&core).contains(p.metadata.uid.as_ref().unwrap())) {
        assert_eq!(label(p, keys::LABEL_ROLE), keys::ROLE_ELASTIC, "{}", p.name_any());
        let steps = s.await_steps(&p.name_any(), 1).await;
        let log = s.log(&p.name_any()).await;
        let resumed = resumed_at(&log).unwrap_or_else(|| panic!("{} did not resume: {log}", p.name_any()));
        assert_eq!(Some(&resumed), acks.get(&index(p)), "{} resumed elsewhere than its ack", p.name_any());
        assert!(steps[0].0 > resumed && steps[0].1 < start_loss / 10.0, "{steps:?} after {resumed}");
        println!(
            "elastic index {} back: resumed at step {resumed}, first step {} loss {}; running {:.1}s after the demand fell",
            index(p),
            steps[0].0,
            steps[0].1,
            regrown.as_secs_f64()
        );
    }
    println!(
        "core trainer loss {start_loss} at step {} -> {} at step {}",
        before[0].0,
        during.last().unwrap().1,
        during.last().unwrap().0
    );
    s.finish().await;
}

#[tokio::test]
async fn a_deeper_deficit_takes_the_whole_job_which_resumes_on_the_other_member_from_its_checkpoint() {
    let s = Setup::start(true).await;
    let (node_a, node_b) = (MEMBERS[0].2, MEMBERS[1].2);
    // member-b lends nothing yet, so the job goes to member-a.
    s.lend(1, Some(0)).await;
    s.submit(2, json!([])).await;
    let first = s.await_running(4, node_a, "the job's 4 pods running on member-a").await;
    let trainer = first.iter().find(|p| label(p, "role") == "trainer" && label(p, keys::LABEL_ROLE) == "core").unwrap();
    let before = s.await_steps(&trainer.name_any(), 4).await;
    let (start_loss, last) = (before[0].1, *before.last().unwrap());

    // member-a takes all of its real node back; member-b has room again.
    s.lend(1, None).await;
    let demand = Instant::now();
    s.lend(0, Some(0)).await;
    let demand_at = jiff::Timestamp::now();
    let gone = await_reclaimed(&s, &uids(&first), "the whole job reclaimed from member-a").await;
    let gone_after = demand.elapsed();
    let noticed = |role: &str| {
        gone.iter()
            .filter(|p| label(p, keys::LABEL_ROLE) == role)
            .filter_map(|p| condition_time(p, keys::CONDITION_RECLAIM_REQUESTED))
            .collect::<Vec<_>>()
    };
    // The elastic trainer first, the core (PS included) after it.
    let (elastic, core) = (noticed(keys::ROLE_ELASTIC), noticed(keys::ROLE_CORE));
    assert!(elastic.len() == 1 && core.len() == 3, "{elastic:?} {core:?}");
    assert!(
        core.iter().all(|c| *c >= elastic[0]),
        "the core was noticed before the elastic trainer: {elastic:?} {core:?}"
    );
    let mut acked_steps = Vec::new();
    for p in &gone {
        let (step, at) = acked(p).unwrap_or_else(|| panic!("{}: no ack", p.name_any()));
        let n = condition_time(p, keys::CONDITION_RECLAIM_REQUESTED).unwrap();
        println!(
            "{} ({}): notice {:.0}s after the demand, ack {:.0}s later at step {step}",
            p.name_any(),
            label(p, keys::LABEL_ROLE),
            secs(n.duration_since(demand_at)).max(0.0),
            secs(at.duration_since(n))
        );
        acked_steps.push(step);
    }
    // The PS leave after the trainers: their checkpoints hold every step the trainers saved.
    let ended = |role: &str| {
        gone.iter().filter(|p| label(p, "role") == role).filter_map(|p| Some(acked(p)?.1)).collect::<Vec<_>>()
    };
    let (ps_ended, trainers_ended) = (ended("ps"), ended("trainer"));
    assert!(
        ps_ended.iter().all(|ps| trainers_ended.iter().all(|t| ps >= t)),
        "a PS left before a trainer: PS {ps_ended:?}, trainers {trainers_ended:?}"
    );
    println!("whole job gone {:.1}s after the demand", gone_after.as_secs_f64());

    // Placed again whole, on member-b, from its checkpoints.
    let again = s.await_running(4, node_b, "the job's 4 new pods running on member-b").await;
    let resumed_after = demand.elapsed();
    assert!(uids(&again).is_disjoint(&uids(&first)));
    for p in again.iter().filter(|p| label(p, "role") == "ps") {
        let log = s.log(&p.name_any()).await;
        assert!(resumed_at(&log).is_some_and(|n| n > 0), "{} did not resume: {log}", p.name_any());
    }
    let top = acked_steps.iter().copied().max().unwrap_or(0);
    for p in again.iter().filter(|p| label(p, "role") == "trainer") {
        let steps = s.await_steps(&p.name_any(), 1).await;
        let log = s.log(&p.name_any()).await;
        let resumed = resumed_at(&log).unwrap_or_else(|| panic!("{} did not resume: {log}", p.name_any()));
        assert!(acked_steps.contains(&resumed), "{} resumed at {resumed}, acked {acked_steps:?}", p.name_any());
        assert!(steps[0].0 > resumed, "the step count went back: {steps:?} after {resumed}");
        assert!(steps[0].1 < start_loss / 10.0, "the loss jumped back: {} (start {start_loss})", steps[0].1);
        println!(
            "on member-b: trainer index {} resumed at step {resumed}, first step {} loss {} ({:.1}s after the demand; before: step {} loss {}; highest ack {top})",
            index(p),
            steps[0].0,
            steps[0].1,
            resumed_after.as_secs_f64(),
            last.0,
            last.1
        );
    }
    s.finish().await;
}

#[tokio::test]
async fn a_dead_parameter_server_restarts_the_whole_gang_and_a_dead_elastic_trainer_only_shrinks_it() {
    let s = Setup::start(false).await;
    let node = MEMBERS[0].2;
    // The PS also save every 50 pushes: a killed one has no time to save on its way out.
    s.submit(2, json!([{"name": "TP_CHECKPOINT_EVERY", "value": "50"}])).await;
    let first = s.await_running(4, node, "the job's 4 pods running on member-a").await;
    let role = |p: &Pod| label(p, keys::LABEL_ROLE).to_owned();
    let elastic = first.iter().find(|p| role(p) == keys::ROLE_ELASTIC).unwrap().clone();
    let trainer =
        first.iter().find(|p| label(p, "role") == "trainer" && role(p) == keys::ROLE_CORE).unwrap().name_any();
    let before = s.await_steps(&trainer, 3).await;
    let start_loss = before[0].1;

    // 1. An elastic trainer's process dies: only it goes; the Job's new trainer joins the
    //    same member as an elastic pod of the gang.
    s.kill_process(0, &elastic.name_any()).await;
    let others: BTreeSet<String> =
        uids(&first).into_iter().filter(|u| Some(u) != elastic.metadata.uid.as_ref()).collect();
    let all_first = uids(&first);
    let regrown = wait_for(WAIT, "the dead trainer replaced", || {
        let all_first = all_first.clone();
        let s = &s;
        async move {
            let pods = s.live("").await;
            let running = pods.iter().all(|p| phase(p) == "Running" && node_of(p) == node);
            let new: Vec<&Pod> =
                pods.iter().filter(|p| p.metadata.uid.as_ref().is_some_and(|u| !all_first.contains(u))).collect();
            (running && pods.len() == 4 && new.len() == 1).then(|| new[0].clone())
        }
    })
    .await;
    assert_eq!(role(&regrown), keys::ROLE_ELASTIC);
    assert_eq!(index(&regrown), index(&elastic));
    let dead = s.pods().get(&elastic.name_any()).await.unwrap();
    assert_eq!(phase(&dead), "Failed");
    assert!(condition_time(&dead, keys::CONDITION_RECLAIM_REQUESTED).is_none(), "tidepool did not stop it");
    for p in s.live("").await.iter().filter(|p| others.contains(p.metadata.uid.as_ref().unwrap())) {
        assert!(condition_time(p, keys::CONDITION_RECLAIM_REQUESTED).is_none(), "{} was stopped too", p.name_any());
    }
    let steady = s.await_steps(&trainer, steps(&s.log(&trainer).await).len() + 2).await;
    println!("elastic trainer killed: the gang went on (core trainer at step {})", steady.last().unwrap().0);

    // 2. PS 0's process dies: the rest of the gang is stopped at once, with a notice, and the
    //    whole gang placed again resumes from its checkpoints.
    let ps0 = first.iter().find(|p| label(p, "role") == "ps" && index(p) == "0").unwrap();
    let (ps0_uid, ps0) = (ps0.metadata.uid.clone().unwrap(), ps0.name_any());
    let running = s.live("").await;
    let survivors: BTreeSet<String> = uids(&running).into_iter().filter(|u| *u != ps0_uid).collect();
    let killed = Instant::now();
    s.kill_process(0, &ps0).await;
    let stopped = await_reclaimed(&s, &survivors, "the rest of the gang stopped").await;
    let stopped_after = killed.elapsed();
    let mut acked_steps = Vec::new();
    for p in &stopped {
        assert_eq!(condition_reason(p, keys::CONDITION_RECLAIM_REQUESTED).as_deref(), Some(keys::REASON_GANG_RESTART));
        assert!(
            condition_time(p, keys::CONDITION_DISRUPTION_TARGET).is_some(),
            "{}: no DisruptionTarget",
            p.name_any()
        );
        let ended = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).map(|c| format!("{c:?}"));
        let (step, _) =
            acked(p).unwrap_or_else(|| panic!("{}: no checkpoint ack; containers: {ended:?}", p.name_any()));
        acked_steps.push(step);
    }
    let noticed: BTreeSet<_> =
        stopped.iter().filter_map(|p| condition_time(p, keys::CONDITION_RECLAIM_REQUESTED)).collect();
    assert!(
        noticed.last().unwrap().duration_since(*noticed.first().unwrap()) <= jiff::SignedDuration::from_secs(1),
        "the gang was not stopped at once: {noticed:?}"
    );
    let dead = s.pods().get(&ps0).await.unwrap();
    assert!(dead.annotations().contains_key(keys::ANNOTATION_GANG_RESTARTED), "the dead PS is not marked");
    let again = s.await_running(4, node, "the gang placed again whole").await;
    let back_after = killed.elapsed();
    assert!(uids(&again).is_disjoint(&uids(&running)), "pods of the old gang still run");
    let mut ps0_resumed = 0;
    for p in again.iter().filter(|p| label(p, "role") == "ps") {
        let log = s.log(&p.name_any()).await;
        let resumed =
            resumed_at(&log).filter(|n| *n > 0).unwrap_or_else(|| panic!("{} did not resume: {log}", p.name_any()));
        if index(p) == "0" {
            ps0_resumed = resumed;
        }
        println!("{} (index {}) resumed at step {resumed}", p.name_any(), index(p));
    }
    for p in again.iter().filter(|p| label(p, "role") == "trainer") {
        let steps = s.await_steps(&p.name_any(), 1).await;
        let log = s.log(&p.name_any()).await;
        let resumed = resumed_at(&log).unwrap_or_else(|| panic!("{} did not resume: {log}", p.name_any()));
        // The global step is PS 0's: it goes on from that checkpoint (what the dead PS had
        // not saved is lost, as with any crash), and the loss stays where training had it.
        assert!(steps[0].0 > ps0_resumed, "{steps:?}: not from PS 0's checkpoint at {ps0_resumed}");
        assert!(steps[0].1 < start_loss / 10.0, "{steps:?}: the loss jumped back (start {start_loss})");
        println!("trainer index {} resumed at step {resumed}: first step {} loss {}", index(p), steps[0].0, steps[0].1);
    }
    println!(
        "PS killed: gang stopped {:.1}s later (acks at steps {acked_steps:?}), running again whole {:.1}s after the kill",
        stopped_after.as_secs_f64(),
        back_after.as_secs_f64()
    );
    s.finish().await;
}
