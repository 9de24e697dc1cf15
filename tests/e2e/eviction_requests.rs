//! A member actor that asks for a copy to leave through Kubernetes' `EvictionRequest` API
//! (1.37, `lifecycle.k8s.io/v1alpha1`, member-a) gets a graceful eviction (issue "Kubernetes
//! 1.37"): tidepool relays the checkpoint notice to the training pod, tells the request, and
//! evicts the copy at the trainer's ack; the training pod ends `Failed` with
//! `DisruptionTarget`, so its Job (`backoffLimit: 0`, ignoring disruptions) makes a new pod.
//! A request withdrawn before the ack withdraws the notice: the pod and its copy stay. Each
//! reclaim is also tidepool's own `EvictionRequest` for the training pod (requester
//! `tidepool.io/reclaim`), which a tenant's tool watching the training namespace sees.
//!
//! Kubernetes 1.37 ships no controller that acts on eviction requests: without tidepool's
//! answer, the request sits there and the copy keeps running (nothing else in these clusters
//! reads them).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::lifecycle::v1alpha1::EvictionRequest;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use crate::harness::*;

const TEST: &str = "evreq";
const NS: &str = "e2e-evreq";
const MEMBER: &str = "e2e-evreq-a";
const NODE: &str = "tidepool-e2e-evreq-a-real";
/// Each band's checkpoint grace: the withdrawn notice is watched past its deadline.
const GRACE_SECONDS: u64 = 20;
const REQUESTER: &str = "e2e.tidepool.io/drain";
/// A member namespace that is not the copies'.
const OTHER_NS: &str = "e2e-evreq-elsewhere";

struct Setup(RealNodeJobs);

impl std::ops::Deref for Setup {
    type Target = RealNodeJobs;
    fn deref(&self) -> &RealNodeJobs {
        &self.0
    }
}

impl Setup {
    async fn start() -> Setup {
        let grace =
            format!("reclaimGraceSeconds: {{high: {GRACE_SECONDS}, medium: {GRACE_SECONDS}, low: {GRACE_SECONDS}}}");
        Setup(RealNodeJobs::start((TEST, NS), MEMBER, NODE, &grace).await)
    }

    /// A Job of one pod running `script` on the real pool (`backoffLimit: 0`, disruptions
    /// ignored); its pod once Running, and its copy.
    async fn job(&self, name: &str, script: &str) -> (Pod, Pod) {
        let job: Job = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                "template": {"metadata": {"labels": {"job": name}}, "spec": {
                    "schedulerName": scheduler_name(TEST),
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "main", "image": self.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                        "command": ["sh", "-c", script],
                        "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}}
                    }]
                }}
            }
        }))
        .unwrap();
        Api::<Job>::namespaced(self.training.clone(), NS).create(&PostParams::default(), &job).await.unwrap();
        let pods = Api::<Pod>::namespaced(self.training.clone(), NS);
        let pod = wait_for(Duration::from_secs(120), &format!("{name}'s pod Running"), || {
            let pods = pods.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(&format!("job={name}"))).await.ok()?.items;
                list.into_iter().find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            }
        })
        .await;
        let copy = self.copies().get(&pod.name_any()).await.unwrap();
        (pod, copy)
    }

    fn copies(&self) -> Api<Pod> {
        Api::namespaced(self.member.clone(), &offload_ns(NS))
    }

    fn requests(&self) -> Api<EvictionRequest> {
        Api::namespaced(self.member.clone(), &offload_ns(NS))
    }

    /// The member actor's request to evict `copy`, named `name`.
    async fn ask(&self, name: &str, copy: &Pod) -> EvictionRequest {
        self.ask_in(&offload_ns(NS), name, copy).await
    }

    /// [`Setup::ask`], made in namespace `ns` of the member.
    async fn ask_in(&self, ns: &str, name: &str, copy: &Pod) -> EvictionRequest {
        let er: EvictionRequest = serde_json::from_value(json!({
            "apiVersion": "lifecycle.k8s.io/v1alpha1", "kind": "EvictionRequest",
            "metadata": {"name": name},
            "spec": {
                "target": {"pod": {"name": copy.name_any(), "uid": copy.uid().unwrap()}},
                "requester": REQUESTER, "intent": "Eviction"
            }
        }))
        .unwrap();
        Api::namespaced(self.member.clone(), ns).create(&PostParams::default(), &er).await.unwrap()
    }

    async fn finish(&self, job: &str, request: &str) {
        let dp =
            DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Background), ..Default::default() };
        let _ = Api::<Job>::namespaced(self.training.clone(), NS).delete(job, &dp).await;
        let _ = self.requests().delete(request, &DeleteParams::default()).await;
        drain_pods(&self.training, NS).await;
    }
}

