//! The virtual kubelet's guard rails, end to end: the offload policy refuses pods that would
//! reach a member's hosts, the ConfigMaps and Secrets a pod uses follow it into the member
//! (and leave with it), and offload pods whose training pod is gone are collected.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tidepool_api::{MemberCluster, keys};

use crate::harness::*;

/// One test's clusters, with its MemberCluster (for member-a) applied.
struct Setup {
    env: Env,
    training: Client,
    member: Client,
}

async fn setup(test: &str, ns: &str, member_name: &str) -> Setup {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    env.install_crds(&training).await;
    reset_members(&training, test).await;
    ensure_namespace(&training, ns).await;
    bridge_member(&env, &training, test, ns, member_name, "member-a").await;
    Setup { env, training, member }
}

/// Waits for the virtual node: a pod bound to a node that does not exist is the training
/// cluster's pod garbage collector's to delete.
async fn wait_node(training: &Client, node: &str) {
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node registered", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(node).await.ok().flatten().map(|_| ()) }
    })
    .await;
}

/// A pod bound to `node`, with `spec` fields added to a plain one-container spec.
fn bound_pod(name: &str, node: &str, spec: Value) -> Pod {
    let mut p = json!({
        "metadata": {"name": name, "labels": {"app": "vk-features"}},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
        }
    });
    for (k, v) in spec.as_object().unwrap() {
        p["spec"][k] = v.clone();
    }
    serde_json::from_value(p).unwrap()
}

async fn wait_phase(pods: &Api<Pod>, name: &str, phase: &str) -> Pod {
    wait_for(Duration::from_secs(60), &format!("pod {name} {phase}"), || async move {
        let p = pods.get(name).await.ok()?;
        (p.status.as_ref()?.phase.as_deref() == Some(phase)).then_some(p)
    })
    .await
}

async fn wait_gone<K>(api: &Api<K>, name: &str, timeout: Duration, what: &str)
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    wait_for(timeout, what, || async move { api.get_opt(name).await.ok()?.is_none().then_some(()) }).await;
}

/// The notes of the Events with `reason` about pod `name`.
pub(crate) async fn event_notes(training: &Client, ns: &str, name: &str, reason: &str) -> Vec<String> {
    let events = Api::<Event>::namespaced(training.clone(), ns).list(&ListParams::default()).await.unwrap();
    events
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| e.note)
        .collect()
}

async fn delete_pod(pods: &Api<Pod>, name: &str) {
    match pods.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("delete pod {name}: {e}"),
    }
}

