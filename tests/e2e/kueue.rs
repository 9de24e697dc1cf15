//! Kueue in front of tidepool (issue "Volcano, Kueue and member gang schedulers", item 3, its
//! first part): the real Kueue (v0.17.0, tests/schedulers/build.sh) in the training cluster queues
//! tenants' batch Jobs by quota; what it admits, tidepool places. One ResourceFlavor for the
//! lent capacity, described by the virtual nodes' own label (`type: virtual-kubelet`), so Kueue
//! steers admitted pods to lent capacity and tidepool picks the member.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "kueue";
const NS: &str = "e2e-kueue";

fn kueue_api(b: &Bridge, kind: &str, plural: &str, namespaced: bool) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind), plural);
    if namespaced { Api::namespaced_with(b.training.clone(), NS, &ar) } else { Api::all_with(b.training.clone(), &ar) }
}

/// Applies `obj` (server-side, forced) through `api`.
async fn apply(api: &Api<DynamicObject>, obj: Value) {
    let obj: DynamicObject = serde_json::from_value(obj).unwrap();
    api.patch(&obj.name_any(), &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&obj)).await.unwrap();
}

/// A batch Job of `pods` pods of 100m CPU for 15 s, queued in LocalQueue `team`.
fn queued_job(name: &str, scheduler: &str, pods: u32) -> Job {
    job_in(name, scheduler, "team", pods, 15)
}

/// A batch Job of `pods` pods of 100m CPU for `seconds`, queued in LocalQueue `queue`.
fn job_in(name: &str, scheduler: &str, queue: &str, pods: u32, seconds: u32) -> Job {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}},
        "spec": {
            "parallelism": pods, "completions": pods, "backoffLimit": 0,
            "template": {"spec": {
                "schedulerName": scheduler, "restartPolicy": "Never",
                "containers": [{"name": "main", "image": FRAMEWORKS_IMAGE, "imagePullPolicy": "Never",
                                "command": ["sleep", seconds.to_string()],
                                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
            }}
        }
    }))
    .unwrap()
}

/// Kueue's queue, a ClusterQueue of 300m CPU over the lent-capacity flavor, for the test's
/// namespace (labelled so Kueue's Job webhooks run there).
async fn queues(b: &Bridge) {
    let label = Patch::Merge(json!({"metadata": {"labels": {"tidepool.io/e2e-kueue": "true"}}}));
    Api::<Namespace>::all(b.training.clone()).patch(NS, &PatchParams::default(), &label).await.unwrap();
    apply(
        &kueue_api(b, "ResourceFlavor", "resourceflavors", false),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
               "metadata": {"name": "e2e-kueue-lent"}, "spec": {"nodeLabels": {"type": "virtual-kubelet"}}}),
    )
    .await;
    apply(
        &kueue_api(b, "ClusterQueue", "clusterqueues", false),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "e2e-kueue"},
               "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
                        "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "e2e-kueue-lent",
                            "resources": [{"name": "cpu", "nominalQuota": "300m"}, {"name": "memory", "nominalQuota": "1Gi"}]}]}]}}),
    )
    .await;
    apply(
        &kueue_api(b, "LocalQueue", "localqueues", true),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
               "spec": {"clusterQueue": "e2e-kueue"}}),
    )
    .await;
}

/// The pods of Job `job`.
async fn pods_of(b: &Bridge, job: &str) -> Vec<k8s_openapi::api::core::v1::Pod> {
    b.pods().list(&ListParams::default().labels(&format!("job-name={job}"))).await.unwrap().items
}

async fn await_complete(jobs: &Api<Job>, name: &str) {
    wait_for(Duration::from_secs(180), &format!("Job {name} Complete"), || async move {
        let j = jobs.get(name).await.ok()?;
        j.status?.conditions?.iter().any(|c| c.type_ == "Complete" && c.status == "True").then_some(())
    })
    .await;
}

