//! A TrainJob as Kubeflow Trainer v2 runs it, over JobSet (both real controllers, the JobSet
//! webhook giving its defaults): a ClusterTrainingRuntime for PyTorch as an admin writes one
//! for lent capacity (`schedulerName` in its pod template — Trainer never sets it — and a
//! `podFailurePolicy` that does not count disruptions), a TrainJob of 2 nodes whose trainer
//! runs torchrun (the runtime's `PET_*` environment) over gloo, to `Complete`. The gang is the
//! JobSet, read from its labels and spec; the nodes find each other by the JobSet's
//! `<job>-node-0-0.<job>` names.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "trainjob";
const NS: &str = "e2e-trainjob";
const RUNTIME: &str = "e2e-tidepool-torch";

fn runtime(store: &str) -> serde_json::Value {
    let env = json!([{"name": "TP_STEPS", "value": "200"}, {"name": "TP_STEP_DELAY_MS", "value": "20"}]);
    let mut node = framework_container("node", "torch_ddp.py", store, env);
    node["command"] = json!(["python3", "/opt/tidepool/tidepool_notice.py", "torchrun", "/opt/tidepool/torch_ddp.py"]);
    json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {"name": RUNTIME, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"replicatedJobs": [{
                "name": "node",
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {
                        "backoffLimit": 0,
                        "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                        "template": {"spec": {"schedulerName": scheduler_name(TEST), "restartPolicy": "Never", "containers": [node]}}
                    }
                }
            }]}}
        }
    })
}

#[tokio::test]
async fn a_trainjob_over_jobset_runs_torchrun_to_completion() {
    let b = Bridge::start(TEST, NS).await;
    let _jobset = Operator::start(&b.env, "jobset", &[]).await;
    let _trainer = Operator::start(&b.env, "trainer", &[]).await;
    let name = format!("tj-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("trainer.kubeflow.org", "v1alpha1", "ClusterTrainingRuntime"),
        "clustertrainingruntimes",
    );
    let runtimes = Api::<DynamicObject>::all_with(b.training.clone(), &ar);
    let obj: DynamicObject = serde_json::from_value(runtime(&store)).unwrap();
    runtimes.patch(RUNTIME, &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&obj)).await.unwrap();
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs");
    let job = json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {"runtimeRef": {"name": RUNTIME}, "trainer": {"numNodes": 2}}
    });
    b.submit(&jobs, job).await;
    let selector = format!("jobset.sigs.k8s.io/jobset-name={name}");
    let pods = b.await_running(&selector, 2, &real_node(TEST, 0)).await;
    for p in &pods {
        println!("{} role {:?}", p.name_any(), p.labels().get(keys::LABEL_ROLE));
        assert_eq!(
            p.labels().get(keys::LABEL_ROLE).map(String::as_str),
            Some(keys::ROLE_CORE),
            "the JobSet is one gang"
        );
    }
    let first = pods[0].name_any();
    let seen = b.await_steps(&first, None, 3).await;
    println!("{first}: {seen:?}");
    assert!(seen.last().unwrap().1 < seen.first().unwrap().1, "the loss falls: {seen:?}");
    b.await_condition(&jobs, &name, "Complete", Duration::from_secs(600)).await;
    b.lend(1, None).await;
}
