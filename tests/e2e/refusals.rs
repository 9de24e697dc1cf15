//! A refusal that needs a person is said on the pod (troubleshooting.md, "Permissions"): a
//! member that refuses tidepool's copy (here its own admission policy) gives the training
//! pod a `MemberForbidden` Warning with the member's words, a training cluster that refuses
//! tidepool's status write gives `TrainingForbidden`; the pod waits (nothing is lost), and
//! once the refusal is lifted the next change of the pod goes through.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

const TEST: &str = "refusals";
const NS: &str = "e2e-refusals";
const MEMBER: &str = "e2e-refusals-a";
const NODE: &str = "tidepool-e2e-refusals-a";

/// A policy of `client`'s cluster refusing `operation` on `resource` in namespace `ns` with
/// `message`, bound to deny; removed by [`lift`].
async fn refuse(client: &Client, name: &str, (operation, resource): (&str, &str), ns: &str, message: &str) {
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": [operation],
                                   "resources": [resource]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            },
            "validations": [{"expression": "false", "message": message, "reason": "Forbidden"}],
        },
    }))
    .unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }))
    .unwrap();
    let pp = PatchParams::apply("e2e-refusals").force();
    Api::<ValidatingAdmissionPolicy>::all(client.clone()).patch(name, &pp, &Patch::Apply(&policy)).await.unwrap();
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone());
    bindings.patch(name, &pp, &Patch::Apply(&binding)).await.unwrap();
    // The API server takes a new policy from its own watch, a moment after the write.
    tokio::time::sleep(Duration::from_secs(2)).await;
}

async fn lift(client: &Client, name: &str) {
    let _ = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).delete(name, &DeleteParams::default()).await;
    let _ = Api::<ValidatingAdmissionPolicy>::all(client.clone()).delete(name, &DeleteParams::default()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
}

/// A pod bound by hand to the member's virtual node.
fn bound_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
        },
    }))
    .unwrap()
}

/// The note of the first Event with `reason` about pod `name`, once there is one.
async fn event_note(training: &Client, name: &str, reason: &str) -> String {
    wait_for(Duration::from_secs(60), &format!("{reason} Event on pod {name}"), || async move {
        crate::vk_features::event_notes(training, NS, name, reason).await.into_iter().next()
    })
    .await
}

async fn phase(pods: &Api<Pod>, name: &str) -> Option<String> {
    pods.get_opt(name).await.ok()??.status?.phase
}

/// Waits until pod `name` of `pods` is Running.
async fn running(pods: &Api<Pod>, name: &str, what: &str) {
    wait_for(Duration::from_secs(60), what, || async move {
        (phase(pods, name).await.as_deref() == Some("Running")).then_some(())
    })
    .await;
}

/// A change of the pod, which has the pod sync look at it again (a refused pod is otherwise
/// retried after 300 s, as the Event says).
async fn touch(pods: &Api<Pod>, name: &str) {
    let label = Patch::Merge(json!({"metadata": {"labels": {"e2e-touched": run_id()}}}));
    pods.patch(name, &PatchParams::default(), &label).await.unwrap();
}

#[tokio::test]
async fn a_members_refusal_and_the_training_clusters_are_said_on_the_pod_and_nothing_is_lost() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, NS).await;
    let member_ns = offload_ns(NS);
    let (member_policy, training_policy) = ("e2e-refusals-member", "e2e-refusals-training");
    lift(&member, member_policy).await;
    lift(&training, training_policy).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let member_pods = Api::<Pod>::namespaced(member.clone(), &member_ns);
    wait_for(Duration::from_secs(90), "virtual node", || {
        let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone());
        async move { nodes.get_opt(NODE).await.ok().flatten().map(|_| ()) }
    })
    .await;

    // 1. The member refuses the copy: MemberForbidden with the member's own words; no copy.
    let said = "no copies here during the e2e change freeze";
    refuse(&member, member_policy, ("CREATE", "pods"), &member_ns, said).await;
    let first = format!("first-{}", run_id());
    pods.create(&PostParams::default(), &bound_pod(&first)).await.unwrap();
    let note = event_note(&training, &first, "MemberForbidden").await;
    assert!(note.contains(said) && note.contains("tried again in 300 s"), "{note}");
    assert!(member_pods.get_opt(&first).await.unwrap().is_none(), "a copy was made past the member's refusal");
    assert_ne!(phase(&pods, &first).await.as_deref(), Some("Failed"), "a refusal failed the pod");
    // Lifted: the pod's next change makes the copy, and it runs.
    lift(&member, member_policy).await;
    touch(&pods, &first).await;
    running(&pods, &first, "the copy made once the member allows it").await;

    // 2. The training cluster refuses tidepool's status write: TrainingForbidden; the copy
    //    runs, the training pod stays Pending until the refusal is lifted.
    let said = "pod status is frozen during the e2e change freeze";
    refuse(&training, training_policy, ("UPDATE", "pods/status"), NS, said).await;
    let second = format!("second-{}", run_id());
    pods.create(&PostParams::default(), &bound_pod(&second)).await.unwrap();
    let note = event_note(&training, &second, "TrainingForbidden").await;
    assert!(note.contains(said), "{note}");
    running(&member_pods, &second, "the copy running in the member").await;
    assert_ne!(phase(&pods, &second).await.as_deref(), Some("Running"), "a status went past the refusal");
    lift(&training, training_policy).await;
    touch(&pods, &second).await;
    running(&pods, &second, "the status written once the training cluster allows it").await;
    drain_pods(&training, NS).await;
    Api::<MemberCluster>::all(training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}