/// Kueue in the training cluster, the test's bridge (member-a alone lending) and queues, and its
/// Jobs' API, with an earlier run's Jobs and Workloads (a rerun on the same clusters) gone: they
/// would hold the quota.
async fn start() -> (Operator, Bridge, Api<Job>) {
    let env = Env::load();
    let kueue = Operator::start(&env, "kueue", &[]).await;
    let b = Bridge::start(TEST, NS).await;
    b.lend(1, Some(0)).await;
    queues(&b).await;
    let jobs = Api::<Job>::namespaced(b.training.clone(), NS);
    let background = kube::api::DeleteParams::background();
    jobs.delete_collection(&background, &ListParams::default()).await.unwrap();
    kueue_api(&b, "Workload", "workloads", true).delete_collection(&background, &ListParams::default()).await.unwrap();
    (kueue, b, jobs)
}

/// Ends a test: its Jobs deleted and every pod of the namespace gone, which a training pod is
/// only once tidepool removed its copy. A test's bridge stops with the test: a copy left
/// running in member-a would be online demand for the next test's bridge on the same node.
async fn finish(b: &Bridge, jobs: &Api<Job>) {
    jobs.delete_collection(&kube::api::DeleteParams::background(), &ListParams::default()).await.unwrap();
    wait_for(Duration::from_secs(120), "every pod of the test gone, copies first", || async {
        b.pods().list(&ListParams::default()).await.ok()?.items.is_empty().then_some(())
    })
    .await;
}

#[tokio::test]
async fn kueue_admits_by_quota_and_tidepool_places_what_it_admits() {
    let (_kueue, b, jobs) = start().await;
    let id = run_id();
    let (first, second) = (format!("first-{id}"), format!("second-{id}"));
    let scheduler = scheduler_name(TEST);
    for name in [&first, &second] {
        let made = jobs.create(&PostParams::default(), &queued_job(name, &scheduler, 2)).await.unwrap();
        assert_eq!(made.spec.unwrap().suspend, Some(true), "Kueue's webhook suspends a queued Job at creation");
    }

    // 200m of 300m: the first is admitted and placed by tidepool on member-a; the second waits
    // in Kueue (no pod of it exists), not in tidepool.
    let on_a = real_node(TEST, 0);
    let running = b.await_running(&format!("job-name={first}"), 2, &on_a).await;
    for p in &running {
        let selector = p.spec.as_ref().and_then(|s| s.node_selector.clone()).unwrap_or_default();
        assert_eq!(
            selector.get("type").map(String::as_str),
            Some("virtual-kubelet"),
            "the flavor's label, set by Kueue"
        );
    }
    let waiting = wait_for(Duration::from_secs(30), "the second Job's Workload pending for quota", || {
        waits_for_quota(&b, &second)
    })
    .await;
    println!("{second}: {waiting}");
    assert!(pods_of(&b, &second).await.is_empty(), "Kueue holds the second Job: no pod of it exists yet");
    assert_eq!(jobs.get(&second).await.unwrap().spec.unwrap().suspend, Some(true));

    // The first ends, its quota comes back, the second is admitted and tidepool places it.
    await_complete(&jobs, &first).await;
    b.await_running(&format!("job-name={second}"), 2, &on_a).await;
    await_complete(&jobs, &second).await;
    finish(&b, &jobs).await;
}