/// The condition `type_` of `p`'s status: (status, reason, message).
fn pod_condition(p: &Pod, type_: &str) -> Option<(String, String, String)> {
    let c = p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default(), c.message.clone().unwrap_or_default()))
}

/// The condition `type_` of the request's status: (status, reason, message).
fn request_condition(er: &EvictionRequest, type_: &str) -> Option<(String, String, String)> {
    let c = er.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits for request `name` to show condition `type_` with `status` and `reason`.
async fn wait_request(s: &Setup, name: &str, type_: &str, status: &str, reason: &str) -> String {
    let api = s.requests();
    wait_for(Duration::from_secs(60), &format!("EvictionRequest {name}: {type_}={status} ({reason})"), || {
        let api = api.clone();
        async move {
            let er = api.get(name).await.ok()?;
            let (st, r, message) = request_condition(&er, type_)?;
            (st == status && r == reason).then_some(message)
        }
    })
    .await
}

/// Waits for training pod `name`'s notice condition to read `status` with `reason`.
async fn wait_notice(s: &Setup, name: &str, status: &str, reason: &str) -> Pod {
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    wait_for(Duration::from_secs(60), &format!("{name}: ReclaimRequested={status} ({reason})"), || {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await.ok()?;
            let (st, r, _) = pod_condition(&p, "tidepool.io/ReclaimRequested")?;
            (st == status && r == reason).then_some(p)
        }
    })
    .await
}

#[tokio::test]
async fn a_members_eviction_request_for_a_copy_is_a_checkpoint_notice_then_a_disruption_the_job_does_not_count() {
    let s = Setup::start().await;
    let job = format!("asked-{}", run_id());
    // The trainer: waits for the notice in its annotations file, then acks as it exits.
    let script = "until grep -q reclaim-deadline /etc/tidepool/annotations 2>/dev/null; do sleep 0.2; done; \
                  echo 'tidepool.io/checkpointed step=7' > /dev/termination-log; exit 0";
    let (pod, copy) = s.job(&job, script).await;
    let name = pod.name_any();
    let request = format!("drain-{}", run_id());
    // A tenant's tool watching eviction requests in the training namespace.
    let (seen, watch) = watch_requests(&s.training);
    s.ask(&request, &copy).await;

    // The notice, naming the request, on the training pod; the request told of it.
    let noticed = wait_notice(&s, &name, "True", "EvictionRequested").await;
    let (_, _, message) = pod_condition(&noticed, "tidepool.io/ReclaimRequested").unwrap();
    assert!(message.contains(&request) && message.contains(REQUESTER), "notice: {message}");
    let told = wait_request(&s, &request, "tidepool.io/CheckpointNotice", "True", "Acknowledged").await;
    println!("request told: {told}");

    // The ack ends it: the copy is gone, the request shows its target evicted.
    let evicted = wait_request(&s, &request, "TargetEvicted", "True", "PodDeleted").await;
    assert!(evicted.contains("acknowledged by the pod as it exited"), "TargetEvicted: {evicted}");
    let copy_now = s.copies().get_opt(&name).await.unwrap();
    assert!(copy_now.is_none_or(|c| c.uid() != copy.uid()), "the copy asked for is still there");

    // The training pod: Failed, reason Reclaimed, with DisruptionTarget; the Job ignores it.
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let failed = pods.get(&name).await.unwrap();
    let st = failed.status.clone().unwrap();
    assert_eq!((st.phase.as_deref(), st.reason.as_deref()), (Some("Failed"), Some("Reclaimed")), "{st:?}");
    assert!(st.message.as_deref().unwrap_or("").contains("evicted by member"), "{:?}", st.message);
    assert_eq!(pod_condition(&failed, "DisruptionTarget").map(|c| c.0), Some("True".to_owned()));
    wait_job_replaced(&s.training, NS, &job, &name).await;

    // The tool saw the reclaim as tidepool's eviction request for the training pod, ending
    // with the pod terminal.
    let ours = wait_for(Duration::from_secs(30), "tidepool's eviction request, target evicted", || {
        let seen = seen.clone();
        let uid = pod.uid().unwrap();
        async move {
            let seen = seen.lock().unwrap();
            let mine: Vec<&EvictionRequest> =
                seen.iter().filter(|er| er.spec.target.pod.as_ref().is_some_and(|t| t.uid == uid)).collect();
            let last = mine.last()?;
            (request_condition(last, "TargetEvicted").map(|c| (c.0, c.1))
                == Some(("True".into(), "PodTerminal".into())))
            .then(|| (*last).clone())
        }
    })
    .await;
    watch.abort();
    assert_eq!((ours.spec.requester.as_str(), ours.spec.intent.as_str()), ("tidepool.io/reclaim", "Eviction"));
    let owner = ours.metadata.owner_references.clone().unwrap_or_default();
    assert!(owner.iter().any(|o| o.kind == "Pod" && Some(&o.uid) == pod.uid().as_ref()), "owner: {owner:?}");
    s.finish(&job, &request).await;
}

