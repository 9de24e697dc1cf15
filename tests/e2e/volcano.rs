//! Volcano in the training cluster (issue "Volcano, Kueue and member gang schedulers", item 1):
//! Volcano's real job controller (vc-controller-manager v1.10.0, tests/schedulers/build.sh) makes a
//! job's PodGroup first and its pods only once a gang scheduler moves the group out of
//! `Pending`; no Volcano scheduler runs here, so for `schedulerName: tidepool` tidepool is that
//! scheduler. Also the training-operator's `--gang-scheduler-name=volcano` path, which waits on
//! the group the same way.

use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use kube::api::{DynamicObject, ListParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "volcano";
const NS: &str = "e2e-volcano";

/// A Volcano Job of the parameter-server shape (a TensorFlow chief that drives the steps, 2
/// parameter servers, 2 workers: TF2's parameter-server training needs its chief, so the gang
/// is 5), TF_CONFIG from Volcano's own tensorflow plugin over its svc plugin's headless
/// Service; any pod failing restarts the whole job (`RestartJob`), and the chief's end completes
/// it. Written as a user writes one but for what Volcano's admission webhook would default
/// (queue, maxRetry), which does not run here.
fn volcano_job(name: &str, scheduler: &str, store: &str, steps: u32) -> Value {
    let task = |task: &str, replicas: u32| {
        let env = json!([
            {"name": "TP_STEPS", "value": steps.to_string()},
            {"name": "TP_STEP_DELAY_MS", "value": "100"},
            {"name": "TP_LOG_EVERY", "value": "10"},
        ]);
        let mut t = json!({
            "name": task, "replicas": replicas,
            "template": {"spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 20,
                "containers": [framework_container("tensorflow", "tf_ps.py", store, env)]
            }}
        });
        if task == "chief" {
            t["policies"] = json!([{"event": "TaskCompleted", "action": "CompleteJob"}]);
        }
        t
    };
    json!({
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler, "minAvailable": 5, "queue": "default", "maxRetry": 3,
            "plugins": {"svc": [], "env": [], "tensorflow": ["--port=2222", "--chief=chief", "--ps=ps", "--worker=worker"]},
            "policies": [{"event": "PodFailed", "action": "RestartJob"}, {"event": "PodEvicted", "action": "RestartJob"}],
            "tasks": [task("chief", 1), task("ps", 2), task("worker", 2)]
        }
    })
}

/// A one-pod Volcano Job asking for `cpu`, never started by anything but its group's phase.
fn small_job(name: &str, scheduler: &str, cpu: &str) -> Value {
    json!({
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler, "minAvailable": 1, "queue": "default", "maxRetry": 1,
            "tasks": [{"name": "main", "replicas": 1, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": FRAMEWORKS_IMAGE, "imagePullPolicy": "Never",
                                "command": ["sleep", "600"], "resources": {"requests": {"cpu": cpu}}}]
            }}}]
        }
    })
}

/// The PodGroup of Volcano Job `job` (named `<job>-<uid>` by Volcano's job controller).
async fn group_of(groups: &Api<DynamicObject>, jobs: &Api<DynamicObject>, job: &str) -> DynamicObject {
    let uid = jobs.get(job).await.unwrap().uid().unwrap();
    let name = format!("{job}-{uid}");
    wait_for(Duration::from_secs(60), &format!("PodGroup {name}"), || {
        let (groups, name) = (groups.clone(), name.clone());
        async move { groups.get_opt(&name).await.ok().flatten() }
    })
    .await
}

fn phase_of(g: &DynamicObject) -> &str {
    g.data["status"]["phase"].as_str().unwrap_or_default()
}

fn condition_of<'a>(g: &'a DynamicObject, type_: &str) -> Option<&'a Value> {
    g.data["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_)
}