/// The operators' jobs through Kueue, as a tenant runs them: a JobSet (two replicated Jobs of
/// one pod) and a PyTorchJob (a master and a worker, real torch over gloo), each naming the
/// LocalQueue, are suspended by Kueue's webhooks at creation, admitted by quota (200m + 100m of
/// the queue's 300m), let go with the flavor's node labels, and placed by tidepool, each whole
/// as one gang on member-a; both run to their end.
#[tokio::test]
async fn a_jobset_and_a_pytorchjob_are_queued_by_kueue_and_placed_by_tidepool() {
    let (_kueue, b, jobs) = start().await;
    let _jobset = Operator::start(&b.env, "jobset", &[]).await;
    let _training = Operator::start(&b.env, "training-operator", &[&format!("--namespace={NS}")]).await;
    let id = run_id();
    let scheduler = scheduler_name(TEST);
    let queue = json!({"kueue.x-k8s.io/queue-name": "team"});
    let (js, pt) = (format!("js-{id}"), format!("pt-{id}"));
    let jobsets = b.jobs("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");
    let template = json!({"spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
        "schedulerName": scheduler, "restartPolicy": "Never",
        "containers": [{"name": "main", "image": FRAMEWORKS_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "20"],
                        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]}}}});
    b.submit(
        &jobsets,
        json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": js, "labels": queue},
            "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": template}]}
        }),
    )
    .await;
    let store = format!("{}/ckpt/{pt}", b.env.var("CHECKPOINT_STORE"));
    let mut job = pytorchjob(&pt, &scheduler, &store, 1, 30);
    job["metadata"]["labels"] = queue;
    let pytorchjobs = b.jobs("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");
    b.submit(&pytorchjobs, job).await;
    let suspended = (
        jobsets.get(&js).await.unwrap().data["spec"]["suspend"].clone(),
        pytorchjobs.get(&pt).await.unwrap().data["spec"]["runPolicy"]["suspend"].clone(),
    );
    assert_eq!(suspended, (json!(true), json!(true)), "Kueue's webhooks suspend both at creation");

    let on_a = real_node(TEST, 0);
    for (selector, n) in
        [(format!("jobset.sigs.k8s.io/jobset-name={js}"), 2), (format!("training.kubeflow.org/job-name={pt}"), 2)]
    {
        let pods = b.await_running(&selector, n, &on_a).await;
        for p in &pods {
            let spec = p.spec.as_ref().unwrap();
            let flavor = spec.node_selector.clone().unwrap_or_default();
            assert_eq!(
                flavor.get("type").map(String::as_str),
                Some("virtual-kubelet"),
                "{}: admitted by Kueue",
                p.name_any()
            );
            let role = p.labels().get(keys::LABEL_ROLE).map(String::as_str);
            assert_eq!(role, Some(keys::ROLE_CORE), "{}: one gang, placed whole", p.name_any());
        }
        println!("{selector}: {:?} on {on_a}", pods.iter().map(|p| p.name_any()).collect::<Vec<_>>());
    }
    b.await_condition(&pytorchjobs, &pt, "Succeeded", Duration::from_secs(300)).await;
    b.await_condition(&jobsets, &js, "Completed", Duration::from_secs(300)).await;
    let background = kube::api::DeleteParams::background();
    jobsets.delete(&js, &background).await.unwrap();
    pytorchjobs.delete(&pt, &background).await.unwrap();
    finish(&b, &jobs).await;
}

/// Two tenants (two ClusterQueues of 200m each in one cohort over the lent-capacity flavor):
/// tenant a, alone, borrows b's unused share and runs two Jobs; tenant b then submits one, and
/// Kueue takes its share back from a (a's borrowed Job suspended, its pods gone from the bridge),
/// so each runs its share of what is lent, both placed by tidepool.
#[tokio::test]
async fn two_tenants_share_the_lent_capacity_by_their_queues() {
    let (_kueue, b, jobs) = start().await;
    for tenant in ["a", "b"] {
        apply(
            &kueue_api(&b, "ClusterQueue", "clusterqueues", false),
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": format!("e2e-kueue-{tenant}")},
                   "spec": {"cohortName": "e2e-kueue-lent", "preemption": {"reclaimWithinCohort": "Any"},
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
                            "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "e2e-kueue-lent",
                                "resources": [{"name": "cpu", "nominalQuota": "200m"}, {"name": "memory", "nominalQuota": "1Gi"}]}]}]}}),
        )
        .await;
        apply(
            &kueue_api(&b, "LocalQueue", "localqueues", true),
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": format!("tenant-{tenant}")},
                   "spec": {"clusterQueue": format!("e2e-kueue-{tenant}")}}),
        )
        .await;
    }
    let id = run_id();
    let scheduler = scheduler_name(TEST);
    let on_a = real_node(TEST, 0);
    let a_jobs: Vec<String> = (0..2).map(|i| format!("a{i}-{id}")).collect();
    for name in &a_jobs {
        jobs.create(&PostParams::default(), &job_in(name, &scheduler, "tenant-a", 2, 600)).await.unwrap();
    }
    for name in &a_jobs {
        b.await_running(&format!("job-name={name}"), 2, &on_a).await;
    }
    println!("tenant a runs {a_jobs:?}: its 200m and b's unused 200m");
    let b_job = format!("b0-{id}");
    jobs.create(&PostParams::default(), &job_in(&b_job, &scheduler, "tenant-b", 2, 600)).await.unwrap();
    b.await_running(&format!("job-name={b_job}"), 2, &on_a).await;
    let mut still = Vec::new();
    for name in &a_jobs {
        let suspended = jobs.get(name).await.unwrap().spec.unwrap().suspend == Some(true);
        if !suspended {
            still.push(name.clone());
        }
    }
    println!("after tenant b's Job: tenant a runs {still:?}");
    assert_eq!(still.len(), 1, "Kueue took b's share back from a: one of a's Jobs suspended");
    let preempted: Vec<&String> = a_jobs.iter().filter(|n| !still.contains(n)).collect();
    // Gone, not just terminating: tidepool removes their copies and ends their deletion.
    wait_for(Duration::from_secs(60), "the suspended Job's pods gone", || {
        let name = preempted[0].clone();
        let b = &b;
        async move { pods_of(b, &name).await.is_empty().then_some(()) }
    })
    .await;
    finish(&b, &jobs).await;
}

