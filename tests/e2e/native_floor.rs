//! The native floor (issue 42): a job whose pods ask for the training cluster's own nodes as
//! core (`tidepool.io/native: core`) runs its core on the training cluster's real node, which
//! the admin offers (`dispatcher.nativeNodes`), and borrows only its elastic pods from
//! member-a's real node. Online demand in member-a takes the borrowed pods, with the notice,
//! and never the core: a watch of the core pods (the training API server's account, not
//! tidepool's) sees no notice, no disruption, no deletion. When member-a lends again, the job
//! grows back there.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use tidepool_api::keys;

use crate::harness::*;
use crate::operators::acked_step;

const TEST: &str = "native-floor";
const NS: &str = "e2e-native-floor";
const MEMBER: &str = "e2e-native-floor-a";
/// The virtual node of member-a's real pool.
const NODE: &str = "tidepool-e2e-native-floor-a-real";
const POD_CPU_MILLI: u32 = 50;
const WAIT: Duration = Duration::from_secs(120);

fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or_default()
}

fn node_of(p: &Pod) -> &str {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or_default()
}

fn condition(p: &Pod, type_: &str) -> bool {
    let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

/// An Indexed Job of `n` sleeping pods, one gang of `min`, every pod asking for the native
/// floor (see [`floor_job`]).
fn job(env: &Env, name: &str, n: u32, min: u32) -> Job {
    let container = json!({"name": "main", "command": ["sleep", "3600"]});
    floor_job(env, (name, n), (name, min, "core"), 5, container)
}

/// An Indexed Job `name` of `n` pods running `container` (its image, its request and the
/// pull policy added), one gang `gang` of `min` asking for native nodes as `native`, tolerating
/// the real nodes' taint (the training cluster's real node has it too), a reclaim or restart
/// not counted as a failure (`podFailurePolicy` on `DisruptionTarget`).
fn floor_job(
    env: &Env,
    (name, n): (&str, u32),
    (gang, min, native): (&str, u32, &str),
    grace: u32,
    mut container: serde_json::Value,
) -> Job {
    container["image"] = json!(env.var("WORKLOAD_IMAGE"));
    container["imagePullPolicy"] = json!("Never");
    container["resources"] = json!({"requests": {"cpu": format!("{POD_CPU_MILLI}m"), "memory": "16Mi"}});
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": 6,
            "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
            "template": {
                "metadata": {"labels": {"job": name},
                             "annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: min.to_string(),
                                             keys::ANNOTATION_NATIVE: native}},
                "spec": {
                    "schedulerName": scheduler_name(TEST),
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": grace,
                    "tolerations": [{"key": env.var("REAL_NODE_TAINT"), "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container]
                }
            }
        }
    }))
    .unwrap()
}

/// The job's pods that are not over, by name.
async fn live(pods: &Api<Pod>, name: &str) -> Vec<Pod> {
    let list = pods.list(&ListParams::default().labels(&format!("job={name}"))).await.map(|l| l.items);
    let mut live: Vec<Pod> = list
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && !matches!(phase(p), "Failed" | "Succeeded"))
        .collect();
    live.sort_by_key(|p| p.name_any());
    live
}

/// Waits until the job runs `native` pods on the training cluster's real node and `lent` on
/// member-a's virtual node, and returns them.
async fn await_split(env: &Env, pods: &Api<Pod>, name: &str, (native, lent): (usize, usize), what: &str) -> Vec<Pod> {
    let real = env.var("TRAINING_REAL_NODE").to_owned();
    wait_for(WAIT, what, || {
        let real = real.clone();
        async move {
            let pods = live(pods, name).await;
            let on = |node: &str| pods.iter().filter(|p| phase(p) == "Running" && node_of(p) == node).count();
            (pods.len() == native + lent && on(&real) == native && on(NODE) == lent).then_some(pods)
        }
    })
    .await
}