/// The Events on the object named `name`, as `reason: message`.
async fn events_on(b: &Bridge, name: &str) -> Vec<String> {
    let events = Api::<Event>::namespaced(b.training.clone(), NS);
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.unwrap();
    list.items
        .into_iter()
        .map(|e| format!("{}: {}", e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

#[tokio::test]
async fn a_volcano_job_runs_whole_on_one_member_is_reclaimed_with_the_notice_and_restarts_by_its_policy() {
    let env = Env::load();
    let _volcano = Operator::start(&env, "volcano", &[]).await;
    let b = Bridge::start(TEST, NS).await;
    let id = run_id();
    let (name, theirs, huge) = (format!("vc-{id}"), format!("theirs-{id}"), format!("huge-{id}"));
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("batch.volcano.sh", "v1alpha1", "Job", "jobs");
    let groups = b.jobs("scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups");
    let ours = scheduler_name(TEST);
    // An earlier run's jobs (a rerun on the same clusters) would compete for member-a.
    jobs.delete_collection(&Default::default(), &ListParams::default()).await.unwrap();
    b.submit(&jobs, small_job(&theirs, "volcano", "50m")).await;
    b.submit(&jobs, small_job(&huge, &ours, "500")).await;
    b.submit(&jobs, volcano_job(&name, &ours, &store, 600)).await;

    let selector = format!("volcano.sh/job-name={name}");
    let (on_a, on_b) = (real_node(TEST, 0), real_node(TEST, 1));
    let first = b.await_running(&selector, 5, &on_a).await;
    let group = group_of(&groups, &jobs, &name).await;
    println!("group {}: {:?}", group.name_any(), group.data["status"]);
    assert_eq!(phase_of(&group), "Running");
    assert_eq!(condition_of(&group, "Scheduled").map(|c| c["status"].clone()), Some(json!("True")));
    assert!(
        first.iter().all(|p| p.annotations().get(keys::ANNOTATION_VOLCANO_GROUP) == Some(&group.name_any())),
        "every pod is in the job's group"
    );
    let said = events_on(&b, &group.name_any()).await;
    println!("group events: {said:?}");
    for reason in ["Inqueue:", "Scheduled:"] {
        assert!(said.iter().any(|e| e.starts_with(reason)), "no {reason} Event on the group: {said:?}");
    }
    let chief = format!("{name}-chief-0");
    let before = b.await_steps(&chief, None, 4).await;
    println!("chief on member-a: {before:?}");
    assert!(before.last().unwrap().1 < before.first().unwrap().1, "the loss falls: {before:?}");

    not_ours_and_too_big(&b, (&groups, &jobs), &theirs, &huge).await;
    let saved = reclaimed_from_member_a(&b, &selector, &first, before.last().unwrap().0).await;

    // RestartJob: Volcano makes the job's pods again; tidepool places them on member-b.
    let again = b.await_running(&selector, 5, &on_b).await;
    let old: Vec<&String> = first.iter().filter_map(|p| p.metadata.uid.as_ref()).collect();
    assert!(again.iter().all(|p| !old.contains(&p.metadata.uid.as_ref().unwrap())), "new pods");
    let retries = jobs.get(&name).await.unwrap().data["status"]["retryCount"].as_u64();
    assert!(retries >= Some(1), "the job restarted by its policy: retryCount {retries:?}");
    let after = b.await_steps(&chief, None, 2).await;
    let log = b.log(&chief, None).await;
    println!("chief on member-b: resumed at {:?}, {after:?}", resumed_at(&log));
    assert_eq!(resumed_at(&log), Some(saved), "the chief resumed from the step it acked");
    wait_for(Duration::from_secs(600), "the Volcano Job Completed", || {
        let (jobs, name) = (jobs.clone(), name.clone());
        async move { (jobs.get(&name).await.ok()?.data["status"]["state"]["phase"] == "Completed").then_some(()) }
    })
    .await;
}

/// The Volcano Job of another scheduler is left alone (its group never gets a phase, so its pod
/// is never made); the one no member could hold stays `Pending` and says why, on its group and
/// (through Volcano's job controller) on the Job.
async fn not_ours_and_too_big(
    b: &Bridge,
    (groups, jobs): (&Api<DynamicObject>, &Api<DynamicObject>),
    theirs: &str,
    huge: &str,
) {
    let big = group_of(groups, jobs, huge).await;
    let name = big.name_any();
    let big = wait_for(Duration::from_secs(60), "the huge job's group Unschedulable", || {
        let (groups, name) = (groups.clone(), name.clone());
        async move { groups.get(&name).await.ok().filter(|g| condition_of(g, "Unschedulable").is_some()) }
    })
    .await;
    let why = condition_of(&big, "Unschedulable").unwrap().clone();
    println!("{huge}: {} {why}", phase_of(&big));
    assert_eq!(phase_of(&big), "Pending");
    assert_eq!(why["reason"], "NotEnoughResources");
    assert!(why["message"].as_str().unwrap_or_default().contains("cpu=500"), "{why}");
    let on_job = wait_for(Duration::from_secs(60), "Volcano's PodGroupPending Event on the huge job", || async move {
        let said = events_on(b, huge).await;
        said.iter().any(|e| e.starts_with("PodGroupPending:") && e.contains("minResources")).then_some(said)
    })
    .await;
    println!("{huge} events: {on_job:?}");
    let foreign = group_of(groups, jobs, theirs).await;
    println!("{theirs}: {:?}", foreign.data.get("status"));
    assert_eq!(phase_of(&foreign), "", "another scheduler's group has no phase from tidepool");
    let managers: Vec<String> = foreign.managed_fields().iter().filter_map(|m| m.manager.clone()).collect();
    assert!(!managers.contains(&scheduler_name(TEST)), "tidepool wrote another scheduler's group: {managers:?}");
    let made = b.pods().list(&ListParams::default().labels(&format!("volcano.sh/job-name={theirs}"))).await.unwrap();
    assert!(made.items.is_empty(), "a pod of the foreign job was made");
}

/// member-a takes its real node back, member-b lends: every pod gets the notice, the chief
/// saves, and the first pod to end ends `Failed`, `Reclaimed`, with `DisruptionTarget` and its
/// ack (the step the chief saved) — the failure Volcano's `PodFailed → RestartJob` policy acts
/// on: it deletes the others and makes the job again. Returns the step saved.
async fn reclaimed_from_member_a(
    b: &Bridge,
    selector: &str,
    first: &[k8s_openapi::api::core::v1::Pod],
    last: u64,
) -> u64 {
    let uids: Vec<String> = first.iter().filter_map(|p| p.metadata.uid.clone()).collect();
    let seen = b.watch(selector);
    b.lend(1, None).await;
    b.lend(0, Some(0)).await;
    let ended = wait_for(WAIT, "a pod of the job reclaimed from member-a", || {
        let ended = seen.ended(&uids, keys::REASON_RECLAIMED);
        async move { (!ended.is_empty()).then_some(ended) }
    })
    .await;
    let p = &ended[0];
    let ack = acked_step(p);
    println!("{}: {} ({:?}), ack at step {ack:?}", p.name_any(), reason(p), condition_reason(p, "DisruptionTarget"));
    assert_eq!(condition_reason(p, "DisruptionTarget").as_deref(), Some(keys::REASON_DISRUPTION_RECLAIM));
    let saved = ack.expect("the pod acked from inside, with the step the chief saved");
    assert!(saved >= last, "the chief saved at or after the last step it logged ({last}): {saved}");
    saved
}

#[tokio::test]
async fn a_tfjob_with_the_operators_volcano_gang_flag_is_scheduled_by_tidepool() {
    let test = "volcano-tfjob";
    let ns = "e2e-volcano-tfjob";
    let b = Bridge::start(test, ns).await;
    let _operator =
        Operator::start(&b.env, "training-operator", &[&format!("--namespace={ns}"), "--gang-scheduler-name=volcano"])
            .await;
    let name = format!("tf-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("kubeflow.org", "v1", "TFJob", "tfjobs");
    b.submit(&jobs, tfjob(&name, &scheduler_name(test), &store, (2, 2), 100)).await;
    let pods = b.await_running(&format!("training.kubeflow.org/job-name={name}"), 5, &real_node(test, 0)).await;
    assert!(
        pods.iter().all(|p| p.annotations().get(keys::ANNOTATION_VOLCANO_GROUP) == Some(&name)),
        "the operator puts its pods in its Volcano PodGroup"
    );
    let groups = b.jobs("scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups");
    let group = groups.get(&name).await.unwrap();
    println!("group {name}: {:?}", group.data["status"]);
    assert_eq!(phase_of(&group), "Running");
    let placed = Api::<Event>::namespaced(b.training.clone(), ns)
        .list(&ListParams::default().fields("reason=Placed"))
        .await
        .unwrap()
        .items;
    let want = format!("gang {ns}/volcano/{name} (5 pods)");
    assert!(
        placed.iter().filter_map(|e| e.message.as_deref()).any(|m| m.contains(&want)),
        "no Placed event for {want}"
    );
    b.await_condition(&jobs, &name, "Succeeded", Duration::from_secs(600)).await;
    b.remove_job(&jobs, &name).await;
}