/// The `cpu` nominalQuota of flavor `flavor` in ClusterQueue `queue` (or the Cohort of that
/// name), in milli-CPU.
async fn cpu_quota(b: &Bridge, queue: &str, flavor: &str) -> Option<i64> {
    let (kind, plural) =
        if queue.ends_with("-cohort") { ("Cohort", "cohorts") } else { ("ClusterQueue", "clusterqueues") };
    let q = kueue_api(b, kind, plural, false).get(queue).await.ok()?;
    let groups = q.data["spec"]["resourceGroups"].as_array()?.clone();
    let f = groups.iter().filter_map(|g| g["flavors"].as_array()).flatten().find(|f| f["name"] == flavor)?.clone();
    let cpu = f["resources"].as_array()?.iter().find(|r| r["name"] == "cpu")?["nominalQuota"].clone();
    let text = cpu.as_str().map(str::to_owned).unwrap_or_else(|| cpu.to_string());
    tidepool_api::resources::parse_milli(&text).ok()
}

/// Waits until member-a's virtual node lends `milli` CPU and the quota over it of the marked
/// ClusterQueue `queue` and of the marked Cohort [`COHORT`] (half of it) say so.
async fn await_quota(b: &Bridge, queue: &str, flavor: &str, milli: i64) {
    let node = real_node(TEST, 0);
    wait_for(Duration::from_secs(60), &format!("{queue}'s {flavor} cpu quota at {milli}m, as lent"), || async {
        let (lent, quota) = (lendable_cpu(&b.training, &node).await?, cpu_quota(b, queue, flavor).await?);
        let half = cpu_quota(b, COHORT, flavor).await?;
        (lent == milli && quota == milli && half == milli / 2).then_some(())
    })
    .await;
}

/// A Cohort marked `"50%"` over the same flavor as the marked ClusterQueue.
const COHORT: &str = "e2e-kueue-half-cohort";

/// Whether the Workload of Job `job` waits for quota (`QuotaReserved` False), with its message.
async fn waits_for_quota(b: &Bridge, job: &str) -> Option<String> {
    let c = workload_condition(b, job, "QuotaReserved").await?;
    (c["status"] == "False").then(|| c["message"].as_str().unwrap_or_default().to_owned())
}