/// A test's clusters and tidepool: member-a's real pool bridged, the training cluster's real
/// node offered as the native pool, a reclaimed pod given 5 s.
struct Setup {
    env: Env,
    training: Client,
    member: Client,
    _tidepool: Tidepool,
}

impl Setup {
    /// Starts tidepool with member-a lending `milli` CPU of its real node.
    async fn start(milli: u32) -> Setup {
        let env = Env::load();
        assert_eq!(env.var("CP_REAL_NODES"), "1", "this test needs the real nodes (CP_REAL_NODES=1)");
        let training = env.client("training").await;
        let member = env.client("member-a").await;
        // An earlier run's Jobs first (no namespace yet on a first run: nothing to delete).
        let _ =
            Api::<Job>::namespaced(training.clone(), NS).delete_collection(&background(), &ListParams::default()).await;
        prepare(&env, &training, TEST, NS).await;
        let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
        put_kubeconfig_secret(&training, NS, "member-a", &kubeconfig).await;
        let mut mc = member_cluster(MEMBER, TEST, NS, "member-a");
        mc.spec.pools = vec![real_pool(&env)];
        apply_member_cluster(&training, &mc).await;
        let dispatcher = "deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 30, medium: 30, low: 10}, \
                          nativeNodes: {nodeSelector: {tidepool.io/test-pool: real}}";
        let tidepool = Tidepool::start_config(&env, TEST, NS, dispatcher, &kubelet_config(&env));
        let s = Setup { env, training, member, _tidepool: tidepool };
        s.lend(Some(milli)).await;
        let nodes = Api::<Node>::all(s.training.clone());
        wait_for(Duration::from_secs(90), "member-a's virtual node Ready", || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get_opt(NODE).await.ok().flatten()?;
                n.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
            }
        })
        .await;
        s
    }

    async fn lend(&self, milli: Option<u32>) {
        lend_real_cpu(&self.env, (&self.training, &self.member), (MEMBER, "member-a"), milli).await;
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), NS)
    }

    fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.training.clone(), NS)
    }

    /// The test's Jobs deleted and their pods gone (through tidepool for the copies).
    async fn finish(&self) {
        self.jobs().delete_collection(&background(), &ListParams::default()).await.unwrap();
        drain_pods(&self.training, NS).await;
    }
}

fn background() -> DeleteParams {
    DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..Default::default() }
}