#[tokio::test]
async fn pods_reaching_for_the_host_are_refused_and_a_normal_pod_beside_them_runs() {
    const TEST: &str = "vk-policy";
    const NS: &str = "e2e-vk-policy";
    const MEMBER: &str = "e2e-vkp-a";
    const NODE: &str = "tidepool-e2e-vkp-a";
    let s = setup(TEST, NS, MEMBER).await;
    let tidepool = Tidepool::start(&s.env, TEST, NS);
    wait_node(&s.training, NODE).await;

    let id = run_id();
    let (privileged, host_path, normal) =
        (format!("privileged-{id}"), format!("hostpath-{id}"), format!("normal-{id}"));
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let privileged_pod = bound_pod(
        &privileged,
        NODE,
        json!({"containers": [{"name": "main", "image": "example.invalid/trainer:1", "securityContext": {"privileged": true}}]}),
    );
    let host_path_pod = bound_pod(
        &host_path,
        NODE,
        json!({"volumes": [{"name": "scratch", "emptyDir": {}}, {"name": "root", "hostPath": {"path": "/"}}]}),
    );
    for pod in [&privileged_pod, &host_path_pod, &bound_pod(&normal, NODE, json!({}))] {
        pods.create(&PostParams::default(), pod).await.unwrap();
    }

    // 1. Both offenders fail with reason OffloadPolicy and a message naming the field.
    for (name, field) in
        [(&privileged, "spec.containers[0].securityContext.privileged"), (&host_path, "spec.volumes[1].hostPath")]
    {
        let failed = wait_phase(&pods, name, "Failed").await;
        let status = failed.status.unwrap();
        assert_eq!(status.reason.as_deref(), Some(keys::REASON_OFFLOAD_POLICY), "{name}");
        let message = status.message.unwrap_or_default();
        assert!(message.contains(field), "{name}: message {message:?} does not name {field}");
        let notes = wait_for(Duration::from_secs(30), &format!("OffloadPolicy event for {name}"), || {
            let training = s.training.clone();
            async move {
                let notes = event_notes(&training, NS, name, keys::REASON_OFFLOAD_POLICY).await;
                (!notes.is_empty()).then_some(notes)
            }
        })
        .await;
        assert!(notes.iter().any(|n| n.contains(field)), "{name}: events {notes:?}");
    }

    // 2. The normal pod beside them runs in the member; the offenders never got there.
    let member_pods = Api::<Pod>::namespaced(s.member.clone(), &offload_ns(NS));
    wait_phase(&member_pods, &normal, "Running").await;
    wait_phase(&pods, &normal, "Running").await;
    for name in [&privileged, &host_path] {
        assert!(member_pods.get_opt(name).await.unwrap().is_none(), "{name} reached the member");
    }

    for name in [&privileged, &host_path, &normal] {
        delete_pod(&pods, name).await;
    }
    for name in [&privileged, &host_path, &normal] {
        wait_gone(&pods, name, Duration::from_secs(60), "training pod deleted").await;
    }
    Api::<MemberCluster>::all(s.training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}

#[tokio::test]
async fn configmaps_and_secrets_follow_their_pod_into_the_member_and_leave_with_it() {
    const TEST: &str = "vk-reflect";
    const NS: &str = "e2e-vk-reflect";
    const MEMBER: &str = "e2e-vkr-a";
    const NODE: &str = "tidepool-e2e-vkr-a";
    let s = setup(TEST, NS, MEMBER).await;
    let tidepool = Tidepool::start(&s.env, TEST, NS);
    wait_node(&s.training, NODE).await;

    let id = run_id();
    let (config, creds, late) = (format!("cfg-{id}"), format!("creds-{id}"), format!("late-{id}"));
    let secret_value = format!("e2e-s3cr3t-{id}");
    let config_maps = Api::<ConfigMap>::namespaced(s.training.clone(), NS);
    let secrets = Api::<Secret>::namespaced(s.training.clone(), NS);
    let cm = |name: &str, lr: &str| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": name}, "data": {"lr": lr}})).unwrap()
    };
    config_maps.create(&PostParams::default(), &cm(&config, "0.1")).await.unwrap();
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(creds.clone()), ..Default::default() },
        data: Some(BTreeMap::from([("token".to_owned(), ByteString(secret_value.clone().into_bytes()))])),
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &secret).await.unwrap();

    // 1. A pod with a ConfigMap volume and a Secret env var: both are copied, then it runs.
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let trainer = format!("trainer-{id}");
    let pod = bound_pod(
        &trainer,
        NODE,
        json!({
            "volumes": [{"name": "config", "configMap": {"name": config}}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                "volumeMounts": [{"name": "config", "mountPath": "/etc/trainer"}],
                "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": creds, "key": "token"}}}]}]
        }),
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let member_ns = offload_ns(NS);
    let member_cms = Api::<ConfigMap>::namespaced(s.member.clone(), &member_ns);
    let member_secrets = Api::<Secret>::namespaced(s.member.clone(), &member_ns);
    let member_pods = Api::<Pod>::namespaced(s.member.clone(), &member_ns);
    // Once the offload pod exists, both copies must have been made before it.
    wait_for(Duration::from_secs(60), "offload pod created", || {
        let (member_pods, trainer) = (member_pods.clone(), trainer.clone());
        async move { member_pods.get_opt(&trainer).await.ok().flatten() }
    })
    .await;
    let copy = member_cms.get(&config).await.expect("the ConfigMap is copied before the pod is created");
    assert_eq!(copy.data.as_ref().unwrap()["lr"], "0.1");
    let labels = copy.metadata.labels.clone().unwrap();
    assert_eq!(labels[keys::LABEL_REFLECTED], "true");
    assert_eq!(labels[keys::LABEL_ORIGIN_CLUSTER], "training");
    assert_eq!(labels[keys::LABEL_ORIGIN_MEMBER], MEMBER);
    let secret_copy = member_secrets.get(&creds).await.expect("the Secret is copied before the pod is created");
    assert_eq!(secret_copy.data.unwrap()["token"], ByteString(secret_value.clone().into_bytes()));
    assert_eq!(secret_copy.metadata.labels.unwrap()[keys::LABEL_ORIGIN_MEMBER], MEMBER);
    wait_phase(&member_pods, &trainer, "Running").await;
    wait_phase(&pods, &trainer, "Running").await;

    // 2. Changing the ConfigMap in training changes the member's copy.
    config_maps
        .patch(&config, &PatchParams::default(), &Patch::Merge(json!({"data": {"lr": "0.2", "epochs": "3"}})))
        .await
        .unwrap();
    wait_for(Duration::from_secs(30), "member copy updated", || {
        let (member_cms, config) = (member_cms.clone(), config.clone());
        async move {
            let data = member_cms.get(&config).await.ok()?.data?;
            (data.get("lr").map(String::as_str) == Some("0.2") && data.contains_key("epochs")).then_some(())
        }
    })
    .await;

    // 3. A pod needing a ConfigMap that does not exist yet waits, saying so, and is not
    //    offloaded; once the ConfigMap exists it is.
    let waiting = format!("waiting-{id}");
    let pod = bound_pod(
        &waiting,
        NODE,
        json!({"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                               "envFrom": [{"configMapRef": {"name": late}}]}]}),
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let notes = wait_for(Duration::from_secs(30), "ReferenceMissing event", || {
        let (training, waiting) = (s.training.clone(), waiting.clone());
        async move {
            let notes = event_notes(&training, NS, &waiting, "ReferenceMissing").await;
            (!notes.is_empty()).then_some(notes)
        }
    })
    .await;
    assert!(notes.iter().any(|n| n.contains(&late)), "{notes:?}");
    assert!(member_pods.get_opt(&waiting).await.unwrap().is_none(), "offloaded without its ConfigMap");
    let phase = pods.get(&waiting).await.unwrap().status.and_then(|s| s.phase);
    assert_ne!(phase.as_deref(), Some("Failed"));
    config_maps.create(&PostParams::default(), &cm(&late, "1")).await.unwrap();
    wait_phase(&member_pods, &waiting, "Running").await;
    assert!(member_cms.get_opt(&late).await.unwrap().is_some());

    // 3b. A ConfigMap of the member's own under the name a pod references: never
    //     overwritten; the pod waits, saying so (`ReflectionConflict`, as troubleshooting.md
    //     shows it), and is not offloaded.
    let taken = format!("taken-{id}");
    config_maps.create(&PostParams::default(), &cm(&taken, "ours")).await.unwrap();
    let theirs = member_cms.create(&PostParams::default(), &cm(&taken, "theirs")).await.unwrap();
    let blocked = format!("blocked-{id}");
    let pod = bound_pod(
        &blocked,
        NODE,
        json!({"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                               "envFrom": [{"configMapRef": {"name": taken}}]}]}),
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let notes = wait_for(Duration::from_secs(30), "ReflectionConflict event", || {
        let (training, blocked) = (s.training.clone(), blocked.clone());
        async move {
            let notes = event_notes(&training, NS, &blocked, "ReflectionConflict").await;
            (!notes.is_empty()).then_some(notes)
        }
    })
    .await;
    let said = format!("member {MEMBER} already has ConfigMap {member_ns}/{taken} that tidepool did not copy");
    assert!(notes.iter().any(|n| n.contains(&said)), "{notes:?}");
    let now = member_cms.get(&taken).await.unwrap();
    assert_eq!(now.metadata.uid, theirs.metadata.uid, "the member's ConfigMap was replaced");
    assert_eq!(now.data.unwrap()["lr"], "theirs", "the member's ConfigMap was overwritten");
    assert!(member_pods.get_opt(&blocked).await.unwrap().is_none(), "offloaded over a conflicting ConfigMap");
    delete_pod(&pods, &blocked).await;
    member_cms.delete(&taken, &DeleteParams::default()).await.unwrap();

    // 4. Secret contents never reach the log: the whole log of this tidepool, read from the
    //    file it writes (not a tail), in plain text or base64 as the API carries it.
    let log = tidepool.log();
    assert!(log.contains("reflected copy created"), "no reflection in the log:\n{log}");
    let encoded = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, secret_value.as_bytes());
    assert!(!log.contains(&secret_value), "secret contents in tidepool's log");
    assert!(!log.contains(&encoded), "secret contents (base64) in tidepool's log");
    let debug = format!("{:?}", secret_value.as_bytes()).trim_matches(['[', ']']).to_owned();
    assert!(!log.contains(&debug), "secret contents (as Debug bytes) in tidepool's log");

    // 5. Deleting the pods removes the copies nobody uses any more.
    delete_pod(&pods, &trainer).await;
    delete_pod(&pods, &waiting).await;
    for name in [&config, &late] {
        wait_gone(&member_cms, name, Duration::from_secs(60), "ConfigMap copy removed").await;
    }
    wait_gone(&member_secrets, &creds, Duration::from_secs(60), "Secret copy removed").await;
    for name in [&trainer, &waiting, &blocked] {
        wait_gone(&pods, name, Duration::from_secs(60), "training pod deleted").await;
    }
    // The training objects themselves are the tenant's and stay.
    assert!(config_maps.get_opt(&config).await.unwrap().is_some());
    assert!(secrets.get_opt(&creds).await.unwrap().is_some());
    Api::<MemberCluster>::all(s.training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}

#[tokio::test]
async fn offload_pods_whose_training_pod_is_gone_are_collected_and_nothing_else_is() {
    const TEST: &str = "vk-orphans";
    const NS: &str = "e2e-vk-orphans";
    const MEMBER: &str = "e2e-vko-a";
    const NODE: &str = "tidepool-e2e-vko-a";
    let s = setup(TEST, NS, MEMBER).await;
    let member_ns = offload_ns(NS);
    // The offload namespace as tidepool makes it (tidepool refuses to put anything in one it
    // did not create), so the orphans can be planted before tidepool starts.
    ensure_namespace(&s.member, &member_ns).await;
    let labels = json!({"metadata": {"labels": {
        keys::LABEL_MANAGED_BY: keys::MANAGED_BY, keys::LABEL_ORIGIN_CLUSTER: "training"
    }}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(s.member.clone())
        .patch(&member_ns, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&labels))
        .await
        .unwrap();
    let member_pods = Api::<Pod>::namespaced(s.member.clone(), &member_ns);
    let id = run_id();
    // A pod in the member as tidepool would have made it, for a training pod that never was.
    let member_pod = |name: &str, cluster: &str, member: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "labels": {keys::LABEL_ORIGIN_CLUSTER: cluster, keys::LABEL_ORIGIN_MEMBER: member,
                           keys::LABEL_ORIGIN_UID: format!("00000000-0000-4000-8000-{id}0000")},
                "annotations": {keys::ANNOTATION_ORIGIN_NAMESPACE: NS, keys::ANNOTATION_ORIGIN_NAME: name}
            },
            "spec": {"terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "example.invalid/trainer:1"}]}
        }))
        .unwrap()
    };
    let (before, after) = (format!("orphan-before-{id}"), format!("orphan-after-{id}"));
    let (other_member, other_cluster) = (format!("other-member-{id}"), format!("other-cluster-{id}"));
    for pod in [
        member_pod(&before, "training", MEMBER),
        // Same origin cluster, another MemberCluster: another bridge's business.
        member_pod(&other_member, "training", "e2e-vko-someone-else"),
        // Same member name, another training cluster: likewise.
        member_pod(&other_cluster, "another-training", MEMBER),
    ] {
        member_pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    let collected = |name: String| {
        let member_pods = member_pods.clone();
        async move {
            match member_pods.get_opt(&name).await.ok()? {
                None => Some(()),
                Some(p) => p.metadata.deletion_timestamp.map(|_| ()),
            }
        }
    };

    // 1. An orphan left while tidepool was down is collected when it starts.
    let tidepool = Tidepool::start(&s.env, TEST, NS);
    wait_for(Duration::from_secs(60), "orphan collected at start", || collected(before.clone())).await;

    // 2. A real offload pod is left alone (checked at the end, after a periodic pass).
    wait_node(&s.training, NODE).await;
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let trainer = format!("trainer-{id}");
    pods.create(&PostParams::default(), &bound_pod(&trainer, NODE, json!({}))).await.unwrap();
    wait_phase(&member_pods, &trainer, "Running").await;

    // 3. A training pod deleted outright (grace period 0: no deletion timestamp for the pod
    //    controller to see) loses its offload copy at once, not at the next pass.
    let quick = format!("quick-{id}");
    let quick_pod = bound_pod(&quick, NODE, json!({"terminationGracePeriodSeconds": 0}));
    pods.create(&PostParams::default(), &quick_pod).await.unwrap();
    wait_phase(&member_pods, &quick, "Running").await;
    delete_pod(&pods, &quick).await;
    wait_gone(&pods, &quick, Duration::from_secs(5), "training pod deleted outright").await;
    wait_for(Duration::from_secs(15), "offload copy of a pod deleted outright collected", || collected(quick.clone()))
        .await;

    member_pods.create(&PostParams::default(), &member_pod(&after, "training", MEMBER)).await.unwrap();
    // 4. An orphan appearing later goes at the next periodic pass: "every 60 s" (README), so
    // within 60 s and a margin, whatever the product's constant says.
    wait_for(Duration::from_secs(60 + 30), "later orphan collected by the periodic pass (every 60 s)", || {
        collected(after.clone())
    })
    .await;
    let offload = member_pods.get(&trainer).await.unwrap();
    assert!(offload.metadata.deletion_timestamp.is_none(), "the collector took a pod whose origin exists");
    for name in [&other_member, &other_cluster] {
        let p = member_pods.get_opt(name).await.unwrap();
        assert!(p.is_some_and(|p| p.metadata.deletion_timestamp.is_none()), "{name} is not this bridge's to collect");
    }

    delete_pod(&pods, &trainer).await;
    wait_gone(&pods, &trainer, Duration::from_secs(60), "training pod deleted").await;
    let dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for name in [&other_member, &other_cluster] {
        let _ = member_pods.delete(name, &dp).await;
    }
    Api::<MemberCluster>::all(s.training.clone()).delete(MEMBER, &DeleteParams::default()).await.unwrap();
    drop(tidepool);
}

#[tokio::test]
async fn an_offload_priority_class_deleted_in_the_member_is_made_again_and_the_pod_runs() {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    const TEST: &str = "vk-prioclass";
    const NS: &str = "e2e-vk-prioclass";
    const MEMBER: &str = "e2e-vkp-a";
    const NODE: &str = "tidepool-e2e-vkp-a";
    let s = setup(TEST, NS, MEMBER).await;
    let tidepool = Tidepool::start(&s.env, TEST, NS);
    wait_node(&s.training, NODE).await;
    // A first pod runs: the member session is up, its PriorityClasses made.
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let first = format!("prio-first-{}", run_id());
    pods.create(&PostParams::default(), &small_bound_pod(&first, NODE, "prio")).await.unwrap();
    wait_phase(&pods, &first, "Running").await;
    // Deleted after tidepool made them: by the member's admin, or by the drain of another
    // MemberCluster on the same API server (seen in the peer benchmark).
    let classes = Api::<PriorityClass>::all(s.member.clone());
    for band in keys::Band::ALL.map(keys::Band::priority_class) {
        classes.delete(&band, &DeleteParams::default()).await.unwrap();
        wait_gone(&classes, &band, Duration::from_secs(30), "the band PriorityClasses deleted").await;
    }

    let name = format!("prio-{}", run_id());
    pods.create(&PostParams::default(), &small_bound_pod(&name, NODE, "prio")).await.unwrap();
    wait_phase(&pods, &name, "Running").await;
    for band in keys::Band::ALL.map(keys::Band::priority_class) {
        assert!(classes.get_opt(&band).await.unwrap().is_some(), "{band} not made again: {}", tidepool.log_tail());
    }
    for pod in [&first, &name] {
        delete_pod(&pods, pod).await;
        wait_gone(&pods, pod, Duration::from_secs(60), "the pods deleted").await;
    }
}

#[tokio::test]
async fn an_offload_namespace_deleted_in_the_member_is_made_again_while_it_terminates_and_the_pod_runs() {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    const TEST: &str = "vk-nsgone";
    const NS: &str = "e2e-vk-nsgone";
    const MEMBER: &str = "e2e-vkn-a";
    const NODE: &str = "tidepool-e2e-vkn-a";
    let s = setup(TEST, NS, MEMBER).await;
    let member_ns = offload_ns(NS);
    let holds = Api::<ConfigMap>::namespaced(s.member.clone(), &member_ns);
    let release = serde_json::json!({"metadata": {"finalizers": null}});
    // A failed earlier run may have left its hold, and the namespace stuck terminating.
    let _ = holds.patch("e2e-hold", &PatchParams::default(), &Patch::Merge(&release)).await;
    let namespaces = Api::<Namespace>::all(s.member.clone());
    wait_for(Duration::from_secs(60), "an earlier run's offload namespace not terminating", || async {
        let ns = namespaces.get_opt(&member_ns).await.ok()?;
        ns.is_none_or(|n| n.metadata.deletion_timestamp.is_none()).then_some(())
    })
    .await;
    let tidepool = Tidepool::start(&s.env, TEST, NS);
    wait_node(&s.training, NODE).await;
    // A first pod runs: tidepool made the offload namespace and remembers it.
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);
    let first = format!("nsgone-first-{}", run_id());
    pods.create(&PostParams::default(), &small_bound_pod(&first, NODE, "nsgone")).await.unwrap();
    wait_phase(&pods, &first, "Running").await;
    delete_pod(&pods, &first).await;
    wait_gone(&pods, &first, Duration::from_secs(60), "the first pod deleted").await;

    // The member's admin deletes the offload namespace; a ConfigMap with a finalizer keeps it
    // terminating for a while, as a namespace with content does.
    let hold: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "e2e-hold", "finalizers": ["tidepool.io/e2e-hold"]}
    }))
    .unwrap();
    holds.create(&PostParams::default(), &hold).await.unwrap();
    namespaces.delete(&member_ns, &DeleteParams::default()).await.unwrap();

    // A new pod comes while the namespace terminates: its copy is refused for a while.
    let name = format!("nsgone-{}", run_id());
    pods.create(&PostParams::default(), &small_bound_pod(&name, NODE, "nsgone")).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let terminating = namespaces.get_opt(&member_ns).await.unwrap();
    assert!(terminating.is_some_and(|n| n.metadata.deletion_timestamp.is_some()), "the namespace terminates");
    holds.patch("e2e-hold", &PatchParams::default(), &Patch::Merge(&release)).await.unwrap();

    // Once it is gone, tidepool makes it again and the pod runs, well before a refusal's
    // five-minute retry.
    wait_phase(&pods, &name, "Running").await;
    let made_again = namespaces.get_opt(&member_ns).await.unwrap().expect("the offload namespace made again");
    assert!(made_again.metadata.deletion_timestamp.is_none(), "{}", tidepool.log_tail());
    // And entered again: tidepool's identity is bound in the new namespace as in the old.
    let managed = ListParams::default().labels(&format!("{}={}", keys::LABEL_MANAGED_BY, keys::MANAGED_BY));
    let bindings = Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(s.member.clone(), &member_ns);
    let bound = wait_for(Duration::from_secs(30), "the offload role bound in the new namespace", || async {
        let items = bindings.list(&managed).await.ok()?.items;
        (!items.is_empty()).then_some(items.len())
    })
    .await;
    assert!(bound > 0);
    delete_pod(&pods, &name).await;
    wait_gone(&pods, &name, Duration::from_secs(60), "the pod deleted").await;
}