/// Every version of every eviction request in the training namespace a watch sees from now on.
fn watch_requests(training: &Client) -> (Arc<Mutex<Vec<EvictionRequest>>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let api = Api::<EvictionRequest>::namespaced(training.clone(), NS);
    let sink = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()));
        while let Some(event) = stream.next().await {
            if let Ok(watcher::Event::Apply(er) | watcher::Event::InitApply(er)) = event {
                sink.lock().unwrap().push(er);
            }
        }
    });
    (seen, task)
}

#[tokio::test]
async fn an_eviction_request_withdrawn_before_the_ack_withdraws_the_notice_and_the_copy_stays() {
    let s = Setup::start().await;
    let job = format!("kept-{}", run_id());
    let (pod, copy) = s.job(&job, "exec sleep 3600").await;
    let name = pod.name_any();

    // Someone who may make eviction requests only in another member namespace names the copy
    // exactly: tidepool is nobody's deputy there, no notice.
    ensure_namespace(&s.member, OTHER_NS).await;
    let elsewhere = format!("elsewhere-{}", run_id());
    s.ask_in(OTHER_NS, &elsewhere, &copy).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let p = Api::<Pod>::namespaced(s.training.clone(), NS).get(&name).await.unwrap();
    assert_eq!(pod_condition(&p, "tidepool.io/ReclaimRequested"), None, "a request from {OTHER_NS} reached the copy");
    let others = Api::<EvictionRequest>::namespaced(s.member.clone(), OTHER_NS);
    let _ = others.delete(&elsewhere, &DeleteParams::default()).await;

    let request = format!("drain-{}", run_id());
    s.ask(&request, &copy).await;
    wait_notice(&s, &name, "True", "EvictionRequested").await;
    wait_request(&s, &request, "tidepool.io/CheckpointNotice", "True", "NoticeSent").await;
    let copies = s.copies();
    wait_for(Duration::from_secs(30), "the deadline on the copy", || {
        let (copies, name) = (copies.clone(), name.clone());
        async move {
            let c = copies.get(&name).await.ok()?;
            c.annotations().contains_key("tidepool.io/reclaim-deadline").then_some(())
        }
    })
    .await;

    let withdraw = json!({"spec": {"intent": "Withdrawn"}});
    s.requests().patch(&request, &PatchParams::default(), &Patch::Merge(withdraw)).await.unwrap();
    let withdrawn = wait_notice(&s, &name, "False", "EvictionWithdrawn").await;
    // False as withdrawn, or gone with the copy's next status (tidepool keeps only its own).
    let target = pod_condition(&withdrawn, "DisruptionTarget").map(|c| c.0);
    assert_ne!(target.as_deref(), Some("True"), "a withdrawn notice left DisruptionTarget");
    wait_request(&s, &request, "Failed", "True", "CanceledDueToNoRequesters").await;
    // tidepool's own request for the training pod is withdrawn with it.
    let training_requests = Api::<EvictionRequest>::namespaced(s.training.clone(), NS);
    let ours = format!("tidepool-reclaim-{}", pod.uid().unwrap());
    let intent = wait_for(Duration::from_secs(30), "tidepool's eviction request withdrawn", || {
        let (api, ours) = (training_requests.clone(), ours.clone());
        async move {
            let er = api.get(&ours).await.ok()?;
            (er.spec.intent == "Withdrawn").then_some(er.spec.intent)
        }
    })
    .await;
    assert_eq!(intent, "Withdrawn");
    wait_for(Duration::from_secs(30), "the deadline off the copy", || {
        let (copies, name) = (copies.clone(), name.clone());
        async move {
            let c = copies.get(&name).await.ok()?;
            (!c.annotations().contains_key("tidepool.io/reclaim-deadline")).then_some(())
        }
    })
    .await;

    // Past the withdrawn deadline: the same copy runs, the training pod with it.
    tokio::time::sleep(Duration::from_secs(GRACE_SECONDS + 5)).await;
    let c = copies.get(&name).await.unwrap();
    assert_eq!(c.uid(), copy.uid(), "the copy was replaced");
    assert_eq!(c.status.and_then(|s| s.phase).as_deref(), Some("Running"));
    let p = Api::<Pod>::namespaced(s.training.clone(), NS).get(&name).await.unwrap();
    assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Running"), "training pod {name}");
    s.finish(&job, &request).await;
}