#[tokio::test]
async fn a_native_core_runs_on_while_online_demand_takes_only_the_borrowed_pods_which_grow_back() {
    let s = Setup::start(4 * POD_CPU_MILLI).await;
    let (env, training, pods, jobs) = (&s.env, &s.training, s.pods(), s.jobs());
    // Four pods, a gang of two: the core (indexes 0 and 1) on the native node, the other two
    // borrowed from member-a.
    let name = format!("floor-{}", run_id());
    jobs.create(&PostParams::default(), &job(env, &name, 4, 2)).await.unwrap();
    let placed = await_split(env, &pods, &name, (2, 2), "the core native, the elastic pods on member-a").await;
    let real = env.var("TRAINING_REAL_NODE");
    let (core, borrowed): (Vec<Pod>, Vec<Pod>) = placed.into_iter().partition(|p| node_of(p) == real);
    for p in &core {
        assert_eq!(p.labels().get(keys::LABEL_ROLE).map(String::as_str), Some(keys::ROLE_CORE), "{}", p.name_any());
        assert_eq!(p.annotations().get(keys::ANNOTATION_PLACEMENT).map(String::as_str), Some(keys::PLACEMENT_NATIVE));
    }
    for p in &borrowed {
        assert_eq!(p.labels().get(keys::LABEL_ROLE).map(String::as_str), Some(keys::ROLE_ELASTIC), "{}", p.name_any());
        assert_eq!(p.annotations().get(keys::ANNOTATION_PLACEMENT).map(String::as_str), Some(NODE));
    }
    let core_names: Vec<String> = core.iter().map(ResourceExt::name_any).collect();
    println!(
        "core {core_names:?} on {real}; borrowed {:?} on {NODE}",
        borrowed.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    let (touched, watch) = watch_untouched(training, NS, core_names.clone());

    // Online demand takes member-a back: the borrowed pods get the notice and go.
    s.lend(Some(0)).await;
    let borrowed_names: Vec<String> = borrowed.iter().map(ResourceExt::name_any).collect();
    wait_for(WAIT, "the borrowed pods reclaimed with the notice", || {
        let (pods, names, name) = (pods.clone(), borrowed_names.clone(), name.clone());
        async move {
            let list = pods.list(&ListParams::default().labels(&format!("job={name}"))).await.ok()?.items;
            let gone = list.iter().filter(|p| names.contains(&p.name_any())).filter(|p| {
                phase(p) == "Failed"
                    && condition(p, keys::CONDITION_RECLAIM_REQUESTED)
                    && condition(p, keys::CONDITION_DISRUPTION_TARGET)
            });
            (gone.count() == names.len()).then_some(())
        }
    })
    .await;
    // The Job replaces them; they wait for room where the gang borrows, the core runs on.
    wait_for(WAIT, "the replacements waiting, told why", || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let live = live(&pods, &name).await;
            let told = |p: &Pod| {
                let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
                conditions.is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.message.as_deref().is_some_and(|m| m.contains("its lent pods wait"))
                    })
                })
            };
            let waiting = live.iter().filter(|p| node_of(p).is_empty() && told(p)).count();
            (live.len() == 4 && waiting == 2).then_some(())
        }
    })
    .await;
    let now = live(&pods, &name).await;
    let running_core: Vec<String> =
        now.iter().filter(|p| node_of(p) == real && phase(p) == "Running").map(ResourceExt::name_any).collect();
    assert_eq!(running_core, core_names, "the core is the same pods, running on the native node");

    // Member-a lends again: the job grows back there.
    s.lend(None).await;
    let back = await_split(env, &pods, &name, (2, 2), "the job back at 2 native + 2 borrowed").await;
    let core_now: Vec<String> = back.iter().filter(|p| node_of(p) == real).map(ResourceExt::name_any).collect();
    assert_eq!(core_now, core_names);
    watch.abort();
    let touched = touched.lock().unwrap().clone();
    assert!(touched.is_empty(), "the native core was disrupted: {touched:?}");

    s.finish().await;
}

/// A Job of `count` `tp-train <role>` pods (tests/workload), one gang `gang` of `min`, asking
/// for native nodes as `native`, with `env` besides the checkpoint store and the step pace.
fn tp_job(
    s: &Setup,
    (name, role, count): (&str, &str, u32),
    (gang, min, native): (&str, u32, &str),
    env: serde_json::Value,
) -> Job {
    let mut vars = vec![
        json!({"name": "TP_STORE", "value": format!("{}/ckpt/{gang}", s.env.var("CHECKPOINT_STORE"))}),
        json!({"name": "TP_STEP_DELAY_MS", "value": "50"}),
    ];
    vars.extend(env.as_array().into_iter().flatten().cloned());
    let container = json!({"name": role, "command": ["tp-train", role], "env": vars,
                           "terminationMessagePolicy": "FallbackToLogsOnError"});
    floor_job(&s.env, (name, count), (gang, min, native), 10, container)
}

/// Waits until `pod` has logged at least `n` step lines; returns them as (step, loss).
async fn await_steps(s: &Setup, pod: &str, n: usize) -> Vec<(u64, f64)> {
    wait_for(WAIT, &format!("{n} step lines in {pod}'s log"), || async move {
        let log = kubectl(&s.env, "training", &["-n", NS, "logs", pod], None).await.1;
        let steps = crate::operators::steps(&log);
        (steps.len() >= n).then_some(steps)
    })
    .await
}