/// Condition `type_` of the Workload Kueue made for Job `job`, once it has one.
async fn workload_condition(b: &Bridge, job: &str, type_: &str) -> Option<Value> {
    let list = kueue_api(b, "Workload", "workloads", true).list(&ListParams::default()).await.ok()?;
    let w = list.items.into_iter().find(|w| w.name_any().contains(job))?;
    w.data["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).cloned()
}

/// A ClusterQueue marked `tidepool.io/lent-quota: "100%"` over a flavor of member-a's virtual
/// node: tidepool keeps its quota at what member-a lends (and a Cohort's marked `"50%"` at half
/// of it). When the member lends less (here its
/// reserve, as a window or an HPA's headroom would), the quota shrinks before anything is
/// reclaimed and Kueue holds the next Job (no pod made) instead of admitting what tidepool
/// would have to take back; the running Job is untouched; when the member lends again, Kueue
/// admits it and tidepool places it. A queue whose mark cannot be read is told so by an Event
/// and left as written.
#[tokio::test]
async fn the_lent_quota_follows_what_the_members_lend_and_kueue_admits_no_more() {
    let (_kueue, b, jobs) = start().await;
    let (flavor, queue, bad) = ("e2e-kueue-a", "e2e-kueue-following", "e2e-kueue-unreadable");
    let node = real_node(TEST, 0);
    apply(
        &kueue_api(&b, "ResourceFlavor", "resourceflavors", false),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor},
               "spec": {"nodeLabels": {"tidepool.io/member": format!("{TEST}-a"), "kubernetes.io/hostname": node}}}),
    )
    .await;
    for (name, share) in [(queue, "100%"), (bad, "lots")] {
        apply(
            &kueue_api(&b, "ClusterQueue", "clusterqueues", false),
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                   "metadata": {"name": name, "annotations": {"tidepool.io/lent-quota": share}},
                   "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
                            "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": flavor,
                                "resources": [{"name": "cpu", "nominalQuota": "0"}, {"name": "memory", "nominalQuota": "8Gi"}]}]}]}}),
        )
        .await;
    }
    apply(
        &kueue_api(&b, "Cohort", "cohorts", false),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Cohort",
               "metadata": {"name": COHORT, "annotations": {"tidepool.io/lent-quota": "50%"}},
               "spec": {"resourceGroups": [{"coveredResources": ["cpu"], "flavors": [{"name": flavor,
                   "resources": [{"name": "cpu", "nominalQuota": "0"}]}]}]}}),
    )
    .await;
    apply(
        &kueue_api(&b, "LocalQueue", "localqueues", true),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "following"},
               "spec": {"clusterQueue": queue}}),
    )
    .await;
    b.lend(0, Some(250)).await;
    await_quota(&b, queue, flavor, 250).await;
    let id = run_id();
    let scheduler = scheduler_name(TEST);
    let (first, second) = (format!("lent-first-{id}"), format!("lent-second-{id}"));
    jobs.create(&PostParams::default(), &job_in(&first, &scheduler, "following", 2, 600)).await.unwrap();
    let running = b.await_running(&format!("job-name={first}"), 2, &node).await;

    // The member takes back all but what the first Job runs on: the quota follows at once, so
    // the second Job waits in Kueue, not as pods tidepool would have to place and reclaim.
    b.lend(0, Some(200)).await;
    await_quota(&b, queue, flavor, 200).await;
    jobs.create(&PostParams::default(), &job_in(&second, &scheduler, "following", 2, 15)).await.unwrap();
    let why = wait_for(Duration::from_secs(30), "the second Job's Workload waiting for quota", || {
        waits_for_quota(&b, &second)
    })
    .await;
    println!("{second}: {why}");
    assert!(pods_of(&b, &second).await.is_empty(), "Kueue holds the second Job: no pod of it exists");
    let still = pods_of(&b, &first).await;
    let uids = |pods: &[k8s_openapi::api::core::v1::Pod]| pods.iter().map(|p| p.uid()).collect::<Vec<_>>();
    assert_eq!(uids(&still), uids(&running), "the first Job's pods were not reclaimed");
    assert!(still.iter().all(|p| phase(p) == "Running"), "the first Job runs on");

    // The member lends again: Kueue admits the second Job and tidepool places it.
    b.lend(0, Some(450)).await;
    await_quota(&b, queue, flavor, 450).await;
    b.await_running(&format!("job-name={second}"), 2, &node).await;

    // Told on the queues themselves; the unreadable mark left its queue as written.
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(b.training.clone(), "default");
    let about = |name: &'static str, reason: &'static str| {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.ok()?;
            list.items.into_iter().filter(|e| e.reason.as_deref() == Some(reason)).filter_map(|e| e.message).next_back()
        }
    };
    let said = wait_for(Duration::from_secs(30), "a LentQuota Event on the queue", || about(queue, "LentQuota")).await;
    println!("{queue}: {said}");
    let refused = wait_for(Duration::from_secs(30), "a LentQuotaInvalid Event on the unreadable queue", || {
        about(bad, "LentQuotaInvalid")
    })
    .await;
    assert!(refused.contains("\"lots\""), "the Event quotes the mark: {refused}");
    assert_eq!(cpu_quota(&b, bad, flavor).await, Some(0), "an unreadable mark leaves the quota as written");
    finish(&b, &jobs).await;
    b.lend(0, None).await;
}

