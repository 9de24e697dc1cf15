//! A PaddleJob in collective mode as the Kubeflow training-operator runs it (2 workers; the
//! operator's `PADDLE_MASTER` names worker 0's Service): PaddlePaddle's own launcher and gloo
//! all-reduce (tests/frameworks/paddle_collective.py) train to the end on member-a's real
//! node, and the PaddleJob is `Succeeded`. (Paddle's CPU wheel has no parameter-server
//! runtime: PS mode is not run.)

use std::time::Duration;

use kube::ResourceExt;
use serde_json::json;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "paddlejob";
const NS: &str = "e2e-paddlejob";

#[tokio::test]
async fn a_collective_paddlejob_trains_over_gloo_to_success() {
    let b = Bridge::start(TEST, NS).await;
    let _operator = Operator::start(&b.env, "training-operator", &[&format!("--namespace={NS}")]).await;
    let name = format!("pd-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let env = json!([{"name": "TP_STEPS", "value": "200"}, {"name": "TP_STEP_DELAY_MS", "value": "20"}]);
    let mut container = framework_container("paddle", "paddle_collective.py", &store, env);
    container["ports"] = json!([{"name": "master", "containerPort": 36543}]);
    let job = json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PaddleJob",
        "metadata": {"name": name},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running"},
            "paddleReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "OnFailure",
                "template": {"spec": {"schedulerName": scheduler_name(TEST), "containers": [container]}}}}
        }
    });
    let jobs = b.jobs("kubeflow.org", "v1", "PaddleJob", "paddlejobs");
    b.submit(&jobs, job).await;
    let selector = format!("training.kubeflow.org/job-name={name}");
    let pods = b.await_running(&selector, 2, &real_node(TEST, 0)).await;
    println!("{:?}", pods.iter().map(ResourceExt::name_any).collect::<Vec<_>>());
    let worker0 = format!("{name}-worker-0");
    let seen = b.await_steps(&worker0, None, 3).await;
    println!("worker 0: {seen:?}");
    assert!(seen.last().unwrap().1 < seen.first().unwrap().1, "the loss falls: {seen:?}");
    b.await_condition(&jobs, &name, "Succeeded", Duration::from_secs(600)).await;
    b.lend(1, None).await;
}