/// The parameter-server job of tests/workload with its floor native: both parameter servers
/// (`tidepool.io/native: all`) and the core trainer (`core`) on the training cluster's real
/// node, the two elastic trainers borrowed from member-a, training together across the two
/// clusters' pod networks (the trainers reach the parameter servers at their pod IPs; the
/// parameter servers are a gang of their own, placed first, so their IPs are known when the
/// trainers are made). Online demand takes the borrowed trainers, which checkpoint and ack;
/// the job trains on with its floor; when member-a lends again they come back there and resume
/// from their checkpoints.
#[tokio::test]
async fn a_ps_job_keeps_its_floor_native_and_trains_with_borrowed_trainers_across_the_pod_networks() {
    let s = Setup::start(4 * POD_CPU_MILLI).await;
    let (pods, jobs, id) = (s.pods(), s.jobs(), run_id());
    let real = s.env.var("TRAINING_REAL_NODE").to_owned();
    let ps = format!("ps-{id}");
    jobs.create(&PostParams::default(), &tp_job(&s, (&ps, "ps", 2), (&ps, 2, "all"), json!([]))).await.unwrap();
    let servers = await_split(&s.env, &pods, &ps, (2, 0), "both parameter servers running natively").await;
    let addresses: Vec<String> = servers
        .iter()
        .map(|p| {
            format!("{}:2222", p.status.as_ref().and_then(|st| st.pod_ip.clone()).expect("a running PS has an IP"))
        })
        .collect();
    println!("parameter servers at {addresses:?} on {real}");
    let trainers = format!("trainer-{id}");
    let tp_ps = json!([{"name": "TP_PS", "value": addresses.join(",")}]);
    jobs.create(&PostParams::default(), &tp_job(&s, (&trainers, "trainer", 3), (&trainers, 1, "core"), tp_ps))
        .await
        .unwrap();
    let placed = await_split(&s.env, &pods, &trainers, (1, 2), "the core trainer native, two borrowed").await;
    let (core, borrowed): (Vec<Pod>, Vec<Pod>) = placed.into_iter().partition(|p| node_of(p) == real);
    // Every trainer trains against the parameter servers, the borrowed ones from member-a.
    for p in core.iter().chain(&borrowed) {
        let steps = await_steps(&s, &p.name_any(), 3).await;
        println!("{} on {}: step {} loss {}", p.name_any(), node_of(p), steps[2].0, steps[2].1);
    }
    let core_trainer = core[0].name_any();
    let (touched, watch) = {
        let mut floor: Vec<String> = servers.iter().map(ResourceExt::name_any).collect();
        floor.push(core_trainer.clone());
        watch_untouched(&s.training, NS, floor)
    };

    // Online demand takes member-a back: the borrowed trainers checkpoint, ack and go.
    s.lend(Some(0)).await;
    let names: Vec<String> = borrowed.iter().map(ResourceExt::name_any).collect();
    let gone = wait_for(WAIT, "the borrowed trainers reclaimed, acked", || {
        let (pods, names, trainers) = (pods.clone(), names.clone(), trainers.clone());
        async move {
            let list = pods.list(&ListParams::default().labels(&format!("job={trainers}"))).await.ok()?.items;
            let gone: Vec<Pod> = list
                .into_iter()
                .filter(|p| names.contains(&p.name_any()) && phase(p) == "Failed" && acked_step(p).is_some())
                .collect();
            (gone.len() == names.len()).then_some(gone)
        }
    })
    .await;
    let acks: std::collections::BTreeMap<String, u64> = gone
        .iter()
        .map(|p| (p.labels()["batch.kubernetes.io/job-completion-index"].clone(), acked_step(p).unwrap()))
        .collect();
    println!("borrowed trainers acked at {acks:?} (by completion index)");
    let at_reclaim = await_steps(&s, &core_trainer, 1).await.len();
    let during = await_steps(&s, &core_trainer, at_reclaim + 3).await;
    println!("core trainer goes on natively: step {}", during.last().unwrap().0);

    // Member-a lends again: the replacements come back there and resume from their acks.
    s.lend(None).await;
    let back = await_split(&s.env, &pods, &trainers, (1, 2), "the trainers back at 1 native + 2 borrowed").await;
    for p in back.iter().filter(|p| node_of(p) == NODE) {
        await_steps(&s, &p.name_any(), 1).await;
        let log = kubectl(&s.env, "training", &["-n", NS, "logs", &p.name_any()], None).await.1;
        let resumed =
            crate::operators::resumed_at(&log).unwrap_or_else(|| panic!("{} did not resume: {log}", p.name_any()));
        let index = &p.labels()["batch.kubernetes.io/job-completion-index"];
        assert_eq!(Some(&resumed), acks.get(index), "{} (index {index}) resumed elsewhere than its ack", p.name_any());
        println!("{} back on {NODE}: resumed at step {resumed}", p.name_any());
    }
    watch.abort();
    let touched = touched.lock().unwrap().clone();
    assert!(touched.is_empty(), "the native floor was disrupted: {touched:?}");
    s.finish().await;
}