/// The copies in member `i` (any namespace) of Job `job`'s pods: they keep the pods' names
/// (their labels are the member's own hashes).
async fn member_pods(b: &Bridge, i: usize, job: &str) -> Vec<k8s_openapi::api::core::v1::Pod> {
    let api = Api::<k8s_openapi::api::core::v1::Pod>::all(b.members[i].clone());
    let all = api.list(&ListParams::default()).await.unwrap().items;
    all.into_iter().filter(|p| p.name_any().starts_with(&format!("{job}-"))).collect()
}

/// Kueue's `waitForPodsReady` (60 s here) and tidepool's gang admission: a Job Kueue admits by
/// quota (300m) that no member can hold whole (each lends 200m) waits in tidepool, its pods
/// Pending with the reason, none placed. Kueue rolls it back at its timeout (the Workload
/// evicted, the Job suspended, its pods deleted) and tidepool follows: nothing of it is left in
/// either member. Queued again, it is admitted once more and, now that member-a lends enough,
/// placed there whole.
#[tokio::test]
async fn kueue_rolls_back_a_gang_tidepool_cannot_place_and_tidepool_follows() {
    let (_kueue, b, jobs) = start().await;
    b.lend(0, Some(200)).await;
    b.lend(1, Some(200)).await;
    let name = format!("fragmented-{}", run_id());
    let selector = format!("job-name={name}");
    // One gang of 3, by tidepool's annotation (a Job's pods are otherwise gangs of one).
    let mut job = job_in(&name, &scheduler_name(TEST), "team", 3, 30);
    let gang = [(keys::ANNOTATION_GANG, name.as_str()), (keys::ANNOTATION_MIN_MEMBER, "3")];
    job.spec.as_mut().unwrap().template.metadata = Some(kube::api::ObjectMeta {
        annotations: Some(gang.map(|(k, v)| (k.to_owned(), v.to_owned())).into()),
        ..Default::default()
    });
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let pending = wait_for(Duration::from_secs(60), "the admitted Job's pods waiting in tidepool", || async {
        let pods = pods_of(&b, &name).await;
        let waiting = pods
            .iter()
            .filter(|p| phase(p) == "Pending" && p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
            .count();
        let why = pods.iter().find_map(|p| {
            let c = p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "PodScheduled")?.clone();
            c.message
        });
        (waiting == 3).then_some(why).flatten()
    })
    .await;
    println!("{name}: pending in tidepool: {pending}");

    let evicted = wait_for(Duration::from_secs(120), "Kueue's PodsReady timeout evicting the Workload", || async {
        let c = workload_condition(&b, &name, "Evicted").await?;
        (c["status"] == "True" || c["reason"] == "PodsReadyTimeout").then_some(c)
    })
    .await;
    println!("{name}: {evicted}");
    assert_eq!(evicted["reason"], "PodsReadyTimeout", "evicted by waitForPodsReady");
    wait_for(Duration::from_secs(60), "the evicted Job's pods gone", || async {
        pods_of(&b, &name).await.is_empty().then_some(())
    })
    .await;
    for i in 0..2 {
        assert!(member_pods(&b, i, &name).await.is_empty(), "nothing of the evicted Job in member {i}");
    }

    // Queued again and admitted again: member-a now lends enough, and tidepool places it whole.
    b.lend(0, Some(400)).await;
    b.await_running(&selector, 3, &real_node(TEST, 0)).await;
    assert_eq!(member_pods(&b, 0, &name).await.len(), 3, "its copies are in member-a");
    await_complete(&jobs, &name).await;
    finish(&b, &jobs).await;
    b.lend(0, None).await;
    b.lend(1, Some(0)).await;
}