/// A core pod that dies restarts its whole gang (tenants.md), native pods included: each gets
/// the notice, then at its deadline `DisruptionTarget` and a delete, so the training cluster's
/// kubelet stops its containers and the delete completes (a status write of `Failed`, which
/// ends a copy's training pod, would leave them running on the node); the Job makes the gang
/// again.
#[tokio::test]
async fn a_dead_core_pod_restarts_its_gang_and_the_kubelet_stops_the_native_pods() {
    let s = Setup::start(4 * POD_CPU_MILLI).await;
    let (pods, jobs, name) = (s.pods(), s.jobs(), format!("restart-{}", run_id()));
    let mut job = job(&s.env, &name, 3, 3);
    // Index 0 dies 8 s after it starts; the others sleep.
    let die = "if [ \"$JOB_COMPLETION_INDEX\" = 0 ]; then sleep 8; exit 3; fi; exec sleep 3600";
    let container = &mut job.spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
    container.command = Some(vec!["sh".into(), "-c".into(), die.into()]);
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let first = await_split(&s.env, &pods, &name, (3, 0), "the gang of three running natively").await;
    let survivors: Vec<(String, String)> = first
        .iter()
        .filter(|p| p.labels()["batch.kubernetes.io/job-completion-index"] != "0")
        .map(|p| (p.name_any(), p.metadata.uid.clone().unwrap()))
        .collect();
    // Each survivor, as a watch of the training API sees it: the notice and DisruptionTarget,
    // then gone (its kubelet stopped it and the delete completed).
    let told = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
    let record = told.clone();
    let names: Vec<String> = survivors.iter().map(|(n, _)| n.clone()).collect();
    let events = watcher(pods.clone(), watcher::Config::default()).default_backoff().applied_objects();
    let watch = tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(Ok(p)) = events.next().await {
            if names.contains(&p.name_any())
                && condition(&p, keys::CONDITION_DISRUPTION_TARGET)
                && condition(&p, keys::CONDITION_RECLAIM_REQUESTED)
            {
                record.lock().unwrap().insert(p.name_any());
            }
        }
    });
    wait_for(Duration::from_secs(150), "the survivors stopped by their kubelet and deleted", || {
        let (pods, survivors) = (pods.clone(), survivors.clone());
        async move {
            for (pod, uid) in &survivors {
                let here = pods.get_opt(pod).await.ok()?;
                if here.is_some_and(|p| p.metadata.uid.as_deref() == Some(uid.as_str())) {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    watch.abort();
    let told = told.lock().unwrap().clone();
    for (pod, _) in &survivors {
        assert!(told.contains(pod), "{pod} went without the notice and DisruptionTarget");
        println!("{pod}: notice, DisruptionTarget, stopped and deleted");
    }
    // The Job makes the gang again, natively.
    let again = await_split(&s.env, &pods, &name, (3, 0), "the gang formed again natively").await;
    let old: Vec<&String> = survivors.iter().map(|(_, uid)| uid).collect();
    assert!(again.iter().all(|p| !old.contains(&p.metadata.uid.as_ref().unwrap())), "a survivor is still there");
    s.finish().await;
}
